"""The statistics of ``mod_isoflop`` and ``head_to_head`` on planted numbers: the best dense model, the
"bracketed" verdict of the dense isoFLOP curve, Holm's correction over the routed shapes, and "met" only when
the corrected test passes. The programmes end to end are in test_repro.py."""
from __future__ import annotations

import pytest

from analysis import stats
from architectures.config import ConfigError
from experiments.repro.common import parse_entry
from experiments.repro.head_to_head import (bench_label, benchmarked, check_entries, default_dense_shapes,
                                             dense_comparison, programme_entries)
from analysis.dense_grid import bracket_verdict, dense_grid_line, grid_bracket
from experiments.repro.common import dense_grid, dense_shape
from experiments.repro.isoflop import budget_analysis, cells_of

BUDGET = 1e12


def planted_runs(losses, params):
    """Run rows as ``isoflop_row`` makes them: ``losses[(variant, n_layer, d_model)]`` one per seed."""
    rows = []
    for (variant, n_layer, d_model), seeds in losses.items():
        for seed, loss in enumerate(seeds):
            rows.append({"budget": BUDGET, "variant": variant, "n_layer": n_layer, "d_model": d_model, "seed": seed,
                         "parameters": params[(n_layer, d_model)] + (7 if variant == "mod" else 0), "steps": 100,
                         "planned_steps": 100, "train_flops_per_token": 1e6, "forward_flops_per_token": 3e5,
                         "matched": True, "measured_deviation": 0.001 * seed, "measured_flops": BUDGET * 1.001,
                         "val_loss": loss, "val_loss_noncausal": loss - 0.01,
                         "val_loss_causal": loss if variant == "mod" else None, "train_time_s": 10.0 + seed,
                         "run_dir": f"/runs/{variant}-{n_layer}x{d_model}-{seed}"})
    return rows


PARAMS = {(1, 16): 90, (1, 24): 190, (2, 16): 100, (2, 24): 200, (2, 32): 300, (4, 24): 220}
DENSE_TURNING = {("vanilla", 1, 16): [3.30, 3.32, 3.31], ("vanilla", 1, 24): [3.20, 3.22, 3.21],
                 ("vanilla", 2, 16): [3.00, 3.10, 3.05], ("vanilla", 2, 24): [2.80, 2.82, 2.81],
                 ("vanilla", 2, 32): [2.90, 2.93, 2.91], ("vanilla", 4, 24): [2.85, 2.86, 2.87]}
MOD = {("mod", 2, 16): [2.50, 2.51, 2.49], ("mod", 2, 24): [2.78, 2.80, 2.83], ("mod", 2, 32): [2.95, 2.96, 2.97]}


def test_bracket_verdict_on_planted_curves():
    assert bracket_verdict([(100, 3.0), (200, 2.8), (300, 2.9)]) == "bracketed"
    assert bracket_verdict([(300, 2.9), (100, 2.7), (200, 2.8)]) == "not bracketed: the best is the smallest shape tried"
    assert bracket_verdict([(100, 3.0), (200, 2.9), (300, 2.8)]) == "not bracketed: the best is the largest shape tried"
    assert bracket_verdict([(100, 3.0), (200, 2.9)]) == "not bracketed: the best is the largest shape tried"
    assert bracket_verdict([(100, 3.0)]) == "not bracketed: only one shape tried"
    # a shape without a loss does not count as a side of the bracket
    assert bracket_verdict([(100, None), (200, 2.8), (300, 2.9), (400, 3.0)]).endswith("smallest shape tried")
    # a best shape at the smallest size any shape can have, the larger ones all worse: no shape lies beyond it
    assert bracket_verdict([(1, 2.7), (2, 2.8), (4, 2.9)], floor=1) == "bracketed by the floor"
    assert bracket_verdict([(1, 2.7), (2, 2.7)], floor=1) == "not bracketed: the best is the smallest shape tried"
    assert bracket_verdict([(2, 2.7), (4, 2.8)], floor=1) == "not bracketed: the best is the smallest shape tried"
    assert bracket_verdict([(1, 2.7)], floor=1) == "not bracketed: only one shape tried"


def test_best_dense_and_bracket_over_parameters_and_per_depth():
    a = budget_analysis(BUDGET, cells_of(planted_runs({**DENSE_TURNING, **MOD}, PARAMS)))
    assert a["best_dense"] == "vanilla 2x24"  # lowest seed mean among the dense shapes (mod 2x16 is lower, not dense)
    cell = a["cells"]["vanilla 2x24"]
    assert cell["val_loss"]["mean"] == pytest.approx(2.81) and cell["val_loss"]["seeds"] == [2.80, 2.82, 2.81]
    lo, hi = cell["val_loss"]["ci"]
    assert 2.80 - 1e-9 <= lo <= 2.81 <= hi <= 2.82 + 1e-9 and (lo, hi) == stats.bootstrap_ci([2.80, 2.82, 2.81])
    assert cell["steps_seeds"] == [100, 100, 100] and cell["max_deviation"] == pytest.approx(0.002)
    assert a["bracket"] == "bracketed" and a["bracket_by_depth"][2] == "bracketed"
    assert a["bracket_by_depth"][1] == "not bracketed: the best is the largest shape tried"
    assert a["bracket_by_depth"][4] == "not bracketed: only one shape tried"
    assert set(a["tests"]) == {"mod 2x16", "mod 2x24", "mod 2x32"}
    assert a["train_time_ratio"]["mod 2x16"] == pytest.approx(1.0)

    rising = {k: [PARAMS[k[1:]] / 100 + 0.01 * i for i in range(3)] for k in DENSE_TURNING}
    a = budget_analysis(BUDGET, cells_of(planted_runs({**rising, **MOD}, PARAMS)))
    assert a["best_dense"] == "vanilla 1x16"
    assert a["bracket"] == "not bracketed: the best is the smallest shape tried (over the widths at n_layer=1)"
    falling = {k: [10 - PARAMS[k[1:]] / 100 + 0.01 * i for i in range(3)] for k in DENSE_TURNING}
    a = budget_analysis(BUDGET, cells_of(planted_runs({**falling, **MOD}, PARAMS)))
    assert a["best_dense"] == "vanilla 2x32"
    assert a["bracket"] == "not bracketed: the best is the largest shape tried (over the widths at n_layer=2)"
    # the width curve turns at n_layer=2, but the deepest shape at that width is better: not bracketed over depth
    deeper = {**DENSE_TURNING, ("vanilla", 4, 24): [2.70, 2.71, 2.72]}
    a = budget_analysis(BUDGET, cells_of(planted_runs({**deeper, **MOD}, PARAMS)))
    assert a["best_dense"] == "vanilla 4x24"
    assert a["bracket"] == "not bracketed: only one shape tried (over the widths at n_layer=4)"
    wider_at_4 = {**deeper, ("vanilla", 4, 16): [2.90, 2.91, 2.92], ("vanilla", 4, 32): [2.80, 2.81, 2.82]}
    a = budget_analysis(BUDGET, cells_of(planted_runs({**wider_at_4, **MOD}, {**PARAMS, (4, 16): 120, (4, 32): 320})))
    assert a["bracket_by_depth"][4] == "bracketed"
    assert a["bracket"] == "not bracketed: the best is the largest shape tried (over the depths at d_model=24)"


def test_holm_over_the_routed_shapes_decides_met(monkeypatch):
    """Planted raw p-values 0.01, 0.04, 0.03: all below 0.05, but Holm's adjustment (x3, x2, x1, monotone) gives
    0.03, 0.06, 0.06, so only the first beats the best dense model."""
    planted = {2.50: 0.01, 2.78: 0.04, 2.95: 0.03}  # by the first seed of each mod shape
    real = stats.welch_p
    monkeypatch.setattr(stats, "welch_p", lambda a, b, alternative="two-sided":
                        planted.get(float(a[0]), real(a, b, alternative)) if len(a) else None)
    a = budget_analysis(BUDGET, cells_of(planted_runs({**DENSE_TURNING, **MOD}, PARAMS)))
    raw = {k: t["p"] for k, t in a["tests"].items()}
    assert raw == {"mod 2x16": 0.01, "mod 2x24": 0.04, "mod 2x32": 0.03}
    assert {k: t["p_holm"] for k, t in a["tests"].items()} == pytest.approx(
        {"mod 2x16": 0.03, "mod 2x24": 0.06, "mod 2x32": 0.06})
    assert a["beats_best_dense"] == ["mod 2x16"]
    best = a["cells"]["vanilla 2x24"]["val_loss"]["seeds"]
    test = a["tests"]["mod 2x16"]
    assert test["difference"] == pytest.approx(2.50 - 2.81) and test["ci_low"] <= test["difference"] <= test["ci_high"]
    assert test["hedges_g"] == pytest.approx(stats.hedges_g(MOD[("mod", 2, 16)], best))
    # the second column: each mod shape against vanilla of its own shape, corrected over the same family
    assert a["tests_same_shape"]["mod 2x32"]["difference"] == pytest.approx(2.96 - 2.91333333)


def test_head_to_head_best_dense_and_corrected_tests():
    def entry(label, dense, losses, time=10.0):
        return {"variant": label, "dense": dense, "val_loss": stats.seed_summary(losses),
                "train_time_s": stats.seed_summary([time] * len(losses))}

    entries = [entry("vanilla", True, [3.00, 3.02, 3.01]), entry("dense:2x64", True, [2.90, 2.91, 2.92], 5.0),
               entry("dense:4x48", True, [2.95, 2.97, 2.96]), entry("mod", False, [2.70, 2.71, 2.72], 12.5),
               entry("moe", False, [2.95, 2.93, 2.94])]
    tests = dense_comparison(entries)
    assert tests["best_dense"] == "dense:2x64" and set(tests["loss"]) == {"mod", "moe"}
    raw = {k: t["p"] for k, t in tests["loss"].items()}
    assert {k: t["p_holm"] for k, t in tests["loss"].items()} == pytest.approx(stats.holm(raw))
    assert tests["beats_best_dense"] == ["mod"] and tests["train_time_ratio"]["mod"] == pytest.approx(2.5)
    # moe beats the reference vanilla, not the best dense model: only the first is a second column
    assert stats.passes(tests["loss_vs_reference"]["moe"]) and not stats.passes(tests["loss"]["moe"])


def test_head_to_head_default_dense_shapes_span_the_routed_flops_and_reach_the_narrow_optimum():
    ladder = [(4, 32), (4, 16), (4, 8), (4, 4)]  # 4 x 8 is the isoFLOP optimum at 4 x 64's 300 steps (results.md)
    assert default_dense_shapes(4, 64, 4, deeper=False) == [(2, 64), (4, 48), (2, 48), *ladder]
    assert default_dense_shapes(4, 64, 4, deeper=True) == [(2, 64), (4, 48), (2, 48), (8, 64), *ladder]
    # every width a positive multiple of n_head, none repeated (d = 96, 8 heads: 72, then 48, 24; 12 is not)
    assert default_dense_shapes(2, 96, 8, deeper=False) == [(1, 96), (2, 72), (1, 72), (2, 48), (2, 24)]
    assert default_dense_shapes(1, 8, 8, deeper=False) == [(1, 8)]

    class Base:
        n_layer, d_model, n_head = 4, 64, 4

    mod, mom = parse_entry("mod"), parse_entry("mom")
    labels = [e.label for e in programme_entries([mod], None, Base, {"vanilla": 1.0, "mod": 0.8})]
    assert labels == ["vanilla", "dense:2x64", "dense:4x48", "dense:2x48", "dense:4x32", "dense:4x16", "dense:4x8",
                      "dense:4x4", "mod"]
    labels = [e.label for e in programme_entries([mom], None, Base, {"vanilla": 1.0, "mom": 1.7})]
    assert labels[3:5] == ["dense:2x48", "dense:8x64"] and labels[-1] == "mom"
    entries = programme_entries([mod], "4x64,1x32", Base, {"vanilla": 1.0, "mod": 0.8})
    assert [e.label for e in entries] == ["vanilla", "dense:1x32", "mod"]  # the reference shape is vanilla itself
    assert [e.dense for e in entries] == [True, True, False]


def test_head_to_head_takes_entries_with_their_own_options():
    entries = check_entries(["mod:n_layer=8:capacity=0.25", "moe", "dense:2x32", "mod:n_layer=8:capacity=0.25"], 1)
    assert [e.label for e in entries] == ["vanilla", "mod:n_layer=8:capacity=0.25", "moe", "dense:2x32"]
    deep = entries[1]
    assert deep.variant == "mod" and deep.model == (("n_layer", "8"), ("mod.capacity", "0.25")) and not deep.dense
    assert deep.run_options() == ["--variant", "mod", "--model.n_layer", "8", "--model.mod.capacity", "0.25"]
    # the benchmark names it as experiments.bench takes a variant with overrides; dense controls are not timed
    assert bench_label(deep) == "mod@n_layer=8@mod.capacity=0.25" and bench_label(entries[0]) == "vanilla"
    assert [benchmarked(e) for e in entries] == [True, True, True, False]
    with pytest.raises(ConfigError, match="no option of mod"):
        check_entries(["mod:nope=1"], 1)
    with pytest.raises(ConfigError, match="valid variants"):
        check_entries(["nope"], 1)
    with pytest.raises(ConfigError, match="empty"):
        check_entries([], 1)
    with pytest.raises(ConfigError, match="bench_steps"):
        check_entries(["mod"], 0)


def test_goal_line_of_a_vanilla_only_grid_says_not_tested_instead_of_not_met():
    from experiments.repro.isoflop import goal_lines

    dense_only = budget_analysis(BUDGET, cells_of(planted_runs(DENSE_TURNING, PARAMS)))
    with_mod = budget_analysis(BUDGET, cells_of(planted_runs({**DENSE_TURNING, **MOD}, PARAMS)))
    (line,) = goal_lines([dense_only])
    assert "no routed shape in the grid: **not tested**" in line and "Holm over the 0" not in line
    assert "not met" not in line and "**met**" not in line
    (line,) = goal_lines([with_mod])
    assert "Holm over the 3 routed shapes" in line and "**met**" in line  # mod 2x16 (2.50) beats vanilla 2x24 (2.81)


def test_dense_shape_of_each_kind_of_dense_entry():
    assert dense_shape("dense:1x32", (4, 64)) == (1, 32)
    assert dense_shape("vanilla", (4, 64)) == (4, 64)
    assert dense_shape("vanilla:n_layer=2", (4, 64)) == (2, 64)


def test_grid_bracket_over_shapes_names_the_axis_the_best_shape_is_at_the_edge_of():
    shapes = {"vanilla": (4, 64), "dense:1x64": (1, 64), "dense:1x32": (1, 32), "dense:2x64": (2, 64)}
    means = {"vanilla": 1.04, "dense:1x64": 0.97, "dense:1x32": 0.96, "dense:2x64": 0.99}
    assert grid_bracket(shapes, means, "dense:1x32") == ("not bracketed: the best is the smallest shape tried "
                                                          "(over the widths at n_layer=1)")
    means["dense:1x16"], shapes["dense:1x16"] = 0.98, (1, 16)
    # the width curve turns at one layer, but no deeper shape at d = 32 was tried: a deeper one may be better
    assert grid_bracket(shapes, means, "dense:1x32") == ("not bracketed: only one shape tried "
                                                          "(over the depths at d_model=32)")
    shapes["dense:2x32"], means["dense:2x32"] = (2, 32), 0.965
    # one layer is the fewest a model can have, so a worse 2 x 32 closes the depth axis at its floor
    assert grid_bracket(shapes, means, "dense:1x32") == (
        "bracketed (over the depths at d_model=32 by the floor, 1 layer, the fewest a model can have)")
    assert "beyond the grid's edge" not in dense_grid_line("dense:1x32", grid_bracket(shapes, means, "dense:1x32"))
    means["dense:2x32"] = 0.96  # a deeper shape as good is no floor: the depth curve does not turn
    assert grid_bracket(shapes, means, "dense:1x32") == ("not bracketed: the best is the smallest shape tried "
                                                          "(over the depths at d_model=32)")
    means["dense:2x32"] = 0.965
    # the floor closes the depth axis only: with no wider one-layer shape the widths stay open
    del shapes["dense:1x64"], means["dense:1x64"]
    assert grid_bracket(shapes, means, "dense:1x32") == ("not bracketed: the best is the largest shape tried "
                                                          "(over the widths at n_layer=1)")
    # and a floor at two layers is no floor: 2 x 32 best over depths 2 / 4 is open below
    assert grid_bracket({"a": (2, 16), "b": (2, 32), "c": (2, 64), "e": (4, 32)},
                        {"a": 1.1, "b": 1.0, "c": 1.2, "e": 1.3}, "b") == (
        "not bracketed: the best is the smallest shape tried (over the depths at d_model=32)")
    assert grid_bracket({"vanilla": (4, 64)}, {"vanilla": 1.0}, "vanilla") == (
        "not bracketed: only one shape tried (over the widths at n_layer=4)")
    assert "bracketed" == grid_bracket({"a": (2, 16), "b": (2, 32), "c": (2, 64), "d": (1, 32), "e": (4, 32)},
                                       {"a": 1.1, "b": 1.0, "c": 1.2, "d": 1.05, "e": 1.3}, "b")
    # two entries of one shape are one point: widths 48 / 64 / 64 with the best at 64 are not a bracket
    assert grid_bracket({"vanilla": (4, 64), "vanilla:n_head=2": (4, 64), "dense:4x48": (4, 48)},
                        {"vanilla": 1.0, "vanilla:n_head=2": 1.1, "dense:4x48": 1.2}, "vanilla") == (
        "not bracketed: the best is the largest shape tried (over the widths at n_layer=4)")
    # a grid of one depth whose widths turn: bracketed over the widths for mod_isoflop (its report says so), not
    # for probe and head_to_head's "Dense grid" line (dense_grid), whose reader is told of no depth axis
    one_depth = {"dense:4x32": (4, 32), "vanilla": (4, 64), "dense:4x96": (4, 96)}
    one_depth_means = {"dense:4x32": 1.1, "vanilla": 1.0, "dense:4x96": 1.2}
    assert grid_bracket(one_depth, one_depth_means, "vanilla") == "bracketed"
    assert grid_bracket(one_depth, one_depth_means, "vanilla", depths_required=True) == dense_grid(
        one_depth_means, (4, 64), "vanilla") == "not bracketed: only one shape tried (over the depths at d_model=64)"
    assert dense_grid_line("b", "bracketed") == "Dense grid: the best dense model is b, bracketed."
    assert "beyond the grid's edge" in dense_grid_line("a", "not bracketed: the best is the smallest shape tried")


# ---------------------------------------------------------------------------- mod_isoflop --tables_from
def _stored(path, runs, options=("--model.d_model", "64"), tokens=512, jobs="1", size=()):
    """A results.json as ``isoflop_experiment`` writes it (the keys ``tables_from`` reads)."""
    import json

    argv = ["experiments/repro/__main__.py", "mod_isoflop", *size, "--jobs", jobs, "--", *options]
    path.write_text(json.dumps({"tokens_per_step": tokens, "runs": runs,
                                "provenance": {"commit": "abc", "argv": argv, "platform": {}}}))
    return path


def _rows(path):
    import json

    return json.loads(path.read_text())["runs"]


def _grid_files(tmp_path):
    """The planted grid split as two invocations would train it: the widths at depth 2 (with MoD) and the depths
    at width 24; vanilla 2x24 is in both."""
    runs = planted_runs({**DENSE_TURNING, **MOD}, PARAMS)
    widths = [r for r in runs if r["n_layer"] == 2]
    depths = [r for r in runs if r["d_model"] == 24 and r["variant"] == "vanilla"]
    return runs, _stored(tmp_path / "widths.json", widths), _stored(tmp_path / "depths.json", depths)


def test_tables_from_merges_two_grids_into_one_dense_curve(tmp_path):
    from experiments.repro import main as repro

    runs, widths, depths = _grid_files(tmp_path)
    merged = repro(["mod_isoflop", "--out", str(tmp_path / "merged"), "--tables_from", f"{widths},{depths}"])
    expected = budget_analysis(BUDGET, cells_of([r for r in runs if r["n_layer"] == 2 or r["d_model"] == 24]))
    (a,) = merged["analysis"]
    assert a["best_dense"] == expected["best_dense"] == "vanilla 2x24" and a["bracket"] == expected["bracket"]
    assert a["bracket"].startswith("bracketed")  # over widths at depth 2 and depths 1 / 4 at width 24
    assert {k: t["p_holm"] for k, t in a["tests"].items()} == {k: t["p_holm"] for k, t in expected["tests"].items()}
    assert len(merged["runs"]) == len({(r["variant"], r["n_layer"], r["d_model"], r["seed"]) for r in
                                       [*_rows(widths), *_rows(depths)]})
    assert "vanilla 1x16" in a["left_out"] and "mod 4x24" in a["left_out"]  # of the product, in no file
    report = (tmp_path / "merged" / "results.md").read_text()
    assert "left out of the grid (not in the merged files)" in report and str(widths) in report
    assert merged["run_options"] == ["--model.d_model", "64"]
    # a file whose runs printed a progress bar holds the same runs (the option changes no result)
    quiet = _stored(tmp_path / "quiet.json", _rows(depths), options=("--model.d_model", "64",
                                                                     "--trainer.enable_progress_bar", "false"))
    again = repro(["mod_isoflop", "--out", str(tmp_path / "quiet"), "--tables_from", f"{widths},{quiet}"])
    assert again["analysis"][0]["best_dense"] == a["best_dense"] and again["run_options"] == merged["run_options"]
    # the depths alone (one width) cannot bracket the best shape over widths
    single = repro(["mod_isoflop", "--out", str(tmp_path / "alone"), "--tables_from", str(depths)])
    assert single["analysis"][0]["bracket"].startswith("not bracketed")


def test_tables_from_refuses_files_that_are_not_the_same_runs(tmp_path):
    from experiments.repro import main as repro

    runs, widths, depths = _grid_files(tmp_path)
    out = ["mod_isoflop", "--out", str(tmp_path / "out"), "--tables_from"]
    changed = [dict(r, val_loss=r["val_loss"] + 1e-9) if r["n_layer"] == 2 else r
               for r in _rows(depths)]
    other = _stored(tmp_path / "other.json", changed)
    with pytest.raises(ConfigError, match=r"vanilla 2x24 at 1\.000e\+12 seed 0 is stored in .*widths\.json and "
                                          r".*other\.json with different val_loss: not the same run"):
        repro([*out, f"{widths},{other}"])
    wider = _stored(tmp_path / "wider.json", _rows(depths), options=("--model.d_model", "96"))
    with pytest.raises(ConfigError, match=r"wider\.json's run options \['--model\.d_model', '96'\] differ from .*widths\.json's"):
        repro([*out, f"{widths},{wider}"])
    longer = _stored(tmp_path / "longer.json", _rows(depths), tokens=1024)
    with pytest.raises(ConfigError, match=r"longer\.json's tokens_per_step 1024 differ"):
        repro([*out, f"{widths},{longer}"])
    short = _stored(tmp_path / "short.json", [r for r in runs if r["n_layer"] == 2 and r["seed"] != 2])
    with pytest.raises(ConfigError, match=r"every shape needs the same seeds; got .*vanilla 1x24 at 1\.000e\+12 \[0, 1, 2\]"):
        repro([*out, f"{short},{depths}"])
    routed_only = _stored(tmp_path / "routed.json", [r for r in runs if r["variant"] == "mod"])
    with pytest.raises(ConfigError, match=r"no vanilla rows at budget 1\.000e\+12"):
        repro([*out, str(routed_only)])
    probe_like = _stored(tmp_path / "probe.json", [{"variant": "vanilla", "seed": 1, "val_loss": 1.0}])
    with pytest.raises(ConfigError, match=r"probe\.json's run rows lack budget, n_layer, d_model, parameters"):
        repro([*out, str(probe_like)])
    unmatched = _stored(tmp_path / "unmatched.json", [{k: v for k, v in r.items() if k != "matched"}
                                                      for r in _rows(depths)])
    with pytest.raises(ConfigError, match=r"unmatched\.json's run rows lack matched: not a mod_isoflop"):
        repro([*out, str(unmatched)])
    small = _stored(tmp_path / "small.json", _rows(depths), size=("--size", "small"))  # another n_head
    with pytest.raises(ConfigError, match=r"small\.json's --size small differ from .*widths\.json's tiny"):
        repro([*out, f"{widths},{small}"])
    with pytest.raises(ConfigError, match=r"--tables_from: the list is empty"):  # not "train the whole grid"
        repro([*out, ""])


def test_tables_from_takes_a_run_whose_stored_figure_is_nan_in_both_files_as_the_same_run(tmp_path):
    from experiments.repro import main as repro

    _, widths, depths = _grid_files(tmp_path)
    nan = [dict(r, val_loss_noncausal=float("nan")) if (r["n_layer"], r["d_model"]) == (2, 24) else r
           for r in _rows(widths)]
    a = _stored(tmp_path / "a.json", nan)
    b = _stored(tmp_path / "b.json", [dict(r, val_loss_noncausal=float("nan")) if r["n_layer"] == 2 else r
                                      for r in _rows(depths)])
    merged = repro(["mod_isoflop", "--out", str(tmp_path / "out"), "--tables_from", f"{a},{b}"])
    assert merged["analysis"][0]["best_dense"] == "vanilla 2x24"


def _tables(path) -> list:
    """A report's table rows and goal lines (not its command and source lines, which name where it ran, nor the run
    table of its records, which a rebuild adds where they are here)."""
    text = path.read_text().split("\n## Runs")[0]
    return [line for line in text.splitlines() if line.startswith(("|", "- budget"))]


@pytest.mark.parametrize("merged", ["merged_1x", "merged_half"])
def test_the_published_merged_isoflop_tables_rebuild_from_their_source_files(tmp_path, merged):
    """Each committed merged isoFLOP report (docs/results/isoflop_seeds/merged_*) is the tool's output over the
    published invocations it names: rebuilt here from those results.json files, its tables and goal lines come back
    to the character (a shape and seed stored twice, e.g. vanilla 4 x 8, are the same run bit for bit, or the merge
    would refuse), and its verdict is the one docs/results.md states."""
    import json

    from experiments.repro import main as repro
    from tests.conftest import REPO

    folder = REPO / "docs" / "results" / "isoflop_seeds" / merged
    published = json.loads((folder / "results.json").read_text())
    sources = [REPO / path for path in published["tables_from"]]
    rebuilt = repro(["mod_isoflop", "--out", str(tmp_path), "--tables_from", ",".join(map(str, sources))])
    assert _tables(tmp_path / "results.md") == _tables(folder / "results.md")
    # the run table of the sources' records; from the merged file itself the same one (its rows' run_dir are
    # relative to their source, or name trained folders that the source, published since, keeps beside its records)
    repro(["mod_isoflop", "--out", str(tmp_path / "itself"), "--tables_from", str(folder / "results.json")])
    tables = [(out / "results.md").read_text().split("\n## Runs")[1:] for out in (tmp_path, tmp_path / "itself")]
    assert tables[0] == tables[1] and len(tables[0]) == 1
    (a,) = rebuilt["analysis"]
    assert a["bracket"] == "bracketed" and a["beats_best_dense"] == []
    assert a["best_dense"] == {"merged_1x": "vanilla 4x8", "merged_half": "vanilla 2x8"}[merged]

