"""Per-step timing and the global loss curve, and the end-of-run ``summary.json``.

``StepRecorder`` keeps no host synchronisation on the training path: step boundaries are CUDA events
on a GPU (``perf_counter`` on CPU), read back in batches on logging steps; the per-step LM losses stay
on the device and are averaged over DDP ranks (one all-reduce) on logging steps. It also keeps each validation's
headline figures (``VAL_HISTORY``: losses and per-level probe accuracy) at the optimiser step it ran after, so a
table can say when a level was learnt, not only whether. Its record is part of the checkpoint (callback state), so
after a resume ``summary.json`` holds the whole run.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import lightning as L
import torch

from callbacks.val_history import VAL_HISTORY, add_validation
from lightning_modules.run_clock import run_age_s
from lightning_modules.steps import completes_step, is_logging_step


class StepRecorder(L.Callback):
    """Wall time of every optimisation step and the global LM loss it produced.

    A step's time is the interval between the starts of two consecutive optimisation steps (with gradient
    accumulation: their first micro-batches), so it covers the whole step: data, forward, backward of
    every micro-batch, optimiser, every callback's hooks and the logging. Intervals that contain
    a validation or a checkpoint save are left out, and so are the first ``skip_first`` steps of each
    process (warm-up allocations) from the median.
    """

    def __init__(self, skip_first: int = 2):
        self.skip_first = skip_first
        self.step_times: List[float] = []  # seconds, in step order (this run and the resumed ones)
        self.timed_steps: List[int] = []
        self.warm: List[bool] = []
        self.steps: List[int] = []
        self._global_losses: List[float] = []
        self._pending_losses: List[Tuple[int, torch.Tensor]] = []
        self._open: Optional[Tuple[int, Any]] = None  # (step, start mark) of the running step
        self._unresolved: List[Tuple[int, Any, Any]] = []
        self._interrupted = False
        self._measured_here = 0
        self._step_starts = True  # the next batch is the first micro-batch of an optimisation step
        self.starts: List[int] = []  # global step at which each process (first run, each resume) began training
        self.seconds_to_first_step: Optional[float] = None  # this run (lightning_modules.run_clock): to its first step
        # after a resume: the earlier processes' wall time, each to the checkpoint the next one resumed from (what
        # a killed process did after its last checkpoint was done again, so it is not counted twice); None when
        # the checkpoint resumed from is older than this field
        self.seconds_before_resume: Optional[float] = 0.0
        self.val_history: List[List[Any]] = []  # [optimiser steps done, {VAL_HISTORY metric: value}] per validation

    # ------------------------------------------------------------------ timing
    @staticmethod
    def _mark(trainer) -> Any:
        if trainer.strategy.root_device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close(self, trainer) -> None:
        if self._open is not None and not self._interrupted:
            step, start = self._open
            self._unresolved.append((step, start, self._mark(trainer)))
        self._open = None

    def _resolve(self) -> None:
        """Turn the recorded marks into seconds (waits for the GPU to reach the last mark)."""
        for step, start, end in self._unresolved:
            if isinstance(start, float):
                seconds = end - start
            else:
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
            self.step_times.append(seconds)
            self.timed_steps.append(step)
            self.warm.append(self._measured_here >= self.skip_first)
            self._measured_here += 1
        self._unresolved = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.starts.append(trainer.global_step)
        self._trainer, self._module = trainer, pl_module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._step_starts:
            return  # a later micro-batch of the running step
        self._close(trainer)
        self._interrupted = False
        self._open = (trainer.global_step + 1, self._mark(trainer))
        if self.seconds_to_first_step is None:
            self.seconds_to_first_step = run_age_s()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._interrupted = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._interrupted = True

    def on_validation_end(self, trainer, pl_module) -> None:
        # the epoch's logged values are reduced into callback_metrics before this hook, and ModelCheckpoint (always
        # ordered last) saves after it: the checkpoint of this validation holds its entry
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if VAL_HISTORY.fullmatch(k)}
        if metrics:
            add_validation(self.val_history, trainer.global_step, metrics)

    # ------------------------------------------------------------------ losses
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step_starts = completes_step(trainer)
        if not self._step_starts:
            return  # the step's mean loss is known at its last micro-batch
        self._record_loss(trainer, pl_module)
        if is_logging_step(trainer, trainer.global_step):
            self._flush(trainer)

    def _record_loss(self, trainer, pl_module) -> None:
        loss = getattr(pl_module, "last_lm_loss", None)
        last = self._pending_losses[-1][0] if self._pending_losses else (self.steps[-1] if self.steps else -1)
        if loss is not None and last < trainer.global_step:
            self._pending_losses.append((trainer.global_step, loss.detach().float().reshape(())))

    def _flush(self, trainer) -> None:
        """Global means of the pending losses (one all-reduce, on every rank at the same step) and timings."""
        self._resolve()
        if not self._pending_losses:
            return
        losses = torch.stack([loss for _, loss in self._pending_losses])
        if trainer.world_size > 1:
            losses = trainer.strategy.reduce(losses, reduce_op="mean")
        self.steps.extend(step for step, _ in self._pending_losses)
        self._global_losses.extend(losses.double().cpu().tolist())
        self._pending_losses = []

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(trainer)
        self._flush(trainer)

    @property
    def losses(self) -> List[float]:
        """Global (all-rank mean) LM loss per step; steps not yet flushed: this rank's value."""
        return self._global_losses + [float(loss) for _, loss in self._pending_losses]

    @property
    def loss_steps(self) -> List[int]:
        return self.steps + [step for step, _ in self._pending_losses]

    def run_seconds(self) -> Tuple[Optional[float], bool]:
        """The run's wall time to now, and whether it is all of it: this process (``lightning_modules.run_clock``)
        and, after a resume, the earlier ones to their checkpoints; after a resume from a checkpoint older than
        that count, this process's only (a lower bound)."""
        now = run_age_s()
        if now is None or self.seconds_before_resume is None:
            return now, False
        return self.seconds_before_resume + now, True

    @property
    def median_step_time(self) -> Optional[float]:
        self._resolve()
        times = [t for t, warm in zip(self.step_times, self.warm) if warm] or self.step_times
        return statistics.median(times) if times else None

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, Any]:
        # a preemption checkpoint is saved before this callback's hook saw the last step: take its loss now,
        # and reduce the pending losses over the ranks (every rank saves a checkpoint at the same step), so
        # the checkpoint holds global means only, never rank 0's share
        if getattr(self, "_module", None) is not None:
            self._record_loss(self._trainer, self._module)
            self._flush(self._trainer)
        self._resolve()
        seconds, complete = self.run_seconds()
        return {"steps": self.loss_steps, "losses": self.losses, "step_times": list(self.step_times),
                "timed_steps": list(self.timed_steps), "warm": list(self.warm), "starts": list(self.starts),
                "val_history": [list(entry) for entry in self.val_history], "run_seconds": seconds if complete else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps, self._global_losses = list(state.get("steps", [])), list(state.get("losses", []))
        self._pending_losses = []
        self.step_times, self.timed_steps = list(state.get("step_times", [])), list(state.get("timed_steps", []))
        self.warm = list(state.get("warm", [True] * len(self.step_times)))
        self.starts = list(state.get("starts", []))
        self.val_history = [list(entry) for entry in state.get("val_history", [])]  # [] from older checkpoints
        self.seconds_before_resume = state.get("run_seconds")  # None from older checkpoints


def routing_summary(trace) -> Dict[str, Dict[str, float]]:
    """Fraction of (token, slot) assignments per option for each routing site of one forward pass."""
    out: Dict[str, Dict[str, float]] = {}
    for site in trace or []:
        counts = site.counts().double()
        total = float(counts.sum())
        if total > 0:
            out[site.name] = {name: float(c) / total for name, c in zip(site.choice_names, counts.tolist())}
    return out


def _callback(trainer, name: str):
    return next((c for c in trainer.callbacks if type(c).__name__ == name), None)


def flops_of_last_batch(module) -> Optional[Dict[str, Any]]:
    """Fallback without the FLOPs callback: this rank's last batch."""
    from architectures.flops import vanilla_flops

    out, shape = getattr(module, "last_output", None), getattr(module, "last_batch_shape", None)
    seq = shape[1] if shape else None
    measured = module.model.flops_per_token(out.trace if out else None, seq)
    vanilla = vanilla_flops(module.model.config, seq)
    return {"forward": measured.forward, "training": measured.training, "components": measured.as_dict(),
            "ratio_to_vanilla": measured.forward / vanilla.forward, "scope": "rank 0, last batch"}


def measured_summary(trainer, module, recorder: StepRecorder) -> Dict[str, Any]:
    """The measured part of ``summary.json``: global loss curve, step times, routing and FLOPs of the global batch.

    Routing fractions and FLOPs come from the callbacks' last logged step (the last step: they flush
    there), reduced over every rank; without those callbacks, from rank 0's last batch (``scope`` says so).
    """
    routing_cb, flops_cb = _callback(trainer, "RoutingStatistics"), _callback(trainer, "FlopsCallback")
    routing = routing_cb.summary() if routing_cb is not None else None
    flops = flops_cb.summary() if flops_cb is not None else None
    out_trace = module.last_output.trace if getattr(module, "last_output", None) else []
    losses = recorder.losses
    return {
        "final_train_loss": losses[-1] if losses else None,
        "median_step_time_s": recorder.median_step_time,
        "step_times_s": [[s, t] for s, t in zip(recorder.timed_steps, recorder.step_times)],
        "routing": routing if routing is not None else routing_summary(out_trace),
        "routing_scope": "global batch, last step" if routing is not None else "rank 0, last batch",
        "flops_per_token": flops if flops is not None else flops_of_last_batch(module),
        "train_loss_curve": list(zip(recorder.loss_steps, losses)),
        "val_history": recorder.val_history,  # [steps done, {val loss, probe accuracy per level}] per validation
        "train_started_at_steps": list(recorder.starts),  # [0] for one run; [0, s] after a resume from step s
        # this process (the last one after a resume): from its start to the start of its first training step
        "seconds_to_first_step": recorder.seconds_to_first_step,
    }


def write_summary(path: pathlib.Path, summary: Dict[str, Any]) -> None:
    """Temp file and rename: a full disk leaves no truncated ``summary.json`` (and says so in one line)."""
    from lightning_modules.storage import write_text_atomic

    write_text_atomic(path, json.dumps(summary, indent=2, default=float) + "\n")


def headline_val_loss(summary: Dict[str, Any]) -> Optional[float]:
    """The validation loss to compare runs by: the causal one when the run has it (routing that sees the
    future), else ``final_val_loss``. Reads run folders written before ``final_val_loss`` became causal too."""
    causal = (summary.get("val_metrics") or {}).get("val/loss_causal")
    return causal if causal is not None else summary.get("final_val_loss")


def noncausal_val_loss(summary: Dict[str, Any]) -> Optional[float]:
    """``val/loss`` (routing as in training), for any summary old or new."""
    value = (summary.get("val_metrics") or {}).get("val/loss")
    return value if value is not None else summary.get("final_val_loss_noncausal", summary.get("final_val_loss"))


def causal_flops_per_token(summary: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Forward FLOPs per token of the causal evaluation (None: the run has none, or predates it)."""
    metrics = summary.get("val_metrics") or {}
    if metrics.get("val/flops_causal") is None:
        return None
    return {"forward": metrics["val/flops_causal"], "ratio_to_vanilla": metrics.get("val/flops_causal_ratio_to_vanilla")}
