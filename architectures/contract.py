"""The model contract: what every architecture returns, and what everything else may read.

Callbacks, FLOPs accounting, analyses and the Lightning modules read ONLY these structures,
never a variant's internals, so a new variant needs one architecture file and one registry entry.

``model(idx, attention_mask=None, return_residuals=False, cache=None, compute_logits=True) -> ModelOutput``
(the one forward, ``base.LanguageModel.forward``; the rest of the declared contract is on that class)

* ``logits``: (B, T, V) float; None with ``compute_logits=False``.
* ``aux_loss``: scalar tensor added to the LM loss (0 for vanilla). ``aux_losses`` breaks it
  down by name (e.g. ``"layer1.moe/balance"``) for logging.
* ``trace``: a list of ``RoutingSite`` (empty for vanilla), one per routing decision point.
* ``residuals``: when ``return_residuals=True``, the residual stream at each sub-layer boundary:
  ``SubLayerState("embed", ...)`` first, then one ``"mha"`` and one ``"ffn"`` state per sub-update
  in the order they happened (routed models report the updates as they actually happened).
* ``cache``: the updated ``KVCache`` when one was passed in (generation).
* ``hidden``: optional (B, T, d) stream the head reads (before ``ln_f``), for a model whose head
  does not read the last residual state (depth gating's gated mix), and always with
  ``compute_logits=False``. Use ``final_hidden(out)``.

The FLOPs of a forward pass are ``model.flops_per_token(trace)`` -> ``Flops`` (see ``flops.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


@dataclass
class RoutingSite:
    """One routing decision point in one forward pass.

    A site chooses, for each token, ``k`` of ``len(choice_names)`` options (experts, modules,
    "skip"/"process", layers). Everything is per token, shape (B, T, k) or (B, T, E).

    * ``name``: unique within the model, e.g. ``"block3.mod"``, ``"layer2.moe"``, ``"mom.attn.step1"``.
    * ``kind``: "expert_choice" (MoD: the block picks tokens), "token_choice" (MoE, MoT, MoM:
      each token picks options), or "soft_gate" (depth gating: a dense distribution, nothing skipped).
    * ``choice_names``: label of each option; index i of ``selected`` refers to ``choice_names[i]``.
      A skip / identity option is named "skip".
    * ``selected``: LongTensor (B, T, k): the option chosen in each of the k slots.
    * ``weights``: (B, T, k): the router weight applied to each chosen option.
    * ``probs``: optional (B, T, E): the full router distribution (for entropy).
    * ``dropped``: optional BoolTensor (B, T, k): slot chosen but dropped by a capacity limit.
    * ``group`` / ``step``: sites of the same group ordered by ``step`` form a chain; the routing
      callback builds transition matrices P(option at step s+1 | option at step s) along it.
    * ``valid``: optional BoolTensor (B, T): real (non-padding) tokens; statistics use only these.
    * ``logits``: optional raw router logits, checked for NaN/Inf to name the failing site.
    """

    name: str
    kind: str
    choice_names: List[str]
    selected: torch.Tensor
    weights: torch.Tensor
    group: str = ""
    step: int = 0
    probs: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return len(self.choice_names)

    def counts(self) -> torch.Tensor:
        """Number of (token, slot) assignments per option, over valid tokens, dropped excluded."""
        keep = torch.ones_like(self.selected, dtype=torch.bool)
        if self.dropped is not None:
            keep &= ~self.dropped
        if self.valid is not None:
            keep &= self.valid.unsqueeze(-1)
        return torch.bincount(self.selected[keep].flatten(), minlength=self.num_choices)[: self.num_choices]


@dataclass
class SubLayerState:
    """The residual stream after a sub-layer update (or the embeddings, tag "embed")."""

    tag: str  # "embed" | "mha" | "ffn"
    layer: int  # index of the (logical) layer or assembly step
    hidden: torch.Tensor  # (B, T, d)


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]
    aux_loss: torch.Tensor
    trace: List[RoutingSite] = field(default_factory=list)
    residuals: Optional[List[SubLayerState]] = None
    aux_losses: Dict[str, torch.Tensor] = field(default_factory=dict)
    cache: Optional["KVCache"] = None
    hidden: Optional[torch.Tensor] = None

    def final_hidden(self) -> torch.Tensor:
        """What the LM head reads (before ``ln_f``): ``hidden`` if set, else the last residual state."""
        if self.hidden is not None:
            return self.hidden
        if not self.residuals:
            raise ValueError("final_hidden() needs forward(..., return_residuals=True)")
        return self.residuals[-1].hidden


class KVCache:
    """Keys and values per attention site for autoregressive decoding.

    ``layers[name] = (k, v)`` with shape (B, heads, t, head_dim); ``offset`` is the number of
    positions already consumed. A routed block that skips a token simply writes nothing for it,
    so different sites may hold different lengths.
    """

    def __init__(self) -> None:
        self.layers: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.offset: int = 0
        self._states: Dict[str, Dict[str, Any]] = {}

    def state(self, kind: str) -> Dict[str, Any]:
        """A variant's own per-row decoding state, by site name, kept with the cache: MoT's key masks
        (``"key_valid"``), its causal gate prefix (``"mot_prefix"``), MoDE's no-op budgets. Values are per-row
        tensors (or tuples of them); ``reorder`` follows them as it follows ``layers``."""
        return self._states.setdefault(kind, {})

    def append(self, name: str, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if name in self.layers:
            pk, pv = self.layers[name]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.layers[name] = (k, v)
        return k, v

    def length(self, name: str) -> int:
        return self.layers[name][0].shape[2] if name in self.layers else 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` in that order: new row b is old row ``index[b]`` (beam search).

        Applies to ``layers`` and to every ``state(kind)`` dict a variant keeps on the cache
        (e.g. MoT's key masks). Entries named ``"<site>.row<b>"`` hold a single row (MoD keeps one per
        sequence, because rows process different numbers of tokens); they are renamed, not indexed.
        """
        rows = [int(i) for i in index.tolist()]
        self.layers = _reorder_entries(self.layers, index, rows)
        self._states = {kind: _reorder_entries(entries, index, rows) for kind, entries in self._states.items()}


_ROW_ENTRY = re.compile(r"(.+)\.row(\d+)")


def _reorder_entries(entries: Dict, index: torch.Tensor, rows: List[int]) -> Dict:
    out: Dict = {}
    per_row: Dict[str, Dict[int, object]] = {}
    for name, value in entries.items():
        match = _ROW_ENTRY.fullmatch(name) if isinstance(name, str) else None
        if match:
            per_row.setdefault(match.group(1), {})[int(match.group(2))] = value
        else:
            out[name] = _select_rows(value, index)
    for site, by_row in per_row.items():
        for new, old in enumerate(rows):
            if old in by_row:
                out[f"{site}.row{new}"] = by_row[old]
    return out


def _select_rows(value, index: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, tuple):
        return tuple(_select_rows(v, index) for v in value)
    return value


def zero_aux(reference: torch.Tensor) -> torch.Tensor:
    return reference.new_zeros((), dtype=torch.float32)


def sum_aux(losses: Dict[str, torch.Tensor], reference: torch.Tensor) -> torch.Tensor:
    total = zero_aux(reference)
    for value in losses.values():
        total = total + value.float()
    return total


def first_nonfinite_site(trace: Sequence[RoutingSite]) -> Optional[str]:
    """Name of the first routing site whose router logits (or weights) are NaN/Inf, if any."""
    for site in trace:
        tensor = site.logits if site.logits is not None else site.weights
        if tensor is not None and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return site.name
    return None
