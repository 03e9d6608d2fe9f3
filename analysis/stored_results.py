"""Programmes' stored reports (``results.json``) read back: one published table, the ``--jobs`` it ran with, and
the run rows of several merged into one set (``--tables_from``, ``--verify``), a run stored twice only if it is the
same run."""
from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Dict, List, Sequence, Tuple

from analysis.provenance import cpu_label
from analysis.retraining import as_text
from architectures.config import ConfigError


def read_published(path: pathlib.Path, option: str = "--published",
                   needs: Sequence[Tuple[str, type]] = (("settings", dict), ("variants", dict))) -> Dict[str, Any]:
    """A programme's ``results.json`` (one line naming ``option``, the argument that gave it, and the file when it
    is missing, unreadable or lacks a key of ``needs``, (key, type) pairs: the probe's schema by default)."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{option}: no file {path}; give the results.json of the published table") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{option}: {path} is unreadable ({err})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(key), kind) for key, kind in needs):
        names = " and ".join(f"'{key}'" for key, _ in needs)
        raise ConfigError(f"{option}: {path} holds no {names} (write it with the experiment's results.json)")
    return data


def stored_jobs(data: Dict[str, Any]) -> int:
    """The ``--jobs`` a stored programme invocation ran with (its results' provenance argv; 1 where it gave none)."""
    argv = (data.get("provenance") or {}).get("argv") or []
    for i, arg in enumerate(argv):
        if arg.startswith("--jobs="):
            return int(arg.split("=", 1)[1])
        if arg == "--jobs" and i + 1 < len(argv):
            return int(argv[i + 1])
    return 1


def same_figure(a: Any, b: Any) -> bool:
    """Two stored figures (numbers, or nested lists / dicts of them) are the same, a NaN equal to a NaN (a
    correlation over constant values is NaN in every copy of that run)."""
    return as_text(a) == as_text(b)


def merge_run_rows(files: Sequence[Tuple[pathlib.Path, Dict[str, Any]]], key: Callable[[Dict[str, Any]], Tuple],
                   same_run: Sequence[str], entry_of: Callable[[Dict[str, Any]], str],
                   option: str = "--tables_from") -> Tuple[List[Dict[str, Any]], List[str]]:
    """(one row per ``key``, in order of first appearance; a line per file naming its commit, CPU and entries) of the
    run rows (``runs``) of several stored programme invocations. A key stored twice must hold the same run (a
    reproduction: equal in every ``same_run`` field), or the files are refused: which one to trust is the user's
    question, not the tool's. Each row gets ``source`` (its file), ``first_source`` (the file it was first stored
    in, whose folder its run_dir is relative to: its file's, or for a merged file's row the one it was merged from)
    and a ``cpu``: its own, else, for rows stored before runs recorded it, its file's, unless that file is itself a
    merge (its provenance names the merging machine, so such rows stay unknown)."""
    rows: Dict[Tuple, Dict[str, Any]] = {}
    sources = []
    for path, data in files:
        if not isinstance(data.get("runs"), list) or not data["runs"]:
            raise ConfigError(f"{option}: {path} holds no run rows ('runs'); give a programme's results.json")
        commit = (data.get("provenance") or {}).get("commit")
        cpu = cpu_label(data)  # the CPU the file's provenance names (None for files from before it was recorded)
        trained_on = None if data.get("tables_from") else cpu
        sources.append(f"`{path}` (tables computed at commit {commit or 'unknown'}{f' on {cpu}' if cpu else ''}; its "
                       f"entries: {', '.join(dict.fromkeys(entry_of(r) for r in data['runs']))})")
        for row in data["runs"]:
            k = key(row)
            if k in rows:
                differs = [f for f in same_run if not same_figure(rows[k].get(f), row.get(f))]
                if differs:
                    raise ConfigError(f"{option}: {entry_of(row)} seed {row.get('seed')} is stored in "
                                      f"{rows[k]['source']} and {path} with different {', '.join(differs)}: not the "
                                      "same run; give one of them")
                continue
            # first_source: the file whose folder the row's run_dir is relative to (the row's first, before merges)
            rows[k] = {**row, "cpu": row.get("cpu") or trained_on, "source": str(path),
                       "first_source": row.get("first_source") or row.get("source") or str(path)}
    return list(rows.values()), sources
