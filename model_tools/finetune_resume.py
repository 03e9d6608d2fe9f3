"""Resuming a preempted fine-tuning run (``experiments.finetune --ckpt_path last``): which run folder and checkpoint
it continues, what the checkpoint must share with the command, and the training call itself.

A SIGTERM or SIGUSR1 stops a GLUE or XSUM run with ``checkpoints/last.ckpt`` in its task's folder
(``callbacks/preemption.py``). The same command with ``--ckpt_path last`` continues the newest such run in its own
folder with the batches and random stream of the uninterrupted run (``datamodules/epoch_order.py``,
``lightning_modules/rng_state.py``); ``glue/all`` keeps its finished tasks (``glue_results.json``). A checkpoint
trained with other settings is refused in one line, naming each difference.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import warnings
from typing import Any, Dict, List, Optional

from architectures.config import ConfigError, flatten

PREEMPTION_CHECKPOINT = "last.ckpt"  # in the task's checkpoints/ (ModelCheckpoint's own files are epoch=...-step=...)
FINETUNE_RECORD = "dyncomp_finetune"  # checkpoint key: {"task": "glue/sst2" | "xsum", "tokenizer": ..., "resume": ...}
VERSION_ENV = "DYNCOMP_FINETUNE_VERSION"  # the run folder rank 0 chose, inherited by the ranks Lightning re-launches
RESUME_HPARAMS = ("model", "task", "optim", "max_steps", "head_dropout")  # what the training of a checkpoint used
RESUME_DATA = ("batch_size", "max_length", "max_train_examples", "max_eval_examples", "drop_empty")
TOKENIZER_FIELDS = ("spec", "corpus", "corpus_path")  # what picks the tokenizer (not where it is cached)


def resume_record(cfg, task: str) -> Dict[str, Any]:
    """What a resumed task must share with its checkpoint besides the module's hyperparameters and the trainer's
    world size and precision: the examples and their order (seed, batch: ``datamodules/epoch_order.py``) and the
    tokenizer. (``--init_from`` is not compared: the checkpoint's weights replace it.)"""
    path = cfg.data["path"]
    tokenizer = getattr(cfg, "tokenizer_source", None) or {}
    return {"task": task, "seed": cfg.seed, "data.path": str(pathlib.Path(path).resolve()) if path else None,
            **{f"data.{key}": cfg.data[key] for key in RESUME_DATA},
            **{f"tokenizer.{key}": tokenizer.get(key) for key in TOKENIZER_FIELDS}}


def trainer_record(trainer) -> Dict[str, Any]:
    return {"world_size": trainer.world_size, "precision": str(trainer.precision)}


def resume_checkpoint(cfg, folder: pathlib.Path, module, task: str, trainer) -> Optional[str]:
    """The checkpoint a task resumes from (None: it starts afresh, as a task of ``glue/all`` not reached before the
    stop does), refused in one line when it was trained otherwise than this command trains."""
    if cfg.ckpt_path is None:
        return None
    path = pathlib.Path(cfg.ckpt_path) if cfg.ckpt_path != "last" else folder / "checkpoints" / PREEMPTION_CHECKPOINT
    if not path.is_file():
        return None
    from model_tools.weights import read_checkpoint

    blob = read_checkpoint(str(path), "ckpt_path")
    record = (blob.get(FINETUNE_RECORD) or {}).get("resume")
    if not isinstance(record, dict):
        raise ConfigError(f"ckpt_path: {path} records no fine-tuning settings to resume with (not a checkpoint of "
                          "experiments.finetune, or from before 2026-12-07); start a new run without --ckpt_path")
    saved = flatten({k: v for k, v in (blob.get("hyper_parameters") or {}).items() if k in RESUME_HPARAMS})
    now = flatten({k: v for k, v in module.hparams.items() if k in RESUME_HPARAMS})
    expected = {**now, **resume_record(cfg, task), **trainer_record(trainer)}
    was = {**saved, **record}
    differences = [f"{key} ({was.get(key)!r} in the checkpoint, {value!r} now)"
                   for key, value in expected.items() if was.get(key) != value]
    if differences:
        raise ConfigError(f"ckpt_path: {path} was fine-tuned with a different {'; '.join(differences)}; resume "
                          "with the command that trained it, or start a new run without --ckpt_path")
    return str(path)


def fit(trainer, module, data, cfg, folder: pathlib.Path, task: str) -> None:
    """Train, from the preempted run's checkpoint when resuming. The checkpoint stays until the task's results are
    written (``drop_stop_checkpoint``): a run killed in its final evaluation resumes there."""
    ckpt_path = resume_checkpoint(cfg, folder, module, task, trainer)
    with warnings.catch_warnings():
        # Lightning does not see that the training loader continues mid-epoch (datamodules/epoch_order.py), and a
        # resume continues in the folder whose checkpoints it finds
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        if ckpt_path:
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if ckpt_path is not None and pathlib.Path(ckpt_path).resolve() == (folder / "checkpoints" /
                                                                        PREEMPTION_CHECKPOINT).resolve():
        # the stop checkpoint stays until the results are written: at the final step, so that a kill in the final
        # evaluation resumes there without training again
        trainer.save_checkpoint(str(folder / "checkpoints" / PREEMPTION_CHECKPOINT))


def drop_stop_checkpoint(folder: pathlib.Path) -> None:
    """The task's results are written: nothing is left to resume."""
    (folder / "checkpoints" / PREEMPTION_CHECKPOINT).unlink(missing_ok=True)


def launcher_version(cfg) -> Optional[str]:
    """The run folder every rank agrees on when the launcher started the ranks (each runs the command): ``--version``,
    an srun step of several tasks' (``slurm-<job id>``) or torchrun's (``torchrun-<run id>``); None: the first
    process decides (and the ranks Lightning starts inherit it: ``VERSION_ENV``). Not from ``WORLD_SIZE`` or
    ``SLURM_NTASKS``: Lightning's own launcher sets the first in the first process, and one process in an
    allocation of several tasks (``salloc -n 4``) has the second."""
    if cfg.version:
        return cfg.version
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_STEP_NUM_TASKS", "1") != "1":
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if all(key in os.environ for key in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):  # torchrun's
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        if run_id == "none":
            raise ConfigError("version: torchrun started the ranks, which must write one run folder; pass --version "
                              "NAME (the same on every rank) or torchrun's --rdzv_id")
        return f"torchrun-{run_id}"
    return None


def run_version(cfg, tasks: List[str], root: pathlib.Path) -> Optional[str]:
    """The run folder, decided before anything is built: inherited, the one ``--ckpt_path`` continues (the
    checkpoint's own; for ``last`` the ``--version`` folder, or the interrupted run under ``root`` that wrote last:
    a resubmitted job has another job or run id), or the launcher's; None: claim a new ``version_N``. A named
    folder holding another run is refused unless it is resumed."""
    if os.environ.get(VERSION_ENV):
        return os.environ[VERSION_ENV]
    if cfg.ckpt_path is None:
        fixed = launcher_version(cfg)
        if fixed is not None:
            refuse_used_folder(root / fixed, tasks)
        return fixed
    if cfg.ckpt_path != "last":
        ckpt = pathlib.Path(cfg.ckpt_path).resolve()
        inside = ckpt.parent.name == "checkpoints" and ckpt.parent.parent.parent == root.resolve()
        return ckpt.parent.parent.name if inside else launcher_version(cfg)
    candidates = [root / cfg.version] if cfg.version else sorted(p for p in root.glob("*") if p.is_dir())
    stopped = [folder for folder in candidates if was_stopped(folder, tasks)]
    if not stopped:
        where = root / cfg.version if cfg.version else root
        raise FileNotFoundError(f"--ckpt_path last: no interrupted run under {where} (a preempted run leaves "
                                "checkpoints/last.ckpt in its task's folder); start without --ckpt_path, or give the "
                                "--log_dir, --task and --variant of the run to resume")
    # the same on every rank: ties (coarse clocks, copied folders) go to the higher version number, then the name
    return max(stopped, key=lambda folder: (last_write(folder, tasks), version_number(folder), folder.name)).name


def version_number(folder: pathlib.Path) -> int:
    match = re.fullmatch(r"version_(\d+)", folder.name)
    return int(match.group(1)) if match else -1


def refuse_used_folder(run_dir: pathlib.Path, tasks: List[str]) -> None:
    if was_stopped(run_dir, tasks) or any((run_dir / name).is_file() for name in ("results.json", "glue_results.json")):
        raise ConfigError(f"version: {run_dir} already holds a run; resume an interrupted one with --ckpt_path last, "
                          "or choose another --version")


def task_folder(run_dir: pathlib.Path, tasks: List[str], task: str) -> pathlib.Path:
    """Where a task's logs and checkpoints go: the run folder, or its sub-folder under ``glue/all``."""
    return run_dir if len(tasks) == 1 else run_dir / task.split("/")[1]


def stop_checkpoints(run_dir: pathlib.Path, tasks: List[str]) -> List[pathlib.Path]:
    """The stop checkpoints of the run's unfinished tasks (one left beside a task's results, by a kill between
    writing them and removing it, does not make the run interrupted)."""
    if len(tasks) == 1 and (run_dir / "results.json").is_file():
        return []
    finished = {row["task"] for row in finished_rows(run_dir)}
    found = [task_folder(run_dir, tasks, t) / "checkpoints" / PREEMPTION_CHECKPOINT for t in tasks if t not in finished]
    return [path for path in found if path.is_file()]


def was_stopped(run_dir: pathlib.Path, tasks: List[str]) -> bool:
    """Whether the run folder holds an unfinished run to resume: a task stopped with its checkpoint, or under
    ``glue/all`` fewer finished tasks than tasks (a run stopped or killed between two tasks)."""
    if stop_checkpoints(run_dir, tasks):
        return True
    path = run_dir / "glue_results.json"
    return len(tasks) > 1 and path.is_file() and len(finished_rows(run_dir)) < len(tasks)


def last_write(run_dir: pathlib.Path, tasks: List[str]) -> float:
    """When the run last wrote what a resume reads (its stop checkpoints, its finished rows)."""
    paths = [*stop_checkpoints(run_dir, tasks), run_dir / "glue_results.json"]
    return max((path.stat().st_mtime for path in paths if path.is_file()), default=0.0)


def finished_rows(run_dir: pathlib.Path) -> List[Dict[str, Any]]:
    """The finished tasks of a ``glue/all`` run folder (``glue_results.json``, written after each task)."""
    path = run_dir / "glue_results.json"
    return json.loads(path.read_text()) if path.is_file() else []
