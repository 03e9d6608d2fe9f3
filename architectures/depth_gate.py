"""Depth gating (``depth_gate``): the blog-post reading of "Mixture of Depths".

THIS SAVES NO COMPUTE. Every layer runs on every token exactly as in vanilla GPT-2; a gating
network then mixes the layer outputs. It is a cheap baseline that shows what token-level depth
gating does to quality and routing statistics, not an efficiency method (for that see ``mod``).

* Gate: a bias-free linear map of the embedded token (token + position embedding, fp32) to L
  logits; softmax gives a distribution g over the L layers.
* Soft mode: output h = sum_l g_l * h_l, where h_l is the residual stream after layer l.
* Hard mode: only the top-k layers by g take part, with g renormalised over those k (k=1: the
  straight-through weight g / stopgrad(g), 1 forward, so the gate still learns). The other
  layers still run (later layers and attention need them), so hard mode saves nothing either.
* Skip mode (``skip_compute``, hard mode only; preset ``depth_gate_skip``): the blog's tokens "only
  pass through" their top-k layers. Layer l runs only on the tokens that chose it: their attention
  sees only the other tokens of their sequence that chose layer l (MoT's subset semantics and cache,
  ``dispatch.run_on_subset``), and a token that did not choose l passes it unchanged. h_l is then the
  token's stream after layer l as it ran (unchanged when skipped) and h = sum over its k layers of
  w * h_l. FLOPs count the layers actually run: k layers per token instead of L.
* ``ln_f`` and the tied head read the mixed stream h.

Trace: one site "depth_gate" of kind "soft_gate" ("token_choice" in skip mode, which really skips) with choices ``layer0 .. layer{L-1}``: in soft
mode ``selected`` lists every layer (k = L) with ``weights`` = g; in hard mode the top-k layers and
their renormalised weights. ``residuals`` report the layer chain as it ran (vanilla sub-updates);
the final mix is not a sub-layer update and is not reported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.dispatch import run_on_subset
from architectures.gpt2 import Block
from architectures.routing import LinearRouter, SiteId, SoftGate, TopK


@dataclass
class DepthGateConfig:
    """Soft / hard depth gating over layer outputs (the blog-post "MoD"; saves no compute)."""

    mode: str = "soft"  # "soft" or "hard"
    top_k: int = 2
    # Hard mode only. False (default): every layer still runs on every token (a cheap baseline; the gate
    # picks which layer outputs are mixed). True: the blog's "tokens only pass through" their top-k
    # layers: a layer runs only on the tokens that chose it (attention among those tokens), the others
    # pass it unchanged, and FLOPs drop accordingly. Preset ``depth_gate_skip``.
    skip_compute: bool = False


class DepthGate(LanguageModel):
    """GPT-2 whose output is a gate-weighted mix of its layer outputs. Saves no compute."""

    config_groups = {"depth_gate": DepthGateConfig}

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        cfg = config.depth_gate
        # k=1: w / w.sum() is identically 1 and gives the gate no gradient; the straight-through
        # p / stopgrad(p) is 1 forward too but passes d loss / d p through (as MoM's K=1 routers)
        pick = (TopK(cfg.top_k, "token_choice" if cfg.skip_compute else "soft_gate", renormalize=True,
                     straight_through=True) if cfg.mode == "hard" else SoftGate())
        self.gate = LinearRouter(config.d_model, config.n_layer, pick, [f"layer{i}" for i in range(config.n_layer)],
                                 SiteId("depth_gate", "depth_gate"))

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        cfg = config.depth_gate
        require(cfg.mode in ("soft", "hard"), "model.depth_gate.mode", f"must be 'soft' or 'hard', got {cfg.mode!r}")
        if cfg.mode == "hard":
            require(isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= config.n_layer, "model.depth_gate.top_k",
                    f"must be in [1, n_layer={config.n_layer}] in hard mode, got {cfg.top_k!r}")
        require(not cfg.skip_compute or cfg.mode == "hard", "model.depth_gate.skip_compute",
                "skipping layers needs mode 'hard' (soft mode mixes every layer)")

    @property
    def skips(self) -> bool:
        return self.config.depth_gate.skip_compute

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        # the gate reads the embedded tokens and reports the "depth_gate" site; extras once the layers ran
        route = self.gate(x, state)
        probs, selected, weights = route.probs, route.selected, route.weights
        # dense per-layer weight (B, T, L): zeros for layers outside the hard top-k
        dense = torch.zeros_like(probs).scatter(-1, selected, weights).to(x.dtype)
        runs = torch.zeros(probs.shape, dtype=torch.bool, device=x.device).scatter(-1, selected, True)
        if state.valid is not None:
            runs &= state.valid.unsqueeze(-1)
        mixed = torch.zeros_like(x)
        ran, pairs = [], []
        for i, block in enumerate(self.blocks):
            if self.skips:  # only the tokens that chose layer i go through it
                after_attn, x, n, p = state.run(
                    lambda s, x, chosen, block=block, key=f"block{i}": run_on_subset(block, x, chosen, s.cache, key),
                    x, runs[..., i])
                state.record("mha", i, after_attn)
                state.record("ffn", i, x)
                ran.append(n)
                pairs.append(p)
            else:
                x = state.block(block, x)
            mixed = mixed + dense[..., i : i + 1] * x
        if self.skips:
            route.site.extras.update(layer_tokens=torch.tensor(ran), score_pairs=torch.tensor(pairs))
        state.hidden = mixed  # the head reads the gated mix, not the last layer
        return x

    def flop_blocks(self):
        return [] if self.skips else self.blocks  # skip mode: counted from what ran (extra_flops)

    def extra_flops(self, sites, T: int) -> cost.Flops:
        """The gate, plus in skip mode the layers that ran: projections and FFN per token run, scores per
        query-key pair computed (without a trace: k layers per token, balanced over the L layers).
        Otherwise every layer runs (the blocks' dense figures); the weighted sum is elementwise."""
        cfg = self.config
        d, L = cfg.d_model, cfg.n_layer
        gate = cost.Flops(router=cost.linear(d, L))
        if not self.skips:
            return gate
        per_token = cost.Flops(attn_proj=cost.attention_projections(d), ffn=cost.ffn(d, cfg.ffn_hidden))
        site = sites.get("depth_gate")
        if site is None or "layer_tokens" not in site.extras:
            k = cfg.depth_gate.top_k
            return per_token.scale(k) + cost.Flops(attn_scores=k * cost.attention_scores(d, T * k / L)) + gate
        tokens = site.selected.shape[0] * site.selected.shape[1]
        ran = float(site.extras["layer_tokens"].sum()) / max(1, tokens)
        scores = cost.attention_scores(d, 1) * float(site.extras["score_pairs"].sum()) / max(1, tokens)
        return per_token.scale(ran) + cost.Flops(attn_scores=scores) + gate
