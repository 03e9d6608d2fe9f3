"""Grouped-GEMM MoE path: the same numbers as the per-expert loop, chosen automatically, static shapes.

Both paths read the same stacked expert parameters (``architectures.experts.GroupedExperts``). CPU runs the
grouped path through PyTorch's CPU grouped-matmul kernel (forced with DYNCOMP_GROUPED_MM=1); the automatic
choice on CPU is the loop.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from architectures import ModelConfig, build_model
from architectures.experts import GroupedExperts
from architectures.grouped_gemm import grouped_dispatch, use_grouped_mm
from architectures.moe_layer import MoEConfig
from tests.references import dense_reference, per_token_reference


def experts_and_inputs(E=4, d=16, hidden=32, N=24, k=2, seed=0):
    torch.manual_seed(seed)
    experts = GroupedExperts(E, d, hidden)
    x = torch.randn(N, d, requires_grad=True)
    selected = torch.randint(0, E + 1, (N, k))  # id E: a no-op expert (costs and adds nothing)
    selected[:, 0] = selected[:, 0].clamp(max=E - 2)  # expert E-1 only ever a 2nd choice; some experts idle
    weights = torch.rand(N, k, requires_grad=True)
    keep = torch.rand(N, k) > 0.2  # capacity drops / padding tokens
    return experts, x, selected, weights, keep


def loop(x, selected, weights, experts, keep=None):
    return experts.loop(x, selected, weights, keep)


def dense(x, selected, weights, experts, keep=None):
    return dense_reference(x, selected, weights, [experts.expert(e) for e in range(len(experts))], keep)


def outputs_and_grads(fn, experts, x, selected, weights, keep):
    for p in experts.parameters():
        p.grad = None
    x.grad = weights.grad = None
    out = fn(x, selected, weights, experts, keep)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    assert all(p.grad is not None for p in experts.parameters())  # idle experts: zero rows, never None
    return [out.detach(), x.grad, weights.grad, *(p.grad for p in experts.parameters())]


@pytest.mark.parametrize("k,with_keep", [(1, False), (2, True)])
def test_grouped_path_matches_the_loop_and_the_references(k, with_keep):
    experts, x, selected, weights, keep = experts_and_inputs(k=k)
    keep = keep if with_keep else None
    grouped = outputs_and_grads(grouped_dispatch, experts, x, selected, weights, keep)
    looped = outputs_and_grads(loop, experts, x, selected, weights, keep)
    masked = outputs_and_grads(dense, experts, x, selected, weights, keep)
    per_token = outputs_and_grads(per_token_reference, experts, x, selected, weights, keep)
    for g, l, r, t in zip(grouped, looped, masked, per_token):
        torch.testing.assert_close(g, l, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, t, atol=1e-5, rtol=1e-5)


def test_grouped_path_in_bf16_is_close_to_fp32():
    experts, x, selected, weights, keep = experts_and_inputs()
    reference = experts.loop(x, selected, weights, keep)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_dispatch(x, selected, weights, experts, keep)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


def test_automatic_choice_and_override(monkeypatch):
    experts, x, *_ = experts_and_inputs()
    monkeypatch.delenv("DYNCOMP_GROUPED_MM", raising=False)
    assert not use_grouped_mm(x)  # CPU: the loop
    monkeypatch.setenv("DYNCOMP_GROUPED_MM", "1")
    assert use_grouped_mm(x)
    monkeypatch.setenv("DYNCOMP_GROUPED_MM", "0")
    assert not use_grouped_mm(x)


@pytest.mark.parametrize("dropless", [True, False])
def test_moe_model_trains_identically_on_either_path(monkeypatch, dropless):
    def step(flag):
        monkeypatch.setenv("DYNCOMP_GROUPED_MM", flag)
        torch.manual_seed(0)
        model = build_model(ModelConfig(variant="moe", size="tiny", vocab_size=64, d_model=32, n_layer=2, n_head=2,
                                        block_size=16, moe=MoEConfig(num_experts=4, top_k=2, dropless=dropless)))
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(idx)
        loss = F.cross_entropy(out.logits.reshape(-1, 64), idx.reshape(-1)) + out.aux_loss
        loss.backward()
        return loss.detach(), [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    loss_grouped, grads_grouped = step("1")
    loss_loop, grads_loop = step("0")
    torch.testing.assert_close(loss_grouped, loss_loop)
    for g, l in zip(grads_grouped, grads_loop):
        torch.testing.assert_close(g, l, atol=1e-5, rtol=1e-4)


def test_grouped_path_traces_to_one_graph_in_bf16():
    """Static shapes: dynamo traces the whole dispatch without a break (the loop breaks at .tolist() unless
    its sizes are traced as unbacked SymInts, as ``model_tools.compiling`` sets up)."""
    experts, x, selected, weights, keep = experts_and_inputs()
    x = x.detach().bfloat16()
    experts = experts.to(torch.bfloat16)
    explanation = torch._dynamo.explain(grouped_dispatch)(x, selected, weights.detach().bfloat16(), experts, keep)
    torch._dynamo.reset()
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        looped = torch._dynamo.explain(loop)(x, selected, weights.detach().bfloat16(), experts, keep)
    torch._dynamo.reset()
    assert looped.graph_break_count > 0


def test_the_experts_module_loops_on_cpu(monkeypatch):
    monkeypatch.delenv("DYNCOMP_GROUPED_MM", raising=False)
    experts, x, selected, weights, keep = experts_and_inputs()
    torch.testing.assert_close(experts(x, selected, weights, keep), experts.loop(x, selected, weights, keep))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the automatic grouped path's device)")
def test_cuda_bf16_picks_the_grouped_path_and_matches_the_loop(monkeypatch):
    monkeypatch.delenv("DYNCOMP_GROUPED_MM", raising=False)
    experts, x, selected, weights, keep = experts_and_inputs(d=64, hidden=256, N=256)
    experts, x = experts.cuda(), x.detach().cuda()
    selected, weights, keep = selected.cuda(), weights.detach().cuda(), keep.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert use_grouped_mm(x) == (torch.cuda.get_device_capability() >= (8, 0))
        grouped = experts(x, selected, weights, keep)
        looped = experts.loop(x, selected, weights, keep)
    torch.testing.assert_close(grouped.float(), looped.float(), atol=3e-2, rtol=3e-2)


def test_the_lazy_constant_marker_is_torch_s_decorator():
    """``grouped_gemm.assume_constant_result`` stands in for ``torch.compiler.assume_constant_result`` (which
    imports torch._dynamo at import time): both must leave a function with the same attributes."""
    from architectures import grouped_gemm

    def ours():
        return 0

    def torch_s():
        return 0

    assert grouped_gemm.assume_constant_result(ours) is ours
    torch.compiler.assume_constant_result(torch_s)
    assert vars(ours) == vars(torch_s) == {"_dynamo_marked_constant": True}
    assert vars(grouped_gemm._cuda_grouped_mm_capable) == vars(torch_s)


def test_a_forced_grouped_path_in_fp64_warns_and_loops(monkeypatch):
    """The grouped matmul has no float64 kernel: ``DYNCOMP_GROUPED_MM=1`` says so once and the experts loop
    (it raised "Expected mat_a to be Float32, BFloat16 or Float16" mid-forward)."""
    from architectures import grouped_gemm

    monkeypatch.setenv("DYNCOMP_GROUPED_MM", "1")
    monkeypatch.setattr(grouped_gemm, "_WARNED", set())
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="moe", size="tiny", vocab_size=64, d_model=32, n_layer=2, n_head=2,
                                    block_size=16)).double()
    idx = torch.randint(0, 64, (2, 16))
    with pytest.warns(UserWarning, match="no torch.float64 kernel .* per-expert loop instead") as caught:
        out = model(idx)
    assert len([w for w in caught if "DYNCOMP_GROUPED_MM" in str(w.message)]) == 1  # once, not per layer
    monkeypatch.setenv("DYNCOMP_GROUPED_MM", "0")
    torch.testing.assert_close(out.logits, model(idx).logits, rtol=0, atol=0)  # exactly the loop
    assert use_grouped_mm(torch.ones(2, dtype=torch.float32)) is False  # =0 still loops
