"""``python -m experiments.repro <experiment> --out DIR [...] [-- RUN OPTIONS]``; see ``experiments/repro/__init__.py``."""
from experiments.repro import main
from experiments.run import cli

if __name__ == "__main__":
    cli(main)
