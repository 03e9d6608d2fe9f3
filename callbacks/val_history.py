"""``summary.json``'s ``val_history``: each validation's losses and probe accuracy per level, at the optimiser steps
done when it ran (``callbacks.run_summary.StepRecorder`` keeps it), and its rebuild from a run's TensorBoard events
for runs written before the recorder kept one (``experiments.repro.publish``). Plain Python: no torch, no Lightning.
"""
from __future__ import annotations

import pathlib
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

# the figures kept per validation: a few numbers each, so a published record keeps them whole
VAL_HISTORY = re.compile(r"val/loss(_causal)?|probe/level\d+/acc")
# events.out.tfevents.<unix seconds>.<host, which may hold dots>.<pid>.<counter>: the order they were written in
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.(\d+)")


def add_validation(history: List[List[Any]], step: int, metrics: Dict[str, float]) -> None:
    """Append ``[step, metrics]`` to a validation history in step order. Entries at ``step`` or later give way: the
    final ``validate`` after the last in-training one at the same step, or a resumed process's validations after a
    killed one's (its later entries are of a timeline the checkpoint did not keep)."""
    while history and history[-1][0] >= step:
        history.pop()
    history.append([int(step), dict(sorted(metrics.items()))])


def event_files(run_dir: pathlib.Path) -> List[pathlib.Path]:
    """The run folder's TensorBoard event files in the order they were written (by the time and counter in their
    names, not the files' modification times, which a copy without -p changes)."""
    def written(path: pathlib.Path) -> Tuple[int, int, str]:
        match = _EVENT_FILE.fullmatch(path.name)
        return (int(match.group(1)), int(match.group(4)), path.name) if match else (0, 0, path.name)

    return sorted(pathlib.Path(run_dir).glob("events.out.tfevents.*"), key=written)


def history_from_events(run_dir: pathlib.Path) -> List[List[Any]]:
    """``val_history`` as the event files hold it, process after process (``add_validation``'s order).

    Lightning logs a validation at its count of stepped batches before the step that ran it is counted, so the
    optimiser steps done are the event's step + 1 (``tests/test_val_history.py`` checks this against the recorder);
    that holds for validations at the end of an optimisation step, which ``experiments.run`` makes every validation
    (``off_grid`` finds those that are not). ``EventFileLoader`` gives every scalar as a tensor (float32)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    history: List[List[Any]] = []
    for path in event_files(run_dir):
        by_step: Dict[int, Dict[str, float]] = {}  # this process's validations, in the order it logged them
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if VAL_HISTORY.fullmatch(value.tag):
                    by_step.setdefault(event.step + 1, {})[value.tag] = float(tensor_util.make_ndarray(value.tensor))
        for step, metrics in by_step.items():
            add_validation(history, step, metrics)
    return history


def off_grid(history: Sequence[Sequence[Any]], val_every: Optional[int], final_step: Optional[int]) -> List[int]:
    """Steps of ``history`` that are neither a multiple of ``val_every`` nor the run's final step: validations
    in the middle of a gradient-accumulation step (runs from before ``val_every`` counted optimisation steps) or
    logged one step late after a resume (before the resume's logging step was aligned), where the event's step + 1
    is not the steps done."""
    if not val_every:
        return []
    return [int(step) for step, _ in history if step % val_every and step != final_step]
