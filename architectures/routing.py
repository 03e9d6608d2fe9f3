"""The routing library: every router of the suite is built from these pieces.

MoE, MoT, MoD, MoDE, MoM, depth gating and cea_moe import from here, so a routing rule (fp32 logits,
capacity priority, balance-loss normalisation, SKIP handling) is written once.

* ``fp32_linear``: router projection in fp32 with autocast off.
* ``token_topk``: softmax (temperature) + top-k per token, with the
  weight rules (renormalised over k, raw probability, or straight-through at k = 1).
* ``expert_choice_topk``: MoD's per-sequence top-k, k from each example's real length.
* ``capacity_keep``: capacity limit per expert, priority by position.
* ``noop_budget_keep``: a causal per-row budget for no-op / SKIP choices.
* ``balance_loss`` / ``z_loss``: Switch balance loss (real experts only) and ST-MoE z-loss.
* ``sorted_dispatch`` (gather / scatter by expert, from ``dispatch.py``), re-exported here.

The ``Router`` modules (torchtitan's layering: router -> reorderer -> experts; here the router) put these
together, so a routed block cannot get the protocol wrong: a router owns the scoring parameters (a linear
map, a gate MLP, a GRU cell + output), computes its logits in fp32 with autocast off (``Router.logits``,
one place), picks with its pick rule (``PickRule.pick(logits, valid) -> Choice``), builds the block's
``RoutingSite`` (the name, group and step fixed when the router is built, ``SiteId``; kind, choices, valid
mask from the ``ForwardState`` unless given) and reports it with the rule's aux losses, once per call:
``decision = self.router(x, state)``. ``ForwardState.report`` refuses a second site of the same name in one
forward. Pick rules: ``Switch`` (MoE: top-k, no-op budget, renormalisation, capacity, balance + z-loss),
``TopK`` (MoT, MoM, hard depth gating), ``ExpertChoice`` (MoD), ``SoftGate`` (soft depth gating);
``FixedChoice`` reports a routerless site (MoM's fixed modules). A caller adds only what it measures while
running (``decision.site.extras``). Writing a rule: docs/pick-rules.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.contract import RoutingSite
from architectures.dispatch import sorted_dispatch  # noqa: F401  (the gather / scatter of the library)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32 even under autocast (which would otherwise run the matmul in bf16/fp16)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def token_topk(logits: torch.Tensor, k: int, temperature: float = 1.0, renormalize: bool = False,
               straight_through: bool = False):
    """(probs, weights, selected) of a token-choice router over the last dimension.

    Choices closed at a call (MoM's layer skipping) come as -inf logits (``Router``'s ``allowed``).
    Weights: at k = 1 with ``straight_through``, p / stopgrad(p) (exactly 1 forward, the router still
    learns from the loss); else renormalised over the k picks when ``renormalize`` (k = 1: exactly 1,
    no gradient); else the raw probabilities (Switch at k = 1).
    """
    probs = F.softmax(logits / temperature, dim=-1) if temperature != 1.0 else logits.softmax(dim=-1)
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


def balance_loss(probs: torch.Tensor, selected: torch.Tensor, num_experts: int,
                 valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Switch loss E * sum_i f_i * P_i over the real experts i < num_experts (coefficient not applied).

    probs (N, E_total), selected (N, k), valid (N,) bool, or None: every token valid (the same numbers as
    an all-True mask, without its masking ops). f_i = share of the valid tokens' real-expert
    assignments that chose i (before capacity dropping, as in Switch); P_i = mean over valid tokens of
    the router probability of i renormalised over the real experts. No-op experts (ids >= num_experts)
    are left out of the sum AND of both denominators, so the loss is the same whatever share of tokens
    skips: it balances the real experts without rewarding skipping (counting the no-op in the
    denominators made it (1 - s)^2 at skip share s, minimised by skipping everything). A uniform router
    over E real experts gives exactly 1.
    """
    # counts by scatter_add, not bincount(selected[valid]): no data-dependent shape, so torch.compile
    # keeps the loss in the graph
    if valid is None:
        n_valid, valid_slots = max(1, probs.shape[0]), probs.new_ones(selected.numel())
    else:
        n_valid = valid.sum().clamp(min=1)
        valid_slots = valid.to(probs.dtype).unsqueeze(-1).expand(-1, selected.shape[1]).reshape(-1)
    counts = probs.new_zeros(probs.shape[1]).scatter_add_(0, selected.reshape(-1), valid_slots)[:num_experts]
    f = counts / counts.sum().clamp(min=1)
    real = probs[:, :num_experts]
    if probs.shape[1] > num_experts:
        real = real / real.sum(-1, keepdim=True).clamp(min=1e-9)
    if valid is not None:
        real = real * valid.unsqueeze(-1).to(probs.dtype)
    P = real.sum(0) / n_valid
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


def z_loss(logits: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """ST-MoE router z-loss: mean over valid tokens of logsumexp(logits)^2 (coefficient not applied);
    ``valid`` None: every token (the numbers of an all-True mask, without its masking ops)."""
    if torch.compiler.is_compiling():
        # logsumexp's decomposition branches on numel(), which a traced token count (MoD's causal decision
        # ahead of staged MoDE's experts) cannot answer; the same max-shifted sum, written out
        top = logits.amax(dim=-1, keepdim=True).detach()
        lse = (logits - top).exp().sum(dim=-1).log() + top.squeeze(-1)
    else:
        lse = torch.logsumexp(logits, dim=-1)
    if valid is None:
        return lse.square().sum() / max(1, lse.shape[0])
    w = valid.to(lse.dtype)
    return (lse.square() * w).sum() / w.sum().clamp(min=1)




# ---------------------------------------------------------------------------- choices and the Router modules
FROM_STATE: Any = object()  # ``valid`` not given: the ForwardState's (B, T) mask of real tokens


@dataclass
class Choice:
    """What a pick rule chose: the one result of ``PickRule.pick`` (the ``Router`` reports it as the site).

    ``selected`` (B, T, k) long ids into the router's choices and ``weights`` (B, T, k) are live: gradients
    flow through them to the router. Optional, when the rule produces them: ``probs`` (B, T, C) the
    distribution over the choices; ``dropped`` (B, T, k) bool, assignments over a capacity limit (they do
    not run); ``keep`` (B*T, k) bool, the assignments that run (valid and within capacity; None: all);
    ``aux`` the rule's losses with their coefficients applied, named without the site (``"balance"``: the
    router reports ``"<site>/balance"``); ``logits`` what the site shows when not the router's own logits
    (MoD's one score per token, (B, T)).
    """

    selected: torch.Tensor
    weights: torch.Tensor
    probs: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    aux: Dict[str, torch.Tensor] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None


@dataclass
class SequenceChoice(Choice):
    """``ExpertChoice``'s result: also ``chosen`` (B, T) bool, and for the sequence top-k the gathered
    positions ``idx`` (B, k_max) with ``real`` (B, k_max) bool (``expert_choice_topk``; None when causal)."""

    chosen: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    real: Optional[torch.Tensor] = None


class PickRule:
    """How a router chooses from its logits: ``pick(logits, valid) -> Choice``.

    ``logits`` (B, T, C) fp32; ``valid`` (B, T) bool of the real tokens or None (all real). The rule only
    chooses: the ``Router`` builds the ``RoutingSite`` (kind ``kind``, its name, choices and valid mask)
    and reports it with the rule's ``aux`` losses. Options are constructor arguments; data that changes per
    call (MoD's causal decision, MoE's no-op budget on the decoding cache) are typed keyword parameters of
    the rule's own ``pick``, and its block then calls ``router.logits``, ``rule.pick`` and ``router.report``
    itself. ``detach_site``: the site holds detached copies of the choice (the block still gets live ones).
    Writing one: docs/pick-rules.md.
    """

    kind: str = "token_choice"
    detach_site: bool = False

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor]) -> Choice:
        raise NotImplementedError


@dataclass
class Decision:
    """What a router decided, for the block to act on: the reported ``site``, the rule's live ``choice``,
    the router's ``logits``, ``aux`` (the losses as reported, site-named) and, for a recurrent router,
    ``carry`` (its state for the next step). ``selected`` / ``weights`` / ``probs`` / ``keep``: the choice's."""

    site: RoutingSite
    choice: Choice
    logits: Optional[torch.Tensor]
    aux: Dict[str, torch.Tensor]
    carry: Optional[torch.Tensor] = None

    @property
    def selected(self) -> torch.Tensor:
        return self.choice.selected

    @property
    def weights(self) -> torch.Tensor:
        return self.choice.weights

    @property
    def probs(self) -> Optional[torch.Tensor]:
        return self.choice.probs

    @property
    def keep(self) -> Optional[torch.Tensor]:
        return self.choice.keep


@dataclass(frozen=True)
class SiteId:
    """Where a router reports: the site's unique ``name``, its ``group`` and chain position ``step``."""

    name: str
    group: str = ""
    step: int = 0

    def at_step(self, step: Optional[int]) -> "SiteId":
        """A router run at several steps (MoM's recurrent routers) reports ``<name>.step<h>`` at step h."""
        return self if step is None else SiteId(f"{self.name}.step{step}", self.group, step)


def report_site(state, kind: str, choice_names: Sequence[str], where: SiteId, choice: Choice,
                logits: Optional[torch.Tensor] = None, *, valid=FROM_STATE, detach: bool = False,
                relay: Optional[Callable[[RoutingSite], RoutingSite]] = None) -> Decision:
    """Build one ``RoutingSite`` from ``choice`` and report it, with the choice's losses named
    ``<site>/<loss>``, to ``state``; returns the ``Decision``.

    ``valid``: the state's mask unless given (a router on gathered tokens passes its own); ``detach``: the
    site holds detached copies; ``relay``: a site transform applied before reporting (MoDE staged re-lays
    its MoE site on the full (B, T) grid).
    """
    valid = state.valid if valid is FROM_STATE else valid
    shown = [choice.selected, choice.weights, choice.probs, choice.logits if choice.logits is not None else logits]
    if detach:
        shown = [None if t is None else t.detach() for t in shown]
    site = RoutingSite(name=where.name, kind=kind, choice_names=list(choice_names), selected=shown[0],
                       weights=shown[1], group=where.group, step=where.step, probs=shown[2], dropped=choice.dropped,
                       valid=None if valid is None else valid.to(torch.bool), logits=shown[3], extras={})
    if relay is not None:
        site = relay(site)
    aux = {f"{where.name}/{key}": loss for key, loss in choice.aux.items()}
    state.report(site, aux)
    return Decision(site, choice, logits, aux)


def flat_valid(valid: Optional[torch.Tensor], N: int, device) -> torch.Tensor:
    """(N,) bool of the real tokens of a (B, T) mask (None: all N real)."""
    return torch.ones(N, dtype=torch.bool, device=device) if valid is None else valid.reshape(N).to(torch.bool)


class Router(nn.Module):
    """Base of the routers: scoring parameters (the subclass), fp32 logits, a pick rule, one reported site.

    ``router(x, state, *carry, valid=, relay=, allowed=, step=) -> Decision``: ``logits`` (the subclass's
    ``scores`` with autocast off, so bf16 autocast never rounds a routing decision), then ``rule.pick``,
    then ``report``: the site (named when the router was built, ``SiteId``) and the rule's losses go to
    ``state``, exactly once. ``removed``: optional (C,) bool of choices taken out (logit -inf; MoM's
    ``removed_modules``); ``allowed``: the choices open at this call (the others -inf for the rule only;
    the site shows the router's logits).
    """

    removed: Optional[torch.Tensor] = None

    def setup(self, rule: PickRule, choice_names: Sequence[str], site: SiteId) -> None:
        self.rule, self.choice_names, self.site = rule, list(choice_names), site

    def scores(self, x: torch.Tensor, *carry):
        raise NotImplementedError

    def logits(self, x: torch.Tensor, *carry):
        """``scores`` in fp32 with autocast off: logits, or (logits, carry) for a recurrent router."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = self.scores(x, *carry)
        if self.removed is None:
            return out
        logits, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        logits = logits.masked_fill(self.removed.to(logits.device), float("-inf"))
        return (logits, *rest) if rest else logits

    def forward(self, x: torch.Tensor, state, *carry, valid=FROM_STATE, relay=None,
                allowed: Optional[torch.Tensor] = None, step: Optional[int] = None) -> Decision:
        out = self.logits(x, *carry)
        logits, new_carry = out if isinstance(out, tuple) else (out, None)
        mask = state.valid if valid is FROM_STATE else valid
        scores = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
        decision = self.report(state, logits, self.rule.pick(scores, mask), valid=valid, relay=relay, step=step)
        decision.carry = new_carry
        return decision

    def report(self, state, logits: Optional[torch.Tensor], choice: Choice, *, valid=FROM_STATE, relay=None,
               step: Optional[int] = None) -> Decision:
        """Report ``choice`` (the rule's pick on ``logits``) as this router's site: for a block that calls its
        rule's ``pick`` itself (a rule with per-call parameters)."""
        return report_site(state, self.rule.kind, self.choice_names, self.site.at_step(step), choice, logits,
                           valid=valid, detach=self.rule.detach_site, relay=relay)

    def report_idle(self, state, shape: Tuple[int, int], k: int, device) -> Decision:
        """The site of a token-choice layer that no token reached (MoDE staged, every token skipped its
        block): all-zero choices, every token invalid, so it counts nothing."""
        B, T = shape
        zeros = torch.zeros(B, T, len(self.choice_names), dtype=torch.float32, device=device)
        idle = Choice(torch.zeros(B, T, k, dtype=torch.long, device=device), zeros[..., :k], probs=zeros,
                      dropped=torch.zeros(B, T, k, dtype=torch.bool, device=device))
        return report_site(state, "token_choice", self.choice_names, self.site, idle, zeros,
                           valid=torch.zeros(B, T, dtype=torch.bool, device=device))


class LinearRouter(Router, nn.Linear):
    """A bias-free linear router (MoE, MoD, MoT, depth gating): ``nn.Linear`` parameters (``weight``; the
    suite's init and old checkpoints see a linear layer), logits ``x @ W^T`` in fp32."""

    def __init__(self, d_model: int, n_choices: int, rule: PickRule, choice_names: Sequence[str], site: SiteId):
        nn.Linear.__init__(self, d_model, n_choices, bias=False)
        self.setup(rule, choice_names, site)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MLPRouter(Router):
    """A gate with a hidden layer (MoT's seed form): d -> hidden (GELU) -> E, in fp32."""

    def __init__(self, d_model: int, hidden: int, n_choices: int, rule: PickRule, choice_names: Sequence[str],
                 site: SiteId):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, n_choices, bias=False)
        self.setup(rule, choice_names, site)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x.float(), self.fc.weight.float(), self.fc.bias.float()))
        return F.linear(h, self.out.weight.float())


class GRURouter(Router):
    """MoM's recurrent router: ``h = GRUCell(x, h_prev)``, ``logits = W_o h``; the carry is h, one row per
    token ((B*T, hidden) for x (B, T, d)); the logits keep x's leading shape."""

    def __init__(self, d_model: int, hidden: int, n_choices: int, rule: PickRule, choice_names: Sequence[str],
                 site: SiteId, bias: bool = False):
        super().__init__()
        self.cell = nn.GRUCell(d_model, hidden)
        self.out = nn.Linear(hidden, n_choices, bias=bias)
        self.setup(rule, choice_names, site)

    def scores(self, x: torch.Tensor, state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        state = self.cell(x.reshape(-1, x.shape[-1]).to(self.cell.weight_ih.dtype), state)
        logits = self.out(state).float()
        return logits.view(*x.shape[:-1], logits.shape[-1]), state


# ---------------------------------------------------------------------------- pick rules
class Switch(PickRule):
    """MoE's token choice: top-k over the E experts + no-op experts; with ``noop_share`` a causal per-row
    budget for the no-op choices (``noop_budget_keep``; tokens past it choose among the real experts, the
    running count on the cache when decoding: ``pick``'s ``budgets``, the cache's ``state("noop_budget")``,
    under ``budget_key``); weights renormalised over k (k > 1 only: at k = 1, w / w = 1 would give the router
    no gradient through the output); a capacity limit per expert unless dropless (``capacity_keep``); the
    balance loss over the real experts and the z-loss (coefficients applied)."""

    def __init__(self, num_experts: int, top_k: int, renormalize: bool, dropless: bool, capacity_factor: float,
                 balance_coef: float, z_loss_coef: float, noop_share: Optional[float] = None, budget_key: str = ""):
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.dropless, self.capacity_factor = dropless, capacity_factor
        self.balance_coef, self.z_loss_coef = balance_coef, z_loss_coef
        self.noop_share, self.budget_key = noop_share, budget_key

    def capacity(self, n_tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.num_experts))

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor],
             budgets: Optional[Dict[str, torch.Tensor]] = None) -> Choice:
        B, T, _ = logits.shape
        N, k = B * T, self.top_k
        probs, weights, selected = token_topk(logits, k)
        if self.noop_share is not None:
            weights, selected = self.noop_budget(probs, weights, selected, valid, budgets)
        if self.renormalize and k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        valid_flat = None if valid is None else valid.reshape(N).to(torch.bool)  # None: all valid
        sel_flat = selected.reshape(N, k)
        keep = None if valid is None else valid_flat.unsqueeze(-1).expand(N, k)
        dropped = torch.zeros(N, k, dtype=torch.bool, device=logits.device)
        if not self.dropless:
            routed = flat_valid(valid, N, logits.device)
            fits = capacity_keep(sel_flat, self.num_experts, self.capacity(int(routed.sum())), routed, T)
            dropped = ~fits
            keep = fits if keep is None else keep & fits
        aux: Dict[str, torch.Tensor] = {}
        if self.balance_coef > 0:
            aux["balance"] = self.balance_coef * balance_loss(
                probs.reshape(N, probs.shape[-1]), sel_flat, self.num_experts, valid_flat)  # explicit width: N may be 0
        if self.z_loss_coef > 0:
            aux["z_loss"] = self.z_loss_coef * z_loss(logits.reshape(N, logits.shape[-1]), valid_flat)
        return Choice(selected, weights, probs, dropped=dropped.view(B, T, k), keep=keep, aux=aux)

    def noop_budget(self, probs, weights, selected, valid, budgets):
        B, T, _ = probs.shape
        valid = torch.ones(B, T, dtype=torch.bool, device=probs.device) if valid is None else valid.to(torch.bool)
        wants = (selected >= self.num_experts).sum(-1)
        keep, state = noop_budget_keep(wants, valid, self.noop_share, self.top_k,
                                       None if budgets is None else budgets.get(self.budget_key))
        if budgets is not None:
            budgets[self.budget_key] = state
        real_only = probs.masked_fill(torch.arange(probs.shape[-1], device=probs.device) >= self.num_experts, -1.0)
        real_w, real_sel = real_only.topk(self.top_k, dim=-1)
        real_w = probs.gather(-1, real_sel)
        over = (~keep).unsqueeze(-1)
        return torch.where(over, real_w, weights), torch.where(over, real_sel, selected)


class TopK(PickRule):
    """Token-choice top-k (``token_topk``: temperature, renormalised / straight-through weights) for MoT,
    MoM and hard depth gating.

    ``adjust(probs, weights, selected) -> (weights, selected)``: a family's rule applied to the pick
    (MoT's random activation and uniform weights). ``balance(probs, selected, valid) -> {"balance": loss}``
    (flat (N, .) tensors, valid (N,) bool): the family's balance loss on the pick (before ``all_paths``).
    ``all_paths``: every choice, weighted by the full distribution (MoM's ``routing_all_possible_path``).
    ``detach``: the site holds detached weights, probs and logits.
    """

    def __init__(self, k: int, kind: str = "token_choice", temperature: float = 1.0, renormalize: bool = False,
                 straight_through: bool = False, adjust: Optional[Callable] = None,
                 balance: Optional[Callable] = None, all_paths: bool = False, detach: bool = False):
        self.k, self.kind, self.temperature, self.renormalize = k, kind, temperature, renormalize
        self.straight_through, self.adjust, self.balance = straight_through, adjust, balance
        self.all_paths, self.detach_site = all_paths, detach

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor]) -> Choice:
        probs, weights, selected = token_topk(logits, self.k, self.temperature, renormalize=self.renormalize,
                                              straight_through=self.straight_through)
        if self.adjust is not None:
            weights, selected = self.adjust(probs, weights, selected)
        aux: Dict[str, torch.Tensor] = {}
        if self.balance is not None:
            N = selected.numel() // selected.shape[-1]
            aux = self.balance(probs.reshape(N, -1), selected.reshape(N, -1), flat_valid(valid, N, logits.device))
        if self.all_paths:
            selected = torch.arange(probs.shape[-1], device=probs.device).expand(*probs.shape)
            weights = probs
        return Choice(selected, weights, probs, aux=aux)


class SoftGate(PickRule):
    """A dense distribution over every choice (soft depth gating): each choice selected, weighted by its
    probability; nothing skipped."""

    kind = "soft_gate"

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor]) -> Choice:
        probs = logits.softmax(dim=-1)
        L = probs.shape[-1]
        selected = torch.arange(L, device=probs.device).expand(*probs.shape[:-1], L)
        return Choice(selected, probs, probs)


class ExpertChoice(PickRule):
    """MoD's expert choice over each sequence (``expert_choice_topk`` on the detached scores, k from each
    row's real length); under causal routing the block's causal decision ``causal`` ((B, T) bool: predictor
    or router sign) instead, padding never chosen. Choices {skip, block}: selected 1 on chosen tokens, weight
    the router output (or ``fixed_weight``, a test hook) on chosen tokens, 0 elsewhere; the site shows them
    detached, with the (B, T) logits."""

    kind = "expert_choice"
    detach_site = True

    def __init__(self, capacity: float):
        self.capacity = capacity

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor], causal: Optional[torch.Tensor] = None,
             fixed_weight: Optional[float] = None) -> SequenceChoice:
        logits = logits.squeeze(-1)
        weight = logits if fixed_weight is None else torch.full_like(logits, fixed_weight)
        idx = real = None
        if causal is not None:
            chosen = causal if valid is None else causal & valid
        else:
            chosen, idx, real = expert_choice_topk(logits.detach(), self.capacity, valid)
        return SequenceChoice(chosen.long().unsqueeze(-1), (weight * chosen).unsqueeze(-1), logits=logits,
                              chosen=chosen, idx=idx, real=real)


class FixedChoice(PickRule):
    """A routerless site (MoM's fixed modules): every token takes choice ``choice`` with weight 1. Nothing is
    scored, so there is no ``Router``: ``report`` picks and reports the site (name, group, step ``where``)."""

    def __init__(self, choice: int):
        self.choice = choice

    def pick(self, logits: torch.Tensor, valid: Optional[torch.Tensor]) -> Choice:
        """``logits`` (B, T, .): only their shape and device are read."""
        B, T = logits.shape[:2]
        selected = torch.full((B, T, 1), self.choice, dtype=torch.long, device=logits.device)
        return Choice(selected, torch.ones(B, T, 1, device=logits.device))

    def report(self, state, choice_names: Sequence[str], where: SiteId, shape: Tuple[int, int], device) -> Decision:
        no_scores = torch.empty(*shape, 0, device=device)
        return report_site(state, self.kind, choice_names, where, self.pick(no_scores, state.valid), valid=state.valid)
