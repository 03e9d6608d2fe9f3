"""Shared pieces of every architecture: the one forward, embeddings, head, weight init, generation.

``LanguageModel`` owns token + learned position embeddings, the final LayerNorm, the tied LM head
and THE forward pass (defined once, here): embed at the cache offset, run ``body``, advance the
cache, apply the head, return ``ModelOutput``. A ``ForwardState`` travels through the blocks and
collects what they report (routing sites, aux losses, residual snapshots). A variant implements only
what differs: its blocks (each ``block(x, state) -> x`` and ``block.flops(sites, T, queries) -> Flops``), or
``body`` when the layout itself is routed (MoM, depth gating). ``flops_per_token`` is composed from
the blocks' figures with one sequence-length rule (``resolve_seq_len``). The declared contract for
callers (causal routing, vanilla-weight mapping, generation readiness) is on this class too.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.config import ConfigError, ModelConfig
from architectures.contract import KVCache, ModelOutput, RoutingSite, SubLayerState, sum_aux
from architectures.experts import StackedLinear
from architectures import flops as cost
from architectures.flops import Flops


@dataclass
class ForwardState:
    """What one forward pass carries through the blocks, and what the blocks report back.

    * ``cache``: the ``KVCache`` when decoding (``None`` otherwise); ``offset`` = positions before this call.
    * ``valid``: (B, T) bool, real (non-padding) tokens of this call, or None (all real).
    * ``causal``: route causally (generation, ``causal_routing()``, or any cached call).
    * ``residuals``: the snapshot list when ``return_residuals`` (embed, then mha/ffn per sub-update).
    * ``trace`` / ``aux``: routing sites and named aux losses, in the order the blocks ran.
    * ``hidden``: set by a body whose head does not read the last stream (depth gating's mix).
    * ``options``: variant-specific switches a model hands its blocks (e.g. MoD's test hook).
    * ``tokens``: the input ids of this call (B, T): their shift idx[:, 1:] is the LM targets of positions
      0 .. T-2, for a loss the model computes itself (early exit's per-layer exit losses).
    * ``loss_weights``: (B, T) weights of the next-token targets of positions 0 .. T-1 (a loss mask), scaled
      by the caller so that a loss the model computes itself is sum(w * ce) over its positions; None: no mask.
    * ``checkpoint``: the activation-checkpointing policy of this call (None: off); ``units`` counts the
      units run so far (``architectures.checkpointing``).
    """

    cache: Optional[KVCache]
    valid: Optional[torch.Tensor]
    causal: bool
    residuals: Optional[List[SubLayerState]]
    offset: int = 0
    trace: List[RoutingSite] = field(default_factory=list)
    aux: Dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: Optional[torch.Tensor] = None
    options: Dict[str, Any] = field(default_factory=dict)
    checkpoint: Optional[Any] = None
    units: int = 0
    reported: Set[str] = field(default_factory=set)  # site names reported so far (each at most once)
    tokens: Optional[torch.Tensor] = None
    loss_weights: Optional[torch.Tensor] = None

    @classmethod
    def standalone(cls) -> "ForwardState":
        """For a block called on its own (tests, references): no cache, no padding, nothing recorded."""
        return cls(cache=None, valid=None, causal=False, residuals=None)

    def record(self, tag: str, layer: int, x: torch.Tensor) -> None:
        """Snapshot the residual stream after a sub-update (no-op unless residuals were asked for)."""
        if self.residuals is not None:
            self.residuals.append(SubLayerState(tag, layer, x))

    def run(self, fn, *args):
        """``fn(state, *args)`` as one checkpointing unit: recomputed in backward when the policy says so."""
        if self.checkpoint is None:
            return fn(self, *args)
        unit, self.units = self.units, self.units + 1
        if not self.checkpoint.applies(unit):
            return fn(self, *args)
        from architectures.checkpointing import run_checkpointed

        return run_checkpointed(fn, self, args)

    def block(self, block, x: torch.Tensor) -> torch.Tensor:
        """``block(x, state)`` as one checkpointing unit."""
        return self.run(lambda state, x: block(x, state), x)

    def report(self, site: Optional[RoutingSite], aux: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Append ``site`` to the trace and ``aux`` to the losses. A second site of the same name in one
        forward raises: each routing decision reports exactly once (the ``Router`` modules report for
        their blocks, ``architectures.routing``)."""
        if site is not None:
            if site.name in self.reported:
                raise ValueError(f"routing site {site.name!r} reported twice in one forward: each routing decision "
                                 "reports exactly one site, under a name unique in the model")
            self.reported.add(site.name)
            self.trace.append(site)
        if aux:
            self.aux.update(aux)


def resolve_seq_len(trace: Optional[List[RoutingSite]], seq_len: Optional[int], default: int) -> int:
    """Keys per query for attention FLOPs, decided in one place: an explicit ``seq_len``, else the
    trace (a cached decode step stamps its full key length as ``extras["key_len"]``; otherwise the
    traced batch's T), else ``default`` (the block size)."""
    if seq_len:
        return int(seq_len)
    for site in trace or []:
        if "key_len" in site.extras:
            return int(site.extras["key_len"])
    if trace:
        return int(trace[0].selected.shape[1])
    return default


class LanguageModel(nn.Module):
    """Decoder-only LM skeleton: ``wte`` + ``wpe`` -> (variant body) -> ``ln_f`` -> tied ``lm_head``."""

    #: set False in a variant whose forward cannot yet decode incrementally with a KVCache
    supports_kv_cache: bool = True
    #: True when a training step may leave some parameters without gradient (an expert or module
    #: that no token chose); DDP then needs find_unused_parameters. Dense models set False.
    may_skip_parameters: bool = True
    #: True when the default (training / eval) routing is not causal: a token's routing may depend on
    #: later tokens (MoD's sequence top-k). Causal evaluation then needs ``causal_routing()``.
    routing_sees_future: bool = False
    #: {group name: dataclass} of the config groups this model reads (``model.<group>.<field>``); registering a
    #: variant of this class adds them to ``ModelConfig`` (CLI options, config.yaml, validation). Options set
    #: in any other group would be silently ignored, so the command lines refuse them
    #: (``registry.check_options_used``).
    config_groups: ClassVar[Dict[str, type]] = {}
    #: activation checkpointing (``architectures.checkpointing.set_activation_checkpointing``); None: off
    checkpoint_policy: Optional[Any] = None
    #: ``group.field`` options of a read group that this class overrides (refused the same way)
    config_fields_ignored: ClassVar[Tuple[str, ...]] = ()

    @property
    def has_causal_routing(self) -> bool:
        """False when no causal routing decision was trained (MoD with ``mod.sampling none``): then
        ``prepare_generation`` refuses, and causal evaluation is not computed (it would measure an
        untrained rule)."""
        return True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        # an instance attribute from the start: torch.compile guards on it, and one that appeared only after
        # the first ``causal_routing()`` would recompile the evaluation graph once more (~40 s for MoT on CPU)
        self._causal = False

    # ------------------------------------------------------------------ config hooks
    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        """Variant-specific checks; raise ConfigError naming the field."""

    # ------------------------------------------------------------------ building blocks
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L).

        Recurrent router cells (MoM's ``GRUCell``) get the same N(0, 0.02) weights and zero biases, as
        the official code initialises its routers (PyTorch's default uniform init made fresh tiny routers
        send every token to SKIP).
        """
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.RNNCellBase):
                for pname, param in module.named_parameters(recurse=False):
                    if pname.startswith("bias"):
                        nn.init.zeros_(param)
                    else:
                        nn.init.normal_(param, mean=0.0, std=std)
            elif isinstance(module, (nn.Linear, StackedLinear)):  # stacked experts: each expert as a Linear
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))

    def embed(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = idx.shape[1]
        if offset + T > self.config.block_size:
            raise ValueError(
                f"sequence of {offset + T} positions exceeds the position table (model.block_size="
                f"{self.config.block_size})"
            )
        pos = torch.arange(offset, offset + T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights counted once
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    # ------------------------------------------------------------------ the one forward
    def forward(
        self,
        idx: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        return_residuals: bool = False,
        cache: Optional[KVCache] = None,
        compute_logits: bool = True,
        loss_weights: Optional[torch.Tensor] = None,
    ) -> ModelOutput:
        """Right padding only: causal attention keeps real tokens from seeing pads; ``attention_mask``
        (its last T columns, so a mask covering the cached prefix works too) tells routers which tokens
        are real. ``compute_logits=False`` skips the head: ``logits`` is None and ``hidden`` is the
        stream the head would read, before ``ln_f``. ``loss_weights`` (B, T): the loss mask's weights of
        the targets of positions 0 .. T-1 divided by the LM loss's divisor (``data.loss_mask``; the LM
        module passes them), so a loss the model computes itself over the targets (early exit's) weighs them
        as the LM loss does and a target of weight 0 cannot train it."""
        T = idx.shape[1]
        offset = cache.offset if cache is not None else 0
        x = self.embed(idx, offset)
        valid = attention_mask[:, -T:].to(torch.bool) if attention_mask is not None else None
        state = ForwardState(cache=cache, valid=valid, causal=self._causal or cache is not None,
                             residuals=[] if return_residuals else None, offset=offset,
                             checkpoint=self.checkpoint_policy if cache is None and torch.is_grad_enabled() else None,
                             tokens=idx, loss_weights=loss_weights)
        state.record("embed", -1, x)
        x = self.body(x, state)
        if cache is not None:
            cache.offset += T
            for site in state.trace:  # a decode step's queries see every cached key
                site.extras.setdefault("key_len", torch.tensor(offset + T))
        hidden = state.hidden if state.hidden is not None else x
        return ModelOutput(
            logits=self.head(hidden) if compute_logits else None, aux_loss=sum_aux(state.aux, x),
            trace=state.trace, residuals=state.residuals, aux_losses=state.aux, cache=cache,
            hidden=hidden if (state.hidden is not None or not compute_logits) else None,
        )

    def body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """The variant's layers: by default every block of ``self.blocks`` in order, ``block(x, state)``."""
        for block in self.blocks:
            x = state.block(block, x)
        return x

    # ------------------------------------------------------------------ FLOPs, composed from the blocks
    def flops_per_token(self, trace: Optional[List[RoutingSite]] = None, seq_len: Optional[int] = None,
                        queries: Optional[int] = None) -> Flops:
        """Forward FLOPs per token of the traced batch (or expected, without a trace): the head plus
        every block's ``flops(sites, T, queries)`` plus ``extra_flops``. T (keys per query) comes from
        ``resolve_seq_len``; ``queries`` = new positions of the call (a cached decode step: 1), by default
        the trace's T, else a full forward (T)."""
        cfg = self.config
        T = resolve_seq_len(trace, seq_len, cfg.block_size)
        if queries is None:
            queries = int(trace[0].selected.shape[1]) if trace else T
        sites = {site.name: site for site in trace or []}
        total = cost.lm_head(cfg.d_model, cfg.vocab_size) + self.extra_flops(sites, T)
        for block in self.flop_blocks():
            total = total + block.flops(sites, T, queries)
        return total

    def flop_blocks(self) -> Iterable[nn.Module]:
        return self.blocks

    def extra_flops(self, sites: Dict[str, RoutingSite], T: int) -> Flops:
        """FLOPs outside the blocks (e.g. depth gating's gate); none by default."""
        return Flops()

    # ------------------------------------------------------------------ declared contract
    _causal: bool = False

    @contextlib.contextmanager
    def causal_routing(self) -> Iterator[None]:
        """Inside, every routing decision is causal, as in generation (MoD uses its causal predictor).
        A no-op for variants whose routing is causal anyway (``routing_sees_future`` False)."""
        previous, self._causal = self._causal, True
        try:
            yield
        finally:
            self._causal = previous

    #: (regex over this model's parameter names, source template) pairs for sparse upcycling from a
    #: vanilla checkpoint, e.g. (r"(blocks\.\d+)\.moe\.experts\.(.*)", r"\1.mlp.\2") (stacked experts:
    #: the dense tensor is broadcast over E)
    upcycle_rules: tuple = ()
    #: True when ``vanilla_state_mapping`` lays a whole vanilla model onto this one's modules (the MoM paper's
    #: phase 2): ``experiments.two_phase`` accepts only these variants.
    two_phase_from_vanilla: bool = False

    def vanilla_state_mapping(self, vanilla_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A vanilla GPT-2 state dict (this suite's names) mapped to this variant's parameter names.

        Default: identical names (every variant whose blocks keep GPT-2's names: tensors that do not
        exist here, or whose shapes differ, are left to the caller to report), plus sparse upcycling
        (Komatsuzaki et al. 2023) by ``upcycle_rules``: every expert copy of a dense sub-layer starts as
        that sub-layer; a stacked target (E experts in one (E, ...) tensor) gets the dense tensor broadcast
        over its first dimension. MoM overrides it with the paper's layer -> module mapping.
        """
        own = self.state_dict()
        mapping = {name: value for name, value in vanilla_state.items() if name in own}
        for name, tensor in own.items():
            for pattern, source in self.upcycle_rules:
                match = re.fullmatch(pattern, name)
                value = vanilla_state.get(match.expand(source)) if match else None
                if value is not None and value.shape == tensor.shape[1:] and tensor.dim() == value.dim() + 1:
                    value = value.expand_as(tensor)  # stacked experts: every expert a view of the dense tensor
                if value is not None and value.shape == tensor.shape:
                    mapping[name] = value
        return mapping

    @torch.no_grad()
    def start_as_dense(self) -> List[str]:
        """After a vanilla state was loaded through ``vanilla_state_mapping``: adjust what a mapping cannot
        express (fresh routers, expert output scales, new branches) so that the model computes the dense
        checkpoint's function at step 0 wherever its routing allows it (docs/bad-input.md, "Upcycling").

        Every sub-module with a ``start_as_dense()`` method (an MoE block, a combination block) does its
        part and says what it changed; the lines are returned for the ``--init_from`` report.
        """
        notes = []
        for name, module in self.named_modules():
            hook = getattr(module, "start_as_dense", None)
            if module is not self and callable(hook):
                note = hook()
                if note:
                    notes.append(f"{name}: {note}")
        return notes

    # ------------------------------------------------------------------ generation
    def prepare_generation(self) -> None:
        """Hook: raise if this model cannot sample causally (e.g. MoD without a predictor)."""

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        greedy: bool = False,
        eos_token_id: Optional[int] = None,
        use_cache: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of the prompts ``idx`` (B, T0), equal lengths.

        With ``use_cache`` the prompt is encoded once and each new token costs one position.
        Rows that emitted ``eos_token_id`` keep emitting it.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if idx.shape[1] + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds model.block_size="
                f"{self.config.block_size}"
            )
        self.prepare_generation()
        with self.causal_routing():
            return self._generate(idx, max_new_tokens, temperature, top_k, greedy, eos_token_id, use_cache, generator)

    def _generate(self, idx, max_new_tokens, temperature, top_k, greedy, eos_token_id, use_cache, generator):
        was_training = self.training
        self.eval()
        cache = KVCache() if (use_cache and self.supports_kv_cache) else None
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        out = idx
        step_input = idx
        for _ in range(max_new_tokens):
            if cache is not None:
                result = self(step_input, cache=cache)
                cache = result.cache
            else:
                result = self(out)
            logits = result.logits[:, -1, :].float()
            next_token = self._pick(logits, temperature, top_k, greedy, generator)
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            out = torch.cat([out, next_token[:, None]], dim=1)
            step_input = next_token[:, None]
            if eos_token_id is not None and bool(finished.all()):
                break
        self.train(was_training)
        return out

    @staticmethod
    def _pick(logits, temperature, top_k, greedy, generator) -> torch.Tensor:
        if greedy or temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def require(condition: bool, field: str, message: str) -> None:
    """Raise ConfigError naming ``field`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{field}: {message}")
