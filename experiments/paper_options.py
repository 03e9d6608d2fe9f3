"""Parameters, expected FLOPs per token and (MoM) depth of the paper-form presets next to our defaults.

    python -m experiments.paper_options [--size small] [--variants moe moe_dense_ffn cea_moe ...]

Models are built on the meta device (no memory, no data), so every size runs in seconds on a laptop.
FLOPs are ``model.flops_per_token()`` without a trace: the expected figure at T = block size (routed
variants: every routing slot a real expert / module, balanced), as a ratio to vanilla GPT-2 at the same
size. MoM depth = the layers a token passes in sequence: bottom + chunks x (H + anchor) + top.
The "Paper / official code vs our default" tables of docs/variants.md quote this command's output.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence



def default_variants() -> List[str]:
    """Every registered variant but the reference itself (the ratios are to vanilla)."""
    from architectures import variant_names

    return [name for name in variant_names() if name != "vanilla"]


def describe(variant: str, size: str) -> dict:
    import torch

    from architectures import build_model
    from architectures.config import ModelConfig

    with torch.device("meta"):
        model = build_model(ModelConfig(variant=variant, size=size))
        vanilla = build_model(ModelConfig(variant="vanilla", size=size))
    embeddings = model.wte.weight.numel() + model.wpe.weight.numel()
    row = {"variant": variant, "size": size,
           "params_non_embedding": sum(p.numel() for p in model.parameters()) - embeddings,
           "flops_ratio": model.flops_per_token().forward / vanilla.flops_per_token().forward}
    layout = getattr(model, "layout", None)
    if layout is not None:
        depth = layout.bottom + layout.chunks * (layout.steps + int(layout.anchor)) + layout.top
        row.update(depth=depth, depth_change=depth / model.config.n_layer - 1.0,
                   layout=f"{layout.bottom}+{layout.chunks}x({layout.steps}{'+A' if layout.anchor else ''})+{layout.top}",
                   top_k=model.config.mom.top_k)
    return row


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    parser = argparse.ArgumentParser(prog="python -m experiments.paper_options", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--variants", nargs="+", default=None, help="default: every registered variant")
    args = parser.parse_args(argv)
    rows = [describe(v, args.size) for v in args.variants or default_variants()]
    for r in rows:
        line = f"{r['size']:6s} {r['variant']:16s} {r['params_non_embedding'] / 1e6:8.2f}M  FLOPs x{r['flops_ratio']:.3f}"
        if "depth" in r:
            line += f"  K={r['top_k']} layout {r['layout']} depth {r['depth']} ({r['depth_change'] * 100:+.0f}%)"
        print(line)
    return rows


if __name__ == "__main__":
    main()
