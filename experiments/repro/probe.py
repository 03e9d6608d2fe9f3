"""Routing probes: does the router send more compute to the tokens that need it?

Every variant trains on ``--data probe`` (datamodules/probe.py: arithmetic chains of depth 0..4,
multi-hop recall, spans in text; every token's difficulty known) at matched training FLOPs: the budget
is what ``--steps`` steps of vanilla spend, and every variant, at the same width and depth, trains until
its *measured* training FLOPs reach it (``--max_train_flops``, docs/compute-budget.md), whatever its
router spends; the isoFLOP plan of ``mod_isoflop`` (``isoflop_configs``) only sizes the ``--max_steps``
cap (``BUDGET_STEP_CAP`` x the planned steps) and is reported beside the steps taken. Each variant runs with
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
from architectures.registry import tagged
from experiments.repro.common import Context, budget_spent, budget_step_cap, figure, fmt, markdown_table

VARIANTS = tuple(tagged("probe"))  # the registry entries tagged "probe" (vanilla first)
LEVELS = range(5)
CHANCE = 0.1  # a digit answer among ten
SOLVED = 0.6  # vanilla "solves" a level when its seed-mean accuracy reaches this
LEARNABLE = {1: 0.9, 2: 0.6}  # the learnable setting: vanilla's seed-mean accuracy on these levels at least this

# Model and data of every run (before the pass-through options, which override them). The MoM router's
# GRU width is cut to d: at the default 256 its FLOPs are 8x a d=64 model's, and matched FLOPs would
# leave MoM 1/8 of vanilla's steps.
# The data: the v2 arithmetic probe, which vanilla learns at this size (datamodules/probe.py; the v1 mix
# ``--data probe`` stays at chance beyond level 0 and can be chosen after ``--``).
DEFAULTS = ["--data", "probe-v2/arith", "--model.d_model", "64", "--model.n_layer", "4", "--model.n_head", "4",
            "--model.block_size", "128", "--data.batch_size", "8", "--model.mom.router_hidden", "64",
            "--optim.lr", "3e-3", "--optim.warmup_steps", "100", "--val_blocks", "32",
            "--callbacks.contribution", "false", "--callbacks.throughput", "false",
            "--trainer.enable_progress_bar", "false"]
QUICK = ["--data.max_tokens", "16384", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2",
         "--data.batch_size", "4", "--val_blocks", "4"]


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
    ctx.validate([[*c.run_options(), "--seed", str(s)] for c, s in grid], budget=budget)
    summaries = ctx.run_many([([*c.run_options(), "--seed", str(seed)], budget_step_cap(budget, tokens, c.flops_per_token),
                               budget) for c, seed in grid])
    runs = [run_row(c, seed, s) for (c, seed), s in zip(grid, summaries)]
    for r in runs:  # the routers themselves: variants whose default routing sees the future, evaluated with it
        r["probe_topk"] = evaluate_default_routing(pathlib.Path(r["run_dir"]), blocks)
        if "spearman_answers" not in r["probe"]:  # a run whose probe.json predates the answers-only correlation
            r["probe"] = evaluate_run(pathlib.Path(r["run_dir"]), blocks)
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
    return evaluate_run(run_dir, blocks, causal=False, only_if_sees_future=True)


def evaluate_run(run_dir: pathlib.Path, blocks: int, causal: bool = True,
                 only_if_sees_future: bool = False) -> Optional[Dict[str, Any]]:
    """The probe summary of a finished run's final model (``last.ckpt``) on its first ``blocks`` validation
    blocks: what ``callbacks/probe.py`` wrote at the end of training, recomputed (runs whose probe.json
    predates a metric get it this way instead of being retrained)."""
    import dataclasses

    from callbacks.probe import evaluate_probe
    from datamodules.lm import DataConfig, LMDataModule
    from experiments.analyze import run_config
    from experiments.repro.common import load_model

    model = load_model(run_dir)
    if only_if_sees_future and not model.routing_sees_future:
        return None
    config = run_config(run_dir)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = LMDataModule(DataConfig(**{k: v for k, v in config["data"].items() if k in fields}),
                        block_size=int(config["model"]["block_size"]), seed=0)
    data.prepare_data()
    data.setup("validate")
    return evaluate_probe(model, data, blocks, causal=causal)


def run_row(c, seed: int, summary: Dict[str, Any]) -> Dict[str, Any]:
    import json

    detail = json.loads((pathlib.Path(summary["run_dir"]) / "probe.json").read_text())
    spent = budget_spent(summary)
    return {"variant": c.variant, "seed": seed, "steps": summary["steps"], "planned_steps": c.steps,
            "train_flops_per_token": c.flops_per_token, "planned_deviation": c.deviation,
            "train_flops": spent["train_flops"], "measured_deviation": spent["spent_deviation"],
            "matched": spent["matched"], "val_loss": summary["val_metrics"].get("val/loss", summary["final_val_loss"]),
            "val_loss_causal": summary["val_metrics"].get("val/loss_causal"),
            "step_time_s": summary["median_step_time_s"], "probe": detail, "run_dir": summary["run_dir"]}


def _mean_std(values: List[float]):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Seed means and standard deviations of the per-level numbers and the headline figures."""
    out: Dict[str, Any] = {"seeds": len(rows), "steps": statistics.fmean(r["steps"] for r in rows),
                           "steps_seeds": [r["steps"] for r in rows], "planned_steps": rows[0]["planned_steps"],
                           "planned_deviation": rows[0]["planned_deviation"], "matched": all(r["matched"] for r in rows),
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
    out["spearman_answers_seeds"] = [r["probe"].get("spearman_answers") for r in rows]
    out["spearman_answers_p_seeds"] = [r["probe"].get("spearman_answers_p") for r in rows]
    out["spearman_answers_t_p"] = one_sided_t(out["spearman_answers_seeds"])
    topk = [r.get("probe_topk") for r in rows]
    out["spearman_topk_seeds"] = [t["spearman"] for t in topk] if all(topk) else None
    out["val_loss"] = _mean_std([r["val_loss"] for r in rows])
    out["val_loss_causal"] = _mean_std([r.get("val_loss_causal") for r in rows])
    out["measured_deviation"] = _mean_std([r["measured_deviation"] for r in rows])
    out["train_flops"] = _mean_std([r["train_flops"] for r in rows])
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


def family(variant: str) -> str:
    """The routing family of a variant: its architecture module (mod, moe, mot, depth_gate, mom)."""
    from architectures.registry import get_variant

    return get_variant(variant).target.split(":")[0].rsplit(".", 1)[-1]


def positive_significant(a: Dict[str, Any], which: str = "spearman") -> bool:
    """Spearman(difficulty, compute) > 0 with p < 0.01 in every seed, and a one-sided t-test over seeds p < 0.05
    (``which``: ``spearman`` over every labelled token, ``spearman_answers`` over the levels >= 1)."""
    rhos, ps, t_p = a.get(f"{which}_seeds") or [], a.get(f"{which}_p_seeds") or [], a.get(f"{which}_t_p")
    every_seed = bool(rhos) and all(r is not None and r > 0 for r in rhos) and all(p is not None and p < 0.01 for p in ps)
    return every_seed and (t_p if t_p is not None else 1.0) < 0.05


def goal_figures(per_variant: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The issue's goals, computed from the seed means: the setting is learnable (vanilla's accuracy on levels
    1 and 2), at least two routed families grade compute by difficulty, and a routed variant matches vanilla on
    the hardest level vanilla solves."""
    vanilla = per_variant["vanilla"]["levels"]
    goals: Dict[str, Any] = {"learnable": {str(k): (vanilla.get(str(k), {}).get("acc", (None, None))[0], floor)
                                           for k, floor in LEARNABLE.items()}}
    goals["learnable_met"] = all(acc is not None and acc >= floor for acc, floor in goals["learnable"].values())
    routed = [v for v in per_variant if v != "vanilla"]
    goals["spearman_positive_significant"] = {v: positive_significant(per_variant[v]) for v in routed}
    for v in ("mod", "mom"):  # the names earlier result files used
        if v in per_variant:
            goals[f"{v}_spearman_positive_significant"] = goals["spearman_positive_significant"][v]
    goals["families_positive"] = sorted({family(v) for v, ok in goals["spearman_positive_significant"].items() if ok})
    goals["two_families_positive"] = len(goals["families_positive"]) >= 2
    # the stricter reading: compute grows with depth among the answers alone (level 0 also holds format tokens)
    goals["answers_positive_significant"] = {v: positive_significant(per_variant[v], "spearman_answers") for v in routed}
    goals["families_grading_answers"] = sorted({family(v) for v, ok in goals["answers_positive_significant"].items() if ok})
    solved = [int(k) for k, row in vanilla.items() if (row["acc"][0] or 0) >= SOLVED]
    if solved:
        level = str(max(solved))
        accs = {v: per_variant[v]["levels"][level]["acc"][0] for v in routed if level in per_variant[v]["levels"]}
        best = max(accs, key=accs.get) if accs else None
        goals.update(hardest_solvable_level=int(level), vanilla_acc=vanilla[level]["acc"][0], best_routed=best,
                     best_routed_acc=accs.get(best), routed_at_least_vanilla=sorted(
                         v for v, acc in accs.items() if acc >= vanilla[level]["acc"][0]))
        goals["best_routed_at_least_vanilla"] = best is not None and accs[best] >= goals["vanilla_acc"]
    return goals


def _rhos(values) -> str:
    return ", ".join("-" if r is None else f"{r:+.3f}" for r in values)


def _pm(cell, digits: int = 3) -> str:
    mean, std = cell
    return "-" if mean is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def report_sections(ctx: Context, budget: float, tokens: int, per_variant, goals) -> List[str]:
    levels = [str(level) for level in LEVELS]
    budget_rows = [[v, f"{'/'.join(str(n) for n in a['steps_seeds'])} ({a['planned_steps']})", _pm(a["train_flops"]),
                    f"{100 * (a['measured_deviation'][0] or 0):+.2f}%" if a["matched"] else
                    "not matched: --max_steps stopped a seed first", _pm(a["val_loss"]),
                    _pm(a["val_loss_causal"]) if a["val_loss_causal"][0] is not None else "same"]
                   for v, a in per_variant.items()]
    acc = markdown_table(["variant", *[f"acc L{k}" for k in levels]],
                         [[v, *[_pm(a["levels"].get(k, {}).get("acc", (None, None)), 2) for k in levels]]
                          for v, a in per_variant.items()])
    compute = markdown_table(
        ["variant", *[f"FLOPs L{k} (rel.)" for k in levels], "Spearman (seeds)", "t-test p",
         "Spearman, answers only (seeds)", "t-test p, answers", "hard compute / token share",
         "Spearman, non-causal routing"],
        [[v, *[_pm(a["levels"].get(k, {}).get("relative_flops", (None, None)), 3) for k in levels],
          _rhos(a["spearman_seeds"]), fmt(a["spearman_t_p"], 3),
          _rhos(a["spearman_answers_seeds"]), fmt(a["spearman_answers_t_p"], 3),
          f"{_pm(a['hard_compute_share'])} / {_pm(a['hard_token_share'])}",
          _rhos(a["spearman_topk_seeds"]) if a.get("spearman_topk_seeds") else "same"] for v, a in per_variant.items()])
    shares = per_variant["vanilla"]["levels"]
    intro = (f"Budget {budget:.3e} training FLOPs per run ({ctx.steps} vanilla steps of {tokens} tokens); every "
             f"variant trains until its measured training FLOPs (routing-aware, every step counted) reach it. Seeds "
             f"per variant: "
             f"{per_variant['vanilla']['seeds']}. Evaluation with causal routing where the variant has one. Token "
             "shares of the levels: " + ", ".join(f"L{k} {100 * shares[k]['token_share'][0]:.1f}%" for k in shares) + ".")
    goal_lines = ["Goal figures (computed from the numbers above):", ""]
    learnable = ", ".join(f"L{k} {fmt(acc, 3)} (>= {floor})" for k, (acc, floor) in goals["learnable"].items())
    goal_lines.append(f"- learnable setting, vanilla's seed-mean accuracy: {learnable}: "
                      f"**{'met' if goals['learnable_met'] else 'not met'}**")
    positive = [v for v, ok in goals["spearman_positive_significant"].items() if ok]
    goal_lines.append(
        "- Spearman(difficulty, compute) positive with p < 0.01 in every seed and one-sided t-test p < 0.05 across "
        f"seeds: {', '.join(positive) or 'no variant'}; families: {', '.join(goals['families_positive']) or 'none'}: "
        f"**{'met' if goals['two_families_positive'] else 'not met'}** (goal: at least two routed families)")
    grading = [v for v, ok in goals["answers_positive_significant"].items() if ok]
    goal_lines.append(
        "- the same test over the answers only (levels >= 1; level 0 also holds format tokens such as `;`, so the "
        f"test above can pass by telling answers from format tokens): {', '.join(grading) or 'no variant'}; families: "
        f"{', '.join(goals['families_grading_answers']) or 'none'}")
    if "hardest_solvable_level" in goals:
        goal_lines.append(
            f"- hardest level vanilla solves (seed-mean accuracy >= {SOLVED}): L{goals['hardest_solvable_level']}; "
            f"vanilla {fmt(goals['vanilla_acc'], 3)}, best routed {goals['best_routed']} {fmt(goals['best_routed_acc'], 3)}; "
            f"routed variants at >= vanilla: {', '.join(goals['routed_at_least_vanilla']) or 'none'}: "
            f"**{'met' if goals['best_routed_at_least_vanilla'] else 'not met'}**")
    else:
        goal_lines.append(f"- vanilla solves no level (seed-mean accuracy >= {SOLVED}): **not met**")
    return [intro, "",
            "Accuracy per difficulty level (mean ± std over seeds; chance for digit answers 0.1):", acc, "",
            "Compute per difficulty level: forward FLOPs per token of the level / the variant's mean over labelled "
            "tokens (1.0 everywhere = no preference), Spearman rho per seed, share of compute vs share of tokens on "
            "levels 3-4; 'answers only': the correlation over the tokens of levels 1-4 (does compute grow with depth among "
            "the answers?); last column: the same correlation when the variant routes as in training (top-k over the whole "
            "sequence, which sees the future), for the variants that have a separate causal routing:", compute, "",
            "Budget and loss (steps per seed, and the analytic plan's; measured training FLOPs spent and their "
            "excess over the budget, at most one step):",
            markdown_table(["variant", "steps (planned)", "FLOPs spent", "spent vs budget", "val loss",
                            "val loss, causal routing"], budget_rows),
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
