"""Sorted token dispatch: run each expert/module once on the contiguous slice of tokens that chose it.

Shared by MoE, MoDE, MoM's FFN assembly, MoT and cea_moe, so FLOPs really follow the routing:
an expert sees only its tokens, and no per-expert boolean mask over all tokens is built.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def sorted_dispatch(
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Weighted sum of expert outputs per token, computing each expert only on its own tokens.

    x: (N, d) tokens. selected: (N, k) LongTensor of expert ids; ids >= len(experts) (e.g. a
    SKIP / no-op option) contribute nothing and cost nothing. weights: (N, k). keep: optional
    (N, k) bool, False for slots dropped by a capacity limit. Returns (N, d_out) with zeros for
    tokens that no expert processed.
    """
    N, k = selected.shape
    flat_expert = selected.reshape(-1)
    flat_weight = weights.reshape(-1)
    flat_token = torch.arange(N, device=x.device).repeat_interleave(k)
    active = flat_expert < len(experts)
    if keep is not None:
        active &= keep.reshape(-1)
    flat_expert, flat_weight, flat_token = flat_expert[active], flat_weight[active], flat_token[active]
    order = torch.argsort(flat_expert, stable=True)
    flat_expert, flat_weight, flat_token = flat_expert[order], flat_weight[order], flat_token[order]
    counts = torch.bincount(flat_expert, minlength=len(experts)).tolist()
    tokens = x.index_select(0, flat_token)
    pieces = []
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            pieces.append(expert(tokens[start : start + count]))
        start += count
    if not pieces:
        return x.new_zeros(N, x.shape[-1])
    outputs = torch.cat(pieces, dim=0)
    outputs = outputs * flat_weight.unsqueeze(-1).to(outputs.dtype)
    result = outputs.new_zeros(N, outputs.shape[-1])
    return result.index_add(0, flat_token, outputs)


def dense_reference(
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The naive reference: every expert on every token, masked. For tests only."""
    out = None
    for e, expert in enumerate(experts):
        gate = ((selected == e) * weights)
        if keep is not None:
            gate = gate * keep
        contribution = expert(x) * gate.sum(-1, keepdim=True).to(x.dtype)
        out = contribution if out is None else out + contribution
    return out if out is not None else torch.zeros_like(x)
