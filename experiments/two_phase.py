"""MoM's two-phase training in one command: phase 1 trains vanilla GPT-2, phase 2 builds the MoM from it.

    python -m experiments.two_phase --variant mom_e [--size tiny --phase1_steps N --phase2_steps M --log_dir DIR]

Both phases are ordinary ``experiments.run`` runs (TensorBoard events, checkpoints, summary.json) under
the same ``--log_dir``, so ``tensorboard --logdir DIR`` shows them side by side:
``DIR/vanilla-<size>/<version>`` and ``DIR/<variant>-<size>/<version>`` with the same version name.
Phase 2 starts from phase 1's ``last.ckpt`` through ``--init_from`` (the MoM's ``init_from_vanilla``:
vanilla layer j -> attention module j and FFN module j, embeddings copied, routers fresh).

Any other option is passed to both phases (model dimensions, data, trainer options must agree);
``--phase1.X V`` / ``--phase2.X V`` pass ``--X V`` to one phase only. Phase 1 validates on the run's
own ``--val_every`` schedule; its ``last.ckpt`` is written at the final step whatever that schedule
is, so phase 2 always starts from the final vanilla model. Phase 2 warms up over
min(500, M / 10) steps unless ``--phase2.optim.warmup_steps`` says otherwise (the official recipe:
AdamW (0.9, 0.95), wd 0.1, lr 1e-3 cosine, 500 warmup steps of 5k). Single process: for DDP, run the
two phases with ``experiments.run`` yourself. ``--phase2_recipe official`` adds the official code's
phase-2 optimiser settings that differ from ours (``OFFICIAL_PHASE2``: Adam eps 1e-5 instead of 1e-8; the
betas, weight decay and lr above are our defaults already); explicit ``--phase2.optim.*`` still win. Prints phase 2's run folder last and writes
``two_phase.json`` (both run folders and the checkpoint used) into it.

Resumable: ``--version NAME`` names both phases' folders (default: the next ``version_N`` free under both), and
the same command with the same ``--version`` goes on where a kill stopped it: a phase that finished (its
``summary.json`` at its steps) is kept, a phase cut off resumes from its newest checkpoint (``last.ckpt``,
written at each validation and by a SIGTERM/SIGUSR1 stop: give long phases a ``--val_every``), phase 2 from
phase 1's final checkpoint as before.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import List, Optional, Sequence, Tuple

from architectures.config import ConfigError


def parse(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str], List[str]]:
    parser = argparse.ArgumentParser(prog="python -m experiments.two_phase", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--variant", default="mom_e", help="a MoM variant (mom, mom_p, mom_e, mom_i, layer_skip, param_share)")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--phase1_steps", type=int, default=300)
    parser.add_argument("--phase2_steps", type=int, default=300)
    parser.add_argument("--log_dir", default="runs/two_phase")
    parser.add_argument("--version", default=None,
                        help="both phases' run folder (default: the next version_N free under both); the same "
                             "command with the same --version resumes: finished phases are kept, a cut-off one resumes")
    parser.add_argument("--phase2_recipe", choices=("ours", "official"), default="ours",
                        help="official: the official code's phase-2 optimiser (Adam eps 1e-5)")
    args, rest = parser.parse_known_args(list(argv))
    for name in ("phase1_steps", "phase2_steps"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {getattr(args, name)}")
    common, only = [], {"phase1": [], "phase2": []}
    i = 0
    while i < len(rest):
        arg = rest[i]
        target = common
        for phase in only:
            if arg.startswith(f"--{phase}."):
                target, arg = only[phase], "--" + arg[len(phase) + 3:]
        target.append(arg)
        if "=" not in arg and i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            target.append(rest[i + 1])
            i += 1
        i += 1
    return args, common + only["phase1"], common + only["phase2"]


# The official phase-2 recipe's settings that differ from OptimConfig's defaults (lr 1e-3, betas (0.9, 0.95)
# and weight decay 0.1 are the same already).
OFFICIAL_PHASE2 = ["--optim.eps", "1e-5"]


def check_variant(variant: str) -> None:
    from architectures.registry import get_variant, variant_names

    cls = get_variant(variant).model_class()
    if not cls.two_phase_from_vanilla:
        usable = [n for n in variant_names() if get_variant(n).model_class().two_phase_from_vanilla]
        raise ConfigError(f"model.variant: {variant!r} cannot start from a vanilla checkpoint; use one of {', '.join(usable)}")


def shared_version(log_dir: pathlib.Path, size: str, variant: str) -> str:
    """The next ``version_N`` free under both phases' folders, so the two runs share one name."""
    taken = set()
    for root in (log_dir / f"vanilla-{size}", log_dir / f"{variant}-{size}"):
        taken |= {int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))}
    return f"version_{max(taken) + 1 if taken else 0}"


def vanilla_options(argv: List[str]) -> List[str]:
    """Phase 1's command without the options shared with phase 2 that vanilla does not read (e.g. the routed
    variant's ``--model.mom.router_hidden``), which ``experiments.run`` would refuse; says what it dropped."""
    from experiments import run

    kept, _, dropped = run.without_ignored_options(argv, run.build_parser())
    if dropped:
        print(f"note: two_phase: phase 1 (vanilla) does not use {', '.join(sorted(dropped))}; dropped from it",
              file=sys.stderr)
    return kept


def run_or_resume(argv: List[str], folder: pathlib.Path, steps: int) -> pathlib.Path:
    """One phase: kept when ``folder`` holds its finished run, resumed from the folder's newest checkpoint when a
    kill cut it off, trained otherwise."""
    from experiments import run
    from experiments.repro.common import newest_checkpoint

    try:
        finished = json.loads((folder / "summary.json").read_text()).get("steps") == steps
    except (OSError, ValueError, AttributeError):
        finished = False
    if finished:
        print(f"note: two_phase: {folder} finished already; kept", file=sys.stderr)
        return folder
    checkpoint = newest_checkpoint(folder)
    if checkpoint is None:
        return run.main(argv)
    print(f"note: two_phase: resuming {folder} from {checkpoint.name}", file=sys.stderr)
    return run.main([*argv, "--ckpt_path", str(checkpoint)])


def main(argv: Optional[Sequence[str]] = None) -> pathlib.Path:
    args, phase1_extra, phase2_extra = parse(sys.argv[1:] if argv is None else argv)
    check_variant(args.variant)
    from callbacks.preemption import time_limit_warning_noted

    # one note for both phases: SIGUSR1 between them (or after) would otherwise meet its default action, which
    # kills; noted then, phase 2 stops after its first step with a checkpoint (callbacks/preemption.py)
    with time_limit_warning_noted():
        return train_both_phases(args, phase1_extra, phase2_extra)


def train_both_phases(args, phase1_extra: List[str], phase2_extra: List[str]) -> pathlib.Path:
    log_dir = pathlib.Path(args.log_dir)
    version = args.version or shared_version(log_dir, args.size, args.variant)
    base = ["--size", args.size, "--log_dir", str(log_dir), "--version", version]
    phase1 = run_or_resume(vanilla_options(["--variant", "vanilla", *base, "--max_steps", str(args.phase1_steps),
                                            *phase1_extra]), log_dir / f"vanilla-{args.size}" / version,
                           args.phase1_steps)
    checkpoint = phase1 / "checkpoints" / "last.ckpt"
    if not checkpoint.is_file():
        raise FileNotFoundError(f"phase 1 wrote no {checkpoint}")
    warmup = ["--optim.warmup_steps", str(min(500, args.phase2_steps // 10))]
    if args.phase2_recipe == "official":
        warmup += OFFICIAL_PHASE2  # before phase2_extra: an explicit --phase2.optim.eps wins
    # the MoM mapping uses every vanilla tensor; the routers are new by design (at tiny, GRU routers wider
    # than d_model are most of the parameters), so no share threshold; the tokenizer check stays
    phase2 = run_or_resume(["--variant", args.variant, *base, "--max_steps", str(args.phase2_steps), *warmup,
                            "--init_from", str(checkpoint), "--init_min_share", "0", *phase2_extra],
                           log_dir / f"{args.variant}-{args.size}" / version, args.phase2_steps)
    record = {"variant": args.variant, "size": args.size, "phase1": str(phase1), "phase1_checkpoint": str(checkpoint),
              "phase2": str(phase2)}
    (phase2 / "two_phase.json").write_text(json.dumps(record, indent=2) + "\n")
    print(phase2)
    return phase2


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
