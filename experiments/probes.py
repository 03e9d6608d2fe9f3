"""The probe evaluation as a library (docs/probes.md, "The library API"): load a finished run, compute per token,
the per-token routed share, per-level tables.

    from experiments import probes

    run = probes.load_run("runs/mod-tiny/version_0")
    tokens, levels = probes.labelled_batch(run, blocks=16)     # (N, T+1) ids, (N, T) levels of the targets
    flops = probes.per_token_compute(run.model, tokens[:, :-1])  # (N, T) forward FLOPs per position
    share = probes.per_token_routed_share(run.model, tokens[:, :-1])
    table = probes.per_level_table(levels, flops=flops, routed_share=share, n_levels=run.levels)
    summary = probes.evaluate(run, blocks=16)                  # what probe.json holds, recomputed

Position t of the inputs predicts target t (token t + 1 of the block); the per-token values of position t
pair with the level of target t, as the probe metrics pair them. Every figure is read through the model
contract (routing trace, ``flops_per_token``), so any variant is measured the same way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch

from callbacks import CallbacksConfig
from callbacks.probe import evaluate_probe, token_flops
from datamodules.probe_labels import evaluation_blocks

PathLike = Union[str, pathlib.Path]


@dataclasses.dataclass
class Run:
    """A finished run: its model (final ``last.ckpt``, eval mode), its data rebuilt from ``config.yaml`` (the
    cache is reused), and the probe options it was trained with."""

    folder: pathlib.Path
    model: Any
    datamodule: Any
    config: Dict[str, Any]
    levels: int
    hard_from: int


def load_run(run_dir: PathLike) -> Run:
    """The run in ``run_dir`` (a folder ``experiments.run`` wrote), on the CPU."""
    from datamodules.lm import DataConfig, LMDataModule
    from analysis.contribution import run_config
    from experiments.repro.common import load_model

    folder = pathlib.Path(run_dir)
    config = run_config(folder)
    model = load_model(folder)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = LMDataModule(DataConfig(**{k: v for k, v in (config.get("data") or {}).items() if k in fields}),
                        block_size=int(config["model"]["block_size"]), seed=int(config.get("seed", 0)))
    data.prepare_data()
    data.setup("validate")
    options = config.get("callbacks") or {}
    defaults = CallbacksConfig()
    return Run(folder, model, data, config, int(options.get("probe_levels", defaults.probe_levels)),
               int(options.get("probe_hard_from", defaults.probe_hard_from)))


def labelled_batch(run: Run, blocks: int = 64) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``blocks`` validation blocks the probe metrics evaluate: (N, T+1) token ids and (N, T) levels
    of their targets (-1 = unlabelled; probe data: also where the target's episode began before the block)."""
    tokens, levels, _, _ = evaluation_blocks(run.datamodule, blocks)
    return torch.as_tensor(tokens), torch.as_tensor(levels)


@torch.no_grad()
def routed_forward(model, idx: torch.Tensor, causal: bool = True):
    """``model(idx)`` in eval mode, with the causal routing where the model trained one (as the probe metrics)."""
    was_training = model.training
    model.eval()
    try:
        use_causal = causal and model.has_causal_routing
        with (model.causal_routing() if use_causal else contextlib.nullcontext()):
            return model(idx.to(next(model.parameters()).device))
    finally:
        model.train(was_training)


def per_token_compute(model, idx: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, T) forward FLOPs each input position paid (``callbacks.probe.token_flops``: the model's own
    ``flops_per_token`` on the trace cut down to that token)."""
    out = routed_forward(model, idx, causal)
    return token_flops(model, out.trace, idx.shape[1], batch_shape=tuple(idx.shape))


def per_token_routed_share(model, idx: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, T): the share of the routing slots that did work for the token, over the hard routing sites (MoD blocks,
    MoE / MoDE / MoT / MoM slots): not a "skip" option, not dropped by a capacity limit. 1.0 for a model without
    hard routing (vanilla; depth gating skips nothing)."""
    out = routed_forward(model, idx, causal)
    return routed_share(out.trace, tuple(idx.shape))


def routed_share(trace, shape: Tuple[int, int]) -> torch.Tensor:
    """``per_token_routed_share`` from a routing trace (sites of kind ``soft_gate`` are left out)."""
    worked, slots = torch.zeros(shape, dtype=torch.float64), 0
    for site in trace:
        if site.kind == "soft_gate":
            continue
        skip = torch.tensor([name == "skip" for name in site.choice_names])
        done = ~skip[site.selected.long().cpu()]
        if site.dropped is not None:
            done &= ~site.dropped.bool().cpu()
        worked += done.double().sum(-1)
        slots += site.selected.shape[-1]
    return worked / slots if slots else torch.ones(shape, dtype=torch.float64)


def per_level_table(levels, n_levels: Optional[int] = None, **values) -> Dict[str, Dict[str, float]]:
    """Per level L (labelled tokens only; levels -1 are left out): ``tokens``, ``token_share``, and for each named
    per-token value (same shape as ``levels``) its mean over the level's tokens and ``<name>_share``, the level's
    part of the value's sum over every labelled token (``flops_share`` is the compute share). Levels without
    tokens are absent; ``n_levels`` (optional) refuses levels outside 0..n_levels-1."""
    level = np.asarray(levels).reshape(-1)
    flat = {name: np.asarray(v, dtype=np.float64).reshape(-1) for name, v in values.items()}
    for name, v in flat.items():
        if v.shape != level.shape:
            raise ValueError(f"per_level_table: {name} has {v.size} values for {level.size} levels")
    labelled = level >= 0
    if n_levels is not None and labelled.any() and int(level.max()) >= n_levels:
        raise ValueError(f"per_level_table: level {int(level.max())} is outside 0..{n_levels - 1}")
    totals = {name: v[labelled].sum() for name, v in flat.items()}
    table = {}
    for value in np.unique(level[labelled]).tolist():
        mask = level == value
        row: Dict[str, float] = {"tokens": int(mask.sum()), "token_share": float(mask.sum() / labelled.sum())}
        for name, v in flat.items():
            row[name] = float(v[mask].mean())
            row[f"{name}_share"] = float(v[mask].sum() / totals[name]) if totals[name] else float("nan")
        table[str(value)] = row
    return table


def evaluate(run: Run, blocks: int = 64, causal: bool = True, batch_size: int = 16) -> Dict[str, Any]:
    """The probe summary (``probe.json``'s figures) of the run's final model on its first ``blocks`` validation
    blocks, with the run's levels and hard threshold."""
    return evaluate_probe(run.model, run.datamodule, blocks, batch_size, causal=causal, levels=run.levels,
                          hard_from=run.hard_from)
