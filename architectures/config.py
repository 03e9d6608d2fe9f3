"""One configuration dataclass for every architecture.

``ModelConfig`` holds the fields every model shares plus one group per variant family
(``mod``, ``moe``, ``mot``, ``depth_gate``, ``mom``, ``combo``). A family reads only its own
group; the others keep their defaults and cost nothing. Sizes (``tiny`` .. ``large``) fill the
shared dimensions that were left as ``None`` (see ``SIZES``), litgpt-style: every real size has a
tiny sibling for CPU runs and tests.

Validation happens in ``ModelConfig.validate()``; every error names the offending field and the
allowed values, so a bad command line fails before any data or weights are touched.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


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


@tracks_explicit
@dataclass
class MoDConfig:
    """Mixture-of-Depths (Raposo et al. 2024). Used by ``mod``, ``mode_staged``, ``mode_integrated``."""

    capacity: float = 0.125
    # Which blocks are routed: "odd" (1, 3, 5, ...: the paper's every-other-block), "even", "all",
    # or an explicit list of block indices.
    routed_blocks: Union[str, List[int]] = "odd"
    # Causal decision used by generate(): "aux_loss" (BCE on router logits), "predictor"
    # (aux MLP on stop-gradient inputs), or "none" (training only; generate() refuses).
    sampling: str = "predictor"
    aux_loss_coef: float = 0.01  # router BCE ("aux_loss"): shapes the router, so it is kept small
    predictor_hidden: int = 64
    # Predictor BCE ("predictor"): its input is stop-gradient, so this only sets its learning rate.
    predictor_loss_coef: float = 1.0
    # MoDE-integrated: number of identity (no-op) experts added next to the MoE experts.
    noop_experts: int = 1


@tracks_explicit
@dataclass
class MoEConfig:
    """Token-choice Mixture-of-Experts FFN (Switch / top-k)."""

    num_experts: int = 8
    top_k: int = 1
    renormalize: bool = True  # weights renormalised over the chosen k (k > 1; k = 1 keeps the raw probability)
    balance_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    # Tokens per expert = capacity_factor * tokens * top_k / E. Ignored when dropless.
    capacity_factor: float = 1.25
    dropless: bool = True
    # Which layers get an MoE FFN: "all", "odd", "even", or an explicit list.
    layers: Union[str, List[int]] = "all"
    expert_ffn_ratio: Optional[float] = None  # None: the model's ffn_ratio
    # "replace": the MoE layer is the block's FFN (Switch; our default). "before_ffn": the MoE layer gets
    # its own LayerNorm and residual update BEFORE the dense FFN, which is kept (the CEA-MoE paper's
    # baseline: a 64-expert top-1 MoE in front of each FFN). Preset ``moe_dense_ffn`` matches ``cea_moe``.
    placement: str = "replace"


@tracks_explicit
@dataclass
class MoTConfig:
    """Mixture of Transformers: whole blocks as experts, top-k gate per mixture layer."""

    num_experts: int = 4
    top_k: int = 2
    layers: Union[str, List[int]] = "all"
    balance_coef: float = 1e-2
    renormalize: bool = True  # gate weights renormalised over the chosen k (k > 1 only, as for MoE)
    # Paper-form options (seed 002; preset ``mot_seq``). Defaults keep our per-token form.
    # "token": each token picks its k blocks. "sequence": the gate reads the mean of the sequence's real
    # tokens and the whole sequence goes through the same k blocks (sees the future: under
    # causal_routing() / decoding each token is routed by the mean of its prefix instead).
    routing: str = "token"
    weights: str = "gate"  # "gate": gate probabilities; "uniform": 1/k forward (seed), gradient to the gate kept
    gate_hidden: int = 0  # 0: linear gate; > 0: gate MLP d -> gate_hidden -> E (GELU)
    aggregation: str = "sum"  # "sum": x + sum_j w_j (Block_j(x) - x); "concat": x + W_c [w_1 u_1; ..; w_k u_k]
    random_activation: float = 0.0  # training only: probability that a routed unit's last slot goes to a random other block


@tracks_explicit
@dataclass
class DepthGateConfig:
    """Soft / hard depth gating over layer outputs (the blog-post "MoD"; saves no compute)."""

    mode: str = "soft"  # "soft" or "hard"
    top_k: int = 2
    # Hard mode only. False (default): every layer still runs on every token (a cheap baseline; the gate
    # picks which layer outputs are mixed). True: the blog's "tokens only pass through" their top-k
    # layers: a layer runs only on the tokens that chose it (attention among those tokens), the others
    # pass it unchanged, and FLOPs drop accordingly. Preset ``depth_gate_skip``.
    skip_compute: bool = False


@tracks_explicit
@dataclass
class MoMConfig:
    """Mixture-of-Modules (Gong et al. 2024). Semantics and defaults: ``architectures/mom.py``.

    Pool sizes and H are per chunk; ``None`` means "the chunk's vanilla layer slots" (the number of
    vanilla layers a chunk replaces), so the default MoM has the vanilla model's parameters and
    ``init_from_vanilla`` maps layer j to module j.
    """

    n_attn: Optional[int] = None  # N_A attention modules per chunk
    n_ffn: Optional[int] = None  # N_F FFN modules per chunk
    top_k: int = 1  # K (SKIP competes inside the K)
    steps: Optional[int] = None  # H assembly steps per chunk
    allow_skip: bool = True
    router_hidden: int = 256
    temperature: float = 0.2
    balance_coef: float = 0.01
    # "plain": one chunk, no bottom/top/anchor (the paper's form). "chunked": the official code's
    # layout sized from n_layer (pools of 4 + an anchor per chunk, the rest split bottom/top).
    # Explicit bottom / chunks / top / anchor override the layout's values.
    layout: str = "plain"
    bottom: Optional[int] = None
    chunks: Optional[int] = None
    top: Optional[int] = None
    anchor: Optional[bool] = None
    # "learned", "vanilla" (module h at step h), "param_share" (module 0 at every step),
    # "moe" (attention fixed at module h, FFN learned), "layer_skip" (step h: module h or SKIP).
    routing: str = "learned"
    weighted_qkv: bool = False  # official-code option: scale each module's QKV by its router weight
    straight_through: bool = True  # K=1: weight p / stopgrad(p) (= 1) so the router gets a gradient
    # Official-code options (gzhch/Mixture-of-Modules; preset ``mom_official``). Defaults: our forms.
    router_bias: bool = False  # the official W_o (nn.Linear) has a bias; ours is bias-free
    # "own": each router scores its own pool (+ SKIP). "max_pool": both routers score max(N_A, N_F) + 1
    # classes as in the official code; classes beyond a router's own pool act as extra SKIPs.
    router_width: str = "own"
    # "site_mean": Switch loss per learned site over its K choices, mean over sites (ours). "official":
    # one loss per router kind over all steps concatenated, f from the top-1 of softmax(probs) (the
    # official double softmax), C = router width; attention + FFN losses summed.
    balance_form: str = "site_mean"
    # routing_all_possible_path: every module runs on every token, weighted by the full router
    # distribution (a dense mixture; saves nothing). SKIP's probability contributes nothing.
    all_paths: bool = False


@tracks_explicit
@dataclass
class CombinationConfig:
    """FFN-Wider / Combination Adjustable (caa) / Enhanced (cea) architectures (Lu et al. 2024).

    Presets (registry): ``cea`` sets outer_ratio 0.125 (Outer-FFN = vanilla 4d of W = 32d);
    ``cea_moe`` sets total_ffn_ratio 8 (dense 4d Outer-FFN, 4d experts inside MHA at r = 0.5).
    """

    wide_ffn_ratio: float = 32.0  # ffn_wider: hidden = ratio * d
    # caa/cea: total FFN width W = ratio * d, split outer/inner. 32 = the FFN-Wider width the paper
    # redistributes, so caa at r = 1 is ffn_wider; use 4 for a vanilla-width split.
    total_ffn_ratio: float = 32.0
    outer_ratio: float = 0.5  # r: Outer-FFN width = r * W, Inner-FFN = (1 - r) * W; r * W must be whole
    inner_experts: int = 4  # cea_moe: experts of the Inner MoE, each (1 - r) * W wide
    inner_top_k: int = 1
    # How the Inner-FFN enters MHA (architectures/combination.py). "additive" (default): full MHA on
    # untransformed values + an additive Inner path with its own V_inner / O'. "paper" (seed 004): one
    # MHA whose keys/values of OTHER positions come from u = h + InnerFFN(h) through the shared W_k / W_v,
    # the own position's from h (the direct pathway); no extra parameters. "paper_masked": the paper's
    # FlashAttention simplification at 14B: every key/value through the Inner-FFN, own position masked.
    inner_wiring: str = "additive"


@dataclass
class ModelConfig:
    """Everything needed to build any registered architecture.

    Shared dimensions left as ``None`` are filled from ``SIZES[size]`` by ``resolve()``.
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
    mod: MoDConfig = field(default_factory=MoDConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mot: MoTConfig = field(default_factory=MoTConfig)
    depth_gate: DepthGateConfig = field(default_factory=DepthGateConfig)
    mom: MoMConfig = field(default_factory=MoMConfig)
    combo: CombinationConfig = field(default_factory=CombinationConfig)
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
        from architectures.registry import VARIANTS  # late import: registry imports the families

        if self.variant not in VARIANTS:
            raise ConfigError(
                f"model.variant: unknown variant {self.variant!r}; valid variants: {', '.join(sorted(VARIANTS))}"
            )
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
        VARIANTS[self.variant].validate(self)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelConfig":
        kwargs = dict(data)
        for name, group in config_groups().items():
            if name in kwargs and isinstance(kwargs[name], dict):
                kwargs[name] = group(**kwargs[name])
        return cls(**kwargs)


def config_groups() -> Dict[str, type]:
    """{group name: its dataclass}, collected from ``ModelConfig``'s fields: the one list of config groups
    (``from_dict``, the CLI's resolved config and the tests all read it)."""
    return {f.name: f.default_factory for f in dataclasses.fields(ModelConfig)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


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
