"""MoE experts stored as stacked parameters (torchtitan's GroupedExperts layering).

``GroupedExperts`` holds E GPT-2 MLPs (``c_fc``: d -> hidden, GELU-tanh, ``c_proj``: hidden -> d, dropout)
as two ``StackedLinear`` layers whose weights are single (E, out, in) parameters in ``nn.Linear`` layout:
state-dict keys ``experts.c_fc.weight`` (E, hidden, d), ``experts.c_fc.bias`` (E, hidden),
``experts.c_proj.weight`` (E, d, hidden), ``experts.c_proj.bias`` (E, d) (no biases with ``bias: false``).
Keeping GPT-2's sub-layer names lets the base init (residual ``c_proj`` scaled by 1/sqrt(2L)) and the
upcycling rules (``experts.c_fc.weight`` <- the dense ``mlp.c_fc.weight``, broadcast over E) read as for an MLP.

Both dispatch paths use these parameters directly (nothing is re-stacked per forward):

* the loop (``GroupedExperts.loop``, the CPU default and wherever the grouped op does not apply): tokens
  sorted by expert (``sort_by_expert``), then ``ExpertMLPs``, ONE autograd node: a matmul pair per expert WITH
  tokens on its contiguous slice, and a backward that writes each stacked gradient once (a busy expert's rows
  one matmul, the idle experts' rows zero-filled at once), so no op depends on the idle experts but their zero
  rows (under autocast the stacks are cast once per forward, as on the grouped path). Under torch.compile
  every expert runs through autograd's own graph (``_traced_mlps``), which dynamo traces as one graph;
* the grouped GEMM (``architectures.grouped_gemm.grouped_dispatch``): the weights as a transposed view (and,
  under bf16 autocast, cast to bf16), see that module for when it is chosen (``DYNCOMP_GROUPED_MM``).

Old checkpoints (``experts.{i}.c_fc.weight``, ... of an ``nn.ModuleList`` of MLPs) still load: a
state-dict pre-hook stacks those keys (``load_state_dict``, Lightning resume, ``--init_from``), and
``stack_legacy_experts`` does the same for a raw state dict read outside ``load_state_dict``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.dispatch import traced_sizes
from architectures.grouped_gemm import grouped_dispatch, sort_by_expert, use_grouped_mm

LINEARS = ("c_fc", "c_proj")


class StackedLinear(nn.Module):
    """E ``nn.Linear(in_features, out_features)`` as one (E, out, in) weight and one (E, out) bias."""

    def __init__(self, num: int, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(num, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num, out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default per expert: U(-1/sqrt(in), 1/sqrt(in)) weights and biases."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} x ({self.in_features} -> {self.out_features}), bias={self.bias is not None}"


class GroupedExperts(nn.Module):
    """E GPT-2 MLP experts as stacked parameters; ``forward`` has ``sorted_dispatch``'s contract."""

    def __init__(self, num_experts: int, d_model: int, hidden: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.num_experts = num_experts
        self.c_fc = StackedLinear(num_experts, d_model, hidden, bias)
        self.c_proj = StackedLinear(num_experts, hidden, d_model, bias)
        self.drop = nn.Dropout(dropout)
        self.register_load_state_dict_pre_hook(_stack_legacy_keys)

    def __len__(self) -> int:
        return self.num_experts

    def forward(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Weighted sum of the chosen experts' outputs per token (``dispatch.sorted_dispatch``'s contract):
        x (N, d), selected / weights / keep (N, k); ids >= E (no-op experts) and dropped slots add nothing."""
        if use_grouped_mm(x):
            return grouped_dispatch(x, selected, weights, self, keep)
        return self.loop(x, selected, weights, keep)

    def loop(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
             keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One matmul pair per expert with tokens, on its contiguous slice of the expert-sorted tokens."""
        N, k = selected.shape
        _, order, counts = sort_by_expert(selected, keep, self.num_experts)
        traced = torch.compiler.is_compiling()
        sizes = traced_sizes(counts[:-1], N * k) if traced else counts.tolist()[:-1]
        order = order[: sum(sizes)]  # the assignments no expert computes sort last
        token_index = order if k == 1 else torch.div(order, k, rounding_mode="floor")  # flat = token * k + slot
        row_weights = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        if not traced and (self.drop.p == 0 or not self.training):  # the common case: one node, gather to combine
            permutation = k == 1 and order.shape[0] == N  # every token once (top-1, none dropped)
            operands = self._operands(x.device.type)
            return RoutedExpertMLPs.apply(x, token_index, row_weights.to(operands[0].dtype), tuple(sizes),
                                          permutation, *operands)
        tokens = x.index_select(0, token_index)
        if traced:  # unbacked sizes: autograd's own per-expert graph, which dynamo traces as one graph
            outputs = self._traced_mlps(tokens, sizes)
        else:
            outputs = ExpertMLPs.apply(tokens, tuple(sizes), *self._operands(x.device.type))
        outputs = self.drop(outputs) * row_weights.to(outputs.dtype)
        if k == 1 and not traced and outputs.shape[0] == N:  # every token once (top-1, none dropped): a permutation
            return outputs.new_empty(N, outputs.shape[-1]).index_copy_(0, token_index, outputs)
        return outputs.new_zeros(N, outputs.shape[-1]).index_add_(0, token_index, outputs)

    def _operands(self, device_type: str) -> List[Optional[torch.Tensor]]:
        """(c_fc weight, bias, c_proj weight, bias), the stacks cast once under autocast, as on the grouped path
        (per expert, the bf16 copies saved for backward would depend on which experts got tokens, and the
        memory plan measures them as fixed)."""
        tensors = [self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias]
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            tensors = [None if t is None else t.to(dtype) for t in tensors]
        return tensors

    def _traced_mlps(self, tokens: torch.Tensor, sizes: List[int]) -> torch.Tensor:
        """Under torch.compile: every expert runs (an idle one on zero rows; a branch on a traced count would
        break the graph), per-expert weights from one ``unbind`` per stacked parameter."""
        fc_w, fc_b, proj_w, proj_b = self._operands(tokens.device.type)
        tokens = tokens.to(fc_w.dtype)
        fc_w, proj_w = fc_w.unbind(0), proj_w.unbind(0)
        fc_b = [None] * self.num_experts if fc_b is None else fc_b.unbind(0)
        proj_b = [None] * self.num_experts if proj_b is None else proj_b.unbind(0)
        pieces = [F.linear(F.gelu(F.linear(piece, fc_w[e], fc_b[e]), approximate="tanh"), proj_w[e], proj_b[e])
                  for e, piece in enumerate(tokens.split(sizes))]
        return torch.cat(pieces, dim=0)

    def expert(self, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Expert ``e`` as a stand-alone MLP function (references and tests; the dispatch never calls it)."""
        def run(x: torch.Tensor) -> torch.Tensor:
            fc_b = None if self.c_fc.bias is None else self.c_fc.bias[e]
            proj_b = None if self.c_proj.bias is None else self.c_proj.bias[e]
            hidden = F.gelu(F.linear(x, self.c_fc.weight[e], fc_b), approximate="tanh")
            return self.drop(F.linear(hidden, self.c_proj.weight[e], proj_b))

        return run

    @torch.no_grad()
    def scale_outputs(self, scale: float) -> None:
        """Multiply every expert's output projection (weight and bias) by ``scale`` (upcycling)."""
        self.c_proj.weight.mul_(scale)
        if self.c_proj.bias is not None:
            self.c_proj.bias.mul_(scale)


class ExpertMLPs(torch.autograd.Function):
    """The expert MLPs of expert-sorted rows as ONE autograd node: ``x`` (M, d) holds each expert's rows
    contiguously (``sizes[e]`` of them, in expert order); every expert with rows runs ``c_proj(gelu(c_fc(x)))``
    on its slice, written in place into one (M, .) output (GELU over all rows at once).

    Backward makes each stacked gradient as ONE (E, ., .) tensor: each busy expert's weight gradient is a
    matmul written into its rows, the idle experts' rows are zero-filled (one ``index_fill``), the bias
    gradients one row sum per busy expert. So the work does not depend on the idle experts
    besides writing their zero rows (the gradient that AdamW then reads; see the module docstring), where
    autograd's own graph of ``unbind`` views made a zero tensor per idle expert and copied every expert's
    gradient into a stack (2,466 vs 790 ms of backward for 64 vs 8 experts at the same routing, issue 29).
    Used with dropout; without it ``RoutedExpertMLPs`` also folds in the gather, the weighting and the combine.
    """

    @staticmethod
    def forward(ctx, x, sizes, fc_w, fc_b, proj_w, proj_b):
        x = x.to(fc_w.dtype)  # autocast: the stacks come cast (``GroupedExperts._operands``)
        segments = _segments(sizes)
        hidden, act, out = _mlps_forward(x, fc_w, fc_b, proj_w, proj_b, segments)
        ctx.segments, ctx.sizes, ctx.biased = segments, sizes, (fc_b is not None, proj_b is not None)
        ctx.save_for_backward(x, hidden, act, fc_w, proj_w)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, hidden, act, fc_w, proj_w = ctx.saved_tensors
        pending = [grad_out]
        del grad_out
        grads = _mlps_backward(ctx, pending, x, hidden, act, fc_w, proj_w, ctx.needs_input_grad[0])
        return grads[0], None, *grads[1:]


class RoutedExpertMLPs(torch.autograd.Function):
    """``ExpertMLPs`` with the dispatch around it in the same node (the loop path without dropout): gather the
    expert-sorted rows ``x[token_index]``, run the experts, multiply each row by its routing weight
    ``row_weights`` (M, 1), combine into (N, D) (``index_copy`` when ``permutation``: every token exactly once,
    else ``index_add`` onto zeros). The same aten ops, in the same order, as autograd's graph of
    index_select -> ExpertMLPs -> mul -> index_copy / index_add (so the same numbers), without its four nodes'
    bookkeeping per layer and step. It saves the rows, the hidden and activated rows, the unweighted outputs
    and the weights: what that graph saved less the weighted outputs, which ``index_copy_``'s autograd formula
    kept (one (M, D) tensor per layer: 18 MB of saved activations at d=384, L=6, B=4, T=512)."""

    @staticmethod
    def forward(ctx, x, token_index, row_weights, sizes, permutation, fc_w, fc_b, proj_w, proj_b):
        tokens = x.index_select(0, token_index).to(fc_w.dtype)
        segments = _segments(sizes)
        hidden, act, out = _mlps_forward(tokens, fc_w, fc_b, proj_w, proj_b, segments)
        weighted = out * row_weights
        combined = weighted.new_empty(x.shape[0], weighted.shape[-1]) if permutation else \
            weighted.new_zeros(x.shape[0], weighted.shape[-1])
        (combined.index_copy_ if permutation else combined.index_add_)(0, token_index, weighted)
        ctx.segments, ctx.sizes, ctx.biased = segments, sizes, (fc_b is not None, proj_b is not None)
        ctx.x_meta = (x.shape, x.dtype)
        ctx.save_for_backward(tokens, hidden, act, out, row_weights, token_index, fc_w, proj_w)
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        tokens, hidden, act, out, row_weights, token_index, fc_w, proj_w = ctx.saved_tensors
        grad_weighted = grad_combined.index_select(0, token_index)
        grad_row_weights = (grad_weighted * out).sum(-1, keepdim=True) if ctx.needs_input_grad[2] else None
        pending = [grad_weighted * row_weights]
        del out, grad_weighted  # as autograd's mul node would: the (M, D) gradients one at a time
        grads = _mlps_backward(ctx, pending, tokens, hidden, act, fc_w, proj_w, ctx.needs_input_grad[0])
        grad_x = None
        if grads[0] is not None:  # index_select's backward: the rows added into zeros
            shape, dtype = ctx.x_meta
            grad_x = grads[0].new_zeros(shape, dtype=dtype).index_add_(0, token_index, grads[0].to(dtype))
        return grad_x, None, grad_row_weights, None, None, *grads[1:]


def _mlps_forward(x, fc_w, fc_b, proj_w, proj_b, segments):
    """(hidden, activated, output) rows of the experts' MLPs on their segments of ``x``."""
    hidden = _segment_linear(x, fc_w, fc_b, segments)
    act = F.gelu(hidden, approximate="tanh")
    return hidden, act, _segment_linear(act, proj_w, proj_b, segments)


def _mlps_backward(ctx, pending: list, x, hidden, act, fc_w, proj_w, input_grad: bool):
    """(grad x or None, grad c_fc weight, bias, grad c_proj weight, bias) of ``_mlps_forward``'s output, whose
    gradient is ``pending``'s one element (in a list the caller empties into this frame, so it is freed here)."""
    # each intermediate gradient is dropped as soon as it is used: the peak of this node is then what
    # autograd's per-expert graph had (tests/test_scale.py's plan-vs-measured-peak cases)
    segments, (fc_biased, proj_biased) = ctx.segments, ctx.biased
    idle = [e for e, size in enumerate(ctx.sizes) if not size]
    grad_out = pending.pop().contiguous()
    grad_proj_w, grad_proj_b = _segment_weight_grads(grad_out, act, proj_w, segments, idle, proj_biased)
    grad_hidden = _segment_linear(grad_out, proj_w.transpose(1, 2), None, segments)  # d loss / d act
    del grad_out
    # in place (an elementwise kernel): d loss / d hidden overwrites d loss / d act, one (M, hidden) less
    torch.ops.aten.gelu_backward.grad_input(grad_hidden, hidden, approximate="tanh", grad_input=grad_hidden)
    grad_fc_w, grad_fc_b = _segment_weight_grads(grad_hidden, x, fc_w, segments, idle, fc_biased)
    grad_x = _segment_linear(grad_hidden, fc_w.transpose(1, 2), None, segments) if input_grad else None
    return grad_x, grad_fc_w, grad_fc_b, grad_proj_w, grad_proj_b


def _segments(sizes) -> List[tuple]:
    """(expert, first row, end row) of every expert with rows."""
    out, start = [], 0
    for e, size in enumerate(sizes):
        if size:
            out.append((e, start, start + size))
        start += size
    return out


def _segment_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], segments) -> torch.Tensor:
    """Rows ``start:end`` of ``x`` through expert ``e``'s (out, in) ``weight[e]`` (+ ``bias[e]``), in place into
    one output; rows of no segment (none: the segments tile ``x``) would stay uninitialised."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    for e, start, end in segments:
        if bias is None:
            torch.mm(x[start:end], weight[e].t(), out=out[start:end])
        else:
            torch.addmm(bias[e], x[start:end], weight[e].t(), out=out[start:end])
    return out


def _segment_weight_grads(grad_out: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, segments, idle,
                          biased: bool):
    """(E, out, in) weight gradient and (E, out) bias gradient (or None) of ``out = inputs @ weight[e].T + bias[e]``
    on each segment: a busy expert's rows are written by one matmul / one row sum, the idle experts' rows are
    zero (one ``index_fill`` of the weight gradient; the small bias gradient starts at zero)."""
    grad_w = torch.empty_like(weight)
    grad_b = grad_out.new_zeros(weight.shape[0], weight.shape[1]) if biased else None
    for e, start, end in segments:
        torch.mm(grad_out[start:end].t(), inputs[start:end], out=grad_w[e])
        if biased:
            torch.sum(grad_out[start:end], 0, out=grad_b[e])
    if idle:
        grad_w.index_fill_(0, torch.tensor(idle, device=weight.device), 0)
    return grad_w, grad_b


def _stack_legacy_keys(module: GroupedExperts, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: an old checkpoint's per-expert keys become the stacked ones."""
    stack_legacy_keys(state_dict, prefix, module.num_experts)


def stack_legacy_keys(state: Dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """In place: ``{prefix}{i}.c_fc.weight`` (i < E) etc. of the old ``nn.ModuleList`` layout become the
    stacked ``{prefix}c_fc.weight``. A tensor present for only some experts is left as it is (then
    ``load_state_dict`` reports those keys, as it would any other mismatch)."""
    for linear in LINEARS:
        for kind in ("weight", "bias"):
            old = [f"{prefix}{i}.{linear}.{kind}" for i in range(num_experts)]
            if all(key in state for key in old):
                state[f"{prefix}{linear}.{kind}"] = torch.stack([state.pop(key) for key in old])


def stack_legacy_experts(model: nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A copy of ``state`` (names as ``model.state_dict()``'s) with every old per-expert layout of ``model``'s
    ``GroupedExperts`` stacked, for code that filters a checkpoint by name before ``load_state_dict``."""
    state = dict(state)
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            stack_legacy_keys(state, f"{name}.", module.num_experts)
    return state


def legacy_parameter_names(model: nn.Module) -> Dict[str, List[str]]:
    """{stacked parameter name: its per-expert names in the old layout}, in the old order of
    ``model.named_parameters()`` (expert by expert: ``0.c_fc.weight, 0.c_fc.bias, 0.c_proj.weight, ...``):
    how optimizer state saved before the stacking lines up with the parameters now."""
    out: Dict[str, List[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for linear in LINEARS:
                for kind, param in getattr(module, linear).named_parameters():
                    out[f"{name}.{linear}.{kind}"] = [f"{name}.{i}.{linear}.{kind}" for i in range(module.num_experts)]
    return out


def legacy_order(model: nn.Module) -> List[str]:
    """``model``'s parameter names as the old per-expert layout ordered them (tied parameters once)."""
    stacked, order = legacy_parameter_names(model), []
    for name, _ in model.named_parameters():
        prefix = name.rsplit(".", 2)[0] + "."
        if name not in stacked:
            order.append(name)
        elif name.endswith("c_fc.weight"):  # the first stacked tensor of a module: all its experts, expert-major
            names = [n for s, ns in stacked.items() if s.startswith(prefix) for n in ns]
            order += sorted(names, key=lambda n: int(n[len(prefix):].split(".")[0]))
    return order

