"""Where a stored run row's run is: the record ``experiments.repro.publish`` keeps beside its report, or the folder
it trained in. ``experiments.repro``'s ``--tables_from`` rebuilds put these folders into the rebuilt report's run
table, so a row must find its own run, never a neighbour's of the same name."""
from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, List, Optional

import yaml

from analysis.retraining import as_text


def stored_run_folder(row: Dict[str, Any]) -> Optional[pathlib.Path]:
    """The folder of a stored row's run here (its record or the trained folder), or None. Where ``run_dir`` is looked
    for:

    - as it is, where absolute;
    - relative to the folder of the file the row was first stored in (``first_source``; ``publish`` keeps each
      record beside its report, and a merge keeps the rows' run_dir as they were);
    - for a row never published (no ``run_dir_trained``), relative to that folder's parents or here: a programme with
      a relative ``--out`` stores it relative to where it ran;
    - for a trained folder a merge named before its file was published, the record that file keeps for it now.

    A folder counts only if it holds the row's run (``holds_run``)."""
    stored = row.get("run_dir")
    if not isinstance(stored, str) or not stored:
        return None
    first = first_file(row)
    if pathlib.Path(stored).is_absolute():
        candidates = [pathlib.Path(stored)]
    elif "run_dir_trained" in row:  # a record, beside its report by construction: not another programme's of that name
        candidates = [first.parent / stored]
    else:
        bases = dict.fromkeys([first.parent, *first.parent.parents, pathlib.Path.cwd()])
        candidates = [base / stored for base in bases]
    found = next((folder for folder in candidates if holds_run(folder, row)), None)
    return found or next((folder for folder in published_since(first, stored) if holds_run(folder, row)), None)


def first_file(row: Dict[str, Any]) -> pathlib.Path:
    """The file a stored row was first stored in: its own, or for a merged file's row the one it was merged from,
    which the merge named as it was given it (relative to where it ran: one of the merged file's parents, or here)."""
    source = pathlib.Path(row["source"])
    first = pathlib.Path(row.get("first_source") or row["source"])
    if first == source or first.is_absolute():
        return first
    return next((root / first for root in [*source.resolve().parents, pathlib.Path.cwd()] if (root / first).is_file()),
                source)


def published_since(path: pathlib.Path, trained: str) -> List[pathlib.Path]:
    """The records ``path`` (a results.json) names for its runs trained in folder ``trained``: its rows'
    ``run_dir`` where their ``run_dir_trained`` is that folder (none where the file is not there or not a report)."""
    try:
        rows = json.loads(path.read_text()).get("runs")
    except (OSError, ValueError, AttributeError):
        return []
    return [path.parent / r["run_dir"] for r in rows if isinstance(r, dict) and r.get("run_dir_trained") == trained
            and isinstance(r.get("run_dir"), str)] if isinstance(rows, list) else []


def holds_run(folder: pathlib.Path, row: Dict[str, Any]) -> bool:
    """Whether ``folder`` holds the run of a stored row: a finished run (summary.json) of the row's registry variant,
    steps, parameters (where the row has them) and final validation loss (the row's headline or plain one: a programme
    headlines one of them), trained with the row's seed. Seed and steps alone do not tell runs apart: a fixed-step
    programme trains every entry the same steps."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return False
    if not (isinstance(summary, dict) and isinstance(config, dict)):
        return False
    losses = [row[k] for k in ("headline_val_loss", "val_loss", "final_val_loss") if k in row]
    return (summary.get("variant") == (row.get("registry_variant") or row.get("variant"))
            and config.get("seed") == row.get("seed") and summary.get("steps") == row.get("steps")
            and all(summary.get(k) == row[k] for k in ("parameters",) if k in row)
            and any(as_text(summary.get("final_val_loss")) == as_text(loss) for loss in losses))
