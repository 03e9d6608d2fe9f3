"""Offline analyses of a trained checkpoint.

    python -m experiments.analyze contribution --ckpt runs/vanilla-tiny/version_0/checkpoints/last.ckpt \
        [--method logit_lens|probe|mi] [--sequences 64] [--clusters 64] [--json OUT]
    python -m experiments.analyze routing runs/mod-tiny/version_0 [--png OUT]

``routing`` reads ``routing/stats.jsonl`` (counts saved by the training run at every routing logging
step), prints each site's option fractions and each transition matrix at the first and the last
logged step, and plots the matrices side by side (``routing/first-vs-last.png``).

MHA-vs-FFN contribution ratios (the FFN-Wider paper) at every sub-layer boundary that
``model(idx, return_residuals=True)`` reports (embeddings, then each MHA / FFN update as it happened):

* ``logit_lens``: next-token top-1 accuracy of the final LayerNorm + unembedding at each state
  (the training-time ContributionCallback, over more data), plus direct logit attribution.
* ``probe``: a linear probe per state, trained on 80% of the probe sequences and scored (top-1) on
  the other 20%. Inputs are the states normalised without affine (LayerNorm statistics only); each
  probe starts from the logit lens (unembedding x ln_f gain, bias from ln_f's bias) and uses the same
  seed, so identical states give identical probes.
* ``mi``: the normalised states of every site clustered with MiniBatchKMeans (the same K at every
  site, same seed), then the plug-in mutual information I(cluster; next token) in bits. Its bias
  (about (K-1)(V-1) / (2 N ln 2)) is the same at every site and cancels in the gains. The clustering's
  own noise does not: each site's information is averaged over ``--restarts`` k-means seeds (``--seed``,
  ``--seed`` + 1, ...), and the ratios' SE is a bootstrap over those seeds.

Ratios come from the gains between consecutive states (``callbacks.contribution.ratios_from_values``):
ratio_MHA = sum of MHA gains / total gain, likewise FFN; they sum to 1. With ``logit_lens`` each ratio
has a standard error (``ratio_mha_se``), by bootstrap over the probe sequences; with ``mi``, over the
k-means seeds.

The probe data are the first sequences of the run's validation set, rebuilt from the ``data`` group
of ``config.yaml`` in the run folder (the folder above ``checkpoints/``), so the embedded corpus
works offline. The result is printed as JSON and written to ``--json`` (default: the run folder's
``contribution-<method>.json``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from analysis.contribution import METHODS, MI_RESTARTS, contribution, routing, run_folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.analyze", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("contribution", help="MHA vs FFN contribution ratios of a checkpoint")
    c.add_argument("--ckpt", required=True, help="a checkpoint written by experiments.run")
    c.add_argument("--method", choices=METHODS, default="logit_lens")
    c.add_argument("--sequences", type=int, default=64, help="validation sequences used as probe data")
    c.add_argument("--batch_size", type=int, default=8)
    c.add_argument("--clusters", type=int, default=64, help="k-means K at every site (--method mi)")
    c.add_argument("--restarts", type=int, default=MI_RESTARTS,
                   help="k-means seeds each site's information is averaged over (--method mi)")
    c.add_argument("--probe_steps", type=int, default=200, help="Adam steps per linear probe (--method probe)")
    c.add_argument("--probe_lr", type=float, default=1e-3)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument("--json", default=None, help="output file (default: <run folder>/contribution-<method>.json)")
    r = commands.add_parser("routing", help="transition matrices and option fractions saved by a run, first vs last step")
    r.add_argument("run_dir", help="a run folder of experiments.run (holds routing/stats.jsonl)")
    r.add_argument("--png", default=None, help="output image (default: <run_dir>/routing/first-vs-last.png)")
    return parser


def print_routing(result: Dict[str, Any], stream=None) -> None:
    stream = stream or sys.stderr
    steps = result["steps"]
    print(f"logged steps: {steps[0]} .. {steps[-1]} ({len(steps)} records)", file=stream)
    for name, site in result["sites"].items():
        print(f"{name}:", file=stream)
        for i, choice in enumerate(site["choices"]):
            first = f"{site['first'][i]:.3f}" if site["first"] is not None else "  -  "
            print(f"  {choice:>12}  first {first}  last {site['last'][i]:.3f}", file=stream)
    for t in result["transitions"]:
        print(f"{t['source']} -> {t['target']} (rows: from, columns: to; last step):", file=stream)
        for row, count in zip(t["last"], t["last_row_counts"]):
            print("  " + " ".join(f"{v:.2f}" for v in row) + f"   (n={int(count)})", file=stream)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.command == "routing":
        result = routing(args.run_dir, args.png)
        print_routing(result)
        print(json.dumps(result))
        return result
    result = contribution(args.ckpt, args.method, args.sequences, args.batch_size, args.clusters,
                          args.probe_steps, args.probe_lr, args.seed, args.device, args.restarts)
    out = pathlib.Path(args.json) if args.json else run_folder(pathlib.Path(args.ckpt)) / f"contribution-{args.method}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for label, value in zip(result["labels"], result["values"]):
        print(f"{label:>12}  {value:.4f}", file=sys.stderr)
    se = f" +- {result['ratio_mha_se']:.3f} (SE, {result['se_method']})" if result.get("ratio_mha_se") is not None else ""
    print(f"ratio_mha={result['ratio_mha']}{se}  ratio_ffn={result['ratio_ffn']}  ({out})", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
