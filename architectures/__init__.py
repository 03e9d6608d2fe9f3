"""Plain-PyTorch architectures (no Lightning import). See ``contract.py`` for the model contract."""
from architectures.config import ConfigError, ModelConfig, SIZES
from architectures.contract import KVCache, ModelOutput, RoutingSite, SubLayerState
from architectures.flops import Flops
from architectures.registry import VARIANTS, build_model, get_variant, variant_names

__all__ = [
    "ConfigError", "ModelConfig", "SIZES", "KVCache", "ModelOutput", "RoutingSite", "SubLayerState",
    "Flops", "VARIANTS", "build_model", "get_variant", "variant_names",
]
