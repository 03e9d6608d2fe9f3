"""Paper-faithful options (issue 17): each option's DEFINING property, at tiny sizes.

The named setups (``moe_dense_ffn``, ``depth_gate_skip``, ``mot_seq``, ``caa_paper``, ``cea_moe_paper``,
``mom_official``) are registry entries, so tests/test_contract.py runs the whole invariant suite on them;
this file checks what makes each option the paper's form.
"""
from __future__ import annotations

import pytest
import torch

from architectures import build_model
from architectures import flops as F_
from architectures.registry import VARIANTS

V, T = 97, 32


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def build(name, seed=0, **extra):
    torch.manual_seed(seed)
    return build_model(VARIANTS[name].test_config(name, **extra))


def tokens(B=2, length=T, seed=1):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- 1. CEA-MoE baseline placement
def test_moe_before_ffn_matches_cea_moe_parameters_and_flops_up_to_the_inner_path():
    """moe_dense_ffn vs cea_moe at the same width: the same experts, router, dense 4d FFN; cea_moe adds
    only its Inner path (V_inner, O' and the strictly-causal score pass), the baseline only one LayerNorm."""
    base, cea = build("moe_dense_ffn"), build("cea_moe")
    cfg = base.config
    d, L = cfg.d_model, cfg.n_layer
    assert cea.config.combo.inner_experts == cfg.moe.num_experts and cea.inner_width == cfg.ffn_hidden
    inner_path = L * 2 * (d * d + d)  # V_inner and O' (with bias)
    assert n_params(base) == n_params(cea) - inner_path + L * 2 * d  # + ln_moe
    score_pass = F_.attention_scores(d, (T - 1) ** 2 / T)
    expected = cea.flops_per_token(seq_len=T).forward - L * (2 * F_.linear(d, d) + score_pass)
    assert base.flops_per_token(seq_len=T).forward == pytest.approx(expected, rel=1e-9)
    # and the Switch placement ("replace") has no dense FFN: 4d x d x 2 fewer matmul FLOPs per layer
    switch = build("moe_dense_ffn", moe={"placement": "replace"})
    gap = base.flops_per_token(seq_len=T).forward - switch.flops_per_token(seq_len=T).forward
    assert gap == pytest.approx(L * F_.ffn(d, cfg.ffn_hidden))


def test_moe_before_ffn_keeps_the_dense_ffn():
    """With every expert's output projection zeroed the model IS vanilla GPT-2 with the same weights."""
    model = build("moe_dense_ffn").eval()
    vanilla = build("vanilla").eval()
    missing = vanilla.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert not missing, missing
    idx = tokens()
    with torch.no_grad():
        assert not torch.allclose(model(idx).logits, vanilla(idx).logits, atol=1e-5)  # the MoE does contribute
        for block in model.blocks:
            for expert in block.moe.experts:
                expert.c_proj.weight.zero_()
                expert.c_proj.bias.zero_()
        torch.testing.assert_close(model(idx).logits, vanilla(idx).logits, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------- 2. depth gating that skips
def _perturb(block):
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p))


def test_depth_gate_skip_mode_runs_a_token_through_its_top_k_layers_only():
    """One token alone (nothing else to attend to): perturbing a layer it did not choose leaves its output
    unchanged in skip mode; in the default hard mode (every layer runs) the same perturbation shows."""
    skip = build("depth_gate_skip").eval()
    runs_all = build("depth_gate_skip", depth_gate={"skip_compute": False}).eval()
    runs_all.load_state_dict(skip.state_dict())
    for token in range(V):
        idx = torch.tensor([[token]])
        with torch.no_grad():
            chosen = set(skip(idx).trace[0].selected.flatten().tolist())
        below = [layer for layer in range(max(chosen)) if layer not in chosen]
        if below:
            break
    else:
        pytest.fail("no token left a layer below its top choice unchosen")
    with torch.no_grad():
        before_skip, before_all = skip(idx).logits, runs_all(idx).logits
        _perturb(skip.blocks[below[0]])
        _perturb(runs_all.blocks[below[0]])
        torch.testing.assert_close(skip(idx).logits, before_skip, atol=0, rtol=0)
        assert not torch.allclose(runs_all(idx).logits, before_all, atol=1e-4)


def test_depth_gate_skip_mode_counts_k_of_L_layers_per_token():
    model = build("depth_gate_skip").eval()
    cfg = model.config
    with torch.no_grad():
        out = model(tokens())
    site = out.trace[0]
    assert int(site.extras["layer_tokens"].sum()) == 2 * T * cfg.depth_gate.top_k
    dense = build("depth_gate_skip", depth_gate={"skip_compute": False}).flops_per_token(out.trace)
    ffn = model.flops_per_token(out.trace).ffn
    assert ffn == pytest.approx(dense.ffn * cfg.depth_gate.top_k / cfg.n_layer)
