"""The routing library: every router of the suite is built from these pieces.

MoE, MoT, MoD, MoDE, MoM, depth gating and cea_moe import from here, so a routing rule (fp32 logits,
capacity priority, balance-loss normalisation, SKIP handling) is written once.

* ``fp32_linear``: router projection in fp32 with autocast off.
* ``token_topk``: softmax (temperature, optional mask of allowed choices) + top-k per token, with the
  weight rules (renormalised over k, raw probability, or straight-through at k = 1).
* ``expert_choice_topk``: MoD's per-sequence top-k, k from each example's real length.
* ``capacity_keep``: capacity limit per expert, priority by position.
* ``noop_budget_keep``: a causal per-row budget for no-op / SKIP choices.
* ``balance_loss`` / ``z_loss``: Switch balance loss (real experts only) and ST-MoE z-loss.
* ``sorted_dispatch`` (gather / scatter by expert, from ``dispatch.py``), re-exported here.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from architectures.dispatch import sorted_dispatch  # noqa: F401  (the gather / scatter of the library)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32 even under autocast (which would otherwise run the matmul in bf16/fp16)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def token_topk(logits: torch.Tensor, k: int, temperature: float = 1.0, renormalize: bool = False,
               straight_through: bool = False, allowed: Optional[torch.Tensor] = None):
    """(probs, weights, selected) of a token-choice router over the last dimension.

    ``allowed`` (bool over the choices) masks choices out before the softmax (MoM's layer skipping).
    Weights: at k = 1 with ``straight_through``, p / stopgrad(p) (exactly 1 forward, the router still
    learns from the loss); else renormalised over the k picks when ``renormalize`` (k = 1: exactly 1,
    no gradient); else the raw probabilities (Switch at k = 1).
    """
    scores = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    probs = F.softmax(scores / temperature, dim=-1) if temperature != 1.0 else scores.softmax(dim=-1)
    top, selected = probs.topk(k, dim=-1)
    if k == 1 and straight_through:
        return probs, top / top.detach(), selected
    if renormalize:
        return probs, top / top.sum(dim=-1, keepdim=True), selected
    return probs, top, selected


def capacity_tokens(capacity: float, seq_len: int) -> int:
    """k = max(1, floor(c * T)): tokens each routed block processes per sequence of ``seq_len`` real tokens.

    A sequence shorter than 1/c still gets one token (as every reference implementation does); an
    empty one gets none. The 1e-9 keeps c * T that lands on a whole number in floating point
    (0.29 * 100 = 28.999...) on it; ``row_capacity`` is the same rule per row.
    """
    return min(seq_len, max(1, math.floor(capacity * seq_len + 1e-9)))


def row_capacity(capacity: float, valid: Optional[torch.Tensor], B: int, T: int, device) -> torch.Tensor:
    """(B,) k = max(1, floor(c * length)) per row from each example's own real length (0 for an empty row)."""
    lengths = torch.full((B,), T, device=device) if valid is None else valid.sum(dim=1)
    k = torch.floor(capacity * lengths.double() + 1e-9).long()
    return torch.minimum(k.clamp(min=1), lengths)


def expert_choice_topk(scores: torch.Tensor, capacity: float, valid: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """MoD's expert choice over each sequence: (chosen (B, T) bool, idx (B, k_max), real (B, k_max) bool).

    Row b chooses its k_b = max(1, floor(c * real length)) best real tokens (padding never). ``idx``
    lists them in position order, then fillers (the row's other tokens by position) up to the widest
    row's k_max; ``real`` marks the chosen ones. Fillers come last, so under causal attention among the
    gathered tokens no chosen token sees one. Without padding (``valid`` None) every row has the same
    k, a Python int (static shapes: one graph under torch.compile, no host sync), and ``real`` is None.
    """
    B, T = scores.shape
    if valid is None:
        k = capacity_tokens(capacity, T)
        # the same stable tie-break as the padded path below, so padding never changes a row's choice
        idx = scores.argsort(dim=1, descending=True, stable=True)[:, :k].sort(dim=1).values
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        return chosen, idx, None
    k_row = row_capacity(capacity, valid, B, T, scores.device)
    k_max = max(1, int(k_row.max()))
    scores = scores.masked_fill(~valid, float("-inf"))
    rank = scores.argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    chosen = rank < k_row.unsqueeze(1)
    positions = torch.arange(T, device=scores.device).expand(B, T)
    order_key = torch.where(chosen, positions, positions + T)  # chosen first, each group by position
    idx = order_key.topk(k_max, dim=1, largest=False, sorted=True).indices
    real = torch.arange(k_max, device=scores.device).unsqueeze(0) < k_row.unsqueeze(1)
    return chosen, idx, real


def capacity_keep(selected: torch.Tensor, num_experts: int, capacity: int, routed: torch.Tensor,
                  seq_len: Optional[int] = None) -> torch.Tensor:
    """(N, k) bool: which assignments fit within ``capacity`` per real expert.

    Priority is by position: every assignment of an earlier position (all batch rows of position t,
    row order, each token's choices in slot order) beats any assignment of a later position. So a later
    token can never evict an earlier token's choice (capacity-limited routing stays causal), and the
    tokens that lose out are spread evenly over the batch rows instead of piling up in the last rows.
    ``seq_len`` = T of the (B, T) grid the N = B*T tokens come from (batch-major); None: one row.
    Assignments to ids >= num_experts (no-op) and of unrouted tokens are never dropped (they cost nothing).
    """
    N, k = selected.shape
    T = seq_len or max(N, 1)
    order = torch.arange(N, device=selected.device).view(-1, T).t().reshape(-1)  # position-major token order
    flat = selected.index_select(0, order).reshape(-1)
    real = (flat < num_experts) & routed.index_select(0, order).repeat_interleave(k)
    key = torch.where(real, flat, torch.full_like(flat, num_experts))
    by_expert = torch.argsort(key, stable=True)
    sorted_key = key[by_expert]
    counts = torch.bincount(sorted_key, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[sorted_key]
    keep_sorted = (rank < capacity) | (sorted_key == num_experts)
    keep_priority = torch.empty_like(keep_sorted)
    keep_priority[by_expert] = keep_sorted
    keep = torch.empty(N, k, dtype=torch.bool, device=selected.device)
    keep[order] = keep_priority.view(N, k)
    return keep


def balance_loss(probs: torch.Tensor, selected: torch.Tensor, num_experts: int, valid: torch.Tensor) -> torch.Tensor:
    """Switch loss E * sum_i f_i * P_i over the real experts i < num_experts (coefficient not applied).

    probs (N, E_total), selected (N, k), valid (N,) bool. f_i = share of the valid tokens' real-expert
    assignments that chose i (before capacity dropping, as in Switch); P_i = mean over valid tokens of
    the router probability of i renormalised over the real experts. No-op experts (ids >= num_experts)
    are left out of the sum AND of both denominators, so the loss is the same whatever share of tokens
    skips: it balances the real experts without rewarding skipping (counting the no-op in the
    denominators made it (1 - s)^2 at skip share s, minimised by skipping everything). A uniform router
    over E real experts gives exactly 1.
    """
    n_valid = valid.sum().clamp(min=1)
    # counts by scatter_add, not bincount(selected[valid]): no data-dependent shape, so torch.compile
    # keeps the loss in the graph
    valid_slots = valid.to(probs.dtype).unsqueeze(-1).expand(-1, selected.shape[1]).reshape(-1)
    counts = probs.new_zeros(probs.shape[1]).scatter_add_(0, selected.reshape(-1), valid_slots)[:num_experts]
    f = counts / counts.sum().clamp(min=1)
    real = probs[:, :num_experts]
    if probs.shape[1] > num_experts:
        real = real / real.sum(-1, keepdim=True).clamp(min=1e-9)
    P = (real * valid.unsqueeze(-1).to(probs.dtype)).sum(0) / n_valid
    return num_experts * (f * P).sum()


def noop_budget_keep(wants: torch.Tensor, valid: torch.Tensor, share: float, k: int,
                     state: Optional[torch.Tensor] = None):
    """(B, T) bool: which tokens may take the no-op experts they chose, and the running state (B, 3).

    Greedy by position within each row: token t keeps its ``wants[b, t]`` no-op assignments while the
    row's accepted no-op assignments stay <= floor(share * k * n_t), n_t = valid tokens up to t. The
    greedy count has the closed form A_t = W_t + min(0, min_{s<=t}(L_s - W_s)) (W: wanted so far,
    L: the limit), so it is one cumsum and one cummin: causal, per row (independent of batch-mates and
    right padding), and ``state`` = (W, running min, n) carries it across cached decoding calls.
    """
    B, T = wants.shape
    if state is None:
        state = wants.new_zeros(B, 3, dtype=torch.float64)
    w = (wants * valid).to(torch.float64)
    W = state[:, :1] + w.cumsum(1)
    n = state[:, 2:3] + valid.to(torch.float64).cumsum(1)
    L = torch.floor(share * k * n + 1e-9)
    m = torch.minimum(state[:, 1:2], torch.cummin(L - W, dim=1).values)
    A = W + m.clamp(max=0)
    A_prev = torch.cat([state[:, :1] + state[:, 1:2].clamp(max=0), A[:, :-1]], dim=1)
    keep = (A - A_prev) >= w
    return keep, torch.stack([W[:, -1], m[:, -1], n[:, -1]], dim=1) if T else state


def z_loss(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over valid tokens of logsumexp(logits)^2 (coefficient not applied)."""
    lse = torch.logsumexp(logits, dim=-1)
    w = valid.to(lse.dtype)
    return (lse.square() * w).sum() / w.sum().clamp(min=1)


