"""Early exit (``early_exit``): LayerSkip training, CALM confidence exit at evaluation and generation.

Training (Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding",
code facebookresearch/LayerSkip):

* **Layer dropout rising with depth, per sample.** Each sequence of the batch skips layer l with
  probability p_l = p_max * D(l), D(l) = exp(l ln 2 / (L - 1)) - 1 (``dropout_schedule exponential``, the
  paper's) or l / (L - 1) (``linear``): 0 at the first layer, p_max at the last. A skipped layer is skipped
  for real: the layer runs on the gathered rows that keep it (the others pass it unchanged, no rescaling, as
  in the paper) and the FLOPs count only those rows.
* **Early-exit loss through the shared head** (``ln_f`` + the tied ``lm_head``) after every layer l < L - 1,
  returned as the named aux losses ``early_exit/layer<l>``. The paper's loss is sum_l e~_l CE_l with
  e_l = e_scale * sum_{i<=l} i (l < L - 1), e_{L-1} = L - 1 + e_scale * sum_{i<=L-2} i, normalised to sum 1;
  the LM loss here already is CE_{L-1} at weight 1, so the aux weight of layer l is e_l / e_{L-1} (the
  paper's loss divided by e~_{L-1}: the same optimum, the learning rate scaled). ``exit_weights official``
  is the official code's scale instead (``LossScaleType.SUM_L``: s_l = e_scale * sum_{i<=l} (i + 1) below the
  last layer, s_{L-1} = L (L + 1) / 2, so layer 0 has a loss too); ``uniform`` gives every layer ``exit_scale``. The paper's time curricula (rotational / gradual) are not implemented.
  **Targets**: the model sees its input ``idx`` (``ForwardState.tokens``); the next-token targets of
  positions 0 .. T-2 are idx[:, 1:], exactly the LM module's targets there (it trains on batch[:, :-1] ->
  batch[:, 1:]); the last position's target is not in the input and gets no exit loss. With padding,
  a pair counts only when both tokens are real. With a loss mask (``data.loss_mask``: the model gets the
  LM loss's weights over its divisor, ``loss_weights``) each exit loss is sum over positions 0 .. T-2 of
  w * CE: the LM loss's weighting without the last target (not in the input), so a target of weight 0
  trains no exit. (XSUM's module masks with ignored targets instead and passes no weights.)

Evaluation and generation (Schuster et al. 2022, "Confident Adaptive Language Modeling"):

* After each layer l < L - 1 every still-running token is checked with the shared head (fp32, autocast
  off): confidence = the softmax max-probability (``confidence softmax``) or the top-1 minus top-2
  probability (``margin``), or, without the head, CALM's hidden-state saturation (``state``: the cosine of
  the token's stream after and before layer l). A token whose confidence reaches ``exit_threshold`` exits:
  its depth is l + 1, it runs no further attention query, FFN or check (gathered, not masked).
* **State propagation** (CALM): an exited token's hidden state is copied to the later layers, where only its
  K and V are computed from the copied state (``ln_1`` then the K/V columns of ``c_attn``), so later tokens
  attend to it at every layer. A token's exit depends only on its own past (causal), so a cached decode
  step (which writes the same K/V) equals the full forward.
* The head reads the exited token's copied state: its logits are those of its exit layer.

Trace: one site per layer, ``layer<l>.exit`` (group ``early_exit``, step l), kind ``token_choice`` with the
choices ``run`` / ``skip`` (skip: exited earlier, or the row dropped the layer in training); ``extras``:
``ran`` (tokens that ran the full layer), ``kv_only`` (exited tokens whose K/V were computed), ``checks``
(tokens the head read after the layer: confidence checks, or the exit-loss head in training), as (B, T)
0/1 masks; the last site also carries ``depth`` (B, T) (layers each token ran) and ``max_depth`` (L).
No site has logits or probabilities: the rule is a threshold on the shared head, not a learned router.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel, require
from architectures.config import ModelConfig
from architectures.contract import RoutingSite
from architectures.gpt2 import Block, causal_attention
from architectures.routing import Choice, SiteId, fp32_linear, report_site

SCHEDULES = ("exponential", "linear")
EXIT_WEIGHTS = ("paper", "official", "uniform")
HEAD_CONFIDENCES = ("softmax", "margin")  # read the shared head: each check costs a head
CONFIDENCES = HEAD_CONFIDENCES + ("state",)


@dataclass
class EarlyExitConfig:
    """LayerSkip training (layer dropout + early-exit loss) and CALM confidence exit at evaluation."""

    p_max: float = 0.1  # layer-dropout rate of the last layer (0: no layer dropout)
    dropout_schedule: str = "exponential"  # "exponential" (the paper's) or "linear" rise with depth
    # "paper": e_l / e_{L-1} with e_scale; "official": the official code's sum_l scale; "uniform": exit_scale each
    exit_weights: str = "paper"
    exit_scale: float = 1.0  # the paper's e_scale (0: no early-exit loss)
    exit_threshold: float = 0.9  # evaluation: exit once the confidence reaches it
    # "softmax" max-probability or top-1 minus top-2 "margin" of the shared head (a head per check), or CALM's
    # hidden-state saturation "state": cosine of the stream after and before the layer (no matmul)
    confidence: str = "softmax"
    eval_exit: bool = True  # False: evaluation and generation run every layer (the last-layer model)


def dropout_rates(cfg: EarlyExitConfig, n_layer: int) -> List[float]:
    """p_l per layer: 0 at the first, ``p_max`` at the last (LayerSkip's D(l))."""
    last = n_layer - 1
    if cfg.dropout_schedule == "linear":
        return [cfg.p_max * l / last for l in range(n_layer)]
    return [cfg.p_max * (math.exp(l * math.log(2) / last) - 1.0) for l in range(n_layer)]


def exit_loss_weights(cfg: EarlyExitConfig, n_layer: int) -> List[float]:
    """Aux weight of the exit loss after each layer l < L - 1 (the LM loss is layer L - 1 at weight 1)."""
    if cfg.exit_weights == "uniform":
        return [cfg.exit_scale] * (n_layer - 1)
    if cfg.exit_weights == "official":  # LayerSkip's code (LossScaleType.SUM_L): cumsum(l + 1), e_scale below L-1
        return [cfg.exit_scale * (l + 1) * (l + 2) / (n_layer * (n_layer + 1)) for l in range(n_layer - 1)]
    e = [cfg.exit_scale * l * (l + 1) / 2 for l in range(n_layer - 1)]  # e_scale * sum_{i<=l} i
    e_last = (n_layer - 1) + cfg.exit_scale * (n_layer - 2) * (n_layer - 1) / 2
    return [value / e_last for value in e]


def confidence(logits: torch.Tensor, rule: str) -> torch.Tensor:
    """CALM's softmax-based confidence of fp32 logits (N, V) -> (N,)."""
    probs = logits.softmax(dim=-1)
    if rule == "margin":
        top = probs.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]
    return probs.max(dim=-1).values


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Attention of gathered queries q (N, H, hd), sorted by token ``rows``, with key ``positions`` (N,), over
    each row's keys k, v (B, H, Tk, hd), causally: one SDPA per row on its own queries (a row without any
    computes nothing)."""
    counts = torch.bincount(rows, minlength=k.shape[0]).tolist()
    keys = torch.arange(k.shape[2], device=q.device)
    pieces = []
    for b, (q_b, p_b) in enumerate(zip(q.split(counts), positions.split(counts))):
        if counts[b]:
            mask = keys[None, :] <= p_b[:, None]
            y = F.scaled_dot_product_attention(q_b.transpose(0, 1)[None], k[b:b + 1], v[b:b + 1], attn_mask=mask)
            pieces.append(y[0].transpose(0, 1))
    return torch.cat(pieces, dim=0) if pieces else q


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, B: int,
                     T: int) -> torch.Tensor:
    """``row_attention``'s values as one graph (torch.compile): the queries scattered back on the (B, T) grid
    (zeros for exited tokens), one causal SDPA, the running tokens' outputs gathered. It computes the scores
    of every query, so compiled evaluation runs more than the eager figure counts."""
    H, hd = q.shape[1], q.shape[2]
    grid = q.new_zeros(B * T, H, hd).index_copy(0, flat, q).view(B, T, H, hd).transpose(1, 2)
    y = causal_attention(grid, k, v).transpose(1, 2).reshape(B * T, H, hd)
    return y.index_select(0, flat)


class EarlyExit(LanguageModel):
    """GPT-2 trained LayerSkip-style that exits per token at the first confident layer (CALM) when evaluating."""

    config_groups = {"early_exit": EarlyExitConfig}
    may_skip_parameters = False  # every layer runs (on zero rows when all rows drop it): zero gradients, not None

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        cfg = config.early_exit
        self.drop_rates = dropout_rates(cfg, config.n_layer)
        self.exit_weights = exit_loss_weights(cfg, config.n_layer)

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        cfg = config.early_exit
        require(config.n_layer >= 2, "model.n_layer", f"early exit needs at least 2 layers, got {config.n_layer}")
        require(0.0 <= cfg.p_max < 1.0, "model.early_exit.p_max", f"must be in [0, 1), got {cfg.p_max}")
        require(cfg.dropout_schedule in SCHEDULES, "model.early_exit.dropout_schedule",
                f"must be one of {', '.join(SCHEDULES)}, got {cfg.dropout_schedule!r}")
        require(cfg.exit_weights in EXIT_WEIGHTS, "model.early_exit.exit_weights",
                f"must be one of {', '.join(EXIT_WEIGHTS)}, got {cfg.exit_weights!r}")
        require(cfg.exit_scale >= 0.0, "model.early_exit.exit_scale", f"must be >= 0, got {cfg.exit_scale}")
        require(0.0 < cfg.exit_threshold <= 1.0, "model.early_exit.exit_threshold",
                f"must be in (0, 1], got {cfg.exit_threshold}")
        require(cfg.confidence in CONFIDENCES, "model.early_exit.confidence",
                f"must be one of {', '.join(CONFIDENCES)}, got {cfg.confidence!r}")

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """Training forwards (no cache) run LayerSkip; everything else the CALM rule (or every layer)."""
        if self.training and state.cache is None:
            return self._train_body(x, state)
        return self._exit_body(x, state)

    # ------------------------------------------------------------------ training: LayerSkip
    def _train_body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        B, T, _ = x.shape
        rates = torch.tensor(self.drop_rates, device=x.device)
        keep = torch.rand(B, len(self.blocks), device=x.device) >= rates  # per sample, per layer
        losses: Dict[str, torch.Tensor] = {}
        for l, block in enumerate(self.blocks):
            rows = keep[:, l].nonzero().squeeze(1)
            after_attn, x = state.run(lambda s, x, rows, block=block: self._run_rows(block, x, rows), x, rows)
            state.record("mha", l, after_attn)
            state.record("ffn", l, x)
            checks = torch.zeros(B, T, dtype=torch.bool, device=x.device)
            if l < len(self.blocks) - 1 and self.exit_weights[l] > 0 and T > 1 and state.tokens is not None:
                losses[f"early_exit/layer{l}"] = self.exit_weights[l] * self._exit_loss(x, state)
                checks[:, :-1] = True  # the exit-loss head reads positions 0 .. T-2
            ran = keep[:, l:l + 1].expand(B, T)
            self._report(state, l, ran, torch.zeros_like(ran), checks)
        self._report_depth(state, keep.sum(dim=1, keepdim=True).expand(B, T).float())
        state.report(None, losses)
        return x

    @staticmethod
    def _run_rows(block: Block, x: torch.Tensor, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``block`` on the rows ``rows`` of x (the others pass unchanged); (stream after attention, after FFN).
        Always gathered, also when every row keeps the layer (no branch on a count: one graph under compile);
        when none does, the block still runs, on zero rows (zero gradients, not None)."""
        sub = x.index_select(0, rows)
        sub = sub + block.attn(block.ln_1(sub))
        after_attn = x.index_copy(0, rows, sub)
        sub = sub + block.mlp(block.ln_2(sub))
        return after_attn, x.index_copy(0, rows, sub)

    def _exit_loss(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """Mean next-token cross-entropy of the shared head after this layer, over the real (token, next
        token) pairs of the input: targets idx[:, 1:], as the LM module's on positions 0 .. T-2."""
        logits = self.head(x[:, :-1]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), state.tokens[:, 1:].reshape(-1), reduction="none")
        if state.loss_weights is not None:  # already divided by the LM loss's total weight
            w = state.loss_weights[:, :-1]
            if state.valid is not None:
                w = w * (state.valid[:, :-1] & state.valid[:, 1:])
            return (ce * w.reshape(-1).to(ce.dtype)).sum()
        if state.valid is None:
            return ce.mean()
        pair = (state.valid[:, :-1] & state.valid[:, 1:]).reshape(-1).to(ce.dtype)
        return (ce * pair).sum() / pair.sum().clamp_min(1.0)

    # ------------------------------------------------------------------ evaluation / generation: CALM
    def _exit_body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        B, T, d = x.shape
        active = torch.ones(B, T, dtype=torch.bool, device=x.device)
        depth = torch.zeros(B, T, device=x.device)
        last = len(self.blocks) - 1
        for l, block in enumerate(self.blocks):
            ran, before = active.clone(), x
            after_attn, x = state.run(lambda s, x, ran, block=block: self._exit_layer(block, x, ran, s), x, ran)
            state.record("mha", l, after_attn)
            state.record("ffn", l, x)
            depth = depth + ran.float()
            checks = torch.zeros_like(ran)
            if l < last and self.config.early_exit.eval_exit:
                flat = ran.reshape(-1).nonzero().squeeze(1)
                if self.config.early_exit.confidence in HEAD_CONFIDENCES:
                    checks = ran
                sure = self._confident(x.reshape(-1, d).index_select(0, flat),
                                       before.reshape(-1, d).index_select(0, flat))
                active = active.reshape(-1).index_put((flat,), ~sure).reshape(B, T)
            self._report(state, l, ran, ~ran, checks)
        self._report_depth(state, depth)
        return x

    def _confident(self, h: torch.Tensor, h_before: torch.Tensor) -> torch.Tensor:
        """The exit decision of gathered states h (N, d) after the layer (``h_before``: before it), in fp32:
        the shared head's confidence, or the cosine of h and h_before (``state``), >= the threshold."""
        cfg = self.config.early_exit
        if cfg.confidence == "state":
            return F.cosine_similarity(h.float(), h_before.float(), dim=-1) >= cfg.exit_threshold
        logits = fp32_linear(F.layer_norm(h.float(), self.ln_f.normalized_shape, self.ln_f.weight.float(),
                                          self.ln_f.bias.float(), self.ln_f.eps), self.lm_head.weight)
        return confidence(logits, cfg.confidence) >= cfg.exit_threshold

    def _exit_layer(self, block: Block, x: torch.Tensor, ran: torch.Tensor,
                    state: ForwardState) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``block`` with the running tokens ``ran`` (B, T) gathered: their Q, K, V, attention and FFN;
        the exited tokens' K and V from their copied state (CALM's propagation). (after attention, after FFN)."""
        B, T, d = x.shape
        attn = block.attn
        flat_x = x.reshape(B * T, d)
        run_idx, done_idx = ran.reshape(-1).nonzero().squeeze(1), (~ran).reshape(-1).nonzero().squeeze(1)
        h = block.ln_1(flat_x)
        qkv = attn.c_attn(h.index_select(0, run_idx))
        kv_done = F.linear(h.index_select(0, done_idx), attn.c_attn.weight[d:],
                           None if attn.c_attn.bias is None else attn.c_attn.bias[d:])
        kv = qkv.new_zeros(B * T, 2 * d).index_copy(0, run_idx, qkv[:, d:]).index_copy(0, done_idx, kv_done)
        k, v = (attn.split_heads(t) for t in kv.view(B, T, 2 * d).chunk(2, dim=-1))
        if state.cache is not None:
            k, v = state.cache.append(block.cache_key, k, v)
        H = attn.n_head
        q = qkv[:, :d].reshape(-1, H, d // H)
        rows = torch.div(run_idx, T, rounding_mode="floor")
        positions = run_idx % T + (k.shape[2] - T)  # key position of each query (the cache's offset first)
        if torch.compiler.is_compiling():
            y = padded_attention(q, k, v, run_idx, B, T).reshape(-1, d)
        else:
            y = row_attention(q, k, v, rows, positions).reshape(-1, d)
        flat_x = flat_x.index_add(0, run_idx, attn.c_proj(y).to(flat_x.dtype))
        after_attn = flat_x.view(B, T, d)
        z = flat_x.index_select(0, run_idx)
        flat_x = flat_x.index_add(0, run_idx, block.mlp(block.ln_2(z)).to(flat_x.dtype))
        return after_attn, flat_x.view(B, T, d)

    # ------------------------------------------------------------------ trace
    def _report(self, state: ForwardState, l: int, ran: torch.Tensor, kv_only: torch.Tensor,
                checks: torch.Tensor) -> None:
        """The layer's site, through the routing library (the one place that builds sites). The extras are
        (B, T) masks, so a trace cut to one token (the probe's per-token compute) still says what it paid."""
        selected = (~ran).long().unsqueeze(-1)  # 0 = run, 1 = skip
        extras = {name: mask.detach().float() for name, mask in
                  (("ran", ran), ("kv_only", kv_only), ("checks", checks))}
        choice = Choice(selected, torch.ones(selected.shape, device=ran.device))
        decision = report_site(state, "token_choice", ["run", "skip"], SiteId(f"layer{l}.exit", "early_exit", l), choice)
        decision.site.extras.update(extras)

    def _report_depth(self, state: ForwardState, depth: torch.Tensor) -> None:
        """The per-token depth convention: on the last depth site, layers run per token and the maximum."""
        site = state.trace[-1]
        site.extras["depth"] = depth
        site.extras["max_depth"] = torch.tensor(float(len(self.blocks)))

    # ------------------------------------------------------------------ FLOPs
    def flop_blocks(self):
        return []  # counted from what ran (extra_flops)

    def extra_flops(self, sites: Dict[str, RoutingSite], T: int) -> cost.Flops:
        """Per token of the traced batch: full layers for the tokens that ran them (projections, scores over
        T keys, FFN), K/V projections for exited tokens, one head per check (the final head is in the base
        figure). Without a trace: the planned training figure (expected layer dropout, every exit-loss head)."""
        cfg = self.config
        d, L, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
        full = cost.dense_block(d, cfg.ffn_hidden, T)
        own = [sites.get(f"layer{l}.exit") for l in range(L)]
        if any(site is None for site in own):
            layers = sum(1.0 - p for p in self.drop_rates)
            heads = sum(1 for w in self.exit_weights if w > 0) * (T - 1) / T
            return full.scale(layers) + cost.lm_head(d, V).scale(heads)
        tokens = own[0].selected.shape[0] * own[0].selected.shape[1]
        ran, kv, checks = (sum(float(site.extras[name].sum()) for site in own) / tokens
                           for name in ("ran", "kv_only", "checks"))
        return full.scale(ran) + cost.Flops(attn_proj=kv * cost.linear(d, 2 * d)) + cost.lm_head(d, V).scale(checks)
