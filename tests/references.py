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
