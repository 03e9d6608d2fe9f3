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


def explain_variants(variants: List[str], size: str = "tiny", vocab_size: int = 4096, batch_size: int = 8,
                     seq_len: Optional[int] = None) -> Dict[str, GraphReport]:
    """Graph report of one training forward + loss per variant (no compilation, CPU fp32)."""
    import torch.nn.functional as F

    from architectures import ModelConfig, build_model

    reports = {}
    for variant in variants:
        torch.manual_seed(0)
        model = build_model(ModelConfig(variant=variant, size=size, vocab_size=vocab_size, dropout=0.0))
        T = seq_len or model.config.block_size
        idx = torch.randint(0, vocab_size, (batch_size, T))

        def loss(idx, model=model):
            out = model(idx)
            return F.cross_entropy(out.logits.reshape(-1, vocab_size), idx.reshape(-1)) + out.aux_loss

        reports[variant] = graph_report(loss, idx)
    return reports


def main(argv: Optional[List[str]] = None) -> Dict[str, GraphReport]:
    """``python -m experiments.compiling [--variants a,b] [--size tiny]``: graphs and breaks per variant."""
    import argparse

    from architectures import variant_names

    parser = argparse.ArgumentParser(prog="python -m experiments.compiling", description=main.__doc__)
    parser.add_argument("--variants", default="all", help="comma-separated, or 'all'")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args(argv)
    names = variant_names() if args.variants == "all" else args.variants.split(",")
    unknown = sorted(set(names) - set(variant_names()))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; valid: {', '.join(variant_names())}")
    reports = explain_variants(names, args.size, args.vocab_size, args.batch_size)
    print(f"{'variant':<18}{'graphs':>7}{'breaks':>8}  where")
    for name, report in reports.items():
        print(f"{name:<18}{report.graphs:>7}{report.graph_breaks:>8}  {'; '.join(report.reasons[:3])}")
    return reports


if __name__ == "__main__":
    main()
