"""Issue 22: activation checkpointing for every variant, the memory plan, paper recipes that fit."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from architectures import build_model, variant_names
from architectures.checkpointing import RoutingMismatch, parse_policy, set_activation_checkpointing
from architectures.config import ConfigError
from architectures.registry import VARIANTS

V, T = 97, 32

# every registry entry, plus routing settings with randomness or capacity drops inside a checkpointed unit
CASES = [(name, {}) for name in variant_names()] + [
    ("moe", {"moe": {"top_k": 2, "dropless": False, "capacity_factor": 1.0}}),
    ("mot_seq", {"mot": {"random_activation": 0.5}}),  # torch.rand inside the unit: RNG must be restored
    ("vanilla", {"dropout": 0.1}),
    ("mod", {"mod": {"sampling": "aux_loss"}}),
    ("mom_official", {"mom": {"balance_form": "official"}}),  # balance parts collected across units
    ("depth_gate_skip", {}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in extra.items()) for name, extra in CASES]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def forward_backward(model, idx, seed=5):
    torch.manual_seed(seed)  # the same RNG stream for both models (dropout, MoT's random slot)
    out = model(idx)
    loss = F.cross_entropy(out.logits.reshape(-1, V), idx.roll(-1, 1).reshape(-1)) + out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("policy", ["blocks", "every_k:2"])
@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_checkpointed_training_step_equals_the_plain_one(name, extra, policy):
    torch.manual_seed(0)
    plain = build_model(VARIANTS[name].test_config(name, **extra)).train()
    ckpt = set_activation_checkpointing(copy.deepcopy(plain), policy)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    out_a, grads_a = forward_backward(plain, idx)
    out_b, grads_b = forward_backward(ckpt, idx)
    torch.testing.assert_close(out_b.logits, out_a.logits, rtol=0, atol=0)
    torch.testing.assert_close(out_b.aux_loss, out_a.aux_loss, rtol=0, atol=0)
    assert out_b.aux_losses.keys() == out_a.aux_losses.keys()
    assert [s.name for s in out_b.trace] == [s.name for s in out_a.trace]  # nothing recorded twice
    for a, b in zip(out_a.trace, out_b.trace):
        assert torch.equal(a.selected, b.selected) and torch.equal(a.weights, b.weights), a.name
    assert grads_b.keys() == grads_a.keys()
    for key in grads_a:
        torch.testing.assert_close(grads_b[key], grads_a[key], rtol=1e-5, atol=1e-7, msg=key)


def test_checkpointing_really_recomputes_and_saves_less():
    """The saved-for-backward bytes drop with checkpointing (so the test above compares a real recompute)."""
    from experiments.memory import saved_activation_bytes

    torch.manual_seed(0)
    model = build_model(VARIANTS["moe"].test_config("moe"))
    idx = torch.randint(0, V, (2, T))
    plain = saved_activation_bytes(model, idx)
    set_activation_checkpointing(model, "blocks")
    blocks = saved_activation_bytes(model, idx)
    set_activation_checkpointing(model, "every_k:2")
    half = saved_activation_bytes(model, idx)
    assert blocks < half < plain


def test_a_recomputation_that_routes_differently_raises():
    torch.manual_seed(0)
    model = set_activation_checkpointing(build_model(VARIANTS["mod"].test_config("mod")), "blocks")
    block = model.blocks[model.routed[0]]
    calls = []
    original = block.router_logits

    def flaky(x):  # the second call (the recomputation) ranks the tokens the other way round
        calls.append(1)
        logits = original(x)
        return logits if len(calls) == 1 else -logits

    block.router_logits = flaky
    out = model(torch.randint(0, V, (2, T)))
    with pytest.raises(RoutingMismatch, match="block"):
        (out.logits.sum() + out.aux_loss).backward()


@pytest.mark.parametrize("value", ["every_k:0", "sometimes", "every_k:x", "every_k:-2"])
def test_bad_checkpointing_values_are_rejected(value):
    with pytest.raises(ConfigError, match="activation_checkpointing: .*none, blocks, every_k:N"):
        parse_policy(value)


def test_policy_values():
    assert parse_policy("none") is None
    assert str(parse_policy("blocks")) == "blocks"
    assert parse_policy("every_k:3").every == 3


def test_no_checkpointing_without_grad_or_with_a_cache():
    torch.manual_seed(0)
    model = set_activation_checkpointing(build_model(VARIANTS["moe"].test_config("moe")), "blocks").eval()
    prompt = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        plain = model.generate(prompt, 4, greedy=True)
    model.checkpoint_policy = None
    assert torch.equal(plain, model.generate(prompt, 4, greedy=True))
