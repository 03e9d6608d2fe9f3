"""recur_halt: the gathered, per-token-halted recursion against a naive masked reference, its FLOPs, its options.

The reference runs the shared stack on EVERY token at every step (dense causal attention, no gathering) and keeps
what the halting rule says, by masks: a halted token's state and its keys / values stay those of its last step.
Its halting is written out from the papers' formulas (ACT: p_s = h_s; PonderNet: p_s = lambda_s prod (1 - lambda);
halt once the cumulative mass reaches 1 - eps; the remainder weights the last state). The model gathers the
running tokens instead; both must give the same logits, depths and aux losses.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from architectures import KVCache, build_model
from architectures import flops as F_
from architectures.config import ConfigError
from architectures.gpt2 import causal_attention
from architectures.registry import VARIANTS

V, T = 97, 32
# tokens halt after 2, 3 or 4 steps at init (the neutral default halts ACT tokens after 2, the deep start runs 4)
MIXED = {"init_std": 0.2, "recur_halt": {"halt_bias_init": -1.0, "threshold": 0.2}}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def build(name="recur_halt", **extra):
    torch.manual_seed(0)
    merged = {**MIXED, **extra, "recur_halt": {**MIXED["recur_halt"], **extra.get("recur_halt", {})}}
    return build_model(VARIANTS[name].test_config(name, **merged)).eval()


def tokens(B=2, length=T, seed=1):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def masked_step(block, x, frozen, running):
    """One shared block on every token; a halted token keeps its state and its frozen keys / values."""
    attn = block.attn
    q, k, v = attn.c_attn(block.ln_1(x)).chunk(3, dim=-1)
    if frozen is not None:
        k, v = torch.where(running[..., None], k, frozen[0]), torch.where(running[..., None], v, frozen[1])
    y = causal_attention(*(attn.split_heads(t) for t in (q, k, v)))
    new = x + attn.c_proj(attn.merge_heads(y))
    new = new + block.mlp(block.ln_2(new))
    return torch.where(running[..., None], new, x), (k, v)


def reference(model, idx):
    """(logits, steps per token, aux value) of the naive masked recursion."""
    cfg, S = model.config.recur_halt, model.max_steps
    x = model.embed(idx)
    for block in model.prelude:
        x = block(x)
    running = torch.ones(idx.shape, dtype=torch.bool)
    cum, remaining, mix = torch.zeros(idx.shape), torch.ones(idx.shape), torch.zeros_like(x)
    steps, remainder, kl = torch.zeros(idx.shape), torch.zeros(idx.shape), torch.zeros(idx.shape)
    frozen = [None] * len(model.shared)
    prior = cfg.prior * (1 - cfg.prior) ** torch.arange(S, dtype=torch.float32)
    prior = prior / prior.sum()
    for s in range(1, S + 1):
        for j, block in enumerate(model.shared):
            x, frozen[j] = masked_step(block, x, frozen[j], running)
        steps += running.float()
        if s < S:
            h = torch.sigmoid(F.linear(x, model.halt_router.proj.weight).squeeze(-1) + model.halt_router.bias)
            p = h if cfg.halting == "act" else remaining * h
            halt = running & (cum + p >= 1 - cfg.threshold)
            w = torch.where(halt, 1 - cum, p)
            going = running & ~halt
            cum, remaining = torch.where(going, cum + p, cum), torch.where(going, remaining * (1 - h), remaining)
        else:
            halt, w = running, 1 - cum
        w = torch.where(running, w, torch.zeros_like(w))
        mix = mix + w[..., None] * x
        remainder = torch.where(halt, w, remainder)
        kl = kl + torch.where(running, w * (w.clamp_min(1e-12).log() - prior[s - 1].log()), torch.zeros_like(w))
        running = running & ~halt
    for block in model.coda:
        mix = block(mix)
    aux = cfg.ponder_cost * (steps + remainder).mean() if cfg.halting == "act" else cfg.kl_coef * kl.mean()
    return model.head(mix), steps, aux


SHAPES = [{}, {"recur_halt": {"n_shared": 2, "max_steps": 4}},
          {"recur_halt": {"prelude": 1, "coda": 1, "max_steps": 4}}]


@pytest.mark.parametrize("name", ["recur_halt", "recur_halt_ponder"])
@pytest.mark.parametrize("shape", SHAPES, ids=["plain", "n_shared2", "prelude_coda"])
def test_the_gathered_recursion_equals_the_masked_reference_and_reports_the_depth_it_ran(name, shape):
    model = build(name, **shape)
    idx = tokens()
    with torch.no_grad():
        out = model(idx)
        logits, steps, aux = reference(model, idx)
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-5)
    (site,) = out.trace
    n_shared = model.config.recur_halt.n_shared
    assert torch.equal(site.extras["depth"], steps * n_shared)  # the depth the token was computed at
    assert float(site.extras["max_depth"]) == model.max_steps * n_shared
    assert torch.equal(site.selected[..., 0] + 1, steps.long())
    assert len(set(steps.flatten().tolist())) >= 2, "the case must mix depths"
    torch.testing.assert_close(out.aux_loss, aux)
    torch.testing.assert_close(site.probs.sum(-1), torch.ones(idx.shape))  # a distribution over the depths


@pytest.mark.parametrize("shape", SHAPES, ids=["plain", "n_shared2", "prelude_coda"])
def test_decoding_with_mixed_depths_equals_the_full_forward(shape):
    model = build(**shape)
    idx = tokens()
    with torch.no_grad():
        full = model(idx)
        cache = KVCache()
        steps = [model(idx[:, :5], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(5, T)]
    torch.testing.assert_close(torch.cat([s.logits for s in steps], dim=1), full.logits, atol=1e-5, rtol=1e-5)
    depth = torch.cat([s.trace[0].extras["depth"] for s in steps], dim=1)
    assert torch.equal(depth, full.trace[0].extras["depth"])
    n = model.config.recur_halt.n_shared
    recursion = {name: kv for name, kv in cache.layers.items() if name.startswith("recur.")}
    assert len(recursion) == model.max_steps * n  # one entry per (step, shared block), every position
    assert {k.shape[2] for k, _ in recursion.values()} == {T}


def shared_flops(model, steps: int, T: int) -> float:
    cfg = model.config
    n = cfg.recur_halt.n_shared
    return steps * n * F_.dense_block(cfg.d_model, cfg.ffn_hidden, T).forward


def test_tokens_that_halt_stop_paying_compute():
    """All tokens halting after step 1 (a large positive bias) pay one step; the deep start pays S."""
    d, S = 32, 4
    head = F_.lm_head(d, V).forward
    for bias, steps, router_steps in ((20.0, 1, 1), (-20.0, S, S - 1)):
        model = build(recur_halt={"halt_bias_init": bias})
        out = model(tokens())
        assert torch.equal(out.trace[0].extras["depth"], torch.full((2, T), float(steps)))
        expected = head + shared_flops(model, steps, T) + router_steps * F_.linear(d, 1)
        assert model.flops_per_token(out.trace).forward == pytest.approx(expected)


def test_the_neutral_default_halts_act_after_two_steps_and_the_deep_start_runs_all():
    torch.manual_seed(0)
    neutral = build_model(VARIANTS["recur_halt"].test_config("recur_halt"))
    assert float(neutral.halt_router.bias.detach()) == neutral.config.recur_halt.halt_bias_init == 0.0
    assert set(neutral(tokens()).trace[0].extras["depth"].flatten().tolist()) <= {1.0, 2.0}
    deep = build_model(VARIANTS["recur_halt"].test_config("recur_halt", recur_halt={"halt_bias_init": -3.0}))
    assert float(deep.halt_router.bias.detach()) == -3.0
    assert torch.equal(deep(tokens()).trace[0].extras["depth"], torch.full((2, T), 4.0))


def test_padding_runs_one_step_and_does_not_count_in_the_ponder_cost():
    model = build()
    idx = tokens()
    mask = torch.ones_like(idx)
    mask[0, 20:] = 0
    with torch.no_grad():
        out = model(idx, attention_mask=mask)
        alone = model(idx[:1, :20])
    (site,) = out.trace
    assert torch.equal(site.extras["depth"][0, 20:], torch.ones(T - 20))
    assert not site.valid[0, 20:].any()
    torch.testing.assert_close(out.logits[0, :20], alone.logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value,message", [
    ("halting", "lstm", "must be one of act, ponder"),
    ("max_steps", 1, "must be >= 2"),
    ("n_shared", 0, "must be an integer >= 1"),
    ("threshold", 1.0, r"must be in \(0, 1\)"),
    ("prior", 0.0, r"must be in \(0, 1\)"),
    ("ponder_cost", -1.0, "must be >= 0"),
    ("prelude", -1, "must be an integer >= 0"),
])
def test_bad_options_are_refused_naming_the_field(field, value, message):
    config = VARIANTS["recur_halt"].test_config("recur_halt", recur_halt={field: value})
    with pytest.raises(ConfigError, match=rf"^model\.recur_halt\.{field}: {message}"):
        build_model(config)


def test_max_steps_zero_takes_the_vanilla_depth():
    model = build_model(VARIANTS["recur_halt"].test_config("recur_halt", n_layer=6,
                                                           recur_halt={"prelude": 1, "coda": 1}))
    assert model.max_steps == 4 and len(model.prelude) == len(model.coda) == 1
    with pytest.raises(ConfigError, match=r"^model\.recur_halt\.max_steps: must be >= 2.*n_layer=2"):
        build_model(VARIANTS["recur_halt"].test_config("recur_halt", n_layer=2, recur_halt={"prelude": 1}))


def test_init_from_vanilla_maps_the_prelude_the_shared_blocks_and_the_coda():
    torch.manual_seed(0)
    vanilla = build_model(VARIANTS["vanilla"].test_config("vanilla")).state_dict()  # 4 blocks
    model = build(recur_halt={"prelude": 1, "coda": 1, "n_shared": 1, "max_steps": 3})
    mapping = model.vanilla_state_mapping(vanilla)
    for own, source in (("prelude.0", "blocks.0"), ("shared.0", "blocks.1"), ("coda.0", "blocks.3")):
        for leaf in ("attn.c_attn.weight", "mlp.c_proj.bias", "ln_2.weight"):
            assert torch.equal(mapping[f"{own}.{leaf}"], vanilla[f"{source}.{leaf}"])
    assert torch.equal(mapping["wte.weight"], vanilla["wte.weight"])
    assert not any(name.startswith("halt_router") for name in mapping)  # the halting unit stays fresh
    model.load_state_dict({**model.state_dict(), **mapping})
