"""``python -m experiments.repro.publish OUT DEST``: a finished programme's report, with each run's small records,
into the repository (``docs/results/<name>/``), so its tables can be rebuilt and its runs checked on another machine
without the run folders.

Copied: the programme's own files at the top of ``OUT`` (``results.md``, ``leaderboard.md`` / ``.csv``, the figures;
``results.json`` rewritten, below), and per run (``results.json``'s ``runs``) its ``config.yaml`` (the resolved config), ``provenance.json``
(code, libraries, CPU, kernels of every process that trained it), ``probe.json`` where there is one, and
``summary.json`` without its per-step lists: ``step_times_s`` is dropped (``median_step_time_s`` and ``run_seconds``
stay) and ``train_loss_curve`` is thinned to at most ``CURVE_POINTS`` points, the last step always kept; what was
thinned is said in the copy's ``published``. A run written before ``summary.json`` kept ``val_history`` (each
validation's losses and probe accuracy per level) gets it from its TensorBoard events where their steps can be
trusted, and ``published`` says which.
Not copied: checkpoints, TensorBoard events, ``leaderboard.json`` and
the ``runs.json`` reuse index (both name the trained folders).
Each row's ``run_dir`` in the copied ``results.json`` becomes the record's path relative to ``DEST`` (the trained
folder stays as ``run_dir_trained``), and so does each run ``leaderboard.csv`` names (by the trained folder: relative to
``OUT`` or, written by older code, to where the programme ran, or in full); the records themselves keep what the run
wrote (its own paths included).
``DEST`` is replaced as a whole (written beside it, then swapped in), so a folder published again holds nothing stale;
a non-empty ``DEST`` that is not a published report is refused.

``python -m experiments.repro.publish --restore OUT DEST``: the run records of a report published without them
(``DEST``), from ``OUT``, a retraining by the same command. Each published row is matched to the retrained row at the
same position; every figure of the published row but its clocks (``CLOCK_FIELDS``) and paths must be equal (as JSON
text: bit for bit; a figure only the retraining has, at any depth of nested dicts, is not compared, its record's note
names it and the restore prints each with its number of rows, unless the row's ``code`` is the report's own), and the
report's commit, dirty flag and diff too, or nothing is written (one line names the row and the field). A row the
report reused from a run at an earlier commit (its ``code``) retrained at the report's commit may differ in its
``code`` only; its record's note names both commits. A retrained row must have trained at the report's code (a
retraining that reused an old run is refused), and the report's own numbers (a reference loss, the budget) must be
equal too. The records go to each published row's ``run_dir``, which must not hold one yet; the report stays as
published but for its ``leaderboard.csv``, which then names the records as publish's does, and each record's
``published.restored`` says so and names the retrained folder (whose version number may differ: two runs at once take
them in the order they start). A report copied into the repository before publish existed
(its rows name the trained folders, no ``run_dir_trained``) gets its records where publish would have put them
(``runs/...`` as in the retraining's ``OUT``), and its rows' ``run_dir`` rewritten to them as publish does (the trained
folder kept as ``run_dir_trained``); every other figure of its ``results.json`` stays. A merged report (rows with a
``source``) is restored through the folders its rows came from. A leaderboard published alone (``DEST`` holds
``leaderboard.json`` of ``experiments.compare``, no ``results.json``; ``OUT``: the ``--log_dir`` of the retrained runs)
is checked run by run (matched by its row and seed: every figure but the step time, and the board's code), and its
records go to ``DEST/runs`` as ``--runs`` writes them.

``python -m experiments.repro.publish --runs LOG_DIR DEST``: the same records of every finished run folder under
``LOG_DIR`` (runs of ``experiments.run`` itself, e.g. a loop over depths and seeds, with no programme report), at
their paths relative to ``LOG_DIR``, under ``DEST/runs``; ``experiments.compare DEST/runs ...`` then rebuilds their
table on any machine. Unfinished folders are refused, so a published set is the finished set.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from analysis.compare import csv_runs_renamed
from analysis.retraining import (CLOCK_FIELDS, PATH_FIELDS, board_mismatch, code_state,  # noqa: F401
                                 report_label, retrained_only, retraining_mismatch,
                                 reused_from_earlier_code)
from architectures.config import ConfigError

CURVE_POINTS = 256
RUN_FILES = ("config.yaml", "provenance.json", "probe.json")  # copied as they are, where present
# the report (results.md, leaderboard.md / .csv) and figures; results.json's rows and leaderboard.csv's runs column
# are rewritten to name the records; leaderboard.json and the runs.json reuse index name the trained folders and stay
# behind
REPORT_SUFFIXES = (".md", ".csv", ".png")


def thinned(curve: Sequence[Any], points: int = CURVE_POINTS) -> List[Any]:
    """Every k-th point of ``curve`` (k the smallest stride leaving at most ``points``), the last always kept."""
    if len(curve) <= points:
        return list(curve)
    stride = -(-(len(curve) - 1) // (points - 1))
    kept = list(curve[::stride])
    if (len(curve) - 1) % stride:
        kept[-1] = curve[-1]  # the stride's last point gives way to the final step
    return kept


def slim_summary(summary: Dict[str, Any], run_dir: Optional[pathlib.Path] = None) -> Dict[str, Any]:
    """``summary.json`` without its per-step lists (the size of a run record is its curves: ~200 KB each); with
    ``run_dir``, a missing ``val_history`` rebuilt from the run's TensorBoard events (``rebuilt_history``)."""
    out = {k: v for k, v in summary.items() if k != "step_times_s"}
    published = {}
    if "val_history" not in summary and run_dir is not None:
        history, published["val_history"] = rebuilt_history(summary, run_dir)
        if history is not None:
            out["val_history"] = history
    if "step_times_s" in summary:
        published["step_times_s"] = f"dropped ({len(summary['step_times_s'] or [])} steps; median_step_time_s kept)"
    if "train_loss_curve" in summary:
        curve = summary["train_loss_curve"] or []
        out["train_loss_curve"] = thinned(curve)
        published["train_loss_curve"] = f"{len(out['train_loss_curve'])} of {len(curve)} points, the last kept"
    return {**out, "published": published}


def rebuilt_history(summary: Dict[str, Any], run_dir: pathlib.Path) -> Tuple[Optional[List[Any]], str]:
    """(``val_history`` from the run's TensorBoard events or None, what the record's ``published`` says about it).
    Not rebuilt where the events' steps cannot be trusted to be the steps done (``callbacks.val_history.off_grid``)."""
    import yaml

    from callbacks.val_history import history_from_events, off_grid

    history = history_from_events(run_dir)
    if not history:
        return None, "not rebuilt: the run folder has no TensorBoard validation events"
    try:
        val_every = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("val_every")
    except (OSError, yaml.YAMLError):
        val_every = None
    late = off_grid(history, val_every, summary.get("steps"))
    if late:
        return None, (f"not rebuilt: validations at steps {late} lie off the --val_every {val_every} grid, where an "
                      "event's step + 1 need not be the steps done")
    return history, ("rebuilt from the run's TensorBoard events (float32; steps: the event's + 1); the run predates "
                     "the recorder's own")


def record_name(run_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Where a run's record goes under ``DEST``: its folder relative to ``OUT`` (``runs/<name>/version_N``), or for a
    folder elsewhere (a reused ``--log_dir``) ``external/`` and its last two parts."""
    try:
        return run_dir.resolve().relative_to(out.resolve())
    except ValueError:
        return pathlib.Path("external", *run_dir.parts[-2:])


def find_run(row: Dict[str, Any], out: pathlib.Path) -> Tuple[pathlib.Path, Dict[str, Any]]:
    """A row's trained folder and its ``summary.json``. ``run_dir`` is stored absolute or relative to where the
    programme ran: one of ``OUT``'s parents (nearest first: ``/x/out/NAME`` ran in ``/x`` when it wrote
    ``out/NAME/runs/...``), then here. The summary must name the same folder and steps as the row: a folder of the
    same relative path from another programme is not this run."""
    stored = pathlib.Path(row["run_dir"])
    candidates = [stored] if stored.is_absolute() else [*(p / stored for p in out.resolve().parents), stored]
    for candidate in candidates:
        try:
            summary = json.loads((candidate / "summary.json").read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            raise ConfigError(f"publish: {candidate}/summary.json is unreadable ({err}); retrain that run or drop "
                              "it from the report") from None
        if summary.get("run_dir") == row["run_dir"] and ("steps" not in row or summary.get("steps") == row["steps"]):
            return candidate, summary
    raise ConfigError(f"publish: the run folder {stored} of {row.get('variant')} seed {row.get('seed')} is not there "
                      f"(no summary.json of that run); run publish where the programme ran, before its run folders "
                      "are removed")


def publish(out: pathlib.Path, dest: pathlib.Path) -> Dict[str, Any]:
    """Copy ``out``'s report and its runs' records to ``dest`` (see the module docstring); the copied results."""
    out, dest = pathlib.Path(out), pathlib.Path(dest)
    results = report_rows(out, "publish", "give the --out folder of a programme that finished")
    rows = results["runs"]
    if dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents:
        raise ConfigError(f"publish: DEST {dest} is inside OUT; give another folder (e.g. docs/results/<name>)")
    if dest.exists() and any(dest.iterdir()) and not (dest / "results.json").is_file():
        raise ConfigError(f"publish: {dest} holds files but no published report (results.json); give an empty or "
                          "a published folder, it is replaced as a whole")
    runs = [find_run(row, out) for row in rows]  # every one found and read before anything is written
    names = [record_name(run_dir, out) for run_dir, _ in runs]
    folders = {}
    for (run_dir, _), name in zip(runs, names):
        if folders.setdefault(name, run_dir.resolve()) != run_dir.resolve():
            raise ConfigError(f"publish: the run folders {folders[name]} and {run_dir} would share the record {name}; "
                              "publish runs of one --out (or one log folder) at a time")
    records = {stored: name.as_posix() for row, (run_dir, _), name in zip(rows, runs, names)
               for stored in (row["run_dir"], str(run_dir.resolve()))}

    def fill(staging: pathlib.Path) -> None:
        for path in sorted(out.iterdir()):
            if path.is_file() and path.suffix in REPORT_SUFFIXES:
                shutil.copy2(path, staging / path.name)
        board = staging / "leaderboard.csv"
        if board.is_file():
            board.write_bytes(board_naming_records(board.read_bytes().decode(), records, out / board.name).encode())
        for row, (run_dir, summary), name in zip(rows, runs, names):
            copy_record(run_dir, summary, staging / name)
            row["run_dir_trained"], row["run_dir"] = row["run_dir"], name.as_posix()
        (staging / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    replace_folder(dest, fill)
    return results


def board_naming_records(text: str, records: Dict[str, str], where: pathlib.Path) -> str:
    """A ``leaderboard.csv``'s text with each run named by its record: ``records`` maps each name a board gives a
    row's trained folder (as the row stored it, resolved, or relative to ``OUT``) to that row's record. A name that is
    neither is kept, with a warning: it is no run of the report."""
    known = set(records.values())

    def record(name: str) -> str:
        if name not in records and name not in known:
            print(f"warning: publish: {where} names {name}, no run of the report; kept as it is", file=sys.stderr)
        return records.get(name, name)

    return csv_runs_renamed(text, record)


def restore(out: pathlib.Path, dest: pathlib.Path) -> List[pathlib.Path]:
    """The records of ``dest``'s published rows from ``out``'s retraining (see the module docstring); their folders.
    All are written to a staging folder first and then moved into place, so a failure leaves none behind."""
    out, dest = pathlib.Path(out), pathlib.Path(dest)
    if not (dest / "results.json").is_file() and (dest / "leaderboard.json").is_file():
        return restore_board(out, dest)
    published = report_rows(dest, "publish --restore", "give as DEST the docs/results folder publish wrote")
    retrained = report_rows(out, "publish --restore", "give as OUT the --out folder of a retraining that finished")
    copied_before_publish = restorable_report(published, dest, out)
    mismatch = retraining_mismatch(published, retrained)
    if mismatch:
        raise ConfigError(f"publish --restore: {out} is not a retraining of {dest}: {mismatch}; retrain with the "
                          "report's command at its commit, on its CPU and kernel settings")
    runs = [find_run(row, out) for row in retrained["runs"]]
    names = ([record_name(run_dir, out) for run_dir, _ in runs] if copied_before_publish
             else [pathlib.Path(row["run_dir"]) for row in published["runs"]])
    targets = [dest / name for name in names]
    present = [t for t in targets if t.exists()]
    if present:
        raise ConfigError(f"publish --restore: {present[0]} already holds a record; restore adds missing records only")
    if len(set(targets)) < len(targets):
        raise ConfigError(f"publish --restore: two of {dest}'s rows would share one record; restore a report whose "
                          "rows are distinct runs")
    commit = code_state(published)[0]
    texts = {}
    if copied_before_publish:  # the rows name their records as publish's would (the trained folder kept)
        for row, name in zip(published["runs"], names):
            row["run_dir_trained"], row["run_dir"] = row["run_dir"], name.as_posix()
        texts[dest / "results.json"] = json.dumps(published, indent=1) + "\n"
    board = dest / "leaderboard.csv"
    if board.is_file():  # its runs named by the records from now on, as publish names them
        records = {row["run_dir_trained"]: row["run_dir"] for row in published["runs"]}
        texts[board] = board_naming_records(board.read_bytes().decode(), records, board)
    label = report_label(published)
    # per row, the figures only the retraining has (nothing to compare them with): each record's note names its own
    extras = [retrained_only(new, old) for old, new in zip(published["runs"], retrained["runs"])]
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".restore.", dir=dest))
    try:
        rows = zip(runs, retrained["runs"], published["runs"], extras)
        for i, ((run_dir, summary), row, old, extra) in enumerate(rows):
            copy_record(run_dir, summary, staging / str(i), {"restored": restored_note(old, row, commit, label, extra)})
        move_into_place(staging, targets, texts)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    left_out = collections.Counter(path for extra in extras for path in extra)  # in the order first met
    if left_out:
        print("publish --restore: left out of the comparison, as only the retraining has them (each record's note "
              "names its own): " + ", ".join(f"{path} ({n} of {len(targets)} rows)" for path, n in left_out.items()))
    return targets


def restored_note(published_row: Dict[str, Any], retrained_row: Dict[str, Any], commit: str, label: str,
                  extra: Sequence[str]) -> str:
    """What a restored record says of itself: the retraining it is, for a row the report reused from a run at an
    earlier commit that commit too, and ``extra``, the figures only the retraining has (``retrained_only``)."""
    earlier = (f"the published run trained at {published_row['code']} and the report reused it; "
               if reused_from_earlier_code(published_row, retrained_row, label) else "")
    return (f"{earlier}retrained at {commit} by the report's command (as {retrained_row['run_dir']}); every figure "
            f"of its row but the clocks{' and the code' if earlier else ''} came back equal"
            + (f" (the retraining also has {', '.join(extra)}, which the published row lacks)" if extra else ""))


def move_into_place(staging: pathlib.Path, targets: Sequence[pathlib.Path], texts: Dict[pathlib.Path, str]) -> None:
    """Move ``staging/<i>`` to ``targets[i]``, then write each of ``texts`` (path: text); a failure anywhere takes
    back the records moved so far (and the texts written), so the folder is as it was and the same command can run
    again."""
    from lightning_modules.storage import write_text_atomic

    made = {parent for target in targets for parent in target.parents if not parent.exists()}
    before = {path: path.read_bytes().decode() for path in texts}
    moved: List[pathlib.Path] = []
    written: List[pathlib.Path] = []
    try:
        for i, target in enumerate(targets):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging / str(i)), str(target))
            moved.append(target)
        for path, text in texts.items():
            write_text_atomic(path, text)
            written.append(path)
    except BaseException:
        for target in moved:
            shutil.rmtree(target, ignore_errors=True)
        for folder in sorted(made, key=lambda path: len(path.parts), reverse=True):  # made for them, deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        for path in written:  # the report as it was, so that its rows name no record
            write_text_atomic(path, before[path])
        raise


def restorable_report(published: Dict[str, Any], dest: pathlib.Path, out: pathlib.Path) -> bool:
    """Whether ``dest`` is a report copied into the repository before publish kept records (its rows name the
    trained folders: restore then puts the records where publish would have and rewrites the rows' ``run_dir``),
    rather than one publish wrote; one line saying why it is neither otherwise."""
    if dest.resolve() == out.resolve() or (dest / "runs.json").is_file():
        what = "OUT itself" if dest.resolve() == out.resolve() else "a programme's --out (it holds runs.json)"
        raise ConfigError(f"publish --restore: DEST {dest} is {what}, not a published report; give the docs/results "
                          "folder of the report")
    if any(row.get("source") for row in published["runs"]):
        raise ConfigError(f"publish --restore: {dest} merges other reports (its rows have a source); restore each "
                          "folder its rows came from")
    kept = {"run_dir_trained" in row for row in published["runs"]}
    if len(kept) > 1:
        raise ConfigError(f"publish --restore: {dest}'s rows mix publish's (with run_dir_trained) and others; not a "
                          "report publish or a programme wrote")
    return kept == {False}


def restore_board(log_dir: pathlib.Path, dest: pathlib.Path) -> List[pathlib.Path]:
    """The records of a leaderboard published without them (``DEST/leaderboard.json`` of ``experiments.compare`` over
    runs of ``experiments.run``, no programme report), from ``LOG_DIR``, a retraining of those runs: the same runs
    (by their row's options and seed), each with every figure the stored board holds of it but its step time and
    folder, and the same code, or nothing is written; then the records go to ``DEST/runs`` as ``--runs`` writes
    them. The rows' statistics are not compared: they follow from the runs (in another order their sums may round
    differently)."""
    from analysis import compare

    stored = stored_board(dest)
    if (dest / "runs").exists():
        raise ConfigError(f"publish --restore: {dest / 'runs'} already holds records; restore adds missing records only")
    try:
        folders = compare.find_run_folders([str(log_dir)])
        runs = compare.read_runs(folders)
    except compare.CompareError as err:
        raise ConfigError(f"publish --restore: the retrained runs under {log_dir} cannot be read ({err}); give the "
                          "--log_dir they wrote to") from None
    if len(runs) < len(folders):
        raise ConfigError(f"publish --restore: {len(folders) - len(runs)} of the run folders under {log_dir} are "
                          "unfinished (named above); let them finish (or resume them) first")
    group_by = stored.get("group_by") if isinstance(stored.get("group_by"), list) else None
    mismatch = board_mismatch(stored, compare.leaderboard(runs, group_by))
    if mismatch:
        raise ConfigError(f"publish --restore: {log_dir} is not a retraining of {dest}'s runs: {mismatch}; retrain "
                          "them by the board's command at its commit, on its CPU and kernel settings")
    note = (f"retrained at {', '.join(stored['code'])} by the board's command; every figure of the run in its "
            "leaderboard.json but its step time came back equal")
    return publish_runs(log_dir, dest, {"restored": note})


def stored_board(dest: pathlib.Path) -> Dict[str, Any]:
    """``DEST/leaderboard.json``, which must name its code and hold rows listing their runs (one line otherwise)."""
    try:
        board = json.loads((dest / "leaderboard.json").read_text())
        listed = {run_dir for row in board["rows"] for run_dir in row["runs"]}
        complete = board.get("code") and board["options"] and all(run["run_dir"] in listed for run in board["runs"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"publish --restore: {dest}/leaderboard.json is not a leaderboard of experiments.compare "
                          f"({err!r}); give the folder compare wrote it to") from None
    if not complete:
        raise ConfigError(f"publish --restore: {dest}/leaderboard.json names no code or has runs no row lists; it "
                          "cannot be shown to be retrained")
    return board


def report_rows(folder: pathlib.Path, who: str, advice: str) -> Dict[str, Any]:
    """A programme's results.json, which must hold run rows with a run_dir (otherwise one line that starts with
    ``who``, the command, names the folder and ends in ``advice``)."""
    try:
        results = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{who}: {folder}/results.json is not a finished programme's report ({err}); "
                          f"{advice}") from None
    rows = results.get("runs")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and r.get("run_dir") for r in rows):
        raise ConfigError(f"{who}: {folder}/results.json has no run rows with a run_dir; nothing to publish; "
                          f"{advice}")
    return results


def replace_folder(target: pathlib.Path, fill) -> None:
    """``target`` replaced as a whole by a folder ``fill(staging)`` writes beside it (one file system, so the swap is
    a rename); nothing of the old ``target`` is left, and no staging folder stays behind when ``fill`` fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(staging)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(staging), str(target))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_runs(log_dir: pathlib.Path, dest: pathlib.Path,
                 notes: Optional[Dict[str, str]] = None) -> List[pathlib.Path]:
    """Copy the records of every run folder under ``log_dir`` to ``dest/runs/<path relative to log_dir>`` (see the
    module docstring; ``dest/runs`` is replaced as a whole); the records' folders."""
    from analysis import compare

    log_dir, dest = pathlib.Path(log_dir), pathlib.Path(dest)
    if not log_dir.is_dir():
        raise ConfigError(f"publish --runs: {log_dir} is not a folder; give the --log_dir the runs wrote to")
    source, records = log_dir.resolve(), (dest / "runs").resolve()
    if source in (records, *records.parents) or records in source.parents:  # replacing DEST/runs would delete runs
        raise ConfigError(f"publish --runs: DEST {dest} and {log_dir} overlap; give another folder (e.g. "
                          "docs/results/<name>)")
    if (dest / "results.json").is_file():
        raise ConfigError(f"publish --runs: {dest} holds a programme's published report, whose runs/ its results.json "
                          "names; give another folder")
    try:
        folders = compare.find_run_folders([str(log_dir)])
    except compare.CompareError:
        raise ConfigError(f"publish --runs: no run folders (config.yaml) under {log_dir}; give the --log_dir the "
                          "runs wrote to") from None
    runs = [(folder, finished_summary(folder)) for folder in folders]  # every one read before anything is written
    names = [run_dir.relative_to(source) for run_dir, _ in runs]

    def fill(staging: pathlib.Path) -> None:
        for (run_dir, summary), name in zip(runs, names):
            copy_record(run_dir, summary, staging / name, notes)

    replace_folder(dest / "runs", fill)
    return [dest / "runs" / name for name in names]


def finished_summary(run_dir: pathlib.Path) -> Dict[str, Any]:
    """The summary.json of a run that finished (as ``experiments.compare`` judges it: a resumed run still training
    has its earlier summary); one line naming the run otherwise."""
    import yaml

    from analysis.compare import flatten, unfinished_reason, without_unused_groups

    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"publish --runs: {run_dir} has no readable summary.json and config.yaml ({err}); let the "
                          "run finish (or resume it) before publishing") from None
    if not isinstance(summary, dict) or not isinstance(config, dict):
        raise ConfigError(f"publish --runs: {run_dir}'s summary.json or config.yaml is not a mapping; not a run of "
                          "experiments.run")
    stale = unfinished_reason(without_unused_groups(flatten(config)), summary)
    if stale:
        raise ConfigError(f"publish --runs: {run_dir} is unfinished ({stale}); let the run finish (or resume it) "
                          "before publishing")
    return summary


def copy_record(run_dir: pathlib.Path, summary: Dict[str, Any], target: pathlib.Path,
                notes: Optional[Dict[str, str]] = None) -> None:
    """One run's record (its small files, its summary thinned) into ``target``; ``notes`` join what the copy's
    ``published`` says of it."""
    target.mkdir(parents=True, exist_ok=True)
    for file in RUN_FILES:
        if (run_dir / file).is_file():
            shutil.copy2(run_dir / file, target / file)
    slim = slim_summary(summary, run_dir)
    slim["published"].update(notes or {})
    (target / "summary.json").write_text(json.dumps(slim, indent=1) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.repro.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="the programme's --out folder (with results.json and runs/); "
                                                           "with --runs: the --log_dir of experiments.run runs")
    parser.add_argument("dest", type=pathlib.Path, help="where the report and the run records go (docs/results/NAME)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--runs", action="store_true",
                      help="publish the records of the run folders under OUT (no programme report) to DEST/runs")
    mode.add_argument("--restore", action="store_true",
                      help="DEST is a report (or a leaderboard) published without its run records, OUT a retraining "
                           "by its command (for a leaderboard: its --log_dir): check every figure came back equal, then "
                           "add the records to DEST")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.runs:
        records = publish_runs(args.out, args.dest)
        print(f"published {len(records)} runs' records of {args.out} to {args.dest / 'runs'}; their table: "
              f"python -m experiments.compare {args.dest / 'runs'}")
        return {"runs": [str(r) for r in records]}
    if args.restore:
        records = restore(args.out, args.dest)
        print(f"restored {len(records)} runs' records of {args.dest} from the retraining {args.out}")
        return {"runs": [str(r) for r in records]}
    results = publish(args.out, args.dest)
    print(f"published {len(results['runs'])} runs' records and the report of {args.out} to {args.dest}")
    return results


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
