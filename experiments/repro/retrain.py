"""``python -m experiments.repro.retrain DEST``: retrain a published report (``docs/results/<name>``) from its own
record and add its runs' records (``publish --restore``), in one command.

The report's ``provenance`` names everything a bit-for-bit retraining needs: the commit (its tree clean), the
command line, the CPU it trained on, the kernel variables and the torch version. Before anything trains, this
refuses (one line) a report that cannot be shown to come back so: no commit or command, a dirty tree, a merged
report (retrain each folder its rows came from), a command that did not train (``NOT_TRAINING``), no CPU, kernel
variables or torch recorded, another CPU model (or id, where recorded) or torch version here; other library
versions get a warning. Then:

1. the code at the commit goes to ``WORK/code``, a clone sharing this checkout's objects (``git clone --shared``),
   so the runs record the report's commit as theirs;
2. the report's command runs there (``python -m experiments.repro ...``, niced; relative paths in it resolve
   there) with ``--out WORK/out``, without ``--no_reuse``, under the recorded kernel variables (those it ran
   without unset, and ``UNRECORDED_CHOICES``), ``--jobs`` as recorded unless given;
3. ``publish --restore WORK/out DEST`` checks every figure of every row came back equal and adds the records.

The same command again resumes: the clone is kept, the programme reuses the runs that finished and resumes the
unfinished one from its last checkpoint. ``WORK`` defaults to ``$DYNCOMP_CACHE/retrain/<DEST's name>``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from analysis.provenance import REPO
from analysis.retraining import machine_mismatch, other_libraries
from architectures.config import ConfigError
from datamodules.files import default_cache_dir
from experiments.repro.publish import report_rows, restore


#: options of a recorded command that rebuild, verify or analyse instead of training the report's runs
NOT_TRAINING = ("--tables_from", "--verify", "--run")
#: variables that choose a run's code path or folder but are not in its record: unset for the retraining
UNRECORDED_CHOICES = ("DYNCOMP_GROUPED_MM", "DYNCOMP_RUN_VERSION", "DYNCOMP_FINETUNE_VERSION")


def retraining_plan(published: Dict[str, Any], dest: pathlib.Path) -> Dict[str, Any]:
    """The report's commit, command (after the programme's script, ``--no_reuse`` left out so that running it again
    resumes) and kernel variables, or one line on why it cannot be retrained bit for bit here."""
    provenance = published.get("provenance") or {}
    where = f"retrain: {dest}"
    if not provenance.get("commit"):
        raise ConfigError(f"{where}/results.json names no commit; only a report that does can be retrained")
    if provenance.get("dirty"):
        raise ConfigError(f"{where} was computed with uncommitted changes at {provenance['commit'][:10]}; they are "
                          "not in any commit, so it cannot be retrained")
    if any(row.get("source") for row in published["runs"]):
        raise ConfigError(f"{where} merges other reports (its rows have a source); retrain each folder its rows "
                          "came from")
    argv = provenance.get("argv") or []
    if len(argv) < 2 or not pathlib.PurePath(argv[0]).as_posix().endswith("experiments/repro/__main__.py"):
        raise ConfigError(f"{where}/results.json records no command line of python -m experiments.repro "
                          f"(provenance.argv: {' '.join(argv)[:80] or 'none'})")
    command = list(argv[1:])
    programme_options = command[:command.index("--")] if "--" in command else command
    other = [o for o in NOT_TRAINING if any(a == o or a.startswith(o + "=") for a in programme_options)]
    if other:
        raise ConfigError(f"{where}'s command has {other[0]}: it did not train its runs, so there is nothing to "
                          "retrain")
    mismatch = machine_mismatch(provenance)
    if mismatch:
        raise ConfigError(f"{where}: {mismatch}; bit for bit needs the same CPU model, kernel variables and torch: "
                          "retrain it on such a machine")
    return {"commit": provenance["commit"], "environment": provenance["kernels"]["environment"],
            "command": [a for a in programme_options if a != "--no_reuse"] + command[len(programme_options):],
            "libraries": other_libraries(provenance)}


def with_option(command: Sequence[str], option: str, value: str) -> List[str]:
    """``command`` with ``option``'s value replaced by ``value`` (``--opt V`` or ``--opt=V``, before a ``--`` that
    starts the runs' own options), or added before it."""
    command = list(command)
    end = command.index("--") if "--" in command else len(command)
    for i, arg in enumerate(command[:end]):
        if arg == option and i + 1 < end:
            return [*command[:i + 1], value, *command[i + 2:]]
        if arg.startswith(option + "="):
            return [*command[:i], f"{option}={value}", *command[i + 1:]]
    return [*command[:end], option, value, *command[end:]]


def git(*args: str, cwd: pathlib.Path = REPO) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"retrain: git {' '.join(args)} failed in {cwd}: {' '.join(done.stderr.split())}")
    return done.stdout.strip()


def code_at(commit: str, target: pathlib.Path, repo: pathlib.Path = REPO) -> pathlib.Path:
    """A clean checkout of ``commit`` at ``target`` (a clone sharing ``repo``'s objects), kept for a resume. It is
    made beside ``target`` and renamed into place once checked out, so an interrupted clone leaves nothing there."""
    if target.exists():
        if (pathlib.Path(git("rev-parse", "--show-toplevel", cwd=target)).resolve() != target.resolve()
                or git("rev-parse", "HEAD", cwd=target) != commit
                or git("status", "--porcelain", "--untracked-files=no", cwd=target)):
            raise ConfigError(f"retrain: {target} holds other code than {commit[:10]}, or changed code; remove it or "
                              "give another --work")
        return target
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True).returncode:
        raise ConfigError(f"retrain: commit {commit[:10]} is not in {repo}'s history; fetch the branch that holds it "
                          "(git fetch origin; a shallow clone: git fetch --unshallow origin) and run this again")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        git("clone", "--quiet", "--shared", "--no-checkout", str(repo), str(partial))
        git("-c", "advice.detachedHead=false", "checkout", "--quiet", commit, cwd=partial)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def run_environment(recorded: Dict[str, Optional[str]], code: pathlib.Path) -> Dict[str, str]:
    """This process's environment with the recorded kernel variables (set as recorded, unset where the report ran
    without them), the suite's unrecorded choices unset (``UNRECORDED_CHOICES``: the default code path and folders)
    and the retrained code first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in recorded and k not in UNRECORDED_CHOICES}
    env.update({k: v for k, v in recorded.items() if v is not None})
    env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def train(command: Sequence[str], code: pathlib.Path, env: Dict[str, str]) -> None:
    """The report's command at its code, niced (a long retraining should not slow the machine's other work)."""
    done = subprocess.run([sys.executable, "-m", "experiments.repro", *command], cwd=code, env=env,
                          preexec_fn=lambda: os.nice(10))
    if done.returncode:
        raise ConfigError(f"retrain: the report's command exited with status {done.returncode} (its output above); "
                          "fix the cause and run this again: finished runs are reused")


def retrain(dest: pathlib.Path, work: pathlib.Path, jobs: Optional[int] = None) -> List[pathlib.Path]:
    """Retrain ``dest``'s report in ``work`` and restore its records (see the module docstring); their folders."""
    dest, work = pathlib.Path(dest), pathlib.Path(work).resolve()  # the command runs in WORK/code: --out absolute
    published = report_rows(dest, "retrain", "give the docs/results folder of a published report")
    plan = retraining_plan(published, dest)
    command = with_option(plan["command"], "--out", str(work / "out"))
    if jobs is not None:
        command = with_option(command, "--jobs", str(jobs))
    walls = [row["wall_s"] for row in published["runs"] if row.get("wall_s") is not None]
    took = f"{sum(walls):,.0f} s of runs summed when published" if walls else "their wall time not recorded"
    print(f"retrain: {len(published['runs'])} runs of {dest} at {plan['commit'][:10]} ({took}); python -m "
          f"experiments.repro {' '.join(command)}", flush=True)
    if plan["libraries"]:
        print(f"warning: retrain: other library versions than the report's ({', '.join(plan['libraries'])}); if a "
              "figure differs, the restore at the end refuses", file=sys.stderr, flush=True)
    code = code_at(plan["commit"], work / "code")
    train(command, code, run_environment(plan["environment"], code))
    return restore(work / "out", dest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.repro.retrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=pathlib.Path, help="a published report's folder (docs/results/NAME)")
    parser.add_argument("--work", type=pathlib.Path, default=None,
                        help="where the code and the runs go (default: $DYNCOMP_CACHE/retrain/NAME); kept for a resume")
    parser.add_argument("--jobs", type=int, default=None, help="runs trained at once (default: as the report ran)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    args = build_parser().parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs: {args.jobs} is not a positive number of runs at once")
    work = args.work or default_cache_dir() / "retrain" / args.dest.resolve().name
    records = retrain(args.dest, work, args.jobs)
    print(f"retrain: restored {len(records)} runs' records of {args.dest} from {work / 'out'}")
    return [str(r) for r in records]


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
