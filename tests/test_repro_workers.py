"""The programmes' worker processes (``--jobs N``) live and die with the programme: results come back to the
call that asked for them, and a failing run, Ctrl-C or a SIGTERM (``kill``, SLURM's time limit) stops the other
workers instead of leaving them training into the run folders a rerun will use."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments.repro.common import run_in_workers
from tests.conftest import REPO

SLEEP_AND_SAY = "(open({path!r}, 'a').write(str(__import__('os').getpid()) + chr(10)), __import__('time').sleep(600))"


def alive(pid: int) -> bool:
    """The process runs (a zombie waiting for its parent to reap it has stopped)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def wait_for_lines(path: pathlib.Path, n: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.is_file() else []
        if len(lines) >= n:
            return [int(line) for line in lines]
        time.sleep(0.1)
    raise AssertionError(f"{n} workers did not start within {timeout} s")


def sigterm_the_programme_once_its_workers_started(calls: list, workers: int, started: pathlib.Path) -> None:
    """``run_in_workers(eval, calls, workers)`` in a programme of its own, SIGTERM'd once ``workers`` calls have
    written their pid to ``started``: the programme exits with SIGTERM's status and no worker outlives it by more
    than 10 s (any that do are killed after the check)."""
    script = textwrap.dedent(f"""
        from experiments.repro.common import run_in_workers
        run_in_workers(eval, {calls!r}, {workers}, lambda k, value: None)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    programme = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env)
    try:
        pids = wait_for_lines(started, workers)
        programme.send_signal(signal.SIGTERM)
        assert programme.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, pids)), "a worker kept running after the programme got SIGTERM"
    finally:
        programme.kill()
        for pid in wait_for_lines(started, 0):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_each_result_comes_back_to_its_call():
    results = {}
    run_in_workers(pow, [(2, 3), (3, 2), (5, 1)], 2, results.__setitem__)
    assert results == {0: 8, 1: 9, 2: 5}


def test_calls_that_finished_when_another_failed_still_report_their_results(tmp_path):
    """A run that finished while another's failure was being raised is recorded (a rerun does not retrain it).
    The failing call waits for the other to finish (its file), not for a fixed time: spawned workers start seconds
    apart on a loaded machine."""
    results = {}
    done, deadline = str(tmp_path / "done"), time.time() + 120
    wait = (f"list(iter(lambda: __import__('os').path.exists({done!r}) or __import__('time').time() > {deadline}"
            " or __import__('time').sleep(0.05), True))")
    calls = [("7",), (f"({wait}, __import__('time').sleep(1.0), 1 / 0)",), (f"(open({done!r}, 'w').close(), 8)[1]",)]
    with pytest.raises(ZeroDivisionError):
        run_in_workers(eval, calls, 3, results.__setitem__)
    assert results == {0: 7, 2: 8}


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").is_file(), reason="reads process states from /proc (Linux)")
def test_a_failing_call_stops_the_other_workers(tmp_path):
    started = tmp_path / "pids"
    # the failing call waits until the other worker has said its pid (a loaded machine starts workers slowly)
    fail_once_started = (f"[__import__('time').sleep(0.05) for _ in range(1200) if not __import__('os').path.exists("
                         f"{str(started)!r})] and 1 / 0 or 1 / 0")
    calls = [(SLEEP_AND_SAY.format(path=str(started)),), (fail_once_started,)]
    begin = time.monotonic()
    with pytest.raises(ZeroDivisionError):
        run_in_workers(eval, calls, 2, lambda k, value: None)
    assert time.monotonic() - begin < 60  # not the sleeping call's 600 s
    (pid,) = wait_for_lines(started, 1, timeout=30)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the sleeping worker outlived the failed programme"


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").is_file(), reason="reads process states from /proc (Linux)")
def test_sigterm_to_the_programme_stops_its_workers(tmp_path):
    started = tmp_path / "pids"
    call = SLEEP_AND_SAY.format(path=str(started))
    sigterm_the_programme_once_its_workers_started([(call,), (call,)], 2, started)


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").is_file(), reason="reads process states from /proc (Linux)")
def test_a_worker_whose_run_ends_gracefully_on_sigterm_starts_no_queued_call(tmp_path):
    """Lightning's SIGTERM handler lets the run end at the next step, and the executor had already queued the
    next call to that worker: it must not start (it left a partial run folder for the kill ten seconds later)."""
    started, second = tmp_path / "pids", tmp_path / "second"
    run_like_lightning = textwrap.dedent(f"""
        import os, signal, time
        got, previous = [], signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda s, f: (got.append(s), previous(s, f) if callable(previous) else None))
        open({str(started)!r}, "a").write(str(os.getpid()) + chr(10))
        while not got:
            time.sleep(0.05)
        time.sleep(0.5)  # the last step, the checkpoint
        signal.signal(signal.SIGTERM, previous)
    """)
    calls = [(f"exec({run_like_lightning!r}, {{}})",), (f"open({str(second)!r}, 'w').write('started')",)]
    sigterm_the_programme_once_its_workers_started(calls, 1, started)
    assert not second.exists(), "the worker started the queued call after SIGTERM"
