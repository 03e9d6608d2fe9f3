"""``--max_train_flops``: the run stops at the first step whose cumulative measured training FLOPs reach the
budget (checked against the FLOPs callback's own per-step figures), the LR cosine follows the share spent,
resumes keep the count, DDP ranks stop together, bad values are refused up front."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from architectures.config import ConfigError
from experiments.run import main
from lightning_modules.lm import cosine_decay
from tests.conftest import REPO, TINY_RUN, file_states

B, T = 4, 64  # TINY_RUN's batch and context
FAST = [*TINY_RUN, "--val_blocks", "4", "--callbacks.contribution", "false", "--callbacks.throughput", "false"]
ROUTED = {"vanilla": [], "mod": [], "mom_e": ["--model.n_layer", "4"]}  # mom_e: K=3 needs more modules than 2 layers give


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def planned_step_flops(variant: str, extra=()) -> float:
    """Training FLOPs of one step by the model's plan (no trace): only to size a budget of a few steps."""
    from architectures import build_model
    from experiments.run import build_parser, expand_aliases, model_config, parse_with_presets

    cfg = parse_with_presets(build_parser(), expand_aliases(["--variant", variant, *FAST, *extra]))
    with torch.device("meta"):
        model = build_model(model_config(cfg, vocab_size=4096))  # the embedded corpus's BPE vocabulary
    return model.flops_per_token(None, T).training * B * T


def measured_counts(run_dir, world: int = 1):
    """Global training FLOPs of each step from the FLOPs callback's per-step log (``--callbacks.flops_every 1``):
    the mean over ranks of FLOPs per token, times the tokens of every rank."""
    per_token = _scalars(run_dir, "flops/training")  # x = step - 1
    return [per_token[x] * B * T * world for x in sorted(per_token)]


def first_step_reaching(counts, budget):
    total = 0.0
    for step, count in enumerate(counts, start=1):
        total += count
        if total >= budget:
            return step, total
    return None, total


# ---------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("value,error", [("0", ConfigError), ("-1e12", ConfigError), (".inf", ConfigError),
                                         (".nan", ConfigError), ("inf", ConfigError), ("-inf", ConfigError),
                                         ("nan", ConfigError), ("lots", argparse.ArgumentError)])
def test_a_budget_that_is_not_positive_and_finite_is_refused_before_any_work(tmp_path, value, error):
    # ".inf" / ".nan" are YAML's floats (they pass the parser's type check); Python's "inf", "-inf", "nan" are
    # given YAML's spelling so that they reach the budget's own check too (issue 30); words fail the parser
    with pytest.raises(error, match=r"max_train_flops(: must be a positive, finite number|\")"):
        main([f"--max_train_flops={value}", "--log_dir", str(tmp_path), *FAST])
    assert not any(tmp_path.iterdir())


def test_a_budget_with_a_step_schedule_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="optim.schedule_steps: cannot be combined with max_train_flops"):
        main(["--max_train_flops", "1e12", "--optim.schedule_steps", "10", "--log_dir", str(tmp_path), *FAST])


def test_command_line_budget_error_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--max_train_flops=-5"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: max_train_flops: must be a positive")


# ---------------------------------------------------------------------------- the counter on its own
class _Model:
    """flops_per_token of a model whose routing spends ``costs[i]`` training FLOPs per token on the i-th batch."""

    def __init__(self, costs):
        self.costs = list(costs)

    def flops_per_token(self, trace, seq_len):
        from architectures.flops import Flops

        return Flops(ffn=self.costs.pop(0) / 3.0)  # training = 3 x forward


def _steps(budget, costs, accumulate=1, warmup=0):
    """Drive a FlopsBudget like training_step does; per step: (may_end before counting, after, stopped)."""
    from types import SimpleNamespace

    from lightning_modules.flops_budget import FlopsBudget

    trainer = SimpleNamespace(world_size=1, should_stop=False)
    counter, model, out = FlopsBudget(budget), _Model(costs), []
    step = 0
    while not trainer.should_stop and model.costs:
        step += 1
        before = counter.may_end_at(step)  # what the callbacks see at the step's first micro-batch
        for _ in range(accumulate):
            counter.add(model, None, (1, 1))
        counter.close_step(trainer, step, warmup)
        out.append((before, counter.may_end_at(step), trainer.should_stop))
    return counter, out


def test_counter_stops_at_the_first_step_reaching_the_budget_and_sums_micro_batches():
    counter, steps = _steps(10.0, [1, 2, 3, 4, 5, 6, 7, 8], accumulate=2)  # steps cost 3, 7, 11, 15
    assert counter.stop_step == 2 and counter.spent == 10.0 and len(steps) == 2 and steps[-1][2]
    counter, steps = _steps(10.5, [3, 3, 3, 3, 3])
    assert counter.stop_step == 4 and counter.spent == 12.0 and counter.fraction() == 1.0


def test_counter_announces_the_possible_last_steps_and_never_changes_its_answer_within_a_step():
    counter, steps = _steps(10.5, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    assert counter.stop_step == 11
    for before, after, stopped in steps:
        assert before == after  # a callback that began measuring at the first micro-batch also measures the last
    assert [before for before, _, _ in steps] == [False] * 9 + [True] * 2  # left <= 2 x the dearest step


def test_counter_schedule_progress_starts_after_the_warmup():
    counter, _ = _steps(10.0, [2, 2, 2, 2, 2], warmup=1)
    assert counter.warmup_fraction == pytest.approx(0.2)
    assert counter.schedule_progress(5, 1) == 1.0
    counter, _ = _steps(10.0, [2, 2, 2], warmup=1)
    assert counter.schedule_progress(3, 1) == pytest.approx((0.6 - 0.2) / 0.8)


# ---------------------------------------------------------------------------- the stop, the count, the schedule
def _budget_run(tmp_path, variant, budget, *extra, max_steps=40):
    return main(["--variant", variant, "--max_steps", str(max_steps), "--max_train_flops", repr(budget),
                 "--val_every", str(max_steps), "--log_dir", str(tmp_path), "--callbacks.flops_every", "1",
                 "--trainer.log_every_n_steps", "1", "--optim.warmup_steps", "2", *FAST, *ROUTED[variant], *extra])


def _check_stop(run_dir, budget, world: int = 1):
    summary = _summary(run_dir)
    counts = measured_counts(run_dir, world)
    stop, total = first_step_reaching(counts, budget)
    assert len(counts) == summary["steps"] == stop  # the first step whose cumulative count reaches the budget
    assert summary["train_flops"] == pytest.approx(total, rel=1e-6)  # TensorBoard holds float32
    assert summary["train_flops"] >= budget > summary["train_flops"] - counts[-1]
    assert summary["max_train_flops"] == budget and summary["stopped_by"] == "max_train_flops"
    assert _scalars(run_dir, "train/flops_spent")[stop - 1] == pytest.approx(summary["train_flops"], rel=1e-6)
    # the summary's FLOPs-per-token and routing figures are those of the last step
    assert summary["flops_per_token"]["step"] == stop
    return summary, counts


def test_budget_stops_at_the_first_step_whose_count_reaches_it_and_the_cosine_ends_there(tmp_path, one_thread):
    per_step = planned_step_flops("vanilla")
    budget = 4.5 * per_step
    run_dir = _budget_run(tmp_path, "vanilla", budget)
    summary, counts = _check_stop(run_dir, budget)
    assert summary["steps"] == 5 and counts == pytest.approx([per_step] * 5, rel=1e-6)
    # the LR after step s (TensorBoard x = s) follows the share of the budget spent since the 2 warmup steps
    lrs = _scalars(run_dir, "lr-AdamW/pg1")
    spent = [sum(counts[:s]) for s in range(len(counts) + 1)]
    for s in range(2, summary["steps"]):
        progress = min(1.0, (spent[s] - spent[2]) / (budget - spent[2]))
        assert lrs[s] == pytest.approx(1e-3 * cosine_decay(progress, 0.1), rel=1e-5), s


@pytest.mark.slow
@pytest.mark.parametrize("variant,extra", [("mod", []), ("mom_e", []), ("mom_e", ["--trainer.accumulate_grad_batches", "2"])])
def test_routed_variants_stop_on_their_measured_count(tmp_path, one_thread, variant, extra):
    accumulate = 2 if extra else 1
    planned = planned_step_flops(variant, ROUTED[variant]) * accumulate
    budget = 4.5 * planned
    summary, counts = _check_stop(_budget_run(tmp_path, variant, budget, *extra), budget, world=accumulate)
    if variant == "mom_e":  # the routers decide what runs: the count is measured, not the plan
        assert summary["train_flops"] != pytest.approx(summary["steps"] * planned, rel=1e-3)


def test_last_step_figures_come_from_the_budgets_last_step_under_gradient_accumulation(tmp_path, one_thread):
    """With accumulation the end is known only at a step's last micro-batch; the FLOPs and routing callbacks
    (which start measuring a step at its first micro-batch) must still measure that step."""
    budget = 3.5 * 2 * planned_step_flops("mod")
    run_dir = main(["--variant", "mod", "--max_steps", "40", "--max_train_flops", repr(budget), "--val_every", "40",
                    "--log_dir", str(tmp_path), "--trainer.accumulate_grad_batches", "2", *FAST])
    summary = _summary(run_dir)
    assert summary["stopped_by"] == "max_train_flops" and summary["steps"] == 4
    assert summary["flops_per_token"]["step"] == 4  # callbacks.flops_every is 50: measured as the last step


def test_resume_keeps_the_count_and_stops_at_the_same_step(tmp_path, one_thread):
    budget = 5.5 * planned_step_flops("mod")
    straight = _summary(_budget_run(tmp_path / "a", "mod", budget))
    first = _budget_run(tmp_path / "b", "mod", budget, max_steps=3)  # --max_steps caps, the budget's schedule stays
    assert _summary(first)["stopped_by"] == "max_steps" and _summary(first)["steps"] == 3
    resumed = _summary(_budget_run(tmp_path / "b", "mod", budget, "--ckpt_path", str(first / "checkpoints" / "last.ckpt")))
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["train_flops"] == pytest.approx(straight["train_flops"], rel=1e-12)
    curve = dict(_summary(first)["train_loss_curve"]) | dict(resumed["train_loss_curve"])
    for step, loss in straight["train_loss_curve"]:
        assert curve[step] == pytest.approx(loss, abs=1e-6), step  # same LR at every step: same trajectory
    again = _summary(_budget_run(tmp_path / "b", "mod", budget, "--ckpt_path", "last"))  # a finished run: no more steps
    assert again["steps"] == 6 and again["train_flops"] == resumed["train_flops"]


def test_a_run_without_budget_cannot_be_resumed_with_one_and_the_refusal_changes_nothing(tmp_path, one_thread, capsys,
                                                                                         monkeypatch):
    """Issue 30: the refusal came from on_load_checkpoint, after config.yaml had recorded the new budget and steps
    (compare then took the run as finished): it must come before anything is written, before the data too."""
    from datamodules import lm
    from experiments import run

    plain = main(["--max_steps", "2", "--val_every", "2", "--log_dir", str(tmp_path), *FAST])
    assert _summary(plain)["max_train_flops"] is None and _summary(plain)["train_flops"] is None
    before = file_states(tmp_path)
    monkeypatch.setattr(lm.LMDataModule, "__init__", lambda *a, **k: pytest.fail("the data module was built"))
    with pytest.raises(SystemExit) as exit_info:
        run.cli(main, ["--max_steps", "20", "--val_every", "2", "--log_dir", str(tmp_path), "--max_train_flops", "1e12",
                       *FAST, "--ckpt_path", str(plain / "checkpoints" / "last.ckpt")])
    assert exit_info.value.code == 2
    assert "error: max_train_flops: the checkpoint to resume was trained without" in capsys.readouterr().err
    assert file_states(tmp_path) == before  # config.yaml still records the run as it was trained
    with pytest.raises(ConfigError, match="max_train_flops: the checkpoint to resume was trained without"):
        main(["--max_steps", "4", "--log_dir", str(tmp_path), "--max_train_flops", "1e12", *FAST, "--ckpt_path", "last"])
    assert file_states(tmp_path) == before


def test_the_budget_sums_every_ranks_count(one_thread):
    """A fake two-rank reduction (the other rank's micro-batches cost differently): the budget counts both ranks,
    so it stops at the first step whose global count reaches it (counting this rank alone stops two steps later)."""
    from types import SimpleNamespace

    from lightning_modules.flops_budget import FlopsBudget

    other_rank = iter([6.0, 6.0, 6.0, 6.0, 6.0])
    reductions = []

    def reduce(tensor, reduce_op):
        assert reduce_op == "sum" and tensor.dtype == torch.float64
        reductions.append(float(tensor))
        return tensor + next(other_rank)

    trainer = SimpleNamespace(world_size=2, should_stop=False,
                              strategy=SimpleNamespace(reduce=reduce, root_device=torch.device("cpu")))
    counter, model, step = FlopsBudget(20.0), _Model([3.0] * 5), 0  # 3 here + 6 there = 9 per step: 9, 18, 27
    while not trainer.should_stop:
        step += 1
        counter.add(model, None, (1, 1))
        counter.close_step(trainer, step)
    assert reductions == [3.0, 3.0, 3.0] and counter.spent == 27.0 and counter.stop_step == 3


# ---------------------------------------------------------------------------- DDP
@pytest.mark.slow
def test_two_process_ddp_ranks_stop_together_on_the_global_count(tmp_path):
    budget = 4.5 * 2 * planned_step_flops("mom_e", ROUTED["mom_e"])  # two ranks' tokens per step
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--variant", "mom_e", "--max_steps", "40", "--val_every", "40",
         "--max_train_flops", repr(budget), "--log_dir", str(tmp_path), "--callbacks.flops_every", "1",
         "--trainer.log_every_n_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
         "--trainer.strategy", "ddp", *FAST, *ROUTED["mom_e"]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # a rank stopping alone would leave the other hanging
    run_dir = tmp_path / "mom_e-tiny" / "version_0"
    summary, counts = _check_stop(run_dir, budget, world=2)
    assert summary["world_size"] == 2 and math.isfinite(summary["train_flops"])
