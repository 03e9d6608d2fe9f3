"""Every shipped size preset parses, validates and builds its model, and every registry variant composes
with every size from the command line (lightning-hydra-template style; the variant presets are the
registry's ``overrides``, not YAML files)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from architectures import build_model, variant_names
from architectures.registry import VARIANTS
from experiments.run import build_parser, expand_aliases, model_config, parse_with_presets, validate_up_front

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
# run presets (sizes); configs/paper/ holds sweep grids, tested in tests/test_paper_recipes.py
PRESETS = sorted((CONFIGS / "sizes").glob("*.yaml"))


def parse(*files):
    argv = [arg for f in files for arg in ("--config", str(f))]
    return build_parser().parse_args(argv)


def test_presets_exist_for_every_size():
    assert {"tiny", "small", "medium", "large"} <= {p.stem for p in PRESETS}


def test_no_variant_yaml_restates_the_registry():
    """Variant presets live in the registry only (issue 21): a YAML copy would drift from it."""
    assert not (CONFIGS / "variants").exists() or not list((CONFIGS / "variants").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_preset_validates_and_builds(preset):
    cfg = parse(preset)
    validate_up_front(cfg)
    with torch.device("meta"):
        model = build_model(model_config(cfg))
    assert model.num_parameters() > 0


@pytest.mark.parametrize("variant", variant_names())
def test_every_variant_composes_with_every_size_and_gets_its_preset(variant):
    parser = build_parser()
    for size in ("tiny", "small", "medium", "large"):
        cfg = parse_with_presets(parser, expand_aliases(["--config", str(CONFIGS / "sizes" / f"{size}.yaml"),
                                                         "--variant", variant]))
        validate_up_front(cfg)
        assert cfg.model.size == size and cfg.model.variant == variant
        mcfg = model_config(cfg)
        for group, values in VARIANTS[variant].overrides.items():
            assert {k: getattr(getattr(mcfg, group), k) for k in values} == values, f"{variant}: model.{group}"
        with torch.device("meta"):
            model = build_model(mcfg)
        assert model.config.n_layer == {"tiny": 4, "small": 12, "medium": 24, "large": 36}[size]


def test_explicit_values_beat_presets_even_when_equal_to_the_dataclass_default():
    def resolved(*argv):
        return model_config(parse_with_presets(build_parser(), expand_aliases(list(argv))))

    assert resolved("--variant", "cea").combo.outer_ratio == 0.125  # the preset
    assert resolved("--variant", "cea", "--model.combo.outer_ratio", "0.5").combo.outer_ratio == 0.5  # == default
    assert resolved("--variant", "mom_e").mom.top_k == 3
    assert resolved("--variant", "mom_e", "--model.mom.top_k", "1").mom.top_k == 1
    built = build_model(resolved("--variant", "cea", "--model.combo.outer_ratio", "0.5"))  # not re-applied
    assert built.config.combo.outer_ratio == 0.5


def test_explicit_values_beat_presets_in_the_python_api_and_bench_set():
    """Issue 12 §3.5: ModelConfig(variant="mom_e", mom=MoMConfig(top_k=1)) built K=3. Issue 31: without frame
    inspection: a dict's keys are explicit (the preset fills the rest), an object is taken whole."""
    import dataclasses

    from architectures import ModelConfig
    from architectures.combination import CombinationConfig
    from architectures.mom import MoMConfig
    from model_tools.benchmark import apply_overrides

    def built(config):
        with torch.device("meta"):
            return build_model(config).config

    assert built(ModelConfig(variant="mom_e")).mom.top_k == 3  # the preset fills what the user left alone
    one = built(ModelConfig(variant="mom_e", mom={"top_k": 1}))  # == dataclass default: still explicit
    assert (one.mom.top_k, one.mom.steps, one.mom.layout) == (1, 1, "chunked")
    whole = built(ModelConfig(variant="mom_e", mom=MoMConfig(top_k=1, router_hidden=64)))  # an object: as given
    assert (whole.mom.top_k, whole.mom.router_hidden, whole.mom.steps, whole.mom.layout) == (1, 64, None, "plain")
    assert built(ModelConfig(variant="cea", combo=CombinationConfig(0.5 * 64))).combo.outer_ratio == 0.5
    copied = dataclasses.replace(ModelConfig(variant="mom_e", mom={"top_k": 1, "router_hidden": 64}), d_model=64)
    assert (built(copied).mom.top_k, copied.mom.router_hidden, copied.mom.steps) == (1, 64, 1)  # a copy keeps it
    assigned = ModelConfig(variant="cea")
    assigned.combo.outer_ratio = 0.5
    assert built(assigned).combo.outer_ratio == 0.5
    bench = apply_overrides(ModelConfig(variant="mom_e"), ["mom.top_k=1"])
    assert built(bench).mom.top_k == 1


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if VARIANTS[v].overrides))
def test_a_config_round_trips_through_a_dict_with_its_preset(variant):
    """Issue 30: ``from_dict(cfg.to_dict())`` of a config whose preset was not applied yet made every group field
    explicit, so mom_e, mom_p, cea_paper, moe_dense_ffn, ... built without their preset. The preset is now in
    the config from the start, explicit values beside it, and the dict keeps both."""
    from architectures import ModelConfig
    from architectures.registry import apply_preset

    explicit = [{}] + ([{"mom": {"top_k": 1}}] if variant == "mom_e" else [])  # 1 == the dataclass default
    for given in explicit:
        config = ModelConfig(variant=variant, **given)
        again = ModelConfig.from_dict(config.to_dict())
        assert again == config == apply_preset(again)
        for group, values in VARIANTS[variant].overrides.items():
            expected = {**values, **{k: v for k, v in given.get(group, {}).items() if k in values}}
            assert {k: getattr(getattr(again, group), k) for k in values} == expected, f"{variant}: model.{group}"
