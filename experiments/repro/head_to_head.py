"""Every variant at equal measured training FLOPs: validation loss (training runs), FLOPs per token
(routing-aware, from each run's summary), and step time + memory from ``experiments.bench`` (all variants
timed in one process, repetitions interleaved so machine noise hits them alike; CPU memory = parameters,
gradients, AdamW state and the activations saved for backward; CUDA memory = peak allocated).

The budget is what vanilla spends in ``--steps`` steps; every variant trains until its measured count
reaches it (``--max_train_flops``, docs/compute-budget.md), with ``--max_steps`` only a cap."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from architectures.config import ConfigError
from callbacks.run_summary import causal_flops_per_token, headline_val_loss, noncausal_val_loss
from experiments.repro.common import Context, budget_spent, budget_step_cap, figure, fmt, markdown_table

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


def _vs_budget(row: Dict[str, Any]) -> str:
    if not row["matched"]:
        return f"not matched: --max_steps stopped it at {100 * (row['spent_deviation'] + 1):.1f}%"
    return f"{100 * row['spent_deviation']:+.2f}%"


def check_variants(variants: Optional[Sequence[str]], bench_steps: int) -> List[str]:
    """The variants to compare, vanilla first (every ratio is relative to it); unknown ones refused."""
    from architectures import variant_names

    variants = list(variants) if variants is not None else variant_names()
    unknown = [v for v in variants if v not in variant_names()]
    if unknown or not variants:
        raise ConfigError(f"--variants: unknown {unknown or 'empty list'}; valid variants: {', '.join(variant_names())}")
    if bench_steps <= 0:
        raise ConfigError(f"--bench_steps: must be a positive integer, got {bench_steps}")
    return ["vanilla", *[v for v in variants if v != "vanilla"]]


def result_row(v: str, s: Dict[str, Any], b: Dict[str, Any], reference: float) -> Dict[str, Any]:
    """One variant's row: its training run's summary ``s`` and its bench timing ``b``."""
    # routing that sees the future is compared by its causal loss (as it would generate), at the causal
    # evaluation's FLOPs; the training-time (non-causal) loss stays in the row
    causal_flops = causal_flops_per_token(s)
    return {"variant": v, "parameters": s["parameters"], "steps": s["steps"], **budget_spent(s),
            "val_loss": headline_val_loss(s),
            "causal": "val/loss_causal" in (s.get("val_metrics") or {}),
            "val_loss_noncausal": noncausal_val_loss(s),
            "val_loss_delta": headline_val_loss(s) - reference,
            "causal_flops_ratio": causal_flops["ratio_to_vanilla"] if causal_flops else None,
            "flops_per_token": s["flops_per_token"]["forward"], "flops_ratio": s["flops_per_token"]["ratio_to_vanilla"],
            "run_step_s": s["median_step_time_s"], "bench_step_s": b["median_step_s"],
            "step_time_ratio": b["step_time_ratio"], "memory_mb": b["memory_mb"], "memory_ratio": b["memory_ratio"],
            "run_dir": s["run_dir"]}


def result_table(rows: Sequence[Dict[str, Any]]) -> str:
    return markdown_table(
        ["variant", "params", "steps", "train FLOPs spent", "vs budget", "val loss", "vs vanilla", "non-causal val loss",
         "fwd FLOPs/token", "FLOPs x", "causal FLOPs x", "run step s", "bench step ms", "time x", "memory MB", "memory x"],
        [[r["variant"] + (" (causal)" if r["causal"] else ""), r["parameters"], r["steps"], r["train_flops"],
          _vs_budget(r), r["val_loss"], f"{r['val_loss_delta']:+.4f}", r["val_loss_noncausal"] if r["causal"] else "-",
          r["flops_per_token"], r["flops_ratio"],
          r["causal_flops_ratio"] if r["causal_flops_ratio"] is not None else "-", r["run_step_s"],
          1000 * r["bench_step_s"], r["step_time_ratio"], r["memory_mb"], r["memory_ratio"]] for r in rows])


def explanation(budget: float, steps: int, tokens: int, bench_steps: int) -> str:
    return (f"Every variant trains until its measured training FLOPs (routing-aware, every step counted) reach "
            f"{fmt(budget)}, what vanilla spends in {steps} steps of {tokens} tokens; same data order and seed. "
            "'vs budget': the count's excess over the budget (at most its last step). 'val loss': the causal "
            "validation loss (`val/loss_causal`, routing decided as in generation) for variants marked "
            "'(causal)', whose training-time routing sees later tokens; their non-causal `val/loss` is in its own "
            "column, and 'causal FLOPs x' is the forward FLOPs per token of that causal evaluation over vanilla's "
            "('FLOPs x': the last training step's). 'run step s': median step of the training run (includes the "
            f"measurement callbacks); 'bench': {bench_steps} interleaved steps per variant in one process, batch "
            "and context as in the runs.")


def plot_rows(ctx: Context, rows: Sequence[Dict[str, Any]]) -> None:
    """Loss against FLOPs per token; step time and memory, each over vanilla's."""
    fig, axes = figure(1, 2, width=5.5)
    ax = axes[0, 0]
    ax.scatter([r["flops_ratio"] for r in rows], [r["val_loss"] for r in rows])
    for r in rows:
        ax.annotate(r["variant"], (r["flops_ratio"], r["val_loss"]), fontsize=7)
    ax.set_xlabel("forward FLOPs / token (x vanilla)")
    ax.set_ylabel("validation loss")
    ax = axes[0, 1]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [r["step_time_ratio"] for r in rows], 0.4, label="step time x vanilla")
    ax.bar([p + 0.2 for p in positions], [r["memory_ratio"] or 0.0 for r in rows], 0.4, label="memory x vanilla")
    ax.set_xticks(list(positions), [r["variant"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.save_figure(fig, "head_to_head")


def head_to_head(ctx: Context, variants: Optional[Sequence[str]] = None, bench_steps: int = 5) -> Dict[str, Any]:
    from experiments import bench
    from experiments.repro.isoflop import model_cost, run_geometry

    variants = check_variants(variants, bench_steps)
    cfg, base, tokens = run_geometry(ctx)
    planned = {v: model_cost(base, v, base.d_model, base.n_layer, base.n_head)[1] for v in variants}
    budget = ctx.steps * tokens * planned["vanilla"]  # vanilla's --steps steps: what its count measures too
    ctx.validate([["--variant", v] for v in variants], budget=budget)
    summaries = dict(zip(variants, ctx.run_many([(["--variant", v], budget_step_cap(budget, tokens, planned[v]), budget)
                                                 for v in variants])))
    timing = bench.run(bench.parse_args([
        "--variants", ",".join(variants), "--size", ctx.size, "--steps", str(bench_steps), "--warmup", "1",
        "--batch_size", str(cfg.data.batch_size), "--seq_len", str(base.block_size), "--vocab_size", str(base.vocab_size),
        "--seed", str(ctx.seed), "--no_hf", *bench_options(ctx.run_options)]))
    reference = headline_val_loss(summaries["vanilla"])
    rows = [result_row(v, summaries[v], timing[v], reference) for v in variants]
    table = result_table(rows)
    sections = [explanation(budget, ctx.steps, tokens, bench_steps), "", table, ""]
    plot_rows(ctx, rows)
    ctx.log_table("head_to_head", table)
    results = {"steps": ctx.steps, "budget": budget, "tokens_per_step": tokens, "variants": variants, "runs": rows}
    ctx.write_report("Head-to-head: every variant at equal measured training FLOPs", sections, results)
    return results
