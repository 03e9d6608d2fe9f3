"""Every shipped YAML preset parses, validates and builds its model (lightning-hydra-template style)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from architectures import build_model, variant_names
from experiments.run import build_parser, model_config, validate_up_front

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
PRESETS = sorted(CONFIGS.rglob("*.yaml"))


def parse(*files):
    argv = [arg for f in files for arg in ("--config", str(f))]
    return build_parser().parse_args(argv)


def test_presets_exist_for_every_size_and_variant():
    names = {p.stem for p in PRESETS}
    assert {"tiny", "small", "medium", "large"} <= names
    assert set(variant_names()) <= names, set(variant_names()) - names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_preset_validates_and_builds(preset):
    cfg = parse(preset)
    validate_up_front(cfg)
    with torch.device("meta"):
        model = build_model(model_config(cfg))
    assert model.num_parameters() > 0


@pytest.mark.parametrize("variant_preset", sorted((CONFIGS / "variants").glob("*.yaml")), ids=lambda p: p.stem)
def test_variant_preset_composes_with_every_size(variant_preset):
    for size in ("tiny", "small", "medium", "large"):
        cfg = parse(CONFIGS / "sizes" / f"{size}.yaml", variant_preset)
        validate_up_front(cfg)
        assert cfg.model.size == size and cfg.model.variant == variant_preset.stem
        with torch.device("meta"):
            model = build_model(model_config(cfg))
        assert model.config.n_layer == {"tiny": 4, "small": 12, "medium": 24, "large": 36}[size]


def test_explicit_values_beat_presets_even_when_equal_to_the_dataclass_default():
    from experiments.run import expand_aliases, parse_with_presets

    def resolved(*argv):
        return model_config(parse_with_presets(build_parser(), expand_aliases(list(argv))))

    assert resolved("--variant", "cea").combo.outer_ratio == 0.125  # the preset
    assert resolved("--variant", "cea", "--model.combo.outer_ratio", "0.5").combo.outer_ratio == 0.5  # == default
    assert resolved("--variant", "mom_e").mom.top_k == 3
    assert resolved("--variant", "mom_e", "--model.mom.top_k", "1").mom.top_k == 1
    built = build_model(resolved("--variant", "cea", "--model.combo.outer_ratio", "0.5"))  # not re-applied
    assert built.config.combo.outer_ratio == 0.5
