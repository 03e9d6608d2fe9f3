"""Routing-aware FLOPs per token from the latest trace, and Lightning's ThroughputMonitor fed with them.

Every ``every`` steps and at the last step ``FlopsCallback`` asks the model for ``flops_per_token(trace, seq_len)`` of the
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

import math
import time
import warnings
from typing import Any, Dict, Optional, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from architectures.contract import RoutingSite
from architectures.flops import COMPONENTS, Flops
from callbacks.common import all_reduce_sum, batch_tokens, require_positive, warn_if_longer_than_run
from callbacks.tensorboard import log_scalars
from lightning_modules.steps import batch_step, completes_step, is_logging_step, log_step, may_be_last_step

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


#: dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name();
#: the first match wins, so the specific names (PCIe / NVL boards) come before the generic ones.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200", 989.5),  # H200 SXM: the H100 SXM tensor cores with more HBM
    ("H100", 989.5),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.5),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU from its name, or None when the table does not know it."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


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
    """Logs routing-aware FLOPs every ``every`` steps and at the last step, and sets ``pl_module.flops_per_batch``.

    All the work (the FLOPs count reads the trace on the host, the cross-rank mean is a collective) happens
    on those steps only; ``flops_per_batch`` holds the latest figure in between.
    """

    def __init__(self, every: int = 50, log: bool = True):
        require_positive("flops_every", every)
        self.every = every
        self.log = log
        self.latest: Dict[str, float] = {}
        self.latest_flops: Optional[Flops] = None  # mean over ranks at the latest measured step
        self.latest_ratio: Optional[float] = None
        self._last = -1
        self._micro: list = []  # the measured step's micro-batch FLOPs (gradient accumulation)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.log:
            warn_if_longer_than_run(trainer, "callbacks.flops_every", self.every, "FLOPs")

    def due(self, trainer, step: int) -> bool:
        return step > 0 and step != self._last and (step % self.every == 0 or may_be_last_step(trainer, step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        out = getattr(pl_module, "last_output", None)
        shape = getattr(pl_module, "last_batch_shape", None)
        if out is None or shape is None:
            return
        step = batch_step(trainer)  # with gradient accumulation: every micro-batch of the step counts
        if not (self.due(trainer, step) or is_logging_step(trainer, step)):  # the monitor reads it on these
            return
        from architectures.flops import vanilla_flops

        model = pl_module.model
        B, T = shape
        self._micro.append(measured_flops(model, out.trace, T))
        if not completes_step(trainer):
            return
        flops = sum(self._micro[1:], self._micro[0]).scale(1.0 / len(self._micro))  # equal-size micro-batches
        self._micro = []
        pl_module.flops_per_batch = int(flops.training * B * T)
        if not (self.due(trainer, step) and self.log):
            return
        self._last = step
        flops = mean_across_ranks(flops, pl_module.device)
        vanilla = vanilla_flops(model.config, T)
        self.latest_flops = flops
        self.latest_ratio = flops.forward / vanilla.forward if vanilla.forward else None
        self.latest = flops_scalars(flops, vanilla)
        if trainer.is_global_zero:
            log_scalars(trainer, self.latest, log_step(trainer))

    def summary(self) -> Optional[Dict[str, Any]]:
        """``summary.json``'s ``flops_per_token``: the mean over ranks at the last measured step (the last step)."""
        if self.latest_flops is None:
            return None
        return {"forward": self.latest_flops.forward, "training": self.latest_flops.training,
                "components": self.latest_flops.as_dict(), "ratio_to_vanilla": self.latest_ratio,
                "step": self._last}

    def final_metrics(self) -> Dict[str, float]:
        keep = ("flops/forward", "flops/training", "flops/ratio_to_vanilla")
        return {k: v for k, v in self.latest.items() if k in keep}


def peak_flops(device_name: str, dtype: Union[torch.dtype, str]) -> Optional[float]:
    table = PEAK_FLOPS.get(device_name.strip().lower())
    if table is None:  # the bench's bf16 table covers more boards (H100 NVL/PCIe, GH200, L40S, ...)
        return peak_bf16_flops(device_name) if dtype in (torch.bfloat16, torch.float16) else None
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        dtype = "tfloat32"  # as Lightning does: fp32 matmuls run on TF32 tensor cores then
    return table.get(dtype)


class PeakAwareThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` that measures on logging steps only, at the run's x-axis, with the right peak.

    * Peak FLOP/s come from ``PEAK_FLOPS`` when Lightning's table lacks the device.
    * Lightning's monitor synchronises with the GPU after every batch; here the clock is read (and the
      device synchronised) only on logging steps, and each update covers the batches since the previous
      one (the rolling window of ``window_size`` batches becomes ``window_size / log_every_n_steps``
      updates, at least 2). The FLOPs of those batches are the latest ``flops_per_batch`` times their count.
    * Figures are written at the step of the batch (``log_step``), like every other scalar; a separate
      ``trainer.validate()`` is not measured (its per-batch numbers had an x-axis of their own).
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        device = trainer.strategy.root_device
        ours = None
        if device.type == "cuda":
            from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

            ours = peak_flops(torch.cuda.get_device_name(device), _plugin_to_compute_dtype(trainer.precision_plugin))
        self.batches_window = getattr(self, "batches_window", self.kwargs.get("window_size", 100))
        every = max(1, getattr(trainer, "log_every_n_steps", 1) or 1)
        self.kwargs["window_size"] = max(2, math.ceil(self.batches_window / every))
        self._unmeasured = 0
        with warnings.catch_warnings():
            if ours is not None:
                warnings.filterwarnings("ignore", message=".*FLOPs not found.*")
            super().setup(trainer, pl_module, stage)
        if self.available_flops is None and ours is not None:
            self.available_flops = int(ours)
            for throughput in self._throughputs.values():
                throughput.available_flops = int(ours)

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, *_: Any) -> None:
        stage = trainer.state.stage
        self._lengths[stage] += self.length_fn(batch)  # shapes only: no device work
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._unmeasured += 1
        if trainer.fit_loop._should_accumulate() or not is_logging_step(trainer, trainer.global_step):
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # a logging step: the clock must see the queued work
        per_batch = getattr(pl_module, "flops_per_batch", None)
        throughput = self._throughputs[stage]
        throughput.update(time=time.perf_counter() - self._t0s[stage], batches=self._batches[stage],
                          samples=self._samples[stage], lengths=self._lengths[stage],
                          flops=None if per_batch is None else per_batch * self._unmeasured)
        self._unmeasured = 0
        metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in throughput.compute().items()}
        if metrics:
            trainer._logger_connector.log_metrics(metrics, step=log_step(trainer))

    @rank_zero_only
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, *_: Any, **__: Any) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        # time the validation (to take it out of the training throughput), but log nothing for it
        self._update(trainer, pl_module, batch, trainer._evaluation_loop.batch_progress.total.ready)


def _batch_size(batch: Any) -> int:
    return int(batch_tokens(batch).shape[0])


def _length(batch: Any) -> int:
    # A batch holds T + 1 tokens per row: inputs [:-1], targets [1:]; T tokens are trained on.
    tokens = batch_tokens(batch)
    return int(tokens.shape[0] * (tokens.shape[1] - 1))


def throughput_monitor(window_size: int = 50) -> PeakAwareThroughputMonitor:
    return PeakAwareThroughputMonitor(batch_size_fn=_batch_size, length_fn=_length, window_size=window_size)
