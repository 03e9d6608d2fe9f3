"""``torch.compile`` for every entry point (``--compile true``) and the graph-break / recompile report.

``compile_model`` compiles the backbone IN PLACE (``nn.Module.compile``): parameter names, state
dicts and checkpoints stay exactly those of the eager model, so a compiled run resumes an eager
checkpoint and vice versa, and ``--init_from`` / weight mapping are unaffected.

Routed dispatch (MoE's loop path, MoDE, MoM, MoT, cea_moe) sizes its per-expert slices from the routing:
``compile_model`` and ``graph_report`` turn on dynamo's capture of ``.tolist()`` / ``.item()`` (``trace_routing_sizes``),
so those sizes are traced as unbacked SymInts (``architectures.dispatch.traced_sizes``) and a training or
evaluation forward + backward is one graph whose shapes follow the routing without recompiling: compute
still follows the routing exactly. KV-cache decoding may break the graph (MoM's all-SKIP check, MoT's
cached subset attention). On CUDA in bf16 the MoE experts run through ``architectures.grouped_gemm``,
whose shapes do not depend on the routing. docs/scale.md lists the measured breaks and their cost.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

#: the default backend; tests use "aot_eager" (dynamo + autograd tracing without C++ code generation)
DEFAULT_BACKEND = "inductor"


def compile_model(model: torch.nn.Module, enabled: bool = True, backend: Optional[str] = None,
                  mode: Optional[str] = None) -> torch.nn.Module:
    """Compile ``model`` in place when ``enabled`` (names and state dict unchanged); returns it."""
    if enabled:
        trace_routing_sizes()
        model.compile(backend=backend or DEFAULT_BACKEND, mode=mode)
    return model


def trace_routing_sizes() -> None:
    """Let dynamo trace data-dependent sizes (``.tolist()`` of per-expert counts, ``nonzero``) as unbacked
    SymInts instead of breaking the graph. Process-wide (dynamo reads its config when it traces)."""
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a rise after warm-up is a recompilation)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclasses.dataclass
class GraphReport:
    graphs: int
    graph_breaks: int
    reasons: List[str]  # unique break reasons, "file:line: first line of the reason"

    def as_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


def graph_report(fn: Callable, *args) -> GraphReport:
    """Graph breaks of ``fn(*args)`` (``torch._dynamo.explain``), with short de-duplicated reasons.

    ``explain`` resets dynamo's caches: call it before compiling anything you want to keep warm.
    """
    import torch._dynamo

    trace_routing_sizes()
    explanation = torch._dynamo.explain(fn)(*args)
    reasons: List[str] = []
    for brk in explanation.break_reasons:
        frame = brk.user_stack[-1] if brk.user_stack else None
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else "?"
        text = f"{where}: {str(brk.reason).strip().splitlines()[0][:120]}"
        if text not in reasons:
            reasons.append(text)
    torch._dynamo.reset()
    return GraphReport(explanation.graph_count, explanation.graph_break_count, reasons)
