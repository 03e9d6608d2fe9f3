"""Per-difficulty metrics on the routing probes (``--data probe`` / ``probe/<task>``; datamodules/probe.py), and on
any corpus with a label file (``--data.labels``; datamodules/probe_labels.py).

At every validation ``ProbeMetrics`` evaluates the first ``blocks`` validation blocks (each DDP rank
its share; sums reduced across ranks) with causal routing where the variant has it, and logs:

* ``probe/level<L>/loss``, ``probe/level<L>/acc``: next-token cross-entropy and top-1 accuracy of the
  tokens of difficulty level L (unlabelled tokens are left out);
* ``probe/level<L>/flops``: mean forward FLOPs spent per token of level L, read from the routing trace
  through the contract only (``token_flops``); ``probe/level<L>/token_share`` and ``compute_share``;
* ``probe/level<L>/depth``: the mean depth per token of level L, for the variants that report a per-token
  depth (``recur_halt``, ``mor``, ``early_exit``: the convention of ``callbacks/depth.py``);
* ``probe/spearman``: Spearman correlation between difficulty and compute over the labelled tokens
  (absent when compute does not vary, e.g. vanilla); ``probe/spearman_answers`` the same over the tokens of
  level >= 1 only (the answers: level 0 also holds format tokens such as ``;``, so ``probe/spearman`` can be
  positive for a router that only tells answers from format tokens, without grading the answers by depth);
* ``probe/hard_token_share``, ``probe/hard_compute_share`` and their ratio ``probe/hard_compute_ratio``:
  the share of the labelled tokens, and of the compute spent on them, that falls on the hardest
  levels (``level >= hard_from``); a ratio above 1 means the router favours hard tokens.

The number of levels and the hard threshold are options (``--callbacks.probe_levels``, default ``LEVELS``;
``--callbacks.probe_hard_from``, default ``HARD_FROM``); a label outside them is an error, not dropped.

The same numbers, plus a breakdown by task family and the per-block counts (``blocks``: labelled tokens and
correct answers per validation block and level, the units of the experiments' bootstrap intervals), go to
``<run>/probe.json``; the logged values are also in ``summary.json`` (``val_metrics``). ``evaluate_probe``
is the same evaluation as a function.

Per-token compute (``token_flops``): the model's own ``flops_per_token`` applied to a trace cut down to
that one token (every site's tensors at [b, t]; of the ``extras``, the per-token (B, T, ...) ones are cut too,
the batch statistics dropped), at the batch's sequence length.
So a token pays for exactly the options its routing chose: MoD, the routed blocks that processed it;
MoDE / MoE, the experts it ran (no-op experts and dropped slots cost nothing); MoM, the modules it
chose (SKIP costs nothing). Work shared by a whole sequence is attributed as a lone token would pay it:
a routed block's attention scores count the token's own key only (a processed token also attends to the
other processed tokens of its row: at capacity c that is ~c*T keys, 4*d FLOPs each, not counted).
Soft gates (depth gating) skip nothing, so every token costs the same; the figure reported for them is
the compute the read-out draws on: the non-layer FLOPs plus the layer FLOPs weighted by the depth the
gate reads, sum_l w_l (l + 1) / L (layers of equal cost), i.e. all the layers when the gate reads the
last one, a quarter of them when it reads the first of four.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
from typing import Any, Dict, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from architectures.config import ConfigError
from architectures.contract import RoutingSite
from callbacks.common import all_reduce_sum, eager_measurement, reported_depth, require_positive
from datamodules.probe_labels import evaluation_blocks, too_few_levels

HARD_FROM = 3  # default: the hardest levels: arith depth 3-4, recall 3 hops
LEVELS = 5  # default: 0..MAX_DEPTH of datamodules/probe.py
_STATS = ("tokens", "loss", "correct", "flops", "depth")  # depth: NaN when the variant reports none


# ---------------------------------------------------------------------------- per-token compute
def _cut(site: RoutingSite, b: int, t: int) -> RoutingSite:
    def one(x):
        return None if x is None else x[b : b + 1, t : t + 1]

    per_token = {k: one(v) for k, v in site.extras.items()  # (B, T, ...) statistics are the token's own
                 if torch.is_tensor(v) and v.dim() >= 2 and v.shape[:2] == site.selected.shape[:2]}
    return dataclasses.replace(site, selected=one(site.selected), weights=one(site.weights), probs=one(site.probs),
                               dropped=one(site.dropped), valid=one(site.valid), logits=one(site.logits),
                               extras=per_token)


def _pattern(site: RoutingSite) -> torch.Tensor:
    """(B*T, k) what a token's slots did: the option, -1 when dropped, -2 when the token was not valid."""
    codes = site.selected.long().clone()
    if site.dropped is not None:
        codes[site.dropped] = -1
    if site.valid is not None:
        codes[~site.valid.bool()] = -2
    return codes.reshape(codes.shape[0] * codes.shape[1], -1)


def _gate_depth(site: RoutingSite) -> torch.Tensor:
    """(B*T,) sum_l w_l (l + 1) / L: the depth a soft gate reads, 1 = the last layer."""
    w = site.weights.detach().float()
    depth = (site.selected.float() + 1.0) / site.num_choices
    out = (w * depth).sum(-1) / w.sum(-1).clamp_min(1e-12)
    return out.reshape(-1)


@torch.no_grad()
def token_flops(model, trace: Sequence[RoutingSite], seq_len: int, batch_shape=None) -> torch.Tensor:
    """(B, T) forward FLOPs per token from the routing trace (see the module docstring)."""
    if not trace:
        B, T = batch_shape
        return torch.full((B, T), float(model.flops_per_token(None, seq_len).forward), dtype=torch.float64)
    B, T = trace[0].selected.shape[:2]
    hard = [s for s in trace if s.kind != "soft_gate"]
    soft = [s for s in trace if s.kind == "soft_gate"]
    keys = torch.cat([_pattern(s) for s in hard], dim=1) if hard else torch.zeros(B * T, 1, dtype=torch.long)
    unique, inverse = torch.unique(keys.cpu(), dim=0, return_inverse=True)
    first = torch.full((len(unique),), B * T, dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(B * T), reduce="amin")
    total, layers, fixed = [], [], []
    for n in first.tolist():
        flops = model.flops_per_token([_cut(s, *divmod(n, T)) for s in trace], seq_len)
        total.append(flops.forward)
        fixed.append(flops.head + flops.router)
        layers.append(flops.attn_proj + flops.attn_scores + flops.ffn)
    total, fixed, layers = (torch.tensor(v, dtype=torch.float64)[inverse] for v in (total, fixed, layers))
    if soft:
        total = fixed + layers * _gate_depth(soft[0]).double().cpu()
    return total.reshape(B, T)


# ---------------------------------------------------------------------------- evaluation
def _empty_stats(families: int, levels: int = LEVELS) -> torch.Tensor:
    return torch.zeros(families + 1, levels, len(_STATS), dtype=torch.float64)  # [all, per family]


@torch.no_grad()
def probe_batches(model, tokens: np.ndarray, levels: np.ndarray, families: np.ndarray, batch_size: int = 16,
                  causal: bool = True):
    """Per labelled token: (level, family, loss, correct, flops) numpy arrays, with causal routing unless
    ``causal=False`` or the model trained no causal decision (then the variant's training-time routing,
    which may see the future)."""
    causal = causal and model.has_causal_routing
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: Dict[str, List[np.ndarray]] = {k: [] for k in ("level", "family", "loss", "correct", "flops", "block", "depth")}
    try:
        for start in range(0, len(tokens), batch_size):
            batch = torch.as_tensor(tokens[start : start + batch_size], device=device)
            idx, targets = batch[:, :-1], batch[:, 1:]
            with (model.causal_routing() if causal else contextlib.nullcontext()), eager_measurement():
                result = model(idx)
            logits = result.logits.float()
            loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").cpu().double()
            correct = (logits.argmax(-1) == targets).cpu().double()
            flops = token_flops(model, result.trace, idx.shape[1], batch_shape=idx.shape)
            level = torch.as_tensor(levels[start : start + batch_size])
            keep = level >= 0
            out["level"].append(level[keep].numpy())
            out["family"].append(np.asarray(families[start : start + batch_size])[keep.numpy()])
            out["loss"].append(loss[keep].numpy())
            out["correct"].append(correct[keep].numpy())
            out["flops"].append(flops[keep].numpy())
            depth = reported_depth(result.trace)  # the per-token-depth variants' depth as run (callbacks/depth.py)
            if depth is not None:
                out["depth"].append(depth[0].detach().double().cpu()[keep].numpy())
            rows = torch.arange(start, start + batch.shape[0]).unsqueeze(1).expand_as(level)
            out["block"].append(rows[keep].numpy())  # the validation block (row of ``tokens``) of each token
    finally:
        model.train(was_training)
    if not out["depth"]:
        del out["depth"]
    return {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in out.items()}


def check_metric_levels(token_levels: np.ndarray, levels: int) -> None:
    """Refuses labels above the metrics' levels 0..levels-1, naming the option to raise."""
    if token_levels.size and int(token_levels.max()) >= levels:
        raise too_few_levels("the data's labels", int(token_levels.max()), levels)


def stats_tensor(tokens: Dict[str, np.ndarray], n_families: int, levels: int = LEVELS) -> torch.Tensor:
    """Sums per (all | family, level): tokens, loss, correct, flops (reduced across ranks by summing)."""
    check_metric_levels(tokens["level"], levels)
    stats = _empty_stats(n_families, levels)
    for row, mask in [(0, np.ones_like(tokens["level"], dtype=bool))] + [
            (f + 1, tokens["family"] == f) for f in range(n_families)]:
        for level in range(levels):
            m = mask & (tokens["level"] == level)
            depth = tokens["depth"][m].sum() if "depth" in tokens else float("nan")
            stats[row, level] = torch.tensor([m.sum(), tokens["loss"][m].sum(), tokens["correct"][m].sum(),
                                              tokens["flops"][m].sum(), depth], dtype=torch.float64)
    return stats


def block_counts(tokens: Dict[str, np.ndarray], n_blocks: int, levels: int = LEVELS) -> Dict[str, List[List[int]]]:
    """Per validation block and level: labelled tokens and correct answers ([block][level]). The blocks are
    the units the experiments' bootstrap resamples (a block's tokens together, never one sequence's tokens
    on their own); summed over the blocks they give the pooled counts of ``stats_tensor``."""
    counts, correct = np.zeros((n_blocks, levels), np.int64), np.zeros((n_blocks, levels), np.int64)
    kept = tokens["level"] < levels  # the levels the pooled table has
    where = (tokens["block"][kept].astype(np.int64), tokens["level"][kept].astype(np.int64))
    np.add.at(counts, where, 1)
    np.add.at(correct, where, tokens["correct"][kept].astype(np.int64))
    return {"tokens": counts.tolist(), "correct": correct.tolist()}


def spearman(level: np.ndarray, flops: np.ndarray) -> Dict[str, Optional[float]]:
    """Spearman rho (ties averaged) and its two-sided p-value; None when either side is constant."""
    if len(level) < 3 or np.ptp(level) == 0 or np.ptp(flops) <= 1e-9 * max(1.0, float(np.abs(flops).max())):
        return {"rho": None, "p": None}
    from scipy.stats import spearmanr

    result = spearmanr(level, flops)
    return {"rho": float(result.statistic), "p": float(result.pvalue)}


def spearman_answers(level: np.ndarray, flops: np.ndarray) -> Dict[str, Optional[float]]:
    """``spearman`` over the tokens of level >= 1 only: does compute grow with depth among the answers?"""
    answers = np.asarray(level) >= 1
    return spearman(np.asarray(level)[answers], np.asarray(flops)[answers])


def summarize(stats: torch.Tensor, rank_corr: Dict[str, Optional[float]], family_names: Sequence[str],
              answers_corr: Optional[Dict[str, Optional[float]]] = None, hard_from: int = HARD_FROM) -> Dict[str, Any]:
    """Per-level table, hard-level shares (levels >= ``hard_from``) and the correlation, from the reduced sums
    (``stats``: ``stats_tensor``'s, whose second dimension is the number of levels)."""

    def table(block: torch.Tensor) -> Dict[str, Dict[str, float]]:
        out = {}
        total_tokens, total_flops = float(block[:, 0].sum()), float(block[:, 3].sum())
        for level in range(block.shape[0]):
            n, loss, correct, flops, depth = block[level].tolist()
            if n > 0:
                out[str(level)] = {"tokens": int(n), "loss": loss / n, "acc": correct / n, "flops": flops / n,
                                   "token_share": n / total_tokens, "compute_share": flops / total_flops}
                if math.isfinite(depth):  # the mean depth per token of the level, where the variant reports it
                    out[str(level)]["depth"] = depth / n
        return out

    levels = table(stats[0])
    hard = [v for k, v in levels.items() if int(k) >= hard_from]
    token_share = sum(v["token_share"] for v in hard)
    compute_share = sum(v["compute_share"] for v in hard)
    return {
        "levels": levels,
        "families": {name: table(stats[i + 1]) for i, name in enumerate(family_names)},
        "spearman": rank_corr["rho"], "spearman_p": rank_corr["p"],
        "spearman_answers": (answers_corr or {}).get("rho"), "spearman_answers_p": (answers_corr or {}).get("p"),
        "hard_from": hard_from, "n_levels": int(stats.shape[1]),
        "hard_token_share": token_share, "hard_compute_share": compute_share,
        "hard_compute_ratio": compute_share / token_share if token_share > 0 else None,
    }


def scalars(summary: Dict[str, Any]) -> Dict[str, float]:
    out = {}
    for level, row in summary["levels"].items():
        for key in ("loss", "acc", "flops", "token_share", "compute_share", "depth"):
            if key in row:
                out[f"probe/level{level}/{key}"] = row[key]
    for key in ("spearman", "spearman_answers", "hard_token_share", "hard_compute_share", "hard_compute_ratio"):
        if summary.get(key) is not None and math.isfinite(summary[key]):
            out[f"probe/{key}"] = summary[key]
    return out


def evaluate_probe(model, datamodule, blocks: int = 64, batch_size: int = 16, rank: int = 0, world: int = 1,
                   causal: bool = True, levels: int = LEVELS, hard_from: int = HARD_FROM) -> Dict[str, Any]:
    """The probe summary of ``model`` on the first ``blocks`` validation blocks (single process)."""
    tokens, token_levels, families, family_names = evaluation_blocks(datamodule, blocks, rank, world)
    per_token = probe_batches(model, tokens, token_levels, families, batch_size, causal=causal)
    stats = stats_tensor(per_token, len(family_names), levels)
    summary = summarize(stats, spearman(per_token["level"], per_token["flops"]), family_names,
                        spearman_answers(per_token["level"], per_token["flops"]), hard_from)
    return {**summary, "blocks": block_counts(per_token, len(tokens), levels)}


# ---------------------------------------------------------------------------- the callback
class ProbeMetrics(L.Callback):
    """Per-difficulty loss, accuracy and compute at every validation (see the module docstring)."""

    def __init__(self, blocks: int = 64, batch_size: int = 16, levels: int = LEVELS, hard_from: int = HARD_FROM):
        require_positive("probe_blocks", blocks)
        self.blocks, self.batch_size = blocks, batch_size
        self.levels, self.hard_from = levels, hard_from
        self.latest: Dict[str, Any] = {}

    def state_dict(self) -> Dict[str, int]:
        """What the logged per-level metrics mean: saved in each checkpoint, so that a resume cannot change it."""
        return {"probe_levels": self.levels, "probe_hard_from": self.hard_from, "probe_blocks": self.blocks}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """A resume that would measure other levels, another hard threshold or other blocks is refused (before
        ``config.yaml`` is rewritten: Lightning restores callbacks before ``on_fit_start``); a run's curves keep
        one meaning from its first step to its last. Checkpoints from before this state have nothing to check."""
        now = self.state_dict()
        changed = [f"callbacks.{k} ({state[k]} in the checkpoint, {now[k]} now)" for k in now
                   if k in state and state[k] != now[k]]
        if changed:
            given = " ".join(f"--callbacks.{k} {state[k]}" for k in now if k in state)
            raise ConfigError(f"ckpt_path: the run measured its probe metrics with other settings: {'; '.join(changed)}; "
                              f"resume with {given}, or start a new run")

    def on_fit_start(self, trainer, pl_module) -> None:
        """The labels are checked against ``levels`` before the first step, not at the first validation. Every rank
        checks all the blocks (not its share), so under DDP all ranks stop together instead of some waiting."""
        _, token_levels, _, _ = evaluation_blocks(trainer.datamodule, self.blocks, 0, 1)
        check_metric_levels(token_levels, self.levels)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.latest = distributed_summary(pl_module.model, trainer.datamodule, self.blocks, trainer.global_rank,
                                          trainer.world_size, self.batch_size, self.levels, self.hard_from)
        self.latest["step"] = trainer.global_step
        for name, value in scalars(self.latest).items():
            pl_module.log(name, value, add_dataloader_idx=False, sync_dist=False)
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank must ask (rank 0 alone waited forever)
        if trainer.is_global_zero and log_dir:
            path = pathlib.Path(log_dir) / "probe.json"
            path.write_text(json.dumps(self.latest, indent=1) + "\n")


def distributed_summary(model, datamodule, blocks: int, rank: int, world: int, batch_size: int = 16,
                        levels: int = LEVELS, hard_from: int = HARD_FROM) -> Dict[str, Any]:
    """Every rank evaluates its share of the blocks; sums are all-reduced and the per-token (level, compute)
    pairs gathered for the rank correlation, so every rank returns the summary of all the blocks."""
    tokens, token_levels, families, family_names = evaluation_blocks(datamodule, blocks, rank, world)
    per_token = probe_batches(model, tokens, token_levels, families, batch_size)
    device = next(model.parameters()).device
    stats = all_reduce_sum(stats_tensor(per_token, len(family_names), levels).to(device)).cpu()
    level, flops = _gather([per_token["level"], per_token["flops"]])
    mine = block_counts(per_token, len(tokens), levels)
    # ranks hold consecutive shares of the blocks (labelled_blocks): rank order is block order
    counts, correct = _gather([np.asarray(mine["tokens"], np.int64).reshape(len(tokens), levels),
                               np.asarray(mine["correct"], np.int64).reshape(len(tokens), levels)])
    summary = summarize(stats, spearman(level, flops), family_names, spearman_answers(level, flops), hard_from)
    return {**summary, "blocks": {"tokens": counts.tolist(), "correct": correct.tolist()}}


def _gather(arrays: List[np.ndarray]) -> List[np.ndarray]:
    """Concatenate each array across DDP ranks (one all_gather_object; a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return arrays
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, arrays)
    return [np.concatenate([g[i] for g in gathered]) for i in range(len(arrays))]


def is_probe_data(cfg: Any) -> bool:
    """Probe data, or any corpus with a label file (``data.labels``): the probe metrics run."""
    data = cfg.get("data") if isinstance(cfg, dict) else getattr(cfg, "data", None)
    field = (lambda key: data.get(key)) if isinstance(data, dict) else (lambda key: getattr(data, key, None))
    from datamodules.probe import TASKS

    return str(field("name") or "") in TASKS or bool(field("labels"))
