"""Mixture-of-Modules: exact special cases, dispatch equivalence, GRU state, SKIP, FLOPs, two-phase init."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.mom import MoMConfig
from tests.references import dense_reference
from architectures.flops import vanilla_flops
from architectures.gpt2 import causal_attention
from architectures.mom import MixtureOfModules, _Route, chunked_defaults
from tests.conftest import cli_summary

V = 256  # a small vocabulary keeps the head cheap; the routing code does not depend on it


SLIM = dict(d_model=64, n_head=2, block_size=64)  # for the tests that run many forward passes


def mom(variant: str = "mom", size: str = "tiny", dims=None, **mom_fields) -> MixtureOfModules:
    torch.manual_seed(0)
    return build_model(ModelConfig(variant=variant, size=size, vocab_size=V, mom=mom_fields, **(dims or {})))


def vanilla(**fields):
    torch.manual_seed(1)
    return build_model(ModelConfig(variant="vanilla", size="tiny", vocab_size=V, **fields))


def tokens(B=2, T=24, seed=2):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def sgd_steps(model, steps=2):
    """A few updates so that no weight is still at its init (biases, LayerNorms included)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        idx = tokens(seed=10 + i)
        out = model(idx)
        torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


# ---------------------------------------------------------------------------- exact special cases
@pytest.mark.parametrize("layout", ["plain", "chunked"])
def test_vanilla_order_reproduces_gpt2_logits_and_residuals_exactly(layout):
    van = sgd_steps(vanilla())
    model = mom(routing="vanilla", layout=layout).eval()
    model.init_from_vanilla(van.state_dict())
    idx = tokens()
    a, b = van(idx, return_residuals=True), model(idx, return_residuals=True)
    assert torch.equal(a.logits, b.logits)
    assert [(s.tag, s.layer) for s in a.residuals] == [(s.tag, s.layer) for s in b.residuals]
    assert all(torch.equal(s.hidden, t.hidden) for s, t in zip(a.residuals, b.residuals))
    assert b.aux_loss.item() == 0 and not b.aux_losses
    assert all((s.selected == s.step).all() for s in b.trace)  # module h at step h


def test_phase2_init_from_a_lightning_checkpoint_reproduces_phase1_logits(tmp_path):
    from model_tools.weights import load_initial_weights

    van = sgd_steps(vanilla())
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in van.state_dict().items()}, "global_step": 2}, path)
    model = mom("mom_e", routing="vanilla", steps=3).eval()  # chunked layout (3 modules + anchor), vanilla order
    load_initial_weights(model, str(path))
    idx = tokens()
    assert torch.equal(van(idx).logits, model(idx).logits)


def test_init_from_vanilla_maps_layers_to_modules_and_leaves_routers_fresh():
    van = sgd_steps(vanilla())
    model = mom("mom_e")  # tiny chunked layout: one chunk of 3 modules + anchor
    routers = {k: v.clone() for k, v in model.state_dict().items() if "router" in k}
    model.init_from_vanilla(van.state_dict())
    state, own = van.state_dict(), model.state_dict()
    for j in range(3):
        assert torch.equal(own[f"chunks.0.attn_modules.{j}.attn.c_attn.weight"], state[f"blocks.{j}.attn.c_attn.weight"])
        assert torch.equal(own[f"chunks.0.attn_modules.{j}.ln_1.bias"], state[f"blocks.{j}.ln_1.bias"])
        assert torch.equal(own[f"chunks.0.ffn_modules.{j}.mlp.c_proj.weight"], state[f"blocks.{j}.mlp.c_proj.weight"])
        assert torch.equal(own[f"chunks.0.ffn_modules.{j}.ln_2.weight"], state[f"blocks.{j}.ln_2.weight"])
    assert torch.equal(own["chunks.0.anchor.mlp.c_fc.weight"], state["blocks.3.mlp.c_fc.weight"])
    assert torch.equal(own["wte.weight"], state["wte.weight"]) and torch.equal(own["ln_f.bias"], state["ln_f.bias"])
    assert all(torch.equal(own[k], v) for k, v in routers.items())


def test_init_from_vanilla_that_does_not_fit_names_the_tensor_and_why():
    model = mom()
    wide = build_model(ModelConfig(variant="vanilla", size="tiny", vocab_size=V, d_model=64, n_head=4))
    with pytest.raises(ConfigError, match=r"wte.weight has shape \(256, 64\).*needs \(256, 128\).*d_model=64"):
        model.init_from_vanilla(wide.state_dict())
    deep = build_model(ModelConfig(variant="vanilla", size="tiny", vocab_size=V, n_layer=6))
    with pytest.raises(ConfigError, match="6 layers.*model.n_layer=4"):
        model.init_from_vanilla(deep.state_dict())
    state = vanilla().state_dict()
    del state["blocks.2.mlp.c_fc.bias"]
    with pytest.raises(ConfigError, match=r"lacks blocks.2.mlp.c_fc.bias \(needed for chunks.0.ffn_modules.2.mlp.c_fc.bias\)"):
        model.init_from_vanilla(state)
    with pytest.raises(ConfigError, match="no wte.weight"):
        model.init_from_vanilla({"foo": torch.zeros(1)})


def test_param_share_equals_gpt2_whose_layers_are_all_layer_zero():
    van = sgd_steps(vanilla())
    shared = {k: v for k, v in van.state_dict().items()}
    for key in list(shared):
        if key.startswith("blocks."):
            shared[key] = shared["blocks.0." + key.split(".", 2)[2]]
    van.load_state_dict(shared)
    model = mom("param_share").eval()
    model.init_from_vanilla(van.state_dict())  # layers 1.. are dropped: the pool holds one module each
    assert model.layout.n_attn == model.layout.n_ffn == 1 and model.layout.steps == 4
    idx = tokens()
    assert torch.equal(van(idx).logits, model(idx).logits)


# ---------------------------------------------------------------------------- SKIP
def force_skip(router):
    """GRU with zero weights and saturated gates: h = ~1 for every token; W_o favours SKIP."""
    with torch.no_grad():
        for p in router.cell.parameters():
            p.zero_()
        hidden = router.cell.hidden_size
        router.cell.bias_ih[hidden: 2 * hidden] = -30.0  # update gate z ~ 0: h = n
        router.cell.bias_ih[2 * hidden:] = 30.0  # n = tanh(30) = 1
        router.out.weight.fill_(-1.0)
        router.out.weight[-1] = 1.0


def test_k1_on_skip_leaves_every_token_unchanged():
    model = mom().eval()
    for chunk in model.chunks:
        force_skip(chunk.attn_router)
        force_skip(chunk.ffn_router)
    idx = tokens()
    out = model(idx, return_residuals=True)
    embed = out.residuals[0].hidden
    assert all(torch.equal(s.hidden, embed) for s in out.residuals)
    assert torch.equal(out.logits, model.head(embed))
    assert all((s.selected == len(s.choice_names) - 1).all() for s in out.trace)
    flops = model.flops_per_token(out.trace)
    assert flops.attn_proj == flops.attn_scores == flops.ffn == 0  # all-SKIP costs nothing but the routers
    assert flops.router > 0


def test_tokens_that_choose_skip_are_unchanged_by_that_sub_step():
    model = mom(top_k=1, temperature=1.0).eval()
    out = model(tokens(B=3, T=40), return_residuals=True)
    states = [s.hidden for s in out.residuals]  # embed, then mha/ffn per step
    skipped = 0
    for i, site in enumerate(out.trace):  # attn0, ffn0, attn1, ... aligned with states[1:]
        skip = site.selected[..., 0] == len(site.choice_names) - 1
        before, after = states[i], states[i + 1]
        assert torch.equal(after[skip], before[skip])
        assert (after[~skip] != before[~skip]).any(-1).all()
        skipped += int(skip.sum())
    assert skipped > 0, "an untrained router at temperature 1 should send some tokens to SKIP"


# ---------------------------------------------------------------------------- dispatch vs dense
def dense_attention(chunk, x, selected, weights, weighted_qkv):
    B, T, d = x.shape
    gate_in = weights if weighted_qkv else torch.ones_like(weights)
    qkv = dense_reference(x.reshape(B * T, d), selected, gate_in, [m.project for m in chunk.attn_modules])
    q, k, v = (chunk.attn_modules[0].attn.split_heads(t) for t in qkv.view(B, T, 3 * d).chunk(3, dim=-1))
    y = chunk.attn_modules[0].attn.merge_heads(causal_attention(q, k, v)).reshape(B * T, d)
    return dense_reference(y, selected, weights, [m.attn.c_proj for m in chunk.attn_modules]).view(B, T, d)


def all_grads(chunk, *tensors):
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in chunk.parameters()]
    return grads + [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("k,weighted_qkv", [(1, False), (2, False), (3, False), (3, True)])
def test_attention_and_ffn_dispatch_equal_dense_masked_reference_values_and_grads(k, weighted_qkv):
    model = mom(n_attn=3, n_ffn=3, steps=2, top_k=k, weighted_qkv=weighted_qkv)
    chunk = model.chunks[0]
    B, T, d = 2, 9, model.config.d_model
    gen = torch.Generator().manual_seed(3)
    selected = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(B * T)])  # id 3 = SKIP
    if k == 1:
        selected[0, 0] = 3  # a token that only skips
    for kind, assemble, reference in (
        ("attn", lambda x, w: chunk.assemble_attention(x, _Route(selected, w), None, ""),
         lambda x, w: dense_attention(chunk, x, selected, w, weighted_qkv)),
        ("ffn", lambda x, w: chunk.assemble_ffn(x, _Route(selected, w)),
         lambda x, w: dense_reference(x.reshape(B * T, d), selected, w, list(chunk.ffn_modules)).view(B, T, d)),
    ):
        results = []
        upstream = torch.randn(B, T, d, generator=gen)
        x0 = torch.randn(B, T, d, generator=gen)
        w0 = torch.rand(B * T, k, generator=gen)
        for fn in (assemble, reference):
            chunk.zero_grad(set_to_none=True)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            out = fn(x, w)
            (out * upstream).sum().backward()
            results.append((out.detach(), all_grads(chunk, x, w)))
        (got, got_grads), (want, want_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=kind)
        for g, r in zip(got_grads, want_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=kind)
        if k == 1:
            assert torch.equal(got.view(B * T, d)[0], torch.zeros(d))  # the all-SKIP token: no update


# ---------------------------------------------------------------------------- GRU routers
@pytest.mark.parametrize("seed", range(3))
def test_routers_start_as_the_official_code_and_fresh_routers_do_not_all_skip(seed):
    """Issue 12 §3.6: GRUCell kept PyTorch's default init; fresh tiny routers sent every attention slot to SKIP."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(variant="mom", size="tiny", vocab_size=V, **SLIM))
    for chunk in model.chunks:
        for router in (chunk.attn_router, chunk.ffn_router):
            for name, param in router.named_parameters():
                if "bias" in name:
                    assert torch.equal(param, torch.zeros_like(param)), name
                else:
                    assert abs(float(param.std()) - 0.02) < 0.003, (name, float(param.std()))
    out = model(tokens(B=4, T=32, seed=seed))
    attn = [s for s in out.trace if s.group.endswith(".attn")]
    skip_share = torch.stack([(s.selected == len(s.choice_names) - 1).float().mean() for s in attn])
    assert float(skip_share.max()) < 0.9, f"SKIP share per attention step {skip_share.tolist()}"


def test_gru_state_is_carried_across_steps():
    model = mom(top_k=2).eval()
    out = model(tokens(), return_residuals=True)
    chunk, states = model.chunks[0], [s.hidden for s in out.residuals]
    router = chunk.attn_router
    d = model.config.d_model
    h, attn_sites = None, [s for s in out.trace if s.group.endswith(".attn")]
    for step, site in enumerate(attn_sites):
        x = states[2 * step].reshape(-1, d)  # the stream entering step h's attention
        fresh, _ = router.logits(x, None)
        carried, h = router.logits(x, h)
        torch.testing.assert_close(site.logits.reshape(-1, site.num_choices), carried)
        if step == 0:
            assert torch.equal(carried, fresh)  # zeros at step 1
        else:
            assert (carried - fresh).abs().max() > 1e-3  # the router sees step h-1's state
    # one chunk's FFN router also carries its own state
    ffn_sites = [s for s in out.trace if s.group.endswith(".ffn")]
    h = None
    for step, site in enumerate(ffn_sites):
        logits, h = chunk.ffn_router.logits(states[2 * step + 1].reshape(-1, d), h)
        torch.testing.assert_close(site.logits.reshape(-1, site.num_choices), logits)


def test_routing_weights_renormalise_over_k_and_k1_keeps_a_router_gradient():
    for k in (1, 3):
        model = mom(top_k=k, n_attn=4, n_ffn=4)
        out = model(tokens())
        for site in out.trace:
            torch.testing.assert_close(site.weights.sum(-1), torch.ones_like(site.weights[..., 0]))
            chosen = site.probs.gather(-1, site.selected)
            torch.testing.assert_close(site.weights, chosen / chosen.sum(-1, keepdim=True))
        out.logits.square().mean().backward()
        for kind in ("attn", "ffn"):
            router = getattr(model.chunks[0], f"{kind}_router")
            used = any((s.selected < s.num_choices - 1).any() for s in out.trace if s.group.endswith(kind))
            if used:  # a router whose every token chose SKIP has nothing to learn from the LM loss
                assert router.out.weight.grad.abs().sum() > 0 and router.cell.weight_ih.grad.abs().sum() > 0
        assert model.chunks[0].ffn_router.out.weight.grad is not None


def test_layer_skip_chooses_only_module_h_or_skip_and_moe_fixes_attention():
    model = mom("layer_skip", temperature=1.0)
    out = model(tokens(B=4, T=32))
    for site in out.trace:
        assert set(site.selected.unique().tolist()) <= {site.step, len(site.choice_names) - 1}
    assert any((s.selected == len(s.choice_names) - 1).any() for s in out.trace)
    model = mom(routing="moe", top_k=2, temperature=1.0)
    out = model(tokens())
    attn = [s for s in out.trace if s.group.endswith(".attn")]
    ffn = [s for s in out.trace if s.group.endswith(".ffn")]
    assert all((s.selected == s.step).all() and s.probs is None for s in attn)
    assert all(s.probs is not None and s.selected.shape[-1] == 2 for s in ffn)
    assert model.chunks[0].attn_router is None and model.chunks[0].ffn_router is not None


class _MoERouterOfStep:
    """Stands in for the scores of MoM's GRU FFN router: at step h, the ``moe`` variant's layer-h router on its
    LayerNorm (the GRU router's pick rule and site are kept)."""

    def __init__(self, moe_model, n_choices):
        self.moe_model, self.n_choices = moe_model, n_choices

    def __call__(self, x, state):
        step = 0 if state is None else int(state[0])
        block = self.moe_model.blocks[step]
        E = block.moe.num_experts
        # other steps' experts would win: only the pool restriction keeps them out
        logits = torch.full((*x.shape[:-1], self.n_choices), 50.0)  # x: (B, T, d), the router's input
        logits[..., step * E:(step + 1) * E] = block.moe.router.logits(block.ln_2(x))
        return logits, torch.full((1,), step + 1)


@pytest.mark.parametrize("k", [2, 3])
def test_moe_routing_is_the_moe_variant_given_the_same_weights_and_routing(k):
    """Issue 12 §3.6: MoM's MoE special case as a per-step expert-pool restriction, exactly the ``moe`` variant.

    k >= 2 (both renormalise over the k picks); at k = 1 MoM's weight is 1 where Switch scales by p."""
    from architectures.moe_layer import MoEConfig

    E, L = 3, 4
    torch.manual_seed(0)
    moe = build_model(ModelConfig(variant="moe", vocab_size=V, d_model=32, n_layer=L, n_head=2, block_size=32,
                                  moe=MoEConfig(num_experts=E, top_k=k, renormalize=True))).eval()
    model = build_model(ModelConfig(variant="mom", vocab_size=V, d_model=32, n_layer=L, n_head=2, block_size=32,
                                    mom=MoMConfig(routing="moe", n_ffn=L * E, top_k=k, allow_skip=False,
                                                  temperature=1.0, straight_through=False))).eval()
    chunk = model.chunks[0]
    with torch.no_grad():
        for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
            model.state_dict()[name].copy_(moe.state_dict()[name])
        for h, block in enumerate(moe.blocks):
            chunk.attn_modules[h].ln_1.load_state_dict(block.ln_1.state_dict())
            chunk.attn_modules[h].attn.load_state_dict(block.attn.state_dict())
            for e in range(E):
                chunk.ffn_modules[h * E + e].ln_2.load_state_dict(block.ln_2.state_dict())
                stacked = block.moe.experts  # expert e's rows of the stacked parameters
                chunk.ffn_modules[h * E + e].mlp.load_state_dict(
                    {f"{n}.{p}": getattr(getattr(stacked, n), p)[e] for n in ("c_fc", "c_proj") for p in ("weight", "bias")})
    chunk.ffn_router.scores = _MoERouterOfStep(moe, len(chunk.ffn_names))
    idx = tokens(B=2, T=16)
    with torch.no_grad():
        want, got = moe(idx), model(idx)
    ffn_sites = [s for s in got.trace if s.group.endswith(".ffn")]
    for site, moe_site in zip(ffn_sites, want.trace):
        assert torch.equal(site.selected - site.step * E, moe_site.selected)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)


def test_moe_routing_restricts_each_step_to_its_own_experts():
    model = mom(routing="moe", n_ffn=8, top_k=2, temperature=1.0)  # plain tiny: 4 steps x 2 experts + SKIP
    out = model(tokens(B=4, T=32))
    for site in (s for s in out.trace if s.group.endswith(".ffn")):
        assert set(site.selected.unique().tolist()) <= {2 * site.step, 2 * site.step + 1, len(site.choice_names) - 1}


def test_trace_names_groups_and_balance_loss():
    model = mom("mom_i", size="tiny")  # K=3, H=2, one chunk of 3 modules + anchor
    idx = tokens()
    mask = torch.ones_like(idx)
    mask[1, -5:] = 0
    out = model(idx, attention_mask=mask)
    assert [s.name for s in out.trace] == ["mom.chunk0.attn.step0", "mom.chunk0.ffn.step0",
                                          "mom.chunk0.attn.step1", "mom.chunk0.ffn.step1"]
    site = out.trace[0]
    assert site.kind == "token_choice" and site.group == "mom.chunk0.attn" and site.step == 0
    assert site.choice_names == ["attn0", "attn1", "attn2", "skip"]
    assert site.selected.shape == (2, 24, 3) and site.probs.shape == (2, 24, 4)
    assert torch.equal(site.valid, mask.bool())
    # Switch loss over all 4 classes (SKIP included), coefficient x mean over the 4 learned sites
    valid = mask.bool().reshape(-1)
    f = torch.bincount(site.selected.reshape(-1, 3)[valid].reshape(-1), minlength=4).float() / (valid.sum() * 3)
    P = site.probs.reshape(-1, 4)[valid].mean(0)
    expected = 0.01 * 4 * (f * P).sum() / 4
    torch.testing.assert_close(out.aux_losses["mom.chunk0.attn.step0/balance"], expected)
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    assert len(out.aux_losses) == 4
    silent = mom("mom_i", balance_coef=0.0)(idx)
    assert silent.aux_loss.item() == 0 and not silent.aux_losses


# ---------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("variant,fields", [
    ("mom", {}), ("mom_e", {}), ("mom_p", {}), ("layer_skip", {}), ("param_share", {}),
    ("mom", {"routing": "moe", "top_k": 2}), ("mom_i", {"weighted_qkv": True}),
    ("mom", {"layout": "chunked", "top_k": 2, "bottom": 1, "chunks": 1, "top": 0}),
])
def test_flops_count_the_chosen_modules_as_flop_counter_mode_does(variant, fields):
    model = mom(variant, dims=SLIM, temperature=1.0, router_hidden=48, **fields).eval()
    idx = tokens(B=3, T=40)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    analytic = model.flops_per_token(out.trace)
    assert counter.get_total_flops() == pytest.approx(analytic.forward * idx.numel(), rel=1e-9)
    assert analytic.forward <= model.flops_per_token(seq_len=40).forward + 1e-6  # no trace: the upper bound


def test_flops_formula_by_hand_and_mom_e_meets_the_benchmark_goal_at_small():
    d, hidden, T, vocab, H = 128, 512, 128, V, 256
    model = mom("mom_e")  # tiny: one chunk of 3 modules + anchor, K=3 of 3 + SKIP, H=1
    f = model.flops_per_token()
    assert f.attn_proj == pytest.approx((1 + 3) * (2 * d * 3 * d + 2 * d * d))
    assert f.attn_scores == pytest.approx(2 * 4 * T * d)  # anchor + one shared attention
    assert f.ffn == pytest.approx((1 + 3) * 2 * 2 * d * hidden)
    assert f.router == pytest.approx(2 * (2 * d * 3 * H + 2 * H * 3 * H + 2 * H * 4))
    assert f.head == pytest.approx(2 * d * vocab)
    with torch.device("meta"):
        small = build_model(ModelConfig(variant="mom_e", size="small"))
    ratio = small.flops_per_token().forward / vanilla_flops(small.config).forward
    assert ratio == pytest.approx(0.8565, abs=1e-4) and ratio <= 0.86


# ---------------------------------------------------------------------------- presets and config errors
# Parameters (tied embeddings counted once) of each preset: see docs/variants.md, "Mixture-of-Modules".
PARAMS = {
    "mom": {"tiny": 7_838_080, "small": 126_022_400, "medium": 356_805_120, "large": 776_411_392},
    "mom_p": {"tiny": 7_837_568, "small": 127_596_800, "medium": 362_710_016, "large": 788_219_648},
    "mom_e": {"tiny": 7_837_568, "small": 127_596_800, "medium": 362_710_016, "large": 788_219_648},
    "mom_i": {"tiny": 7_837_568, "small": 127_596_800, "medium": 362_710_016, "large": 788_219_648},
    "layer_skip": {"tiny": 7_838_080, "small": 126_022_400, "medium": 356_805_120, "large": 776_411_392},
    "param_share": {"tiny": 6_647_808, "small": 46_473_216, "medium": 65_110_016, "large": 85_319_680},
}
LAYOUTS = {"tiny": (0, 1, 0, 3), "small": (1, 2, 1, 4), "medium": (2, 4, 2, 4), "large": (3, 6, 3, 4)}


@pytest.mark.parametrize("variant", sorted(PARAMS))
def test_presets_build_at_every_size_with_the_documented_parameter_counts(variant):
    for size, expected in PARAMS[variant].items():
        with torch.device("meta"):
            model = build_model(ModelConfig(variant=variant, size=size))
        cfg, lay = model.config, model.layout
        assert model.num_parameters() == expected, (variant, size)
        d, L = cfg.d_model, cfg.n_layer
        vanilla_params = build_vanilla_count(cfg)
        router = 3 * cfg.mom.router_hidden * (d + cfg.mom.router_hidden + 2)
        n_routers = (2 if variant != "param_share" else 0) * lay.chunks
        outputs = sum(cfg.mom.router_hidden * len(names) for c in model.chunks
                      for names, r in ((c.attn_names, c.attn_router), (c.ffn_names, c.ffn_router)) if r is not None)
        pool = lay.chunks * (lay.slots - 1) * per_layer(d) if variant == "param_share" else 0
        assert expected == vanilla_params + n_routers * router + outputs - pool
        if variant in ("mom_p", "mom_e", "mom_i"):
            assert (lay.bottom, lay.chunks, lay.top, lay.slots) == LAYOUTS[size] and lay.anchor
            assert lay.bottom + lay.top + lay.chunks * (lay.slots + 1) == L


def per_layer(d):
    return 12 * d * d + 13 * d  # attn 4d^2+4d, mlp 8d^2+5d, two LayerNorms 4d


def build_vanilla_count(cfg):
    return cfg.vocab_size * cfg.d_model + cfg.block_size * cfg.d_model + 2 * cfg.d_model + cfg.n_layer * per_layer(cfg.d_model)


def test_chunked_layout_table():
    assert [chunked_defaults(n) for n in (4, 12, 24, 36)] == [(0, 1, 0), (1, 2, 1), (2, 4, 2), (3, 6, 3)]


@pytest.mark.parametrize("fields,match", [
    ({"top_k": 6}, r"model.mom.top_k: K=6 exceeds the 4 attn modules \+ SKIP"),
    ({"top_k": 5, "allow_skip": False}, "model.mom.top_k: K=5 exceeds the 4 attn modules of the pool"),
    ({"top_k": 0}, "model.mom.top_k"),
    ({"steps": 0}, "model.mom.steps: H must be an integer >= 1"),
    ({"n_attn": 0}, "model.mom.n_attn: the attention pool needs >= 1 module"),
    ({"n_ffn": 0}, "model.mom.n_ffn: the FFN pool needs >= 1 module"),
    ({"routing": "random"}, "model.mom.routing: unknown routing 'random'"),
    ({"layout": "zigzag"}, "model.mom.layout: unknown layout"),
    ({"chunks": 3}, "model.mom.chunks: bottom=0 \\+ chunks=3"),
    ({"routing": "vanilla", "steps": 5}, "model.mom.n_attn: routing 'vanilla' uses attention module h at step h"),
    ({"routing": "layer_skip", "top_k": 2}, "model.mom.top_k: routing 'layer_skip'"),
    ({"routing": "layer_skip", "allow_skip": False}, "model.mom.allow_skip"),
    ({"temperature": 0.0}, "model.mom.temperature"),
    ({"balance_coef": -1.0}, "model.mom.balance_coef"),
])
def test_bad_configs_raise_config_error_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(variant="mom", size="tiny", mom=MoMConfig(**fields)).resolve()


def test_presets_keep_user_overrides():
    from architectures.registry import apply_preset

    cfg = apply_preset(ModelConfig(variant="mom_e", mom={"top_k": 2}))  # a dict: the preset fills the rest
    assert (cfg.mom.top_k, cfg.mom.steps, cfg.mom.layout) == (2, 1, "chunked")
    with pytest.raises(ConfigError, match="model.variant: unknown variant 'mom_x'"):
        build_model(ModelConfig(variant="mom_x"))


# ---------------------------------------------------------------------------- CLI
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mom", "mom_p", "mom_e", "mom_i", "layer_skip", "param_share"])
def test_cli_short_run_of_each_registry_name(variant, tmp_path):
    summary = cli_summary(variant, tmp_path, "--model.n_layer", "4", steps=2)
    expected_groups = {"mom.chunk0.attn", "mom.chunk0.ffn"}
    assert {name.rsplit(".step", 1)[0] for name in summary["routing"]} == expected_groups
    # the run's routing-aware FLOPs: routers exactly as configured, modules at most the K-slot upper bound
    config = ModelConfig(variant=variant, size="tiny", d_model=32, n_layer=4, n_head=2, block_size=64, vocab_size=4096)
    with torch.device("meta"):
        bound = build_model(config).flops_per_token(seq_len=64)
    flops = summary["flops_per_token"]["components"]
    assert flops["router"] == pytest.approx(bound.router)
    assert 0 < summary["flops_per_token"]["forward"] <= bound.forward * (1 + 1e-9)


def test_init_from_a_hugging_face_gpt2_folder_reproduces_its_logits(tmp_path):
    import transformers  # a hard dependency (pyproject.toml): a broken install must fail, not skip
    from model_tools.weights import load_initial_weights

    torch.manual_seed(4)
    hf_config = transformers.GPT2Config(vocab_size=V, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = mom("mom_e", routing="vanilla", steps=3).eval()  # bottom 0, 3 pooled layers + anchor
    load_initial_weights(model, str(tmp_path / "hf"))
    idx = tokens()
    torch.testing.assert_close(model(idx).logits, hf(idx).logits, rtol=1e-4, atol=1e-4)
