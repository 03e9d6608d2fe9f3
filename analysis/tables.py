"""Tables and figures of the experiment reports: number formatting, markdown tables, matplotlib figures.

Shared by ``experiments.compare`` and ``experiments.repro`` (which uses ``compare`` for its run tables),
so it sits below both.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


def figure(nrows: int = 1, ncols: int = 1, width: float = 5.0, height: float = 3.8):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ci_cell(mean: Optional[float], ci, digits: int = 3) -> str:
    """'mean [low, high]', the mean alone without an interval, '-' without a mean."""
    if mean is None:
        return "-"
    lo, hi = ci if ci is not None else (None, None)
    return fmt(mean, digits) if lo is None else f"{fmt(mean, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def test_cell(test: Optional[Mapping[str, Any]], digits: int = 4) -> str:
    """'Δ [CI], g, p (Holm)' of a test against a baseline (``analysis.stats.compare_groups`` + ``with_holm``)."""
    if not test or test.get("difference") is None:
        return "-"
    text = f"{test['difference']:+.{digits}f}"
    if test.get("ci_low") is not None:
        text += f" [{test['ci_low']:+.{digits}f}, {test['ci_high']:+.{digits}f}]"
    return f"{text}, g {fmt(test.get('hedges_g'), 2)}, p {fmt(test.get('p_holm'), 3)}"


def error_bars(summaries: Sequence[Mapping[str, Any]]) -> list:
    """matplotlib's ``yerr`` (distances below and above each mean) of seed summaries (``analysis.stats.seed_summary``:
    a mean and its interval); 0 where there is no interval or no mean."""
    below, above = [], []
    for s in summaries:
        mean, (lo, hi) = s["mean"], s["ci"]
        below.append(mean - lo if mean is not None and lo is not None else 0.0)
        above.append(hi - mean if mean is not None and hi is not None else 0.0)
    return [below, above]


def plotted_means(summaries: Sequence[Mapping[str, Any]]) -> list:
    """The seed summaries' means for matplotlib: NaN (not drawn) where no seed had a finite value."""
    return [s["mean"] if s["mean"] is not None else math.nan for s in summaries]


def verification_table(figures: Sequence[Tuple[str, Sequence[Optional[float]], Sequence[Optional[float]]]]) -> Tuple[str, List[Dict[str, Any]]]:
    """(markdown, rows) of (figure, published (mean, low, high), this run's (mean, low, high)): each figure next to
    the published one with both intervals, and whether this run's mean lies in the published interval."""
    rows = []
    for name, published, mine in figures:
        lo, hi = published[1], published[2]
        inside = None if lo is None or mine[0] is None else bool(lo <= mine[0] <= hi)
        rows.append({"figure": name, "published": list(published), "this_run": list(mine), "inside_published_ci": inside})

    def cell(values) -> str:
        mean, lo, hi = values
        return fmt(mean) if lo is None else f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}]"

    table = markdown_table(["figure", "published [95% CI]", "this run [95% CI]", "inside published CI"],
                           [[r["figure"], cell(r["published"]), cell(r["this_run"]),
                             "-" if r["inside_published_ci"] is None else ("yes" if r["inside_published_ci"] else "**no**")]
                            for r in rows])
    return table, rows
