"""Sorted token dispatch: run each expert/module once on the contiguous slice of tokens that chose it.

Shared by MoE, MoDE, MoM's FFN assembly, MoT and cea_moe, so FLOPs really follow the routing:
an expert sees only its tokens, and no per-expert boolean mask over all tokens is built.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

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
    tokens that no expert processed. Under autograd every expert gets a gradient (zero for one no token
    chose), as on the grouped-GEMM path.
    """
    N, k = selected.shape
    E = len(experts)
    # Inactive slots (SKIP / no-op ids >= E, or dropped) get key E and sort to the end, so one
    # argsort + one bincount replace boolean filtering (each a hidden nonzero + copy).
    key = selected.reshape(-1).clamp(max=E)
    if keep is not None:
        key = torch.where(keep.reshape(-1), key, torch.full_like(key, E))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)
    traced = torch.compiler.is_compiling()
    sizes = traced_sizes(counts[:E], N * k) if traced else counts.tolist()[:E]
    order = order[: sum(sizes)]
    token_index = order if k == 1 else torch.div(order, k, rounding_mode="floor")  # flat = token * k + slot
    flat_weight = weights.reshape(-1).index_select(0, order)
    tokens = x.index_select(0, token_index)
    pieces = []
    # An expert no token chose still runs, on an empty slice, when gradients are recorded: its gradient is
    # then zero (what d loss / d weights is, what the naive reference and the grouped-GEMM path give)
    # instead of None, so AdamW's momentum and weight decay treat it the same on every path and device.
    # Under torch.compile every expert runs (an idle one on zero rows): a branch on a traced count would
    # break the graph.
    touch_idle = traced or torch.is_grad_enabled()
    for expert, count, piece in zip(experts, sizes, tokens.split(sizes)):
        if touch_idle or count:
            pieces.append(expert(piece))
    if not pieces:
        return x.new_zeros(N, x.shape[-1])
    outputs = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
    outputs = outputs * flat_weight.unsqueeze(-1).to(outputs.dtype)
    return outputs.new_zeros(N, outputs.shape[-1]).index_add(0, token_index, outputs)


def traced_sizes(counts: torch.Tensor, total: int, low: int = 0) -> List[int]:
    """``counts.tolist()`` under torch.compile: unbacked sizes (``capture_scalar_outputs``, set by
    ``model_tools.compiling``) with the bounds the tracer cannot know (low <= count <= total), so the
    per-expert slices stay in one graph and do not recompile when the routing changes."""
    sizes = counts.tolist()
    for size in sizes:
        torch._check(size >= low)
        torch._check(size <= total)
    return sizes
