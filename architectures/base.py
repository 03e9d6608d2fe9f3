"""Shared pieces of every architecture: embeddings, head, weight init, generation.

``LanguageModel`` owns token + learned position embeddings, the final LayerNorm and the tied
LM head. A variant subclasses it and implements ``forward`` (returning ``ModelOutput``) and
``flops_per_token``. ``generate`` works for every variant whose ``forward`` honours a ``KVCache``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.config import ConfigError, ModelConfig
from architectures.contract import KVCache, ModelOutput, RoutingSite
from architectures.flops import Flops


class LanguageModel(nn.Module):
    """Decoder-only LM skeleton: ``wte`` + ``wpe`` -> (variant body) -> ``ln_f`` -> tied ``lm_head``."""

    #: set False in a variant whose forward cannot yet decode incrementally with a KVCache
    supports_kv_cache: bool = True
    #: True when a training step may leave some parameters without gradient (an expert or module
    #: that no token chose); DDP then needs find_unused_parameters. Dense models set False.
    may_skip_parameters: bool = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

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
            elif isinstance(module, nn.Linear):
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

    # ------------------------------------------------------------------ contract
    def forward(  # pragma: no cover - abstract
        self,
        idx: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        return_residuals: bool = False,
        cache: Optional[KVCache] = None,
    ) -> ModelOutput:
        raise NotImplementedError

    def flops_per_token(self, trace: Optional[List[RoutingSite]] = None, seq_len: Optional[int] = None) -> Flops:
        raise NotImplementedError  # pragma: no cover - abstract

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
