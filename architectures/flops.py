"""Analytic, routing-aware FLOPs accounting.

Conventions (so the figures can be checked against ``torch.utils.flop_counter.FlopCounterMode``):

* A matmul (m x k) @ (k x n) costs 2*m*k*n FLOPs. Bias adds, LayerNorm, GELU, softmax and
  gather/scatter are not counted (the counter does not count them either).
* Attention scores count what the math SDPA kernel computes: Q K^T and A V over the FULL
  key set of the (sub)sequence (the counter, like the kernel, ignores the causal mask):
  4 * t_keys * d per query token.
* Training FLOPs = 3 x forward FLOPs (backward = 2 x forward for every matmul).
* Per-token figures are averages over the B*T tokens of the batch the trace came from.

Every model exposes ``flops_per_token(trace=None, seq_len=None) -> Flops``; with no trace it
returns the expected figure for a full-length sequence under the configured capacities.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

from architectures.config import ModelConfig

COMPONENTS = ("attn_proj", "attn_scores", "ffn", "router", "head")


@dataclass
class Flops:
    """Forward FLOPs per token, split by component."""

    attn_proj: float = 0.0
    attn_scores: float = 0.0
    ffn: float = 0.0
    router: float = 0.0
    head: float = 0.0

    @property
    def forward(self) -> float:
        return self.attn_proj + self.attn_scores + self.ffn + self.router + self.head

    @property
    def training(self) -> float:
        return 3.0 * self.forward

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(**{c: getattr(self, c) + getattr(other, c) for c in COMPONENTS})

    def scale(self, factor: float) -> "Flops":
        return Flops(**{c: getattr(self, c) * factor for c in COMPONENTS})

    def as_dict(self) -> Dict[str, float]:
        out = asdict(self)
        out["forward"] = self.forward
        out["training"] = self.training
        return out


def linear(d_in: int, d_out: int) -> float:
    """FLOPs of one token through a d_in -> d_out linear map."""
    return 2.0 * d_in * d_out


def attention_projections(d: int) -> float:
    """QKV (d -> 3d) and output (d -> d) projections of one token."""
    return linear(d, 3 * d) + linear(d, d)


def attention_scores(d: int, keys: float) -> float:
    """QK^T and AV of one query token against ``keys`` keys (all heads together)."""
    return 4.0 * keys * d


def ffn(d: int, hidden: int) -> float:
    return linear(d, hidden) + linear(hidden, d)


def dense_block(d: int, hidden: int, keys: float) -> Flops:
    """One full GPT-2 block for one token attending to ``keys`` keys."""
    return Flops(attn_proj=attention_projections(d), attn_scores=attention_scores(d, keys), ffn=ffn(d, hidden))


def lm_head(d: int, vocab: int) -> Flops:
    return Flops(head=linear(d, vocab))


def vanilla_flops(config: ModelConfig, seq_len: Optional[int] = None) -> Flops:
    """Forward FLOPs per token of the dense model at sequence length ``seq_len`` (default T)."""
    T = seq_len or config.block_size
    block = dense_block(config.d_model, config.ffn_hidden, T)
    return block.scale(config.n_layer) + lm_head(config.d_model, config.vocab_size)
