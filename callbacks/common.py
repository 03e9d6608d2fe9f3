"""Helpers shared by the measurement callbacks (they import this module, never each other for these)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def eager_measurement():
    """Context for a callback's measurement forward (routing map, contribution, probe): a model compiled with
    ``--compile true`` runs it eagerly. Each such forward has its own batch shape and options
    (``return_residuals``), so compiled it would add a graph of its own to the training and evaluation ones
    (for MoT tens of seconds to minutes each on CPU); eager gives the same numbers, within float rounding."""
    return torch.compiler.set_stance("force_eager")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum in place across the default process group (a no-op outside distributed runs)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def batch_tokens(batch):
    """The (B, T+1) token ids of a training batch: under a loss mask a batch is a (tokens, weights) pair."""
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def require_positive(field: str, value: int) -> None:
    """A callback's interval or size, checked where the callback is built (also outside the CLI)."""
    if value <= 0:
        raise ValueError(f"callbacks.{field}: must be a positive integer, got {value}")


def warn_if_longer_than_run(trainer, field: str, every: int, what: str) -> None:
    """Before training: an interval longer than the run would log only once, at the last step."""
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and 0 < max_steps < every:
        rank_zero_warn(f"{field}={every} is longer than trainer.max_steps={max_steps}: {what} is logged only "
                       f"at the last step; lower {field} for a curve")


def reported_depth(trace):
    """The per-token depth convention of the per-token-depth variants (recur_halt, mor, early_exit): the last
    site whose ``extras`` hold ``"depth"`` gives ``(depth (B, T) float, max_depth float, valid (B, T) bool or
    None)``; None when no site reports a depth."""
    for site in reversed(list(trace or [])):
        if "depth" in site.extras:
            return site.extras["depth"], float(site.extras["max_depth"]), site.valid
    return None
