"""``python -m experiments.compiling [--variants a,b] [--size tiny]``: the graphs and graph breaks of one
training forward + loss per variant. ``torch.compile`` itself: ``model_tools/compiling.py``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from model_tools.compiling import GraphReport, graph_report


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
