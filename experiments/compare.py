"""A leaderboard of any set of training runs: ``python -m experiments.compare RUN_DIR_OR_GLOB ... [--out DIR]``.

    python -m experiments.compare runs/                       # every run folder below runs/
    python -m experiments.compare 'sweep/*/version_*' other/run --group_by variant --out board/

Each argument is a run folder of ``experiments.run`` (it holds ``config.yaml``), a folder searched
recursively for run folders (a sweep's ``--log_dir``, a repro experiment's ``--out``), or a glob of
either. The table (markdown on stdout; with ``--out``: ``leaderboard.md``, ``.csv``, ``.json`` and the
plot ``leaderboard.png``) has one row per configuration: the variant, the options that differ between
the runs (from their resolved ``config.yaml``), the number of seeds ``n`` and, as mean ± std over the
seeds, steps, tokens, measured training FLOPs, validation loss, causal validation loss (variants whose
routing sees the future, e.g. MoD), forward FLOPs per token, median step time and parameters. The
``.csv`` and ``.json`` name the run folders below ``--out`` relative to it (a board written beside its
runs names them on any machine it is copied to), others by their full path.

Runs are seeds of one configuration when every option but the seed and the output paths is equal
(``IGNORED``); ``--group_by variant[,model.d_model,...]`` groups by those options instead (options that
vary inside a group are listed with all their values). Rows are ranked by the causal validation loss
where they have one, else by the validation loss (what ``summary.json``'s ``final_val_loss`` holds);
``pareto`` marks the rows no other beats on both training FLOPs and that loss.

Statistics (``analysis/stats.py``): each row's 95% percentile-bootstrap interval of its mean ranking loss
over its seeds; ``--baseline NAME`` (a row label as in the plot's legend, or a variant only one row has)
tests every other row against that one: the difference in mean loss with its bootstrap interval, Hedges'
g, Welch's two-sided p over seeds and that p after Holm's correction over the rows. Routing-probe runs add a
second table, accuracy per difficulty level: seed mean, bootstrap interval over seeds, seeds that solve the
level (>= 0.9) and, with ``--baseline``, the difference from the baseline's with Holm's correction per level
(e.g. the depth-necessity check: ``--group_by model.n_layer --baseline 'vanilla n_layer=1'``). A table whose runs
were trained by different code (``summary.json``'s ``provenance``: commit, dirty tree) says so in one
``warning:`` line and at the top of the markdown note.

Refused (one ``error:`` line, exit status 2): runs with different tokenizers or validation sets (data
fingerprints from the checkpoints, validation fraction, context length, validation batches evaluated:
their losses are not comparable), no run folders matched, an unreadable ``summary.json``,
``config.yaml`` or checkpoint (the file is named). Unfinished runs (no ``summary.json`` yet, or a
summary older than the run's ``trainer.max_steps`` although no budget stopped it) are skipped with a warning.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Dict, Optional, Sequence

from analysis.compare import compare, to_markdown
from architectures.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_GLOB",
                        help="run folders, folders holding run folders, or globs of either")
    parser.add_argument("--group_by", action="append", default=None, metavar="KEYS",
                        help="comma-separated grouping options (variant, size or config keys such as model.d_model; "
                             "default: every option but the seed and output paths); repeatable")
    parser.add_argument("--out", default=None, help="write leaderboard.md/.csv/.json/.png into this folder")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="a row label (as in the plot's legend, e.g. 'mod capacity=0.25') or a variant only one "
                             "row has: every other row is tested against it (difference in mean loss with its "
                             "bootstrap CI, Hedges' g, Welch p, Holm-corrected p)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    group_by = [k.strip() for item in args.group_by or [] for k in item.split(",") if k.strip()] or None
    board = compare(args.runs, group_by, pathlib.Path(args.out) if args.out else None, args.baseline)
    print(to_markdown(board), end="")
    for path in (board.get("files") or {}).values():
        print(f"wrote {path}", file=sys.stderr)
    return board


def cli(argv: Optional[Sequence[str]] = None) -> None:
    """As ``experiments.run.cli`` (``error: <one line>``, exit status 2), without importing the training stack:
    a table should not wait for Lightning to load."""
    try:
        main(argv)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
