"""``--init_from``'s share counts the parameters outside the embeddings (issue 21 §4).

At GPT-2's vocabulary the embedding table is most of a small model: counted in, a source missing half
the model's blocks reported 94.5% initialised and the 50% guard could not notice.
"""
from __future__ import annotations

import pytest
import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from model_tools.weights import init_report, load_initial_weights

# GPT-2's vocabulary at a small width: the embeddings outweigh the blocks, as at the suite's small sizes
SHAPE = dict(vocab_size=50257, d_model=32, n_layer=4, n_head=2, block_size=32)


def vanilla_state(n_layer: int):
    torch.manual_seed(0)
    return build_model(ModelConfig(variant="vanilla", **{**SHAPE, "n_layer": n_layer})).state_dict()


@pytest.fixture(scope="module")
def target():
    return build_model(ModelConfig(variant="moe", **SHAPE))


@pytest.mark.parametrize("source_layers", [1, 2, 3])
def test_the_share_is_that_of_the_blocks_the_source_initialises(target, source_layers):
    state = vanilla_state(source_layers)
    report = init_report(target, state, target.vanilla_state_mapping(state))
    blocks = [n for n in report.sizes if n.startswith("blocks.")]
    from_source = {*report.loaded, *(t for t, _ in report.mapped)}
    block_share = sum(report.sizes[n] for n in blocks if n in from_source) / sum(report.sizes[n] for n in blocks)
    # the source's blocks initialise the first source_layers of 4 blocks (routers new): about that fraction
    assert block_share == pytest.approx(source_layers / 4, abs=0.03)
    # only ln_f (2 x 32 parameters) is outside the blocks and the embeddings
    assert report.initialised_share == pytest.approx(block_share, abs=0.01)
    counted_with_embeddings = sum(report.sizes[n] for n in from_source) / report.model_parameters
    assert counted_with_embeddings > 0.85  # what the old share said


def test_the_guard_refuses_a_source_that_initialises_a_quarter_of_the_blocks(target, tmp_path, capsys):
    path = tmp_path / "one_layer.pt"
    torch.save(vanilla_state(1), path)
    with pytest.raises(ConfigError, match=r"only 2\d\.\d% of the moe model's parameters outside the embeddings"):
        load_initial_weights(target, str(path), strict=True)
    assert "parameters outside the embeddings initialised from the source" in capsys.readouterr().err
    load_initial_weights(target, str(path), strict=False)  # --init_strict false: loads anyway
    torch.testing.assert_close(target.wte.weight, vanilla_state(1)["wte.weight"])


@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "saved-apart"])
def test_the_tied_lm_head_of_the_source_is_not_reported_unused(shared):
    """Two-phase MoM training reported the vanilla checkpoint's ``lm_head.weight`` (GPT-2's tied copy of
    ``wte.weight``) as unused; it is used with the embeddings, and counted once in the source's size."""
    state = vanilla_state(4)
    if not shared:  # a state dict whose save lost the sharing
        state = {k: v.clone() for k, v in state.items()}
    torch.manual_seed(0)
    mom = build_model(ModelConfig(variant="mom_e", **SHAPE))
    report = init_report(mom, state, mom.vanilla_state_mapping(state))
    assert report.unused == []
    assert sum(report.source_sizes.values()) == sum(v.numel() for k, v in state.items() if k != "lm_head.weight")
