"""Paper-faithful options (issue 17): each option's DEFINING property, at tiny sizes.

The named setups (``moe_dense_ffn``, ``depth_gate_skip``, ``mot_seq``, ``caa_paper``, ``cea_moe_paper``,
``mom_official``) are registry entries, so tests/test_contract.py runs the whole invariant suite on them;
this file checks what makes each option the paper's form.
"""
from __future__ import annotations

import pytest
import torch

from architectures import build_model
from architectures import flops as cost
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
    score_pass = cost.attention_scores(d, (T - 1) ** 2 / T)
    expected = cea.flops_per_token(seq_len=T).forward - L * (2 * cost.linear(d, d) + score_pass)
    assert base.flops_per_token(seq_len=T).forward == pytest.approx(expected, rel=1e-9)
    # and the Switch placement ("replace") has no dense FFN: 4d x d x 2 fewer matmul FLOPs per layer
    switch = build("moe_dense_ffn", moe={"placement": "replace"})
    gap = base.flops_per_token(seq_len=T).forward - switch.flops_per_token(seq_len=T).forward
    assert gap == pytest.approx(L * cost.ffn(d, cfg.ffn_hidden))


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
            block.moe.experts.scale_outputs(0.0)
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


# ---------------------------------------------------------------------------- 3. MoT, seed 002 options
def test_mot_sequence_routing_sends_the_whole_sequence_to_the_same_blocks():
    model = build("mot_seq").eval()
    idx = tokens()
    with torch.no_grad():
        out = model(idx)
    for site in out.trace:
        assert torch.equal(site.selected, site.selected[:, :1].expand_as(site.selected)), site.name
    # causally (generation), token t is routed by the mean of its prefix: as the prefix alone would be
    with torch.no_grad(), model.causal_routing():
        causal = model(idx).trace
    for t in (0, 5, T - 1):
        with torch.no_grad():
            alone = model(idx[:, : t + 1]).trace
        for site, ref in zip(causal, alone):
            assert torch.equal(site.selected[:, t], ref.selected[:, t]), (site.name, t)


def test_mot_uniform_weights_are_exactly_one_over_k_and_the_gate_still_learns():
    model = build("mot_seq")
    idx = tokens()
    out = model(idx)
    k = model.config.mot.top_k
    for site in out.trace:
        assert torch.equal(site.weights.detach(), torch.full_like(site.weights, 1.0 / k))
    out.logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in model.named_parameters() if ".gate." in n)


def test_mot_gate_with_a_hidden_layer():
    model = build("mot_seq", mot={"gate_hidden": 24})
    gate = model.blocks[0].gate
    d, E = model.config.d_model, model.config.mot.num_experts
    assert (gate.fc.in_features, gate.fc.out_features, gate.out.out_features) == (d, 24, E)
    assert n_params(model) - n_params(build("mot")) == model.config.n_layer * (d * 24 + 24 + 24 * E - d * E)


def test_mot_concat_aggregation_starts_as_the_weighted_sum_then_mixes_the_slots():
    summed = build("mot").eval()
    concat = build("mot", mot={"aggregation": "concat"}).eval()
    missing = concat.load_state_dict(summed.state_dict(), strict=False).missing_keys
    assert missing and all(".combine." in n for n in missing)
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(concat(idx).logits, summed(idx).logits, atol=1e-5, rtol=1e-5)
        concat.blocks[0].combine.weight.add_(0.1 * torch.randn_like(concat.blocks[0].combine.weight))
        assert not torch.allclose(concat(idx).logits, summed(idx).logits, atol=1e-4)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        out = concat(idx)
    assert concat.flops_per_token(out.trace).forward * idx.numel() == pytest.approx(counter.get_total_flops(), rel=1e-6)


def test_mot_forced_random_activation_reaches_every_block_in_training_only():
    model = build("mot", mot={"top_k": 1, "random_activation": 1.0})
    idx = tokens(B=4)
    with torch.no_grad():
        out = model.train()(idx)
    E = model.config.mot.num_experts
    for site in out.trace:
        assert set(site.selected.flatten().tolist()) == set(range(E)), site.name
        assert not torch.equal(site.selected[..., 0], site.probs.argmax(-1)), "the slot is forced, not the gate's pick"
    with torch.no_grad():
        evaluated = model.eval()(idx)
    for site in evaluated.trace:
        assert torch.equal(site.selected[..., 0], site.probs.argmax(-1)), "no random slot at evaluation"
    two = build("mot", mot={"top_k": 2, "random_activation": 1.0}).train()
    with torch.no_grad():
        for site in two(idx).trace:
            assert (site.selected[..., 0] != site.selected[..., 1]).all(), "the random block is a new one"
    seq = build("mot_seq", mot={"random_activation": 1.0}).train()
    with torch.no_grad():
        for site in seq(idx).trace:  # sequence routing: one random block per sequence, not per token
            assert torch.equal(site.selected, site.selected[:, :1].expand_as(site.selected)), site.name
            assert (site.selected[..., 0] != site.selected[..., 1]).all()


# ---------------------------------------------------------------------------- 4. CAA / CEA paper wiring
def test_paper_wiring_adds_no_parameters_over_ffn_wider():
    """Same W: the paper's CEA is ffn_wider's parameters plus the split FFN's second output bias (d per
    layer); the additive default adds V_inner and O' on top."""
    paper, additive = build("cea_paper"), build("cea")
    wider = build("ffn_wider", combo={"wide_ffn_ratio": paper.config.combo.total_ffn_ratio})
    d, L = paper.config.d_model, paper.config.n_layer
    assert n_params(paper) == n_params(wider) + L * d == paper.num_parameters_formula()
    assert n_params(additive) - n_params(paper) == L * 2 * (d * d + d)
    moe_paper, moe_additive = build("cea_moe_paper"), build("cea_moe")
    assert n_params(moe_additive) - n_params(moe_paper) == L * 2 * (d * d + d) == \
        moe_additive.num_parameters_formula() - moe_paper.num_parameters_formula()


@pytest.mark.parametrize("wiring", ["paper", "paper_masked"])
@pytest.mark.parametrize("name", ["cea_paper", "cea_moe_paper"])
def test_paper_wiring_other_positions_see_the_inner_ffn_a_token_never_its_own(name, wiring):
    model = build(name, combo={"inner_wiring": wiring}).eval()
    attn = model.blocks[1].attn
    captured = {}

    def keep(module, args, out):  # returns None: the output is left as it is
        captured["out"] = out.output if hasattr(out, "output") else out

    handle = attn.inner.ffn.register_forward_hook(keep)
    h = torch.randn(1, T, model.config.d_model, requires_grad=False)
    try:
        update, _ = attn(h)
    finally:
        handle.remove()
    inner = captured["out"]
    i = T // 2
    grad = torch.autograd.grad(update[0, i].square().sum(), inner)[0][0]
    assert grad[i].abs().max() == 0, "a token must not receive its own Inner-FFN output"
    assert grad[:i].abs().amax(-1).gt(0).all(), "every earlier position reaches it through the Inner-FFN"
    assert grad[i + 1:].abs().max() == 0, "causal"


def test_paper_wiring_with_a_silent_inner_ffn_is_vanilla_attention():
    from architectures.gpt2 import CausalSelfAttention

    model = build("cea_paper").eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.inner.ffn.c_proj.weight.zero_()
        attn.inner.ffn.c_proj.bias.zero_()
        vanilla = CausalSelfAttention(model.config.d_model, model.config.n_head)
        vanilla.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("inner.")})
        h = torch.randn(2, T, model.config.d_model)
        torch.testing.assert_close(attn(h)[0], vanilla(h), atol=1e-5, rtol=1e-5)


def test_paper_masked_wiring_flops_match_the_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    for name in ("cea_paper", "cea_moe_paper"):
        model = build(name, combo={"inner_wiring": "paper_masked"}).eval()
        idx = tokens()
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
            out = model(idx)
        assert model.flops_per_token(out.trace).forward * idx.numel() == pytest.approx(counter.get_total_flops(), rel=1e-6)


# ---------------------------------------------------------------------------- 5. MoM, official-code options
def _assembly(weighted_qkv: bool, seed=0):
    """A chunk of two attention modules (no SKIP) and a hand-made route: module 0 weight 1, module 1 weight 0."""
    from architectures.mom import _Route

    model = build("mom", seed=seed, mom={"n_attn": 2, "n_ffn": 2, "steps": 2, "top_k": 2, "allow_skip": False,
                                         "weighted_qkv": weighted_qkv}, n_layer=2)
    chunk = model.chunks[0]
    B = 2
    selected = torch.tensor([[0, 1]]).repeat(B * T, 1)
    weights = torch.tensor([[1.0, 0.0]]).repeat(B * T, 1).requires_grad_(True)
    return chunk, _Route(selected, weights), torch.randn(B, T, model.config.d_model)


@pytest.mark.parametrize("weighted_qkv", [False, True])
def test_mom_weighted_qkv_decides_whether_a_weight_zero_module_changes_qkv(weighted_qkv):
    chunk, route, x = _assembly(weighted_qkv)
    before = chunk.assemble_attention(x, route, None, "")
    with torch.no_grad():
        chunk.attn_modules[1].attn.c_attn.weight.add_(torch.randn_like(chunk.attn_modules[1].attn.c_attn.weight))
    after = chunk.assemble_attention(x, route, None, "")
    if weighted_qkv:
        torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)  # weight 0: no say in Q/K/V
    else:
        assert (after - before).abs().max() > 1e-3  # summed unweighted: module 1 reshapes Q/K/V


@pytest.mark.parametrize("weighted_qkv", [False, True])
def test_mom_weighted_qkv_decides_whether_the_router_learns_through_qkv(weighted_qkv):
    """Gradient of the update wrt the router weights: through the output projections only (False), or
    also through the weighted Q/K/V (True)."""
    chunk, route, x = _assembly(weighted_qkv)
    out = chunk.assemble_attention(x, route, None, "")
    target = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * target).sum(), route.weights)
    # the output-projection path alone: d/dw_k of sum_k w_k c_proj_k(attn) with attn held fixed
    with torch.no_grad():
        B, T_, d = x.shape
        flat = x.reshape(B * T_, d)
        qkv_w = route.weights if weighted_qkv else torch.ones_like(route.weights)
        from architectures.dispatch import sorted_dispatch

        qkv = sorted_dispatch(flat, route.selected, qkv_w, [m.project for m in chunk.attn_modules])
        y = chunk.attn_modules[0].attn.attend(qkv.view(B, T_, 3 * d)).reshape(B * T_, d)
        direct = torch.stack([(m.attn.c_proj(y) * target.reshape(B * T_, d)).sum(-1) for m in chunk.attn_modules], -1)
    if weighted_qkv:
        assert not torch.allclose(grad, direct, atol=1e-4)
    else:
        torch.testing.assert_close(grad, direct, atol=1e-5, rtol=1e-4)


def test_mom_official_router_bias_and_width():
    model = build("mom_official")
    chunk = model.chunks[0]
    n_attn, n_ffn = chunk.n_attn, chunk.n_ffn
    assert n_attn != n_ffn
    width = max(n_attn, n_ffn) + 1
    for router in (chunk.attn_router, chunk.ffn_router):
        assert router.out.out_features == width and router.out.bias is not None
        assert torch.count_nonzero(router.out.bias) == 0  # zero init, as every bias
    assert chunk.ffn_names == [f"ffn{i}" for i in range(n_ffn)] + ["skip"] * (width - n_ffn)
    out = model(tokens())
    out.logits.logsumexp(-1).mean().backward()
    assert chunk.ffn_router.out.bias.grad.abs().max() > 0
    for site in out.trace:  # a surplus class runs nothing: FLOPs count only real modules
        assert site.num_choices == width
    own = build("mom", mom={"n_ffn": 2})
    assert own.chunks[0].ffn_router.out.out_features == 3 and own.chunks[0].ffn_router.out.bias is None


def test_mom_official_balance_loss_form():
    model = build("mom_official")
    out = model(tokens())
    assert set(out.aux_losses) == {"mom.attn/balance", "mom.ffn/balance"}
    for kind in ("attn", "ffn"):
        probs = torch.cat([s.probs.reshape(-1, s.num_choices) for s in out.trace if f".{kind}." in s.name])
        scores = probs.softmax(-1)  # the official second softmax
        C = scores.shape[-1]
        f = torch.bincount(scores.argmax(-1), minlength=C).float() / scores.shape[0]
        expected = model.config.mom.balance_coef * C * (f * scores.mean(0)).sum()
        torch.testing.assert_close(out.aux_losses[f"mom.{kind}/balance"].detach(), expected)


def test_mom_all_paths_is_the_dense_mixture_of_every_module():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build("mom", mom={"all_paths": True}).eval()
    idx = tokens()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        out = model(idx)
    for site in out.trace:
        assert site.selected.shape[-1] == site.num_choices  # every class, every token
        torch.testing.assert_close(site.weights, site.probs)
    assert model.flops_per_token(out.trace).forward * idx.numel() == pytest.approx(counter.get_total_flops(), rel=1e-6)
    pool = model.chunks[0].n_ffn
    sparse = build("mom").eval()
    with torch.no_grad():
        k1 = sparse(idx)
    assert model.flops_per_token(out.trace).ffn == pytest.approx(pool * model.layout.steps
                                                                  * cost.ffn(32, model.config.ffn_hidden))
    assert sparse.flops_per_token(k1.trace).ffn < model.flops_per_token(out.trace).ffn
    # every token depends on every FFN module (module 2, say), even one it would not pick at K = 1
    with torch.no_grad():
        before = model(idx).logits
        for p in model.chunks[0].ffn_modules[2].parameters():
            p.add_(torch.randn_like(p))
        assert (model(idx).logits - before).abs().amax(-1).gt(1e-6).all()


def test_two_phase_official_recipe_sets_adam_eps_1e5_for_phase2_only(tmp_path, monkeypatch):
    import experiments.run
    from experiments import two_phase
    from tests.test_two_phase import fake_run

    calls = []
    monkeypatch.setattr(experiments.run, "main", fake_run(calls, tmp_path))
    two_phase.main(["--variant", "mom_e", "--phase1_steps", "3", "--phase2_steps", "4", "--log_dir", str(tmp_path),
                    "--phase2_recipe", "official"])
    phase1, phase2 = calls
    assert "--optim.eps" not in phase1
    assert phase2[phase2.index("--optim.eps") + 1] == "1e-5"
    calls.clear()
    two_phase.main(["--variant", "mom_e", "--phase1_steps", "3", "--phase2_steps", "4", "--log_dir", str(tmp_path)])
    assert "--optim.eps" not in calls[1]  # our recipe by default


def test_paper_options_command_reports_parameters_flops_and_mom_depth(capsys):
    from experiments import paper_options

    rows = {r["variant"]: r for r in paper_options.main(["--size", "tiny", "--variants", "mom_e", "depth_gate_skip"])}
    assert rows["mom_e"]["depth"] == 2 and rows["mom_e"]["layout"] == "0+1x(1+A)+0"  # 4 layers: 3 slots + anchor
    assert rows["depth_gate_skip"]["flops_ratio"] < 1.0 and "depth" not in rows["depth_gate_skip"]
    assert "mom_e" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the invariant suite on the options
# Options that are not a registry entry of their own still get every invariant of tests/test_contract.py.
from tests import test_contract as suite  # noqa: E402

OPTION_CASES = [
    ("mot", {"mot": {"aggregation": "concat"}}),
    ("mot", {"mot": {"routing": "sequence", "aggregation": "concat", "top_k": 1}}),
    ("mot", {"mot": {"weights": "uniform", "gate_hidden": 8}}),
    ("depth_gate_skip", {"depth_gate": {"top_k": 1}}),
    ("moe_dense_ffn", {"moe": {"top_k": 2}}),
    ("cea_paper", {"combo": {"inner_wiring": "paper_masked"}}),
    ("cea_moe_paper", {"combo": {"inner_wiring": "paper_masked"}}),
    ("mom", {"mom": {"all_paths": True}}),
    ("mom", {"mom": {"weighted_qkv": True, "top_k": 2}}),
    ("mom_official", {"mom": {"all_paths": True, "weighted_qkv": True}}),
]
OPTION_IDS = [name + "".join(f"-{g}.{k}={v}" for g, d in extra.items() for k, v in d.items()) for name, extra in OPTION_CASES]


@pytest.mark.parametrize("name,extra", OPTION_CASES, ids=OPTION_IDS)
def test_options_keep_every_invariant(name, extra):
    for training in (False, True):
        suite.test_positions_up_to_t_ignore_later_tokens(name, extra, training)
    suite.test_every_router_parameter_gets_a_gradient_from_the_lm_loss_alone(name, extra)
    suite.test_router_values_are_those_of_an_fp32_computation_under_bf16_autocast(name, extra)
    suite.test_one_site_per_routing_decision_with_unique_names_and_an_honoured_valid_mask(name, extra)
    suite.test_an_example_ignores_batch_mates_and_right_padding_and_short_sequences_run(name, extra)
    suite.test_kv_cache_decoding_equals_the_full_causal_forward(name, extra)
    suite.test_aux_loss_is_the_sum_of_its_parts_and_residuals_are_ordered(name, extra)
    suite.test_analytic_flops_match_the_flop_counter_for_a_full_forward_and_cached_decode_steps(name, extra)
    suite.test_planned_flops_without_a_trace_are_defined(name, extra)


@pytest.mark.parametrize("name,extra,field", [
    ("moe", {"moe": {"placement": "after"}}, "model.moe.placement"),
    ("depth_gate", {"depth_gate": {"skip_compute": True}}, "model.depth_gate.skip_compute"),
    ("mot", {"mot": {"routing": "batch"}}, "model.mot.routing"),
    ("mot", {"mot": {"weights": "equal"}}, "model.mot.weights"),
    ("mot", {"mot": {"aggregation": "mean"}}, "model.mot.aggregation"),
    ("mot", {"mot": {"gate_hidden": -1}}, "model.mot.gate_hidden"),
    ("mot", {"mot": {"random_activation": 1.5}}, "model.mot.random_activation"),
    ("cea", {"combo": {"inner_wiring": "paper2"}}, "model.combo.inner_wiring"),
    ("cea_moe", {"combo": {"inner_wiring": "paper2"}}, "model.combo.inner_wiring"),
    ("mom", {"mom": {"router_width": "max"}}, "model.mom.router_width"),
    ("mom", {"mom": {"balance_form": "switch"}}, "model.mom.balance_form"),
])
def test_a_bad_option_value_names_its_field(name, extra, field):
    from architectures.config import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build(name, **extra)
