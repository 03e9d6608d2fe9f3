"""``--init_from``: start a model from a vanilla checkpoint of this suite or from Hugging Face GPT-2.

Sources: a Lightning checkpoint (``.ckpt``) or ``state_dict`` file of this suite's vanilla model,
``hf:<hub id>`` (e.g. ``hf:gpt2``), or a local Hugging Face folder (config.json + weights).
A checkpoint of the target's own variant loads by name; a vanilla one goes through the variant's
``vanilla_state_mapping`` (the paper-faithful mapping). Before loading, a table of loaded / mapped /
unused / newly initialised tensors (counts and share of parameters) goes to stderr; in strict mode (the
command lines' default) a source trained with another tokenizer, or one that initialises less than
``--init_min_share`` of the parameters outside the embeddings, is refused. Shares leave the token and
position embeddings (and the head tied to them) out: at small sizes they are most of the parameters, so
a source missing half the model's blocks would otherwise still count as almost fully initialising it.
``python -m experiments.weights [SIZE]`` prints, for every variant, what a vanilla model of SIZE initialises
(the table in docs/training.md); ``python -m experiments.weights --step0 RUN_DIR [BATCHES]`` the step-0 validation loss
of every variant started from that vanilla run.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Dict, List, Optional, Tuple

import torch

from architectures.config import ConfigError
from architectures.experts import stack_legacy_experts


def read_checkpoint(path, option: str = "ckpt_path") -> dict:
    """The checkpoint at ``path`` as a dict; a missing, truncated or foreign file is one ConfigError line.

    Memory-mapped when the file allows it, so reading the metadata of a large checkpoint is cheap.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{option}: {path} does not exist or is not a file")
    try:
        try:
            blob = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle means "not a usable checkpoint"
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise ConfigError(f"{option}: {path} is not a readable PyTorch checkpoint (truncated or another kind of "
                          f"file: {reason})") from None
    if not isinstance(blob, dict):
        raise ConfigError(f"{option}: {path} holds a {type(blob).__name__}, not a checkpoint dict")
    return blob


def saved_fingerprints(blob: dict) -> Optional[Dict[str, str]]:
    """The data/tokenizer fingerprints ``LMDataModule`` saved in a checkpoint (None: it records none)."""
    return next((v["fingerprints"] for v in blob.values() if isinstance(v, dict) and "fingerprints" in v), None)


def read_source(source: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Optional[str]]]:
    """(state dict in this suite's names, {"variant", "tokenizer"} recorded with it; None where unknown)."""
    if source.startswith("hf:") or (pathlib.Path(source).is_dir() and (pathlib.Path(source) / "config.json").is_file()):
        return _hf_state(source.removeprefix("hf:")), {"variant": "vanilla", "tokenizer": None}
    path = pathlib.Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"init_from: {source} is neither a checkpoint file, 'hf:<id>' nor a Hugging Face folder")
    blob = read_checkpoint(path, "init_from")
    state = blob.get("state_dict", blob)
    model = (blob.get("hyper_parameters") or {}).get("model") or {}
    saved = saved_fingerprints(blob) or {}
    meta = {"variant": model.get("variant") if isinstance(model, dict) else None, "tokenizer": saved.get("tokenizer")}
    # Lightning checkpoints prefix the LanguageModelModule attribute name.
    state = {k.removeprefix("model."): v for k, v in state.items()
             if isinstance(v, torch.Tensor) and not k.startswith(("val_", "tokens_seen"))}
    if not state:
        raise ConfigError(f"init_from: {path} holds no tensors (not a model checkpoint)")
    return state, meta


_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def check_source(source: str) -> None:
    """Fail in seconds on an ``--init_from`` that cannot be loaded, before any data is built: a missing,
    truncated or foreign file, a Hugging Face folder without weights, or a Hub model that is neither cached
    nor reachable. (Whether its tensors fit the model is checked when it is loaded.)"""
    path = pathlib.Path(source)
    if source.startswith("hf:"):
        name = source.removeprefix("hf:")
        if pathlib.Path(name).is_dir():
            return check_source(name)
        from datamodules.corpora import hub_reachable

        if not _hf_cached(name) and not hub_reachable():
            raise FileNotFoundError(_hf_offline_message(name))
        return
    if path.is_dir() and (path / "config.json").is_file():
        if not any((path / w).is_file() for w in _HF_WEIGHTS):
            raise FileNotFoundError(f"init_from: {path} has config.json but no weights ({' or '.join(_HF_WEIGHTS)})")
        return
    if not path.exists():
        raise FileNotFoundError(f"init_from: {source} does not exist; pass a checkpoint file (.ckpt), hf:<id> or a "
                                "Hugging Face folder")
    if not path.is_file():
        raise FileNotFoundError(f"init_from: {source} is neither a checkpoint file, 'hf:<id>' nor a Hugging Face folder")
    read_checkpoint(path, "init_from")


def _hf_cached(name: str) -> bool:
    """Whether the Hugging Face cache holds ``name``'s config and weights (no network)."""
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(name, filename), str)

    try:
        return cached("config.json") and any(cached(w) for w in _HF_WEIGHTS)
    except ValueError:  # not a valid repo id
        return False


def _hf_offline_message(name: str) -> str:
    return (f"init_from: Hugging Face model {name!r} is not cached and the Hub is unreachable (or HF_HUB_OFFLINE=1); "
            "pass a local folder with config.json + model.safetensors")


def _hf_state(source: str) -> Dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    from architectures.gpt2 import state_dict_from_hf
    from datamodules.corpora import hub_reachable

    if not pathlib.Path(source).is_dir() and not hub_reachable():
        try:
            hf = GPT2LMHeadModel.from_pretrained(source, local_files_only=True)
        except OSError as err:
            raise FileNotFoundError(_hf_offline_message(source)) from err
    else:
        try:
            hf = GPT2LMHeadModel.from_pretrained(source)
        except OSError as err:  # e.g. no such model on the Hub, or a folder without weights
            reason = (str(err).strip().splitlines() or ["unreadable"])[0][:200]
            raise FileNotFoundError(f"init_from: cannot load Hugging Face model {source!r} ({reason})") from None
    return state_dict_from_hf(hf.state_dict())


DEFAULT_MIN_SHARE = 0.5  # refuse (unless --init_strict false) when less of the model than this is initialised

#: the token / position embeddings and the head tied to them: left out of every share (see the docstring)
EMBEDDINGS = ("wte.weight", "wpe.weight", "lm_head.weight")


@dataclasses.dataclass
class InitReport:
    """What ``--init_from`` did, counted in tensors and in parameters (shared tensors counted once).

    Shares are of the parameters outside the embeddings (``EMBEDDINGS``): the blocks, routers and final
    LayerNorm, what a variant adds to the embedding tables."""

    loaded: List[str]  # same name in source and model
    mapped: List[Tuple[str, str]]  # (model name, source name): the variant's vanilla mapping
    unused: List[str]  # source tensors nothing was initialised from
    new: List[str]  # model tensors left at their fresh initialisation
    sizes: Dict[str, int]  # numel of every model tensor (shared storage counted once) and source tensor
    source_sizes: Dict[str, int]

    @property
    def model_parameters(self) -> int:
        return sum(self.sizes.values())

    @property
    def body_parameters(self) -> int:
        """Parameters outside the embeddings: what every share is a share of."""
        return sum(size for name, size in self.sizes.items() if name not in EMBEDDINGS)

    def share(self, names) -> float:
        return sum(self.sizes.get(n, 0) for n in names if n not in EMBEDDINGS) / max(self.body_parameters, 1)

    @property
    def initialised_share(self) -> float:
        return self.share([*self.loaded, *(t for t, _ in self.mapped)])

    def table(self, source: str, variant: str) -> str:
        source_total = max(sum(self.source_sizes.values()), 1)
        rows = [
            ("loaded (same name)", len(self.loaded), self.share(self.loaded), "outside the embeddings"),
            ("mapped (renamed)", len(self.mapped), self.share([t for t, _ in self.mapped]), "outside the embeddings"),
            ("newly initialised", len(self.new), self.share(self.new), "outside the embeddings"),
            ("unused in source", len(self.unused), sum(self.source_sizes[n] for n in self.unused) / source_total,
             "of the source"),
        ]
        embeddings = [n for n in EMBEDDINGS if self.sizes.get(n)]
        from_source = {*self.loaded, *(t for t, _ in self.mapped)}
        lines = [f"init_from {source} -> {variant}: {100 * self.initialised_share:.1f}% of the "
                 f"{self.body_parameters:,} parameters outside the embeddings initialised from the source "
                 f"(embeddings {', '.join(embeddings)}: "
                 f"{'from the source' if all(n in from_source for n in embeddings) else 'not all from the source'})",
                 f"  {'tensors':<20} {'count':>6} {'share':>7}"]
        lines += [f"  {name:<20} {count:>6} {100 * share:>6.1f}% {what}" for name, count, share, what in rows]
        for label, names in (("new", self.new), ("unused", self.unused)):
            if names:
                lines.append(f"  {label}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
        return "\n".join(lines)


def _source_finder(state: Dict[str, torch.Tensor], used: set):
    """Which source tensor a mapped tensor came from: the same object, a view of its storage (e.g. one
    expert's slice of an MLP, or the dense tensor broadcast over stacked experts), or an equal copy (e.g. an
    upcycled expert, or stacked experts each a copy of it); "?" when none is found.
    Equal copies are ambiguous for tensors that are alike (fresh zero biases): a source not yet used,
    then the one whose name ends most like the target's, wins."""
    by_identity = {id(v): k for k, v in state.items()}
    by_storage = {v.untyped_storage().data_ptr(): k for k, v in state.items() if v.numel()}
    by_value: Dict[tuple, List[str]] = {}
    for k, v in state.items():
        by_value.setdefault(_value_key(v), []).append(k)

    def suffix_match(a: str, b: str) -> int:
        n = 0
        for x, y in zip(reversed(a.split(".")), reversed(b.split("."))):
            if x != y:
                break
            n += 1
        return n

    def find(target: str, tensor: torch.Tensor) -> str:
        if id(tensor) in by_identity:
            return by_identity[id(tensor)]
        if tensor.numel() and tensor.untyped_storage().data_ptr() in by_storage:
            return by_storage[tensor.untyped_storage().data_ptr()]
        candidates = by_value.get(_value_key(tensor), [])
        if not candidates and tensor.dim() > 1 and len(tensor) and bool((tensor == tensor[0]).all()):
            candidates = by_value.get(_value_key(tensor[0]), [])  # stacked experts, each a copy of one tensor
        if not candidates:
            return "?"
        return max(candidates, key=lambda c: (c not in used, suffix_match(c, target)))

    return find


def _value_key(tensor: torch.Tensor):
    """A cheap content key (shape, sum, first values): equal copies share it; distinct tensors almost never."""
    flat = tensor.detach().reshape(-1)
    return tuple(tensor.shape), float(flat.double().sum()) if flat.numel() else 0.0, tuple(flat[:8].tolist())


def init_report(model: torch.nn.Module, state: Dict[str, torch.Tensor], mapping: Dict[str, torch.Tensor]) -> InitReport:
    own = model.state_dict()
    sizes, seen = {}, set()
    for name, tensor in own.items():  # tied weights (lm_head = wte) are one set of parameters
        key = (tensor.data_ptr(), tensor.numel()) if tensor.numel() else (name,)
        sizes[name] = 0 if key in seen else tensor.numel()
        seen.add(key)
    loaded, mapped, used = [], [], set()
    find_source = _source_finder(state, used)
    for target, tensor in mapping.items():
        source = target if target in state and state[target] is tensor else find_source(target, tensor)
        used.add(source)
        (loaded.append(target) if source == target else mapped.append((target, source)))
    initialised = set(mapping)
    tied = tied_copies(state)  # the source's lm_head.weight is its wte.weight: used when wte is, counted once
    for name, first in tied.items():
        if name in used or first in used:
            used |= {name, first}
    return InitReport(loaded=loaded, mapped=mapped, unused=[k for k in state if k not in used],
                      new=[k for k in own if k not in initialised and sizes[k]], sizes=sizes,
                      source_sizes={k: 0 if k in tied else v.numel() for k, v in state.items()})


def tied_copies(state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """{name: the first name of the same tensor} for the source's tied tensors: the same storage, or (a state
    dict that lost the sharing when saved) the same values under GPT-2's tied pair ``lm_head.weight`` /
    ``wte.weight``."""
    first: Dict[tuple, str] = {}
    tied = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)) if tensor.numel() else (name,)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    for head, embedding in (("lm_head.weight", "wte.weight"),):
        if head in state and embedding in state and head not in tied and torch.equal(state[head], state[embedding]):
            tied[head] = embedding
    return tied


def load_initial_weights(model: torch.nn.Module, source: str, strict: bool = False,
                         min_share: float = DEFAULT_MIN_SHARE, tokenizer: Optional[str] = None) -> InitReport:
    """Initialise ``model`` from ``source`` and print what was loaded, mapped, unused and new.

    ``tokenizer`` is this run's tokenizer fingerprint ("name:hash"); with ``strict`` (the command lines'
    default, ``--init_strict``) a checkpoint trained with another tokenizer, or one that initialises less
    than ``min_share`` of the parameters, is refused; without it, another tokenizer loads with a warning on
    stderr. Shape mismatches are always refused.
    """
    state, meta = read_source(source)
    variant = getattr(getattr(model, "config", None), "variant", type(model).__name__)
    trained_with = meta["tokenizer"]
    if tokenizer and trained_with and trained_with.split(":")[-1] != tokenizer.split(":")[-1]:
        if strict:
            raise ConfigError(f"init_from: {source} was trained with tokenizer {trained_with}, this run uses "
                              f"{tokenizer}; pass the --tokenizer it was trained with (or --init_strict false to "
                              "load anyway)")
        # loaded anyway, as asked, but never silently: token ids now mean other strings than the embeddings learnt
        print(f"warning: init_from: {source} was trained with tokenizer {trained_with}, this run uses {tokenizer}; "
              "loading anyway (--init_strict false): its token embeddings and head belong to other tokens",
              file=sys.stderr)
    own = model.state_dict()
    state = stack_legacy_experts(model, state)  # a run saved before the experts were stacked
    same_variant = meta["variant"] == variant and variant != "vanilla"
    # a checkpoint of this very variant loads by name; a vanilla one goes through the variant's mapping
    mapping = {k: v for k, v in state.items() if k in own} if same_variant else model.vanilla_state_mapping(state)
    mismatched = [f"{k}: source {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in mapping.items() if k in own and own[k].shape != v.shape]
    if mismatched:
        raise ConfigError("init_from: tensor shapes do not fit the model: " + "; ".join(mismatched[:5]))
    report = init_report(model, state, mapping)
    print(report.table(source, variant), file=sys.stderr)
    if strict and report.initialised_share < min_share:
        raise ConfigError(f"init_from: only {100 * report.initialised_share:.1f}% of the {variant} model's parameters "
                          f"outside the embeddings come from {source} (threshold {100 * min_share:.0f}%); pass --init_strict false to "
                          "train the rest from scratch anyway")
    if variant == "vanilla" and report.new:
        raise ConfigError(f"init_from: checkpoint lacks {report.new[:5]} for a vanilla model")
    model.load_state_dict(mapping, strict=False)
    if not same_variant and hasattr(model, "start_as_dense"):
        # upcycled: fresh routers and new branches set so that step 0 computes the checkpoint's function
        # wherever the routing allows it (docs/bad-input.md, "Upcycling")
        notes = model.start_as_dense()
        if notes:
            print(f"  function-preserving start ({len(notes)} layers): {notes[0]}", file=sys.stderr)
    return report
