"""Routing probes: does the router send more compute to the tokens that need it?

Every variant trains on ``--data probe`` (datamodules/probe.py: arithmetic chains of depth 0..4,
multi-hop recall, spans in text; every token's difficulty known) at matched training FLOPs: the
isoFLOP sizing of ``mod_isoflop`` (``isoflop_configs``) gives each variant the number of steps that
spends the budget of ``--steps`` steps of vanilla, at the same width and depth. Each variant runs with
``--seeds`` seeds (training order and initialisation). The final model of every run is evaluated by
``callbacks/probe.py`` (causal routing where the variant has it) on the first ``--blocks`` validation
blocks: loss, accuracy and FLOPs per token per difficulty level, Spearman(difficulty, compute), and the
share of compute on the hardest levels (3-4) against their share of tokens.

Outputs: ``results.md`` (tables, goal figures), ``results.json``, ``probe_accuracy.png`` (accuracy vs
difficulty per variant) and ``probe_compute.png`` (compute vs difficulty per variant, relative to the
variant's mean over labelled tokens, and absolute).
"""
from __future__ import annotations

import math
import pathlib
import statistics
from typing import Any, Dict, List, Optional, Sequence

from architectures.config import ConfigError
from experiments.repro.common import Context, figure, fmt, markdown_table

VARIANTS = ("vanilla", "mod", "mode_staged", "mode_integrated", "moe", "mom", "mom_e", "depth_gate")
LEVELS = range(5)
CHANCE = 0.1  # a digit answer among ten
SOLVABLE = 0.3  # a level counts as solvable when some variant's seed-mean accuracy reaches this

# Model and data of every run (before the pass-through options, which override them). The MoM router's
# GRU width is cut to d: at the default 256 its FLOPs are 8x a d=64 model's, and matched FLOPs would
# leave MoM 1/8 of vanilla's steps.
DEFAULTS = ["--data", "probe", "--model.d_model", "64", "--model.n_layer", "4", "--model.n_head", "4",
            "--model.block_size", "128", "--data.batch_size", "8", "--model.mom.router_hidden", "64",
            "--optim.lr", "3e-3", "--optim.warmup_steps", "30", "--val_batches", "4",
            "--callbacks.contribution", "false", "--callbacks.throughput", "false",
            "--trainer.enable_progress_bar", "false"]
QUICK = ["--data.max_tokens", "16384", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2",
         "--data.batch_size", "4", "--val_batches", "1"]


def probe_experiment(ctx: Context, variants: Sequence[str] = VARIANTS, seeds: int = 3, blocks: int = 128,
                     min_steps: int = 20, quick: bool = False) -> Dict[str, Any]:
    from architectures import variant_names
    from experiments.repro.isoflop import isoflop_configs, model_cost, run_geometry

    unknown = [v for v in variants if v not in variant_names()]
    if unknown or not variants:
        raise ConfigError(f"--variants: unknown {unknown or 'empty list'}; valid variants: {', '.join(variant_names())}")
    if seeds < 1 or blocks < 1:
        raise ConfigError(f"--seeds and --blocks: must be positive integers, got {seeds} and {blocks}")
    variants = ["vanilla", *[v for v in variants if v != "vanilla"]]
    ctx.run_options = [*DEFAULTS, *(QUICK if quick else []), "--callbacks.probe_blocks", str(blocks), *ctx.run_options]
    _, base, tokens = run_geometry(ctx)
    _, reference = model_cost(base, "vanilla", base.d_model, base.n_layer, base.n_head)
    budget = ctx.steps * tokens * reference
    plan = isoflop_configs(budget, base, tokens, variants, [base.d_model], base.n_layer, base.n_head, min_steps=min_steps)
    grid = [(c, ctx.seed + i) for c in plan for i in range(seeds)]
    ctx.validate([[*c.run_options(), "--seed", str(s)] for c, s in grid])
    runs = []
    for c, seed in grid:
        s = ctx.run([*c.run_options(), "--seed", str(seed)], steps=c.steps)
        runs.append(run_row(c, seed, s))
    for r in runs:  # the routers themselves: variants whose default routing sees the future, evaluated with it
        r["probe_topk"] = evaluate_default_routing(pathlib.Path(r["run_dir"]), blocks)
    per_variant = {v: aggregate([r for r in runs if r["variant"] == v]) for v in variants}
    goals = goal_figures(per_variant)
    sections = report_sections(ctx, budget, tokens, per_variant, goals)
    plot_accuracy(ctx, per_variant)
    plot_compute(ctx, per_variant)
    ctx.log_table("probe", "\n".join(sections))
    results = {"budget": budget, "tokens_per_step": tokens, "variants": per_variant, "goals": goals, "runs": runs}
    ctx.write_report("Routing probes: compute vs difficulty at matched training FLOPs", sections, results)
    return results


def evaluate_default_routing(run_dir: pathlib.Path, blocks: int) -> Optional[Dict[str, Any]]:
    """The probe summary with the variant's training-time (non-causal) routing, for variants that have a
    separate causal routing (MoD, MoDE); None for the others (their routing is the same either way)."""
    import dataclasses

    from callbacks.probe import evaluate_probe
    from datamodules.lm import DataConfig, LMDataModule
    from experiments.analyze import run_config
    from experiments.repro.common import load_model

    model = load_model(run_dir)
    if not model.routing_sees_future:
        return None
    config = run_config(run_dir)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = LMDataModule(DataConfig(**{k: v for k, v in config["data"].items() if k in fields}),
                        block_size=int(config["model"]["block_size"]), seed=0)
    data.prepare_data()
    data.setup("validate")
    return evaluate_probe(model, data, blocks, causal=False)


def run_row(c, seed: int, summary: Dict[str, Any]) -> Dict[str, Any]:
    import json

    detail = json.loads((pathlib.Path(summary["run_dir"]) / "probe.json").read_text())
    return {"variant": c.variant, "seed": seed, "steps": c.steps, "train_flops_per_token": c.flops_per_token,
            "planned_deviation": c.deviation, "measured_deviation": summary["flops_per_token"]["training"]
            * summary["tokens_seen"] / c.budget - 1.0, "val_loss": summary["final_val_loss"],
            "step_time_s": summary["median_step_time_s"], "probe": detail, "run_dir": summary["run_dir"]}


def _mean_std(values: List[float]):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Seed means and standard deviations of the per-level numbers and the headline figures."""
    out: Dict[str, Any] = {"seeds": len(rows), "steps": rows[0]["steps"], "planned_deviation": rows[0]["planned_deviation"],
                           "levels": {}}
    for level in LEVELS:
        key = str(level)
        cells = [r["probe"]["levels"].get(key) for r in rows]
        if any(c is None for c in cells):
            continue
        out["levels"][key] = {m: _mean_std([c[m] for c in cells]) for m in ("acc", "loss", "flops", "compute_share",
                                                                           "token_share")}
        mean_flops = [sum(r["probe"]["levels"][k]["flops"] * r["probe"]["levels"][k]["token_share"]
                          for k in r["probe"]["levels"]) for r in rows]
        out["levels"][key]["relative_flops"] = _mean_std([c["flops"] / m for c, m in zip(cells, mean_flops)])
    for key in ("spearman", "hard_compute_share", "hard_token_share", "hard_compute_ratio"):
        out[key] = _mean_std([r["probe"][key] for r in rows])
    out["spearman_seeds"] = [r["probe"]["spearman"] for r in rows]
    out["spearman_p_seeds"] = [r["probe"]["spearman_p"] for r in rows]
    out["spearman_t_p"] = one_sided_t(out["spearman_seeds"])
    topk = [r.get("probe_topk") for r in rows]
    out["spearman_topk_seeds"] = [t["spearman"] for t in topk] if all(topk) else None
    out["val_loss"] = _mean_std([r["val_loss"] for r in rows])
    out["measured_deviation"] = _mean_std([r["measured_deviation"] for r in rows])
    return out


def one_sided_t(values: List[Optional[float]]) -> Optional[float]:
    """p-value of a one-sample t-test that the seed mean is > 0 (None with fewer than 2 finite values)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return None
    from scipy.stats import ttest_1samp

    if statistics.stdev(values) == 0:
        return 0.0 if values[0] > 0 else 1.0
    return float(ttest_1samp(values, 0.0, alternative="greater").pvalue)


def goal_figures(per_variant: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The issue's two goals, computed from the seed means."""
    goals: Dict[str, Any] = {}
    for v in ("mod", "mom"):
        if v in per_variant:
            a = per_variant[v]
            rhos, ps = a["spearman_seeds"], a["spearman_p_seeds"]
            every_seed = bool(rhos) and all(r is not None and r > 0 for r in rhos) and all(
                p is not None and p < 0.01 for p in ps)
            goals[f"{v}_spearman_positive_significant"] = every_seed and (a["spearman_t_p"] or 1.0) < 0.05
    solvable = [int(k) for k in per_variant["vanilla"]["levels"]
                if max((a["levels"].get(k, {}).get("acc", (0, 0))[0] or 0) for a in per_variant.values()) >= SOLVABLE]
    if solvable:
        level = str(max(solvable))
        routed = {v: a["levels"][level]["acc"][0] for v, a in per_variant.items() if v != "vanilla" and level in a["levels"]}
        best = max(routed, key=routed.get) if routed else None
        goals.update(hardest_solvable_level=int(level), vanilla_acc=per_variant["vanilla"]["levels"][level]["acc"][0],
                     best_routed=best, best_routed_acc=routed.get(best))
        goals["best_routed_at_least_vanilla"] = best is not None and routed[best] >= goals["vanilla_acc"]
    return goals


def _rhos(values) -> str:
    return ", ".join("-" if r is None else f"{r:+.3f}" for r in values)


def _pm(cell, digits: int = 3) -> str:
    mean, std = cell
    return "-" if mean is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def report_sections(ctx: Context, budget: float, tokens: int, per_variant, goals) -> List[str]:
    levels = [str(level) for level in LEVELS]
    budget_rows = [[v, a["steps"], f"{100 * a['planned_deviation']:+.2f}%",
                    f"{100 * (a['measured_deviation'][0] or 0):+.2f}%", _pm(a["val_loss"])] for v, a in per_variant.items()]
    acc = markdown_table(["variant", *[f"acc L{k}" for k in levels]],
                         [[v, *[_pm(a["levels"].get(k, {}).get("acc", (None, None)), 2) for k in levels]]
                          for v, a in per_variant.items()])
    compute = markdown_table(
        ["variant", *[f"FLOPs L{k} (rel.)" for k in levels], "Spearman (seeds)", "t-test p", "hard compute / token share",
         "Spearman, non-causal routing"],
        [[v, *[_pm(a["levels"].get(k, {}).get("relative_flops", (None, None)), 3) for k in levels],
          _rhos(a["spearman_seeds"]), fmt(a["spearman_t_p"], 3),
          f"{_pm(a['hard_compute_share'])} / {_pm(a['hard_token_share'])}",
          _rhos(a["spearman_topk_seeds"]) if a.get("spearman_topk_seeds") else "same"] for v, a in per_variant.items()])
    shares = per_variant["vanilla"]["levels"]
    intro = (f"Budget {budget:.3e} training FLOPs per run ({ctx.steps} vanilla steps of {tokens} tokens); every "
             f"variant trains the steps that spend it (isoFLOP sizing). Seeds per variant: "
             f"{per_variant['vanilla']['seeds']}. Evaluation with causal routing where the variant has one. Token "
             "shares of the levels: " + ", ".join(f"L{k} {100 * shares[k]['token_share'][0]:.1f}%" for k in shares) + ".")
    goal_lines = ["Goal figures (computed from the numbers above):", ""]
    for v in ("mod", "mom"):
        key = f"{v}_spearman_positive_significant"
        if key in goals:
            goal_lines.append(f"- {v}: Spearman(difficulty, compute) positive with p < 0.01 in every seed and t-test "
                              f"p < 0.05 across seeds: **{'yes' if goals[key] else 'no'}**")
    if "hardest_solvable_level" in goals:
        goal_lines.append(
            f"- hardest solvable level (some variant >= {SOLVABLE:.0%} mean accuracy): L{goals['hardest_solvable_level']}; "
            f"vanilla {fmt(goals['vanilla_acc'], 3)}, best routed {goals['best_routed']} {fmt(goals['best_routed_acc'], 3)}: "
            f"**{'at least vanilla' if goals['best_routed_at_least_vanilla'] else 'below vanilla'}**")
    return [intro, "",
            "Accuracy per difficulty level (mean ± std over seeds; chance for digit answers 0.1):", acc, "",
            "Compute per difficulty level: forward FLOPs per token of the level / the variant's mean over labelled "
            "tokens (1.0 everywhere = no preference), Spearman rho per seed, share of compute vs share of tokens on "
            "levels 3-4; last column: the same correlation when the variant routes as in training (top-k over the whole "
            "sequence, which sees the future), for the variants that have a separate causal routing:", compute, "",
            "Budget and loss:", markdown_table(["variant", "steps", "planned dev.", "measured dev.", "val loss"], budget_rows),
            "", *goal_lines, ""]


def _series(per_variant, metric: str):
    for i, (v, a) in enumerate(per_variant.items()):
        keys = sorted(a["levels"], key=int)
        means = [a["levels"][k][metric][0] for k in keys]
        stds = [a["levels"][k][metric][1] for k in keys]
        yield v, [int(k) for k in keys], means, stds, {"marker": "osD^vP*X"[i % 8], "linestyle": "-" if i < 8 else "--"}


def plot_accuracy(ctx: Context, per_variant) -> None:
    fig, axes = figure(1, 1, width=6.4, height=4.4)
    ax = axes[0, 0]
    for v, x, mean, std, style in _series(per_variant, "acc"):
        ax.errorbar(x, mean, yerr=std, capsize=3, label=v, **style)
    ax.axhline(CHANCE, color="grey", linewidth=0.8, linestyle=":", label="chance (digit answers)")
    ax.set_xlabel("difficulty level (sequential operations)")
    ax.set_ylabel("next-token accuracy (mean ± std over seeds)")
    ax.set_xticks(list(LEVELS))
    ax.set_ylim(0, 1.02)
    ax.set_title("Probe accuracy vs difficulty, matched training FLOPs")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    ctx.save_figure(fig, "probe_accuracy")


def plot_compute(ctx: Context, per_variant) -> None:
    fig, axes = figure(1, 2, width=5.6, height=4.4)
    for v, x, mean, std, style in _series(per_variant, "relative_flops"):
        axes[0, 0].errorbar(x, mean, yerr=std, capsize=3, label=v, **style)
    for v, x, mean, std, style in _series(per_variant, "flops"):
        axes[0, 1].errorbar(x, [m / 1e6 for m in mean], yerr=[s / 1e6 for s in std], capsize=3, label=v, **style)
    axes[0, 0].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes[0, 0].set_ylabel("FLOPs per token / variant's mean (1 = no preference)")
    axes[0, 0].set_title("Relative compute vs difficulty")
    axes[0, 1].set_ylabel("forward MFLOPs per token")
    axes[0, 1].set_title("Absolute compute vs difficulty")
    for ax in axes[0]:
        ax.set_xlabel("difficulty level (sequential operations)")
        ax.set_xticks(list(LEVELS))
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    ctx.save_figure(fig, "probe_compute")
