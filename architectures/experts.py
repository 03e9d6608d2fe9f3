"""MoE experts stored as stacked parameters (torchtitan's GroupedExperts layering).

``GroupedExperts`` holds E GPT-2 MLPs (``c_fc``: d -> hidden, GELU-tanh, ``c_proj``: hidden -> d, dropout)
as two ``StackedLinear`` layers whose weights are single (E, out, in) parameters in ``nn.Linear`` layout:
state-dict keys ``experts.c_fc.weight`` (E, hidden, d), ``experts.c_fc.bias`` (E, hidden),
``experts.c_proj.weight`` (E, d, hidden), ``experts.c_proj.bias`` (E, d) (no biases with ``bias: false``).
Keeping GPT-2's sub-layer names lets the base init (residual ``c_proj`` scaled by 1/sqrt(2L)) and the
upcycling rules (``experts.c_fc.weight`` <- the dense ``mlp.c_fc.weight``, broadcast over E) read as for an MLP.

Both dispatch paths use these parameters directly (nothing is re-stacked per forward):

* the loop (``GroupedExperts.loop``, the CPU default and wherever the grouped op does not apply): tokens
  sorted by expert (``sort_by_expert``), then one matmul pair per expert WITH tokens on its contiguous slice.
  The per-expert weights come from ONE ``unbind(0)`` per forward: indexing ``w[e]`` per expert would make a
  full-size (E, ., .) zero gradient per expert in backward. An idle expert costs nothing and still gets a
  zero gradient (its rows of the one stacked gradient), so its dispatch time does not grow with idle experts
  (under autocast the stacks are cast once per forward, as on the grouped path);
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
        # under torch.compile the sizes are traced (unbacked, see ``traced_sizes``) and every expert runs, an
        # idle one on zero rows: a branch on a traced count would break the graph
        traced = torch.compiler.is_compiling()
        sizes = traced_sizes(counts[:-1], N * k) if traced else counts.tolist()[:-1]
        order = order[: sum(sizes)]  # the assignments no expert computes sort last
        token_index = order if k == 1 else torch.div(order, k, rounding_mode="floor")  # flat = token * k + slot
        # one split (not a slice per expert) into each expert's tokens
        slices = x.index_select(0, token_index).split(sizes)
        runs = list(range(self.num_experts)) if traced else [e for e, count in enumerate(sizes) if count]
        if not runs and torch.is_grad_enabled():
            runs = [0]  # nothing routed: one empty call still gives every expert a (zero) gradient
        fc, proj = self._unbound("c_fc", x.device.type), self._unbound("c_proj", x.device.type)
        pieces = [self._mlp(slices[e], fc, proj, e) for e in runs]
        if not pieces:
            return x.new_zeros(N, x.shape[-1])
        outputs = self.drop(torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0])
        outputs = outputs * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(outputs.dtype)
        return outputs.new_zeros(N, outputs.shape[-1]).index_add(0, token_index, outputs)

    def _unbound(self, linear: str, device_type: str):
        """Per-expert (weight, bias) views from one ``unbind`` each (one stacked gradient in backward). Under
        autocast the stack is cast once, as on the grouped path (per expert, the bf16 copies saved for backward
        would depend on which experts got tokens, and the memory plan measures them as fixed)."""
        layer = getattr(self, linear)
        weight, bias = layer.weight, layer.bias
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return weight.unbind(0), bias.unbind(0) if bias is not None else [None] * self.num_experts

    @staticmethod
    def _mlp(x: torch.Tensor, fc, proj, e: int) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, fc[0][e], fc[1][e]), approximate="tanh"), proj[0][e], proj[1][e])

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

