"""MoD isoFLOP comparison (Raposo et al. 2024, arXiv 2404.02258, Figures 3-4), with dense controls and seeds.

For each training-FLOP budget, every model (variant x depth x width: ``--layers`` x ``--widths``; vanilla is
always in the grid, the dense curve every claim is measured against) trains ``--seeds`` seeds until its
*measured* training FLOPs reach the budget (``--max_train_flops``: the routing-aware count of every step,
docs/compute-budget.md), so a router that spends more or less than planned still ends at the budget;
``--max_steps`` is only a cap (``BUDGET_STEP_CAP`` x the planned steps). The plan, ``steps = round(budget /
(tokens_per_step * training FLOPs per token))`` from the model's analytic ``flops_per_token().training``
(fwd + bwd = 3 x fwd, MoD's capacity and routed blocks included), chooses the grid: configurations that
would need fewer than ``min_steps`` steps are left out (a run overshoots the budget by at most its last
step, under ``1 / min_steps``), as are shapes a variant cannot build (MoD's routed blocks at one layer),
and a budget too small for the smallest model of a variant is an error before any run starts.

Per budget (``budget_analysis``, statistics from ``analysis/stats.py``): each shape's seed mean with its 95%
bootstrap interval over seeds; the best dense shape (lowest seed-mean validation loss); whether the dense curve
turns inside the grid ("bracketed": the best shape has a narrower and a wider one beside it at its depth, and a
shallower and a deeper one at its width when the grid has several depths, or at one layer, the fewest a model
can have, only deeper ones, all worse; else which edge it is at), and each depth's curve over widths; every
routed shape against the best dense model (difference in means with its bootstrap interval, Hedges' g, one-sided
Welch over seeds, Holm over the routed shapes of the budget; "met" only when the corrected test passes) and
against vanilla of its own shape; training wall clock (median step x steps) beside the FLOPs. The plot is
validation loss vs parameters, one panel per budget and one line per variant and depth (the paper's isoFLOP
curves). Finished runs are reused (``runs.json``); results.json/md record the wall time of training and of the
tables.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from callbacks.run_summary import headline_val_loss, noncausal_val_loss
from analysis import stats
from analysis.tables import ci_cell, error_bars, test_cell
from analysis.dense_grid import bracket_verdict, grid_bracket, is_bracketed
from analysis.provenance import origin_lines, run_origin
from analysis.wall_time import run_wall, wall_time_lines
from analysis.stored_results import merge_run_rows, read_published, stored_jobs
from experiments.repro.common import (Context, budget_spent, budget_step_cap, figure, fmt, markdown_table,
                                     record_stored_runs, result_options, run_model_config)

TOLERANCE = 0.05
LEFT_OUT_WHY = "fewer than --min_steps steps, or a shape the variant cannot build"
ALPHA = 0.05  # the level of the corrected tests against the best dense model


@dataclass(frozen=True)
class IsoFlopConfig:
    variant: str
    d_model: int
    n_layer: int
    n_head: int
    parameters: int
    flops_per_token: float  # training FLOPs (forward + backward) per token
    tokens_per_step: int
    steps: int
    budget: float

    @property
    def total_flops(self) -> float:
        return self.steps * self.tokens_per_step * self.flops_per_token

    @property
    def deviation(self) -> float:
        """Relative difference between the planned training FLOPs and the budget."""
        return self.total_flops / self.budget - 1.0

    def run_options(self) -> List[str]:
        return ["--variant", self.variant, "--model.d_model", str(self.d_model), "--model.n_layer", str(self.n_layer),
                "--model.n_head", str(self.n_head)]


def model_cost(base: ModelConfig, variant: str, d_model: int, n_layer: int, n_head: int) -> Tuple[int, float]:
    """(parameters, training FLOPs per token at full context) of ``base`` changed to this variant and shape.

    Built on the meta device: no memory is allocated, so paper sizes cost nothing to size.
    """
    config = dataclasses.replace(base, variant=variant, d_model=d_model, n_layer=n_layer, n_head=n_head)
    with torch.device("meta"):
        model = build_model(config)
    return model.num_parameters(), model.flops_per_token(None, model.config.block_size).training


def isoflop_configs(budget: float, base: ModelConfig, tokens_per_step: int, variants: Sequence[str] = ("vanilla", "mod"),
                    widths: Sequence[int] = (64,), n_layer: Optional[int] = None, n_head: Optional[int] = None,
                    min_steps: int = 20, tolerance: float = TOLERANCE,
                    depths: Optional[Sequence[int]] = None,
                    bases: Optional[Dict[str, ModelConfig]] = None) -> List[IsoFlopConfig]:
    """Every (variant, depth, width) that can spend ``budget`` training FLOPs in at least ``min_steps`` steps.

    ``depths`` (default: ``[n_layer]``, the base's depth without it) x ``widths`` is the grid of every variant;
    a shape a variant cannot build (MoD's routed blocks need at least two layers) is left out of that variant.
    ``base`` supplies everything else (size, vocabulary, block size, and its own variant's config groups: a
    config holds only those, so another variant gets its preset); ``bases`` (variant -> its own resolved
    config, as its run parses it) replaces it for the variants it holds, so their own options count
    (``-- --model.mod.capacity 0.25`` plans MoD at that capacity).
    Raises ``ConfigError`` when the budget is not positive or too small for a variant's smallest model.
    """
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ConfigError(f"budget: must be a positive number of FLOPs, got {budget!r}")
    if tokens_per_step <= 0:
        raise ConfigError(f"tokens_per_step: must be positive, got {tokens_per_step}")
    if not variants or not widths or (depths is not None and not depths):
        raise ConfigError("isoflop: the grid is empty (no variants, widths or depths)")
    if min_steps < math.ceil(0.5 / tolerance):
        raise ConfigError(f"min_steps: {min_steps} steps cannot guarantee {tolerance:.0%} accuracy; use >= "
                          f"{math.ceil(0.5 / tolerance)}")
    resolved = base.resolve()
    depths = sorted(set(depths or [n_layer or resolved.n_layer]))
    n_head = n_head or resolved.n_head
    bad = [w for w in widths if w <= 0 or w % n_head]
    if bad or min(depths) <= 0:
        raise ConfigError(f"widths: {bad} are not positive multiples of n_head={n_head}" if bad
                          else f"layers: {depths} must be positive")
    configs = []
    for variant in variants:
        own = (bases or {}).get(variant, resolved)
        costs = shape_costs(own, variant, [(n, w) for n in depths for w in sorted(set(widths))], n_head)
        fitting = [c for c in (fitting_config(budget, variant, shape, cost, n_head, tokens_per_step)
                               for shape, cost in costs.items()) if c.steps >= min_steps and abs(c.deviation) <= tolerance]
        if not fitting:
            if not costs:
                raise ConfigError(f"layers: no shape of the grid builds a {variant} model (depths {depths})")
            smallest = min(costs, key=lambda shape: costs[shape][1])
            need = min_steps * tokens_per_step * costs[smallest][1]
            raise ConfigError(f"budget: {budget:.3e} FLOPs is too small for the smallest {variant} model "
                              f"(n_layer={smallest[0]}, d_model={smallest[1]}): {min_steps} steps of {tokens_per_step} "
                              f"tokens need {need:.3e}")
        configs.extend(fitting)
    return configs


def shape_costs(resolved: ModelConfig, variant: str, shapes: Sequence[Tuple[int, int]],
                n_head: int) -> Dict[Tuple[int, int], Tuple[int, float]]:
    """(parameters, training FLOPs per token) of every (n_layer, d_model) the variant can build."""
    costs = {}
    for n_layer, width in shapes:
        try:
            costs[(n_layer, width)] = model_cost(resolved, variant, width, n_layer, n_head)
        except ConfigError:  # e.g. MoD at one layer: its routed blocks select none; that shape is not in its grid
            continue
    return costs


def fitting_config(budget: float, variant: str, shape: Tuple[int, int], cost: Tuple[int, float], n_head: int,
                   tokens_per_step: int) -> IsoFlopConfig:
    """The plan of one shape at the budget: its steps rounded from the analytic training FLOPs per token."""
    (n_layer, width), (params, per_token) = shape, cost
    steps = round(budget / (tokens_per_step * per_token))
    return IsoFlopConfig(variant, width, n_layer, n_head, params, per_token, tokens_per_step, steps, budget)


def default_widths(d_model: int, n_head: int) -> List[int]:
    return sorted({max(n_head, round(d_model * f / n_head) * n_head) for f in (0.5, 0.75, 1.0, 1.25)})


def run_geometry(ctx: Context) -> Tuple[Any, ModelConfig, int]:
    """(parsed run config, base model config with the tokenizer's vocabulary, tokens per optimisation step)."""
    from datamodules.lm import DataConfig, LMDataModule
    from experiments.run import model_config

    cfg = ctx.parse(ctx.argv(["--variant", "vanilla"]))
    block_size = model_config(cfg).resolve().block_size
    vocab = LMDataModule(DataConfig(**cfg.data.as_dict()), block_size=block_size, seed=cfg.seed).vocab_size
    base = model_config(cfg, vocab_size=vocab).resolve()
    devices = cfg.trainer.devices
    world = (int(devices) if str(devices).isdigit() else 1) * int(cfg.trainer.num_nodes or 1)
    tokens = cfg.data.batch_size * block_size * world * int(cfg.trainer.accumulate_grad_batches or 1)
    return cfg, base, tokens


def check_variants(variants: Sequence[str]) -> List[str]:
    """The variants of the grid, vanilla first: the dense curve is always trained (every claim is against it)."""
    from architectures import variant_names

    unknown = [v for v in variants if v not in variant_names()]
    if unknown:
        raise ConfigError(f"--variants: unknown {unknown}; valid variants: {', '.join(variant_names())}")
    return ["vanilla", *[v for v in dict.fromkeys(variants) if v != "vanilla"]]


def variant_bases(ctx: Context, variants: Sequence[str], vocab_size: int) -> Dict[str, ModelConfig]:
    """Each variant's resolved model config as its run parses its command line (preset, then the pass-through
    options, its own groups' included), with the tokenizer's vocabulary: what the grid's shapes are cut from."""
    return {v: run_model_config(ctx, ["--variant", v], vocab_size) for v in variants}


def isoflop_experiment(ctx: Context, budgets: Optional[Sequence[float]] = None, widths: Optional[Sequence[int]] = None,
                       n_layer: Union[int, Sequence[int], None] = None, variants: Sequence[str] = ("vanilla", "mod"),
                       min_steps: int = 20, seeds: int = 5) -> Dict[str, Any]:
    """Every variant at every (depth, width) of the grid and budget, ``seeds`` seeds each; the analysis of
    ``budget_analysis`` per budget (``n_layer``: one depth or the list of depths; default the size's)."""
    variants = check_variants(variants)
    if seeds < 1:
        raise ConfigError(f"--seeds: must be a positive integer, got {seeds}")
    _, base, tokens = run_geometry(ctx)
    depths = sorted(set([n_layer] if isinstance(n_layer, int) else (n_layer or [base.n_layer])))
    widths = list(widths or default_widths(base.d_model, base.n_head))
    if budgets is None:
        _, reference = model_cost(base, "vanilla", base.d_model, base.n_layer, base.n_head)
        budgets = [0.5 * ctx.steps * tokens * reference, ctx.steps * tokens * reference]
    bases = variant_bases(ctx, variants, base.vocab_size)
    plan = {b: isoflop_configs(b, base, tokens, variants, widths, min_steps=min_steps, depths=depths, bases=bases)
            for b in budgets}
    with ctx.part("training"):
        runs = train_grid(ctx, plan, seeds)
    with ctx.part("tables"):
        analyses = [{**budget_analysis(b, cells_of([r for r in runs if r["budget"] == b])),
                     "left_out": left_out(plan[b], variants, depths, widths)} for b in plan]
        sections = report_sections(tokens, depths, widths, seeds, analyses)
        sections += wall_time_lines(runs, lambda r: f"{r['variant']} {r['n_layer']}x{r['d_model']} at {r['budget']:.3e}",
                                    ctx.workers) + origin_lines(runs)
        plot_isoflop(ctx, analyses)
        ctx.log_table("mod_isoflop", "\n".join(sections))
    results = {"tokens_per_step": tokens, "budgets": list(plan), "widths": widths, "depths": depths, "seeds": seeds,
               "variants": variants, "analysis": analyses, "runs": runs, "run_options": result_options(ctx.run_options),
               "size": ctx.size}
    ctx.write_report("MoD isoFLOP comparison", sections, results)
    return results


# ---------------------------------------------------------------------------- --tables_from
# the figures an (budget, shape, seed) stored in two files must agree in to be one run
SAME_RUN = ("parameters", "steps", "measured_flops", "val_loss", "val_loss_causal", "val_loss_noncausal")


def stored_run_options(data: Dict[str, Any]) -> Optional[List[str]]:
    """The pass-through run options a stored invocation trained with, those that can change a result: its own
    record (``run_options``), else its provenance argv after ``--``; None when it names neither."""
    if isinstance(data.get("run_options"), list):
        return result_options(data["run_options"])
    argv = (data.get("provenance") or {}).get("argv")
    if not isinstance(argv, list):
        return None
    return result_options(argv[argv.index("--") + 1:] if "--" in argv else [])


ROW_KEY = ("budget", "variant", "n_layer", "d_model", "seed")  # one run of the grid
# what the tables read of a stored row besides ROW_KEY and SAME_RUN (isoflop_row writes them all)
ROW_FIGURES = ("planned_steps", "train_flops_per_token", "forward_flops_per_token", "matched", "measured_deviation",
               "train_time_s")


def stored_size(data: Dict[str, Any]) -> str:
    """The ``--size`` a stored invocation gave every run (its record, else its provenance argv before ``--``;
    the default, tiny, where it gave none): it sets n_head even where d_model and block_size are overridden."""
    if isinstance(data.get("size"), str):
        return data["size"]
    argv = (data.get("provenance") or {}).get("argv") or []
    own = argv[:argv.index("--")] if "--" in argv else argv
    for i, arg in enumerate(own):
        if arg.startswith("--size="):
            return arg.split("=", 1)[1]
        if arg == "--size" and i + 1 < len(own):
            return own[i + 1]
    return "tiny"


def run_key(row: Dict[str, Any]) -> Tuple[Any, ...]:
    return tuple(row[k] for k in ROW_KEY)


def stored_isoflop_runs(paths: Sequence[pathlib.Path]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], List[str]]:
    """(each file's results, one row per budget, shape and seed, a line per file) of one or more mod_isoflop
    results.json files whose runs trained with the same tokens per step and run options
    (``analysis.stored_results.merge_run_rows``: a run stored twice must be the same run)."""
    files = [read_published(path, "--tables_from", needs=(("runs", list), ("tokens_per_step", int))) for path in paths]
    options = [stored_run_options(data) for data in files]
    for path, data, opts in zip(paths, files, options):
        missing = [k for k in (*ROW_KEY, *SAME_RUN, *ROW_FIGURES)
                   if not all(isinstance(r, dict) and k in r for r in data["runs"])]
        if missing:
            raise ConfigError(f"--tables_from: {path}'s run rows lack {', '.join(missing)}: not a mod_isoflop "
                              "results.json (give the file the programme wrote)")
        if opts is None:
            raise ConfigError(f"--tables_from: {path} names no run options (no run_options, no provenance argv); "
                              "give a mod_isoflop results.json written by the programme")
        for what, mine, first in (("tokens_per_step", data["tokens_per_step"], files[0]["tokens_per_step"]),
                                  ("--size", stored_size(data), stored_size(files[0])),
                                  ("run options", opts, options[0])):
            if mine != first:
                raise ConfigError(f"--tables_from: {path}'s {what} {mine} differ from {paths[0]}'s {first}; only "
                                  "runs trained alike share a table")
    runs, sources = merge_run_rows(list(zip(paths, files)), run_key, SAME_RUN,
                                   lambda r: f"{shape_label(r['variant'], r['n_layer'], r['d_model'])} at {fmt(r['budget'])}")
    return files, runs, sources


def tables_from(ctx: Context, paths: Sequence[pathlib.Path]) -> Dict[str, Any]:
    """The isoFLOP tables, tests and figure rebuilt from stored run rows (no run folders needed) of one or more
    invocations: e.g. a width grid and a depth grid at one budget, analysed as one dense curve. The grid is the
    union of the files' shapes, not a full depths x widths product: the shapes of that product no file holds are
    listed per budget."""
    files, runs, sources = stored_isoflop_runs(paths)
    seed_sets: Dict[str, set] = {}
    for r in runs:
        seed_sets.setdefault(f"{shape_label(r['variant'], r['n_layer'], r['d_model'])} at {fmt(r['budget'])}",
                             set()).add(r["seed"])
    if len({tuple(sorted(v)) for v in seed_sets.values()}) > 1:
        raise ConfigError("--tables_from: every shape needs the same seeds; got " + ", ".join(
            f"{k} {sorted(v)}" for k, v in seed_sets.items()) + "; merge files of complete shapes")
    budgets = sorted({r["budget"] for r in runs})
    without_dense = [fmt(b) for b in budgets if not any(r["variant"] == "vanilla" and r["budget"] == b for r in runs)]
    if without_dense:
        raise ConfigError(f"--tables_from: no vanilla rows at budget {', '.join(without_dense)}; every claim is "
                          "against the dense curve of its budget")
    depths, widths = sorted({r["n_layer"] for r in runs}), sorted({r["d_model"] for r in runs})
    variants = list(dict.fromkeys(["vanilla", *(r["variant"] for r in runs)]))
    seeds = len(next(iter(seed_sets.values())))
    ctx.workers = min(stored_jobs(data) for data in files)  # the wall-time line's "N at once" (a bound when several)
    analyses = []
    for b in budgets:
        at = [r for r in runs if r["budget"] == b]
        held = {shape_label(r["variant"], r["n_layer"], r["d_model"]) for r in at}
        analyses.append({**budget_analysis(b, cells_of(at)), "left_out_why": "not in the merged files",
                         "left_out": [label for v in variants for n in depths for w in widths
                                      if (label := shape_label(v, n, w)) not in held]})
    grid = (f"the union of the merged files' shapes over depths {depths} and widths {widths} (vanilla: the dense "
            "curve; the shapes of that product no file holds are listed in the goal lines)")
    preface = ["Rebuilt from the stored run rows of " + "; ".join(sources) + " (no run retrained; a shape and seed "
               "stored in two files is the same run there, bit for bit, and its row is the first file's). Train times "
               "are each run's own invocation's: runs of different files were timed under different machine loads, "
               "so their train-time ratios compare them only roughly.", "",
               *record_stored_runs(ctx, runs, lambda r: f"{shape_label(r['variant'], r['n_layer'], r['d_model'])} at "
                                   f"{fmt(r['budget'])}")]
    sections = preface + report_sections(files[0]["tokens_per_step"], depths, widths, seeds, analyses, grid=grid)
    sections += wall_time_lines(runs, lambda r: f"{r['variant']} {r['n_layer']}x{r['d_model']} at {r['budget']:.3e}",
                                ctx.workers) + origin_lines(runs)
    plot_isoflop(ctx, analyses)
    results = {"tokens_per_step": files[0]["tokens_per_step"], "budgets": budgets, "widths": widths, "depths": depths,
               "seeds": seeds, "variants": variants, "analysis": analyses, "runs": runs,
               "run_options": stored_run_options(files[0]), "size": stored_size(files[0]),
               "tables_from": [str(p) for p in paths]}
    ctx.write_report("MoD isoFLOP comparison (rebuilt from stored runs)", sections, results)
    return results


def train_grid(ctx: Context, plan: Dict[float, List[IsoFlopConfig]], seeds: int) -> List[Dict[str, Any]]:
    """Every (budget, shape, seed) trained until its measured FLOPs reach the budget, or reused (runs.json)."""
    jobs = [(budget, c, ctx.seed + i) for budget, configs in plan.items() for c in configs for i in range(seeds)]
    for budget, configs in plan.items():
        ctx.validate([[*c.run_options(), "--seed", str(ctx.seed)] for c in configs], budget=budget)
    summaries = ctx.run_many([([*c.run_options(), "--seed", str(seed)],
                               budget_step_cap(budget, c.tokens_per_step, c.flops_per_token), budget)
                              for budget, c, seed in jobs])
    return [isoflop_row(budget, c, s, seed) for (budget, c, seed), s in zip(jobs, summaries)]


def isoflop_row(budget: float, c, s: Dict[str, Any], seed: Optional[int] = None) -> Dict[str, Any]:
    """One run's row: its plan ``c`` at ``budget`` and its summary ``s``."""
    spent = budget_spent(s)
    step_time = s["median_step_time_s"]
    return {"budget": budget, "variant": c.variant, "d_model": c.d_model, "n_layer": c.n_layer, "seed": seed,
            "parameters": s["parameters"], "steps": s["steps"], "planned_steps": c.steps,
            "train_flops_per_token": c.flops_per_token, "planned_flops": c.total_flops,
            "planned_deviation": c.deviation, "measured_flops": spent["train_flops"],
            "measured_deviation": spent["spent_deviation"], "matched": spent["matched"],
            # routing decided as in generation (MoD's causal loss): what the curves compare
            "val_loss": headline_val_loss(s), "val_loss_noncausal": noncausal_val_loss(s),
            "val_loss_causal": s.get("val_metrics", {}).get("val/loss_causal"),
            "forward_flops_per_token": s["flops_per_token"]["forward"],
            # wall clock at the budget: median step x steps (the measurement callbacks included)
            "step_time_s": step_time, "train_time_s": step_time * s["steps"] if step_time is not None else None,
            **run_wall(s), **run_origin(s), "run_dir": s["run_dir"]}


def shape_label(variant: str, n_layer: int, d_model: int) -> str:
    return f"{variant} {n_layer}x{d_model}"


def left_out(configs: Sequence[IsoFlopConfig], variants: Sequence[str], depths: Sequence[int],
             widths: Sequence[int]) -> List[str]:
    """The grid's shapes not in a budget's plan (fewer than min_steps steps, outside the tolerance, or a shape
    the variant cannot build)."""
    planned = {shape_label(c.variant, c.n_layer, c.d_model) for c in configs}
    return [label for v in variants for n in depths for w in widths if (label := shape_label(v, n, w)) not in planned]


def cells_of(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The runs of one budget grouped by (variant, depth, width): each figure over the seeds (``seed_summary``:
    mean, std, bootstrap interval over seeds)."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(shape_label(r["variant"], r["n_layer"], r["d_model"]), []).append(r)
    cells = {}
    for label, rows in groups.items():
        first = rows[0]
        cells[label] = {"variant": first["variant"], "dense": first["variant"] == "vanilla", "n_layer": first["n_layer"],
                        "d_model": first["d_model"], "parameters": first["parameters"],
                        "planned_steps": first["planned_steps"], "steps_seeds": [r["steps"] for r in rows],
                        "train_flops_per_token": first["train_flops_per_token"],
                        "forward_flops_per_token": first["forward_flops_per_token"],
                        "matched": all(r["matched"] for r in rows),
                        "max_deviation": max(r["measured_deviation"] for r in rows),
                        "noncausal": first["val_loss_causal"] is not None,
                        **{key: stats.seed_summary([r[key] for r in rows])
                           for key in ("val_loss", "val_loss_noncausal", "train_time_s", "measured_flops")}}
    return cells


def budget_analysis(budget: float, cells: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One budget: the best dense shape (lowest seed-mean loss), whether the dense curve turns inside the grid
    (``grid_bracket``; and each depth's curve over widths), and every routed shape against the best dense
    model (one-sided Welch over seeds, Holm over the routed shapes; difference with its bootstrap interval,
    Hedges' g) and against vanilla of its own shape (the second column)."""
    dense = {k: c for k, c in cells.items() if c["dense"]}
    routed = {k: c for k, c in cells.items() if not c["dense"]}
    best = stats.lowest_mean({k: c["val_loss"]["mean"] for k, c in dense.items()})
    loss = {k: c["val_loss"]["seeds"] for k, c in routed.items()}
    tests = stats.against_baseline(loss, dense[best]["val_loss"]["seeds"], "less")
    same = {k: shape_label("vanilla", c["n_layer"], c["d_model"]) for k, c in routed.items()}
    same_shape = stats.with_holm({k: stats.compare_groups(loss[k], dense[same[k]]["val_loss"]["seeds"], "less")
                                  for k in routed if same[k] in dense})
    depths = sorted({c["n_layer"] for c in dense.values()})
    best_time = dense[best]["train_time_s"]["mean"]
    return {"budget": budget, "cells": cells, "best_dense": best,
            "bracket": grid_bracket({k: (c["n_layer"], c["d_model"]) for k, c in dense.items()},
                                    {k: c["val_loss"]["mean"] for k, c in dense.items()}, best),
            # each depth's curve over widths, ordered by d_model as grid_bracket orders them
            "bracket_by_depth": {n: bracket_verdict([(c["d_model"], c["val_loss"]["mean"]) for c in dense.values()
                                                     if c["n_layer"] == n]) for n in depths},
            "tests": tests, "tests_same_shape": same_shape,
            "train_time_ratio": {k: (c["train_time_s"]["mean"] / best_time if best_time and c["train_time_s"]["mean"]
                                     is not None else None) for k, c in routed.items()},
            "beats_best_dense": sorted(k for k, t in tests.items() if stats.passes(t, ALPHA))}


def _spent_cell(cell: Dict[str, Any]) -> str:
    """The largest measured excess over the budget among the seeds, or why a seed is not at the budget."""
    if not cell["matched"]:
        return "not matched: --max_steps stopped a seed before the budget"
    return f"{100 * cell['max_deviation']:+.2f}%"


def cells_table(analyses: Sequence[Dict[str, Any]]) -> str:
    rows = []
    for a in analyses:
        for label, c in sorted(a["cells"].items(), key=lambda kv: (not kv[1]["dense"], kv[1]["variant"],
                                                                   kv[1]["n_layer"], kv[1]["d_model"])):
            best = " (best dense)" if label == a["best_dense"] else ""
            rows.append([fmt(a["budget"]), label + best, c["parameters"],
                         f"{'/'.join(str(n) for n in c['steps_seeds'])} ({c['planned_steps']})",
                         c["train_flops_per_token"], c["measured_flops"]["mean"], _spent_cell(c),
                         ci_cell(c["val_loss"]["mean"], c["val_loss"]["ci"], 4),
                         ci_cell(c["val_loss_noncausal"]["mean"], c["val_loss_noncausal"]["ci"], 4) if c["noncausal"]
                         else "-", ci_cell(c["train_time_s"]["mean"], c["train_time_s"]["ci"], 1)])
    return markdown_table(["budget", "shape (variant LxD)", "params", "steps per seed (planned)",
                           "planned train FLOPs/token", "FLOPs spent (seed mean)", "spent vs budget (worst seed)",
                           "val loss (MoD: causal) [95% CI]", "val loss, top-k over T [95% CI]",
                           "train time s [95% CI]"], rows)


def tests_table(analyses: Sequence[Dict[str, Any]]) -> str:
    rows = [[fmt(a["budget"]), label, test_cell(t), test_cell(a["tests_same_shape"].get(label)),
             fmt(a["train_time_ratio"][label], 3)] for a in analyses for label, t in a["tests"].items()]
    return markdown_table(["budget", "routed shape", "Δ loss vs best dense [95% CI], g, p (Holm)",
                           "Δ loss vs vanilla of the same shape [95% CI], g, p (Holm)",
                           "train time / best dense's"], rows)


def goal_lines(analyses: Sequence[Dict[str, Any]]) -> List[str]:
    """Per budget: the best dense model, whether the dense curve turns inside the grid, and the corrected verdict."""
    lines = []
    for a in analyses:
        best = a["cells"][a["best_dense"]]
        per_depth = "; ".join(f"n_layer={n}: {v}" for n, v in a["bracket_by_depth"].items())
        beaten = a["beats_best_dense"]
        if a["tests"]:
            verdict = (f"lower validation loss than the best dense model, one-sided Welch over seeds, Holm over the "
                       f"{len(a['tests'])} routed shapes, p < {ALPHA}: {', '.join(beaten) or 'none'}: "
                       f"**{'met' if beaten else 'not met'}**")
        else:  # a vanilla-only grid: nothing to test, and "not met" would claim a test that never ran
            verdict = "no routed shape in the grid: **not tested**"
        lines.append(
            f"- budget {fmt(a['budget'])}: best dense model {a['best_dense']} (loss "
            f"{ci_cell(best['val_loss']['mean'], best['val_loss']['ci'], 4)}); dense isoFLOP curve: "
            f"{a['bracket']} (per depth, over widths: {per_depth}); {verdict}; left out of the grid "
            f"({a.get('left_out_why', LEFT_OUT_WHY)}): {', '.join(a.get('left_out') or []) or 'none'}")
    return lines


def report_sections(tokens: int, depths: Sequence[int], widths: Sequence[int], seeds: int,
                    analyses: Sequence[Dict[str, Any]], grid: Optional[str] = None) -> List[str]:
    grid = grid or (f"depths {list(depths)} x widths {list(widths)}, every variant at every shape it can build "
                    "(vanilla: the dense curve)")
    intro = (f"{tokens} tokens per step; {grid}, {seeds} seeds each. Every run trains until its measured "
             "training FLOPs (routing-aware, every step counted: --max_train_flops) reach the budget; 'FLOPs spent' "
             "is that count, 'spent vs budget' its excess (at most the last step), 'steps per seed (planned)' the "
             "steps each seed took and those the analytic plan predicted. Intervals: 95% percentile bootstrap over "
             "seeds; train time: median step time x steps of each run.")
    return [intro, "", cells_table(analyses), "",
            "Every routed shape against the best dense model of its budget (lowest seed-mean loss) and against "
            "vanilla of the same shape: difference in seed means [95% bootstrap CI, each side's seeds resampled on "
            "their own], Hedges' g over seeds, one-sided Welch t-test over seeds (lower loss) after Holm's "
            "correction over the routed shapes of the budget; training wall clock relative to the best dense "
            "model's:", "", tests_table(analyses), "",
            "Goal lines (computed from the numbers above; 'met' only when the corrected test passes; 'bracketed': "
            "the best dense shape has a narrower and a wider one beside it at its depth, and a shallower and a "
            "deeper one at its width when the grid has several depths, so the isoFLOP curve turns inside the grid):", "", *goal_lines(analyses), ""]


def plot_isoflop(ctx: Context, analyses: Sequence[Dict[str, Any]]) -> None:
    """Validation loss over parameters, one panel per budget, one line per variant and depth, 95% intervals."""
    fig, axes = figure(1, len(analyses), width=5.6, height=4.4)
    for ax, a in zip(axes[0], analyses):
        lines = sorted({(c["variant"], c["n_layer"]) for c in a["cells"].values()})
        depths = sorted({n for _, n in lines})
        for variant, n_layer in lines:
            cells = sorted((c for c in a["cells"].values() if (c["variant"], c["n_layer"]) == (variant, n_layer)),
                           key=lambda c: c["parameters"])
            means = [c["val_loss"]["mean"] for c in cells]
            ax.errorbar([c["parameters"] for c in cells], means, yerr=error_bars([c["val_loss"] for c in cells]), capsize=3, marker="o",
                        linestyle="-" if variant == "vanilla" else "--", color=f"C{depths.index(n_layer)}",
                        label=f"{variant}, n_layer={n_layer}")
        best = a["cells"][a["best_dense"]]
        ax.scatter([best["parameters"]], [best["val_loss"]["mean"]], marker="*", s=160, color="black", zorder=5,
                   label=f"best dense ({a['best_dense']})")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("validation loss, seed mean [95% CI] (MoD: causal)")
        turns = "bracketed" if is_bracketed(a["bracket"]) else "not bracketed"
        ax.set_title(f"budget {a['budget']:.2e} training FLOPs ({turns})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.save_figure(fig, "mod_isoflop")

