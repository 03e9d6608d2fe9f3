"""Mixture of Transformers: subset attention semantics, vanilla equivalence, KV cache, FLOPs, errors."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import KVCache, ModelConfig, build_model
from architectures.config import ConfigError
from architectures.mot import MoTConfig, MoTLayer
from tests.conftest import cli_summary


def tiny_config(**mot) -> ModelConfig:
    return ModelConfig(variant="mot", vocab_size=101, d_model=32, n_layer=3, n_head=4, block_size=32,
                       mot=MoTConfig(**mot))


def _model(**mot):
    torch.manual_seed(0)
    return build_model(tiny_config(**mot))


def naive_mot_layer(layer: MoTLayer, x: torch.Tensor) -> torch.Tensor:
    """Reference: per sequence and expert, run the block on exactly the tokens routed to it."""
    logits = x.float() @ layer.gate.weight.float().t()
    w, sel = logits.softmax(-1).topk(layer.cfg.top_k, dim=-1)
    if layer.cfg.renormalize and w.shape[-1] > 1:
        w = w / w.sum(-1, keepdim=True)
    rows = []
    for b in range(x.shape[0]):
        row = x[b]
        for e, block in enumerate(layer.experts):
            gate = ((sel[b] == e) * w[b]).sum(-1)  # (T,)
            idx = gate.nonzero().squeeze(-1)
            if idx.numel():
                sub = x[b, idx].unsqueeze(0)
                update = (block(sub) - sub)[0] * gate[idx].unsqueeze(-1)
                row = row.index_add(0, idx, update)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("E,k,renorm", [(4, 2, True), (3, 1, True), (4, 2, False)])
def test_layer_matches_per_sequence_subset_reference_forward_and_grad(E, k, renorm):
    model = _model(num_experts=E, top_k=k, renormalize=renorm)
    layer = model.blocks[0]
    x = torch.randn(3, 11, 32, requires_grad=True)
    got, _, site, _ = layer.mix(x)
    want = naive_mot_layer(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(want)
    grads = []
    for out in (got, want):
        layer.zero_grad(set_to_none=False)
        x.grad = None
        (out * upstream).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in layer.parameters()] + [x.grad.clone()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert layer.gate.weight.grad.abs().sum() > 0, "the gate must receive gradient through the weights"


def test_one_expert_top1_equals_vanilla_block_and_model():
    mot = _model(num_experts=1, top_k=1)
    torch.manual_seed(1)
    vanilla = build_model(ModelConfig(vocab_size=101, d_model=32, n_layer=3, n_head=4, block_size=32))
    state = {k.replace("blocks.", "", 1): v for k, v in vanilla.state_dict().items()}
    new = {}
    for name in mot.state_dict():
        if ".gate." in name:
            new[name] = mot.state_dict()[name]
        elif ".experts.0." in name:
            i, rest = name.split(".", 2)[1], name.split(".experts.0.", 1)[1]
            new[name] = state[f"{i}.{rest}"]
        else:
            new[name] = vanilla.state_dict()[name]
    mot.load_state_dict(new)
    x = torch.randn(2, 9, 32)
    out, after_attn, _, _ = mot.blocks[1].mix(x, want_attn=True)
    torch.testing.assert_close(out, vanilla.blocks[1](x))
    block = vanilla.blocks[1]
    torch.testing.assert_close(after_attn, x + block.attn(block.ln_1(x)))
    idx = torch.randint(0, 101, (2, 16))
    torch.testing.assert_close(mot(idx).logits, vanilla(idx).logits)


def test_expert_cache_holds_only_its_tokens():
    model = _model(num_experts=4, top_k=2).eval()
    cache = KVCache()
    out = model(torch.randint(0, 101, (1, 12)), cache=cache)
    counts = out.trace[0].counts()
    for e in range(4):
        assert cache.length(f"block0.expert{e}") == int(counts[e])


def test_padding_is_not_routed_and_passes_unchanged():
    model = _model(num_experts=4, top_k=2)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    out = model(torch.randint(0, 101, (2, 10)), attention_mask=mask, return_residuals=True)
    states = [s.hidden for s in out.residuals]
    pad = ~mask.bool()
    for before, after in zip(states[:-1], states[1:]):
        assert torch.equal(before[pad], after[pad])
    assert int(out.trace[0].counts().sum()) == 2 * 17


def test_trace_balance_loss_and_flops():
    model = _model(num_experts=4, top_k=2, layers=[0, 2])
    idx = torch.randint(0, 101, (2, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    assert [s.name for s in out.trace] == ["layer0.mot", "layer2.mot"]
    assert out.trace[0].kind == "token_choice" and out.trace[0].selected.shape == (2, 16, 2)
    assert set(out.aux_losses) == {"layer0.mot/balance", "layer2.mot/balance"}
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    flops = model.flops_per_token(out.trace, seq_len=16)
    assert flops.forward * idx.numel() == pytest.approx(counter.get_total_flops())
    out.aux_loss.backward()
    assert model.blocks[0].gate.weight.grad.abs().sum() > 0


def test_expected_flops_without_trace_for_balanced_routing():
    from architectures import flops as cost

    model = _model(num_experts=4, top_k=2, layers=[1])
    T, d = 32, 32
    dense = cost.dense_block(d, 128, T)
    mixture = cost.Flops(attn_proj=2 * dense.attn_proj, ffn=2 * dense.ffn, router=2 * d * 4,
                       attn_scores=4 * (T * 2 / 4) * d * 2)
    want = dense.scale(2) + mixture + cost.lm_head(d, 101)
    assert model.flops_per_token().forward == pytest.approx(want.forward)


@pytest.mark.parametrize("mot,field", [
    (dict(num_experts=2, top_k=3), "model.mot.top_k"),
    (dict(num_experts=0, top_k=1), "model.mot.num_experts"),
    (dict(layers=[3]), "model.mot.layers"),
    (dict(balance_coef=-1.0), "model.mot.balance_coef"),
])
def test_rejects_bad_config_naming_the_field(mot, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config(**mot).resolve()


@pytest.mark.slow
def test_cli_short_run(tmp_path):
    s = cli_summary("mot", tmp_path, "--model.mot.num_experts", "4", "--model.mot.top_k", "2")
    flops = s["flops_per_token"]["components"]
    d, L = 32, 2
    # top-2 of whole blocks: every token runs two blocks' projections and FFNs at every layer
    assert flops["attn_proj"] == pytest.approx(2 * L * 4 * 2 * d * d)
    assert flops["router"] == pytest.approx(L * 2 * d * 4)
    assert flops["ffn"] == pytest.approx(2 * L * 2 * 2 * d * 4 * d)
    assert s["flops_per_token"]["ratio_to_vanilla"] > 1.0
    assert set(s["routing"]) == {"layer0.mot", "layer1.mot"}
