"""Does a dense grid bracket its best model? An isoFLOP claim against "the best dense model" holds only where the
loss curve over model size turns inside the grid (a smaller and a larger shape on either side of the best); otherwise
a shape beyond the grid's edge may be better still. ``experiments.repro``'s probe, head_to_head and isoflop reports
state this verdict for every budget."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple


AT_FLOOR = "bracketed by the floor"


def bracket_verdict(points: Sequence[Tuple[float, Optional[float]]], floor: Optional[float] = None) -> str:
    """Whether a curve of (size, mean loss) turns inside the grid: "bracketed" when its lowest point has a smaller
    and a larger shape on either side, else which edge of the grid the best shape is at. ``floor``: the smallest
    size a shape can have (one layer); a best shape there whose larger ones are all strictly worse is ``AT_FLOOR``,
    as no shape lies beyond that edge."""
    points = sorted((p, m) for p, m in points if m is not None and math.isfinite(m))
    if len(points) < 2:
        return "not bracketed: only one shape tried" if points else "not bracketed: no shape with a loss"
    best = min(range(len(points)), key=lambda i: points[i][1])
    if best == 0:
        (size, loss), larger = points[0], points[1:]
        if size == floor and all(m > loss for _, m in larger):
            return AT_FLOOR
        return "not bracketed: the best is the smallest shape tried"
    if best == len(points) - 1:
        return "not bracketed: the best is the largest shape tried"
    return "bracketed"


def grid_bracket(shapes: Dict[str, Tuple[int, int]], means: Dict[str, Optional[float]], best: str,
                 depths_required: bool = False) -> str:
    """Whether the best dense shape (``shapes``: label -> (n_layer, d_model), ``means``: its mean loss) is inside
    the grid on both axes: over the widths at its depth, and over the depths at its width when the grid has more
    than one depth or ``depths_required`` (a grid of one depth then is "only one shape tried" over the depths). An
    isoFLOP claim against "the best dense model" needs "bracketed"; otherwise a model beyond the grid's edge may be
    better still. One layer is the fewest a model can have, so a best one-layer shape whose deeper shapes at its
    width are all worse is bracketed over the depths by that floor (the verdict says so). ``mod_isoflop``'s
    verdict is over the widths alone for a one-depth grid (its report defines "bracketed" so and names the depth)."""
    n_layer, d_model = shapes[best]
    verdict = bracket_verdict(_best_per_size([(d, means[k]) for k, (n, d) in shapes.items() if n == n_layer]))
    if verdict != "bracketed":
        return f"{verdict} (over the widths at n_layer={n_layer})"
    if depths_required or len({n for n, _ in shapes.values()}) > 1:
        # no dense model has fewer layers than one, so deeper ones that are all worse close the depth axis
        verdict = bracket_verdict(_best_per_size([(n, means[k]) for k, (n, d) in shapes.items() if d == d_model]),
                                  floor=1)
        if verdict == AT_FLOOR:
            return (f"bracketed (over the depths at d_model={d_model} by the floor, 1 layer, the fewest a model "
                    "can have)")
        if verdict != "bracketed":
            return f"{verdict} (over the depths at d_model={d_model})"
    return "bracketed"


def _best_per_size(points: Sequence[Tuple[float, Optional[float]]]) -> List[Tuple[float, float]]:
    """One point per size, its lowest finite loss: two entries of one shape (``vanilla`` and ``dense:4x64``, or an
    entry with another option) are one point of the curve, not a smaller and a larger shape around the best."""
    best: Dict[float, float] = {}
    for size, loss in points:
        if loss is not None and math.isfinite(loss):  # bracket_verdict drops the others anyway
            best[size] = min(loss, best.get(size, loss))
    return list(best.items())


def is_bracketed(verdict: str) -> bool:
    """Whether a ``grid_bracket`` verdict says the curve turns inside the grid (a reason may follow it)."""
    return verdict.startswith("bracketed")


def dense_grid_line(best: str, verdict: str) -> str:
    """The report's line on the dense grid (``grid_bracket``'s verdict), with what it means for the claims."""
    caveat = ("" if is_bracketed(verdict) else "; a dense shape beyond the grid's edge may be better "
              "still, so 'beats the best dense model' below is against the best shape tried, not the isoFLOP optimum")
    return f"Dense grid: the best dense model is {best}, {verdict}{caveat}."
