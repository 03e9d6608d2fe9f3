"""A variant with an option is one file plus one registry line (issue 21 §1).

A toy variant is written to a temporary module OUTSIDE the package (no project file is touched): its model
class, its config dataclass and one ``register(...)`` call. From that alone it must get its CLI options
(``--model.toy.ffn_mult``), its preset, config validation with a one-line error naming the field, the
invariant suite (tests/test_contract.py, which is driven by the registry) and a 3-step training run; with
it registered, the tests that enumerate the registry or the config groups still pass. Old run folders and
checkpoints (every group in every config, as the code wrote them before configs held only their variant's
groups) still load, their unread groups dropped.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from architectures import ModelConfig, build_model
from architectures.config import SHARED_FIELDS, ConfigError, config_groups, flatten
from architectures.registry import VARIANTS, Variant, register, unregister
from tests.conftest import REPO, TINY_RUN

TOY_MODULE = "toy_wide_variant"
TOY_SOURCE = textwrap.dedent('''
    """A toy variant: GPT-2 whose FFN is ``model.toy.ffn_mult * d`` wide. The whole variant is this file."""
    from dataclasses import dataclass

    import torch.nn as nn

    from architectures.base import LanguageModel, require
    from architectures.gpt2 import Block
    from architectures.registry import Variant, register


    @dataclass
    class ToyConfig:
        ffn_mult: float = 2.0  # FFN hidden width = ffn_mult * d_model


    class ToyWide(LanguageModel):
        config_groups = {"toy": ToyConfig}
        may_skip_parameters = False

        def __init__(self, config):
            super().__init__(config)
            hidden = int(round(config.toy.ffn_mult * config.d_model))
            self.blocks = nn.ModuleList([Block(config, i, ffn_hidden=hidden) for i in range(config.n_layer)])

        @staticmethod
        def validate_config(config):
            require(config.toy.ffn_mult > 0, "model.toy.ffn_mult", f"must be > 0, got {config.toy.ffn_mult}")


    register("toy_wide", Variant(ToyWide, "toy: GPT-2 with a model.toy.ffn_mult * d wide FFN",
                                 overrides={"toy": {"ffn_mult": 3.0}}))
''')


def write_toy(folder: pathlib.Path) -> pathlib.Path:
    path = folder / f"{TOY_MODULE}.py"
    path.write_text(TOY_SOURCE)
    assert not path.resolve().is_relative_to(REPO), "the toy variant must live outside the project"
    return path


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy variant registered in this process; unregistered afterwards (its group is forgotten)."""
    write_toy(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(TOY_MODULE)
    yield module
    unregister("toy_wide")
    sys.modules.pop(TOY_MODULE, None)
    assert "toy" not in config_groups() and "toy_wide" not in VARIANTS
    from experiments.run import build_parser

    assert "--model.toy." not in build_parser().format_help()  # later tests' parsers do not see the group


def toy_env(folder: pathlib.Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), "OMP_NUM_THREADS": "1"}


def test_a_toy_variant_gets_cli_options_preset_and_validation_from_its_registry_line(toy):
    from experiments.run import build_parser, expand_aliases, model_config, parse_with_presets, validate_up_front

    assert config_groups()["toy"] is toy.ToyConfig
    assert "--model.toy.ffn_mult" in build_parser().format_help()

    def parsed(*argv):
        return parse_with_presets(build_parser(), expand_aliases(list(argv)))

    cfg = parsed("--variant", "toy_wide")
    validate_up_front(cfg)
    assert model_config(cfg).toy.ffn_mult == 3.0  # the preset
    cfg = parsed("--variant", "toy_wide", "--model.toy.ffn_mult", "2.0")  # explicit, equal to the dataclass default
    validate_up_front(cfg)
    model = build_model(model_config(cfg))
    assert model.config.toy.ffn_mult == 2.0 and model.blocks[0].mlp.c_fc.out_features == 2 * model.config.d_model
    with pytest.raises(ConfigError, match=r"^model\.toy\.ffn_mult: must be > 0, got -1"):
        validate_up_front(parsed("--variant", "toy_wide", "--model.toy.ffn_mult", "-1"))
    # the group is the config's only group: to_dict / from_dict / replace keep it
    config = ModelConfig(variant="toy_wide", toy=toy.ToyConfig(ffn_mult=1.5))
    assert list(config.groups) == ["toy"] and list(config.to_dict())[-1] == "toy"
    assert ModelConfig.from_dict(config.to_dict()).toy.ffn_mult == 1.5
    assert dataclasses.replace(config, d_model=64).toy.ffn_mult == 1.5
    with pytest.raises(ConfigError, match=r"^model\.toy\.ffn_mult: the vanilla variant does not use this option "
                                          r"\(set to 1\.5\); it applies to toy_wide; .*\(groups vanilla reads: none\)$"):
        validate_up_front(parsed("--variant", "vanilla", "--model.toy.ffn_mult", "1.5"))


def test_registering_refuses_a_taken_name_and_a_preset_the_class_cannot_read(toy):
    with pytest.raises(ConfigError, match="already registered"):
        register("toy_wide", VARIANTS["toy_wide"])
    with pytest.raises(ConfigError, match=r"model\.toy\.ffn_width is not a field of ToyConfig"):
        register("toy_bad_field", Variant(toy.ToyWide, "bad", overrides={"toy": {"ffn_width": 3}}))
    with pytest.raises(ConfigError, match=r"model\.mom, which .* does not list"):
        register("toy_bad_group", Variant(toy.ToyWide, "bad", overrides={"mom": {"top_k": 2}}))
    class Clash(toy.ToyWide):
        config_groups = {"wide_clash": toy.ToyConfig, "mom": toy.ToyConfig}  # "mom" belongs to MoMConfig

    with pytest.raises(ConfigError, match=r"model\.mom is already architectures\.mom\.MoMConfig's group"):
        register("toy_clash", Variant(Clash, "clash"))
    assert "wide_clash" not in config_groups()  # nothing registered half-way
    assert not {"toy_bad_field", "toy_bad_group", "toy_clash"} & set(VARIANTS)


def test_a_config_naming_an_unregistered_group_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"^model\.toy: not a model field or registered config group"):
        ModelConfig.from_dict({"variant": "vanilla", "toy": {"ffn_mult": 2.0}})


@pytest.mark.slow
def test_the_toy_variant_passes_the_invariant_suite(tmp_path):
    """tests/test_contract.py parametrises over the registry: the toy's cases appear once it is registered."""
    write_toy(tmp_path)
    (tmp_path / "toy_plugin.py").write_text(f"import {TOY_MODULE}  # noqa: F401  (registers toy_wide)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "toy_plugin", "-p", "no:cacheprovider", "-m", "not slow",
         "-k", "toy_wide", "tests/test_contract.py"],
        cwd=REPO, env=toy_env(tmp_path), capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 8, summary  # every invariant ran on the toy


@pytest.mark.slow
def test_the_tests_that_enumerate_the_registry_and_groups_pass_with_the_toy_registered(tmp_path):
    """A newcomer's variant with an option (the toy's ``model.toy``) must break no existing test: the tests that
    go over every variant or every config group, and the old-layout loading, run with the toy registered."""
    write_toy(tmp_path)
    (tmp_path / "toy_plugin.py").write_text(f"import {TOY_MODULE}  # noqa: F401  (registers toy_wide)\n")
    selected = "toy_wide or old_layout or old_run_folders or presets_and_defaults or explicit"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "toy_plugin", "-p", "no:cacheprovider", "-m", "not slow",
         "-k", selected, "tests/test_configs.py", "tests/test_argument_errors.py",
         "tests/test_one_file_variant.py"],
        cwd=REPO, env=toy_env(tmp_path), capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    toy_cases = [line for line in result.stdout.splitlines() if line.startswith("PASSED") and "[toy_wide]" in line]
    assert len(toy_cases) >= 3, result.stdout[-4000:]  # the registry-wide cases ran on the toy too


@pytest.mark.slow
def test_the_toy_variant_trains_three_steps_from_the_command_line(tmp_path):
    write_toy(tmp_path)
    command = [sys.executable, "-c", f"import {TOY_MODULE}; from experiments.run import cli; cli()"]
    env = toy_env(tmp_path)  # (its option's validation: the test above, in this process)
    run = subprocess.run(command + ["--variant", "toy_wide", *TINY_RUN, "--max_steps", "3", "--val_every", "3",
                                    "--log_dir", str(tmp_path / "runs")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    run_dir = pathlib.Path(run.stdout.strip().splitlines()[-1])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["variant"] == "toy_wide" and saved["model"]["toy"] == {"ffn_mult": 3.0}
    assert set(saved["model"]) == {*SHARED_FIELDS, "toy"}  # the variant's group only
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] is not None


# ---------------------------------------------------------------------------- old run folders and checkpoints
# The model section of a config.yaml / checkpoint written before the config groups moved into the architecture
# files (ModelConfig then declared all six groups itself, in this order, before ``preset``).
OLD_MODEL_SECTION = """
variant: mom_e
size: tiny
vocab_size: 97
d_model: 32
n_layer: 4
n_head: 2
block_size: 32
ffn_ratio: 4.0
dropout: 0.0
bias: true
layer_norm_eps: 1.0e-05
init_std: 0.02
mod: {capacity: 0.125, routed_blocks: odd, sampling: predictor, aux_loss_coef: 0.01, predictor_hidden: 64,
      predictor_loss_coef: 1.0, noop_experts: 1}
moe: {num_experts: 8, top_k: 1, renormalize: true, balance_coef: 0.01, z_loss_coef: 0.001, capacity_factor: 1.25,
      dropless: true, layers: all, expert_ffn_ratio: null, placement: replace}
mot: {num_experts: 4, top_k: 2, layers: all, balance_coef: 0.01, renormalize: true, routing: token, weights: gate,
      gate_hidden: 0, aggregation: sum, random_activation: 0.0}
depth_gate: {mode: soft, top_k: 2, skip_compute: false}
mom: {n_attn: null, n_ffn: null, top_k: 3, steps: 1, allow_skip: true, router_hidden: 16, temperature: 0.2,
      balance_coef: 0.01, layout: chunked, bottom: null, chunks: null, top: null, anchor: null, routing: learned,
      weighted_qkv: false, straight_through: true, router_bias: false, router_width: own, balance_form: site_mean,
      all_paths: false}
combo: {wide_ffn_ratio: 32.0, total_ffn_ratio: 32.0, outer_ratio: 0.5, inner_experts: 4, inner_top_k: 1,
        inner_wiring: additive}
preset: mom_e
"""


def test_an_old_layout_config_and_checkpoint_still_load_and_resume(tmp_path):
    import lightning as L

    from experiments.run import build_parser, checkpoint_differences, model_config, run_fingerprints
    from lightning_modules.lm import LanguageModelModule

    old = yaml.safe_load(OLD_MODEL_SECTION)
    config = ModelConfig.from_dict(old)
    # the groups mom_e reads, every field and value kept; the others dropped (whatever groups are registered)
    assert config.to_dict() == {k: v for k, v in old.items() if k not in config_groups() or k == "mom"}
    # the run folder's config.yaml goes back into the CLI
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": old}))
    cfg = build_parser().parse_args(["--config", str(tmp_path / "config.yaml")])
    assert model_config(cfg) == config
    # a checkpoint written by the old code: Lightning's hyper_parameters hold the old model dict
    torch.manual_seed(0)
    model = build_model(config)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": old, "optim": None, "max_steps": 10, "val_names": None},
                "pytorch-lightning_version": L.__version__}, ckpt)
    loaded = LanguageModelModule.load_from_checkpoint(str(ckpt), map_location="cpu").model
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name

    class Data:  # the resume check compares the model fields (this checkpoint records no data fingerprints)
        def fingerprints(self):
            return {}

    assert checkpoint_differences(str(ckpt), run_fingerprints(config, Data())) == []
    assert list(loaded.config.groups) == ["mom"]  # and what it saves from now on holds only that group


# Real run folders written by the old code (every group in every config.yaml), committed with the results.
OLD_RUN_CONFIGS = sorted((REPO / "docs" / "results" / "probe_kernels").glob("*/*-tiny/config.yaml"))


@pytest.mark.parametrize("path", OLD_RUN_CONFIGS[:2], ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_real_old_run_folders_load_with_their_variants_groups_only(path):
    from analysis.compare import without_unused_groups

    old = yaml.safe_load(path.read_text())["model"]
    config = ModelConfig.from_dict(old)
    reads = VARIANTS[old["variant"]].model_class().config_groups
    assert set(old) - set(config.to_dict()) == set(old) & set(config_groups()) - set(reads)  # the unread groups gone
    for group in reads:  # every value the old file holds is kept (fields added since take their defaults)
        assert dataclasses.asdict(getattr(config, group)).items() >= old[group].items()
    new = {"model": config.to_dict()}  # experiments.compare reads old and new alike
    same = {k: v for k, v in flatten(new).items() if k in flatten({"model": old})}
    assert without_unused_groups(flatten({"model": old})) == same


# ---------------------------------------------------------------------------- a pick rule from docs/pick-rules.md
PICK_RULES_PAGE = REPO / "docs" / "pick-rules.md"


def page_rule_code() -> str:
    """The page's threshold rule: the python block of "## Writing a pick rule" that defines ``Threshold``."""
    section = PICK_RULES_PAGE.read_text().split("## Writing a pick rule", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    found = [b for b in blocks if "class Threshold(PickRule)" in b]
    assert len(found) == 1, "docs/pick-rules.md: one python block under 'Writing a pick rule' defines Threshold"
    return found[0]


def page_rule():
    namespace: dict = {}
    exec(compile(page_rule_code(), str(PICK_RULES_PAGE), "exec"), namespace)  # the page's code, as written
    return namespace["Threshold"]


def test_the_page_s_threshold_rule_picks_above_tau_with_a_straight_through_weight():
    Threshold = page_rule()
    logits = torch.tensor([[[-2.0], [0.5], [3.0]], [[1.0], [-1.0], [0.0]]], requires_grad=True)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    choice = Threshold(tau=0.6, target=0.5, rate_coef=2.0).pick(logits, valid)
    p = torch.sigmoid(logits.detach())
    assert torch.equal(choice.selected, (p > 0.6).long())
    assert torch.equal(choice.weights.detach(), (p > 0.6).float())  # exactly 1 on processed tokens, 0 on skipped
    rate = p[..., 0][valid].mean()  # the padded token is not counted
    torch.testing.assert_close(choice.aux["rate"], 2.0 * (rate - 0.5) ** 2)
    choice.weights.sum().backward()  # d w / d logit = 1 - p on processed tokens (p / stopgrad(p)), 0 on skipped
    torch.testing.assert_close(logits.grad, torch.where(p > 0.6, 1 - p, torch.zeros_like(p)))


def threshold_variant(Threshold):
    """A one-option variant built on the page's rule: each block runs for the tokens whose gate passes tau."""
    import torch.nn as nn

    from architectures.base import LanguageModel, require
    from architectures.gpt2 import Block
    from architectures.routing import LinearRouter, SiteId

    @dataclasses.dataclass
    class GateConfig:
        tau: float = 0.5  # a token runs a block when sigmoid(its gate score) > tau

    class GatedBlock(nn.Module):
        def __init__(self, config, index: int):
            super().__init__()
            self.block = Block(config, index)
            self.router = LinearRouter(config.d_model, 1, Threshold(config.gate.tau), ["skip", "block"],
                                       SiteId(f"block{index}.gate"))

        def forward(self, x, state):
            route = self.router(x, state)
            return x + route.weights.to(x.dtype) * (self.block(x, state) - x)

        def flops(self, sites, T, queries=None):
            return self.block.flops(sites, T, queries)  # every token computes the block (the page's toy)

    class Gated(LanguageModel):
        config_groups = {"gate": GateConfig}

        def __init__(self, config):
            super().__init__(config)
            self.blocks = nn.ModuleList([GatedBlock(config, i) for i in range(config.n_layer)])

        @staticmethod
        def validate_config(config):
            require(0 < config.gate.tau < 1, "model.gate.tau", f"must be in (0, 1), got {config.gate.tau}")

    return Gated


@pytest.mark.slow
def test_a_variant_on_the_page_s_rule_trains_and_passes_the_routing_health_check():
    """The page's rule in a registered variant with one option: it trains, reports its sites and rate losses,
    and after the health test's 200 steps (tests/test_contract.py, seed 0) neither skips nor runs everything
    by collapse."""
    from tests.test_contract import routing_health_failure

    register("toy_gate", Variant(threshold_variant(page_rule()), "toy: blocks gated by the pick-rules page's rule",
                                 overrides={"gate": {"tau": 0.5}}))
    try:
        torch.manual_seed(0)
        model = build_model(VARIANTS["toy_gate"].test_config("toy_gate"))
        out = model(torch.randint(0, 97, (2, 16)))
        assert [s.name for s in out.trace] == [f"block{i}.gate" for i in range(4)]
        assert set(out.aux_losses) == {f"block{i}.gate/rate" for i in range(4)}
        with pytest.raises(ConfigError, match=r"^model\.gate\.tau: must be in \(0, 1\)"):
            VARIANTS["toy_gate"].test_config("toy_gate", gate={"tau": 1.5}).validate()
        assert routing_health_failure("toy_gate", 0) is None
    finally:
        unregister("toy_gate")
