"""Variant registry: ``variant name -> (model class, config overrides, description)``.

Adding a variant = one architecture file + one entry in ``VARIANTS`` below. Entries name their
class as "module:Class" and are imported lazily, so ``--help`` and config validation stay fast.
``overrides`` are applied to the variant's config group before user overrides (presets such as
``mom_e`` are the generic ``mom`` class with different defaults).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Dict

from architectures.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Variant:
    target: str  # "module:Class"
    description: str
    overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # {"group": {"field": value}}

    def model_class(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)

    def validate(self, config: ModelConfig) -> None:
        self.model_class().validate_config(config)


VARIANTS: Dict[str, Variant] = {
    "vanilla": Variant("architectures.gpt2:GPT2", "dense GPT-2 (the reference for every ratio)"),
}


def variant_names():
    return sorted(VARIANTS)


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ConfigError(f"model.variant: unknown variant {name!r}; valid variants: {', '.join(variant_names())}")
    return VARIANTS[name]


def apply_preset(config: ModelConfig) -> ModelConfig:
    """Return ``config`` with the variant's preset overrides applied to fields still at their defaults."""
    variant = get_variant(config.variant)
    if not variant.overrides:
        return config
    config = dataclasses.replace(config)
    for group_name, values in variant.overrides.items():
        group = getattr(config, group_name)
        defaults = type(group)()
        changes = {k: v for k, v in values.items() if getattr(group, k) == getattr(defaults, k)}
        setattr(config, group_name, dataclasses.replace(group, **changes))
    return config


def build_model(config: ModelConfig):
    """Resolve sizes, apply the variant preset, validate, and instantiate the model."""
    config = apply_preset(config).resolve()
    return get_variant(config.variant).model_class()(config)
