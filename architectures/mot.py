"""Mixture of Transformers (``mot``): whole Transformer blocks as top-k experts.

At each mixture layer (``model.mot.layers``) a bias-free linear gate (fp32) scores E expert blocks
per token; each token goes to its top-k blocks and its residual stream becomes
``x + sum_j w_j * (Block_j(x) - x)``, with w renormalised over the k choices (``renormalize``).
With renormalised weights this equals ``sum_j w_j * Block_j(x)``; writing it as a weighted update
keeps the unweighted residual path (as in MoD) and gives the gate its gradient through w.

Attention inside an expert block (our choice, SPEC §2 "mot"): a block computes keys/values only for
the tokens routed to it and each such token attends causally among the tokens of ITS OWN sequence
routed to the same block, in their original order (positions are already in the embeddings).
So an expert block is an MoD-style block over its own token subset: compute really follows routing.

Layout: one argsort groups the (token, slot) assignments by (expert, sequence, position). Per expert,
the per-token parts (LayerNorms, QKV and output projections, MLP) run on the packed n_e tokens; only
the attention core runs on a right-padded (B, M_e, .) layout, M_e = the largest per-sequence count.
Right padding keeps a plain causal mask exact (a real token never sees a pad). The FLOPs count what
runs: projections and MLP for n_e tokens, scores for B * M_e queries against M_e keys.

Generation (KV cache): an expert block's cache holds keys/values of the tokens routed to it only
(``cache.layers["block{i}.expert{e}"]``). Rows of a batch route differently, so the cached keys are
padded per call; which cached positions are real is kept in ``cache.state("key_valid")[name]`` (B, t) and
masked in attention.

Anti-collapse: the Switch balance loss (``routing.balance_loss``) on the gate (``balance_coef``).

Seed 002's forms, as options (preset ``mot_seq``; docs/variants.md, "Paper / official code vs our default"):
``routing="sequence"`` (the gate reads the mean of the sequence's real tokens and the whole sequence goes
through the same k blocks; under ``causal_routing()`` or with a cache each token is routed by its prefix
mean instead, the running sum carried on the cache), ``weights="uniform"`` (exactly 1/k forward, the
gate probability's gradient kept), ``gate_hidden`` (gate MLP), ``aggregation="concat"`` (the k slot updates
concatenated and mixed by ``combine``, initialised to the sum), ``random_activation`` (training only: a
unit's last slot goes to a random other block). Attention FLOPs come from the query-key pairs recorded in
the site (``extras["score_pairs"]``), so cached decode steps are counted as run.
Padding tokens (``attention_mask`` 0) are not routed: their stream passes the layer unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig, layer_selection
from architectures.contract import KVCache, RoutingSite
from architectures.dispatch import expert_update, plan_segments, run_idle, score_pairs
from architectures.gpt2 import Block
from architectures.routing import LinearRouter, MLPRouter, SiteId, TopK, balance_loss


@dataclass
class MoTConfig:
    """Mixture of Transformers: whole blocks as experts, top-k gate per mixture layer."""

    num_experts: int = 4
    top_k: int = 2
    layers: Union[str, List[int]] = "all"
    balance_coef: float = 1e-2
    renormalize: bool = True  # gate weights renormalised over the chosen k (k > 1 only, as for MoE)
    # Paper-form options (seed 002; preset ``mot_seq``). Defaults keep our per-token form.
    # "token": each token picks its k blocks. "sequence": the gate reads the mean of the sequence's real
    # tokens and the whole sequence goes through the same k blocks (sees the future: under
    # causal_routing() / decoding each token is routed by the mean of its prefix instead).
    routing: str = "token"
    weights: str = "gate"  # "gate": gate probabilities; "uniform": 1/k forward (seed), gradient to the gate kept
    gate_hidden: int = 0  # 0: linear gate; > 0: gate MLP d -> gate_hidden -> E (GELU)
    aggregation: str = "sum"  # "sum": x + sum_j w_j (Block_j(x) - x); "concat": x + W_c [w_1 u_1; ..; w_k u_k]
    random_activation: float = 0.0  # training only: probability that a routed unit's last slot goes to a random other block


class MoTLayer(nn.Module):
    """E expert blocks behind a top-k gate (per token, or per sequence with ``mot.routing = "sequence"``)."""

    def __init__(self, config: ModelConfig, index: int = 0, step: int = 0):
        super().__init__()
        cfg = config.mot
        self.cfg = cfg
        self.config = config
        self.index, self.step, self.site_name = index, step, f"layer{index}.mot"
        d, E = config.d_model, cfg.num_experts
        # a linear gate, or the seed's gate MLP (d -> gate_hidden -> E); k > 1 weights renormalised over the
        # k picks (at k = 1 the raw probability keeps the gate learning)
        pick = TopK(cfg.top_k, renormalize=cfg.renormalize and cfg.top_k > 1, adjust=self.seed_rules,
                    balance=self.balance if cfg.balance_coef > 0 else None)
        names = [f"expert{i}" for i in range(E)]
        site = SiteId(self.site_name, "mot", step)
        self.gate = (MLPRouter(d, cfg.gate_hidden, E, pick, names, site) if cfg.gate_hidden
                     else LinearRouter(d, E, pick, names, site))
        self.experts = nn.ModuleList([Block(config) for _ in range(cfg.num_experts)])
        if cfg.aggregation == "concat":
            self.combine = nn.Linear(cfg.top_k * d, d, bias=False)
            self.reset_combine()

    def reset_combine(self) -> None:
        """W_c = [I .. I]: concatenation starts out as the weighted sum, then learns to mix the k slots."""
        d = self.config.d_model
        with torch.no_grad():
            self.combine.weight.copy_(torch.eye(d).repeat(1, self.cfg.top_k))

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The block protocol: mix, report the site and losses, snapshot mha / ffn."""
        x, after_attn, site, losses = self.mix(x, state.valid, state.cache, f"block{self.index}",
                                               state.residuals is not None, state.causal, state)
        if state.residuals is not None:
            state.record("mha", self.index, after_attn)
        state.record("ffn", self.index, x)
        return x


    # ------------------------------------------------------------------ routing
    def gate_input(self, x: torch.Tensor, valid, cache: Optional[KVCache], causal: bool, name: str) -> torch.Tensor:
        """What the gate reads: the token itself, or (sequence routing) the mean of the sequence's real
        tokens; causally (decoding, causal_routing()) the mean of the prefix up to each token, carried
        on the cache across calls."""
        if self.cfg.routing == "token":
            return x
        B, T, d = x.shape
        w = torch.ones(B, T, 1, dtype=torch.float32, device=x.device) if valid is None else valid.float().unsqueeze(-1)
        xs = x.float() * w
        if not causal:
            return (xs.sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1)).expand(B, T, d)
        carried = None if cache is None else cache.state("mot_prefix").get(name)
        total, count = xs.cumsum(1), w.cumsum(1)
        if carried is not None:
            total, count = total + carried[0].unsqueeze(1), count + carried[1].unsqueeze(1)
        if cache is not None:
            cache.state("mot_prefix")[name] = (total[:, -1], count[:, -1])
        return total / count.clamp(min=1)

    def route(self, x: torch.Tensor, state: ForwardState, valid=None, cache: Optional[KVCache] = None,
              causal: bool = False, name: str = ""):
        """The gate decides on ``gate_input`` and reports the layer's site (and balance loss) to ``state``."""
        return self.gate(self.gate_input(x, valid, cache, causal, name), state, valid=valid)

    def seed_rules(self, probs, weights, selected):
        """The seed's rules on the gate's pick: random activation (training) and uniform 1/k weights."""
        k = self.cfg.top_k
        if self.training and self.cfg.random_activation > 0:
            selected = self.force_random(selected)
            weights = probs.gather(-1, selected)
            weights = weights / weights.sum(-1, keepdim=True) if self.cfg.renormalize and k > 1 else weights
        if self.cfg.weights == "uniform":
            # the seed's 1/k exactly, forward; the probability's gradient still reaches the gate
            chosen = probs.gather(-1, selected)
            weights = 1.0 / k + (chosen - chosen.detach())  # exactly 1/k: p - p is 0
        return weights, selected

    def balance(self, probs, selected, valid_flat) -> Dict[str, torch.Tensor]:
        return {"balance": self.cfg.balance_coef * balance_loss(probs, selected, self.cfg.num_experts, valid_flat)}

    def force_random(self, selected: torch.Tensor) -> torch.Tensor:
        """With probability ``random_activation`` per routed unit (token, or sequence), the last slot goes to
        a uniformly random block not already among the unit's other choices (anti-collapse, seed 002)."""
        B, T, k = selected.shape
        E = self.cfg.num_experts
        # one draw per sequence under sequence routing (its tokens share their choices, so they share the
        # random block too), one per token otherwise
        rows = (B, 1) if self.cfg.routing == "sequence" else (B, T)
        flip = (torch.rand(rows, device=selected.device) < self.cfg.random_activation).expand(B, T)
        scores = torch.rand(*rows, E, device=selected.device).expand(B, T, E)
        if k > 1:  # never one of the token's other choices
            scores = scores.scatter(-1, selected[..., : k - 1], -1.0)
        last = torch.where(flip, scores.argmax(-1), selected[..., -1])
        return torch.cat([selected[..., :-1], last.unsqueeze(-1)], dim=-1)

    # ------------------------------------------------------------------ mixing
    def mix(self, x, valid=None, cache=None, cache_prefix="", want_attn=False, causal=None,
            state: Optional[ForwardState] = None):
        """Returns (new x, x after the attention updates only or None, RoutingSite, aux losses); the gate
        reports the site and losses to ``state`` (standalone: a throwaway state)."""
        B, T, d = x.shape
        N, k = B * T, self.cfg.top_k
        causal = cache is not None if causal is None else causal
        state = ForwardState.standalone() if state is None else state
        route = self.route(x, state, valid, cache, causal, cache_prefix)
        weights, selected = route.weights, route.selected
        x_flat, w_flat = x.reshape(N, d), weights.reshape(N * k)
        full, attn, slots = [], [], []
        pairs = 0
        for e, seg in enumerate(plan_segments(selected, valid, self.cfg.num_experts, run_idle())):
            if seg is None:
                continue
            name = f"{cache_prefix}.expert{e}"
            a, f = expert_update(self.experts[e], x_flat.index_select(0, seg.tokens), seg, B, cache, name)
            pairs += score_pairs(seg, B, cache, name)
            w = w_flat.index_select(0, seg.slots).to(x.dtype).unsqueeze(-1)
            full.append(f * w)
            attn.append(a * w)
            slots.append(seg.slots)
        combine = lambda parts: self.aggregate(x, torch.cat(slots) if slots else None, parts)
        route.site.extras["score_pairs"] = torch.tensor(float(pairs))
        return combine(full), (combine(attn) if want_attn else None), route.site, route.aux

    def aggregate(self, x: torch.Tensor, slots: Optional[torch.Tensor], parts) -> torch.Tensor:
        """x plus the weighted updates: summed per token, or (``concat``) laid out by slot and mixed by W_c."""
        B, T, d = x.shape
        k = self.cfg.top_k
        if self.cfg.aggregation == "concat":
            by_slot = x.new_zeros(B * T * k, d)
            if slots is not None:
                by_slot = by_slot.index_add(0, slots, torch.cat(parts).to(x.dtype))
            return x + self.combine(by_slot.view(B, T, k * d))
        if slots is None:
            return x
        return x.reshape(B * T, d).index_add(0, slots // k, torch.cat(parts).to(x.dtype)).view(B, T, d)

    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        """Gate + each expert block on its own tokens (padded attention layout included; score pairs as
        recorded, cached keys included) + the concatenation's W_c for every token."""
        site, seq_len, config = sites.get(self.site_name), T, self.config
        d, E, k = config.d_model, self.cfg.num_experts, self.cfg.top_k
        per_token = cost.Flops(attn_proj=cost.attention_projections(d), ffn=cost.ffn(d, config.ffn_hidden))
        h = self.cfg.gate_hidden
        gate = cost.Flops(router=cost.linear(d, h) + cost.linear(h, E) if h else cost.linear(d, E))
        if self.cfg.aggregation == "concat":
            gate = gate + cost.Flops(ffn=cost.linear(k * d, d))
        if site is None:  # balanced routing: every sequence sends T*k/E tokens to each expert
            scores = cost.attention_scores(d, seq_len * k / E) * k
            return per_token.scale(k) + cost.Flops(attn_scores=scores) + gate
        B, T, _ = site.selected.shape
        n_tokens, scores = 0, 0.0
        for seg in plan_segments(site.selected, site.valid, E):
            if seg is not None:
                n_tokens += seg.tokens.numel()
                scores += B * seg.width * cost.attention_scores(d, seg.width)
        if "score_pairs" in site.extras:
            scores = cost.attention_scores(d, 1) * float(site.extras["score_pairs"])
        return per_token.scale(n_tokens / (B * T)) + cost.Flops(attn_scores=scores / (B * T)) + gate


class MoT(LanguageModel):
    """GPT-2 whose mixture layers are top-k mixtures of whole blocks (see the module docstring)."""

    config_groups = {"mot": MoTConfig}
    # --init_from a vanilla model: every expert block starts as the vanilla block of its layer
    upcycle_rules = ((r"(blocks\.\d+)\.experts\.\d+\.(.*)", r"\1.\2"),)

    @property
    def routing_sees_future(self) -> bool:  # sequence routing reads the whole sequence's mean
        return self.config.mot.routing == "sequence"

    def init_weights(self) -> None:
        super().init_weights()
        for block in self.blocks:
            if hasattr(block, "combine"):
                block.reset_combine()

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.mot_layers = layer_selection(config.mot.layers, config.n_layer, "model.mot.layers")
        self.blocks = nn.ModuleList([
            MoTLayer(config, i, self.mot_layers.index(i)) if i in self.mot_layers else Block(config, i)
            for i in range(config.n_layer)
        ])

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        cfg = config.mot
        require(isinstance(cfg.num_experts, int) and cfg.num_experts >= 1, "model.mot.num_experts",
                f"must be an integer >= 1, got {cfg.num_experts!r}")
        require(isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= cfg.num_experts, "model.mot.top_k",
                f"must be in [1, num_experts={cfg.num_experts}], got {cfg.top_k!r}")
        require(cfg.balance_coef >= 0, "model.mot.balance_coef", f"must be >= 0, got {cfg.balance_coef}")
        layer_selection(cfg.layers, config.n_layer, "model.mot.layers")
        for field, value, allowed in (("routing", cfg.routing, ("token", "sequence")), ("weights", cfg.weights, ("gate", "uniform")),
                                      ("aggregation", cfg.aggregation, ("sum", "concat"))):
            require(value in allowed, f"model.mot.{field}", f"unknown value {value!r}; use one of {', '.join(allowed)}")
        require(isinstance(cfg.gate_hidden, int) and cfg.gate_hidden >= 0, "model.mot.gate_hidden",
                f"must be an integer >= 0 (0: linear gate), got {cfg.gate_hidden!r}")
        require(0.0 <= cfg.random_activation <= 1.0, "model.mot.random_activation",
                f"must be a probability in [0, 1], got {cfg.random_activation}")
