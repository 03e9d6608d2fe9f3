"""The clock of one training run (``experiments.run.main``), for ``seconds_to_first_step`` and ``run_seconds``.

A run's time starts when its process starts if it is the first run of that process (the interpreter and the
imports are part of what a run costs), and at its own ``main`` call otherwise: programmes that train several
runs in one process (``--jobs 1``) or in reused worker processes (``--jobs N``) would else charge each run
with every earlier run's time. Standard library only: ``experiments.run`` imports it before Lightning.
"""
from __future__ import annotations

import os
import time
from typing import Optional

_started: Optional[float] = None  # perf_counter at this run's main()
_offset = 0.0  # the process's age then, for its first run; 0 for later runs
_runs_in_process = 0


def process_age_s() -> Optional[float]:
    """Seconds since this process started (interpreter start-up and every import included), from ``/proc``
    (10 ms resolution); None where there is no ``/proc`` (not Linux)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mark_run_start() -> None:
    """Start this run's clock (``experiments.run.main`` calls it first)."""
    global _started, _offset, _runs_in_process
    _offset = (process_age_s() or 0.0) if _runs_in_process == 0 else 0.0
    _started = time.perf_counter()
    _runs_in_process += 1


def run_age_s() -> Optional[float]:
    """Seconds since this run started (see the module docstring); the process's age when no run was marked."""
    if _started is None:
        return process_age_s()
    return _offset + time.perf_counter() - _started
