"""Measurement callbacks: routing statistics, FLOPs / throughput, MHA-vs-FFN contribution, TensorBoard extras.

They read only the model contract (``architectures/contract.py``) through ``pl_module.model`` and
``pl_module.last_output``, so every variant, present or future, is measured the same way.
``experiments.run`` switches them on by default through ``default_callbacks(cfg)``; the options are
the ``--callbacks.*`` group (``CallbacksConfig``).

This module stays import-light (no Lightning) because ``experiments.run`` builds its parser from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from architectures.config import ConfigError

MAX_PROBE_LEVELS = 127  # levels are stored as int8 beside the token cache (-1 = unlabelled)


@dataclass
class CallbacksConfig:
    """``--callbacks.*``: which measurement callbacks run and how often (intervals in optimisation steps).

    Args:
        routing: routing statistics (token fractions, entropy, load CV, processed / dropped, transitions).
        routing_every: steps between cross-rank reductions and logs of the routing counts.
        routing_images_every: steps between transition heatmaps and routing-map images.
        flops: log routing-aware FLOPs per token and the ratio to vanilla.
        flops_every: steps between FLOPs logs.
        throughput: Lightning's ThroughputMonitor (FLOP/s, and MFU on a GPU with a known peak).
        throughput_window: batches in the monitor's rolling average (its first figures come after this many).
        contribution: logit-lens MHA vs FFN contribution on a fixed probe batch.
        contribution_every: steps between contribution measurements (also measured at the end).
        contribution_batch_size: sequences in the fixed probe batch (ratios get a bootstrap standard error over them).
        contribution_seq_len: tokens per probe sequence (default: the model's context).
        tensorboard: custom-scalars layout and hparams with the final metrics.
        probe_blocks: validation blocks of the per-difficulty probe metrics (with --data probe* or --data.labels).
        probe_levels: difficulty levels 0..N-1 of the probe metrics (labels must lie in -1..N-1).
        probe_hard_from: the "hard" levels of the hard-token shares: level >= this.
        depth: per-token depth (histogram, mean; mean per probe level) of the variants that report one
            (recur_halt, mor, early_exit; callbacks/depth.py); a no-op for the others.
        depth_every: steps between depth logs.
    """

    routing: bool = True
    routing_every: int = 50
    routing_images_every: int = 500
    flops: bool = True
    flops_every: int = 50
    throughput: bool = True
    throughput_window: int = 50
    contribution: bool = True
    contribution_every: int = 250
    contribution_batch_size: int = 32
    contribution_seq_len: Optional[int] = None
    tensorboard: bool = True
    probe_blocks: int = 64
    probe_levels: int = 5  # the probe data's levels 0..MAX_DEPTH
    probe_hard_from: int = 3  # arith depth 3-4, recall 3 hops
    depth: bool = True
    depth_every: int = 50

    def validate(self, block_size: Optional[int] = None) -> None:
        for name in ("routing_every", "routing_images_every", "flops_every", "contribution_every",
                     "contribution_batch_size", "probe_blocks", "depth_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"callbacks.{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.throughput_window, int) or self.throughput_window < 2:
            raise ConfigError(f"callbacks.throughput_window: must be an integer >= 2, got {self.throughput_window!r}")
        if not isinstance(self.probe_levels, int) or not 2 <= self.probe_levels <= MAX_PROBE_LEVELS:
            raise ConfigError(f"callbacks.probe_levels: must be an integer in 2..{MAX_PROBE_LEVELS}, got "
                              f"{self.probe_levels!r}")
        hard = self.probe_hard_from
        if not isinstance(hard, int) or not 1 <= hard < self.probe_levels:
            raise ConfigError(f"callbacks.probe_hard_from: must be an integer in 1..{self.probe_levels - 1} "
                              f"(callbacks.probe_levels - 1), got {hard!r}")
        seq = self.contribution_seq_len
        if seq is not None and (not isinstance(seq, int) or seq <= 0):
            raise ConfigError(f"callbacks.contribution_seq_len: must be a positive integer or null, got {seq!r}")
        if seq is not None and block_size is not None and seq > block_size:
            raise ConfigError(
                f"callbacks.contribution_seq_len: probe sequences of {seq} tokens exceed the model context "
                f"(model.block_size={block_size})"
            )


def config_from(cfg: Any) -> CallbacksConfig:
    """The ``callbacks`` group of a run config (jsonargparse Namespace or dict); defaults when absent."""
    group = getattr(cfg, "callbacks", None) if not isinstance(cfg, dict) else cfg.get("callbacks")
    if group is None:
        return CallbacksConfig()
    values = group.as_dict() if hasattr(group, "as_dict") else dict(group)
    return CallbacksConfig(**values)


def default_callbacks(cfg: Any) -> List[Any]:
    """The measurement callbacks the run config asks for, in the order they must run.

    The FLOPs callback comes before the ThroughputMonitor: it sets ``pl_module.flops_per_batch``,
    which the monitor reads on the same batch end.
    """
    config = config_from(cfg)
    config.validate()
    out: List[Any] = []
    if config.routing:
        from callbacks.routing import RoutingStatistics

        out.append(RoutingStatistics(every=config.routing_every, images_every=config.routing_images_every))
    if config.flops or config.throughput:
        from callbacks.flops import FlopsCallback, throughput_monitor

        out.append(FlopsCallback(every=config.flops_every, log=config.flops))
        if config.throughput:
            out.append(throughput_monitor(window_size=config.throughput_window))
    if config.contribution:
        from callbacks.contribution import ContributionCallback

        out.append(ContributionCallback(every=config.contribution_every, batch_size=config.contribution_batch_size,
                                        seq_len=config.contribution_seq_len))
    from callbacks.probe import ProbeMetrics, is_probe_data

    if is_probe_data(cfg):
        out.append(ProbeMetrics(blocks=config.probe_blocks, levels=config.probe_levels,
                                hard_from=config.probe_hard_from))
    if config.depth:  # after ProbeMetrics: it draws the per-level depth that callback has just computed
        from callbacks.depth import DepthFigures

        out.append(DepthFigures(every=config.depth_every))
    if config.tensorboard:
        from callbacks.tensorboard import TensorBoardExtras

        # experiments.run validates once more after fit: the hparams carry those final numbers
        out.append(TensorBoardExtras(after_final_validation=True))
    return out
