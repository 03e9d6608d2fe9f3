"""FFN-Wider and the combination architectures ``caa`` / ``cea`` / ``cea_moe`` (Lu et al., NeurIPS 2024,
arXiv 2403.02436; ../shared/SPEC.md §2).

``ffn_wider``: vanilla GPT-2 whose FFN hidden width is ``combo.wide_ffn_ratio * d`` (default 32d).

``caa`` (Combination Adjustable Architecture). The total FFN width ``W = combo.total_ffn_ratio * d``
(default 32d, the FFN-Wider width, so ``caa`` at r = 1 *is* ``ffn_wider``) is split into an
Outer-FFN of width ``r * W`` (``r = combo.outer_ratio``; the usual FFN after MHA) and an Inner-FFN
of width ``(1 - r) * W`` that lives inside MHA. One pre-LN block computes, with ``h = ln_1(x)``:

    q, k, v   = c_attn(h)                                  # the vanilla fused projection
    direct    = softmax_causal(q k^T / sqrt(dh)) v          # key j <= i: the direct pathway
    v_inner   = V_inner(InnerFFN(h))                        # per-token values through the Inner-FFN
    inner     = softmax_strict(q k^T / sqrt(dh)) v_inner    # key j <  i: own Inner-FFN output masked
    x         = x + O(direct) + O'(inner)                   # "mha" residual state
    x         = x + OuterFFN(ln_2(x))                       # "ffn" residual state

* Q and K are shared by both pathways (SPEC's formula uses one ``QK^T``): the Inner path only adds
  what other tokens' Inner-FFN outputs say, weighted by the same attention pattern renormalised
  over the strictly earlier keys. Its own ``V_inner`` (d -> d) and ``O'`` (d -> d) are separate
  from the direct ``V`` and ``O``, so with the Inner-FFN switched off the block is exactly vanilla.
* The direct pathway keeps the normal value projection, so a token still sees its own
  (untransformed) representation, as the paper's "direct pathway in MHA" prescribes.
* No token receives its own Inner-FFN output: the Inner path uses a causal mask with the diagonal
  removed (the paper's FlashAttention-compatible simplification). It is computed as ordinary
  causal attention of queries 1..T-1 over keys/values 0..T-2 (a one-position shift), so every
  kernel (flash included) applies and no explicit mask is needed. The first position has no
  allowed key at all: its Inner output is defined as 0 (before ``O'``, whose bias still applies),
  never a NaN from a softmax over nothing.
* KV cache: the direct K/V are cached under ``block{i}``, the Inner values under
  ``block{i}.inner`` (with a zero-width placeholder key, since K is shared).

``cea`` (Combination Enhanced Architecture): ``caa`` with a fixed ratio. Our choice: r = 0.125 at
W = 32d, i.e. the Outer-FFN keeps the vanilla 4d width and the other 28d move inside MHA. The paper's
MoE version does the same (the dense FFN stays as the Outer-FFN, the added capacity moves inside);
our sources give no number for the FFN-Wider CEA ratio. The preset lives in the registry.

``cea_moe``: the Inner-FFN is an ``MoELayer`` (``combo.inner_experts`` experts, top-``combo.inner_top_k``;
balance / z-loss / capacity settings from the ``moe`` group). Each expert has the Inner-FFN width
``(1 - r) * W``, so at top-1 a token's active FFN compute equals ``caa``'s. Preset: W = 8d, r = 0.5,
i.e. a dense 4d Outer-FFN and 4d experts inside MHA, as the paper's 14B model (dense FFN outside,
top-1 MoE inside). Its routing sites are ``block{i}.inner_moe`` (group "inner_moe", step i).

Paper wiring (``combo.inner_wiring``; presets ``cea_paper``, ``cea_moe_paper``). The default above is our
additive reading of SPEC; the paper (seed 004) routes the OTHER positions' keys and values through the
Inner-FFN and keeps the own position's from before it, inside ONE attention:

    q, k, v   = c_attn(h)                                   # the own position's key/value: direct pathway
    u         = h + InnerFFN(h)                             # the Inner-FFN with its residual (our reading)
    k', v'    = W_k u, W_v u                                # the same W_k, W_v (no new parameters)
    scores_ij = q_i k'_j (j < i),  q_i k_i (j = i)         # one softmax over both
    x         = x + O(sum_{j<i} a_ij v'_j + a_ii v_i)

* ``"paper"``: as above. With the Inner-FFN's output zero it is exactly vanilla MHA; a token never sees
  its own Inner-FFN output; parameters are exactly ffn_wider's at the same W (no V_inner / O'). The
  attention is computed explicitly (scores over all cached keys, the own-key term added), so it does
  not use a fused kernel. KV cache: the Inner keys/values k', v' under ``block{i}``.
* ``"paper_masked"``: the simplification the authors used at 14B for FlashAttention-2: every key and
  value through the Inner-FFN, the own position masked (strictly causal; position 0 gets 0).
  Why ``additive`` stays the default: it keeps the fused causal kernel for the direct path and was the
  form this suite's measurements used; the paper forms are one switch away.

FLOPs (``flops.py`` conventions): ``V_inner`` and ``O'`` count as ``attn_proj``; the Inner path's
scores count what the math kernel computes, ``(T-1)^2`` query-key pairs per sequence; the Inner-FFN
(dense or the experts actually run) counts as ``ffn``, its router as ``router``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.contract import KVCache, RoutingSite
from architectures.gpt2 import MLP, CausalSelfAttention, causal_attention
from architectures.moe_layer import MoEConfig, MoELayer, MoEResult, validate_moe_config
from architectures.routing import SiteId


@dataclass
class CombinationConfig:
    """FFN-Wider / Combination Adjustable (caa) / Enhanced (cea) architectures (Lu et al. 2024).

    Presets (registry): ``cea`` sets outer_ratio 0.125 (Outer-FFN = vanilla 4d of W = 32d);
    ``cea_moe`` sets total_ffn_ratio 8 (dense 4d Outer-FFN, 4d experts inside MHA at r = 0.5).
    """

    wide_ffn_ratio: float = 32.0  # ffn_wider: hidden = ratio * d
    # caa/cea: total FFN width W = ratio * d, split outer/inner. 32 = the FFN-Wider width the paper
    # redistributes, so caa at r = 1 is ffn_wider; use 4 for a vanilla-width split.
    total_ffn_ratio: float = 32.0
    outer_ratio: float = 0.5  # r: Outer-FFN width = r * W, Inner-FFN = (1 - r) * W; r * W must be whole
    inner_experts: int = 4  # cea_moe: experts of the Inner MoE, each (1 - r) * W wide
    inner_top_k: int = 1
    # How the Inner-FFN enters MHA (architectures/combination.py). "additive" (default): full MHA on
    # untransformed values + an additive Inner path with its own V_inner / O'. "paper" (seed 004): one
    # MHA whose keys/values of OTHER positions come from u = h + InnerFFN(h) through the shared W_k / W_v,
    # the own position's from h (the direct pathway); no extra parameters. "paper_masked": the paper's
    # FlashAttention simplification at 14B: every key/value through the Inner-FFN, own position masked.
    inner_wiring: str = "additive"

INNER_SITE = "inner_moe"


def strictly_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention in which a query sees only keys STRICTLY before it; a query with none gets 0.

    Queries are the last ``q.shape[2]`` positions of the key sequence (as in ``causal_attention``).
    Key j < query i  <=>  causal attention over the keys shifted by one position: drop the last key,
    and drop the queries at absolute position 0 (there is at most one, when nothing is cached).
    """
    t_q, t_k = q.shape[2], k.shape[2]
    empty = max(0, t_q - (t_k - 1))
    zeros = q.new_zeros(q.shape[0], q.shape[1], empty, v.shape[-1])
    if empty == t_q:
        return zeros
    out = causal_attention(q[:, :, empty:], k[:, :, :-1], v[:, :, :-1], dropout_p)
    return torch.cat([zeros, out], dim=2) if empty else out


def attention_with_direct_self(q, k, v, k_self, v_self, dropout_p: float = 0.0) -> torch.Tensor:
    """The paper's CAA attention: query i sees the keys/values (k, v) of positions j < i and its OWN
    direct key/value (k_self, v_self) instead of its k_i, v_i, under one softmax.

    Queries are the last ``q.shape[2]`` positions of the key sequence (cached decoding as in
    ``causal_attention``). Explicit math (no fused kernel): Q K^T and A V over every key, the own-key
    term elementwise.
    """
    t_q, t_k = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    earlier = torch.arange(t_k, device=q.device)[None, :] < torch.arange(t_k - t_q, t_k, device=q.device)[:, None]
    scores = scores.masked_fill(~earlier, float("-inf"))
    own = (q * k_self).sum(-1, keepdim=True) * scale
    probs = torch.cat([scores, own], dim=-1).float().softmax(dim=-1).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs[..., :-1] @ v + probs[..., -1:] * v_self


WIRINGS = ("additive", "paper", "paper_masked")


class InnerPath(nn.Module):
    """The Inner-FFN (dense MLP or MoE) and, in the additive wiring, the Inner path's own value and output
    projections (the paper wiring reuses the attention's W_k, W_v and O)."""

    def __init__(self, d_model: int, ffn: nn.Module, bias: bool, wiring: str = "additive"):
        super().__init__()
        self.ffn = ffn
        self.wiring = wiring
        if wiring == "additive":
            self.v_proj = nn.Linear(d_model, d_model, bias=bias)
            self.c_proj = nn.Linear(d_model, d_model, bias=bias)

    def transform(self, h: torch.Tensor, valid, state=None) -> Tuple[torch.Tensor, Optional[MoEResult]]:
        """InnerFFN(h): the dense MLP's output or the MoE's update (tokens with no expert get 0); an MoE's
        router reports its site to ``state``."""
        if isinstance(self.ffn, MoELayer):
            result = self.ffn(h, valid, state=state)
            return result.output, result
        return self.ffn(h), None

    def values(self, h: torch.Tensor, valid, state=None) -> Tuple[torch.Tensor, Optional[MoEResult]]:
        if isinstance(self.ffn, MoELayer):
            result = self.ffn(h, valid, state=state)
            return self.v_proj(result.output), result
        return self.v_proj(self.ffn(h)), None


class CombinationAttention(CausalSelfAttention):
    """Vanilla causal MHA (the direct pathway) plus, when ``inner`` is given, the Inner path."""

    def __init__(self, d_model: int, n_head: int, inner: Optional[InnerPath], bias: bool = True, dropout: float = 0.0):
        super().__init__(d_model, n_head, bias, dropout)
        self.inner = inner

    def forward(  # type: ignore[override]
        self,
        h: torch.Tensor,
        cache: Optional[KVCache] = None,
        cache_key: str = "",
        valid: Optional[torch.Tensor] = None,
        state=None,
    ) -> Tuple[torch.Tensor, Optional[MoEResult]]:
        if self.inner is not None and self.inner.wiring != "additive":
            return self.paper_forward(h, cache, cache_key, valid, state)
        q, k, v = (self.split_heads(t) for t in self.c_attn(h).chunk(3, dim=-1))
        if cache is not None:
            k, v = cache.append(cache_key, k, v)
        p = self.dropout if self.training else 0.0
        out = self.c_proj(self.merge_heads(causal_attention(q, k, v, p)))
        moe = None
        if self.inner is not None:
            values, moe = self.inner.values(h, valid, state)
            v_inner = self.split_heads(values)
            if cache is not None:
                # K is shared with the direct path: cache only the Inner values (zero-width key).
                _, v_inner = cache.append(cache_key + ".inner", v_inner[..., :0], v_inner)
            out = out + self.inner.c_proj(self.merge_heads(strictly_causal_attention(q, k, v_inner, p)))
        return self.resid_drop(out), moe

    def paper_forward(self, h, cache, cache_key, valid, state=None):
        """The paper's wiring (module docstring): other positions' K/V from h + InnerFFN(h), own from h."""
        d = h.shape[-1]
        q, k_self, v_self = (self.split_heads(t) for t in self.c_attn(h).chunk(3, dim=-1))
        inner, moe = self.inner.transform(h, valid, state)
        bias = self.c_attn.bias[d:] if self.c_attn.bias is not None else None
        k, v = (self.split_heads(t) for t in F.linear(h + inner.to(h.dtype), self.c_attn.weight[d:], bias).chunk(2, dim=-1))
        if cache is not None:
            k, v = cache.append(cache_key, k, v)
        p = self.dropout if self.training else 0.0
        if self.inner.wiring == "paper_masked":
            y = strictly_causal_attention(q, k, v, p)
        else:
            y = attention_with_direct_self(q, k, v, k_self, v_self, p)
        return self.resid_drop(self.c_proj(self.merge_heads(y))), moe


class CombinationBlock(nn.Module):
    """Pre-LN block: x + MHA(+Inner-FFN)(ln_1 x), then + OuterFFN(ln_2 x) when the Outer width > 0.

    With no Inner path its parameters are named exactly like ``gpt2.Block`` (weights interchange).
    """

    def __init__(self, config: ModelConfig, outer: int, inner: Optional[nn.Module], index: int = 0,
                 inner_width: int = 0):
        super().__init__()
        d = config.d_model
        self.index, self.d_model, self.inner_width = index, d, inner_width
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        path = InnerPath(d, inner, config.bias, config.combo.inner_wiring) if inner is not None else None
        self.attn = CombinationAttention(d, config.n_head, path, config.bias, config.dropout)
        self.outer = outer
        if outer > 0:
            self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
            self.mlp = MLP(d, outer, config.bias, config.dropout)

    @torch.no_grad()
    def start_as_dense(self) -> str:
        """Upcycling hook: the Inner path (new; vanilla has none) starts with a zero output, so the block is
        exactly the vanilla block: O' = 0 in the additive wiring, the Inner-FFN's output projection(s) = 0 in
        the paper wirings (then h + InnerFFN(h) = h)."""
        inner = self.attn.inner
        if inner is None:
            return ""
        if inner.wiring == "additive":
            writers = [inner.c_proj]
        else:
            writers = [inner.ffn.experts.c_proj] if isinstance(inner.ffn, MoELayer) else [inner.ffn.c_proj]
        for layer in writers:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
        return "Inner path output zero"

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        # the mask only tells an Inner MoE which tokens to route and count (right padding, as vanilla)
        layer = self.index
        update, _ = self.attn(self.ln_1(x), state.cache, f"block{layer}", state.valid, state)  # an Inner MoE reports
        x = x + update
        state.record("mha", layer, x)
        if self.outer > 0:
            x = x + self.mlp(self.ln_2(x))
        state.record("ffn", layer, x)  # unchanged when r = 0: no Outer-FFN
        return x

    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        d = self.d_model
        flops = cost.Flops(attn_proj=cost.attention_projections(d), attn_scores=cost.attention_scores(d, T),
                         ffn=cost.ffn(d, self.outer) if self.outer else 0.0)
        inner = self.attn.inner
        if inner is None:
            return flops
        # strictly causal = causal over the keys shifted by one: the call's Q queries (minus one at
        # absolute position 0, which has no earlier key) x (T - 1) keys, averaged over the Q new tokens
        Q = T if queries is None else queries
        strictly_causal = cost.attention_scores(d, (Q - max(0, Q - (T - 1))) * (T - 1) / Q)
        if inner.wiring != "additive":
            # one attention: W_k, W_v once more on u; scores as vanilla ("paper": every key and the own one)
            # or over the strictly earlier keys ("paper_masked", the shifted causal call)
            path = cost.Flops(attn_proj=cost.linear(d, 2 * d))
            if inner.wiring == "paper_masked":
                path = path + cost.Flops(attn_scores=strictly_causal - cost.attention_scores(d, T))
            return flops + path + self.inner_ffn_flops(sites)
        path = cost.Flops(attn_proj=2 * cost.linear(d, d), attn_scores=strictly_causal)
        return flops + path + self.inner_ffn_flops(sites)

    def inner_ffn_flops(self, sites: Dict[str, RoutingSite]) -> cost.Flops:
        inner, d = self.attn.inner, self.d_model
        if isinstance(inner.ffn, MoELayer):
            return inner.ffn.layer_flops(sites.get(f"block{self.index}.{INNER_SITE}"))
        return cost.Flops(ffn=cost.ffn(d, self.inner_width))


def validate_wiring(config: ModelConfig) -> None:
    wiring = config.combo.inner_wiring
    require(wiring in WIRINGS, "model.combo.inner_wiring", f"unknown wiring {wiring!r}; use one of {', '.join(WIRINGS)}")


def _whole(value: float, field: str, what: str) -> int:
    require(value >= 0 and abs(value - round(value)) < 1e-6, field,
            f"{what} = {value:g} is not a whole number of hidden units")
    return int(round(value))


class CombinationLM(LanguageModel):
    """``caa`` / ``cea``: Outer-FFN of width r*W after MHA, dense Inner-FFN of width (1-r)*W inside it."""

    config_groups = {"combo": CombinationConfig}
    may_skip_parameters = False  # dense: every parameter gets a gradient every step

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        outer, inner = self.widths(config)
        self.outer_width, self.inner_width = outer, inner
        self.blocks = nn.ModuleList(
            [CombinationBlock(config, outer, self.make_inner(config, inner, i) if inner > 0 else None, i, inner)
             for i in range(config.n_layer)]
        )

    # ------------------------------------------------------------------ configuration
    @classmethod
    def widths(cls, config: ModelConfig) -> Tuple[int, int]:
        """(Outer-FFN width, Inner-FFN width) = (r*W, W - r*W); raises ConfigError naming the field."""
        c = config.combo
        require(isinstance(c.total_ffn_ratio, (int, float)) and c.total_ffn_ratio > 0, "model.combo.total_ffn_ratio",
                f"must be > 0, got {c.total_ffn_ratio!r}")
        require(isinstance(c.outer_ratio, (int, float)) and 0.0 <= c.outer_ratio <= 1.0, "model.combo.outer_ratio",
                f"must be in [0, 1], got {c.outer_ratio!r}")
        d = config.d_model
        total = _whole(c.total_ffn_ratio * d, "model.combo.total_ffn_ratio",
                       f"W = total_ffn_ratio * d_model = {c.total_ffn_ratio:g} * {d}")
        require(total >= 1, "model.combo.total_ffn_ratio", f"W = total_ffn_ratio * d_model must be >= 1, got {total}")
        outer = _whole(c.outer_ratio * total, "model.combo.outer_ratio",
                       f"Outer-FFN width r * W = {c.outer_ratio:g} * {total}")
        return outer, total - outer

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        cls.widths(config)
        validate_wiring(config)

    def make_inner(self, config: ModelConfig, width: int, index: int) -> nn.Module:
        """Block ``index``'s Inner-FFN, ``width`` wide."""
        return MLP(config.d_model, width, config.bias, config.dropout)

    def init_weights(self) -> None:
        super().init_weights()
        # The base init shrinks every "*c_proj.weight" as a residual writer; inside the Inner path
        # only O' (inner.c_proj) writes to the residual, the Inner-FFN output feeds V_inner.
        for name, param in self.named_parameters():
            if ".inner.ffn." in name and name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=self.config.init_std)

    def num_parameters_formula(self) -> int:
        """Closed-form parameter count (tied head counted once); tests check it against the model."""
        cfg = self.config
        d, b = cfg.d_model, int(cfg.bias)
        mlp = lambda h: 2 * d * h + b * (h + d)  # noqa: E731
        linear = d * d + b * d
        block = 2 * d + 4 * d * d + b * 4 * d  # ln_1, c_attn, c_proj
        if self.inner_width:
            additive = self.config.combo.inner_wiring == "additive"
            block += self.inner_ffn_parameters(mlp(self.inner_width)) + (2 * linear if additive else 0)
        if self.outer_width:
            block += 2 * d + mlp(self.outer_width)
        return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + 2 * d

    def inner_ffn_parameters(self, dense_mlp: int) -> int:
        return dense_mlp


class CombinationMoELM(CombinationLM):
    """``cea_moe``: the Inner-FFN is an MoE layer; the Outer-FFN stays dense."""

    config_groups = {"combo": CombinationConfig, "moe": MoEConfig}  # moe: the Inner MoE's other settings
    may_skip_parameters = True  # an Inner expert may get no token
    # the Inner MoE takes its size and placement from combo (inner_moe_config): these moe options would be ignored
    config_fields_ignored = ("moe.num_experts", "moe.top_k", "moe.expert_ffn_ratio", "moe.layers", "moe.placement")

    @staticmethod
    def inner_moe_config(config: ModelConfig):
        return dataclasses.replace(config.moe, num_experts=config.combo.inner_experts,
                                   top_k=config.combo.inner_top_k, expert_ffn_ratio=None)

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        outer, inner = cls.widths(config)
        c = config.combo
        require(inner > 0, "model.combo.outer_ratio",
                f"cea_moe needs an Inner-FFN (r < 1) to hold its experts, got r = {c.outer_ratio:g}")
        require(isinstance(c.inner_experts, int) and c.inner_experts >= 1, "model.combo.inner_experts",
                f"cea_moe needs at least 1 expert, got {c.inner_experts!r}")
        require(isinstance(c.inner_top_k, int) and 1 <= c.inner_top_k <= c.inner_experts, "model.combo.inner_top_k",
                f"must be in [1, inner_experts={c.inner_experts}], got {c.inner_top_k!r}")
        validate_moe_config(cls.inner_moe_config(config), prefix="model.moe")
        validate_wiring(config)

    def make_inner(self, config: ModelConfig, width: int, index: int) -> nn.Module:
        return MoELayer(config.d_model, width, self.inner_moe_config(config), config.bias, config.dropout,
                        site=SiteId(f"block{index}.{INNER_SITE}", INNER_SITE, index))

    def inner_ffn_parameters(self, dense_mlp: int) -> int:
        E = self.config.combo.inner_experts
        return E * dense_mlp + self.config.d_model * E  # experts + bias-free router


class FFNWider(CombinationLM):
    """``ffn_wider``: vanilla GPT-2 with FFN hidden width ``combo.wide_ffn_ratio * d`` (no Inner path)."""

    @classmethod
    def widths(cls, config: ModelConfig) -> Tuple[int, int]:
        ratio = config.combo.wide_ffn_ratio
        require(isinstance(ratio, (int, float)) and ratio > 0, "model.combo.wide_ffn_ratio", f"must be > 0, got {ratio!r}")
        d = config.d_model
        return _whole(ratio * d, "model.combo.wide_ffn_ratio", f"FFN width wide_ffn_ratio * d_model = {ratio:g} * {d}"), 0
