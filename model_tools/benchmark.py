"""The contenders of the side-by-side training-step benchmark (our variants, Hugging Face GPT-2 and Mixtral,
a minimal GPT-2) and their interleaved timing, memory, FLOPs and expert-dispatch measurements. The command
line and what the report holds: ``experiments/bench.py`` (``python -m experiments.bench``).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import yaml

from architectures import ModelConfig, build_model
from architectures.checkpointing import parse_policy, set_activation_checkpointing, watch_checkpoint_inputs
from architectures.config import SHARED_FIELDS, SIZES, ConfigError, config_groups
from architectures.flops import vanilla_flops
from callbacks.flops import peak_bf16_flops  # one peak table for bench and training MFU
from lightning_modules.lm import make_adamw, parameter_groups
from model_tools.compiling import GraphReport, compile_model, compiled_graphs, graph_report
from model_tools.minimal_gpt2 import minimal_from_config

HF_REFERENCE = "hf_gpt2"
MINIMAL_REFERENCE = "min_gpt2"
#: Hugging Face ``MixtralForCausalLM`` (random weights from a config) with the ``moe`` group's experts and
#: top-k (``--set moe.num_experts=...``), and the same model with ONE expert: the peer's own MoE cost ratio
MIXTRAL_REFERENCE = "hf_mixtral"
MIXTRAL_ONE_EXPERT = "hf_mixtral_1"
MIXTRAL_AUX_COEF = 0.01  # the load-balancing loss's weight (ours: moe.balance_coef's default)
REFERENCES = (HF_REFERENCE, MINIMAL_REFERENCE, MIXTRAL_REFERENCE, MIXTRAL_ONE_EXPERT)


def parse_override(item: str) -> Tuple[List[str], Any]:
    """``GROUP.FIELD=VALUE`` or ``FIELD=VALUE`` -> (path, value), checked against ``ModelConfig``'s fields."""
    key, sep, raw = item.partition("=")
    if not sep or not key or not raw.strip():
        raise ConfigError(f"--set {item}: expected FIELD=VALUE or GROUP.FIELD=VALUE (e.g. --set mod.capacity=0.25)")
    path = key.split(".")
    groups = config_groups()
    top = set(SHARED_FIELDS) - {"variant", "preset"}
    if len(path) == 1 and path[0] in top:
        pass
    elif len(path) == 2 and path[0] in groups and path[1] in {f.name for f in dataclasses.fields(groups[path[0]])}:
        pass
    else:
        raise ConfigError(f"--set {key}: no such model config field; fields: {', '.join(sorted(top))}, or "
                          f"GROUP.FIELD with GROUP one of {', '.join(groups)}")
    try:
        value = yaml.safe_load(raw)  # 512 -> int, 0.25 -> float, true -> bool, [1, 3] -> list
    except yaml.YAMLError:
        raise ConfigError(f"--set {item}: {raw!r} is not a value (a number, true/false, a string or a [list])") from None
    return path, value


def variant_of(label: str) -> str:
    """``moe@moe.num_experts=64`` -> ``moe``: a benchmarked variant may carry its own ``@GROUP.FIELD=VALUE``
    overrides (after ``--set``), so that e.g. 8 and 64 experts run side by side in one process."""
    return label.split("@")[0]


def label_overrides(label: str) -> List[str]:
    return label.split("@")[1:]


def uses_moe_layer(label: str) -> bool:
    from architectures.registry import uses_option

    # every MoELayer user reads the moe group's losses (cea_moe sets its own experts and top-k)
    return label not in REFERENCES and uses_option(variant_of(label), "moe.balance_coef")


def apply_overrides(config: ModelConfig, overrides: List[str]) -> ModelConfig:
    """``config`` with each ``--set`` applied; one of a group the variant does not read (the same ``--set`` goes
    to every benchmarked variant, vanilla included; ``check_overrides`` makes sure some variant reads it) is
    skipped, as the config holds only its variant's groups."""
    for item in overrides:
        (*path, leaf), value = parse_override(item)
        if path and path[0] not in config.groups:
            continue
        target = config
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return config


def check_overrides(overrides: List[str], variants: List[str], size: str = "tiny") -> None:
    """Before any timing: every ``--set`` parses, its value is valid for each variant, and some benchmarked
    variant reads it (the same ``--set`` applies to every variant, vanilla included)."""
    from architectures.registry import apply_preset, uses_option

    for item in overrides:
        path, _ = parse_override(item)
        if len(path) == 2 and not any(uses_option(variant_of(v), ".".join(path)) for v in variants):
            raise ConfigError(f"--set {item}: none of the benchmarked variants ({', '.join(variants)}) uses "
                              f"model.{'.'.join(path)}; add a variant that does to --variants")
    for label in variants:
        for item in label_overrides(label):
            path, _ = parse_override(item)
            if len(path) == 2 and not uses_option(variant_of(label), ".".join(path)):
                raise ConfigError(f"--variants {label}: {variant_of(label)} does not use model.{'.'.join(path)}")
        config = ModelConfig(variant=variant_of(label), size=size)
        apply_preset(apply_overrides(config, [*overrides, *label_overrides(label)])).resolve()


def base_config(args, label: str) -> ModelConfig:
    config = ModelConfig(variant=variant_of(label), size=args.size, vocab_size=args.vocab_size, dropout=0.0)
    config = apply_overrides(config, [*args.set, *label_overrides(label)])
    if args.seq_len:
        config.block_size = max(args.seq_len, config.block_size or SIZES[args.size]["block_size"])
    return config


def hf_model(config: ModelConfig) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.d_model, n_layer=config.n_layer,
        n_head=config.n_head, n_inner=config.ffn_hidden, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=config.layer_norm_eps, attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(hf_config)


def mixtral_model(config: ModelConfig, num_experts: int, top_k: int) -> torch.nn.Module:
    """Hugging Face's Mixtral at our model's width, depth, heads (no grouped-query sharing), FFN width,
    vocabulary and length, tied embeddings, SDPA, its default experts implementation, no dropout."""
    from transformers import MixtralConfig, MixtralForCausalLM

    hf_config = MixtralConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_hidden,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_head,
        max_position_embeddings=config.block_size, num_local_experts=num_experts, num_experts_per_tok=top_k,
        router_aux_loss_coef=MIXTRAL_AUX_COEF, output_router_logits=True, tie_word_embeddings=True,
        attention_dropout=0.0, attn_implementation="sdpa",
    )
    return MixtralForCausalLM(hf_config)


def reference_model(name: str, args) -> Tuple[torch.nn.Module, ModelConfig]:
    """(model, our vanilla config of the same shape) of a reference contender."""
    config = build_model(base_config(args, "vanilla")).config
    if name == HF_REFERENCE:
        return hf_model(config), config
    if name == MINIMAL_REFERENCE:
        return minimal_from_config(config), config
    moe = base_config(args, "moe").moe
    return mixtral_model(config, moe.num_experts if name == MIXTRAL_REFERENCE else 1, moe.top_k), config


class Contender:
    """One model + optimizer, and how to run one training step of it."""

    def __init__(self, name: str, args):
        self.name = name
        torch.manual_seed(args.seed)
        if name in REFERENCES:
            self.model, self.config = reference_model(name, args)
        else:
            self.model = build_model(base_config(args, name))
            self.config = self.model.config
            set_activation_checkpointing(self.model, args.activation_checkpointing)
        self.device = torch.device(args.device)
        self.model.to(self.device).train()
        self.autocast = args.precision == "bf16-mixed"
        self.compiled = args.compile
        self.graphs: Optional[GraphReport] = None
        self.recompiles = 0
        self.warm = False  # set after the warm-up steps (which compile)
        self.clock = time.process_time if args.clock == "process" else time.perf_counter
        # the same optimizer as training (lightning_modules.lm), so step times are what a run sees
        self.optimizer = make_adamw(parameter_groups(self.model, 0.1), lr=1e-4)
        self.times: List[float] = []
        self.split: List[Tuple[float, float]] = []  # (forward + backward, AdamW step) seconds of the timed steps
        self.last_split = (0.0, 0.0)
        self.memory_bytes = 0
        self.last_trace = None

    def forward_loss(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self._forward_loss(batch)

    def _forward_loss(self, batch: torch.Tensor) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        if self.name == HF_REFERENCE:
            logits, aux = self.model(input_ids=idx).logits, 0.0
        elif self.name == MINIMAL_REFERENCE:
            logits, aux = self.model(idx), 0.0
        elif self.name in (MIXTRAL_REFERENCE, MIXTRAL_ONE_EXPERT):
            out = self.model(input_ids=idx, output_router_logits=True)
            logits, aux = out.logits, MIXTRAL_AUX_COEF * out.aux_loss
        else:
            out = self.model(idx)
            logits, aux, self.last_trace = out.logits, out.aux_loss, out.trace
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)) + aux

    def step(self, batch: torch.Tensor, measure_memory: bool = False) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            # what the other contenders keep on the GPU (their weights, gradients, AdamW state), not ours
            others = torch.cuda.memory_allocated() - self.resident_bytes()
        graphs_before = compiled_graphs() if self.compiled else 0
        start = self.clock()
        if measure_memory and self.device.type == "cpu" and not self.compiled:
            loss, activation_bytes = self.forward_loss_saving(batch)
        else:
            loss = self.forward_loss(batch)
            activation_bytes = 0
        loss.backward()
        sync(self.device)
        backward_done = self.clock()
        self.optimizer.step()
        sync(self.device)
        elapsed = self.clock() - start
        self.last_split = (backward_done - start, elapsed - (backward_done - start))
        if self.compiled and self.warm:  # a graph compiled after warm-up is a recompilation
            self.recompiles += compiled_graphs() - graphs_before
        if measure_memory:
            if self.device.type == "cuda":  # this model's peak: the process's peak less the others' memory
                self.memory_bytes = torch.cuda.max_memory_allocated() - others
            else:
                params = sum(p.numel() * p.element_size() for p in self.model.parameters())
                self.memory_bytes = 4 * params + activation_bytes  # weights + grads + 2 Adam moments
        return elapsed

    def resident_bytes(self) -> int:
        """Weights, gradients and optimizer state this contender holds between steps."""
        tensors = [*self.model.parameters(), *(p.grad for p in self.model.parameters() if p.grad is not None),
                   *(v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def forward_loss_saving(self, batch: torch.Tensor):
        """(loss, bytes saved for backward): storages saved by autograd, parameters excluded, plus the
        inputs checkpointed units keep (``model_tools.memory``)."""
        from model_tools.memory import recorded_saved_storages

        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        with watch_checkpoint_inputs(skip=params) as inputs, recorded_saved_storages(params) as saved:
            loss = self.forward_loss(batch)
        for t in inputs:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return loss, sum(saved.values())

    def saved_activation_mb(self, batch: torch.Tensor, policy: str) -> float:
        """Saved-for-backward MB of one forward + loss under ``policy`` (the model's own policy restored)."""
        previous = getattr(self.model, "checkpoint_policy", None)
        set_activation_checkpointing(self.model, policy)
        try:
            return self.forward_loss_saving(batch)[1] / 2**20
        finally:
            self.model.checkpoint_policy = previous

    def flops_per_token(self, seq_len: int) -> float:
        if self.name in (MIXTRAL_REFERENCE, MIXTRAL_ONE_EXPERT):
            return float("nan")  # SwiGLU experts, rotary attention: not our analytic count
        if self.name in REFERENCES:
            return vanilla_flops(self.config, seq_len).forward
        return self.model.flops_per_token(self.last_trace, seq_len).forward

    def report_graphs_then_compile(self, batch: torch.Tensor) -> None:
        """Graph breaks of one forward + loss (explain resets dynamo, so before compiling), then compile."""
        self.graphs = graph_report(self.forward_loss, batch)
        compile_model(self.model)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_generation(contender: Contender, prompt: torch.Tensor, new_tokens: int) -> Optional[float]:
    if contender.name in REFERENCES:
        return None
    try:
        contender.model.generate(prompt, 2, greedy=True)  # warm-up
        start = time.perf_counter()
        contender.model.generate(prompt, new_tokens, greedy=True)
        return prompt.shape[0] * new_tokens / (time.perf_counter() - start)
    except (ConfigError, NotImplementedError) as err:
        print(f"  {contender.name}: generate() unavailable ({err})", file=sys.stderr)
        return None


def captured_dispatches(contender: Contender, batch: torch.Tensor) -> List[Tuple[torch.nn.Module, tuple]]:
    """(experts module, its (x, selected, weights, keep) inputs) of every MoE layer in one forward of ``batch``."""
    from architectures.experts import GroupedExperts

    captured, handles = [], []
    for module in contender.model.modules():
        if isinstance(module, GroupedExperts):
            hook = lambda m, inputs, out: captured.append((m, tuple(  # noqa: E731
                t.detach() if isinstance(t, torch.Tensor) else t for t in inputs)))
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            contender.forward_loss(batch)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def time_dispatch(experts: torch.nn.Module, inputs: tuple, clock) -> Tuple[float, float]:
    """Seconds of the experts' forward, and of its backward (gradients into x, the weights and the stacked
    expert parameters, set to None first as a training step does), on ``inputs``."""
    x, selected, weights, keep = (*inputs, None)[:4]
    x, weights = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    start = clock()
    loss = experts(x, selected, weights, keep).float().pow(2).sum()
    middle = clock()
    loss.backward()
    return middle - start, clock() - middle


def _per_layer(pairs, clock) -> Tuple[float, float]:
    """Mean (forward, backward) seconds per MoE layer over (experts, inputs) pairs."""
    times = [time_dispatch(experts, inputs, clock) for experts, inputs in pairs]
    return sum(t[0] for t in times) / len(times), sum(t[1] for t in times) / len(times)


def dispatch_times(contenders: List[Contender], batch: torch.Tensor, reps: int) -> Dict[str, Dict[str, float]]:
    """``--dispatch``: per MoE contender, the median over ``reps`` (interleaved) of the mean ms per MoE layer of
    the expert dispatch's forward and backward on its own routing, and on the first MoE contender's routing
    (its expert ids, so the experts past its count sit idle); and the mean number of experts with tokens."""
    moe = [c for c in contenders if uses_moe_layer(c.name)]
    captured = {c.name: captured_dispatches(c, batch) for c in moe}
    first = captured[moe[0].name]
    times: Dict[str, Dict[str, List[Tuple[float, float]]]] = {c.name: {"own": [], "first": []} for c in moe}
    for rep in range(reps):
        for c in (moe if rep % 2 == 0 else moe[::-1]):
            layers = captured[c.name]
            times[c.name]["own"].append(_per_layer(layers, c.clock))
            if len(first) == len(layers) and all(len(e) >= len(f) for (e, _), (f, _) in zip(layers, first)):
                times[c.name]["first"].append(_per_layer([(e, i) for (e, _), (_, i) in zip(layers, first)], c.clock))
    out = {}
    for c in moe:
        active = [int(i[1][i[1] < len(e)].unique().numel()) for e, i in captured[c.name]]
        row = {"dispatch_experts": len(captured[c.name][0][0]), "dispatch_layers": len(active),
               "dispatch_active_experts": sum(active) / len(active), "dispatch_routing_of": moe[0].name}
        for key, suffix in (("own", ""), ("first", "_first_routing")):
            if times[c.name][key]:
                row[f"dispatch_forward_ms{suffix}"] = 1000 * statistics.median(t[0] for t in times[c.name][key])
                row[f"dispatch_backward_ms{suffix}"] = 1000 * statistics.median(t[1] for t in times[c.name][key])
        out[c.name] = row
    return out


def run(args) -> Dict[str, Dict[str, float]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    contenders = [Contender(name, args) for name in args.variant_list]
    seq_len = args.seq_len or contenders[0].config.block_size
    gen = torch.Generator().manual_seed(args.seed)
    device = contenders[0].device

    def new_batch() -> torch.Tensor:
        return torch.randint(0, args.vocab_size, (args.batch_size, seq_len + 1), generator=gen).to(device)

    batches = [new_batch() for _ in range(4)]
    checkpointed = args.activation_checkpointing if parse_policy(args.activation_checkpointing) else "blocks"
    saved_mb = {c.name: {"none": c.saved_activation_mb(batches[0], "none"),
                         checkpointed: c.saved_activation_mb(batches[0], checkpointed)}
                for c in contenders if c.name not in REFERENCES}
    time_steps(contenders, batches, new_batch, args)
    dispatch = dispatch_times(contenders, batches[0], args.steps) if args.dispatch else {}
    results: Dict[str, Dict[str, float]] = {}
    for c in contenders:
        results[c.name] = contender_result(c, args, seq_len)
        results[c.name].update(dispatch.get(c.name, {}))
        if c.name in saved_mb:  # the saved activations without and with checkpointing (``checkpointing``)
            results[c.name].update(saved_activation_mb=saved_mb[c.name]["none"], checkpointing=checkpointed,
                                    saved_activation_mb_checkpointed=saved_mb[c.name][checkpointed])
        if c.graphs is not None:
            results[c.name].update(graphs=c.graphs.graphs, graph_breaks=c.graphs.graph_breaks,
                                    break_reasons=c.graphs.reasons, recompiles=c.recompiles)
        if args.generate:
            prompt = batches[0][:1, : max(1, min(seq_len, c.config.block_size - args.generate) // 2)]
            results[c.name]["generate_tokens_per_s"] = time_generation(c, prompt, args.generate)
    add_ratios(results)
    return results


def time_steps(contenders: List[Contender], batches: List[torch.Tensor], new_batch, args) -> None:
    """Warm-up (compiling first under ``--compile``), the interleaved timed steps, then with ``--compile`` the
    steps on fresh batches that count recompilations."""
    if args.compile:
        for c in contenders:
            c.report_graphs_then_compile(batches[0])
    for c in contenders:
        for i in range(max(args.warmup, 1 if args.compile else 0)):  # compiled: the first step compiles
            c.step(batches[i % len(batches)])
        c.step(batches[0], measure_memory=True)
        c.warm = True
    for rep in range(args.steps):
        order = contenders if rep % 2 == 0 else contenders[::-1]  # alternate order: no position bias
        for c in order:
            c.times.append(c.step(batches[rep % len(batches)]))
            c.split.append(c.last_split)
    if args.compile:
        for _ in range(args.recompile_steps):  # fresh tokens: the routing differs every step
            batch = new_batch()
            for c in contenders:
                c.step(batch)


def contender_result(c: Contender, args, seq_len: int) -> Dict[str, float]:
    """Medians of the timed steps, memory, FLOPs per token, parameters and MFU of one contender."""
    tokens = args.batch_size * seq_len
    median = statistics.median(c.times)
    result = {
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "memory_mb": c.memory_bytes / 2**20,
        "forward_backward_s": statistics.median(t[0] for t in c.split),
        "optimizer_s": statistics.median(t[1] for t in c.split),
        "flops_per_token": c.flops_per_token(seq_len),
        "params": sum(p.numel() for p in c.model.parameters()),
    }
    result["mfu"] = mfu(result, tokens / median, args)
    return result


def add_ratios(results: Dict[str, Dict[str, float]]) -> None:
    """Every contender's ratios to vanilla, vanilla's speed against the references, Mixtral's over its own dense."""
    base = results["vanilla"]
    for name, r in results.items():
        r["step_time_ratio"] = r["median_step_s"] / base["median_step_s"]
        r["flops_ratio"] = r["flops_per_token"] / base["flops_per_token"]
        r["time_over_flops_ratio"] = r["step_time_ratio"] / r["flops_ratio"]
        r["memory_ratio"] = r["memory_mb"] / base["memory_mb"] if base["memory_mb"] else None
    if HF_REFERENCE in results:
        # >= 1.0 means our vanilla steps at least as fast as the Hugging Face reference
        base["speed_vs_hf"] = results[HF_REFERENCE]["median_step_s"] / base["median_step_s"]
    if MINIMAL_REFERENCE in results:
        base["speed_vs_minimal"] = results[MINIMAL_REFERENCE]["median_step_s"] / base["median_step_s"]
    if MIXTRAL_REFERENCE in results and MIXTRAL_ONE_EXPERT in results:  # the peer's MoE over its own dense
        results[MIXTRAL_REFERENCE]["time_x_one_expert"] = (results[MIXTRAL_REFERENCE]["median_step_s"]
                                                           / results[MIXTRAL_ONE_EXPERT]["median_step_s"])


def mfu(result: Dict[str, float], tokens_per_s: float, args) -> Optional[float]:
    """Model FLOPs utilisation: analytic training FLOPs/s over the GPU's dense bf16 peak (CUDA + bf16 only)."""
    if args.device != "cuda" or args.precision != "bf16-mixed":
        return None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_bf16_flops(torch.cuda.get_device_name())
    if peak is None:
        return None
    return 3.0 * result["flops_per_token"] * tokens_per_s / peak
