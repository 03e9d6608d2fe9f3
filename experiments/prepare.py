"""Build the token caches a run will read, before training: ``python -m experiments.prepare --data openwebtext``.

Takes the options of ``experiments.run`` (the data ones matter: ``--data``, ``--tokenizer``, ``--data.*``;
the others are accepted and ignored), so the caches it builds are exactly the ones that run opens: run it
with the training command's options. It tokenises the training corpus and every validation set on
``--data.num_proc`` processes (default: every CPU this process may use), prints the disk space the cache
will need before it starts, shows a progress bar with throughput and ETA, and is resumable: a killed
prepare continues from its finished shards (``datamodules/cache_build.py``). A cache already built is
verified and reused. Under DDP, prepare first: a training run does not build a large cache while its
other ranks wait at a barrier (docs/training.md). The last lines printed are the cache folders.

Exit status: 0 when every cache is built; 2 for a user mistake (one ``error: ...`` line on stderr).
"""
from __future__ import annotations

import pathlib
import sys
from typing import List, Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> List[pathlib.Path]:
    from datamodules.lm import DataConfig, LMDataModule
    from experiments import run

    parser = run.build_parser()
    parser.prog = "python -m experiments.prepare"
    cfg = run.parse_with_presets(parser, run.expand_aliases(list(sys.argv[1:] if argv is None else argv)))
    run.validate_up_front(cfg)
    data = LMDataModule(DataConfig(**run._as_dict(cfg.data)), block_size=run.model_config(cfg).resolve().block_size)
    data.prepare_data()
    folders = [data._folder(corpus) for corpus in data._corpora().values()]
    for folder in folders:
        print(folder)
    return folders


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
