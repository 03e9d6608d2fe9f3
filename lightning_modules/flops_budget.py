"""A training budget in measured FLOPs (``--max_train_flops``): count, stop, and the schedule's clock.

The count is the FLOPs callback's routing-aware figure (``model.flops_per_token(trace, T).training``,
forward + backward = 3 x forward; ``architectures/flops.py``) times the tokens of each micro-batch,
summed over every micro-batch of gradient accumulation and every DDP rank. ``LanguageModelModule``
feeds it from ``training_step`` right after the forward pass, so the step that reaches the budget is
known before that step's logging decisions and before the LR scheduler runs:

* training stops after the first optimisation step whose cumulative count reaches the budget
  (``trainer.should_stop``: the step itself completes, its optimiser update included);
* the warmup/cosine schedule reads ``fraction()``, the share of the budget spent, as its progress;
* the count is part of the checkpoint, so a resumed run continues the same count and stops at the
  same step as an uninterrupted one.

Under DDP the per-step count is summed over the ranks with one all-reduce of one number per step; every
rank then holds the same total (the all-reduce returns the same value everywhere), so every rank stops
at the same step. Reading the routing trace to count is a host sync per micro-batch for routed models:
the price of a stop at an exact step (nothing of this runs without a budget).

This module imports no Lightning: it only needs ``trainer.world_size``, ``trainer.strategy.reduce`` and
``trainer.should_stop``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch

from architectures.config import ConfigError

#: the steps before a possible end of the budget during which every step is measured as a last step
#: would be (routing and FLOPs figures, loss checks): a step may cost up to this many times the dearest
#: step so far before the end can come unannounced (only matters with gradient accumulation)
END_MARGIN = 2.0


def validate_budget(value: Any, field: str = "max_train_flops") -> Optional[float]:
    """``None`` (no budget) or a positive, finite number of FLOPs; anything else is a ``ConfigError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{field}: must be a positive, finite number of training FLOPs (e.g. 1.5e12), got {value!r}")
    return float(value)


def require_counted_flops(checkpoint: Dict[str, Any]) -> None:
    """A run resumed with a budget must have counted its FLOPs from its start: its checkpoint holds the count."""
    if "flops_budget" not in checkpoint:
        raise ConfigError("max_train_flops: the checkpoint to resume was trained without a FLOPs budget, so the "
                          "FLOPs it spent were not counted; resume it without --max_train_flops")


class FlopsBudget:
    """Cumulative measured training FLOPs of the whole run (all ranks), and the step that reaches ``max_flops``."""

    def __init__(self, max_flops: float):
        self.max_flops = validate_budget(max_flops)
        self.spent = 0.0  # global, through the last counted step
        self.steps_counted = 0  # optimisation steps in ``spent``
        self.stop_step: Optional[int] = None  # the step that reached the budget (1-based: steps completed)
        self.warmup_fraction: Optional[float] = None  # ``fraction()`` when the LR warmup ended
        self.dearest_step = 0.0  # the largest global count of one step so far
        self._pending = 0.0  # this rank's micro-batches of the running step
        self._announced: Optional[int] = None  # the latest step announced as possibly the last before it was counted

    # ------------------------------------------------------------------ counting
    def add(self, model, trace: Optional[Sequence[Any]], shape) -> None:
        """One micro-batch of this rank: ``shape`` = (B, T) of the tokens trained on."""
        batch, seq = int(shape[0]), int(shape[1])
        per_token = model.flops_per_token(list(trace) if trace is not None else None, seq).training
        self._pending += per_token * batch * seq

    def close_step(self, trainer, completed: int, warmup_steps: int = 0) -> None:
        """At the step's last micro-batch, before its logging decisions: add every rank's count; stop at the budget."""
        if self.stop_step is None and self._may_reach(completed):
            self._announced = completed  # its measurement started as a last step's: it stays one (see may_end_at)
        step = self._pending
        self._pending = 0.0
        if trainer.world_size > 1:  # the same sum on every rank: every rank takes the same decision
            packed = torch.tensor(step, dtype=torch.float64, device=trainer.strategy.root_device)
            step = float(trainer.strategy.reduce(packed, reduce_op="sum"))
        self.spent += step
        self.steps_counted = completed
        self.dearest_step = max(self.dearest_step, step)
        # the cosine starts here (later than at warmup_steps only after a resume that changed optim.warmup_steps)
        if self.warmup_fraction is None and completed >= warmup_steps:
            self.warmup_fraction = self.fraction()
        if self.stop_step is None and self.exhausted:
            self.stop_step = completed
            trainer.should_stop = True

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.max_flops

    def fraction(self) -> float:
        """Share of the budget spent, in [0, 1]."""
        return min(1.0, self.spent / self.max_flops)

    def may_end_at(self, completed: int) -> bool:
        """Whether step ``completed`` is or may be the step that reaches the budget.

        Before the step is counted (the earlier micro-batches of a step under gradient accumulation, whose
        callbacks must already know): true when the budget left is within ``END_MARGIN`` of the dearest steps
        so far, so the last step is always among the measured ones. The answer never changes within a step
        (a callback that began to measure the step at its first micro-batch must end at its last): once
        counted, true for the step that reached the budget and for a step announced before it was counted."""
        if completed <= self.steps_counted:
            return completed == self.stop_step or completed == self._announced
        return self.stop_step is None and self._may_reach(completed)

    def _may_reach(self, completed: int) -> bool:
        left = self.max_flops - self.spent
        return self.dearest_step > 0 and left <= (completed - self.steps_counted) * END_MARGIN * self.dearest_step

    # ------------------------------------------------------------------ schedule
    def schedule_progress(self, step: int, warmup_steps: int) -> float:
        """Cosine progress in [0, 1] after the warmup: the budget's share spent since the warmup ended.

        ``step`` (LambdaLR's counter) = optimisation steps done = ``steps_counted`` when the scheduler
        runs, after the step was counted."""
        if warmup_steps <= 0:
            return self.fraction()
        start = self.warmup_fraction if self.warmup_fraction is not None else 0.0
        if start >= 1.0:
            return 1.0
        return min(1.0, max(0.0, (self.fraction() - start) / (1.0 - start)))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict[str, Any]:
        return {"max_flops": self.max_flops, "spent": self.spent, "steps_counted": self.steps_counted,
                "stop_step": self.stop_step, "warmup_fraction": self.warmup_fraction,
                "dearest_step": self.dearest_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.spent = float(state["spent"])
        self.steps_counted = int(state["steps_counted"])
        self.warmup_fraction = state.get("warmup_fraction")
        self.dearest_step = float(state.get("dearest_step", 0.0))
        # a resume with a larger budget continues a finished run; with the same (or a smaller) one it is over
        self.stop_step = (state.get("stop_step") or self.steps_counted) if self.exhausted else None
