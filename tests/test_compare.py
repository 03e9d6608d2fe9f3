"""``python -m experiments.compare``: the leaderboard of run folders, on real runs trained here (2 configurations
x 2 seeds, a few steps of a tiny model), and on copies of them with summaries of known numbers."""
from __future__ import annotations

import csv
import json
import math
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from analysis import compare
from experiments import compare as compare_cli
from experiments.repro.common import Context
from tests.conftest import REPO, TINY_RUN

STEPS = 2
CONFIGS = {"vanilla": ["--variant", "vanilla"], "mod": ["--variant", "mod", "--model.mod.capacity", "0.25"]}
SEEDS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(config name, seed): run folder} of four real runs of experiments.run."""
    from experiments.run import main

    root = tmp_path_factory.mktemp("compare_runs")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folders = {(name, seed): main([*argv, "--seed", str(seed), "--max_steps", str(STEPS), "--val_every", str(STEPS),
                                       "--log_dir", str(root / "runs"), *TINY_RUN, "--callbacks.contribution", "false",
                                       "--callbacks.throughput", "false"])
                   for name, argv in CONFIGS.items() for seed in SEEDS}
    finally:
        torch.set_num_threads(before)
    return folders


def copy_runs(runs, tmp_path: pathlib.Path, keys=None) -> dict:
    """Copies of the real run folders (so tests can edit them) under tmp_path/runs."""
    out = {}
    for key in keys or runs:
        name, seed = key
        out[key] = tmp_path / "runs" / f"{name}-seed{seed}"
        shutil.copytree(runs[key], out[key])
    return out


def edit_summary(folder: pathlib.Path, **values) -> None:
    path = folder / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(values)
    path.write_text(json.dumps(summary))


def edit_config(folder: pathlib.Path, key: str, value) -> None:
    path = folder / "config.yaml"
    config = yaml.safe_load(path.read_text())
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value
    path.write_text(yaml.safe_dump(config))


def run_cli(argv, capsys) -> tuple:
    """(exit status, stdout, stderr) of the command as ``python -m experiments.compare`` runs it."""
    try:
        compare_cli.cli(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row_of(board: dict, variant: str) -> dict:
    return next(r for r in board["rows"] if r["variant"] == variant)


# ---------------------------------------------------------------------------- on the real runs
def test_real_runs_one_row_per_configuration_with_its_seeds(runs, tmp_path):
    board = compare.compare([str(next(iter(runs.values())).parent.parent)], out=tmp_path / "board")
    assert {r["variant"] for r in board["rows"]} == {"vanilla", "mod"}
    for name in CONFIGS:
        row = row_of(board, name)
        assert row["n"] == 2 and sorted(row["seeds"]) == list(SEEDS)
        summaries = [json.loads((runs[(name, s)] / "summary.json").read_text()) for s in SEEDS]
        losses = [s["val_metrics"]["val/loss"] for s in summaries]
        assert row["val_loss"]["mean"] == pytest.approx(sum(losses) / 2)
        assert row["val_loss"]["std"] == pytest.approx(abs(losses[0] - losses[1]) / math.sqrt(2))
        headline = [s["val_metrics"].get("val/loss_causal", s["val_metrics"]["val/loss"]) for s in summaries]
        assert row["headline_val_loss"]["mean"] == pytest.approx(sum(headline) / 2)
        assert row["steps"]["mean"] == STEPS and row["tokens"]["mean"] == summaries[0]["tokens_seen"]
        flops = [s["flops_per_token"]["training"] * s["tokens_seen"] for s in summaries]
        assert row["train_flops"]["mean"] == pytest.approx(sum(flops) / 2)
        assert row["parameters"]["mean"] == summaries[0]["parameters"]
    # MoD's routing sees the future: it reports a causal validation loss, vanilla has none
    assert row_of(board, "mod")["val_loss_causal"]["n"] == 2 and row_of(board, "vanilla")["val_loss_causal"]["n"] == 0
    # MoD at capacity 0.25 spends fewer FLOPs per token than vanilla
    assert row_of(board, "mod")["flops_per_token"]["mean"] < row_of(board, "vanilla")["flops_per_token"]["mean"]


def test_differing_options_are_found_in_the_resolved_configs(runs):
    loaded = compare.read_runs(runs.values())
    # the seed and the output folders differ too, but do not make another configuration
    assert compare.differing_options(loaded) == ["model.mod.capacity", "model.variant"]
    board = compare.leaderboard(loaded)
    assert board["options"] == ["variant", "model.mod.capacity"]
    assert row_of(board, "mod")["model.mod.capacity"] == 0.25
    assert row_of(board, "vanilla")["model.mod.capacity"] is None  # vanilla reads no mod options: not a difference


def test_files_written_markdown_csv_json_and_plot(runs, tmp_path):
    board = compare.compare([str(p) for p in runs.values()], out=tmp_path)
    assert set(board["files"]) == {"md", "csv", "json", "png"}
    markdown = (tmp_path / "leaderboard.md").read_text()
    assert markdown.startswith("| variant | model.mod.capacity | n | steps | tokens | train FLOPs | val loss |")
    with (tmp_path / "leaderboard.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["variant"] for r in rows] == [r["variant"] for r in board["rows"]]  # sorted by val loss, like the table
    for row, expected in zip(rows, board["rows"]):
        assert float(row["val_loss_mean"]) == pytest.approx(expected["val_loss"]["mean"])
        assert row["n"] == "2"
    saved = json.loads((tmp_path / "leaderboard.json").read_text())
    assert saved["rows"][0]["val_loss"] == board["rows"][0]["val_loss"] and len(saved["runs"]) == 4
    image = tmp_path / "leaderboard.png"
    assert image.stat().st_size > 10_000 and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_written_board_names_the_runs_below_it_relative_to_it(runs, tmp_path, monkeypatch):
    """A board written beside its runs (a published report's records) names them by paths that hold on any machine
    it is copied to; runs elsewhere keep their full path. The board returned keeps full paths."""
    copied = copy_runs(runs, tmp_path / "report", keys=[("vanilla", 1), ("mod", 1)])
    elsewhere = copy_runs(runs, tmp_path / "other", keys=[("vanilla", 2)])
    monkeypatch.chdir(tmp_path)
    board = compare.compare(["report/runs", str(elsewhere["vanilla", 2])], out=pathlib.Path("report"))
    saved = json.loads((tmp_path / "report" / "leaderboard.json").read_text())
    expected = {f"runs/{folder.name}" for folder in copied.values()} | {str(elsewhere["vanilla", 2].resolve())}
    assert {run["run_dir"] for run in saved["runs"]} == expected
    assert {d for row in saved["rows"] for d in row["runs"]} == expected
    with (tmp_path / "report" / "leaderboard.csv").open() as handle:
        assert {d for row in csv.DictReader(handle) for d in row["runs"].split(" ")} == expected
    assert all(pathlib.Path(run["run_dir"]).is_absolute() for run in board["runs"])
    assert sorted(str((tmp_path / "report" / run["run_dir"]).resolve()) for run in saved["runs"]) == sorted(
        run["run_dir"] for run in board["runs"])


def test_a_written_csv_renamed_changes_its_run_names_only(runs, tmp_path):
    """``csv_runs_renamed`` (publish names runs by their records) writes back every other byte: the identity gives the
    file compare wrote; a rename touches the ``runs`` column alone; a text without that column is returned as is."""
    compare.compare([str(d) for d in runs.values()], out=tmp_path / "board")
    text = (tmp_path / "board" / "leaderboard.csv").read_bytes().decode()
    assert "\r\n" in text and compare.csv_runs_renamed(text, lambda name: name) == text
    renamed = compare.csv_runs_renamed(text, lambda name: "R")
    with (tmp_path / "board" / "leaderboard.csv").open(newline="") as handle:
        before = list(csv.DictReader(handle))
    after = list(csv.DictReader(renamed.splitlines()))
    assert [{**row, "runs": None} for row in before] == [{**row, "runs": None} for row in after]
    assert [row["runs"] for row in after] == [" ".join("R" for _ in row["runs"].split()) for row in before]
    assert compare.csv_runs_renamed("a,b\r\n1,2\r\n", lambda name: "R") == "a,b\r\n1,2\r\n"


def test_plot_has_error_bars_pareto_front_legend_and_labels(runs, tmp_path, monkeypatch):
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    board = compare.leaderboard(compare.read_runs(runs.values()))
    compare.plot(board, tmp_path / "x.png")
    ax = figures[0].axes[0]
    assert "FLOPs" in ax.get_xlabel() and "validation loss" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "Pareto front" in labels and any(label.startswith("mod") and "(n=2)" in label for label in labels)
    assert len(ax.containers) == 2  # one errorbar container per configuration


# ---------------------------------------------------------------------------- known numbers
def test_aggregation_checked_by_hand_on_known_numbers(runs, tmp_path):
    """Summaries with known values in copies of the real folders: mean, sample std, n and the spent FLOPs."""
    folders = copy_runs(runs, tmp_path)
    known = {("vanilla", 1): dict(val_metrics={"val/loss": 2.0}, tokens_seen=1000,
                                  flops_per_token={"forward": 10.0, "training": 30.0}),
             # no budget: summary.json's train_flops is None, the FLOPs are FLOPs/token x tokens
             ("vanilla", 2): dict(val_metrics={"val/loss": 3.0}, tokens_seen=1000, train_flops=None,
                                  flops_per_token={"forward": 10.0, "training": 30.0}),
             # MoD's causal losses rank it: below vanilla although its (non-causal) val loss is lower
             ("mod", 1): dict(val_metrics={"val/loss": 1.0, "val/loss_causal": 4.0}, tokens_seen=2000,
                              flops_per_token={"forward": 5.0, "training": 15.0}, median_step_time_s=0.1),
             # the FLOPs a budgeted run counted win over FLOPs/token x tokens
             ("mod", 2): dict(val_metrics={"val/loss": 2.0, "val/loss_causal": 6.0}, tokens_seen=2000,
                              flops_per_token={"forward": 7.0, "training": 21.0}, train_flops=50_000.0,
                              median_step_time_s=0.3)}
    for key, values in known.items():
        edit_summary(folders[key], **values)
    board = compare.compare([str(tmp_path / "runs")])
    vanilla, mod = row_of(board, "vanilla"), row_of(board, "mod")
    assert vanilla["val_loss"] == {"mean": 2.5, "std": pytest.approx(math.sqrt(0.5)), "n": 2}
    assert vanilla["train_flops"] == {"mean": 30_000.0, "std": 0.0, "n": 2}
    assert mod["val_loss_causal"] == {"mean": 5.0, "std": pytest.approx(math.sqrt(2.0)), "n": 2}
    assert mod["val_loss"] == {"mean": 1.5, "std": pytest.approx(math.sqrt(0.5)), "n": 2}
    assert mod["headline_val_loss"]["mean"] == 5.0 and vanilla["headline_val_loss"]["mean"] == 2.5
    assert mod["train_flops"]["mean"] == pytest.approx((30_000.0 + 50_000.0) / 2)
    assert mod["train_flops"]["std"] == pytest.approx(math.sqrt(2) * 10_000.0)
    assert mod["flops_per_token"]["mean"] == 6.0 and mod["step_time_s"]["mean"] == pytest.approx(0.2)
    assert [r["variant"] for r in board["rows"]] == ["vanilla", "mod"]  # lower (causal where present) loss first
    # vanilla: less loss at the same or lower FLOPs than MoD's mean (30k vs 40k): MoD is dominated
    assert [r["pareto"] for r in board["rows"]] == [True, False]
    markdown = compare.to_markdown(board)
    assert "| vanilla | - | 2 |" in markdown and "| 2.5000 ± 0.7071 | - |" in markdown
    assert "| 1.5000 ± 0.7071 | 5.0000 ± 1.4142 |" in markdown


def test_probe_accuracy_columns_appear_only_for_probe_runs_and_are_seed_means(runs, tmp_path):
    folders = copy_runs(runs, tmp_path)
    assert "| acc L" not in compare.to_markdown(compare.compare([str(tmp_path / "runs")]))  # no probe run: no column
    for (variant, seed), folder in folders.items():  # routing-probe metrics as callbacks/probe.py logs them
        accs = {"vanilla": [(1.0, 0.8), (1.0, 0.6)], "mod": [(1.0, 0.9), (0.5, 0.7)]}[variant][seed - 1]
        edit_summary(folder, val_metrics={"val/loss": 1.0, "probe/level0/acc": accs[0], "probe/level4/acc": accs[1]})
    board = compare.compare([str(tmp_path / "runs")])
    assert board["headers"][-2:] == ["acc L0", "acc L4"]  # levels no run has are left out
    vanilla, mod = row_of(board, "vanilla"), row_of(board, "mod")
    assert vanilla["probe_acc_L4"] == {"mean": pytest.approx(0.7), "std": pytest.approx(math.sqrt(0.02)), "n": 2}
    assert mod["probe_acc_L0"]["mean"] == 0.75 and mod["probe_acc_L4"]["mean"] == pytest.approx(0.8)
    markdown = compare.to_markdown(board)
    assert "| acc L0 | acc L4 | Pareto |" in markdown and "0.7000 ± 0.1414" in markdown


def test_probe_columns_cover_every_level_a_run_logged_in_level_order(runs, tmp_path):
    """--callbacks.probe_levels sets how many levels a probe has (probe-v6/bounce: 8): every level any run logged
    gets its columns, numerically ordered (L10 after L9), and a row without a level holds it empty."""
    folders = copy_runs(runs, tmp_path)
    for (variant, seed), folder in folders.items():
        levels = range(11) if variant == "mod" else range(8)
        edit_summary(folder, val_metrics={"val/loss": 1.0, **{f"probe/level{k}/acc": k / 20 + seed / 100 for k in levels}})
    board = compare.compare([str(tmp_path / "runs")], baseline="vanilla")
    assert [h for h in board["headers"] if h.startswith("acc L")] == [f"acc L{k}" for k in range(11)]
    vanilla, mod = row_of(board, "vanilla"), row_of(board, "mod")
    assert mod["probe_acc_L10"]["mean"] == pytest.approx(0.5 + 0.015) and vanilla["probe_acc_L10"]["n"] == 0
    assert mod["probe_levels"]["probe_acc_L7"]["vs_baseline"]["difference"] == pytest.approx(0.0)
    levels = compare.probe_levels_markdown(board)
    assert "acc L9 [95% CI]" in levels and levels.index("acc L9 [") < levels.index("acc L10 [")


def test_step_caps_of_runs_a_flops_budget_stopped_are_no_difference(runs, tmp_path):
    folders = copy_runs(runs, tmp_path)
    for (variant, seed), folder in folders.items():  # budget runs: each variant with its own --max_steps cap
        edit_config(folder, "trainer.max_steps", {"vanilla": 40, "mod": 70}[variant])
        edit_summary(folder, stopped_by="max_train_flops", max_train_flops=1e9)
    assert compare.differing_options(compare.read_runs(folders.values())) == ["model.mod.capacity", "model.variant"]
    stopped = folders[("mod", 1)]  # one run the cap stopped (finished at its cap): the cap is a difference
    edit_summary(stopped, stopped_by="max_steps")
    edit_config(stopped, "trainer.max_steps", json.loads((stopped / "summary.json").read_text())["steps"])
    assert "trainer.max_steps" in compare.differing_options(compare.read_runs(folders.values()))


def test_pareto_front_by_hand():
    points = [(1.0, 3.0), (2.0, 2.0), (3.0, 2.5), (4.0, 1.0), (2.0, 2.0), (None, 0.5)]
    assert compare.pareto_front(points) == [True, True, False, True, True, False]


def test_single_seed_has_no_std(runs):
    board = compare.leaderboard(compare.read_runs([runs[("vanilla", 1)], runs[("mod", 1)]]))
    assert all(r["n"] == 1 and r["val_loss"]["std"] is None for r in board["rows"])
    assert "±" not in compare.to_markdown(board).split("\n\n")[0]


def test_group_by_variant_merges_configurations_and_lists_their_values(runs, tmp_path):
    folders = copy_runs(runs, tmp_path)
    extra = tmp_path / "runs" / "vanilla-lr"
    shutil.copytree(runs[("vanilla", 1)], extra)
    edit_config(extra, "optim.lr", 0.5)
    edit_summary(extra, val_metrics={"val/loss": 9.0})
    by_config = compare.compare([str(tmp_path / "runs")])
    assert "optim.lr" in by_config["options"]
    assert sorted(r["n"] for r in by_config["rows"]) == [1, 2, 2]  # the other lr is another configuration
    by_variant = compare.compare([str(tmp_path / "runs")], group_by=["variant"])
    vanilla = row_of(by_variant, "vanilla")
    assert vanilla["n"] == 3 and len(vanilla["optim.lr"]) == 2 and 0.5 in vanilla["optim.lr"]
    assert vanilla["varies"] == ["optim.lr"] and row_of(by_variant, "mod")["varies"] == []
    lr_cell = " / ".join(f"{v:.4f}" for v in vanilla["optim.lr"])
    assert f"| vanilla | - | {lr_cell} | 3 |" in compare.to_markdown(by_variant)
    losses = [json.loads((folders[("vanilla", s)] / "summary.json").read_text())["val_metrics"]["val/loss"]
              for s in SEEDS] + [9.0]
    assert vanilla["val_loss"]["mean"] == pytest.approx(sum(losses) / 3)
    with pytest.raises(compare.CompareError, match="--group_by: unknown option 'colour'"):
        compare.compare([str(tmp_path / "runs")], group_by=["colour"])


def test_mean_and_std_are_over_the_values_that_exist():
    stat = compare.mean_std([1.0, None, 3.0, float("nan")])
    assert (stat["mean"], stat["n"]) == (2.0, 2) and stat["std"] == pytest.approx(math.sqrt(2.0))
    single = compare.mean_std([None, 4.0])
    assert (single["mean"], single["std"], single["n"]) == (4.0, None, 1)


def test_a_number_only_some_runs_of_a_row_have_is_marked_with_its_n(runs):
    board = compare.compare([str(p) for p in runs.values()], group_by=["size"])  # all four runs in one row
    (row,) = board["rows"]
    assert row["n"] == 4 and row["val_loss_causal"]["n"] == 2  # only MoD has a causal loss
    # and the mean is over those two runs, not the row's four (issue 30: a mean over every run let a planted bug by)
    causal = [json.loads((folder / "summary.json").read_text())["val_metrics"]["val/loss_causal"]
              for (variant, _), folder in runs.items() if variant == "mod"]
    assert row["val_loss_causal"]["mean"] == pytest.approx(sum(causal) / 2)
    assert row["val_loss_causal"]["std"] == pytest.approx(abs(causal[0] - causal[1]) / math.sqrt(2))
    assert sorted(row["variant"]) == ["mod", "vanilla"] and "variant" in row["varies"]
    line = compare.to_markdown(board).splitlines()[2]
    assert line.count("(n=2)") == 1 and line.count("(n=") == 1  # the causal loss; every other number has all 4


def test_probe_levels_get_seed_intervals_solved_seeds_and_holm_corrected_tests_per_level(runs, tmp_path):
    """Per-level accuracy of probe runs: bootstrap interval over seeds, seeds reaching 0.9, and against a baseline
    row the difference with Welch's p, Holm-corrected over the other rows within each level (here one other row,
    so p_holm == p), recomputed from the seeds by hand."""
    from scipy.stats import ttest_ind

    folders = copy_runs(runs, tmp_path)
    for seed in SEEDS:  # a third configuration, so that each level's Holm family has two members
        other = tmp_path / "runs" / f"vanilla-lr-seed{seed}"
        shutil.copytree(runs[("vanilla", seed)], other)
        edit_config(other, "optim.lr", 0.5)
        folders[("vanilla-lr", seed)] = other
    # (L1, L4) per seed
    accs = {"vanilla": [(1.0, 0.62), (1.0, 0.55)], "mod": [(1.0, 0.93), (0.8, 0.88)], "vanilla-lr": [(0.9, 0.6), (1.0, 0.7)]}
    for (name, seed), folder in folders.items():
        l1, l4 = accs[name][seed - 1]
        edit_summary(folder, val_metrics={"val/loss": 1.0 + seed, "probe/level1/acc": l1, "probe/level4/acc": l4})
    assert "Accuracy per difficulty level" not in compare.to_markdown(compare.compare([str(runs[("vanilla", 1)])]))
    board = compare.compare([str(tmp_path / "runs")], baseline="vanilla lr=0.0010")
    mod = row_of(board, "mod")
    vanilla, other = sorted((r for r in board["rows"] if r["variant"] == "vanilla"), key=lambda r: r["optim.lr"])
    l4 = [a[1] for a in accs["mod"]]
    assert mod["probe_levels"]["probe_acc_L4"]["ci"][0] == pytest.approx(0.88)  # 2 seeds: the resampled means'
    assert mod["probe_levels"]["probe_acc_L4"]["ci"][1] == pytest.approx(0.93)  # 2.5% / 97.5% are the two seeds
    assert mod["probe_levels"]["probe_acc_L4"]["solved"] == 0.5 and vanilla["probe_levels"]["probe_acc_L1"]["solved"] == 1.0
    base = {level: [a[level] for a in accs["vanilla"]] for level in (0, 1)}
    holm_checked = 0
    for level, key in ((0, "probe_acc_L1"), (1, "probe_acc_L4")):  # each level its own family of two tests
        p = {name: float(ttest_ind([a[level] for a in accs[name]], base[level], equal_var=False).pvalue)
             if len({a[level] for a in accs[name]} | set(base[level])) > 1 else None for name in ("mod", "vanilla-lr")}
        present = {k: v for k, v in p.items() if v is not None and v == v}
        smallest = min(present, key=present.get) if present else None
        for name, row in (("mod", mod), ("vanilla-lr", other)):
            got = row["probe_levels"][key]["vs_baseline"]
            if name == smallest and len(present) == 2:
                assert got["p_holm"] == pytest.approx(min(1.0, 2 * present[name]))
                holm_checked += 1
            if name in present:
                assert got["p"] == pytest.approx(present[name]) and got["p_holm"] >= got["p"]
    assert holm_checked == 2  # both levels' families had two tests
    test = mod["probe_levels"]["probe_acc_L4"]["vs_baseline"]
    assert test["difference"] == pytest.approx(sum(l4) / 2 - sum(base[1]) / 2)
    assert "vs_baseline" not in vanilla["probe_levels"]["probe_acc_L4"]
    markdown = compare.to_markdown(board)
    assert "| row | n | acc L1 [95% CI] (seeds >= 0.9) | acc L4 [95% CI] (seeds >= 0.9) |" in markdown
    assert f"| {test['difference']:+.3f} [{test['ci_low']:+.3f}, {test['ci_high']:+.3f}], p {test['p_holm']:.3f} |" \
        in markdown
    assert "0.905 [" in markdown and "(1/2)" in markdown and "| baseline | baseline |" in markdown


def test_the_first_step_each_seed_solves_a_level_comes_from_its_validation_history(runs, tmp_path):
    """Per row and level: the median, least and most first solving step over the seeds that solve it, of the runs
    with a validation history; a seed that solves and falls back still solved first at that step."""
    folders = copy_runs(runs, tmp_path)
    acc = lambda *values: [[step, {"probe/level1/acc": v}] for step, v in zip((2, 4, 6), values)]  # noqa: E731
    histories = {("vanilla", 1): acc(0.5, 0.95, 0.85), ("vanilla", 2): acc(0.9, 0.2, 0.99),
                 ("mod", 1): acc(0.1, 0.3, 0.92), ("mod", 2): None}  # None: written before the recorder kept one
    for key, history in histories.items():
        edit_summary(folders[key], val_metrics={"val/loss": 1.0, "probe/level1/acc": 0.5}, val_history=history)
    board = compare.compare([str(tmp_path / "runs")])
    vanilla, mod = (row_of(board, v)["probe_levels"]["probe_acc_L1"]["first_solved"] for v in ("vanilla", "mod"))
    assert vanilla == {"median": 3, "min": 2, "max": 4, "solving": 2, "n": 2}
    assert mod == {"median": 6, "min": 6, "max": 6, "solving": 1, "n": 1}
    markdown = compare.to_markdown(board)
    assert "first step L1 >= 0.9: median [min, max] (seeds)" in markdown
    assert "| 3 [2, 4] (2/2) |" in markdown and "| 6 [6, 6] (1/1) |" in markdown
    assert compare._first_solved_cell({"median": None, "min": None, "max": None, "solving": 0, "n": 3}) == "never (0/3)"
    assert compare._first_solved_cell(None) == "-"
    assert compare._first_solved_cell({"median": 2500.5, "min": 2000, "max": 3001, "solving": 2, "n": 2}) == \
        "2,500.5 [2,000, 3,001] (2/2)"
    assert compare.first_solved_summary([3000, None, 1000, 2000]) == \
        {"median": 2000, "min": 1000, "max": 3000, "solving": 3, "n": 4}
    for key in histories:
        edit_summary(folders[key], val_history=None)
    assert "first step" not in compare.to_markdown(compare.compare([str(tmp_path / "runs")]))


def test_baseline_rows_get_intervals_effect_sizes_and_holm_corrected_p(runs, tmp_path, capsys):
    """Three configurations (vanilla, a second vanilla learning rate, MoD) with known per-seed losses, tested
    against MoD: the numbers are those of analysis.stats, recomputed here from the seeds by hand."""
    from scipy.stats import ttest_ind

    from analysis import stats

    folders = copy_runs(runs, tmp_path)
    for seed in SEEDS:
        other = tmp_path / "runs" / f"vanilla-lr-seed{seed}"
        shutil.copytree(runs[("vanilla", seed)], other)
        edit_config(other, "optim.lr", 0.5)
        folders[("vanilla-lr", seed)] = other
    losses = {"vanilla": [2.0, 2.3], "vanilla-lr": [3.0, 3.1], "mod": [1.0, 1.4]}
    for (name, seed), folder in folders.items():
        value = losses[name][seed - 1]  # MoD: its causal loss ranks it, so that is the one the tests use
        edit_summary(folder, val_metrics={"val/loss": value - 0.5, "val/loss_causal": value} if name == "mod"
                     else {"val/loss": value})
    board = compare.compare([str(tmp_path / "runs")], baseline="mod")
    assert board["baseline"] == "mod capacity=0.2500 lr=0.0010"  # the row's label, as in the plot's legend
    assert compare.compare([str(tmp_path / "runs")], baseline=board["baseline"])["rows"] == board["rows"]
    rows = {(r["variant"], r.get("optim.lr")): r for r in board["rows"]}
    mod = next(r for r in board["rows"] if r["variant"] == "mod")
    assert "vs_baseline" not in mod and mod["headline_ci"] == stats.bootstrap_ci(losses["mod"])
    tested = {name: next(r for (v, lr), r in rows.items() if v == "vanilla" and (lr == 0.5) == (name == "vanilla-lr"))
              for name in ("vanilla", "vanilla-lr")}
    welch = {n: float(ttest_ind(losses[n], losses["mod"], equal_var=False).pvalue) for n in tested}
    smaller, larger = sorted(welch, key=welch.get)
    holm = {smaller: min(1.0, 2 * welch[smaller]), larger: max(min(1.0, 2 * welch[smaller]), welch[larger])}
    for name, row in tested.items():
        test = row["vs_baseline"]
        assert test["difference"] == pytest.approx(sum(losses[name]) / 2 - 1.2)
        assert test["p"] == pytest.approx(welch[name]) and test["p_holm"] == pytest.approx(holm[name])
        assert test["hedges_g"] == pytest.approx(stats.hedges_g(losses[name], losses["mod"]))
        assert test["ci_low"] <= test["difference"] <= test["ci_high"]
    markdown = compare.to_markdown(board)
    assert f"| loss 95% CI | Δ loss vs {board['baseline']} [95% CI] | Hedges' g | Welch p | p (Holm) |" in markdown
    assert "| baseline |" in markdown and "Holm's correction" in markdown
    row = tested["vanilla-lr"]["vs_baseline"]
    assert f"{row['difference']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]" in markdown
    code, out, err = run_cli([str(tmp_path / "runs"), "--baseline", "vanilla"], capsys)  # two vanilla rows
    assert code == 2 and err.startswith("error: --baseline: 'vanilla' names several rows; use one of the row labels")
    code, out, _ = run_cli([str(tmp_path / "runs"), "--baseline", "mod", "--out", str(tmp_path / "board")], capsys)
    assert code == 0 and "Δ loss vs mod" in out
    with (tmp_path / "board" / "leaderboard.csv").open() as handle:
        saved = {r["variant"] + r.get("optim.lr", ""): r for r in csv.DictReader(handle)}
    assert float(saved["vanilla0.5"]["vs_baseline_p_holm"]) == pytest.approx(holm["vanilla-lr"])


def test_a_table_of_runs_from_different_commits_warns_in_one_line_and_in_its_markdown(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path)
    for (name, seed), folder in folders.items():
        edit_summary(folder, provenance={"commit": "a" * 40, "dirty": False, "commits": ["a" * 40]})
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 0 and "mixes code versions" not in err and "Code: aaaaaaaaaa (every run)." in out
    edit_summary(folders[("mod", 2)], provenance={"commit": "b" * 40, "dirty": True, "diff_sha256": "c" * 64})
    edit_summary(folders[("mod", 1)], provenance=None)  # a run from before provenance was recorded
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    (line,) = [line for line in err.splitlines() if "mixes code versions" in line]
    assert code == 0 and line.startswith("warning: the table mixes code versions: aaaaaaaaaa (2 runs), ")
    assert "bbbbbbbbbb+dirty:cccccccc (1 run)" in line and "unknown (1 run)" in line
    assert "**Warning: the table mixes code versions**: aaaaaaaaaa (2 runs)" in out


def test_a_table_of_runs_on_different_cpu_kernels_warns_in_one_line(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path)
    avx512 = {"cpu_capability": "AVX512", "environment": {"MKL_CBWR": None, "OMP_NUM_THREADS": "1"}}
    for folder in folders.values():
        edit_summary(folder, provenance={"commit": "a" * 40, "dirty": False, "kernels": avx512})
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 0 and "kernel paths" not in err
    edit_summary(folders[("mod", 2)], provenance={"commit": "a" * 40, "dirty": False, "kernels": {
        "cpu_capability": "AVX2", "environment": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}})
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    (line,) = [line for line in err.splitlines() if "kernel paths" in line]
    assert code == 0 and line == ("warning: the table mixes CPU kernel paths: AVX512 (3 runs), AVX2 "
                                  "(ATEN_CPU_CAPABILITY=avx2,MKL_CBWR=AVX2) (1 run); the same command on other kernels "
                                  "differs like another seed (docs/results.md, 'Reproducibility')")


def test_real_runs_record_the_code_they_ran(runs):
    board = compare.leaderboard(compare.read_runs(runs.values()))
    (label,) = board["code"]  # trained in one process: one code version
    assert label != "unknown" and board["code"][label] == 4
    import torch

    kernels = [compare.read_runs([folder])[0].summary["provenance"]["kernels"] for folder in runs.values()]
    assert all(k["cpu_capability"] == torch.backends.cpu.get_cpu_capability() for k in kernels)


# ---------------------------------------------------------------------------- refusals and skips
def test_mixed_tokenizers_refused(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path, [("vanilla", 1), ("mod", 1)])
    ckpt = folders[("mod", 1)] / "checkpoints" / "last.ckpt"
    blob = torch.load(ckpt, map_location="cpu", weights_only=False)
    blob["LMDataModule"]["fingerprints"]["tokenizer"] = "byte:0123456789abcdef"
    torch.save(blob, ckpt)
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: runs with different tokenizers cannot be compared")
    assert "byte:0123456789abcdef" in err


def test_runs_without_checkpoints_are_compared_by_their_data_options(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path, [("vanilla", 1), ("mod", 1)])
    for folder in folders.values():
        shutil.rmtree(folder / "checkpoints")
    shutil.copytree(folders[("mod", 1)], tmp_path / "runs" / "mod-again")
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 0 and "2 run(s) have no checkpoint with data/tokenizer fingerprints" not in err
    assert "3 run(s) have no checkpoint with data/tokenizer fingerprints" in err
    (duplicate,) = [line for line in err.splitlines() if "have the same configuration and seed" in line]
    assert str(folders[("mod", 1)]) in duplicate and str(tmp_path / "runs" / "mod-again") in duplicate
    shutil.rmtree(tmp_path / "runs" / "mod-again")
    edit_config(folders[("mod", 1)], "data.tokenizer", "byte")
    code, _, err = run_cli([str(tmp_path / "runs")], capsys)
    error = err.splitlines()[-1]
    assert code == 2 and error.startswith("error: runs with different tokenizers") and "data.tokenizer=byte" in error


def test_mixed_validation_sets_refused(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path, [("vanilla", 1), ("mod", 1)])
    # a run from before --val_blocks: val_batches x data.batch_size = 2 x 4, the same 8 blocks as val_blocks 8
    config = yaml.safe_load((folders[("mod", 1)] / "config.yaml").read_text())
    assert config.pop("val_blocks") == 8 and config["data"]["batch_size"] == 4
    (folders[("mod", 1)] / "config.yaml").write_text(yaml.safe_dump({**config, "val_batches": 2}))
    code, _, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 0, err
    edit_config(folders[("mod", 1)], "val_batches", 7)  # its loss is a mean over other validation blocks
    code, _, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: runs with different validation sets cannot be compared") and "28 val blocks" in err


def test_unfinished_runs_skipped_with_a_warning(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path)
    (folders[("vanilla", 2)] / "summary.json").unlink()  # still training
    edit_config(folders[("mod", 2)], "trainer.max_steps", 50)  # resumed toward more steps: its summary is old
    code, out, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 0
    assert f"warning: skipping {folders[('vanilla', 2)]}: unfinished (no summary.json yet)" in err
    stale = f"warning: skipping {folders[('mod', 2)]}: unfinished (summary.json at step {STEPS} of trainer.max_steps 50)"
    assert stale in err
    board = compare.compare([str(tmp_path / "runs")])
    assert [r["n"] for r in board["rows"]] == [1, 1]
    assert "| 1 |" in out
    # a FLOPs budget that ended the run before max_steps: finished
    edit_summary(folders[("mod", 2)], stopped_by="max_train_flops", max_train_flops=1e9, train_flops=1.01e9)
    rows = compare.compare([str(tmp_path / "runs")])["rows"]  # its max_steps makes it a configuration of its own
    assert sorted(r["n"] for r in rows) == [1, 1, 1] and any(r["trainer.max_steps"] == 50 for r in rows)


def test_no_runs_matched_and_unreadable_files_are_one_line_errors(runs, tmp_path, capsys):
    code, _, err = run_cli([str(tmp_path / "nothing-*")], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: no run folders matched")
    folders = copy_runs(runs, tmp_path, [("vanilla", 1)])
    (folders[("vanilla", 1)] / "summary.json").unlink()
    code, _, err = run_cli([str(tmp_path / "runs")], capsys)
    assert code == 2 and "none of the 1 run folders matched has finished" in err
    broken = {"summary.json": "{ not json", "config.yaml": "model: [unclosed", "checkpoints/last.ckpt": "garbage"}
    for name, text in broken.items():
        folder = tmp_path / name.replace("/", "_")
        shutil.copytree(runs[("vanilla", 1)], folder)
        (folder / name).write_text(text)
        code, _, err = run_cli([str(folder)], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("error: ") and str(folder / name) in err


def test_cli_entry_point_with_a_glob(runs, tmp_path):
    pattern = str(next(iter(runs.values())).parent.parent / "*" / "version_*")
    done = subprocess.run([sys.executable, "-m", "experiments.compare", pattern, "--group_by", "variant",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| variant | model.mod.capacity | n |") and (tmp_path / "leaderboard.png").is_file()


# ---------------------------------------------------------------------------- the repro experiments' run table
def test_repro_experiments_write_their_run_table_through_compare(runs, tmp_path):
    ctx = Context(out=tmp_path)
    for (name, seed), folder in runs.items():  # as ctx.run records a trained or reused run
        ctx.cached("experiments.run", [name, str(seed)], lambda folder=folder: folder)
    ctx.write_report("title", ["experiment table"], {"x": 1})
    for suffix in ("md", "csv", "json", "png"):
        assert (tmp_path / f"leaderboard.{suffix}").is_file()
    report = (tmp_path / "results.md").read_text()
    assert "## Runs (`python -m experiments.compare`)" in report
    assert (tmp_path / "leaderboard.md").read_text() in report
    assert json.loads((tmp_path / "results.json").read_text())["leaderboard"]["md"] == str(tmp_path / "leaderboard.md")
    ctx.close()


def test_repro_run_table_notes_incomparable_runs_instead_of_failing(runs, tmp_path, capsys):
    folders = copy_runs(runs, tmp_path, [("vanilla", 1), ("mod", 1)])
    edit_config(folders[("mod", 1)], "model.block_size", 32)
    ctx = Context(out=tmp_path / "out")
    for folder in folders.values():
        ctx.record_run(folder)
    ctx.write_report("title", ["experiment table"], {})
    report = (tmp_path / "out" / "results.md").read_text()
    assert "experiment table" in report and "No run table: runs with different validation sets" in report
    assert not (tmp_path / "out" / "leaderboard.md").exists()
    assert "warning: [repro] no run table" in capsys.readouterr().err
    ctx.close()


@pytest.mark.slow
def test_repro_probe_table_aggregates_its_seeds(tmp_path, one_thread):
    """The probe experiment end to end (``--quick``): its run table is compare's, one row per variant over 2 seeds."""
    from experiments.repro import main

    main(["probe", "--out", str(tmp_path), "--quick", "--steps", "20", "--seeds", "2", "--blocks", "4",
          "--variants", "vanilla,mod", "--dense_shapes", "2x32", "--", "--data.cache_dir", str(tmp_path / "cache")])
    board = json.loads((tmp_path / "leaderboard.json").read_text())
    assert sorted((r["variant"], r["n"]) for r in board["rows"]) == [("mod", 2), ("vanilla", 2)]
    # every run stopped at the FLOPs budget: the per-variant --max_steps caps are no difference; MoD's cheaper
    # steps show in the steps column instead
    assert "trainer.max_steps" not in board["options"] and board["options"] == ["variant"]
    steps = {r["variant"]: r["steps"]["mean"] for r in board["rows"]}
    assert steps["mod"] > steps["vanilla"] == 20
    again = compare.compare([str(tmp_path / "runs")])  # the command on the experiment's folder: the same table
    assert [r["val_loss"] for r in again["rows"]] == [r["val_loss"] for r in board["rows"]]
    assert compare.to_markdown(again) in (tmp_path / "results.md").read_text()


def test_published_run_records_rebuild_the_same_table_and_an_unfinished_run_is_refused(runs, tmp_path):
    """``publish --runs`` copies each run's small records (no checkpoint, thinned curves): compare over the records
    gives the table of the trained folders, row for row (the runs' folders aside), so a published table of plain
    experiments.run runs rebuilds on any machine."""
    from architectures.config import ConfigError
    from experiments.repro import publish

    copy_runs(runs, tmp_path)
    records = publish.main([str(tmp_path / "runs"), str(tmp_path / "docs"), "--runs"])["runs"]
    assert sorted(pathlib.Path(r).name for r in records) == sorted(f"{n}-seed{s}" for n, s in runs)
    assert not list((tmp_path / "docs").rglob("*.ckpt"))
    trained, published = (compare.compare([str(path)]) for path in (tmp_path / "runs", tmp_path / "docs" / "runs"))
    drop = ("runs",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in published["rows"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in trained["rows"]]
    before = {p: p.read_bytes() for p in (tmp_path / "docs").rglob("*") if p.is_file()}
    steps = json.loads((tmp_path / "runs" / "mod-seed2" / "summary.json").read_text())["steps"]
    edit_summary(tmp_path / "runs" / "mod-seed2", steps=1)  # a resumed run still training: its earlier summary
    with pytest.raises(ConfigError, match=r"publish --runs: .*mod-seed2 is unfinished \(summary\.json at step 1 of "):
        publish.main([str(tmp_path / "runs"), str(tmp_path / "docs"), "--runs"])
    edit_summary(tmp_path / "runs" / "mod-seed2", steps=steps)
    (tmp_path / "runs" / "vanilla-seed1" / "summary.json").unlink()  # a run that has not written one yet
    with pytest.raises(ConfigError, match=r"publish --runs: .*vanilla-seed1 has no readable summary\.json"):
        publish.main([str(tmp_path / "runs"), str(tmp_path / "docs"), "--runs"])
    assert {p: p.read_bytes() for p in (tmp_path / "docs").rglob("*") if p.is_file()} == before  # nothing written
    # DEST/runs is replaced as a whole: it must not be, or hold, the folder the runs are read from
    for log_dir, dest in ((tmp_path / "docs" / "runs", tmp_path / "docs"), (tmp_path / "runs" / "mod-seed1", tmp_path),
                          (tmp_path, tmp_path / "runs" / "x")):
        with pytest.raises(ConfigError, match=r"publish --runs: DEST .* overlap"):
            publish.main([str(log_dir), str(dest), "--runs"])
    assert {p: p.read_bytes() for p in (tmp_path / "docs").rglob("*") if p.is_file()} == before
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "results.json").write_text("{}")  # a programme's published report: its runs/ is its own
    with pytest.raises(ConfigError, match=r"publish --runs: .*report holds a programme's published report"):
        publish.main([str(tmp_path / "docs" / "runs"), str(tmp_path / "report"), "--runs"])


def test_publish_rebuilds_a_missing_validation_history_from_the_runs_tensorboard_events(runs, tmp_path):
    """A run written before summary.json kept val_history gets it in its record from its events (float32, steps
    shifted by Lightning's one), and the record says so; a run with its own keeps it as it is."""
    from experiments.repro import publish

    folders = copy_runs(runs, tmp_path, [("mod", 1), ("mod", 2)])
    own = json.loads((folders[("mod", 1)] / "summary.json").read_text())["val_history"]
    assert [step for step, _ in own] == [STEPS] and "val/loss" in own[0][1]
    summary = json.loads((folders[("mod", 2)] / "summary.json").read_text())
    original = summary.pop("val_history")
    (folders[("mod", 2)] / "summary.json").write_text(json.dumps(summary))
    publish.main([str(tmp_path / "runs"), str(tmp_path / "docs"), "--runs"])
    records = {n: json.loads((tmp_path / "docs" / "runs" / f"mod-seed{n}" / "summary.json").read_text()) for n in (1, 2)}
    assert records[1]["val_history"] == own and "val_history" not in records[1]["published"]
    rebuilt = records[2]["val_history"]
    assert [step for step, _ in rebuilt] == [step for step, _ in original]
    assert rebuilt[0][1] == pytest.approx(original[0][1], rel=1e-6)
    assert "TensorBoard events" in records[2]["published"]["val_history"]


def test_the_published_necessity_table_rebuilds_from_its_run_records():
    """docs/results/probe_bounce_necessity: the 20 runs' records (4 depths x 5 seeds, equal steps) give the committed
    table to the character, and the verdict probes.md states: no depth's accuracy on the top levels differs from one
    layer's after Holm's correction (8 layers' L4 gain is inside the seeds' spread; 2 and 4 layers are below)."""
    folder = REPO / "docs" / "results" / "probe_bounce_necessity"
    board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
    rows = {r["model.n_layer"]: r for r in board["rows"]}
    assert sorted(rows) == [1, 2, 4, 8] and all(r["n"] == 5 and r["steps"]["mean"] == 8000 for r in rows.values())
    for depth in (2, 4, 8):
        for level in ("probe_acc_L3", "probe_acc_L4"):
            assert rows[depth]["probe_levels"][level]["vs_baseline"]["p_holm"] > 0.05
    assert rows[8]["probe_acc_L4"]["mean"] > rows[1]["probe_acc_L4"]["mean"] > rows[4]["probe_acc_L4"]["mean"]


def test_the_wide_probes_necessity_table_rebuilds_from_its_run_records():
    """docs/results/probe_bounce_wide_necessity (probe-v6/bounce, levels 0-7): the 20 runs' records give the committed
    table to the character, with all eight levels, and probes.md's verdict: no depth differs from one layer at any
    level after Holm's correction, and levels 5-7 stay below what the last three operands alone give (0.31)."""
    folder = REPO / "docs" / "results" / "probe_bounce_wide_necessity"
    board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
    rows = {r["model.n_layer"]: r for r in board["rows"]}
    assert sorted(rows) == [1, 2, 4, 8] and all(r["n"] == 5 and r["steps"]["mean"] == 8000 for r in rows.values())
    assert [h for h in board["headers"] if h.startswith("acc L")] == [f"acc L{k}" for k in range(8)]
    for depth in (2, 4, 8):
        assert all(level["vs_baseline"]["p_holm"] > 0.05 for level in rows[depth]["probe_levels"].values())
    assert all(rows[d][f"probe_acc_L{k}"]["mean"] < 0.31 for d in rows for k in (5, 6, 7))
    masked = REPO / "docs" / "results" / "probe_bounce_wide_answers_only"
    answers_only = compare.compare([str(masked / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(answers_only) == (masked / "leaderboard.md").read_text()
    deep = {r["model.n_layer"]: r for r in answers_only["rows"]}[8]["probe_levels"]
    assert all(deep[f"probe_acc_L{k}"]["vs_baseline"]["p_holm"] < 0.05 for k in (2, 3))  # 1 layer ahead


def test_the_shift_probes_necessity_tables_rebuild_from_their_run_records():
    """docs/results/probe_shift_necessity (8,000 steps) and probe_shift_long (16,000), probe-v7/shift, 1/2/4 layers x 5
    seeds: the records give the committed tables to the character, and probes.md's verdict: level 0 solved everywhere;
    at 16,000 steps level 1 is solved by 5/5 four-layer, 4/5 two-layer and 2/5 one-layer seeds, and neither deeper
    row passes Holm's correction against one layer at either budget (not met)."""
    solved = {}
    for name, steps in (("probe_shift_necessity", 8000), ("probe_shift_long", 16000)):
        folder = REPO / "docs" / "results" / name
        board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
        assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
        rows = {r["model.n_layer"]: r for r in board["rows"]}
        assert sorted(rows) == [1, 2, 4] and all(r["n"] == 5 and r["steps"]["mean"] == steps for r in rows.values())
        assert [h for h in board["headers"] if h.startswith("acc L")] == ["acc L0", "acc L1"]
        assert all(r["probe_acc_L0"]["mean"] == 1.0 for r in rows.values())
        assert all(rows[d]["probe_levels"]["probe_acc_L1"]["vs_baseline"]["p_holm"] > 0.05 for d in (2, 4))
        level = {d: r["probe_levels"]["probe_acc_L1"] for d, r in rows.items()}
        solved[steps] = {d: round(v["solved"] * v["solved_n"]) for d, v in level.items()}  # share x seeds
    assert solved == {8000: {1: 0, 2: 1, 4: 2}, 16000: {1: 2, 2: 4, 4: 5}}


def test_the_preregistered_shift_replication_rebuilds_and_meets_its_verdict():
    """docs/results/probe_shift_replication (docs/results/preregistered/probe_shift_replication.md: 10 new seeds,
    1/2/4 layers, 16,000 steps): the records give the committed table to the character, and the verdict fixed
    before the runs: 4 layers above 1 on level 1 after Holm (met; 2 layers too); seeds solving 2/10, 8/10, 8/10."""
    folder = REPO / "docs" / "results" / "probe_shift_replication"
    board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
    rows = {r["model.n_layer"]: r for r in board["rows"]}
    assert sorted(rows) == [1, 2, 4] and all(r["n"] == 10 and r["steps"]["mean"] == 16000 for r in rows.values())
    level = {d: r["probe_levels"]["probe_acc_L1"] for d, r in rows.items()}
    for depth in (2, 4):
        test = level[depth]["vs_baseline"]
        assert test["difference"] > 0 and test["p_holm"] < 0.05
    assert {d: round(v["solved"] * v["solved_n"]) for d, v in level.items()} == {1: 2, 2: 8, 4: 8}
    commits = {json.loads(p.read_text())[0]["commit"][:7] for p in (folder / "runs").glob("*/*/provenance.json")}
    assert commits == {"4eb1c64"}  # the commit the pre-registration names


def test_the_preregistered_induct_check_rebuilds_and_no_depth_solves_level_1():
    """docs/results/probe_induct_necessity (docs/results/preregistered/probe_induct_necessity.md: 1/2/4 layers, batch
    32, 4,000 steps; the fifth 4-layer run stopped at the plan's cut-off): the records give the committed table, the
    letter of the rule passes (2 vs 1 layer after Holm) while no run solves level 1 (counted as not met)."""
    folder = REPO / "docs" / "results" / "probe_induct_necessity"
    board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
    rows = {r["model.n_layer"]: r for r in board["rows"]}
    assert {d: r["n"] for d, r in rows.items()} == {1: 5, 2: 5, 4: 4}
    level = {d: r["probe_levels"]["probe_acc_L1"] for d, r in rows.items()}
    assert level[2]["vs_baseline"]["difference"] > 0 and level[2]["vs_baseline"]["p_holm"] < 0.05
    assert all(v["solved"] == 0 for v in level.values()) and all(r["probe_acc_L0"]["mean"] == 1.0 for r in rows.values())


def test_the_preregistered_8k_induct_check_rebuilds_and_is_not_met():
    """docs/results/probe_induct_necessity_8k (docs/results/preregistered/probe_induct_necessity_8k.md: 1/2/4 layers,
    seeds 1342-1346, 8,000 steps): the records give the committed table, and the plan's verdict is 'not met': one
    layer solves level 1 in no seed, but neither deeper row passes Holm nor solves it in 4 of 5 seeds. The records
    predate the recorder's val_history: publish rebuilt it from the events, at every 1,000 steps."""
    from experiments.repro.necessity import necessity_verdict

    folder = REPO / "docs" / "results" / "probe_induct_necessity_8k"
    board = compare.compare([str(folder / "runs")], ["model.n_layer"], baseline="vanilla n_layer=1")
    assert compare.to_markdown(board) == (folder / "leaderboard.md").read_text()
    assert board["code"] == {"6e7a2f2984": 15}
    rows = {r["model.n_layer"]: r for r in board["rows"]}
    assert {d: r["n"] for d, r in rows.items()} == {1: 5, 2: 5, 4: 5}
    level = {d: r["probe_levels"]["probe_acc_L1"] for d, r in rows.items()}
    verdict = necessity_verdict(board)  # experiments.repro necessity's rule, as the plan fixed it
    assert verdict["level"] == 1 and verdict["verdict"] == "not met"
    assert {d: v["solving"] for d, v in verdict["depths"].items()} == {1: 0, 2: 1, 4: 2}
    assert verdict["shallow_fails"] and verdict["deeper_meeting"] == []
    assert {d: round(verdict["depths"][d]["p_holm"], 3) for d in (2, 4)} == {2: 0.218, 4: 0.057}
    assert level[1]["first_solved"]["solving"] == 0 and level[4]["first_solved"]["min"] == 4000
    for run in (folder / "runs").rglob("summary.json"):
        steps = [step for step, _ in json.loads(run.read_text())["val_history"]]
        assert steps == list(range(1000, 8001, 1000))
