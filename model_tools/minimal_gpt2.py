"""A minimal one-file plain-PyTorch GPT-2, the speed floor for ``experiments.bench`` (``min_gpt2``).

The same architecture as ``architectures.gpt2.GPT2`` (pre-LN, learned positions, tied head, fused
QKV, SDPA causal attention, tanh GELU) with nothing else: no dropout modules, no cache, no
residual stream recording, no output dataclass. If our vanilla is slower than this at the same
config, the difference is framework overhead in our code, not the math.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MinimalBlock(nn.Module):
    def __init__(self, d: int, n_head: int, hidden: int, eps: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.c_fc = nn.Linear(d, hidden)
        self.mlp_proj = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class MinimalGPT2(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d_model: int, n_layer: int, n_head: int, hidden: int,
                 eps: float = 1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList([MinimalBlock(d_model, n_head, hidden, eps) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, eps=eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def minimal_from_config(config) -> MinimalGPT2:
    """The minimal model at a ``ModelConfig``'s shape."""
    return MinimalGPT2(config.vocab_size, config.block_size, config.d_model, config.n_layer, config.n_head,
                       config.ffn_hidden, config.layer_norm_eps)
