"""Shared test fixtures: a per-repo token cache, the optional ../shared data, tiny model overrides."""
from __future__ import annotations

import os
import pathlib

import pytest


def crash_at_step(step: int):
    """A Lightning callback that raises at the end of optimiser step ``step``: the run dies as under SIGKILL, with no
    checkpoint but the one its last validation wrote (``experiments.run.extra_run_callbacks`` takes it)."""
    import lightning as L

    class CrashAtStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == step:
                raise RuntimeError("killed")

    return CrashAtStep()


def recorder_state(checkpoint: dict) -> dict:
    """The ``StepRecorder`` callback's state in a loaded Lightning checkpoint."""
    return next(state for key, state in checkpoint["callbacks"].items() if key.startswith("StepRecorder"))


def file_states(folder: pathlib.Path) -> dict:
    """Every file under ``folder``: its bytes and modification time, to show that a command changed none of them."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


class DiskFillsAfter:
    """A binary handle on a disk that fills after ``room`` bytes: then every write raises ENOSPC, as write(2) does."""

    def __init__(self, handle, room: int = 0):
        self.handle, self.room = handle, room

    def write(self, data):
        import errno

        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# One cache for the whole session: the embedded corpus's BPE is trained and tokenised once.
os.environ.setdefault("DYNCOMP_CACHE", str(REPO / ".cache" / "dyncomp"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``-n auto``), each worker gets its share of the cores for torch's threads and for
    the processes tests start: two workers with two threads each on a 2-core machine would spin-wait on
    each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores_between_workers()

# Options that make any CLI run tiny and fast on CPU.
TINY_RUN = [
    "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2", "--model.block_size", "64",
    "--data.batch_size", "4", "--val_blocks", "8", "--trainer.enable_progress_bar", "false",
]

# Presets that need more layers than a 1- or 2-layer test model has: MoM-E / MoM-I pick K=3 of a pool of
# n_layer - 1 modules + SKIP; MoR's middle-cycle default (N_r = 2) needs a first, a last and 2 shared positions.
# Cross-variant loops build every variant, with at least these layers.
MIN_LAYERS = {"mom_e": 3, "mom_i": 3, "mor": 4, "mor_token": 4}


def tiny_layers(variant: str, n_layer: int) -> int:
    return max(n_layer, MIN_LAYERS.get(variant, 1))


def cli_summary(variant: str, tmp_path: pathlib.Path, *extra: str, steps: int = 3) -> dict:
    """Train ``variant`` for ``steps`` steps through the CLI (in this process) and return its summary, after
    the checks every short run must pass: the variant and step count recorded, both final losses finite."""
    import json
    import math

    from experiments import run

    folder = run.main(["--variant", variant, "--max_steps", str(steps), "--val_every", str(steps),
                       "--log_dir", str(tmp_path), *TINY_RUN, *extra])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["variant"] == variant and summary["steps"] == steps
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_val_loss"])
    return summary


def run_in_two_ddp_processes(options) -> pathlib.Path:
    """``experiments.run OPTIONS`` as a 2-process CPU DDP job in a subprocess; its run folder (the last stdout line)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *options, "--trainer.devices", "2",
                           "--trainer.strategy", "ddp"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pathlib.Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def offline(monkeypatch):
    """As on a machine without the Hugging Face Hub: every hub access must fail fast or use local files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def one_thread():
    # tiny models: thread hand-offs cost more than the math, and on a shared 2-core machine much more
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (only on the project's development machines)")
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the slow tests go first: a 100-second test started last would run alone while the
    other workers sit idle. A serial run keeps the files' order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files' order otherwise


def bounce_segments(task: str, slots: int, episodes: int):
    """(level, operands, result) of every segment of the first ``episodes`` episodes of a bounce probe
    (``slots`` operand slots per segment), read by position, not by the solver."""
    from datamodules import probe

    segment_len = slots + 4  # slots, '=', two result digits, ';'
    for index in range(episodes):
        family, (data, levels) = probe.episode(task, index)
        text = data.decode("ascii")
        assert family == "bounce" and len(text) == len(levels) == probe.EPISODE_LEN - 1
        for start in range(0, (len(text) // segment_len) * segment_len, segment_len):
            segment = text[start : start + segment_len]
            assert segment[slots] == "=" and segment[-1] == ";"
            operands = [int(c) for c in segment[:slots] if c != probe.BLANK]
            yield levels[start + slots + 2], operands, int(segment[slots + 1 : slots + 3])


def probe_texts(task: str, count: int):
    """(text, levels) of a probe task's first ``count`` episodes."""
    from datamodules import probe

    for index in range(count):
        _, (data, levels) = probe.episode(task, index)
        yield data.decode("ascii"), levels


def brief_probe_run(task: str, tmp_path, *extra: str) -> dict:
    """A 3-step run of the CLI on a probe task with its default level options: the run's ``probe.json``."""
    import json

    from datamodules import probe
    from experiments.run import main

    run_dir = main(["--data", task, "--data.max_tokens", str(64 * probe.EPISODE_LEN), "--data.cache_dir",
                    str(tmp_path / "c"), "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path),
                    *TINY_RUN, "--model.block_size", "128", "--callbacks.probe_blocks", "16", *extra])
    return json.loads((run_dir / "probe.json").read_text())


def solved_level_counts(task: str, episodes: int):
    """Every label of the first ``episodes`` episodes of a probe task re-derived from the bytes alone by its
    brute-force solver (asserted equal to the generator's); the count of labels per level."""
    from collections import Counter

    from datamodules import probe

    seen = Counter()
    for index in range(episodes):
        family, (data, levels) = probe.episode(task, index)
        solved = probe.solve_episode(family, data, probe.version(task))
        assert {i: (data[i], level) for i, level in enumerate(levels) if level != probe.NO_LABEL} == solved
        seen.update(level for _, level in solved.values())
    return seen


def assert_rows_name_their_origin(rows, report: str) -> None:
    """A programme's run rows carry the code and the CPU each run trained at (bit-identical reruns need both),
    and its report names them: the invariant every matched-compute programme keeps."""
    from collections import Counter

    from analysis import provenance

    cpu = provenance.cpu_model()
    assert cpu and all(r["cpu"] == cpu for r in rows)
    commit = provenance.code_state()["commit"]
    assert all(r["code"] != "unknown" and r["code"].startswith(commit[:10]) for r in rows) if commit else True
    for code, n in Counter(r["code"] for r in rows).items():
        assert f"`{code}` ({n} run{'s' * (n != 1)})" in report
    assert f"CPUs the runs trained on: `{cpu}` ({len(rows)} runs)." in report and "different CPUs" not in report
