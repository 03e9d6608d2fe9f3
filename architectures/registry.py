"""Variant registry: ``variant name -> (model class, preset, description, test settings)``.

Adding a variant = one architecture file + one entry in ``_BUILT_IN`` below, which ``register`` installs
(docs/adding-a-variant.md; a variant defined elsewhere calls ``register`` itself).
The architecture file holds the model class and, when the variant has options, their dataclass; the
class names its groups (``config_groups = {"mom": MoMConfig}``). Registering collects everything else
from the entry:

* config groups: each group is recorded as ``model.<group>`` (``config.register_group``), hence the CLI
  options ``--model.<group>.<field>``; a config of the variant holds exactly its class's groups
  (``ModelConfig.groups``, what ``config.yaml`` and checkpoint hparams hold);
* presets: ``overrides`` fill the group fields the user did not give when the config is built (``mom_e`` is
  the ``mom`` class with other defaults), checked against the group's fields when registered;
* validation: ``ModelConfig.validate`` ends with the variant name and the class's ``validate_config``;
* tests: ``test_settings`` make the tiny case every registry-driven test runs.

This module imports ``config`` (never the reverse: the variant check reaches ``ModelConfig`` through
``config.set_variant_validator``) and the family modules named by the entries.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple, Union

from architectures.config import (
    ConfigError, ModelConfig, config_groups, register_group, set_variant_options, set_variant_validator,
    unregister_group,
)


#: Tags an entry may carry: the experiments that include the variant by default.
TAGS = {
    "device_check": "experiments/device_check.py: the GPU check's benchmark (eager and compiled step times, MFU)",
    "probe": "experiments/repro/probe.py: the routing-probe experiment's variants (one per routing decision)",
}

#: The tiny shape every variant is tested at (tests/test_contract.py): d_model 32, 4 layers, T 32.
TINY_TEST_SETTINGS: Dict[str, Any] = dict(vocab_size=97, d_model=32, n_layer=4, n_head=2, block_size=32)


@dataclass(frozen=True)
class Variant:
    target: Union[str, type]  # the model class, or "module:Class"
    description: str
    overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # {"group": {"field": value}}
    # ModelConfig overrides for the invariant suite, on top of TINY_TEST_SETTINGS ({"group": {...}} for groups)
    test_settings: Dict[str, Any] = field(default_factory=dict)
    # which experiments include the variant by default (see TAGS)
    tags: Tuple[str, ...] = ()

    def test_config(self, name: str, **extra: Any) -> ModelConfig:
        """A tiny ``ModelConfig`` of this variant: TINY_TEST_SETTINGS, then ``test_settings``, then ``extra``
        (group dicts merged field by field)."""
        merged: Dict[str, Any] = dict(TINY_TEST_SETTINGS)
        for source in (self.test_settings, extra):
            for key, value in source.items():
                merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        return ModelConfig.from_dict({"variant": name, **merged})

    def model_class(self):
        if isinstance(self.target, type):
            return self.target
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)

    def validate(self, config: ModelConfig) -> None:
        self.model_class().validate_config(config)


VARIANTS: Dict[str, Variant] = {}


def register(name: str, variant: Variant) -> Variant:
    """Add ``variant`` under ``name``: its class's config groups are recorded (``register_group``), its preset
    checked against them. Raises ConfigError when the name is taken or the preset names an unknown group or field."""
    if name in VARIANTS:
        raise ConfigError(f"model.variant: {name!r} is already registered ({VARIANTS[name].description}); "
                          "choose another name")
    unknown_tags = sorted(set(variant.tags) - set(TAGS))
    if unknown_tags:
        raise ConfigError(f"variant {name}: unknown tag {unknown_tags[0]!r}; tags: {', '.join(TAGS)}")
    groups = variant.model_class().config_groups
    for group, values in {**variant.overrides, **_group_settings(variant.test_settings)}.items():
        if group not in groups:
            raise ConfigError(f"variant {name}: settings for model.{group}, which {variant.target} does not list in "
                              f"config_groups ({', '.join(groups) or 'none'})")
        known = {f.name for f in dataclasses.fields(groups[group])}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"variant {name}: model.{group}.{unknown[0]} is not a field of "
                              f"{groups[group].__qualname__}; fields: {', '.join(sorted(known))}")
    for group, cls in groups.items():  # all-or-nothing: a taken group name refuses the whole entry
        current = config_groups().get(group)
        if current is not None and current is not cls:
            raise ConfigError(f"variant {name}: model.{group} is already {current.__module__}.{current.__qualname__}'s "
                              "group; give the new group another name")
    for group, cls in groups.items():
        register_group(group, cls)
    VARIANTS[name] = variant
    return variant


def unregister(name: str) -> None:
    """Remove a variant, and the config groups no remaining variant uses (for tests of temporary variants)."""
    variant = VARIANTS.pop(name)
    in_use = {g for v in VARIANTS.values() for g in v.model_class().config_groups}
    for group in set(variant.model_class().config_groups) - in_use:
        unregister_group(group)


def _group_settings(settings: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {k: v for k, v in settings.items() if isinstance(v, dict)}


_SMALL_GRU = {"mom": {"router_hidden": 32}}

_BUILT_IN: Dict[str, Variant] = {
    "vanilla": Variant("architectures.gpt2:GPT2", "dense GPT-2 (the reference for every ratio)",
                       tags=("device_check", "probe")),
    "mod": Variant("architectures.mod:MoD", "Mixture-of-Depths: expert-choice top-k tokens per routed block",
                   test_settings={"mod": {"capacity": 0.25}}, tags=("device_check", "probe")),
    "mode_staged": Variant("architectures.mod:MoDEStaged", "MoDE staged: MoD routing around blocks with an MoE MLP",
                           test_settings={"moe": {"num_experts": 4}, "mod": {"capacity": 0.25}}, tags=("probe",)),
    "mode_integrated": Variant("architectures.mod:MoDEIntegrated",
                               "MoDE integrated: MoE router over experts plus no-op experts",
                               test_settings={"moe": {"num_experts": 4}, "mod": {"capacity": 0.25}}, tags=("probe",)),
    "ffn_wider": Variant("architectures.combination:FFNWider", "GPT-2 with a wide FFN (combo.wide_ffn_ratio * d, default 32d)",
                         test_settings={"combo": {"wide_ffn_ratio": 8.0}}),
    "caa": Variant("architectures.combination:CombinationLM",
                   "Combination Adjustable Architecture: FFN width W split into Outer-FFN (r) and Inner-FFN in MHA (1-r)"),
    "cea": Variant("architectures.combination:CombinationLM",
                   "Combination Enhanced Architecture: caa with the fixed ratio r = 0.125 (Outer-FFN 4d of 32d)",
                   overrides={"combo": {"outer_ratio": 0.125}}),
    "cea_moe": Variant("architectures.combination:CombinationMoELM",
                       "cea with an MoE Inner-FFN (combo.inner_experts, top combo.inner_top_k), dense 4d Outer-FFN",
                       overrides={"combo": {"total_ffn_ratio": 8.0}}),
    "cea_paper": Variant("architectures.combination:CombinationLM",
                         "cea with the paper's wiring: other positions' keys/values through the Inner-FFN, "
                         "own position direct, one MHA (no V_inner / O')",
                         overrides={"combo": {"outer_ratio": 0.125, "inner_wiring": "paper"}}),
    "cea_moe_paper": Variant("architectures.combination:CombinationMoELM",
                             "cea_moe with the paper's wiring (Inner MoE on the keys/values of other positions)",
                             overrides={"combo": {"total_ffn_ratio": 8.0, "inner_wiring": "paper"}}),
    "moe": Variant("architectures.moe:MoEGPT", "GPT-2 with token-choice top-k MoE FFNs (Switch when k=1)",
                   test_settings={"moe": {"num_experts": 4}}, tags=("device_check", "probe")),
    "moe_dense_ffn": Variant("architectures.moe:MoEGPT",
                             "the CEA-MoE paper's baseline: dense FFN kept, a top-1 MoE layer (own residual) before it; "
                             "experts sized as cea_moe's (4 x 4d) so the two compare at equal expert capacity",
                             overrides={"moe": {"placement": "before_ffn", "num_experts": 4, "top_k": 1}}),
    "mot": Variant("architectures.mot:MoT", "Mixture of Transformers: whole blocks as top-k experts", tags=("probe",)),
    "mot_seq": Variant("architectures.mot:MoT",
                       "MoT as in seed 002: sequence-level routing, uniform 1/k weights, gate with a hidden layer, "
                       "forced random activation (10%) next to the balance loss",
                       overrides={"mot": {"routing": "sequence", "weights": "uniform", "gate_hidden": 128,
                                          "random_activation": 0.1}},
                       # the suite compares training-mode forwards, so the random slot is off there;
                       # tests/test_paper_options.py tests it
                       test_settings={"mot": {"gate_hidden": 16, "random_activation": 0.0}}),
    "depth_gate": Variant("architectures.depth_gate:DepthGate",
                          "gate-weighted sum of layer outputs (blog-post 'MoD'; saves no compute)", tags=("probe",)),
    "depth_gate_skip": Variant("architectures.depth_gate:DepthGate",
                               "hard depth gating that really skips: each token runs only its top-k layers (the blog's form)",
                               overrides={"depth_gate": {"mode": "hard", "top_k": 2, "skip_compute": True}},
                               tags=("probe",)),
    "mom": Variant("architectures.mom:MixtureOfModules",
                   "Mixture-of-Modules: GRU routers assemble pooled attention/FFN modules (plain form, K=1, H=L)",
                   test_settings=_SMALL_GRU, tags=("probe",)),
    "mom_p": Variant("architectures.mom:MixtureOfModules", "MoM-P performant: K=2, H=6, chunked layout",
                     overrides={"mom": {"top_k": 2, "steps": 6, "layout": "chunked"}}, test_settings=_SMALL_GRU),
    "mom_e": Variant("architectures.mom:MixtureOfModules", "MoM-E efficient: K=3, H=1, chunked layout",
                     overrides={"mom": {"top_k": 3, "steps": 1, "layout": "chunked"}}, test_settings=_SMALL_GRU,
                     tags=("device_check", "probe")),
    "mom_i": Variant("architectures.mom:MixtureOfModules", "MoM-I interpolated: K=3, H=2, chunked layout",
                     overrides={"mom": {"top_k": 3, "steps": 2, "layout": "chunked"}}, test_settings=_SMALL_GRU),
    "mom_official": Variant("architectures.mom:MixtureOfModules",
                            "MoM with the official code's router and loss: W_o with bias, both routers sized "
                            "max(N_A, N_F) + 1, the official balance-loss form, chunked layout",
                            overrides={"mom": {"layout": "chunked", "router_bias": True, "router_width": "max_pool",
                                               "balance_form": "official"}},
                            # unequal pools at test size, so the surplus classes of max_pool exist
                            test_settings={"mom": {"router_hidden": 32, "n_ffn": 2}}),
    "layer_skip": Variant("architectures.mom:MixtureOfModules",
                          "layer skipping as MoM: step h runs layer h or SKIP (learned, K=1)",
                          overrides={"mom": {"routing": "layer_skip"}}, test_settings=_SMALL_GRU),
    "param_share": Variant("architectures.mom:MixtureOfModules",
                           "parameter sharing as MoM: one attention + one FFN module reused at all L steps",
                           overrides={"mom": {"routing": "param_share", "n_attn": 1, "n_ffn": 1}}),
    "mor": Variant("architectures.mor:MixtureOfRecursions",
                   "Mixture-of-Recursions, expert choice: a shared middle stack cycled num_recursions times, the "
                   "top-k of the still-active tokens continue at each recursion (capacity shrinking)",
                   # top-k at both recursions in the invariant suite (the default schedule's first is 1: all tokens)
                   test_settings={"mor": {"capacities": [0.5, 0.25]}}, tags=("probe",)),
    "mor_token": Variant("architectures.mor:MixtureOfRecursions",
                         "Mixture-of-Recursions, token choice: each token's recursion depth chosen once by a router "
                         "over the depths, with a balance loss", overrides={"mor": {"routing": "token"}},
                         tags=("probe",)),
    "recur_halt": Variant("architectures.recur_halt:RecurHalt",
                          "a shared block applied up to max_steps times per token, halted per token online (ACT, "
                          "Graves 2016): halted tokens stop paying compute", tags=("probe",)),
    "recur_halt_ponder": Variant("architectures.recur_halt:RecurHalt",
                                 "recur_halt with PonderNet's halting (Banino et al. 2021): geometric prior, KL term",
                                 overrides={"recur_halt": {"halting": "ponder"}}),
    "early_exit": Variant("architectures.early_exit:EarlyExit",
                          "early exit: LayerSkip training (layer dropout rising with depth, exit loss at every "
                          "layer), CALM confidence exit per token at evaluation",
                          # at the tiny test init the head's max-probability is ~0.013-0.020 (median 0.0154): this
                          # threshold makes about half the tokens exit early. The suite compares unseeded training
                          # forwards, so layer dropout is off there; tests/test_early_exit.py tests it
                          test_settings={"early_exit": {"exit_threshold": 0.0155, "p_max": 0.0}}, tags=("probe",)),
}
for _name, _variant in _BUILT_IN.items():
    register(_name, _variant)


def variant_names():
    return sorted(VARIANTS)


def tagged(tag: str) -> List[str]:
    """The variants carrying ``tag`` (``TAGS``), in registration order."""
    if tag not in TAGS:
        raise ConfigError(f"unknown variant tag {tag!r}; tags: {', '.join(TAGS)}")
    return [name for name, variant in VARIANTS.items() if tag in variant.tags]


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ConfigError(f"model.variant: unknown variant {name!r}; valid variants: {', '.join(variant_names())}")
    return VARIANTS[name]


def apply_preset(config: ModelConfig) -> ModelConfig:
    """``config`` with its variant's preset in its groups. A config gets its preset when it is built
    (``ModelConfig``'s docstring: explicit values win), so this is ``config`` itself unless ``variant`` was
    assigned afterwards: then a copy holds the new variant's groups, those it shares with the old variant as
    they were, the others with the new preset. The CLI puts the preset into the parser's defaults instead
    (``preset_defaults``), so an explicit command-line value wins there too."""
    get_variant(config.variant)
    return config if config.preset == config.variant else dataclasses.replace(config)


def preset_defaults(variant: str, prefix: str = "model") -> Dict[str, Any]:
    """The variant's preset as parser defaults: ``{"model.<group>.<field>": value, "model.preset": name}``."""
    if variant not in VARIANTS:
        return {}
    out = {f"{prefix}.{group}.{name}": value
           for group, values in VARIANTS[variant].overrides.items() for name, value in values.items()}
    out[f"{prefix}.preset"] = variant
    return out


def _validate_variant(config: ModelConfig) -> None:
    get_variant(config.variant).validate(config)


def _variant_options(name: str):
    """(the groups ``name`` reads, its preset), or None for an unknown name: ``ModelConfig`` builds its groups
    from them (installed with ``config.set_variant_options``)."""
    variant = VARIANTS.get(name)
    return None if variant is None else (variant.model_class().config_groups, variant.overrides)


set_variant_validator(_validate_variant)
set_variant_options(_variant_options)


def uses_option(variant: str, key: str) -> bool:
    """Whether ``variant`` reads the option ``key`` (``"group.field"``): its model class reads the group
    (``config_groups``) and does not override the field (``config_fields_ignored``)."""
    cls = get_variant(variant).model_class()
    return key.split(".")[0] in cls.config_groups and key not in cls.config_fields_ignored


def ignored_options(config: ModelConfig) -> List[Tuple[str, Any]]:
    """``(group.field, value)`` of every option of the variant's groups that its class overrides
    (``config_fields_ignored``) although it was set away from its default (the variant's preset, else the
    dataclass default), e.g. ``moe.num_experts`` for cea_moe (its Inner MoE's size comes from model.combo)."""
    overrides = get_variant(config.variant).overrides
    out = []
    for group, options in config.groups.items():
        default = type(options)()
        for f in dataclasses.fields(options):
            key = f"{group}.{f.name}"
            value = getattr(options, f.name)
            if value != overrides.get(group, {}).get(f.name, getattr(default, f.name)) and not uses_option(config.variant, key):
                out.append((key, value))
    return out


def unread_group_options(variant: str, model: Dict[str, Any], given: Sequence[str] = ()) -> List[Tuple[str, Any]]:
    """``(group.field, value)`` of the options in ``model`` (a parsed ``model`` section: every registered group)
    whose group ``variant`` does not read, which its config would drop: those set away from the dataclass
    default, and those named in ``given`` (``group.field`` keys the user typed, even at their default)."""
    reads = get_variant(variant).model_class().config_groups
    out = []
    for group, cls in config_groups().items():
        values = model.get(group) or {}
        if group in reads or not isinstance(values, dict):
            continue
        default = cls()
        out += [(f"{group}.{k}", v) for k, v in values.items()
                if hasattr(default, k) and (v != getattr(default, k) or f"{group}.{k}" in given)]
    return out


def check_groups_read(variant: str, model: Dict[str, Any], given: Sequence[str] = ()) -> None:
    """Refuse options of a group ``variant`` does not read (``unread_group_options``): one line naming the
    option, the variant's groups and the variants that read it."""
    unread = unread_group_options(variant, model, given)
    if not unread:
        return
    key, value = unread[0]
    reads = get_variant(variant).model_class().config_groups
    users = [name for name in variant_names() if uses_option(name, key)]
    more = f" (also unread: {', '.join('model.' + k for k, _ in unread[1:])})" if len(unread) > 1 else ""
    raise ConfigError(f"model.{key}: the {variant} variant does not use this option (set to {value!r}); it applies "
                      f"to {', '.join(users) or 'no variant'}; drop it or choose one of those variants (groups "
                      f"{variant} reads: {', '.join(reads) or 'none'}){more}")


def check_options_used(config: ModelConfig) -> None:
    """Refuse options the variant would ignore: one line naming the option and the variants that read it."""
    ignored = ignored_options(config)
    if not ignored:
        return
    key, value = ignored[0]
    users = [name for name in variant_names() if uses_option(name, key)]
    more = f" (also ignored: {', '.join('model.' + k for k, _ in ignored[1:])})" if len(ignored) > 1 else ""
    raise ConfigError(f"model.{key}: the {config.variant} variant does not use this option (set to {value!r}); "
                      f"it applies to {', '.join(users) or 'no variant'}; drop it or choose one of those "
                      f"variants{more}")


def build_model(config: ModelConfig):
    """Resolve sizes, apply the variant preset, validate, instantiate the model and initialise its weights
    (once, here: a model class only defines ``init_weights``)."""
    config = apply_preset(config).resolve()
    model = get_variant(config.variant).model_class()(config)
    model.init_weights()
    return model
