"""Fine-tuning runs stop on SIGTERM / SIGUSR1 with a checkpoint, and ``--ckpt_path last`` continues them: the
resumed run's weights equal the uninterrupted run's, bit for bit (experiments/finetune.py,
datamodules/epoch_order.py)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from datamodules.epoch_order import ResumableEpochSampler
from tests.test_cluster import SignalAtStep

pytestmark = pytest.mark.usefixtures("offline", "one_thread")  # fixtures in tests/conftest.py

TINY = ["--variant", "vanilla", "--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2",
        "--model.block_size", "32", "--trainer.enable_progress_bar", "false", "--tokenizer", "bytes",
        "--lr", "3e-3", "--save_checkpoint", "true", "--trainer.accelerator", "cpu"]


def write_sst2(root: pathlib.Path, name: str = "SST-2", rows: int = 10) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{'good fine' if i % 2 else 'bad poor'} {i}\t{i % 2}\n" for i in range(rows)]
    for split in ("train.tsv", "dev.tsv"):
        (folder / split).write_text("sentence\tlabel\n" + "".join(lines))


def write_rte(root: pathlib.Path, rows: int = 10) -> None:
    folder = root / "RTE"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{i}\tit is {i}\tit is {i + i % 2}\t{'entailment' if i % 2 == 0 else 'not_entailment'}\n"
             for i in range(rows)]
    for split in ("train.tsv", "dev.tsv"):
        (folder / split).write_text("index\tsentence1\tsentence2\tlabel\n" + "".join(lines))


@pytest.fixture
def glue(tmp_path):
    root = tmp_path / "glue_data"
    write_sst2(root)
    write_rte(root)
    return root


class CrashAt(L.Callback):
    """A kill (an exception) as training starts, or as the final evaluation starts."""

    def __init__(self, when: str):
        self.when = when

    def on_train_start(self, trainer, pl_module):
        if self.when == "train":
            raise RuntimeError("killed")

    def on_validation_start(self, trainer, pl_module):
        if self.when == "evaluation" and trainer.state.fn == "validate":
            raise RuntimeError("killed")


class CountSteps(L.Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1


@pytest.fixture
def with_callback(monkeypatch):
    """``with_callback(callback, task=None)``: the next fine-tuning trainers (of ``task`` only, if given) get it."""
    import experiments.finetune as finetune

    make_trainer = finetune.make_trainer

    def arm(callback, task=None):
        def with_it(*args, **kwargs):
            trainer = make_trainer(*args, **kwargs)
            if task is None or task == kwargs.get("task", args[5:6] and args[5]):
                trainer.callbacks.append(callback)
            return trainer

        monkeypatch.setattr(finetune, "make_trainer", with_it)

    yield arm
    monkeypatch.setattr(finetune, "make_trainer", make_trainer)


@pytest.fixture
def signal_at(with_callback):
    """``signal_at(step, signum, task=None)``: the next fine-tuning trainers (of ``task`` only, if given) signal
    their process after that step."""
    return lambda step, signum, task=None: with_callback(SignalAtStep(step, signum), task)


def stop(main, argv, signal_at, step: int, signum: int = signal.SIGTERM, task=None) -> int:
    """Run ``argv`` with ``signum`` sent after ``step`` (of ``task``'s training only, if given); the stop's exit
    status. The next runs are not signalled."""
    signal_at(step, signum, task)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    signal_at(10 ** 6, signum)
    return stopped.value.code


def trained_weights(folder: pathlib.Path) -> dict:
    (ckpt,) = (folder / "checkpoints").glob("epoch=*.ckpt")
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------- the order
def test_an_iterator_starts_at_the_step_it_is_made_at_whatever_epoch_lightning_counts():
    """Each iterator starts where the optimiser steps done put it: a resumed epoch deals exactly the batches the
    uninterrupted run had left, and set_epoch (late with workers, one too many after --max_steps resumes) is not
    read."""
    dataset = list(range(23))
    whole = ResumableEpochSampler(dataset, batch_size=4, seed=7)  # 6 batches per epoch, the last short
    epochs = []
    for e in range(3):
        whole.set_epoch(e)
        epochs.append(list(whole))
    step = [0]
    resumed = ResumableEpochSampler(dataset, batch_size=4, seed=7, steps_done=lambda: step[0])
    for step[0] in range(3 * 6):
        epoch, done = divmod(step[0], 6)
        resumed.set_epoch(epoch + 1)  # ignored
        assert list(resumed) == epochs[epoch][4 * done:], step[0]


def test_the_ranks_share_every_example_of_each_epoch_and_one_process_is_lightnings_ddp_order():
    dataset = list(range(11))
    ranks = [ResumableEpochSampler(dataset, batch_size=2, seed=3, rank=r, world_size=2) for r in range(2)]
    for sampler in ranks:
        sampler.set_epoch(1)
    assert set(list(ranks[0]) + list(ranks[1])) == set(dataset)
    assert len(list(ranks[0])) == len(list(ranks[1]))  # the same number of steps on every rank
    lightning_order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    lightning_order.set_epoch(2)
    one = ResumableEpochSampler(dataset, batch_size=2, seed=3)
    one.set_epoch(2)
    assert list(one) == list(lightning_order)
    assert list(one) != sorted(dataset)  # shuffled


# ---------------------------------------------------------------------------- stop and resume
# 3 steps per epoch. After step 4 (mid-epoch) the stop comes at the next step's end; after step 3 at the end of
# the epoch's validation, which follows it. --max_steps (max_epochs=-1: Lightning counts one epoch too many after an
# epoch-end resume) and a loader worker (its iterator takes the indices before set_epoch) must not change the order
@pytest.mark.parametrize("signum,step,stopped_at,extra,steps", [
    (signal.SIGTERM, 4, 5, [], 9), (signal.SIGUSR1, 3, 3, [], 9), (signal.SIGTERM, 3, 3, ["--max_steps", "8"], 8),
    (signal.SIGTERM, 4, 5, ["--data.num_workers", "1"], 9), (signal.SIGUSR1, 3, 3, ["--data.num_workers", "1"], 9)],
    ids=["sigterm-mid-epoch", "sigusr1-epoch-end", "max_steps-epoch-end", "worker-mid-epoch", "worker-epoch-end"])
def test_a_stopped_glue_run_resumes_to_the_uninterrupted_runs_weights(glue, tmp_path, signal_at, signum, step,
                                                                    stopped_at, extra, steps):
    from experiments.finetune import main

    argv = ["--task", "glue/sst2", "--data.path", str(glue), "--epochs", "3", "--batch_size", "4", *TINY, *extra]
    whole = main([*argv, "--log_dir", str(tmp_path / "whole")])
    runs = tmp_path / "stopped"
    before = signal.getsignal(signal.SIGUSR1)
    assert stop(main, [*argv, "--log_dir", str(runs)], signal_at, step, signum) == 128 + signum
    assert signal.getsignal(signal.SIGUSR1) == before
    folder = runs / "glue-sst2-vanilla" / "version_0"
    last = folder / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == stopped_at
    assert not (folder / "results.json").exists()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = main([*argv, "--log_dir", str(runs), "--ckpt_path", "last"])
    # Lightning's "your dataloader is not resumable" does not apply, nor its "exists and is not empty"
    assert not [str(w.message) for w in caught if "resum" in str(w.message) or "not empty" in str(w.message)]
    assert resumed == folder  # in its own folder
    assert not last.exists()  # nothing left to resume
    assert_same_weights(trained_weights(resumed), trained_weights(whole))
    ours, theirs = (json.loads((f / "results.json").read_text()) for f in (resumed, whole))
    assert ours["metrics"] == theirs["metrics"] and ours["steps"] == theirs["steps"] == steps


def test_a_stopped_glue_all_keeps_its_finished_tasks_and_resumes_the_interrupted_one(glue, tmp_path, signal_at,
                                                                                    monkeypatch):
    import experiments.finetune as finetune

    monkeypatch.setattr(finetune, "task_list", lambda task: ["glue/sst2", "glue/rte"])
    argv = ["--task", "glue/all", "--data.path", str(glue), "--epochs", "2", "--batch_size", "4", *TINY]
    whole = finetune.main([*argv, "--log_dir", str(tmp_path / "whole")])
    runs = tmp_path / "stopped"
    stop(finetune.main, [*argv, "--log_dir", str(runs)], signal_at, 4, task="glue/rte")  # after step 5, in epoch 2
    folder = runs / "glue-all-vanilla" / "version_0"
    (first,) = json.loads((folder / "glue_results.json").read_text())
    events = sorted((folder / "sst2").rglob("events.*"))

    assert finetune.main([*argv, "--log_dir", str(runs), "--ckpt_path", "last"]) == folder
    rows = json.loads((folder / "glue_results.json").read_text())
    assert rows[0] == first and sorted((folder / "sst2").rglob("events.*")) == events  # not trained again
    expected = json.loads((whole / "glue_results.json").read_text())
    assert [r["metrics"] for r in rows] == [r["metrics"] for r in expected]
    assert_same_weights(trained_weights(folder / "rte"), trained_weights(whole / "rte"))
    assert (folder / "glue_results.md").read_text() == (whole / "glue_results.md").read_text()


def test_a_glue_all_run_killed_between_two_tasks_resumes_at_the_next_task(glue, tmp_path, with_callback,
                                                                          monkeypatch):
    import experiments.finetune as finetune

    monkeypatch.setattr(finetune, "task_list", lambda task: ["glue/sst2", "glue/rte"])
    argv = ["--task", "glue/all", "--data.path", str(glue), "--epochs", "1", "--batch_size", "4", *TINY]
    whole = finetune.main([*argv, "--log_dir", str(tmp_path / "whole")])
    with_callback(CrashAt("train"), task="glue/rte")  # killed as the second task starts: no checkpoint
    with pytest.raises(RuntimeError, match="killed"):
        finetune.main([*argv, "--log_dir", str(tmp_path / "killed")])
    with_callback(L.Callback())
    resumed = finetune.main([*argv, "--log_dir", str(tmp_path / "killed"), "--ckpt_path", "last"])
    assert resumed == tmp_path / "killed" / "glue-all-vanilla" / "version_0"
    rows, expected = (json.loads((f / "glue_results.json").read_text()) for f in (resumed, whole))
    assert [r["metrics"] for r in rows] == [r["metrics"] for r in expected]
    assert_same_weights(trained_weights(resumed / "rte"), trained_weights(whole / "rte"))


class SignalInFinalEvaluation(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "validate" and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_in_a_tasks_final_evaluation_finishes_it_and_stops_glue_all_before_the_next(glue, tmp_path,
                                                                                           with_callback, monkeypatch):
    import experiments.finetune as finetune

    monkeypatch.setattr(finetune, "task_list", lambda task: ["glue/sst2", "glue/rte"])
    argv = ["--task", "glue/all", "--data.path", str(glue), "--epochs", "1", "--batch_size", "4", *TINY,
            "--log_dir", str(tmp_path)]
    with_callback(SignalInFinalEvaluation(), task="glue/sst2")
    with pytest.raises(SystemExit) as stopped:
        finetune.main(argv)
    assert stopped.value.code == 128 + signal.SIGTERM
    folder = tmp_path / "glue-all-vanilla" / "version_0"
    assert [r["task"] for r in json.loads((folder / "glue_results.json").read_text())] == ["glue/sst2"]
    assert not (folder / "rte").exists()  # stopped before the next task
    with_callback(L.Callback())
    assert finetune.main([*argv, "--ckpt_path", "last"]) == folder
    assert len(json.loads((folder / "glue_results.json").read_text())) == 2


def test_the_checkpoint_stays_until_the_results_are_written(glue, tmp_path, signal_at, with_callback):
    """A resumed run killed in its final evaluation can be resumed again (and then does not train again)."""
    from experiments.finetune import main

    argv = ["--task", "glue/sst2", "--data.path", str(glue), "--epochs", "2", "--batch_size", "4", *TINY,
            "--log_dir", str(tmp_path)]
    stop(main, argv, signal_at, 4)
    with_callback(CrashAt("evaluation"))
    with pytest.raises(RuntimeError, match="killed"):
        main([*argv, "--ckpt_path", "last"])
    folder = tmp_path / "glue-sst2-vanilla" / "version_0"
    assert (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "results.json").exists()
    counter = CountSteps()
    with_callback(counter)
    assert main([*argv, "--ckpt_path", "last"]) == folder
    assert counter.steps == 0  # the stop checkpoint was at the final step
    assert json.loads((folder / "results.json").read_text())["steps"] == 6
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["epoch=1-step=6.ckpt"]


def test_a_stopped_xsum_run_resumes_to_the_uninterrupted_runs_weights_and_summaries(tmp_path, signal_at):
    from experiments.finetune import main
    from tests.test_xsum import _row, write_xsum

    rows = [_row(i, f"Document {i} says {i % 3} things.", f"Says {i % 3}.") for i in range(10)]
    folder = write_xsum(tmp_path / "xsum", rows, rows[:3])
    argv = ["--task", "xsum", "--data.path", str(folder), "--epochs", "2", "--batch_size", "4", "--max_new_tokens",
            "4", *TINY, "--model.block_size", "64"]
    whole = main([*argv, "--log_dir", str(tmp_path / "whole")])
    stop(main, [*argv, "--log_dir", str(tmp_path / "stopped")], signal_at, 4)  # 3 steps per epoch: stops after 5
    resumed = main([*argv, "--log_dir", str(tmp_path / "stopped"), "--ckpt_path", "last"])
    assert_same_weights(trained_weights(resumed), trained_weights(whole))
    assert (resumed / "predictions.jsonl").read_text() == (whole / "predictions.jsonl").read_text()
    ours, theirs = (json.loads((f / "results.json").read_text()) for f in (resumed, whole))
    assert ours["rouge"] == theirs["rouge"] and ours["steps"] == theirs["steps"] == 6


# ---------------------------------------------------------------------------- refusals
def test_a_resume_with_other_training_settings_is_refused_in_one_line(glue, tmp_path, signal_at, capsys):
    from experiments.finetune import main
    from experiments.run import cli

    argv = ["--task", "glue/sst2", "--data.path", str(glue), "--epochs", "2", "--batch_size", "4", *TINY,
            "--log_dir", str(tmp_path)]
    stop(main, argv, signal_at, 2)
    capsys.readouterr()
    for change, named in [(["--lr", "1e-3"], "optim.lr"), (["--seed", "5"], "seed"),
                          (["--batch_size", "2"], "data.batch_size"), (["--trainer.precision", "bf16-mixed"], "precision"),
                          (["--data.max_eval_examples", "4"], "data.max_eval_examples")]:
        with pytest.raises(SystemExit) as refused:
            cli(main, [*argv, *change, "--ckpt_path", "last"])
        lines = capsys.readouterr().err.strip().splitlines()  # after the data's notes (the check needs the steps)
        assert refused.value.code == 2 and [line for line in lines if line.startswith("error:")] == lines[-1:], lines
        assert lines[-1].startswith("error: ckpt_path: ") and f" {named} (" in lines[-1]
    last = tmp_path / "glue-sst2-vanilla" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file()  # a refused resume leaves the run as it was
    blob = torch.load(last, map_location="cpu", weights_only=False)
    del blob["dyncomp_finetune"]["resume"]  # a checkpoint from before the record
    torch.save(blob, tmp_path / "old.ckpt")
    with pytest.raises(SystemExit):
        cli(main, [*argv, "--ckpt_path", str(tmp_path / "old.ckpt")])
    assert "records no fine-tuning settings to resume with" in capsys.readouterr().err


def test_the_same_data_folder_by_another_path_resumes(glue, tmp_path, signal_at, monkeypatch):
    from experiments.finetune import main

    argv = ["--task", "glue/sst2", "--epochs", "2", "--batch_size", "4", *TINY, "--log_dir", str(tmp_path / "runs")]
    stop(main, [*argv, "--data.path", str(glue)], signal_at, 4)
    monkeypatch.chdir(glue.parent)
    assert (main([*argv, "--data.path", glue.name, "--ckpt_path", "last"]) / "results.json").is_file()


TORCHRUN = {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
LAUNCHER_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "DYNCOMP_FINETUNE_VERSION",
                *TORCHRUN)


@pytest.mark.parametrize("env,version,expected", [
    ({}, None, None), ({}, "mine", "mine"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "2"}, None, "slurm-77"),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}, None, None),  # one process in an allocation of four tasks
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "job9"}, None, "torchrun-job9"),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}, None, "version: torchrun started the ranks"),
    ({"WORLD_SIZE": "2"}, None, None),  # what Lightning's own launcher leaves in the first process
    ({"DYNCOMP_FINETUNE_VERSION": "version_3", **TORCHRUN}, None, "version_3"),  # a rank Lightning started
], ids=["one-process", "named", "srun", "salloc", "torchrun", "torchrun-no-id", "lightning", "inherited"])
def test_ranks_the_launcher_started_share_one_run_folder(env, version, expected, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from architectures.config import ConfigError
    from model_tools.finetune_resume import run_version

    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = SimpleNamespace(version=version, ckpt_path=None)
    if expected and expected.startswith("version:"):
        with pytest.raises(ConfigError, match=expected):
            run_version(cfg, ["glue/sst2"], tmp_path)
    else:
        assert run_version(cfg, ["glue/sst2"], tmp_path) == expected


def test_a_named_folder_that_holds_a_run_is_refused_unless_resumed(tmp_path):
    from types import SimpleNamespace

    from architectures.config import ConfigError
    from model_tools.finetune_resume import run_version

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run; resume an interrupted one with --ckpt_path last"):
        run_version(SimpleNamespace(version="mine", ckpt_path=None), ["glue/sst2"], tmp_path)
    with pytest.raises(FileNotFoundError, match="no interrupted run under .*mine"):
        run_version(SimpleNamespace(version="mine", ckpt_path="last"), ["glue/sst2"], tmp_path)
    (tmp_path / "mine" / "results.json").unlink()
    (tmp_path / "mine" / "checkpoints").mkdir()
    (tmp_path / "mine" / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert run_version(SimpleNamespace(version="mine", ckpt_path="last"), ["glue/sst2"], tmp_path) == "mine"


def test_a_resubmitted_srun_job_resumes_the_run_of_the_job_before(tmp_path, monkeypatch):
    """Another job id (a resubmitted job, or torchrun's new run id): --ckpt_path last finds the interrupted run
    wherever it is under the task's folder, and a checkpoint named explicitly keeps its own folder."""
    import time
    from types import SimpleNamespace

    from model_tools.finetune_resume import run_version

    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    for name in ("version_9", "version_10", "slurm-77"):  # slurm-77 stopped last
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / "last.ckpt").write_bytes(b"")
        time.sleep(0.02)
    (tmp_path / "version_10" / "results.json").write_text("{}")  # finished: its leftover checkpoint does not count
    assert run_version(SimpleNamespace(version=None, ckpt_path="last"), ["glue/sst2"], tmp_path) == "slurm-77"
    explicit = str(tmp_path / "version_9" / "checkpoints" / "last.ckpt")
    assert run_version(SimpleNamespace(version=None, ckpt_path=explicit), ["glue/sst2"], tmp_path) == "version_9"
    assert run_version(SimpleNamespace(version=None, ckpt_path=None), ["glue/sst2"], tmp_path) == "slurm-78"


@pytest.mark.parametrize("extra,pattern", [
    ([], r"^error: --ckpt_path last: no interrupted run under .*; start without --ckpt_path"),
    (["--eval_only", "true", "--init_from", "x.ckpt"], r"^error: ckpt_path: resumes a preempted training run"),
])
def test_nothing_to_resume_is_one_line(glue, tmp_path, capsys, extra, pattern):
    import re

    from experiments.finetune import main
    from experiments.run import cli

    (tmp_path / "x.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit) as refused:
        cli(main, ["--task", "glue/sst2", "--data.path", str(glue), *TINY, "--log_dir", str(tmp_path / "runs"),
                   "--ckpt_path", "last", *[str(tmp_path / a) if a.endswith(".ckpt") else a for a in extra]])
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1 and re.match(pattern, err), err


# ---------------------------------------------------------------------------- under DDP
@pytest.mark.slow
def test_a_two_process_ddp_glue_run_stopped_by_sigusr1_resumes_to_the_uninterrupted_runs_weights(tmp_path):
    """gloo DDP, 2 processes (Lightning re-launches the command for rank 1): SIGUSR1 to rank 0 stops both ranks
    after the same step with one last.ckpt holding both ranks' generators, exit 138; the resumed run's weights (each
    rank's share of every epoch, dropout on) equal the uninterrupted run's."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    glue = tmp_path / "glue_data"
    write_sst2(glue, rows=1200)  # 150 steps per epoch with two ranks of 4: the signal lands inside the run
    command = [sys.executable, "-m", "experiments.finetune", "--task", "glue/sst2", "--data.path", str(glue),
               "--epochs", "2", "--batch_size", "4", *TINY, "--trainer.devices", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DYNCOMP_FINETUNE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    straight = subprocess.run([*command, "--log_dir", str(tmp_path / "a")], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    runs = tmp_path / "b"
    process = subprocess.Popen([*command, "--log_dir", str(runs)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    folder = runs / "glue-sst2-vanilla" / "version_0"
    deadline = time.time() + 300
    while not list((folder / "checkpoints").glob("epoch=0-*.ckpt")):  # the first epoch is over: both ranks train
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    blob = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert 150 <= blob["global_step"] < 300 and len(blob["rng_states"]) == 2
    resumed = subprocess.run([*command, "--log_dir", str(runs), "--ckpt_path", "last"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(trained_weights(folder), trained_weights(tmp_path / "a" / "glue-sst2-vanilla" / "version_0"))
