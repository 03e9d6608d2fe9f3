"""Activation checkpointing of a model's blocks (``--activation_checkpointing none|blocks|every_k:N``).

A checkpointed unit (a block of the body, or one MoM assembly step) keeps only its inputs for
backward and recomputes its forward when the gradient reaches it (``torch.utils.checkpoint``,
``use_reentrant=False``, RNG state of CPU and the inputs' device restored, autocast state kept).

Routed blocks write to the ``ForwardState`` while they run (routing sites, aux losses, residual
snapshots, MoM's official balance parts). The recomputation therefore runs on a *replay* state: a
copy of the state as the unit found it (options snapshotted, fresh lists and dicts), so nothing is
recorded twice. Its trace list compares every site the recomputation reports with the site of the
forward pass, in order: a different routing decision (``selected`` or ``dropped``) raises instead of
silently giving other gradients. With the same inputs, RNG and kernels the decisions are the same,
so the gradients equal the non-checkpointed ones (``tests/test_scale.py``). Early stopping of the
recomputation is off, so every site of the unit is compared (it costs the few operations after the
unit's last saved tensor).

Policies: ``none``; ``blocks`` (every unit); ``every_k:N`` (units 0, N, 2N, ...: one in N, a memory /
recompute trade-off between the two). Units are counted in the order the forward runs them.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from architectures.config import ConfigError

POLICIES = "none, blocks, every_k:N (N a positive integer)"


@dataclass(frozen=True)
class CheckpointPolicy:
    every: int  # 1: every unit; N: units 0, N, 2N, ...

    def applies(self, unit: int) -> bool:
        return unit % self.every == 0

    def __str__(self) -> str:
        return "blocks" if self.every == 1 else f"every_k:{self.every}"


def parse_policy(value: Any, field: str = "activation_checkpointing") -> Optional[CheckpointPolicy]:
    """``"none"`` -> None, ``"blocks"`` -> every unit, ``"every_k:N"`` -> one unit in N; else ConfigError."""
    text = str(value).strip() if value is not None else "none"
    if text in ("none", "false", "False", ""):
        return None
    if text == "blocks":
        return CheckpointPolicy(1)
    match = re.fullmatch(r"every_k:(\d+)", text)
    if match and int(match.group(1)) >= 1:
        return CheckpointPolicy(int(match.group(1)))
    raise ConfigError(f"{field}: unknown value {value!r}; use one of {POLICIES}")


def set_activation_checkpointing(model: torch.nn.Module, value: Any) -> torch.nn.Module:
    """Set the policy on a ``LanguageModel`` (an attribute, not a parameter: checkpoints are unchanged)."""
    model.checkpoint_policy = parse_policy(value)
    return model


class RoutingMismatch(RuntimeError):
    pass


class _ReplayTrace(list):
    """The trace of a recomputation: each appended site must repeat the forward pass's decision."""

    def __init__(self, expected: List[Any]):
        super().__init__()
        self.expected = expected

    def append(self, site) -> None:  # type: ignore[override]
        i = len(self)
        super().append(site)
        ref = self.expected[i] if i < len(self.expected) else None
        difference = replay_difference(ref, site)
        if difference:
            raise RoutingMismatch(
                f"activation checkpointing: recomputing routing site {site.name} gave other decisions than the "
                f"forward pass: {difference}. The recomputation must see what the forward saw (inputs, RNG, the "
                "padding mask, options); non-deterministic kernels can also cause this. Train with "
                "--activation_checkpointing none")


def _differing(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} in the forward, {tuple(b.shape)} recomputed"
    where = (a != b).nonzero()
    first = tuple(int(v) for v in where[0]) if len(where) else ()
    return f"{len(where)} of {a.numel()} entries differ, the first at {first}"


def replay_difference(ref, site) -> str:
    """What differs between the forward pass's site ``ref`` and the recomputation's ``site`` ('' if nothing)."""
    if ref is None:
        return "the forward pass reported no site at this point"
    if ref.name != site.name:
        return f"the forward pass reported {ref.name} here"
    if (ref.valid is None) != (site.valid is None):
        return f"the padding mask (valid) is {'missing' if site.valid is None else 'present'} in the recomputation"
    if ref.valid is not None and not torch.equal(ref.valid, site.valid):
        return f"valid (the padding mask): {_differing(ref.valid, site.valid)}"
    if not torch.equal(ref.selected, site.selected):
        return f"selected: {_differing(ref.selected, site.selected)}"
    if (ref.dropped is None) != (site.dropped is None):
        return "dropped is reported in only one of the two"
    if ref.dropped is not None and not torch.equal(ref.dropped, site.dropped):
        return f"dropped: {_differing(ref.dropped, site.dropped)}"
    return ""


def _copy_containers(value: Any) -> Any:
    """Dicts / lists / tuples copied recursively, tensors and other leaves shared."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_containers(v) for v in value)
    return value


class _Inputs(list):
    """Tensors checkpointed units keep for their recomputation; ``unit_bytes``: per unit, the bytes its
    forward saves when it is not checkpointed (parameters, ``skip`` storages, excluded)."""

    def __init__(self, skip=()):
        super().__init__()
        self.skip = set(skip)
        self.unit_bytes: List[int] = []

    @property
    def units(self) -> int:
        return len(self.unit_bytes)

    def measure(self, fn: Callable, state, args) -> None:
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.skip:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(_scratch(state, _copy_containers(state.options), []), *args)
        self.unit_bytes.append(sum(saved.values()))
        self.extend(a for a in args if isinstance(a, torch.Tensor))


_WATCHERS: List[_Inputs] = []


@contextlib.contextmanager
def watch_checkpoint_inputs(skip=()):
    """Collect the tensor inputs checkpointed units keep alive until backward (the memory plan counts them:
    saved-tensor hooks do not see them), and each unit's activations when not checkpointed (one more
    forward of the unit, for measuring only)."""
    inputs = _Inputs(skip)
    _WATCHERS.append(inputs)
    try:
        yield inputs
    finally:
        _WATCHERS.remove(inputs)


def _scratch(state, options, trace):
    """A state like ``state`` as a unit found it, whose records go nowhere (the recomputation's)."""
    return type(state)(cache=None, valid=state.valid, causal=state.causal,
                       residuals=None if state.residuals is None else [], offset=state.offset, trace=trace,
                       options=options)


def run_checkpointed(fn: Callable, state, args) -> Any:
    """``fn(state, *args)`` under ``torch.utils.checkpoint``; the recomputation runs on a replay state."""
    for watcher in _WATCHERS:
        watcher.measure(fn, state, args)
    options = _copy_containers(state.options)
    forward: dict = {}

    def unit(*tensors):
        if "sites" not in forward:  # the forward pass: the real state records
            start = len(state.trace)
            out = fn(state, *tensors)
            forward["sites"] = list(state.trace[start:])
            return out
        return fn(_scratch(state, _copy_containers(options), _ReplayTrace(forward["sites"])), *tensors)

    with set_checkpoint_early_stop(False):  # recompute to the end, so every site is compared
        return checkpoint(unit, *args, use_reentrant=False, preserve_rng_state=True)
