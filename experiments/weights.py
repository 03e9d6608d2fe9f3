"""``python -m experiments.weights [SIZE]``: for every variant, what ``--init_from`` a vanilla model of SIZE
initialises (the table in docs/training.md); ``python -m experiments.weights --step0 RUN_DIR [BATCHES]``: the
step-0 validation loss of every variant started from that vanilla run. The loading itself:
``model_tools/weights.py``.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import torch

from model_tools.weights import init_report, load_initial_weights, read_source


def mapping_table(size: str = "tiny") -> str:
    """Markdown: for each variant, what ``--init_from`` a vanilla model of ``size`` initialises."""
    from architectures import ModelConfig, build_model, variant_names
    from architectures.registry import apply_preset

    state = build_model(ModelConfig(variant="vanilla", size=size).resolve()).state_dict()
    lines = [f"| variant | share of parameters outside the embeddings from vanilla ({size}) | "
             "tensors loaded / mapped / new / unused | |",
             "|---|---|---|---|"]
    for name in variant_names():
        model = build_model(apply_preset(ModelConfig(variant=name, size=size)).resolve())
        own, mapping = model.state_dict(), model.vanilla_state_mapping(state)
        bad = [k for k, v in mapping.items() if k in own and own[k].shape != v.shape]
        report = init_report(model, state, mapping)
        note = f"refused: {len(bad)} shapes differ (e.g. `{bad[0]}`)" if bad else ""
        share = "-" if bad else f"{100 * report.initialised_share:.1f}%"
        lines.append(f"| `{name}` | {share} | {len(report.loaded)} / "
                     f"{len(report.mapped)} / {len(report.new)} / {len(report.unused)} | {note} |")
        del model
    return "\n".join(lines)


def validation_blocks(saved: dict, batches: int) -> list:
    """The first ``batches`` validation batches of the run whose ``config.yaml`` is ``saved``, in order."""
    from callbacks.common import batch_tokens
    from datamodules.lm import DataConfig, LMDataModule

    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = LMDataModule(DataConfig(**{k: v for k, v in saved["data"].items() if k in fields}),
                        block_size=saved["model"]["block_size"], seed=saved.get("seed", 0))
    data.prepare_data()
    data.setup("fit")
    loader = data.val_dataloader()
    loader = loader[0] if isinstance(loader, (list, tuple)) else loader
    return [batch_tokens(b) for _, b in zip(range(batches), loader)]  # under a loss mask: (tokens, weights)


@torch.no_grad()
def evaluate(model, blocks: list):
    """(mean loss, every block's logits) of ``model`` in evaluation mode."""
    model.eval()
    losses, logits = [], []
    for block in blocks:
        out = model(block[:, :-1]).logits.float()
        logits.append(out)
        losses.append(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), block[:, 1:].reshape(-1)))
    return float(torch.stack(losses).mean()), torch.cat(logits)


def upcycled(name: str, preserve: bool, shape: dict, ckpt: str):
    """Variant ``name`` of the checkpoint's shape started from ``ckpt``: with the function-preserving start
    (``preserve``) or the mapped weights only; None when a mapped tensor's shape differs."""
    import contextlib
    import io

    from architectures import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(variant=name, **shape))
    own, mapping = model.state_dict(), model.vanilla_state_mapping(read_source(ckpt)[0])
    if any(k in own and own[k].shape != v.shape for k, v in mapping.items()):
        return None
    with contextlib.redirect_stderr(io.StringIO()):
        if preserve:
            load_initial_weights(model, ckpt)
        else:
            model.load_state_dict(mapping, strict=False)
    return model


def step0_table(run_dir: str, batches: int = 8) -> str:
    """Markdown: the step-0 validation loss of every variant ``--init_from`` the vanilla run ``run_dir``
    (its ``config.yaml`` names the data; ``checkpoints/last.ckpt`` the weights), next to the checkpoint's
    own loss, with and without the function-preserving start, and the largest logit difference.

    Each variant is built at the checkpoint's size with its default preset; the same ``batches``
    validation batches (the first ones, in order) are used for every row.
    """
    import yaml

    from architectures import variant_names

    run = pathlib.Path(run_dir)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    ckpt = str(run / "checkpoints" / "last.ckpt")
    blocks = validation_blocks(saved, batches)
    shape = {k: saved["model"][k] for k in ("vocab_size", "d_model", "n_layer", "n_head", "block_size", "ffn_ratio",
                                            "bias", "layer_norm_eps")}
    dense_loss, dense_logits = evaluate(upcycled("vanilla", True, shape, ckpt), blocks)
    lines = [f"step-0 validation loss, {len(blocks)} batches of {run} (vanilla: {dense_loss:.4f})", "",
             "| variant | step-0 loss | - vanilla | without the function-preserving start | max abs logit diff |",
             "|---|---|---|---|---|"]
    for name in variant_names():
        before, after = upcycled(name, False, shape, ckpt), upcycled(name, True, shape, ckpt)
        if after is None:
            lines.append(f"| `{name}` | - | | | refused: shapes differ |")
            continue
        loss, logits = evaluate(after, blocks)
        old = evaluate(before, blocks)[0]
        diff = float((logits - dense_logits).abs().max())
        lines.append(f"| `{name}` | {loss:.4f} | {loss - dense_loss:+.4f} | {old:.4f} ({old - dense_loss:+.4f}) "
                     f"| {diff:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--step0":
        print(step0_table(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8))
    else:
        print(mapping_table(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
