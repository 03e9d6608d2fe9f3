"""Naive references the tests compare the fast paths with (test code: not part of the package)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def dense_reference(x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor, experts: Sequence[Callable],
                    keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``architectures.dispatch.sorted_dispatch`` the naive way: every expert on every token, masked."""
    out = None
    for e, expert in enumerate(experts):
        gate = ((selected == e) * weights)
        if keep is not None:
            gate = gate * keep
        contribution = expert(x) * gate.sum(-1, keepdim=True).to(x.dtype)
        out = contribution if out is None else out + contribution
    return out if out is not None else torch.zeros_like(x)


def per_token_reference(x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor, experts,
                        keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``architectures.experts.GroupedExperts`` token by token: for each (token, slot) that a real expert
    computes, that expert's GPT-2 MLP written out from its slice of the stacked parameters (eval: no dropout)."""
    fc, proj = experts.c_fc, experts.c_proj
    rows = []
    for n in range(x.shape[0]):
        row = torch.zeros_like(x[n])
        for j in range(selected.shape[1]):
            e = int(selected[n, j])
            if e >= len(experts) or (keep is not None and not bool(keep[n, j])):
                continue
            hidden = fc.weight[e] @ x[n] + (fc.bias[e] if fc.bias is not None else 0)
            hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
            out = proj.weight[e] @ hidden + (proj.bias[e] if proj.bias is not None else 0)
            row = row + weights[n, j] * out
        rows.append(row)
    return torch.stack(rows)
