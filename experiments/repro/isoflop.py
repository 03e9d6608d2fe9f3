"""MoD isoFLOP comparison (Raposo et al. 2024, arXiv 2404.02258, Figures 3-4).

For each training-FLOP budget, every model (variant x width) trains until its *measured* training FLOPs
reach the budget (``--max_train_flops``: the routing-aware count of every step, docs/compute-budget.md),
so a router that spends more or less than planned still ends at the budget; ``--max_steps`` is only a cap
(``BUDGET_STEP_CAP`` x the planned steps). The plan, ``steps = round(budget / (tokens_per_step *
training FLOPs per token))`` from the model's analytic ``flops_per_token().training`` (fwd + bwd = 3 x
fwd, MoD's capacity and routed blocks included), chooses the grid: configurations that would need fewer
than ``min_steps`` steps are left out (a run overshoots the budget by at most its last step, under
``1 / min_steps``), and a budget too small for the smallest model of a variant is an error before any
run starts. The plot is validation loss vs parameters, one curve per variant and budget (the paper's
isoFLOP curves).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from callbacks.run_summary import headline_val_loss, noncausal_val_loss
from experiments.repro.common import Context, budget_spent, budget_step_cap, figure, fmt, markdown_table

TOLERANCE = 0.05


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
                    min_steps: int = 20, tolerance: float = TOLERANCE) -> List[IsoFlopConfig]:
    """Every (variant, width) that can spend ``budget`` training FLOPs in at least ``min_steps`` steps.

    ``base`` supplies everything else (size, vocabulary, block size, and its own variant's config groups: a
    config holds only those, so another variant gets its preset).
    Raises ``ConfigError`` when the budget is not positive or too small for a variant's smallest model.
    """
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ConfigError(f"budget: must be a positive number of FLOPs, got {budget!r}")
    if tokens_per_step <= 0:
        raise ConfigError(f"tokens_per_step: must be positive, got {tokens_per_step}")
    if not variants or not widths:
        raise ConfigError("isoflop: the grid is empty (no variants or no widths)")
    if min_steps < math.ceil(0.5 / tolerance):
        raise ConfigError(f"min_steps: {min_steps} steps cannot guarantee {tolerance:.0%} accuracy; use >= "
                          f"{math.ceil(0.5 / tolerance)}")
    resolved = base.resolve()
    n_layer = n_layer or resolved.n_layer
    n_head = n_head or resolved.n_head
    bad = [w for w in widths if w <= 0 or w % n_head]
    if bad:
        raise ConfigError(f"widths: {bad} are not positive multiples of n_head={n_head}")
    configs = []
    for variant in variants:
        fitting = []
        costs = {w: model_cost(resolved, variant, w, n_layer, n_head) for w in sorted(widths)}
        for width, (params, per_token) in costs.items():
            steps = round(budget / (tokens_per_step * per_token))
            if steps < min_steps:
                continue
            config = IsoFlopConfig(variant, width, n_layer, n_head, params, per_token, tokens_per_step, steps, budget)
            if abs(config.deviation) <= tolerance:
                fitting.append(config)
        if not fitting:
            smallest = min(costs)
            need = min_steps * tokens_per_step * costs[smallest][1]
            raise ConfigError(f"budget: {budget:.3e} FLOPs is too small for the smallest {variant} model "
                              f"(d_model={smallest}): {min_steps} steps of {tokens_per_step} tokens need {need:.3e}")
        configs.extend(fitting)
    return configs


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


def isoflop_experiment(ctx: Context, budgets: Optional[Sequence[float]] = None, widths: Optional[Sequence[int]] = None,
                       n_layer: Optional[int] = None, variants: Sequence[str] = ("vanilla", "mod"),
                       min_steps: int = 20) -> Dict[str, Any]:
    from architectures import variant_names

    unknown = [v for v in variants if v not in variant_names()]
    if unknown:
        raise ConfigError(f"--variants: unknown {unknown}; valid variants: {', '.join(variant_names())}")
    _, base, tokens = run_geometry(ctx)
    widths = list(widths or default_widths(base.d_model, base.n_head))
    if budgets is None:
        _, reference = model_cost(base, "vanilla", base.d_model, n_layer or base.n_layer, base.n_head)
        budgets = [0.5 * ctx.steps * tokens * reference, ctx.steps * tokens * reference]
    plan = {b: isoflop_configs(b, base, tokens, variants, widths, n_layer, min_steps=min_steps) for b in budgets}
    for budget, configs in plan.items():
        ctx.validate([c.run_options() for c in configs], budget=budget)
    jobs = [(budget, c) for budget, configs in plan.items() for c in configs]
    summaries = ctx.run_many([(c.run_options(), budget_step_cap(budget, tokens, c.flops_per_token), budget)
                              for budget, c in jobs])
    rows = [isoflop_row(budget, c, s) for (budget, c), s in zip(jobs, summaries)]
    table = markdown_table(
        ["budget", "variant", "d", "params", "steps (planned)", "planned train FLOPs/token", "FLOPs spent",
         "spent vs budget", "val loss (MoD: causal)", "val loss, top-k over T", "step s"],
        [[r["budget"], r["variant"], r["d_model"], r["parameters"], f"{r['steps']} ({r['planned_steps']})",
          r["train_flops_per_token"], r["measured_flops"], _spent_cell(r), r["val_loss"],
          r["val_loss_noncausal"] if r["val_loss_causal"] is not None else "-", r["step_time_s"]] for r in rows])
    sections = [f"{tokens} tokens per step; n_layer={n_layer or base.n_layer}; widths {widths}. Every run trains until "
                "its measured training FLOPs (routing-aware, every step counted: --max_train_flops) reach the budget; "
                "'FLOPs spent' is that count, 'spent vs budget' its excess (at most the last step), 'steps (planned)' "
                "the steps it took and those the analytic plan predicted.", "", table, "",
                "Observations (computed from the numbers above):", "",
                *isoflop_observations(rows), ""]
    plot_isoflop(ctx, plan, variants, rows)
    ctx.log_table("mod_isoflop", table)
    results = {"tokens_per_step": tokens, "budgets": list(plan), "widths": widths, "runs": rows}
    ctx.write_report("MoD isoFLOP comparison", sections, results)
    return results


def isoflop_row(budget: float, c, s: Dict[str, Any]) -> Dict[str, Any]:
    """One run's row: its plan ``c`` at ``budget`` and its summary ``s``."""
    spent = budget_spent(s)
    return {"budget": budget, "variant": c.variant, "d_model": c.d_model, "n_layer": c.n_layer,
            "parameters": s["parameters"], "steps": s["steps"], "planned_steps": c.steps,
            "train_flops_per_token": c.flops_per_token, "planned_flops": c.total_flops,
            "planned_deviation": c.deviation, "measured_flops": spent["train_flops"],
            "measured_deviation": spent["spent_deviation"], "matched": spent["matched"],
            # routing decided as in generation (MoD's causal loss): what the curves compare
            "val_loss": headline_val_loss(s), "val_loss_noncausal": noncausal_val_loss(s),
            "val_loss_causal": s.get("val_metrics", {}).get("val/loss_causal"),
            "forward_flops_per_token": s["flops_per_token"]["forward"],
            "step_time_s": s["median_step_time_s"], "run_dir": s["run_dir"]}


def plot_isoflop(ctx: Context, plan: Dict[float, Any], variants: Sequence[str], rows: Sequence[Dict[str, Any]]) -> None:
    """Validation loss over parameters, one curve per budget and variant."""
    fig, axes = figure(1, 1, width=6.0, height=4.2)
    ax = axes[0, 0]
    colours = {b: f"C{i}" for i, b in enumerate(plan)}
    for budget in plan:
        for variant, style in zip(variants, ("-", "--", ":", "-.")):
            points = sorted((r["parameters"], r["val_loss"]) for r in rows if r["budget"] == budget and r["variant"] == variant)
            if points:
                ax.plot(*zip(*points), style, marker="o", color=colours[budget], label=f"{variant}, {budget:.2e} FLOPs")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("validation loss (MoD: causal routing, as in generation)")
    ax.legend(fontsize=7)
    ax.set_title("isoFLOP curves: MoD vs vanilla at matched measured FLOPs")
    ctx.save_figure(fig, "mod_isoflop")


def _spent_cell(row: Dict[str, Any]) -> str:
    """The measured excess over the budget, or why the run is not at the budget."""
    if not row["matched"]:
        return f"not matched: --max_steps stopped it at {100 * (row['measured_deviation'] + 1):.1f}% of the budget"
    return f"{100 * row['measured_deviation']:+.2f}%"


def isoflop_observations(rows: List[Dict[str, Any]]) -> List[str]:
    lines = []
    for budget in sorted({r["budget"] for r in rows}):
        best = {}
        for r in rows:
            if r["budget"] == budget and (r["variant"] not in best or r["val_loss"] < best[r["variant"]]["val_loss"]):
                best[r["variant"]] = r
        if "vanilla" not in best:
            continue
        v = best["vanilla"]
        for name, r in best.items():
            if name == "vanilla":
                continue
            lines.append(
                f"- budget {budget:.2e}: best vanilla d={v['d_model']} loss {v['val_loss']:.4f}; best {name} d={r['d_model']} "
                f"loss {r['val_loss']:.4f} ({100 * (r['val_loss'] - v['val_loss']) / v['val_loss']:+.2f}%), "
                f"forward FLOPs/token {fmt(r['forward_flops_per_token'] / v['forward_flops_per_token'], 3)}x, "
                f"step time {fmt(r['step_time_s'] / v['step_time_s'], 3)}x of that vanilla.")
    return lines
