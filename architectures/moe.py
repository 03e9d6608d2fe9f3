"""Token-choice Mixture-of-Experts FFN (Switch / top-k) and the ``moe`` variant.

``MoELayer`` is the one MoE layer of the suite: the ``moe`` variant, MoDE (``mod``), ``cea_moe`` and
MoM's MoE special case all use it. It replaces a block's MLP: it returns the FFN *update* only (the
caller adds the residual), so a token that gets no expert (dropped by the capacity limit, routed to a
no-op expert, or padding) is left unchanged by the residual.

Routing: the router is a bias-free linear map evaluated in fp32 (``x.float()``, autocast off),
softmax over the ``E + noop_experts`` choices, top-k per token; the k weights are optionally
renormalised to sum to 1. A no-op expert ("skip") costs nothing and adds nothing (MoDE-integrated).

Capacity: with ``dropless=False`` each real expert accepts at most
``ceil(capacity_factor * N * k / E)`` (token, slot) assignments, N = routed (valid) tokens. Priority is
deterministic, GShard/Switch style: all first-choice slots before all second-choice slots, and within
a slot earlier tokens (batch-major, then position) first. Slots over capacity are marked ``dropped``.
Capacity applies per forward call, so in KV-cache decoding (a few tokens per call) it rarely binds:
the usual train/inference difference of capacity-limited MoE. ``dropless=True`` (the default) has none.

Dispatch: ``architectures.dispatch.sorted_dispatch`` (one argsort by expert, one index_select, each
expert once on its contiguous segment, one index_add), so FLOPs follow the routing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as F_
from architectures.base import LanguageModel, require
from architectures.config import ModelConfig, MoEConfig, layer_selection
from architectures.contract import KVCache, ModelOutput, RoutingSite, SubLayerState, sum_aux
from architectures.grouped_gemm import expert_dispatch
from architectures.gpt2 import MLP, Block, CausalSelfAttention


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32 even under autocast (which would otherwise run the matmul in bf16/fp16)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def validate_moe_config(cfg: MoEConfig, prefix: str = "model.moe", noop_experts: int = 0) -> None:
    """Checks shared by every user of ``MoELayer``; errors name ``prefix.<field>``."""
    require(isinstance(cfg.num_experts, int) and cfg.num_experts >= 1, f"{prefix}.num_experts",
            f"must be an integer >= 1, got {cfg.num_experts!r}")
    total = cfg.num_experts + noop_experts
    require(isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= total, f"{prefix}.top_k",
            f"must be in [1, num_experts{' + noop_experts' if noop_experts else ''}={total}], got {cfg.top_k!r}")
    require(cfg.capacity_factor > 0, f"{prefix}.capacity_factor", f"must be > 0, got {cfg.capacity_factor}")
    require(cfg.balance_coef >= 0, f"{prefix}.balance_coef", f"must be >= 0, got {cfg.balance_coef}")
    require(cfg.z_loss_coef >= 0, f"{prefix}.z_loss_coef", f"must be >= 0, got {cfg.z_loss_coef}")
    if cfg.expert_ffn_ratio is not None:
        require(cfg.expert_ffn_ratio > 0, f"{prefix}.expert_ffn_ratio", f"must be > 0, got {cfg.expert_ffn_ratio}")


@dataclass
class MoEResult:
    output: torch.Tensor  # (B, T, d): the FFN update only; tokens with no expert get 0
    site: RoutingSite
    aux_losses: Dict[str, torch.Tensor] = field(default_factory=dict)


def capacity_keep(selected: torch.Tensor, num_experts: int, capacity: int, routed: torch.Tensor) -> torch.Tensor:
    """(N, k) bool: which assignments fit within ``capacity`` per real expert.

    Priority: slot-major (every token's 1st choice before any 2nd choice), then token order. One
    stable argsort gives each assignment its rank inside its expert's segment. Assignments to ids
    >= num_experts (no-op) and of unrouted tokens are never dropped (they cost nothing).
    """
    N, k = selected.shape
    flat = selected.t().reshape(-1)  # slot-major order
    real = (flat < num_experts) & routed.repeat(k)
    key = torch.where(real, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.bincount(sorted_key, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[sorted_key]
    keep_sorted = (rank < capacity) | (sorted_key == num_experts)
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep.view(k, N).t()


def balance_loss(probs: torch.Tensor, selected: torch.Tensor, num_experts: int, valid: torch.Tensor) -> torch.Tensor:
    """Switch loss E * sum_i f_i * P_i over the real experts i < num_experts (coefficient not applied).

    probs (N, E_total), selected (N, k), valid (N,) bool. f_i = share of the valid tokens' k
    assignments that chose i (before capacity dropping, as in Switch); P_i = mean router probability
    of i over valid tokens. No-op experts take part in the softmax and in the denominators but are
    left out of the sum: the router may send tokens to a no-op expert without paying a balance
    penalty (MoDE: skipping is meant to be learned), while the real experts are still balanced.
    A uniform router over E real experts and no no-op gives exactly 1.
    """
    n_valid = valid.sum().clamp(min=1)
    k = selected.shape[1]
    # counts by scatter_add, not bincount(selected[valid]): no data-dependent shape, so torch.compile
    # keeps the loss in the graph
    valid_slots = valid.to(probs.dtype).unsqueeze(-1).expand(-1, k).reshape(-1)
    counts = probs.new_zeros(probs.shape[1]).scatter_add_(0, selected.reshape(-1), valid_slots)
    f = counts[:num_experts] / (n_valid * k)
    P = (probs * valid.unsqueeze(-1).to(probs.dtype)).sum(0)[:num_experts] / n_valid
    return num_experts * (f * P).sum()


def z_loss(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over valid tokens of logsumexp(logits)^2 (coefficient not applied)."""
    lse = torch.logsumexp(logits, dim=-1)
    w = valid.to(lse.dtype)
    return (lse.square() * w).sum() / w.sum().clamp(min=1)


class MoELayer(nn.Module):
    """E GPT-2 MLP experts (+ optional no-op experts) behind a token-choice top-k router."""

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig, bias: bool = True, dropout: float = 0.0,
                 noop_experts: int = 0):
        super().__init__()
        require(noop_experts >= 0, "noop_experts", f"must be >= 0, got {noop_experts}")
        validate_moe_config(cfg, noop_experts=noop_experts)
        self.cfg = cfg
        self.hidden = hidden
        self.num_experts = cfg.num_experts
        self.noop_experts = noop_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(d_model, cfg.num_experts + noop_experts, bias=False)
        self.experts = nn.ModuleList([MLP(d_model, hidden, bias, dropout) for _ in range(cfg.num_experts)])
        self.choice_names = [f"expert{i}" for i in range(cfg.num_experts)] + ["skip"] * noop_experts

    @property
    def num_choices(self) -> int:
        return self.num_experts + self.noop_experts

    def capacity(self, n_tokens: int) -> int:
        return max(1, math.ceil(self.cfg.capacity_factor * n_tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor):
        """fp32 router: (logits, probs, weights, selected), shapes (..., E_total) and (..., k)."""
        logits = fp32_linear(x, self.router.weight)
        probs = logits.softmax(dim=-1)
        weights, selected = probs.topk(self.top_k, dim=-1)
        if self.cfg.renormalize and self.cfg.top_k > 1:
            # never at k=1: w/w = 1 would give the router no gradient through the output (Switch
            # scales the expert output by the raw probability)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, selected

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, site_name: str = "moe",
                group: str = "moe", step: int = 0) -> MoEResult:
        B, T, d = x.shape
        N = B * T
        logits, probs, weights, selected = self.route(x)
        valid_flat = (torch.ones(N, dtype=torch.bool, device=x.device) if valid is None
                      else valid.reshape(N).to(torch.bool))
        sel_flat, w_flat = selected.reshape(N, self.top_k), weights.reshape(N, self.top_k)
        keep = None if valid is None else valid_flat.unsqueeze(-1).expand(N, self.top_k)
        dropped = torch.zeros(N, self.top_k, dtype=torch.bool, device=x.device)
        if not self.cfg.dropless:
            fits = capacity_keep(sel_flat, self.num_experts, self.capacity(int(valid_flat.sum())), valid_flat)
            dropped = ~fits
            keep = fits if keep is None else keep & fits
        out = expert_dispatch(x.reshape(N, d), sel_flat, w_flat.to(x.dtype), self.experts, keep)
        aux: Dict[str, torch.Tensor] = {}
        probs_flat = probs.reshape(N, probs.shape[-1])  # explicit width: N may be 0
        if self.cfg.balance_coef > 0:
            aux[f"{site_name}/balance"] = self.cfg.balance_coef * balance_loss(
                probs_flat, sel_flat, self.num_experts, valid_flat)
        if self.cfg.z_loss_coef > 0:
            aux[f"{site_name}/z_loss"] = self.cfg.z_loss_coef * z_loss(logits.reshape(N, logits.shape[-1]), valid_flat)
        site = RoutingSite(
            name=site_name, kind="token_choice", choice_names=list(self.choice_names),
            selected=selected, weights=weights, group=group, step=step, probs=probs,
            dropped=dropped.view(B, T, self.top_k), valid=None if valid is None else valid.to(torch.bool),
            logits=logits,
        )
        return MoEResult(output=out.view(B, T, out.shape[-1]), site=site, aux_losses=aux)

    def flops_per_token(self, site: Optional[RoutingSite], d_model: int) -> F_.Flops:
        """Router (all tokens) + the experts actually run: active (real, valid, not dropped) assignments
        per token of the batch. With no site: the expected k experts per token."""
        router = F_.linear(d_model, self.num_choices)
        per_expert = F_.ffn(d_model, self.hidden)
        if site is None:
            return F_.Flops(ffn=self.top_k * per_expert, router=router)
        return F_.Flops(ffn=active_assignments(site, self.num_experts) * per_expert, router=router)


def active_assignments(site: RoutingSite, num_experts: int) -> float:
    """Expert evaluations per token of the batch: real expert, valid token, not dropped."""
    keep = site.selected < num_experts
    if site.dropped is not None:
        keep = keep & ~site.dropped
    if site.valid is not None:
        keep = keep & site.valid.unsqueeze(-1)
    return float(keep.sum()) / max(1, site.selected.shape[0] * site.selected.shape[1])


# ---------------------------------------------------------------------------- the ``moe`` variant
class MoEBlock(nn.Module):
    """Pre-LN block whose MLP is an ``MoELayer``: x + attn(ln_1 x), then + moe(ln_2 x)."""

    def __init__(self, config: ModelConfig, hidden: int, noop_experts: int = 0):
        super().__init__()
        d = config.d_model
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(d, config.n_head, config.bias, config.dropout)
        self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.moe = MoELayer(d, hidden, config.moe, config.bias, config.dropout, noop_experts)

    def forward(self, x, valid=None, cache=None, cache_key="", residuals=None, layer=0, site_name="moe",
                step=0):
        x = x + self.attn(self.ln_1(x), cache, cache_key)
        if residuals is not None:
            residuals.append(SubLayerState("mha", layer, x))
        result = self.moe(self.ln_2(x), valid, site_name=site_name, group="moe", step=step)
        x = x + result.output
        if residuals is not None:
            residuals.append(SubLayerState("ffn", layer, x))
        return x, result


def expert_hidden(config: ModelConfig) -> int:
    ratio = config.moe.expert_ffn_ratio
    return config.ffn_hidden if ratio is None else int(round(ratio * config.d_model))


def trace_seq_len(trace: Optional[List[RoutingSite]], seq_len: Optional[int], default: int) -> int:
    """Sequence length for attention FLOPs: explicit, else the traced batch's T, else ``default``."""
    if seq_len:
        return seq_len
    if trace:
        return int(trace[0].selected.shape[1])
    return default


class MoEGPT(LanguageModel):
    """GPT-2 whose FFN is a token-choice MoE at the layers ``model.moe.layers`` (others dense).

    Trace: one ``token_choice`` site per MoE layer, ``layer{i}.moe``, all in group "moe" with
    ``step`` = rank among MoE layers, so the routing callback can chain expert(l) -> expert(l+1).
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.moe_layers = layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")
        hidden = expert_hidden(config)
        self.blocks = nn.ModuleList([
            MoEBlock(config, hidden) if i in self.moe_layers else Block(config) for i in range(config.n_layer)
        ])
        self.init_weights()

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        validate_moe_config(config.moe)
        layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")

    def forward(self, idx: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                return_residuals: bool = False, cache: Optional[KVCache] = None) -> ModelOutput:
        offset = cache.offset if cache is not None else 0
        valid = attention_mask.to(torch.bool) if attention_mask is not None else None
        x = self.embed(idx, offset)
        residuals = [SubLayerState("embed", -1, x)] if return_residuals else None
        trace: List[RoutingSite] = []
        aux: Dict[str, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            if isinstance(block, MoEBlock):
                x, result = block(x, valid, cache, f"block{i}", residuals, i, f"layer{i}.moe", len(trace))
                trace.append(result.site)
                aux.update(result.aux_losses)
            else:
                x = block(x, cache, f"block{i}", residuals, i)
        if cache is not None:
            cache.offset += idx.shape[1]
        return ModelOutput(logits=self.head(x), aux_loss=sum_aux(aux, x), trace=trace, residuals=residuals,
                           aux_losses=aux, cache=cache)

    def flops_per_token(self, trace: Optional[List[RoutingSite]] = None, seq_len: Optional[int] = None) -> F_.Flops:
        cfg = self.config
        T = trace_seq_len(trace, seq_len, cfg.block_size)
        sites = {site.name: site for site in trace or []}
        total = F_.lm_head(cfg.d_model, cfg.vocab_size)
        attention = F_.Flops(attn_proj=F_.attention_projections(cfg.d_model),
                             attn_scores=F_.attention_scores(cfg.d_model, T))
        for i, block in enumerate(self.blocks):
            total = total + attention
            if isinstance(block, MoEBlock):
                total = total + block.moe.flops_per_token(sites.get(f"layer{i}.moe"), cfg.d_model)
            else:
                total = total + F_.Flops(ffn=F_.ffn(cfg.d_model, cfg.ffn_hidden))
        return total
