"""Grouped-GEMM MoE experts: all experts' FFNs as two grouped matmuls with routing-independent shapes.

``architectures.experts.GroupedExperts`` (the stacked expert parameters) picks its path by itself:

- ``grouped_dispatch`` on CUDA (compute capability >= 8.0) in bf16 (bf16 tensors, or bf16 autocast),
  when the grouped matmul op exists (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``). No
  tensor shape depends on the routing and nothing is read back to the host, so ``torch.compile`` traces it
  as one graph and the step never waits on a ``.tolist()``. The stacked (E, out, in) parameters enter as a
  transposed view (cast to bf16 under autocast): nothing is re-stacked per forward;
- ``GroupedExperts.loop`` (one matmul pair per expert with tokens, on its contiguous slice) everywhere else.

The environment variable ``DYNCOMP_GROUPED_MM`` overrides the choice: ``0`` always loops, ``1`` uses
the grouped path wherever the op runs (CPU too: PyTorch >= 2.9 has a CPU kernel; tests use it) and has a
kernel for the compute dtype (``GROUPED_DTYPES``: fp32, bf16, fp16; in fp64 it warns once and loops).

Layout: the (token, slot) assignments are sorted by expert (``sort_by_expert``, shared with the loop) and
each expert's rows start at a multiple of ``ALIGN_ROWS`` (bf16 grouped GEMM needs 16-byte aligned group
boundaries in the weight-gradient GEMM, whose contraction runs over the rows), in a buffer of
``N*k + E*ALIGN_ROWS`` rows, the worst case, so its size is static. Padding rows and assignments that no
expert computes (dropped by capacity, no-op experts, padding tokens) are zero and get no gradient.

FLOPs: importing this module registers ``grouped_mm_flops`` for ``aten._grouped_mm`` with
``torch.utils.flop_counter``, so ``FlopCounterMode`` counts the grouped path (it counted 0 before). It counts
what the kernel multiplies: the routed rows plus each expert's alignment padding (fewer than
``ALIGN_ROWS`` zero rows per expert with tokens), which the analytic figure (``MoELayer.layer_flops``:
routed assignments only) leaves out; ``alignment_padding_rows`` gives that difference.

Gradients: an expert that no token chose gets a zero gradient on both paths (its rows of the one stacked
parameter's gradient).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

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


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without its ``import torch._dynamo`` (~1-9 s at import time, for
    every run that does not compile): the decorator only sets this attribute, which dynamo reads when it traces
    a call (tests/test_grouped_gemm.py checks that torch's decorator still sets exactly this)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result  # a constant of the machine: no trace, no graph break under compile
def _cuda_grouped_mm_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _bf16_compute(x: torch.Tensor) -> bool:
    if x.dtype == torch.bfloat16:
        return True
    return torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == torch.bfloat16


#: the dtypes the grouped matmul has kernels for; ``DYNCOMP_GROUPED_MM=1`` in another (fp64) loops instead
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARNED: set = set()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _warn_no_kernel(dtype: torch.dtype) -> None:
    if dtype not in _WARNED:  # once per dtype and process, not per layer and step
        _WARNED.add(dtype)
        import warnings

        warnings.warn(f"DYNCOMP_GROUPED_MM=1: the grouped matmul has no {dtype} kernel (it takes "
                      f"{', '.join(str(d) for d in GROUPED_DTYPES)}); the MoE experts run the per-expert loop instead",
                      stacklevel=3)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """The automatic choice (see the module docstring)."""
    if grouped_mm_op() is None:
        return False
    override = os.environ.get("DYNCOMP_GROUPED_MM")
    if override == "1" and _compute_dtype(x) not in GROUPED_DTYPES:
        _warn_no_kernel(_compute_dtype(x))
        return False
    if override is not None:
        return override == "1"
    return x.is_cuda and _cuda_grouped_mm_capable(x.device.index or 0) and _bf16_compute(x)


def sort_by_expert(selected: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int):
    """(key, order, counts) of the flat (token, slot) assignments: ``key`` their expert id, ``num_experts`` for
    those no expert computes (no-op ids, dropped slots); ``order`` a stable sort by key; ``counts`` (E + 1,)
    assignments per key. Static shapes (no ``bincount``), so the grouped path traces as one graph."""
    key = selected.reshape(-1).clamp(max=num_experts)
    if keep is not None:
        key = torch.where(keep.reshape(-1), key, torch.full_like(key, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device)
    return key, torch.argsort(key, stable=True), counts.scatter_add_(0, key, torch.ones_like(key))


def _operands(linear, dtype: torch.dtype):
    """(E, in, out) weight as a transposed view of the (E, out, in) parameter (cast only under autocast), and
    the (E, out) bias or None."""
    weight = linear.weight.transpose(1, 2).to(dtype)
    return weight, None if linear.bias is None else linear.bias.to(dtype)


def _add_bias(out: torch.Tensor, bias: Optional[torch.Tensor], row_expert: torch.Tensor,
              live: torch.Tensor) -> torch.Tensor:
    """``out`` + each row's expert bias; rows of no expert (id E: padding, past offs[-1]) add none. The mask
    is a ``where``, not a product: their gradient rows may hold garbage (uninitialised rows x 0 = NaN), which
    a ``where`` drops and a product would carry into the last expert's bias gradient."""
    if bias is None:
        return out
    return out + torch.where(live, bias.index_select(0, row_expert.clamp(max=bias.shape[0] - 1)), 0)


def alignment_padding_rows(counts: torch.Tensor) -> int:
    """Zero rows the grouped path multiplies besides the routed ones, for per-expert assignment ``counts``."""
    counts = counts.long()
    return int(((counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS - counts).sum())


def grouped_dispatch(
    x: torch.Tensor,
    selected: torch.Tensor,
    weights: torch.Tensor,
    experts,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``GroupedExperts.forward`` via two grouped matmuls (shapes independent of the routing). ``experts``: an
    ``architectures.experts.GroupedExperts`` (stacked ``c_fc`` / ``c_proj`` parameters and ``drop``)."""
    N, k = selected.shape
    E = len(experts)
    grouped_mm = grouped_mm_op()
    dtype = torch.bfloat16 if _bf16_compute(x) else x.dtype
    key, order, counts = sort_by_expert(selected, keep, E)
    sorted_key = key.index_select(0, order)
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

    fc_w, fc_b = _operands(experts.c_fc, dtype)
    proj_w, proj_b = _operands(experts.c_proj, dtype)
    live = (row_expert < E).unsqueeze(-1)  # rows of real assignments (not padding, not past offs[-1])
    hidden = _add_bias(grouped_mm(buffer, fc_w, offs=offs), fc_b, row_expert, live)
    hidden = torch.where(live, F.gelu(hidden, approximate="tanh"), 0)  # rows past offs[-1] are uninitialised
    out = _add_bias(grouped_mm(hidden, proj_w, offs=offs), proj_b, row_expert, live)
    out = experts.drop(out)
    out = torch.where(active, out.index_select(0, row), 0)  # rows past offs[-1] are never read
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return out.new_zeros(N, out.shape[-1]).index_add(0, token_index, out)
