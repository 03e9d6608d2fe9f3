"""Vanilla GPT-2: pre-LN blocks, learned positions, tied embeddings, SDPA attention.

Also the building blocks (``CausalSelfAttention``, ``MLP``, ``Block``) that the routed variants
reuse, and the loader for Hugging Face ``GPT2LMHeadModel`` weights. Parameter names follow HF
(``c_attn``, ``c_proj``, ``c_fc``, ``ln_1``, ``ln_2``) so the mapping is a transpose of HF's Conv1D.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import flops as cost
from architectures.base import ForwardState, LanguageModel
from architectures.config import ModelConfig
from architectures.contract import KVCache, RoutingSite


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA for queries that are the LAST q.shape[2] positions of the key sequence.

    Without a cache, queries == keys and the plain causal mask applies. With a cache, query i sits
    at key position (t_k - t_q + i) and may see every key up to and including it.
    """
    t_q, t_k = q.shape[2], k.shape[2]
    if t_q == t_k:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if t_q == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

    def merge_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, H, T, D = t.shape
        return t.transpose(1, 2).reshape(B, T, H * D)

    def attend(self, qkv: torch.Tensor, cache: Optional[KVCache] = None, cache_key: str = "") -> torch.Tensor:
        """Causal attention from fused (B, T, 3d) projections; returns (B, T, d) before c_proj."""
        q, k, v = (self.split_heads(t) for t in qkv.chunk(3, dim=-1))
        if cache is not None:
            k, v = cache.append(cache_key, k, v)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.merge_heads(y)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, cache_key: str = "") -> torch.Tensor:
        return self.resid_drop(self.c_proj(self.attend(self.c_attn(x), cache, cache_key)))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(d_model, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation ("gelu_new"); HF equivalence depends on it.
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(ln_1 x), then + mlp(ln_2 x).

    ``index`` is the layer number its residual snapshots carry; ``cache_key`` names its KV-cache entry
    (default ``block{index}``).
    """

    def __init__(self, config: ModelConfig, index: int = 0, cache_key: Optional[str] = None,
                 ffn_hidden: Optional[int] = None):
        super().__init__()
        d = config.d_model
        self.index = index
        self.cache_key = cache_key or f"block{index}"
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(d, config.n_head, config.bias, config.dropout)
        self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.mlp = MLP(d, ffn_hidden or config.ffn_hidden, config.bias, config.dropout)
        self.d_model, self.ffn_hidden = d, ffn_hidden or config.ffn_hidden

    def forward(self, x: torch.Tensor, state: Optional[ForwardState] = None) -> torch.Tensor:
        state = state or ForwardState.standalone()
        x = x + self.attn(self.ln_1(x), state.cache, self.cache_key)
        state.record("mha", self.index, x)
        x = x + self.mlp(self.ln_2(x))
        state.record("ffn", self.index, x)
        return x

    def flops(self, sites: Dict[str, RoutingSite], T: int, queries: Optional[int] = None) -> cost.Flops:
        return cost.dense_block(self.d_model, self.ffn_hidden, T)


class GPT2(LanguageModel):
    """Dense GPT-2, the reference for every ratio (FLOPs, step time, loss)."""

    may_skip_parameters = False

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])


# ---------------------------------------------------------------------------- Hugging Face weights
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def state_dict_from_hf(hf_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Map a ``GPT2LMHeadModel`` state dict to this suite's GPT2 names (Conv1D weights transposed)."""
    out: Dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # causal-mask buffers of older HF versions
        name = key.removeprefix("transformer.")
        if name.startswith("h."):
            name = "blocks." + name[2:]
            if name.endswith(_HF_CONV1D):
                value = value.t()
        out[name] = value.contiguous()
    out.setdefault("lm_head.weight", out["wte.weight"])
    return out


def config_from_hf(hf_config, **overrides) -> ModelConfig:
    """A ModelConfig matching a ``transformers.GPT2Config``."""
    inner = hf_config.n_inner or 4 * hf_config.n_embd
    return ModelConfig(
        variant=overrides.pop("variant", "vanilla"),
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.n_embd,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        block_size=hf_config.n_positions,
        ffn_ratio=inner / hf_config.n_embd,
        layer_norm_eps=hf_config.layer_norm_epsilon,
        dropout=0.0,
        **overrides,
    )
