"""``--init_from``: start a model from a vanilla checkpoint of this suite or from Hugging Face GPT-2.

Sources: a Lightning checkpoint (``.ckpt``) or ``state_dict`` file of this suite's vanilla model,
``hf:<hub id>`` (e.g. ``hf:gpt2``), or a local Hugging Face folder (config.json + weights).
A vanilla target loads the weights directly; a variant that defines ``init_from_vanilla`` (MoM's
phase 2, for example) maps them itself; any other variant loads the tensors whose names and shapes
match and reports the rest.
"""
from __future__ import annotations

import pathlib
from typing import Dict

import torch

from architectures.config import ConfigError


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


def vanilla_state_from(source: str) -> Dict[str, torch.Tensor]:
    if source.startswith("hf:") or (pathlib.Path(source).is_dir() and (pathlib.Path(source) / "config.json").is_file()):
        return _hf_state(source.removeprefix("hf:"))
    path = pathlib.Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"init_from: {source} is neither a checkpoint file, 'hf:<id>' nor a Hugging Face folder")
    blob = read_checkpoint(path, "init_from")
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else blob
    # Lightning checkpoints prefix the LanguageModelModule attribute name.
    return {k.removeprefix("model."): v for k, v in state.items() if not k.startswith(("val_", "tokens_seen"))}


def _hf_state(source: str) -> Dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    from architectures.gpt2 import state_dict_from_hf
    from datamodules.corpora import hub_reachable

    if not pathlib.Path(source).is_dir() and not hub_reachable():
        try:
            hf = GPT2LMHeadModel.from_pretrained(source, local_files_only=True)
        except OSError as err:
            raise FileNotFoundError(
                f"init_from: Hugging Face model {source!r} is not cached and the Hub is unreachable; "
                "pass a local folder with config.json + model.safetensors"
            ) from err
    else:
        hf = GPT2LMHeadModel.from_pretrained(source)
    return state_dict_from_hf(hf.state_dict())


def load_initial_weights(model: torch.nn.Module, source: str) -> None:
    state = vanilla_state_from(source)
    if hasattr(model, "init_from_vanilla"):
        model.init_from_vanilla(state)
        return
    own = model.state_dict()
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and own[k].shape != v.shape]
    if mismatched:
        raise ConfigError("init_from: tensor shapes do not fit the model: " + "; ".join(mismatched[:5]))
    missing = model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False).missing_keys
    if missing and type(model).__name__ == "GPT2":
        raise ConfigError(f"init_from: checkpoint lacks {missing[:5]} for a vanilla model")
