"""Sorted token dispatch: run each expert/module once on the contiguous slice of tokens that chose it.

Shared by MoE, MoDE, MoM's FFN assembly, MoT and cea_moe, so FLOPs really follow the routing:
an expert sees only its tokens, and no per-expert boolean mask over all tokens is built.

Subset dispatch (``plan_segments``, ``run_on_subset``): a whole GPT-2 block run on the tokens routed to it,
attending causally among its own sequence's routed tokens in a right-padded (B, M, .) layout (MoT's expert
blocks, hard depth gating with skipped compute, MoD's causal decision under torch.compile).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.contract import KVCache


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


# ---------------------------------------------------------------------------- a block on a token subset
@dataclass
class ExpertSegment:
    """The tokens one expert block processes: flat token ids, flat slot ids, padded-layout ids."""

    tokens: torch.Tensor  # (n,) into B*T, sorted by (sequence, position)
    slots: torch.Tensor  # (n,) into B*T*k, to pick the gate weight
    padded: torch.Tensor  # (n,) into B*M
    width: int  # M: the largest number of this expert's tokens in one sequence


def plan_segments(selected: torch.Tensor, valid: Optional[torch.Tensor], num_experts: int,
                  keep_idle: bool = False) -> List[Optional[ExpertSegment]]:
    """Group assignments by expert, then sequence, then position (one argsort); None for idle experts
    unless ``keep_idle`` (then an empty segment).

    Padding tokens get expert id E and sort to the end (no boolean filtering: its nonzero would give a
    data-dependent shape). Under torch.compile the sizes are unbacked (``dispatch.traced_sizes``) and every
    expert gets a segment, an idle one empty: a branch on a traced count would break the graph.
    """
    B, T, k = selected.shape
    N, E = B * T, num_experts
    expert = selected.reshape(-1)
    slots = torch.arange(N * k, device=selected.device)
    tokens = slots // k
    if valid is not None:
        expert = torch.where(valid.reshape(N)[tokens], expert, torch.full_like(expert, E))
    order = torch.argsort(expert * N + tokens)
    expert, slots, tokens = expert[order], slots[order], tokens[order]
    segment = expert * B + tokens // T
    counts = torch.bincount(segment, minlength=(E + 1) * B)
    rank = torch.arange(tokens.numel(), device=tokens.device) - (torch.cumsum(counts, 0) - counts)[segment]
    # M >= 1: an idle expert (run on zero tokens when traced or recording gradients) keeps a non-empty attention
    widths = counts[: E * B].view(E, B).max(dim=1).values.clamp(min=1)
    padded = (tokens // T) * torch.cat([widths, widths.new_zeros(1)])[expert] + rank
    per_expert = counts[: E * B].view(E, B).sum(1)
    traced = torch.compiler.is_compiling()
    if traced:
        sizes, width_list = traced_sizes(per_expert, N), traced_sizes(widths, T, low=1)
    else:
        sizes, width_list = torch.stack([per_expert, widths]).tolist()
    live = sum(sizes)  # the padding tokens' assignments sorted last
    parts = zip(*(t[:live].split(sizes) for t in (tokens, slots, padded)))
    keep = traced or keep_idle
    return [ExpertSegment(*part, width) if keep or n else None for part, n, width in zip(parts, sizes, width_list)]


def run_idle() -> bool:
    """Whether an expert block no token chose runs anyway, on zero tokens (its attention core on a (B, 1)
    layout of zeros): whenever gradients are recorded, so that it gets a zero gradient instead of None, the
    rule of every routed path (``dispatch.sorted_dispatch``, ``experts.GroupedExperts``, the compiled graph):
    AdamW's weight decay and momentum then treat it alike in eager and compiled training."""
    return torch.is_grad_enabled()


def cached_subset_attention(block: nn.Module, qkv: torch.Tensor, new_valid: torch.Tensor, cache: KVCache,
                            name: str) -> torch.Tensor:
    """Attention of padded new tokens (B, M, 3d) against this expert's cached tokens plus themselves."""
    attn = block.attn
    q, k, v = (attn.split_heads(t) for t in qkv.chunk(3, dim=-1))
    masks = cache.state("key_valid")
    old = masks.get(name)
    k, v = cache.append(name, k, v)
    key_valid = new_valid if old is None else torch.cat([old, new_valid], dim=1)
    masks[name] = key_valid
    M, t_k = q.shape[2], k.shape[2]
    causal = torch.ones(M, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - M)
    own = torch.zeros(M, t_k, dtype=torch.bool, device=q.device)
    own[:, t_k - M:] = torch.eye(M, dtype=torch.bool, device=q.device)  # pads see themselves: no empty rows
    mask = causal & (key_valid[:, None, None, :] | own)
    return attn.merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def expert_update(block: nn.Module, x: torch.Tensor, seg: ExpertSegment, batch: int,
                  cache: Optional[KVCache], name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(attention update, full update Block(x) - x) for the packed tokens x (n, d) of one expert."""
    attn = block.attn
    qkv = attn.c_attn(block.ln_1(x))
    layout = qkv.new_zeros(batch * seg.width, qkv.shape[-1]).index_copy(0, seg.padded, qkv)
    layout = layout.view(batch, seg.width, qkv.shape[-1])  # no -1: no division by a traced width
    if cache is None:
        y = attn.attend(layout)
    else:
        new_valid = torch.zeros(batch * seg.width, dtype=torch.bool, device=x.device)
        new_valid[seg.padded] = True
        y = cached_subset_attention(block, layout, new_valid.view(batch, seg.width), cache, name)
    y = y.reshape(batch * seg.width, -1).index_select(0, seg.padded)
    a = attn.resid_drop(attn.c_proj(y))
    return a, a + block.mlp(block.ln_2(x + a))


def score_pairs(seg: ExpertSegment, batch: int, cache: Optional[KVCache], name: str) -> int:
    """Query-key pairs the padded subset attention just computed: B * M queries against the M new keys
    plus, when decoding, every key this subset cached before (what the math kernel and the FLOP counter see)."""
    keys = cache.length(name) if cache is not None else seg.width
    return batch * seg.width * keys


def run_on_subset(block: nn.Module, x: torch.Tensor, chosen: torch.Tensor, cache: Optional[KVCache], name: str):
    """Run ``block`` only on the tokens ``chosen`` (B, T) bool; the others pass unchanged.

    Attention runs among the chosen tokens of each sequence (MoT's subset semantics, KV cache included).
    Returns (x after the attention update, x after the whole block, tokens run, score pairs).
    """
    B, T, d = x.shape
    # with gradients recorded an unchosen block still runs, on zero tokens: a zero gradient (``run_idle``)
    seg = plan_segments(torch.zeros(B, T, 1, dtype=torch.long, device=x.device), chosen, 1, run_idle())[0]
    if seg is None:
        return x, x, 0, 0
    flat = x.reshape(B * T, d)
    a, f = expert_update(block, flat.index_select(0, seg.tokens), seg, B, cache, name)
    after_attn = flat.index_add(0, seg.tokens, a.to(x.dtype)).view(B, T, d)  # autocast: the update may be bf16
    after = flat.index_add(0, seg.tokens, f.to(x.dtype)).view(B, T, d)
    return after_attn, after, seg.tokens.numel(), score_pairs(seg, B, cache, name)
