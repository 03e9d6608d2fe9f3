"""Mixture-of-Modules experiments (Gong et al. 2024, arXiv 2407.06677).

* ``mom_kh``: validation loss over K (modules per step) x H (assembly steps), Figure 4.
* ``mom_removal``: validation loss of ONE trained MoM over an N_A x N_F grid of modules kept in the
  pool, Figure 3. Modules are removed from outside the model by ``removed_modules`` (a documented
  forward hook on the routers, below); the weights are never touched.
* ``mom_transitions``: module-to-module transition probabilities of a trained MoM, Figure 6, from
  the routing trace with ``callbacks.routing``'s accumulator (the same counts the training-time
  callback logs).
* ``mom_two_phase``: two-phase training (vanilla, then MoM initialised from it) vs a from-scratch MoM
  at equal total steps, with ``experiments.two_phase`` for the two-phase arm.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from architectures.config import ConfigError
from architectures.mom import MixtureOfModules
from analysis.provenance import origin_lines, run_origin
from analysis.wall_time import run_wall, wall_time_lines
from experiments.repro.common import (Context, figure, fmt, load_model, load_summary, markdown_table, mean_loss,
                                      validation_sequences)

SKIP = "skip"


# ---------------------------------------------------------------------------- model access
def mom_model(model) -> MixtureOfModules:
    if not isinstance(model, MixtureOfModules):
        raise ConfigError(f"model.variant: {model.config.variant!r} is not a Mixture-of-Modules model")
    return model


def removed_modules(model, attn: Sequence[int] = (), ffn: Sequence[int] = ()):
    """``MixtureOfModules.removed_modules``: the modules' router logits set to -inf while inside the context."""
    return mom_model(model).removed_modules(attn, ffn)


@torch.no_grad()
def routing_stats(model, sequences: torch.Tensor, batch_size: int = 8):
    """``callbacks.routing.RoutingStats`` summed over the sequences (eval mode, no gradients)."""
    from callbacks.routing import RoutingAccumulator

    model.eval()
    accumulator = RoutingAccumulator()
    for start in range(0, sequences.shape[0], batch_size):
        accumulator.add(model(sequences[start : start + batch_size, :-1]).trace)
    stats = accumulator.reduce()
    if stats is None:
        raise ConfigError(f"model.variant: {model.config.variant!r} produced no routing trace")
    return stats


def module_usage(stats, kind: str) -> torch.Tensor:
    """(pool,) selections of each real module of ``kind`` summed over every step and chunk."""
    total = None
    for name, site in stats.sites.items():
        if not site.layout.group.endswith(f".{kind}"):
            continue
        real = torch.tensor([c != SKIP for c in site.layout.choices])
        counts = site.counts[real]
        total = counts if total is None else total + counts
    if total is None:
        raise ConfigError(f"no MoM {kind} routing sites in the trace")
    return total


def removal_order(model, sequences: torch.Tensor, order: str) -> Tuple[List[int], List[int]]:
    """Module indices in the order they are removed: least used first ("usage") or last index first ("index")."""
    n_attn, n_ffn = mom_model(model).pool_sizes()
    if order == "index":
        return list(range(n_attn - 1, -1, -1)), list(range(n_ffn - 1, -1, -1))
    if order != "usage":
        raise ConfigError(f"--order: unknown order {order!r}; use usage or index")
    stats = routing_stats(model, sequences)
    attn, ffn = ([int(i) for i in torch.argsort(module_usage(stats, kind), stable=True)] for kind in ("attn", "ffn"))
    return attn, ffn


# ---------------------------------------------------------------------------- K x H sweep
def kh_sweep(ctx: Context, ks: Sequence[int], hs: Sequence[int], variant: str = "mom",
             options: Sequence[str] = (), seeds: int = 5) -> Dict[str, Any]:
    """Every (K, H) cell and vanilla at ``seeds`` seeds (from ``ctx.seed`` on): the loss table as seed means with
    bootstrap intervals, and per K whether the deepest H beats the shallowest (Holm over the Ks)."""
    if seeds < 1:
        raise ConfigError(f"--seeds: must be a positive integer, got {seeds}")
    grid = {(k, h): ["--variant", variant, *options, "--model.mom.top_k", str(k), "--model.mom.steps", str(h)]
            for k in ks for h in hs}
    reference = ["--variant", "vanilla", *options]
    ctx.validate([*grid.values(), reference])
    points = [(cell, seed) for cell in [None, *grid] for seed in range(ctx.seed, ctx.seed + seeds)]
    summaries = ctx.run_many([([*(reference if cell is None else grid[cell]), "--seed", str(seed)], None, None)
                              for cell, seed in points])
    from analysis.stats import seed_summary

    vanilla_rows = [{"K": None, "H": None, "variant": "vanilla", "seed": seed, "val_loss": s["final_val_loss"],
                     **run_wall(s), **run_origin(s), "run_dir": s["run_dir"]}
                    for (cell, seed), s in zip(points, summaries) if cell is None]
    vanilla = seed_summary([r["val_loss"] for r in vanilla_rows])
    rows = [kh_row(cell, seed, s) for (cell, seed), s in zip(points, summaries) if cell is not None]
    cells = kh_cells(rows, grid)
    tests = kh_depth_tests(rows, ks, hs)
    sections = kh_sections(ctx, variant, seeds, ks, hs, vanilla, cells, tests, rows, vanilla_rows)
    plot_kh(ctx, variant, ks, hs, cells, vanilla)
    ctx.log_table("mom_kh", sections[4])
    results = {"variant": variant, "steps": ctx.steps, "seeds": seeds, "vanilla_val_loss": vanilla,
               "cells": [{"K": k, "H": h, **cell} for (k, h), cell in cells.items()], "depth_tests": tests,
               "runs": [*vanilla_rows, *rows]}  # every run, so that publish keeps their records
    ctx.write_report("MoM K x H sweep", sections, results)
    return results


def kh_row(cell: Tuple[int, int], seed: int, s: Dict[str, Any]) -> Dict[str, Any]:
    """One run of the sweep (a (K, H) cell at a seed) as the figures its tables use."""
    return {"K": cell[0], "H": cell[1], "seed": seed, "val_loss": s["final_val_loss"],
            "flops_ratio": s["flops_per_token"]["ratio_to_vanilla"], "flops_per_token": s["flops_per_token"]["forward"],
            "parameters": s["parameters"], "step_time_s": s["median_step_time_s"],
            "skip_share": skip_share(s["routing"]), **run_wall(s), **run_origin(s), "run_dir": s["run_dir"]}


def kh_cells(rows: Sequence[Dict[str, Any]], grid: Dict[Tuple[int, int], Any]) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """Per (K, H) cell: the loss over seeds (``seed_summary``) and the seed means of the cost figures."""
    from analysis.stats import seed_summary

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    cells = {}
    for cell in grid:
        runs = [r for r in rows if (r["K"], r["H"]) == cell]
        cells[cell] = {"val_loss": seed_summary([r["val_loss"] for r in runs]),
                       **{key: mean([r[key] for r in runs]) for key in ("flops_ratio", "flops_per_token",
                                                                          "parameters", "step_time_s", "skip_share")}}
    return cells


def kh_depth_tests(rows: Sequence[Dict[str, Any]], ks: Sequence[int], hs: Sequence[int]) -> Dict[str, Any]:
    """Per K, the deepest H against the shallowest (the paper: more assembly steps, lower loss): one-sided Welch
    over seeds, Holm over the Ks. None with a single H."""
    from analysis.stats import compare_groups, with_holm

    if len(hs) < 2:
        return {}
    low, high = min(hs), max(hs)
    losses = lambda k, h: [r["val_loss"] for r in rows if (r["K"], r["H"]) == (k, h)]  # noqa: E731
    return with_holm({f"K={k}": compare_groups(losses(k, high), losses(k, low), "less") for k in ks})


def kh_sections(ctx: Context, variant: str, seeds: int, ks: Sequence[int], hs: Sequence[int], vanilla: Dict[str, Any],
                cells: Dict[Tuple[int, int], Dict[str, Any]], tests: Dict[str, Any], rows: Sequence[Dict[str, Any]],
                vanilla_runs: Sequence[Dict[str, Any]]) -> List[str]:
    """results.md's sections: the loss and FLOPs tables over K x H, the depth tests, every run, the observations,
    the wall time per part and the code and CPUs the runs trained at."""
    from analysis.tables import ci_cell, test_cell

    loss = lambda k, h: ci_cell(cells[(k, h)]["val_loss"]["mean"], cells[(k, h)]["val_loss"]["ci"], 4)  # noqa: E731
    test_rows = [[name, f"H={max(hs)} vs H={min(hs)}", test_cell(t)] for name, t in tests.items()]
    return [
        f"Variant `{variant}` (K = model.mom.top_k, H = model.mom.steps), {ctx.steps} steps each, {seeds} seed(s) "
        f"from {ctx.seed} on; vanilla reference val loss {ci_cell(vanilla['mean'], vanilla['ci'], 4)}. Cells: "
        "seed mean [95% bootstrap interval over seeds].", "",
        "Validation loss (rows K, columns H):", "",
        markdown_table(["K \\ H", *map(str, hs)], [[k, *(loss(k, h) for h in hs)] for k in ks]), "",
        "Forward FLOPs per token relative to vanilla (routing-aware, last training batch):", "",
        markdown_table(["K \\ H", *map(str, hs)], [[k, *(cells[(k, h)]["flops_ratio"] for h in hs)] for k in ks]), "",
        *(["Deeper assembly against the shallowest, per K (Δ = deepest H's loss minus the shallowest's; one-sided "
           "Welch over seeds, Holm over the Ks):", "", markdown_table(["K", "comparison", "Δ val loss [95% CI], g, p"],
                                                                      test_rows), ""] if tests else []),
        "All runs:", "",
        markdown_table(["K", "H", "seed", "val loss", "FLOPs/token", "x vanilla", "params", "step s", "SKIP share"],
                       [[r["K"], r["H"], str(r["seed"]), r["val_loss"], r["flops_per_token"], r["flops_ratio"],
                         r["parameters"], r["step_time_s"], r["skip_share"]] for r in rows]), "",
        "Observations (computed from the seed means above):", "", *kh_observations(cells, ks, hs, tests), "",
        *wall_time_lines([*vanilla_runs, *rows], kh_part, ctx.workers), *origin_lines([*vanilla_runs, *rows]),
    ]


def kh_part(row: Dict[str, Any]) -> str:
    """A run's part of the sweep, for the wall-time table: vanilla or its (K, H) cell."""
    return "vanilla" if row["K"] is None else f"K={row['K']} H={row['H']}"


def plot_kh(ctx: Context, variant: str, ks: Sequence[int], hs: Sequence[int],
            cells: Dict[Tuple[int, int], Dict[str, Any]], vanilla: Dict[str, Any]) -> None:
    """Loss over H per K (seed means with their intervals), and loss against FLOPs per token."""
    from analysis.tables import error_bars, plotted_means

    fig, axes = figure(1, 2, width=5.0)
    for k in ks:
        summaries = [cells[(k, h)]["val_loss"] for h in hs]
        means = plotted_means(summaries)
        ratios = [cells[(k, h)]["flops_ratio"] for h in hs]
        axes[0, 0].errorbar(list(hs), means, yerr=error_bars(summaries), marker="o", capsize=3, label=f"K={k}")
        axes[0, 1].scatter(ratios, means, label=f"K={k}")
        for h, x, y in zip(hs, ratios, means):
            axes[0, 1].annotate(f"{k},{h}", (x, y), fontsize=7)
    for ax in axes[0]:
        if vanilla["mean"] is not None:
            ax.axhline(vanilla["mean"], color="gray", linestyle="--", label="vanilla (seed mean)")
        ax.set_ylabel("validation loss (seed mean)")
        ax.legend(fontsize=7)
    axes[0, 0].set_xlabel("H (assembly steps)")
    axes[0, 1].set_xlabel("forward FLOPs / token (x vanilla)")
    fig.suptitle(f"MoM K x H sweep ({variant}, {ctx.size}, {ctx.steps} steps, {len(vanilla['seeds'])} seed(s))")
    ctx.save_figure(fig, "mom_kh")


def skip_share(routing: Dict[str, Dict[str, float]]) -> Optional[float]:
    shares = [fractions.get(SKIP, 0.0) for name, fractions in routing.items() if name.startswith("mom.")]
    return sum(shares) / len(shares) if shares else None


def pareto_front(points: Dict[Any, Tuple[float, float]]) -> List[Any]:
    """Keys whose (cost, loss) no other point beats in both (lower is better)."""
    front = []
    for key, (cost, loss) in points.items():
        if not any(c <= cost and l <= loss and (c, l) != (cost, loss) for c, l in points.values()):
            front.append(key)
    return sorted(front, key=lambda k: points[k][0])


def kh_observations(cells: Dict[Tuple[int, int], Dict[str, Any]], ks: Sequence[int], hs: Sequence[int],
                    tests: Dict[str, Any]) -> List[str]:
    """The trend over H per K (seed means; a claim only where the depth test passes), the Pareto front and the
    lowest cell."""
    from analysis.stats import passes

    loss = {cell: c["val_loss"]["mean"] for cell, c in cells.items() if c["val_loss"]["mean"] is not None}
    lines = [f"- No finite loss in any seed (diverged): K={k}, H={h}." for (k, h) in cells if (k, h) not in loss]
    for k in (ks if len(hs) >= 2 else ()):
        series = [loss.get((k, h)) for h in hs]
        changes = ", ".join("-" if a is None or b is None else f"{b - a:+.4f}" for a, b in zip(series, series[1:]))
        test = tests[f"K={k}"]
        verdict = ("lower after Holm" if passes(test) else "not shown lower" if test.get("p_holm") is not None
                   else "untested (one seed, or no finite loss)")
        lines.append(f"- K={k}: seed-mean loss changes with each step in H: {changes}; H={max(hs)} vs H={min(hs)}: "
                     f"{verdict} (a trend over H is not tested beyond this pair).")
    if not loss:
        return lines
    front = pareto_front({cell: (cells[cell]["flops_ratio"], value) for cell, value in loss.items()})
    lines.append("- Loss-vs-FLOPs Pareto front (K,H), seed means: " + ", ".join(f"({k},{h})" for k, h in front) + ".")
    if (3, 2) in loss:
        lines.append(f"- (K=3, H=2) is {'on' if (3, 2) in front else 'not on'} the Pareto front.")
    best = min(loss, key=loss.get)
    lines.append(f"- Lowest seed-mean loss: K={best[0]}, H={best[1]} ({loss[best]:.4f}).")
    return lines


# ---------------------------------------------------------------------------- module removal
def trained_run(ctx: Context, variant: str, options: Sequence[str], run: Optional[str]) -> pathlib.Path:
    if run:
        path = pathlib.Path(run)
        if not (path / "checkpoints" / "last.ckpt").is_file():
            raise FileNotFoundError(f"--run: {path} has no checkpoints/last.ckpt")
        return path
    argv = ["--variant", variant, *options]
    ctx.validate([argv])
    return pathlib.Path(ctx.run(argv)["run_dir"])


def removal_grid(model, data: torch.Tensor, attn_order: Sequence[int], ffn_order: Sequence[int]
                 ) -> Dict[Tuple[int, int], Optional[float]]:
    """Validation loss with every (attention, FFN) count of modules kept, removing in the given orders; None
    where fewer choices than K remain."""
    n_a, n_f = mom_model(model).pool_sizes()
    k = model.config.mom.top_k
    skip = 1 if model.config.mom.allow_skip else 0
    grid: Dict[Tuple[int, int], Optional[float]] = {}
    for keep_a in range(n_a, 0, -1):
        for keep_f in range(n_f, 0, -1):
            if k > keep_a + skip or k > keep_f + skip:
                grid[(keep_a, keep_f)] = None  # fewer choices than K: not a valid configuration
                continue
            with removed_modules(model, attn_order[: n_a - keep_a], ffn_order[: n_f - keep_f]):
                grid[(keep_a, keep_f)] = mean_loss(model, data)
    return grid


def plot_removal(ctx: Context, grid: Dict[Tuple[int, int], Optional[float]], a_keep: List[int], f_keep: List[int],
                 variant: str) -> None:
    """The removal grid as a heat map, each cell labelled with its loss."""
    fig, axes = figure(1, 1, width=5.0, height=4.2)
    ax = axes[0, 0]
    matrix = torch.tensor([[float("nan") if grid[(a, f)] is None else grid[(a, f)] for f in f_keep] for a in a_keep])
    image = ax.imshow(matrix.numpy(), cmap="viridis_r")
    ax.set_xticks(range(len(f_keep)), f_keep)
    ax.set_yticks(range(len(a_keep)), a_keep)
    ax.set_xlabel("FFN modules kept (N_F)")
    ax.set_ylabel("attention modules kept (N_A)")
    for i, a in enumerate(a_keep):
        for j, f in enumerate(f_keep):
            if grid[(a, f)] is not None:
                ax.text(j, i, f"{grid[(a, f)]:.2f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(image, ax=ax, label="validation loss")
    ax.set_title(f"MoM module removal ({variant})")
    ctx.save_figure(fig, "mom_removal")


def removal(ctx: Context, variant: str = "mom", options: Sequence[str] = (), run: Optional[str] = None,
            sequences: int = 64, order: str = "usage") -> Dict[str, Any]:
    run_dir = trained_run(ctx, variant, options, run)
    model = load_model(run_dir)
    n_a, n_f = mom_model(model).pool_sizes()
    data = validation_sequences(run_dir, model, sequences)
    attn_order, ffn_order = removal_order(model, data, order)
    k = model.config.mom.top_k
    grid = removal_grid(model, data, attn_order, ffn_order)
    intact = grid[(n_a, n_f)]
    half_a, three_quarter_f = max(1, round(n_a / 2)), max(1, round(0.75 * n_f))
    checks = {
        f"remove ~50% attention (keep {half_a}/{n_a})": grid.get((half_a, n_f)),
        f"remove ~25% FFN (keep {three_quarter_f}/{n_f})": grid.get((n_a, three_quarter_f)),
        f"both (keep {half_a}/{n_a} attention, {three_quarter_f}/{n_f} FFN)": grid.get((half_a, three_quarter_f)),
        "keep 1 attention, 1 FFN": grid.get((1, 1)),
    }
    a_keep, f_keep = list(range(n_a, 0, -1)), list(range(n_f, 0, -1))
    sections = [
        f"Trained model: `{run_dir}` ({model.config.variant}, pool N_A={n_a}, N_F={n_f}, K={k}, "
        f"H={model.layout.steps}). Removal order: {order} (attention {attn_order}, FFN {ffn_order}: first listed is "
        f"removed first). Loss over the first {data.shape[0]} validation sequences.", "",
        "Validation loss (rows: attention modules kept, columns: FFN modules kept; '-' = fewer choices than K):", "",
        markdown_table(["N_A \\ N_F", *map(str, f_keep)], [[a, *(grid[(a, f)] for f in f_keep)] for a in a_keep]), "",
        markdown_table(["configuration", "val loss", "change vs intact", "relative"],
                       [[name, value, None if value is None else value - intact,
                         None if value is None else f"{100 * (value - intact) / intact:+.2f}%"]
                        for name, value in [("intact", intact), *checks.items()]]), "",
    ]
    plot_removal(ctx, grid, a_keep, f_keep, model.config.variant)
    ctx.log_table("mom_removal", sections[3])
    results = {"run_dir": str(run_dir), "order": order, "attn_order": attn_order, "ffn_order": ffn_order,
               "n_attn": n_a, "n_ffn": n_f, "top_k": k, "intact": intact,
               "grid": [{"attn_kept": a, "ffn_kept": f, "val_loss": v} for (a, f), v in grid.items()],
               "checks": checks}
    ctx.write_report("MoM module removal", sections, results)
    return results


# ---------------------------------------------------------------------------- transitions
def group_transitions(stats) -> Dict[str, Dict[str, Any]]:
    """Per router group: choices, counts summed over consecutive steps, and each step pair's counts."""
    groups: Dict[str, Dict[str, Any]] = {}
    for t in stats.transitions:
        entry = groups.setdefault(t.group, {"choices": list(stats.sites[t.source].layout.choices), "pairs": []})
        entry["pairs"].append((t.source, t.target, t.counts.clone()))
    for entry in groups.values():
        entry["counts"] = sum(c for _, _, c in entry["pairs"])
    return groups


def transition_shares(counts: torch.Tensor, choices: Sequence[str]) -> Dict[str, float]:
    """Shares of all transitions that follow the vanilla order (i -> i+1), repeat a module, or involve SKIP."""
    total = float(counts.sum())
    real = [i for i, c in enumerate(choices) if c != SKIP]
    skip = [i for i, c in enumerate(choices) if c == SKIP]
    sequential = sum(float(counts[i, i + 1]) for i in real if i + 1 in real)
    repeat = sum(float(counts[i, i]) for i in real)
    with_skip = float(counts[skip, :].sum() + counts[:, skip].sum() - counts[skip][:, skip].sum()) if skip else 0.0
    share = (lambda x: x / total) if total > 0 else (lambda x: 0.0)
    return {"sequential": share(sequential), "repeat": share(repeat), "with_skip": share(with_skip),
            "other": share(total - sequential - repeat - with_skip)}


def transitions(ctx: Context, variant: str = "mom", options: Sequence[str] = (), run: Optional[str] = None,
                sequences: int = 64) -> Dict[str, Any]:
    run_dir = trained_run(ctx, variant, options, run)
    model = load_model(run_dir)
    mom_model(model)
    data = validation_sequences(run_dir, model, sequences)
    stats = routing_stats(model, data)
    groups = group_transitions(stats)
    if not groups:
        raise ConfigError("the MoM has a single assembly step (H=1): there are no step-to-step transitions")
    sections = [f"Trained model: `{run_dir}` ({model.config.variant}); routes of the first {data.shape[0]} validation "
                "sequences. P(module j at step h+1 | module i at step h), summed over the consecutive steps.", ""]
    results: Dict[str, Any] = {"run_dir": str(run_dir), "groups": {}}
    fig, axes = figure(2, len(groups), width=4.6, height=4.2)
    for col, (group, entry) in enumerate(sorted(groups.items())):
        choices, counts = entry["choices"], entry["counts"]
        rows = counts.sum(1, keepdim=True)
        matrix = torch.where(rows > 0, counts / rows.clamp_min(1e-30), torch.zeros_like(counts))
        shares = transition_shares(counts, choices)
        usage = [stats.sites[name].fractions.tolist() for name in sorted({s for s, _, _ in entry["pairs"]}
                                                                          | {t for _, t, _ in entry["pairs"]},
                                                                          key=lambda n: stats.sites[n].layout.step)]
        load_cv = [stats.sites[n].load_cv for n in stats.sites if stats.sites[n].layout.group == group]
        results["groups"][group] = {"choices": choices, "matrix": matrix.tolist(), "counts": counts.tolist(),
                                    "shares": shares, "usage_per_step": usage, "load_cv_per_step": load_cv}
        sections += [f"### {group}", "", markdown_table(["from \\ to", *choices],
                                                        [[c, *row] for c, row in zip(choices, matrix.tolist())]), "",
                     f"Transitions in vanilla order (module i -> i+1): {100 * shares['sequential']:.1f}%; same module "
                     f"again: {100 * shares['repeat']:.1f}%; to or from SKIP: {100 * shares['with_skip']:.1f}%; other "
                     f"jumps: {100 * shares['other']:.1f}%. Load imbalance (CV of module counts) per step: "
                     + ", ".join(fmt(v, 3) for v in load_cv) + ".", ""]
        heat = axes[0, col]
        heat.imshow(matrix.numpy(), vmin=0, vmax=1, cmap="viridis")
        heat.set_xticks(range(len(choices)), choices, rotation=90, fontsize=7)
        heat.set_yticks(range(len(choices)), choices, fontsize=7)
        for i in range(len(choices)):
            for j in range(len(choices)):
                heat.text(j, i, f"{float(matrix[i, j]):.2f}", ha="center", va="center", fontsize=6,
                          color="white" if matrix[i, j] < 0.6 else "black")
        heat.set_title(f"{group}: P(next | current)", fontsize=8)
        draw_route_graph(axes[1, col], entry, usage, choices)
    fig.tight_layout()
    ctx.save_figure(fig, "mom_transitions")
    ctx.write_report("MoM module transitions", sections, results)
    return results


def draw_route_graph(ax, entry: Dict[str, Any], usage: List[List[float]], choices: Sequence[str]) -> None:
    """Layered graph: a column per step, a node per module (size = usage), edges = transition shares."""
    steps = len(usage)
    for h, (_, _, counts) in enumerate(entry["pairs"]):
        total = float(counts.sum())
        for i in range(counts.shape[0]):
            for j in range(counts.shape[1]):
                share = float(counts[i, j]) / total if total > 0 else 0.0
                if share > 0.01:
                    ax.plot([h, h + 1], [i, j], color="tab:blue", alpha=min(1.0, 0.2 + share), linewidth=8 * share)
    for h in range(steps):
        ax.scatter([h] * len(choices), range(len(choices)), s=[600 * u for u in usage[h]], color="tab:orange", zorder=3)
    ax.set_yticks(range(len(choices)), choices, fontsize=7)
    ax.set_xticks(range(steps), [f"step {h + 1}" for h in range(steps)], fontsize=7)
    ax.set_ylim(len(choices) - 0.5, -0.5)
    ax.set_title("routes (node: usage, edge: transition share)", fontsize=8)


# ---------------------------------------------------------------------------- two-phase vs from scratch
@torch.no_grad()
def module_similarity(model, sequences: torch.Tensor) -> Dict[str, float]:
    """Mean pairwise cosine similarity of the pool modules' outputs on the same inputs (the first chunk's input).

    Attention modules are compared by their QKV projections, FFN modules by their outputs, per token,
    averaged over tokens and module pairs: 1 means the modules compute the same function (homogeneous).
    """
    out = {}
    for kind, outputs in mom_model(model).pool_outputs(sequences[:, :-1]).items():
        sims = [torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
                for i, a in enumerate(outputs) for b in outputs[i + 1:]]
        out[kind] = sum(sims) / len(sims) if sims else None
    return out


def routing_profile(model, sequences: torch.Tensor) -> Dict[str, Optional[float]]:
    stats = routing_stats(model, sequences)
    entropies = [s.entropy for s in stats.sites.values() if s.entropy is not None]
    cvs = [s.load_cv for s in stats.sites.values() if s.load_cv is not None]
    skips = [float(s.fractions[list(s.layout.choices).index(SKIP)]) for s in stats.sites.values() if SKIP in s.layout.choices]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"router_entropy": mean(entropies), "load_cv": mean(cvs), "skip_share": mean(skips)}


ARMS = ("two-phase", "from scratch", "vanilla", "phase 1")  # the runs of one seed; the first two are MoM
MEASURES = ("attn", "ffn", "router_entropy", "load_cv", "skip_share")


def plot_two_phase(ctx: Context, variant: str, s1: int, per_seed: Sequence[Dict[str, Any]]) -> None:
    """Each arm's training loss over the total step: the mean over seeds at the steps every seed logged (no
    interpolation, and no seed's curve stretched past its own end), with the band between the lowest and highest
    seed."""
    import numpy as np

    fig, axes = figure(1, 1, width=6.0)
    ax = axes[0, 0]
    styles = {"phase 1": ("phase 1 (vanilla)", "tab:gray", 0), "two-phase": (f"phase 2 ({variant} from vanilla)",
              "tab:blue", s1), "from scratch": (f"{variant} from scratch", "tab:red", 0), "vanilla": ("vanilla", "black", 0)}
    for arm, (label, colour, offset) in styles.items():
        curves = [dict(seed["runs"][arm]["train_loss_curve"]) for seed in per_seed]
        steps = np.array(sorted(set.intersection(*(set(curve) for curve in curves))), dtype=float)
        losses = np.array([[curve[step] for step in steps.astype(int)] for curve in curves], dtype=float)
        ax.plot(steps + offset, losses.mean(0), color=colour, linewidth=1.2, label=label)
        ax.fill_between(steps + offset, losses.min(0), losses.max(0), color=colour, alpha=0.2, linewidth=0)
    ax.set_xlabel("total training step")
    ax.set_ylabel("training loss (seed mean; band: lowest to highest seed)")
    ax.legend(fontsize=7)
    ax.set_title(f"two-phase vs from-scratch {variant}, {len(per_seed)} seed(s)")
    ctx.save_figure(fig, "mom_two_phase")


def two_phase_seed(ctx: Context, variant: str, s1: int, s2: int, options: Sequence[str], seed: int,
                   sequences: int) -> Dict[str, Any]:
    """One seed's four runs (phase 1, phase 2 from it, MoM from scratch and vanilla for s1 + s2 steps) and the
    module measures of the two MoM arms."""
    from experiments import two_phase as two_phase_cli

    argv = ["--variant", variant, "--size", ctx.size, "--phase1_steps", str(s1), "--phase2_steps", str(s2),
            "--log_dir", str(ctx.log_dir), *ctx.run_options, *options, "--seed", str(seed),
            "--phase1.val_every", str(s1), "--phase2.val_every", str(s2)]
    # a fixed folder name per command, so that a rerun resumes the phases a kill cut off (none under --no_reuse)
    started = ctx.started_file("experiments.two_phase", argv)
    version = ["--version", f"two_phase-{started.stem}"] if started is not None else []
    phase2_dir = ctx.cached("experiments.two_phase", argv, lambda: two_phase_cli.main([*argv, *version]))
    record = json.loads((phase2_dir / "two_phase.json").read_text())
    ctx.record_run(pathlib.Path(record["phase1"]))  # phase 1 in the run table too
    runs = {"two-phase": load_summary(phase2_dir),
            "from scratch": ctx.run(["--variant", variant, *options, "--seed", str(seed)], steps=s1 + s2),
            "vanilla": ctx.run(["--variant", "vanilla", *options, "--seed", str(seed)], steps=s1 + s2),
            "phase 1": load_summary(pathlib.Path(record["phase1"]))}
    measures = {}
    for arm in ARMS[:2]:
        model = load_model(pathlib.Path(runs[arm]["run_dir"]))
        data = validation_sequences(pathlib.Path(runs[arm]["run_dir"]), model, sequences)
        measures[arm] = {**module_similarity(model, data), **routing_profile(model, data)}
    return {"seed": seed, "runs": runs, "measures": measures}


def two_phase_analysis(per_seed: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Each arm's validation loss and each MoM arm's measures over seeds (mean, std, bootstrap interval over
    seeds); two-phase against from scratch (the paper's claim: lower loss; one-sided Welch over seeds, one test)
    and both MoM arms against vanilla at the same total steps (Holm over the two)."""
    from analysis.stats import against_baseline, seed_summary

    loss = {arm: [s["runs"][arm]["final_val_loss"] for s in per_seed] for arm in ARMS}
    return {"val_loss": {arm: seed_summary(values) for arm, values in loss.items()},
            "measures": {arm: {key: seed_summary([s["measures"][arm][key] for s in per_seed]) for key in MEASURES}
                         for arm in ARMS[:2]},
            "two_phase_vs_from_scratch": against_baseline({"two-phase": loss["two-phase"]}, loss["from scratch"])
            ["two-phase"],
            "vs_vanilla": against_baseline({arm: loss[arm] for arm in ARMS[:2]}, loss["vanilla"])}


def two_phase_verdict(analysis: Dict[str, Any], seeds: int) -> str:
    """The goal line: two-phase beats from scratch only when its one-sided test passes (no test with one seed)."""
    from analysis.stats import passes
    from analysis.tables import test_cell

    test = analysis["two_phase_vs_from_scratch"]
    counts = f"{test.get('n', 0)} and {test.get('n_baseline', 0)} of {seeds} seeds with a finite loss"
    if test.get("p_holm") is None or min(test.get("n", 0), test.get("n_baseline", 0)) < seeds:
        return (f"Two-phase vs from scratch: no claim ({counts}; difference {fmt(test.get('difference'), 4)} nats); "
                "a claim needs every seed of both arms, and --seeds 5 or more.")
    verdict = "**beats**" if passes(test) else "is **not shown to beat**"
    return (f"Two-phase {verdict} from-scratch training at equal total steps: validation loss difference "
            f"{test_cell(test)} (one-sided Welch over {seeds} seeds each, alpha 0.05).")


def two_phase_tables(variant: str, s1: int, s2: int, analysis: Dict[str, Any]) -> List[str]:
    """results.md's tables: per arm the loss and measures (seed mean [95% CI]), then the tests."""
    from analysis.tables import ci_cell, test_cell

    cell = lambda summary: ci_cell(summary["mean"], summary["ci"], 4)  # noqa: E731
    names = {"two-phase": f"two-phase (vanilla {s1} + {variant} {s2})", "from scratch": f"from scratch ({variant} "
             f"{s1 + s2})", "vanilla": f"vanilla {s1 + s2} (reference)", "phase 1": f"phase 1 alone (vanilla {s1})"}
    rows = [[names[arm], cell(analysis["val_loss"][arm]),
             *(cell(analysis["measures"][arm][key]) if arm in analysis["measures"] else "-" for key in MEASURES)]
            for arm in ARMS]
    headers = ["model", "val loss [95% CI]", "attn module sim.", "FFN module sim.", "router entropy", "load CV",
               "SKIP share"]
    tests = [[names["two-phase"], "from scratch", test_cell(analysis["two_phase_vs_from_scratch"])],
             *([names[arm], "vanilla (Holm over the two MoM arms)", test_cell(t)]
               for arm, t in analysis["vs_vanilla"].items())]
    return [markdown_table(headers, rows), "", markdown_table(["arm", "against", "Δ val loss [95% CI], g, p"], tests), ""]


def two_phase(ctx: Context, variant: str = "mom", phase1_steps: Optional[int] = None,
              phase2_steps: Optional[int] = None, options: Sequence[str] = (), sequences: int = 32,
              seeds: int = 5) -> Dict[str, Any]:
    from experiments import two_phase as two_phase_cli

    if seeds < 1:
        raise ConfigError(f"--seeds: must be a positive integer, got {seeds}")
    s1 = phase1_steps or max(1, ctx.steps // 2)
    s2 = phase2_steps or max(1, ctx.steps - s1)
    two_phase_cli.check_variant(variant)
    ctx.validate([["--variant", variant, *options], ["--variant", "vanilla", *options]])
    with ctx.part("training and measures"):
        per_seed = [two_phase_seed(ctx, variant, s1, s2, options, ctx.seed + i, sequences) for i in range(seeds)]
    analysis = two_phase_analysis(per_seed)
    sections = [
        f"Equal total steps: {s1} + {s2} (two-phase) vs {s1 + s2} (from scratch), {seeds} seed(s) from {ctx.seed} on, "
        "each arm with the same seed. Module similarity = mean pairwise cosine similarity of the pool modules' "
        "outputs on the same inputs (1 = homogeneous modules). Intervals: 95% percentile bootstrap over seeds; "
        "Δ: the arm's loss minus the other's (negative = lower loss), one-sided Welch over seeds.", "",
        *two_phase_tables(variant, s1, s2, analysis), two_phase_verdict(analysis, seeds), ""]
    plot_two_phase(ctx, variant, s1, per_seed)
    results = {"variant": variant, "phase1_steps": s1, "phase2_steps": s2, "seeds": seeds, **analysis,
               "runs": [{"seed": s["seed"], "arm": arm, "run_dir": s["runs"][arm]["run_dir"],
                         "steps": s["runs"][arm]["steps"], "final_val_loss": s["runs"][arm]["final_val_loss"]}
                        for s in per_seed for arm in ARMS],  # one row per run: publish copies their records
               "measures_per_seed": [{"seed": s["seed"], **s["measures"]} for s in per_seed]}
    ctx.write_report("MoM two-phase vs from-scratch training", sections, results)
    return results
