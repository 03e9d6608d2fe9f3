"""Mixture-of-Depths (Raposo et al. 2024, arXiv 2404.02258) and MoDE (staged / integrated).

``mod``: in each routed block (``model.mod.routed_blocks``, default every odd block) a scalar linear
router r = w^T x (fp32, autocast off) scores every token; the block takes the top k = max(1, floor(c*T))
tokens of each sequence, T = that example's real (unpadded) length (expert choice), keeps them in their original order, runs attention and MLP on the gathered (B, k, d)
tensor only (causal among the k; positions are already in the embeddings) and writes back
x_i + r_i * f(X_sel)_i. Every other token is copied through bit for bit.

The update is computed as ``(x + r*a) + r*m`` with ``a`` the attention update and ``m`` the MLP
output on ``x + a`` (the block's internal, unweighted residual): the same number as ``x + r*(a+m)``,
and with r == 1 exactly the vanilla block's arithmetic, so capacity 1 with a fixed unit router weight
reproduces GPT-2 bit for bit (``MoD.fixed_router_weight`` is that test hook).

Top-k over the sequence is not causal. For sampling each routed block has a causal decision
(``model.mod.sampling``): "aux_loss" trains the router logits with BCE against top-k membership and
decides sigmoid(r) > 0.5; "predictor" trains a small MLP on the stop-gradient block input with BCE
(no gradient reaches the LM) and decides sigmoid(p) > 0.5. Generation (``generate()``, any forward
with a ``KVCache``, or ``with model.causal_routing():``) routes by that decision. The number of
processed tokens then differs per sequence, so those paths attend row by row, and each row keeps its
own cache entry per routed block (``"block{i}.row{b}"``): a token the block skips writes nothing.

MoDE (``mode_staged``, ``mode_integrated``) uses the shared ``MoELayer`` (architectures/moe_layer.py).
Staged: the MLP of each routed block is an MoE layer, so routing happens around attention + MoE.
Integrated: routed blocks keep dense attention and replace the MLP by an MoE layer with
``model.mod.noop_experts`` identity experts, so skipping is a token-choice among the experts, within
a budget of ``1 - model.mod.capacity`` of each row's assignments. In both,
the remaining blocks get an MoE MLP when ``model.moe.layers`` selects them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ConfigError, ModelConfig, layer_selection
from architectures.contract import RoutingSite
from architectures.dispatch import plan_segments
from architectures.gpt2 import MLP, Block, CausalSelfAttention
from architectures.moe_layer import UPCYCLE_RULES, MoEBlock, MoEConfig, MoELayer, expert_hidden, validate_moe_config
from architectures.routing import Decision, ExpertChoice, LinearRouter, SiteId, capacity_tokens


@dataclass
class MoDConfig:
    """Mixture-of-Depths (Raposo et al. 2024). Used by ``mod``, ``mode_staged``, ``mode_integrated``."""

    capacity: float = 0.125
    # Which blocks are routed: "odd" (1, 3, 5, ...: the paper's every-other-block), "even", "all",
    # or an explicit list of block indices.
    routed_blocks: Union[str, List[int]] = "odd"
    # Causal decision used by generate(): "aux_loss" (BCE on router logits), "predictor"
    # (aux MLP on stop-gradient inputs), or "none" (training only; generate() refuses).
    sampling: str = "predictor"
    aux_loss_coef: float = 0.01  # router BCE ("aux_loss"): shapes the router, so it is kept small
    predictor_hidden: int = 64
    # Predictor BCE ("predictor"): its input is stop-gradient, so this only sets its learning rate.
    predictor_loss_coef: float = 1.0
    # MoDE-integrated: number of identity (no-op) experts added next to the MoE experts.
    noop_experts: int = 1

SAMPLING_CHOICES = ("aux_loss", "predictor", "none")


# ---------------------------------------------------------------------------- configuration
def routed_block_indices(config: ModelConfig) -> List[int]:
    indices = layer_selection(config.mod.routed_blocks, config.n_layer, "model.mod.routed_blocks")
    require(bool(indices), "model.mod.routed_blocks",
            f"{config.mod.routed_blocks!r} selects no block for model.n_layer={config.n_layer}")
    return indices


def validate_mod_routing(config: ModelConfig) -> None:
    """Checks for expert-choice MoD routing (``mod``, ``mode_staged``)."""
    cfg = config.mod
    require(isinstance(cfg.capacity, (int, float)) and 0.0 < cfg.capacity <= 1.0, "model.mod.capacity",
            f"must be in (0, 1], got {cfg.capacity!r}")
    routed_block_indices(config)
    require(cfg.sampling in SAMPLING_CHOICES, "model.mod.sampling",
            f"unknown causal sampling {cfg.sampling!r}; use one of {', '.join(SAMPLING_CHOICES)}")
    if cfg.sampling == "aux_loss":
        require(cfg.aux_loss_coef > 0, "model.mod.aux_loss_coef",
                f"must be > 0 with model.mod.sampling='aux_loss' (the router BCE is the causal predictor), "
                f"got {cfg.aux_loss_coef}")
    if cfg.sampling == "predictor":
        require(isinstance(cfg.predictor_hidden, int) and cfg.predictor_hidden >= 1, "model.mod.predictor_hidden",
                f"must be an integer >= 1 with model.mod.sampling='predictor', got {cfg.predictor_hidden!r}")
        require(cfg.predictor_loss_coef > 0, "model.mod.predictor_loss_coef",
                f"must be > 0 with model.mod.sampling='predictor', got {cfg.predictor_loss_coef}")


def masked_mean(values: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    if valid is None:
        return values.mean()
    w = valid.to(values.dtype)
    return (values * w).sum() / w.sum().clamp(min=1)


def _scatter_rows(values: torch.Tensor, flat: torch.Tensor, n_rows: int, fill=0) -> torch.Tensor:
    """Rows of ``values`` (N, ...) placed at ``flat`` in an (n_rows, ...) tensor filled with ``fill``."""
    values = values.detach()
    out = values.new_full((n_rows, *values.shape[1:]), fill)
    return out.index_copy(0, flat, values)


def _select_tokens(site: RoutingSite, keep: torch.Tensor) -> RoutingSite:
    """The site restricted to the gathered tokens ``keep`` (flat bool), as one row."""
    def pick(t):
        return None if t is None else t.reshape(keep.numel(), *t.shape[2:])[keep].unsqueeze(0)

    return RoutingSite(
        name=site.name, kind=site.kind, choice_names=site.choice_names, selected=pick(site.selected),
        weights=pick(site.weights), group=site.group, step=site.step, probs=pick(site.probs),
        dropped=pick(site.dropped), valid=pick(site.valid), logits=pick(site.logits), extras=site.extras,
    )


def expand_site(site: RoutingSite, flat: torch.Tensor, B: int, T: int) -> RoutingSite:
    """An MoE site computed on the N processed tokens, re-laid on the full (B, T) grid.

    Tokens the MoD router skipped are marked invalid, so statistics and FLOPs count only the tokens
    the MoE layer really saw, and the site lines up token-for-token with the other layers' sites.
    """
    N = flat.numel()

    def put(t, fill=0):
        if t is None:
            return None
        full = _scatter_rows(t.reshape(N, *t.shape[2:]), flat, B * T, fill)
        return full.view(B, T, *full.shape[1:])

    seen = torch.ones(N, dtype=torch.bool, device=flat.device) if site.valid is None else site.valid.reshape(N)
    return RoutingSite(
        name=site.name, kind=site.kind, choice_names=site.choice_names, selected=put(site.selected),
        weights=put(site.weights), group=site.group, step=site.step, probs=put(site.probs),
        dropped=put(site.dropped, False), valid=put(seen, False), logits=put(site.logits), extras=site.extras,
    )


# ---------------------------------------------------------------------------- blocks
class RoutedBlock(nn.Module):
    """A block behind an expert-choice MoD router; its MLP is a GPT-2 MLP or (staged MoDE) an MoE layer.

    Parameter names of the block proper (``ln_1``, ``attn``, ``ln_2``, ``mlp``) match ``gpt2.Block``,
    so vanilla weights load into it; ``router`` and ``predictor`` are the extra parameters.
    """

    def __init__(self, config: ModelConfig, index: int, step: int, moe_step: Optional[int] = None):
        super().__init__()
        d = config.d_model
        self.cfg = config.mod
        self.index, self.step, self.moe_step = index, step, moe_step
        self.name = f"block{index}.mod"
        self.d_model, self.ffn_hidden = d, config.ffn_hidden
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(d, config.n_head, config.bias, config.dropout)
        self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        if moe_step is None:
            self.mlp: nn.Module = MLP(d, config.ffn_hidden, config.bias, config.dropout)
        else:
            self.mlp = MoELayer(d, expert_hidden(config), config.moe, config.bias, config.dropout,
                                site=SiteId(f"block{index}.moe", "moe", moe_step))
        self.router = LinearRouter(d, 1, ExpertChoice(self.cfg.capacity), ["skip", "block"], SiteId(self.name, "mod", step))
        self.predictor: Optional[nn.Module] = None
        if self.cfg.sampling == "predictor":
            h = self.cfg.predictor_hidden
            self.predictor = nn.Sequential(nn.Linear(d, h), nn.GELU(approximate="tanh"), nn.Linear(h, 1))

    def start_as_dense(self) -> str:
        """Upcycling hook: a staged-MoDE MoE MLP gives the dense MLP's update for the tokens the block takes
        (the MoD router itself cannot be made dense: tokens past the capacity skip the block)."""
        return self.mlp.match_dense(replaces_ffn=True) if isinstance(self.mlp, MoELayer) else ""

    # -------------------------------------------------------------- routing
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 with autocast off, so that top-k ranks are not decided by bf16 ties
        return self.router.logits(x).squeeze(-1)

    def predictor_logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            first, act, last = self.predictor
            h = act(F.linear(x.detach().float(), first.weight.float(), first.bias.float()))
            return F.linear(h, last.weight.float(), last.bias.float()).squeeze(-1)

    def causal_decision(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(B, T) bool from information up to each token only: sigmoid(predictor or router) > 0.5."""
        if self.predictor is not None:
            return self.predictor_logits(x) > 0
        return logits > 0

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The router picks (the sequence top-k, or the causal decision) and reports the block's site."""
        logits = self.router.logits(x)
        causal = self.causal_decision(x, logits.squeeze(-1)) if state.causal else None
        choice = self.router.rule.pick(logits, state.valid, causal, state.options.get("fixed_router_weight"))
        route = self.router.report(state, logits, choice)
        if state.causal:
            return self._forward_causal(x, route, state)
        return self._forward_topk(x, route, state)

    def _forward_topk(self, x, route: Decision, state: ForwardState) -> torch.Tensor:
        """Each row takes its own k_b = max(1, floor(c * real length)) best tokens, in position order
        (``routing.expert_choice_topk``).

        Rows are gathered to a common width k_max: a row's k_b chosen tokens come first, then fillers
        (the row's next tokens by position). Attention among the gathered tokens is causal, so the
        chosen ones never see a filler, and fillers are not written back: an example's output does not
        depend on its batch-mates or on right padding.
        """
        B, T, d = x.shape
        idx, real, logits, weight = route.choice.idx, route.choice.real, route.choice.logits, route.weights
        k_max = idx.shape[1]
        flat = (idx + torch.arange(B, device=x.device).unsqueeze(1) * T).reshape(-1)
        write = None if real is None else real.reshape(-1)
        chosen = self._run(x, flat, (B, k_max), weight, self.attn.attend, real, state, write=write)
        pairs = float(B * k_max * k_max)
        extras = {"attn_pairs": torch.tensor(pairs), "processed": torch.tensor(float(B * k_max))}
        extras.update(self._sampling_losses(x, logits, chosen, state))
        route.site.extras.update(extras)
        return chosen.out

    def _forward_causal(self, x, route: Decision, state: ForwardState) -> torch.Tensor:
        """The tokens the causal decision picked run the block, each attending among its own row's picked
        tokens (row by row); a token no row picked is copied through."""
        if torch.compiler.is_compiling() and state.cache is None:
            return self._forward_causal_traced(x, route, state)
        B, T, d = x.shape
        decided, weight = route.choice.chosen, route.weights
        flat = decided.reshape(-1).nonzero().squeeze(-1)
        if not flat.numel() and state.cache is None and torch.is_grad_enabled():
            # no token picked the block, gradients recorded: it runs on zero tokens (a zero gradient, not None)
            return self._forward_causal_traced(x, route, state)
        counts = decided.sum(dim=1).tolist()
        pairs = [0.0]

        def attend_rows(qkv: torch.Tensor) -> torch.Tensor:
            outs = []
            for b, seg in enumerate(qkv.split(counts, dim=1)):
                if seg.shape[1]:
                    key = f"block{self.index}.row{b}"
                    outs.append(self.attn.attend(seg, state.cache, key))
                    if state.cache is not None:
                        pairs[0] += seg.shape[1] * state.cache.length(key)
            return torch.cat(outs, dim=1)

        if flat.numel():
            chosen = self._run(x, flat, (1, flat.numel()), weight, attend_rows, None, state)
        else:
            chosen = self._skip_all(x, state)
        # with a cache each query also scores the row's earlier keys: not derivable from this trace alone
        if state.cache is not None:
            route.site.extras["attn_pairs"] = torch.tensor(pairs[0])
        return chosen.out

    def _forward_causal_traced(self, x, route: Decision, state: ForwardState) -> torch.Tensor:
        """``_forward_causal`` under torch.compile (and, eager, for a block no token picked while gradients are
        recorded): the same update as one graph. The per-row counts are traced
        sizes, on which no Python branch can be taken: the picked tokens attend in MoT's right-padded (B, M)
        layout (``dispatch.plan_segments``, M = the largest row count, at least 1; a real token never sees a pad),
        and a batch where nothing was picked runs the block on zero tokens. ``attn_pairs`` records the
        B * M * M scores that layout computes."""
        B, T, d = x.shape
        decided = route.choice.chosen
        seg = plan_segments(torch.zeros(B, T, 1, dtype=torch.long, device=x.device), decided, 1, keep_idle=True)[0]

        def attend_padded(qkv: torch.Tensor) -> torch.Tensor:
            layout = qkv.new_zeros(B * seg.width, qkv.shape[-1]).index_copy(0, seg.padded, qkv[0])
            y = self.attn.attend(layout.view(B, seg.width, qkv.shape[-1]))
            return y.reshape(B * seg.width, -1).index_select(0, seg.padded).unsqueeze(0)

        chosen = self._run(x, seg.tokens, (1, seg.tokens.numel()), route.weights, attend_padded, None, state)
        width = decided.sum(dim=1).max().clamp(min=1).double()
        route.site.extras["attn_pairs"] = B * width * width
        return chosen.out

    # -------------------------------------------------------------- compute on the processed tokens
    def _run(self, x, flat, shape: Tuple[int, int], weight, attend: Callable, valid_sel, state: ForwardState,
             write: Optional[torch.Tensor] = None) -> "_Chosen":
        """Gather the tokens at ``flat`` as ``shape`` = (rows, len), update them, scatter back.

        ``write`` (bool per gathered token): which results are written back; the others (fillers)
        were computed only to give every row the same width.
        """
        B, T, d = x.shape
        xf = x.reshape(B * T, d)
        x_sel = xf.index_select(0, flat).view(*shape, d)
        r = weight.reshape(-1).index_select(0, flat).view(*shape, 1).to(x.dtype)
        a = self.attn.resid_drop(self.attn.c_proj(attend(self.attn.c_attn(self.ln_1(x_sel)))))
        m = self._ffn(self.ln_2(x_sel + a), valid_sel, flat, B, T, state, write)
        h = (x_sel + r * a).reshape(-1, d)
        y = h + r.reshape(-1, 1) * m.reshape(-1, d)
        if write is not None:
            flat, h, y = flat[write], h[write], y[write]
        out = xf.index_copy(0, flat, y).view(B, T, d)
        if state.residuals is not None:
            state.record("mha", self.index, xf.index_copy(0, flat, h).view(B, T, d))
            state.record("ffn", self.index, out)
        mask = torch.zeros(B * T, dtype=torch.bool, device=x.device).index_fill(0, flat, True).view(B, T)
        return _Chosen(out, mask)

    def _skip_all(self, x, state: ForwardState) -> "_Chosen":
        """No token chose the block (possible only with causal decisions): nothing runs."""
        B, T, _ = x.shape
        state.record("mha", self.index, x)
        state.record("ffn", self.index, x)
        if isinstance(self.mlp, MoELayer):  # its site still reports: every token invalid
            self.mlp.router.report_idle(state, (B, T), self.mlp.top_k, x.device)
        return _Chosen(x, torch.zeros(B, T, dtype=torch.bool, device=x.device))

    def _ffn(self, z, valid_sel, flat, B, T, state: ForwardState, write=None):
        if not isinstance(self.mlp, MoELayer):
            return self.mlp(z)

        def relay(site: RoutingSite) -> RoutingSite:  # the MoE site re-laid on the (B, T) grid before it reports
            site = site if write is None else _select_tokens(site, write)
            return expand_site(site, flat if write is None else flat[write], B, T)

        return self.mlp(z, valid=valid_sel, state=state, relay=relay).output

    # -------------------------------------------------------------- causal predictors and the trace
    def _sampling_losses(self, x, logits, chosen: "_Chosen", state: ForwardState) -> Dict[str, torch.Tensor]:
        """BCE of the causal decision against top-k membership, and the decision's agreement with it."""
        if self.cfg.sampling == "none":
            return {}
        target = chosen.mask.to(torch.float32)
        if self.cfg.sampling == "predictor":
            decision, name, coef = self.predictor_logits(x), "predictor_bce", self.cfg.predictor_loss_coef
        else:
            decision, name, coef = logits, "router_bce", self.cfg.aux_loss_coef
        bce = F.binary_cross_entropy_with_logits(decision, target, reduction="none")
        state.aux[f"{self.name}/{name}"] = coef * masked_mean(bce, state.valid)
        agree = ((decision.detach() > 0) == chosen.mask).to(torch.float32)
        return {"causal_agreement": masked_mean(agree, state.valid)}

    # -------------------------------------------------------------- FLOPs
    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        """Per token of the batch: the block on the processed tokens only, the router and predictor on all."""
        d, hidden = self.d_model, self.ffn_hidden
        site = sites.get(self.name)
        if site is None:
            k = capacity_tokens(self.cfg.capacity, T)
            frac, pairs_per_token = k / T, k * k / T
        else:  # what ran: the chosen tokens plus any fillers that pad rows to a common width
            n_tokens = site.selected.shape[0] * site.selected.shape[1]
            processed = site.extras.get("processed")
            frac = float(site.selected.sum() if processed is None else processed) / n_tokens
            pairs = site.extras.get("attn_pairs")
            if pairs is None:
                pairs = site.selected.squeeze(-1).sum(dim=1).double().square().sum()
            pairs_per_token = float(pairs) / n_tokens
        out = cost.Flops(attn_proj=frac * cost.attention_projections(d), attn_scores=pairs_per_token * 4.0 * d,
                       router=cost.linear(d, 1))
        if self.predictor is not None:
            out = out + cost.Flops(router=cost.linear(d, self.cfg.predictor_hidden) + cost.linear(self.cfg.predictor_hidden, 1))
        if isinstance(self.mlp, MoELayer):
            moe_site = sites.get(f"block{self.index}.moe")
            moe = self.mlp.layer_flops(moe_site)
            # with a site the experts are already per token of the batch; the MoE router ran on the processed ones
            return out + (cost.Flops(ffn=moe.ffn, router=frac * moe.router) if moe_site is not None else moe.scale(frac))
        return out + cost.Flops(ffn=frac * cost.ffn(d, hidden))


class _Chosen:
    __slots__ = ("out", "mask")

    def __init__(self, out, mask):
        self.out, self.mask = out, mask


# ---------------------------------------------------------------------------- models
class MoD(LanguageModel):
    """Mixture-of-Depths GPT-2 (``mod``). See the module docstring.

    ``fixed_router_weight``: test hook. When set to a float, every routed block multiplies its update
    by that constant instead of the router output (selection still uses the router). With capacity 1
    and 1.0 the model computes exactly what GPT-2 computes with the same block weights.
    """

    config_groups = {"mod": MoDConfig}
    fixed_router_weight: Optional[float] = None
    routing_sees_future = True  # the sequence top-k: causal only inside causal_routing()
    # every routed block takes k >= 1 tokens and its router/predictor always get a loss: nothing idles
    may_skip_parameters = False

    uses_mod_router = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.routed = routed_block_indices(config) if self.uses_mod_router else []
        self.blocks = nn.ModuleList(self._make_blocks(config))

    def _make_blocks(self, config: ModelConfig) -> List[nn.Module]:
        """Routed blocks from ``_routed_block``; the other blocks of the MoE chain an ``MoEBlock``; the rest dense."""
        routed = routed_block_indices(config)
        chain = self._moe_chain(config, routed)
        return [self._routed_block(config, i, routed, chain) if i in routed
                else MoEBlock(config, expert_hidden(config), i, f"block{i}.moe", *chain[i]) if i in chain
                else Block(config, i) for i in range(config.n_layer)]

    def _moe_chain(self, config: ModelConfig, routed: List[int]) -> Dict[int, Tuple[str, int]]:
        """block index -> (group, step) of its MoE site; MoD has none."""
        return {}

    def _routed_block(self, config: ModelConfig, i: int, routed: List[int], chain) -> nn.Module:
        return RoutedBlock(config, i, routed.index(i), moe_step=chain[i][1] if i in chain else None)

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        validate_mod_routing(config)

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        state.options["fixed_router_weight"] = self.fixed_router_weight
        return super().body(x, state)

    @property
    def has_causal_routing(self) -> bool:
        return not (self.uses_mod_router and self.config.mod.sampling == "none")

    def prepare_generation(self) -> None:
        if not self.has_causal_routing:
            raise ConfigError(
                "model.mod.sampling: 'none' trains no causal routing decision, so the top-k router cannot be "
                "used to sample token by token; train with 'predictor' or 'aux_loss' to use generate()"
            )


class MoDEStaged(MoD):
    """Staged MoDE: MoD routing around blocks whose MLP is an MoE layer (tokens can skip attention too).

    Every MoE site (routed or not) is in group "moe", ordered by block, so expert transitions chain
    through the whole depth; a routed block's site marks the tokens it skipped as invalid.
    """

    config_groups = {"mod": MoDConfig, "moe": MoEConfig}
    may_skip_parameters = True  # an expert may get no token
    # routed blocks keep their MoE under the name "mlp", the other MoE layers under "moe"
    upcycle_rules = UPCYCLE_RULES + ((r"(blocks\.\d+)\.mlp\.experts\.(.*)", r"\1.mlp.\2"),)

    def _moe_chain(self, config: ModelConfig, routed: List[int]) -> Dict[int, Tuple[str, int]]:
        order = sorted(set(layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")) | set(routed))
        return {i: ("moe", step) for step, i in enumerate(order)}

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        validate_mod_routing(config)
        validate_moe_config(config.moe)
        layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")


class MoDEIntegrated(MoD):
    """Integrated MoDE: in routed blocks the MLP is an MoE layer whose router may pick no-op experts.

    Attention stays dense; skipping is token choice, hence causal: no predictor is needed to sample
    (``model.mod.sampling`` is unused). The compute budget is MoD's: at most ``1 - model.mod.capacity``
    of each row's (token, slot) assignments may go to the no-op experts, greedily by position (tokens
    past the budget choose among the real experts; ``moe.noop_budget_keep``), and the balance loss
    counts only the real experts, so skipping is neither rewarded nor able to take the whole row.
    Sites with no-op experts form group "mode", the plain MoE layers (``model.moe.layers`` outside the routed blocks) group "moe", so each chain
    has one set of choices.
    """

    config_groups = {"mod": MoDConfig, "moe": MoEConfig}
    uses_mod_router = False
    may_skip_parameters = True
    upcycle_rules = UPCYCLE_RULES
    routing_sees_future = False  # token choice; the no-op budget counts earlier positions only

    def _moe_chain(self, config: ModelConfig, routed: List[int]) -> Dict[int, Tuple[str, int]]:
        plain = sorted(set(layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")) - set(routed))
        chain = {i: ("mode", step) for step, i in enumerate(routed)}
        chain.update({i: ("moe", step) for step, i in enumerate(plain)})
        return chain

    def _routed_block(self, config: ModelConfig, i: int, routed: List[int], chain) -> nn.Module:
        return MoEBlock(config, expert_hidden(config), i, f"block{i}.moe", *chain[i],
                        noop_experts=config.mod.noop_experts, noop_share=1.0 - config.mod.capacity)

    @classmethod
    def validate_config(cls, config: ModelConfig) -> None:
        routed_block_indices(config)
        require(isinstance(config.mod.capacity, (int, float)) and 0.0 < config.mod.capacity <= 1.0, "model.mod.capacity",
                f"must be in (0, 1] (1 - capacity is the no-op experts' budget), got {config.mod.capacity!r}")
        require(isinstance(config.mod.noop_experts, int) and config.mod.noop_experts >= 1, "model.mod.noop_experts",
                f"must be an integer >= 1 for mode_integrated (the no-op experts are how tokens skip), "
                f"got {config.mod.noop_experts!r}")
        validate_moe_config(config.moe, noop_experts=config.mod.noop_experts)
        layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")
