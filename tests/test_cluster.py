"""Cluster launching: the SLURM template and torchrun recipe, Lightning's SLURM environment as
``experiments.run`` builds it, preemption (SIGTERM / SIGUSR1 -> last.ckpt -> resume), and the sweep."""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
import types

import lightning as L
import pytest
import torch

from architectures.config import ConfigError
from callbacks.preemption import PreemptionCheckpoint
from experiments import sweep
from tests.conftest import REPO, TINY_RUN, recorder_state

SBATCH = REPO / "experiments" / "slurm" / "train.sbatch"
TORCHRUN = REPO / "experiments" / "slurm" / "torchrun.sh"


def fake_command(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A stand-in for srun / torchrun on PATH that writes its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > "{tmp_path}/{name}.args"\n')
    script.chmod(0o755)
    return bin_dir


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUN_ID", "NNODES", "NODE_RANK"))}
    env.update(extra)
    return env


# ---------------------------------------------------------------------------- templates
@pytest.mark.parametrize("script", [SBATCH, TORCHRUN], ids=["sbatch", "torchrun"])
def test_scripts_are_valid_bash(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_template_requests_requeue_signal_and_runs_srun():
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=SIGUSR1@90" in directives
    assert "#SBATCH --requeue" in directives
    assert any(line.startswith("#SBATCH --nodes=") for line in directives)
    assert any(line.startswith("#SBATCH --ntasks-per-node=") for line in directives)
    text = SBATCH.read_text()
    assert "srun --kill-on-bad-exit=1 python -m experiments.run" in text
    # the token cache is built before training, by its own step: not behind the ranks' 30-minute barrier
    assert 'python -m experiments.prepare "$@"' in text
    assert text.index('python -m experiments.prepare "$@"') < text.index("srun --kill-on-bad-exit=1 python -m experiments.run")


def test_sbatch_template_matches_trainer_to_allocation_and_resumes_newest_checkpoint(tmp_path):
    bin_dir = fake_command(tmp_path, "srun")
    log_dir = tmp_path / "logs"
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                    SLURM_NTASKS_PER_NODE="4(x2)", SLURM_SUBMIT_DIR=str(REPO))
    run = lambda: subprocess.run(["bash", str(SBATCH), "--variant", "mod", "--log_dir", str(log_dir)],  # noqa: E731
                                 env=env, capture_output=True, text=True)
    result = run()
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:3] == ["--kill-on-bad-exit=1", "python", "-m"] and args[3] == "experiments.run"
    joined = " ".join(args)
    assert "--trainer.num_nodes 2 --trainer.devices 4 --variant mod" in joined
    assert joined.endswith("--version slurm-4242")  # fresh job: nothing to resume
    # requeued: Lightning's hpc checkpoint (SIGUSR1) and our newer last.ckpt (the SIGTERM that followed)
    run_dir = log_dir / "mod-tiny" / "slurm-4242"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "hpc_ckpt_1.ckpt").write_bytes(b"")
    time.sleep(0.05)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert run().returncode == 0
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[-4:] == ["--version", "slurm-4242", "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")]
    time.sleep(0.05)
    (run_dir / "hpc_ckpt_2.ckpt").write_bytes(b"")  # newer than last.ckpt: that one wins
    assert run().returncode == 0
    assert (tmp_path / "srun.args").read_text().splitlines()[-1] == str(run_dir / "hpc_ckpt_2.ckpt")


@pytest.mark.parametrize("option", [["--trainer.devices", "2"], ["--trainer.num_nodes=1"]])
def test_sbatch_template_refuses_a_trainer_that_contradicts_the_allocation(tmp_path, option):
    bin_dir = fake_command(tmp_path, "srun")
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="2",
                    SLURM_NTASKS_PER_NODE="4", SLURM_SUBMIT_DIR=str(REPO))
    result = subprocess.run(["bash", str(SBATCH), "--variant", "mod", *option], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "does not match the allocation" in result.stderr
    assert not (tmp_path / "srun.args").exists()  # nothing was started


def test_torchrun_recipe_passes_geometry_and_needs_a_shared_run_id_across_nodes(tmp_path):
    bin_dir = fake_command(tmp_path, "torchrun")
    fake_command(tmp_path, "python")  # the prepare step before torchrun
    base = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", NPROC_PER_NODE="3")
    missing = subprocess.run(["bash", str(TORCHRUN), "--variant", "mod"], env={**base, "NNODES": "2"},
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "RUN_ID" in missing.stderr
    ok = subprocess.run(["bash", str(TORCHRUN), "--variant", "mod"],
                        env={**base, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "RUN_ID": "r1"},
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    joined = " ".join((tmp_path / "torchrun.args").read_text().splitlines())
    assert "--nnodes 2 --nproc_per_node 3 --node_rank 1 --master_addr node0" in joined
    assert "-m experiments.run --trainer.num_nodes 2 --trainer.devices 3 --variant mod --version r1" in joined
    assert (tmp_path / "python.args").read_text().splitlines() == ["-m", "experiments.prepare", "--variant", "mod"]


# ---------------------------------------------------------------------------- Lightning under SLURM
SLURM_ENV = {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
             "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "node[01-02]", "SLURM_JOB_NAME": "dyncomp"}


def test_lightning_selects_slurm_environment_with_the_tasks_ranks(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    # A Trainer sets the process-global rank_zero_only.rank (here to 6); put it back afterwards, or every
    # later run in this pytest process would think it is not rank 0 and write no logs or files.
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))

    from callbacks.run_summary import StepRecorder
    from experiments.run import build_parser, expand_aliases, make_trainer, run_version

    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "DYNCOMP_RUN_VERSION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    argv = ["--log_dir", str(tmp_path), *TINY_RUN, "--trainer.accelerator", "cpu", "--trainer.devices", "4",
            "--trainer.num_nodes", "2", "--trainer.strategy", "ddp"]
    cfg = build_parser().parse_args(expand_aliases(argv))
    root = tmp_path / "vanilla-tiny"
    version = run_version(cfg, root)
    assert version == "slurm-4242"  # every task, and the requeued job, use the same run folder
    trainer, _ = make_trainer(cfg, root, version, extra_callbacks=[StepRecorder()])
    environment = trainer.strategy.cluster_environment
    # ranks from SLURM; the requeue is PreemptionCheckpoint's (after a consistent checkpoint), not Lightning's
    assert isinstance(environment, SLURMEnvironment) and not environment.auto_requeue
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (6, 2, 1, 8)
    assert trainer.num_nodes == 2 and trainer.num_devices == 4
    assert pathlib.Path(trainer.default_root_dir) == root / version  # hpc_ckpt_N lands in the run folder
    assert [c.requeue_job for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)] == ["4242"]



def test_torchrun_inside_a_slurm_job_keeps_torchruns_ranks(tmp_path, monkeypatch):
    """``srun --ntasks-per-node=1 torchrun.sh``: SLURM's variables (one task) and torchrun's (its workers are the
    ranks). Lightning picks TorchElasticEnvironment first; no SLURM environment may be forced on it (every worker
    would be rank 0 of 1), and no requeue is set up."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    from callbacks.run_summary import StepRecorder
    from experiments.run import build_parser, expand_aliases, make_trainer

    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_JOB_ID": "99",
                       "SLURM_NODELIST": "node01", "SLURM_JOB_NAME": "dyncomp", "TORCHELASTIC_RUN_ID": "r1",
                       "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    argv = ["--log_dir", str(tmp_path), *TINY_RUN, "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.strategy", "ddp"]
    cfg = build_parser().parse_args(expand_aliases(argv))
    trainer, _ = make_trainer(cfg, tmp_path / "vanilla-tiny", "r1", extra_callbacks=[StepRecorder()])
    assert isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
    assert (trainer.global_rank, trainer.world_size) == (1, 2)
    assert [c.requeue_job for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)] == [None]

# ---------------------------------------------------------------------------- preemption
def _ckpt_step(path: pathlib.Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.slow
def test_sigterm_saves_last_checkpoint_and_the_same_command_resumes_to_max_steps(tmp_path):
    command = [sys.executable, "-m", "experiments.run", "--max_steps", "60", "--val_every", "5",
               "--log_dir", str(tmp_path), *TINY_RUN]
    env = clean_env(OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned = time.time()  # the process exists by now
    last = tmp_path / "vanilla-tiny" / "version_0" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while not last.is_file():  # the first periodic checkpoint (step 5): training is under way
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.2)
    periodic = _ckpt_step(last)
    # file times come from the kernel's coarse clock (a few ms behind time.time()): a file touched now dates the
    # signal on the same clock as the checkpoint's mtime
    marker = tmp_path / "signalled"
    marker.touch()
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert "preemption: saved" in stderr, stderr
    assert process.returncode == 128 + signal.SIGTERM  # 143, not 0: the run did not finish
    step = _ckpt_step(last)
    assert last.stat().st_mtime_ns >= marker.stat().st_mtime_ns and periodic <= step < 60
    assert not (last.parent.parent / "summary.json").exists()  # the interrupted run did not finish
    before = recorder_state(torch.load(last, weights_only=False))["run_seconds"]
    resumed = subprocess.run([*command, "--ckpt_path", "last"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((pathlib.Path(resumed.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    assert summary["steps"] == 60
    assert summary["train_started_at_steps"] == [0, step]  # continued from the saved step, not from scratch
    assert [s for s, _ in summary["train_loss_curve"]] == list(range(1, 61))  # the whole run's curve
    assert summary["tokens_seen"] == 60 * 4 * 64
    # the wall time holds the preempted process's, to its preemption checkpoint (saved after the signal), and the
    # resumed one's (seconds_to_first_step: the resumed process's own, not carried)
    assert before >= signalled - spawned - 0.02 and summary["run_seconds_complete"] is True  # /proc ticks: 10 ms
    assert summary["run_seconds"] >= before + summary["seconds_to_first_step"]


def test_preemption_callback_leaves_sigusr1_to_lightning_when_it_handles_it():
    lightning_handler = lambda signum, frame: None  # noqa: E731  (what SLURM auto-requeue installs)
    previous = signal.signal(signal.SIGUSR1, lightning_handler)
    one_process = types.SimpleNamespace(world_size=1)
    try:
        callback = PreemptionCheckpoint("unused")
        callback.on_train_start(one_process, None)
        assert signal.getsignal(signal.SIGUSR1) is lightning_handler
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # outside SLURM nobody handles it: the callback does
        callback.on_train_start(one_process, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert callback.requested == signal.SIGUSR1
        callback.teardown(None, None, "fit")
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and callback.requested is None
    finally:
        signal.signal(signal.SIGUSR1, previous)



def _lightning_signals(world_size: int):
    """A trainer stand-in with Lightning's real signal connector (what ``fit`` / ``validate`` register)."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    trainer = types.SimpleNamespace(world_size=world_size, local_rank=0, _accelerator_connector=types.SimpleNamespace(
        cluster_environment=None), strategy=types.SimpleNamespace(launcher=None, root_device=torch.device("cpu")))
    trainer._signal_connector = _SignalConnector(trainer)
    return trainer


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("ending", ["normal", "exception"])
def test_sigterm_only_raises_the_flag_and_the_handler_from_before_the_run_is_back_after_it(ending, world_size):
    """Lightning's SIGTERM handler makes a collective inside the handler under DDP (a hang), and in one process
    stops the run after any micro-batch (inside a gradient-accumulation step); the callback's handler takes its
    place for the run (from the sanity check on): it raises the flag, calls what ran before Lightning's, and not
    Lightning's. Afterwards the handler from before the run is back, never Lightning's, in Lightning's order of
    teardowns on either ending (a normal end: Lightning's first; an exception: the callback's first)."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("before"))
    original = signal.getsignal(signal.SIGTERM)
    try:
        trainer = _lightning_signals(world_size=world_size)
        connector = trainer._signal_connector
        connector.register_signal_handlers()
        callback = PreemptionCheckpoint("unused")
        callback.on_sanity_check_start(trainer, None)
        callback.on_train_start(trainer, None)  # again: idempotent
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.requested == signal.SIGTERM and calls == ["before"] and not connector.received_sigterm
        if ending == "normal":
            connector.teardown()
            callback.teardown(trainer, None, "fit")
        else:
            callback.on_exception(trainer, None, ValueError("not a stop"))
            assert signal.getsignal(signal.SIGTERM) is original  # not Lightning's, which broadcasts in the handler
            connector.teardown()
        assert signal.getsignal(signal.SIGTERM) is original
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_flag_lightnings_handler_raised_before_the_callback_took_sigterm_goes_to_the_vote():
    before = signal.getsignal(signal.SIGTERM)
    try:
        ddp = _lightning_signals(world_size=2)  # a SIGTERM on this rank before the callback took the signal
        ddp._signal_connector.register_signal_handlers()
        ddp._signal_connector.received_sigterm = True
        callback = PreemptionCheckpoint("unused")
        callback.on_train_start(ddp, None)
        assert callback.requested == signal.SIGTERM and not ddp._signal_connector.received_sigterm
        ddp._signal_connector.teardown()
        callback.teardown(ddp, None, "fit")
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_sigterm_before_the_run_starts_makes_no_collective_in_the_handler_and_goes_to_the_vote(stage, monkeypatch):
    """Lightning registers its SIGTERM handler after the setup hooks and before the sanity check, the first step
    or the final validation's start (its data loaders are built in between); its notifier broadcasts rank 0's
    flag inside the handler under DDP, a hang where the other ranks are elsewhere. After the callback's setup hook
    a SIGTERM in that window raises the callback's flag and makes no collective."""
    import torch.distributed as dist

    collectives = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: collectives.append("broadcast"))
    before = signal.getsignal(signal.SIGTERM)
    ddp = _lightning_signals(world_size=2)
    callback = PreemptionCheckpoint("unused")
    try:
        callback.setup(ddp, None, stage)
        ddp._signal_connector.register_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        assert collectives == [] and callback.requested == signal.SIGTERM
        callback.on_train_start(ddp, None) if stage == "fit" else callback.on_validation_start(
            types.SimpleNamespace(**vars(ddp), state=types.SimpleNamespace(fn="validate")), None)
        assert callback.requested == signal.SIGTERM  # taking SIGTERM over keeps the flag for the vote
    finally:
        ddp._signal_connector.teardown()
        callback.teardown(ddp, None, stage)
        signal.signal(signal.SIGTERM, before)


def test_sigusr1_is_sticky_so_a_later_sigterm_still_requeues():
    callback = PreemptionCheckpoint("unused", requeue_job="4242")
    callback._request(signal.SIGUSR1, None)
    callback._request(signal.SIGTERM, None)
    assert callback.requested == signal.SIGTERM and callback.usr1


class SignalAtStep(L.Callback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class SignalDuringValidation(L.Callback):
    """Sends ``signum`` to this process as the first batch of the validation after step ``step`` starts."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "fit" and trainer.global_step == self.step and batch_idx == 0:
            os.kill(os.getpid(), self.signum)


def test_sigusr1_outside_slurm_saves_last_checkpoint_and_resume_reaches_max_steps(tmp_path, monkeypatch):
    import experiments.run as run

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [SignalAtStep(3, signal.SIGUSR1)])
    argv = ["--max_steps", "8", "--val_every", "100", "--log_dir", str(tmp_path), *TINY_RUN]
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as stopped:
        run.main(argv)
    assert stopped.value.code == 128 + signal.SIGUSR1  # documented non-zero status: `train && evaluate` stops
    assert signal.getsignal(signal.SIGUSR1) == before  # the handler is restored after the run
    last = tmp_path / "vanilla-tiny" / "version_0" / "checkpoints" / "last.ckpt"
    stopped_at = _ckpt_step(last)
    assert stopped_at == 4  # the signal lands in step 3's end, after the callback's turn: it stops after step 4
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [])
    summary = json.loads((run.main([*argv, "--ckpt_path", "last"]) / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["train_started_at_steps"] == [0, stopped_at]
    assert summary["run_dir"] == str(last.parent.parent)  # resumed in the same run folder



SLURM_ONE_TASK = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                  "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "node01", "SLURM_JOB_NAME": "dyncomp"}


def test_sigusr1_under_slurm_stops_after_the_step_saves_last_ckpt_then_requeues(tmp_path, monkeypatch):
    """SLURM's time-limit warning (SIGUSR1) under SLURM: not Lightning's handler (a checkpoint saved inside the
    signal handler, mid-step, with collectives that can hang DDP, and training going on until SLURM's SIGTERM)
    but ours: the run stops after the step, writes last.ckpt, and only then requeues the job; no hpc_ckpt."""
    import experiments.run as run

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_ONE_TASK.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{fake_command(tmp_path, 'scontrol')}:{os.environ['PATH']}")
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [SignalAtStep(3, signal.SIGUSR1)])
    argv = ["--max_steps", "8", "--val_every", "100", "--log_dir", str(tmp_path / "runs"), *TINY_RUN]
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as stopped:
        run.main(argv)
    assert stopped.value.code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before
    run_dir = tmp_path / "runs" / "vanilla-tiny" / "version_0"
    assert _ckpt_step(run_dir / "checkpoints" / "last.ckpt") == 4  # a whole step's checkpoint
    assert not list(run_dir.rglob("hpc_ckpt_*"))
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]


@pytest.mark.parametrize("env,job", [({}, None), (SLURM_ONE_TASK, "4242"),
                                     ({**SLURM_ONE_TASK, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}, "77_3"),
                                     ({**SLURM_ONE_TASK, "SLURM_JOB_NAME": "interactive"}, None),
                                     ({**SLURM_ONE_TASK, "TORCHELASTIC_RUN_ID": "r1"}, None)],
                         ids=["no-slurm", "job", "array-task", "interactive", "torchrun-in-slurm"])
def test_the_job_a_sigusr1_stop_requeues(env, job, monkeypatch):
    from callbacks.preemption import slurm_requeue_job

    for key in [*SLURM_ENV, "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert slurm_requeue_job() == job


class SignalAtMicroBatch(L.Callback):
    def __init__(self, batch_idx: int, signum: int):
        self.batch_idx, self.signum = batch_idx, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            os.kill(os.getpid(), self.signum)


def test_sigterm_in_the_middle_of_a_gradient_accumulation_step_stops_after_the_whole_step(tmp_path, monkeypatch):
    """Two micro-batches per step; SIGTERM after the first micro-batch of step 3. Lightning's own handler stopped the
    run there, half a step in, and the resume lost that micro-batch's gradients; now the step is finished, the
    checkpoint holds whole steps only, and the resumed run's losses are the uninterrupted run's."""
    import experiments.run as run

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    argv = ["--max_steps", "6", "--val_every", "100", "--trainer.accumulate_grad_batches", "2", *TINY_RUN]
    straight = json.loads((run.main([*argv, "--log_dir", str(tmp_path / "a")]) / "summary.json").read_text())
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [SignalAtMicroBatch(4, signal.SIGTERM)])
    with pytest.raises(SystemExit) as stopped:
        run.main([*argv, "--log_dir", str(tmp_path / "b")])
    assert stopped.value.code == 128 + signal.SIGTERM
    last = tmp_path / "b" / "vanilla-tiny" / "version_0" / "checkpoints" / "last.ckpt"
    blob = torch.load(last, map_location="cpu", weights_only=False)
    assert blob["global_step"] == 3
    assert blob["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 6  # whole steps
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [])
    resumed = json.loads((run.main([*argv, "--log_dir", str(tmp_path / "b"), "--ckpt_path", "last"])
                          / "summary.json").read_text())
    assert resumed["train_started_at_steps"] == [0, 3]
    assert resumed["train_loss_curve"] == straight["train_loss_curve"]

def test_sigusr1_is_never_left_to_its_default_action_from_training_to_the_summary(tmp_path, monkeypatch):
    """Once training is over nothing handles SIGUSR1, and its default action kills: SLURM's time-limit warning then
    would cost the finished run its final validation and summary. The callback handles it during training; from
    the moment fit's teardown gives it back (no window in between: the noting handler is what it gives back) to
    the summary it is noted, one that comes then lets the run finish, and the default is back afterwards."""
    import callbacks.preemption as preemption
    import experiments.run as run

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    seen = {}
    real = run.write_run_summary, preemption.PreemptionCheckpoint.teardown, \
        preemption.PreemptionCheckpoint.on_train_batch_end

    def write_run_summary(trainer, *args):
        seen["at_summary"] = signal.getsignal(signal.SIGUSR1)
        if seen["at_summary"] == preemption._note_usr1:  # never to the default action: it would kill the test
            os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning as the summary is written
        return real[0](trainer, *args)

    def teardown(self, trainer, pl_module, stage):
        real[1](self, trainer, pl_module, stage)
        seen.setdefault("after_teardown", []).append(signal.getsignal(signal.SIGUSR1))

    def on_train_batch_end(self, *args):
        seen["training"] = signal.getsignal(signal.SIGUSR1)
        return real[2](self, *args)

    monkeypatch.setattr(run, "write_run_summary", write_run_summary)
    monkeypatch.setattr(preemption.PreemptionCheckpoint, "teardown", teardown)
    monkeypatch.setattr(preemption.PreemptionCheckpoint, "on_train_batch_end", on_train_batch_end)
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        run_dir = run.main(["--max_steps", "2", "--val_every", "2", "--log_dir", str(tmp_path), *TINY_RUN])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and preemption._usr1_noted is None
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert getattr(seen["training"], "__func__", None) is preemption.PreemptionCheckpoint._request  # a stop
    assert seen["after_teardown"] == [preemption._note_usr1] * 2  # after fit, and after the final validation
    assert seen["at_summary"] == preemption._note_usr1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2  # the run finished all the same


class SignalAtSetup(L.Callback):
    unprotected = False  # the default action was in place: the signal would have killed the run (and the test)

    def setup(self, trainer, pl_module, stage):
        if stage == "fit":
            self.unprotected = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
            if not self.unprotected:
                os.kill(os.getpid(), signal.SIGUSR1)


def test_a_sigusr1_before_the_callback_takes_it_stops_the_run_at_its_first_step_with_a_checkpoint(tmp_path,
                                                                                              monkeypatch):
    """SLURM's time-limit warning while the run sets up (data, model, loaders) used to meet the default action and
    kill it without a checkpoint; it is noted and the callback stops the run at its first step, as for one later."""
    import experiments.run as run

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    signaller = SignalAtSetup()
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [signaller])
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as stopped:
            run.main(["--max_steps", "4", "--val_every", "100", "--log_dir", str(tmp_path), *TINY_RUN])
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert not signaller.unprotected
    assert stopped.value.code == 128 + signal.SIGUSR1
    last = tmp_path / "vanilla-tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 1


TB_ARGV = ["--max_steps", "8", "--val_every", "4", "--trainer.log_every_n_steps", "1", *TINY_RUN]


def _train_losses(run_dir: pathlib.Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(train/loss per TensorBoard step, val_history) of the run without a preemption."""
    import experiments.run as run

    run_dir = run.main([*TB_ARGV, "--log_dir", str(tmp_path_factory.mktemp("straight"))])
    return _train_losses(run_dir), json.loads((run_dir / "summary.json").read_text())["val_history"]


class SignalDuringSave:
    """Sends ``signum`` to this process while the checkpoint of step ``step`` is being written."""

    def __init__(self, real_save, step: int, signum: int):
        self.real_save, self.step, self.signum, self.sent = real_save, step, signum, False

    def __call__(self, obj, path, *args, **kwargs):
        if not self.sent and isinstance(obj, dict) and obj.get("global_step") == self.step:
            self.sent = True
            os.kill(os.getpid(), self.signum)
        return self.real_save(obj, path, *args, **kwargs)


@pytest.mark.parametrize("how", ["sigterm-during-a-checkpoint-write", "sigusr1-after-a-step",
                                 "sigterm-during-a-validation"])
def test_tensorboard_after_preemption_and_resume_holds_the_uninterrupted_runs_losses(how, tmp_path, monkeypatch,
                                                                                    uninterrupted):
    """Issue 30: after SIGTERM during a checkpoint write and a resume, train/loss sat one step late (Lightning's
    resume guess added one to its logging step); after SIGUSR1 the stopping step's scalars never reached
    TensorBoard (the callback raised before Lightning logged them). Every step once, at its own x, same value.
    The stop at step 4 falls on a validation step: that validation ran (the SIGUSR1 stop used to cut it after its
    first batch, and the resumed run never redid it), so val_history is the uninterrupted run's. (Since the
    callback took SIGTERM from Lightning, a SIGTERM during a checkpoint write stops the run a step later, whole.)"""
    uninterrupted_losses, uninterrupted_history = uninterrupted
    import experiments.run as run
    from lightning_modules import storage

    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    if how == "sigterm-during-a-checkpoint-write":
        monkeypatch.setattr(storage, "atomic_torch_save", SignalDuringSave(storage.atomic_torch_save, 4, signal.SIGTERM))
    elif how == "sigterm-during-a-validation":
        monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [SignalDuringValidation(4, signal.SIGTERM)])
    else:
        monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [SignalAtStep(3, signal.SIGUSR1)])
    argv = [*TB_ARGV, "--log_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as stopped:
        run.main(argv)
    assert stopped.value.code == 128 + (signal.SIGTERM if how.startswith("sigterm") else signal.SIGUSR1)
    run_dir = tmp_path / "vanilla-tiny" / "version_0"
    stopped_at = _ckpt_step(run_dir / "checkpoints" / "last.ckpt")
    # the handler only raises a flag; Lightning runs the checkpoint callbacks last, so a signal during the
    # validation's checkpoint write is seen at the next step's end
    assert stopped_at == (5 if how == "sigterm-during-a-checkpoint-write" else 4)
    assert _train_losses(run_dir) == {x: v for x, v in uninterrupted_losses.items() if x < stopped_at}
    monkeypatch.undo()
    for key in SLURM_ENV:
        monkeypatch.delenv(key, raising=False)
    run.main([*argv, "--ckpt_path", "last"])
    assert _train_losses(run_dir) == uninterrupted_losses and sorted(uninterrupted_losses) == list(range(8))
    history = json.loads((run_dir / "summary.json").read_text())["val_history"]
    assert [step for step, _ in history] == [4, 8] and history == uninterrupted_history


@pytest.mark.slow
def test_preemption_under_two_process_ddp_leaves_one_last_ckpt_and_resumes_bit_exact(tmp_path):
    """gloo DDP with 2 processes (Lightning starts rank 1 as a fresh process, no fork): SIGUSR1 to rank 0
    stops both ranks after the same step, exits 138, writes one consistent last.ckpt, and the resumed
    run's losses equal an uninterrupted run's bit for bit. Dropout makes every rank draw random numbers: each
    rank's generator is in the checkpoint and set again on its own rank."""
    base = [sys.executable, "-m", "experiments.run", "--max_steps", "30", "--val_every", "2", *TINY_RUN,
            "--model.dropout", "0.1",
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    env = clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    straight = subprocess.run([*base, "--log_dir", str(tmp_path / "a")], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    straight_summary = json.loads((tmp_path / "a" / "vanilla-tiny" / "version_0" / "summary.json").read_text())
    expected = dict(straight_summary["train_loss_curve"])
    command = [*base, "--log_dir", str(tmp_path / "b")]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "b" / "vanilla-tiny" / "version_0" / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints / "last.ckpt").is_file():  # the first periodic checkpoint: both ranks are training
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert "preemption: saved" in stderr and "Traceback" not in stderr, stderr[-3000:]
    blob = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=False)
    step = int(blob["global_step"])
    assert 2 <= step < 30
    assert blob["LMDataModule"]["samples_consumed"] == step * 4  # per rank: consistent with the step
    assert sorted(p.name for p in checkpoints.iterdir() if "last" in p.name) == ["last.ckpt"]  # one, no temp copies
    resumed = subprocess.run([*command, "--ckpt_path", "last"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((checkpoints.parent / "summary.json").read_text())
    curve = dict(summary["train_loss_curve"])
    # the summary keeps the whole run's curve across the resume (the recorder's state is in the checkpoint)
    assert sorted(curve) == list(range(1, 31)) and summary["world_size"] == 2
    assert summary["train_started_at_steps"] == [0, step]
    for s in curve:
        assert curve[s] == expected[s], (s, curve[s], expected[s])  # bit-exact, before and after the resume
    # every validation of the whole run (rank 0 writes them; the metrics are synced over the ranks) is in
    # val_history once, equal to the uninterrupted run's and to what TensorBoard holds
    from callbacks.val_history import history_from_events

    history = summary["val_history"]
    assert [s for s, _ in history] == list(range(2, 31, 2))
    assert history == straight_summary["val_history"] and history_from_events(checkpoints.parent) == history



@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["sigusr1", "sigterm"])
def test_a_signal_to_every_srun_task_stops_both_ranks_after_one_step(signum, tmp_path):
    """Two tasks as srun starts them (SLURM_PROCID 0/1, gloo DDP, no launcher), and a signal to both at once, as
    ``--signal=SIGUSR1@90`` (time limit) or a preemption / ``scancel`` (SIGTERM) sends it. Lightning's handlers made
    collectives inside the handler, wherever each rank's step was: SIGUSR1's auto-requeue saved a checkpoint there,
    SIGTERM's broadcast rank 0's flag there (this test hung in 2 of 7 tries). Now both ranks stop after the same
    whole step, exit 128 + the signal, leave one last.ckpt and no hpc_ckpt, rank 0 requeues the job once (SIGUSR1
    only), and the requeued job's tasks resume it to the end."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    job = "31337"
    argv = [sys.executable, "-m", "experiments.run", "--max_steps", "40", "--val_every", "2", *TINY_RUN,
            "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--log_dir", str(tmp_path / "runs")]
    env = clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_PORT=port, SLURM_JOB_ID=job,
                    SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                    SLURM_JOB_NAME="dyncomp", PATH=f"{fake_command(tmp_path, 'scontrol')}:{os.environ['PATH']}")
    env.pop("DYNCOMP_RUN_VERSION", None)

    def srun(*extra):
        return [subprocess.Popen([*argv, *extra], cwd=REPO, env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]

    run_dir = tmp_path / "runs" / "vanilla-tiny" / f"slurm-{job}"
    tasks = srun()
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "last.ckpt").is_file():  # the first periodic checkpoint
            assert all(t.poll() is None for t in tasks) and time.time() < deadline, tasks[0].communicate()
            time.sleep(0.1)
        for t in tasks:
            t.send_signal(signum)
        outputs = [t.communicate(timeout=180) for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    assert [t.returncode for t in tasks] == [128 + signum] * 2, [err[-3000:] for _, err in outputs]
    step = _ckpt_step(run_dir / "checkpoints" / "last.ckpt")
    assert 2 <= step < 40
    assert not list(run_dir.rglob("hpc_ckpt_*"))
    requeued = (tmp_path / "scontrol.args").read_text().split() if (tmp_path / "scontrol.args").exists() else []
    assert requeued == (["requeue", job] if signum == signal.SIGUSR1 else [])  # rank 0 only, once
    requeued = srun("--version", f"slurm-{job}", "--ckpt_path", "last")
    outputs = [t.communicate(timeout=300) for t in requeued]
    assert [t.returncode for t in requeued] == [0, 0], [err[-3000:] for _, err in outputs]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["train_started_at_steps"] == [0, step] and summary["world_size"] == 2


SIGTERM_ON_RANK_1_DURING_A_VALIDATION = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import lightning as L
import experiments.run as run


class SigtermDuringValidation(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "fit" and trainer.global_rank == 1 and trainer.global_step == 4 and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


run.extra_run_callbacks = lambda cfg: [SigtermDuringValidation()]
run.cli()
"""


@pytest.mark.slow
def test_a_sigterm_to_one_rank_during_a_validation_stops_both_after_it_with_uneven_shares(tmp_path):
    """gloo DDP with 2 processes, 9 validation blocks (5 and 4 per rank: uneven shares), SIGTERM to rank 1 alone
    during the validation at step 4: the ranks vote when the validation ends, both stop there (exit 143) and
    last.ckpt holds step 4. (Lightning relaunches the script for rank 1, so both ranks carry the signalling hook.)"""
    script = tmp_path / "launch.py"
    script.write_text(SIGTERM_ON_RANK_1_DURING_A_VALIDATION.format(repo=str(REPO)))
    env = clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    command = [sys.executable, str(script), "--max_steps", "30", "--val_every", "2", *TINY_RUN, "--val_blocks", "9",
               "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
               "--log_dir", str(tmp_path / "runs")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "stopping after the validation at step 4" in done.stderr, done.stderr[-3000:]
    assert _ckpt_step(tmp_path / "runs" / "vanilla-tiny" / "version_0" / "checkpoints" / "last.ckpt") == 4

# ---------------------------------------------------------------------------- sweep
def _no_jobs(monkeypatch):
    launched = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: launched.append(a) or subprocess.CompletedProcess(a, 0))
    return launched


@pytest.mark.parametrize("argv,pattern", [
    ([], "grid is empty"),
    (["--grid", "variant="], "has no values"),
    (["--grid", "variant=vanilla,nope"], "valid variants: .*vanilla"),
    (["--grid", "model.mod.capacity=0.5,1.5", "--grid", "variant=mod"], "model.mod.capacity"),
    (["--grid", "variant=vanilla", "--", "--nope", "1"], "invalid run options: .*--nope 1"),
])
def test_bad_grids_fail_before_any_job(monkeypatch, argv, pattern):
    launched = _no_jobs(monkeypatch)
    with pytest.raises(ConfigError, match=pattern):
        sweep.main(argv)
    assert launched == []


def test_empty_grid_file_fails_before_any_job(tmp_path, monkeypatch):
    launched = _no_jobs(monkeypatch)
    grid = tmp_path / "grid.yaml"
    grid.write_text("options: [--size, tiny]\ngrid: {}\n")
    with pytest.raises(ConfigError, match="empty"):
        sweep.main([str(grid)])
    assert launched == []


def test_dry_run_prints_one_sbatch_command_per_configuration(tmp_path, monkeypatch, capsys):
    launched = _no_jobs(monkeypatch)
    grid = tmp_path / "grid.yaml"
    grid.write_text("options: [--max_steps, 50]\nsbatch: [--time=01:00:00]\n"
                    "grid:\n  - {variant: [vanilla, mod], seed: [1, 2]}\n  - {variant: mom, model.mom.top_k: [1, 2]}\n")
    jobs = sweep.main([str(grid), "--dry_run", "--no_plan", "--", "--trainer.num_nodes", "2", "--trainer.devices", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert launched == [] and len(lines) == len(jobs) == 6
    for line in lines:
        words = shlex.split(line)
        assert words[0] == "sbatch" and "--nodes=2" in words and "--ntasks-per-node=4" in words
        assert "--gpus-per-node=4" in words and "--time=01:00:00" in words
        template = words.index(str(sweep.SBATCH_TEMPLATE))
        run_options = words[template + 1:]
        assert run_options[:2] == ["--max_steps", "50"]
        sweep.validate([run_options])  # each printed command is a valid experiments.run command line
    assert sorted(" ".join(shlex.split(l)[-4:]) for l in lines[:4]) == [
        "--variant mod --seed 1", "--variant mod --seed 2", "--variant vanilla --seed 1", "--variant vanilla --seed 2"]
    assert [shlex.split(l)[-1] for l in lines[4:]] == ["1", "2"]


def test_dry_run_local_launcher_prints_run_commands(capsys, monkeypatch):
    _no_jobs(monkeypatch)
    sweep.main(["--grid", "variant=vanilla,mod", "--launcher", "local", "--dry_run", "--no_plan", "--",
                "--trainer.accelerator", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [shlex.split(l)[1:3] for l in lines] == [["-m", "experiments.run"]] * 2
    assert [shlex.split(l)[-1] for l in lines] == ["vanilla", "mod"]
