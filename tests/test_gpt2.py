"""Vanilla GPT-2 and the model contract."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ConfigError, ModelConfig, build_model
from architectures.contract import RoutingSite, first_nonfinite_site
from architectures.flops import vanilla_flops
from architectures.gpt2 import config_from_hf, state_dict_from_hf


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=101, d_model=32, n_layer=3, n_head=4, block_size=40)
    base.update(kw)
    return ModelConfig(**base)


def test_small_has_gpt2_parameter_count():
    with torch.device("meta"):
        model = build_model(ModelConfig(size="small"))
    assert model.num_parameters() == 124_439_808
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("size,expected", [("medium", 354_823_168), ("large", 774_030_080)])
def test_larger_sizes_match_gpt2(size, expected):
    with torch.device("meta"):
        model = build_model(ModelConfig(size=size))
    assert model.num_parameters() == expected


def test_matches_hugging_face_gpt2_logits():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(vocab_size=211, n_positions=48, n_embd=48, n_layer=3, n_head=4,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_config).eval()
    ours = build_model(config_from_hf(hf_config)).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict()))
    idx = torch.randint(0, 211, (3, 48))
    with torch.no_grad():
        diff = (hf(idx).logits - ours(idx).logits).abs().max().item()
    assert diff < 1e-5


def test_forward_contract_shapes_values_and_residuals():
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    idx = torch.randint(0, 101, (2, 17))
    out = model(idx, return_residuals=True)
    assert out.logits.shape == (2, 17, 101)
    assert out.aux_loss.item() == 0.0 and out.trace == []
    tags = [(s.tag, s.layer) for s in out.residuals]
    assert tags == [("embed", -1)] + [(t, i) for i in range(3) for t in ("mha", "ffn")]
    # the last residual state through ln_f + head IS the output
    torch.testing.assert_close(model.head(out.residuals[-1].hidden), out.logits)
    # the model is causal: changing a later token never changes earlier logits
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 101
    torch.testing.assert_close(model(idx2).logits[:, :10], out.logits[:, :10])


def test_generate_rejects_overlong_requests():
    model = build_model(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 20)


def test_flops_match_flop_counter_math_backend():
    torch.manual_seed(0)
    config = tiny(n_layer=2, block_size=64)
    model = build_model(config)
    idx = torch.randint(0, 101, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    analytic = model.flops_per_token(out.trace, 64)
    assert analytic.forward * idx.numel() == counter.get_total_flops()
    assert analytic.training == 3 * analytic.forward
    assert model.flops_per_token() == vanilla_flops(model.config)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(d_model=30), "model.d_model"),
        (dict(n_layer=-1), "model.n_layer"),
        (dict(variant="nope"), "model.variant"),
        (dict(size="huge"), "model.size"),
        (dict(dropout=1.5), "model.dropout"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_model(tiny(**overrides))


def test_unknown_variant_lists_valid_names():
    with pytest.raises(ConfigError, match="vanilla"):
        build_model(tiny(variant="nope"))


def test_sequence_longer_than_position_table_is_an_error():
    model = build_model(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 41, dtype=torch.long))


def test_config_round_trips_through_dict():
    config = build_model(tiny(variant="vanilla")).config
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_nonfinite_router_site_is_named():
    ok = RoutingSite("a", "token_choice", ["x", "y"], torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, 1))
    bad = RoutingSite("b", "token_choice", ["x", "y"], torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, 1),
                      logits=torch.tensor([[[0.0, float("nan")]]]))
    assert first_nonfinite_site([ok, bad]) == "b"
    assert first_nonfinite_site([ok]) is None
