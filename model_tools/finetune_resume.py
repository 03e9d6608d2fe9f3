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
import pathlib
import re
import warnings
from typing import Any, Dict, List, Optional

from architectures.config import ConfigError, flatten

PREEMPTION_CHECKPOINT = "last.ckpt"  # in the task's checkpoints/ (ModelCheckpoint's own files are epoch=...-step=...)
FINETUNE_RECORD = "dyncomp_finetune"  # checkpoint key: {"task": "glue/sst2" | "xsum", "tokenizer": ..., "resume": ...}
RESUME_HPARAMS = ("model", "task", "optim", "max_steps", "head_dropout")  # what the training of a checkpoint used
RESUME_DATA = ("path", "batch_size", "max_length", "max_train_examples", "drop_empty")  # the examples and batches


def resume_record(cfg, task: str) -> Dict[str, Any]:
    """What a resumed task must share with its checkpoint besides the module's hyperparameters: the examples, their
    order (seed, batch, world size: ``datamodules/epoch_order.py``) and the initial weights."""
    return {"task": task, "seed": cfg.seed, "init_from": cfg.init_from,
            **{f"data.{key}": cfg.data[key] for key in RESUME_DATA}}


def resume_checkpoint(cfg, folder: pathlib.Path, module, task: str, world_size: int) -> Optional[str]:
    """The checkpoint a task resumes from (None: it starts afresh, as a task of ``glue/all`` not reached before the
    stop does), refused in one line when it was trained otherwise than this command trains."""
    if cfg.ckpt_path is None:
        return None
    path = pathlib.Path(cfg.ckpt_path) if cfg.ckpt_path != "last" else folder / "checkpoints" / PREEMPTION_CHECKPOINT
    if not path.is_file():
        return None
    from model_tools.weights import read_checkpoint

    blob = read_checkpoint(str(path), "ckpt_path")
    saved = flatten({k: v for k, v in (blob.get("hyper_parameters") or {}).items() if k in RESUME_HPARAMS})
    now = flatten({k: v for k, v in module.hparams.items() if k in RESUME_HPARAMS})
    record = (blob.get(FINETUNE_RECORD) or {}).get("resume") or {}
    expected = {**resume_record(cfg, task), "world_size": world_size}
    differences = [f"{key} ({saved.get(key)!r} in the checkpoint, {value!r} now)"
                   for key, value in now.items() if saved.get(key) != value]
    differences += [f"{key} ({record.get(key)!r} in the checkpoint, {value!r} now)"
                    for key, value in expected.items() if record.get(key) != value]
    if differences:
        raise ConfigError(f"ckpt_path: {path} was fine-tuned with a different {'; '.join(differences)}; resume "
                          "with the command that trained it, or start a new run without --ckpt_path")
    return str(path)


def fit(trainer, module, data, cfg, folder: pathlib.Path, task: str) -> None:
    """Train, from the preempted run's checkpoint when resuming; once the task has finished, its preemption
    checkpoint is gone (nothing is left to resume)."""
    ckpt_path = resume_checkpoint(cfg, folder, module, task, trainer.world_size)
    with warnings.catch_warnings():
        # Lightning does not see that the training loader continues mid-epoch (datamodules/epoch_order.py), and a
        # resume continues in the folder whose checkpoints it finds
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        if ckpt_path:
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        (folder / "checkpoints" / PREEMPTION_CHECKPOINT).unlink(missing_ok=True)


def resumed_version(cfg, tasks: List[str], root: pathlib.Path) -> Optional[str]:
    """The run folder ``--ckpt_path`` continues: the checkpoint's own, or for ``last`` the newest interrupted run
    under ``root``; None: a new folder (no ``--ckpt_path``, or a checkpoint from elsewhere)."""
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path != "last":
        ckpt = pathlib.Path(cfg.ckpt_path).resolve()
        inside = ckpt.parent.name == "checkpoints" and ckpt.parent.parent.parent == root.resolve()
        return ckpt.parent.parent.name if inside else None
    numbers = [int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    stopped = [n for n in numbers if was_stopped(root / f"version_{n}", tasks)]
    if not stopped:
        raise FileNotFoundError(f"--ckpt_path last: no interrupted run under {root} (a preempted run leaves "
                                "checkpoints/last.ckpt in its task's folder); start without --ckpt_path, or give the "
                                "--log_dir, --task and --variant of the run to resume")
    return f"version_{max(stopped)}"


def task_folder(run_dir: pathlib.Path, tasks: List[str], task: str) -> pathlib.Path:
    """Where a task's logs and checkpoints go: the run folder, or its sub-folder under ``glue/all``."""
    return run_dir if len(tasks) == 1 else run_dir / task.split("/")[1]


def was_stopped(run_dir: pathlib.Path, tasks: List[str]) -> bool:
    """Whether a task of the run folder was stopped with its checkpoint (the run finished: none is left)."""
    return any((task_folder(run_dir, tasks, t) / "checkpoints" / PREEMPTION_CHECKPOINT).is_file() for t in tasks)


def finished_rows(run_dir: pathlib.Path) -> List[Dict[str, Any]]:
    """The finished tasks of a ``glue/all`` run folder (``glue_results.json``, written after each task)."""
    path = run_dir / "glue_results.json"
    return json.loads(path.read_text()) if path.is_file() else []
