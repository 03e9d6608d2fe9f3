"""Grouped-GEMM vs per-expert loop: the same gradients (None never stands for zero) and a FLOP count for both.

CPU runs the grouped path through PyTorch's CPU grouped-matmul kernel, forced with ``DYNCOMP_GROUPED_MM=1``.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import ModelConfig, build_model
from architectures import flops as cost
from architectures.experts import GroupedExperts
from architectures.grouped_gemm import alignment_padding_rows, grouped_dispatch, grouped_mm_op
from architectures.moe_layer import MoEConfig
from tests.references import dense_reference, per_token_reference

pytestmark = pytest.mark.skipif(grouped_mm_op() is None, reason="this PyTorch has no grouped matmul")

E, D, H = 4, 16, 32


def idle_expert_inputs(N=12, k=2):
    """Routing in which expert E-1 gets no token (ids E-1 only where the slot is dropped)."""
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, H)
    selected = torch.randint(0, E - 1, (N, k))
    return experts, torch.randn(N, D), selected, torch.rand(N, k)


def loop(x, selected, weights, experts, keep=None):
    return experts.loop(x, selected, weights, keep)


def dense(x, selected, weights, experts, keep=None):
    return dense_reference(x, selected, weights, [experts.expert(e) for e in range(len(experts))], keep)


def expert_grads(experts, e):
    """Expert ``e``'s rows of the stacked gradients (None where a parameter got no gradient at all)."""
    return [None if p.grad is None else p.grad[e] for p in experts.parameters()]


@pytest.mark.parametrize("dispatch", [loop, grouped_dispatch, dense, per_token_reference])
def test_an_expert_no_token_chose_gets_a_zero_gradient_on_every_path(dispatch):
    experts, x, selected, weights = idle_expert_inputs()
    dispatch(x, selected, weights, experts).pow(2).sum().backward()
    for grad in expert_grads(experts, E - 1):
        assert grad is not None and not grad.any()
    assert all(grad.abs().sum() > 0 for grad in expert_grads(experts, 0))


@pytest.mark.parametrize("dispatch", [loop, grouped_dispatch])
def test_nothing_routed_still_gives_zero_gradients(dispatch):
    experts, x, selected, weights = idle_expert_inputs()
    out = dispatch(x, torch.full_like(selected, E), weights, experts)  # every slot to a no-op expert
    assert not out.any()
    out.sum().backward()
    for p in experts.parameters():  # zero, not None: AdamW then moves the experts the same on both paths
        assert p.grad is not None and not p.grad.any()


def test_adamw_moves_an_idle_expert_identically_on_both_paths(monkeypatch):
    """Step 1 uses every expert; step 2 leaves one idle: momentum and weight decay must move it the same."""
    def train(flag):
        monkeypatch.setenv("DYNCOMP_GROUPED_MM", flag)
        experts, x, selected, weights = idle_expert_inputs()
        optimizer = torch.optim.AdamW(experts.parameters(), lr=1e-2, weight_decay=0.1)
        busy = torch.arange(x.shape[0] * 2).remainder(E).view(-1, 2)
        for routing in (busy, selected):
            optimizer.zero_grad()
            experts(x, routing, weights).pow(2).sum().backward()
            optimizer.step()
        return [p.detach()[E - 1].clone() for p in experts.parameters()]

    grouped, loop = train("1"), train("0")
    for g, l in zip(grouped, loop):
        torch.testing.assert_close(g, l, atol=1e-6, rtol=1e-5)




def test_flop_counter_counts_the_grouped_matmul_forward_and_backward():
    experts, x, selected, weights = idle_expert_inputs(N=13, k=2)
    x.requires_grad_(True)
    counts = torch.bincount(selected.reshape(-1), minlength=E)
    routed = cost.ffn(D, H) * selected.numel()
    padding = cost.ffn(D, H) * alignment_padding_rows(counts)
    with FlopCounterMode(display=False) as forward_only:
        out = grouped_dispatch(x, selected, weights, experts)
    assert forward_only.get_total_flops() == routed + padding > 0
    with FlopCounterMode(display=False) as both:
        grouped_dispatch(x, selected, weights, experts).sum().backward()
    assert both.get_total_flops() == 3 * (routed + padding)
    with FlopCounterMode(display=False) as looped:
        experts.loop(x, selected, weights).sum().backward()
    assert looped.get_total_flops() == 3 * routed  # the loop multiplies no padding
    del out


@pytest.mark.parametrize("flag", ["0", "1"])
@pytest.mark.parametrize("moe", [dict(num_experts=4, top_k=2, layers="odd"),
                                 dict(num_experts=8, top_k=1, dropless=False, capacity_factor=0.5)])
def test_moe_model_flops_match_the_counter_on_both_paths(monkeypatch, flag, moe):
    """The analytic figure (routed assignments) equals the counter on the loop; on the grouped path the counter
    also counts the alignment padding rows, which the routing trace determines exactly."""
    monkeypatch.setenv("DYNCOMP_GROUPED_MM", flag)
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="moe", vocab_size=101, d_model=32, n_layer=4, n_head=4, block_size=32,
                                    moe=MoEConfig(**moe)))
    idx = torch.randint(0, 101, (3, 20))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(idx)
    analytic = model.flops_per_token(out.trace, seq_len=20).forward * idx.numel()
    padding = 0
    if flag == "1":
        hidden = model.blocks[1].moe.hidden
        for site in out.trace:
            active = ~site.dropped if site.dropped is not None else torch.ones_like(site.selected, dtype=torch.bool)
            counts = torch.bincount(site.selected[active].reshape(-1), minlength=site.probs.shape[-1])
            padding += cost.ffn(32, hidden) * alignment_padding_rows(counts)
        assert padding > 0
    assert counter.get_total_flops() == pytest.approx(analytic + padding)
