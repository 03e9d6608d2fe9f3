"""Train any registered variant: ``python -m experiments.run --variant mod``.

With no options it trains the ``tiny`` vanilla model on the embedded corpus (no network) in a few
minutes on a laptop CPU. Every field is overridable from the command line:

    --variant, --size             -> model.variant, model.size
    --data NAME, --tokenizer T    -> data.name, data.tokenizer
    --max_steps N                 -> trainer.max_steps
    --max_train_flops F           stop at the first step whose cumulative measured training FLOPs reach F
                                  (--max_steps stays a hard cap; docs/compute-budget.md)
    --model.mod.capacity 0.25     (any ModelConfig field, nested groups too)
    --optim.lr 3e-4, --data.batch_size 32, --trainer.devices 2, --trainer.strategy ddp, ...
    --config FILE.yaml            (e.g. experiments/configs/mod.yaml), --print_config

The same command runs under DDP (Lightning re-launches it once per rank, so everything before the
Trainer is deterministic), on SLURM (``srun python -m experiments.run ...``) and with torchrun.
Run folder: ``<log_dir>/<variant>-<size>/version_<N>`` with TensorBoard events, ``config.yaml``
(the resolved config), ``checkpoints/{last,best-*}.ckpt``, ``summary.json`` and ``provenance.json`` (the
code commit, whether the tree was dirty, library versions: analysis/provenance.py). The folder path is
the last line printed.

Exit status: 0 when the run finished; 2 for a user mistake (one ``error: ...`` line on stderr naming the
option or file, nothing written that looks like a run); 128 + signal (143 SIGTERM, 138 SIGUSR1) when a
preemption signal stopped it after saving ``checkpoints/last.ckpt`` (resume with ``--ckpt_path last``).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import pathlib
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# Keep stdout clean and start-up fast before the heavy imports. Lightning (~5 s: it imports torch._dynamo,
# torchmetrics, and through them transformers and scipy) is imported by the functions that need it, so that
# ``import experiments.run`` for its helpers (``model_config``, ``expand_aliases``) costs torch and the suite only.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # noqa: E402

from architectures import ModelConfig, variant_names  # noqa: E402
from architectures.checkpointing import parse_policy, set_activation_checkpointing  # noqa: E402
from architectures.config import ConfigError, SIZES, SharedModelConfig, config_groups, flatten  # noqa: E402
from architectures.registry import check_groups_read, check_options_used  # noqa: E402
from callbacks import MAX_PROBE_LEVELS, CallbacksConfig, config_from as callbacks_config  # noqa: E402
from datamodules.catalog import REQUIRED_TOKENIZER, corpus_names, ignored_data_options  # noqa: E402
from datamodules.corpora import DataError  # noqa: E402
from lightning_modules.storage import StorageError, atomic_checkpoint_io, check_writable, claim_next_version  # noqa: E402
from lightning_modules.storage import is_storage_error, release_unstarted, remove_killed_checkpoint_writes  # noqa: E402
from lightning_modules.storage import storage_message  # noqa: E402
from lightning_modules.run_clock import mark_run_start  # noqa: E402
from datamodules.probe_labels import check_label_file, label_file_levels, too_few_levels  # noqa: E402
from lightning_modules.flops_budget import require_counted_flops, validate_budget  # noqa: E402

ALIASES = {
    "--variant": "--model.variant",
    "--size": "--model.size",
    "--data": "--data.name",
    "--tokenizer": "--data.tokenizer",
    "--max_steps": "--trainer.max_steps",
    "--batch_size": "--data.batch_size",
}

DEFAULT_VAL_BLOCKS = 320  # the blocks the old default (20 batches of the default data.batch_size 16) evaluated

# Trainer arguments that the run wires itself (logger, callbacks) or that jsonargparse cannot type.
_TRAINER_SKIP = {"logger", "callbacks", "plugins", "profiler", "strategy", "accelerator", "precision", "devices"}


def expand_aliases(argv: Sequence[str], aliases: Optional[Dict[str, str]] = None) -> List[str]:
    """Rewrite short options (``--variant mod``, ``--size=tiny``) to their canonical nested names."""
    aliases = ALIASES if aliases is None else aliases
    out = []
    for arg in argv:
        head, sep, tail = arg.partition("=")
        out.append(aliases.get(head, head) + sep + tail if sep else aliases.get(arg, arg))
    return out


# float options whose every value must reach the option's own check (which names the option and what it takes):
# Python's spellings of infinity and NaN get YAML's, which the parser reads as floats
_FINITE_FLOAT_OPTIONS = ("--max_train_flops",)


def join_option_values(argv: Sequence[str]) -> List[str]:
    """``--option -1e12`` -> ``--option=-1e12``: argparse takes ``-1e12`` and ``-inf`` (not ``-1``) for an option
    and reports "expected one argument"; joined, the value reaches the option's own check and its message. The
    options above are joined with any value, and ``inf`` / ``-inf`` / ``nan`` become ``.inf`` / ``-.inf`` / ``.nan``
    (the parser refused Python's spellings with a dump of its union types)."""
    out: List[str] = []
    for arg in argv:
        option = out[-1] if out and out[-1].startswith("--") and "=" not in out[-1] else None
        if option and (_is_negative_number(arg) or (option in _FINITE_FLOAT_OPTIONS and not arg.startswith("--"))):
            out[-1] = f"{option}={arg}"
        else:
            out.append(arg)
    return [_yaml_float_spelling(arg) for arg in out]


def _is_negative_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return arg.startswith("-")


def _yaml_float_spelling(arg: str) -> str:
    head, sep, value = arg.partition("=")
    word = value.strip().lower()
    if not sep or head not in _FINITE_FLOAT_OPTIONS or word.lstrip("+-") not in ("inf", "infinity", "nan"):
        return arg
    return f"{head}={'-' if word.startswith('-') else ''}{'.nan' if word.endswith('nan') else '.inf'}"


def default_precision() -> str:
    import torch

    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def build_parser() -> ArgumentParser:
    from datamodules.lm import DataConfig
    from lightning_modules.lm import OptimConfig

    parser = ArgumentParser(
        prog="python -m experiments.run",
        description="Train a dynamic-computation Transformer variant. Aliases: "
        + ", ".join(f"{k} = {v}" for k, v in ALIASES.items()),
        default_env=False,
        exit_on_error=False,  # parse errors reach cli(): one line, exit status 2
    )
    add_run_options(parser)
    add_model_arguments(parser)
    parser.add_class_arguments(DataConfig, "data")
    parser.add_class_arguments(OptimConfig, "optim")
    parser.add_class_arguments(CallbacksConfig, "callbacks")
    add_trainer_arguments(parser)
    return parser


def add_run_options(parser: ArgumentParser) -> None:
    """The options outside the config groups: seed, folders, resume and initial weights, budget, validation,
    compiling and activation checkpointing."""
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--log_dir", type=str, default="runs")
    parser.add_argument("--version", type=Optional[str], default=None,
                        help="run folder name (default: next version_N; under SLURM slurm-<job id>)")
    parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                        help="resume: a checkpoint path, or 'last' for the newest last.ckpt of this variant-size")
    parser.add_argument("--init_from", type=Optional[str], default=None,
                        help="initialise weights from a vanilla checkpoint, 'hf:gpt2' or a local HF folder")
    parser.add_argument("--init_strict", type=bool, default=True,
                        help="refuse --init_from when its tokenizer differs or it initialises less than "
                        "--init_min_share of the parameters")
    parser.add_argument("--init_min_share", type=float, default=0.5,
                        help="smallest share of the model's parameters outside the embeddings --init_from must "
                             "initialise (strict mode)")
    parser.add_argument("--max_train_flops", type=Optional[float], default=None,
                        help="training budget in measured FLOPs (routing-aware, every rank and micro-batch): stop at "
                        "the first step that reaches it; the LR cosine follows the share spent; --max_steps stays a "
                        "hard cap (docs/compute-budget.md)")
    parser.add_argument("--val_every", type=int, default=100, help="validate every N optimisation steps")
    parser.add_argument("--val_blocks", type=Optional[int], default=None,
                        help=f"blocks each validation evaluates per validation set (the first N; default "
                        f"{DEFAULT_VAL_BLOCKS}), in all: split across the ranks, so the loss is the same for any "
                        "number of processes and any data.batch_size")
    parser.add_argument("--val_batches", type=Optional[int], default=None,
                        help="deprecated: --val_blocks N x data.batch_size (the count then depended on the "
                        "per-rank batch)")
    parser.add_argument("--compile", type=bool, default=False,
                        help="torch.compile the model in place (names and checkpoints unchanged)")
    parser.add_argument("--activation_checkpointing", type=str, default="none",
                        help="none | blocks | every_k:N: recompute the blocks' activations in backward "
                        "(routing replayed exactly; docs/scale.md)")


def add_trainer_arguments(parser: ArgumentParser) -> None:
    """``--trainer.*``: Lightning's Trainer options, less those the run wires itself, with the run's defaults."""
    from lightning import Trainer

    parser.add_class_arguments(Trainer, "trainer", skip=_TRAINER_SKIP, fail_untyped=False)
    parser.add_argument("--trainer.accelerator", type=str, default="auto")
    parser.add_argument("--trainer.devices", type=str, default="auto")
    parser.add_argument("--trainer.strategy", type=str, default="auto")
    parser.add_argument("--trainer.precision", type=Optional[str], default=None,
                        help="default: bf16-mixed on a bf16-capable GPU, else 32-true")
    parser.set_defaults({
        "trainer.max_steps": 300,
        "trainer.gradient_clip_val": 1.0,
        "trainer.log_every_n_steps": 10,
        "trainer.num_sanity_val_steps": 0,
        "trainer.use_distributed_sampler": False,
        "trainer.enable_model_summary": False,
    })


def add_model_arguments(parser: ArgumentParser, prefix: str = "model") -> None:
    """``--model.<field>`` for the shared fields and ``--model.<group>.<field>`` for every registered group; a
    run's config keeps only its variant's groups, and options of the others are refused (``check_groups_read``)."""
    parser.add_class_arguments(SharedModelConfig, prefix)
    for group, cls in config_groups().items():
        parser.add_class_arguments(cls, f"{prefix}.{group}")


def validate_up_front(cfg: Namespace, argv: Sequence[str] = ()) -> None:
    """Fail before any work: unknown names list the valid ones, bad values name the field. ``argv`` (the command
    line, when there is one) makes an option of a group the variant does not read an error even at its default."""
    if cfg.model.variant not in variant_names():
        raise ConfigError(f"model.variant: unknown variant {cfg.model.variant!r}; valid variants: {', '.join(variant_names())}")
    if cfg.model.size not in SIZES:
        raise ConfigError(f"model.size: unknown size {cfg.model.size!r}; valid sizes: {', '.join(SIZES)}")
    if cfg.data.name not in corpus_names():
        raise DataError(f"data.name: unknown dataset {cfg.data.name!r}; valid datasets: {', '.join(corpus_names())}")
    if cfg.trainer.max_steps is None or cfg.trainer.max_steps <= 0:
        raise ConfigError(f"trainer.max_steps: must be a positive integer, got {cfg.trainer.max_steps}")
    validate_budget(cfg.max_train_flops)
    if cfg.max_train_flops is not None and cfg.optim.schedule_steps is not None:
        raise ConfigError("optim.schedule_steps: cannot be combined with max_train_flops (the cosine then ends where "
                          "the FLOPs budget is spent); drop one of them")
    if cfg.val_every <= 0:
        raise ConfigError(f"val_every: must be a positive integer, got {cfg.val_every}")
    if not 0.0 <= cfg.init_min_share <= 1.0:
        raise ConfigError(f"init_min_share: must be in [0, 1], got {cfg.init_min_share}")
    resolve_val_blocks(cfg)
    parse_policy(cfg.activation_checkpointing)
    from datamodules.lm import DataConfig
    from lightning_modules.lm import OptimConfig

    DataConfig(**_as_dict(cfg.data)).validate()
    OptimConfig(**_as_dict(cfg.optim)).validate()
    callbacks_config(cfg).validate(model_config(cfg).resolve().block_size)
    if cfg.data.labels:  # its levels against --callbacks.probe_levels; its length once the token cache exists
        check_label_file(cfg.data.labels, callbacks_config(cfg).probe_levels)
    check_probe_levels(cfg.data.name, callbacks_config(cfg).probe_levels)
    given = [head.removeprefix("--model.") for head in (item.partition("=")[0] for item in argv)
             if head.startswith("--model.")]
    check_groups_read(cfg.model.variant, _as_dict(cfg.model), given)
    model_config(cfg).resolve()
    check_options_used(model_config(cfg))
    check_data_options(cfg.data)


def resolve_val_blocks(cfg: Namespace) -> None:
    """Set ``cfg.val_blocks`` (a global count of blocks) from the deprecated ``--val_batches`` (N batches of
    ``data.batch_size`` blocks: the blocks it evaluated on one process) or the default; ``val_batches`` is
    then None, so ``config.yaml`` records the count in blocks only."""
    for name in ("val_blocks", "val_batches"):
        if cfg[name] is not None and cfg[name] <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {cfg[name]}")
    if cfg.val_batches is not None:
        if cfg.val_blocks is not None:
            raise ConfigError("val_batches: deprecated alias of --val_blocks, and both are set; keep only --val_blocks")
        cfg.val_blocks = cfg.val_batches * cfg.data.batch_size
        print(f"warning: --val_batches is deprecated; it now means --val_blocks {cfg.val_blocks} (val_batches x "
              "data.batch_size: a global count of blocks, the same for any number of processes); use --val_blocks",
              file=sys.stderr)
        cfg.val_batches = None
    elif cfg.val_blocks is None:
        cfg.val_blocks = DEFAULT_VAL_BLOCKS


def check_data_options(data: Namespace) -> None:
    """Refuse data options the dataset does not read (``--data probe/arith --data.path X`` would ignore the path)
    and a tokenizer it cannot be read with (the probe data are byte ids), before the data are built."""
    required = REQUIRED_TOKENIZER.get(data.name)
    if required is not None and data.tokenizer not in (None, required):
        raise DataError(f"data.tokenizer: dataset {data.name!r} needs the byte-level {required!r} tokenizer, got "
                        f"{data.tokenizer!r}; drop --tokenizer")
    ignored = ignored_data_options(data.name, _as_dict(data))
    if ignored:
        option, users = ignored[0]
        raise DataError(f"data.{option}: dataset {data.name!r} does not read this option; it applies to "
                        f"{', '.join(users)}; drop it or choose one of those datasets")


def check_sources_up_front(cfg: Namespace) -> None:
    """The argument errors about files and the Hub, found in seconds: before the corpus and tokenizer are
    built (which takes minutes for a large corpus). ``--init_from`` must be readable (or cached / reachable
    on the Hub), ``--ckpt_path`` must exist, be readable and match the command's model settings; the data
    and tokenizer fingerprints are compared again once they are known (``train``)."""
    if cfg.init_from:
        from model_tools.weights import check_source

        check_source(cfg.init_from)
    folder = run_root(cfg.log_dir, model_config(cfg)) / cfg.version if cfg.version else None
    if folder is not None and folder.exists() and not folder.is_dir():
        raise ConfigError(f"version: {folder} is a file, not a run folder; choose another --version")
    if cfg.ckpt_path:
        mcfg = model_config(cfg).resolve()
        model = {k: v for k, v in flatten(mcfg.to_dict()).items() if k != "vocab_size"}  # from the tokenizer
        resolve_ckpt(cfg, run_root(cfg.log_dir, mcfg), {"model": model}, notes=False)


def without_ignored_options(argv: Sequence[str], parser: ArgumentParser) -> Tuple[List[str], Optional[str], List[str]]:
    """(``argv`` without the model options its variant does not use, the variant, the dropped option names).

    For commands built for several variants at once (sweeps, reproduction grids); a command line a user
    typed is refused instead (``check_groups_read``, ``check_options_used``). Options from ``--config`` files are
    not dropped."""
    from architectures.registry import get_variant, uses_option

    argv, canonical = list(argv), expand_aliases(list(argv))  # item for item
    try:
        variant = parser.parse_args(canonical).model.variant
        used = get_variant(variant).model_class().config_groups
    except (SystemExit, argparse.ArgumentError, ConfigError, TypeError, ValueError):
        return argv, None, []  # validation reports it

    def ignored(head: str) -> bool:  # "--model.mod.capacity", or a whole group "--model.mod"
        group, _, field = head.removeprefix("--model.").partition(".")
        if not head.startswith("--model.") or group not in config_groups():
            return False
        return not uses_option(variant, f"{group}.{field}") if field else group not in used

    kept, dropped, skip = [], [], False
    for i, (item, name) in enumerate(zip(argv, canonical)):
        head = name.partition("=")[0]
        if skip:
            skip = False
        elif ignored(head):
            dropped.append(head)
            skip = "=" not in item and i + 1 < len(argv)  # "--key value": drop the value too
        else:
            kept.append(item)
    return kept, variant, dropped


def run_root(log_dir: str, mcfg: ModelConfig) -> pathlib.Path:
    """``<log_dir>/<variant>-<size>``: the folder that holds this variant-size's run folders."""
    return pathlib.Path(log_dir) / f"{mcfg.variant}-{mcfg.size}"


def _as_dict(ns) -> Dict[str, Any]:
    return ns.as_dict() if isinstance(ns, Namespace) else dict(ns)


def model_config(cfg: Namespace, vocab_size: Optional[int] = None) -> ModelConfig:
    from architectures.registry import apply_preset

    config = apply_preset(ModelConfig.from_dict(_as_dict(cfg.model)))
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    return config


def resolved_namespace(cfg: Namespace, mcfg: ModelConfig) -> Namespace:
    """The config as it actually ran: size defaults, preset and tokenizer vocabulary filled in, and of the model
    groups only those the variant reads."""
    resolved = cfg.clone()
    resolved.model = Namespace(**mcfg.resolve().to_dict())
    for group in mcfg.groups:
        resolved.model[group] = Namespace(**resolved.model[group])
    return resolved


def print_resolved_config(parser: ArgumentParser, cfg: Namespace) -> None:
    """``--print_config``: the config as the run uses it (size defaults, preset, ``val_blocks`` filled in), not the
    parser's raw defaults (``d_model: null`` for tiny). The vocabulary comes from the tokenizer, known only once
    the data are prepared: its line says so."""
    import re

    text = parser.dump(resolved_namespace(cfg, model_config(cfg).resolve()), skip_unset=False, skip_validation=True)
    tokenizer = cfg.data.tokenizer or f"the default of data.name {cfg.data.name}"
    note = f"  # placeholder: the run replaces it by the vocabulary size of the tokenizer ({tokenizer})"
    print(re.sub(r"^(  vocab_size: .*)$", lambda m: m.group(1) + note, text, count=1, flags=re.M), end="")


def fixed_version(cfg: Namespace, root: pathlib.Path, ckpt_path: Optional[str] = None) -> Optional[str]:
    """The run folder when it is decided by the command or the launcher: explicit, the resumed run's own
    folder, inherited from the launching rank, or the SLURM job (several tasks); None: a new folder."""
    if cfg.version:
        return cfg.version
    ckpt_path = ckpt_path or (cfg.ckpt_path if cfg.ckpt_path != "last" else None)
    if ckpt_path:
        ckpt = pathlib.Path(ckpt_path).resolve()
        if ckpt.parent.name == "checkpoints" and ckpt.parent.parent.parent == root.resolve():
            return ckpt.parent.parent.name  # resume in place: logs continue in the same folder
    if os.environ.get("DYNCOMP_RUN_VERSION"):
        return os.environ["DYNCOMP_RUN_VERSION"]
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_NTASKS", "1") != "1":
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return None


def run_version(cfg: Namespace, root: pathlib.Path, ckpt_path: Optional[str] = None) -> str:
    """Deterministic across ranks: ``fixed_version``, else the next free version_N, created exclusively
    (``claim_next_version``) so that jobs started at once (a sweep of 1-GPU SLURM jobs, two shells) each
    get their own folder. ``ckpt_path`` is the resolved checkpoint (``--ckpt_path last`` resolved)."""
    version = fixed_version(cfg, root, ckpt_path)
    if version is None:
        version = claim_next_version(root)
        os.environ["DYNCOMP_RUN_VERSION"] = version  # inherited by DDP ranks that Lightning re-launches
    return version


def resolve_ckpt(cfg: Namespace, root: pathlib.Path, expected: Optional[Dict[str, Any]] = None,
                 notes: bool = True) -> Optional[str]:
    """The checkpoint to resume, checked against the command (``expected``: ``run_fingerprints``, or only
    its ``model`` part before the data are known).

    ``last`` takes the newest ``last.ckpt`` under ``root`` among the runs trained with the same model,
    data and tokenizer (others are skipped, and named unless ``notes`` is False); an explicit path must
    match too. A FLOPs budget needs a checkpoint that counted its FLOPs: refused here, before anything is
    written (the module's own refusal comes after ``config.yaml`` would be rewritten)."""
    path = _matching_ckpt(cfg, root, expected, notes)
    if path is not None and cfg.max_train_flops is not None:
        from model_tools.weights import read_checkpoint

        require_counted_flops(read_checkpoint(path, "ckpt_path"))
    return path


class CheckpointMismatch(ConfigError):
    """``--ckpt_path`` names a checkpoint trained with other model, data or tokenizer settings than the command's."""


def _matching_ckpt(cfg: Namespace, root: pathlib.Path, expected: Optional[Dict[str, Any]], notes: bool) -> Optional[str]:
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path != "last":
        if expected is not None:
            differences = checkpoint_differences(cfg.ckpt_path, expected)
            if differences:
                raise CheckpointMismatch(f"ckpt_path: {cfg.ckpt_path} was trained with a different "
                                         f"{'; '.join(differences)}; resume with the command that trained it, or "
                                         "start a new run without --ckpt_path")
        return cfg.ckpt_path
    candidates = sorted(root.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not candidates:
        raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {root}; start a new run without --ckpt_path, "
                                "or give the --log_dir, --variant and --size of the run to resume")
    if expected is None:
        return str(candidates[0])
    skipped = []
    for candidate in candidates:
        differences = checkpoint_differences(str(candidate), expected)
        if not differences:
            for folder, why in skipped if notes else ():
                print(f"note: --ckpt_path last: skipped newer {folder} (different {why})", file=sys.stderr)
            return str(candidate)
        skipped.append((candidate.parent.parent, "; ".join(differences)))
    folder, why = skipped[0]
    raise ConfigError(f"--ckpt_path last: no run under {root} matches this command; the newest, {folder}, "
                      f"was trained with a different {why}")


def run_fingerprints(mcfg: ModelConfig, data) -> Dict[str, Any]:
    """What a resumed run must share with the command: every resolved model field, data and tokenizer."""
    return {"model": flatten(mcfg.resolve().to_dict()), **data.fingerprints()}


def checkpoint_differences(path: str, expected: Dict[str, Any]) -> List[str]:
    """Human-readable differences between the checkpoint's fingerprints and ``expected`` (empty: same)."""
    from model_tools.weights import read_checkpoint, saved_fingerprints

    blob = read_checkpoint(path, "ckpt_path")
    model = (blob.get("hyper_parameters") or {}).get("model")
    if not model:
        return ["model (the checkpoint holds no hyper_parameters.model; not written by experiments.run)"]
    try:
        saved_model = flatten(ModelConfig.from_dict(model).resolve().to_dict())
    except (ConfigError, TypeError, ValueError) as err:
        return [f"model ({err})"]
    out = [f"model.{k} ({saved_model.get(k)!r} in the checkpoint, {v!r} now)"
           for k, v in expected["model"].items() if saved_model.get(k) != v]
    saved = saved_fingerprints(blob)
    if "data" not in expected:  # up front, before the data are built: the model check only
        return out
    if saved is None:  # checkpoints written before fingerprints were saved: the model check is all we have
        print(f"warning: {path} records no data/tokenizer fingerprints; only the model settings were checked",
              file=sys.stderr)
        return out
    for key in ("data", "tokenizer", "val_fraction", "val_blocks", "labels"):
        if key == "val_blocks" and key not in saved:  # checkpoints from before it was saved: unknown, not checked
            continue
        was = saved.get(key, "none" if key == "labels" else None)  # checkpoints from before labels: none
        if key in expected and was != expected[key]:
            label = {"val_fraction": "data.val_fraction", "labels": "data.labels / data.loss_mask",
                     "val_blocks": "--val_blocks"}.get(key, key)
            now = expected[key]
            if key == "data" and saved.get("data_source"):  # name the files as well as their fingerprints
                was, now = f"{was} = {saved['data_source']}", f"{now} = {expected.get('data_source')}"
            out.append(f"{label} ({was} in the checkpoint, {now} now)")
    return out


def refuse_foreign_run_folder(run_dir: pathlib.Path, ckpt_path: Optional[str]) -> None:
    """Never write into another run's folder: one that holds checkpoints is only reused to resume it."""
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir() or not any(checkpoints.glob("*.ckpt")):
        return
    if ckpt_path and pathlib.Path(ckpt_path).resolve().is_relative_to(run_dir.resolve()):
        return
    raise ConfigError(f"version: {run_dir} already holds another run's checkpoints; choose a new --version, "
                      f"or resume it with --ckpt_path {checkpoints / 'last.ckpt'}")


def parse_with_presets(parser: ArgumentParser, argv: Sequence[str], prefix: str = "model") -> Namespace:
    """Parse twice: once to learn the variant, then with its preset as defaults, so that YAML files
    and explicit command-line values override the preset and the preset overrides dataclass defaults."""
    from architectures.registry import preset_defaults

    probe = [a for a in argv if not a.startswith("--print_config")]
    first = parser.parse_args(probe, defaults=True)
    preset = preset_defaults(first[prefix].variant, prefix)
    # finetune's data group has neither field: None, no defaults
    preset.update(data_defaults(first.get("data.name"), first.get("data.labels")))
    # the parser's own defaults come back afterwards: a parser that parses several runs' options (the repro
    # programmes') must not carry one variant's preset into the next one's fields
    before = {key: parser.get_default(key) for key in preset}
    parser.set_defaults(preset)
    try:
        return parser.parse_args(list(argv))
    finally:
        parser.set_defaults(before)


def check_probe_levels(name: str, levels: int) -> None:
    """A probe dataset's labels against --callbacks.probe_levels, from its name: before the data are built."""
    from datamodules.probe import TASKS, level_count

    if name in TASKS and levels < level_count(name):
        raise too_few_levels(f"{name}'s labels", level_count(name) - 1, levels)


def data_defaults(name: Optional[str], labels: Optional[str] = None) -> Dict[str, Any]:
    """Defaults the data set for other groups, beaten by any explicit value: the number of levels of a probe
    dataset or of a label file, and the hard levels where the usual threshold lies past the data's top level
    (probe-v7/shift's two levels: the top one). The hard threshold follows the data, not an explicit
    --callbacks.probe_levels: levels the data never use would leave the hard metrics empty."""
    from datamodules.probe import TASKS, level_count

    levels = level_count(name) if name in TASKS else _label_file_levels_or_none(labels)
    if levels is None:
        return {}
    return {"callbacks.probe_levels": levels, "callbacks.probe_hard_from": min(CallbacksConfig.probe_hard_from, levels - 1)}


def _label_file_levels_or_none(labels: Optional[str]) -> Optional[int]:
    """A label file's level count, or None where it cannot be a default (no labelled token, one level only, more
    levels than the metrics keep) or the file cannot be read: the up-front label-file checks then report the
    file itself, in their usual order, instead of blaming an option the user never gave."""
    if not labels:
        return None
    try:
        levels = label_file_levels(labels)
    except (DataError, OSError):
        return None
    return levels if levels is not None and 2 <= levels <= MAX_PROBE_LEVELS else None


def main(argv: Optional[Sequence[str]] = None,
         on_run_folder: Optional[Callable[[pathlib.Path], None]] = None) -> Optional[pathlib.Path]:
    """Train one run; its folder (None for ``--print_config``). ``on_run_folder(folder)`` is called once the run
    has its folder, before it trains (``experiments.repro`` records it there to resume the run after a kill)."""
    mark_run_start()
    parser = build_parser()
    argv = join_option_values(expand_aliases(list(sys.argv[1:] if argv is None else argv)))
    printing = "--print_config" in argv  # ours, resolved; "--print_config=..." forms stay jsonargparse's
    cfg = parse_with_presets(parser, [a for a in argv if a != "--print_config"])
    validate_up_front(cfg, argv)
    if printing:
        print_resolved_config(parser, cfg)
        return None
    check_sources_up_front(cfg)
    from callbacks.preemption import time_limit_warning_noted

    with time_limit_warning_noted():  # SLURM's SIGUSR1 must not kill the run at any point of it (the callback's)
        return train(cfg, parser, on_run_folder)


def train(cfg: Namespace, parser: ArgumentParser,
          on_run_folder: Optional[Callable[[pathlib.Path], None]] = None) -> pathlib.Path:
    import lightning as L

    from datamodules.lm import DataConfig, LMDataModule
    from model_tools.compiling import compile_model
    from model_tools.weights import load_initial_weights
    from lightning_modules.lm import LanguageModelModule

    # an unwritable or read-only log dir fails now, not after the corpus is tokenised
    check_writable(pathlib.Path(cfg.log_dir) / f"{cfg.model.variant}-{cfg.model.size}")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = LMDataModule(DataConfig(**_as_dict(cfg.data)), block_size=model_config(cfg).resolve().block_size, seed=cfg.seed,
                        val_blocks=cfg.val_blocks)
    mcfg = model_config(cfg, vocab_size=data.vocab_size)
    mcfg.resolve()
    module = LanguageModelModule(model=mcfg.to_dict(), optim=_as_dict(cfg.optim),
                                 max_steps=cfg.trainer.max_steps, val_names=data.val_names_from_corpus(),
                                 max_train_flops=cfg.max_train_flops)
    if cfg.init_from:
        load_initial_weights(module.model, cfg.init_from, strict=cfg.init_strict, min_share=cfg.init_min_share,
                             tokenizer=data.fingerprints()["tokenizer"])
    set_activation_checkpointing(module.model, cfg.activation_checkpointing)
    compile_model(module.model, cfg.compile)

    root = pathlib.Path(cfg.log_dir) / f"{mcfg.variant}-{mcfg.size}"
    ckpt_path = resolve_ckpt(cfg, root, run_fingerprints(mcfg, data))
    claimed = fixed_version(cfg, root, ckpt_path) is None
    version = run_version(cfg, root, ckpt_path)
    try:
        refuse_foreign_run_folder(root / version, ckpt_path)
        if on_run_folder is not None:
            on_run_folder(root / version)
        return fit_and_summarise(cfg, parser, module, data, mcfg, root, version, ckpt_path)
    except BaseException:
        if claimed and module.global_step == 0:
            release_unstarted(root / version)  # a run that failed before its first step leaves no folder
        raise


def fit_and_summarise(cfg: Namespace, parser: ArgumentParser, module, data, mcfg: ModelConfig, root: pathlib.Path,
                      version: str, ckpt_path: Optional[str]) -> pathlib.Path:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from callbacks.run_summary import StepRecorder

    inherited = os.environ.get("DYNCOMP_RUN_VERSION")
    writer = config_writer(lambda path: parser.save(resolved_namespace(cfg, mcfg), path, overwrite=True,
                                                    skip_validation=True))
    trainer, recorder = make_trainer(cfg, root, version, extra_callbacks=[StepRecorder(), writer],
                                     find_unused=module.model.may_skip_parameters, monitor=module.selection_metric)
    run_dir = pathlib.Path(trainer.logger.log_dir)
    if trainer.is_global_zero:
        for tmp in remove_killed_checkpoint_writes(root / version / "checkpoints"):
            print(f"note: removed {tmp}, left by a checkpoint write that was killed", file=sys.stderr)

    try:
        try:
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        except SIGTERMException:  # preempted: every rank stopped after the same step and saved (callbacks/preemption)
            close_process_group()
            raise
        final = trainer.validate(module, datamodule=data, verbose=False)
        if trainer.global_step % cfg.val_every:
            # ModelCheckpoint saves every val_every steps; make last.ckpt hold the final step too, after its
            # validation (a run extended from it keeps that validation in val_history, as TensorBoard does)
            trainer.save_checkpoint(root / version / "checkpoints" / "last.ckpt")
        try:
            write_run_summary(trainer, module, data, mcfg, recorder, final, run_dir)
        finally:  # every rank reaches it, whatever rank 0's summary did
            close_process_group()
    finally:
        if inherited == version:  # the DDP ranks have started; later runs in this process pick anew
            os.environ.pop("DYNCOMP_RUN_VERSION", None)
    return run_dir


def write_run_summary(trainer, module, data, mcfg: ModelConfig, recorder, final, run_dir: pathlib.Path) -> None:
    """Rank 0 writes the run's ``summary.json`` and prints the run folder."""
    from callbacks.run_summary import measured_summary, write_summary
    from analysis.provenance import summary_provenance

    metrics = {k: float(v) for k, v in (final[0] if final else {}).items()}
    if trainer.is_global_zero:
        summary = {
            "variant": mcfg.variant,
            "size": mcfg.size,
            "steps": trainer.global_step,
            **final_validation(metrics, module.selection_metric),
            "val_metrics": metrics,
            "tokens_seen": module.tokens_seen,
            "unigram_entropy_nats": data.unigram_entropy(),
            "parameters": module.model.num_parameters(),
            **measured_summary(trainer, module, recorder),  # global loss curve, routing, FLOPs, step times
            **budget_summary(module),
            "world_size": trainer.world_size,
            # this run (every process, each to the checkpoint the next resumed from; StepRecorder.run_seconds):
            # start-up, training, validations, to this write; a lower bound when not complete
            **dict(zip(("run_seconds", "run_seconds_complete"), recorder.run_seconds())),
            "run_dir": str(run_dir),
            "provenance": summary_provenance(run_dir),  # code commit, dirty tree, library versions, threads
        }
        write_summary(run_dir / "summary.json", summary)
        print(run_dir)


def close_process_group() -> None:
    """End DDP together: every rank waits for the others, then the process group is destroyed. A rank that left
    the interpreter with the group alive while another was still writing (rank 0's summary) died at exit now and
    then ("terminate called without an active exception", SIGABRT with gloo), and srun's --kill-on-bad-exit
    counted the finished job as failed. No-op without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def budget_summary(module) -> Dict[str, Any]:
    """``summary.json``'s FLOPs budget: the budget, the measured training FLOPs spent (every rank and micro-batch)
    and what ended the run; ``None`` everywhere for a run without a budget (its FLOPs were not counted)."""
    budget = module.flops_budget
    if budget is None:
        return {"max_train_flops": None, "train_flops": None, "stopped_by": "max_steps"}
    stopped_by = "max_train_flops" if budget.stop_step is not None else "max_steps"
    if stopped_by == "max_steps":
        print(f"warning: max_train_flops: --max_steps ended the run at {100 * budget.fraction():.1f}% of the FLOPs "
              "budget (the LR cosine had not finished); raise --max_steps", file=sys.stderr)
    return {"max_train_flops": budget.max_flops, "train_flops": budget.spent, "stopped_by": stopped_by}


def final_validation(metrics: Dict[str, float], key: str) -> Dict[str, Any]:
    """The summary's headline validation figures. ``final_val_loss`` is the ``key`` loss (the causal one for
    routing that sees the future), named by ``final_val_loss_metric``; the non-causal loss stays reported
    next to it, with the causal evaluation's forward FLOPs per token (its own processed share)."""
    out: Dict[str, Any] = {"final_val_loss": metrics.get(key), "final_val_ppl": metrics.get(key.replace("loss", "ppl")),
                           "final_val_loss_metric": key}
    if key == "val/loss_causal":
        out["final_val_loss_noncausal"] = metrics.get("val/loss")
        out["final_val_flops_per_token_causal"] = {"forward": metrics.get("val/flops_causal"),
                                                   "ratio_to_vanilla": metrics.get("val/flops_causal_ratio_to_vanilla")}
    return out


def config_writer(save):
    """A callback that writes the run folder's ``config.yaml`` once the data is prepared and a resumed checkpoint
    restored (Lightning calls ``on_fit_start`` after ``prepare_data``, ``setup`` and the restore), so a bad corpus,
    tokenizer or checkpoint leaves no folder that looks like a run and a refused resume leaves the run as it was.
    It also appends this process's record to ``provenance.json`` (each resume adds one)."""
    import lightning as L

    class ConfigWriter(L.Callback):
        def on_fit_start(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                run_dir = pathlib.Path(trainer.logger.log_dir)
                from analysis.provenance import FILE, record_start

                path = run_dir / "config.yaml"
                try:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    save(path)
                    path = run_dir / FILE
                    record_start(run_dir)  # the code and libraries of this process (each resume adds one)
                except OSError as err:
                    if is_storage_error(err):
                        raise StorageError(storage_message(path, err)) from None
                    raise

    return ConfigWriter()


def make_trainer(cfg: Namespace, root: pathlib.Path, version: str, extra_callbacks=(), find_unused: bool = False,
                 monitor: str = "val/loss"):
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=str(root.parent), name=root.name, version=version, default_hp_metric=False)
    checkpoints = ModelCheckpoint(
        dirpath=str(root / version / "checkpoints"),
        filename="best-{step}",
        monitor=monitor,  # val/loss_causal for routing that sees the future (LanguageModelModule.selection_metric)
        mode="min",
        save_top_k=1,
        save_last=True,
        # save when each validation ends (every val_every steps), with its fresh score: saving at the batch end
        # of that step scored the weights by the previous validation's loss
        every_n_epochs=1,
        save_on_train_epoch_end=False,
    )
    from callbacks.preemption import PreemptionCheckpoint, slurm_requeue_job  # SIGTERM/SIGUSR1 -> last.ckpt

    slurm_job = slurm_requeue_job()
    callbacks = [checkpoints, PreemptionCheckpoint(checkpoints.dirpath, requeue_job=slurm_job),
                 LearningRateMonitor(logging_interval="step"), *extra_callbacks]
    callbacks.extend(extra_run_callbacks(cfg))
    kwargs = _as_dict(cfg.trainer)
    if kwargs.get("enable_progress_bar") is not False:  # None: Lightning's default, a bar
        callbacks.append(progress_bar())
    quiet_lightning_notices()
    kwargs["precision"] = kwargs.get("precision") or default_precision()
    kwargs["devices"] = _devices(kwargs.get("devices", "auto"))
    if kwargs.get("strategy") == "ddp" and find_unused:
        # routed models may leave an expert/module without tokens in a step
        kwargs["strategy"] = "ddp_find_unused_parameters_true"
    kwargs.update(
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(root / version),  # where Lightning looks for a SLURM hpc_ckpt_N to resume (old runs')
        # Lightning counts val_check_interval in training batches, and a preset that accumulates (small: 4 batches
        # per step) validated every val_every / 4 optimisation steps
        val_check_interval=cfg.val_every * (kwargs.get("accumulate_grad_batches") or 1),
        check_val_every_n_epoch=None,
        limit_val_batches=None,  # the datamodule takes val_blocks (global) and splits them across the ranks
        # checkpoints: temp file in the checkpoint folder, fsync, rename (never a truncated file under the final name)
        plugins=[atomic_checkpoint_io(), *slurm_environment(slurm_job)],
    )
    trainer = L.Trainer(**kwargs)
    recorder = next(c for c in callbacks if c.__class__.__name__ == "StepRecorder")
    return trainer, recorder


def slurm_environment(slurm_job) -> list:
    """Under SLURM, Lightning's environment (ranks from the tasks) without its auto-requeue, whose SIGUSR1 handler
    saves a checkpoint mid-step with collectives that can hang DDP; ``PreemptionCheckpoint`` stops every rank
    after the same step, saves ``last.ckpt`` and requeues instead (callbacks/preemption.py)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if slurm_job is not None else []


def progress_bar():
    """Lightning's progress bar without what reads as noise on a step-based run: ``Epoch 0/-2`` (max_epochs is
    -1: the run ends at max_steps) and ``v_num: on_0`` (the last 4 characters of ``version_0``; the run folder
    is the last line printed)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    class RunProgressBar(RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):
        def get_metrics(self, trainer, pl_module):
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            return items

        def _get_train_description(self, current_epoch: int) -> str:  # RichProgressBar's
            description = f"Epoch {current_epoch}"
            if self.trainer.max_epochs not in (None, -1):
                description += f"/{self.trainer.max_epochs - 1}"
            return f"{description:{len(self.validation_description)}}"

    return RunProgressBar()


class _DropTips:
    """A logging filter: Lightning's advertisement for its cloud logger, printed by every run."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip:")


def quiet_lightning_notices() -> None:
    """The first screen of a run holds what concerns it: no cloud-logger tip, no deprecation notice that
    Lightning's own pytree helper raises under this torch version (the user can do nothing about either)."""
    import logging
    import warnings

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def extra_run_callbacks(cfg: Namespace) -> list:
    """Measurement callbacks (routing, FLOPs, contribution) when their module is present."""
    try:
        from callbacks import default_callbacks
    except ImportError:
        return []
    return default_callbacks(cfg)


def _devices(value):
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


# The user mistakes ``cli`` reports as one line (exit status 2) instead of a traceback; so are a full disk
# and an unwritable folder (``StorageError``, or an OSError with such an errno from any other write).
USER_ERRORS = (ConfigError, DataError, FileNotFoundError, argparse.ArgumentError, StorageError)
USER_ERROR_EXIT = 2


def cli(entry=None, argv: Optional[Sequence[str]] = None) -> None:
    """Run ``entry(argv)`` (default: ``main``) as a command: a user mistake prints ``error: <one line>``
    to stderr and exits with status 2; a preempted run exits with ``callbacks.preemption``'s status."""
    try:
        (entry or main)(argv)
    except USER_ERRORS as err:
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT) from None
    except OSError as err:
        if not is_storage_error(err):
            raise
        # a write or read outside the wrapped ones (event files, caches, inputs): name the path and the cause
        where = err.filename or "a file of the run (the system did not say which)"
        remedy = ("free space on that disk or choose another --log_dir / cache folder"
                  if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "fix that path's permissions or choose another one")
        print(f"error: {where}: {err.strerror or err}; {remedy}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT) from None


if __name__ == "__main__":
    cli()
