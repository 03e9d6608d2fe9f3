"""Mixture-of-Depths (``mod``) and MoDE (``mode_staged``, ``mode_integrated``).

Routing semantics (k tokens, order, bypass, padding), equivalence with GPT-2 at capacity 1, causal
sampling with a KV cache, FLOPs against torch's FlopCounterMode, config errors and a CLI run.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ConfigError, KVCache, ModelConfig, build_model
from architectures.mod import MoDConfig, RoutedBlock
from architectures.moe_layer import MoEConfig

V, T = 97, 64
TINY_RUN = [  # conftest.TINY_RUN's tiny CLI overrides (conftest is not importable as a module)
    "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2", "--model.block_size", "64",
    "--data.batch_size", "4", "--val_blocks", "8", "--trainer.enable_progress_bar", "false",
]


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: a second intra-op thread only adds waiting on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(variant="mod", **mod) -> ModelConfig:
    return ModelConfig(variant=variant, size="tiny", d_model=64, n_layer=4, n_head=4, block_size=T, vocab_size=V,
                       mod=MoDConfig(**mod), moe=MoEConfig(num_experts=4, top_k=1))


def model(variant="mod", seed=0, **mod):
    torch.manual_seed(seed)
    return build_model(tiny(variant, **mod))


def tokens(B=3, length=T, seed=1):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def mod_sites(out):
    return [s for s in out.trace if s.group == "mod"]


# ---------------------------------------------------------------------------- routing semantics
@pytest.mark.parametrize("capacity,length", [(0.125, 64), (0.25, 40), (0.5, 33)])
def test_each_routed_block_processes_exactly_k_tokens_and_only_them(capacity, length):
    m = model(capacity=capacity)
    k = math.floor(capacity * length)
    seen = {}
    hooks = [m.blocks[i].attn.c_attn.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(("attn", i), inp[0].shape))
             for i in (1, 3)]
    hooks += [m.blocks[i].mlp.c_fc.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(("mlp", i), inp[0].shape))
              for i in (1, 3)]
    out = m(tokens(3, length))
    for h in hooks:
        h.remove()
    # the block's matmuls run on (B, k, .) only: compute is really saved
    assert all(shape[:2] == (3, k) for shape in seen.values()) and len(seen) == 4
    sites = mod_sites(out)
    assert [s.name for s in sites] == ["block1.mod", "block3.mod"] and [s.step for s in sites] == [0, 1]
    for s in sites:
        assert s.kind == "expert_choice" and s.choice_names == ["skip", "block"]
        assert s.selected.shape == (3, length, 1)
        assert s.selected.sum(dim=(1, 2)).tolist() == [k] * 3
        # the chosen tokens are the router's top k, and the weights are the router outputs there
        top = s.logits.topk(k, dim=1).indices
        assert torch.equal(torch.zeros_like(s.logits).scatter(1, top, 1.0).long(), s.selected[..., 0])
        chosen = s.selected[..., 0].bool()
        assert torch.equal(s.weights[..., 0][chosen], s.logits[chosen]) and not s.weights[..., 0][~chosen].any()
        assert s.counts().tolist() == [3 * (length - k), 3 * k]


def test_unselected_tokens_pass_a_routed_block_bit_for_bit():
    m = model(capacity=0.25)
    out = m(tokens(), return_residuals=True)
    states = {(s.tag, s.layer): s.hidden for s in out.residuals}
    assert len(out.residuals) == 1 + 2 * 4
    for site, layer in zip(mod_sites(out), (1, 3)):
        chosen = site.selected[..., 0].bool()
        before, mid, after = states[("ffn", layer - 1)], states[("mha", layer)], states[("ffn", layer)]
        assert torch.equal(after[~chosen], before[~chosen]) and torch.equal(mid[~chosen], before[~chosen])
        assert not torch.isclose(after[chosen], before[chosen]).all(dim=-1).any()


def test_selected_tokens_attend_causally_among_themselves_only():
    """The update of a chosen token equals the block run on the chosen subsequence alone."""
    m = model(capacity=0.25)
    block: RoutedBlock = m.blocks[1]
    out = m(tokens(B=1), return_residuals=True)
    states = {(s.tag, s.layer): s.hidden for s in out.residuals}
    x = states[("ffn", 0)][0]
    site = mod_sites(out)[0]
    pos = site.selected[0, :, 0].nonzero().squeeze(-1)
    assert torch.equal(pos, pos.sort().values)
    xs = x[pos].unsqueeze(0)
    r = site.logits[0, pos].view(1, -1, 1)
    a = block.attn(block.ln_1(xs))
    f = a + block.mlp(block.ln_2(xs + a))
    torch.testing.assert_close(states[("ffn", 1)][0, pos], (xs + r * f)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routed", ["odd", "all"])
def test_capacity_one_with_unit_router_weight_reproduces_vanilla_exactly(routed):
    torch.manual_seed(0)
    vanilla = build_model(tiny("vanilla"))
    m = model(capacity=1.0, routed_blocks=routed, seed=5)
    missing, unexpected = m.load_state_dict(vanilla.state_dict(), strict=False)
    assert not unexpected and all(".router." in k or ".predictor." in k for k in missing)
    m.fixed_router_weight = 1.0
    idx = tokens()
    assert torch.equal(m(idx).logits, vanilla(idx).logits)
    m.fixed_router_weight = None  # the learned router weight scales the update: no longer vanilla
    assert not torch.allclose(m(idx).logits, vanilla(idx).logits)


def test_padding_is_never_chosen_while_a_real_token_is_left_out():
    m = model(capacity=0.125, sampling="none")  # k = 8 of 64
    pad = 0
    with torch.no_grad():  # make padding the router's favourite, so only the mask can keep it out
        for i in (1, 3):
            m.blocks[i].router.weight.zero_()
            m.blocks[i].router.weight[0, 0] = 1.0
        m.wte.weight[pad, 0] = 100.0
    idx = tokens(B=3)
    idx[idx == pad] = 1
    mask = torch.ones(3, T, dtype=torch.long)
    for row, real in enumerate((5, 20, T)):
        idx[row, real:] = pad
        mask[row, real:] = 0
    out = m(idx, attention_mask=mask)
    unmasked = m(idx)
    for s, s_free in zip(mod_sites(out), mod_sites(unmasked)):
        chosen, valid = s.selected[..., 0].bool(), mask.bool()
        assert torch.equal(s.valid, valid)
        # k from each row's real length: max(1, floor(0.125 * 5)) = 1, floor(0.125 * 20) = 2, 8; no padding
        assert not (chosen & ~valid).any() and chosen.sum(dim=1).tolist() == [1, 2, 8]
        assert s_free.selected[1, 20:].sum() == 8  # without the mask the router would take padding
        assert s.counts().tolist() == [89 - 11, 11]  # statistics see the 89 real tokens only
    torch.testing.assert_close(out.logits[2], unmasked.logits[2])


# ---------------------------------------------------------------------------- causal sampling
@pytest.mark.parametrize("sampling,loss_name", [("predictor", "predictor_bce"), ("aux_loss", "router_bce")])
def test_sampling_losses_and_agreement(sampling, loss_name):
    m = model(sampling=sampling)
    out = m(tokens())
    assert set(out.aux_losses) == {f"block1.mod/{loss_name}", f"block3.mod/{loss_name}"}
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    for s in mod_sites(out):
        decision = (m.blocks[s.step * 2 + 1].predictor_logits(_block_input(m, s.step * 2 + 1)) > 0
                    if sampling == "predictor" else s.logits > 0)
        expected = (decision == s.selected[..., 0].bool()).float().mean()
        torch.testing.assert_close(s.extras["causal_agreement"], expected)


def _block_input(m, layer):
    out = m(tokens(), return_residuals=True)
    return {(s.tag, s.layer): s.hidden for s in out.residuals}[("ffn", layer - 1)]


def test_predictor_loss_trains_the_predictor_only():
    m = model(sampling="predictor")
    idx = tokens()
    grads = []
    for with_aux in (False, True):
        m.zero_grad(set_to_none=True)
        out = m(idx)
        lm = F.cross_entropy(out.logits.reshape(-1, V), idx.roll(-1, 1).reshape(-1))
        (lm + out.aux_loss if with_aux else lm).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    lm_only, full = grads
    assert all(".predictor." not in n for n in lm_only)
    assert {n for n in full if ".predictor." in n} == {n for n, _ in m.named_parameters() if ".predictor." in n}
    for name, g in lm_only.items():
        assert torch.equal(full[name], g), name
    assert lm_only["blocks.1.router.weight"].abs().sum() > 0  # the router learns through r * f


def test_router_bce_reaches_the_router():
    m = model(sampling="aux_loss")
    out = m(tokens())
    out.aux_losses["block1.mod/router_bce"].backward()
    assert m.blocks[1].router.weight.grad.abs().sum() > 0
    # it shapes the residual stream below the router too (paper: it touches the LM objective), never above
    later = [p for n, p in m.named_parameters() if n.startswith(("blocks.2.", "blocks.3.", "ln_f."))]
    later += [p for n, p in m.blocks[1].named_parameters() if not n.startswith("router.")]
    assert all(p.grad is None for p in later)


def test_cached_decoding_matches_the_full_causal_forward_and_skips_write_no_cache():
    m = model().eval()
    idx = tokens(B=2, length=24, seed=7)
    with torch.no_grad(), m.causal_routing():
        full = m(idx)
        cache = KVCache()
        steps = [m(idx[:, :10], cache=cache)] + [m(idx[:, t:t + 1], cache=cache) for t in range(10, 24)]
    logits = torch.cat([s.logits for s in steps], dim=1)
    torch.testing.assert_close(logits, full.logits, rtol=1e-4, atol=1e-5)
    for j, site in enumerate(mod_sites(full)):
        per_step = torch.cat([mod_sites(s)[j].selected for s in steps], dim=1)
        assert torch.equal(per_step, site.selected)  # same decisions token by token
        for row in range(2):
            processed = int(site.selected[row].sum())
            assert 0 < processed < 24
            assert cache.length(f"block{2 * j + 1}.row{row}") == processed  # skipped tokens wrote nothing
    assert cache.length("block0") == cache.length("block2") == 24 and cache.offset == 24


def test_generate_is_causal_and_cache_free_generation_agrees():
    m = model()
    prompt = tokens(B=2, length=6, seed=9)
    with_cache = m.generate(prompt, 20, greedy=True)
    without = m.generate(prompt, 20, greedy=True, use_cache=False)
    assert torch.equal(with_cache, without)
    with torch.no_grad(), m.causal_routing():
        full = m(with_cache[:, :-1])
    assert torch.equal(full.logits[:, 5:].argmax(-1), with_cache[:, 6:])  # the full pass picks the same tokens


def test_trained_predictor_agrees_with_the_full_sequence_top_k():
    """After training the predictors, generation processes largely the tokens a full pass would pick."""
    m = model(capacity=0.25)
    params = [p for n, p in m.named_parameters() if ".predictor." in n]
    for p in m.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(150):
        out = m(tokens(B=8, seed=100 + step))
        opt.zero_grad()
        out.aux_loss.backward()
        opt.step()
    agreement = [float(s.extras["causal_agreement"]) for s in mod_sites(m(tokens(B=16, seed=1)))]
    assert min(agreement) > 0.85
    generated = m.generate(tokens(B=4, length=8, seed=2), T - 8, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), m.causal_routing():
        causal = mod_sites(m(generated))
    with torch.no_grad():
        top_k = mod_sites(m(generated))
    first = (causal[0].selected == top_k[0].selected).float().mean()
    assert first > 0.85  # block 1 sees the same inputs in both passes: pure predictor accuracy


def test_generate_refuses_without_a_causal_decision():
    m = model(sampling="none")
    with pytest.raises(ConfigError, match=r"^model\.mod\.sampling"):
        m.generate(tokens(B=1, length=4), 3)


# ---------------------------------------------------------------------------- FLOPs
def counted_flops(m, idx, causal=False):
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if causal:
            with m.causal_routing():
                out = m(idx)
        else:
            out = m(idx)
    return counter.get_total_flops(), out


@pytest.mark.parametrize("variant,sampling,causal", [
    ("mod", "predictor", False), ("mod", "aux_loss", False), ("mod", "predictor", True),
    ("mode_staged", "predictor", False), ("mode_staged", "predictor", True), ("mode_integrated", "none", False),
])
def test_flops_match_flop_counter(variant, sampling, causal):
    m = model(variant, sampling=sampling, capacity=0.25)
    B = 2
    counted, out = counted_flops(m, tokens(B), causal)
    analytic = m.flops_per_token(out.trace, T)
    assert analytic.forward * B * T == pytest.approx(counted, rel=1e-9)
    if variant == "mod" and not causal:
        assert m.flops_per_token(None, T).forward == pytest.approx(analytic.forward, rel=1e-12)


def test_flops_scale_with_capacity_and_capacity_squared():
    d, hidden = 64, 256
    full, quarter = model(capacity=1.0).flops_per_token(None, T), model(capacity=0.25).flops_per_token(None, T)
    vanilla = build_model(tiny("vanilla")).flops_per_token(None, T)
    assert full.attn_proj == vanilla.attn_proj and full.ffn == vanilla.ffn
    dense_scores = 4 * T * d
    assert quarter.attn_scores == pytest.approx(2 * dense_scores + 2 * dense_scores * 0.25 ** 2)
    assert quarter.ffn == pytest.approx((2 + 2 * 0.25) * 4 * d * hidden)
    assert quarter.router == pytest.approx(2 * (2 * d + 2 * d * 64 + 2 * 64))  # router + predictor


# ---------------------------------------------------------------------------- MoDE
def test_mode_staged_routes_around_an_moe_block():
    m = model("mode_staged", capacity=0.25)
    shapes = []
    hook = m.blocks[1].mlp.register_forward_hook(lambda mod, inp, out: shapes.append(inp[0].shape))
    out = m(tokens())
    hook.remove()
    assert shapes == [(3, 16, 64)]  # the MoE layer sees only the k routed tokens
    sites = {s.name: s for s in out.trace}
    assert set(sites) == {"block0.moe", "block1.mod", "block1.moe", "block2.moe", "block3.mod", "block3.moe"}
    assert [sites[f"block{i}.moe"].step for i in range(4)] == [0, 1, 2, 3]
    moe, mod = sites["block1.moe"], sites["block1.mod"]
    assert moe.selected.shape == (3, T, 1) and torch.equal(moe.valid, mod.selected[..., 0].bool())
    assert int(moe.counts().sum()) == 3 * 16
    assert {"block1.mod/predictor_bce", "block1.moe/balance"} <= set(out.aux_losses)
    assert torch.equal(m.generate(tokens(B=2, length=5), 8, greedy=True),
                       m.generate(tokens(B=2, length=5), 8, greedy=True, use_cache=False))


def test_mode_integrated_uses_noop_experts_in_routed_blocks():
    m = model("mode_integrated", sampling="none", noop_experts=2)
    out = m(tokens(), return_residuals=True)
    sites = {s.name: s for s in out.trace}
    assert sites["block1.moe"].choice_names == ["expert0", "expert1", "expert2", "expert3", "skip", "skip"]
    assert sites["block1.moe"].group == "mode" and sites["block0.moe"].group == "moe"
    assert sites["block0.moe"].choice_names == ["expert0", "expert1", "expert2", "expert3"]
    states = {(s.tag, s.layer): s.hidden for s in out.residuals}
    skipped = sites["block1.moe"].selected[..., 0] >= 4
    assert skipped.any()
    assert torch.equal(states[("ffn", 1)][skipped], states[("mha", 1)][skipped])  # no-op: MLP skipped
    assert torch.equal(m.generate(tokens(B=2, length=5), 8, greedy=True),  # token choice: no predictor needed
                       m.generate(tokens(B=2, length=5), 8, greedy=True, use_cache=False))


def test_mode_integrated_noop_share_never_exceeds_the_budget_and_decoding_agrees():
    """Issue 12 §3.3: nothing kept the no-op from taking every token (97.6% after 300 steps)."""
    m = model("mode_integrated", sampling="none", capacity=0.25).eval()
    with torch.no_grad():
        for block in m.blocks:
            if block.moe.noop_experts:  # every token prefers the no-op: a constant feature, a large weight on it
                block.ln_2.bias[0] = 5.0
                block.moe.router.weight.zero_()
                block.moe.router.weight[block.moe.num_experts:, 0] = 10.0
    idx = tokens(B=2, length=40)
    out = m(idx)
    site = next(s for s in out.trace if s.group == "mode")
    skip_share = (site.selected >= 4).float().mean(dim=(1, 2))
    assert torch.all(skip_share <= 0.75 + 1e-6), f"no-op share per row {skip_share.tolist()}"
    assert torch.all(skip_share >= 0.7), "the budget should bind with a router that always prefers skipping"
    # the running budget travels on the cache: decoding makes the same choices as the full forward
    cache = KVCache()
    steps = [m(idx[:, :17], cache=cache)] + [m(idx[:, t:t + 1], cache=cache) for t in range(17, 40)]
    logits = torch.cat([o.logits for o in steps], dim=1)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)


def test_balance_loss_does_not_reward_skipping():
    """Issue 12 §3.3: with the no-op in f's denominator the loss was (1 - s)^2 at skip share s."""
    from architectures.routing import balance_loss

    E, N = 4, 400
    for skip in (0.0, 0.5, 0.9):
        n_skip = int(skip * N)
        selected = torch.cat([torch.full((n_skip, 1), E), torch.arange(N - n_skip).remainder(E).unsqueeze(-1)])
        probs = torch.full((N, E + 1), (1 - skip) / E)
        probs[:, E] = skip
        loss = balance_loss(probs, selected, E, torch.ones(N, dtype=torch.bool))
        torch.testing.assert_close(loss, torch.tensor(1.0), msg=f"skip share {skip}")


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("variant,mod,field", [
    ("mod", dict(capacity=0.0), "model.mod.capacity"),
    ("mod", dict(capacity=1.5), "model.mod.capacity"),
    ("mod", dict(routed_blocks=[1, 7]), "model.mod.routed_blocks"),
    ("mod", dict(routed_blocks=[]), "model.mod.routed_blocks"),
    ("mod", dict(routed_blocks="middle"), "model.mod.routed_blocks"),
    ("mod", dict(sampling="oracle"), "model.mod.sampling"),
    ("mod", dict(sampling="aux_loss", aux_loss_coef=0.0), "model.mod.aux_loss_coef"),
    ("mod", dict(sampling="predictor", predictor_hidden=0), "model.mod.predictor_hidden"),
    ("mode_staged", dict(capacity=2.0), "model.mod.capacity"),
    ("mode_integrated", dict(noop_experts=0), "model.mod.noop_experts"),
])
def test_bad_config_names_the_field(variant, mod, field):
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.")):
        tiny(variant, **mod).resolve()


@pytest.mark.parametrize("variant", ["mod", "mode_staged"])
def test_sequences_shorter_than_one_over_capacity_route_one_token(variant):
    """Issue 12 §3.4: T < 1/capacity raised ConfigError; every reference implementation takes k >= 1."""
    m = model(variant, capacity=0.125)
    for length in (1, 3, 7):
        out = m(tokens(length=length))
        assert all(s.selected.sum(dim=(1, 2)).tolist() == [1, 1, 1] for s in mod_sites(out))
    tiny("mod", capacity=0.01).resolve()  # k = floor(0.01 * 64) = 0 at block_size is k = 1, not an error


@pytest.mark.parametrize("variant", ["mod", "mode_staged"])
def test_an_example_does_not_depend_on_right_padding_or_batch_mates(variant):
    """Issue 12 §3.4: k came from the padded batch length, so an example changed with its batch-mates."""
    m = model(variant, capacity=0.25, sampling="none").eval()
    idx = tokens(B=3, length=48)
    mask = torch.ones(3, 48, dtype=torch.long)
    mask[0, 21:] = 0
    mask[1, 37:] = 0
    with torch.no_grad():
        padded = m(idx, attention_mask=mask)
        for row, length in enumerate((21, 37, 48)):
            alone = m(idx[row:row + 1, :length])
            torch.testing.assert_close(padded.logits[row, :length], alone.logits[0], atol=1e-5, rtol=1e-5)
            for s, s_alone in zip(mod_sites(padded), mod_sites(alone)):
                assert torch.equal(s.selected[row, :length], s_alone.selected[0])


@pytest.mark.parametrize("sampling", ["predictor", "aux_loss"])
def test_router_and_predictor_logits_are_fp32_under_bf16_autocast(sampling):
    """Issue 12 §3.4: F.linear(x.float(), w.float()) still ran in bf16 under autocast."""
    m = model(capacity=0.25, sampling=sampling)
    block = m.blocks[1]
    x = torch.randn(2, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = block.router_logits(x)
        out = m(tokens(B=2, length=16))
        predicted = block.predictor_logits(x) if block.predictor is not None else None
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, (x @ block.router.weight.t()).squeeze(-1), atol=1e-5, rtol=1e-5)
    assert all(s.logits.dtype == torch.float32 for s in mod_sites(out))
    if predicted is not None:
        assert predicted.dtype == torch.float32
        torch.testing.assert_close(predicted, block.predictor(x).squeeze(-1), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_run_reports_the_processed_token_fraction(tmp_path):
    from experiments import run
    folder = run.main(["--variant", "mod", "--max_steps", "3", "--log_dir", str(tmp_path),
                       "--model.mod.capacity", "0.25", *TINY_RUN])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["variant"] == "mod" and summary["steps"] == 3
    assert set(summary["routing"]) == {"block1.mod"}  # n_layer=2: block 1 is the only odd block
    assert summary["routing"]["block1.mod"]["block"] == pytest.approx(0.25)
    assert summary["routing"]["block1.mod"]["skip"] == pytest.approx(0.75)
    assert summary["flops_per_token"]["ratio_to_vanilla"] < 1.0
    assert math.isfinite(summary["final_val_loss"])


@pytest.mark.parametrize("capacity", [0.125, 0.29, 0.57])
def test_planned_k_is_the_k_the_router_takes(capacity):
    """The FLOPs plan (no trace) and the router use one capacity rule (c * T on a whole number counts as it)."""
    from architectures.routing import capacity_tokens, expert_choice_topk, row_capacity

    T = 100
    _, idx, real = expert_choice_topk(torch.randn(2, T), capacity, None)
    padded = row_capacity(capacity, torch.ones(2, T, dtype=torch.bool), 2, T, "cpu")
    assert real is None and idx.shape[1] == capacity_tokens(capacity, T) == int(padded[0]) == math.floor(capacity * T + 1e-9)
    model = build_model(ModelConfig(variant="mod", size="tiny", vocab_size=64, d_model=32, n_layer=2, n_head=2,
                                    block_size=T, mod=MoDConfig(capacity=capacity, routed_blocks="all", sampling="none")))
    out = model(torch.randint(0, 64, (2, T)))
    assert model.flops_per_token(None).forward == pytest.approx(model.flops_per_token(out.trace).forward, rel=1e-9)
