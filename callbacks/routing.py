"""Routing statistics from the ``RoutingSite`` trace of every training step, summed across DDP ranks.

Per site (tags ``routing/<site>/...``):

* ``frac/<option>``: share of the kept (token, slot) assignments that went to each option
  (expert, module, ``skip``); dropped slots and padding are excluded, as in ``RoutingSite.counts()``.
* ``entropy``: mean router entropy in nats, from ``probs`` (sites without ``probs`` log none).
* ``load_cv``: load imbalance, the coefficient of variation (population std / mean) of the counts
  over the non-skip options (skip is a choice, not a load); 0 is perfectly balanced.
* ``processed_fraction``: share of tokens with at least one kept non-skip slot (MoD: the tokens a
  routed block processed), for sites of kind ``expert_choice`` or with a ``skip`` option.
* ``dropped_fraction``: share of (token, slot) assignments dropped by a capacity limit (MoE), for
  sites that report ``dropped``.
* ``weights``: histogram of the router weights of the kept slots (rank 0's latest batch).

Transition matrices: the sites of one ``group`` ordered by ``step`` form a chain; for each pair of
consecutive sites, C[i, j] counts tokens whose option at the first site is i and at the next is j,
and P = C with rows normalised (rows of options never chosen stay 0). With k > 1 slots every pair of
kept slots counts once (a token with k_a and k_b kept slots adds k_a * k_b), so a row i reads "among
tokens that used option i at step s, how their slots at step s+1 were spread". Images (rank 0):
``routing/<group>/transitions`` (heatmaps) and ``routing/map`` (for a fixed sample sequence, which
option each site gave each token; white = skipped or dropped, MoD paper Figure 5 style).

DDP: on a logging step (every ``routing_every`` steps and the last step) every rank packs that step's
trace into one float tensor and makes the same single ``all_reduce`` of it (the layout is fixed by the
sorted site names, identical on every rank of the same model), then rank 0 alone logs: the figures are
those of the global batch. Other steps do no routing work at all (no host synchronisation).
The numbers are also saved, one JSON line per logging step, in ``<run folder>/routing/stats.jsonl``.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from architectures.contract import RoutingSite
from callbacks.common import all_reduce_sum, eager_measurement, require_positive, warn_if_longer_than_run
from callbacks.tensorboard import figure, log_figure, log_histogram, log_scalars, tag_part
from lightning_modules.steps import batch_step, completes_step, log_step, may_be_last_step

SKIP = "skip"
# Per-site scalars after the E counts in the packed tensor.
_SCALARS = ("tokens", "slots", "dropped", "processed", "entropy_sum", "entropy_tokens")


@dataclass(frozen=True)
class SiteLayout:
    name: str
    kind: str
    choices: Tuple[str, ...]
    group: str
    step: int
    has_probs: bool
    has_dropped: bool

    @property
    def width(self) -> int:
        return len(self.choices) + len(_SCALARS)

    @property
    def reports_processed(self) -> bool:
        return self.kind == "expert_choice" or SKIP in self.choices


@dataclass(frozen=True)
class Layout:
    """Where each site's numbers and each transition matrix live in the packed tensor."""

    sites: Tuple[SiteLayout, ...]  # sorted by name
    chains: Tuple[Tuple[str, Tuple[Tuple[str, str], ...]], ...]  # (group, consecutive (site, next site) pairs)

    @staticmethod
    def of(trace: Sequence[RoutingSite]) -> "Layout":
        sites = tuple(sorted(
            (SiteLayout(s.name, s.kind, tuple(s.choice_names), s.group or s.name, int(s.step),
                        s.probs is not None, s.dropped is not None) for s in trace),
            key=lambda s: s.name,
        ))
        names = [s.name for s in sites]
        if len(set(names)) != len(names):
            raise ValueError(f"routing trace has duplicate site names: {names}")
        groups: Dict[str, List[SiteLayout]] = {}
        for site in sites:
            groups.setdefault(site.group, []).append(site)
        chains = []
        for group in sorted(groups):
            ordered = sorted(groups[group], key=lambda s: (s.step, s.name))
            pairs = tuple((a.name, b.name) for a, b in zip(ordered, ordered[1:]))
            if pairs:
                chains.append((group, pairs))
        return Layout(sites, tuple(chains))

    def site(self, name: str) -> SiteLayout:
        return next(s for s in self.sites if s.name == name)

    @property
    def size(self) -> int:
        total = sum(s.width for s in self.sites)
        for _, pairs in self.chains:
            total += sum(len(self.site(a).choices) * len(self.site(b).choices) for a, b in pairs)
        return total


def kept_onehot(site: RoutingSite, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B*T, E): how many kept (valid, not dropped) slots of each token went to each option.

    Built with scatter_add (no host synchronisation, unlike ``bincount`` / boolean indexing on a GPU).
    """
    selected = site.selected.long()
    keep = torch.ones_like(selected, dtype=dtype)
    if site.dropped is not None:
        keep = keep * (~site.dropped).to(dtype)
    if site.valid is not None:
        keep = keep * site.valid.unsqueeze(-1).to(dtype)
    n_tokens = selected.shape[0] * selected.shape[1]
    out = torch.zeros(n_tokens, site.num_choices, dtype=dtype, device=selected.device)
    return out.scatter_add_(1, selected.reshape(n_tokens, -1), keep.reshape(n_tokens, -1))


def _valid(site: RoutingSite, dtype: torch.dtype) -> torch.Tensor:
    B, T = site.selected.shape[:2]
    if site.valid is None:
        return torch.ones(B * T, dtype=dtype, device=site.selected.device)
    return site.valid.reshape(-1).to(dtype)


def site_vector(site: RoutingSite, onehot: torch.Tensor) -> torch.Tensor:
    """[counts per option..., tokens, slots, dropped, processed, entropy_sum, entropy_tokens]."""
    dtype = onehot.dtype
    valid = _valid(site, dtype)
    k = site.selected.shape[-1]
    counts = onehot.sum(0)
    tokens = valid.sum()
    dropped = torch.zeros((), dtype=dtype, device=onehot.device)
    if site.dropped is not None:
        dropped = (site.dropped.reshape(valid.shape[0], -1).to(dtype) * valid[:, None]).sum()
    work = onehot.sum(-1)
    if SKIP in site.choice_names:
        work = work - onehot[:, site.choice_names.index(SKIP)]
    processed = ((work > 0).to(dtype) * valid).sum()
    entropy_sum = entropy_tokens = tokens * 0
    if site.probs is not None:
        p = site.probs.detach().reshape(valid.shape[0], -1).to(dtype)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)
        entropy_sum, entropy_tokens = (entropy * valid).sum(), tokens
    scalars = torch.stack([tokens, tokens * k, dropped, processed, entropy_sum, entropy_tokens])
    return torch.cat([counts, scalars])


def transition_counts(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """C[i, j] = sum over valid tokens of kept slots on i at the first site times kept slots on j at the next."""
    return (a * valid[:, None]).T @ b


def pack(trace: Sequence[RoutingSite], layout: Layout, dtype: torch.dtype) -> torch.Tensor:
    by_name = {s.name: s for s in trace}
    onehots = {name: kept_onehot(site, dtype) for name, site in by_name.items()}
    parts = [site_vector(by_name[s.name], onehots[s.name]) for s in layout.sites]
    for _, pairs in layout.chains:
        for a, b in pairs:
            valid = _valid(by_name[a], dtype) * _valid(by_name[b], dtype)
            parts.append(transition_counts(onehots[a], onehots[b], valid).reshape(-1))
    return torch.cat(parts)


@dataclass
class SiteStats:
    layout: SiteLayout
    counts: torch.Tensor  # (E,) kept assignments per option
    tokens: float
    slots: float
    dropped: float
    processed: float
    entropy: Optional[float]

    @property
    def fractions(self) -> torch.Tensor:
        total = self.counts.sum()
        return self.counts / total if total > 0 else torch.zeros_like(self.counts)

    @property
    def load_cv(self) -> Optional[float]:
        work = torch.tensor([c != SKIP for c in self.layout.choices])
        loads = self.counts[work]
        if loads.numel() < 2 or loads.sum() <= 0:
            return None
        return float(loads.std(unbiased=False) / loads.mean())

    @property
    def processed_fraction(self) -> Optional[float]:
        if not self.layout.reports_processed or self.tokens <= 0:
            return None
        return self.processed / self.tokens

    @property
    def dropped_fraction(self) -> Optional[float]:
        if not self.layout.has_dropped or self.slots <= 0:
            return None
        return self.dropped / self.slots


@dataclass
class Transition:
    group: str
    source: str
    target: str
    counts: torch.Tensor  # (E_source, E_target)

    @property
    def matrix(self) -> torch.Tensor:
        """Row-normalised: P(option j at the next site | option i here); rows never visited stay 0."""
        rows = self.counts.sum(1, keepdim=True)
        return torch.where(rows > 0, self.counts / rows.clamp_min(1e-30), torch.zeros_like(self.counts))


@dataclass
class RoutingStats:
    sites: Dict[str, SiteStats]
    transitions: List[Transition]

    @staticmethod
    def unpack(packed: torch.Tensor, layout: Layout) -> "RoutingStats":
        flat = packed.detach().double().cpu()
        sites: Dict[str, SiteStats] = {}
        pos = 0
        for site in layout.sites:
            E = len(site.choices)
            counts, scalars = flat[pos : pos + E], flat[pos + E : pos + site.width].tolist()
            pos += site.width
            values = dict(zip(_SCALARS, scalars))
            entropy = values["entropy_sum"] / values["entropy_tokens"] if values["entropy_tokens"] > 0 else None
            sites[site.name] = SiteStats(site, counts, values["tokens"], values["slots"], values["dropped"],
                                         values["processed"], entropy if site.has_probs else None)
        transitions = []
        for group, pairs in layout.chains:
            for a, b in pairs:
                Ea, Eb = len(layout.site(a).choices), len(layout.site(b).choices)
                transitions.append(Transition(group, a, b, flat[pos : pos + Ea * Eb].reshape(Ea, Eb)))
                pos += Ea * Eb
        return RoutingStats(sites, transitions)

    def scalars(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for name, stats in self.sites.items():
            prefix = f"routing/{tag_part(name)}"
            for option, value in zip(stats.layout.choices, stats.fractions.tolist()):
                out[f"{prefix}/frac/{tag_part(option)}"] = value
            for key in ("entropy", "load_cv", "processed_fraction", "dropped_fraction"):
                value = getattr(stats, key)
                if value is not None:
                    out[f"{prefix}/{key}"] = float(value)
        return out


class RoutingAccumulator:
    """Sums packed per-step routing numbers on this rank until ``reduce`` (a collective) is called."""

    def __init__(self) -> None:
        self.layout: Optional[Layout] = None
        self.buffer: Optional[torch.Tensor] = None

    def add(self, trace: Sequence[RoutingSite]) -> None:
        layout = Layout.of(trace)
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise RuntimeError(
                "routing sites changed during the run (a variant must emit the same sites every step, "
                f"or DDP ranks would reduce different shapes): {[s.name for s in self.layout.sites]} -> "
                f"{[s.name for s in layout.sites]}"
            )
        device = trace[0].selected.device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # exact counts beyond 2**24
        with torch.no_grad():
            packed = pack(trace, layout, dtype)
        self.buffer = packed if self.buffer is None else self.buffer.add_(packed)

    def reduce(self) -> Optional[RoutingStats]:
        """Sum across ranks (every rank must call this at the same step), unpack, and start a new interval."""
        if self.layout is None or self.buffer is None:
            return None
        total = all_reduce_sum(self.buffer)
        self.buffer = None
        return RoutingStats.unpack(total, self.layout)


def _has_routers(model) -> bool:
    """Whether ``model`` holds a router or gate module (the families name them so), i.e. should report routing."""
    modules = model.named_modules() if isinstance(model, torch.nn.Module) else []
    return any(name.rsplit(".", 1)[-1].endswith(("router", "gate")) for name, _ in modules)


class RoutingStatistics(L.Callback):
    """Logs routing statistics every ``every`` steps (and at the last step), heatmaps every ``images_every``.

    Only those steps do any work: the trace of that step's batch is packed on every rank and summed
    across ranks in one all-reduce, so each logged figure is a statistic of the global batch. Between
    them the callback touches nothing (no host synchronisation, no kernels). Rank 0 also appends the
    numbers (counts per option and transition counts) to ``<run folder>/routing/stats.jsonl``, which
    ``python -m experiments.analyze routing RUN_DIR`` reads.
    """

    def __init__(self, every: int = 50, images_every: int = 500, sample: Optional[torch.Tensor] = None):
        require_positive("routing_every", every)
        require_positive("routing_images_every", images_every)
        self.every = every
        self.images_every = images_every
        self.sample = sample  # (1, T) token ids of the routing-map sequence; default: first validation row
        self.accumulator = RoutingAccumulator()
        self.latest: Optional[RoutingStats] = None
        self.latest_step: Optional[int] = None
        self._disabled = False
        self._last_logged = -1
        self._next_images = 0
        self._latest_trace: Sequence[RoutingSite] = ()

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        warn_if_longer_than_run(trainer, "callbacks.routing_every", self.every, "routing")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sample is None and trainer.is_global_zero:
            from callbacks.contribution import validation_rows

            rows = validation_rows(trainer, 1)  # fixed across resumes: the first validation sequence
            if rows is not None:
                self.sample = rows[:1, :-1]

    def due(self, trainer, step: int) -> bool:
        return step > 0 and step != self._last_logged and (step % self.every == 0 or may_be_last_step(trainer, step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._disabled:
            return
        step = batch_step(trainer)  # with gradient accumulation: every micro-batch of the step counts
        if not self.due(trainer, step):
            return
        out = getattr(pl_module, "last_output", None)
        trace = out.trace if out is not None else []
        if not trace:
            self._disabled = True
            model = getattr(pl_module, "model", None)
            if _has_routers(model):  # a dense variant (vanilla, cea, ...) has nothing to log: no warning for it
                variant = getattr(getattr(model, "config", None), "variant", type(pl_module).__name__)
                rank_zero_warn(f"routing statistics: variant {variant!r} has routers but reported no routing sites; "
                               "nothing is logged for routing")
            return
        if self.sample is None and isinstance(batch, torch.Tensor) and batch.dim() == 2:
            self.sample = batch[:1, :-1].detach().clone()
        self.accumulator.add(trace)
        self._latest_trace = trace
        if not completes_step(trainer):
            return
        self._last_logged = step
        stats = self.accumulator.reduce()  # collective: every rank, same step
        self.latest, self.latest_step = stats, log_step(trainer)
        if stats is None or not trainer.is_global_zero:
            return
        self._log(trainer, pl_module, stats, self.latest_step)

    def _log(self, trainer, pl_module, stats: RoutingStats, step: int) -> None:
        log_scalars(trainer, stats.scalars(), step)
        save_stats(trainer, stats, step)
        for site in self._latest_trace:
            log_histogram(trainer, f"routing/{tag_part(site.name)}/weights", kept_weights(site), step)
        if trainer.global_step >= self._next_images or may_be_last_step(trainer, trainer.global_step):
            self._next_images = (trainer.global_step // self.images_every + 1) * self.images_every
            for group, fig in transition_figures(stats.transitions, stats.sites).items():
                log_figure(trainer, f"routing/{tag_part(group)}/transitions", fig, step)
            fig = self.routing_map(pl_module)
            if fig is not None:
                log_figure(trainer, "routing/map", fig, step)

    def routing_map(self, pl_module):
        model = getattr(pl_module, "model", pl_module)
        if self.sample is None:
            return None
        sample = self.sample[:, : model.config.block_size].to(next(model.parameters()).device)
        was_training = model.training
        model.eval()
        try:
            cuda = [sample.device] if sample.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=cuda), eager_measurement():
                trace = model(sample).trace
        finally:
            model.train(was_training)
        return routing_map_figure(trace)

    def summary(self) -> Optional[Dict[str, Dict[str, float]]]:
        """``summary.json``'s ``routing``: option fractions per site of the global batch at the last logged step."""
        if self.latest is None:
            return None
        return {name: dict(zip(s.layout.choices, s.fractions.tolist())) for name, s in self.latest.sites.items()}

    def final_metrics(self) -> Dict[str, float]:
        """Site averages of the latest logged step (the per-site series are in the scalars)."""
        if self.latest is None:
            return {}
        out = {}
        for key in ("entropy", "load_cv", "processed_fraction", "dropped_fraction"):
            values = [getattr(s, key) for s in self.latest.sites.values() if getattr(s, key) is not None]
            if values:
                out[f"routing/mean_{key}"] = float(sum(values) / len(values))
        return out


STATS_FILE = pathlib.Path("routing") / "stats.jsonl"


def stats_record(stats: RoutingStats, step: int) -> Dict[str, Any]:
    """One JSON line: counts per option of every site, and the transition counts of every chain link."""
    return {
        "step": step,
        "sites": {name: {"choices": list(s.layout.choices), "counts": s.counts.tolist(), "tokens": s.tokens,
                         "processed": s.processed, "dropped": s.dropped, "slots": s.slots}
                  for name, s in stats.sites.items()},
        "transitions": [{"group": t.group, "source": t.source, "target": t.target, "counts": t.counts.tolist()}
                        for t in stats.transitions],
    }


def save_stats(trainer, stats: RoutingStats, step: int) -> Optional[pathlib.Path]:
    # the logger's folder (the run folder): ``trainer.log_dir`` is a broadcast under DDP, and rank 0 is alone here
    folder = getattr(trainer.logger, "log_dir", None) if getattr(trainer, "logger", None) is not None else None
    if not folder:
        return None
    path = pathlib.Path(folder) / STATS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(stats_record(stats, step)) + "\n")
    return path


def load_stats(run_dir) -> List[Tuple[int, RoutingStats]]:
    """The records of ``routing/stats.jsonl`` as ``RoutingStats`` (the last record wins for a repeated step)."""
    from datamodules.corpora import DataError, jsonl_rows

    path = pathlib.Path(run_dir) / STATS_FILE
    by_step: Dict[int, RoutingStats] = {}
    for line_no, record in jsonl_rows(path):  # not UTF-8 / not JSON: a DataError naming the file and line
        try:
            step, stats = int(record["step"]), _stats_from_record(record)
        except KeyError as err:
            raise DataError(f"{path}:{line_no}: not a routing statistics record: no {err.args[0]!r} field (written by "
                            "another version, or edited); delete the line or the file") from None
        except (AttributeError, TypeError, ValueError, RuntimeError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise DataError(f"{path}:{line_no}: not a routing statistics record ({reason}); delete the line or the "
                            "file") from None
        by_step[step] = stats
    return sorted(by_step.items())


def _stats_from_record(record: dict) -> RoutingStats:
    sites = {}
    for name, site in record["sites"].items():
        layout = SiteLayout(name, "", tuple(site["choices"]), "", 0, False, False)
        counts = torch.tensor(site["counts"], dtype=torch.float64)
        if counts.shape != (len(layout.choices),):
            raise ValueError(f"site {name}: {tuple(counts.shape)} counts for {len(layout.choices)} choices")
        sites[name] = SiteStats(layout, counts, float(site["tokens"]), float(site["slots"]), float(site["dropped"]),
                                float(site["processed"]), None)
    transitions = []
    for t in record["transitions"]:
        counts = torch.tensor(t["counts"], dtype=torch.float64)
        if counts.dim() != 2:
            raise ValueError(f"transition {t['source']} -> {t['target']}: counts are not a matrix")
        transitions.append(Transition(t["group"], t["source"], t["target"], counts))
    return RoutingStats(sites, transitions)


def kept_weights(site: RoutingSite) -> torch.Tensor:
    keep = torch.ones_like(site.selected, dtype=torch.bool)
    if site.dropped is not None:
        keep &= ~site.dropped
    if site.valid is not None:
        keep &= site.valid.unsqueeze(-1)
    return site.weights.detach()[keep]


# ---------------------------------------------------------------------------- images
def draw_transition(ax, t: "Transition", source_choices: Sequence[str], target_choices: Sequence[str], fig=None,
                    title: Optional[str] = None):
    """One row-normalised heatmap: colour bar, from/to labels, rows never visited hatched with their counts."""
    import numpy as np

    rows = t.counts.sum(1).numpy()
    matrix = np.ma.masked_array(t.matrix.numpy(), mask=np.repeat((rows <= 0)[:, None], t.counts.shape[1], 1))
    ax.set_facecolor("lightgrey")  # masked (unvisited) rows show the hatched grey background
    ax.patch.set_hatch("///")
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    ax.set_title(title or f"{t.source} -> {t.target}", fontsize=8)
    ax.set_yticks(range(len(source_choices)), [f"{c} (n={int(n)})" for c, n in zip(source_choices, rows)], fontsize=6)
    ax.set_xticks(range(len(target_choices)), list(target_choices), fontsize=6, rotation=90)
    ax.set_ylabel(f"from: {t.source}", fontsize=7)
    ax.set_xlabel(f"to: {t.target}", fontsize=7)
    if matrix.size <= 100:
        for (i, j), value in _cells(t.matrix.numpy()):
            if rows[i] > 0:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if value < 0.6 else "black")
    if fig is not None:
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        bar.set_label("P(to | from)", fontsize=6)
        bar.ax.tick_params(labelsize=6)
    return image


def transition_figures(transitions: Sequence[Transition], sites: Dict[str, SiteStats]):
    """One figure per group: a row-normalised heatmap per consecutive pair of sites."""
    by_group: Dict[str, List[Transition]] = {}
    for t in transitions:
        by_group.setdefault(t.group, []).append(t)
    figures = {}
    for group, items in by_group.items():
        cols = min(len(items), 3)
        rows = (len(items) + cols - 1) // cols
        fig, axes = figure(rows, cols, width=4.5, height=4.0)
        for ax in axes.flat[len(items):]:
            ax.axis("off")
        for ax, t in zip(axes.flat, items):
            draw_transition(ax, t, sites[t.source].layout.choices, sites[t.target].layout.choices, fig)
        fig.suptitle(f"{group}: P(option at the next site | option here); hatched: row never visited", fontsize=8)
        fig.tight_layout()
        figures[group] = fig
    return figures


def _cells(matrix):
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            yield (i, j), float(matrix[i, j])


def routing_map_codes(trace: Sequence[RoutingSite]) -> torch.Tensor:
    """(sites, T) for batch row 0: index of the option with the largest kept weight, -1 if none (skip/dropped)."""
    rows = []
    for site in trace:
        weights = site.weights.detach()[0].float().clone()  # (T, k)
        selected = site.selected[0].long()
        unusable = torch.zeros_like(selected, dtype=torch.bool)
        if site.dropped is not None:
            unusable |= site.dropped[0]
        skip = [i for i, name in enumerate(site.choice_names) if name == SKIP]
        if skip:
            unusable |= torch.isin(selected, torch.tensor(skip, device=selected.device))
        weights[unusable] = float("-inf")
        best = weights.argmax(-1)
        code = selected.gather(-1, best[:, None]).squeeze(-1)
        code[torch.isinf(weights.max(-1).values)] = -1
        rows.append(code.cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)


def option_colours(trace: Sequence[RoutingSite]) -> Dict[str, int]:
    """A colour index per option *name* (same name, same colour on every row), in order of appearance."""
    colours: Dict[str, int] = {}
    for site in trace:
        for name in site.choice_names:
            if name != SKIP and name not in colours:
                colours[name] = len(colours)
    return colours


def routing_map_figure(trace: Sequence[RoutingSite]):
    """Which option each site gave each token of the sample; the legend names the options (colour = option name)."""
    import numpy as np
    from matplotlib.patches import Patch

    codes = routing_map_codes(trace)
    if codes.numel() == 0:
        return None
    colours = option_colours(trace)
    named = np.full(codes.shape, -1)
    for row, site in enumerate(trace):
        for option, name in enumerate(site.choice_names):
            if name in colours:
                named[row][codes[row].numpy() == option] = colours[name]
    cmap = "tab10" if len(colours) <= 10 else "tab20"
    size = 10 if len(colours) <= 10 else 20
    fig, axes = figure(1, 1, width=max(5.0, codes.shape[1] / 12 + 2.5), height=max(2.2, 0.3 * codes.shape[0] + 1.2))
    ax = axes[0, 0]
    ax.imshow(np.ma.masked_less(named, 0) % size, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0,
              vmax=size - 1)
    ax.set_yticks(range(len(trace)), [s.name for s in trace], fontsize=6)
    ax.set_xlabel("token position (fixed validation sequence)", fontsize=7)
    ax.set_title("routing map: option with the largest weight; white: skipped / dropped", fontsize=8)
    import matplotlib.pyplot as plt

    palette = plt.get_cmap(cmap)
    handles = [Patch(color=palette((i % size) / (size - 1)), label=name) for name, i in colours.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", label="skip / dropped"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6, frameon=False,
              ncol=1 if len(handles) <= 16 else 2)
    fig.tight_layout()
    return fig


def first_last_figure(records: Sequence[Tuple[int, "RoutingStats"]]):
    """Transition matrices of the first and the last logged step side by side, one row per chain link."""
    (first_step, first), (last_step, last) = records[0], records[-1]
    if not last.transitions:
        return None
    fig, axes = figure(len(last.transitions), 2, width=4.5, height=4.0)
    for row, t_last in enumerate(last.transitions):
        t_first = next((t for t in first.transitions if (t.source, t.target) == (t_last.source, t_last.target)), None)
        source, target = last.sites[t_last.source].layout.choices, last.sites[t_last.target].layout.choices
        for col, (step, t) in enumerate(((first_step, t_first), (last_step, t_last))):
            if t is None:
                axes[row, col].axis("off")
                continue
            draw_transition(axes[row, col], t, source, target, fig, title=f"step {step}: {t.source} -> {t.target}")
    fig.tight_layout()
    return fig
