"""The reproduction experiments (``python -m experiments.repro``): their building blocks, and every
experiment end to end at a minimal grid with a tiny model."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import yaml

from architectures import ModelConfig, build_model
from analysis.contribution import run_config
from architectures.config import ConfigError
from experiments.repro import main as repro
from experiments.repro.head_to_head import bench_options
from experiments.repro.isoflop import isoflop_configs, model_cost
from experiments.repro.mom import pareto_front, removed_modules, transition_shares
from tests.conftest import TINY_RUN, assert_rows_name_their_origin, crash_at_step

STEPS = ["--steps", "3"]


def results(out: pathlib.Path) -> dict:
    assert (out / "results.md").is_file()
    return json.loads((out / "results.json").read_text())


# ---------------------------------------------------------------------------- isoFLOP sizing
@pytest.mark.parametrize("budget", [3e10, 2e11, 1.7e12])
def test_isoflop_configs_spend_the_budget_within_5_percent(budget):
    base = ModelConfig(variant="mod", size="tiny", vocab_size=4096, block_size=64, mod={"capacity": 0.25})
    configs = isoflop_configs(budget, base, tokens_per_step=512, variants=("vanilla", "mod"), widths=(32, 48, 64, 96))
    assert {c.variant for c in configs} == {"vanilla", "mod"}
    for c in configs:
        assert c.steps >= 20
        assert abs(c.steps * c.tokens_per_step * c.flops_per_token / budget - 1) <= 0.05
        # the planned FLOPs are the model's own training figure, capacity included
        real = build_model(ModelConfig(variant=c.variant, size="tiny", vocab_size=4096, block_size=64, d_model=c.d_model,
                                       n_layer=c.n_layer, n_head=c.n_head, mod=base.mod))
        assert c.flops_per_token == pytest.approx(real.flops_per_token(None, 64).training)
        assert c.parameters == real.num_parameters()
    vanilla = {c.d_model: c for c in configs if c.variant == "vanilla"}
    mod = {c.d_model: c for c in configs if c.variant == "mod"}
    for width in set(vanilla) & set(mod):  # MoD spends fewer FLOPs per token, so it gets more steps
        assert mod[width].flops_per_token < vanilla[width].flops_per_token and mod[width].steps > vanilla[width].steps


def test_isoflop_budget_too_small_or_invalid_is_an_error():
    base = ModelConfig(size="tiny", vocab_size=4096, block_size=64)
    _, smallest = model_cost(base.resolve(), "vanilla", 32, 4, 4)
    with pytest.raises(ConfigError, match="too small for the smallest vanilla model"):
        isoflop_configs(19 * 512 * smallest, base, 512, widths=(32, 64))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="budget"):
            isoflop_configs(bad, base, 512, widths=(32,))
    with pytest.raises(ConfigError, match="n_head"):
        isoflop_configs(1e12, base, 512, widths=(30,))


# ---------------------------------------------------------------------------- MoM module removal hook
def tiny_mom(**mom) -> torch.nn.Module:
    config = ModelConfig(variant="mom", size="tiny", vocab_size=64, d_model=32, n_layer=4, n_head=2, block_size=16)
    for key, value in {"top_k": 2, "steps": 3, "router_hidden": 16, **mom}.items():
        setattr(config.mom, key, value)
    torch.manual_seed(0)
    return build_model(config).eval()


def test_removed_modules_are_never_selected_and_are_restored_on_exit():
    model = tiny_mom()
    idx = torch.randint(0, 64, (4, 16))
    with torch.no_grad():
        before = model(idx)
        with removed_modules(model, attn=[0, 2], ffn=[1]):
            during = model(idx)
        after = model(idx)
    for site in during.trace:
        names = site.choice_names
        removed = {"attn0", "attn2"} if ".attn." in site.name else {"ffn1"}
        chosen = {names[i] for i in site.selected.unique().tolist()}
        assert not chosen & removed, site.name
        assert torch.allclose(site.weights.sum(-1), torch.ones(()))  # renormalised over what is left
    used = {before.trace[0].choice_names[i] for i in before.trace[0].selected.unique().tolist()}
    assert used & {"attn0", "attn2"}  # the removal did change the routes
    assert not torch.allclose(during.logits, before.logits)
    assert torch.equal(after.logits, before.logits)  # the removal ends with the context


def test_removing_too_many_or_from_fixed_routing_is_refused():
    with pytest.raises(ConfigError, match="fewer than K=2"):
        with removed_modules(tiny_mom(), attn=[0, 1, 2, 3]):
            pass
    with pytest.raises(ConfigError, match="out of range"):
        with removed_modules(tiny_mom(), ffn=[7]):
            pass
    with pytest.raises(ConfigError, match="learned routing"):
        with removed_modules(tiny_mom(routing="moe", top_k=1, steps=4), attn=[1]):
            pass


def test_transition_shares_and_pareto_front():
    choices = ["m0", "m1", "m2", "skip"]
    counts = torch.tensor([[1.0, 4, 0, 0], [0, 2, 3, 0], [0, 0, 0, 1], [0, 1, 0, 0]])
    shares = transition_shares(counts, choices)
    assert shares == pytest.approx({"sequential": 7 / 12, "repeat": 3 / 12, "with_skip": 2 / 12, "other": 0.0})
    front = pareto_front({"a": (1.0, 5.0), "b": (2.0, 4.0), "c": (2.5, 4.5), "d": (3.0, 3.0)})
    assert front == ["a", "b", "d"]


def test_bench_options_keep_only_model_overrides():
    assert bench_options(["--model.d_model", "32", "--data.batch_size", "4", "--model.mom.top_k=2",
                          "--model.variant", "mod"]) == ["--set", "d_model=32", "--set", "mom.top_k=2"]


# ---------------------------------------------------------------------------- experiments end to end
def test_unknown_variant_or_empty_grid_fails_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="valid variants"):
        repro(["head_to_head", "--out", str(tmp_path), "--variants", "vanilla,nope", *STEPS, "--", *TINY_RUN])
    with pytest.raises(ConfigError, match="empty"):
        repro(["mom_kh", "--out", str(tmp_path), "--ks", ",", *STEPS, "--", *TINY_RUN])
    with pytest.raises(ConfigError, match="too small"):
        repro(["mod_isoflop", "--out", str(tmp_path), "--budgets", "1e6", "--widths", "32", *STEPS, "--", *TINY_RUN])
    assert not (tmp_path / "runs").exists()


def test_mom_kh_sweep_end_to_end_and_reuse(tmp_path):
    """Two seeds per cell: each run trains at its seed, the cell's loss summary is its seeds' losses, the depth test
    per K compares the deepest H with the shallowest, and a rerun reuses every run."""
    from analysis.stats import passes
    from experiments.repro import mom

    out = tmp_path / "kh"
    command = ["mom_kh", "--out", str(out), "--ks", "1", "--hs", "1,2", "--seeds", "2", *STEPS, "--", *TINY_RUN]
    first = repro(command)
    cell_runs = [r for r in first["runs"] if r["K"] is not None]
    assert [(r["K"], r["H"], r["seed"]) for r in cell_runs] == [(1, 1, 1337), (1, 1, 1338), (1, 2, 1337), (1, 2, 1338)]
    vanilla = [r for r in first["runs"] if r["K"] is None]  # in the rows too, so publish keeps their records
    assert [(r["variant"], r["seed"]) for r in vanilla] == [("vanilla", 1337), ("vanilla", 1338)]
    assert first["vanilla_val_loss"]["seeds"] == [r["val_loss"] for r in vanilla]
    for r in cell_runs:
        summary = json.loads((pathlib.Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["variant"] == "mom" and summary["final_val_loss"] == r["val_loss"]
        assert run_config(pathlib.Path(r["run_dir"]))["seed"] == r["seed"]
        assert any(p.name.startswith("events.out.tfevents") for p in pathlib.Path(r["run_dir"]).iterdir())
    cells = {(c["K"], c["H"]): c for c in first["cells"]}
    for (k, h), cell in cells.items():
        assert cell["val_loss"]["seeds"] == [r["val_loss"] for r in first["runs"] if (r["K"], r["H"]) == (k, h)]
    assert cells[(1, 2)]["flops_per_token"] > cells[(1, 1)]["flops_per_token"]  # more assembly steps, more FLOPs
    test = first["depth_tests"]["K=1"]
    assert test["n"] == 2 and test["difference"] == pytest.approx(
        cells[(1, 2)]["val_loss"]["mean"] - cells[(1, 1)]["val_loss"]["mean"])
    assert (out / "mom_kh.png").is_file() and any((out / "tensorboard").iterdir())
    table = (out / "results.md").read_text()
    assert "| K \\ H | 1 | 2 |" in table and "H=2 vs H=1" in table
    assert ("lower after Holm" in table) == passes(test)
    assert all(r["wall_measured"] and r["wall_s"] > 0 and r["code"] and r["cpu"] for r in first["runs"])
    walls = {part: sum(r["wall_s"] for r in first["runs"] if mom.kh_part(r) == part)
             for part in ("vanilla", "K=1 H=1", "K=1 H=2")}
    for part, seconds in walls.items():  # each part's runs, both seeds, in the wall-time table
        assert f"| {part} | 2 | {seconds:,.0f} | {seconds / 2:,.0f} |" in table
    assert "Code the runs trained at: `" in table and "CPUs the runs trained on: `" in table
    again = repro(command)
    assert [r["run_dir"] for r in again["runs"]] == [r["run_dir"] for r in first["runs"]]  # reused, not retrained


def test_a_programme_killed_mid_run_resumes_that_run_from_its_last_validation(tmp_path, monkeypatch):
    """The programme dies at step 6 (of 8, validation every 4): the rerun of the same command resumes the run in
    its folder from step 4's last.ckpt, through the worker processes too, and ends where the run that was
    never stopped ends; a third invocation reuses it."""
    import experiments.run as run
    from experiments.repro.common import Context

    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "DYNCOMP_RUN_VERSION"):
        monkeypatch.delenv(key, raising=False)
    options = ["--val_every", "4", *TINY_RUN]  # the pass-through options' --val_every wins over the programme's
    straight = Context(tmp_path / "straight", steps=8, run_options=options).run([])
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [crash_at_step(6)])
    killed = Context(tmp_path / "killed", steps=8, run_options=options)
    with pytest.raises(RuntimeError, match="killed"):
        killed.run([])
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [])
    [started] = (tmp_path / "killed" / "runs.started").glob("*.json")
    folder = pathlib.Path(json.loads(started.read_text())["run_dir"])
    assert (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "summary.json").exists()
    assert not (tmp_path / "killed" / "runs.json").exists()  # not finished: not in the index

    again = Context(tmp_path / "killed", steps=8, run_options=options, workers=2)
    [resumed] = again.run_many([([], None, None)])  # a spawned worker process resumes it
    assert resumed["run_dir"] == str(folder) and resumed["steps"] == 8
    assert resumed["train_started_at_steps"] == [0, 4]
    assert resumed["train_loss_curve"] == straight["train_loss_curve"]
    assert resumed["val_history"] == straight["val_history"] and resumed["val_metrics"] == straight["val_metrics"]
    third = Context(tmp_path / "killed", steps=8, run_options=options).run([])
    assert third["run_dir"] == str(folder)  # finished and indexed: reused, not trained again
    fresh = Context(tmp_path / "killed", steps=8, run_options=options, reuse=False).run([])
    assert fresh["run_dir"] != str(folder) and fresh["train_started_at_steps"] == [0]  # --no_reuse: trained anew


@pytest.fixture(scope="module")
def trained_mom(tmp_path_factory):
    """One tiny MoM (pool 2 + SKIP, K=1, H=3) trained by the removal experiment, shared with the transitions test."""
    out = tmp_path_factory.mktemp("removal")
    result = repro(["mom_removal", "--out", str(out), "--sequences", "8", *STEPS, "--", *TINY_RUN,
                    "--model.mom.steps", "3"])
    return out, result


def test_mom_removal_heatmap_end_to_end(trained_mom):
    out, result = trained_mom
    assert results(out)["n_attn"] == 2 and (out / "mom_removal.png").is_file()
    grid = {(g["attn_kept"], g["ffn_kept"]): g["val_loss"] for g in result["grid"]}
    assert set(grid) == {(a, f) for a in (1, 2) for f in (1, 2)}
    assert grid[(2, 2)] == pytest.approx(result["intact"])
    assert all(loss is not None and 0 < loss < 10 for loss in grid.values())


def test_mom_transitions_end_to_end(trained_mom, tmp_path):
    removal_out, removal_result = trained_mom
    result = repro(["mom_transitions", "--out", str(tmp_path), "--run", removal_result["run_dir"], "--sequences", "8"])
    assert set(result["groups"]) == {"mom.chunk0.attn", "mom.chunk0.ffn"}
    for group in result["groups"].values():
        matrix = torch.tensor(group["matrix"])
        visited = torch.tensor(group["counts"]).sum(1) > 0
        assert torch.allclose(matrix[visited].sum(1), torch.ones(int(visited.sum()), dtype=matrix.dtype))
        assert sum(group["shares"].values()) == pytest.approx(1.0)
    assert (tmp_path / "mom_transitions.png").is_file() and not (tmp_path / "runs").exists()  # nothing trained


@pytest.mark.slow  # ~45-60 s: a 2 x 2 grid, two seeds, trained end to end
def test_mod_isoflop_runs_spend_the_budget(tmp_path):
    """Two depths x one width, two seeds: vanilla at both depths (the dense curve), MoD where it can be built (its
    routed blocks need two layers), every run at the budget, the tables, the figure, and the rerun reuses every run."""
    budget = 1.2e10
    command = ["mod_isoflop", "--out", str(tmp_path), "--budgets", str(budget), "--widths", "32", "--layers", "1,2",
               "--seeds", "2", *STEPS, "--", *TINY_RUN]
    result = repro(command)
    shapes = sorted({(r["variant"], r["n_layer"], r["d_model"]) for r in result["runs"]})
    assert shapes == [("mod", 2, 32), ("vanilla", 1, 32), ("vanilla", 2, 32)]
    assert sorted(r["seed"] for r in result["runs"] if r["variant"] == "mod") == [1337, 1338]
    for r in result["runs"]:
        summary = json.loads((pathlib.Path(r["run_dir"]) / "summary.json").read_text())
        # every run trained until its measured count reached the budget: matched, overshooting by under one step
        assert summary["max_train_flops"] == budget and summary["stopped_by"] == "max_train_flops" and r["matched"]
        assert summary["steps"] == r["steps"] and r["measured_flops"] == summary["train_flops"]
        assert budget <= r["measured_flops"] < budget + r["measured_flops"] / r["steps"] * (1 + 1e-9)
        assert r["measured_deviation"] == pytest.approx(r["measured_flops"] / budget - 1.0)
        assert run_config(pathlib.Path(r["run_dir"]))["seed"] == r["seed"] and r["train_time_s"] == pytest.approx(r["step_time_s"] * r["steps"])
    (analysis,) = result["analysis"]
    dense = {k: c["val_loss"]["mean"] for k, c in analysis["cells"].items() if c["dense"]}
    assert set(dense) == {"vanilla 1x32", "vanilla 2x32"} and analysis["best_dense"] == min(dense, key=dense.get)
    best = (analysis["cells"][analysis["best_dense"]]["n_layer"],)
    assert analysis["bracket"] == f"not bracketed: only one shape tried (over the widths at n_layer={best[0]})"
    assert analysis["left_out"] == ["mod 1x32"]
    assert set(analysis["tests"]) == {"mod 2x32"} and analysis["tests"]["mod 2x32"]["p_holm"] is not None
    report = (tmp_path / "results.md").read_text()
    assert "FLOPs spent" in report and "not matched" not in report and "vanilla 1x32" in report
    assert "Δ loss vs best dense" in report and "dense isoFLOP curve: not bracketed" in report
    assert ("**met**" in report) == bool(analysis["beats_best_dense"])
    assert (tmp_path / "mod_isoflop.png").is_file()
    assert set(results(tmp_path)["wall_time_s"]) == {"training", "tables"} and "Wall time of this invocation" in report
    assert "Wall time per part" in report and all(r["wall_measured"] and r["wall_s"] > 0 for r in results(tmp_path)["runs"])
    assert_rows_name_their_origin(result["runs"], report)
    again = repro(command)  # resumable: every finished run is reused
    assert [r["run_dir"] for r in again["runs"]] == [r["run_dir"] for r in result["runs"]]


@pytest.mark.slow
def test_mom_two_phase_end_to_end(tmp_path):
    """Two seeds: each arm trains at each seed (phase 1 and from scratch at their steps), the loss summaries are
    the per-seed runs' own, the one test of two-phase against from scratch decides the goal line, and the
    programme is publishable (one row per run) and resumable (a rerun reuses every run)."""
    from analysis.stats import passes
    from experiments.repro.publish import publish

    command = ["mom_two_phase", "--out", str(tmp_path / "out"), "--steps", "4", "--seeds", "2", "--", *TINY_RUN]
    result = repro(command)
    assert result["phase1_steps"] == 2 and result["phase2_steps"] == 2 and result["seeds"] == 2
    rows = {(r["seed"], r["arm"]): r for r in result["runs"]}
    assert set(rows) == {(s, arm) for s in (1337, 1338) for arm in ("two-phase", "from scratch", "vanilla", "phase 1")}
    for (seed, arm), row in rows.items():
        summary = json.loads((pathlib.Path(row["run_dir"]) / "summary.json").read_text())
        assert run_config(pathlib.Path(row["run_dir"]))["seed"] == seed and summary["final_val_loss"] == row["final_val_loss"]
        assert (summary["variant"], summary["steps"]) == {"phase 1": ("vanilla", 2), "two-phase": ("mom", 2),
                                                         "from scratch": ("mom", 4), "vanilla": ("vanilla", 4)}[arm]
    for arm in ("two-phase", "from scratch", "vanilla", "phase 1"):
        assert result["val_loss"][arm]["seeds"] == [rows[(s, arm)]["final_val_loss"] for s in (1337, 1338)]
    for arm in ("two-phase", "from scratch"):
        assert all(-1.0 <= m[arm]["ffn"] <= 1.0 for m in result["measures_per_seed"])
    test = result["two_phase_vs_from_scratch"]
    assert test["n"] == 2 and test["difference"] == pytest.approx(
        result["val_loss"]["two-phase"]["mean"] - result["val_loss"]["from scratch"]["mean"])
    report = (tmp_path / "out" / "results.md").read_text()
    assert ("Two-phase **beats**" in report) == passes(test) and "one-sided Welch over 2 seeds each" in report
    assert (tmp_path / "out" / "mom_two_phase.png").is_file()
    assert len(publish(tmp_path / "out", tmp_path / "published")["runs"]) == 8
    again = repro(command)
    assert [r["run_dir"] for r in again["runs"]] == [r["run_dir"] for r in result["runs"]]


def test_mom_two_phase_with_one_seed_makes_no_claim():
    from experiments.repro.mom import two_phase_verdict

    one = {"two_phase_vs_from_scratch": {"difference": -0.02, "ci_low": None, "ci_high": None, "p": None,
                                         "hedges_g": None, "n": 1, "n_baseline": 1, "p_holm": None}}
    line = two_phase_verdict(one, 1)
    assert "no claim (1 and 1 of 1 seeds" in line and "beat" not in line
    lost = {"two_phase_vs_from_scratch": {"difference": -0.5, "ci_low": -0.6, "ci_high": -0.4, "p": 0.001,
                                          "hedges_g": -3.0, "n": 4, "n_baseline": 5, "p_holm": 0.001}}
    line = two_phase_verdict(lost, 5)  # a seed's loss was not finite: the test over the rest makes no claim
    assert "no claim (4 and 5 of 5 seeds" in line and "beat" not in line


@pytest.mark.slow
def test_contribution_end_to_end_with_ood_text(tmp_path):
    """Two seeds per model: every run at its seed, each model's figures over its seeds, and the three claims'
    tests computed from the rows (the correlation of r with the MHA ratio and with the OOD loss per seed)."""
    from analysis.stats import one_sample_p
    from experiments.repro.contribution import correlation

    ood = tmp_path / "ood.txt"
    ood.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    result = repro(["contribution", "--out", str(tmp_path / "out"), "--wide_ratio", "8", "--ratios", "0.25,0.5,0.75",
                    "--methods", "logit_lens,mi", "--sequences", "8", "--ood", f"fox={ood}", "--ood_tokens", "600",
                    "--seeds", "2", "--mi_restarts", "2", *STEPS, "--", *TINY_RUN])
    names = ["vanilla", "ffn_wider", "caa r=0.25", "caa r=0.5", "caa r=0.75"]
    assert [(r["name"], r["seed"]) for r in result["runs"]] == [(n, s) for n in names for s in (1337, 1338)]
    for r in result["runs"]:
        assert 0 < r["ood"]["fox"] < 10 and run_config(pathlib.Path(r["run_dir"]))["seed"] == r["seed"]
        if r["mha_mi"] is not None:
            assert r["mha_mi"] + r["ffn_mi"] == pytest.approx(1.0)
    models = result["models"]
    assert models["ffn_wider"]["parameters"] > models["vanilla"]["parameters"]  # 8d FFN vs 4d
    for name in names:
        assert models[name]["val_loss"]["seeds"] == [r["val_loss"] for r in result["runs"] if r["name"] == name]
    tests = result["tests"]
    for method, test in tests["wider_raises_ffn"].items():  # a ratio a method leaves undefined is not counted
        defined = lambda name: sum(r[f"ffn_{method}"] is not None for r in result["runs"] if r["name"] == name)  # noqa: E731
        assert (test["n"], test["n_baseline"]) == (defined("ffn_wider"), defined("vanilla"))
    for seed, got in zip((1337, 1338), tests["lower_r_lowers_ood"]["fox"]["correlations"]):
        caa = [r for r in result["runs"] if r["r"] is not None and r["seed"] == seed]
        assert got == pytest.approx(correlation([r["r"] for r in caa], [r["ood"]["fox"] for r in caa]))
    fox = tests["lower_r_lowers_ood"]["fox"]
    assert fox["p"] == one_sample_p(fox["correlations"], 0.0, "greater") and fox["p_holm"] == fox["p"]  # one OOD set
    report = (tmp_path / "out" / "results.md").read_text()
    assert "OOD loss fox" in report and "per seed, positive:" in report and "seed mean [95% bootstrap" in report
    assert result["mi_restarts"] == 2 and "averaged over 2 k-means seeds" in report


def test_contribution_table_shows_each_ratio_with_its_standard_error():
    from experiments.repro.common import fmt
    from experiments.repro.contribution import with_se

    assert with_se(0.41234, 0.0512) == "0.412 ± 0.051"
    assert with_se(0.5, None) == fmt(0.5) and with_se(None, 0.1) == fmt(None)


def test_the_published_5_seed_contribution_tests_rebuild_from_their_rows_and_no_claim_is_shown():
    """docs/results/contribution_seeds (pre-registered in docs/results/preregistered/mom_kh_contribution_seeds.md):
    the three claims' tests, recomputed from the stored per-run rows, are the report's, and none passes after Holm.
    Every run's record is in the folder, and the seed-1337 rows give the one-seed table's losses (but vanilla's,
    6.3441 there: that table's vanilla was another training)."""
    from analysis.stats import passes
    from experiments.repro.contribution import claim_tests
    from tests.conftest import REPO

    folder = REPO / "docs" / "results" / "contribution_seeds"
    published = json.loads((folder / "results.json").read_text())
    rows = published["runs"]
    assert len(rows) == 30 and {r["seed"] for r in rows} == set(range(1337, 1342))
    assert all((folder / r["run_dir"] / "summary.json").is_file() for r in rows)
    tests = claim_tests(rows, published["methods"], list(published["ood"]))
    assert json.loads(json.dumps(tests)) == published["tests"]
    assert not any(passes(test) for family in tests.values() for test in family.values())
    first = {r["name"]: r for r in rows if r["seed"] == 1337}  # the one-seed table in docs/results.md
    one_seed_table = {"ffn_wider": 6.2993, "caa r=0.125": 6.4097, "caa r=0.25": 6.3319, "caa r=0.5": 6.3230,
                      "caa r=0.75": 6.3266}
    assert {m: round(first[m]["val_loss"], 4) for m in one_seed_table} == one_seed_table
    assert round(first["vanilla"]["val_loss"], 4) == 6.3440  # the table's 6.3441 was another training (results.md)


@pytest.mark.slow
def test_head_to_head_end_to_end(tmp_path):
    result = repro(["head_to_head", "--out", str(tmp_path), "--variants", "mod,moe:num_experts=4", "--bench_steps", "1", "--seeds", "2",
                    "--dense_shapes", "1x32", *STEPS, "--", *TINY_RUN])
    entries = {r["variant"]: r for r in result["entries"]}
    moe = "moe:num_experts=4"  # an entry with its own options, trained and benchmarked with them
    assert list(entries) == ["vanilla", "dense:1x32", "mod", moe]
    assert [r["dense"] for r in result["entries"]] == [True, True, False, False]
    vanilla = entries["vanilla"]
    assert vanilla["flops_ratio"] == 1.0 and vanilla["step_time_ratio"] == 1.0
    assert vanilla["steps_seeds"] == [3, 3] and vanilla["train_flops"]["mean"] == pytest.approx(result["budget"])
    assert entries["dense:1x32"]["flops_ratio"] < 1.0 and entries["dense:1x32"]["bench_step_s"] is None
    for r in result["runs"]:
        assert r["val_loss"] > 0 and r["matched"] and r["budget"] == result["budget"] and r["train_flops"] >= result["budget"]
        assert r["train_time_s"] == pytest.approx(r["run_step_s"] * r["steps"])
    for r in (entries["vanilla"], entries["mod"], entries[moe]):
        assert r["memory_mb"] > 0 and r["bench_step_s"] > 0
    assert min(entries["mod"]["steps_seeds"]) > 3  # MoD's cheaper steps buy more of them
    dense = {k: r["val_loss"]["mean"] for k, r in entries.items() if r["dense"]}
    assert result["best_dense"] == min(dense, key=dense.get) and set(result["tests"]["loss"]) == {"mod", moe}
    report = (tmp_path / "results.md").read_text()
    assert "not matched" not in report and "train time s [95% CI]" in report and "dense:1x32" in report
    # MoD's top-k sees the future: compared by its causal loss, at the causal evaluation's FLOPs (issue 20)
    mod = next(r for r in result["runs"] if r["variant"] == "mod")
    metrics = json.loads((pathlib.Path(mod["run_dir"]) / "summary.json").read_text())["val_metrics"]
    assert mod["causal"] and mod["val_loss"] == metrics["val/loss_causal"] and mod["val_loss_noncausal"] == metrics["val/loss"]
    assert mod["causal_flops_ratio"] == metrics["val/flops_causal_ratio_to_vanilla"]
    assert not vanilla["causal"] and vanilla["causal_flops_ratio"] is None
    assert set(results(tmp_path)["wall_time_s"]) == {"training", "benchmark", "tables"}
    assert "Wall time per part" in report and "| dense:1x32 |" in report
    assert_rows_name_their_origin(result["runs"], report)
    # two dense shapes at different depths: neither axis has a curve to turn, and the report says so
    assert result["dense_grid"].startswith("not bracketed: only one shape tried")
    assert f"Dense grid: the best dense model is {result['best_dense']}, {result['dense_grid']}" in report
    assert (tmp_path / "head_to_head.png").is_file()
    config = yaml.safe_load((pathlib.Path(entries[moe]["run_dirs"][0]) / "config.yaml").read_text())
    assert config["model"]["moe"]["num_experts"] == 4


@pytest.mark.slow
def test_contribution_reports_slimpajama_subset_losses(tmp_path):
    """With SlimPajama-layout data the runs validate per subset and the table shows those losses.

    The set names below are attached to generated text only to exercise the plumbing."""
    import random

    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from his her which or be are an".split()
    sets = ["RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaGithub", "RedPajamaArXiv"]
    data = tmp_path / "sp"
    data.mkdir()
    for split, rows in (("train", 160), ("validation", 40)):
        with open(data / f"{split}.jsonl", "w") as handle:
            for i in range(rows):
                text = " ".join(rng.choice(words) for _ in range(200))
                handle.write(json.dumps({"text": text, "meta": {"redpajama_set_name": sets[i % 4]}}) + "\n")
    result = repro(["contribution", "--out", str(tmp_path / "out"), "--wide_ratio", "8", "--ratios", "0.5",
                    "--methods", "logit_lens", "--sequences", "4", "--seeds", "1", *STEPS, "--", *TINY_RUN,
                    "--data", "slimpajama", "--data.path", str(data), "--tokenizer", "bytes"])
    report = (tmp_path / "out" / "results.md").read_text()
    for r in result["runs"]:
        assert set(r["ood"]) == {"RedPajamaGithub", "RedPajamaArXiv"}
        summary = json.loads((pathlib.Path(r["run_dir"]) / "summary.json").read_text())
        assert r["ood"]["RedPajamaArXiv"] == summary["val_metrics"]["val/RedPajamaArXiv/loss"] > 0
        if r["se_logit_lens"] is not None:  # one seed: the ratio with its bootstrap SE over the sequences
            assert f"{r['mha_logit_lens']:.3f} ± {r['se_logit_lens']:.3f}" in report
    assert "OOD loss RedPajamaGithub" in report and "holds" not in report  # one seed: no claim is tested


class FakeRun:
    """``experiments.run.main`` without training: claims ``root/version_N`` (reporting it to ``on_run_folder``),
    writes a summary, and records how it was called; ``fail`` makes it raise instead (after releasing the folder
    when ``release``), ``refuse_resume`` raises the run's refusal of a checkpoint."""

    def __init__(self, root, fail=False, release=False, refuse_resume=False):
        self.root, self.fail, self.release, self.refuse_resume, self.calls = root, fail, release, refuse_resume, []

    def __call__(self, argv, on_run_folder=None):
        from lightning_modules.storage import claim_next_version

        self.calls.append(list(argv))
        if "--ckpt_path" in argv:
            if self.refuse_resume == "mismatch":
                from experiments.run import CheckpointMismatch

                raise CheckpointMismatch("ckpt_path: was trained with a different model.n_layer")
            if self.refuse_resume:
                raise ConfigError("ckpt_path: cannot read it (Input/output error)")
            folder = pathlib.Path(argv[argv.index("--ckpt_path") + 1]).parent.parent
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            folder = self.root / claim_next_version(self.root)
            if on_run_folder is not None:
                on_run_folder(folder)
        if self.fail:
            if self.release:
                import shutil

                shutil.rmtree(folder)
            raise RuntimeError("failed before its first step")
        (folder / "summary.json").write_text("{}")
        return folder


def _started(tmp_path, monkeypatch, **fake):
    import experiments.run as run

    fake_run = FakeRun(tmp_path / "runs" / "vanilla-tiny", **fake)
    monkeypatch.setattr(run, "main", fake_run)
    return fake_run, tmp_path / "runs.started" / "abc.json"


def test_a_record_whose_folder_was_released_and_claimed_again_is_not_followed(tmp_path, monkeypatch):
    """A start that failed released its folder; another command claimed the same version_N. The rerun must not
    take that run for its own (it carries another record's mark, or none)."""
    from experiments.repro.common import STARTED_MARK, started_folder, train_resumably

    fake, started = _started(tmp_path, monkeypatch, fail=True, release=True)
    with pytest.raises(RuntimeError):
        train_resumably(["--seed", "1"], started)
    assert not started.exists()  # the failed start leaves no record
    other = tmp_path / "runs" / "vanilla-tiny" / "version_0"  # the next command's run, in the released folder
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_text("")
    started.parent.mkdir(exist_ok=True)
    started.write_text(json.dumps({"argv": ["--seed", "1"], "run_dir": str(other)}))  # a stale record, however left
    assert started_folder(started, ["--seed", "1"]) is None  # no mark
    (other / STARTED_MARK).write_text("another.json\n")
    assert started_folder(started, ["--seed", "1"]) is None  # another record's mark
    (other / STARTED_MARK).write_text("abc.json\n")
    assert started_folder(started, ["--seed", "2"]) is None  # another command's record
    assert started_folder(started, ["--seed", "1"]) == other


def test_a_run_cut_off_before_its_first_checkpoint_starts_again_in_a_clean_folder(tmp_path, monkeypatch):
    from experiments.repro.common import started_folder, train_resumably

    fake, started = _started(tmp_path, monkeypatch)
    first = train_resumably(["--seed", "1"], started)
    (first / "summary.json").unlink()  # as if killed before its first checkpoint, after some steps
    (first / "events.out.tfevents.1").write_text("the killed attempt's steps")
    again = train_resumably(["--seed", "1"], started)
    assert again == first and not (again / "events.out.tfevents.1").exists()  # released, claimed anew, clean
    assert (again / "summary.json").is_file() and started_folder(started, ["--seed", "1"]) == again
    assert all("--ckpt_path" not in call for call in fake.calls)
    assert train_resumably(["--seed", "1"], started) == again and len(fake.calls) == 2  # finished: returned as it is


def test_a_checkpoint_trained_with_other_settings_is_left_and_the_run_starts_again(tmp_path, monkeypatch, capsys):
    from experiments.repro.common import started_folder, train_resumably

    fake, started = _started(tmp_path, monkeypatch, refuse_resume="mismatch")
    first = train_resumably(["--seed", "1"], started)
    (first / "summary.json").unlink()
    (first / "checkpoints").mkdir()
    (first / "checkpoints" / "last.ckpt").write_text("")
    again = train_resumably(["--seed", "1"], started)
    assert again != first and (first / "checkpoints" / "last.ckpt").is_file()  # left where it is
    assert started_folder(started, ["--seed", "1"]) == again
    assert "cannot resume" in capsys.readouterr().err


def test_any_other_refusal_of_the_checkpoint_stops_and_keeps_the_record(tmp_path, monkeypatch):
    """An unreadable checkpoint (a transient I/O error) is not a reason to train from step 0: the error stops the
    programme, and the next invocation resumes the same folder."""
    from experiments.repro.common import started_folder, train_resumably

    fake, started = _started(tmp_path, monkeypatch, refuse_resume=True)
    first = train_resumably(["--seed", "1"], started)
    (first / "summary.json").unlink()
    (first / "checkpoints").mkdir()
    (first / "checkpoints" / "last.ckpt").write_text("")
    with pytest.raises(ConfigError, match="Input/output error"):
        train_resumably(["--seed", "1"], started)
    assert started_folder(started, ["--seed", "1"]) == first and len(fake.calls) == 2
    fake.refuse_resume = False
    assert train_resumably(["--seed", "1"], started) == first  # resumed in place
    assert fake.calls[-1] == ["--seed", "1", "--ckpt_path", str(first / "checkpoints" / "last.ckpt")]


def test_a_relaunched_ddp_rank_follows_the_record_and_touches_nothing(tmp_path, monkeypatch):
    from experiments.repro.common import started_folder, train_resumably

    fake, started = _started(tmp_path, monkeypatch)
    first = train_resumably(["--seed", "1"], started)
    (first / "summary.json").unlink()  # rank 0 is training it, no checkpoint yet
    (first / "events.out.tfevents.1").write_text("rank 0's")
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake.fail = True  # stop in main: what matters is how it was called and what was left
    with pytest.raises(RuntimeError):
        train_resumably(["--seed", "1"], started)
    assert fake.calls[-1] == ["--seed", "1"] and (first / "events.out.tfevents.1").is_file()
    assert started_folder(started, ["--seed", "1"]) == first
    (first / "checkpoints").mkdir()
    (first / "checkpoints" / "last.ckpt").write_text("")
    with pytest.raises(RuntimeError):
        train_resumably(["--seed", "1"], started)
    assert fake.calls[-1] == ["--seed", "1", "--ckpt_path", str(first / "checkpoints" / "last.ckpt")]


def test_a_file_system_without_locks_runs_unlocked_with_a_note(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from experiments.repro.common import train_resumably

    fake, started = _started(tmp_path, monkeypatch)

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert (train_resumably(["--seed", "1"], started) / "summary.json").is_file()
    assert "cannot be locked (No locks available)" in capsys.readouterr().err


def test_a_second_programme_running_the_same_command_at_once_is_refused(tmp_path, monkeypatch):
    from experiments.repro.common import started_lock, train_resumably

    fake, started = _started(tmp_path, monkeypatch)
    with started_lock(started):  # the first programme, training the run
        with pytest.raises(ConfigError, match="another programme is training this run"):
            train_resumably(["--seed", "1"], started)
    assert fake.calls == []
    assert (train_resumably(["--seed", "1"], started) / "summary.json").is_file()  # the lock went with its holder


def test_explicit_version_or_checkpoint_and_no_reuse_bypass_the_record(tmp_path, monkeypatch):
    from experiments.repro.common import train_resumably

    fake, started = _started(tmp_path, monkeypatch)
    train_resumably(["--seed", "1", "--ckpt_path=last"], started)
    train_resumably(["--seed", "1"], None)
    assert not started.exists() and fake.calls == [["--seed", "1", "--ckpt_path=last"], ["--seed", "1"]]


def test_the_published_two_phase_verdict_follows_from_its_run_records():
    """docs/results/mom_two_phase_seeds: every row's loss is its record's, and the analysis and goal line rebuilt
    from the records are the published ones (not met at 5 seeds)."""
    from experiments.repro.mom import ARMS, two_phase_analysis, two_phase_verdict
    from tests.conftest import REPO

    folder = REPO / "docs" / "results" / "mom_two_phase_seeds"
    published = json.loads((folder / "results.json").read_text())
    per_seed = []
    for measures in published["measures_per_seed"]:
        rows = {r["arm"]: r for r in published["runs"] if r["seed"] == measures["seed"]}
        runs = {arm: json.loads((folder / rows[arm]["run_dir"] / "summary.json").read_text()) for arm in ARMS}
        assert all(runs[arm]["final_val_loss"] == rows[arm]["final_val_loss"] for arm in ARMS)
        per_seed.append({"seed": measures["seed"], "runs": runs, "measures": measures})
    analysis = two_phase_analysis(per_seed)
    assert analysis["two_phase_vs_from_scratch"] == pytest.approx(published["two_phase_vs_from_scratch"])
    line = two_phase_verdict(analysis, published["seeds"])
    assert published["seeds"] == 5 and "is **not shown to beat**" in line and line in (folder / "results.md").read_text()


def test_mom_kh_observations_survive_a_cell_without_a_finite_loss():
    """A cell whose every seed diverged has no mean: the observations name it and go on (no crash after training)."""
    from analysis.stats import seed_summary
    from experiments.repro.mom import kh_depth_tests, kh_observations

    rows = [{"K": 1, "H": h, "seed": s, "val_loss": loss} for h, losses in ((1, [6.5, 6.6]), (2, [float("nan")] * 2))
            for s, loss in zip((1, 2), losses)]
    cells = {(1, h): {"val_loss": seed_summary([r["val_loss"] for r in rows if r["H"] == h]), "flops_ratio": float(h)}
             for h in (1, 2)}
    lines = kh_observations(cells, [1], [1, 2], kh_depth_tests(rows, [1], [1, 2]))
    assert lines[0] == "- No finite loss in any seed (diverged): K=1, H=2."
    assert "changes with each step in H: -; H=2 vs H=1: untested" in lines[1] and "K=1, H=1 (6.5500)" in lines[-1]


def test_the_two_phase_figure_averages_the_seeds_at_the_steps_they_all_logged():
    """No interpolation onto one seed's steps: a seed whose curve ends early (or is thinned otherwise) neither gets
    values made up past its end nor shifts the others; the mean and band are over the steps every seed has."""
    import types

    from experiments.repro.mom import plot_two_phase

    arms = ("phase 1", "two-phase", "from scratch", "vanilla")
    short = {"runs": {arm: {"train_loss_curve": [[1, 4.0], [2, 3.0], [3, 2.0]]} for arm in arms}}
    longer = {"runs": {arm: {"train_loss_curve": [[1, 6.0], [2, 5.0], [3, 4.0], [4, 1.0]]} for arm in arms}}
    saved = {}
    ctx = types.SimpleNamespace(save_figure=lambda fig, name: saved.setdefault(name, fig))
    plot_two_phase(ctx, "mom_e", 10, [longer, short])
    ax = saved["mom_two_phase"].axes[0]
    steps, means = ax.lines[1].get_data()  # the two-phase arm, offset by phase 1's 10 steps
    assert list(steps) == [11, 12, 13] and list(means) == [5.0, 4.0, 3.0]
    assert list(ax.lines[0].get_data()[0]) == [1, 2, 3]


def test_the_published_5_seed_mom_kh_sweep_rebuilds_from_its_rows_and_deeper_assembly_is_not_shown_better():
    """docs/results/mom_kh_seeds (pre-registered in docs/results/preregistered/mom_kh_contribution_seeds.md): per K,
    H = 6 against H = 1 (one-sided Welch over 5 seeds, Holm over the three Ks), the cells and the observations,
    recomputed from the stored rows, are the report's. No K passes (H = 6 is worse at every K); (3, 2) is off the
    loss-vs-FLOPs Pareto front, and the lowest cell is (3, 1). The vanilla rows' losses are h2h_seeds' bit for bit (the
    same seeds and model options, trained at 21453ad on the same CPU model under a budget that also stopped at 300)."""
    from analysis.stats import passes
    from experiments.repro.mom import kh_cells, kh_depth_tests, kh_observations
    from tests.conftest import REPO

    folder = REPO / "docs" / "results" / "mom_kh_seeds"
    published = json.loads((folder / "results.json").read_text())
    ks, hs = [1, 2, 3], [1, 2, 4, 6]
    rows = [r for r in published["runs"] if r["K"] is not None]
    assert len(rows) == 60 and {r["seed"] for r in rows} == set(range(1337, 1342))
    assert all((folder / r["run_dir"] / "summary.json").is_file() for r in published["runs"])
    tests = kh_depth_tests(rows, ks, hs)
    assert json.loads(json.dumps(tests)) == published["depth_tests"]
    assert not any(passes(t) for t in tests.values()) and all(t["ci_low"] > 0 for t in tests.values())
    cells = kh_cells(rows, {(k, h): None for k in ks for h in hs})
    assert json.loads(json.dumps([{"K": k, "H": h, **c} for (k, h), c in cells.items()])) == published["cells"]
    observations = kh_observations(cells, ks, hs, tests)
    assert "- (K=3, H=2) is not on the Pareto front." in observations
    assert "- Lowest seed-mean loss: K=3, H=1 (6.4367)." in observations
    h2h = json.loads((REPO / "docs" / "results" / "h2h_seeds" / "results.json").read_text())["runs"]
    vanilla = lambda runs: {r["seed"]: r["val_loss"] for r in runs if r.get("variant") == "vanilla"}  # noqa: E731
    assert vanilla(published["runs"]) == vanilla(h2h)


def test_the_per_token_depth_table_retrained_on_another_cpu_keeps_every_verdict():
    """docs/results/depth_h2h (50 runs at 23802ae on an Intel Xeon, its records restored by a retraining on that CPU)
    retrained at the same commit on an AMD EPYC (docs/results/depth_h2h_amd): each board rebuilds from its own records
    run for run; 19 of the 50 AMD runs equal the published ones bit for bit, the rest differ by under 0.003 nats
    (another CPU's kernels); and every row is still worse than the best dense model (2 x 64) after Holm, in both."""
    from analysis import compare
    from analysis.retraining import as_text, board_mismatch, board_runs
    from tests.conftest import REPO

    results = REPO / "docs" / "results"
    published = json.loads((results / "depth_h2h" / "leaderboard.json").read_text())
    retrained = json.loads((results / "depth_h2h_amd" / "leaderboard.json").read_text())
    for name, board in (("depth_h2h", published), ("depth_h2h_amd", retrained)):
        records = compare.find_run_folders([str(results / name / "runs")])
        assert len(records) == 50 and board_mismatch(board, compare.leaderboard(compare.read_runs(records),
                                                                                 board["group_by"])) is None
    old, new = board_runs(published), board_runs(retrained)
    assert set(old) == set(new) and len(old) == 50
    same = lambda a, b: all(as_text(a.get(f)) == as_text(b.get(f)) for f in {*a, *b})  # noqa: E731
    assert sum(same(old[k], new[k]) for k in old) == 19
    assert max(abs(old[k]["headline_val_loss"] - new[k]["headline_val_loss"]) for k in old) < 0.003
    for board in (published, retrained):
        tests = [row["vs_baseline"] for row in board["rows"] if row.get("vs_baseline")]
        assert len(tests) == 9 and all(t["difference"] > 0 and t["p_holm"] < 0.05 for t in tests)
