"""The ``moe`` variant: GPT-2 whose FFN is a token-choice Mixture-of-Experts layer at ``model.moe.layers``.

The layer, its config (``model.moe``) and its block live in the library module ``architectures.moe_layer``
(MoDE and ``cea_moe`` use them too); this file is the variant's model class only.
"""
from __future__ import annotations

import torch.nn as nn

from architectures.base import LanguageModel
from architectures.config import ModelConfig, layer_selection
from architectures.gpt2 import Block
from architectures.moe_layer import UPCYCLE_RULES, MoEBlock, MoEConfig, expert_hidden, validate_moe_config


class MoEGPT(LanguageModel):
    """GPT-2 whose FFN is a token-choice MoE at the layers ``model.moe.layers`` (others dense).

    Trace: one ``token_choice`` site per MoE layer, ``layer{i}.moe``, all in group "moe" with
    ``step`` = rank among MoE layers, so the routing callback can chain expert(l) -> expert(l+1).
    """

    config_groups = {"moe": MoEConfig}
    upcycle_rules = UPCYCLE_RULES

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.moe_layers = layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")
        hidden = expert_hidden(config)
        self.blocks = nn.ModuleList([
            MoEBlock(config, hidden, i, f"layer{i}.moe", "moe", self.moe_layers.index(i)) if i in self.moe_layers
            else Block(config, i) for i in range(config.n_layer)
        ])

    @staticmethod
    def validate_config(config: ModelConfig) -> None:
        validate_moe_config(config.moe)
        layer_selection(config.moe.layers, config.n_layer, "model.moe.layers")
