"""``experiments.repro.publish``: a programme's report and its runs' small records into the repository, with no
path of the machine that trained them, and summaries thinned to what a table or a reviewer needs."""
from __future__ import annotations

import csv
import json
import pathlib
from typing import List

import numpy as np
import pytest

from architectures.config import ConfigError
from experiments.repro import publish


@pytest.mark.parametrize("length,points", [(0, 4), (3, 4), (4, 4), (5, 4), (1000, 256), (1001, 256), (257, 256)])
def test_a_thinned_curve_keeps_its_first_and_last_point_in_order_within_the_limit(length, points):
    curve = [[step, float(step)] for step in range(1, length + 1)]
    kept = publish.thinned(curve, points)
    assert len(kept) <= points and (kept == curve if length <= points else len(kept) >= points // 2)
    if curve:
        assert kept[0] == curve[0] and kept[-1] == curve[-1]
    steps = [s for s, _ in kept]
    assert steps == sorted(set(steps)) and all(point in curve for point in kept)


def _programme_out(root: pathlib.Path, steps: int = 1000) -> pathlib.Path:
    """What a programme leaves: its report at the top of OUT, a run folder per row (run_dir relative to where it
    ran, as the programmes store it), the reuse index, a checkpoint and an events file."""
    out = root / "out" / "prog"
    rows = []
    for seed in (1337, 1338):
        run = out / "runs" / "vanilla-tiny" / f"version_{seed - 1337}"
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(b"\0" * 64)
        (run / "events.out.tfevents.1").write_bytes(b"\0" * 64)
        (run / "config.yaml").write_text(f"seed: {seed}\n")
        (run / "provenance.json").write_text(json.dumps([{"commit": "a" * 40, "kernels": {"cpu": "AMD EPYC"}}]))
        (run / "probe.json").write_text(json.dumps({"levels": {}}))
        summary = {"steps": steps, "median_step_time_s": 0.01, "run_seconds": 12.0, "run_dir": str(run.relative_to(root)),
                   "step_times_s": [[s, 0.01] for s in range(1, steps + 1)],
                   "train_loss_curve": [[s, 5.0 - s / steps] for s in range(1, steps + 1)]}
        (run / "summary.json").write_text(json.dumps(summary))
        rows.append({"variant": "vanilla", "seed": seed, "steps": steps, "val_loss": 1.0,
                     "run_dir": str(run.relative_to(root))})
    (out / "results.json").write_text(json.dumps({"settings": {}, "runs": rows}))
    (out / "results.md").write_text("# report\n")
    (out / "figure.png").write_bytes(b"\x89PNG")
    (out / "runs.json").write_text(json.dumps({"[\"x\"]": rows[0]["run_dir"]}))
    return out


def test_publish_copies_the_report_and_each_runs_records_without_paths_or_curves(tmp_path, monkeypatch):
    out = _programme_out(tmp_path)
    monkeypatch.chdir(tmp_path / "out")  # not where the programme ran: the folders are found from OUT's parents
    dest = tmp_path / "docs" / "results" / "prog"
    results = publish.main([str(out), str(dest)])
    assert sorted(p.name for p in dest.iterdir()) == ["figure.png", "results.json", "results.md", "runs"]
    stored = json.loads((dest / "results.json").read_text())
    assert stored == results
    for seed, row in zip((1337, 1338), stored["runs"]):
        assert row["run_dir"] == f"runs/vanilla-tiny/version_{seed - 1337}"  # relative to DEST: no machine's path
        assert row["run_dir_trained"] == f"out/prog/runs/vanilla-tiny/version_{seed - 1337}"
        record = dest / row["run_dir"]
        assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "probe.json", "provenance.json", "summary.json"]
        trained = out / "runs" / "vanilla-tiny" / f"version_{seed - 1337}"
        for name in ("config.yaml", "probe.json", "provenance.json"):
            assert (record / name).read_bytes() == (trained / name).read_bytes()
        slim, full = (json.loads((d / "summary.json").read_text()) for d in (record, trained))
        assert "step_times_s" not in slim and slim["train_loss_curve"][-1] == full["train_loss_curve"][-1]
        assert len(slim["train_loss_curve"]) <= publish.CURVE_POINTS
        assert {k: v for k, v in slim.items() if k not in ("train_loss_curve", "published")} == \
            {k: v for k, v in full.items() if k not in ("train_loss_curve", "step_times_s")}
        assert "1000 steps" in slim["published"]["step_times_s"]
    # published again after the programme's report changed: DEST is replaced, nothing stale stays
    (dest / "runs" / "vanilla-tiny" / "version_9").mkdir()
    (out / "figure.png").unlink()
    assert publish.main([str(out), str(dest)]) == results
    assert not (dest / "figure.png").exists() and not (dest / "runs" / "vanilla-tiny" / "version_9").exists()
    assert [p.name for p in dest.parent.iterdir()] == ["prog"]  # no staging folder left beside it


def test_publish_names_each_run_of_the_leaderboard_csv_by_its_record(tmp_path, monkeypatch, capsys):
    """The programme's run table names a run relative to OUT (compare now), relative to where the programme ran (older
    code) or by its full path; the published copy names each by its record, a folder with no record as it was, and
    keeps every other byte (CRLF, a quoted field); a name that is no run of the report is kept, with a warning."""
    out = _programme_out(tmp_path)
    monkeypatch.chdir(tmp_path / "out")
    trained = [out / "runs" / "vanilla-tiny" / f"version_{i}" for i in (0, 1)]
    names = [[trained[0].relative_to(out).as_posix(), "elsewhere/version_3"],
             ["out/prog/runs/vanilla-tiny/version_1", str(trained[0])]]
    text = "variant,note,runs\r\n" + "".join(f'vanilla,"a, b",{" ".join(n)}\r\n' for n in names)
    (out / "leaderboard.csv").write_bytes(text.encode())
    publish.main([str(out), str(tmp_path / "dest")])
    assert capsys.readouterr().err.count("names elsewhere/version_3, no run of the report") == 1
    assert (tmp_path / "dest" / "leaderboard.csv").read_bytes().decode() == (
        'variant,note,runs\r\nvanilla,"a, b",runs/vanilla-tiny/version_0 elsewhere/version_3\r\n'
        'vanilla,"a, b",runs/vanilla-tiny/version_1 runs/vanilla-tiny/version_0\r\n')


def test_a_thinned_summary_says_what_it_dropped_and_adds_nothing_a_run_did_not_write():
    assert publish.slim_summary({"steps": 3}) == {"steps": 3, "published": {}}
    slim = publish.slim_summary({"step_times_s": [[1, 0.1]], "train_loss_curve": None})
    assert slim["train_loss_curve"] == [] and set(slim["published"]) == {"step_times_s", "train_loss_curve"}


def test_runs_outside_out_are_published_under_external_and_two_that_would_share_a_record_are_refused(tmp_path):
    out = _programme_out(tmp_path)
    results = json.loads((out / "results.json").read_text())
    for i, row in enumerate(results["runs"]):  # runs of a reused --log_dir elsewhere, stored with absolute paths
        moved = tmp_path / f"logs{i}" / "vanilla-tiny" / f"version_{i}"
        moved.parent.mkdir(parents=True)
        (tmp_path / row["run_dir"]).rename(moved)
        summary = json.loads((moved / "summary.json").read_text())
        row["run_dir"] = summary["run_dir"] = str(moved)
        (moved / "summary.json").write_text(json.dumps(summary))
    (out / "results.json").write_text(json.dumps(results))
    published = publish.publish(out, tmp_path / "dest")
    assert [r["run_dir"] for r in published["runs"]] == ["external/vanilla-tiny/version_0", "external/vanilla-tiny/version_1"]
    # the same last two parts under two log folders: one record for two runs, refused
    second = pathlib.Path(results["runs"][1]["run_dir"])
    clash = second.parent.parent.parent / "logs_b" / "vanilla-tiny" / "version_0"
    clash.parent.mkdir(parents=True)
    second.rename(clash)
    summary = json.loads((clash / "summary.json").read_text())
    results["runs"][1]["run_dir"] = summary["run_dir"] = str(clash)
    (clash / "summary.json").write_text(json.dumps(summary))
    (out / "results.json").write_text(json.dumps(results))
    with pytest.raises(ConfigError, match=r"would share the record external/vanilla-tiny/version_0"):
        publish.publish(out, tmp_path / "dest2")
    assert not (tmp_path / "dest2").exists()


def test_publish_refuses_a_missing_foreign_or_unreadable_run_before_writing_anything(tmp_path):
    out = _programme_out(tmp_path)
    dest = tmp_path / "dest"
    second = out / "runs" / "vanilla-tiny" / "version_1" / "summary.json"
    summary = json.loads(second.read_text())
    second.write_text(json.dumps({**summary, "steps": 7}))  # the same folder name, another run
    with pytest.raises(ConfigError, match=r"run folder .*version_1 of vanilla seed 1338 is not there"):
        publish.publish(out, dest)
    second.write_text("{")
    with pytest.raises(ConfigError, match=r"version_1/summary\.json is unreadable"):
        publish.publish(out, dest)
    second.unlink()
    with pytest.raises(ConfigError, match=r"run folder .*version_1 of vanilla seed 1338 is not there"):
        publish.publish(out, dest)
    assert not dest.exists()
    with pytest.raises(ConfigError, match="is inside OUT"):
        publish.publish(out, out)
    (dest / "notes").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds files but no published report"):
        publish.publish(out, dest)
    assert [p.name for p in dest.iterdir()] == ["notes"]


# Reports copied into docs/results before publish kept records (their rows name the trained folders): the set may only
# shrink. Retrain one by its report's command at its commit, on its CPU, and ``publish --restore`` adds the records
# (as it did for isoflop_seeds, its width, half, half_depth and mod_width, h2h_seeds and probe_bounce_amd24 on an AMD
# EPYC, and for mom_rerun/*, isoflop_pilot, probe, probe_bounce_narrow, probe_routed, probe_depth and the leaderboard
# depth_h2h on an Intel Xeon).
COPIED_WITHOUT_RECORDS = {
    "probe_bounce", "probe_bounce_grid", "probe_bounce_recursion", "probe_bounce_routers"}


def record_of(row: dict, folder: pathlib.Path, results: pathlib.Path, restored: dict):
    """The folder of a row's run record in the repository, or None: at its ``run_dir`` relative to its report's folder
    (what publish writes); for a row that names a folder under docs/results by a machine's path, there; for a row a
    merged report copied from a report restored since (``restored``: its folder's {trained folder: record}), that
    record."""
    run_dir = row.get("run_dir")
    if not isinstance(run_dir, str):
        return None
    places = [] if pathlib.Path(run_dir).is_absolute() else [folder / run_dir]
    if "docs/results/" in run_dir:
        places.append(results / run_dir.split("docs/results/", 1)[1])
    if run_dir in restored.get(folder, {}):
        places.append(folder / restored[folder][run_dir])
    return next((place for place in places if (place / "summary.json").is_file()), None)


def rows_with_homes(results: pathlib.Path):
    """(row, the folder its run_dir is relative to, {folder: {trained folder: record}} of restored reports) for every
    run row of every report under docs/results (a merged report's rows live in the folder of their ``source``)."""
    from tests.conftest import REPO

    restored = {folder: {r["run_dir_trained"]: r["run_dir"] for r in report.get("runs") or [] if "run_dir_trained" in r}
                for folder, report in reports(results)}
    for folder, report in reports(results):
        rows = report.get("runs")
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, dict):
                first = row.get("first_source") or row.get("source")  # a merged report's row: the file it came from
                yield row, (REPO / first).parent if first else folder, restored


def reports(results: pathlib.Path):
    """(folder, results.json) of every report under docs/results, run records' own files left out."""
    for path in sorted(results.rglob("results.json")):
        if "runs" not in path.relative_to(results).parts:
            yield path.parent, json.loads(path.read_text())


def test_every_published_run_record_is_in_the_repository():
    """Every run row of every report under docs/results names its record (its summary.json), under its own report's
    folder or, for a merged report, under the folder of the file the row came from (``source``), and every leaderboard
    published alone has a record per run, except the folders copied before publish kept records
    (``COPIED_WITHOUT_RECORDS``, exactly: a newly restored folder leaves it)."""
    from tests.conftest import REPO

    results = REPO / "docs" / "results"
    without: set = set()
    checked = 0
    for row, home, restored in rows_with_homes(results):
        checked += 1
        if record_of(row, home, results, restored) is None:
            without.add(home.relative_to(results).as_posix())
    for board in results.rglob("leaderboard.json"):
        if not (board.parent / "results.json").is_file():  # a leaderboard published alone
            runs = json.loads(board.read_text())["runs"]
            checked += len(runs)
            if len(list(board.parent.glob("runs/**/summary.json"))) != len(runs):
                without.add(board.parent.relative_to(results).as_posix())
    assert checked >= 800  # every report's rows and board's runs (946 when this was written)
    assert without == COPIED_WITHOUT_RECORDS


def test_every_published_leaderboard_names_its_records_relative_to_its_folder():
    """A leaderboard published beside its records (``.json`` and ``.csv``) names each by its path from the board's
    folder, which holds on any clone, not by the path of the machine that wrote it nor the folder it ran in
    (``experiments.compare --out`` and publish write them so), and names its own: beside a report, exactly the
    report's records; in a ``.csv`` row, records of the row's seeds in its order. A board restored later keeps the
    trained folders it was published with (``depth_h2h``), which name no record of its report."""
    import yaml

    from tests.conftest import REPO

    results = REPO / "docs" / "results"
    named = 0
    for board in [*results.rglob("leaderboard.json"), *results.rglob("leaderboard.csv")]:
        if "runs" in board.relative_to(results).parts:
            continue
        report = board.parent / "results.json"
        rows = json.loads(report.read_text())["runs"] if report.is_file() else []
        trained = {r["run_dir_trained"] for r in rows if "run_dir_trained" in r}
        names = board_run_names(board)
        for run_dir in names:
            where = f"{board.relative_to(results)}: {run_dir}"
            assert "docs/results/" not in run_dir and run_dir not in trained, where
            if not pathlib.Path(run_dir).is_absolute():
                assert (board.parent / run_dir / "summary.json").is_file(), where
                named += 1
        if trained:
            assert set(names) == {r["run_dir"] for r in rows}, board.relative_to(results)
        if board.suffix == ".csv":
            with board.open(newline="") as handle:
                for row in csv.DictReader(handle):
                    records = [board.parent / name for name in row["runs"].split() if not name.startswith("/")]
                    seeds = [yaml.safe_load((record / "config.yaml").read_text())["seed"] for record in records]
                    assert not records or json.loads(row["seeds"]) == seeds, f"{board.relative_to(results)}: {row['runs']}"
    assert named >= 900  # 372 names in leaderboard.json files and 571 in leaderboard.csv files when this was written


def board_run_names(board: pathlib.Path) -> List[str]:
    """The run folders a leaderboard names: in ``.json`` each row's and each run's, in ``.csv`` the ``runs`` column."""
    if board.suffix == ".json":
        stored = json.loads(board.read_text())
        return [run["run_dir"] for run in stored["runs"]] + [d for row in stored["rows"] for d in row["runs"]]
    with board.open(newline="") as handle:
        return [name for row in csv.DictReader(handle) for name in row["runs"].split()]


def test_every_run_record_holds_its_rows_seed_loss_steps_and_parameters():
    """A record is its row's run, not a neighbour's: a restore matches rows to retrained runs, and two runs trained at
    once swap version folders. The row's val_loss is one of the record's validation losses (programmes headline the
    causal or the plain one); its final_val_loss, steps and parameters, where it has them, are the record's, and its
    seed is the record's config's."""
    import yaml

    from tests.conftest import REPO

    results = REPO / "docs" / "results"
    checked = 0
    for row, home, restored in rows_with_homes(results):
        record = record_of(row, home, results, restored)
        if record is None:
            continue  # rows without records are the previous test's
        summary = json.loads((record / "summary.json").read_text())
        losses = {summary["final_val_loss"], *(v for k, v in summary["val_metrics"].items() if k.startswith("val/loss"))}
        where = f"{home.relative_to(results)} {row['run_dir']}"
        assert "val_loss" not in row or row["val_loss"] in losses, where
        assert all(row[k] == summary[k] for k in ("final_val_loss", "steps", "parameters") if k in row), where
        assert "seed" not in row or row["seed"] == yaml.safe_load((record / "config.yaml").read_text())["seed"], where
        checked += 1
    assert checked >= 650  # 695 when this was written


def _published_without_records(tmp_path) -> pathlib.Path:
    """A report published before its records were kept: publish's output with runs/ gone."""
    import shutil

    dest = tmp_path / "docs" / "report"
    publish.publish(_programme_out(tmp_path / "first"), dest)
    shutil.rmtree(dest / "runs")
    results = json.loads((dest / "results.json").read_text())
    (dest / "results.json").write_text(json.dumps({**results, "provenance": CODE}))
    return dest


CODE = {"commit": "a" * 40, "dirty": False, "diff_sha256": None}


def _retrained(tmp_path, change=None) -> pathlib.Path:
    """The same command run again: every figure equal, other clocks, and the two seeds' version folders swapped (two
    runs at once take the version numbers in the order they start)."""
    out = _programme_out(tmp_path / "again")
    results = json.loads((out / "results.json").read_text())
    runs = out / "runs" / "vanilla-tiny"
    (runs / "version_0").rename(runs / "swap")
    (runs / "version_1").rename(runs / "version_0")
    (runs / "swap").rename(runs / "version_1")
    for row, version in zip(results["runs"], ("version_1", "version_0")):
        row.update({"wall_s": 99.0, "step_time_s": 0.5, "run_step_s": 0.4, **(change or {})})
        row["run_dir"] = row["run_dir"].rsplit("/", 1)[0] + "/" + version
        summary = json.loads((runs / version / "summary.json").read_text())
        (runs / version / "summary.json").write_text(json.dumps({**summary, "run_dir": row["run_dir"]}))
    (out / "results.json").write_text(json.dumps({**results, "provenance": CODE}))
    return out


def test_restore_adds_the_records_of_a_retraining_whose_every_figure_equals_the_published_rows(tmp_path):
    dest = _published_without_records(tmp_path)
    report = (dest / "results.md").read_text(), (dest / "results.json").read_text()
    records = publish.main(["--restore", str(_retrained(tmp_path)), str(dest)])["runs"]
    rows = json.loads((dest / "results.json").read_text())["runs"]
    assert records == [str(dest / row["run_dir"]) for row in rows]
    for row in rows:  # the row's own record, at its published path, and the note that it came back by retraining
        summary = json.loads((dest / row["run_dir"] / "summary.json").read_text())
        assert summary["steps"] == row["steps"] and "retrained at " + "a" * 40 in summary["published"]["restored"]
        assert (dest / row["run_dir"] / "config.yaml").read_text() == f"seed: {row['seed']}\n"
    assert ((dest / "results.md").read_text(), (dest / "results.json").read_text()) == report  # the report stays
    with pytest.raises(ConfigError, match="already holds a record; restore adds missing records only"):
        publish.restore(_retrained(tmp_path / "2"), dest)


def test_a_row_reused_from_an_earlier_commit_is_restored_from_its_retraining_at_the_reports_and_says_both(tmp_path):
    """A programme reuses the finished runs of its --out, so a row may carry an earlier commit than its report; its
    retraining at the report's commit relabels it. Only that code may differ, and the record names both commits."""
    dest = _published_without_records(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    results["runs"][0]["code"], results["runs"][1]["code"] = "e" * 10, "a" * 10  # one reused row, one trained at a
    (dest / "results.json").write_text(json.dumps(results))
    publish.restore(_retrained(tmp_path, {"code": "a" * 10}), dest)
    notes = [json.loads((dest / r["run_dir"] / "summary.json").read_text())["published"]["restored"]
             for r in results["runs"]]
    assert notes[0].startswith("the published run trained at " + "e" * 10 + " and the report reused it; retrained "
                               "at " + "a" * 40) and notes[0].endswith("but the clocks and the code came back equal")
    assert notes[1].startswith("retrained at " + "a" * 40) and notes[1].endswith("but the clocks came back equal")


def test_a_restored_record_names_the_figures_only_its_retraining_has(tmp_path, capsys):
    """Later code writes figures an earlier run did not (probe.json's hops family and n_levels): the restore compares
    every published figure, the record's note names what it left out, at any depth, and the restore says so too."""
    dest = _published_without_records(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    rows = [{**r, "probe": {"levels": {"0": 1.0}}} for r in results["runs"]]
    rows[0]["hard_from"] = 3  # published in one row: compared there, left out in the other
    (dest / "results.json").write_text(json.dumps({**results, "runs": rows}))
    capsys.readouterr()
    publish.restore(_retrained(tmp_path, {"probe": {"levels": {"0": 1.0}, "n_levels": 5}, "hard_from": 3}), dest)
    assert capsys.readouterr().out == ("publish --restore: left out of the comparison, as only the retraining has them "
                                       "(each record's note names its own): probe.n_levels (2 of 2 rows), "
                                       "hard_from (1 of 2 rows)\n")
    row = results["runs"][1]
    note = json.loads((dest / row["run_dir"] / "summary.json").read_text())["published"]["restored"]
    assert note.endswith("came back equal (the retraining also has probe.n_levels, hard_from, which the published "
                         "row lacks)")
    assert publish.retrained_only({"wall_s": 1.0, "probe": {"a": {"b": 1, "c": 2}}}, {"probe": {"a": {"b": 1}}}) == [
        "probe.a.c"]


@pytest.mark.parametrize("published,retrained,named", [
    ("e" * 10, "e" * 10, "trained at e+, not at the report's a+: the retraining reused a run it did not train"),
    ("a" * 10, "f" * 10, "trained at f+, not at the report's a+"),  # trained elsewhere than the report's commit
    ("unknown", "a" * 10, 'code "unknown" published, "a+" retrained'),  # not a clean commit: nothing says it is earlier
    ("e" * 10 + "+dirty:12345678", "a" * 10, r'code "e+\+dirty:12345678" published'),
    ("e" * 10 + ">" + "a" * 10, "a" * 10, 'code "e+>a+" published'),  # resumed across commits
])
def test_restore_refuses_a_code_that_differs_unless_a_clean_earlier_run_was_retrained_at_the_reports(
        tmp_path, published, retrained, named):
    dest = _published_without_records(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    (dest / "results.json").write_text(json.dumps({**results, "runs": [{**r, "code": published} for r in
                                                                        results["runs"]]}))
    with pytest.raises(ConfigError, match=r"row 0 \(vanilla seed 1337\):? " + named):
        publish.restore(_retrained(tmp_path, {"code": retrained}), dest)
    assert not (dest / "runs").exists()


def test_a_reused_row_needs_every_other_figure_and_the_report_its_own_numbers_equal_dirty_reports_included():
    reused = {"variant": "mod", "seed": 1, "code": "e" * 10, "val_loss": 1.0}
    dirty = {**CODE, "dirty": True, "diff_sha256": "d" * 64}
    report = lambda row, **top: {"provenance": dirty, "runs": [row], **top}  # noqa: E731
    again = {**reused, "code": "a" * 10 + "+dirty:" + "d" * 8}
    assert publish.retraining_mismatch(report(reused, budget=1e12), report(again, budget=1e12)) is None
    assert "val_loss" in publish.retraining_mismatch(report(reused), report({**again, "val_loss": 1.5}))
    assert publish.retraining_mismatch(report(reused, vanilla_val_loss=6.0), report(again, vanilla_val_loss=6.5)) == (
        "the report's vanilla_val_loss is 6.0, the retraining's 6.5")


@pytest.mark.parametrize("change,named", [({"val_loss": 1.0000001}, "row 0 (vanilla seed 1337): val_loss 1.0 "),
                                          ({"steps": 999}, "row 0 (vanilla seed 1337): steps 1000 "),
                                          ({"steps": 1000.0}, "row 0 (vanilla seed 1337): steps 1000 published, 1000.0")])
def test_restore_refuses_a_retraining_that_differs_in_any_figure_and_writes_nothing(tmp_path, change, named):
    dest = _published_without_records(tmp_path)
    with pytest.raises(ConfigError, match=r"publish --restore: .* is not a retraining of .*: " + named.replace("(", r"\(")
                       .replace(")", r"\)") + ".*; retrain with the report's command"):
        publish.restore(_retrained(tmp_path, change), dest)
    assert not (dest / "runs").exists()


def test_restore_refuses_another_commit_or_a_folder_publish_did_not_write(tmp_path):
    dest = _published_without_records(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    (dest / "results.json").write_text(json.dumps({**results, "provenance": {**CODE, "commit": "b" * 40}}))
    with pytest.raises(ConfigError, match=r"the report's code \(commit, dirty, diff\) is \('b+', False, None\), the "
                                          r"retraining's \('a+', False, None\)"):
        publish.restore(_retrained(tmp_path), dest)
    (dest / "results.json").write_text(json.dumps({**results, "provenance": None}))
    with pytest.raises(ConfigError, match="the published report names no commit"):
        publish.restore(_retrained(tmp_path / "3"), dest)
    unpublished = _programme_out(tmp_path / "raw")
    with pytest.raises(ConfigError, match=r"is a programme's --out \(it holds runs.json\), not a published report"):
        publish.restore(_retrained(tmp_path / "2"), unpublished)
    assert not (dest / "runs").exists()


def _copied_before_publish(tmp_path) -> pathlib.Path:
    """A report copied into docs/ before publish existed: the programme's results.json, results.md and run table
    (``leaderboard.csv``, CRLF as compare writes it), its rows and the table naming the trained folders, no records."""
    import shutil

    out = _programme_out(tmp_path / "first")
    dest = tmp_path / "docs" / "old_report"
    dest.mkdir(parents=True)
    shutil.copy2(out / "results.md", dest / "results.md")
    results = json.loads((out / "results.json").read_text())
    (dest / "results.json").write_text(json.dumps({**results, "provenance": CODE}))
    trained = " ".join(row["run_dir"] for row in results["runs"])
    (dest / "leaderboard.csv").write_bytes(f"variant,runs\r\nvanilla,{trained}\r\n".encode())
    return dest


def test_restore_gives_a_report_copied_before_publish_its_records_and_rows_as_publish_writes_them(tmp_path):
    dest = _copied_before_publish(tmp_path)
    before = json.loads((dest / "results.json").read_text())
    publish.restore(_retrained(tmp_path), dest)
    after = json.loads((dest / "results.json").read_text())
    # the records at the retraining's own paths under DEST (its version folders were swapped: seed 1337 is version_1)
    assert [r["run_dir"] for r in after["runs"]] == ["runs/vanilla-tiny/version_1", "runs/vanilla-tiny/version_0"]
    assert [r["run_dir_trained"] for r in after["runs"]] == [r["run_dir"] for r in before["runs"]]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in publish.PATH_FIELDS} for r in rows]  # noqa: E731
    assert strip(after["runs"]) == strip(before["runs"]) and {**after, "runs": 0} == {**before, "runs": 0}
    for row in after["runs"]:
        assert (dest / row["run_dir"] / "config.yaml").read_text() == f"seed: {row['seed']}\n"
    # the run table names the records too, in the rows' order
    assert (dest / "leaderboard.csv").read_bytes() == b"variant,runs\r\nvanilla,runs/vanilla-tiny/version_1 runs/vanilla-tiny/version_0\r\n"
    with pytest.raises(ConfigError, match="already holds a record"):  # now a report publish wrote, with its records
        publish.restore(_retrained(tmp_path / "2"), dest)


def test_restore_refuses_merged_or_mixed_reports_and_writes_nothing(tmp_path):
    dest = _copied_before_publish(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    for rows, refusal in ((
            [{**results["runs"][0], "source": "docs/results/a/results.json"}, results["runs"][1]],
            r"merges other reports \(its rows have a source\); restore each folder its rows came from"),
            ([{**results["runs"][0], "run_dir_trained": "x"}, results["runs"][1]], "rows mix publish's")):
        (dest / "results.json").write_text(json.dumps({**results, "runs": rows}))
        with pytest.raises(ConfigError, match=refusal):
            publish.restore(_retrained(tmp_path / str(len(refusal))), dest)
    assert sorted(p.name for p in dest.iterdir()) == ["leaderboard.csv", "results.json", "results.md"]


def test_retraining_rows_compare_bit_for_bit_with_nan_equal_to_nan_and_only_the_clocks_free():
    run = {"variant": "mod", "seed": 1, "val_loss": float("nan"), "probe": {"levels": [0.5, float("nan")]},
           "wall_s": 3.0}
    report = lambda *rows: {"provenance": CODE, "runs": list(rows)}  # noqa: E731
    assert publish.retraining_mismatch(report(run), report({**run, "wall_s": 9.0, "new_field": 1})) is None
    assert "row 1 (mod seed 1): val_loss NaN published, 0.5 retrained" in publish.retraining_mismatch(
        report(run, run), report(run, {**run, "val_loss": 0.5}))
    assert publish.retraining_mismatch(report(run), report(run, run)) == "1 published rows, 2 retrained"
    assert "probe" in publish.retraining_mismatch(report(run), report({**run, "probe": {"levels": [0.5, 0.0]}}))


def test_a_figure_only_the_retraining_has_is_left_out_at_any_depth_but_a_published_one_is_compared():
    """A run a report reused from an earlier commit wrote its probe.json without the figures later code adds (the
    hops family, n_levels): the retraining's extra keys have nothing to be compared with; every published one must
    come back, at every depth of nested dicts, and the refusal names the first figure that differs."""
    run = {"variant": "mod", "seed": 1, "probe": {"families": {"arith": {"0": {"acc": 1.0}}}, "spearman": None}}
    report = lambda *rows: {"provenance": CODE, "runs": list(rows)}  # noqa: E731
    later = {**run, "probe": {"families": {"arith": {"0": {"acc": 1.0, "tokens": 5}}, "hops": {}}, "n_levels": 5,
                              "spearman": None}}
    assert publish.retraining_mismatch(report(run), report(later)) is None
    changed = {**later, "probe": {**later["probe"], "families": {"arith": {"0": {"acc": 0.5}}, "hops": {}}}}
    assert publish.retraining_mismatch(report(run), report(changed)) == (
        "row 0 (mod seed 1): probe.families.arith.0.acc 1.0 published, 0.5 retrained")
    lost = {**later, "probe": {k: v for k, v in later["probe"].items() if k != "spearman"}}
    assert publish.retraining_mismatch(report(run), report(lost)) == (
        "row 0 (mod seed 1): probe.spearman null published, missing retrained")
    for published, retrained in (({"a": {}}, {"a": {"b": 1}}), ({"a": {"b": 1}}, {"a": 1}), ({"a": {}}, {"a": None}),
                                 ([{"b": 1}], [{"b": 1, "c": 2}]), ([1.0], [1.0, 2.0])):
        wrong = publish.retraining_mismatch(report({**run, "probe": published}), report({**run, "probe": retrained}))
        assert (wrong is None) == (published == {"a": {}} and retrained == {"a": {"b": 1}}), (published, retrained)


def test_a_row_trained_at_the_reports_own_code_may_not_gain_a_figure_at_any_depth():
    """The same code wrote the published row and the retrained one: an extra figure there is a difference, not a
    figure later code added."""
    run = {"variant": "mod", "seed": 1, "code": "a" * 10, "probe": {"levels": {"0": 1.0}}}
    report = lambda *rows: {"provenance": CODE, "runs": list(rows)}  # noqa: E731
    nested = {**run, "probe": {"levels": {"0": 1.0, "1": 0.5}}}
    assert publish.retraining_mismatch(report(run), report(nested)) == (
        "row 0 (mod seed 1): probe.levels.1 missing published, 0.5 retrained")
    assert publish.retraining_mismatch(report(run), report({**run, "n_levels": 5})) == (
        "row 0 (mod seed 1): n_levels missing published, 5 retrained")
    assert publish.retraining_mismatch(report(run), report({**run, "wall_s": 3.0})) is None


@pytest.fixture(scope="module")
def board_runs(tmp_path_factory):
    """Two real runs of experiments.run (vanilla, seeds 1 and 2) and the leaderboard experiments.compare made of them,
    published as a leaderboard only (DEST holds leaderboard.json and .md, no records)."""
    import shutil

    from analysis import compare
    from experiments.run import main
    from tests.conftest import TINY_RUN

    root = tmp_path_factory.mktemp("board")
    for seed in (1, 2):
        main(["--seed", str(seed), "--max_steps", "2", "--val_every", "2", "--log_dir", str(root / "log"), *TINY_RUN,
              "--callbacks.contribution", "false", "--callbacks.throughput", "false"])
    compare.compare([str(root / "log")], group_by=["model.variant"], out=root / "board")
    dest = root / "published"
    dest.mkdir()
    for name in ("leaderboard.json", "leaderboard.md"):
        shutil.copy2(root / "board" / name, dest / name)
    return root / "log", dest


def _retraining(log: pathlib.Path, where: pathlib.Path, **summary_changes) -> pathlib.Path:
    """The runs again, elsewhere: every summary.json with other clocks (and ``summary_changes`` in the first)."""
    import shutil

    shutil.copytree(log, where)
    for i, path in enumerate(sorted(where.rglob("summary.json"))):
        summary = json.loads(path.read_text())
        summary["median_step_time_s"] = 9.0
        summary.update(summary_changes if i == 0 else {})
        path.write_text(json.dumps(summary))
    return where


def test_restore_gives_a_leaderboard_only_folder_the_records_of_a_retraining_with_every_figure_equal(board_runs,
                                                                                                      tmp_path):
    import shutil

    log, published = board_runs
    dest = tmp_path / "dest"
    shutil.copytree(published, dest)
    records = publish.main(["--restore", str(_retraining(log, tmp_path / "again")), str(dest)])["runs"]
    assert len(records) == 2 and sorted(p.name for p in dest.iterdir()) == ["leaderboard.json", "leaderboard.md", "runs"]
    for record in map(pathlib.Path, records):
        summary = json.loads((record / "summary.json").read_text())
        assert " by the board's command; every figure of the run" in summary["published"]["restored"]
    with pytest.raises(ConfigError, match="already holds records; restore adds missing records only"):
        publish.restore(_retraining(log, tmp_path / "third"), dest)


def test_restore_refuses_a_leaderboard_retraining_that_differs_in_a_figure_or_the_code(board_runs, tmp_path):
    import shutil

    log, published = board_runs
    dest = tmp_path / "dest"
    shutil.copytree(published, dest)
    first = json.loads(sorted(log.rglob("summary.json"))[0].read_text())
    ulp = {"final_val_loss": float(np.nextafter(first["final_val_loss"], 10.0)),
           "val_metrics": {**first["val_metrics"], "val/loss": float(np.nextafter(first["val_metrics"]["val/loss"], 10.0))}}
    with pytest.raises(ConfigError, match=r"is not a retraining of .*: {\"variant\": \"vanilla\"} seed 1: headline_val_loss .* stored, .* retrained"):
        publish.restore(_retraining(log, tmp_path / "ulp", **ulp), dest)
    board = json.loads((dest / "leaderboard.json").read_text())
    (dest / "leaderboard.json").write_text(json.dumps({**board, "code": {"0123456789": 2}}))
    with pytest.raises(ConfigError, match=r"the board's code is \{'0123456789': 2\}, the retraining's"):
        publish.restore(_retraining(log, tmp_path / "again"), dest)
    assert not (dest / "runs").exists()


def test_a_restore_that_fails_midway_takes_back_its_records_and_can_run_again(tmp_path, monkeypatch):
    import lightning_modules.storage as storage

    dest = _copied_before_publish(tmp_path)
    before = {name: (dest / name).read_bytes() for name in ("results.json", "leaderboard.csv")}
    write = storage.write_text_atomic

    def full_disk_after_one(path, text, what="write"):  # results.json written, the run table not: both taken back
        if path.name == "leaderboard.csv" and text != before["leaderboard.csv"].decode():
            raise OSError(28, "No space left on device")
        write(path, text, what)

    monkeypatch.setattr(storage, "write_text_atomic", full_disk_after_one)
    with pytest.raises(OSError, match="No space left"):
        publish.restore(_retrained(tmp_path), dest)
    assert {name: (dest / name).read_bytes() for name in before} == before and not (dest / "runs").exists()
    monkeypatch.undo()
    publish.restore(_retrained(tmp_path / "2"), dest)  # the same command again: nothing was left in its way
    assert all((dest / r["run_dir"] / "summary.json").is_file() for r in json.loads((dest / "results.json").read_text())["runs"])


def test_restore_refuses_a_leaderboard_retraining_with_a_run_missing_or_unfinished(board_runs, tmp_path):
    import shutil

    log, published = board_runs
    dest = tmp_path / "dest"
    shutil.copytree(published, dest)
    fewer = _retraining(log, tmp_path / "fewer")
    shutil.rmtree(sorted(fewer.rglob("summary.json"))[1].parent)
    with pytest.raises(ConfigError, match=r"the run of {\"variant\": \"vanilla\"} seed 2 is in only the stored board"):
        publish.restore(fewer, dest)
    unfinished = _retraining(log, tmp_path / "unfinished")
    sorted(unfinished.rglob("summary.json"))[1].unlink()
    with pytest.raises(ConfigError, match=r"1 of the run folders under .* are unfinished \(named above\)"):
        publish.restore(unfinished, dest)
    assert not (dest / "runs").exists()
