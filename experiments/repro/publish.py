"""``python -m experiments.repro.publish OUT DEST``: a finished programme's report, with each run's small records,
into the repository (``docs/results/<name>/``), so its tables can be rebuilt and its runs checked on another machine
without the run folders.

Copied: the programme's own files at the top of ``OUT`` (``results.md``, ``results.json``, ``leaderboard.md``, the
figures), and per run (``results.json``'s ``runs``) its ``config.yaml`` (the resolved config), ``provenance.json``
(code, libraries, CPU, kernels of every process that trained it), ``probe.json`` where there is one, and
``summary.json`` without its per-step lists: ``step_times_s`` is dropped (``median_step_time_s`` and ``run_seconds``
stay) and ``train_loss_curve`` is thinned to at most ``CURVE_POINTS`` points, the last step always kept; what was
thinned is said in the copy's ``published``. Not copied: checkpoints, TensorBoard events, the ``runs.json`` index.
Each row's ``run_dir`` in the copied ``results.json`` becomes the record's path relative to ``DEST`` (the trained
folder stays as ``run_dir_trained``), so no published file holds a path of the machine that trained it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
from typing import Any, Dict, List, Optional, Sequence

from architectures.config import ConfigError

CURVE_POINTS = 256
RUN_FILES = ("config.yaml", "provenance.json", "probe.json")  # copied as they are, where present
REPORT_SUFFIXES = (".md", ".json", ".png")
SKIPPED = ("runs.json",)  # the reuse index: paths of the machine that trained


def thinned(curve: Sequence[Any], points: int = CURVE_POINTS) -> List[Any]:
    """Every k-th point of ``curve`` (k the smallest stride leaving at most ``points``), the last always kept."""
    if len(curve) <= points:
        return list(curve)
    stride = -(-(len(curve) - 1) // (points - 1))
    kept = list(curve[::stride])
    if kept[-1] != curve[-1]:
        kept[-1] = curve[-1]  # the stride's last point gives way to the final step
    return kept


def slim_summary(summary: Dict[str, Any]) -> Dict[str, Any]:
    """``summary.json`` without its per-step lists (the size of a run record is its curves: ~200 KB each)."""
    out = {k: v for k, v in summary.items() if k != "step_times_s"}
    curve = summary.get("train_loss_curve") or []
    out["train_loss_curve"] = thinned(curve)
    out["published"] = {"step_times_s": f"dropped ({len(summary.get('step_times_s') or [])} steps; "
                                        "median_step_time_s kept)",
                        "train_loss_curve": f"{len(out['train_loss_curve'])} of {len(curve)} points, the last kept"}
    return out


def record_name(run_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Where a run's record goes under ``DEST``: its folder relative to ``OUT`` (``runs/<name>/version_N``), or for a
    folder elsewhere (a reused ``--log_dir``) ``runs/`` and its last two parts."""
    try:
        return run_dir.resolve().relative_to(out.resolve())
    except ValueError:
        return pathlib.Path("runs", *run_dir.parts[-2:])


def find_run_dir(row: Dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    """A row's trained folder: its ``run_dir`` as stored, absolute or relative to where the programme ran: one of
    ``OUT``'s parents (nearest first: ``/x/out/NAME`` ran in ``/x`` when it wrote ``out/NAME/runs/...``), then here."""
    stored = pathlib.Path(row["run_dir"])
    candidates = [stored] if stored.is_absolute() else [*(p / stored for p in out.resolve().parents), stored]
    for candidate in candidates:
        if (candidate / "summary.json").is_file():
            return candidate
    raise ConfigError(f"publish: the run folder {stored} of {row.get('variant')} seed {row.get('seed')} is not there "
                      f"(no summary.json); run publish where the programme ran, before its run folders are removed")


def publish(out: pathlib.Path, dest: pathlib.Path) -> Dict[str, Any]:
    """Copy ``out``'s report and its runs' records to ``dest`` (see the module docstring); the copied results."""
    out, dest = pathlib.Path(out), pathlib.Path(dest)
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"publish: {out}/results.json is not a finished programme's report ({err}); give the "
                          "--out folder of a programme that finished") from None
    rows = results.get("runs")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and r.get("run_dir") for r in rows):
        raise ConfigError(f"publish: {out}/results.json has no run rows with a run_dir; nothing to publish")
    if dest.resolve() == out.resolve():
        raise ConfigError("publish: DEST is OUT; give another folder (e.g. docs/results/<name>)")
    run_dirs = [find_run_dir(row, out) for row in rows]  # every one found before anything is written
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(out.iterdir()):
        if path.is_file() and path.suffix in REPORT_SUFFIXES and path.name not in SKIPPED + ("results.json",):
            shutil.copy2(path, dest / path.name)
    for row, run_dir in zip(rows, run_dirs):
        copy_record(row, run_dir, out, dest)
    (dest / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def copy_record(row: Dict[str, Any], run_dir: pathlib.Path, out: pathlib.Path, dest: pathlib.Path) -> None:
    """One run's record into ``dest``; ``row``'s ``run_dir`` rewritten to it (the trained one kept beside)."""
    name = record_name(run_dir, out)
    target = dest / name
    target.mkdir(parents=True, exist_ok=True)
    for file in RUN_FILES:
        if (run_dir / file).is_file():
            shutil.copy2(run_dir / file, target / file)
    summary = json.loads((run_dir / "summary.json").read_text())
    (target / "summary.json").write_text(json.dumps(slim_summary(summary), indent=1) + "\n")
    row["run_dir_trained"], row["run_dir"] = row["run_dir"], name.as_posix()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m experiments.repro.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="the programme's --out folder (with results.json and runs/)")
    parser.add_argument("dest", type=pathlib.Path, help="where the report and the run records go (docs/results/NAME)")
    args = parser.parse_args(argv)
    results = publish(args.out, args.dest)
    print(f"published {len(results['runs'])} runs' records and the report of {args.out} to {args.dest}")
    return results


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
