"""Experiments that reproduce the papers' findings, one command each:

    python -m experiments.repro <name> --out DIR [--size tiny] [--steps N] [--seed S] [-- RUN OPTIONS]

Everything after ``--`` is passed to every training run of the experiment (any
``python -m experiments.run`` option, e.g. ``--model.d_model 64 --data.batch_size 8`` or
``--data slimpajama --data.path ...``); the experiment's own grid options come after them and win.
Each experiment trains its grid through ``experiments.run.main`` (every run logs to TensorBoard under
``DIR/runs``), then writes ``DIR/results.md`` (markdown tables), ``DIR/results.json`` and PNG plots,
which it also logs as images under ``DIR/tensorboard``. Finished runs are reused when the same command
runs again (``DIR/runs.json``; ``--no_reuse`` retrains), and one that a kill cut off resumes from its last
checkpoint (``common.train_resumably``). The same command runs at paper sizes on a
cluster with ``--size small|medium|large`` and real data after ``--``.

| name | paper finding |
|---|---|
| ``mom_kh`` | MoM: validation loss over K in {1,2,3} x H in {1,2,4,6} (Figure 4) |
| ``mom_removal`` | MoM: validation loss of a trained MoM over N_A x N_F modules kept (Figure 3) |
| ``mom_transitions`` | MoM: module-to-module transition probabilities (Figure 6) |
| ``mom_two_phase`` | MoM: two-phase (vanilla -> MoM) vs from-scratch training at equal total steps |
| ``mod_isoflop`` | MoD: isoFLOP comparison with vanilla at every depth x width (loss vs parameters per FLOP budget), seeds, best dense model, bracket verdict, tests |
| ``contribution`` | FFN-Wider: MHA/FFN contribution vs FFN width and vs the CAA Outer-FFN ratio r, OOD loss |
| ``head_to_head`` | every variant at equal measured FLOPs with dense controls and seeds: val loss, tests against the best dense model, FLOPs/token, wall clock, step time, memory |
| ``necessity`` | does a probe level need depth: dense vanilla at several depths, equal steps, seeds; per-level tables against the shallowest and the pre-registered rule's verdict |
| ``probe`` | routing probes: accuracy and compute per difficulty level at matched FLOPs, dense controls, tests against the best dense model (``--quick``: a smoke run; ``--verify ROW``: retrain a published row) |
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

EXPERIMENTS = ("mom_kh", "mom_removal", "mom_transitions", "mom_two_phase", "mod_isoflop", "contribution",
               "head_to_head", "necessity", "probe")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.repro", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--out", required=True, help="output folder (tables, plots, runs)")
        sub.add_argument("--size", default="tiny", help="model size of every run (tiny, small, medium, large)")
        sub.add_argument("--steps", type=int, default=300, help="training steps per run")
        sub.add_argument("--seed", type=int, default=1337)
        sub.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        sub.add_argument("--no_reuse", action="store_true", help="retrain runs that already finished (and resume none)")
        sub.add_argument("--jobs", type=int, default=1,
                         help="runs trained at once, each in its own process (probe, mod_isoflop, head_to_head, mom_kh; "
                              "the other experiments train one after another; default 1)")
        return sub

    add_mom_experiments(add)
    add_training_experiments(add)
    add_probe_experiment(add)
    return parser


def add_mom_experiments(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The MoM paper's experiments: K x H, module removal, transitions, two-phase training."""
    p = add("mom_kh", "MoM validation loss over K x H")
    p.add_argument("--ks", default="1,2,3", help="K values (modules per step)")
    p.add_argument("--hs", default="1,2,4,6", help="H values (assembly steps)")
    p.add_argument("--variant", default="mom")
    p.add_argument("--seeds", type=int, default=5, help="seeds per cell and for vanilla, from --seed on (default 5)")
    for name, text in (("mom_removal", "MoM module-removal heatmap"), ("mom_transitions", "MoM transition graph")):
        p = add(name, text)
        p.add_argument("--variant", default="mom", help="the MoM variant trained when --run is not given")
        p.add_argument("--run", default=None, help="analyse this finished run folder instead of training one")
        p.add_argument("--sequences", type=int, default=64, help="validation sequences evaluated")
        if name == "mom_removal":
            p.add_argument("--order", default="usage", choices=("usage", "index"),
                           help="which modules go first: least used, or highest index")
    p = add("mom_two_phase", "two-phase vs from-scratch MoM at equal total steps")
    p.add_argument("--variant", default="mom")
    p.add_argument("--phase1_steps", type=int, default=None, help="default: steps / 2")
    p.add_argument("--phase2_steps", type=int, default=None, help="default: steps - phase1_steps")
    p.add_argument("--seeds", type=int, default=5, help="seeds per arm, from --seed on (default 5)")


def add_training_experiments(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """MoD at equal FLOPs, MHA/FFN contribution, every variant head to head."""
    p = add("mod_isoflop", "MoD vs vanilla at equal training FLOPs")
    p.add_argument("--budgets", default=None,
                   help="training FLOP budgets, comma-separated (default: 0.5x and 1x the FLOPs of --steps steps "
                        "of the vanilla model at the size's width)")
    p.add_argument("--widths", default=None, help="d_model values (default: 1/2, 3/4, 1, 5/4 of the size's width)")
    p.add_argument("--layers", default=None,
                   help="n_layer values, comma-separated: every variant at every depth x width (default: the size's)")
    p.add_argument("--variants", default="vanilla,mod", help="comma-separated; vanilla (the dense curve) is always in")
    p.add_argument("--min_steps", type=int, default=20, help="configurations needing fewer steps are left out")
    p.add_argument("--seeds", type=int, default=5, help="seeds per shape (default 5)")
    p.add_argument("--tables_from", default=None, metavar="RESULTS_JSON,...",
                   help="rebuild the tables, tests and figure from the run rows stored in these results.json files "
                        "(one invocation's, or several trained alike merged: e.g. a width grid and a depth grid of "
                        "one budget as one dense curve) without training")
    p = add("contribution", "MHA/FFN contribution vs FFN width and CAA ratio r")
    p.add_argument("--wide_ratio", type=float, default=32.0, help="ffn_wider and caa total FFN width / d")
    p.add_argument("--ratios", default="0.125,0.25,0.5,0.75", help="CAA Outer-FFN ratios r")
    p.add_argument("--methods", default="logit_lens,mi", help="contribution methods (logit_lens, probe, mi)")
    p.add_argument("--sequences", type=int, default=64, help="validation sequences for the contribution analysis")
    p.add_argument("--ood", action="append", default=[], metavar="NAME=PATH",
                   help="out-of-distribution text (.txt or .jsonl with 'text'), repeatable")
    p.add_argument("--ood_tokens", type=int, default=32768, help="tokens evaluated per OOD file")
    p.add_argument("--seeds", type=int, default=5, help="seeds per model, from --seed on (default 5)")
    p.add_argument("--mi_restarts", type=int, default=None,
                   help="k-means seeds the mi method averages each site over (default: analysis.contribution's, 5)")
    p = add("head_to_head", "all variants at equal measured training FLOPs (vanilla's --steps steps)")
    p.add_argument("--variants", default=None,
                   help="comma-separated entries: a variant (mod) or a variant with model options "
                        "(mod:n_layer=8:capacity=0.125); default: every registered variant")
    p.add_argument("--bench_steps", type=int, default=5, help="timed steps per variant in the interleaved benchmark")
    p.add_argument("--seeds", type=int, default=5, help="seeds per entry (default 5)")
    p.add_argument("--dense_shapes", default=None, metavar="LxD,...",
                   help="dense vanilla controls at the same budget, n_layer x d_model (default: half the depth, 3/4 the "
                        "width, both; and twice the depth when a routed variant plans more FLOPs per token than vanilla)")


def add_probe_experiment(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """The depth-necessity check, the routing probes at matched training FLOPs, and ``--verify`` of a published row."""
    p = add("necessity", "does a probe level need depth: vanilla at several depths, equal steps, seeds, the verdict")
    p.add_argument("--layers", default="1,2,4", help="the depths compared, comma-separated (the shallowest is the "
                   "baseline)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per depth, from --seed on (default 5)")
    p.add_argument("--level", type=int, default=None, help="the level judged (default: the top level of the task)")
    p.add_argument("--shallow_max", type=int, default=1,
                   help="the shallowest depth may solve the level in at most this many seeds (default 1)")
    p.add_argument("--min_solving", type=int, default=4,
                   help="each deeper depth must solve the level in at least this many seeds (default 4)")
    p.add_argument("--tables_from", default=None, metavar="DIR",
                   help="the tables and verdict from the finished run folders under DIR (e.g. a published check's "
                        "runs/), without training")
    p = add("probe", "routing probes: compute vs per-token difficulty at matched training FLOPs")
    p.set_defaults(steps=600)  # --steps: vanilla's steps; the budget every variant spends
    p.add_argument("--variants", default=None,
                   help="comma-separated entries: a variant (mod) or a variant with model options "
                        "(mod:n_layer=8:capacity=0.125); default: the registry's probe variants (vanilla, mod, "
                        "mode_staged, mode_integrated, moe, mot, depth_gate, depth_gate_skip, mom, mom_e, mor, "
                        "mor_token, recur_halt, early_exit)")
    p.add_argument("--dense_shapes", default=None, metavar="LxD,...",
                   help="dense vanilla controls at the same budget, n_layer x d_model (e.g. 2x64,4x48,8x64; default: "
                        "half the depth, 3/4 the width, both, and twice the depth of the reference model)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per entry (default 5)")
    p.add_argument("--blocks", type=int, default=128, help="validation blocks of the per-difficulty evaluation")
    p.add_argument("--min_steps", type=int, default=None,
                   help="an entry planned to train fewer steps at the budget is refused (default 20; 10 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny models and data: checks the pipeline in seconds")
    p.add_argument("--verify", default=None, metavar="ROW",
                   help="retrain this row (an entry of the published table) from nothing into a fresh --out, and "
                        "report each figure beside the published one with its interval")
    p.add_argument("--published", default=None, metavar="RESULTS_JSON",
                   help="the published table's results.json for --verify (default docs/results/probe/results.json)")
    p.add_argument("--tables_from", default=None, metavar="RESULTS_JSON,...",
                   help="rebuild the tables, tests and figures from the run rows stored in these results.json files "
                        "(one invocation's, or several at the same settings and budget merged) without training")


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    from experiments.repro.common import Context

    argv = list(sys.argv[1:] if argv is None else argv)
    own, run_options = split_argv(argv)
    args = build_parser().parse_args(own)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = Context(out=args.out, size=args.size, steps=args.steps, seed=args.seed, run_options=run_options,
                  reuse=not args.no_reuse, workers=args.jobs, threads=args.threads, command="python -m experiments.repro " + shlex.join(argv))
    try:
        return dispatch(ctx, args)
    finally:
        ctx.close()


def dispatch_probes(ctx, args) -> Dict[str, Any]:
    """The probe programmes: the depth-necessity check, and the routed comparison at matched FLOPs."""
    from experiments.repro.common import parse_list

    if args.experiment == "necessity":
        from experiments.repro.necessity import necessity_experiment, tables_from

        if args.tables_from is not None:
            return tables_from(ctx, args.tables_from, level=args.level, shallow_max=args.shallow_max,
                               min_solving=args.min_solving)
        return necessity_experiment(ctx, parse_list(args.layers, int, "layers"), args.seeds, level=args.level,
                                    shallow_max=args.shallow_max, min_solving=args.min_solving)
    from experiments.repro.probe import VARIANTS, probe_experiment

    variants = parse_list(args.variants, str, "variants") if args.variants else VARIANTS
    return probe_experiment(ctx, variants, seeds=args.seeds, blocks=args.blocks,
                            min_steps=args.min_steps or (10 if args.quick else 20),
                            quick=args.quick, dense_shapes=args.dense_shapes, verify=args.verify,
                            published=args.published, tables_from_paths=stored_results(args))


def stored_results(args) -> List[pathlib.Path]:
    """``--tables_from``'s files; [] when it is not given (an empty value is refused: the list is empty)."""
    from experiments.repro.common import parse_list

    if args.tables_from is None:
        return []
    return [pathlib.Path(p) for p in parse_list(args.tables_from, str, "tables_from")]


def dispatch(ctx, args) -> Dict[str, Any]:
    from experiments.repro.common import parse_list

    name = args.experiment
    if name == "mom_kh":
        from experiments.repro.mom import kh_sweep

        return kh_sweep(ctx, parse_list(args.ks, int, "ks"), parse_list(args.hs, int, "hs"), args.variant,
                        seeds=args.seeds)
    if name == "mom_removal":
        from experiments.repro.mom import removal

        return removal(ctx, args.variant, run=args.run, sequences=args.sequences, order=args.order)
    if name == "mom_transitions":
        from experiments.repro.mom import transitions

        return transitions(ctx, args.variant, run=args.run, sequences=args.sequences)
    if name == "mom_two_phase":
        from experiments.repro.mom import two_phase

        return two_phase(ctx, args.variant, args.phase1_steps, args.phase2_steps, seeds=args.seeds)
    if name == "mod_isoflop":
        from experiments.repro.isoflop import isoflop_experiment, tables_from

        if args.tables_from is not None:
            return tables_from(ctx, stored_results(args))
        return isoflop_experiment(
            ctx, budgets=parse_list(args.budgets, float, "budgets") if args.budgets else None,
            widths=parse_list(args.widths, int, "widths") if args.widths else None,
            n_layer=parse_list(args.layers, int, "layers") if args.layers else None,
            variants=parse_list(args.variants, str, "variants"), min_steps=args.min_steps, seeds=args.seeds)
    if name == "contribution":
        from experiments.repro.contribution import contribution_experiment, parse_ood

        return contribution_experiment(
            ctx, wide_ratio=args.wide_ratio, ratios=parse_list(args.ratios, float, "ratios"),
            methods=parse_list(args.methods, str, "methods"), sequences=args.sequences,
            ood=parse_ood(args.ood), ood_tokens=args.ood_tokens, seeds=args.seeds, mi_restarts=args.mi_restarts)
    if name in ("necessity", "probe"):
        return dispatch_probes(ctx, args)
    from experiments.repro.head_to_head import head_to_head

    variants = parse_list(args.variants, str, "variants") if args.variants else None
    return head_to_head(ctx, variants, bench_steps=args.bench_steps, seeds=args.seeds, dense_shapes=args.dense_shapes)
