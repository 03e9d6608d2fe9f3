"""The model configuration: shared fields plus the option groups of the active variant.

``ModelConfig`` is plain typed data. It holds the fields every model shares (``variant``, ``size``, the
dimensions, dropout, ...) and ``groups``: ``{group name: options dataclass}`` for exactly the groups the
variant reads. A family's options live in its own dataclass in its architecture file (``MoMConfig`` in
``architectures/mom.py``, ...); the model class names the groups it reads (``config_groups = {"mom":
MoMConfig}``) and the registry (``architectures/registry.py``, which imports this module, never the
other way round) records each one with ``register_group`` and tells this module, through
``set_variant_options``, which groups and which preset a variant has. ``config.mom.top_k`` reads the group
(``__getattr__`` looks the name up in ``groups``), so a family reads its options as an attribute.

The variant's preset is applied when the config is built, to the fields the user did not give:

* a group given as a dict (``from_dict``, a run folder's ``config.yaml``, a checkpoint, the CLI,
  ``ModelConfig(variant="mom_e", mom={"top_k": 1})``): its keys are explicit and beat the preset, even when
  equal to the dataclass default; the preset fills the other fields;
* a group given as an object (``mom=MoMConfig(top_k=1)``, or the groups a ``dataclasses.replace`` copy
  passes on): taken as it is: every field of it is explicit, the preset fills none;
* a group not given: the preset over the dataclass defaults.

Assigning afterwards (``config.combo.outer_ratio = 0.5``) simply changes the value: nothing re-applies a
preset later. Groups the variant does not read are dropped, so ``to_dict()``, ``config.yaml`` and checkpoint
hyper-parameters hold only the variant's groups; old run folders and checkpoints, which hold all of them,
still load (``from_dict`` drops the others). The command line refuses options of a group the variant does
not read (``registry.check_groups_read``).

Sizes (``tiny`` .. ``large``) fill the shared dimensions that were left as ``None`` (see ``SIZES``),
litgpt-style: every real size has a tiny sibling for CPU runs and tests.

Validation happens in ``ModelConfig.validate()``; every error names the offending field and the
allowed values, so a bad command line fails before any data or weights are touched. The variant's own
checks reach it through ``set_variant_validator`` (installed by the registry).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what is allowed."""


def tracks_explicit(cls):
    """Deprecated no-op, kept so that variant files written for the old config still import: explicit values
    are now told apart where the config is built (``ModelConfig``'s docstring), not by the group class."""
    return cls


# d = width, L = layers, heads, T = context (block size). See ../shared/SPEC.md §1.
SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=128, n_layer=4, n_head=4, block_size=128),
    "small": dict(d_model=768, n_layer=12, n_head=12, block_size=1024),
    "medium": dict(d_model=1024, n_layer=24, n_head=16, block_size=1024),
    "large": dict(d_model=1280, n_layer=36, n_head=20, block_size=1024),
}

GPT2_VOCAB_SIZE = 50257


@dataclass
class SharedModelConfig:
    """The fields every model shares (the CLI's ``--model.<field>`` options). Dimensions left as ``None`` are
    filled from ``SIZES[size]`` by ``ModelConfig.resolve()``."""

    variant: str = "vanilla"
    size: str = "tiny"
    vocab_size: int = GPT2_VOCAB_SIZE
    d_model: Optional[int] = None
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    block_size: Optional[int] = None
    ffn_ratio: float = 4.0
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    # The variant whose preset filled the config's groups: set when the config is built (a record for
    # config.yaml and ``registry.apply_preset``; the preset is never applied twice).
    preset: Optional[str] = None


@dataclass(init=False)
class ModelConfig(SharedModelConfig):
    """Everything needed to build any registered architecture: the shared fields (``SharedModelConfig``) and
    ``groups``, the option groups the variant reads with its preset applied (module docstring); each group is
    also an attribute (``config.mom``). Build one with keywords: the shared fields, and a group by its name
    (``ModelConfig(variant="mom_e", size="small", mom={"top_k": 2})``).
    """

    groups: Dict[str, Any] = field(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(SHARED_FIELDS) - {"groups"} - set(_GROUPS))
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: not a model field or registered config group (groups: "
                              f"{', '.join(_GROUPS)}); register the variant that defines it first")
        for name in SHARED_FIELDS:
            object.__setattr__(self, name, values.pop(name, _SHARED_DEFAULTS[name]))
        given = {**dict(values.pop("groups", None) or {}), **values}
        object.__setattr__(self, "groups", _variant_groups(self.variant, given))
        if _variant_options(self.variant) is not None:
            object.__setattr__(self, "preset", self.variant)

    def __getattr__(self, name: str) -> Any:
        groups = self.__dict__.get("groups")  # absent while unpickling
        if groups is not None and name in groups:
            return groups[name]
        if groups is not None and name in _GROUPS:
            raise AttributeError(f"model.{name}: the {self.variant} variant does not read this group "
                                 f"(its groups: {', '.join(groups) or 'none'})")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("groups", {}):
            self.groups[name] = value
        elif name in _GROUPS:
            raise ConfigError(f"model.{name}: the {self.variant} variant does not read this group "
                              f"(its groups: {', '.join(self.groups) or 'none'})")
        else:
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ resolution
    def resolve(self) -> "ModelConfig":
        """Return a copy with size defaults filled in and every field validated."""
        if self.size not in SIZES:
            raise ConfigError(f"model.size: unknown size {self.size!r}; valid sizes: {', '.join(SIZES)}")
        cfg = dataclasses.replace(self)
        for name, value in SIZES[self.size].items():
            if getattr(cfg, name) is None:
                setattr(cfg, name, value)
        cfg.validate()
        return cfg

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_hidden(self) -> int:
        return int(round(self.ffn_ratio * self.d_model))

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "block_size"):
            value = getattr(self, name)
            if value is None or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name}: must be a positive integer, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ConfigError(
                f"model.d_model: width {self.d_model} is not divisible by model.n_head={self.n_head}"
            )
        if self.ffn_ratio <= 0:
            raise ConfigError(f"model.ffn_ratio: must be > 0, got {self.ffn_ratio}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")
        _variant_validator(self)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        """The shared fields, then one dict per group the variant reads (``model.<group>.<field>``, the layout
        of ``config.yaml`` and checkpoint hyper-parameters); ``from_dict`` of it builds the same config."""
        data = {name: getattr(self, name) for name in SHARED_FIELDS}
        data.update({name: dataclasses.asdict(group) for name, group in self.groups.items()})
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """From a dict such as ``to_dict()``, a run folder's ``config.yaml`` ``model:`` section or a checkpoint's
        ``hyper_parameters["model"]``. Its group keys are explicit (they beat the preset); a group the variant
        does not read is dropped (old run folders and checkpoints hold all of them), one the variant reads but
        ``data`` lacks takes the preset; a key that is neither a field nor a registered group is refused by name.
        ``dataclasses.asdict``'s layout (the groups under ``groups``) is read too."""
        values = dict(data)
        nested = values.pop("groups", None) or {}
        return cls(**{**nested, **values})


SHARED_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SharedModelConfig))
_SHARED_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SharedModelConfig)}


def _no_variant_check(config: ModelConfig) -> None:
    """Until the registry installs its check (importing ``architectures`` does), only shared fields are validated."""


_variant_validator: Callable[[ModelConfig], None] = _no_variant_check


def set_variant_validator(check: Callable[[ModelConfig], None]) -> None:
    """Install the check ``ModelConfig.validate`` runs last: the variant name and the variant's own rules.
    The registry installs it, so this module does not import the registry (which imports the families)."""
    global _variant_validator
    _variant_validator = check


# ---------------------------------------------------------------------------- the groups
#: {group name: its dataclass}: every group some registered variant reads.
_GROUPS: Dict[str, type] = {}

#: ``variant -> ({group: dataclass} it reads, {group: {field: preset value}})``, or None for an unknown
#: variant; installed by the registry (``set_variant_options``).
VariantOptions = Callable[[str], Optional[Tuple[Dict[str, type], Dict[str, Dict[str, Any]]]]]


def _no_variants(variant: str):
    return None


_variant_options: VariantOptions = _no_variants


def set_variant_options(lookup: VariantOptions) -> None:
    """Install the registry's answer to "which groups does this variant read, with which preset"."""
    global _variant_options
    _variant_options = lookup


def config_groups() -> Dict[str, type]:
    """{group name: its dataclass} of every registered group: the one list of config groups (the CLI's
    options, ``from_dict``'s check of names and the tests read it). A config holds only its variant's."""
    return dict(_GROUPS)


def register_group(name: str, group: type) -> None:
    """Record the dataclass ``group`` as the config group ``model.<name>``. Registering the same class again
    is a no-op; another class under a taken name is refused."""
    current = _GROUPS.get(name)
    if current is group:
        return
    if not dataclasses.is_dataclass(group):
        raise TypeError(f"config group model.{name}: {group!r} is not a dataclass")
    if current is not None or name in SHARED_FIELDS or name == "groups" or not name.isidentifier():
        taken = f"by {current.__module__}.{current.__qualname__}" if current is not None else "by ModelConfig"
        raise ConfigError(f"model.{name}: the name is taken {taken}; give the new group another name")
    _GROUPS[name] = group


def unregister_group(name: str) -> None:
    """Forget the config group ``model.<name>`` (tests registering a temporary variant clean up with it)."""
    _GROUPS.pop(name, None)


def _variant_groups(variant: str, given: Dict[str, Any]) -> Dict[str, Any]:
    """The groups ``variant`` reads, built from ``given`` (dicts or group objects) and the variant's preset
    (module docstring); given groups the variant does not read are dropped. For an unknown variant the given
    groups are kept as they are (``validate`` names the variant)."""
    options = _variant_options(variant)
    if options is None:
        return {name: _GROUPS[name](**value) if isinstance(value, Mapping) else value for name, value in given.items()}
    reads, presets = options
    return {name: _group(name, cls, given.get(name), presets.get(name, {})) for name, cls in reads.items()}


def _group(name: str, cls: type, given: Any, preset: Dict[str, Any]) -> Any:
    """One group: an object as it is (every field of it was given), else ``preset`` under the dict's fields."""
    if isinstance(given, cls):
        return given
    if given is not None and not isinstance(given, Mapping):
        raise ConfigError(f"model.{name}: expected a {cls.__qualname__} or a dict of its fields, got "
                          f"{type(given).__name__}")
    given = dict(given or {})
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"model.{name}.{unknown[0]}: not a field of {cls.__qualname__}; fields: "
                          f"{', '.join(sorted(known))}")
    return cls(**{**preset, **given})


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested config dict as ``{"model.mod.capacity": 0.125, ...}`` (tuples as lists, as YAML writes them)."""
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def layer_selection(spec: Union[str, List[int]], n_layer: int, field_name: str) -> List[int]:
    """Turn "all" / "odd" / "even" / [indices] into a sorted list of layer indices, validated."""
    if isinstance(spec, str):
        choices = {
            "all": list(range(n_layer)),
            "odd": list(range(1, n_layer, 2)),
            "even": list(range(0, n_layer, 2)),
        }
        if spec not in choices:
            raise ConfigError(f"{field_name}: unknown selection {spec!r}; use one of all, odd, even or a list of indices")
        return choices[spec]
    indices = sorted(set(int(i) for i in spec))
    bad = [i for i in indices if not 0 <= i < n_layer]
    if bad:
        raise ConfigError(f"{field_name}: layer index {bad} out of range for n_layer={n_layer} (valid 0..{n_layer - 1})")
    if not indices:
        raise ConfigError(f"{field_name}: the list of layers is empty")
    return indices
