"""MoE layer and the ``moe`` variant: dispatch equivalence, losses, capacity, FLOPs, errors."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.moe_layer import MoEConfig, MoELayer
from architectures.routing import SiteId, balance_loss, capacity_keep, z_loss
from tests.conftest import cli_summary


def dense_moe(layer: MoELayer, x: torch.Tensor, keep: torch.Tensor = None) -> torch.Tensor:
    """Naive reference: router recomputed from scratch, every expert on every token, masked."""
    logits = x.float() @ layer.router.weight.float().t()
    probs = logits.softmax(-1)
    w, sel = probs.topk(layer.top_k, dim=-1)
    if layer.cfg.renormalize and w.shape[-1] > 1:
        w = w / w.sum(-1, keepdim=True)
    if keep is not None:
        w = w * keep
    out = torch.zeros_like(x)
    for e in range(len(layer.experts)):
        out = out + layer.experts.expert(e)(x) * ((sel == e) * w).sum(-1, keepdim=True)
    return out


def _layer(E=4, k=2, noop=0, site=SiteId("moe", "moe"), **kw) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(16, 24, MoEConfig(num_experts=E, top_k=k, **kw), noop_experts=noop, site=site)


def _grads(module, x):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("E,k,noop,renorm,dropless", [
    (4, 1, 0, True, True), (4, 2, 0, True, True), (4, 2, 0, False, True), (3, 2, 1, True, True),
    (4, 2, 0, True, False), (4, 1, 1, True, False),
])
def test_sorted_dispatch_matches_dense_reference_forward_and_grad(E, k, noop, renorm, dropless):
    layer = _layer(E, k, noop, renormalize=renorm, dropless=dropless, capacity_factor=0.6)
    x = torch.randn(3, 7, 16, requires_grad=True)
    result = layer(x)
    ref = dense_moe(layer, x, ~result.site.dropped)
    torch.testing.assert_close(result.output, ref, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(ref)
    grads = []
    for out in (result.output, ref):
        layer.zero_grad(set_to_none=False)
        x.grad = None
        (out * upstream).sum().backward()
        grads.append(_grads(layer, x))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert layer.router.weight.grad.abs().sum() > 0
    if not dropless:
        assert result.site.dropped.any(), "capacity 0.6 should drop something"


def test_balance_loss_equals_formula_on_hand_made_routing():
    # 4 tokens, 2 real experts + 1 no-op; top-1 choices 0, 0, 1, 2 (the last is the no-op)
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    selected = torch.tensor([[0], [0], [1], [2]])
    valid = torch.ones(4, dtype=torch.bool)
    # the no-op is out of the sum and of the denominators: f over real assignments, P renormalised over real
    real = probs[:, :2] / probs[:, :2].sum(-1, keepdim=True)
    f = torch.tensor([2 / 3, 1 / 3])
    P = real.mean(0)
    assert balance_loss(probs, selected, 2, valid).item() == pytest.approx(2 * (f * P).sum().item())
    # padding is excluded from both f and P
    valid = torch.tensor([True, True, True, False])
    f = torch.tensor([2 / 3, 1 / 3])
    P = real[:3].mean(0)
    assert balance_loss(probs, selected, 2, valid).item() == pytest.approx(2 * (f * P).sum().item())
    # a perfectly uniform router scores exactly 1
    uniform = torch.full((4, 4), 0.25)
    assert balance_loss(uniform, torch.tensor([[0], [1], [2], [3]]), 4, torch.ones(4, dtype=torch.bool)).item() == pytest.approx(1.0)


def test_aux_losses_carry_coefficients_and_z_loss_formula():
    layer = _layer(4, 1, balance_coef=0.5, z_loss_coef=0.25, site=SiteId("layer3.moe", "moe"))
    x = torch.randn(2, 5, 16)
    r = layer(x)
    assert set(r.aux_losses) == {"layer3.moe/balance", "layer3.moe/z_loss"}
    logits = x.reshape(10, 16) @ layer.router.weight.t()
    want_z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(r.aux_losses["layer3.moe/z_loss"], 0.25 * want_z)
    torch.testing.assert_close(z_loss(logits, torch.ones(10, dtype=torch.bool)), want_z)
    probs = logits.softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / 10
    torch.testing.assert_close(r.aux_losses["layer3.moe/balance"], 0.5 * 4 * (f * probs.mean(0)).sum())


def test_router_receives_gradient_from_output_and_from_balance_loss():
    layer = _layer(4, 2)
    x = torch.randn(2, 6, 16)
    layer(x).output.sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    layer.zero_grad()
    layer(x).aux_losses["moe/balance"].backward()
    assert layer.router.weight.grad.abs().sum() > 0


def test_router_runs_in_fp32_under_bf16_input_and_autocast():
    layer = _layer(4, 1).to(torch.bfloat16)
    r = layer(torch.randn(1, 4, 16, dtype=torch.bfloat16))
    assert r.site.logits.dtype == torch.float32 and r.site.probs.dtype == torch.float32
    assert r.output.dtype == torch.bfloat16
    layer = _layer(4, 1)
    x = torch.randn(1, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = layer(x)
    assert r.site.logits.dtype == torch.float32, "autocast must not lower the router's precision"
    torch.testing.assert_close(r.site.logits[0], x[0] @ layer.router.weight.t())


def test_capacity_priority_is_by_position_then_row_then_slot():
    # 4 tokens of one row, k=2, 2 experts, capacity 3: t0..t2 fill both experts, t3 loses both choices
    selected = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = capacity_keep(selected, 2, 3, torch.ones(4, dtype=torch.bool))
    want = torch.tensor([[True, True], [True, True], [True, True], [False, False]])
    assert torch.equal(keep, want)
    # two rows of two positions (batch-major input): position 0 of both rows goes before position 1
    selected = torch.tensor([[0], [0], [0], [0]])  # row0: t0, t1; row1: t0, t1
    keep = capacity_keep(selected, 2, 2, torch.ones(4, dtype=torch.bool), seq_len=2)
    assert torch.equal(keep.squeeze(-1), torch.tensor([True, False, True, False]))
    # no-op ids and unrouted tokens are never dropped and take no capacity
    selected = torch.tensor([[2], [0], [0], [0]])
    keep = capacity_keep(selected, 2, 1, torch.tensor([True, False, True, True]))
    assert torch.equal(keep.squeeze(-1), torch.tensor([True, True, True, False]))


@pytest.mark.parametrize("seed", range(6))
def test_capacity_limited_top2_is_causal(seed):
    """Issue 12 §3.1: slot-major priority let a later token evict an earlier token's 2nd choice."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(num_experts=4, top_k=2, dropless=False, capacity_factor=1.0)).eval()
    idx = torch.randint(0, 101, (2, 16))
    changed = idx.clone()
    changed[:, 8:] = torch.randint(0, 101, (2, 8))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a.logits[:, :8], b.logits[:, :8], atol=1e-5, rtol=0)
    for sa, sb in zip(a.trace, b.trace):
        assert torch.equal(sa.dropped[:, :8], sb.dropped[:, :8])


def test_capacity_drops_spread_evenly_over_batch_rows():
    """Issue 12 §3.1: batch-major priority dropped 0% of rows 0-5 and a third of row 7."""
    torch.manual_seed(0)
    layer = MoELayer(16, 24, MoEConfig(num_experts=4, top_k=1, dropless=False, capacity_factor=1.0))
    with torch.no_grad():
        layer.router.weight.mul_(20)  # a skewed router, so capacity binds
    dropped = layer(torch.randn(8, 128, 16)).site.dropped.squeeze(-1).float().mean(dim=1)
    assert dropped.mean() > 0.1, "the test needs a binding capacity"
    assert dropped.max() - dropped.min() < 0.15, f"drop share per row {dropped.tolist()}"


def test_capacity_limits_counts_and_dropped_tokens_get_no_update():
    layer = _layer(4, 1, dropless=False, capacity_factor=0.5)
    x = torch.randn(2, 16, 16)
    r = layer(x)
    cap = math.ceil(0.5 * 32 * 1 / 4)
    assert int(r.site.counts().max()) <= cap
    dropped = r.site.dropped.squeeze(-1)
    assert dropped.sum() == 32 - r.site.counts().sum()
    assert torch.all(r.output[dropped] == 0)
    assert torch.all(r.output[~dropped].abs().sum(-1) > 0)


def test_dropless_never_drops_and_padding_gets_no_expert():
    layer = _layer(4, 2)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    r = layer(torch.randn(2, 8, 16), valid=valid)
    assert not r.site.dropped.any()
    assert torch.all(r.output[~valid] == 0)
    assert int(r.site.counts().sum()) == 2 * int(valid.sum())


def test_layer_flops_count_active_experts_only():
    for dropless in (True, False):
        layer = _layer(4, 2, noop=1, dropless=dropless, capacity_factor=0.5)
        x = torch.randn(2, 9, 16)
        with FlopCounterMode(display=False) as counter:
            r = layer(x)
        per_token = layer.layer_flops(r.site)
        assert per_token.forward * 18 == pytest.approx(counter.get_total_flops())
    assert layer.layer_flops(None).ffn == pytest.approx(2 * 2 * 2 * 16 * 24)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_experts=0), "model.moe.num_experts"),
    (dict(num_experts=2, top_k=3), "model.moe.top_k"),
    (dict(capacity_factor=0.0), "model.moe.capacity_factor"),
    (dict(capacity_factor=-1.0), "model.moe.capacity_factor"),
])
def test_layer_rejects_bad_config(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        MoELayer(8, 16, MoEConfig(**kwargs))


# ---------------------------------------------------------------------------- the ``moe`` variant


def tiny_config(**moe) -> ModelConfig:
    return ModelConfig(variant="moe", vocab_size=101, d_model=32, n_layer=4, n_head=4, block_size=32,
                       moe=MoEConfig(**moe))


def _model(**moe):
    torch.manual_seed(0)
    return build_model(tiny_config(**moe))


def test_trace_and_aux_losses_follow_the_contract():
    model = _model(num_experts=4, top_k=2, layers="odd")
    out = model(torch.randint(0, 101, (2, 12)))
    assert [s.name for s in out.trace] == ["layer1.moe", "layer3.moe"]
    assert [s.step for s in out.trace] == [0, 1] and {s.group for s in out.trace} == {"moe"}
    site = out.trace[0]
    assert site.kind == "token_choice" and site.choice_names == [f"expert{i}" for i in range(4)]
    assert site.selected.shape == site.weights.shape == site.dropped.shape == (2, 12, 2)
    torch.testing.assert_close(site.weights.sum(-1), torch.ones(2, 12))
    assert set(out.aux_losses) == {f"layer{i}.moe/{n}" for i in (1, 3) for n in ("balance", "z_loss")}
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))


def test_one_expert_top1_equals_vanilla_with_the_same_weights():
    moe = _model(num_experts=1, top_k=1)
    torch.manual_seed(1)
    vanilla = build_model(ModelConfig(vocab_size=101, d_model=32, n_layer=4, n_head=4, block_size=32))
    state = {}
    for name, value in vanilla.state_dict().items():  # the old per-expert key layout, stacked on load
        state[name.replace(".mlp.", ".moe.experts.0.")] = value
    state.update({k: v for k, v in moe.state_dict().items() if "router" in k})
    moe.load_state_dict(state)
    idx = torch.randint(0, 101, (2, 16))
    torch.testing.assert_close(moe(idx).logits, vanilla(idx).logits)


def test_dropped_tokens_pass_the_ffn_unchanged():
    model = _model(num_experts=4, top_k=1, dropless=False, capacity_factor=0.5, layers=[2])
    out = model(torch.randint(0, 101, (2, 16)), return_residuals=True)
    dropped = out.trace[0].dropped.squeeze(-1)
    assert dropped.any() and not dropped.all()
    states = {(s.tag, s.layer): s.hidden for s in out.residuals}
    before, after = states[("mha", 2)], states[("ffn", 2)]
    assert torch.equal(after[dropped], before[dropped])
    assert not torch.allclose(after[~dropped], before[~dropped])


@pytest.mark.parametrize("moe", [dict(num_experts=4, top_k=2, layers="odd"),
                                 dict(num_experts=8, top_k=1, dropless=False, capacity_factor=0.5)])
def test_flops_match_flop_counter(moe):
    model = _model(**moe)
    idx = torch.randint(0, 101, (3, 20))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    flops = model.flops_per_token(out.trace, seq_len=20)
    assert flops.forward * idx.numel() == pytest.approx(counter.get_total_flops())
    assert flops.forward <= model.flops_per_token(seq_len=20).forward  # dropping only removes work


def test_expected_flops_equal_vanilla_plus_router_for_switch():
    from architectures.flops import vanilla_flops

    model = _model(num_experts=8, top_k=1)
    cfg = model.config
    want = vanilla_flops(cfg).forward + cfg.n_layer * 2 * cfg.d_model * 8
    assert model.flops_per_token().forward == pytest.approx(want)


def test_padding_is_not_routed_and_does_not_change_real_tokens():
    model = _model(num_experts=4, top_k=2).eval()
    idx = torch.randint(0, 101, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    out = model(idx, attention_mask=mask)
    alone = model(idx[1:, :6])
    torch.testing.assert_close(out.logits[1, :6], alone.logits[0])
    counts = out.trace[0].counts()
    assert int(counts.sum()) == 2 * 16


@pytest.mark.parametrize("moe,field", [
    (dict(num_experts=2, top_k=3), "model.moe.top_k"),
    (dict(capacity_factor=0.0), "model.moe.capacity_factor"),
    (dict(num_experts=0), "model.moe.num_experts"),
    (dict(layers=[1, 4]), "model.moe.layers"),
    (dict(layers="every"), "model.moe.layers"),
])
def test_variant_rejects_bad_config_naming_the_field(moe, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(**moe).resolve()


# ---------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_short_run(tmp_path):
    s = cli_summary("moe", tmp_path, "--model.moe.num_experts", "8", "--model.moe.top_k", "1")
    flops = s["flops_per_token"]["components"]
    d, L, hidden = 32, 2, 128
    # dropless top-1: exactly one expert (same width as the dense FFN) per token, plus an 8-way router
    assert flops["ffn"] == pytest.approx(L * 2 * 2 * d * hidden)
    assert flops["router"] == pytest.approx(L * 2 * d * 8)
    assert s["flops_per_token"]["ratio_to_vanilla"] == pytest.approx(1 + flops["router"] / (s["flops_per_token"]["forward"] - flops["router"]))
    assert set(s["routing"]) == {"layer0.moe", "layer1.moe"}
    for fractions in s["routing"].values():
        assert sum(fractions.values()) == pytest.approx(1.0)


def test_moe_layer_accepts_zero_tokens():
    """A routed block (MoDE) can hand the MoE layer no tokens at all; that must cost and return nothing."""
    from architectures.moe_layer import MoEConfig
    from architectures.moe_layer import MoELayer

    layer = MoELayer(16, 32, MoEConfig(num_experts=4, top_k=2, dropless=False))
    x = torch.randn(2, 0, 16, requires_grad=True)
    result = layer(x)
    assert result.output.shape == (2, 0, 16)
    assert all(float(v) == 0.0 for v in result.aux_losses.values())
    (result.output.sum() + sum(result.aux_losses.values())).backward()


def test_switch_top1_router_learns_through_the_expert_output():
    """k=1: the output is scaled by the raw probability, so the LM loss alone trains the router."""
    from architectures.moe_layer import MoEConfig

    torch.manual_seed(0)
    layer = MoELayer(16, 32, MoEConfig(num_experts=4, top_k=1, balance_coef=0.0, z_loss_coef=0.0))
    x = torch.randn(2, 8, 16)
    result = layer(x)
    assert (result.site.weights < 1).all()  # raw softmax probabilities, not renormalised to 1
    result.output.pow(2).sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
