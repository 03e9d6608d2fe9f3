"""Fine-tune any variant on GLUE or XSUM: ``python -m experiments.finetune --task glue/cola --variant mod``.

    --task glue/<cola|sst2|mrpc|qqp|stsb|mnli|qnli|rte|wnli> | glue/all | xsum
    --variant V, --size S, --model.* overrides   the backbone (as in experiments.run)
    --init_from CKPT | hf:gpt2 | HF_FOLDER       pre-trained weights; a suite checkpoint fixes the backbone's
                                                 shape (and, for the same variant, all its settings); a vanilla
                                                 checkpoint initialises any variant (model_tools/weights.py)
    --tokenizer T                                default: the one a fine-tuned --init_from recorded, else the
                                                 checkpoint's run config (config.yaml next to checkpoints/), else gpt2
    --data.path PATH                             local files instead of the Hub (see datamodules/glue.py, xsum.py)
    --init_strict false, --init_min_share F      load a checkpoint of another tokenizer / below share F anyway
    --ckpt_path last | CKPT                      resume a preempted run (SIGTERM / SIGUSR1 saved its
                                                 checkpoints/last.ckpt) in its own folder, with the same command
    --version NAME                               the run folder (default: the next version_N; srun: slurm-<job id>)
    --eval_only true                             evaluate --init_from without training (GLUE: a fine-tuned checkpoint;
                                                 its task must be --task; --max_steps / --epochs are ignored)
    --epochs N / --max_steps N (overrides epochs), --batch_size B, --lr, --weight_decay, --warmup_ratio, --dropout
    --max_train_examples N, --max_eval_examples N   seeded subsets for quick runs
    XSUM: --num_beams K (1 = greedy), --max_new_tokens N, --length_penalty A, --eval_split validation|test

Outputs, in ``<log_dir>/<task>-<variant>/version_N``: TensorBoard events, ``results.json`` (GLUE: the
task's metrics per validation split and its GLUE score; XSUM: ROUGE-1/2/L and ``predictions.jsonl``).
``glue/all`` runs the nine tasks in turn (one sub-folder each) and writes ``glue_results.md`` and
``glue_results.json``. The run folder is the last line printed.

Preemption (``callbacks/preemption.py``, as in ``experiments.run``): SIGTERM, or SIGUSR1 (SLURM's time-limit
warning), stops the run after the current step, saves ``checkpoints/last.ckpt`` in the task's folder and exits
with status 143 / 138. The same command with ``--ckpt_path last`` continues it in that folder with the same
batches (``datamodules/epoch_order.py``); ``glue/all`` keeps its finished tasks' rows, resumes the interrupted task
and runs the rest. The job is not requeued: a requeued fine-tuning job would start over without
``--ckpt_path last``. The checkpoint is removed once its task's results are written (``model_tools/finetune_resume.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # noqa: E402

from architectures import ModelConfig, variant_names  # noqa: E402
from architectures.config import ConfigError, SIZES  # noqa: E402
from datamodules.corpora import DataError  # noqa: E402
from experiments.run import add_model_arguments, expand_aliases, parse_with_presets  # noqa: E402
from model_tools.finetune_resume import FINETUNE_RECORD, PREEMPTION_CHECKPOINT, VERSION_ENV, finished_rows, fit  # noqa: E402
from model_tools.finetune_resume import drop_stop_checkpoint, resume_record, run_version, task_folder  # noqa: E402
from model_tools.finetune_resume import trainer_record  # noqa: E402
from lightning_modules.storage import claim_next_version, release_if_empty  # noqa: E402

ALIASES = {"--variant": "--model.variant", "--size": "--model.size", "--batch_size": "--data.batch_size"}
SHAPE_FIELDS = ("size", "vocab_size", "d_model", "n_layer", "n_head", "block_size", "ffn_ratio", "bias", "layer_norm_eps")


@dataclass
class FinetuneData:
    path: Optional[str] = None  # GLUE: a folder; XSUM: a folder or one split-named file
    drop_empty: bool = False  # drop (and count) rows with an empty text instead of failing
    batch_size: int = 32
    eval_batch_size: int = 8  # XSUM generation batch
    max_length: Optional[int] = None  # GLUE sequence length; default: the model's block size
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None
    num_workers: int = 0


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m experiments.finetune", default_env=False, exit_on_error=False,
                            description="Fine-tune a variant on GLUE or XSUM. Aliases: "
                            + ", ".join(f"{k} = {v}" for k, v in ALIASES.items()))
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--task", type=str, required=True, help="glue/<task>, glue/all or xsum")
    parser.add_argument("--init_from", type=Optional[str], default=None)
    parser.add_argument("--init_strict", type=bool, default=True,
                        help="refuse --init_from when its tokenizer differs or it initialises less than --init_min_share")
    parser.add_argument("--init_min_share", type=float, default=0.5)
    parser.add_argument("--tokenizer", type=Optional[str], default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--log_dir", type=str, default="runs/finetune")
    parser.add_argument("--epochs", type=Optional[int], default=None, help="default: 3 for GLUE, 1 for XSUM")
    parser.add_argument("--max_steps", type=Optional[int], default=None, help="stop after N steps (overrides epochs)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_ratio", type=float, default=0.06)
    parser.add_argument("--dropout", type=float, default=0.1, help="backbone and head dropout while fine-tuning")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--length_penalty", type=float, default=1.0)
    parser.add_argument("--eval_split", type=str, default="validation")
    parser.add_argument("--rouge_stemmer", type=bool, default=False)
    parser.add_argument("--save_checkpoint", type=bool, default=False)
    parser.add_argument("--version", type=Optional[str], default=None,
                        help="the run folder's name (default: the next version_N; under srun slurm-<job id>)")
    parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                        help="resume a preempted run: 'last' (the newest interrupted run of this command's folder) "
                        "or its checkpoints/last.ckpt")
    parser.add_argument("--eval_only", type=bool, default=False,
                        help="evaluate --init_from without training (GLUE: a checkpoint fine-tuned on the task, "
                        "written with --save_checkpoint true; XSUM: any checkpoint)")
    parser.add_argument("--compile", type=bool, default=False, help="torch.compile the backbone in place")
    parser.add_argument("--trainer.accelerator", type=str, default="auto")
    parser.add_argument("--trainer.devices", type=str, default="auto")
    parser.add_argument("--trainer.precision", type=Optional[str], default=None)
    parser.add_argument("--trainer.enable_progress_bar", type=bool, default=True)
    add_model_arguments(parser)
    parser.add_class_arguments(FinetuneData, "data")
    return parser


def task_list(task: str) -> List[str]:
    from datamodules.glue import GLUE_TASKS, get_task

    if task == "xsum":
        return ["xsum"]
    if task in ("glue/all", "glue"):
        return [f"glue/{t}" for t in GLUE_TASKS]
    if not task.startswith("glue/"):
        raise DataError(f"task: unknown task {task!r}; valid: glue/<{'|'.join(GLUE_TASKS)}>, glue/all, xsum")
    return [get_task(task).slug]


def validate_up_front(cfg: Namespace) -> None:
    task_list(cfg.task)
    if cfg.model.variant not in variant_names():
        raise ConfigError(f"model.variant: unknown variant {cfg.model.variant!r}; valid variants: {', '.join(variant_names())}")
    if cfg.model.size not in SIZES:
        raise ConfigError(f"model.size: unknown size {cfg.model.size!r}; valid sizes: {', '.join(SIZES)}")
    checks = [
        (cfg.epochs is None or cfg.epochs > 0, "epochs", "must be a positive integer"),
        (cfg.max_steps is None or cfg.max_steps > 0, "max_steps", "must be a positive integer"),
        (cfg.lr > 0, "lr", "must be > 0"),
        (0 <= cfg.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)"),
        (0 <= cfg.dropout < 1, "dropout", "must be in [0, 1)"),
        (cfg.num_beams >= 1, "num_beams", "must be >= 1"),
        (cfg.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
        (cfg.eval_split in ("validation", "test"), "eval_split", "must be 'validation' or 'test'"),
        (cfg.data.batch_size > 0, "data.batch_size", "must be a positive integer"),
        (cfg.data.max_length is None or cfg.data.max_length >= 4, "data.max_length", "must be >= 4"),
        (cfg.data.max_train_examples is None or cfg.data.max_train_examples > 0, "data.max_train_examples",
         "must be a positive integer (or unset for all)"),
        (cfg.data.max_eval_examples is None or cfg.data.max_eval_examples > 0, "data.max_eval_examples",
         "must be a positive integer (or unset for all)"),
        (cfg.data.eval_batch_size > 0, "data.eval_batch_size", "must be a positive integer"),
        (0.0 <= cfg.init_min_share <= 1.0, "init_min_share", "must be in [0, 1]"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ConfigError(f"{name}: {message}, got {cfg[name]!r}")
    if cfg.eval_only and not cfg.init_from:
        raise ConfigError("eval_only: needs --init_from (the checkpoint to evaluate)")
    if cfg.eval_only and len(task_list(cfg.task)) > 1:
        raise ConfigError("eval_only: evaluates one fine-tuned task checkpoint; pass --task glue/<task>, not glue/all")
    check_ckpt_path_option(cfg)
    from architectures.registry import apply_preset, check_groups_read, check_options_used
    from model_tools.weights import check_source

    check_groups_read(cfg.model.variant, _as_dict(cfg.model))
    check_options_used(apply_preset(ModelConfig.from_dict(_as_dict(cfg.model))))
    if cfg.init_from:
        check_source(cfg.init_from)  # a missing file or an unreachable Hub model: now, not after the data


def check_ckpt_path_option(cfg: Namespace) -> None:
    if cfg.ckpt_path is None:
        return
    if cfg.eval_only:
        raise ConfigError("ckpt_path: resumes a preempted training run; --eval_only trains nothing (evaluate a "
                          "checkpoint with --init_from)")
    if cfg.ckpt_path == "last":
        return
    if len(task_list(cfg.task)) > 1:
        raise ConfigError(f"ckpt_path: {cfg.task} resumes its newest interrupted run with --ckpt_path last, not "
                          "one task's checkpoint")
    if not pathlib.Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path: {cfg.ckpt_path} is not a file; give the interrupted run's "
                                "checkpoints/last.ckpt, or --ckpt_path last")


def _as_dict(ns) -> Dict[str, Any]:
    return ns.as_dict() if isinstance(ns, Namespace) else dict(ns)


def check_task_files(cfg: Namespace, tasks: List[str]) -> None:
    """Every task's files, before anything trains (glue/all used to fail at MNLI after five tasks)."""
    glue = [t for t in tasks if t.startswith("glue/")]
    if glue:
        from datamodules.glue import check_files

        check_files(glue, cfg.data.path, splits=("validation",) if cfg.eval_only else ("train", "validation"))


# ---------------------------------------------------------------------------- backbone and tokenizer
def _is_hf(source: str) -> bool:
    path = pathlib.Path(source)
    return source.startswith("hf:") or (path.is_dir() and (path / "config.json").is_file())


@functools.lru_cache(maxsize=4)  # glue/all asks once per task; a checkpoint is read once
def checkpoint_model_config(source: str) -> ModelConfig:
    """The backbone configuration stored with ``--init_from``."""
    if _is_hf(source):
        from transformers import GPT2Config

        from architectures.gpt2 import config_from_hf
        from datamodules.corpora import hub_reachable

        name = source.removeprefix("hf:")
        try:
            hf = GPT2Config.from_pretrained(name, local_files_only=not pathlib.Path(name).is_dir() and not hub_reachable())
        except OSError as err:
            raise FileNotFoundError(f"init_from: Hugging Face config of {name!r} is not cached and the Hub is "
                                    "unreachable; pass a local folder with config.json + model.safetensors") from err
        return config_from_hf(hf)
    path = pathlib.Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"init_from: {source} is neither a checkpoint file, 'hf:<id>' nor a Hugging Face folder")
    from model_tools.weights import read_checkpoint

    blob = read_checkpoint(path, "init_from")
    model = (blob.get("hyper_parameters") or {}).get("model")
    if not model:
        raise ConfigError(f"init_from: {path} holds no model configuration (hyper_parameters.model); "
                          "use a checkpoint written by experiments.run")
    return ModelConfig.from_dict(model)


def backbone_config(cfg: Namespace, vocab_size: int) -> ModelConfig:
    """The backbone to build: the ``--init_from`` source's own config for its variant, else the command's
    variant with the source's shape (or the command's config without a source)."""
    from architectures.registry import apply_preset

    cli = apply_preset(ModelConfig.from_dict(cfg.model.as_dict() if isinstance(cfg.model, Namespace) else dict(cfg.model)))
    source = checkpoint_model_config(cfg.init_from) if cfg.init_from else None
    if source is None:
        built = dataclasses.replace(cli, vocab_size=vocab_size)
    elif source.variant == cli.variant:
        built = source  # the checkpoint's own variant: every setting as it was trained
    else:
        built = dataclasses.replace(cli, **{f: getattr(source, f) for f in SHAPE_FIELDS})
    built = dataclasses.replace(built, dropout=cfg.dropout).resolve()
    if vocab_size > built.vocab_size:
        raise ConfigError(f"tokenizer: {vocab_size} tokens do not fit the backbone's vocabulary of {built.vocab_size}; "
                          "pass the --tokenizer the checkpoint was trained with")
    return built


def load_backbone(model, init_from: str, strict: bool = False, min_share: float = 0.5, tokenizer=None) -> None:
    """``--init_from`` into the backbone, with the table of loaded / mapped / unused / new tensors
    (a checkpoint of the same variant loads by name; a vanilla one through the variant's mapping)."""
    from model_tools.weights import load_initial_weights

    fingerprint = f"{tokenizer.name}:{tokenizer.fingerprint}" if tokenizer is not None else None
    load_initial_weights(model, init_from, strict=strict, min_share=min_share, tokenizer=fingerprint)


def load_task_head(module, init_from: str, spec) -> None:
    """``--eval_only`` on GLUE: the classification head must come from the checkpoint (a fresh head
    would measure nothing), so it must be a checkpoint fine-tuned on this task."""
    from model_tools.weights import read_checkpoint

    if _is_hf(init_from):
        raise ConfigError(f"eval_only: {init_from} has no trained {spec.slug} classification head; fine-tune first "
                          "(--save_checkpoint true) and evaluate that checkpoint")
    blob = read_checkpoint(init_from, "init_from")
    state = blob.get("state_dict", blob)
    head = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    task = (blob.get("hyper_parameters") or {}).get("task")
    if not head or (task and task != spec.name):
        raise ConfigError(f"eval_only: {init_from} has no trained {spec.slug} classification head (its task: "
                          f"{task or 'none'}); fine-tune on {spec.slug} with --save_checkpoint true and evaluate that")
    module.head.load_state_dict(head)


def finetune_record(init_from: Optional[str]) -> Optional[Dict[str, Any]]:
    """What a fine-tuned checkpoint records (``FINETUNE_RECORD``: its task and the tokenizer's source), or None
    for any other source (a pre-training checkpoint, Hugging Face weights, a fine-tuned checkpoint from
    before the record)."""
    if not init_from or _is_hf(init_from) or not pathlib.Path(init_from).is_file():
        return None
    from model_tools.weights import read_checkpoint

    record = read_checkpoint(init_from, "init_from").get(FINETUNE_RECORD)
    return record if isinstance(record, dict) else None


def tokenizer_source(spec: Optional[str], init_from: Optional[str]) -> Dict[str, Any]:
    """Where the run's tokenizer comes from: ``--tokenizer``, else the one a fine-tuned ``--init_from`` recorded,
    else the one in the pre-training run's config (config.yaml next to checkpoints/), else gpt2. The corpus
    (and its cache folder) is what a ``bpe`` tokenizer is trained on."""
    from datamodules.files import default_cache_dir

    record = finetune_record(init_from)
    if record and isinstance(record.get("tokenizer"), dict):
        recorded = dict(record["tokenizer"])
        return recorded if spec is None else {**recorded, "spec": spec}
    source = {"spec": spec, "corpus": "embedded", "corpus_path": [], "cache_dir": str(default_cache_dir())}
    if init_from and not _is_hf(init_from):
        run_config = pathlib.Path(init_from).resolve().parent.parent / "config.yaml"
        if run_config.is_file():
            import yaml

            data = (yaml.safe_load(run_config.read_text()) or {}).get("data", {})
            source["corpus"], source["corpus_path"] = data.get("name", "embedded"), data.get("path") or []
            if data.get("cache_dir"):
                source["cache_dir"] = str(data["cache_dir"])
            if spec is None:
                source["spec"] = data.get("tokenizer") or _corpus_default_tokenizer(
                    source["corpus"], source["corpus_path"], pathlib.Path(source["cache_dir"]))
    source["spec"] = source["spec"] or "gpt2"
    return source


def build_tokenizer(source: Dict[str, Any]):
    from datamodules.catalog import get_corpus
    from datamodules.tokenizer import get_tokenizer

    cache_dir = pathlib.Path(source["cache_dir"])
    corpus = None
    if source["spec"] == "bpe":  # the BPE is trained on (and cached with) its corpus
        corpus = get_corpus(source["corpus"], path=source["corpus_path"], cache_dir=cache_dir)
    return get_tokenizer(source["spec"], cache_dir, corpus)


def resolve_tokenizer(spec: Optional[str], init_from: Optional[str]):
    """The run's tokenizer (``tokenizer_source``)."""
    return build_tokenizer(tokenizer_source(spec, init_from))


def check_init_from(cfg: Namespace, tasks: List[str]) -> None:
    """Before the tokenizer and the data are built, with ``--eval_only``: a checkpoint fine-tuned on another
    task (or, for GLUE, one with no classification head) gets its own line instead of surfacing later as a
    tokenizer or head error. (A missing or unreadable ``--init_from`` was refused by ``validate_up_front``:
    ``weights.check_source``.)"""
    if not cfg.init_from or _is_hf(cfg.init_from) or not cfg.eval_only:
        return
    if cfg.max_steps is not None or cfg.epochs is not None:
        print("warning: --eval_only trains nothing, so --max_steps / --epochs are ignored", file=sys.stderr)
    from model_tools.weights import read_checkpoint

    blob = read_checkpoint(cfg.init_from, "init_from")
    record = finetune_record(cfg.init_from)
    fine_tuned = (blob.get("hyper_parameters") or {}).get("task")  # GLUE checkpoints from before the record
    task = (record or {}).get("task") or (f"glue/{fine_tuned}" if fine_tuned else None)
    if task and task != tasks[0]:
        raise ConfigError(f"eval_only: {cfg.init_from} was fine-tuned on {task}, not {tasks[0]}; pass --task {task} "
                          f"or a checkpoint fine-tuned on {tasks[0]}")
    if tasks[0].startswith("glue/") and not any(k.startswith("head.") for k in blob.get("state_dict", {})):
        raise ConfigError(f"eval_only: {cfg.init_from} has no trained {tasks[0]} classification head (a "
                          f"pre-training checkpoint?); fine-tune on {tasks[0]} with --save_checkpoint true and "
                          "evaluate that checkpoint")


def record_finetune(task: str, tokenizer: Dict[str, Any], resume: Dict[str, Any]):
    """A Lightning callback: every fine-tuned checkpoint records its task and tokenizer source under
    ``FINETUNE_RECORD``, so ``--eval_only --init_from`` it finds its tokenizer and refuses another task, and what a
    resumed run must share with it besides the module's hyperparameters (``resume_record``)."""
    import lightning as L

    class RecordFinetune(L.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            checkpoint[FINETUNE_RECORD] = {"task": task, "tokenizer": dict(tokenizer),
                                           "resume": {**resume, **trainer_record(trainer)}}

    return RecordFinetune()


def _corpus_default_tokenizer(name: str, path, cache_dir: pathlib.Path) -> str:
    from datamodules.catalog import get_corpus

    try:
        return get_corpus(name, path=path, cache_dir=cache_dir).default_tokenizer
    except DataError:  # a Hub corpus that is offline now: those all default to gpt2
        return "gpt2"


# ---------------------------------------------------------------------------- training
def default_precision() -> str:
    import torch

    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def make_trainer(cfg: Namespace, save_dir: pathlib.Path, name: str, version: str, epochs: int, task: str):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from callbacks.preemption import PreemptionCheckpoint, slurm_requeue_job
    from experiments.run import slurm_environment
    from lightning_modules.rng_state import KeepRandomStream
    from lightning_modules.storage import atomic_checkpoint_io

    devices = cfg.trainer.devices
    # the stop's checkpoint; not requeued (the requeued command would start over without --ckpt_path last), but
    # under SLURM Lightning's auto-requeue is off too: it saved mid-step inside the signal handler
    preemption = PreemptionCheckpoint(pathlib.Path(save_dir, name, version) / "checkpoints", PREEMPTION_CHECKPOINT)
    record = record_finetune(task, getattr(cfg, "tokenizer_source", None) or {}, resume_record(cfg, task))
    return L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=int(devices) if str(devices).isdigit() else devices,
        precision=cfg.trainer.precision or default_precision(),
        max_epochs=-1 if cfg.max_steps else epochs,  # --max_steps overrides the epochs (the LR schedule too)
        max_steps=cfg.max_steps or -1,
        gradient_clip_val=1.0,
        logger=TensorBoardLogger(save_dir=str(save_dir), name=name, version=version, default_hp_metric=False),
        enable_checkpointing=cfg.save_checkpoint,
        # synced temp file in the checkpoint folder, then renamed (issue 20)
        plugins=[atomic_checkpoint_io(), *slurm_environment(slurm_requeue_job())],
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        callbacks=[preemption, record, KeepRandomStream()],  # a resume continues the dropout stream too
    )


def optim_settings(cfg: Namespace, total_steps: int) -> Dict[str, Any]:
    return {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "beta2": 0.999, "min_lr_ratio": 0.0,
            "warmup_steps": int(cfg.warmup_ratio * total_steps)}


def total_steps(cfg: Namespace, train_size: int, epochs: int, world: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    return epochs * math.ceil(train_size / (cfg.data.batch_size * world))


def build_module(module_cls, cfg: Namespace, run_tokenizer, **kwargs):
    import lightning as L

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    mcfg = backbone_config(cfg, run_tokenizer.vocab_size)
    module = module_cls(model=mcfg.to_dict(), **kwargs)
    if cfg.init_from:
        load_backbone(module.model, cfg.init_from, strict=cfg.init_strict, min_share=cfg.init_min_share,
                      tokenizer=run_tokenizer)
    from model_tools.compiling import compile_model

    compile_model(module.model, cfg.compile)
    return module, mcfg


def run_glue_task(cfg: Namespace, task: str, tokenizer, save_dir: pathlib.Path, name: str,
                  version: str) -> Tuple[Dict[str, Any], Optional[int]]:
    """The task's results, and a preemption signal that came during its final evaluation (noted: the task
    finished) or None."""
    from datamodules.glue import GlueDataModule, get_task
    from lightning_modules.glue import GlueModule, glue_score, split_prefix

    spec = get_task(task)
    epochs = cfg.epochs or 3
    start = time.time()
    probe = backbone_config(cfg, tokenizer.vocab_size)
    data = GlueDataModule(task, tokenizer, max_length=min(cfg.data.max_length or probe.block_size, probe.block_size),
                          batch_size=cfg.data.batch_size, path=cfg.data.path,
                          drop_empty=cfg.data.drop_empty, max_train_examples=cfg.data.max_train_examples,
                          max_eval_examples=cfg.data.max_eval_examples, seed=cfg.seed, num_workers=cfg.data.num_workers)
    data.setup("validate" if cfg.eval_only else "fit")
    trainer = make_trainer(cfg, save_dir, name, version, epochs, task=spec.slug)
    steps = 1 if cfg.eval_only else total_steps(cfg, len(data.train_set), epochs, trainer.world_size)
    module, mcfg = build_module(GlueModule, cfg, tokenizer, task=spec.name, optim=optim_settings(cfg, steps),
                                max_steps=steps, head_dropout=cfg.dropout)
    if cfg.eval_only:
        load_task_head(module, cfg.init_from, spec)
    else:
        fit(trainer, module, data, cfg, pathlib.Path(save_dir, name, version), spec.slug)
    final = trainer.validate(module, datamodule=data, verbose=False)
    if trainer.is_global_zero:  # predictions of every rank, gathered by the module
        module.write_predictions(pathlib.Path(trainer.logger.log_dir), data.val_sets, tokenizer.decode, tokenizer.eot_id)
    logged = {k: float(v) for k, v in (final[0] if final else {}).items()}
    splits = {}
    for split in spec.val_splits:
        prefix = split_prefix(split)
        splits[split] = {m: logged[f"{prefix}/{m}"] for m in spec.metrics}
    scores = [glue_score(spec, values) for values in splits.values()]
    return {
        "task": spec.slug, "variant": mcfg.variant, "metrics": splits, "score": sum(scores) / len(scores),
        "train_examples": len(data.train_set or []), "eval_examples": {s: len(d) for s, d in data.val_sets.items()},
        "steps": trainer.global_step, "seconds": round(time.time() - start, 1), "init_from": cfg.init_from, "eval_only": cfg.eval_only,
        "log_dir": trainer.logger.log_dir,
    }, noted_signal(trainer)


def noted_signal(trainer) -> Optional[int]:
    """A signal the task's preemption callback noted on any rank (every rank calls this: under DDP the ranks agree,
    as they do on a stop, since the signal may have reached one rank only)."""
    import torch

    from callbacks.preemption import PreemptionCheckpoint

    noted = next((c.noted for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None) or 0
    if trainer.world_size > 1:
        flag = torch.tensor([float(noted)], device=trainer.strategy.root_device)
        noted = int(trainer.strategy.reduce(flag, reduce_op="max").item())
    return noted or None


def run_xsum(cfg: Namespace, tokenizer, save_dir: pathlib.Path, name: str, version: str) -> Dict[str, Any]:
    from datamodules.xsum import XSumDataModule
    from lightning_modules.xsum import ROUGE_KEYS, XSumModule

    epochs = cfg.epochs or 1
    start = time.time()
    probe = backbone_config(cfg, tokenizer.vocab_size)
    data = XSumDataModule(tokenizer, probe.block_size, batch_size=cfg.data.batch_size, path=[cfg.data.path] if cfg.data.path else None,
                          max_new_tokens=cfg.max_new_tokens, eval_split=cfg.eval_split, drop_empty=cfg.data.drop_empty,
                          max_train_examples=cfg.data.max_train_examples, max_eval_examples=cfg.data.max_eval_examples,
                          eval_batch_size=cfg.data.eval_batch_size, seed=cfg.seed, num_workers=cfg.data.num_workers)
    data.setup("validate" if cfg.eval_only else "fit")
    trainer = make_trainer(cfg, save_dir, name, version, epochs, task="xsum")
    steps = 1 if cfg.eval_only else total_steps(cfg, len(data.train_set), epochs, trainer.world_size)
    module, mcfg = build_module(XSumModule, cfg, tokenizer, optim=optim_settings(cfg, steps), max_steps=steps,
                                eot_id=tokenizer.eot_id, num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens,
                                length_penalty=cfg.length_penalty, rouge_stemmer=cfg.rouge_stemmer, tokenizer=tokenizer)
    if not cfg.eval_only:
        fit(trainer, module, data, cfg, pathlib.Path(save_dir, name, version), "xsum")
    val = trainer.validate(module, datamodule=data, verbose=False)
    test = trainer.test(module, dataloaders=data.test_dataloader(), verbose=False)
    rouge = {k: float(test[0][f"test/{k}"]) for k in ROUGE_KEYS} if test else {}
    run_dir = pathlib.Path(trainer.logger.log_dir)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / "predictions.jsonl").open("w", encoding="utf-8") as handle:
            for row in module.predictions:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {
        "task": "xsum", "variant": mcfg.variant, "rouge": rouge, "eval_split": cfg.eval_split,
        "val_summary_loss": float(val[0]["val/loss"]) if val and "val/loss" in val[0] else None,
        "decoding": "greedy" if cfg.num_beams == 1 else f"beam{cfg.num_beams}", "max_new_tokens": cfg.max_new_tokens,
        "train_examples": len(data.train_set or []), "eval_examples": len(data.eval_set), "steps": trainer.global_step,
        "seconds": round(time.time() - start, 1), "init_from": cfg.init_from, "eval_only": cfg.eval_only, "log_dir": str(run_dir),
    }


# ---------------------------------------------------------------------------- the GLUE table
def glue_table(results: List[Dict[str, Any]]) -> str:
    lines = ["| task | metrics (x100) | score |", "|---|---|---|"]
    for r in results:
        parts = []
        for split, values in r["metrics"].items():
            tag = "" if split == "validation" else split.replace("validation_", "") + " "
            parts += [f"{tag}{m} {100 * v:.2f}" for m, v in values.items()]
        lines.append(f"| {r['task']} | {', '.join(parts)} | {100 * r['score']:.2f} |")
    if results:
        mean = sum(r["score"] for r in results) / len(results)
        lines.append(f"| average ({len(results)} tasks) | | {100 * mean:.2f} |")
    return "\n".join(lines) + "\n"


def write_json(path: pathlib.Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> pathlib.Path:
    parser = build_parser()
    cfg = parse_with_presets(parser, expand_aliases(list(sys.argv[1:] if argv is None else argv), ALIASES))
    validate_up_front(cfg)
    tasks = task_list(cfg.task)
    check_init_from(cfg, tasks)
    check_task_files(cfg, tasks)
    label = "glue-all" if len(tasks) > 1 else tasks[0].replace("/", "-")
    root = pathlib.Path(cfg.log_dir) / f"{label}-{cfg.model.variant}"
    version = run_version(cfg, tasks, root)  # before the tokenizer: a refusal costs nothing
    cfg.tokenizer_source = tokenizer_source(cfg.tokenizer, cfg.init_from)  # recorded in fine-tuned checkpoints
    tokenizer = build_tokenizer(cfg.tokenizer_source)
    version = version or claim_next_version(root)  # exclusively: two jobs started at once took one folder
    os.environ[VERSION_ENV] = version  # DDP re-launches this command once per rank: they inherit the folder
    run_dir = root / version
    from callbacks.preemption import time_limit_warning_noted

    try:
        with time_limit_warning_noted():  # SLURM's SIGUSR1 never kills the run: it stops it with a checkpoint
            run_tasks(cfg, tasks, tokenizer, root, version)
    except BaseException:
        release_if_empty(run_dir)  # failed before anything was written: no empty run folder is left
        raise
    finally:
        os.environ.pop(VERSION_ENV, None)
    print(run_dir)
    return run_dir


def run_tasks(cfg: Namespace, tasks: List[str], tokenizer, root: pathlib.Path, version: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    run_dir = root / version
    if len(tasks) == 1:
        if tasks == ["xsum"]:
            result = run_xsum(cfg, tokenizer, root, "", version)
        else:
            result, _ = run_glue_task(cfg, tasks[0], tokenizer, root, "", version)  # a noted signal: it finished
        if rank_zero_only.rank == 0:
            write_json(run_dir / "results.json", result)
            drop_stop_checkpoint(run_dir)
        return
    results = finished_rows(run_dir) if cfg.ckpt_path else []  # a resumed glue/all keeps its finished tasks
    for task in tasks[len(results):]:
        result, noted = run_glue_task(cfg, task, tokenizer, run_dir, task.split("/")[1], "")
        results.append(result)
        if rank_zero_only.rank == 0:  # rewritten after every task: a later failure keeps the finished rows
            write_json(run_dir / "glue_results.json", results)
            (run_dir / "glue_results.md").write_text(glue_table(results))
            drop_stop_checkpoint(task_folder(run_dir, tasks, task))
        if noted and len(results) < len(tasks):
            stop_between_tasks(noted, task, tasks[len(results)])


def stop_between_tasks(signum: int, task: str, following: str) -> None:
    """A preemption signal came during a task's final evaluation: the task finished, its row is written, and the
    run stops before the next task (exit status 128 + signal; ``--ckpt_path last`` resumes at that task), every DDP
    rank alike (``noted_signal``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from callbacks.preemption import preempted_status

    rank_zero_info(f"preemption: signal {signum} received during {task}'s final evaluation; stopping before "
                   f"{following} (resume with --ckpt_path last)")
    raise SIGTERMException(preempted_status(signum))


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
