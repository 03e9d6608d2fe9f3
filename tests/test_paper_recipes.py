"""Paper-scale recipes (experiments/configs/paper): every one parses, and the dry-run estimate is analytic."""
from __future__ import annotations

import pathlib

import pytest

from architectures.flops import vanilla_flops
from experiments import sweep
from experiments.run import model_config
from tests.conftest import REPO

RECIPES = sorted((REPO / "experiments" / "configs" / "paper").glob("*.yaml"))
TOKENS_PER_STEP = 8 * 16 * 4 * 1024  # 8 GPUs x batch 16 x accumulation 4 x T (sizes/small.yaml)


def parsed(recipe: pathlib.Path):
    configurations, common, _ = sweep.load_grid(str(recipe), [])
    return sweep.validate([[*common, *c] for c in configurations])


def test_the_four_recipes_exist():
    assert {p.stem for p in RECIPES} == {"mod_isoflop_220m", "mom_two_phase", "ffn_wider_contribution", "cea_moe"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_run_prints_jobs_and_estimate(recipe, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes name --config files relative to the repository
    jobs = sweep.main([str(recipe), "--dry_run", "--no_plan"])  # the memory plan: tests/test_scale.py
    captured = capsys.readouterr()
    assert jobs and all(job[0] == "sbatch" and "--gpus-per-node=8" in job for job in jobs)
    assert len(captured.out.strip().splitlines()) == len(jobs)  # stdout: the commands only
    assert "GPU-h" in captured.err and "total:" in captured.err and captured.err.count("\n# ") >= len(jobs) + 2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_estimate_is_tokens_times_analytic_training_flops(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    for cfg in parsed(recipe):
        row = sweep.estimate(cfg)
        assert row["tokens"] == cfg.trainer.max_steps * TOKENS_PER_STEP and row["gpus"] == 8
        assert row["flops"] == pytest.approx(row["tokens"] * row["flops_per_token"])
        if row["variant"] == "vanilla":  # independent check against the dense formula
            dense = vanilla_flops(model_config(cfg).resolve(), 1024).training
            assert row["flops_per_token"] == pytest.approx(dense)
        else:
            assert row["flops_per_token"] > 0


def test_mod_isoflop_points_spend_the_same_budget(monkeypatch):
    monkeypatch.chdir(REPO)
    rows = [sweep.estimate(cfg) for cfg in parsed(REPO / "experiments/configs/paper/mod_isoflop_220m.yaml")]
    assert all(r["flops"] == pytest.approx(6e18, rel=0.01) for r in rows)
    assert any(r["variant"] == "vanilla" and 200e6 < r["parameters"] < 240e6 for r in rows)  # the ~220M point
    assert sweep.gpu_hours(6e18, 989.5, 0.4) == pytest.approx(6e18 / (989.5e12 * 0.4) / 3600)
