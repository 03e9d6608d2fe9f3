"""Per-token depth figures for the per-token-depth families (``recur_halt``, ``mor``, ``early_exit``).

The convention (the variants report it, this callback only reads it): the LAST routing site of a forward whose
``extras`` hold ``"depth"`` carries ``extras["depth"]``, a (B, T) float tensor of the (shared-)block
applications each token received as run, and ``extras["max_depth"]``, a 0-dim tensor with the largest possible
depth (``callbacks.common.reported_depth`` reads it; its ``valid`` mask, when the site has one, keeps padding out).

``DepthFigures`` logs every ``every`` optimisation steps (and at the last step), over the global batch (every
micro-batch of the step on every rank, summed in one all-reduce):

* ``depth/mean`` and ``depth/mean_share`` (mean / max_depth) of the real tokens;
* ``depth/per_token``: the histogram of the tokens' depths, one bucket per whole depth 0 .. max_depth
  (a token of depth x counts in bucket floor(x)), written from the reduced counts.

On probe data (``--data probe*`` or ``--data.labels``) the mean depth per difficulty level is computed by
``callbacks.probe.ProbeMetrics`` with its levels (``probe/level<L>/depth``, reduced across ranks there); at
each validation this callback draws it as the figure ``depth/per_level``. A variant that reports no depth
disables the callback at its first due step, silently.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import lightning as L
import torch

from callbacks.common import all_reduce_sum, require_positive, reported_depth, warn_if_longer_than_run
from callbacks.tensorboard import figure, log_figure, log_scalars, tb_writer
from lightning_modules.steps import batch_step, completes_step, log_step, may_be_last_step


def depth_counts(trace, max_depth: Optional[int] = None) -> Optional[torch.Tensor]:
    """float64 (max_depth + 3,): tokens per whole depth 0 .. max_depth, then the depth sum and the token count
    (real tokens only); None when the trace reports no depth."""
    found = reported_depth(trace)
    if found is None:
        return None
    depth, top, valid = found
    top = int(round(top)) if max_depth is None else max_depth
    values = depth.detach().double().flatten()
    if valid is not None:
        values = values[valid.flatten().to(values.device)]
    buckets = torch.bincount(values.floor().clamp(0, top).long(), minlength=top + 1).double()
    return torch.cat([buckets.cpu(), torch.tensor([float(values.sum()), float(values.numel())], dtype=torch.float64)])


def depth_scalars(counts: torch.Tensor) -> Dict[str, float]:
    """``depth/mean`` and ``depth/mean_share`` from ``depth_counts`` (reduced) numbers."""
    top, total, n = counts.numel() - 3, float(counts[-2]), float(counts[-1])
    if n == 0:
        return {}
    mean = total / n
    return {"depth/mean": mean, "depth/mean_share": mean / top if top > 0 else float("nan")}


def log_depth_histogram(trainer, counts: torch.Tensor, step: int) -> None:
    """The histogram of ``depth_counts`` (buckets [d, d + 1)) through the TensorBoard writer."""
    writer = tb_writer(trainer)
    buckets = counts[:-2]
    n, total = float(counts[-1]), float(counts[-2])
    if writer is None or n == 0:
        return
    depths = torch.arange(buckets.numel(), dtype=torch.float64)
    present = (buckets > 0).nonzero().flatten()
    writer.add_histogram_raw("depth/per_token", min=float(depths[present].min()), max=float(depths[present].max()),
                             num=n, sum=total, sum_squares=float((buckets * depths.square()).sum()),
                             bucket_limits=(depths + 1.0).tolist(), bucket_counts=buckets.tolist(), global_step=step)


def level_depth_figure(levels: Dict[str, Dict[str, float]]):
    """A bar chart of the mean depth per probe level (``ProbeMetrics``' summary rows that carry ``depth``)."""
    rows = sorted((int(level), row["depth"]) for level, row in levels.items() if "depth" in row)
    if not rows:
        return None
    fig, axes = figure()
    ax = axes[0, 0]
    ax.bar([str(level) for level, _ in rows], [depth for _, depth in rows])
    ax.set_xlabel("difficulty level")
    ax.set_ylabel("mean depth per token")
    fig.tight_layout()
    return fig


class DepthFigures(L.Callback):
    """Depth per token (histogram, mean) on the training batches; mean depth per probe level (see the module
    docstring)."""

    def __init__(self, every: int = 50):
        require_positive("depth_every", every)
        self.every = every
        self._disabled = False
        self._pending: List[torch.Tensor] = []
        self.latest: Dict[str, float] = {}
        self.latest_counts: Optional[torch.Tensor] = None

    def on_fit_start(self, trainer, pl_module) -> None:
        warn_if_longer_than_run(trainer, "callbacks.depth_every", self.every, "the depth per token")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = batch_step(trainer)
        if self._disabled or not (step > 0 and (step % self.every == 0 or may_be_last_step(trainer, step))):
            return
        out = getattr(pl_module, "last_output", None)
        counts = depth_counts(out.trace if out is not None else [])
        if counts is None:
            self._disabled = True  # the variant reports no depth (the same on every rank: same model)
            return
        self._pending.append(counts)
        if not completes_step(trainer):
            return
        device = next(pl_module.parameters()).device
        total = all_reduce_sum(torch.stack(self._pending).sum(0).to(device)).cpu()  # collective: every rank
        self._pending = []
        self.latest_counts, self.latest = total, depth_scalars(total)
        if trainer.is_global_zero:
            log_scalars(trainer, self.latest, log_step(trainer))
            log_depth_histogram(trainer, total, log_step(trainer))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        from callbacks.probe import ProbeMetrics

        probe = next((cb for cb in trainer.callbacks if isinstance(cb, ProbeMetrics)), None)
        levels = (probe.latest or {}).get("levels", {}) if probe is not None else {}
        fig = level_depth_figure(levels)
        if fig is not None:
            log_figure(trainer, "depth/per_level", fig, log_step(trainer))
