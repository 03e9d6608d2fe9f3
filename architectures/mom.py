"""Mixture-of-Modules (Gong et al. 2024, arXiv 2407.06677; official code gzhch/Mixture-of-Modules).

A chunk owns a pool of ``N_A`` attention modules and ``N_F`` FFN modules plus SKIP, and two GRU
routers (attention, FFN). For H assembly steps, per token:

* the attention router reads the residual stream x (pre-LN) and its GRU state from the previous
  step (zeros at step 1), ``logits = W_o h``, ``p = softmax(logits / tau)``, top-K over
  {modules, SKIP}, the K weights renormalised over the chosen K (SKIP included);
* attention assembly (the official code's ``weighted_qkv=False`` path): the chosen modules' QKV
  projections ``c_attn_m(LN_m x)`` are summed per token (unweighted, or weighted by the router
  weights with ``weighted_qkv``), one shared causal attention runs over all tokens, and the update is
  ``sum_k w_k * c_proj_k(attn)``. A token whose K choices are all SKIP has zero Q/K/V (it stays in
  the key set with a zero key and a zero value, exactly as in the official code) and a zero update;
* the FFN router picks K of {FFN modules, SKIP}; ``x += sum_k w_k * FFN_k(LN_k x)``.

Compute follows the routing: every module's projections (QKV, output, FFN) run only on the tokens
that chose it (``architectures.dispatch.sorted_dispatch``); SKIP costs nothing. The shared attention
runs once per step over all tokens whenever any token of the batch chose a real attention module.

Layout (official code): ``bottom`` vanilla layers, then ``chunks`` (a pool run for H steps, followed
by an anchor vanilla layer when ``anchor``), then ``top`` vanilla layers. ``layout="plain"`` is the
paper's form: one chunk, no bottom/top and no anchor, so the pool holds one module per vanilla layer
and vanilla routing reproduces GPT-2 exactly. ``layout="chunked"`` sizes the official layout from
n_layer: pools of 4 (the official ``num_attn = num_ffn = 4``) plus an anchor per chunk, the remaining
layers split between bottom and top (small 1 + 2x(4+1) + 1, medium 2 + 4x5 + 2, large 3 + 6x5 + 3;
below 7 layers one chunk of n_layer - 1 modules + anchor).

Routing modes (``model.mom.routing``), each a configuration of the same code:
``learned``; ``vanilla`` (module h at step h, one slot, weight 1); ``param_share`` (module 0 at every
step); ``moe`` (attention fixed at module h, FFN learned over the pool); ``layer_skip`` (the learned
router may choose only module h or SKIP at step h, K=1).
Under ``moe`` the FFN pool is restricted per step (``allowed_choices``): step h chooses among its own
E = n_ffn / steps experts, so each step is an MoE layer with its own experts. Given the same weights
and the same routing (a linear router on the step's LayerNorm, temperature 1, no SKIP) it computes
exactly the ``moe`` variant at K >= 2, where both renormalise the weights over the K picks (tested, K = 2
and 3). At K = 1 it does not: MoM's weight is the renormalised 1 (``straight_through``: p / stopgrad(p),
1 forward), where the ``moe`` variant (Switch) scales the expert's output by the raw probability p.
Its own router is the GRU.
Routers (GRUCell and W_o) start at N(0, 0.02) weights and zero biases, as in the official code.
Fixed sites have no router; they still appear in the trace (one slot, weight 1).

With K=1 the renormalised weight is 1 and carries no gradient; ``straight_through`` (default) uses
``p / stopgrad(p)`` (exactly 1 forward) so the router learns from the LM loss, like the official
code's ``use_ste`` option.

Balance loss: Switch-style over all classes including SKIP, ``C * sum_i f_i P_i`` per learned site,
``balance_coef`` times the mean over sites (the official code concatenates all depths into one loss).

Official-code options (preset ``mom_official``; docs/variants.md, "Paper / official code vs our default"):
``router_bias`` (W_o with a bias), ``router_width="max_pool"`` (both routers score max(N_A, N_F) + SKIP;
classes past a router's own pool are no-ops named "skip"), ``balance_form="official"`` (one loss per
router kind over all steps, the official double softmax and top-1 f, ``official_balance_loss``),
``all_paths`` (``routing_all_possible_path``: every module on every token, weighted by the full
distribution). ``weighted_qkv=False`` (default) lets a module picked with a small or zero weight fully
change the summed Q/K/V and gives the router a gradient only through the output projections;
``True`` scales each module's Q/K/V by its weight (no say at weight 0, a gradient through Q/K/V).

Contract: one ``RoutingSite`` per router and step (``mom.chunk{c}.{attn|ffn}.step{h}``, group
``mom.chunk{c}.{attn|ffn}``, choices ``attn0..``/``ffn0..`` + ``skip``), so the routing callback builds
P(module at h+1 | module at h) per router. Residuals: ``"mha"`` after each attention assembly and
``"ffn"`` after each FFN assembly (vanilla layers report theirs as GPT-2 does). KV cache: one entry per
step's shared attention (``chunk{c}.step{h}``, the assembled K/V of every token, zeros for all-SKIP
tokens) plus one per vanilla layer; a router looks only at its own token, so cached decoding
reproduces the full forward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ConfigError, ModelConfig
from architectures.contract import KVCache, RoutingSite
from architectures.dispatch import sorted_dispatch
from architectures.gpt2 import MLP, Block, CausalSelfAttention
from architectures.routing import FixedChoice, GRURouter, SiteId, TopK, balance_loss, flat_valid


@dataclass
class MoMConfig:
    """Mixture-of-Modules (Gong et al. 2024). Semantics and defaults: ``architectures/mom.py``.

    Pool sizes and H are per chunk; ``None`` means "the chunk's vanilla layer slots" (the number of
    vanilla layers a chunk replaces), so the default MoM has the vanilla model's parameters and
    ``init_from_vanilla`` maps layer j to module j.
    """

    n_attn: Optional[int] = None  # N_A attention modules per chunk
    n_ffn: Optional[int] = None  # N_F FFN modules per chunk
    top_k: int = 1  # K (SKIP competes inside the K)
    steps: Optional[int] = None  # H assembly steps per chunk
    allow_skip: bool = True
    router_hidden: int = 256
    temperature: float = 0.2
    balance_coef: float = 0.01
    # "plain": one chunk, no bottom/top/anchor (the paper's form). "chunked": the official code's
    # layout sized from n_layer (pools of 4 + an anchor per chunk, the rest split bottom/top).
    # Explicit bottom / chunks / top / anchor override the layout's values.
    layout: str = "plain"
    bottom: Optional[int] = None
    chunks: Optional[int] = None
    top: Optional[int] = None
    anchor: Optional[bool] = None
    # "learned", "vanilla" (module h at step h), "param_share" (module 0 at every step),
    # "moe" (attention fixed at module h, FFN learned), "layer_skip" (step h: module h or SKIP).
    routing: str = "learned"
    weighted_qkv: bool = False  # official-code option: scale each module's QKV by its router weight
    straight_through: bool = True  # K=1: weight p / stopgrad(p) (= 1) so the router gets a gradient
    # Official-code options (gzhch/Mixture-of-Modules; preset ``mom_official``). Defaults: our forms.
    router_bias: bool = False  # the official W_o (nn.Linear) has a bias; ours is bias-free
    # "own": each router scores its own pool (+ SKIP). "max_pool": both routers score max(N_A, N_F) + 1
    # classes as in the official code; classes beyond a router's own pool act as extra SKIPs.
    router_width: str = "own"
    # "site_mean": Switch loss per learned site over its K choices, mean over sites (ours). "official":
    # one loss per router kind over all steps concatenated, f from the top-1 of softmax(probs) (the
    # official double softmax), C = router width; attention + FFN losses summed.
    balance_form: str = "site_mean"
    # routing_all_possible_path: every module runs on every token, weighted by the full router
    # distribution (a dense mixture; saves nothing). SKIP's probability contributes nothing.
    all_paths: bool = False

ROUTINGS = ("learned", "vanilla", "param_share", "moe", "layer_skip")
LAYOUTS = ("plain", "chunked")
# Which sites have a learned router under each routing mode.
_LEARNED = {
    "learned": {"attn": True, "ffn": True},
    "vanilla": {"attn": False, "ffn": False},
    "param_share": {"attn": False, "ffn": False},
    "moe": {"attn": False, "ffn": True},
    "layer_skip": {"attn": True, "ffn": True},
}
_CHUNK_POOL = 4  # official num_attn = num_ffn = 4
ROUTER_WIDTHS = ("own", "max_pool")
BALANCE_FORMS = ("site_mean", "official")


@dataclass(frozen=True)
class MoMLayout:
    bottom: int
    chunks: int
    top: int
    anchor: bool
    slots: int  # vanilla layers replaced by each chunk's pool
    n_attn: int
    n_ffn: int
    steps: int


def chunked_defaults(n_layer: int) -> Tuple[int, int, int]:
    """(bottom, chunks, top) of the official layout for ``n_layer`` vanilla layers."""
    if n_layer < _CHUNK_POOL + 3:
        return 0, 1, 0
    chunks = (n_layer - 2) // (_CHUNK_POOL + 1)
    rest = n_layer - chunks * (_CHUNK_POOL + 1)
    return rest // 2, chunks, rest - rest // 2


def resolve_layout(config: ModelConfig) -> MoMLayout:
    """Fill the ``None`` fields of ``config.mom`` and validate them; errors name the field."""
    m = config.mom
    require(m.layout in LAYOUTS, "model.mom.layout", f"unknown layout {m.layout!r}; use one of {', '.join(LAYOUTS)}")
    if m.layout == "plain":
        bottom, chunks, top, anchor = 0, 1, 0, False
    else:
        (bottom, chunks, top), anchor = chunked_defaults(config.n_layer), True
    bottom = bottom if m.bottom is None else m.bottom
    chunks = chunks if m.chunks is None else m.chunks
    top = top if m.top is None else m.top
    anchor = anchor if m.anchor is None else bool(m.anchor)
    for name, value, low in (("bottom", bottom, 0), ("top", top, 0), ("chunks", chunks, 1)):
        require(isinstance(value, int) and value >= low, f"model.mom.{name}", f"must be an integer >= {low}, got {value!r}")
    body = config.n_layer - bottom - top - (chunks if anchor else 0)
    require(body >= chunks and body % chunks == 0, "model.mom.chunks",
            f"bottom={bottom} + chunks={chunks} x (slots{' + anchor' if anchor else ''}) + top={top} must equal "
            f"model.n_layer={config.n_layer} with at least one slot per chunk")
    slots = body // chunks
    n_attn = slots if m.n_attn is None else m.n_attn
    n_ffn = slots if m.n_ffn is None else m.n_ffn
    steps = slots if m.steps is None else m.steps
    require(isinstance(n_attn, int) and n_attn >= 1, "model.mom.n_attn", f"the attention pool needs >= 1 module, got {n_attn!r}")
    require(isinstance(n_ffn, int) and n_ffn >= 1, "model.mom.n_ffn", f"the FFN pool needs >= 1 module, got {n_ffn!r}")
    require(isinstance(steps, int) and steps >= 1, "model.mom.steps", f"H must be an integer >= 1, got {steps!r}")
    return MoMLayout(bottom, chunks, top, anchor, slots, n_attn, n_ffn, steps)


def router_width(m, layout: "MoMLayout", kind: str) -> int:
    """Classes a router scores: its pool (+ SKIP), or max(N_A, N_F) (+ SKIP) as the official routers."""
    pool = layout.n_attn if kind == "attn" else layout.n_ffn
    base = max(layout.n_attn, layout.n_ffn) if m.router_width == "max_pool" else pool
    return base + (1 if m.allow_skip else 0)


def validate_mom_config(config: ModelConfig) -> MoMLayout:
    m = config.mom
    require(m.routing in ROUTINGS, "model.mom.routing", f"unknown routing {m.routing!r}; use one of {', '.join(ROUTINGS)}")
    layout = resolve_layout(config)
    require(isinstance(m.top_k, int) and m.top_k >= 1, "model.mom.top_k", f"K must be an integer >= 1, got {m.top_k!r}")
    require(m.router_width in ROUTER_WIDTHS, "model.mom.router_width",
            f"unknown width {m.router_width!r}; use one of {', '.join(ROUTER_WIDTHS)}")
    require(m.balance_form in BALANCE_FORMS, "model.mom.balance_form",
            f"unknown form {m.balance_form!r}; use one of {', '.join(BALANCE_FORMS)}")
    skip = 1 if m.allow_skip else 0
    for kind, pool in (("attn", layout.n_attn), ("ffn", layout.n_ffn)):
        if _LEARNED[m.routing][kind]:
            require(m.top_k <= router_width(m, layout, kind), "model.mom.top_k",
                    f"K={m.top_k} exceeds the {pool} {kind} modules{' + SKIP' if skip else ''} of the pool "
                    f"(lower K or enlarge the pool with model.mom.n_{kind})")
    require(m.router_hidden >= 1, "model.mom.router_hidden", f"must be >= 1, got {m.router_hidden}")
    require(m.temperature > 0, "model.mom.temperature", f"must be > 0, got {m.temperature}")
    require(m.balance_coef >= 0, "model.mom.balance_coef", f"must be >= 0, got {m.balance_coef}")
    if m.routing in ("vanilla", "layer_skip", "moe"):
        require(layout.n_attn >= layout.steps, "model.mom.n_attn",
                f"routing {m.routing!r} uses attention module h at step h: needs n_attn >= steps "
                f"(got n_attn={layout.n_attn}, steps={layout.steps})")
    if m.routing in ("vanilla", "layer_skip"):
        require(layout.n_ffn >= layout.steps, "model.mom.n_ffn",
                f"routing {m.routing!r} uses FFN module h at step h: needs n_ffn >= steps "
                f"(got n_ffn={layout.n_ffn}, steps={layout.steps})")
    if m.routing == "moe":
        require(layout.n_ffn % layout.steps == 0, "model.mom.n_ffn",
                f"routing 'moe' gives each of the {layout.steps} steps its own n_ffn / steps experts: n_ffn must be "
                f"a multiple of steps, got n_ffn={layout.n_ffn}")
        per_step = layout.n_ffn // layout.steps + skip
        require(m.top_k <= per_step, "model.mom.top_k",
                f"K={m.top_k} exceeds the {per_step} choices of a step under routing 'moe' (n_ffn / steps"
                f"{' + SKIP' if skip else ''})")
    if m.routing == "layer_skip":
        require(m.allow_skip, "model.mom.allow_skip", "routing 'layer_skip' needs the SKIP module")
        require(m.top_k == 1, "model.mom.top_k", f"routing 'layer_skip' chooses module h or SKIP: K must be 1, got {m.top_k}")
    return layout


# ---------------------------------------------------------------------------- modules and routers
class PreNormed(nn.Module):
    """A GPT-2 sub-layer behind its own LayerNorm, under the vanilla block's names (``norm``, ``name``), so a
    vanilla block's weights map onto a pool module one to one."""

    def __init__(self, config: ModelConfig, norm: str, name: str, layer: nn.Module):
        super().__init__()
        self.add_module(norm, nn.LayerNorm(config.d_model, eps=config.layer_norm_eps))
        self.add_module(name, layer)


class AttentionModule(PreNormed):
    """One pool attention module: its LayerNorm ``ln_1``, QKV and output projections (``attn``)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "ln_1", "attn", CausalSelfAttention(config.d_model, config.n_head, config.bias,
                                                                      config.dropout))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.c_attn(self.ln_1(x))

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, cache_key: str = "") -> torch.Tensor:
        """The full sub-layer on every token: the fixed-routing path, identical to GPT-2's."""
        return self.attn(self.ln_1(x), cache, cache_key)


class FFNModule(PreNormed):
    """One pool FFN module: its LayerNorm ``ln_2`` and ``mlp``."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "ln_2", "mlp", MLP(config.d_model, config.ffn_hidden, config.bias, config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_2(x))


def official_balance_loss(parts: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The official code's ``load_balancing_loss_func`` over one router kind (coefficient not applied).

    ``parts``: (probs (N, C), valid (N,)) of every learned step, concatenated as the official code
    concatenates all depths. Its routers already output softmax(logits / tau), and the loss applies a
    second softmax to them: P_i = mean of softmax(probs)_i, f_i = share of tokens whose top-1 is i (top-1
    whatever K), loss = C * sum_i f_i P_i over all C classes (SKIP included).
    """
    probs = torch.cat([p for p, _ in parts])
    valid = torch.cat([v for _, v in parts]).to(probs.dtype)
    scores = probs.softmax(dim=-1)
    C = scores.shape[-1]
    top1 = torch.nn.functional.one_hot(scores.argmax(dim=-1), C).to(probs.dtype)
    n = valid.sum().clamp(min=1)
    f = (top1 * valid.unsqueeze(-1)).sum(0) / n
    P = (scores * valid.unsqueeze(-1)).sum(0) / n
    return C * (f * P).sum()


def router_flops(d_model: int, hidden: int, n_choices: int) -> float:
    """GRUCell input and hidden matmuls (the hidden one runs on zeros at step 1 too) + W_o."""
    return cost.linear(d_model, 3 * hidden) + cost.linear(hidden, 3 * hidden) + cost.linear(hidden, n_choices)


@dataclass
class _Route:
    selected: torch.Tensor  # (N, k) long
    weights: torch.Tensor  # (N, k)
    fixed: Optional[int] = None  # module id when the site has no router


class MoMChunk(nn.Module):
    """A module pool with its two routers, run for H steps, then the optional anchor layer."""

    def __init__(self, config: ModelConfig, layout: MoMLayout, index: int, first_layer: int = 0,
                 balance_scale: float = 1.0):
        super().__init__()
        m = config.mom
        self.index = index
        self.config = config
        self.first_layer, self.balance_scale = first_layer, balance_scale
        self.cfg = m
        self.steps = layout.steps
        self.n_attn, self.n_ffn = layout.n_attn, layout.n_ffn
        # classes past a router's own pool (SKIP, and with router_width "max_pool" the surplus) are all no-ops
        self.attn_names = [f"attn{i}" for i in range(self.n_attn)]
        self.attn_names += ["skip"] * (router_width(m, layout, "attn") - self.n_attn)
        self.ffn_names = [f"ffn{i}" for i in range(self.n_ffn)]
        self.ffn_names += ["skip"] * (router_width(m, layout, "ffn") - self.n_ffn)
        self.attn_modules = nn.ModuleList([AttentionModule(config) for _ in range(self.n_attn)])
        self.ffn_modules = nn.ModuleList([FFNModule(config) for _ in range(self.n_ffn)])
        learned = _LEARNED[m.routing]
        # K over the pool + SKIP at temperature tau, renormalised over the K (straight-through at K = 1); the
        # site holds detached copies
        per_site = m.balance_coef > 0 and m.balance_form != "official"  # the official form: MixtureOfModules.body
        pick = TopK(m.top_k, temperature=m.temperature, renormalize=True, straight_through=m.straight_through,
                    balance=self.balance if per_site else None, all_paths=m.all_paths, detach=True)
        # one router per kind, run at every step: its site is ``mom.chunk{c}.{kind}.step{h}``
        self.attn_router = (GRURouter(config.d_model, m.router_hidden, len(self.attn_names), pick, self.attn_names,
                                      self.site("attn"), m.router_bias) if learned["attn"] else None)
        self.ffn_router = (GRURouter(config.d_model, m.router_hidden, len(self.ffn_names), pick, self.ffn_names,
                                     self.site("ffn"), m.router_bias) if learned["ffn"] else None)
        self.anchor = (Block(config, first_layer + layout.steps, f"chunk{index}.anchor") if layout.anchor
                       else None)
        self.resid_drop = nn.Dropout(config.dropout)

    # ------------------------------------------------------------------ routing
    def allowed_choices(self, kind: str, step: int, n_names: int, device) -> Optional[torch.Tensor]:
        """The choices a learned router may take at ``step`` (None: all of them).

        ``layer_skip``: module h or SKIP. ``moe``: the FFN pool is split into ``steps`` groups of
        E = n_ffn / steps experts and step h chooses within its own group (plus SKIP when allowed), so
        each step is one MoE layer with its own experts, as in the ``moe`` variant.
        """
        routing = self.cfg.routing
        if routing == "layer_skip":
            allowed = torch.zeros(n_names, dtype=torch.bool, device=device)
            allowed[step] = allowed[-1] = True
            return allowed
        if routing == "moe" and kind == "ffn":
            per_step = self.n_ffn // self.steps
            allowed = torch.zeros(n_names, dtype=torch.bool, device=device)
            allowed[step * per_step:(step + 1) * per_step] = True
            if self.cfg.allow_skip:
                allowed[-1] = True
            return allowed
        return None

    def _fixed_module(self, kind: str, step: int) -> int:
        if self.cfg.routing == "param_share":
            return 0
        return step  # vanilla order; "moe" fixes attention at module h

    def site(self, kind: str) -> SiteId:
        group = f"mom.chunk{self.index}.{kind}"
        return SiteId(group, group)

    def route(self, kind: str, router, x: torch.Tensor, step: int,
              state: Optional[torch.Tensor], run: ForwardState) -> Tuple[_Route, Optional[torch.Tensor]]:
        """The step's router decides and reports the site ``mom.chunk{c}.{kind}.step{h}``; a site without a
        router reports its fixed module (one slot, weight 1)."""
        B, T, d = x.shape
        if router is None:
            module = self._fixed_module(kind, step)
            route = FixedChoice(module).report(run, self.attn_names if kind == "attn" else self.ffn_names,
                                               self.site(kind).at_step(step), (B, T), x.device)
            return _Route(route.selected.reshape(B * T, 1), route.weights.reshape(B * T, 1), fixed=module), state
        allowed = self.allowed_choices(kind, step, len(router.choice_names), x.device)
        route = router(x, run, state, allowed=allowed, step=step)
        k = route.selected.shape[-1]
        if self.cfg.balance_coef > 0 and self.cfg.balance_form == "official":  # its parts per router kind
            run.options.setdefault("mom_balance", {}).setdefault(kind, []).append(
                (route.probs.reshape(B * T, -1), flat_valid(run.valid, B * T, x.device)))
        return _Route(route.selected.reshape(B * T, k), route.weights.reshape(B * T, k)), route.carry

    def balance(self, probs, picked, valid) -> Dict[str, torch.Tensor]:
        """The per-site form: the Switch loss over all classes, SKIP included."""
        loss = balance_loss(probs, picked, probs.shape[-1], valid)
        return {"balance": loss * (self.cfg.balance_coef * self.balance_scale)}

    # ------------------------------------------------------------------ assembly
    def assemble_attention(self, x: torch.Tensor, route: _Route, cache: Optional[KVCache], cache_key: str) -> torch.Tensor:
        """The attention update (B, T, d) for the routed choices. Under torch.compile (no cache) the all-SKIP
        skip is a ``torch.cond``, so the step stays one graph and still skips the shared attention."""
        if route.fixed is not None:
            return self.attn_modules[route.fixed](x, cache, cache_key)
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        shared = self.attn_modules[0].attn  # any module: head split/merge and the SDPA call are parameter-free
        real = (route.selected < self.n_attn).any()  # some token chose a real module: the attention runs
        traced = torch.compiler.is_compiling() and cache is None  # decoding may break the graph here
        all_skip = not traced and not bool(real)
        if all_skip and cache is not None:  # keep this step's cache aligned: all-SKIP tokens have zero K/V
            zeros = x.new_zeros(B, shared.n_head, T, d // shared.n_head)
            cache.append(cache_key, zeros, zeros)
        if all_skip and not torch.is_grad_enabled():
            return torch.zeros_like(x)
        # with gradients recorded the modules still run on their (empty) slices when all tokens SKIP: a zero
        # gradient, as for any idle module (``sorted_dispatch``) and as the compiled graph gives
        qkv_weights = route.weights if self.cfg.weighted_qkv else torch.ones_like(route.weights)
        qkv = sorted_dispatch(flat, route.selected, qkv_weights, [m.project for m in self.attn_modules])
        # the shared attention skipped: zeros that still depend on the projections (their gradient zero, not None)
        skipped = lambda qkv: qkv[..., :d] * 0
        if traced:  # the same skip as one graph: a cond on the flag instead of a Python branch on it
            y = torch.cond(real, shared.attend, skipped, (qkv.view(B, T, 3 * d),))
        elif all_skip:  # the shared attention does not run
            y = skipped(qkv.view(B, T, 3 * d))
        else:
            y = shared.attend(qkv.view(B, T, 3 * d), cache, cache_key)
        out = sorted_dispatch(y.reshape(B * T, d), route.selected, route.weights,
                              [m.attn.c_proj for m in self.attn_modules])
        return self.resid_drop(out.view(B, T, d))

    def assemble_ffn(self, x: torch.Tensor, route: _Route) -> torch.Tensor:
        if route.fixed is not None:
            return self.ffn_modules[route.fixed](x)
        B, T, d = x.shape
        out = sorted_dispatch(x.reshape(B * T, d), route.selected, route.weights, list(self.ffn_modules))
        return out.view(B, T, d)

    def forward(self, x: torch.Tensor, run: ForwardState) -> torch.Tensor:
        attn_state = ffn_state = None
        for step in range(self.steps):  # each step one activation-checkpointing unit
            x, attn_state, ffn_state = run.run(self.assembly_step, x, attn_state, ffn_state, step)
        if self.anchor is not None:
            x = run.block(self.anchor, x)
        return x

    def assembly_step(self, run: ForwardState, x: torch.Tensor, attn_state, ffn_state, step: int):
        """Step h: route and assemble attention, then the FFN; returns x and both GRU states."""
        layer = self.first_layer + step
        route, attn_state = self.route("attn", self.attn_router, x, step, attn_state, run)
        x = x + self.assemble_attention(x, route, run.cache, f"chunk{self.index}.step{step}")
        run.record("mha", layer, x)
        route, ffn_state = self.route("ffn", self.ffn_router, x, step, ffn_state, run)
        x = x + self.assemble_ffn(x, route)
        run.record("ffn", layer, x)
        return x, attn_state, ffn_state

    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        """This chunk's sites: attention projections (QKV + output) once per (token, chosen real module);
        attention scores ``4 * T * d`` per token once per step when any token of the batch chose a real
        attention module (the shared attention runs over all tokens); FFN once per (token, chosen real
        module); each learned router's GRUCell (input + hidden matmuls) and ``W_o`` for every token.
        With no site: the upper bound, every one of the K slots a real module (min(K, pool) per step;
        1 for fixed and layer-skip sites). Plus the anchor layer, dense."""
        cfg = self.config
        d, hidden = cfg.d_model, cfg.ffn_hidden
        total = self.anchor.flops(sites, T, queries) if self.anchor is not None else cost.Flops()
        learned = _LEARNED[cfg.mom.routing]
        for kind, pool, names in (("attn", self.n_attn, len(self.attn_names)), ("ffn", self.n_ffn, len(self.ffn_names))):
            router = router_flops(d, cfg.mom.router_hidden, names) if learned[kind] else 0.0
            own = [sites.get(f"mom.chunk{self.index}.{kind}.step{h}") for h in range(self.steps)]
            if all(site is not None for site in own):
                per_step = [float((s.selected < pool).sum()) / (s.selected.shape[0] * s.selected.shape[1]) for s in own]
            elif cfg.mom.all_paths and learned[kind]:
                per_step = [float(pool)] * self.steps  # the dense mixture runs every module
            else:
                choices = pool // self.steps if (cfg.mom.routing == "moe" and kind == "ffn") else pool
                k = 1 if (not learned[kind] or cfg.mom.routing == "layer_skip") else min(cfg.mom.top_k, choices)
                per_step = [float(k)] * self.steps
            modules = sum(per_step)
            if kind == "attn":
                scores = sum(1 for r in per_step if r > 0) * cost.attention_scores(d, T)
                total = total + cost.Flops(attn_proj=modules * cost.attention_projections(d), attn_scores=scores)
            else:
                total = total + cost.Flops(ffn=modules * cost.ffn(d, hidden))
            total = total + cost.Flops(router=router * len(per_step))
        return total


# ---------------------------------------------------------------------------- the model
class MixtureOfModules(LanguageModel):
    """GPT-2 embeddings/head around bottom vanilla layers, MoM chunks and top vanilla layers."""

    config_groups = {"mom": MoMConfig}
    two_phase_from_vanilla = True  # vanilla_state_mapping: the paper's layer -> module mapping

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.layout = validate_mom_config(config)
        lay = self.layout
        learned = _LEARNED[config.mom.routing]
        self.n_learned_sites = lay.chunks * lay.steps * (int(learned["attn"]) + int(learned["ffn"]))
        per_chunk = lay.steps + int(lay.anchor)  # logical layers a chunk reports (steps, then the anchor)
        self.bottom = nn.ModuleList([Block(config, i, f"bottom{i}") for i in range(lay.bottom)])
        self.chunks = nn.ModuleList([
            MoMChunk(config, lay, c, lay.bottom + c * per_chunk, 1.0 / max(1, self.n_learned_sites))
            for c in range(lay.chunks)])
        first_top = lay.bottom + lay.chunks * per_chunk
        self.top = nn.ModuleList([Block(config, first_top + i, f"top{i}") for i in range(lay.top)])

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        validate_mom_config(config)

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        for module in self.bottom:
            x = state.block(module, x)
        for chunk in self.chunks:  # checkpointed per assembly step inside
            x = chunk(x, state)
        for module in self.top:
            x = state.block(module, x)
        for kind, parts in state.options.pop("mom_balance", {}).items():  # balance_form "official"
            state.aux[f"mom.{kind}/balance"] = self.config.mom.balance_coef * official_balance_loss(parts)
        return x

    def flop_blocks(self):
        return [*self.bottom, *self.chunks, *self.top]

    # ------------------------------------------------------------------ analysis hooks (experiments/repro/mom.py)
    def pool_sizes(self) -> Tuple[int, int]:
        """(N_A, N_F): attention and FFN modules in each chunk's pools."""
        return self.chunks[0].n_attn, self.chunks[0].n_ffn

    @contextlib.contextmanager
    def removed_modules(self, attn: Sequence[int] = (), ffn: Sequence[int] = ()) -> Iterator[None]:
        """Remove attention modules ``attn`` and FFN modules ``ffn`` (pool indices) from every chunk's pool.

        Each chunk's GRU router gets the removed modules as ``removed`` (``Router.logits`` sets their logits to
        -inf): the softmax gives them probability exactly 0, top-K never selects them, and
        the K weights are renormalised over the remaining choices (SKIP included) as for any other logits.
        The GRU state is untouched, so later steps see the same recurrence. Leaving the context restores
        the full pools. Fixed (non-learned) routing has no logits to mask and is refused, as is a removal that
        leaves fewer than K choices.
        """
        masked = []
        try:
            for chunk in self.chunks:
                for kind, router, names, drop in (("attn", chunk.attn_router, chunk.attn_names, attn),
                                                  ("ffn", chunk.ffn_router, chunk.ffn_names, ffn)):
                    drop = sorted(set(int(i) for i in drop))
                    if not drop:
                        continue
                    pool = len([n for n in names if n != "skip"])
                    if router is None:
                        raise ConfigError(f"model.mom.routing: {self.config.mom.routing!r} routes {kind} modules "
                                          "without a router; modules can only be removed from learned routing")
                    if drop[0] < 0 or drop[-1] >= pool:
                        raise ConfigError(f"removed {kind} modules {drop} out of range for a pool of {pool}")
                    left = len(names) - len(drop)
                    if self.config.mom.top_k > left:
                        raise ConfigError(f"removing {len(drop)} of {pool} {kind} modules leaves {left} choices, "
                                          f"fewer than K={self.config.mom.top_k}")
                    mask = torch.zeros(len(names), dtype=torch.bool)
                    mask[drop] = True
                    router.removed = mask
                    masked.append(router)
            yield
        finally:
            for router in masked:
                router.removed = None

    @torch.no_grad()
    def pool_outputs(self, idx: torch.Tensor) -> Dict[str, List[torch.Tensor]]:
        """Each pool module of the first chunk on that chunk's input for ``idx`` (eval mode): attention modules
        by their QKV projections, FFN modules by their outputs (to compare what the modules compute)."""
        captured: List[torch.Tensor] = []
        chunk = self.chunks[0]
        handle = chunk.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
        try:
            self.eval()
            self(idx)
        finally:
            handle.remove()
        x = captured[0]
        return {"attn": [m.project(x) for m in chunk.attn_modules], "ffn": [m(x) for m in chunk.ffn_modules]}

    # ------------------------------------------------------------------ two-phase training
    def vanilla_mapping(self) -> List[Tuple[str, str]]:
        """(MoM parameter name, vanilla GPT-2 parameter name) for every tensor phase 2 copies.

        Vanilla layers in order: bottom blocks, then per chunk ``slots`` layers whose attention
        (ln_1, attn) -> attention module j and MLP (ln_2, mlp) -> FFN module j (j < pool size; layers
        beyond a smaller pool are dropped, modules beyond a larger pool keep their init), then the
        chunk's anchor layer, then the top blocks. Routers are not mapped.
        """
        pairs = [(n, n) for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")]
        lay, layer = self.layout, 0

        def add(target_prefix: str, module: nn.Module, source_layer: int) -> None:
            pairs.extend((f"{target_prefix}.{k}", f"blocks.{source_layer}.{k}") for k in module.state_dict())

        for i, block in enumerate(self.bottom):
            add(f"bottom.{i}", block, layer)
            layer += 1
        for c, chunk in enumerate(self.chunks):
            for j in range(lay.slots):
                if j < lay.n_attn:
                    add(f"chunks.{c}.attn_modules.{j}", chunk.attn_modules[j], layer + j)
                if j < lay.n_ffn:
                    add(f"chunks.{c}.ffn_modules.{j}", chunk.ffn_modules[j], layer + j)
            layer += lay.slots
            if chunk.anchor is not None:
                add(f"chunks.{c}.anchor", chunk.anchor, layer)
                layer += 1
        for i, block in enumerate(self.top):
            add(f"top.{i}", block, layer)
            layer += 1
        return pairs

    def vanilla_state_mapping(self, vanilla_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The paper's mapping (``vanilla_mapping``) applied: {MoM parameter name: vanilla tensor}; routers absent.

        Raises ``ConfigError`` naming the tensor when the checkpoint does not fit this MoM.
        """
        state = _strip_prefix(vanilla_state)
        blocks = {int(k.split(".")[1]) for k in state if k.startswith("blocks.")}
        if len(blocks) != self.config.n_layer:
            raise ConfigError(
                f"init_from: the vanilla checkpoint has {len(blocks)} layers but this MoM is laid out over "
                f"model.n_layer={self.config.n_layer} vanilla layers ({_describe(self.layout)}); build the MoM "
                "with the checkpoint's size"
            )
        own = self.state_dict()
        mapping = {}
        for target, source in self.vanilla_mapping():
            if source not in state:
                raise ConfigError(f"init_from: the vanilla checkpoint lacks {source} (needed for {target})")
            if tuple(state[source].shape) != tuple(own[target].shape):
                raise ConfigError(
                    f"init_from: vanilla tensor {source} has shape {tuple(state[source].shape)} but {target} needs "
                    f"{tuple(own[target].shape)}: {_shape_hint(state, self.config)}"
                )
            mapping[target] = state[source]
        return mapping

    def init_from_vanilla(self, vanilla_state: Dict[str, torch.Tensor]) -> None:
        """Phase 2: copy a vanilla GPT-2 state dict (this suite's names) into the pools; routers stay fresh."""
        self.load_state_dict(self.vanilla_state_mapping(vanilla_state), strict=False)


def _strip_prefix(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Accept state dicts saved with a wrapper prefix (``model.``, ``_orig_mod.``)."""
    if "wte.weight" in state:
        return state
    for key in state:
        if key.endswith("wte.weight"):
            prefix = key[: -len("wte.weight")]
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    raise ConfigError("init_from: the checkpoint has no wte.weight: it is not a GPT-2 / vanilla state dict of this suite")


def _shape_hint(state: Dict[str, torch.Tensor], config: ModelConfig) -> str:
    vocab, d = state["wte.weight"].shape if "wte.weight" in state else ("?", "?")
    positions = state["wpe.weight"].shape[0] if "wpe.weight" in state else "?"
    fc = next((v for k, v in state.items() if k.endswith("mlp.c_fc.weight")), None)
    hidden = fc.shape[0] if fc is not None else "?"
    return (f"the checkpoint has d_model={d}, ffn hidden={hidden}, vocab={vocab}, block_size={positions}; this MoM has "
            f"d_model={config.d_model}, ffn hidden={config.ffn_hidden}, vocab={config.vocab_size}, "
            f"block_size={config.block_size}")


def _describe(layout: MoMLayout) -> str:
    anchor = " + anchor" if layout.anchor else ""
    return f"bottom {layout.bottom} + {layout.chunks} x ({layout.slots} slots{anchor}) + top {layout.top}"
