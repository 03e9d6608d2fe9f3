"""``summary.json``'s ``val_history``: every validation's losses and probe accuracy per level, at the optimiser step
it ran after, whole after a resume, and the same as what TensorBoard holds (from which publish rebuilds it for runs
written before the recorder kept it)."""
from __future__ import annotations

import json

import pytest

from callbacks.run_summary import VAL_HISTORY, add_validation, val_history_from_events
from datamodules import probe
from tests.conftest import TINY_RUN

TASK = "probe-v7/shift"


def _run(tmp_path, version, steps, *extra):
    from experiments.run import main

    return main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                 str(tmp_path / "c"), "--val_every", "2", "--log_dir", str(tmp_path), "--version", version, *TINY_RUN,
                 "--model.block_size", "128", "--callbacks.probe_blocks", "16", "--callbacks.contribution", "false",
                 "--callbacks.throughput", "false", "--max_steps", str(steps), *extra])


def _history(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["val_history"]


def test_a_resumed_run_keeps_every_validation_and_tensorboard_agrees(tmp_path, one_thread):
    whole = _run(tmp_path, "whole", 6)
    first = _run(tmp_path, "resumed", 4)
    assert [step for step, _ in _history(first)] == [2, 4]
    resumed = _run(tmp_path, "resumed", 6, "--ckpt_path", str(first / "checkpoints" / "last.ckpt"))
    history, expected = _history(resumed), _history(whole)
    assert [step for step, _ in history] == [step for step, _ in expected] == [2, 4, 6]
    for (_, got), (_, want) in zip(history, expected):  # a resume continues the same run
        assert set(got) == set(want) == {"val/loss", "probe/level0/acc", "probe/level1/acc"}
        assert got == pytest.approx(want, rel=1e-6)
    summary = json.loads((resumed / "summary.json").read_text())
    assert history[-1][1] == {k: v for k, v in summary["val_metrics"].items() if VAL_HISTORY.fullmatch(k)}
    rebuilt = val_history_from_events(resumed)  # two processes' event files: the resumed one's values win
    assert [step for step, _ in rebuilt] == [2, 4, 6]
    for (_, got), (_, want) in zip(rebuilt, history):
        assert got == pytest.approx(want, rel=1e-6)  # TensorBoard stores float32


def test_a_validation_at_a_step_already_recorded_replaces_it_and_history_stays_in_step_order():
    history = []
    add_validation(history, 2, {"val/loss": 3.0})
    add_validation(history, 4, {"val/loss": 2.0})
    add_validation(history, 4, {"val/loss": 1.5})  # the final validate after the last in-training one
    assert history == [[2, {"val/loss": 3.0}], [4, {"val/loss": 1.5}]]
    add_validation(history, 3, {"val/loss": 9.0})  # a process that resumed from step 2 and validated at 3
    assert history == [[2, {"val/loss": 3.0}], [3, {"val/loss": 9.0}]]


def test_the_recorded_names_are_the_losses_and_probe_accuracies_only():
    assert all(VAL_HISTORY.fullmatch(k) for k in ("val/loss", "val/loss_causal", "probe/level0/acc", "probe/level12/acc"))
    assert not any(VAL_HISTORY.fullmatch(k) for k in ("val/ppl", "probe/level1/loss", "train/loss", "probe/levelx/acc"))
