"""ffn_wider / caa / cea / cea_moe: Inner-path masking, equivalences with vanilla, parameters, cache, FLOPs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from architectures import build_model
from architectures.combination import CombinationLM, CombinationMoELM, FFNWider, strictly_causal_attention
from architectures.config import ConfigError, ModelConfig
from architectures.combination import CombinationConfig
from architectures.contract import KVCache
from architectures.gpt2 import GPT2, CausalSelfAttention
from tests.conftest import cli_summary

D, VOCAB, T = 32, 64, 16


def small(variant: str, bias: bool = True, **combo) -> ModelConfig:
    combo.setdefault("total_ffn_ratio", 4.0)
    return ModelConfig(variant=variant, vocab_size=VOCAB, d_model=D, n_layer=2, n_head=4, block_size=T,
                       bias=bias, combo=combo)  # a dict: the preset fills the rest


def build(variant: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return build_model(small(variant, **kw)).eval()


def tokens(B: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, t), generator=torch.Generator().manual_seed(seed))


def vanilla_like(model) -> GPT2:
    """A vanilla GPT-2 whose FFN width is the model's Outer-FFN width, loaded with the shared weights."""
    cfg = small("vanilla", bias=model.config.bias)
    cfg.ffn_ratio = model.outer_width / D
    gpt = build_model(cfg).eval()
    state = {k: v for k, v in model.state_dict().items() if ".inner." not in k}
    gpt.load_state_dict(state)
    return gpt


# ---------------------------------------------------------------------------- the Inner path
def masked_reference(q, k, v):
    """Naive scores with j < i allowed (queries = the last t_q positions); rows with no key -> 0."""
    t_q, t_k = q.shape[2], k.shape[2]
    pos_q = torch.arange(t_k - t_q, t_k)[:, None]
    allowed = torch.arange(t_k)[None, :] < pos_q
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs @ v


@pytest.mark.parametrize("t_q,t_k", [(7, 7), (1, 1), (1, 6), (3, 8), (5, 6)])
def test_strictly_causal_attention_matches_masked_reference(t_q, t_k):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, t, 8, generator=g) for t in (t_q, t_k, t_k))
    out = strictly_causal_attention(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, masked_reference(q, k, v), rtol=1e-5, atol=1e-6)
    if t_q == t_k:
        assert out[:, :, 0].abs().max() == 0  # the first position has no earlier key


@pytest.mark.parametrize("variant", ["caa", "cea", "cea_moe"])
def test_own_inner_ffn_output_has_no_effect_on_own_output(variant):
    model = build(variant)
    captured = []

    def keep(module, inputs, output):
        out = output.output if hasattr(output, "output") else output
        out.retain_grad()
        captured.append(out)

    hooks = [block.attn.inner.ffn.register_forward_hook(keep) for block in model.blocks]
    t = 6
    model(tokens()).logits[:, t].sum().backward()
    for h in hooks:
        h.remove()
    assert len(captured) == model.config.n_layer
    for inner_out in captured:
        grad = inner_out.grad
        assert grad[:, t].abs().max() == 0, "a token must not receive its own Inner-FFN output"
        assert grad[:, t + 1:].abs().max() == 0, "causality"
        assert (grad[:, :t].abs().sum(-1) > 0).all(), "earlier tokens' Inner-FFN outputs must reach token t"


def test_first_position_is_independent_of_the_inner_ffn_and_later_ones_are_not():
    model = build("caa")
    x = tokens()
    before = model(x).logits
    with torch.no_grad():
        for block in model.blocks:
            block.attn.inner.ffn.c_fc.weight.mul_(-3.0)
    after = model(x).logits
    torch.testing.assert_close(after[:, 0], before[:, 0], rtol=0, atol=0)
    assert (after[:, 1:] - before[:, 1:]).abs().amax() > 1e-4


# ---------------------------------------------------------------------------- equivalences with vanilla
@pytest.mark.parametrize("variant,combo", [("caa", dict(outer_ratio=1.0)), ("ffn_wider", dict(wide_ffn_ratio=8.0))])
def test_without_inner_ffn_the_model_is_vanilla_with_the_same_ffn_width(variant, combo):
    model = build(variant, **combo)
    assert model.inner_width == 0
    assert model.outer_width == (4 * D if variant == "caa" else 8 * D)
    gpt = vanilla_like(model)
    assert set(gpt.state_dict()) == set(model.state_dict())
    x = tokens()
    torch.testing.assert_close(model(x).logits, gpt(x).logits, rtol=0, atol=0)


def test_caa_at_r1_is_ffn_wider_with_the_same_width():
    caa = build("caa", total_ffn_ratio=8.0, outer_ratio=1.0)
    wide = build("ffn_wider", seed=3, wide_ffn_ratio=8.0)
    wide.load_state_dict(caa.state_dict())
    x = tokens()
    torch.testing.assert_close(caa(x).logits, wide(x).logits, rtol=0, atol=0)


def test_direct_pathway_alone_is_vanilla_attention():
    model = build("caa", outer_ratio=0.5)
    with torch.no_grad():
        for block in model.blocks:
            inner = block.attn.inner
            for p in (inner.ffn.c_proj.weight, inner.ffn.c_proj.bias, inner.v_proj.bias, inner.c_proj.bias):
                p.zero_()
    x = tokens()
    torch.testing.assert_close(model(x).logits, vanilla_like(model)(x).logits, rtol=1e-6, atol=1e-6)
    # the same at the MHA level: the direct pathway is CausalSelfAttention with the same weights
    block = model.blocks[0]
    mha = CausalSelfAttention(D, 4)
    mha.load_state_dict({k: v for k, v in block.attn.state_dict().items() if not k.startswith("inner.")})
    h = torch.randn(2, T, D)
    torch.testing.assert_close(block.attn(h)[0], mha(h), rtol=1e-6, atol=1e-6)


def test_inner_path_is_softmax_nodiag_of_the_shared_scores_through_v_inner_and_o_prime():
    model = build("caa")
    attn = model.blocks[0].attn
    h = torch.randn(2, T, D)
    q, k, v = (attn.split_heads(t) for t in attn.c_attn(h).chunk(3, dim=-1))
    direct = attn.c_proj(attn.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    v_inner = attn.split_heads(attn.inner.v_proj(attn.inner.ffn(h)))
    inner = attn.inner.c_proj(attn.merge_heads(masked_reference(q, k, v_inner)))
    torch.testing.assert_close(attn(h)[0], direct + inner, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- residual snapshots
@pytest.mark.parametrize("variant,combo", [("caa", {}), ("caa", dict(outer_ratio=0.0)), ("cea_moe", {})])
def test_residuals_separate_mha_with_inner_ffn_from_the_outer_ffn(variant, combo):
    model = build(variant, **combo)
    out = model(tokens(), return_residuals=True)
    tags = [s.tag for s in out.residuals]
    assert tags == ["embed"] + ["mha", "ffn"] * model.config.n_layer
    embed, mha, ffn = out.residuals[0].hidden, out.residuals[1].hidden, out.residuals[2].hidden
    block = model.blocks[0]
    torch.testing.assert_close(mha - embed, block.attn(block.ln_1(embed))[0], rtol=1e-5, atol=1e-5)
    if model.outer_width:
        torch.testing.assert_close(ffn - mha, block.mlp(block.ln_2(mha)), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(ffn, mha)
    torch.testing.assert_close(model.head(out.residuals[-1].hidden), out.logits)


# ---------------------------------------------------------------------------- presets and parameters
def test_presets_fix_the_ratios():
    cea = build_model(ModelConfig(variant="cea"))
    d = cea.config.d_model
    assert (cea.outer_width, cea.inner_width) == (4 * d, 28 * d)
    moe = build_model(ModelConfig(variant="cea_moe"))
    assert (moe.outer_width, moe.inner_width) == (4 * d, 4 * d)
    assert moe.blocks[0].attn.inner.ffn.num_experts == 4 and moe.blocks[0].attn.inner.ffn.top_k == 1
    caa = build_model(ModelConfig(variant="caa"))
    assert (caa.outer_width, caa.inner_width) == (16 * d, 16 * d)
    wide = build_model(ModelConfig(variant="ffn_wider"))
    assert (wide.outer_width, wide.inner_width) == (32 * d, 0)
    # a user value survives the preset
    cfg = ModelConfig(variant="cea", combo=CombinationConfig(outer_ratio=0.25))
    assert build_model(cfg).outer_width == 8 * d


@pytest.mark.parametrize("variant,bias,combo", [
    ("ffn_wider", True, {}), ("ffn_wider", False, dict(wide_ffn_ratio=2.0)), ("caa", True, {}),
    ("caa", False, dict(outer_ratio=0.25)), ("caa", True, dict(outer_ratio=0.0)), ("caa", True, dict(outer_ratio=1.0)),
    ("cea", True, {}), ("cea_moe", True, {}), ("cea_moe", False, dict(inner_experts=3, inner_top_k=2)),
])
def test_parameter_count_matches_closed_form(variant, bias, combo):
    model = build(variant, bias=bias, **combo)
    d, b, L = D, int(bias), 2
    outer, inner = model.outer_width, model.inner_width
    mlp = lambda h: 2 * d * h + b * (h + d)  # noqa: E731
    E = model.config.combo.inner_experts
    per_inner = (E * mlp(inner) + d * E) if variant == "cea_moe" else mlp(inner)
    per_block = (2 * d + 4 * d * d + 4 * b * d  # ln_1, c_attn (d->3d), c_proj (O)
                 + (per_inner + 2 * (d * d + b * d) if inner else 0)  # Inner-FFN, V_inner, O'
                 + (2 * d + mlp(outer) if outer else 0))  # ln_2, Outer-FFN
    expected = VOCAB * d + T * d + L * per_block + 2 * d  # wte (tied head), wpe, blocks, ln_f
    assert model.num_parameters() == expected == model.num_parameters_formula()
    assert outer + inner == (model.config.combo.wide_ffn_ratio * d if variant == "ffn_wider"
                             else model.config.combo.total_ffn_ratio * d)


def test_cache_reorder_keeps_the_inner_values_with_their_rows():
    model = build("cea_moe")
    x = tokens(B=3, t=8)
    cache = KVCache()
    model(x[:, :7], cache=cache)
    order = torch.tensor([2, 0, 2])
    cache.reorder(order)
    step = model(x[order, 7:], cache=cache).logits[:, -1]
    torch.testing.assert_close(step, model(x[order]).logits[:, -1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("variant,combo", [
    ("ffn_wider", dict(wide_ffn_ratio=8.0)), ("caa", {}), ("caa", dict(outer_ratio=0.0)), ("caa", dict(outer_ratio=1.0)),
    ("cea", {}), ("cea_moe", {}), ("cea_moe", dict(inner_experts=3, inner_top_k=2)),
])
def test_flops_match_flop_counter(variant, combo):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build(variant, **combo)
    B = 2
    x = tokens(B)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        out = model(x)
    measured = counter.get_total_flops() / (B * T)
    flops = model.flops_per_token(out.trace, T)
    assert flops.forward == pytest.approx(measured, rel=1e-9)
    d = D
    outer, inner = model.outer_width, model.inner_width
    expected_ffn = 2 * (4 * d * outer) + (0 if variant == "cea_moe" else 2 * 4 * d * inner)
    if variant == "cea_moe":
        assert flops.ffn > expected_ffn and flops.router == pytest.approx(2 * 2 * d * model.config.combo.inner_experts)
    else:
        assert flops.ffn == pytest.approx(expected_ffn) and flops.router == 0
    inner_scores = 4 * d * (T - 1) ** 2 / T if inner else 0.0
    assert flops.attn_scores == pytest.approx(2 * (4 * d * T + inner_scores))
    # no trace: the expected figure (top-k experts per token, nothing dropped in dropless mode)
    assert model.flops_per_token(None, T).forward == pytest.approx(flops.forward)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("variant,combo,field", [
    ("caa", dict(outer_ratio=1.5), "model.combo.outer_ratio"),
    ("caa", dict(outer_ratio=-0.1), "model.combo.outer_ratio"),
    ("caa", dict(outer_ratio=0.3), "model.combo.outer_ratio"),  # 0.3 * 128 = 38.4 units
    ("cea", dict(total_ffn_ratio=4.01), "model.combo.total_ffn_ratio"),  # W = 128.32
    ("caa", dict(total_ffn_ratio=0.0), "model.combo.total_ffn_ratio"),
    ("ffn_wider", dict(wide_ffn_ratio=0.0), "model.combo.wide_ffn_ratio"),
    ("ffn_wider", dict(wide_ffn_ratio=4.1), "model.combo.wide_ffn_ratio"),
    ("cea_moe", dict(inner_experts=0), "model.combo.inner_experts"),
    ("cea_moe", dict(inner_experts=2, inner_top_k=3), "model.combo.inner_top_k"),
    ("cea_moe", dict(outer_ratio=1.0), "model.combo.outer_ratio"),
])
def test_bad_config_names_the_field(variant, combo, field):
    with pytest.raises(ConfigError) as err:
        build(variant, **combo)
    assert str(err.value).startswith(field + ":")


def test_cea_moe_reports_routing_sites_and_aux_losses():
    model = build("cea_moe")
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 10:] = 0
    out = model(tokens(), attention_mask=mask)
    assert [s.name for s in out.trace] == ["block0.inner_moe", "block1.inner_moe"]
    assert [(s.group, s.step) for s in out.trace] == [("inner_moe", 0), ("inner_moe", 1)]
    assert out.trace[0].selected.shape == (2, T, 1) and torch.equal(out.trace[0].valid, mask.bool())
    assert set(out.aux_losses) == {f"block{i}.inner_moe/{n}" for i in range(2) for n in ("balance", "z_loss")}
    assert out.aux_loss.item() == pytest.approx(sum(v.item() for v in out.aux_losses.values()))
    assert build("caa")(tokens()).trace == []


def test_classes_are_registered():
    from architectures.registry import get_variant

    assert get_variant("ffn_wider").model_class() is FFNWider
    assert get_variant("caa").model_class() is CombinationLM is get_variant("cea").model_class()
    assert get_variant("cea_moe").model_class() is CombinationMoELM


# ---------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_cea_runs_with_the_preset_widths(tmp_path):
    s = cli_summary("cea", tmp_path)
    d, L, W = 32, 2, 32 * 32  # TINY_RUN width and depth; W = 32d, Outer 4d + Inner 28d
    flops = s["flops_per_token"]["components"]
    assert flops["ffn"] == pytest.approx(L * 2 * 2 * d * W)
    assert flops["attn_proj"] == pytest.approx(L * 12 * d * d)  # QKV, O, V_inner, O'
    assert flops["router"] == 0 and s["routing"] == {}


@pytest.mark.slow
def test_cli_cea_moe_reports_inner_routing(tmp_path):
    s = cli_summary("cea_moe", tmp_path, "--model.combo.inner_experts", "2")
    d, L = 32, 2
    flops = s["flops_per_token"]["components"]
    # dense 4d Outer-FFN + exactly one 4d expert per token (dropless top-1) + a 2-way router
    assert flops["ffn"] == pytest.approx(L * 2 * (2 * 2 * d * 4 * d))
    assert flops["router"] == pytest.approx(L * 2 * d * 2)
    assert set(s["routing"]) == {"block0.inner_moe", "block1.inner_moe"}
    for shares in s["routing"].values():
        assert set(shares) == {"expert0", "expert1"} and sum(shares.values()) == pytest.approx(1.0)


def test_cli_rejects_bad_ratio_before_any_work(tmp_path):
    from experiments import run
    with pytest.raises(ConfigError, match=r"^model\.combo\.outer_ratio: must be in \[0, 1\]"):
        run.main(["--variant", "caa", "--model.combo.outer_ratio", "1.5", "--max_steps", "3", "--log_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())
