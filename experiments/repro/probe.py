"""Routing probes: does the router send more compute to the tokens that need it?

Every entry trains on ``--data probe-v2/arith`` (datamodules/probe.py: every token's difficulty known) at
matched training FLOPs: the budget is what ``--steps`` steps of the reference vanilla model spend, and every
entry trains until its *measured* training FLOPs reach it (``--max_train_flops``, docs/compute-budget.md),
whatever its router spends; the analytic plan only sizes the ``--max_steps`` cap (``BUDGET_STEP_CAP`` x the
planned steps) and is reported beside the steps taken.

Entries (``--variants``): a registered variant (``mod``), or a variant with model options of its own
(``mod:n_layer=8:capacity=0.125``: ``key=value`` pairs after ``:``, a key being a ``ModelConfig`` field, a
``group.field``, or a field only one of the variant's option groups has). Dense controls
(``--dense_shapes 2x64,4x48,8x64``: n_layer x d_model, default half the depth, 3/4 the width and twice the
depth of the reference) are vanilla models of other shapes at the same budget: "beats vanilla" means beats
the best dense model (lowest mean validation loss) at the same measured training FLOPs; the reference
vanilla (the base shape) is one of the dense models and stays as a second column. Each entry runs with
``--seeds`` seeds (training order and initialisation; default 5).

The final model of every run is evaluated by ``callbacks/probe.py`` (causal routing where the variant has
it) on the first ``--blocks`` validation blocks: loss, accuracy and FLOPs per token per difficulty level,
per-block counts, Spearman(difficulty, compute) over all labelled tokens and over the answers only.

Statistics (``analysis/stats.py``, 95%, seeded percentile bootstrap): a level's accuracy interval is
hierarchical (seeds resampled, then validation blocks within each seed: never the tokens of one block on
their own); the loss, Spearman and wall-clock intervals resample seeds. Every routed entry is tested against
the best dense model over seeds with Welch's one-sided t-test (lower loss; higher accuracy per level), with
Holm's correction over the routed entries (per figure and level); effect sizes: Hedges' g and the difference
in means with its bootstrap interval. Spearman: a one-sided one-sample t-test over seeds (rho > 0), Holm over
the routed entries. A goal line says "met" only when the corrected test passes. Beside each mean accuracy:
the share of seeds that solve the level (accuracy >= 0.9), for tasks learnt in a sharp transition.
Wall clock: median step time x steps per run, beside the FLOPs.

``--verify ROW`` retrains one row of a published table (``--published``, default
``docs/results/probe/results.json``: the programme's own results.json) from nothing, with its seeds, into
a fresh ``--out``, and reports each figure next to the published one with both intervals.

Outputs: ``results.md`` (tables, goal figures), ``results.json`` (``settings``: what --verify checks),
``probe_accuracy.png`` and ``probe_compute.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from architectures.config import ConfigError
from architectures.registry import tagged
from analysis import stats
from analysis.tables import ci_cell as _ci, test_cell as _test_cell
from callbacks import CallbacksConfig
from datamodules.probe import level_meaning
from analysis.dense_grid import dense_grid_line
from analysis.provenance import origin_lines, run_origin
from analysis.stored_results import stored_jobs
from analysis.wall_time import run_wall, wall_time_lines
from experiments.repro.common import (Context, Entry, budget_spent, budget_step_cap, dense_entries, dense_grid,
                                     entry_cost, figure, fmt, markdown_table, narrower_width, option_path,
                                     parse_entry, parse_shape, parse_shapes, record_stored_runs,
                                     run_model_config)  # noqa: F401  (option_path, parse_shape: probe's API)

VARIANTS = tuple(tagged("probe"))  # the registry entries tagged "probe" (vanilla first)
CHANCE = {"probe": 0.1, "probe-v2/arith": 0.1}  # the answers' chance where it is one number: a digit among ten
SOLVED = 0.6  # the best dense model "solves" a level when its seed-mean accuracy reaches this
LEARNABLE = {1: 0.9, 2: 0.6}  # the learnable setting: vanilla's seed-mean accuracy on these levels at least this
ALPHA = 0.05  # the corrected tests' level
PUBLISHED = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "probe" / "results.json"

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


# ---------------------------------------------------------------------------- entries
def default_dense_shapes(n_layer: int, d_model: int, n_head: int) -> List[Tuple[int, int]]:
    """Half the depth, 3/4 of the width, both, and twice the depth of the reference: FLOPs per token below and
    above the routed entries' (at the programme's size, planned from each entry's own parse, they span ~0.47x
    (depth_gate_skip: below the half-depth and the narrower shapes, hence both together) to ~1.7x (mom))."""
    fewer, narrower = max(1, n_layer // 2), narrower_width(d_model, n_head)
    return [(fewer, d_model), (n_layer, narrower), (fewer, narrower), (2 * n_layer, d_model)]


def programme_entries(variants: Sequence[str], dense_shapes: Optional[str], base) -> List[Entry]:
    """The reference vanilla first, then the dense controls, then the other entries (duplicates dropped)."""
    if not variants:
        raise ConfigError("--variants: the list is empty")
    shapes = (parse_shapes(dense_shapes, base.n_head) if dense_shapes
              else default_dense_shapes(base.n_layer, base.d_model, base.n_head))
    dense = dense_entries(shapes, (base.n_layer, base.d_model))
    entries: Dict[str, Entry] = {}
    for text in ["vanilla", *dense, *variants]:
        entries.setdefault(text, parse_entry(text))
    return list(entries.values())


# ---------------------------------------------------------------------------- the budget and the plan
@dataclasses.dataclass(frozen=True)
class Planned:
    entry: Entry
    flops_per_token: float  # analytic training FLOPs per token (full context)
    steps: int  # the plan's steps at the budget
    budget: float
    tokens_per_step: int

    @property
    def deviation(self) -> float:
        return self.steps * self.tokens_per_step * self.flops_per_token / self.budget - 1.0


def plan_entries(ctx: Context, entries: Sequence[Entry], budget: float, tokens: int, vocab_size: int,
                 min_steps: int) -> List[Planned]:
    plan = []
    for entry in entries:
        per_token = entry_cost(ctx, entry, vocab_size)
        steps = round(budget / (tokens * per_token))
        if steps < min_steps:
            raise ConfigError(f"--variants: {entry.label} would train {steps} steps at the budget (fewer than "
                              f"{min_steps}); raise --steps or leave it out")
        plan.append(Planned(entry, per_token, steps, budget, tokens))
    return plan


def programme_settings(ctx: Context, seeds: int, blocks: int, quick: bool) -> Dict[str, Any]:
    """What decides a row's numbers besides its entry (a verification must match them)."""
    from experiments.repro.common import result_options

    return {"experiment": "probe", "size": ctx.size, "steps": ctx.steps, "seed": ctx.seed, "seeds": seeds,
            "blocks": blocks, "quick": quick, "run_options": result_options(ctx.run_options)}


def prepare(ctx: Context, variants: Sequence[str], seeds: int, blocks: int, quick: bool,
            dense_shapes: Optional[str]) -> Tuple[Dict[str, Any], List[Entry], float, int, int]:
    """(settings, entries, budget, tokens per step, vocabulary size); sets the runs' common options."""
    from experiments.repro.isoflop import model_cost, run_geometry

    if seeds < 1 or blocks < 1:
        raise ConfigError(f"--seeds and --blocks: must be positive integers, got {seeds} and {blocks}")
    settings = programme_settings(ctx, seeds, blocks, quick)
    ctx.run_options = [*DEFAULTS, *(QUICK if quick else []), "--callbacks.probe_blocks", str(blocks), *ctx.run_options]
    _, base, tokens = run_geometry(ctx)
    entries = programme_entries(variants, dense_shapes, base)
    _, reference = model_cost(base, "vanilla", base.d_model, base.n_layer, base.n_head)
    return settings, entries, ctx.steps * tokens * reference, tokens, base.vocab_size


# ---------------------------------------------------------------------------- the programme
def probe_experiment(ctx: Context, variants: Sequence[str] = VARIANTS, seeds: int = 5, blocks: int = 128,
                     min_steps: int = 20, quick: bool = False, dense_shapes: Optional[str] = None,
                     verify: Optional[str] = None, published: Optional[pathlib.Path] = None,
                     tables_from_paths: Sequence[pathlib.Path] = ()) -> Dict[str, Any]:
    if tables_from_paths:
        return tables_from(ctx, tables_from_paths)
    if verify is not None:
        return verify_row(ctx, verify, pathlib.Path(published or PUBLISHED), seeds, blocks, min_steps, quick)
    with ctx.part("planning"):
        settings, entries, budget, tokens, vocab = prepare(ctx, variants, seeds, blocks, quick, dense_shapes)
        plan = plan_entries(ctx, entries, budget, tokens, vocab, min_steps)
    with ctx.part("training and evaluating the runs"):
        runs = train_runs(ctx, plan, seeds, blocks)
    return write_tables(ctx, settings, budget, tokens, [e.label for e in entries], runs)


def write_tables(ctx: Context, settings: Dict[str, Any], budget: float, tokens: int, labels: Sequence[str],
                 runs: List[Dict[str, Any]], preface: Sequence[str] = (), extra: Optional[Dict[str, Any]] = None
                 ) -> Dict[str, Any]:
    """The programme's tables, tests, goal lines and figures from its run rows (one per entry and seed)."""
    with ctx.part("tables"):
        per_variant = {label: aggregate([r for r in runs if r["variant"] == label]) for label in labels}
        tests = dense_tests(per_variant)
        goals = goal_figures(per_variant, tests)
        verdict = dense_grid_verdict(ctx, settings, per_variant, tests["best_dense"])
        sections = [*preface, dense_grid_line(tests["best_dense"], verdict), "",
                    *report_sections(ctx, budget, tokens, per_variant, tests, goals)]
        sections += wall_time_lines(runs, lambda r: r["variant"], ctx.workers) + origin_lines(runs)
        plot_accuracy(ctx, per_variant)
        plot_compute(ctx, per_variant)
    ctx.log_table("probe", "\n".join(sections))
    results = {"settings": settings, "budget": budget, "tokens_per_step": tokens, "variants": per_variant,
               "best_dense": tests["best_dense"], "dense_grid": verdict, "tests": tests, "goals": goals, "runs": runs,
               **(extra or {})}
    ctx.write_report("Routing probes: compute vs difficulty at matched training FLOPs", sections, results)
    return results


def reference_shape(ctx: Context, settings: Dict[str, Any]) -> Tuple[int, int]:
    """(n_layer, d_model) of the reference vanilla as its runs parsed them: the programme's defaults, then the
    stored pass-through options (``settings``, so a table rebuilt from stored rows gets the same shape)."""
    options = [*DEFAULTS, *(QUICK if settings.get("quick") else []), *settings.get("run_options", [])]
    run = dataclasses.replace(ctx, size=settings.get("size", ctx.size), run_options=options)
    config = run_model_config(run, ["--variant", "vanilla"], vocab_size=None)
    return config.n_layer, config.d_model


def dense_grid_verdict(ctx: Context, settings: Dict[str, Any], per_variant: Dict[str, Dict[str, Any]],
                       best: str) -> str:
    """Whether the dense shapes bracket the best one (``grid_bracket``): "beats the best dense model" is a claim
    against the isoFLOP optimum only when they do."""
    try:
        reference = reference_shape(ctx, settings)
    except (ConfigError, ValueError, argparse.ArgumentError) as err:
        # stored options this code no longer parses: the tables stand, the verdict is unknown
        return f"unknown (the stored run options do not parse here: {err})"
    return dense_grid({v: a["headline_val_loss"][0] for v, a in per_variant.items() if a.get("dense")}, reference, best)


# ---------------------------------------------------------------------------- --tables_from
#: what must be equal for two stored rows of one (entry, seed) to be the same run
SAME_RUN = ("steps", "train_flops", "val_loss", "val_loss_causal", "headline_val_loss", "probe")


def merged_rows(paths: Sequence[pathlib.Path]
                ) -> Tuple[List[Dict[str, Any]], List[str], List[Dict[str, Any]], List[str]]:
    """(each file's results, read once, entry labels: dense first, then routed, each in order of appearance; one row per
    entry and seed; a line per file naming its commit) of one or more probe results.json files at identical
    settings and budget (``analysis.stored_results.merge_run_rows``: an (entry, seed) stored twice must hold the
    same run)."""
    from analysis.stored_results import merge_run_rows, read_published
    from experiments.repro.common import comparable_settings

    files = [read_published(path, "--tables_from") for path in paths]
    first = files[0]

    def same(key, data):
        if key == "settings":
            return comparable_settings(data[key]) == comparable_settings(first[key])
        return data.get(key) == first.get(key)

    for path, data in zip(paths[1:], files[1:]):
        for key in ("settings", "budget", "tokens_per_step"):
            if not same(key, data):
                raise ConfigError(f"--tables_from: {path}'s {key} is {data.get(key)!r}, {paths[0]}'s is "
                                  f"{first.get(key)!r}; only runs of the same programme settings and budget share a table")
    runs, sources = merge_run_rows(list(zip(paths, files)), lambda r: (r["variant"], r["seed"]), SAME_RUN,
                                   lambda r: r["variant"])
    labels = list(dict.fromkeys(r["variant"] for r in runs))
    dense = [label for label in labels if next(r for r in runs if r["variant"] == label).get("dense")]
    return files, dense + [label for label in labels if label not in dense], runs, sources


def tables_from(ctx: Context, paths: Sequence[pathlib.Path]) -> Dict[str, Any]:
    """The probe tables rebuilt from stored run rows (``results.json``, no run folders or checkpoints needed),
    of one programme invocation or merged over several at the same settings and budget."""
    files, labels, runs, sources = merged_rows(paths)
    first = files[0]
    runs.sort(key=lambda r: labels.index(r["variant"]))  # entry-major, as one invocation orders them
    if "vanilla" not in labels:
        raise ConfigError("--tables_from: no vanilla rows in the files; the tables are relative to the reference vanilla")
    wanted = first["settings"].get("seeds")
    seed_sets = {label: sorted(r["seed"] for r in runs if r["variant"] == label) for label in labels}
    if len({tuple(v) for v in seed_sets.values()}) > 1 or (wanted and len(next(iter(seed_sets.values()))) != wanted):
        raise ConfigError(f"--tables_from: every entry needs the programme's {wanted} seeds, the same ones; got "
                          + ", ".join(f"{k} {v}" for k, v in seed_sets.items()) + "; merge files of complete entries")
    ctx.steps = first["settings"]["steps"]
    # the runs' own options (their task decides the report's chance line): the stored ones, not this command's
    ctx.run_options = list(first["settings"].get("run_options") or [])
    jobs = {stored_jobs(data) for data in files}
    # the wall-time line's "N at once" of the runs' invocations (several: the smallest, a bound on the wall time)
    ctx.workers = min(jobs)
    preface = ["Rebuilt from the stored run rows of " + "; ".join(sources) + " (no run retrained; an entry and seed "
               "stored in two files is the same run there, bit for bit).", "",
               *record_stored_runs(ctx, runs, lambda r: r["variant"])]
    return write_tables(ctx, first["settings"], first["budget"], first["tokens_per_step"], labels, runs, preface,
                        {"tables_from": [str(p) for p in paths]})


def train_runs(ctx: Context, plan: Sequence[Planned], seeds: int, blocks: int) -> List[Dict[str, Any]]:
    """Every (entry, seed) trained to the budget (or reused), evaluated, as one row each."""
    grid = [(c, ctx.seed + i) for c in plan for i in range(seeds)]
    ctx.validate([[*c.entry.run_options(), "--seed", str(s)] for c, s in grid], budget=plan[0].budget)
    summaries = ctx.run_many([([*c.entry.run_options(), "--seed", str(seed)],
                               budget_step_cap(c.budget, c.tokens_per_step, c.flops_per_token), c.budget)
                              for c, seed in grid])
    runs = [run_row(c, seed, s) for (c, seed), s in zip(grid, summaries)]
    for r in runs:  # the routers themselves: variants whose default routing sees the future, evaluated with it
        r["probe_topk"] = evaluate_default_routing(pathlib.Path(r["run_dir"]), blocks)
        if "spearman_answers" not in r["probe"] or "blocks" not in r["probe"]:  # a probe.json from before them
            r["probe"] = evaluate_run(pathlib.Path(r["run_dir"]), blocks)
    return runs


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
    from analysis.contribution import run_config
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


def run_row(c: Planned, seed: int, summary: Dict[str, Any]) -> Dict[str, Any]:
    import json

    from callbacks.run_summary import headline_val_loss

    detail = json.loads((pathlib.Path(summary["run_dir"]) / "probe.json").read_text())
    spent = budget_spent(summary)
    step_time = summary["median_step_time_s"]
    return {"variant": c.entry.label, "registry_variant": c.entry.variant, "dense": c.entry.dense, "seed": seed,
            "steps": summary["steps"], "planned_steps": c.steps, "train_flops_per_token": c.flops_per_token,
            "planned_deviation": c.deviation, "train_flops": spent["train_flops"],
            "measured_deviation": spent["spent_deviation"], "matched": spent["matched"],
            "val_loss": summary["val_metrics"].get("val/loss", summary["final_val_loss"]),
            "val_loss_causal": summary["val_metrics"].get("val/loss_causal"),
            "headline_val_loss": headline_val_loss(summary),  # causal where the variant has it: what it is ranked by
            "step_time_s": step_time, "train_time_s": step_time * summary["steps"] if step_time is not None else None,
            **run_wall(summary), **run_origin(summary),
            "probe": detail, "run_dir": summary["run_dir"]}


def _mean_std(values: List[Optional[float]]):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def level_accuracy(rows: List[Dict[str, Any]], key: str) -> Dict[str, Any]:
    """A level's accuracy over the seeds: per seed, mean ± std, the hierarchical bootstrap interval (seeds, then
    validation blocks; over seeds alone for a probe.json without per-block counts) and the share solving it."""
    accs = [r["probe"]["levels"][key]["acc"] for r in rows]
    blocks = [r["probe"].get("blocks") for r in rows]
    if all(blocks):
        level = int(key)
        ci = stats.hierarchical_ratio_ci([[b[level] for b in x["correct"]] for x in blocks],
                                         [[b[level] for b in x["tokens"]] for x in blocks])
    else:
        ci = stats.bootstrap_ci(accs)
    return {"acc_seeds": accs, "acc_ci": ci, "solved_share": stats.solved_share(accs)}


def aggregate(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Seed means and standard deviations of the per-level numbers and the headline figures, with intervals."""
    out: Dict[str, Any] = {"variant": rows[0].get("registry_variant", rows[0]["variant"]), "dense": rows[0].get("dense"),
                           "seeds": len(rows), "steps": statistics.fmean(r["steps"] for r in rows),
                           "steps_seeds": [r["steps"] for r in rows], "planned_steps": rows[0]["planned_steps"],
                           "planned_deviation": rows[0]["planned_deviation"], "matched": all(r["matched"] for r in rows),
                           "levels": {}}
    for key in sorted({k for r in rows for k in r["probe"]["levels"]}, key=int):  # every level the runs logged
        cells = [r["probe"]["levels"].get(key) for r in rows]
        if any(c is None for c in cells):
            continue
        out["levels"][key] = {m: _mean_std([c[m] for c in cells]) for m in ("acc", "loss", "flops", "compute_share",
                                                                           "token_share")}
        mean_flops = [sum(r["probe"]["levels"][k]["flops"] * r["probe"]["levels"][k]["token_share"]
                          for k in r["probe"]["levels"]) for r in rows]
        out["levels"][key]["relative_flops"] = _mean_std([c["flops"] / m for c, m in zip(cells, mean_flops)])
        out["levels"][key].update(level_accuracy(rows, key))
    for key in ("spearman", "hard_compute_share", "hard_token_share", "hard_compute_ratio"):
        out[key] = _mean_std([r["probe"][key] for r in rows])
    out["hard_from"] = rows[0]["probe"].get("hard_from", CallbacksConfig.probe_hard_from)  # older rows: the default
    for which in ("spearman", "spearman_answers"):
        out[f"{which}_seeds"] = [r["probe"].get(which) for r in rows]
        out[f"{which}_p_seeds"] = [r["probe"].get(f"{which}_p") for r in rows]
        out[f"{which}_t_p"] = one_sided_t(out[f"{which}_seeds"])
        out[f"{which}_ci"] = stats.bootstrap_ci(out[f"{which}_seeds"])
    out["spearman_answers"] = _mean_std(out["spearman_answers_seeds"])
    topk = [r.get("probe_topk") for r in rows]
    out["spearman_topk_seeds"] = [t["spearman"] for t in topk] if all(topk) else None
    for key in ("val_loss", "val_loss_causal", "headline_val_loss", "train_time_s", "train_flops"):
        values = [r.get(key) for r in rows]
        out[key], out[f"{key}_seeds"], out[f"{key}_ci"] = _mean_std(values), values, stats.bootstrap_ci(values)
    out["measured_deviation"] = _mean_std([r["measured_deviation"] for r in rows])
    return out


def one_sided_t(values: List[Optional[float]], alternative: str = "greater") -> Optional[float]:
    """p-value of a one-sample t-test that the seed mean is > 0 (``alternative="less"``: < 0; None with fewer than
    2 finite values)."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative: {alternative!r} is not one of 'greater', 'less'")
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return None
    from scipy.stats import ttest_1samp

    if statistics.stdev(values) == 0:  # no spread: the direction of the one value decides
        sign = 1 if alternative == "greater" else -1
        return 0.0 if sign * values[0] > 0 else 1.0
    return float(ttest_1samp(values, 0.0, alternative=alternative).pvalue)


def family(variant: str) -> str:
    """The routing family of a variant: its architecture module (mod, moe, mot, depth_gate, mom)."""
    from architectures.registry import get_variant

    return get_variant(variant).target.split(":")[0].rsplit(".", 1)[-1]


# ---------------------------------------------------------------------------- tests against the best dense model
def best_dense(per_variant: Dict[str, Dict[str, Any]]) -> str:
    """The dense entry (vanilla of any shape) with the lowest mean validation loss."""
    return stats.lowest_mean({v: a["headline_val_loss"][0] for v, a in per_variant.items() if a.get("dense")})


def dense_tests(per_variant: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every routed entry against the best dense model (and against the reference vanilla, the second column):
    loss (one-sided: lower), accuracy per level (one-sided: higher), Holm over the routed entries per figure; the
    Spearman t-tests corrected over the routed entries too (written into ``per_variant``)."""
    best = best_dense(per_variant)
    routed = [v for v, a in per_variant.items() if not a.get("dense")]

    def family_of(metric, alternative, against, level=None):
        def seeds(v):
            return per_variant[v]["levels"].get(level, {}).get("acc_seeds", []) if level else per_variant[v][metric]
        return stats.against_baseline({v: seeds(v) for v in routed}, seeds(against), alternative)

    tests = {"best_dense": best, "loss": family_of("headline_val_loss_seeds", "less", best),
             "loss_vs_reference": family_of("headline_val_loss_seeds", "less", "vanilla"),
             "acc": {k: family_of(None, "greater", best, k) for k in per_variant[best]["levels"]},
             "train_time_ratio": {v: _ratio(per_variant[v]["train_time_s"][0], per_variant[best]["train_time_s"][0])
                                  for v in routed}}
    for which in ("spearman", "spearman_answers"):
        corrected = stats.holm({v: per_variant[v][f"{which}_t_p"] for v in routed})
        for v in routed:
            per_variant[v][f"{which}_t_p_holm"] = corrected[v]
    return tests


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def positive_significant(a: Dict[str, Any], which: str = "spearman") -> bool:
    """Spearman(difficulty, compute) > 0 with p < 0.01 in every seed, and the one-sided t-test over seeds p < 0.05
    after Holm's correction over the routed entries (``which``: ``spearman`` over every labelled token,
    ``spearman_answers`` over the levels >= 1)."""
    rhos, ps = a.get(f"{which}_seeds") or [], a.get(f"{which}_p_seeds") or []
    t_p = a.get(f"{which}_t_p_holm", a.get(f"{which}_t_p"))
    every_seed = bool(rhos) and all(r is not None and r > 0 for r in rhos) and all(p is not None and p < 0.01 for p in ps)
    return every_seed and (t_p if t_p is not None else 1.0) < ALPHA


def goal_figures(per_variant: Dict[str, Dict[str, Any]], tests: Dict[str, Any]) -> Dict[str, Any]:
    """The issue's goals from the numbers and the corrected tests: the setting is learnable (the reference
    vanilla's accuracy on levels 1 and 2, those of them the task has), at least two routed families grade compute
    by difficulty, a routed entry beats the best dense model on the hardest level that model solves, and on
    validation loss."""
    vanilla = per_variant["vanilla"]["levels"]
    # the floors of the levels the task has (probe-v7/v8 have levels 0 and 1 only: L1's floor alone)
    goals: Dict[str, Any] = {"learnable": {str(k): (vanilla[str(k)].get("acc", (None, None))[0], floor)
                                           for k, floor in LEARNABLE.items() if str(k) in vanilla},
                             "best_dense": tests["best_dense"]}
    goals["learnable_met"] = bool(goals["learnable"]) and all(acc is not None and acc >= floor
                                                              for acc, floor in goals["learnable"].values())
    routed = [v for v, a in per_variant.items() if not a.get("dense")]
    for which, key, families in (("spearman", "spearman_positive_significant", "families_positive"),
                                 ("spearman_answers", "answers_positive_significant", "families_grading_answers")):
        goals[key] = {v: positive_significant(per_variant[v], which) for v in routed}
        goals[families] = sorted({family(per_variant[v]["variant"]) for v, ok in goals[key].items() if ok})
    goals["two_families_positive"] = len(goals["families_positive"]) >= 2
    goals["beats_best_dense_loss"] = sorted(v for v, t in tests["loss"].items() if _passes(t))
    dense_levels = per_variant[tests["best_dense"]]["levels"]
    solved = [int(k) for k, row in dense_levels.items() if (row["acc"][0] or 0) >= SOLVED]
    if solved:
        level = str(max(solved))
        accs = {v: per_variant[v]["levels"][level]["acc"][0] for v in routed if level in per_variant[v]["levels"]}
        goals.update(hardest_solvable_level=int(level), dense_acc=dense_levels[level]["acc"][0],
                     best_routed=max(accs, key=accs.get) if accs else None,
                     routed_at_least_dense=sorted(v for v, acc in accs.items() if acc >= dense_levels[level]["acc"][0]),
                     beats_best_dense=sorted(v for v, t in tests["acc"].get(level, {}).items() if _passes(t)))
        goals["best_routed_acc"] = accs.get(goals["best_routed"])
    return goals


def _passes(test: Dict[str, Any]) -> bool:
    return stats.passes(test, ALPHA)


# ---------------------------------------------------------------------------- the report
def _rhos(values) -> str:
    return ", ".join("-" if r is None else f"{r:+.3f}" for r in values)


def _pm(cell, digits: int = 3) -> str:
    mean, std = cell
    return "-" if mean is None else f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def _acc_cell(row: Optional[Dict[str, Any]]) -> str:
    """'mean [CI] k/n': the seed-mean accuracy, its hierarchical interval, the seeds at >= 0.9 of all."""
    if not row:
        return "-"
    seeds = row.get("acc_seeds") or []
    solved = sum(1 for a in seeds if a >= stats.SOLVED)
    return f"{_ci(row['acc'][0], row.get('acc_ci'), 2)} {solved}/{len(seeds)}"


def table_levels(per_variant) -> List[str]:
    """The levels (as ``probe.json`` keys) any entry has, in level order: 0-4, or 0-7 on ``probe-v6/bounce``."""
    return sorted({k for a in per_variant.values() for k in a["levels"]}, key=int)


def accuracy_table(per_variant) -> str:
    levels = table_levels(per_variant)
    return markdown_table(["entry", *[f"acc L{k}" for k in levels]],
                          [[v, *[_acc_cell(a["levels"].get(k)) for k in levels]] for v, a in per_variant.items()])


def compute_table(per_variant) -> str:
    levels = table_levels(per_variant)
    return markdown_table(
        ["entry", *[f"FLOPs L{k} (rel.)" for k in levels], "Spearman (seeds)", "t-test p (Holm)",
         "Spearman, answers only (seeds)", "t-test p, answers (Holm)", "hard compute / token share",
         "Spearman, non-causal routing"],
        [[v, *[_pm(a["levels"].get(k, {}).get("relative_flops", (None, None)), 3) for k in levels],
          _rhos(a["spearman_seeds"]), fmt(a.get("spearman_t_p_holm", a["spearman_t_p"]), 3),
          _rhos(a["spearman_answers_seeds"]), fmt(a.get("spearman_answers_t_p_holm", a["spearman_answers_t_p"]), 3),
          f"{_pm(a['hard_compute_share'])} / {_pm(a['hard_token_share'])}",
          _rhos(a["spearman_topk_seeds"]) if a.get("spearman_topk_seeds") else "same"] for v, a in per_variant.items()])


def dense_table(per_variant, tests, goals) -> str:
    level = str(goals.get("hardest_solvable_level", max(int(k) for k in per_variant[tests["best_dense"]]["levels"])))
    rows = [[v, _test_cell(tests["loss"][v]), _test_cell(tests["loss_vs_reference"][v]),
             _test_cell(tests["acc"].get(level, {}).get(v), 3), fmt(tests["train_time_ratio"][v], 3)]
            for v in tests["loss"]]
    return markdown_table(["entry", f"Δ loss vs best dense ({tests['best_dense']})", "Δ loss vs vanilla (reference)",
                           f"Δ acc L{level} vs best dense", "train time / best dense's"], rows)


def budget_table(per_variant) -> str:
    rows = [[v, f"{'/'.join(str(n) for n in a['steps_seeds'])} ({a['planned_steps']})", _pm(a["train_flops"]),
             f"{100 * (a['measured_deviation'][0] or 0):+.2f}%" if a["matched"] else
             "not matched: --max_steps stopped a seed first", _ci(a["headline_val_loss"][0], a["headline_val_loss_ci"], 4),
             _pm(a["val_loss"]), _ci(a["train_time_s"][0], a["train_time_s_ci"], 1)] for v, a in per_variant.items()]
    return markdown_table(["entry", "steps (planned)", "FLOPs spent", "spent vs budget",
                           "val loss (causal where present) [95% CI]", "val loss, routing as in training",
                           "train time s [95% CI]"], rows)


def goal_lines(goals) -> List[str]:
    def met(ok: bool) -> str:
        return f"**{'met' if ok else 'not met'}**"

    learnable = (", ".join(f"L{k} {fmt(acc, 3)} (>= {floor})" for k, (acc, floor) in goals["learnable"].items())
                 or "the task has neither L1 nor L2")
    positive = [v for v, ok in goals["spearman_positive_significant"].items() if ok]
    grading = [v for v, ok in goals["answers_positive_significant"].items() if ok]
    lines = ["Goal figures (computed from the numbers above; a goal is met only when its corrected test passes):", "",
             f"- learnable setting, the reference vanilla's seed-mean accuracy: {learnable}: {met(goals['learnable_met'])}",
             "- Spearman(difficulty, compute) positive with p < 0.01 in every seed and one-sided t-test over seeds "
             f"p < {ALPHA} after Holm's correction over the routed entries: {', '.join(positive) or 'none'}; families: "
             f"{', '.join(goals['families_positive']) or 'none'}: {met(goals['two_families_positive'])} (goal: at "
             "least two routed families)",
             "- the same test over the answers only (levels >= 1; level 0 also holds format tokens such as `;`): "
             f"{', '.join(grading) or 'none'}; families: {', '.join(goals['families_grading_answers']) or 'none'}",
             f"- lower validation loss than the best dense model ({goals['best_dense']}), one-sided Welch over seeds, "
             f"Holm p < {ALPHA}: {', '.join(goals['beats_best_dense_loss']) or 'none'}: "
             f"{met(bool(goals['beats_best_dense_loss']))}"]
    if "hardest_solvable_level" in goals:
        lines.append(
            f"- hardest level the best dense model solves (seed-mean accuracy >= {SOLVED}): "
            f"L{goals['hardest_solvable_level']}; {goals['best_dense']} {fmt(goals['dense_acc'], 3)}, best routed "
            f"{goals['best_routed']} {fmt(goals['best_routed_acc'], 3)}; at >= its mean (no test): "
            f"{', '.join(goals['routed_at_least_dense']) or 'none'}; higher accuracy, one-sided Welch over seeds, Holm "
            f"p < {ALPHA}: {', '.join(goals['beats_best_dense']) or 'none'}: {met(bool(goals['beats_best_dense']))}")
    else:
        lines.append(f"- the best dense model solves no level (seed-mean accuracy >= {SOLVED}): **not met**")
    return lines


def level_span(first: int, last: int) -> str:
    return f"level {first}" if first == last else f"levels {first}-{last}"


def run_task(ctx: Context) -> Optional[str]:
    """The runs' task: the last ``--data.name`` of their options (``--data`` being its alias), the programme's
    default task without one."""
    from experiments.run import expand_aliases

    options = expand_aliases([*DEFAULTS, *ctx.run_options])
    name = "--data.name"
    tasks = [o.partition("=")[2] if o.startswith(f"{name}=") else options[i + 1] for i, o in enumerate(options)
             if (o == name and i + 1 < len(options)) or o.startswith(f"{name}=")]
    return tasks[-1] if tasks else None


def answer_chance(ctx: Context) -> Optional[float]:
    """The answers' chance accuracy of the runs' task where ``CHANCE`` knows it: None for the others (v7/v8
    letters, for instance)."""
    return CHANCE.get(run_task(ctx))


def report_sections(ctx: Context, budget: float, tokens: int, per_variant, tests, goals) -> List[str]:
    shares = per_variant["vanilla"]["levels"]
    top = int(table_levels(per_variant)[-1])
    hard = level_span(per_variant["vanilla"].get("hard_from", CallbacksConfig.probe_hard_from), top)
    dense = [v for v, a in per_variant.items() if a.get("dense")]
    intro = (f"Budget {budget:.3e} training FLOPs per run ({ctx.steps} steps of the reference vanilla, {tokens} tokens "
             "each); every entry trains until its measured training FLOPs (routing-aware, every step counted) reach "
             f"it. Seeds per entry: {per_variant['vanilla']['seeds']}. Dense models: {', '.join(dense)}; the best of "
             f"them by validation loss: {tests['best_dense']}. Evaluation with causal routing where the variant has "
             "one. Token shares of the levels: " +
             ", ".join(f"L{k} {100 * shares[k]['token_share'][0]:.1f}%" for k in shares) + ".")
    return [intro, "",
            "Accuracy per difficulty level: seed mean [95% CI: hierarchical bootstrap, seeds then validation blocks "
            f"within each seed] and the seeds that solve the level (accuracy >= {stats.SOLVED}) of all" +
            (f"; chance for digit answers {chance}:" if (chance := answer_chance(ctx)) is not None else ":"),
            accuracy_table(per_variant), "",
            "Against the best dense model at the same measured training FLOPs (and the reference vanilla): difference "
            "in seed means [95% bootstrap CI, each entry's seeds resampled on their own], Hedges' g over seeds, "
            "one-sided Welch t-test over seeds (loss: lower; accuracy: higher) after Holm's correction over the routed "
            "entries; training wall clock (median step time x steps) relative to the best dense model's:",
            dense_table(per_variant, tests, goals), "",
            "Compute per difficulty level: forward FLOPs per token of the level / the entry's mean over labelled "
            "tokens (1.0 everywhere = no preference), Spearman rho per seed with the one-sided t-test over seeds "
            f"(Holm over the routed entries), share of compute vs share of tokens on {hard}; 'answers only': the "
            f"correlation over the tokens of {level_span(1, top)}; last column: the same correlation when the variant routes as "
            "in training (top-k over the whole sequence, which sees the future), where it has a separate causal "
            "routing:", compute_table(per_variant), "",
            "Budget, loss and wall clock (steps per seed, and the analytic plan's; measured training FLOPs spent and "
            "their excess over the budget, at most one step; loss and time intervals: bootstrap over seeds):",
            budget_table(per_variant), "", *goal_lines(goals), ""]


# ---------------------------------------------------------------------------- --verify
def row_figures(a: Dict[str, Any]) -> List[Tuple[str, Tuple[Optional[float], ...]]]:
    """(figure, (mean, CI low, CI high)) of one row of the table (an ``aggregate``, published or new)."""
    def stat(key):
        mean = (a.get(key) or [None])[0]
        lo, hi = a.get(f"{key}_ci") or (None, None)
        return mean, lo, hi

    out = [("val loss (causal where present)", stat("headline_val_loss")), ("training FLOPs", stat("train_flops")),
           ("train time s", stat("train_time_s"))]
    for k in sorted(a.get("levels") or {}, key=int):
        row = a["levels"][k]
        out.append((f"acc L{k}", (row["acc"][0], *(row.get("acc_ci") or (None, None)))))
        out.append((f"share of seeds solving L{k}", (row.get("solved_share"), None, None)))
    out += [("Spearman", stat("spearman")), ("Spearman, answers only", stat("spearman_answers"))]
    return out


def verify_row(ctx: Context, row: str, published_path: pathlib.Path, seeds: int, blocks: int, min_steps: int,
               quick: bool) -> Dict[str, Any]:
    """Retrain one published row from nothing (its seeds, a fresh --out) and set its figures beside the published."""
    from analysis.tables import verification_table
    from analysis.stored_results import read_published
    from experiments.repro.common import check_kernels, check_settings, require_fresh

    published = read_published(published_path)
    if row not in published["variants"]:
        raise ConfigError(f"--verify: no row {row!r} in {published_path}; rows: {', '.join(published['variants'])}")
    settings = programme_settings(ctx, seeds, blocks, quick)
    check_settings(published["settings"], settings, published_path)
    check_kernels(published, published_path)
    require_fresh(ctx.out)
    ctx.reuse = False
    _, entries, budget, tokens, vocab = prepare(ctx, [row], seeds, blocks, quick, dense_shapes=row.split(":", 1)[-1]
                                                if row.startswith("dense:") else None)
    entry = next(e for e in entries if e.label == row)
    runs = train_runs(ctx, plan_entries(ctx, [entry], budget, tokens, vocab, min_steps), seeds, blocks)
    mine = aggregate(runs)
    theirs = dict(row_figures(published["variants"][row]))
    table, figures = verification_table([(name, theirs.get(name, (None, None, None)), values)
                                         for name, values in row_figures(mine)])
    outside = [f["figure"] for f in figures if f["inside_published_ci"] is False]
    sections = [f"Row `{row}` of {published_path} retrained from nothing ({seeds} seeds from {ctx.seed}) at budget "
                f"{budget:.3e} training FLOPs; each figure beside the published one, both with their 95% intervals "
                "(as in the published table):", "", table, "",
                f"Figures whose mean falls outside the published interval: {', '.join(outside) or 'none'}.", ""]
    results = {"settings": settings, "verify": row, "published": str(published_path), "budget": budget,
               "figures": figures, "variants": {row: mine}, "runs": runs}
    ctx.write_report(f"Verification of the published row {row}", sections, results)
    return results


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
    if (chance := answer_chance(ctx)) is not None:
        ax.axhline(chance, color="grey", linewidth=0.8, linestyle=":", label="chance (digit answers)")
    ax.set_xlabel(level_meaning(run_task(ctx)))
    ax.set_ylabel("next-token accuracy (mean ± std over seeds)")
    ax.set_xticks([int(k) for k in table_levels(per_variant)])
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
        ax.set_xlabel(level_meaning(run_task(ctx)))
        ax.set_xticks([int(k) for k in table_levels(per_variant)])
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    ctx.save_figure(fig, "probe_compute")
