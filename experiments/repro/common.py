"""What every reproduction experiment shares: running a grid through ``experiments.run.main``,
evaluating trained checkpoints, and writing the markdown table, plots and TensorBoard images.

Runs go to ``<out>/runs/<variant>-<size>/version_N`` (TensorBoard events, checkpoints, summary.json),
so ``tensorboard --logdir <out>`` shows every run of an experiment next to its figures
(``<out>/tensorboard``). ``<out>/runs.json`` maps each run's exact options to its folder: rerunning an
experiment with the same options reuses the finished runs instead of training them again. The runs an
experiment used are tabulated by ``experiments.compare`` (``<out>/leaderboard.{md,csv,json,png}``, and the
"Runs" section of ``results.md``), the same table ``python -m experiments.compare <out>`` prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from architectures.config import ConfigError
from analysis.dense_grid import grid_bracket
from analysis.tables import figure, fmt, markdown_table  # noqa: F401  (the experiments import them from here)


@dataclasses.dataclass
class Context:
    """One experiment invocation: where it writes, and the options every one of its runs gets."""

    out: pathlib.Path
    size: str = "tiny"
    steps: int = 300
    seed: int = 1337
    run_options: List[str] = dataclasses.field(default_factory=list)  # passed to every run (after ``--``)
    reuse: bool = True
    workers: int = 1  # runs trained at once (``--jobs``)
    threads: Optional[int] = None  # torch threads per run (``--threads``)
    command: Optional[str] = None  # the experiment's command line, quoted in results.md
    wall_time_s: Dict[str, float] = dataclasses.field(default_factory=dict)  # per part of the programme (``part``)
    _parser: Any = dataclasses.field(default=None, repr=False)
    _writer: Any = dataclasses.field(default=None, repr=False)
    _run_dirs: List[pathlib.Path] = dataclasses.field(default_factory=list, repr=False)  # this invocation's runs

    def __post_init__(self) -> None:
        self.out = pathlib.Path(self.out)
        if self.steps <= 0:
            raise ConfigError(f"--steps: must be a positive integer, got {self.steps}")
        if self.workers < 1:
            raise ConfigError(f"--jobs: must be a positive integer, got {self.workers}")

    @property
    def log_dir(self) -> pathlib.Path:
        return self.out / "runs"

    def argv(self, options: Sequence[str], steps: Optional[int] = None, budget: Optional[float] = None) -> List[str]:
        """A run's full command line: common options, the pass-through options, then the grid point's.

        With ``budget`` the run trains until its measured training FLOPs reach it (``--max_train_flops``) and
        ``steps`` is only a cap (``budget_step_cap``)."""
        steps = self.steps if steps is None else steps
        budget_options = [] if budget is None else ["--max_train_flops", repr(float(budget))]
        # One validation + checkpoint at the end: last.ckpt is the final model, evaluated offline.
        argv = ["--size", self.size, "--max_steps", str(steps), *budget_options, "--val_every", str(steps),
                "--seed", str(self.seed), "--log_dir", str(self.log_dir), *self.run_options, *options]
        from experiments.run import without_ignored_options

        # common options may hold one variant's settings (e.g. the probe grid's model.mom.router_hidden)
        return without_ignored_options(argv, self.parser())[0]

    # ------------------------------------------------------------------ validation before any run
    def parser(self):
        if self._parser is None:
            from experiments.run import build_parser

            self._parser = build_parser()
        return self._parser

    def parse(self, argv: Sequence[str]):
        """The run's resolved options (jsonargparse Namespace), parsed and validated as ``experiments.run`` does:
        the variant's preset under the explicit options (``cea_moe``'s FFN ratio, not the dataclass default)."""
        from experiments.run import expand_aliases, parse_with_presets, validate_up_front

        try:
            cfg = parse_with_presets(self.parser(), expand_aliases(list(argv)))
        except SystemExit as exit_:  # jsonargparse reports and exits on unknown options
            raise ConfigError(f"invalid run options: {' '.join(argv)}") from exit_
        validate_up_front(cfg)
        return cfg

    def validate(self, grid: Iterable[Sequence[str]], budget: Optional[float] = None) -> None:
        """Every configuration is checked before the first run starts."""
        grid = list(grid)
        if not grid:
            raise ConfigError("the experiment's grid is empty: nothing to run")
        for options in grid:
            self.parse(self.argv(options, budget=budget))

    # ------------------------------------------------------------------ running
    def run(self, options: Sequence[str], steps: Optional[int] = None, budget: Optional[float] = None) -> Dict[str, Any]:
        """Train one configuration (or reuse the finished run with identical options, or resume the one a kill
        stopped: ``train_resumably``); its summary + run_dir."""
        argv = self.argv(options, steps, budget)
        started = self.started_file("experiments.run", argv)
        return load_summary(self.cached("experiments.run", argv, lambda: train_resumably(argv, started)))

    def run_many(self, jobs: Sequence[Tuple[Sequence[str], Optional[int], Optional[float]]]) -> List[Dict[str, Any]]:
        """``run`` for each (options, steps, budget), in order; with ``workers`` > 1 the runs that are not
        finished yet train in that many processes at once (one torch thread each unless ``threads`` says
        otherwise). The index (``runs.json``) is only written here, by the parent, so it never races."""
        if self.workers <= 1:
            return [self.run(options, steps, budget) for options, steps, budget in jobs]
        argvs = [self.argv(options, steps, budget) for options, steps, budget in jobs]
        done: Dict[int, pathlib.Path] = {}
        todo = []
        for i, argv in enumerate(argvs):
            previous = self.finished("experiments.run", argv)
            if previous is not None:
                done[i] = previous
            elif argv not in [argvs[j] for j in todo]:
                todo.append(i)
        for i in todo:
            print(f"[repro] python -m experiments.run {' '.join(argvs[i])}", file=sys.stderr, flush=True)

        def record(k: int, run_dir: str) -> None:
            done[todo[k]] = pathlib.Path(run_dir)
            self.remember("experiments.run", argvs[todo[k]], done[todo[k]])

        run_in_workers(_train_in_worker, [(argvs[i], self.threads or 1, self.started_file("experiments.run", argvs[i]))
                                          for i in todo], self.workers, record)
        for i, argv in enumerate(argvs):  # duplicates of a configuration share its run
            if i not in done:
                done[i] = done[next(j for j in todo if argvs[j] == argv)]
        return [load_summary(self.record_run(done[i])) for i in range(len(argvs))]

    def cached(self, command: str, argv: Sequence[str], produce: Callable[[], pathlib.Path]) -> pathlib.Path:
        """``produce()``'s run folder, or the folder an earlier identical command left with a summary.json."""
        previous = self.finished(command, argv)
        if previous is not None:
            return self.record_run(previous)
        print(f"[repro] python -m {command} {' '.join(argv)}", file=sys.stderr, flush=True)
        run_dir = pathlib.Path(produce())
        self.remember(command, argv, run_dir)
        return self.record_run(run_dir)

    def finished(self, command: str, argv: Sequence[str]) -> Optional[pathlib.Path]:
        """The folder an earlier identical command left with a summary.json (None: train it; or ``--no_reuse``)."""
        previous = self._index().get(json.dumps([command, *argv]))
        if self.reuse and previous and (pathlib.Path(previous) / "summary.json").is_file():
            return pathlib.Path(previous)
        return None

    def started_file(self, command: str, argv: Sequence[str]) -> Optional[pathlib.Path]:
        """Where ``train_resumably`` records the folder of the command's run as it starts (one file per command,
        so that workers never write the same file); None under ``--no_reuse`` (nothing is resumed)."""
        import hashlib

        if not self.reuse:
            return None
        key = hashlib.sha256(json.dumps([command, *argv]).encode()).hexdigest()[:20]
        return self.out / "runs.started" / f"{key}.json"

    def remember(self, command: str, argv: Sequence[str], run_dir: pathlib.Path) -> None:
        """Record in ``runs.json`` which folder the command's run went to."""
        index = self._index()
        index[json.dumps([command, *argv])] = str(run_dir)
        self._write_index(index)

    def record_run(self, run_dir: pathlib.Path) -> pathlib.Path:
        """Add a run folder to this experiment's run table (``run_table``)."""
        if run_dir not in self._run_dirs:
            self._run_dirs.append(run_dir)
        return run_dir

    def _index(self) -> Dict[str, str]:
        path = self.out / "runs.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _write_index(self, index: Dict[str, str]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "runs.json.tmp"
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        tmp.replace(self.out / "runs.json")

    @contextlib.contextmanager
    def part(self, name: str):
        """Time a part of the programme (training, tables): wall seconds added to ``wall_time_s[name]``, which
        ``write_report`` puts into results.json and results.md."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wall_time_s[name] = self.wall_time_s.get(name, 0.0) + time.perf_counter() - start

    # ------------------------------------------------------------------ outputs
    def write_report(self, title: str, sections: Sequence[str], results: Dict[str, Any],
                     board: Optional[Dict[str, Any]] = None) -> pathlib.Path:
        """``results.md`` (the experiment's sections, then the run table: ``board`` where the experiment built its
        own ``experiments.compare`` table of these runs, grouped or against a baseline) and ``results.json``."""
        self.out.mkdir(parents=True, exist_ok=True)
        header = [f"# {title}", ""]
        if self.command:
            header += [f"Command: `{self.command}`", ""]
        runs, files = self.run_table(board)
        (self.out / "results.md").write_text("\n".join(header + list(sections) + self.wall_time_lines() + runs).rstrip()
                                             + "\n")
        results = {**results, "leaderboard": files} if files else results
        results = {**results, "wall_time_s": dict(self.wall_time_s)} if self.wall_time_s else results
        from analysis.provenance import provenance

        results = {**results, "provenance": provenance()}  # the code that computed the tables from the runs
        (self.out / "results.json").write_text(json.dumps(results, indent=2, default=_jsonable) + "\n")
        return self.out / "results.md"

    def wall_time_lines(self) -> List[str]:
        """results.md's line of the wall time per part of this invocation (none when nothing was timed)."""
        if not self.wall_time_s:
            return []
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.wall_time_s.items())
        return [f"Wall time of this invocation per part: {parts} (reused runs cost no training time).", ""]

    def run_table(self, board: Optional[Dict[str, Any]] = None) -> Tuple[List[str], Dict[str, str]]:
        """The runs of this invocation through ``experiments.compare`` (or ``board``, their table built already):
        written to ``<out>/leaderboard.*``, returned as results.md lines with the files. Runs that cannot be
        compared leave a note, not a table."""
        from analysis import compare

        if not self._run_dirs:
            return [], {}
        heading = ["", "## Runs (`python -m experiments.compare`)", ""]
        try:
            board = board or compare.leaderboard(compare.read_runs(self._run_dirs))
        except ConfigError as err:  # incomparable runs, an unreadable file: the experiment's own tables still stand
            print(f"warning: [repro] no run table: {err}", file=sys.stderr)
            return heading + [f"No run table: {err}", ""], {}
        files = compare.write_leaderboard(board, self.out)
        self.log_table("leaderboard", compare.to_markdown(board))
        return heading + [compare.to_markdown(board)], {k: str(v) for k, v in files.items()}

    def save_figure(self, fig, name: str) -> pathlib.Path:
        """PNG into the output folder and the same image into ``<out>/tensorboard``."""
        import matplotlib.pyplot as plt

        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        writer = self.tensorboard()
        writer.add_figure(f"repro/{name}", fig, global_step=0, close=False)
        writer.flush()
        plt.close(fig)
        return path

    def log_table(self, name: str, markdown: str) -> None:
        writer = self.tensorboard()
        writer.add_text(f"repro/{name}", markdown, global_step=0)
        writer.flush()

    def tensorboard(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _jsonable(value):
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return float(value)


#: a budget run's ``--max_steps``: this many times the steps its plan (analytic FLOPs per token) needs, room for
#: routers that spend less than planned (MoM-E spent half its upper bound); a run the cap stops is reported
BUDGET_STEP_CAP = 4.0


def run_in_workers(fn: Callable[..., Any], calls: Sequence[Tuple[Any, ...]], workers: int,
                   on_result: Callable[[int, Any], None]) -> None:
    """``fn(*call)`` for every call, ``workers`` at once, each in a fresh spawned interpreter (no forked torch
    state); ``on_result(k, value)`` in this process as call k finishes. A SIGTERM (``kill``, SLURM's time limit),
    Ctrl-C or a failing call stops the workers too: a ``ProcessPoolExecutor`` left to itself keeps its workers
    training for an hour after the programme was killed, and a rerun then races them for the same run folders."""
    import concurrent.futures
    import multiprocessing
    import signal
    import threading

    if not calls:
        return
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_exits_on_sigterm)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main_thread else None
    futures: Dict[Any, int] = {}
    reported = set()
    try:
        futures = {pool.submit(_call_unless_stopping, fn, *call): k for k, call in enumerate(calls)}
        for future in concurrent.futures.as_completed(futures):
            reported.add(future)
            on_result(futures[future], future.result())
    except BaseException:
        # calls that finished while the failure was raised are kept (their runs need no retraining)
        finished = [f for f in futures if f not in reported and f.done() and not f.cancelled() and f.exception() is None]
        _stop_workers(pool, in_main_thread)
        for future in finished:
            on_result(futures[future], future.result())
        raise
    else:
        pool.shutdown()
    finally:
        if in_main_thread and previous is not None:  # None: a handler installed outside Python, left as it is
            signal.signal(signal.SIGTERM, previous)


_worker_state = {"stopping": False, "in_call": False}  # a pool worker's own (each spawned interpreter has one)


def _worker_exits_on_sigterm() -> None:
    """A worker's SIGTERM handler. In a call whose own handler calls this one (Lightning's composes the handler
    it found: it checkpoints and ends the run through ``SIGTERMException``), the worker is only marked as
    stopping, and ``_call_unless_stopping`` then refuses the call the executor had already queued to it:
    without that, the worker started the next run for the ten seconds before ``_stop_workers`` killed it,
    leaving a partial run folder. Idle, or in a call that left SIGTERM to this handler, it exits at once."""
    import signal

    def on_sigterm(signum, frame):
        _worker_state["stopping"] = True
        if not _worker_state["in_call"] or signal.getsignal(signal.SIGTERM) is on_sigterm:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def _call_unless_stopping(fn: Callable[..., Any], *args: Any) -> Any:
    import signal

    if _worker_state["stopping"]:
        os._exit(128 + signal.SIGTERM)  # the programme is being stopped: no new call starts
    _worker_state["in_call"] = True
    try:
        return fn(*args)
    finally:
        _worker_state["in_call"] = False


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_in_workers, which stops the workers


def _stop_workers(pool, in_main_thread: bool) -> None:
    """Terminate a process pool's workers (the executor has no public call for it before Python 3.14); a second
    SIGTERM or Ctrl-C meanwhile does not cut it short (the workers that linger are killed)."""
    import signal

    ignored = [(s, signal.signal(s, signal.SIG_IGN)) for s in (signal.SIGTERM, signal.SIGINT)] if in_main_thread else []
    try:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    finally:
        for signum, handler in ignored:
            if handler is not None:
                signal.signal(signum, handler)


STARTED_MARK = "repro_started"  # in a run folder: the name of the runs.started/ record that owns it


def _train_in_worker(argv: Sequence[str], threads: int, started: Optional[pathlib.Path]) -> str:
    """One ``experiments.run`` in a worker process of ``Context.run_many`` (``train_resumably``); its run folder."""
    import torch

    torch.set_num_threads(threads)
    return str(train_resumably(argv, started))


def train_resumably(argv: Sequence[str], started: Optional[pathlib.Path]) -> pathlib.Path:
    """``experiments.run`` of ``argv`` so that a programme killed mid-run (a session's end, SLURM's time limit)
    loses at most what its run did since its last checkpoint: the run's folder goes into ``started`` (and a
    ``STARTED_MARK`` naming it into the folder) before it trains, and the same command later resumes that
    folder's newest checkpoint (``last.ckpt``, written at each validation and by a SIGTERM/SIGUSR1 stop)
    instead of training from step 0. A folder with no checkpoint starts again (what a killed start leaves in it
    is removed: ``release_unstarted``); one that finished but never reached ``runs.json`` (killed in between)
    is returned as it is; a checkpoint the run refuses as trained with other settings (the code or data changed
    since) is left where it is and the run starts again in a new folder. Explicit ``--version`` /
    ``--ckpt_path`` options are the user's: the run then goes as they say; so does ``started`` None
    (``--no_reuse``)."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    from experiments import run as run_cli

    argv = list(argv)
    if started is None or any(a.split("=", 1)[0] in ("--version", "--ckpt_path") for a in argv):
        return run_cli.main(argv)
    folder = started_folder(started, argv)
    if folder is not None and (folder / "summary.json").is_file():
        return folder
    if (_get_rank() or 0) != 0:  # a DDP rank: follow the record (Lightning's launcher starts this rank after
        # rank 0 has written it), never remove or write anything
        checkpoint = newest_checkpoint(folder)
        return run_cli.main([*argv, "--ckpt_path", str(checkpoint)] if checkpoint is not None else argv)
    with started_lock(started):
        return _train_or_resume(argv, started, started_folder(started, argv))


def newest_checkpoint(folder: Optional[pathlib.Path]) -> Optional[pathlib.Path]:
    """The run folder's newest ``checkpoints/*.ckpt``: ``last.ckpt``, or a ``best-*`` that a kill left newer (it is
    saved just before ``last.ckpt``); None when there is none, or no folder. (Lightning's SLURM ``hpc_ckpt_*`` are
    the requeued job's own to resume.)"""
    found = list(folder.glob("checkpoints/*.ckpt")) if folder is not None else []
    return max(found, key=lambda p: (p.stat().st_mtime, p.name == "last.ckpt")) if found else None


@contextlib.contextmanager
def started_lock(started: pathlib.Path):
    """Hold ``started``'s lock while its run trains: a second programme running the same command at the same
    time (a session's leftover, a second shell) is refused instead of resuming, or removing, the folder the
    first one is writing. The lock goes with the process that holds it, however that process ends. On a file
    system without locks (Lustre without ``flock``, some FUSE mounts) the run goes on unlocked, with a note."""
    import errno
    import fcntl

    started.parent.mkdir(parents=True, exist_ok=True)
    with open(started.with_suffix(".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another programme is training this run now ({started.with_suffix('.lock')} is "
                              "locked); wait for it to end, or stop it, and run the command again") from None
        except OSError as err:
            if err.errno not in (errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOLCK):
                raise
            print(f"[repro] note: {started.parent} cannot be locked ({err.strerror}); nothing stops a second "
                  "programme from running this command at the same time", file=sys.stderr, flush=True)
        yield


def _train_or_resume(argv: List[str], started: pathlib.Path, folder: Optional[pathlib.Path]) -> pathlib.Path:
    """``train_resumably`` on rank 0, holding the run's lock."""
    from experiments import run as run_cli
    from lightning_modules.storage import release_unstarted

    if folder is not None and (folder / "summary.json").is_file():  # again, under the lock
        return folder
    checkpoint = newest_checkpoint(folder)
    if checkpoint is not None:
        print(f"[repro] resuming {folder} from {checkpoint.name} (the programme was stopped during this run)",
              file=sys.stderr, flush=True)
        try:
            return run_cli.main([*argv, "--ckpt_path", str(checkpoint)])
        except run_cli.CheckpointMismatch as err:
            print(f"[repro] cannot resume {folder} ({err}); training the run again in a new folder",
                  file=sys.stderr, flush=True)
    elif folder is not None:  # cut off before its first checkpoint: nothing to resume, and it is this command's
        release_unstarted(folder)  # what a start writes; anything else (a non-finite dump) keeps the folder
    try:
        return run_cli.main(argv, on_run_folder=lambda run_folder: record_started(started, argv, run_folder))
    except BaseException:
        if started_folder(started, argv) is None:  # failed before its first step: the run released its folder
            started.unlink(missing_ok=True)
        raise


def record_started(started: pathlib.Path, argv: Sequence[str], folder: pathlib.Path) -> None:
    """``train_resumably``'s record of a run's folder, and the mark in the folder that makes it this command's
    (a folder released by a failed start can be claimed again by another command)."""
    from lightning_modules.storage import write_text_atomic

    started.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / STARTED_MARK, started.name + "\n")
    write_text_atomic(started, json.dumps({"argv": list(argv), "run_dir": str(folder)}) + "\n")


def started_folder(started: pathlib.Path, argv: Sequence[str]) -> Optional[pathlib.Path]:
    """The run folder ``train_resumably`` recorded for ``argv``; None when there is none, the record is
    unreadable or another argv's, or the folder is gone or no longer carries this record's mark."""
    try:
        record = json.loads(started.read_text())
        folder = pathlib.Path(record["run_dir"])
        mark = (folder / STARTED_MARK).read_text().strip()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder if record.get("argv") == list(argv) and mark == started.name else None


def budget_step_cap(budget: float, tokens_per_step: int, planned_flops_per_token: float) -> int:
    """``--max_steps`` of a run that trains until it has spent ``budget`` measured training FLOPs."""
    return max(1, math.ceil(BUDGET_STEP_CAP * budget / (tokens_per_step * planned_flops_per_token)))


def budget_spent(summary: Dict[str, Any]) -> Dict[str, Any]:
    """A budget run's measured training FLOPs (every rank and micro-batch), relative to its budget, and whether
    the budget ended it (``matched``; False: ``--max_steps`` stopped it first, the row is not at matched FLOPs)."""
    budget, spent = summary.get("max_train_flops"), summary.get("train_flops")
    return {"train_flops": spent, "budget": budget,
            "spent_deviation": spent / budget - 1.0 if budget and spent is not None else None,
            "matched": summary.get("stopped_by") == "max_train_flops"}


def load_summary(run_dir: pathlib.Path) -> Dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["run_dir"] = str(run_dir)
    return summary


def parse_list(text: str, cast=float, option: str = "list") -> List[Any]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = [cast(t) for t in items]
    except ValueError as err:
        raise ConfigError(f"--{option}: cannot read {text!r} as a comma-separated list ({err})") from err
    if not values:
        raise ConfigError(f"--{option}: the list is empty")
    return values


# ---------------------------------------------------------------------------- entries: a variant and its options
@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the programme: a variant and its own model options; ``label`` names it in every table."""

    label: str
    variant: str
    model: Tuple[Tuple[str, str], ...] = ()  # (ModelConfig option path, value): ("n_layer", "8"), ("mod.capacity", ...)
    dense: bool = False

    def run_options(self) -> List[str]:
        return ["--variant", self.variant, *[x for key, value in self.model for x in (f"--model.{key}", value)]]


def option_path(variant: str, key: str) -> str:
    """``key`` as a ModelConfig option path: a field (``n_layer``), ``group.field``, or a field that only one
    of the variant's option groups has (``capacity`` of MoD: ``mod.capacity``)."""
    from architectures.config import SHARED_FIELDS
    from architectures.registry import get_variant

    groups = get_variant(variant).model_class().config_groups or {}
    top = set(SHARED_FIELDS) - {"variant", "preset"}
    if key in top:
        return key
    group, _, field = key.rpartition(".")
    owners = [g for g, cls in groups.items() if (not group or g == group)
              and field in {f.name for f in dataclasses.fields(cls)}]
    if len(owners) == 1:
        return f"{owners[0]}.{field}"
    known = sorted(top) + sorted(f"{g}.{f.name}" for g, cls in groups.items() for f in dataclasses.fields(cls))
    raise ConfigError(f"--variants: {variant}:{key}=... {'is ambiguous' if owners else 'is no option of ' + variant}; "
                      f"options: {', '.join(known)}")


def parse_entry(text: str) -> Entry:
    """``NAME``, ``NAME:key=value[:key=value...]`` or ``dense:LxD`` (see the module docstring)."""
    from architectures import variant_names

    if text.startswith("dense:"):
        n_layer, d_model = parse_shape(text[len("dense:"):])
        return Entry(text, "vanilla", (("n_layer", str(n_layer)), ("d_model", str(d_model))), dense=True)
    name, *pairs = text.split(":")
    if name not in variant_names():
        raise ConfigError(f"--variants: unknown {name!r}; valid variants: {', '.join(variant_names())}")
    model = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--variants: {text!r}: {pair!r} is not key=value (e.g. mod:n_layer=8:capacity=0.125)")
        model.append((option_path(name, key), value))
    return Entry(text, name, tuple(model), dense=name == "vanilla")


def run_model_config(ctx: Context, options: Sequence[str], vocab_size: int):
    """The resolved model config of the run with these options, as its run parses them (the variant's preset,
    then the common, pass-through and own options), with the tokenizer's vocabulary."""
    from experiments.run import model_config

    return model_config(ctx.parse(ctx.argv(options)), vocab_size=vocab_size).resolve()


def entry_cost(ctx: Context, entry: Entry, vocab_size: int) -> float:
    """Training FLOPs per token of the entry's model, resolved from its command line as its run will be
    (built on the meta device: nothing allocated)."""
    import torch

    from architectures import build_model

    config = run_model_config(ctx, entry.run_options(), vocab_size)
    with torch.device("meta"):
        model = build_model(config)
    return model.flops_per_token(None, config.block_size).training


def parse_shape(text: str) -> Tuple[int, int]:
    layers, sep, width = text.partition("x")
    if not (sep and layers.isdigit() and width.isdigit() and int(layers) > 0 and int(width) > 0):
        raise ConfigError(f"--dense_shapes: {text!r} is not n_layer x d_model such as 4x48")
    return int(layers), int(width)


def dense_shape(label: str, reference: Tuple[int, int]) -> Tuple[int, int]:
    """(n_layer, d_model) of a dense entry: ``dense:LxD``'s, or the reference's with the entry's own ``n_layer`` /
    ``d_model`` (``vanilla``, ``vanilla:n_layer=2``)."""
    if label.startswith("dense:"):
        return parse_shape(label[len("dense:"):])
    shape = dict(zip(("n_layer", "d_model"), reference))
    for key, value in parse_entry(label).model:
        if key in shape:
            shape[key] = int(value)
    return shape["n_layer"], shape["d_model"]


def dense_grid(means: Dict[str, Optional[float]], reference: Tuple[int, int], best: str) -> str:
    """``grid_bracket`` over dense entries by label (``means``: label -> mean loss), each label's shape read by
    ``dense_shape`` against the reference vanilla's (``probe`` and ``head_to_head`` label their dense models so),
    the depth axis always: their "Dense grid" line says "bracketed" with no definition beside it."""
    return grid_bracket({label: dense_shape(label, reference) for label in means}, means, best, depths_required=True)


def narrower_width(d_model: int, n_head: int) -> int:
    """3/4 of the width, a positive multiple of ``n_head``: the narrower dense control."""
    return max(n_head, round(0.75 * d_model / n_head) * n_head)


def parse_shapes(text: str, n_head: int) -> List[Tuple[int, int]]:
    """``--dense_shapes LxD,...`` as (n_layer, d_model) pairs; widths must be multiples of ``n_head``."""
    shapes = [parse_shape(s) for s in parse_list(text, str, "dense_shapes")]
    bad = [f"{n}x{d}" for n, d in shapes if d % n_head]
    if bad:
        raise ConfigError(f"--dense_shapes: widths of {', '.join(bad)} are not multiples of n_head={n_head}")
    return shapes


def dense_entries(shapes: Sequence[Tuple[int, int]], reference: Tuple[int, int]) -> List[str]:
    """The entries ``dense:LxD`` of the shapes, the reference shape left out (the reference vanilla is that model)."""
    return [f"dense:{n}x{d}" for n, d in shapes if (n, d) != tuple(reference)]


# ---------------------------------------------------------------------------- trained checkpoints
def checkpoint_of(run_dir: pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(run_dir) / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the run wrote no last.ckpt")
    return path


def load_model(run_dir: pathlib.Path):
    """The trained model of a run (its final ``last.ckpt``), in eval mode on CPU."""
    from analysis.contribution import load_model as load

    return load(checkpoint_of(run_dir), "cpu")


def validation_sequences(run_dir: pathlib.Path, model, count: int) -> torch.Tensor:
    """(N, T+1): the first ``count`` blocks of the run's validation set, rebuilt from its config.yaml."""
    from analysis.contribution import probe_sequences

    return probe_sequences(pathlib.Path(run_dir), model.config.block_size, model.config.vocab_size, count)


@torch.no_grad()
def mean_loss(model, sequences: torch.Tensor, batch_size: int = 8) -> float:
    """Token-weighted next-token cross-entropy (nats) of ``model`` over (N, T+1) token ids."""
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, sequences.shape[0], batch_size):
        batch = sequences[start : start + batch_size]
        logits = model(batch[:, :-1]).logits
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                       reduction="sum"))
        tokens += batch[:, 1:].numel()
    return total / max(1, tokens)


def run_tokenizer(run_dir: pathlib.Path):
    """The tokenizer a run trained with (from its config.yaml)."""
    from datamodules.lm import DataConfig, LMDataModule
    from analysis.contribution import run_config

    config = run_config(pathlib.Path(run_dir))
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in (config.get("data") or {}).items() if k in fields})
    return LMDataModule(data, block_size=int(config["model"]["block_size"]), seed=0).tokenizer


def read_documents(path: pathlib.Path) -> List[str]:
    """Text of a .txt (one document) or .jsonl file (its ``text`` field per line)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--ood: no file {path}")
    if path.suffix == ".jsonl":
        docs = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                text = json.loads(line).get("text")
                if isinstance(text, str) and text.strip():
                    docs.append(text)
        if not docs:
            raise ConfigError(f"--ood: {path} has no rows with a 'text' field")
        return docs
    return [path.read_text(encoding="utf-8")]


def text_blocks(tokenizer, documents: Sequence[str], block_size: int, max_tokens: int) -> torch.Tensor:
    """Documents joined with EOT and cut into non-overlapping (N, block_size + 1) blocks."""
    ids: List[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eot_id)
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    n = (len(ids) - 1) // block_size
    if n < 1:
        raise ConfigError(f"--ood: only {len(ids)} tokens, fewer than one block of {block_size + 1}")
    return torch.stack([torch.tensor(ids[i * block_size : i * block_size + block_size + 1]) for i in range(n)])


# ---------------------------------------------------------------------------- published tables and --verify
# Pass-through options that change where a run reads or writes files, or what it prints, not what it computes.
_NOT_RESULT_OPTIONS = ("--data.cache_dir", "--data.num_workers", "--log_dir", "--trainer.enable_progress_bar")


def result_options(options: Sequence[str]) -> List[str]:
    """The pass-through options that can change a result (``--data.cache_dir X`` and the like left out)."""
    out: List[str] = []
    skip = False
    for item in options:
        if skip:
            skip = False
            continue
        head = item.split("=", 1)[0]
        if head in _NOT_RESULT_OPTIONS:
            skip = "=" not in item
            continue
        out.append(item)
    return out


def comparable_settings(settings: Dict[str, Any]) -> Dict[str, Any]:
    """A programme's stored ``settings`` with its ``run_options`` reduced to those that change results, so a table
    stored before an option was known to be harmless still matches one stored after."""
    if isinstance(settings, dict) and isinstance(settings.get("run_options"), list):
        return {**settings, "run_options": result_options(settings["run_options"])}
    return settings


def record_stored_runs(ctx: Context, runs: Sequence[Dict[str, Any]], entry_of: Callable[[Dict[str, Any]], str]
                       ) -> List[str]:
    """Put the run folders of stored rows (``merge_run_rows``'s) into the rebuilt report's run table
    (``Context.run_table``), when every one is here (``analysis.stored_runs.stored_run_folder``). A table of some of
    the rows would read as the whole, so without all of them there is none, and the returned line says which is
    missing."""
    from analysis.stored_runs import stored_run_folder

    folders, missing = [], []
    for row in runs:
        folder = stored_run_folder(row)
        if folder is None:
            missing.append(f"{entry_of(row)} seed {row.get('seed')} ({row.get('run_dir') or 'no run_dir'})")
        folders.append(folder)
    if missing:
        return [f"No run table: {len(missing)} of the {len(runs)} rows' run folders are not here (first "
                f"{missing[0]}); `python -m experiments.repro.publish` keeps each row's record beside its report.", ""]
    for folder in folders:
        ctx.record_run(folder)
    return []


def check_settings(published: Dict[str, Any], mine: Dict[str, Any], path: pathlib.Path) -> None:
    """Refuse a verification whose settings differ from those of the published table (naming the first)."""
    published, mine = comparable_settings(published), comparable_settings(mine)
    for key in sorted(set(published) | set(mine)):
        if published.get(key) != mine.get(key):
            raise ConfigError(f"--verify: this command's {key} is {mine.get(key)!r}, the published table's ({path}) is "
                              f"{published.get(key)!r}; rerun with the published settings")


def check_kernels(published: Dict[str, Any], path: pathlib.Path) -> None:
    """Refuse a verification on another CPU kernel path than the published runs' (capability and the kernel
    variables: docs/results.md, Reproducibility): on another path the figures move like a seed's do."""
    from analysis.provenance import kernels

    theirs = (published.get("provenance") or {}).get("kernels")
    if not theirs:
        return  # a table from before runs recorded their kernels: nothing to compare
    mine = kernels()
    for key in ("cpu_capability", "environment"):
        if theirs.get(key) != mine.get(key):
            wanted = " ".join(f"{k}={v}" for k, v in sorted((theirs.get("environment") or {}).items()) if v)
            raise ConfigError(f"--verify: this process's kernel {key} is {mine.get(key)!r}, the published runs' ({path}) "
                              f"{theirs.get(key)!r}; export {wanted or 'the same kernel variables'} and rerun")


def require_fresh(out: pathlib.Path) -> None:
    """--verify retrains from nothing: its output folder must not hold anything yet."""
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} is not empty; --verify retrains from nothing into a fresh folder: give a new --out")


