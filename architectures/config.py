"""The model configuration: shared fields plus one group per variant family, registered by the family.

``ModelConfig`` holds the fields every model shares (``variant``, ``size``, the dimensions, dropout,
...). A family's options live in its own dataclass in its architecture file (``MoMConfig`` in
``architectures/mom.py``, ...); the registry (``architectures/registry.py``, which imports this module,
never the other way round) adds it here as the group ``model.<name>`` via ``register_group`` when a
variant using it is registered. A group is then an ordinary dataclass field of ``ModelConfig``: the CLI
option ``--model.<group>.<field>``, ``dataclasses.asdict``, ``config.yaml`` and checkpoints all see it, in
the same layout as before the groups moved (old run folders and checkpoints load unchanged).

Sizes (``tiny`` .. ``large``) fill the shared dimensions that were left as ``None`` (see ``SIZES``),
litgpt-style: every real size has a tiny sibling for CPU runs and tests.

Validation happens in ``ModelConfig.validate()``; every error names the offending field and the
allowed values, so a bad command line fails before any data or weights are touched. The variant's own
checks reach it through ``set_variant_validator`` (installed by the registry).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what is allowed."""


def tracks_explicit(cls):
    """Class decorator for a config group: remember which fields the user set explicitly.

    ``explicit_fields(group)`` is the set of fields given to the constructor (by name or position) or
    assigned afterwards; ``dataclasses.replace`` keeps the original's set and adds the fields it changes.
    Variant presets (``registry.apply_preset``) fill only the other fields, so an explicit value wins
    even when it equals the dataclass default (``MoMConfig(top_k=1)`` with ``mom_e`` builds K=1).
    """
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)  # keeps the signature that jsonargparse reads
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        given = set(names[: len(args)]) | set(kwargs)
        source = _replaced_object(cls)
        if source is not None:  # dataclasses.replace passes every field: keep what was explicit before
            given = set(explicit_fields(source)) | {n for n in names if getattr(self, n) != getattr(source, n)}
        object.__setattr__(self, "_explicit", frozenset(given))

    def __setattr__(self, name, value):
        if "_explicit" in self.__dict__ and name in names:
            object.__setattr__(self, "_explicit", self._explicit | {name})
        object.__setattr__(self, name, value)

    cls.__init__, cls.__setattr__ = __init__, __setattr__
    return cls


def _replaced_object(cls):
    """The object ``dataclasses.replace`` is copying when it is the caller of ``cls.__init__``, else None."""
    import sys

    frame = sys._getframe(2)
    # Python <= 3.12 builds the copy in dataclasses.replace itself, 3.13+ in dataclasses._replace.
    if frame.f_globals.get("__name__") == "dataclasses" and frame.f_code.co_name in ("replace", "_replace"):
        obj = frame.f_locals.get("obj")
        return obj if isinstance(obj, cls) else None
    return None


def explicit_fields(group) -> frozenset:
    """Fields of a config group the user set explicitly (see ``tracks_explicit``)."""
    return getattr(group, "_explicit", frozenset())


# d = width, L = layers, heads, T = context (block size). See ../shared/SPEC.md §1.
SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=128, n_layer=4, n_head=4, block_size=128),
    "small": dict(d_model=768, n_layer=12, n_head=12, block_size=1024),
    "medium": dict(d_model=1024, n_layer=24, n_head=16, block_size=1024),
    "large": dict(d_model=1280, n_layer=36, n_head=20, block_size=1024),
}

GPT2_VOCAB_SIZE = 50257


@dataclass
class ModelConfig:
    """Everything needed to build any registered architecture.

    Shared dimensions left as ``None`` are filled from ``SIZES[size]`` by ``resolve()``. The family groups
    (``mod``, ``moe``, ``mot``, ``depth_gate``, ``mom``, ``combo``, and any variant registered later) are
    fields added by ``register_group``; ``config_groups()`` lists them.
    """

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
    # Name of the variant whose preset overrides (registry) are already in these fields; set by
    # registry.apply_preset and by the CLI, so a preset is applied exactly once and explicit user
    # values always win.
    preset: Optional[str] = None

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
        """Every field; ``from_dict`` of it builds the same model. Before the variant's preset is applied
        (``preset`` None) a group lists only the fields set explicitly: the preset fills the others, and a
        dict holding every field would make them all explicit (``from_dict`` passes them to the group's
        constructor), so ``mom_e``, ``cea_paper``, ... would build without their preset."""
        data = dataclasses.asdict(self)
        if self.preset is None:
            for name in config_groups():
                group = getattr(self, name)
                data[name] = {k: v for k, v in data[name].items() if k in explicit_fields(group)}
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelConfig":
        """From a dict such as ``to_dict()``, a run folder's ``config.yaml`` ``model:`` section or a checkpoint's
        ``hyper_parameters["model"]``. A group missing from ``data`` keeps its defaults (a run saved before the
        group existed); a key that is neither a field nor a registered group is refused by name."""
        kwargs = dict(data)
        groups = config_groups()
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ConfigError(f"model.{unknown[0]}: not a model field or registered config group (groups: "
                              f"{', '.join(groups)}); register the variant that defines it before loading this config")
        for name, group in groups.items():
            if name in kwargs and isinstance(kwargs[name], dict):
                kwargs[name] = group(**kwargs[name])
        return cls(**kwargs)


def _no_variant_check(config: ModelConfig) -> None:
    """Until the registry installs its check (importing ``architectures`` does), only shared fields are validated."""


_variant_validator: Callable[[ModelConfig], None] = _no_variant_check


def set_variant_validator(check: Callable[[ModelConfig], None]) -> None:
    """Install the check ``ModelConfig.validate`` runs last: the variant name and the variant's own rules.
    The registry installs it, so this module does not import the registry (which imports the families)."""
    global _variant_validator
    _variant_validator = check


def config_groups() -> Dict[str, type]:
    """{group name: its dataclass}, collected from ``ModelConfig``'s fields: the one list of config groups
    (``from_dict``, the CLI's resolved config and the tests all read it)."""
    return {f.name: f.default_factory for f in dataclasses.fields(ModelConfig)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


_SHARED_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def register_group(name: str, group: type) -> None:
    """Make the dataclass ``group`` the config group ``model.<name>``: a ``ModelConfig`` field defaulting to
    ``group()``. Registering the same class again is a no-op; another class under a taken name is refused."""
    current = config_groups().get(name)
    if current is group:
        return
    if not dataclasses.is_dataclass(group):
        raise TypeError(f"config group model.{name}: {group!r} is not a dataclass")
    if current is not None or name in _SHARED_FIELDS or not name.isidentifier():
        taken = f"by {current.__module__}.{current.__qualname__}" if current is not None else "by ModelConfig"
        raise ConfigError(f"model.{name}: the name is taken {taken}; give the new group another name")
    _redefine_model_config({**config_groups(), name: group})


def unregister_group(name: str) -> None:
    """Remove the config group ``model.<name>`` (tests registering a temporary variant clean up with it)."""
    groups = config_groups()
    if name in groups:
        del groups[name]
        _redefine_model_config(groups)


def _redefine_model_config(groups: Dict[str, type]) -> None:
    """Re-run the dataclass machinery on ``ModelConfig`` (the same class object, so every import of it stays
    valid) with the shared fields followed by ``groups``."""
    cls = ModelConfig
    shared = [f for f in dataclasses.fields(cls) if f.name in _SHARED_FIELDS]
    for name in ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__", "__dataclass_fields__",
                 "__dataclass_params__"):
        if name in cls.__dict__:
            delattr(cls, name)
    for name in set(cls.__annotations__) - _SHARED_FIELDS:
        del cls.__annotations__[name]
        if name in cls.__dict__:
            delattr(cls, name)
    for f in shared:  # the dataclass machinery replaced each Field by its default: give the Field back
        setattr(cls, f.name, f)
    for name, group in groups.items():
        cls.__annotations__[name] = group
        setattr(cls, name, field(default_factory=group))
    dataclass(cls)


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
