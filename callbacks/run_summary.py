"""Per-step timing and loss trajectory, and the end-of-run ``summary.json``."""
from __future__ import annotations

import json
import pathlib
import statistics
import time
from typing import Any, Dict, List, Optional

import lightning as L
import torch


class StepRecorder(L.Callback):
    """Wall time of every optimisation step and the LM loss it produced (kept on device until the end).

    The first ``skip_first`` steps are excluded from the median (they include warm-up allocations).
    """

    def __init__(self, skip_first: int = 2):
        self.skip_first = skip_first
        self.step_times: List[float] = []
        self._losses: List[torch.Tensor] = []
        self.steps: List[int] = []
        self._t0: Optional[float] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        if self._t0 is not None:
            self.step_times.append(time.perf_counter() - self._t0)
        loss = getattr(pl_module, "last_lm_loss", None)
        if loss is not None:
            self._losses.append(loss.detach())
            self.steps.append(trainer.global_step)

    @property
    def losses(self) -> List[float]:
        return [float(x) for x in self._losses]

    @property
    def median_step_time(self) -> Optional[float]:
        times = self.step_times[self.skip_first:] or self.step_times
        return statistics.median(times) if times else None


def routing_summary(trace) -> Dict[str, Dict[str, float]]:
    """Fraction of (token, slot) assignments per option for each routing site of one forward pass."""
    out: Dict[str, Dict[str, float]] = {}
    for site in trace or []:
        counts = site.counts().double()
        total = float(counts.sum())
        if total > 0:
            out[site.name] = {name: float(c) / total for name, c in zip(site.choice_names, counts.tolist())}
    return out


def write_summary(path: pathlib.Path, summary: Dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2, default=float) + "\n")
