"""The token-choice Mixture-of-Experts FFN (Switch / top-k): ``MoELayer``, its config and ``MoEBlock``.

A library module, no family: ``MoELayer`` is the one MoE layer of the suite, the ``moe`` variant (moe.py),
MoDE (mod.py) and ``cea_moe`` (combination.py) use it (MoM's ``routing: moe`` is its own GRU-routed configuration, not this layer). It replaces a block's MLP: it returns the FFN *update* only (the
caller adds the residual), so a token that gets no expert (dropped by the capacity limit, routed to a
no-op expert, or padding) is left unchanged by the residual.

Placement (``moe.placement``): "replace" (default, Switch) puts the layer where the block's MLP was;
"before_ffn" (the CEA-MoE paper's baseline, preset ``moe_dense_ffn``) keeps the dense MLP and runs the MoE
layer in front of it with its own LayerNorm and residual.

Routing: the router is a bias-free linear map evaluated in fp32 (``x.float()``, autocast off),
softmax over the ``E + noop_experts`` choices, top-k per token; the k weights are optionally
renormalised to sum to 1. A no-op expert ("skip") costs nothing and adds nothing (MoDE-integrated).

Capacity: with ``dropless=False`` each real expert accepts at most
``ceil(capacity_factor * N * k / E)`` (token, slot) assignments, N = routed (valid) tokens. Priority is
by position (``capacity_keep``): all assignments at position t, over the batch rows, before any at t+1,
so a later token never evicts an earlier one (causal) and drops spread evenly over the rows. Slots over
capacity are marked ``dropped``.
Capacity applies per forward call, so in KV-cache decoding (a few tokens per call) it rarely binds:
the usual train/inference difference of capacity-limited MoE. ``dropless=True`` (the default) has none.

Experts: ``architectures.experts.GroupedExperts``, the E MLPs as stacked (E, ., .) parameters
(``experts.c_fc.weight`` ...). Dispatch: one argsort by expert, one index_select, each expert with tokens once
on its contiguous segment (or two grouped matmuls on CUDA bf16), one index_add, so FLOPs follow the routing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn

from architectures import flops as cost
from architectures.base import ForwardState, require
from architectures.config import ModelConfig
from architectures.contract import KVCache, RoutingSite
from architectures.experts import GroupedExperts
from architectures.gpt2 import MLP, CausalSelfAttention
from architectures.routing import LinearRouter, SiteId, Switch


@dataclass
class MoEConfig:
    """Token-choice Mixture-of-Experts FFN (Switch / top-k)."""

    num_experts: int = 8
    top_k: int = 1
    renormalize: bool = True  # weights renormalised over the chosen k (k > 1; k = 1 keeps the raw probability)
    balance_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    # Tokens per expert = capacity_factor * tokens * top_k / E. Ignored when dropless.
    capacity_factor: float = 1.25
    dropless: bool = True
    # Which layers get an MoE FFN: "all", "odd", "even", or an explicit list.
    layers: Union[str, List[int]] = "all"
    expert_ffn_ratio: Optional[float] = None  # None: the model's ffn_ratio
    # "replace": the MoE layer is the block's FFN (Switch; our default). "before_ffn": the MoE layer gets
    # its own LayerNorm and residual update BEFORE the dense FFN, which is kept (the CEA-MoE paper's
    # baseline: a 64-expert top-1 MoE in front of each FFN). Preset ``moe_dense_ffn`` matches ``cea_moe``.
    placement: str = "replace"


PLACEMENTS = ("replace", "before_ffn")


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
    require(cfg.placement in PLACEMENTS, f"{prefix}.placement",
            f"unknown placement {cfg.placement!r}; use one of {', '.join(PLACEMENTS)}")
    if cfg.expert_ffn_ratio is not None:
        require(cfg.expert_ffn_ratio > 0, f"{prefix}.expert_ffn_ratio", f"must be > 0, got {cfg.expert_ffn_ratio}")


@dataclass
class MoEResult:
    output: torch.Tensor  # (B, T, d): the FFN update only; tokens with no expert get 0
    site: RoutingSite
    aux_losses: Dict[str, torch.Tensor] = field(default_factory=dict)


class MoELayer(nn.Module):
    """E GPT-2 MLP experts (stacked parameters) (+ optional no-op experts) behind a token-choice top-k router."""

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig, bias: bool = True, dropout: float = 0.0,
                 noop_experts: int = 0, noop_share: Optional[float] = None, site: SiteId = SiteId("moe", "moe")):
        super().__init__()
        require(noop_experts >= 0, "noop_experts", f"must be >= 0, got {noop_experts}")
        validate_moe_config(cfg, noop_experts=noop_experts)
        self.cfg = cfg
        self.hidden = hidden
        self.num_experts = cfg.num_experts
        self.noop_experts = noop_experts
        self.top_k = cfg.top_k
        # most a row's (token, slot) assignments that may go to no-op experts (MoDE's compute budget)
        self.noop_share = noop_share if noop_experts else None
        self.choice_names = [f"expert{i}" for i in range(cfg.num_experts)] + ["skip"] * noop_experts
        pick = Switch(cfg.num_experts, cfg.top_k, cfg.renormalize, cfg.dropless, cfg.capacity_factor, cfg.balance_coef,
                      cfg.z_loss_coef, self.noop_share, budget_key=site.name)
        self.router = LinearRouter(d_model, cfg.num_experts + noop_experts, pick, self.choice_names, site)
        self.experts = GroupedExperts(cfg.num_experts, d_model, hidden, bias, dropout)

    @property
    def num_choices(self) -> int:
        return self.num_experts + self.noop_experts

    #: std of an upcycled router's logits (per unit-variance input feature): small enough that the softmax
    #: is uniform to ~1e-6, large enough that the top-1 ties between the identical experts are broken
    UPCYCLED_ROUTER_LOGIT_STD = 1e-6

    @torch.no_grad()
    def match_dense(self, replaces_ffn: bool) -> str:
        """Make this freshly upcycled layer (every expert a copy of one dense MLP) give the dense update at step 0.

        * Router: N(0, (1e-6)^2 / d) weights, so every probability is 1/E_total to ~1e-6 (the noise only
          breaks the ties between identical experts; AdamW's first update, ~lr per weight, dwarfs it); the
          no-op rows are the mean of the real rows, so a no-op logit never exceeds the largest real one and
          no token is skipped at k = 1.
        * ``replaces_ffn`` (the layer stands where the dense MLP was): each expert's output projection is
          scaled by the inverse of the total weight a token gets at a uniform router, E_total / k (k weights
          of 1 / E_total each; Switch top-1 multiplies by the raw probability) -- nothing when the k > 1
          weights are renormalised to sum to 1. Else (a layer added next to the dense MLP, e.g.
          ``placement: before_ffn``) the output projections start at zero, so the layer adds nothing.
        Exact up to the ~1e-6 router spread, unless a capacity limit drops tokens (``dropless: false``) or
        k > 1 with no-op experts (a no-op may then be among the k).
        """
        d = self.router.weight.shape[1]
        weight = torch.randn_like(self.router.weight) * (self.UPCYCLED_ROUTER_LOGIT_STD / math.sqrt(d))
        if self.noop_experts:
            weight[self.num_experts:] = weight[: self.num_experts].mean(dim=0)
        self.router.weight.copy_(weight)
        sums_to_one = self.cfg.renormalize and self.top_k > 1
        scale = (1.0 if sums_to_one else self.num_choices / self.top_k) if replaces_ffn else 0.0
        self.experts.scale_outputs(scale)
        return f"router near-uniform, expert outputs x {scale:g}"

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                state: Optional[ForwardState] = None, relay=None) -> MoEResult:
        """The router reports the site (``relay``: re-laid first) and its aux losses to ``state`` (standalone:
        a throwaway state); ``valid``: the tokens of ``x`` that are real (not taken from ``state``); ``cache``:
        the decoding cache, which carries the no-op budget between calls."""
        B, T, d = x.shape
        N = B * T
        state = ForwardState.standalone() if state is None else state
        logits = self.router.logits(x)
        budgets = None if cache is None else cache.state("noop_budget")
        choice = self.router.rule.pick(logits, valid, budgets)
        route = self.router.report(state, logits, choice, valid=valid, relay=relay)
        sel_flat, w_flat = route.selected.reshape(N, self.top_k), route.weights.reshape(N, self.top_k)
        out = self.experts(x.reshape(N, d), sel_flat, w_flat.to(x.dtype), route.keep)
        return MoEResult(output=out.view(B, T, out.shape[-1]), site=route.site, aux_losses=route.aux)

    def layer_flops(self, site: Optional[RoutingSite]) -> cost.Flops:
        """Per token, of this sub-layer (its cost does not depend on T): router (all tokens) + the experts
        actually run: active (real, valid, not dropped) assignments per token of the batch. With no site:
        the expected k experts per token. A block adds it to its own ``flops(sites, T, queries)``."""
        d_model = self.router.in_features
        router = cost.linear(d_model, self.num_choices)
        per_expert = cost.ffn(d_model, self.hidden)
        if site is None:
            return cost.Flops(ffn=self.top_k * per_expert, router=router)
        return cost.Flops(ffn=active_assignments(site, self.num_experts) * per_expert, router=router)


def active_assignments(site: RoutingSite, num_experts: int) -> float:
    """Expert evaluations per token of the batch: real expert, valid token, not dropped."""
    keep = site.selected < num_experts
    if site.dropped is not None:
        keep = keep & ~site.dropped
    if site.valid is not None:
        keep = keep & site.valid.unsqueeze(-1)
    return float(keep.sum()) / max(1, site.selected.shape[0] * site.selected.shape[1])


# ---------------------------------------------------------------------------- the block
class MoEBlock(nn.Module):
    """Pre-LN block whose MLP is an ``MoELayer``: x + attn(ln_1 x), then + moe(ln_2 x).

    With ``moe.placement = "before_ffn"`` (the CEA-MoE paper's baseline) the dense FFN is kept and the
    MoE layer runs in front of it with its own LayerNorm and residual: x + attn(ln_1 x), then
    + moe(ln_moe x), then + mlp(ln_2 x). The "ffn" residual snapshot is taken after both (the FFN
    sub-layer is MoE + dense FFN), so the contract's mha / ffn alternation holds.

    Reports one ``token_choice`` site ``site_name`` (group ``group``, chain position ``step``).
    """

    def __init__(self, config: ModelConfig, hidden: int, index: int = 0, site_name: str = "moe",
                 group: str = "moe", step: int = 0, noop_experts: int = 0, noop_share: Optional[float] = None):
        super().__init__()
        d = config.d_model
        self.index, self.site_name = index, site_name
        self.cache_key = f"block{index}"
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(d, config.n_head, config.bias, config.dropout)
        self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.moe = MoELayer(d, hidden, config.moe, config.bias, config.dropout, noop_experts, noop_share,
                            SiteId(site_name, group, step))
        self.dense_hidden = 0
        if config.moe.placement == "before_ffn":
            self.ln_moe = nn.LayerNorm(d, eps=config.layer_norm_eps)
            self.mlp = MLP(d, config.ffn_hidden, config.bias, config.dropout)
            self.dense_hidden = config.ffn_hidden

    def start_as_dense(self) -> str:
        """Upcycling hook (``LanguageModel.start_as_dense``): "replace" scales the experts to the dense MLP's
        update, "before_ffn" (the dense MLP kept) starts the added MoE layer at zero."""
        return self.moe.match_dense(replaces_ffn=not self.dense_hidden)

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), state.cache, self.cache_key)
        state.record("mha", self.index, x)
        moe_in = self.ln_moe(x) if self.dense_hidden else self.ln_2(x)
        result = self.moe(moe_in, state.valid, cache=state.cache, state=state)
        x = x + result.output
        if self.dense_hidden:
            x = x + self.mlp(self.ln_2(x))
        state.record("ffn", self.index, x)
        return x

    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        d = self.ln_1.normalized_shape[0]
        attention = cost.Flops(attn_proj=cost.attention_projections(d), attn_scores=cost.attention_scores(d, T),
                             ffn=cost.ffn(d, self.dense_hidden) if self.dense_hidden else 0.0)
        return attention + self.moe.layer_flops(sites.get(self.site_name))


def expert_hidden(config: ModelConfig) -> int:
    ratio = config.moe.expert_ffn_ratio
    return config.ffn_hidden if ratio is None else int(round(ratio * config.d_model))


#: --init_from a vanilla model: every expert starts as the layer's dense MLP (sparse upcycling; the stacked
#: expert tensors get the dense one broadcast over E). Every model with ``MoEBlock``s uses it.
UPCYCLE_RULES = ((r"(blocks\.\d+)\.moe\.experts\.(.*)", r"\1.mlp.\2"),)
