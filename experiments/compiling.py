"""``torch.compile`` for every entry point (``--compile true``) and the graph-break / recompile report.

``compile_model`` compiles the backbone IN PLACE (``nn.Module.compile``): parameter names, state
dicts and checkpoints stay exactly those of the eager model, so a compiled run resumes an eager
checkpoint and vice versa, and ``--init_from`` / weight mapping are unaffected.

What compiles to one graph (measured with ``graph_report``, CPU, torch 2.13): vanilla and the other
dense variants, MoD (static k = floor(c*T)). Data-dependent dispatch (MoE, MoDE, MoM, MoT, cea_moe)
breaks the graph where the number of tokens per expert becomes a Python int (``.tolist()`` in
``architectures.dispatch``) and at boolean indexing in the balance loss; on CUDA in bf16 the MoE
experts run through ``architectures.grouped_gemm`` instead, whose shapes do not depend on the
routing. The README lists the measured breaks and their cost.
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
        model.compile(backend=backend or DEFAULT_BACKEND, mode=mode)
    return model


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
