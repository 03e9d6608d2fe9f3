"""early_exit: CALM exit against a naive per-token reference, LayerSkip training, depth and FLOPs as run.

The reference (``naive_calm``) walks each sequence token by token and layer by layer with the block's own
modules: a running token computes Q, K, V, attends to the keys written so far at that layer, runs the FFN
and is checked with the shared head; an exited token only writes the K and V of its copied state. The
model's gathered forward must give the same logits and report the same per-token depth.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import KVCache, build_model
from architectures.config import ConfigError
from architectures.early_exit import confidence, dropout_rates, exit_loss_weights, EarlyExitConfig
from architectures.registry import VARIANTS
from tests import invariants

V, T, L = 97, 32, 4
STATE_THRESHOLD = 0.72  # the cosine of the stream across a layer is 0.3-0.9 in this case


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def build(seed=0, **early_exit):
    torch.manual_seed(seed)
    model = build_model(VARIANTS["early_exit"].test_config("early_exit", early_exit=early_exit))
    with torch.no_grad():  # a sharper head and larger layer updates than the init's, so that the confidences
        model.wte.weight.mul_(4.0)  # vary from layer to layer and tokens exit at every depth
        for name, param in model.named_parameters():
            if name.endswith("c_proj.weight"):
                param.mul_(30.0)
    return model


def tokens(B=3, length=T, seed=1):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def naive_calm(model, idx):
    """(logits (B, T, V), depth (B, T)) by the per-token loop described in the module docstring."""
    cfg, d = model.config.early_exit, model.config.d_model
    B, Tn = idx.shape
    logits, depth = torch.zeros(B, Tn, V), torch.zeros(B, Tn)
    for b in range(B):
        keys = [[] for _ in model.blocks]
        for t in range(Tn):
            h = model.wte(idx[b, t]) + model.wpe.weight[t]
            running = True
            for l, block in enumerate(model.blocks):
                attn = block.attn
                qkv = attn.c_attn(block.ln_1(h))
                keys[l].append(qkv[d:])
                if not running:
                    continue
                depth[b, t] += 1
                before = h
                kv = torch.stack(keys[l])  # (t + 1, 2d)
                q, k, v = (z.view(-1, attn.n_head, d // attn.n_head).transpose(0, 1)
                           for z in (qkv[None, :d], kv[:, :d], kv[:, d:]))
                y = torch.softmax(q @ k.transpose(1, 2) / (d // attn.n_head) ** 0.5, dim=-1) @ v
                h = h + attn.c_proj(y.transpose(0, 1).reshape(d))
                h = h + block.mlp(block.ln_2(h))
                if l < L - 1 and cfg.eval_exit:
                    score = (F.cosine_similarity(h, before, dim=0) if cfg.confidence == "state"
                             else confidence(model.head(h)[None].float(), cfg.confidence)[0])
                    running = bool(score < cfg.exit_threshold)
            logits[b, t] = model.head(h)
    return logits, depth


def spread(depth):
    return sorted(set(depth.long().flatten().tolist()))


@pytest.mark.parametrize("rule,threshold", [("softmax", 0.03), ("softmax", 0.035), ("margin", 0.005), ("margin", 0.01),
                                            ("state", STATE_THRESHOLD)])
def test_gathered_exit_equals_the_naive_per_token_reference_and_reports_its_depth(rule, threshold):
    model = build(confidence=rule, exit_threshold=threshold).eval()
    idx = tokens()
    with torch.no_grad():
        out = model(idx)
        logits, depth = naive_calm(model, idx)
    assert len([x for x in spread(depth) if x < L]) >= 2, f"the case exits at too few depths: {spread(depth)}"
    torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
    site = out.trace[-1]
    assert site.name == f"layer{L - 1}.exit" and float(site.extras["max_depth"]) == L
    assert torch.equal(site.extras["depth"], depth)
    for l, layer_site in enumerate(out.trace):  # "run" at layer l exactly for the tokens that reached it
        assert torch.equal(layer_site.selected[..., 0] == 0, depth > l)


def test_eval_exit_off_runs_every_layer_as_the_dense_model():
    model = build(exit_threshold=0.03, eval_exit=False).eval()
    idx = tokens()
    with torch.no_grad():
        out = model(idx)
        x = model.embed(idx)
        for block in model.blocks:
            x = block(x)
    torch.testing.assert_close(out.logits, model.head(x), atol=1e-5, rtol=1e-5)
    assert bool((out.trace[-1].extras["depth"] == L).all())


def test_cached_decoding_equals_the_full_forward_and_generation_with_spread_exits():
    model = build(exit_threshold=0.03).eval()
    idx = tokens(B=2)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache()
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, T)]
    assert len(spread(full.trace[-1].extras["depth"])) >= 3
    torch.testing.assert_close(torch.cat([s.logits for s in steps], dim=1), full.logits, atol=1e-5, rtol=1e-5)
    depth = torch.cat([s.trace[-1].extras["depth"] for s in steps], dim=1)
    assert torch.equal(depth, full.trace[-1].extras["depth"])
    prompt = tokens(B=2, length=4)
    assert torch.equal(model.generate(prompt, 8, greedy=True), model.generate(prompt, 8, greedy=True, use_cache=False))


def counted(model, *args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        torch.manual_seed(7)
        out = model(*args, **kwargs)
    return out, counter.get_total_flops()


@pytest.mark.parametrize("training,rule", [(False, "softmax"), (False, "state"), (True, "softmax")],
                         ids=["eval", "eval-state", "train"])
def test_flops_per_token_equal_the_flop_counter_as_run_with_exits_and_with_layer_dropout(training, rule):
    threshold = STATE_THRESHOLD if rule == "state" else 0.03
    model = build(exit_threshold=threshold, confidence=rule, p_max=0.6).train(training)
    idx = tokens(B=4)
    mask = torch.ones(4, T, dtype=torch.long)
    mask[1, 20:] = 0
    out, flops = counted(model, idx, attention_mask=mask)
    depth = out.trace[-1].extras["depth"]
    assert float(depth.mean()) < L and len(spread(depth)) >= 2, "the case skips nothing: the check would see nothing"
    assert model.flops_per_token(out.trace).forward * idx.numel() == pytest.approx(flops, rel=1e-6)
    if not training:
        cache = KVCache()
        counted(model, idx[:, :20], cache=cache)
        out, flops = counted(model, idx[:, 20:21], cache=cache)
        assert model.flops_per_token(out.trace, queries=1).forward * 4 == pytest.approx(flops, rel=1e-6)


def test_layer_dropout_skips_whole_rows_and_the_depth_counts_the_layers_run():
    model = build(p_max=0.7).train()
    idx = tokens(B=8)
    with torch.no_grad():
        torch.manual_seed(3)
        out = model(idx, return_residuals=True)
    states = [out.residuals[0].hidden] + [s.hidden for s in out.residuals[2::2]]  # embed, then after each layer
    ran = torch.stack([(after - before).abs().amax(dim=-1) > 0 for before, after in zip(states, states[1:])], -1)
    assert torch.equal(ran.all(dim=1) | ~ran.any(dim=1), torch.ones_like(ran[:, 0]))  # per sample, all T or none
    assert bool(ran[:, :, 0].all()), "p_0 is 0: the first layer always runs"
    assert not bool(ran.all()), "nothing dropped: the check would see nothing"
    assert torch.equal(out.trace[-1].extras["depth"], ran.sum(-1).float())


def test_dropout_rates_and_exit_weights_follow_the_paper():
    exp = dropout_rates(EarlyExitConfig(p_max=0.2), 4)
    assert exp == pytest.approx([0.0, 0.2 * (2 ** (1 / 3) - 1), 0.2 * (2 ** (2 / 3) - 1), 0.2])
    assert dropout_rates(EarlyExitConfig(p_max=0.3, dropout_schedule="linear"), 4) == pytest.approx([0, 0.1, 0.2, 0.3])
    # e_l = e_scale * sum_{i<=l} i = [0, 1, 3] * 0.5; e_{L-1} = 3 + 0.5 * 3 = 4.5
    assert exit_loss_weights(EarlyExitConfig(exit_scale=0.5), 4) == pytest.approx([0.0, 0.5 / 4.5, 1.5 / 4.5])
    assert exit_loss_weights(EarlyExitConfig(exit_weights="uniform", exit_scale=0.3), 4) == pytest.approx([0.3] * 3)
    # the official code: cumsum(l + 1) = [1, 3, 6, 10], times e_scale below the last layer, over the last one's 10
    official = exit_loss_weights(EarlyExitConfig(exit_weights="official", exit_scale=0.5), 4)
    assert official == pytest.approx([0.05, 0.15, 0.3])


def test_exit_losses_are_the_weighted_next_token_losses_of_the_head_after_each_layer():
    model = build(p_max=0.0, exit_scale=0.5).train()
    idx = tokens(B=3)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[2, 9:] = 0
    out = model(idx, attention_mask=mask, return_residuals=True)
    pair = (mask[:, :-1] * mask[:, 1:]).bool()
    weights = exit_loss_weights(model.config.early_exit, L)
    assert sorted(out.aux_losses) == ["early_exit/layer1", "early_exit/layer2"]  # layer 0 has weight 0
    for l in (1, 2):
        h = out.residuals[2 + 2 * l].hidden  # after layer l's FFN
        ce = F.cross_entropy(model.head(h)[:, :-1][pair].float(), idx[:, 1:][pair])
        torch.testing.assert_close(out.aux_losses[f"early_exit/layer{l}"], weights[l] * ce)
    out.aux_loss.backward()
    assert model.blocks[0].mlp.c_fc.weight.grad.abs().max() > 0  # the exits train the layers below them


def test_with_a_loss_mask_the_exit_losses_are_the_lm_loss_s_weighted_mean_and_masked_targets_train_nothing():
    """``data.loss_mask``: the LM module hands the model its weights divided by the LM loss's divisor; each exit
    loss is then sum(w * CE) over the real pairs (a naive per-position reference), and the head's logits at a
    masked position get no gradient from the exits (before this, the exits trained on every target)."""
    model = build(p_max=0.0, exit_scale=0.5).train()
    idx = tokens(B=3)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[2, 9:] = 0
    weights = (torch.rand(3, T, generator=torch.Generator().manual_seed(3)) > 0.6).float()
    weights[0, 0] = 1.0
    scaled = weights / weights.sum()
    out = model(idx, attention_mask=mask, return_residuals=True, loss_weights=scaled)
    exit_weights = exit_loss_weights(model.config.early_exit, L)
    heads = {}
    for l in (1, 2):
        h = out.residuals[2 + 2 * l].hidden
        h.retain_grad()
        heads[l] = h
        naive = sum(float(scaled[b, t]) * float(F.cross_entropy(model.head(h[b, t]).detach().float(), idx[b, t + 1]))
                    for b in range(3) for t in range(T - 1) if mask[b, t] and mask[b, t + 1])
        assert float(out.aux_losses[f"early_exit/layer{l}"]) == pytest.approx(exit_weights[l] * naive, rel=1e-5)
    sum(out.aux_losses.values()).backward()
    grad = heads[2].grad  # layer 2 is below no later exit: its stream's gradient is its own exit's
    masked = (weights[:, :-1] == 0) | ~(mask[:, :-1] & mask[:, 1:]).bool()
    assert masked.any() and (~masked).any()
    assert grad[:, :-1][masked].abs().max() == 0 and grad[:, :-1][~masked].abs().max() > 0


def test_training_is_causal_with_layer_dropout_and_a_layer_no_row_runs_gets_zero_gradients():
    model = build(p_max=0.6)
    invariants.check_causal(model, tokens(), T // 2, training=True)
    model.drop_rates = [0.0, 0.0, 0.0, 1.0]  # every row drops the last layer
    idle = invariants.check_idle_units_get_zero_gradients(model, tokens(B=2, length=6))
    assert idle == []
    model.train()
    torch.manual_seed(0)
    out = model(tokens(B=2, length=6))
    (out.logits.sum() + out.aux_loss).backward()
    assert float(model.blocks[3].mlp.c_fc.weight.grad.abs().max()) == 0.0


@pytest.mark.parametrize("field,value,message", [
    ("p_max", 1.0, r"model\.early_exit\.p_max: must be in \[0, 1\)"),
    ("dropout_schedule", "cosine", r"model\.early_exit\.dropout_schedule: must be one of exponential, linear"),
    ("exit_weights", "x", r"model\.early_exit\.exit_weights: must be one of paper, official, uniform"),
    ("exit_scale", -1.0, r"model\.early_exit\.exit_scale: must be >= 0"),
    ("exit_threshold", 0.0, r"model\.early_exit\.exit_threshold: must be in \(0, 1\]"),
    ("confidence", "entropy", r"model\.early_exit\.confidence: must be one of softmax, margin, state"),
])
def test_bad_options_are_refused_with_the_field_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        build_model(VARIANTS["early_exit"].test_config("early_exit", early_exit={field: value}))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_forward_traces_as_one_graph_without_breaks(training):
    """LayerSkip's row gather has no branch on a count, and under torch.compile evaluation attends on the
    (B, T) grid (``padded_attention``): dynamo traces a whole step at once."""
    from experiments import compiling

    model = build(p_max=0.5, exit_threshold=0.03).train(training)
    idx = tokens(B=2, length=16)

    def loss(idx):
        out = model(idx)
        return F.cross_entropy(out.logits.reshape(-1, V), idx.reshape(-1)) + out.aux_loss

    with torch.set_grad_enabled(training):
        report = compiling.graph_report(loss, idx)
    assert (report.graphs, report.graph_breaks) == (1, 0), report.reasons


@pytest.mark.parametrize("cached", [0, 5])
def test_the_compiled_padded_attention_gives_the_gathered_attention(cached):
    """The one-graph form of evaluation's attention equals the eager per-row one on the running tokens."""
    from architectures.early_exit import padded_attention, row_attention

    B, Tn, H, hd = 3, 7, 2, 4
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, cached + Tn, hd, generator=gen), torch.randn(B, H, cached + Tn, hd, generator=gen)
    running = torch.rand(B, Tn, generator=gen) < 0.5
    running[1] = False  # a row without running tokens
    flat = running.reshape(-1).nonzero().squeeze(1)
    q = torch.randn(flat.numel(), H, hd, generator=gen)
    rows, positions = torch.div(flat, Tn, rounding_mode="floor"), flat % Tn + cached
    torch.testing.assert_close(padded_attention(q, k, v, flat, B, Tn), row_attention(q, k, v, rows, positions))


@pytest.mark.parametrize("rule", ["softmax", "state"])
def test_the_probes_per_token_compute_follows_each_tokens_exit_and_sums_to_the_counted_flops(rule):
    """``callbacks.probe.token_flops`` cuts the trace to one token: a token pays the layers it ran, K/V after it
    exited and its head checks; the per-token figures add up to the FlopCounter's count of the forward."""
    from callbacks.probe import token_flops

    model = build(exit_threshold=STATE_THRESHOLD if rule == "state" else 0.03, confidence=rule).eval()
    idx = tokens()
    out, flops = counted(model, idx)
    per_token = token_flops(model, out.trace, T)
    depth = out.trace[-1].extras["depth"]
    assert len(spread(depth)) >= 2, "one depth only: nothing checked"
    assert float(per_token.sum()) == pytest.approx(flops, rel=1e-6)
    order = depth.flatten().argsort()
    assert (per_token.flatten()[order].diff() >= -1e-6).all(), "a token that ran more layers costs no less"
