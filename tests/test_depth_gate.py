"""Depth gating: gates sum to 1, output is the gated mix of layer outputs, FLOPs = vanilla + gate."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.depth_gate import DepthGateConfig
from architectures.flops import vanilla_flops
from tests.conftest import cli_summary


def tiny_config(**gate) -> ModelConfig:
    return ModelConfig(variant="depth_gate", vocab_size=101, d_model=32, n_layer=4, n_head=4, block_size=32,
                       depth_gate=DepthGateConfig(**gate))


def _model(**gate):
    torch.manual_seed(0)
    model = build_model(tiny_config(**gate))
    torch.nn.init.normal_(model.gate.weight, std=1.0)  # a peaked gate, so the top-k actually matters
    return model


@pytest.mark.parametrize("gate", [dict(mode="soft"), dict(mode="hard", top_k=2), dict(mode="hard", top_k=1)])
def test_gates_sum_to_one_and_output_is_the_gated_mix(gate):
    model = _model(**gate)
    idx = torch.randint(0, 101, (2, 12))
    out = model(idx, return_residuals=True)
    site = out.trace[0]
    assert site.kind == "soft_gate" and site.choice_names == [f"layer{i}" for i in range(4)]
    k = 4 if gate["mode"] == "soft" else gate["top_k"]
    assert site.selected.shape == site.weights.shape == (2, 12, k)
    torch.testing.assert_close(site.weights.sum(-1), torch.ones(2, 12))
    torch.testing.assert_close(site.probs.sum(-1), torch.ones(2, 12))
    layer_out = torch.stack([s.hidden for s in out.residuals if s.tag == "ffn"], dim=-1)  # (B, T, d, L)
    dense = torch.zeros(2, 12, 4).scatter(-1, site.selected, site.weights)
    assert int((dense > 0).sum(-1).max()) == k
    mixed = (layer_out * dense.unsqueeze(2)).sum(-1)
    torch.testing.assert_close(out.logits, model.head(mixed), rtol=1e-5, atol=1e-5)


def test_hard_mode_picks_the_largest_gates():
    model = _model(mode="hard", top_k=2)
    out = model(torch.randint(0, 101, (1, 8)))
    site = out.trace[0]
    top = site.probs.topk(2, dim=-1)
    assert torch.equal(site.selected, top.indices)
    torch.testing.assert_close(site.weights, top.values / top.values.sum(-1, keepdim=True))


def test_zero_gate_gives_the_uniform_average():
    model = _model()
    torch.nn.init.zeros_(model.gate.weight)
    out = model(torch.randint(0, 101, (1, 6)))
    torch.testing.assert_close(out.trace[0].weights, torch.full((1, 6, 4), 0.25))


@pytest.mark.parametrize("gate", [dict(mode="soft"), dict(mode="hard", top_k=2), dict(mode="hard", top_k=1)])
def test_gate_receives_gradient_from_the_lm_loss(gate):
    """Issue 12 §3.2: hard top_k=1 used w / w.sum() == 1, a gate gradient of ~1e-11 (it never learned)."""
    model = _model(**gate)
    idx = torch.randint(0, 101, (2, 8))
    logits = model(idx).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 101), idx[:, 1:].reshape(-1)).backward()
    grad = model.gate.weight.grad
    assert grad is not None and grad.abs().max() > 1e-5, f"gate gradient {None if grad is None else grad.abs().max()}"


def test_flops_are_vanilla_plus_gate_and_match_the_counter():
    model = _model(mode="hard", top_k=1)
    idx = torch.randint(0, 101, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    flops = model.flops_per_token(out.trace, seq_len=16)
    assert flops.forward * idx.numel() == pytest.approx(counter.get_total_flops())
    want = vanilla_flops(model.config, 16).forward + 2 * 32 * 4
    assert flops.forward == pytest.approx(want), "depth gating saves no compute"


@pytest.mark.parametrize("gate,field", [
    (dict(mode="mixed"), "model.depth_gate.mode"),
    (dict(mode="hard", top_k=5), "model.depth_gate.top_k"),
    (dict(mode="hard", top_k=0), "model.depth_gate.top_k"),
])
def test_rejects_bad_config_naming_the_field(gate, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(**gate).resolve()


@pytest.mark.slow
def test_cli_short_run(tmp_path):
    s = cli_summary("depth_gate", tmp_path, "--model.depth_gate.mode", "hard", "--model.depth_gate.top_k", "1")
    flops = s["flops_per_token"]
    gate = 2 * 32 * 2  # d -> L
    assert flops["components"]["router"] == pytest.approx(gate)
    assert flops["ratio_to_vanilla"] == pytest.approx(flops["forward"] / (flops["forward"] - gate))
    assert flops["ratio_to_vanilla"] > 1.0, "depth gating saves no compute"
    assert sum(s["routing"]["depth_gate"].values()) == pytest.approx(1.0)


def test_final_hidden_is_what_the_head_reads():
    """depth_gate's head reads the gated mix, not the last residual; the contract exposes it."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="depth_gate", vocab_size=50, d_model=16, n_layer=3, n_head=2,
                                    block_size=12)).eval()
    out = model(torch.randint(0, 50, (2, 12)), return_residuals=True)
    torch.testing.assert_close(model.head(out.final_hidden()), out.logits)
    assert not torch.allclose(model.head(out.residuals[-1].hidden), out.logits)
