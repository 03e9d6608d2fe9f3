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
* ``ln_f`` and the tied head read the mixed stream h.

Trace: one site "depth_gate" of kind "soft_gate" with choices ``layer0 .. layer{L-1}``: in soft
mode ``selected`` lists every layer (k = L) with ``weights`` = g; in hard mode the top-k layers and
their renormalised weights. ``residuals`` report the layer chain as it ran (vanilla sub-updates);
the final mix is not a sub-layer update and is not reported.
"""
from __future__ import annotations


import torch
import torch.nn as nn

from architectures import flops as F_
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.contract import RoutingSite
from architectures.gpt2 import Block
from architectures.routing import fp32_linear, token_topk


class DepthGate(LanguageModel):
    """GPT-2 whose output is a gate-weighted mix of its layer outputs. Saves no compute."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.gate = nn.Linear(config.d_model, config.n_layer, bias=False)
        self.init_weights()

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        cfg = config.depth_gate
        require(cfg.mode in ("soft", "hard"), "model.depth_gate.mode", f"must be 'soft' or 'hard', got {cfg.mode!r}")
        if cfg.mode == "hard":
            require(isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= config.n_layer, "model.depth_gate.top_k",
                    f"must be in [1, n_layer={config.n_layer}] in hard mode, got {cfg.top_k!r}")

    def gate_weights(self, x0: torch.Tensor):
        """(logits, probs, selected, weights) from the embedded tokens x0 (B, T, d)."""
        logits = fp32_linear(x0, self.gate.weight)
        if self.config.depth_gate.mode == "hard":
            # k=1: w / w.sum() is identically 1 and gives the gate no gradient; the straight-through
            # p / stopgrad(p) is 1 forward too but passes d loss / d p through (as MoM's K=1 routers)
            probs, weights, selected = token_topk(logits, self.config.depth_gate.top_k, renormalize=True,
                                                  straight_through=True)
        else:
            probs = logits.softmax(dim=-1)
            L = probs.shape[-1]
            selected = torch.arange(L, device=probs.device).expand(*probs.shape[:-1], L)
            weights = probs
        return logits, probs, selected, weights

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        logits, probs, selected, weights = self.gate_weights(x)
        # dense per-layer weight (B, T, L): zeros for layers outside the hard top-k
        dense = torch.zeros_like(probs).scatter(-1, selected, weights).to(x.dtype)
        mixed = torch.zeros_like(x)
        for i, block in enumerate(self.blocks):
            x = block(x, state)
            mixed = mixed + dense[..., i : i + 1] * x
        state.report(RoutingSite(
            name="depth_gate", kind="soft_gate", choice_names=[f"layer{i}" for i in range(len(self.blocks))],
            selected=selected, weights=weights, group="depth_gate", probs=probs, logits=logits, valid=state.valid,
        ))
        state.hidden = mixed  # the head reads the gated mix, not the last layer
        return x

    def extra_flops(self, sites, T: int) -> F_.Flops:
        """Every layer runs (the blocks' dense figures) plus the gate; the weighted sum is elementwise."""
        return F_.Flops(router=F_.linear(self.config.d_model, self.config.n_layer))
