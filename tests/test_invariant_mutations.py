"""Tests of the tests: each bug class the invariant suite must catch, planted in a toy variant.

The toy is a routed GPT-2 (each block behind a token-choice router over {block, skip}) registered
temporarily in the registry and built through ``build_model``, like any variant. The clean toy routes
with the suite's ``Router`` (``architectures.routing``) and passes every check of ``tests/invariants.py``;
each mutant (one planted bug) must fail the check that covers its class, so a check weakened until it can
no longer fail is noticed here. The router-protocol bugs (bf16 logits, no site, two sites, a repeated
name, no valid mask) cannot be written with the ``Router`` (it computes fp32 logits with autocast off,
reports its one site with the state's valid mask, and ``ForwardState.report`` refuses a repeated name), so
those mutants route by hand, as a variant that bypasses the ``Router`` would.
"""
from __future__ import annotations

from typing import FrozenSet

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import build_model
from architectures.base import ForwardState, LanguageModel
from architectures.contract import RoutingSite
from architectures.flops import Flops
from architectures.gpt2 import Block
from architectures.registry import VARIANTS, Variant
from architectures.routing import LinearRouter, SiteId, TopK, fp32_linear, token_topk
from tests import invariants

V, T = 97, 32
#: bugs planted in a block that routes by hand (the ``Router`` cannot make them)
BY_HAND = {"bf16_router", "bf16_router_weight", "collapse", "no_site", "two_sites", "same_name", "same_name_reported",
           "no_valid"}


class ToyRoutedBlock(nn.Module):
    """x, or block(x) for the tokens whose router picks "block" (top-1 of {block, skip}, straight-through)."""

    def __init__(self, config, index: int, bugs: FrozenSet[str]):
        super().__init__()
        self.index, self.bugs = index, bugs
        self.block = Block(config, index)
        self.router = LinearRouter(config.d_model, 2, TopK(1, straight_through=True), ["block", "skip"],
                                   SiteId(f"block{index}.toy"))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if "bf16_router" in self.bugs:  # autocast runs the projection in bf16; the cast hides it from a dtype check
            return F.linear(x, self.router.weight).float()
        if "bf16_router_weight" in self.bugs:  # a bf16 copy of the weight, then an "fp32" projection
            return fp32_linear(x, self.router.weight.bfloat16())
        logits = fp32_linear(x, self.router.weight)
        if "collapse" in self.bugs:  # every token prefers skip, as a router collapsed onto its no-op
            logits = logits + torch.tensor([0.0, 20.0])
        return logits

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        if "lookahead_in_training" in self.bugs and self.training:
            x = x + 0.5 * torch.roll(x, -1, dims=1)  # each position reads the next one
        if self.bugs & BY_HAND:
            weights, selected = self.route_by_hand(x, state)
        else:  # the Router: fp32 logits, top-1 straight-through, one site reported with the valid mask
            route = self.router(x, state)
            weights, selected = route.weights, route.selected
        run = (selected == 0).to(x.dtype) * weights.to(x.dtype)
        if "idle_skipped" in self.bugs and not bool((selected == 0).any()):
            return x  # a block no token chose does not run: its parameters get no gradient (None)
        return x + run * (self.block(x, state) - x)

    def route_by_hand(self, x: torch.Tensor, state: ForwardState):
        logits = self.logits(x)
        probs, weights, selected = token_topk(logits, 1, straight_through=True)
        site = RoutingSite(
            name="toy" if self.bugs & {"same_name", "same_name_reported"} else f"block{self.index}.toy",
            kind="token_choice", choice_names=["block", "skip"], selected=selected, weights=weights, probs=probs,
            logits=logits, valid=None if "no_valid" in self.bugs else state.valid)
        if "same_name" in self.bugs:  # appended past ForwardState.report, which would refuse the repeated name
            state.trace.append(site)
        elif not ("no_site" in self.bugs and self.index == 1):
            state.report(site)
        if "two_sites" in self.bugs:
            state.report(RoutingSite(**{**vars(site), "name": f"block{self.index}.toy.again"}))
        return weights, selected

    def flops(self, sites, T: int, queries=None) -> Flops:
        return self.block.flops(sites, T, queries)


class ToyRouted(LanguageModel):
    bugs: FrozenSet[str] = frozenset()

    def __init__(self, config):
        super().__init__(config)
        self.blocks = nn.ModuleList([ToyRoutedBlock(config, i, self.bugs) for i in range(config.n_layer)])
        if "skip_init" not in self.bugs:
            self.init_weights()

    def init_weights(self) -> None:
        if "skip_init" not in self.bugs:
            super().init_weights()


def mutant(*bugs: str) -> type:
    return type("ToyRouted_" + "_".join(bugs), (ToyRouted,), {"bugs": frozenset(bugs)})


@pytest.fixture
def toy(monkeypatch):
    """build(*bugs): a tiny toy model with those bugs, built through the registry and ``build_model``."""
    def build(*bugs: str):
        name = "toy_" + "_".join(bugs or ("clean",))
        cls = mutant(*bugs)
        monkeypatch.setitem(globals(), cls.__name__, cls)  # "module:Class" resolves it
        monkeypatch.setitem(VARIANTS, name, Variant(f"{__name__}:{cls.__name__}", "toy routed GPT-2 (test only)"))
        torch.manual_seed(0)
        return build_model(VARIANTS[name].test_config(name, vocab_size=V, block_size=T))

    return build


def tokens(B=3):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


def right_padded():
    mask = torch.ones(3, T, dtype=torch.long)
    mask[0, 11:] = 0
    mask[1, 23:] = 0
    return mask


def run_all_checks(model) -> None:
    for training in (False, True):
        invariants.check_causal(model, tokens(), T // 2, training)
    invariants.check_router_fp32(model, tokens())
    invariants.check_routing_sites(model, tokens(), right_padded())
    invariants.check_initialised(model)
    with torch.no_grad():
        invariants.check_routing_healthy(model.eval()(tokens()).trace)


def test_the_clean_toy_passes_every_check(toy):
    model = toy()
    with torch.no_grad():  # the toy really routes: both choices taken, so the checks have something to see
        counts = model(tokens()).trace[0].counts()
    assert (counts > 0).all(), counts
    run_all_checks(model)


MUTATIONS = [
    # (bugs, the check that must fail, what its message says)
    (("lookahead_in_training",), lambda m: invariants.check_causal(m, tokens(), T // 2, training=True),
     "look-ahead"),
    (("bf16_router",), lambda m: invariants.check_router_fp32(m, tokens()), "bfloat16"),
    (("bf16_router_weight",), lambda m: invariants.check_router_fp32(m, tokens()), "fp32 recomputation"),
    (("no_site",), lambda m: invariants.check_routing_sites(m, tokens(), right_padded()), "blocks.1 reported 0"),
    (("two_sites",), lambda m: invariants.check_routing_sites(m, tokens(), right_padded()), "reported 2 routed sites"),
    (("same_name",), lambda m: invariants.check_routing_sites(m, tokens(), right_padded()),
     r"more than once in one forward .*\['toy'\]"),
    (("no_valid",), lambda m: invariants.check_routing_sites(m, tokens(), right_padded()), "no valid mask"),
    (("skip_init",), invariants.check_initialised, "PyTorch's default init"),
    (("collapse",), lambda m: invariants.check_routing_healthy(m.eval()(tokens()).trace), "go to skip"),
    # every token prefers skip, so every block is idle; the clean toy still runs them (zero gradients)
    (("collapse", "idle_skipped"), lambda m: invariants.check_idle_units_get_zero_gradients(m, tokens(B=1)),
     r"got no gradient \(None, not zero\)"),
]


@pytest.mark.parametrize("bugs,check,message", MUTATIONS, ids=["+".join(m[0]) for m in MUTATIONS])
def test_the_check_for_each_bug_class_fails_on_a_toy_variant_with_that_bug(toy, bugs, check, message):
    model = toy(*bugs)
    with pytest.raises(AssertionError, match=message):
        with torch.enable_grad() if "idle_skipped" in bugs else torch.no_grad():
            check(model)


def test_the_idle_check_passes_on_the_clean_toy_with_every_block_idle(toy):
    """The toy runs a block no token chose (weight 0): its gradient is zero, not None."""
    assert invariants.check_idle_units_get_zero_gradients(toy("collapse"), tokens(B=1))


def test_a_repeated_site_name_is_refused_when_it_is_reported(toy):
    """``ForwardState.report`` raises on a second site of one name in a forward (before any check runs)."""
    with pytest.raises(ValueError, match=r"routing site 'toy' reported twice in one forward"):
        toy("same_name_reported")(tokens())


def test_a_router_called_twice_under_one_name_raises(toy):
    """The ``Router`` reports on every call, so a block that decides twice under one name cannot go unnoticed."""
    block = toy().blocks[0]
    state = ForwardState.standalone()
    x = torch.randn(2, 5, block.router.in_features)
    route = block.router(x, state)
    assert state.trace == [route.site] and route.site.logits.dtype == torch.float32
    with pytest.raises(ValueError, match="reported twice"):
        block.router(x, state)


def test_the_lookahead_in_training_mode_is_invisible_in_eval_mode(toy):
    """Why the suite checks training mode too: in eval mode this mutant is causal."""
    invariants.check_causal(toy("lookahead_in_training"), tokens(), T // 2, training=False)
