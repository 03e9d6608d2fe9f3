"""Side-by-side training-step benchmark: ``python -m experiments.bench --variants vanilla,mod --size tiny``.

Times full training steps (forward, backward, AdamW step) of each variant in ONE process,
interleaving the repetitions (A B C A B C ...) so that machine noise hits every variant alike,
and reports per variant: median step time, tokens/s, memory, analytic FLOPs per token, and the
ratios to vanilla. The Hugging Face ``GPT2LMHeadModel`` (attn_implementation="sdpa") built with the
identical config is timed as the external reference ``hf_gpt2``.

Memory: on CUDA the peak allocated bytes of the step; on CPU the bytes of parameters, gradients,
AdamW state and the activations saved for backward (measured with saved-tensor hooks).
Optionally (``--generate N``) it also times ``generate()`` with a KV cache, in new tokens/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
import yaml

from architectures import ModelConfig, build_model, variant_names
from architectures.config import SIZES, ConfigError
from architectures.gpt2 import vanilla_flops
from lightning_modules.lm import make_adamw, parameter_groups

HF_REFERENCE = "hf_gpt2"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="vanilla", help=f"comma-separated; valid: {', '.join(variant_names())}, {HF_REFERENCE}")
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=10, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=None, help="sequence length (default: the size's T)")
    parser.add_argument("--vocab_size", type=int, default=50257)
    parser.add_argument("--set", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                        help="model config override, e.g. --set mod.capacity=0.25 --set d_model=512")
    parser.add_argument("--no_hf", action="store_true", help=f"do not add the {HF_REFERENCE} reference")
    parser.add_argument("--generate", type=int, default=0, help="also time generate() of N new tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in variant_names() and v != HF_REFERENCE]
    if unknown or not args.variant_list:
        parser.error(f"--variants: unknown {unknown or 'empty list'}; valid: {', '.join(variant_names())}, {HF_REFERENCE}")
    if args.steps <= 0 or args.batch_size <= 0:
        parser.error("--steps and --batch_size must be positive")
    if "vanilla" not in args.variant_list:
        args.variant_list.insert(0, "vanilla")  # every ratio is relative to vanilla
    if not args.no_hf and HF_REFERENCE not in args.variant_list:
        args.variant_list.append(HF_REFERENCE)
    return args


def apply_overrides(config: ModelConfig, overrides: List[str]) -> ModelConfig:
    for item in overrides:
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw)  # 512 -> int, 0.25 -> float, true -> bool, [1, 3] -> list
        target = config
        *path, leaf = key.split(".")
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, leaf):
            raise ConfigError(f"--set {key}: no such model config field")
        setattr(target, leaf, value)
    return config


def base_config(args, variant: str) -> ModelConfig:
    config = ModelConfig(variant=variant, size=args.size, vocab_size=args.vocab_size, dropout=0.0)
    config = apply_overrides(config, args.set)
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


class Contender:
    """One model + optimizer, and how to run one training step of it."""

    def __init__(self, name: str, args):
        self.name = name
        torch.manual_seed(args.seed)
        if name == HF_REFERENCE:
            self.config = build_model(base_config(args, "vanilla")).config
            self.model = hf_model(self.config)
        else:
            self.model = build_model(base_config(args, name))
            self.config = self.model.config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).train()
        # the same optimizer as training (lightning_modules.lm), so step times are what a run sees
        self.optimizer = make_adamw(parameter_groups(self.model, 0.1), lr=1e-4)
        self.times: List[float] = []
        self.memory_bytes = 0
        self.last_trace = None

    def forward_loss(self, batch: torch.Tensor) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        if self.name == HF_REFERENCE:
            logits, aux = self.model(input_ids=idx).logits, 0.0
        else:
            out = self.model(idx)
            logits, aux, self.last_trace = out.logits, out.aux_loss, out.trace
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)) + aux

    def step(self, batch: torch.Tensor, measure_memory: bool = False) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if measure_memory and self.device.type == "cpu":
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
                loss = self.forward_loss(batch)
            activation_bytes = sum({s.data_ptr(): s.nbytes() for s in saved}.values())
        else:
            loss = self.forward_loss(batch)
            activation_bytes = 0
        loss.backward()
        self.optimizer.step()
        sync(self.device)
        elapsed = time.perf_counter() - start
        if measure_memory:
            if self.device.type == "cuda":
                self.memory_bytes = torch.cuda.max_memory_allocated()
            else:
                params = sum(p.numel() * p.element_size() for p in self.model.parameters())
                self.memory_bytes = 4 * params + activation_bytes  # weights + grads + 2 Adam moments
        return elapsed

    def flops_per_token(self, seq_len: int) -> float:
        if self.name == HF_REFERENCE:
            return vanilla_flops(self.config, seq_len).forward
        return self.model.flops_per_token(self.last_trace, seq_len).forward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_generation(contender: Contender, prompt: torch.Tensor, new_tokens: int) -> Optional[float]:
    if contender.name == HF_REFERENCE:
        return None
    try:
        contender.model.generate(prompt, 2, greedy=True)  # warm-up
        start = time.perf_counter()
        contender.model.generate(prompt, new_tokens, greedy=True)
        return prompt.shape[0] * new_tokens / (time.perf_counter() - start)
    except (ConfigError, NotImplementedError) as err:
        print(f"  {contender.name}: generate() unavailable ({err})", file=sys.stderr)
        return None


def run(args) -> Dict[str, Dict[str, float]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    contenders = [Contender(name, args) for name in args.variant_list]
    seq_len = args.seq_len or contenders[0].config.block_size
    gen = torch.Generator().manual_seed(args.seed)
    device = contenders[0].device
    batches = [torch.randint(0, args.vocab_size, (args.batch_size, seq_len + 1), generator=gen).to(device)
               for _ in range(4)]
    for c in contenders:
        for i in range(args.warmup):
            c.step(batches[i % len(batches)])
        c.step(batches[0], measure_memory=True)
    for rep in range(args.steps):
        order = contenders if rep % 2 == 0 else contenders[::-1]  # alternate order: no position bias
        for c in order:
            c.times.append(c.step(batches[rep % len(batches)]))
    results: Dict[str, Dict[str, float]] = {}
    tokens = args.batch_size * seq_len
    for c in contenders:
        median = statistics.median(c.times)
        results[c.name] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "memory_mb": c.memory_bytes / 2**20,
            "flops_per_token": c.flops_per_token(seq_len),
            "params": sum(p.numel() for p in c.model.parameters()),
        }
        if args.generate:
            prompt = batches[0][:1, : max(1, min(seq_len, c.config.block_size - args.generate) // 2)]
            results[c.name]["generate_tokens_per_s"] = time_generation(c, prompt, args.generate)
    base = results["vanilla"]
    for name, r in results.items():
        r["step_time_ratio"] = r["median_step_s"] / base["median_step_s"]
        r["flops_ratio"] = r["flops_per_token"] / base["flops_per_token"]
        r["time_over_flops_ratio"] = r["step_time_ratio"] / r["flops_ratio"]
        r["memory_ratio"] = r["memory_mb"] / base["memory_mb"] if base["memory_mb"] else None
    if HF_REFERENCE in results:
        # >= 1.0 means our vanilla steps at least as fast as the Hugging Face reference
        base["speed_vs_hf"] = results[HF_REFERENCE]["median_step_s"] / base["median_step_s"]
    return results


def print_table(results: Dict[str, Dict[str, float]], args, seq_len: int) -> None:
    print(f"size={args.size} batch={args.batch_size} seq={seq_len} steps={args.steps} "
          f"device={'cuda' if torch.cuda.is_available() else 'cpu'} threads={torch.get_num_threads()}")
    header = f"{'variant':<16}{'step ms':>10}{'tok/s':>10}{'mem MB':>9}{'GFLOP/tok':>11}{'time x':>8}{'FLOPs x':>9}{'t/F':>7}"
    print(header)
    for name, r in results.items():
        print(f"{name:<16}{1000 * r['median_step_s']:>10.1f}{r['tokens_per_s']:>10.0f}{r['memory_mb']:>9.1f}"
              f"{r['flops_per_token'] / 1e9:>11.4f}{r['step_time_ratio']:>8.3f}{r['flops_ratio']:>9.3f}"
              f"{r['time_over_flops_ratio']:>7.3f}")
    if "speed_vs_hf" in results["vanilla"]:
        print(f"vanilla speed vs {HF_REFERENCE}: {results['vanilla']['speed_vs_hf']:.3f}x (>= 1 means ours is faster)")


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    results = run(args)
    seq_len = args.seq_len or SIZES[args.size]["block_size"]
    print_table(results, args, seq_len)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "variant_list"},
                       "variants": args.variant_list, "results": results}, handle, indent=2)
    return results


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
