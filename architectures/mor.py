"""Mixture-of-Recursions (Bae et al., NeurIPS 2025, arXiv 2507.10524; official code raymin0223/mixture_of_recursions).

A stack of ``S`` shared blocks is applied up to ``N_r = model.mor.num_recursions`` times; a router decides per
token how many recursions it gets. Parameter sharing (``model.mor.sharing``):

* ``middle_cycle`` (the paper's best): a distinct first and last block, the ``L - 2`` middle positions filled by
  ``S = (L - 2) / N_r`` shared blocks cycled ``N_r`` times;
* ``cycle``: ``S = L / N_r`` shared blocks cycled ``N_r`` times, nothing distinct.

At full depth every token runs ``L`` block applications, as the dense model does.

Routing (``model.mor.routing``):

* ``expert`` (expert choice, the official ``MoRLlamaDecoderLayer``): at recursion r a router per recursion scores
  the still-active tokens (the residual stream, fp32), ``g = alpha * sigmoid(w_r^T x / temperature)``, and each
  row keeps its top ``k_r = max(1, floor(beta_r * real length))`` of them (hierarchical filtering: only tokens
  chosen at r - 1 are candidates at r). ``beta_r`` = ``model.mor.capacities``, by default ``(N_r - r) / N_r``
  (r = 0 .. N_r - 1: 1, 1/2 for two recursions; 1, 2/3, 1/3 for three; our reading of the paper, the official
  configs were not available). The top-k is not causal, so, as in MoD, each recursion has a causal decision
  (``model.mor.sampling``): ``predictor`` (an MLP on the stop-gradient stream trained with BCE on top-k
  membership, the official ``aux_router``) or ``aux_loss`` (BCE on the router logit itself); generation and
  ``causal_routing()`` route by it (sigmoid > 0.5).
* ``token`` (token choice): one router over the ``N_r`` depths reads the stream once, before the first
  recursion; each token takes its argmax depth, with weight ``g`` = that depth's softmax probability, and a
  Switch balance loss over the depths (``mor.depth/balance``). Causal by construction.

Update of a token that runs recursion r (``F`` = the shared stack, its residuals included, as the official
code's decoder layers): expert choice ``x + g F(x)`` at every recursion (``update: official``, the official
``scatter_add`` of ``weights * block output``) or ``x + g (F(x) - x)`` (``update: delta``, MoD's form);
token choice ``F(x)`` at the recursions before the token's last, the gated form at its last.

Compute and KV: the tokens that run recursion r are gathered (``(B, M)`` right-padded layout, pads after the
real tokens so causal attention never shows them to a real query) and only they pay the stack; at recursion r a
token attends only over the tokens active at r, with their keys and values at r (recursion-wise KV caching:
one cache entry per recursion, shared block and row, ``mor.r{r}.s{j}.row{b}``, written only by the tokens that
ran it). Per-token depth (``extras["depth"]``, shared-block applications as run; ``extras["max_depth"]``) is
reported on the family's last routing site, with the FLOPs statistics of the whole recursion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.contract import RoutingSite
from architectures.dispatch import traced_sizes
from architectures.gpt2 import Block
from architectures.routing import (Decision, LinearRouter, PickRule, SequenceChoice, SiteId, TopK, balance_loss,
                                   capacity_tokens, row_capacity)

ROUTINGS = ("expert", "token")
SHARINGS = ("middle_cycle", "cycle")
UPDATES = ("official", "delta")
SAMPLINGS = ("predictor", "aux_loss")


@dataclass
class MoRConfig:
    """Mixture-of-Recursions. Used by ``mor`` (expert choice) and ``mor_token`` (token choice)."""

    routing: str = "expert"  # "expert" | "token"
    sharing: str = "middle_cycle"  # "middle_cycle" | "cycle"
    num_recursions: int = 2  # N_r; must divide the shared positions (L - 2, or L for cycle)
    # expert choice: capacity per recursion, non-increasing in (0, 1]; None: (N_r - r) / N_r
    capacities: Optional[List[float]] = None
    alpha: float = 0.1  # expert choice: g = alpha * sigmoid(logit / temperature)
    temperature: float = 1.0  # router temperature (both routings)
    update: str = "official"  # "official": x + g F(x); "delta": x + g (F(x) - x)
    sampling: str = "predictor"  # expert choice's causal decision: "predictor" | "aux_loss"
    predictor_hidden: int = 64
    predictor_loss_coef: float = 1.0  # its input is stop-gradient: this only sets its learning rate
    aux_loss_coef: float = 0.01  # router BCE ("aux_loss")
    balance_coef: float = 0.01  # token choice: Switch balance loss over the depths


# ---------------------------------------------------------------------------- configuration
def recursion_layout(n_layer: int, num_recursions: int, sharing: str) -> Tuple[int, int]:
    """(distinct blocks at each end, shared blocks S) for ``n_layer`` block applications at full depth."""
    edge = 1 if sharing == "middle_cycle" else 0
    return edge, (n_layer - 2 * edge) // num_recursions


def capacity_schedule(cfg: MoRConfig) -> List[float]:
    """beta_r per recursion: the given list, else (N_r - r) / N_r (1, 1/2; 1, 2/3, 1/3; ...)."""
    n = cfg.num_recursions
    return list(cfg.capacities) if cfg.capacities is not None else [(n - r) / n for r in range(n)]


def validate_mor(config: ModelConfig) -> None:
    cfg = config.mor
    for field, value, allowed in (("routing", cfg.routing, ROUTINGS), ("sharing", cfg.sharing, SHARINGS),
                                  ("update", cfg.update, UPDATES), ("sampling", cfg.sampling, SAMPLINGS)):
        require(value in allowed, f"model.mor.{field}", f"unknown value {value!r}; use one of {', '.join(allowed)}")
    n = cfg.num_recursions
    require(isinstance(n, int) and n >= 1, "model.mor.num_recursions", f"must be an integer >= 1, got {n!r}")
    shared = config.n_layer - (2 if cfg.sharing == "middle_cycle" else 0)
    edge = config.n_layer - shared
    require(shared >= n, "model.mor.num_recursions",
            f"{n} recursions need model.n_layer >= {n + edge} with sharing {cfg.sharing!r} (got {config.n_layer})")
    require(shared % n == 0, "model.mor.num_recursions",
            f"{n} does not divide the {shared} shared positions of model.n_layer={config.n_layer} with sharing "
            f"{cfg.sharing!r}; choose a divisor of {shared}")
    if cfg.capacities is not None:
        caps = list(cfg.capacities)
        require(len(caps) == n and all(0 < c <= 1 for c in caps) and caps == sorted(caps, reverse=True),
                "model.mor.capacities", f"needs {n} non-increasing values in (0, 1] (one per recursion), got {caps}")
    require(cfg.alpha > 0, "model.mor.alpha", f"must be > 0, got {cfg.alpha}")
    require(cfg.temperature > 0, "model.mor.temperature", f"must be > 0, got {cfg.temperature}")
    require(isinstance(cfg.predictor_hidden, int) and cfg.predictor_hidden >= 1, "model.mor.predictor_hidden",
            f"must be an integer >= 1, got {cfg.predictor_hidden!r}")
    for field in ("predictor_loss_coef", "aux_loss_coef"):
        require(getattr(cfg, field) > 0, f"model.mor.{field}", f"must be > 0, got {getattr(cfg, field)}")
    require(cfg.balance_coef >= 0, "model.mor.balance_coef", f"must be >= 0, got {cfg.balance_coef}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask.to(values.dtype)
    return (values * w).sum() / w.sum().clamp(min=1)


# ---------------------------------------------------------------------------- pick rules
class RecursionChoice(PickRule):
    """Expert choice at one recursion: of the ``active`` tokens each row keeps its top
    ``k = max(1, floor(beta * real length))`` by router logit (``causal``: the caller's causal (B, T) decision
    instead). Weight ``g = alpha * sigmoid(logit / temperature)`` on the chosen tokens (the official router);
    ``logits`` of the choice: the scaled (B, T) score the sampling loss reads."""

    kind = "expert_choice"
    detach_site = True  # the site shows the decision; the block keeps the live gate

    def __init__(self, capacity: float, alpha: float, temperature: float):
        self.capacity, self.alpha, self.temperature = capacity, alpha, temperature

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor], active: Optional[torch.Tensor] = None,
             causal: Optional[torch.Tensor] = None) -> SequenceChoice:
        scores = logits.squeeze(-1) / self.temperature
        gate = self.alpha * torch.sigmoid(scores)
        active = torch.ones_like(gate, dtype=torch.bool) if active is None else active
        if causal is not None:
            chosen = active & causal
        else:
            chosen = hierarchical_topk(scores.detach(), active, self.capacity, valid)
        return SequenceChoice(chosen.long().unsqueeze(-1), (gate * chosen).unsqueeze(-1), logits=scores, chosen=chosen)


def hierarchical_topk(scores: torch.Tensor, active: torch.Tensor, capacity: float,
                      valid: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) bool: each row's ``k_b = max(1, floor(capacity * real length))`` best tokens among ``active``
    (stable tie-break by position). With a non-increasing schedule ``k_b`` never exceeds the active count."""
    B, T = scores.shape
    k_row = row_capacity(capacity, valid, B, T, scores.device)
    rank = scores.masked_fill(~active, float("-inf")).argsort(dim=1, descending=True, stable=True).argsort(dim=1)
    return (rank < k_row.unsqueeze(1)) & active


def depth_balance(coef: float, depths: int):
    """The token-choice balance loss: Switch ``N_r * sum_i f_i P_i`` over the depths (coefficient applied)."""
    def balance(probs, selected, valid_flat):
        if coef <= 0:
            return {}
        return {"balance": coef * balance_loss(probs, selected, depths, valid_flat)}
    return balance


# ---------------------------------------------------------------------------- the gathered recursion
@dataclass
class Gathered:
    """The tokens that run one recursion: ``flat`` (N,) indices into the (B*T) grid, batch-major, by position;
    ``padded`` (N,) their slots in the (B, width) layout (None: the layout is exactly ``flat``); ``counts`` per
    row; ``width`` a Python int (static or, under torch.compile, an unbacked size); ``width_t`` it as a tensor."""

    flat: torch.Tensor
    padded: Optional[torch.Tensor]
    width: int
    counts: torch.Tensor
    width_t: Optional[torch.Tensor] = None


def gather_plan(run: torch.Tensor, static_width: Optional[int] = None) -> Gathered:
    """Lay the tokens of ``run`` (B, T) out right-padded: row b's tokens by position, then pads. With
    ``static_width`` (every row runs exactly that many: expert choice without padding) the shapes are static;
    otherwise one argsort (no boolean filtering, whose shape would be data-dependent) and the sizes as unbacked
    values under torch.compile (``dispatch.traced_sizes``), so the recursion stays in one graph."""
    B, T = run.shape
    counts = run.sum(dim=1)
    grid = torch.arange(B * T, device=run.device)
    if static_width is not None:
        positions = torch.arange(T, device=run.device).expand(B, T)
        idx = torch.where(run, positions, positions + T).topk(static_width, dim=1, largest=False, sorted=True).indices
        flat = (idx + torch.arange(B, device=run.device).unsqueeze(1) * T).reshape(-1)
        return Gathered(flat, None, static_width, counts)
    order = torch.argsort(torch.where(run.reshape(-1), grid, grid + B * T))  # running tokens first, in grid order
    # at least 1 wide: a recursion no token reached still runs (on pads only) when gradients are recorded
    width_t = counts.max().clamp(min=1) if B * T else counts.new_zeros(())
    if torch.compiler.is_compiling():
        n, width = traced_sizes(counts.sum().view(1), B * T)[0], traced_sizes(width_t.view(1), T, low=1)[0]
    else:
        n, width = torch.stack([counts.sum(), width_t]).tolist()
    flat = order[:n]
    rank = (run.cumsum(dim=1) - 1).reshape(-1).index_select(0, flat)
    return Gathered(flat, torch.div(flat, T, rounding_mode="floor") * width + rank, width, counts, width_t)


class _Stats:
    """What the recursion ran, for FLOPs: shared-block token applications and attention score pairs."""

    def __init__(self):
        self.tokens, self.pairs = 0.0, 0.0


def _combine(x_sel, f_sel, gate_sel, last_sel, update: str):
    """The update of the gathered tokens: gated at a token's last recursion, ``F(x)`` before it (token choice)."""
    g = gate_sel.unsqueeze(-1).to(x_sel.dtype)
    gated = x_sel + g * f_sel if update == "official" else x_sel + g * (f_sel - x_sel)
    return gated if last_sel is None else torch.where(last_sel.unsqueeze(-1), gated, f_sel)


# ---------------------------------------------------------------------------- the model
class MixtureOfRecursions(LanguageModel):
    """Mixture-of-Recursions GPT-2 (``mor``, ``mor_token``). See the module docstring."""

    config_groups = {"mor": MoRConfig}
    # every recursion runs (on zero tokens when none was picked and gradients are recorded): nothing idles
    may_skip_parameters = False

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        cfg = config.mor
        edge, S = recursion_layout(config.n_layer, cfg.num_recursions, cfg.sharing)
        self.cfg, self.S, self.N = cfg, S, cfg.num_recursions
        self.first = nn.ModuleList([Block(config, 0)] if edge else [])
        self.shared = nn.ModuleList([Block(config, edge + j) for j in range(S)])
        self.last = nn.ModuleList([Block(config, config.n_layer - 1)] if edge else [])
        self.routing_sees_future = cfg.routing == "expert"  # the top-k over each row; causal_routing() is not
        d = config.d_model
        if cfg.routing == "expert":
            self.routers = nn.ModuleList([
                LinearRouter(d, 1, RecursionChoice(beta, cfg.alpha, cfg.temperature), ["skip", "recurse"],
                             SiteId(f"mor.rec{r}", "mor", r))
                for r, beta in enumerate(capacity_schedule(cfg))])
            if cfg.sampling == "predictor":
                h = cfg.predictor_hidden
                self.predictors = nn.ModuleList([
                    nn.Sequential(nn.Linear(d, h), nn.GELU(approximate="tanh"), nn.Linear(h, 1))
                    for _ in range(self.N)])
        else:
            pick = TopK(1, temperature=cfg.temperature, balance=depth_balance(cfg.balance_coef, self.N))
            self.router = LinearRouter(d, self.N, pick, [f"depth{i + 1}" for i in range(self.N)],
                                       SiteId("mor.depth", "mor", 0))

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        validate_mor(config)

    @property
    def depth_site_name(self) -> str:
        return f"mor.rec{self.N - 1}" if self.cfg.routing == "expert" else "mor.depth"

    # -------------------------------------------------------------- body
    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        for block in self.first:
            x = state.block(block, x)
        x = self.recursions(x, state)
        for block in self.last:
            x = state.block(block, x)
        return x

    def recursions(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The N_r recursions; each token's depth as run on the family's last site, with the FLOPs statistics."""
        B, T, _ = x.shape
        active = torch.ones(B, T, dtype=torch.bool, device=x.device) if state.valid is None else state.valid
        depth = torch.zeros(B, T, device=x.device)
        stats, plan, site = _Stats(), None, None
        if self.cfg.routing == "token":
            plan = self.router(x, state)
            site = plan.site
        for r in range(self.N):
            run, gate, last, width, site = self.decide(r, x, active, plan, state, site)
            x = self.recurse(r, x, run, gate, last, width, state, stats)
            depth = depth + run.to(depth.dtype) * self.S
            active = run
        site.extras.update({"depth": depth, "max_depth": torch.tensor(float(self.N * self.S)),
                            "block_tokens": torch.as_tensor(stats.tokens, dtype=torch.float64),
                            "attn_pairs": torch.as_tensor(stats.pairs, dtype=torch.float64)})
        return x

    # -------------------------------------------------------------- routing
    def decide(self, r: int, x, active, plan: Optional[Decision], state: ForwardState, site):
        """(run, gate, last, static width, site) of recursion r: which tokens run it, their weight, which of them
        end there (None: all), the layout width when it is static."""
        if plan is not None:  # token choice: depth chosen once
            depth = plan.selected[..., 0]
            run = active & (depth >= r)
            return run, plan.weights[..., 0], depth == r, None, site
        router = self.routers[r]
        logits = router.logits(x)
        causal = self.causal_decision(r, x, logits.squeeze(-1)) if state.causal else None
        route = router.report(state, logits, router.rule.pick(logits, state.valid, active=active, causal=causal))
        if not state.causal:
            self.sampling_loss(r, x, route, active, state)
        B, T = active.shape
        static = None if state.causal or state.valid is not None else capacity_tokens(router.rule.capacity, T)
        return route.choice.chosen, route.weights[..., 0], None, static, route.site

    def predictor_logits(self, r: int, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            first, act, last = self.predictors[r]
            h = act(F.linear(x.detach().float(), first.weight.float(), first.bias.float()))
            return F.linear(h, last.weight.float(), last.bias.float()).squeeze(-1)

    def causal_decision(self, r: int, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(B, T) bool from each token alone: sigmoid(predictor or router logit) > 0.5."""
        return (self.predictor_logits(r, x) if self.cfg.sampling == "predictor" else logits) > 0

    def sampling_loss(self, r: int, x, route: Decision, active, state: ForwardState) -> None:
        """BCE of the causal decision against top-k membership, over the candidates of recursion r."""
        target = route.choice.chosen.to(torch.float32)
        if self.cfg.sampling == "predictor":
            decision, name, coef = self.predictor_logits(r, x), "predictor_bce", self.cfg.predictor_loss_coef
        else:
            decision, name, coef = route.choice.logits, "router_bce", self.cfg.aux_loss_coef
        bce = F.binary_cross_entropy_with_logits(decision, target, reduction="none")
        state.aux[f"mor.rec{r}/{name}"] = coef * masked_mean(bce, active)
        agree = ((decision.detach() > 0) == route.choice.chosen).to(torch.float32)
        route.site.extras["causal_agreement"] = masked_mean(agree, active)

    # -------------------------------------------------------------- compute on the gathered tokens
    def recurse(self, r: int, x, run, gate, last, width, state: ForwardState, stats: _Stats) -> torch.Tensor:
        """Recursion r on the tokens of ``run`` only: gathered, the shared stack, the update, scattered back."""
        B, T, d = x.shape
        plan = gather_plan(run, width)
        idle = not torch.compiler.is_compiling() and plan.flat.numel() == 0
        if idle and not (torch.is_grad_enabled() and state.cache is None):
            for block in self.shared:  # nothing runs: the stream is unchanged
                state.record("mha", block.index + r * self.S, x)
                state.record("ffn", block.index + r * self.S, x)
            return x
        attend = self.row_attention(r, plan, state, stats) if state.cache is not None else \
            self.padded_attention(plan, B, stats)
        xf = x.reshape(B * T, d)
        x_sel = xf.index_select(0, plan.flat)
        f_sel = state.run(lambda st, xs: self.stack(r, xs, attend, x, plan.flat, st), x_sel)
        pick = lambda t: t.reshape(-1).index_select(0, plan.flat)  # noqa: E731
        y = _combine(x_sel, f_sel, pick(gate), None if last is None else pick(last), self.cfg.update)
        out = xf.index_copy(0, plan.flat, y).view(B, T, d)
        state.record("ffn", self.shared[-1].index + r * self.S, out)
        stats.tokens = stats.tokens + (plan.counts.sum() if plan.padded is not None else plan.flat.numel()) * self.S
        return out

    def stack(self, r: int, xs, attend, x, flat, state: ForwardState) -> torch.Tensor:
        """F: the shared blocks (their residuals included) on the gathered tokens (N, d); the snapshots show the
        (B, T, d) stream ``x`` with the gathered tokens at their intermediate states."""
        xf = x.reshape(-1, x.shape[-1])
        for j, block in enumerate(self.shared):
            a = block.attn.resid_drop(block.attn.c_proj(attend(j, block.attn.c_attn(block.ln_1(xs)))))
            xs = xs + a
            state.record("mha", block.index + r * self.S, xf.index_copy(0, flat, xs).view_as(x))
            xs = xs + block.mlp(block.ln_2(xs))
            if j < len(self.shared) - 1:
                state.record("ffn", block.index + r * self.S, xf.index_copy(0, flat, xs).view_as(x))
        return xs

    def padded_attention(self, plan: Gathered, B: int, stats: _Stats):
        """Causal attention in the (B, M) layout: a row's tokens among themselves, pads last (never seen)."""
        M = plan.width
        M_t = plan.width_t if plan.width_t is not None else M  # a tensor where the width is data-dependent
        stats.pairs = stats.pairs + B * M_t * M_t * self.S

        def attend(j: int, qkv: torch.Tensor) -> torch.Tensor:
            attn = self.shared[j].attn
            if plan.padded is None:
                return attn.attend(qkv.view(B, M, -1)).reshape(B * M, -1)
            layout = qkv.new_zeros(B * M, qkv.shape[-1]).index_copy(0, plan.padded, qkv)
            return attn.attend(layout.view(B, M, -1)).reshape(B * M, -1).index_select(0, plan.padded)
        return attend

    def row_attention(self, r: int, plan: Gathered, state: ForwardState, stats: _Stats):
        """Cached decoding: each row's new tokens of recursion r attend over the row's keys of recursion r."""
        counts = plan.counts.tolist()

        def attend(j: int, qkv: torch.Tensor) -> torch.Tensor:
            outs = []
            for b, seg in enumerate(qkv.split(counts, dim=0)):
                if seg.shape[0]:
                    key = f"mor.r{r}.s{j}.row{b}"
                    outs.append(self.shared[j].attn.attend(seg.unsqueeze(0), state.cache, key)[0])
                    stats.pairs += float(seg.shape[0] * state.cache.length(key))
            return torch.cat(outs, dim=0) if outs else qkv.new_zeros(0, qkv.shape[-1] // 3)
        return attend

    # -------------------------------------------------------------- FLOPs
    def flop_blocks(self):
        return list(self.first) + list(self.last)

    def extra_flops(self, sites: Dict[str, RoutingSite], T: int) -> cost.Flops:
        """The recursions: the shared stack on the tokens that ran it (from the trace, or the planned
        schedule), attention scores as computed, the routers (and predictors) on every token."""
        d, hidden = self.config.d_model, self.config.ffn_hidden
        site = sites.get(self.depth_site_name)
        if site is not None and "block_tokens" in site.extras:  # as run
            n_tokens = site.selected.shape[0] * site.selected.shape[1]
            frac = float(site.extras["block_tokens"]) / n_tokens
            pairs = float(site.extras["attn_pairs"]) / n_tokens
        elif site is not None:
            frac, pairs = self.selected_fractions(sites)
        else:
            frac, pairs = self.planned_fractions(T)
        out = cost.Flops(attn_proj=frac * cost.attention_projections(d), attn_scores=pairs * 4.0 * d,
                       ffn=frac * cost.ffn(d, hidden))
        return out + cost.Flops(router=self.router_flops())

    def selected_fractions(self, sites: Dict[str, RoutingSite]) -> Tuple[float, float]:
        """Shared-block applications and score pairs per token from the sites' selections alone (a trace whose
        statistics were dropped: the probe callback's one-token cuts), each row's runners attending among
        themselves (a lone token: its own key)."""
        site = sites[self.depth_site_name]
        valid = torch.ones_like(site.selected[..., 0], dtype=torch.bool) if site.valid is None else site.valid.bool()
        if self.cfg.routing == "expert":
            runs = [sites[f"mor.rec{r}"].selected[..., 0].bool() & valid for r in range(self.N)]
        else:
            runs = [(site.selected[..., 0] >= r) & valid for r in range(self.N)]
        n_tokens = valid.numel()
        tokens = sum(float(run.sum()) for run in runs) * self.S
        pairs = sum(float(run.sum(dim=1).double().square().sum()) for run in runs) * self.S
        return tokens / n_tokens, pairs / n_tokens

    def planned_fractions(self, T: int) -> Tuple[float, float]:
        """Shared-block applications and score pairs per token of a full-length row, without a trace:
        expert choice from the capacity schedule, token choice with the depths used evenly."""
        if self.cfg.routing == "expert":
            ks = [capacity_tokens(beta, T) for beta in capacity_schedule(self.cfg)]
        else:
            ks = [T * (self.N - r) / self.N for r in range(self.N)]
        return sum(ks) * self.S / T, sum(k * k for k in ks) * self.S / T

    def router_flops(self) -> float:
        d = self.config.d_model
        if self.cfg.routing == "token":
            return cost.linear(d, self.N)
        per = cost.linear(d, 1)
        if self.cfg.sampling == "predictor":
            per += cost.linear(d, self.cfg.predictor_hidden) + cost.linear(self.cfg.predictor_hidden, 1)
        return self.N * per
