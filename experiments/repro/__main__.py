"""``python -m experiments.repro <experiment> --out DIR [...] [-- RUN OPTIONS]``; see ``experiments/repro/__init__.py``."""
import sys

from architectures.config import ConfigError
from datamodules.corpora import DataError
from experiments.repro import main

if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
