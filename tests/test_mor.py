"""Mixture-of-Recursions (``architectures/mor.py``): against a port of the official expert-choice layer, against a
naive per-token reference, the recursion-wise KV rule, the reported depth, FLOPs as run and the config checks.

The invariant suite (tests/test_contract.py) runs on the registry entries ``mor`` and ``mor_token`` and their
routing settings; this file checks what is specific to MoR.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from architectures import KVCache, build_model
from architectures.config import ConfigError
from architectures.mor import capacity_schedule
from architectures.registry import VARIANTS

V = 97


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def build(name="mor", seed=0, **mor):
    torch.manual_seed(seed)
    extra = {"n_layer": mor.pop("n_layer", 4)}
    if name == "mor":
        mor.setdefault("capacities", None)  # the entry's tiny case sets two; None: the paper's schedule
    return build_model(VARIANTS[name].test_config(name, mor=mor, **extra)).eval()


def tokens(B=3, T=32, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the official expert-choice layer
def official_recursion(total_x, router_weight, blocks, capacity_factor, temp, alpha, prev_selected_tokens):
    """``MoRLlamaDecoderLayer.forward`` of raymin0223/mixture_of_recursions (model/mor_model/expert_choice_router.py,
    commit 82c97f29cd140efa01f5cc4fe0de73a4c3b6ffd6), eval mode, ``router_func="sigmoid"``, ``gating="weighted"``,
    no kv_sharing, steps 1-5 ported line by line; its decoder layers are our ``gpt2.Block`` (a pre-LN block with its
    residual, causal attention among the gathered tokens, as the official gathered causal mask gives)."""
    bs, seq_len, hidden_dim = total_x.shape
    top_k = max(1, int(capacity_factor * seq_len))
    x = total_x
    if prev_selected_tokens is not None:
        x = torch.gather(x, 1, index=prev_selected_tokens.expand(-1, -1, hidden_dim))
    _router_weights = F.linear(x / temp, router_weight)  # mor_router: a bias-free linear map to 1
    router_weights = torch.sigmoid(_router_weights)
    router_probs = router_weights * alpha
    weights, selected_tokens = torch.topk(router_probs, top_k, dim=1, sorted=False)
    selected_tokens, index = torch.sort(selected_tokens, dim=1)
    weights = torch.gather(weights, dim=1, index=index)
    top_k_tokens = torch.gather(x, dim=1, index=selected_tokens.expand(-1, -1, hidden_dim))
    if prev_selected_tokens is not None:
        selected_tokens = torch.gather(prev_selected_tokens, dim=1, index=selected_tokens)
    for blk in blocks:
        top_k_tokens = blk(top_k_tokens)
    total_x = torch.scatter_add(total_x, dim=1, index=selected_tokens.expand(-1, -1, hidden_dim),
                                src=top_k_tokens * weights)
    return total_x, selected_tokens, weights


def official_forward(model, idx):
    """The whole model with the official recursion layers in the middle: (logits, [(selected, weights)] per r)."""
    cfg = model.cfg
    x = model.embed(idx)
    for block in model.first:
        x = block(x)
    chosen, prev = [], None
    for r, beta in enumerate(capacity_schedule(cfg)):
        x, prev, weights = official_recursion(x, model.routers[r].weight, model.shared, beta, cfg.temperature,
                                              cfg.alpha, prev)
        chosen.append((prev[..., 0], weights[..., 0]))
    for block in model.last:
        x = block(x)
    return model.head(x), chosen


@pytest.mark.parametrize("settings", [
    dict(n_layer=5, num_recursions=3),  # the paper's N_r = 3, capacities 1, 2/3, 1/3
    dict(n_layer=4, num_recursions=2, capacities=[0.5, 0.25], temperature=0.5, alpha=0.3),
    dict(n_layer=6, num_recursions=3, sharing="cycle", capacities=[0.75, 0.5, 0.125]),  # S = 2 shared blocks
], ids=["nr3", "nr2-top-k-both", "cycle-S2"])
def test_expert_choice_picks_the_official_tokens_and_weights_and_gives_its_forward(settings):
    model = build(**settings)
    with torch.no_grad():
        ours = model(tokens())
        reference, chosen = official_forward(model, tokens())
    for r, (selected, weights) in enumerate(chosen):
        site = ours.trace[r]
        ours_selected = site.selected[..., 0].bool()
        expected = torch.zeros_like(ours_selected).scatter(1, selected, True)
        assert torch.equal(ours_selected, expected), f"recursion {r}: other tokens chosen"
        torch.testing.assert_close(site.weights[..., 0].gather(1, selected), weights, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(ours.logits, reference, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- a naive per-token reference
def stack_per_token(model, h, runs, r):
    """The shared stack at recursion r, one token at a time: token t attends over the tokens s <= t of its row
    that run recursion r, with their states at r. Returns F(h) (B, T, d) (rows not running: h)."""
    B, T, d = h.shape
    for block in model.shared:
        attn = block.attn
        q, k, v = (attn.split_heads(t) for t in attn.c_attn(block.ln_1(h)).chunk(3, dim=-1))
        a = torch.zeros_like(h)
        for b in range(B):
            for t in range(T):
                keys = [s for s in range(t + 1) if runs[b, s]]
                if runs[b, t]:
                    y = F.scaled_dot_product_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys])
                    a[b, t] = attn.c_proj(attn.merge_heads(y))[0, 0]
        mid = h + a
        h = torch.where(runs.unsqueeze(-1), mid + block.mlp(block.ln_2(mid)), h)
    return h


def naive_token_choice(model, idx):
    """Token choice from scratch: argmax depth of softmax(W x / temperature) after the first block, recursions
    r <= depth, the gate (the chosen depth's probability) at the last one. Returns (logits, depth as run)."""
    cfg = model.cfg
    x = model.embed(idx)
    for block in model.first:
        x = block(x)
    probs = (F.linear(x, model.router.weight) / cfg.temperature).softmax(-1)
    gate, chosen = probs.max(-1)
    depth = torch.zeros(idx.shape)
    for r in range(model.N):
        runs = chosen >= r
        f = stack_per_token(model, x, runs, r)
        g = gate.unsqueeze(-1)
        gated = x + g * f if cfg.update == "official" else x + g * (f - x)
        x = torch.where((chosen == r).unsqueeze(-1), gated, torch.where(runs.unsqueeze(-1), f, x))
        depth += runs.float() * model.S
    for block in model.last:
        x = block(x)
    return model.head(x), depth


@pytest.mark.parametrize("settings", [dict(), dict(sharing="cycle", update="delta"), dict(n_layer=5, num_recursions=3)],
                         ids=["middle-cycle", "cycle-delta", "nr3"])
def test_token_choice_equals_a_naive_per_token_reference_and_reports_the_depth_run(settings):
    model = build("mor_token", **settings)
    with torch.no_grad():
        # routers at init score almost uniformly: sharper ones, so that every depth is chosen
        model.router.weight.mul_(50.0)
        idx = tokens(B=2, T=16)
        out = model(idx)
        reference, depth = naive_token_choice(model, idx)
    torch.testing.assert_close(out.logits, reference, atol=2e-5, rtol=1e-5)
    site = out.trace[-1]
    assert torch.equal(site.extras["depth"], depth)
    assert float(site.extras["max_depth"]) == model.N * model.S
    assert len(set(depth.flatten().tolist())) == model.N, "the check saw only one depth"


def test_expert_choice_reports_the_depth_each_token_was_computed_at():
    """depth = S * (number of recursion sites that chose the token); a token's stream changes in exactly the
    recursions that chose it (checked on the residual snapshots)."""
    model = build(n_layer=5, num_recursions=3)
    with torch.no_grad():
        out = model(tokens(), return_residuals=True)
    chosen = torch.stack([s.selected[..., 0] for s in out.trace])  # (N_r, B, T)
    assert torch.equal(out.trace[-1].extras["depth"], chosen.sum(0).float() * model.S)
    ffn = [s.hidden for s in out.residuals if s.tag == "ffn"][1:1 + model.N]  # after each recursion
    before = [s.hidden for s in out.residuals if s.tag == "ffn"][0]
    for r, after in enumerate(ffn):
        changed = (after - before).abs().amax(-1) > 0
        assert torch.equal(changed, chosen[r].bool()), f"recursion {r}"
        before = after


# ---------------------------------------------------------------------------- recursion-wise KV caching
@pytest.mark.parametrize("name", ["mor", "mor_token"])
def test_each_recursion_caches_the_keys_of_exactly_the_tokens_that_ran_it(name):
    model = build(name, sharing="cycle")
    if name == "mor_token":
        model.router.weight.data.mul_(50.0)
    idx = tokens(B=2, T=20)
    with torch.no_grad(), model.causal_routing():
        full = model(idx)
        cache = KVCache()
        model(idx[:, :7], cache=cache)
        for t in range(7, 20):
            model(idx[:, t:t + 1], cache=cache)
    runs = recursion_runs(model, full.trace)
    for r, run in enumerate(runs):
        for j in range(model.S):
            for b in range(2):
                assert cache.length(f"mor.r{r}.s{j}.row{b}") == int(run[b].sum()), f"recursion {r}, block {j}, row {b}"
    assert any(int(run.sum()) < run.numel() for run in runs), "every token ran every recursion: nothing checked"


def recursion_runs(model, trace):
    if model.cfg.routing == "expert":
        return [s.selected[..., 0].bool() for s in trace]
    depth = trace[0].selected[..., 0]
    return [depth >= r for r in range(model.N)]


# ---------------------------------------------------------------------------- FLOPs
def test_expert_choice_flops_follow_the_capacity_schedule_and_undercut_vanilla():
    """Without padding recursion r runs k_r = floor(beta_r T) tokens per row: the traced figure is the planned one,
    below the dense model's at the same depth."""
    model = build(n_layer=5, num_recursions=3)
    with torch.no_grad():
        out = model(tokens())
    traced, planned = model.flops_per_token(out.trace), model.flops_per_token(None, seq_len=32)
    assert traced.forward == pytest.approx(planned.forward, rel=1e-12)
    assert float(out.trace[-1].extras["block_tokens"]) == 3 * (32 + 21 + 10)
    vanilla = build_model(VARIANTS["vanilla"].test_config("vanilla", n_layer=5)).flops_per_token(None, seq_len=32)
    assert traced.ffn == pytest.approx(vanilla.ffn * (2 + (32 + 21 + 10) / 32) / 5)


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("settings,field", [
    (dict(num_recursions=3), "model.mor.num_recursions"),  # 2 shared positions at L = 4
    (dict(capacities=[0.5, 0.75]), "model.mor.capacities"),
    (dict(capacities=[1.0]), "model.mor.capacities"),
    (dict(routing="mixed"), "model.mor.routing"),
    (dict(sharing="sequence"), "model.mor.sharing"),
    (dict(alpha=0.0), "model.mor.alpha"),
])
def test_bad_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        build(**settings)


def test_the_balance_loss_is_switch_over_the_depths():
    model = build("mor_token")
    model.router.weight.data.mul_(50.0)
    with torch.no_grad():
        out = model(tokens())
    site = out.trace[0]
    probs, chosen = site.probs.reshape(-1, model.N), site.selected.reshape(-1)
    f = torch.bincount(chosen, minlength=model.N).float() / chosen.numel()
    expected = model.cfg.balance_coef * model.N * (f * probs.mean(0)).sum()
    torch.testing.assert_close(out.aux_losses["mor.depth/balance"], expected)


@pytest.mark.parametrize("name", ["mor", "mor_token"])
def test_every_residual_snapshot_is_the_whole_stream(name):
    """(B, T, d) after every block application, inside a shared stack of 2 (cycle) too: the contribution
    callback's logit lens reads each one."""
    model = build(name, sharing="cycle")
    with torch.no_grad():
        out = model(tokens(), return_residuals=True)
    assert len(out.residuals) == 1 + 2 * 4
    assert all(s.hidden.shape == (3, 32, 32) for s in out.residuals)


@pytest.mark.parametrize("name", ["mor", "mor_token"])
def test_per_token_compute_of_the_probe_callback_is_the_depth_each_token_ran(name):
    """``callbacks.probe.token_flops`` cuts the trace to one token (statistics dropped): a token pays the distinct
    blocks, ``depth`` shared-block applications (its own key in their attention) and the routers."""
    from architectures import flops as F_
    from callbacks.probe import token_flops

    model = build(name, n_layer=5, num_recursions=3)
    if name == "mor_token":
        model.router.weight.data.mul_(50.0)
    with torch.no_grad():
        out = model(tokens())
    per_token = token_flops(model, out.trace, 32)
    cfg, d = model.config, model.config.d_model
    edge = F_.dense_block(d, cfg.ffn_hidden, 32).scale(2) + F_.lm_head(d, cfg.vocab_size)
    shared = F_.dense_block(d, cfg.ffn_hidden, 1).forward
    expected = edge.forward + model.router_flops() + out.trace[-1].extras["depth"].double() * shared
    torch.testing.assert_close(per_token, expected, rtol=1e-12, atol=0)
    assert len(set(out.trace[-1].extras["depth"].flatten().tolist())) > 1, "one depth only: nothing checked"
