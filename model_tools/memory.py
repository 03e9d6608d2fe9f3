"""Memory plan: will a training job fit its GPUs? (``experiments.sweep --dry_run``, ``experiments.bench --plan``)

Per GPU, for one optimisation step of a job (every rank holds the whole model: DDP):

* parameters (fp32 master weights), gradients (fp32), AdamW state (two fp32 moments), and under DDP
  with more than one GPU the gradient buckets (one more fp32 copy of the gradients: Lightning's DDP
  does not use ``gradient_as_bucket_view``);
* activations, **measured**: one forward + loss of the real model on the CPU, at the job's precision
  (bf16 autocast for ``bf16-mixed``) and checkpointing policy, at batch 1 and 2 of a short sequence,
  counting the storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``; parameters
  excluded) plus the inputs a checkpointed unit keeps. The difference between the two batches is the
  per-token cost, the rest is per-step (bf16 copies of the weights under autocast); both are scaled to
  the micro-batch x sequence length of the job. The largest saved storage per token (the logits'
  log-softmax) gives the transient gradient buffers at the start of backward (two of its size), and
  with checkpointing one unit's recomputed activations (the activations checkpointing removed, per
  checkpointed unit) come on top;
* the peak: weights + optimizer state + the larger of (backward start: activations + the head's
  gradients + the transient / recomputed unit) and (backward end: every gradient).

Not included: the CUDA caching allocator's fragmentation and reserved-but-unused blocks, NCCL's
communication buffers, cuBLAS / attention kernel workspaces, the CUDA context (~0.5-1 GiB), and
data-loader pinned memory. The CPU measurement uses CPU kernels: the GPU's flash attention saves
about as much (output + log-sum-exp per query), the math kernel would save T x T scores per head.
Routing that depends on the data (MoE loads, MoM choices) is measured on random tokens.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
import json
import math
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F

from architectures.config import ConfigError
from architectures.checkpointing import parse_policy, set_activation_checkpointing, watch_checkpoint_inputs

GiB = 2 ** 30
#: sequence length of the CPU measurement (activations per token do not depend on it with the
#: CPU's flash attention kernel; tests/test_scale.py checks it)
MEASURE_T = 16


@dataclasses.dataclass
class Activations:
    """Measured activation bytes, to scale: ``per_token * tokens + fixed``."""

    per_token: float  # saved for backward (+ checkpointed units' inputs)
    fixed: float  # per step, independent of the batch (autocast's bf16 weight copies)
    largest_per_token: float  # the largest single saved storage per token (its gradient is a transient)
    unit_per_token: float  # one checkpointed unit's recomputed activations (0 without checkpointing)

    def peak(self, tokens: int) -> float:
        """Activation bytes at the start of backward: saved + the larger of transient and one recomputed unit."""
        return self.per_token * tokens + self.fixed + max(2 * self.largest_per_token, self.unit_per_token) * tokens


@contextlib.contextmanager
def recorded_saved_storages(params: Set[int]) -> Iterator[Dict[int, int]]:
    """Within the block, record what autograd saves for backward; on leaving it, the yielded dict is
    {data_ptr: bytes} of the saved storages still alive, parameters (``params``: their data pointers) excluded.

    Read after the forward, through weak references: a tensor saved by a part of the graph that the forward itself
    dropped (a branch not in the loss) is freed before the backward and its address may be reused by a later
    storage; keyed by address as it was saved, the count depended on the allocator (up to ~6% between two
    identical measurements of depth_gate_skip). The hook keeps a detached alias (same storage): the tensor itself
    would close a loop tensor -> grad_fn -> saved tensor for ops that save their output (exp, sigmoid, softmax),
    which kept a dropped branch alive, counted and leaking until the cycle collector ran. (No ``gc.collect()``
    here: with the alias nothing autograd saves is in a cycle, and a collection costs ~0.25 s in a process that
    imported Lightning, per measurement.)"""
    packed: List[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    saved: Dict[int, int] = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()


def saved_storages(model: torch.nn.Module, idx: torch.Tensor, autocast: bool = False) -> Dict[int, int]:
    """{data_ptr: bytes} of the storages one forward + loss saves for backward, parameters excluded,
    plus the inputs checkpointed units keep for their recomputation."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with watch_checkpoint_inputs() as inputs, recorded_saved_storages(params) as saved:
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(idx[:, :-1])
            logits = out.logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)) + out.aux_loss
    for t in inputs:
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    del loss, out, logits
    return saved


def saved_activation_bytes(model: torch.nn.Module, idx: torch.Tensor, autocast: bool = False) -> int:
    """Bytes saved for backward by one forward + loss (see ``saved_storages``)."""
    return sum(saved_storages(model, idx, autocast).values())


def measure_activations(model: torch.nn.Module, policy: Any = "none", autocast: bool = False,
                        seq_len: int = MEASURE_T, seed: int = 0, share_casts: bool = True) -> Activations:
    """Per-token and per-step activation bytes of ``model`` under ``policy`` (CPU forward at batch 1 and 2).

    ``share_casts``: under autocast, both forwards run inside one outer autocast region, so autocast's cache
    casts each fp32 weight to bf16 once, not once per forward (the casts were most of a large model's measuring
    time). Each forward still saves its copies and counts them as its own, so the figures are the same as with
    a cast per forward (``tests/test_fast_start.py`` compares them)."""
    vocab, seq_len = model.config.vocab_size, min(seq_len, model.config.block_size)
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, vocab, (2, seq_len + 1), generator=gen).to(next(model.parameters()).device)
    previous = getattr(model, "checkpoint_policy", None)
    checkpointed = bool(parse_policy(policy))
    try:
        set_activation_checkpointing(model, policy)
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast and share_casts):
            one, two = (saved_storages(model, batch[:b], autocast) for b in (1, 2))
    finally:
        model.checkpoint_policy = previous
    per_token = (sum(two.values()) - sum(one.values())) / seq_len
    fixed = max(0.0, sum(one.values()) - per_token * seq_len)
    largest = max(batch_dependent(one.values(), two.values()), default=0) / (2 * seq_len)
    unit = 0.0
    if checkpointed:  # per unit, the growth from batch 1 to 2 (the unit's bf16 weight copies excluded)
        one_unit, two_unit = (checkpointed_unit_bytes(model, policy, batch[:b], autocast) for b in (1, 2))
        unit = max((b - a for a, b in zip(one_unit, two_unit)), default=0) / seq_len
    return Activations(per_token, fixed, largest, unit)


def batch_dependent(one, two) -> List[int]:
    """Sizes of the storages of the batch-2 forward that the batch-1 forward has no storage of the same size
    of (the per-step ones, such as autocast's weight copies, occur in both)."""
    left = Counter(one)
    out = []
    for size in two:
        if left[size]:
            left[size] -= 1
        else:
            out.append(size)
    return out


def checkpointed_unit_bytes(model, policy: Any, idx: torch.Tensor, autocast: bool = False) -> List[int]:
    """Per unit the policy checkpoints, the bytes it saves when run without checkpointing."""
    previous = getattr(model, "checkpoint_policy", None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with watch_checkpoint_inputs(skip=params) as inputs:
        set_activation_checkpointing(model, policy)
        try:
            with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
                model(idx[:, :-1])
        finally:
            model.checkpoint_policy = previous
    return inputs.unit_bytes


@dataclasses.dataclass
class Plan:
    """Estimated peak bytes per GPU of one job, and what fits."""

    parameters: int
    micro_batch: int
    seq_len: int
    accumulate: int
    gpus: int
    precision: str
    checkpointing: str
    weights: float
    gradients: float
    optimizer: float
    ddp_buckets: float
    head_gradients: float
    activations: Activations
    activations_plain: Optional[Activations]  # without checkpointing, when the job checkpoints
    gpu_memory_gb: float

    def activation_bytes(self, micro_batch: int, plain: bool = False) -> float:
        acts = self.activations_plain if (plain and self.activations_plain) else self.activations
        return acts.peak(micro_batch * self.seq_len)

    def peak(self, micro_batch: Optional[int] = None, plain: bool = False) -> float:
        b = self.micro_batch if micro_batch is None else micro_batch
        start = self.activation_bytes(b, plain) + self.head_gradients
        return self.weights + self.optimizer + self.ddp_buckets + max(start, self.gradients)

    @property
    def fits(self) -> bool:
        return self.peak() <= self.gpu_memory_gb * GiB

    def largest_fitting_micro_batch(self) -> int:
        """The largest micro-batch that fits and divides the global batch (micro x accumulation); 0: none."""
        global_batch = self.micro_batch * self.accumulate
        for b in range(self.micro_batch, 0, -1):
            if global_batch % b == 0 and self.peak(b) <= self.gpu_memory_gb * GiB:
                return b
        return 0

    def row(self) -> Dict[str, Any]:
        fit_b = self.micro_batch if self.fits else self.largest_fitting_micro_batch()
        return {
            "params_M": self.parameters / 1e6, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
            "accumulate": self.accumulate, "gpus": self.gpus, "precision": self.precision,
            "checkpointing": self.checkpointing,
            "weights_GiB": self.weights / GiB, "grads_GiB": self.gradients / GiB,
            "optimizer_GiB": self.optimizer / GiB, "ddp_buckets_GiB": self.ddp_buckets / GiB,
            "activations_GiB": self.activation_bytes(self.micro_batch) / GiB,
            "activations_plain_GiB": self.activation_bytes(self.micro_batch, plain=True) / GiB,
            "peak_GiB": self.peak() / GiB, "peak_plain_GiB": self.peak(plain=True) / GiB,
            "gpu_GiB": self.gpu_memory_gb, "fits": self.fits,
            "fitting_micro_batch": fit_b,
            "fitting_accumulate": (self.micro_batch * self.accumulate) // fit_b if fit_b else None,
        }


def check_plan_settings(gpu_memory_gb: float, micro_batch: Optional[int] = None, seq_len: Optional[int] = None) -> None:
    """Settings a plan can be made for (None: not given); anything else is one ConfigError line
    (an infinite, zero or NaN memory made every plan "fit", a negative length planned negative activations)."""
    if not (isinstance(gpu_memory_gb, (int, float)) and math.isfinite(gpu_memory_gb) and gpu_memory_gb > 0):
        raise ConfigError(f"--gpu_memory_gb: must be a positive, finite number of GiB (e.g. 80), got {gpu_memory_gb}")
    for name, value in (("--batch_size", micro_batch), ("--seq_len", seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}: must be a positive integer, got {value}")


def plan_model(model, micro_batch: int, seq_len: int, accumulate: int = 1, gpus: int = 1,
               precision: str = "32-true", checkpointing: str = "none", gpu_memory_gb: float = 80.0) -> Plan:
    """The plan of training ``model`` (built on the CPU) with these settings."""
    check_plan_settings(gpu_memory_gb, micro_batch, seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    fp32 = 4.0 * n_params
    autocast = precision.startswith("bf16")
    acts = measure_activations(model, checkpointing, autocast)
    plain = measure_activations(model, "none", autocast) if parse_policy(checkpointing) else None
    head = 4.0 * sum(p.numel() for m in (model.wte, model.ln_f) for p in m.parameters())
    return Plan(parameters=n_params, micro_batch=micro_batch, seq_len=seq_len, accumulate=accumulate, gpus=gpus,
                precision=precision, checkpointing=checkpointing, weights=fp32, gradients=fp32, optimizer=2 * fp32,
                ddp_buckets=fp32 if gpus > 1 else 0.0, head_gradients=head, activations=acts,
                activations_plain=plain, gpu_memory_gb=gpu_memory_gb)


def build_for_measurement(config, seed: int = 0) -> torch.nn.Module:
    """The model of ``config`` on the CPU in training mode, with cheap random weights: built on the meta
    device, then every matrix filled with a tiled N(0, 0.02) pattern (2^20 values) and LayerNorms reset.
    Only the activations' sizes are measured with it, and GPT-2's full init of a large model takes minutes
    on a CPU. Stacked MoE experts (``architectures.experts.StackedLinear``) share one expert's storage
    (a stride-0 expansion over E): the parameter count is the full one, the memory one expert's, so a
    64-expert ``small`` model (3.7B parameters) is measured in ~1 GiB; the saved activations do not depend
    on the experts' values."""
    from architectures import build_model
    from architectures.experts import StackedLinear

    with torch.device("meta"):
        model = build_model(config)
    _materialise(model, StackedLinear)
    model.lm_head.weight = model.wte.weight  # materialised separately; the real model is tied
    pattern = torch.randn(2 ** 20, generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        for param in model.parameters():
            flat = (param[0] if param.dim() and param.stride(0) == 0 else param).reshape(-1)  # a view: the storage
            for start in range(0, flat.numel(), pattern.numel()):
                chunk = flat[start:start + pattern.numel()]
                chunk.copy_(pattern[: chunk.numel()])
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.reset_parameters()
    return model.train()


def _materialise(model: torch.nn.Module, shared_over_first_dim: type) -> None:
    """``to_empty(device="cpu")``, except that the parameters of ``shared_over_first_dim`` modules get one
    slice of storage expanded over their first dimension."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            shape = param.shape
            data = (torch.empty(shape[1:]).expand(shape) if isinstance(module, shared_over_first_dim)
                    else torch.empty(shape))
            module._parameters[name] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")


def measurement_key(inputs: Tuple[Any, str, str]) -> str:
    config, precision, checkpointing = inputs
    return json.dumps([dataclasses.asdict(config), precision, checkpointing], sort_keys=True, default=str)


def measure(config, precision: str = "bf16-mixed", checkpointing: str = "none") -> Plan:
    """The measured plan of a model config at micro-batch 1 on one GPU (the model built on the CPU); ``job_plan``
    gives it a job's batch, accumulation and GPUs. Needs torch and ``architectures`` only (a worker process
    that runs it imports neither Lightning nor the run's CLI)."""
    model = build_for_measurement(config)
    try:
        return plan_model(model, 1, config.block_size, precision=precision, checkpointing=checkpointing)
    finally:
        del model
        gc.collect()


def job_plan(measured: Plan, cfg, gpu_memory_gb: float = 80.0) -> Plan:
    """``measured`` (``measure`` of the job's ``measurement_inputs``) for this parsed run configuration."""
    nodes, tasks, _ = geometry(cfg)
    return dataclasses.replace(measured, micro_batch=int(cfg.data.batch_size),
                               accumulate=int(cfg.trainer.accumulate_grad_batches or 1), gpus=nodes * tasks,
                               ddp_buckets=measured.gradients if nodes * tasks > 1 else 0.0,
                               gpu_memory_gb=gpu_memory_gb)


def print_plans(rows: List[Dict[str, Any]], labels: List[str], say: Callable[[str], None]) -> None:
    say("# memory plan per GPU (GiB; measured activations scaled, see docs/scale.md; excludes allocator "
        "fragmentation, NCCL buffers, kernel workspaces, CUDA context)")
    say(f"# {'#':>3} {'job':<18}{'params':>8}{'micro':>6}{'T':>6}{'prec':>11}{'ckpt':>11}{'weights+opt':>12}"
        f"{'grads':>7}{'ddp':>6}{'acts':>8}{'acts(no ckpt)':>14}{'peak':>8}{'GPU':>5}  fits")
    for i, (label, r) in enumerate(zip(labels, rows)):
        verdict = "yes" if r["fits"] else (
            f"NO: micro-batch {r['fitting_micro_batch']} x accumulation {r['fitting_accumulate']} fits"
            if r["fitting_micro_batch"] else "NO: not even micro-batch 1")
        say(f"# {i:>3} {label:<18}{r['params_M']:>7.0f}M{r['micro_batch']:>6}{r['seq_len']:>6}{r['precision']:>11}"
            f"{r['checkpointing']:>11}{r['weights_GiB'] + r['optimizer_GiB']:>12.2f}{r['grads_GiB']:>7.2f}"
            f"{r['ddp_buckets_GiB']:>6.2f}{r['activations_GiB']:>8.2f}{r['activations_plain_GiB']:>14.2f}"
            f"{r['peak_GiB']:>8.2f}{r['gpu_GiB']:>5.0f}  {verdict}")


def measured_cpu_peak(model, optimizer, idx: torch.Tensor, autocast: bool = False) -> int:
    """Peak bytes of one training step on the CPU, by ``torch.distributed._tools.mem_tracker.MemTracker``
    (every tensor storage: weights, gradients, optimizer state, activations, temporaries)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(idx[:, :-1])
            logits = out.logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)) + out.aux_loss
        del out, logits
        loss.backward()
        optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")
    return int(sum(snapshot["Total"] for snapshot in peak.values()))


def geometry(cfg) -> Tuple[int, int, bool]:
    """(nodes, tasks per node, uses GPUs) of a parsed run configuration."""
    nodes = int(cfg.trainer.num_nodes or 1)
    devices = str(cfg.trainer.devices)
    tasks = int(devices) if devices.isdigit() else 1
    return nodes, tasks, str(cfg.trainer.accelerator) != "cpu"
