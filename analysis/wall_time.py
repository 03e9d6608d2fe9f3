"""How long a programme's runs took, per part of it, from their run rows: each run's wall time (``run_seconds``, or a
lower bound where the run's clock was lost) and the table of it under every ``experiments.repro`` report."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple


def run_wall_seconds(summary: Dict[str, Any]) -> Tuple[Optional[float], bool]:
    """A run's wall time (``run_seconds``: start-up when its process was started for it, training,
    validations; after a resume every process, each to the checkpoint the next resumed from: the work that made it
    into the run, not the work a killed process did after its last checkpoint) and whether it was measured, or a
    lower bound: a run resumed from a checkpoint that did not carry the clock
    (``run_seconds_complete`` false, or a summary from before that field: its last process only), or, for run
    folders written before ``run_seconds``, its timed steps summed (their ``seconds_to_first_step`` counted every
    earlier run of a reused process)."""
    if summary.get("run_seconds") is not None:
        return float(summary["run_seconds"]), bool(summary.get("run_seconds_complete", not was_resumed(summary)))
    steps = summary.get("step_times_s") or []
    if not steps:
        return None, False
    return sum(float(t) for _, t in steps), False


def was_resumed(summary: Dict[str, Any]) -> bool:
    """Whether more than one process trained the run (``train_started_at_steps``: [0, s, ...] after a resume)."""
    return len(summary.get("train_started_at_steps") or [0]) > 1


def run_wall(summary: Dict[str, Any]) -> Dict[str, Any]:
    """A run row's ``wall_s`` / ``wall_measured`` (``run_wall_seconds``) and ``wall_resumed`` (``was_resumed``), for
    ``wall_time_lines``."""
    return {**dict(zip(("wall_s", "wall_measured"), run_wall_seconds(summary))), "wall_resumed": was_resumed(summary)}


def wall_time_lines(rows: Sequence[Dict[str, Any]], part_of, workers: int) -> List[str]:
    """The programme's wall time per part: each part's runs (``part_of(row)``: the entry), their wall times
    summed (one run per core at once: divide by the runs trained at once). Finished runs are reused, so this
    is what the whole programme costs, whatever this invocation retrained (``Context.part`` times that)."""
    unknown = sum(r.get("wall_s") is None for r in rows)
    if unknown == len(rows):
        return []  # rows stored before runs recorded their wall time (as origin_lines without code or CPU)
    parts: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        parts.setdefault(part_of(row), []).append(row)
    lines = ["| part | runs | wall time of its runs, summed (s) | per run (s) |", "|---|---|---|---|"]
    total, estimated = 0.0, False
    for part, members in parts.items():
        timed = [r for r in members if r.get("wall_s") is not None]
        if not timed:  # rows stored before runs recorded their wall time: nothing to bound
            lines.append(f"| {part} | {len(members)} | - | - |")
            continue
        walls = sum(r["wall_s"] for r in timed)
        bound = any(not r.get("wall_measured") for r in timed)
        estimated |= bound
        total += walls
        mark = ">= " if bound else ""
        partial = ">= " if bound or len(timed) < len(members) else ""  # the untimed runs' time is not in the sum
        lines.append(f"| {part} | {len(members)} | {partial}{walls:,.0f} | {mark}{walls / len(timed):,.0f} |")
    # the wording of published reports (their tables are rebuilt byte for byte from stored rows): a ">=" resumed run
    # is one whose checkpoint did not carry the clock (run_wall_seconds)
    note = (" (>=: a lower bound, for resumed runs (their last process only) and run folders from before "
            "`run_seconds` was recorded (their timed steps only))") if estimated else ""
    if unknown:
        note += (f" ({unknown} stored before runs recorded their wall time, not counted: '-' where a part has none, "
                 "'>=' on the sum of a part with some; per run: over the runs with a wall time)")
    if any(r.get("wall_resumed") and r.get("wall_measured") for r in rows):
        note += (" (a resumed run: each of its processes to the checkpoint the next resumed from; what a killed "
                 "process did after its last checkpoint was done again and is counted once)")
    return [f"Wall time per part: every run's process, start to its summary{note}; {len(rows)} runs, "
            f"{total:,.0f} s summed, about {total / max(1, workers):,.0f} s at {max(1, workers)} at once.", "", *lines, ""]
