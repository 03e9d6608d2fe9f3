"""Recursion with online per-token halting (``recur_halt``): Adaptive Computation Time (Graves 2016,
"Adaptive Computation Time for Recurrent Neural Networks", arXiv 1603.08983) over a shared block, with
the per-position halting of Universal Transformers (Dehghani et al. 2019); PonderNet (Banino et al. 2021,
arXiv 2107.05407) is the other halting rule (``model.recur_halt.halting ponder``, preset ``recur_halt_ponder``).

Layout: ``prelude`` distinct dense blocks, then a shared stack of ``n_shared`` blocks applied up to
``max_steps`` times per token (0: (n_layer - prelude - coda) / n_shared, the vanilla model's depth), then
``coda`` distinct dense blocks, the final LayerNorm and the tied head.

Halting (read at every step s < S = max_steps, from the token's state x_s after the step, fp32 with
autocast off): h_s = sigmoid(w . x_s + b).

* ACT: the halting mass of step s is p_s = h_s. A token halts after the first step N with
  sum_{s<=N} p_s >= 1 - eps (``threshold`` eps), or at S. Its remainder R = 1 - sum_{s<N} p_s; the stream
  the next layer reads is the mean-field mix y = sum_{s<N} p_s x_s + R x_N. Ponder cost tau * (N + R)
  (gradient through R; ``ponder_cost`` tau), aux loss ``recur_halt/ponder``.
* PonderNet: h_s is the conditional halting probability lambda_s; p_s = lambda_s prod_{j<s}(1 - lambda_j).
  The same threshold rule, remainder and mean-field mix (deterministic halting at training and evaluation,
  not the paper's sampling, so compute is decided per token and causally); the KL to a geometric prior
  (``prior`` lambda_p, truncated at S and renormalised), ``kl_coef`` beta, aux loss ``recur_halt/ponder_kl``.

``halt_bias_init`` sets b at initialisation; a negative bias is the "deep start" (arXiv 2604.21999: every
token first runs all steps), 0 the neutral start (ACT halts nearly every token after 2 steps). The default is 0:
the deep start (-3) did not train better here (3 seeds x 300 steps, docs/variants.md, "recur_halt").

Compute follows the halting: at step s the still-running tokens are gathered (flat indices, never a mask),
and only they pay the projections, the FFN and the halting unit. Attention at step s: a running token's
query sees, for every earlier position (and its own), that position's key / value of step s of the same
shared block: computed this step when that token still runs, else REUSED from the last step it ran (its
K/V are frozen when it halts). So a halted token costs nothing later, everything a query reads depends
on earlier positions only, and the KV cache keeps one entry per (step, shared block) holding, per
position, the K/V of that step as run (a halted token's frozen K/V are written into the entries of the
steps it skipped): decoding equals the full forward. Queries of a step are laid out right-padded per row
(eager: the rows with a running token, as wide as the row with the most; under torch.compile every row, at
least one slot wide: one graph, no recompiles); the scores of that layout (rows x width x keys) are what the
FLOPs count.

Trace: one site per forward, ``recur_halt`` (the halting chain: the unit is read at every step, the depth is
decided online), kind ``token_choice`` over the depths ``depth1 .. depth{S}`` (steps run): ``selected`` = steps - 1,
``weights`` = the weight of the halting step's state in the mix (R), ``probs`` = each step's weight in the mix
(ACT's / PonderNet's distribution over depths, sums to 1), ``logits`` = the halting logits read at steps 1 .. S-1
(0 where the token had halted), ``valid`` = the real tokens. ``extras["attn_pairs"]`` (S,): the scores each step
computed. The per-token depth convention: ``extras["depth"]`` (B, T) shared-block applications each token received
(steps run x n_shared; padding runs step 1 only) and ``extras["max_depth"]`` = S x n_shared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.contract import RoutingSite
from architectures.gpt2 import Block
from architectures.dispatch import traced_sizes
from architectures.routing import Choice, Router, SiteId, report_site

HALTING = ("act", "ponder")
SITE = "recur_halt"  # the one routing site: the halting chain of a forward


@dataclass
class RecurHaltConfig:
    """A shared block stack applied up to ``max_steps`` times per token, halted per token (ACT / PonderNet)."""

    halting: str = "act"  # "act" (Graves 2016) or "ponder" (PonderNet, Banino et al. 2021)
    max_steps: int = 0  # S; 0: (n_layer - prelude - coda) / n_shared
    n_shared: int = 1  # blocks in the shared stack (one step applies all of them)
    prelude: int = 0  # distinct dense blocks before the recursion
    coda: int = 0  # distinct dense blocks after it
    halt_bias_init: float = 0.0  # b at init: 0 neutral; < 0 "deep start" (all steps first; did not train better: docs)
    threshold: float = 0.01  # eps: a token halts once its cumulative halting mass reaches 1 - eps
    ponder_cost: float = 0.01  # ACT's tau: aux loss tau * mean(N + R)
    prior: float = 0.5  # PonderNet's lambda_p of the geometric prior
    kl_coef: float = 0.01  # PonderNet's beta: aux loss beta * mean KL(p || geometric(lambda_p))


# ---------------------------------------------------------------------------- the halting unit
@dataclass
class Halting:
    """One step's halting decision on the gathered running tokens (all (N,)): ``logits``; ``halt``; ``mass``,
    the weight of the token's state in the mix (p_s, or the remainder R when it halts); ``cum`` /
    ``remaining``: the running sums after this step (used by the tokens that continue)."""

    logits: torch.Tensor
    halt: torch.Tensor
    mass: torch.Tensor
    cum: torch.Tensor
    remaining: torch.Tensor


class HaltRouter(Router):
    """The halting unit: logit w . x + b in fp32 with autocast off (``Router.logits``; a bias-free
    ``nn.Linear`` for w, so the suite's init covers it, and a bias set by ``halt_bias_init``). ``decide`` is the
    halting rule (ACT's or PonderNet's mass, the threshold, the remainder), read at every step; the chain of
    decisions is reported once per forward, as one site (``RecurHalt._finish``)."""

    def __init__(self, d_model: int, cfg: RecurHaltConfig):
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(1))
        self.halting, self.threshold = cfg.halting, cfg.threshold

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.proj.weight.float()) + self.bias.float()

    def decide(self, x: torch.Tensor, cum: torch.Tensor, remaining: torch.Tensor,
               valid: Optional[torch.Tensor]) -> Halting:
        logits = self.logits(x).reshape(-1)
        h = torch.sigmoid(logits)
        p = h if self.halting == "act" else remaining * h  # the halting mass of this step
        new_cum = cum + p
        halt = new_cum >= 1.0 - self.threshold
        if valid is not None:
            halt = halt | ~valid  # padding runs one step only
        mass = torch.where(halt, 1.0 - cum, p)  # a halting token's remainder R = 1 - its earlier masses
        return Halting(logits, halt, mass, new_cum, remaining * (1.0 - h))


# ---------------------------------------------------------------------------- a step on the gathered tokens
@dataclass
class Layout:
    """Where the running tokens of a step sit in the right-padded query layout: ``rows`` (R,) batch rows with a
    running token, ``slots`` (N,) each token's place in the (R * width) layout, ``positions`` (R * width,)
    absolute query positions (padding slots: 0, they see key 0 and are discarded)."""

    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    width: int
    query_slots: torch.Tensor  # 0-dim float64: R * width, the queries the scores are computed for


def plan_layout(run: torch.Tensor, B: int, T: int, offset: int) -> Layout:
    """The padded query layout of the running tokens ``run`` (flat indices b * T + t, ascending).

    Eager: only the rows with a running token, as wide as the widest. Under torch.compile every row, at least
    one slot wide (traced sizes with their bounds, ``dispatch.traced_sizes``: a branch on a traced size would
    break the graph), as MoD's traced path does; the FLOPs count the layout that ran, either way."""
    row, pos = run // T, run % T
    counts = torch.bincount(row, minlength=B)
    if torch.compiler.is_compiling():
        rows = torch.arange(B, device=run.device)
        (width,) = traced_sizes(counts.max().clamp(min=1).view(1), T, low=1)
        row_rank = rows
        query_slots = B * counts.max().clamp(min=1).double()  # a tensor: no host sync
    else:
        width = int(counts.max())  # 0 when no token runs (counts has B entries)
        rows = counts.nonzero().squeeze(-1)
        row_rank = torch.cumsum((counts > 0).long(), 0) - 1  # a row's place among the rows with running tokens
        query_slots = (counts > 0).sum().double() * counts.max().double()
    first = torch.cumsum(counts, 0) - counts  # index in ``run`` of each row's first token
    rank = torch.arange(run.numel(), device=run.device) - first[row]
    slots = row_rank[row] * width + rank
    positions = torch.zeros(rows.numel() * width, dtype=torch.long, device=run.device)
    positions = positions.index_copy(0, slots, pos + offset)
    return Layout(rows, slots, positions, width, query_slots)


def gathered_attention(block: Block, h: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor], run: torch.Tensor,
                       layout: Layout, state: ForwardState, key: str, shape):
    """Attention of the running tokens (h = ln_1 of their states, (N, d)) at one step of one shared block.

    ``kv``: this call's (B * T, d) keys / values as of the previous step; the running tokens' rows are
    replaced by their fresh ones (the halted ones keep theirs: frozen). Returns (update (N, d), new kv)."""
    attn = block.attn
    B, T = shape
    q, k, v = attn.c_attn(h).chunk(3, dim=-1)
    keys, values = kv[0].index_copy(0, run, k), kv[1].index_copy(0, run, v)
    K, V = (attn.split_heads(t.view(B, T, -1)) for t in (keys, values))
    if state.cache is not None:
        K, V = state.cache.append(key, K, V)
    K, V = K.index_select(0, layout.rows), V.index_select(0, layout.rows)
    R, width = layout.rows.numel(), layout.width
    d = q.shape[-1]
    Q = attn.split_heads(q.new_zeros(R * width, d).index_copy(0, layout.slots, q).view(R, width, d))
    see = torch.arange(K.shape[2], device=q.device) <= layout.positions.view(R, 1, width, 1)
    y = F.scaled_dot_product_attention(Q, K, V, attn_mask=see, dropout_p=attn.dropout if attn.training else 0.0)
    y = attn.merge_heads(y).reshape(R * width, d).index_select(0, layout.slots)
    return attn.resid_drop(attn.c_proj(y)), (keys, values)


def _grid(x: torch.Tensor, run: torch.Tensor, x_run: torch.Tensor, shape) -> torch.Tensor:
    return x.index_copy(0, run, x_run).view(*shape, -1)


# ---------------------------------------------------------------------------- the model
@dataclass
class _Run:
    """The per-token bookkeeping of one forward (flat over the B * T tokens of the call)."""

    x: torch.Tensor  # each token's current state (frozen once it halted)
    mix: torch.Tensor  # the mean-field mix y
    cum: torch.Tensor  # cumulative halting mass
    remaining: torch.Tensor  # PonderNet's prod (1 - lambda)
    steps: torch.Tensor  # steps run
    remainder: torch.Tensor  # R of the halting step (live)
    kl: torch.Tensor  # PonderNet's sum p log(p / prior) (live)
    kv: List[Tuple[torch.Tensor, torch.Tensor]]  # per shared block: keys / values as of the last step run
    run: torch.Tensor  # flat indices of the running tokens
    logits: torch.Tensor  # (B * T, S - 1) halting logits as read (0 where the step did not run)
    masses: torch.Tensor  # (B * T, S) each step's weight in the mix: the distribution over depths
    pairs: List[torch.Tensor] = field(default_factory=list)  # per step: the attention scores computed


class RecurHalt(LanguageModel):
    """A shared block stack with per-token online halting (see the module docstring)."""

    config_groups = {"recur_halt": RecurHaltConfig}
    may_skip_parameters = False  # every token runs step 1, and the halting unit always gets a gradient

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        cfg = config.recur_halt
        self.max_steps = resolved_steps(config)
        first_shared = cfg.prelude
        self.prelude = nn.ModuleList([Block(config, i) for i in range(cfg.prelude)])
        self.shared = nn.ModuleList([Block(config, first_shared + j, cache_key=f"recur.block{j}")
                                     for j in range(cfg.n_shared)])
        coda_start = cfg.prelude + self.max_steps * cfg.n_shared
        self.coda = nn.ModuleList([Block(config, coda_start + i) for i in range(cfg.coda)])
        self.halt_router = HaltRouter(config.d_model, cfg)

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        cfg = config.recur_halt
        require(cfg.halting in HALTING, "model.recur_halt.halting",
                f"must be one of {', '.join(HALTING)}, got {cfg.halting!r}")
        for name in ("n_shared",):
            require(isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1, f"model.recur_halt.{name}",
                    f"must be an integer >= 1, got {getattr(cfg, name)!r}")
        for name in ("prelude", "coda", "max_steps"):
            require(isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 0, f"model.recur_halt.{name}",
                    f"must be an integer >= 0, got {getattr(cfg, name)!r}")
        require(resolved_steps(config) >= 2, "model.recur_halt.max_steps",
                f"must be >= 2 (one halting decision at least), got {resolved_steps(config)} (0 derives it from "
                f"model.n_layer={config.n_layer}: (n_layer - prelude - coda) / n_shared); set it or raise n_layer")
        require(0.0 < cfg.threshold < 1.0, "model.recur_halt.threshold", f"must be in (0, 1), got {cfg.threshold!r}")
        require(0.0 < cfg.prior < 1.0, "model.recur_halt.prior", f"must be in (0, 1), got {cfg.prior!r}")
        for name in ("ponder_cost", "kl_coef"):
            require(getattr(cfg, name) >= 0, f"model.recur_halt.{name}", f"must be >= 0, got {getattr(cfg, name)!r}")
        require(math.isfinite(cfg.halt_bias_init), "model.recur_halt.halt_bias_init", "must be a finite number")

    def init_weights(self) -> None:
        super().init_weights()
        with torch.no_grad():
            self.halt_router.bias.fill_(self.config.recur_halt.halt_bias_init)

    def vanilla_state_mapping(self, vanilla_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``--init_from`` a vanilla model: the prelude from its first blocks, shared block j from the block after
        them (``blocks.{prelude + j}``), the coda from its last blocks; embeddings and ``ln_f`` by name; the
        halting unit stays fresh. Shapes that do not fit are left to the caller to report."""
        cfg = self.config.recur_halt
        L = self.config.n_layer
        sources = {**{f"prelude.{i}.": f"blocks.{i}." for i in range(cfg.prelude)},
                   **{f"shared.{j}.": f"blocks.{cfg.prelude + j}." for j in range(cfg.n_shared)},
                   **{f"coda.{i}.": f"blocks.{L - cfg.coda + i}." for i in range(cfg.coda)}}
        own = self.state_dict()
        mapping = {name: value for name, value in vanilla_state.items() if name in own}
        for name in own:
            for prefix, source in sources.items():
                value = vanilla_state.get(source + name[len(prefix):]) if name.startswith(prefix) else None
                if value is not None:
                    mapping[name] = value
        return mapping

    # -------------------------------------------------------------- the forward
    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        for block in self.prelude:
            x = state.block(block, x)
        B, T, d = x.shape
        track = self._start(x.reshape(B * T, d))
        for step in range(1, self.max_steps + 1):
            self._step(track, step, state, (B, T))
        self._finish(track, state, (B, T))
        x = track.mix.view(B, T, d)
        if not self.coda:
            state.hidden = x  # the head reads the mix; the residual snapshots end at the last step as run
        for block in self.coda:
            x = state.block(block, x)
        return x

    def _start(self, x: torch.Tensor) -> _Run:
        n = x.shape[0]
        zeros = x.new_zeros(n, dtype=torch.float32)
        kv = [(x.new_zeros(n, self.config.d_model), x.new_zeros(n, self.config.d_model)) for _ in self.shared]
        S = self.max_steps
        return _Run(x=x, mix=torch.zeros_like(x), cum=zeros, remaining=zeros + 1.0, steps=zeros.clone(),
                    remainder=zeros.clone(), kl=zeros.clone(), kv=kv, run=torch.arange(n, device=x.device),
                    logits=x.new_zeros(n, S - 1, dtype=torch.float32), masses=x.new_zeros(n, S, dtype=torch.float32))

    def _step(self, track: _Run, step: int, state: ForwardState, shape) -> None:
        """Step ``step`` on the running tokens: the shared stack, then (before the last step) the halting unit;
        the tokens that halt leave ``track.run``."""
        run, B, T = track.run, *shape
        layout = plan_layout(run, B, T, state.offset)
        track.pairs.append(layout.query_slots * (state.offset + T))
        x_run, kv = state.run(lambda s, full, *flat_kv: self._stack(s, full, flat_kv, run, layout, step, shape),
                              track.x, *[t for pair in track.kv for t in pair])
        track.x, track.kv = track.x.index_copy(0, run, x_run), kv
        track.steps = track.steps.index_add(0, run, torch.ones_like(run, dtype=torch.float32))
        if step == self.max_steps:  # every token still running halts: its remainder
            mass = 1.0 - track.cum.index_select(0, run)
            halt = torch.ones_like(run, dtype=torch.bool)
        else:
            mass, halt = self._decide(track, x_run, step, state)
        self._accumulate(track, x_run, mass, halt, step)

    def _stack(self, state: ForwardState, full: torch.Tensor, flat_kv, run, layout: Layout, step: int, shape):
        """The shared blocks on the running tokens of ``full`` (B * T, d), gathered; ``flat_kv``: k0, v0, k1, v1,
        ... (B * T, d). Returns their new states (N, d) and the new keys / values."""
        x, kv = full.index_select(0, run), []
        first_layer = self.config.recur_halt.prelude + (step - 1) * len(self.shared)
        for j, block in enumerate(self.shared):
            pair = (flat_kv[2 * j], flat_kv[2 * j + 1])
            a, pair = gathered_attention(block, block.ln_1(x), pair, run, layout, state, f"recur.step{step}.block{j}",
                                         shape)
            x = x + a
            if state.residuals is not None:
                state.record("mha", first_layer + j, _grid(full, run, x, shape))
            x = x + block.mlp(block.ln_2(x))
            if state.residuals is not None:
                full = full.index_copy(0, run, x)
                state.record("ffn", first_layer + j, full.view(*shape, -1))
            kv.append(pair)
        return x, kv

    def _decide(self, track: _Run, x_run: torch.Tensor, step: int, state: ForwardState):
        """The halting unit on the running tokens' states after step ``step``; the running sums move on for the
        tokens that continue."""
        run = track.run
        valid = None if state.valid is None else state.valid.reshape(-1).index_select(0, run)
        decision = self.halt_router.decide(x_run, track.cum.index_select(0, run),
                                           track.remaining.index_select(0, run), valid)
        track.logits[:, step - 1] = track.logits[:, step - 1].index_copy(0, run, decision.logits.detach())
        go = ~decision.halt
        track.cum = track.cum.index_copy(0, run[go], decision.cum[go])
        track.remaining = track.remaining.index_copy(0, run[go], decision.remaining[go])
        return decision.mass, decision.halt

    def _accumulate(self, track: _Run, x_run, mass, halt, step: int) -> None:
        """The mix, the remainder and the KL term of this step; the halted tokens leave the run."""
        run = track.run
        track.mix = track.mix.index_add(0, run, mass.unsqueeze(-1).to(x_run.dtype) * x_run)
        track.remainder = track.remainder.index_copy(0, run[halt], mass[halt])
        track.masses[:, step - 1] = track.masses[:, step - 1].index_copy(0, run, mass.detach())
        if self.config.recur_halt.halting == "ponder":
            prior = self._prior(x_run.device)[step - 1]
            track.kl = track.kl.index_add(0, run, mass * (mass.clamp_min(1e-12).log() - prior.log()))
        track.run = run[~halt]

    def _prior(self, device) -> torch.Tensor:
        """The geometric prior lambda_p (1 - lambda_p)^(s-1) over s = 1..S, renormalised."""
        lam = self.config.recur_halt.prior
        g = lam * (1.0 - lam) ** torch.arange(self.max_steps, dtype=torch.float32, device=device)
        return g / g.sum()

    def _finish(self, track: _Run, state: ForwardState, shape) -> None:
        """The aux loss, and the one site of the halting chain (the depth convention in its extras)."""
        cfg, valid = self.config.recur_halt, state.valid
        per_token = track.steps + track.remainder if cfg.halting == "act" else track.kl
        w = torch.ones_like(per_token) if valid is None else valid.reshape(-1).to(per_token.dtype)
        mean = (per_token * w).sum() / w.sum().clamp(min=1)
        aux = {"ponder": cfg.ponder_cost * mean} if cfg.halting == "act" else {"ponder_kl": cfg.kl_coef * mean}
        n, S = len(self.shared), self.max_steps
        steps = track.steps.view(*shape)
        extras = {"depth": (steps * n).detach(), "max_depth": torch.tensor(float(S * n)),
                  "attn_pairs": torch.stack(track.pairs)}
        choice = Choice((steps.long() - 1).unsqueeze(-1), track.remainder.detach().view(*shape, 1),
                        probs=track.masses.view(*shape, S), aux=aux, logits=track.logits.view(*shape, S - 1))
        decision = report_site(state, "token_choice", [f"depth{s}" for s in range(1, S + 1)], SiteId(SITE), choice)
        decision.site.extras.update(extras)  # the aux losses go out as "recur_halt/ponder" (the site's name)

    # -------------------------------------------------------------- FLOPs
    def flop_blocks(self):
        return [*self.prelude, *self.coda]

    def extra_flops(self, sites: Dict[str, RoutingSite], T: int) -> cost.Flops:
        """The shared stack as run: projections and FFN per token and step it ran, the scores of each step's
        query layout (``attn_pairs``; a token cut out of its batch: T keys per query), the halting unit on the
        tokens of steps 1 .. S-1. Without a trace: every token runs all S steps."""
        cfg, d = self.config, self.config.d_model
        per_app = cost.Flops(attn_proj=cost.attention_projections(d), ffn=cost.ffn(d, cfg.ffn_hidden))
        scores, halting = cost.attention_scores(d, 1), cost.linear(d, 1)
        n, S = len(self.shared), self.max_steps
        site = sites.get(SITE)
        if site is None:
            return (per_app + cost.Flops(attn_scores=scores * T)).scale(S * n) + cost.Flops(router=(S - 1) * halting)
        steps = site.selected[..., 0] + 1  # every token, padding too (it runs step 1)
        tokens = steps.numel()
        running = [float((steps >= s).sum()) for s in range(1, S + 1)]
        pairs = site.extras.get("attn_pairs")
        pairs = [r * T for r in running] if pairs is None else pairs.tolist()
        total = per_app.scale(n * sum(running)) + cost.Flops(attn_scores=scores * n * sum(pairs),
                                                           router=halting * sum(running[:-1]))
        return total.scale(1.0 / tokens)


def resolved_steps(config: ModelConfig) -> int:
    """S: ``max_steps``, or (0) the vanilla model's depth in shared-stack applications."""
    cfg = config.recur_halt
    if cfg.max_steps:
        return cfg.max_steps
    return max(0, (config.n_layer - cfg.prelude - cfg.coda) // max(1, cfg.n_shared))
