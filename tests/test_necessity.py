"""``experiments.repro necessity``: the depth-necessity programme (vanilla at several depths, equal steps, seeds),
its verdict rule on known tables, and the programme end to end on a tiny probe."""
from __future__ import annotations

import pathlib

import pytest
import yaml

from architectures.config import ConfigError
from experiments import repro
from experiments.repro.necessity import check_settings, necessity_verdict

TINY_PROBE = ["--data", "probe-v7/shift", "--data.max_tokens", "8192", "--model.block_size", "128",
              "--callbacks.probe_blocks", "16", "--model.d_model", "32", "--model.n_head", "2", "--data.batch_size", "4",
              "--val_blocks", "8", "--trainer.enable_progress_bar", "false", "--val_every", "10"]


def _row(layers: int, accuracies, difference=None, p_holm=None):
    solved = sum(a >= 0.9 for a in accuracies)
    level = {"ci": (min(accuracies), max(accuracies)), "solved": solved / len(accuracies), "solved_n": len(accuracies)}
    if layers > 1:
        level["vs_baseline"] = {"difference": difference, "p_holm": p_holm}
    return {"model.n_layer": layers, "n": len(accuracies), "probe_acc_L1": {"mean": sum(accuracies) / len(accuracies)},
            "probe_levels": {"probe_acc_L0": {**level, "solved": 1.0}, "probe_acc_L1": level}}


def _board(*rows):
    return {"baseline": f"vanilla n_layer={min(r['model.n_layer'] for r in rows)}", "rows": list(rows)}


SHALLOW = _row(1, [0.1, 0.1, 0.2, 0.1, 0.95])  # solves level 1 in one seed: allowed
SOLVING = [0.99, 0.98, 0.97, 0.96, 0.5]  # four of five


@pytest.mark.parametrize("deeper,verdict,meeting", [
    ([_row(2, SOLVING, 0.6, 0.01), _row(4, SOLVING, 0.6, 0.01)], "met", [2, 4]),
    ([_row(2, SOLVING, 0.6, 0.2), _row(4, SOLVING, 0.6, 0.01)], "partly met", [4]),  # 2 layers fail Holm
    ([_row(2, [0.99, 0.98, 0.5, 0.5, 0.5], 0.4, 0.01), _row(4, SOLVING, 0.6, 0.01)], "partly met", [4]),  # 2 of 5
    ([_row(2, SOLVING, 0.6, 0.2), _row(4, SOLVING, 0.6, 0.06)], "not met", []),
    ([_row(2, SOLVING, -0.1, 0.01), _row(4, SOLVING, -0.1, 0.01)], "not met", []),  # significant, the wrong way
    ([_row(2, SOLVING, 0.6, 0.05), _row(4, SOLVING, 0.6, 0.049)], "partly met", [4]),  # p 0.05 does not pass
    ([_row(2, SOLVING, 0.0, 0.01), _row(4, SOLVING, 0.6, 0.01)], "partly met", [4]),  # no difference does not
    ([_row(2, SOLVING, None, None), _row(4, SOLVING, 0.6, 0.01)], "partly met", [4]),  # no test: not met by it
], ids=["met", "partly-holm", "partly-seeds", "not-met", "negative", "p-at-alpha", "tie", "no-test"])
def test_the_rule_on_known_tables(deeper, verdict, meeting):
    result = necessity_verdict(_board(SHALLOW, *deeper))
    assert (result["verdict"], result["deeper_meeting"], result["level"]) == (verdict, meeting, 1)


def test_a_shallow_model_that_solves_the_level_too_often_is_never_met():
    shallow = _row(1, [0.95, 0.95, 0.1, 0.1, 0.1])  # two seeds: more than --shallow_max 1
    result = necessity_verdict(_board(shallow, _row(2, SOLVING, 0.6, 0.01), _row(4, SOLVING, 0.6, 0.01)))
    assert result["verdict"] == "not met" and not result["shallow_fails"]
    assert necessity_verdict(_board(shallow, _row(2, SOLVING, 0.6, 0.01)), shallow_max=2)["verdict"] == "met"


def test_boards_the_rule_cannot_judge_are_refused():
    with pytest.raises(ConfigError, match=r"--level: the runs report levels 0, 1, not 3"):
        necessity_verdict(_board(SHALLOW, _row(2, SOLVING, 0.6, 0.01)), level=3)
    with pytest.raises(ConfigError, match=r"the table's baseline is None, not the shallowest depth"):
        necessity_verdict({"rows": [SHALLOW, _row(2, SOLVING, 0.6, 0.01)]})
    one_run = _row(4, [0.99], 0.8, 0.001)  # its test would leave Holm's family: the other row's p uncorrected
    with pytest.raises(ConfigError, match=r"4 layers: fewer than two runs measured level 1"):
        necessity_verdict(_board(SHALLOW, _row(2, SOLVING, 0.6, 0.04), one_run))
    without_level = _row(4, SOLVING, 0.6, 0.01)
    del without_level["probe_levels"]["probe_acc_L1"]
    with pytest.raises(ConfigError, match=r"4 layers: fewer than two runs measured level 1"):
        necessity_verdict(_board(SHALLOW, _row(2, SOLVING, 0.6, 0.01), without_level))


def test_the_verdict_line_writes_a_missing_number_as_a_dash():
    from experiments.repro.necessity import verdict_line

    nan_row = _row(2, SOLVING, None, None)
    nan_row["probe_acc_L1"]["mean"] = None
    line = verdict_line(necessity_verdict(_board(SHALLOW, nan_row)))
    assert "2 layers - (4/5 seeds solve it; - vs 1 layer, Holm p -)" in line


@pytest.mark.parametrize("layers,seeds,shallow_max,min_solving,pattern", [
    ([2], 5, 1, 4, r"--layers: at least two different positive depths, got 2"),
    ([2, 2], 5, 1, 4, r"--layers: at least two different"),
    ([0, 2], 5, 1, 4, r"--layers: at least two different positive depths, got 0,2"),
    ([1, 2], 1, 0, 1, r"--seeds: at least 2"),
    ([1, 2], 5, 5, 4, r"--shallow_max: 0 to 4"),
    ([1, 2], 5, 1, 6, r"--min_solving: 1 to 5"),
])
def test_grids_the_rule_cannot_judge_are_refused_naming_the_option(layers, seeds, shallow_max, min_solving, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_settings(layers, seeds, shallow_max, min_solving)


def test_the_programme_end_to_end_reuses_its_runs_and_publishes(tmp_path, monkeypatch):
    """Two depths x two seeds on a tiny probe: the report holds the verdict line and compare's tables grouped by
    depth against the shallowest; a second invocation trains nothing; publish copies the records."""
    from experiments import run
    from experiments.repro import publish

    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["necessity", "--out", str(out), "--steps", "20", "--layers", "2,1", "--seeds", "2", "--min_solving", "1",
            "--", *TINY_PROBE]
    results = repro.main(argv)
    assert [(r["n_layer"], r["seed"]) for r in results["runs"]] == [(1, 1337), (1, 1338), (2, 1337), (2, 1338)]
    assert results["verdict"]["level"] == 1 and set(results["verdict"]["depths"]) == {1, 2}
    report = (out / "results.md").read_text()
    assert f"**Verdict: {results['verdict']['verdict']}.** Level 1: 1 layer" in report
    assert "Δ L1 vs baseline" in report and "| vanilla n_layer=1 | 2 |" in report  # compare's tables, by depth
    trained = [r["run_dir"] for r in results["runs"]]
    monkeypatch.setattr(run, "main", lambda *a, **k: pytest.fail("a finished run was trained again"))
    again = repro.main(argv)
    assert [r["run_dir"] for r in again["runs"]] == trained and again["verdict"] == results["verdict"]
    for row in results["runs"]:  # the runs trained what the rows say
        config = yaml.safe_load((pathlib.Path(row["run_dir"]) / "config.yaml").read_text())
        assert (config["model"]["n_layer"], config["seed"]) == (row["n_layer"], row["seed"])
    published = publish.publish(out, tmp_path / "published")
    assert len(list((tmp_path / "published" / "runs").rglob("summary.json"))) == 4
    assert published["verdict"]["verdict"] == results["verdict"]["verdict"]
    rebuilt = repro.main(["necessity", "--out", str(tmp_path / "rebuilt"), "--min_solving", "1", "--tables_from",
                          str(tmp_path / "published" / "runs")])  # from the records alone
    assert rebuilt["verdict"] == results["verdict"]


def test_the_published_8k_check_rebuilds_its_verdict_from_its_records(tmp_path):
    from tests.conftest import REPO

    results = repro.main(["necessity", "--out", str(tmp_path), "--tables_from",
                          str(REPO / "docs" / "results" / "probe_induct_necessity_8k" / "runs")])
    assert results["verdict"]["verdict"] == "not met" and results["settings"]["layers"] == [1, 2, 4]
    assert "**Verdict: not met.** Level 1: 1 layer 0.071 (0/5 seeds solve it)" in (tmp_path / "results.md").read_text()


def test_the_published_16k_check_rebuilds_its_pre_registered_verdict_from_its_records(tmp_path):
    """docs/results/probe_induct_necessity_16k (pre-registered, seeds 1357-1361): partly met, the 4-layer row alone
    (5/5 seeds solve level 1, Holm p < 0.05); the verdict in the published report is the records' own."""
    from tests.conftest import REPO

    folder = REPO / "docs" / "results" / "probe_induct_necessity_16k"
    results = repro.main(["necessity", "--out", str(tmp_path), "--tables_from", str(folder / "runs")])
    assert results["verdict"]["verdict"] == "partly met" and results["settings"]["layers"] == [1, 2, 4]
    line = next(l for l in (tmp_path / "results.md").read_text().splitlines() if l.startswith("**Verdict"))
    assert line.startswith("**Verdict: partly met.** Level 1: 1 layer 0.140 (0/5 seeds solve it); 2 layers 0.551 (2/5")
    assert "4 layers 1.000 (5/5 seeds solve it" in line and line in (folder / "results.md").read_text()
