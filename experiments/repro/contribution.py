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
                            ood: Optional[Dict[str, pathlib.Path]] = None, ood_tokens: int = 32768) -> Dict[str, Any]:
    from analysis.contribution import METHODS, contribution

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"--methods: unknown {bad}; valid methods: {', '.join(METHODS)}")
    ood = ood or {}
    configs = grid(wide_ratio, ratios)
    ctx.validate([c["argv"] for c in configs.values()])
    rows = []
    for name, c in configs.items():
        s = ctx.run(c["argv"])
        run_dir = pathlib.Path(s["run_dir"])
        row = {"name": name, "r": c["r"], "ffn": c["ffn"], "val_loss": s["final_val_loss"], "parameters": s["parameters"],
               "flops_ratio": s["flops_per_token"]["ratio_to_vanilla"], "run_dir": str(run_dir)}
        for method in methods:
            result = contribution(str(checkpoint_of(run_dir)), method, sequences=sequences, seed=ctx.seed)
            row[f"mha_{method}"], row[f"ffn_{method}"] = result["ratio_mha"], result["ratio_ffn"]
            row[f"se_{method}"] = result.get("ratio_mha_se")  # bootstrap over sequences (logit lens); MHA and FFN share it
        row["ood"] = {k.split("/")[1]: v for k, v in s.get("val_metrics", {}).items()
                      if k.startswith("val/") and k.endswith("/loss") and k.count("/") == 2}
        row["ood"].update(ood_losses(run_dir, ood, ood_tokens))
        rows.append(row)
    ood_names = sorted({k for r in rows for k in r["ood"]})
    headers = ["model", "FFN width", "params", "FLOPs x", "val loss",
               *(f"MHA ratio ({m})" for m in methods), *(f"FFN ratio ({m})" for m in methods),
               *(f"OOD loss {n}" for n in ood_names)]
    table = markdown_table(headers, [[r["name"], r["ffn"], r["parameters"], r["flops_ratio"], r["val_loss"],
                                      *(with_se(r[f"mha_{m}"], r.get(f"se_{m}")) for m in methods),
                                      *(with_se(r[f"ffn_{m}"], r.get(f"se_{m}")) for m in methods),
                                      *(r["ood"].get(n) for n in ood_names)] for r in rows])
    sections = [f"{ctx.steps} steps per run; contribution over the first {sequences} validation sequences; ratios "
                "from the gains between consecutive residual states (MHA updates vs FFN updates, summing to 1).", "",
                table, "", "Observations (computed from the numbers above):", "",
                *observations(rows, methods, ood_names), ""]
    plot(ctx, rows, methods, ood_names)
    ctx.log_table("contribution", table)
    results = {"wide_ratio": wide_ratio, "methods": list(methods), "ood": {k: str(v) for k, v in ood.items()}, "runs": rows}
    ctx.write_report("MHA vs FFN contribution: FFN width and the CAA Outer-FFN ratio", sections, results)
    return results


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


def observations(rows: List[Dict[str, Any]], methods: Sequence[str], ood_names: Sequence[str]) -> List[str]:
    by_name = {r["name"]: r for r in rows}
    vanilla, wider = by_name["vanilla"], by_name["ffn_wider"]
    lines = []
    for m in methods:
        v, w = vanilla[f"ffn_{m}"], wider[f"ffn_{m}"]
        if v is not None and w is not None:
            lines.append(f"- {m}: FFN ratio vanilla {v:.3f} -> ffn_wider {w:.3f} "
                         f"({'raised' if w > v else 'not raised'} by the wider FFN).")
    caa = sorted((r for r in rows if r["r"] is not None), key=lambda r: r["r"])
    rs = [r["r"] for r in caa]
    for m in methods:
        c = correlation(rs, [r[f"mha_{m}"] for r in caa])
        if c is not None:
            lines.append(f"- {m}: correlation of r with the MHA ratio over the caa runs: {c:+.2f} "
                         f"(the paper expects negative: lower r, larger MHA contribution).")
    for n in ood_names:
        c = correlation(rs, [r["ood"].get(n) for r in caa])
        if c is not None:
            losses = ", ".join(f"r={r['r']:g}: {fmt(r['ood'].get(n))}" for r in caa)
            lines.append(f"- OOD {n}: correlation of r with the loss {c:+.2f} (paper: positive, lower r better); {losses}.")
    return lines


def plot(ctx: Context, rows: List[Dict[str, Any]], methods: Sequence[str], ood_names: Sequence[str]) -> None:
    panels = 2 if ood_names else 1
    fig, axes = figure(1, panels, width=5.5)
    ax = axes[0, 0]
    names = [r["name"] for r in rows]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(rows))], [r[f"mha_{m}"] or 0.0 for r in rows], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("MHA contribution ratio")
    ax.legend(fontsize=7)
    ax.set_title("MHA contribution (FFN ratio = 1 - MHA)")
    if ood_names:
        ax = axes[0, 1]
        caa = sorted((r for r in rows if r["r"] is not None), key=lambda r: r["r"])
        for n in ood_names:
            line = ax.plot([r["r"] for r in caa], [r["ood"].get(n) for r in caa], marker="o", label=n)[0]
            for ref, style in (("vanilla", ":"), ("ffn_wider", "--")):
                value = next(r for r in rows if r["name"] == ref)["ood"].get(n)
                if value is not None:
                    ax.axhline(value, color=line.get_color(), linestyle=style, alpha=0.5)
        ax.set_xlabel("Outer-FFN ratio r (dotted: vanilla, dashed: ffn_wider)")
        ax.set_ylabel("out-of-distribution loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.save_figure(fig, "contribution")
