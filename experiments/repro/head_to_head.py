"""Every variant at equal measured training FLOPs, against dense controls: validation loss (training runs,
``--seeds`` seeds each), FLOPs per token (routing-aware, from each run's summary), the training wall clock
(median step x steps), and step time + memory from ``experiments.bench`` (the reference vanilla and every routed
entry, with its own options, timed in one process, repetitions interleaved so machine noise hits them alike; CPU memory =
parameters, gradients, AdamW state and the activations saved for backward; CUDA memory = peak allocated).

The budget is what vanilla spends in ``--steps`` steps; every entry trains until its measured count
reaches it (``--max_train_flops``, docs/compute-budget.md), with ``--max_steps`` only a cap. Dense controls
(``--dense_shapes LxD,...``, vanilla of other depths and widths; default fewer layers, narrower, both, twice
the depth when a routed variant plans more FLOPs per token than vanilla, and the reference depth at halved widths
down to one head dimension) train to the same budget, and the report says whether they bracket the best dense
shape (its width curve turns inside the grid, ``analysis.dense_grid.grid_bracket``):
"beats vanilla" means beats the best dense model (lowest seed-mean loss), tested per routed entry with a
one-sided Welch test over seeds, Holm over the routed entries, Hedges' g and the difference with its
bootstrap interval over seeds (``analysis/stats.py``); the reference vanilla is the second column."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from architectures.config import ConfigError
from callbacks.run_summary import causal_flops_per_token, headline_val_loss, noncausal_val_loss
from analysis import stats
from analysis.tables import ci_cell, error_bars, test_cell
from analysis.dense_grid import dense_grid_line
from analysis.provenance import origin_lines, run_origin
from analysis.wall_time import run_wall, wall_time_lines
from experiments.repro.common import (Context, Entry, budget_spent, budget_step_cap, dense_entries, dense_grid,
                                     entry_cost, figure, fmt, markdown_table, narrower_width, parse_entry,
                                     parse_shapes)

ALPHA = 0.05  # the level of the corrected tests against the best dense model

_NOT_MODEL = {"variant", "size"}


def bench_options(run_options: Sequence[str]) -> List[str]:
    """``--model.X V`` / ``--model.X=V`` run options as ``experiments.bench --set X=V``."""
    out, items = [], list(run_options)
    for i, item in enumerate(items):
        if not item.startswith("--model."):
            continue
        key, sep, value = item[len("--model."):].partition("=")
        if not sep:
            if i + 1 >= len(items):
                continue
            value = items[i + 1]
        if key not in _NOT_MODEL:
            out += ["--set", f"{key}={value}"]
    return out


def check_entries(variants: Optional[Sequence[str]], bench_steps: int) -> List[Entry]:
    """The entries to compare, vanilla first (every ratio is relative to it): registry names (``mod``) or a
    variant with its own model options (``mod:n_layer=8:capacity=0.125``, as ``experiments.repro probe``
    takes them); unknown names and options refused before anything trains."""
    from architectures import variant_names

    texts = list(variants) if variants is not None else variant_names()
    if not texts:
        raise ConfigError(f"--variants: the list is empty; valid variants: {', '.join(variant_names())}")
    if bench_steps <= 0:
        raise ConfigError(f"--bench_steps: must be a positive integer, got {bench_steps}")
    return [parse_entry(text) for text in dict.fromkeys(["vanilla", *texts])]


def benchmarked(entry: Entry) -> bool:
    """The reference vanilla and every routed entry are timed in the interleaved benchmark; dense controls of
    other shapes are not (their cost is their FLOPs, read from their runs)."""
    return not entry.dense or entry.label == "vanilla"


def bench_label(entry: Entry) -> str:
    """The entry as ``experiments.bench`` names a variant with its own overrides: ``mod@n_layer=8@mod.capacity=0.125``."""
    return "".join([entry.variant, *(f"@{key}={value}" for key, value in entry.model)])


def default_dense_shapes(n_layer: int, d_model: int, n_head: int, deeper: bool) -> List[Tuple[int, int]]:
    """Dense controls whose FLOPs per token span the routed entries': fewer layers, narrower, both (all below the
    reference's), twice the depth when ``deeper`` (a routed entry plans more training FLOPs per token than the
    reference vanilla), and the reference depth at halved widths down to ``n_head``: at a small budget the
    isoFLOP-optimal dense model is far narrower than the reference (4 x 8 at 4 x 64's 300 steps,
    docs/results.md), and a claim against "the best dense model" needs the width curve to turn inside the grid.
    The halved widths are at the reference depth only, so when one of them is best the depth axis at its width
    has one shape and the report's verdict says "not bracketed ... (over the depths at d_model=D)": add
    ``--dense_shapes`` at that width and other depths to settle it."""
    fewer, narrower = max(1, n_layer // 2), narrower_width(d_model, n_head)
    shapes = [(fewer, d_model), (n_layer, narrower), (fewer, narrower)] + ([(2 * n_layer, d_model)] if deeper else [])
    return list(dict.fromkeys(shapes + [(n_layer, width) for width in halved_widths(d_model, n_head)]))


def halved_widths(d_model: int, n_head: int) -> List[int]:
    """d/2, d/4, ... while a positive multiple of ``n_head`` (at least one head dimension each)."""
    widths, width = [], d_model // 2
    while width >= n_head and width % n_head == 0:
        widths.append(width)
        width //= 2
    return widths


def programme_entries(entries: Sequence[Entry], dense_shapes: Optional[str], base,
                      planned: Dict[str, float]) -> List[Entry]:
    """The reference vanilla, the dense controls (``--dense_shapes`` or ``default_dense_shapes``), the other
    entries (``planned``: each entry's training FLOPs per token by label)."""
    reference = (base.n_layer, base.d_model)
    shapes = (parse_shapes(dense_shapes, base.n_head) if dense_shapes else
              default_dense_shapes(*reference, base.n_head, deeper=max(planned.values()) > planned["vanilla"]))
    dense = [parse_entry(text) for text in dense_entries(shapes, reference)]
    unique = {e.label: e for e in [parse_entry("vanilla"), *dense, *entries]}
    return list(unique.values())


def seed_row(entry: Entry, seed: int, s: Dict[str, Any]) -> Dict[str, Any]:
    """One training run of an entry: its summary ``s`` as the figures the tables aggregate over seeds."""
    # routing that sees the future is compared by its causal loss (as it would generate), at the causal
    # evaluation's FLOPs; the training-time (non-causal) loss stays in the row
    causal_flops = causal_flops_per_token(s)
    step_time = s["median_step_time_s"]
    return {"variant": entry.label, "registry_variant": entry.variant, "dense": entry.dense, "seed": seed,
            "parameters": s["parameters"], "steps": s["steps"], **budget_spent(s), "val_loss": headline_val_loss(s),
            "causal": "val/loss_causal" in (s.get("val_metrics") or {}), "val_loss_noncausal": noncausal_val_loss(s),
            "causal_flops_ratio": causal_flops["ratio_to_vanilla"] if causal_flops else None,
            "flops_per_token": s["flops_per_token"]["forward"], "run_step_s": step_time,
            "train_time_s": step_time * s["steps"] if step_time is not None else None, **run_wall(s),
            **run_origin(s), "run_dir": s["run_dir"]}


def entry_row(rows: Sequence[Dict[str, Any]], b: Optional[Dict[str, Any]], reference_flops: float) -> Dict[str, Any]:
    """An entry's seeds aggregated (``seed_summary``: mean, std, bootstrap interval over seeds) with its bench
    timing ``b`` (None: a dense control of another shape, not benchmarked)."""
    first = rows[0]
    out = {key: first[key] for key in ("variant", "registry_variant", "dense", "parameters", "causal", "budget",
                                       "causal_flops_ratio", "flops_per_token")}
    out.update({key: stats.seed_summary([r[key] for r in rows])
                for key in ("val_loss", "val_loss_noncausal", "train_time_s", "train_flops", "run_step_s")})
    out.update(steps_seeds=[r["steps"] for r in rows], matched=all(r["matched"] for r in rows),
               spent_deviation=max(r["spent_deviation"] for r in rows), flops_ratio=first["flops_per_token"] / reference_flops,
               bench_step_s=b["median_step_s"] if b else None, step_time_ratio=b["step_time_ratio"] if b else None,
               memory_mb=b["memory_mb"] if b else None, memory_ratio=b["memory_ratio"] if b else None,
               run_dirs=[r["run_dir"] for r in rows])
    return out


def dense_comparison(entries: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The best dense entry (lowest seed-mean loss) and every routed entry against it and against the reference
    vanilla: difference [bootstrap CI], Hedges' g, one-sided Welch over seeds, Holm over the routed entries."""
    by_label = {e["variant"]: e for e in entries}
    best = stats.lowest_mean({k: e["val_loss"]["mean"] for k, e in by_label.items() if e["dense"]})
    routed = {k: e["val_loss"]["seeds"] for k, e in by_label.items() if not e["dense"]}
    tests = stats.against_baseline(routed, by_label[best]["val_loss"]["seeds"], "less")
    best_time = by_label[best]["train_time_s"]["mean"]
    return {"best_dense": best, "loss": tests,
            "loss_vs_reference": stats.against_baseline(routed, by_label["vanilla"]["val_loss"]["seeds"], "less"),
            "train_time_ratio": {k: by_label[k]["train_time_s"]["mean"] / best_time
                                 if best_time and by_label[k]["train_time_s"]["mean"] is not None else None
                                 for k in routed},
            "beats_best_dense": sorted(k for k, t in tests.items() if stats.passes(t, ALPHA))}


def _vs_budget(row: Dict[str, Any]) -> str:
    if not row["matched"]:
        return "not matched: --max_steps stopped a seed before the budget"
    return f"{100 * row['spent_deviation']:+.2f}%"


def result_table(entries: Sequence[Dict[str, Any]], tests: Dict[str, Any]) -> str:
    """Loss, the tests against the best dense model and the reference vanilla, and wall clock at the budget."""
    def cell(r, key, digits=4):
        return ci_cell(r[key]["mean"], r[key]["ci"], digits)

    return markdown_table(
        ["entry", "params", "steps per seed", "train FLOPs spent (mean)", "vs budget (worst seed)", "val loss [95% CI]",
         f"Δ loss vs best dense ({tests['best_dense']}) [95% CI], g, p (Holm)",
         "Δ loss vs vanilla (reference) [95% CI], g, p (Holm)", "non-causal val loss", "train time s [95% CI]",
         "train time / best dense's"],
        [[r["variant"] + (" (causal)" if r["causal"] else "") + (" (best dense)" if r["variant"] == tests["best_dense"]
                                                                 else ""), r["parameters"],
          "/".join(str(n) for n in r["steps_seeds"]), r["train_flops"]["mean"], _vs_budget(r), cell(r, "val_loss"),
          test_cell(tests["loss"].get(r["variant"])), test_cell(tests["loss_vs_reference"].get(r["variant"])),
          cell(r, "val_loss_noncausal") if r["causal"] else "-", cell(r, "train_time_s", 1),
          fmt(tests["train_time_ratio"].get(r["variant"]), 3)] for r in entries])


def cost_table(entries: Sequence[Dict[str, Any]]) -> str:
    """FLOPs per token, run step time, and the interleaved benchmark's step time and memory."""
    return markdown_table(
        ["entry", "fwd FLOPs/token", "FLOPs x", "causal FLOPs x", "run step s (seed mean)", "bench step ms", "time x",
         "memory MB", "memory x"],
        [[r["variant"], r["flops_per_token"], r["flops_ratio"],
          r["causal_flops_ratio"] if r["causal_flops_ratio"] is not None else "-", r["run_step_s"]["mean"],
          1000 * r["bench_step_s"] if r["bench_step_s"] is not None else "-", r["step_time_ratio"], r["memory_mb"],
          r["memory_ratio"]] for r in entries])


def explanation(budget: float, steps: int, tokens: int, bench_steps: int, seeds: int) -> str:
    return (f"Every entry trains {seeds} seeds until its measured training FLOPs (routing-aware, every step counted) "
            f"reach {fmt(budget)}, what the reference vanilla spends in {steps} steps of {tokens} tokens; seeds "
            "from --seed on, the same data order per seed. Dense controls (`dense:LxD`, vanilla of n_layer L and "
            "width D) and the reference vanilla are the dense models; 'best dense': the lowest seed-mean loss. "
            "Intervals: 95% percentile bootstrap over seeds; tests: one-sided Welch over seeds (lower loss), Holm "
            "over the routed entries, Hedges' g. 'vs budget': the count's excess over the budget (at most its last "
            "step). 'val loss': the causal validation loss (`val/loss_causal`, routing decided as in generation) for "
            "entries marked '(causal)', whose training-time routing sees later tokens; their non-causal `val/loss` "
            "is in its own column, and 'causal FLOPs x' is the forward FLOPs per token of that causal evaluation "
            "over vanilla's ('FLOPs x': the last training step's, over the reference vanilla's). 'train time': "
            "median step time x steps of each run (the wall clock at matched FLOPs, measurement callbacks "
            f"included); 'bench': {bench_steps} interleaved steps per registered variant at the reference shape in "
            "one process, batch and context as in the runs (dense controls of other shapes: '-').")


def plot_rows(ctx: Context, rows: Sequence[Dict[str, Any]]) -> None:
    """Loss (seed mean, 95% CI) against FLOPs per token; step time and memory, each over vanilla's."""
    fig, axes = figure(1, 2, width=5.5)
    ax = axes[0, 0]
    for dense, marker in ((True, "s"), (False, "o")):
        group = [r for r in rows if bool(r["dense"]) == dense]
        ax.errorbar([r["flops_ratio"] for r in group], [r["val_loss"]["mean"] for r in group],
                    yerr=error_bars([r["val_loss"] for r in group]), fmt=marker, capsize=3,
                    label="dense" if dense else "routed")
    for r in rows:
        ax.annotate(r["variant"], (r["flops_ratio"], r["val_loss"]["mean"]), fontsize=7)
    ax.set_xlabel("forward FLOPs / token (x reference vanilla)")
    ax.set_ylabel("validation loss, seed mean [95% CI]")
    ax.legend(fontsize=7)
    benched = [r for r in rows if r["step_time_ratio"] is not None]
    ax = axes[0, 1]
    positions = range(len(benched))
    ax.bar([p - 0.2 for p in positions], [r["step_time_ratio"] for r in benched], 0.4, label="step time x vanilla")
    ax.bar([p + 0.2 for p in positions], [r["memory_ratio"] or 0.0 for r in benched], 0.4, label="memory x vanilla")
    ax.set_xticks(list(positions), [r["variant"] for r in benched], rotation=60, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.save_figure(fig, "head_to_head")


def train_entries(ctx: Context, entries: Sequence[Entry], costs: Dict[str, float], budget: float, tokens: int,
                  seeds: int) -> List[Dict[str, Any]]:
    """Every (entry, seed) trained until its measured FLOPs reach the budget, or reused (runs.json)."""
    grid = [(e, ctx.seed + i) for e in entries for i in range(seeds)]
    ctx.validate([[*e.run_options(), "--seed", str(ctx.seed)] for e in entries], budget=budget)
    summaries = ctx.run_many([([*e.run_options(), "--seed", str(seed)], budget_step_cap(budget, tokens, costs[e.label]),
                               budget) for e, seed in grid])
    return [seed_row(e, seed, s) for (e, seed), s in zip(grid, summaries)]


def goal_line(tests: Dict[str, Any]) -> str:
    beaten = tests["beats_best_dense"]
    return (f"- lower validation loss than the best dense model ({tests['best_dense']}) at the same measured training "
            f"FLOPs, one-sided Welch over seeds, Holm over the {len(tests['loss'])} routed entries, p < {ALPHA}: "
            f"{', '.join(beaten) or 'none'}: **{'met' if beaten else 'not met'}**")


def head_to_head(ctx: Context, variants: Optional[Sequence[str]] = None, bench_steps: int = 5, seeds: int = 5,
                 dense_shapes: Optional[str] = None) -> Dict[str, Any]:
    from experiments.repro.isoflop import run_geometry

    compared = check_entries(variants, bench_steps)
    if seeds < 1:
        raise ConfigError(f"--seeds: must be a positive integer, got {seeds}")
    cfg, base, tokens = run_geometry(ctx)
    planned = {e.label: entry_cost(ctx, e, base.vocab_size) for e in compared}
    budget = ctx.steps * tokens * planned["vanilla"]  # vanilla's --steps steps: what its count measures too
    entries = programme_entries(compared, dense_shapes, base, planned)
    costs = {e.label: planned.get(e.label) or entry_cost(ctx, e, base.vocab_size) for e in entries}
    with ctx.part("training"):
        runs = train_entries(ctx, entries, costs, budget, tokens, seeds)
    with ctx.part("benchmark"):
        timing = benchmark(ctx, cfg, base, [bench_label(e) for e in compared if benchmarked(e)], bench_steps)
    with ctx.part("tables"):
        reference_flops = next(r["flops_per_token"] for r in runs if r["variant"] == "vanilla")
        rows = [entry_row([r for r in runs if r["variant"] == e.label],
                          timing[bench_label(e)] if benchmarked(e) else None, reference_flops)
                for e in entries]
        tests = dense_comparison(rows)
        verdict = dense_grid({r["variant"]: r["val_loss"]["mean"] for r in rows if r["dense"]},
                             (base.n_layer, base.d_model), tests["best_dense"])
        sections = [explanation(budget, ctx.steps, tokens, bench_steps, seeds), "",
                    dense_grid_line(tests["best_dense"], verdict), "", result_table(rows, tests), "",
                    cost_table(rows), "", "Goal line (computed from the numbers above; 'met' only when the corrected "
                    "test passes):", "", goal_line(tests), "",
                    *wall_time_lines(runs, lambda r: r["variant"], ctx.workers), *origin_lines(runs)]
        plot_rows(ctx, rows)
        ctx.log_table("head_to_head", "\n".join(sections))
    results = {"steps": ctx.steps, "budget": budget, "tokens_per_step": tokens, "seeds": seeds,
               "variants": [e.label for e in compared],
               "entries": rows, "best_dense": tests["best_dense"], "dense_grid": verdict, "tests": tests, "runs": runs}
    ctx.write_report("Head-to-head: every variant at equal measured training FLOPs, with dense controls",
                     sections, results)
    return results


def benchmark(ctx: Context, cfg, base, variants: Sequence[str], bench_steps: int) -> Dict[str, Dict[str, Any]]:
    """Step time and memory of the compared entries (``bench_label``s) at the reference shape and their own
    options, interleaved in one process."""
    from experiments import bench

    return bench.run(bench.parse_args([
        "--variants", ",".join(dict.fromkeys(variants)), "--size", ctx.size, "--steps", str(bench_steps), "--warmup", "1",
        "--batch_size", str(cfg.data.batch_size), "--seq_len", str(base.block_size), "--vocab_size", str(base.vocab_size),
        "--seed", str(ctx.seed), "--no_hf", *bench_options(ctx.run_options)]))
