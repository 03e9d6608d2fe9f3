"""The repro programmes plan, validate and cost every entry from its command line with ONE parser; the run
itself parses its command line once, with a fresh parser (``experiments.run.main``). Both must give the same
model: before, the programmes' parse skipped the variant's preset (``cea_moe`` planned with the dataclass's
FFN ratio: 2.1x its FLOPs), and the costs built from vanilla's config dropped the pass-through options of other
variants' groups (``mom.router_hidden``: MoM planned at 3.6x, ``layer_skip`` stopped by its step cap)."""
from __future__ import annotations

import pytest

from architectures import variant_names
from experiments.repro.common import Context, entry_cost, parse_entry
from experiments.run import build_parser, expand_aliases, join_option_values, model_config, parse_with_presets

OPTIONS = ["--model.d_model", "32", "--model.block_size", "32", "--model.mom.router_hidden", "16"]


def run_model_config(argv):
    """The model ``experiments.run.main`` builds from ``argv`` (its parse: a fresh parser, presets applied)."""
    return model_config(parse_with_presets(build_parser(), join_option_values(expand_aliases(list(argv))))).resolve()


@pytest.mark.slow  # a fresh parser per variant, as every run builds one (~1 s each)
def test_every_variant_is_parsed_by_the_programmes_as_its_run_parses_it(tmp_path):
    ctx = Context(out=tmp_path, run_options=OPTIONS)
    # every variant twice, in both orders, through the same parser: no preset may leak into the next entry
    names = [*variant_names(), *reversed(variant_names())]
    for name in names:
        argv = ctx.argv(parse_entry(name).run_options())
        assert model_config(ctx.parse(argv)).resolve() == run_model_config(argv), name


def test_the_planned_cost_follows_presets_and_pass_through_options(tmp_path):
    import dataclasses

    import torch

    from architectures import build_model

    ctx = Context(out=tmp_path, run_options=OPTIONS)
    for name in ("cea_moe", "mom", "layer_skip", "mod", "cea_moe"):  # cea_moe again after mom: nothing carried over
        argv = ctx.argv(parse_entry(name).run_options())
        config = run_model_config(argv)
        assert config.groups.get("mom") is None or config.groups["mom"].router_hidden == 16
        with torch.device("meta"):
            model = build_model(dataclasses.replace(config, vocab_size=4096))
        assert entry_cost(ctx, parse_entry(name), 4096) == model.flops_per_token(None, config.block_size).training, name


def test_the_isoflop_plan_counts_a_variant_s_own_pass_through_options(tmp_path):
    """``mod_isoflop -- --model.mod.capacity 0.5`` plans MoD at capacity 0.5 (before: at its preset's 0.125,
    because the grid's shapes were cut from vanilla's config, which holds no MoD options)."""
    import dataclasses

    import torch

    from architectures import build_model
    from experiments.repro.isoflop import isoflop_configs, variant_bases

    options = ["--model.d_model", "32", "--model.block_size", "32", "--model.mod.capacity", "0.5"]
    ctx = Context(out=tmp_path, run_options=options)
    bases = variant_bases(ctx, ["vanilla", "mod"], 4096)
    assert bases["mod"].groups["mod"].capacity == 0.5
    plan = isoflop_configs(1e11, bases["vanilla"], 256, ["vanilla", "mod"], [32], depths=[4], bases=bases)
    mod = next(c for c in plan if c.variant == "mod")
    run = dataclasses.replace(run_model_config(ctx.argv(["--variant", "mod"])), vocab_size=4096)
    with torch.device("meta"):
        expected = build_model(run).flops_per_token(None, run.block_size).training
    assert mod.flops_per_token == expected
    default = isoflop_configs(1e11, bases["vanilla"], 256, ["vanilla", "mod"], [32], depths=[4])
    assert next(c for c in default if c.variant == "mod").flops_per_token < expected  # capacity 0.125: cheaper
