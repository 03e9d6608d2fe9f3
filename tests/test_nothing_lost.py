"""Issue 20 (nothing lost): racing jobs get their own run folder, checkpoints are written atomically, a full
disk or an unwritable log dir is one line (exit 2) naming the path, found before the data are prepared."""
from __future__ import annotations

import errno
import io
import json
import math
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
import yaml

from experiments import run
from lightning_modules import storage
from tests.conftest import REPO, TINY_RUN, DiskFillsAfter

CORPUS = "It was the best of times, it was the worst of times. " * 80


@pytest.fixture
def corpus(tmp_path) -> pathlib.Path:
    path = tmp_path / "good.txt"
    path.write_text(CORPUS)
    return path


def _argv(tmp_path, corpus, *extra):
    return [*TINY_RUN, "--data", "text", "--data.path", str(corpus), "--tokenizer", "bytes", "--max_steps", "2",
            "--val_every", "1", "--log_dir", str(tmp_path / "logs"), "--data.cache_dir", str(tmp_path / "cache"), *extra]


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


# ---------------------------------------------------------------------------- racing jobs
def _claim(root: str, barrier, queue) -> None:
    """What one job does: experiments.run's own run_version (the 'next free version' path), then write its
    own files into the folder it got; 'x' mode fails if another job already wrote there."""
    os.environ.pop("DYNCOMP_RUN_VERSION", None)
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    os.environ.update(SLURM_JOB_ID=str(os.getpid()), SLURM_NTASKS="1")  # a single-task SLURM job takes this path too
    cfg = run.Namespace(version=None, ckpt_path=None)
    barrier.wait()
    version = run.run_version(cfg, pathlib.Path(root))
    folder = pathlib.Path(root) / version
    with open(folder / "config.yaml", "x") as handle:
        handle.write(f"owner: {os.getpid()}\n")
    queue.put((version, os.getpid()))


def race(job, root: pathlib.Path, jobs: int) -> list:
    """``jobs`` forked processes run ``job(root, barrier, queue)``, released at once by the barrier; every one
    must exit 0; returns what each put on the queue."""
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(jobs), context.Queue()
    processes = [context.Process(target=job, args=(str(root), barrier, queue)) for _ in range(jobs)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    return [queue.get(timeout=5) for _ in range(jobs)]


def test_jobs_started_at_once_claim_distinct_run_folders(tmp_path):
    root = tmp_path / "logs" / "vanilla-tiny"
    (root / "version_0").mkdir(parents=True)  # an earlier run: the racers start above it
    jobs = 6
    claims = race(_claim, root, jobs)
    versions = sorted(v for v, _ in claims)
    assert versions == sorted(f"version_{i}" for i in range(1, jobs + 1))
    for version, pid in claims:  # every folder holds exactly its own job's file
        assert (root / version / "config.yaml").read_text() == f"owner: {pid}\n"


def test_a_fresh_log_dir_removed_by_a_job_started_at_the_same_moment_is_made_again(tmp_path, monkeypatch):
    folder = tmp_path / "logs" / "vanilla-tiny"
    real_mkstemp, removed = tempfile.mkstemp, []

    def other_job_releases_first(*args, dir=None, **kwargs):
        if not removed:  # between our mkdir and our probe, the other job removed the empty folders it created
            removed.append(dir)
            os.rmdir(dir)
        return real_mkstemp(*args, dir=dir, **kwargs)
    monkeypatch.setattr(storage.tempfile, "mkstemp", other_job_releases_first)
    storage.check_writable(folder)
    assert removed == [folder] and not folder.exists()  # probed on the second try, then released
    real_mkdir, gone = pathlib.Path.mkdir, []

    def root_removed_once(self, *args, **kwargs):
        if self.name == "version_0" and not gone:
            gone.append(self)
            os.rmdir(self.parent)
        return real_mkdir(self, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "mkdir", root_removed_once)
    assert storage.claim_next_version(folder) == "version_0" and (folder / "version_0").is_dir() and gone


def _probe_and_claim(root: str, barrier, queue) -> None:
    barrier.wait()
    for _ in range(50):
        storage.check_writable(pathlib.Path(root))
    queue.put(storage.claim_next_version(pathlib.Path(root)))


def test_jobs_started_at_once_into_a_fresh_log_dir_all_start(tmp_path):
    root, jobs = tmp_path / "logs" / "mod-tiny", 6  # nobody made it: each job probes, creates and releases it
    assert sorted(race(_probe_and_claim, root, jobs)) == [f"version_{i}" for i in range(jobs)]


@pytest.mark.slow
def test_three_real_runs_started_at_once_write_three_intact_run_folders(tmp_path, corpus):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("DYNCOMP_RUN_VERSION", None)
    # the measurement callbacks off: the race is about the run folder (the token cache is safe to share)
    command = [sys.executable, "-m", "experiments.run", *_argv(tmp_path, corpus), "--callbacks.routing", "false",
               "--callbacks.flops", "false", "--callbacks.throughput", "false", "--callbacks.contribution", "false"]
    processes = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
    outputs = [p.communicate(timeout=600) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    folders = [pathlib.Path(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert len(set(folders)) == 3
    for folder, process in zip(folders, processes):
        # events.out.tfevents.<time>.<host>.<pid>.<n>: every event file was written by this folder's own job
        assert {p.name.split(".")[-2] for p in folder.glob("events.out.tfevents.*")} == {str(process.pid)}
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["run_dir"] == str(folder) and summary["steps"] == 2
        config = yaml.safe_load((folder / "config.yaml").read_text())  # whole, one job's
        assert config["model"]["variant"] == "vanilla" and config["log_dir"] == str(tmp_path / "logs")
        blob = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert blob["global_step"] == 2
        assert not list((folder / "checkpoints").glob(".*"))  # no temp files left


# ---------------------------------------------------------------------------- atomic checkpoints
class FullDisk(Exception):
    pass


def _full_disk_save(real_save, keep: float = 0.5):
    """torch.save as on a disk that fills up: checkpoints get ``keep`` of their bytes, then ENOSPC."""
    def save(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and "state_dict" in obj):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[: int(len(buffer.getvalue()) * keep)]
        if isinstance(f, (str, os.PathLike)):
            pathlib.Path(f).write_bytes(data)
        else:
            f.write(data)
        raise OSError(errno.ENOSPC, "No space left on device")
    return save


def test_atomic_save_keeps_the_previous_checkpoint_whole_when_the_disk_fills(tmp_path, monkeypatch):
    target = tmp_path / "checkpoints" / "last.ckpt"
    storage.atomic_torch_save({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, target)
    before = target.read_bytes()
    monkeypatch.setattr(torch, "save", _full_disk_save(torch.save))
    with pytest.raises(storage.StorageError, match=rf"disk full: cannot save checkpoint {re.escape(str(target))} "
                                                   r"\(No space left on device\); free space .*--ckpt_path last"):
        storage.atomic_torch_save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 2}, target)
    assert target.read_bytes() == before  # the final name still holds the whole previous checkpoint
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # the temp file is gone


def test_atomic_save_writes_a_synced_temp_file_in_the_same_folder_then_renames(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", fd)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", pathlib.Path(src), pathlib.Path(dst)))
                        or real_replace(src, dst))
    target = tmp_path / "checkpoints" / "best-step=2.ckpt"
    storage.atomic_checkpoint_io().save_checkpoint({"state_dict": {}, "global_step": 2}, target)
    replaces = [e for e in events if e[0] == "replace"]
    assert len(replaces) == 1 and replaces[0][2] == target
    assert replaces[0][1].parent == target.parent  # same folder: a rename, never a copy across filesystems
    assert events.index(replaces[0]) > 0 and events[0][0] == "fsync"  # data synced before the rename
    assert torch.load(target, weights_only=False)["global_step"] == 2
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~storage._UMASK)  # not mkstemp's 0600


def test_disk_full_during_a_checkpoint_save_is_one_line_and_leaves_no_truncated_checkpoint(tmp_path, corpus, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(torch, "save", _full_disk_save(torch.save))
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, _argv(tmp_path, corpus))
    assert exit_info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(r"disk full: cannot save checkpoint \S+/vanilla-tiny/version_0/checkpoints/\S+\.ckpt "
                     r"\(No space left on device\); free space", line), line
    checkpoints = tmp_path / "logs" / "vanilla-tiny" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == []  # nothing truncated under a final name, no temp file


def _checkpoint_disk_fills(monkeypatch, room: int = 1000):
    """Checkpoint temp files (``.NAME.ckpt.XXXX.tmp``) get ``room`` bytes; every other file is written as usual."""
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        handle = real_fdopen(fd, mode, *args, **kwargs)
        return DiskFillsAfter(handle, room) if ".ckpt." in os.readlink(f"/proc/self/fd/{fd}") else handle
    monkeypatch.setattr(storage.os, "fdopen", fdopen)


def test_a_full_disk_under_torchs_zip_writer_is_the_storage_line_not_its_runtime_error(tmp_path, monkeypatch):
    """Issue 30: torch.save's zip writer turns the write's ENOSPC into ``RuntimeError: [enforce fail at
    inline_container.cc:672] unexpected pos``, which the atomic writer (catching OSError) let through."""
    target = tmp_path / "checkpoints" / "last.ckpt"
    _checkpoint_disk_fills(monkeypatch)
    with pytest.raises(storage.StorageError, match=rf"disk full: cannot save checkpoint {re.escape(str(target))} "
                                                   r"\(No space left on device\); free space .*--ckpt_path last"):
        storage.atomic_torch_save({"state_dict": {"w": torch.zeros(10_000)}, "global_step": 2}, target)
    assert list(target.parent.iterdir()) == []  # no temp file left


def test_a_full_disk_under_torchs_zip_writer_ends_a_run_in_one_line(tmp_path, corpus, capsys, monkeypatch):
    _checkpoint_disk_fills(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, _argv(tmp_path, corpus))
    assert exit_info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(r"disk full: cannot save checkpoint \S+/checkpoints/\S+\.ckpt \(No space left on device\)", line), line


def test_temp_files_of_a_killed_checkpoint_write_are_removed_when_the_run_starts_again(tmp_path, corpus, capsys):
    """Issue 30: a write killed between mkstemp and the rename (SIGKILL, a node lost) left its temp file forever."""
    first = run.main(_argv(tmp_path, corpus))
    checkpoints = first / "checkpoints"
    killed = [checkpoints / ".last.ckpt.k1ll3d.tmp", checkpoints / ".best-step=2.ckpt.x9y8z7.tmp"]
    for path in killed:
        path.write_bytes(b"half a checkpoint")
    (checkpoints / ".notes.tmp").write_text("not a checkpoint write: kept")
    capsys.readouterr()
    resumed = run.main([*_argv(tmp_path, corpus), "--max_steps", "3", "--ckpt_path", "last"])
    assert resumed == first and not any(p.exists() for p in killed) and (checkpoints / ".notes.tmp").exists()
    err = capsys.readouterr().err
    assert all(f"note: removed {p}, left by a checkpoint write that was killed" in err for p in killed), err


def _refuse_under(folder: pathlib.Path, err: int):
    """Path.mkdir and mkstemp fail under ``folder`` as on a read-only or foreign-owned disk (tests run as root,
    where chmod does not stop a write)."""
    real_mkdir, real_mkstemp = pathlib.Path.mkdir, storage.tempfile.mkstemp

    def mkdir(self, *args, **kwargs):
        if pathlib.Path(self).resolve().is_relative_to(folder.resolve()):
            raise OSError(err, os.strerror(err), str(self))
        return real_mkdir(self, *args, **kwargs)

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and pathlib.Path(dir).resolve().is_relative_to(folder.resolve()):
            raise OSError(err, os.strerror(err), str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)
    return mkdir, mkstemp


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_unwritable_log_dir_fails_in_one_line_before_the_data_are_prepared(tmp_path, corpus, capsys, monkeypatch, err):
    from datamodules.lm import LMDataModule

    mkdir, mkstemp = _refuse_under(tmp_path / "logs", err)
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    monkeypatch.setattr(storage.tempfile, "mkstemp", mkstemp)
    prepared = []
    monkeypatch.setattr(LMDataModule, "prepare_data", lambda self: prepared.append(1))
    start = time.time()
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, _argv(tmp_path, corpus))
    assert exit_info.value.code == 2 and time.time() - start < 30
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(rf"log_dir: cannot write to {re.escape(str(tmp_path / 'logs'))}\S* \({os.strerror(err)}\); "
                     r"make it writable or choose another --log_dir", line), line
    assert prepared == []


def test_log_dir_below_a_file_fails_in_one_line_before_the_data_are_prepared(tmp_path, corpus, capsys, monkeypatch):
    from datamodules.lm import LMDataModule

    prepared = []
    monkeypatch.setattr(LMDataModule, "prepare_data", lambda self: prepared.append(1))
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, [*_argv(tmp_path, corpus), "--log_dir", str(corpus / "runs")])
    assert exit_info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(rf"log_dir: cannot write to {re.escape(str(corpus))}/runs\S* \(Not a directory\)", line), line
    assert prepared == []


def test_a_run_that_fails_before_writing_releases_its_claimed_folder(tmp_path, corpus, monkeypatch):
    from datamodules.lm import LMDataModule

    def broken(self):
        raise run.DataError("data.path: broken on purpose")
    monkeypatch.setattr(LMDataModule, "prepare_data", broken)
    with pytest.raises(run.DataError):
        run.main(_argv(tmp_path, corpus))
    assert list((tmp_path / "logs" / "vanilla-tiny").iterdir()) == []


# ---------------------------------------------------------------------------- validation independent of world size
VAL_MODEL = dict(variant="mod", d_model=32, n_layer=2, n_head=2, block_size=16)
VAL_BATCH, VAL_BLOCKS = 16, 37  # 1 x 16: batches of 16, 16, 5; 2 x 8 (the same global batch): 19 + 18 blocks, uneven


def _val_datamodule(folder: pathlib.Path, batch_size: int = VAL_BATCH):
    from datamodules.lm import DataConfig, LMDataModule

    corpus = folder / "val.txt"
    if not corpus.exists():
        corpus.write_text(" ".join(f"line {i} of the validation test, word {i * 7 % 13}." for i in range(120)))
    config = DataConfig(name="text", tokenizer="bytes", path=[str(corpus)], batch_size=batch_size, val_fraction=0.2,
                        cache_dir=str(folder / "cache"))
    return LMDataModule(config, block_size=VAL_MODEL["block_size"], seed=0, val_blocks=VAL_BLOCKS)


def _validate(folder: pathlib.Path, world: int, strategy="auto"):
    """Validate one fresh model on ``world`` processes of batch ``VAL_BATCH / world`` (the same global batch)."""
    import lightning as L

    from lightning_modules.lm import LanguageModelModule

    data = _val_datamodule(folder, VAL_BATCH // world)
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model={**VAL_MODEL, "vocab_size": data.vocab_size})
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    return {k: float(v) for k, v in metrics.items()}, module, data


def _val_worker(rank: int, world: int, port: int, folder: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    metrics, _, _ = _validate(pathlib.Path(folder), world, DDPStrategy(process_group_backend="gloo"))
    if rank == 0:
        (pathlib.Path(folder) / "ddp.json").write_text(json.dumps(metrics))


@pytest.mark.slow
def test_validation_loss_is_the_same_for_one_process_of_batch_16_and_two_of_batch_8(tmp_path, one_thread):
    """Issue 30: the same global batch on twice the processes (half the per-rank batch) validated half the
    blocks when the count was val_batches x data.batch_size; with --val_blocks both evaluate the same blocks."""
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from tests.test_global_metrics import _free_port

    rank = getattr(rank_zero_only, "rank", 0)
    try:
        single, module, data = _validate(tmp_path, 1)
    finally:
        rank_zero_only.rank = rank
    mp.start_processes(_val_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    double = json.loads((tmp_path / "ddp.json").read_text())
    assert {"val/loss", "val/loss_causal"} <= single.keys() == double.keys()
    for key, value in single.items():
        assert double[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    # the headline figures to the bit (measured: 5.550346374511719 and 5.550333023071289 on both; the per-rank
    # sums group the blocks differently, so equality is to float rounding in general, exact here)
    assert (double["val/loss"], double["val/loss_causal"]) == (single["val/loss"], single["val/loss_causal"])
    # and both are the mean over exactly the first VAL_BLOCKS validation blocks (a naive reference)
    blocks = torch.stack([data.val_sets["val"][i] for i in range(VAL_BLOCKS)])
    assert len(data.val_sets["val"]) > len(blocks)  # the limit matters
    module.eval()
    with torch.no_grad():
        logits = module.model(blocks[:, :-1]).logits
        reference = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
        with module.model.causal_routing():
            causal = module.model(blocks[:, :-1]).logits
        reference_causal = F.cross_entropy(causal.reshape(-1, causal.shape[-1]), blocks[:, 1:].reshape(-1))
    assert single["val/loss"] == pytest.approx(float(reference), rel=1e-5)
    assert single["val/loss_causal"] == pytest.approx(float(reference_causal), rel=1e-5)


class _FakeTrainer:
    def __init__(self, rank, world):
        self.global_rank, self.world_size = rank, world


def test_validation_share_is_every_block_once_for_any_world_size():
    from datamodules.lm import validation_share

    for count in (1, 9, 64, 320):
        for world in (1, 2, 4):
            if world > count:
                continue
            shares = [validation_share(count, rank, world) for rank in range(world)]
            assert np.concatenate(shares).tolist() == list(range(count))  # contiguous, in order, each block once
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("per_rank_batch", [{1: 16, 2: 8, 4: 4}, {1: 3, 2: 3, 4: 3}], ids=["same-global-batch", "same-batch"])
def test_validation_blocks_are_a_global_count_whatever_the_world_size_and_batch(tmp_path, per_rank_batch):
    """1 x 16, 2 x 8 and 4 x 4 (the same global batch) and 1, 2, 4 x 3: the same VAL_BLOCKS blocks each time."""
    shares = {}
    for world, batch in per_rank_batch.items():
        data = _val_datamodule(tmp_path, batch)
        data.prepare_data()
        data.setup("validate")
        got = []
        for rank in range(world):
            data.trainer = _FakeTrainer(rank, world)
            got.append([int(i) for batch in data.val_dataloader() for i in batch[:, 0]])  # first token identifies a block
        shares[world] = got
        assert sorted(sum(got, [])) == sorted(shares[1][0])  # the same blocks for any number of processes
    assert len(shares[1][0]) == VAL_BLOCKS
    assert [len(s) for s in shares[2]] == [19, 18]
    data.trainer = _FakeTrainer(0, 40)
    with pytest.raises(run.DataError, match=r"validation set 'val' evaluates 37 blocks, fewer than the 40 ranks"):
        data.val_dataloader()


@pytest.mark.parametrize("argv,blocks,warned", [([], 320, False), (["--val_blocks", "37"], 37, False),
                                                (["--val_batches", "3", "--data.batch_size", "4"], 12, True)],
                         ids=["default", "val_blocks", "deprecated-val_batches"])
def test_val_blocks_resolves_the_deprecated_val_batches_and_config_yaml_records_blocks(argv, blocks, warned, capsys):
    cfg = run.build_parser().parse_args(run.expand_aliases(argv))
    run.resolve_val_blocks(cfg)
    assert (cfg.val_blocks, cfg.val_batches) == (blocks, None)
    assert ("warning: --val_batches is deprecated; it now means --val_blocks 12" in capsys.readouterr().err) == warned


def test_causal_flops_are_the_causal_evaluations_own_share(tmp_path):
    from architectures.flops import vanilla_flops

    metrics, module, data = _validate(tmp_path, 1)
    blocks = torch.stack([data.val_sets["val"][i] for i in range(VAL_BLOCKS)])
    module.eval()
    with torch.no_grad(), module.model.causal_routing():
        trace = module.model(blocks[:, :-1]).trace
    reference = module.model.flops_per_token(trace, VAL_MODEL["block_size"]).forward
    assert metrics["val/flops_causal"] == pytest.approx(reference, rel=1e-6)
    assert metrics["val/flops_causal_ratio_to_vanilla"] == pytest.approx(
        reference / vanilla_flops(module.model.config).forward, rel=1e-6)
    at_capacity = module.model.flops_per_token(None, VAL_MODEL["block_size"]).forward
    assert metrics["val/flops_causal"] != pytest.approx(at_capacity)  # an untrained predictor is not at capacity


# ---------------------------------------------------------------------------- causal selection and hparams
@pytest.fixture(scope="module")
def mod_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mod")
    corpus = folder / "good.txt"
    corpus.write_text(CORPUS)
    return run.main([*_argv(folder, corpus), "--variant", "mod", "--max_steps", "4", "--val_every", "2",
                     "--trainer.log_every_n_steps", "1"])


def test_routing_that_sees_the_future_is_selected_and_summarised_by_its_causal_loss(mod_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = json.loads((mod_run / "summary.json").read_text())
    metrics = summary["val_metrics"]
    assert summary["final_val_loss_metric"] == "val/loss_causal"
    assert summary["final_val_loss"] == metrics["val/loss_causal"] != metrics["val/loss"]
    assert summary["final_val_loss_noncausal"] == metrics["val/loss"]
    assert summary["final_val_ppl"] == pytest.approx(math.exp(metrics["val/loss_causal"]))
    assert summary["final_val_flops_per_token_causal"] == {"forward": metrics["val/flops_causal"],
                                                           "ratio_to_vanilla": metrics["val/flops_causal_ratio_to_vanilla"]}
    # the best checkpoint is the step with the lowest causal loss of the validations during fit (steps 2, 4)
    events = EventAccumulator(str(mod_run), size_guidance={"scalars": 0})
    events.Reload()
    causal = {e.step: e.value for e in events.Scalars("val/loss_causal")}
    best = torch.load(next((mod_run / "checkpoints").glob("best-*.ckpt")), map_location="cpu", weights_only=False)
    state = next(v for k, v in best["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["monitor"] == "val/loss_causal"
    # scored by the validation of its own weights (not the previous one), and the lowest of the two
    fit_scores = {2: causal[1], 4: causal[3]}  # x value = index of the step's batch
    assert float(state["best_model_score"]) == pytest.approx(min(fit_scores.values()))
    assert best["global_step"] == min(fit_scores, key=fit_scores.get)


def test_hparams_hold_the_final_train_loss_and_tokens_seen(mod_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(mod_run), size_guidance={"scalars": 0})
    events.Reload()
    summary = json.loads((mod_run / "summary.json").read_text())
    assert events.Scalars("hparams/train/tokens_seen")[-1].value == summary["tokens_seen"] == 4 * 4 * 64
    assert events.Scalars("hparams/train/loss")[-1].value == pytest.approx(events.Scalars("train/loss")[-1].value)
    assert events.Scalars("hparams/train/loss")[-1].value == pytest.approx(summary["final_train_loss"], rel=1e-5)


def test_head_to_head_reads_the_causal_loss_from_old_and_new_summaries():
    from callbacks.run_summary import causal_flops_per_token, headline_val_loss, noncausal_val_loss

    old = {"final_val_loss": 3.0, "val_metrics": {"val/loss": 3.0, "val/loss_causal": 3.2}}  # before issue 20
    new = {"final_val_loss": 3.2, "final_val_loss_noncausal": 3.0,
           "val_metrics": {"val/loss": 3.0, "val/loss_causal": 3.2, "val/flops_causal": 5.0,
                           "val/flops_causal_ratio_to_vanilla": 0.9}}
    dense = {"final_val_loss": 2.5, "val_metrics": {"val/loss": 2.5}}
    assert [headline_val_loss(s) for s in (old, new, dense)] == [3.2, 3.2, 2.5]
    assert [noncausal_val_loss(s) for s in (old, new, dense)] == [3.0, 3.0, 2.5]
    assert causal_flops_per_token(old) is None and causal_flops_per_token(dense) is None
    assert causal_flops_per_token(new) == {"forward": 5.0, "ratio_to_vanilla": 0.9}
