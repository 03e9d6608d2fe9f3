"""MHA vs FFN contribution (Lu et al., NeurIPS 2024, arXiv 2403.02436).

Trains vanilla (FFN 4d), ``ffn_wider`` (FFN ``wide_ratio`` x d) and ``caa`` at total FFN width
``wide_ratio`` x d for each Outer-FFN ratio r, then measures each final model's contribution ratios with
``analysis.contribution.contribution`` (logit lens / linear probe / mutual information over the run's
validation sequences). Out-of-distribution loss comes from two places:

* runs trained on SlimPajama (``-- --data slimpajama --data.path ...``) validate on every non-CC/C4
  subset; those ``val/<subset>/loss`` figures are read from each run's summary;
* ``--ood NAME=PATH`` text files (.txt, or .jsonl with a ``text`` field) are tokenised with the run's
  tokenizer and scored with the trained model (loss per token over non-overlapping blocks).

Paper claims checked: a wider FFN raises the FFN's contribution ratio and lowers the MHA's; lowering
r raises the MHA(+Inner-FFN) contribution and improves out-of-distribution loss.
"""
from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence

from architectures.config import ConfigError
from experiments.repro.common import (Context, checkpoint_of, figure, fmt, load_model, markdown_table, mean_loss,
                                      read_documents, run_tokenizer, text_blocks)


def parse_ood(items: Sequence[str]) -> Dict[str, pathlib.Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--ood: expected NAME=PATH, got {item!r}")
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"--ood {name}: no file {path}")
        out[name] = pathlib.Path(path)
    return out


def grid(wide_ratio: float, ratios: Sequence[float]) -> Dict[str, Dict[str, Any]]:
    w = f"{wide_ratio:g}"
    configs = {"vanilla": {"r": None, "ffn": "4d", "argv": ["--variant", "vanilla"]},
               "ffn_wider": {"r": None, "ffn": f"{w}d", "argv": ["--variant", "ffn_wider", "--model.combo.wide_ffn_ratio", w]}}
    for r in ratios:
        if not 0 < r < 1:
            raise ConfigError(f"--ratios: the Outer-FFN ratio r must be in (0, 1), got {r}")
        configs[f"caa r={r:g}"] = {"r": r, "ffn": f"{r * wide_ratio:g}d outer + {(1 - r) * wide_ratio:g}d inner",
                                   "argv": ["--variant", "caa", "--model.combo.total_ffn_ratio", w,
                                            "--model.combo.outer_ratio", f"{r:g}"]}
    return configs


def ood_losses(run_dir: pathlib.Path, ood: Dict[str, pathlib.Path], max_tokens: int) -> Dict[str, float]:
    if not ood:
        return {}
    model = load_model(run_dir)
    tokenizer = run_tokenizer(run_dir)
    return {name: mean_loss(model, text_blocks(tokenizer, read_documents(path), model.config.block_size, max_tokens))
            for name, path in ood.items()}


def with_se(value: Optional[float], se: Optional[float]) -> str:
    """A ratio with its bootstrap standard error where the method has one ("0.41 ± 0.05")."""
    return fmt(value) if se is None or value is None else f"{value:.3f} ± {se:.3f}"


def contribution_experiment(ctx: Context, wide_ratio: float = 32.0, ratios: Sequence[float] = (0.125, 0.25, 0.5, 0.75),
                            methods: Sequence[str] = ("logit_lens", "mi"), sequences: int = 64,
                            ood: Optional[Dict[str, pathlib.Path]] = None, ood_tokens: int = 32768,
                            seeds: int = 5, mi_restarts: Optional[int] = None) -> Dict[str, Any]:
    from analysis.contribution import METHODS, MI_RESTARTS

    mi_restarts = MI_RESTARTS if mi_restarts is None else mi_restarts

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"--methods: unknown {bad}; valid methods: {', '.join(METHODS)}")
    for option, value in (("seeds", seeds), ("mi_restarts", mi_restarts)):
        if value < 1:
            raise ConfigError(f"--{option}: must be a positive integer, got {value}")
    ood = ood or {}
    configs = grid(wide_ratio, ratios)
    ctx.validate([c["argv"] for c in configs.values()])
    rows = [measured_row(ctx, name, c, seed, methods, sequences, ood, ood_tokens, mi_restarts)
            for name, c in configs.items() for seed in range(ctx.seed, ctx.seed + seeds)]
    ood_names = sorted({k for r in rows for k in r["ood"]})
    models = model_summaries(rows, configs, methods, ood_names)
    tests = claim_tests(rows, methods, ood_names)
    table = contribution_table(models, methods, ood_names, seeds)
    sections = [f"{ctx.steps} steps per run, {seeds} seed(s) per model from {ctx.seed} on; contribution over the first "
                f"{sequences} validation sequences; ratios from the gains between consecutive residual states (MHA "
                "updates vs FFN updates, summing to 1)"
                + (f"; mi: each site's information averaged over {mi_restarts} k-means seeds. " if "mi" in methods
                   else ". ")
                + ("Cells: a ratio ± its bootstrap SE (logit lens: over the sequences; mi: over the k-means seeds)."
                   if seeds == 1 else
                   "Cells: seed mean [95% bootstrap interval over seeds]."), "",
                table, "", "Observations (computed from the numbers above; tests over seeds, Holm within each claim):",
                "", *observations(models, tests, methods, ood_names), ""]
    plot(ctx, models, methods, ood_names)
    ctx.log_table("contribution", table)
    results = {"wide_ratio": wide_ratio, "methods": list(methods), "seeds": seeds, "mi_restarts": mi_restarts,
               "ood": {k: str(v) for k, v in ood.items()}, "models": models, "tests": tests, "runs": rows}
    ctx.write_report("MHA vs FFN contribution: FFN width and the CAA Outer-FFN ratio", sections, results)
    return results


def measured_row(ctx: Context, name: str, config: Dict[str, Any], seed: int, methods: Sequence[str], sequences: int,
                 ood: Dict[str, pathlib.Path], ood_tokens: int, mi_restarts: int) -> Dict[str, Any]:
    """One model at one seed: trained (or reused), its contribution ratios per method and its OOD losses (the
    SlimPajama subsets it validated on, and the ``--ood`` files scored now)."""
    from analysis.contribution import contribution

    s = ctx.run([*config["argv"], "--seed", str(seed)])
    run_dir = pathlib.Path(s["run_dir"])
    row = {"name": name, "seed": seed, "r": config["r"], "ffn": config["ffn"], "val_loss": s["final_val_loss"],
           "parameters": s["parameters"], "flops_ratio": s["flops_per_token"]["ratio_to_vanilla"], "run_dir": str(run_dir)}
    for method in methods:
        result = contribution(str(checkpoint_of(run_dir)), method, sequences=sequences, seed=ctx.seed,
                              restarts=mi_restarts)
        row[f"mha_{method}"], row[f"ffn_{method}"] = result["ratio_mha"], result["ratio_ffn"]
        row[f"se_{method}"] = result.get("ratio_mha_se")  # bootstrap (sequences / k-means seeds); MHA and FFN share it
    row["ood"] = {k.split("/")[1]: v for k, v in s.get("val_metrics", {}).items()
                  if k.startswith("val/") and k.endswith("/loss") and k.count("/") == 2}
    row["ood"].update(ood_losses(run_dir, ood, ood_tokens))
    return row


def model_summaries(rows: Sequence[Dict[str, Any]], configs: Dict[str, Dict[str, Any]], methods: Sequence[str],
                    ood_names: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Per model: its figures over seeds (``seed_summary``); with one seed, the ratios' SE over sequences too."""
    from analysis.stats import seed_summary

    models = {}
    for name, config in configs.items():
        runs = [r for r in rows if r["name"] == name]
        figures = ["val_loss", *(f"{side}_{m}" for m in methods for side in ("mha", "ffn"))]
        models[name] = {"r": config["r"], "ffn": config["ffn"], "parameters": runs[0]["parameters"],
                        "flops_ratio": runs[0]["flops_ratio"],
                        **{key: seed_summary([r[key] for r in runs]) for key in figures},
                        "ood": {n: seed_summary([r["ood"].get(n) for r in runs]) for n in ood_names},
                        "se": {m: runs[0][f"se_{m}"] for m in methods} if len(runs) == 1 else {}}
    return models


def claim_tests(rows: Sequence[Dict[str, Any]], methods: Sequence[str], ood_names: Sequence[str]) -> Dict[str, Any]:
    """The paper's three claims tested over seeds: the wider FFN raises the FFN ratio (one-sided Welch, Holm over
    methods); lower r raises the MHA ratio (per seed the correlation of r with it over the caa models, its mean
    below 0 by a one-sided one-sample t-test, Holm over methods); lower r lowers the OOD loss (the correlation
    above 0, Holm over the OOD sets). A claim with fewer than two seeds, or fewer than three r, has no test."""
    from analysis.stats import compare_groups, finite, one_sample_p, with_holm

    values = lambda name, key: [r[key] for r in rows if r["name"] == name]  # noqa: E731
    wider = {m: compare_groups(values("ffn_wider", f"ffn_{m}"), values("vanilla", f"ffn_{m}"), "greater")
             for m in methods}
    seeds = sorted({r["seed"] for r in rows})
    caa = lambda seed: sorted((r for r in rows if r["r"] is not None and r["seed"] == seed), key=lambda r: r["r"])  # noqa: E731
    per_seed = lambda figure: [correlation([r["r"] for r in caa(s)], [figure(r) for r in caa(s)]) for s in seeds]  # noqa: E731
    mha = {m: per_seed(lambda r, m=m: r[f"mha_{m}"]) for m in methods}
    ood = {n: per_seed(lambda r, n=n: r["ood"].get(n)) for n in ood_names}

    def family(correlations: Dict[str, List[Optional[float]]], alternative: str) -> Dict[str, Dict[str, Any]]:
        return with_holm({k: {"correlations": v, "n": len(finite(v)), "p": one_sample_p(v, 0.0, alternative)}
                          for k, v in correlations.items()})

    return {"wider_raises_ffn": with_holm(wider), "lower_r_raises_mha": family(mha, "less"),
            "lower_r_lowers_ood": family(ood, "greater")}


def contribution_table(models: Dict[str, Dict[str, Any]], methods: Sequence[str], ood_names: Sequence[str],
                       seeds: int) -> str:
    """One row per model: loss, ratios and OOD losses (seed means [CI], or with one seed the ratio ± its SE)."""
    from analysis.tables import ci_cell

    def cell(summary, se=None, digits=4):
        return with_se(summary["mean"], se) if seeds == 1 else ci_cell(summary["mean"], summary["ci"], digits)

    headers = ["model", "FFN width", "params", "FLOPs x", "val loss", *(f"MHA ratio ({m})" for m in methods),
               *(f"FFN ratio ({m})" for m in methods), *(f"OOD loss {n}" for n in ood_names)]
    return markdown_table(headers, [[name, m["ffn"], m["parameters"], m["flops_ratio"], cell(m["val_loss"]),
                                     *(cell(m[f"mha_{k}"], m["se"].get(k), 3) for k in methods),
                                     *(cell(m[f"ffn_{k}"], m["se"].get(k), 3) for k in methods),
                                     *(cell(m["ood"][n]) for n in ood_names)] for name, m in models.items()])


def correlation(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    n = len(pairs)
    mx, my = sum(p[0] for p in pairs) / n, sum(p[1] for p in pairs) / n
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    syy = sum((y - my) ** 2 for _, y in pairs)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def observations(models: Dict[str, Dict[str, Any]], tests: Dict[str, Any], methods: Sequence[str],
                 ood_names: Sequence[str]) -> List[str]:
    """The three claims on seed means, each with its test's verdict (none with one seed)."""
    from analysis.stats import passes

    def verdict(test: Dict[str, Any]) -> str:
        if test.get("p_holm") is None:
            return "no test (fewer than two seeds with the figure defined, or fewer than three r)"
        return f"{'holds' if passes(test) else 'not shown'} (p {fmt(test['p_holm'], 3)} after Holm)"

    vanilla, wider = models["vanilla"], models["ffn_wider"]
    caa = sorted((m for m in models.values() if m["r"] is not None), key=lambda m: m["r"])
    rs = [m["r"] for m in caa]
    lines = []
    for m in methods:
        v, w = vanilla[f"ffn_{m}"]["mean"], wider[f"ffn_{m}"]["mean"]
        if v is not None and w is not None:
            lines.append(f"- {m}: FFN ratio vanilla {v:.3f} -> ffn_wider {w:.3f}; raised by the wider FFN: "
                         f"{verdict(tests['wider_raises_ffn'][m])}.")
    for m in methods:
        c = correlation(rs, [x[f"mha_{m}"]["mean"] for x in caa])
        if c is not None:
            lines.append(f"- {m}: correlation of r with the seed-mean MHA ratio over the caa models {c:+.2f} (the paper "
                         f"expects negative); per seed, negative: {verdict(tests['lower_r_raises_mha'][m])}.")
    for n in ood_names:
        c = correlation(rs, [x["ood"][n]["mean"] for x in caa])
        if c is not None:
            losses = ", ".join(f"r={x['r']:g}: {fmt(x['ood'][n]['mean'])}" for x in caa)
            lines.append(f"- OOD {n}: correlation of r with the seed-mean loss {c:+.2f} (paper: positive, lower r "
                         f"better; {losses}); per seed, positive: {verdict(tests['lower_r_lowers_ood'][n])}.")
    return lines


def plot(ctx: Context, models: Dict[str, Dict[str, Any]], methods: Sequence[str], ood_names: Sequence[str]) -> None:
    """MHA ratio per model and method (seed means with intervals), and OOD loss over the Outer-FFN ratio r."""
    from analysis.tables import error_bars, plotted_means

    panels = 2 if ood_names else 1
    fig, axes = figure(1, panels, width=5.5)
    ax = axes[0, 0]
    names = list(models)
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        summaries = [models[n][f"mha_{m}"] for n in names]
        ax.bar([j + i * width for j in range(len(names))], plotted_means(summaries), width, label=m,
               yerr=error_bars(summaries), capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("MHA contribution ratio (seed mean)")
    ax.legend(fontsize=7)
    ax.set_title("MHA contribution (FFN ratio = 1 - MHA; no bar: undefined)")
    if ood_names:
        ax = axes[0, 1]
        caa = sorted((m for m in models.values() if m["r"] is not None), key=lambda m: m["r"])
        for n in ood_names:
            line = ax.plot([m["r"] for m in caa], [m["ood"][n]["mean"] for m in caa], marker="o", label=n)[0]
            for ref, style in (("vanilla", ":"), ("ffn_wider", "--")):
                value = models[ref]["ood"][n]["mean"]
                if value is not None:
                    ax.axhline(value, color=line.get_color(), linestyle=style, alpha=0.5)
        ax.set_xlabel("Outer-FFN ratio r (dotted: vanilla, dashed: ffn_wider)")
        ax.set_ylabel("out-of-distribution loss (seed mean)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.save_figure(fig, "contribution")
