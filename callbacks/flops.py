"""Routing-aware FLOPs per token from the latest trace, and Lightning's ThroughputMonitor fed with them.

Every ``every`` steps ``FlopsCallback`` asks the model for ``flops_per_token(trace, seq_len)`` of the
batch it just trained on (the contract; see ``architectures/flops.py`` for the conventions), averages
it across DDP ranks (one all-reduce of the 5 components; routed models differ slightly per rank) and
logs on rank 0:

* ``flops/forward``, ``flops/training`` (= 3 x forward): FLOPs per token;
* ``flops/forward/<component>`` for attn_proj, attn_scores, ffn, router, head;
* ``flops/ratio_to_vanilla``: forward FLOPs over those of dense GPT-2 of the same size and length.

It also sets ``pl_module.flops_per_batch`` (training FLOPs of this rank's batch), which the
``ThroughputMonitor`` placed after it reads on every batch, giving ``train/device/flops_per_sec`` and
``train/device/mfu`` in TensorBoard. Lightning's device table misses some GPUs; ``PEAK_FLOPS`` fills
them in (a device named plainly "NVIDIA H200": 989.5e12 dense bf16).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from architectures.contract import RoutingSite
from architectures.flops import COMPONENTS, Flops
from callbacks.routing import all_reduce_sum
from callbacks.tensorboard import log_scalars

# Dense (no sparsity) peak FLOP/s per device name (lower case, exact), for names Lightning's table misses.
PEAK_FLOPS: Dict[str, Dict[Union[torch.dtype, str], float]] = {
    "nvidia h200": {
        torch.bfloat16: 989.5e12,
        torch.float16: 989.5e12,
        "tfloat32": 494.7e12,
        torch.float32: 66.9e12,
        torch.float64: 33.5e12,
    },
}


def measured_flops(model, trace: Optional[Sequence[RoutingSite]], seq_len: Optional[int]) -> Flops:
    return model.flops_per_token(list(trace) if trace is not None else None, seq_len)


def flops_scalars(flops: Flops, vanilla: Flops) -> Dict[str, float]:
    out = {"flops/forward": flops.forward, "flops/training": flops.training,
           "flops/ratio_to_vanilla": flops.forward / vanilla.forward if vanilla.forward else float("nan")}
    for name in COMPONENTS:
        out[f"flops/forward/{name}"] = getattr(flops, name)
    return out


def mean_across_ranks(flops: Flops, device: torch.device) -> Flops:
    """Every rank must call this at the same step (one all-reduce of 5 numbers)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flops
    packed = torch.tensor([getattr(flops, c) for c in COMPONENTS], dtype=torch.float64, device=device)
    all_reduce_sum(packed)
    packed /= dist.get_world_size()
    return Flops(**dict(zip(COMPONENTS, packed.tolist())))


class FlopsCallback(L.Callback):
    """Logs routing-aware FLOPs every ``every`` steps and keeps ``pl_module.flops_per_batch`` current."""

    def __init__(self, every: int = 50, log: bool = True):
        if every <= 0:
            raise ValueError(f"callbacks.flops_every: must be a positive integer, got {every}")
        self.every = every
        self.log = log
        self.latest: Dict[str, float] = {}
        self._last = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        out = getattr(pl_module, "last_output", None)
        if out is None:
            return
        step = trainer.global_step
        due = step > 0 and step % self.every == 0 and step != self._last
        if not due and hasattr(pl_module, "flops_per_batch"):
            return
        from architectures.gpt2 import vanilla_flops

        model = pl_module.model
        B, T = out.logits.shape[:2]
        flops = measured_flops(model, out.trace, T)
        pl_module.flops_per_batch = int(flops.training * B * T)
        if not (due and self.log):
            return
        self._last = step
        flops = mean_across_ranks(flops, out.logits.device)
        self.latest = flops_scalars(flops, vanilla_flops(model.config, T))
        if trainer.is_global_zero:
            log_scalars(trainer, self.latest, step)

    def final_metrics(self) -> Dict[str, float]:
        keep = ("flops/forward", "flops/training", "flops/ratio_to_vanilla")
        return {k: v for k, v in self.latest.items() if k in keep}


def peak_flops(device_name: str, dtype: Union[torch.dtype, str]) -> Optional[float]:
    table = PEAK_FLOPS.get(device_name.strip().lower())
    if table is None:
        return None
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        dtype = "tfloat32"  # as Lightning does: fp32 matmuls run on TF32 tensor cores then
    return table.get(dtype)


class PeakAwareThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` whose peak FLOP/s come from ``PEAK_FLOPS`` when Lightning's table lacks the device."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        device = trainer.strategy.root_device
        ours = None
        if device.type == "cuda":
            from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

            ours = peak_flops(torch.cuda.get_device_name(device), _plugin_to_compute_dtype(trainer.precision_plugin))
        with warnings.catch_warnings():
            if ours is not None:
                warnings.filterwarnings("ignore", message=".*FLOPs not found.*")
            super().setup(trainer, pl_module, stage)
        if self.available_flops is None and ours is not None:
            self.available_flops = int(ours)
            for throughput in self._throughputs.values():
                throughput.available_flops = int(ours)


def _batch_size(batch: Any) -> int:
    return int(batch.shape[0])


def _length(batch: Any) -> int:
    # A batch holds T + 1 tokens per row: inputs [:-1], targets [1:]; T tokens are trained on.
    return int(batch.shape[0] * (batch.shape[1] - 1))


def throughput_monitor(window_size: int = 50) -> PeakAwareThroughputMonitor:
    return PeakAwareThroughputMonitor(batch_size_fn=_batch_size, length_fn=_length, window_size=window_size)
