"""``summary.json``'s ``val_history``: every validation's losses and probe accuracy per level, at the optimiser step
it ran after, whole after a resume, and the same as what TensorBoard holds (from which publish rebuilds it for runs
written before the recorder kept it)."""
from __future__ import annotations

import json
import os
import shutil

from callbacks.val_history import VAL_HISTORY, add_validation, event_files, history_from_events, off_grid
from datamodules import probe
from tests.conftest import TINY_RUN

TASK = "probe-v7/shift"


def _run(tmp_path, version, steps, *extra):
    from experiments.run import main

    return main(["--data", TASK, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                 str(tmp_path / "c"), "--val_every", "2", "--log_dir", str(tmp_path), "--version", version, *TINY_RUN,
                 "--model.block_size", "128", "--callbacks.probe_blocks", "16", "--callbacks.contribution", "false",
                 "--callbacks.throughput", "false", "--max_steps", str(steps), *extra])


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _steps(history):
    return [step for step, _ in history]


def test_a_resumed_run_keeps_every_validation_and_tensorboard_agrees(tmp_path, one_thread):
    whole = _run(tmp_path, "whole", 6)
    first = _run(tmp_path, "resumed", 4)
    assert _steps(_summary(first)["val_history"]) == [2, 4]
    resumed = _run(tmp_path, "resumed", 6, "--ckpt_path", str(first / "checkpoints" / "last.ckpt"))
    summary = _summary(resumed)
    history, expected = summary["val_history"], _summary(whole)["val_history"]
    assert _steps(history) == _steps(expected) == [2, 4, 6]
    for (_, got), (_, want) in zip(history, expected):  # a resume continues the same run
        assert set(got) == set(want) == {"val/loss", "probe/level0/acc", "probe/level1/acc"}
        assert got == want
    assert history[-1][1] == {k: v for k, v in summary["val_metrics"].items() if VAL_HISTORY.fullmatch(k)}
    assert len(event_files(resumed)) >= 3  # two processes (and the final validate's writer)
    assert history_from_events(resumed) == history  # the same float32 values, at the steps done


def test_validations_count_optimisation_steps_under_gradient_accumulation(tmp_path, one_thread):
    """--val_every counts optimisation steps: Lightning's val_check_interval counts batches, and with 2 batches
    per step a run validated every step."""
    run = _run(tmp_path, "acc", 4, "--trainer.accumulate_grad_batches", "2")
    history = _summary(run)["val_history"]
    assert _steps(history) == [2, 4]
    assert history_from_events(run) == history


def test_a_run_extended_past_an_off_grid_end_keeps_its_final_validation(tmp_path, one_thread):
    """last.ckpt of a run ending between validations is saved after its final validation, so extending the run
    keeps that validation, as TensorBoard does."""
    run = _run(tmp_path, "ext", 5)
    assert _steps(_summary(run)["val_history"]) == [2, 4, 5]
    extended = _run(tmp_path, "ext", 8, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    history = _summary(extended)["val_history"]
    assert _steps(history) == [2, 4, 5, 6, 8]
    assert history_from_events(extended) == history
    assert off_grid(history, 2, 8) == [5]  # the earlier end: publish would not rebuild such a run's history


def test_publish_rebuilds_only_what_the_events_can_vouch_for(tmp_path, one_thread):
    from experiments.repro.publish import rebuilt_history

    run = _run(tmp_path, "pub", 4)
    summary = _summary(run)
    history, note = rebuilt_history(summary, run)
    assert history == summary["val_history"] and note.startswith("rebuilt from the run's TensorBoard events")
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("val_every: 2", "val_every: 3"))
    history, note = rebuilt_history(summary, run)
    assert history is None and "steps [2] lie off the --val_every 3 grid" in note
    for path in event_files(run):
        path.unlink()
    assert rebuilt_history(summary, run) == (None, "not rebuilt: the run folder has no TensorBoard validation events")


def test_event_files_are_read_in_the_order_their_names_give_not_their_modification_times(tmp_path):
    names = ["events.out.tfevents.1796465144.host.a.b.20798.1", "events.out.tfevents.1796464634.vm.20798.0",
             "events.out.tfevents.1796464634.vm.20798.2"]
    for age, name in enumerate(names):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))  # a copy without -p: times that say nothing
    assert [p.name for p in event_files(tmp_path)] == [names[1], names[2], names[0]]
    shutil.rmtree(tmp_path)


def test_a_later_process_replaces_the_validations_its_checkpoint_did_not_keep():
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
