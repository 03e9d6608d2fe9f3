"""Grouped-GEMM MoE experts: all experts' FFNs as two grouped matmuls with routing-independent shapes.

``expert_dispatch`` is what ``MoELayer`` calls. It has the contract of
``architectures.dispatch.sorted_dispatch`` (weighted sum of the chosen experts' outputs per token) and
picks the path by itself:

- ``grouped_dispatch`` on CUDA (compute capability >= 8.0) in bf16 (bf16 tensors, or bf16 autocast),
  when the experts are GPT-2 ``MLP`` modules and the grouped matmul op exists
  (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``). No tensor shape depends on the
  routing and nothing is read back to the host, so ``torch.compile`` traces it as one graph and the
  step never waits on a ``.tolist()``;
- ``sorted_dispatch`` (one matmul pair per expert on its contiguous slice) everywhere else.

The environment variable ``DYNCOMP_GROUPED_MM`` overrides the choice: ``0`` always loops, ``1`` uses
the grouped path wherever the op runs (CPU too: PyTorch >= 2.9 has a CPU kernel; tests use it).

Layout: the (token, slot) assignments are sorted by expert and each expert's rows start at a multiple
of ``ALIGN_ROWS`` (bf16 grouped GEMM needs 16-byte aligned group boundaries in the weight-gradient
GEMM, whose contraction runs over the rows), in a buffer of ``N*k + E*ALIGN_ROWS`` rows, the worst
case, so its size is static. Padding rows and assignments that no expert computes (dropped by
capacity, no-op experts, padding tokens) are zero and get no gradient.

FLOPs: importing this module registers ``grouped_mm_flops`` for ``aten._grouped_mm`` with
``torch.utils.flop_counter``, so ``FlopCounterMode`` counts the grouped path (it counted 0 before). It counts
what the kernel multiplies: the routed rows plus each expert's alignment padding (fewer than
``ALIGN_ROWS`` zero rows per expert with tokens), which the analytic figure (``MoELayer.flops_per_token``:
routed assignments only) leaves out; ``alignment_padding_rows`` gives that difference.

Gradients: an expert that no token chose gets a zero gradient on both paths (its weights are in the
stacked operand here; the loop runs it on an empty slice), see ``dispatch.sorted_dispatch``.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from architectures.dispatch import sorted_dispatch

ALIGN_ROWS = 8  # 16 bytes of bf16


def grouped_mm_op() -> Optional[Callable]:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _offs_end(offs: Optional[torch.Tensor], full: int) -> int:
    """Rows (or columns) the grouped matmul multiplies: up to ``offs[-1]``; what lies past it is never computed.
    ``full`` when there are no offsets or their values cannot be read (fake / meta tensors while tracing)."""
    if offs is None or offs.numel() == 0:
        return full
    try:
        return int(offs[-1])
    except Exception:  # noqa: BLE001 - data-dependent value under FakeTensorMode / meta: the upper bound
        return full


def grouped_mm_flops(a, b, offs=None, bias=None, out_dtype=None, *args, out_val=None, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm`` for ``FlopCounterMode`` (which counts it as 0 otherwise): 2 * m * k * n
    summed over the groups, i.e. over the rows / contraction columns up to ``offs[-1]``, in each of its
    layouts: (M, K) x (G, K, N) grouped over M (the forward and the input gradient); (K, M) x (M, N) grouped
    over the contraction M (the weight gradient); (G, M, K) x (K, N) grouped over N; (G, M, K) x (G, K, N)."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * _offs_end(offs, a.shape[0]) * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * _offs_end(offs, a.shape[1]) * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.shape[1] * a.shape[2] * _offs_end(offs, b.shape[1])
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _register_grouped_mm_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is not None and op not in flop_registry:  # a PyTorch with its own formula keeps it
        register_flop_formula(op, get_raw=True)(grouped_mm_flops)


_register_grouped_mm_flops()


@torch.compiler.assume_constant_result  # a constant of the machine: no trace, no graph break under compile
def _cuda_grouped_mm_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _bf16_compute(x: torch.Tensor) -> bool:
    if x.dtype == torch.bfloat16:
        return True
    return torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16


def use_grouped_mm(x: torch.Tensor, experts: Sequence) -> bool:
    """The automatic choice (see the module docstring)."""
    from architectures.gpt2 import MLP

    if grouped_mm_op() is None or not experts or not all(isinstance(e, MLP) for e in experts):
        return False
    override = os.environ.get("DYNCOMP_GROUPED_MM")
    if override is not None:
        return override == "1"
    return x.is_cuda and _cuda_grouped_mm_capable(x.device.index or 0) and _bf16_compute(x)


def expert_dispatch(x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor, experts: Sequence,
                    keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sorted_dispatch``'s contract; the grouped-GEMM path where it applies."""
    dispatch = grouped_dispatch if use_grouped_mm(x, experts) else sorted_dispatch
    return dispatch(x, selected, weights, experts, keep)


def _stacked(experts, linear: str, dtype: torch.dtype):
    """(E, in, out) weights and an (E + 1, out) bias table whose last row (no expert) is zero."""
    layers = [getattr(e, linear) for e in experts]
    weight = torch.stack([layer.weight for layer in layers]).transpose(1, 2).to(dtype)
    out_features = layers[0].weight.shape[0]
    biases = [layer.bias if layer.bias is not None else layer.weight.new_zeros(out_features) for layer in layers]
    bias = torch.stack([*biases, layers[0].weight.new_zeros(out_features)]).to(dtype)
    return weight, bias


def alignment_padding_rows(counts: torch.Tensor) -> int:
    """Zero rows the grouped path multiplies besides the routed ones, for per-expert assignment ``counts``."""
    counts = counts.long()
    return int(((counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS - counts).sum())


def grouped_dispatch(
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
    experts: Sequence,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``sorted_dispatch`` for GPT-2 ``MLP`` experts via two grouped matmuls (shapes independent of routing)."""
    N, k = selected.shape
    E = len(experts)
    grouped_mm = grouped_mm_op()
    dtype = torch.bfloat16 if _bf16_compute(x) else x.dtype
    key = selected.reshape(-1).clamp(max=E)  # E: no real expert (no-op id or dropped)
    if keep is not None:
        key = torch.where(keep.reshape(-1), key, torch.full_like(key, E))
    order = torch.argsort(key, stable=True)
    sorted_key = key.index_select(0, order)
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    padded = (counts[:E] + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = torch.cat([padded_ends.new_zeros(1), padded_ends])  # index E: where inactive rows go
    rank = torch.arange(N * k, device=x.device) - starts.index_select(0, sorted_key)
    row = padded_starts.index_select(0, sorted_key) + rank  # buffer row of each sorted assignment
    active = (sorted_key < E).unsqueeze(-1)

    token_index = order if k == 1 else torch.div(order, k, rounding_mode="floor")
    rows = N * k + E * ALIGN_ROWS
    tokens = torch.where(active, x.index_select(0, token_index), 0).to(dtype)
    buffer = tokens.new_zeros(rows, x.shape[-1]).index_copy(0, row, tokens)
    offs = padded_ends.to(torch.int32)
    row_expert = torch.full((rows,), E, dtype=torch.long, device=x.device).index_copy(0, row, sorted_key)

    fc_w, fc_b = _stacked(experts, "c_fc", dtype)
    proj_w, proj_b = _stacked(experts, "c_proj", dtype)
    live = (row_expert < E).unsqueeze(-1)  # rows of real assignments (not padding, not past offs[-1])
    hidden = grouped_mm(buffer, fc_w, offs=offs) + fc_b.index_select(0, row_expert)
    hidden = torch.where(live, F.gelu(hidden, approximate="tanh"), 0)  # rows past offs[-1] are uninitialised
    out = grouped_mm(hidden, proj_w, offs=offs) + proj_b.index_select(0, row_expert)
    out = experts[0].drop(out)
    out = torch.where(active, out.index_select(0, row), 0)  # rows past offs[-1] are never read
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return out.new_zeros(N, out.shape[-1]).index_add(0, token_index, out)
