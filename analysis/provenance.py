"""What a run was computed with: the code commit (and whether the tree had uncommitted changes), the library
versions, the interpreter and the thread count. ``experiments.run`` records it in every run folder
(``provenance.json``: one record per process that trained the run, so a resume by other code shows;
``summary.json``'s ``provenance``: the record of the process that finished it, with every commit the
run trained at); ``experiments.compare`` warns when a table mixes commits.

The tree is dirty when a tracked file differs from the commit (untracked files, e.g. run outputs, do not
count); ``diff_sha256`` tells two dirty trees at one commit apart. Outside a git checkout, or without git,
``commit`` is None.
"""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import platform
import subprocess
import sys
from collections import Counter
from importlib import metadata
from typing import Any, Dict, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
# Environment variables that choose the CPU kernels' code path (and so the rounding of every matmul and
# reduction): runs that differ here differ like seeds after a few hundred steps (docs/results.md).
KERNEL_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
LIBRARIES = ("torch", "lightning", "numpy", "scipy", "jsonargparse", "tokenizers", "datasets", "matplotlib")
FILE = "provenance.json"


def _git(*args: str) -> Optional[bytes]:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


@functools.lru_cache(maxsize=None)
def _code_state() -> Dict[str, Any]:
    # read once per process, at its first record (after the suite's modules are imported): a checkout that
    # moves on while a long-lived worker trains must not relabel the code that worker loaded
    return _read_code_state()


def code_state() -> Dict[str, Any]:
    """{"commit", "dirty", "diff_sha256"} of the code this process runs (None values outside a checkout), as
    the checkout was when this process first asked."""
    return dict(_code_state())


def _read_code_state() -> Dict[str, Any]:
    head = _git("rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "dirty": None, "diff_sha256": None}
    diff = _git("diff", "HEAD", "--no-ext-diff", "--binary") or b""
    return {"commit": head.decode().strip(), "dirty": bool(diff.strip()),
            "diff_sha256": hashlib.sha256(diff).hexdigest() if diff.strip() else None}


def library_versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


CPUINFO = pathlib.Path("/proc/cpuinfo")


def cpuinfo() -> Dict[str, str]:
    """/proc/cpuinfo's fields, each key's first value (the first processor's), from one read (Linux; {} elsewhere):
    on a many-core host the kernel builds this file anew, per CPU, at every read."""
    fields: Dict[str, str] = {}
    try:
        for line in CPUINFO.read_text().splitlines():
            key, colon, value = line.partition(":")
            if colon:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> Optional[str]:
    return cpuinfo().get("model name") or platform.processor() or None


def cpu_id() -> Optional[str]:
    """Vendor, family/model/stepping: tells CPUs apart that a hypervisor names alike ("Intel(R) Xeon(R) Processor"),
    which matters because bit-identical runs need the same CPU model, not only the same kernel path."""
    info = cpuinfo()
    fields = [info.get(name) for name in ("vendor_id", "cpu family", "model", "stepping")]
    return None if None in fields else f"{fields[0]} {fields[1]}/{fields[2]}/{fields[3]}"


def kernels() -> Dict[str, Any]:
    """The CPU and the kernel code path torch runs on it: bit-identical runs need the same record here
    (and the same thread count), whatever the code and seed."""
    import os

    import torch

    return {"cpu": cpu_model(), "cpu_id": cpu_id(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(),
            "environment": {name: os.environ.get(name) for name in KERNEL_VARIABLES}}


def kernel_label(summary: Dict[str, Any]) -> str:
    """A run's kernels as a table names them: CPU capability plus the variables set (``unknown`` for older runs)."""
    record = (summary.get("provenance") or {}).get("kernels")
    if not record:
        return "unknown"
    env = ",".join(f"{k}={v}" for k, v in sorted(record.get("environment", {}).items()) if v and k != "OMP_NUM_THREADS")
    return f"{record.get('cpu_capability')}" + (f" ({env})" if env else "")


def cpu_label(summary: Dict[str, Any]) -> Optional[str]:
    """The CPU model a run trained on, several joined with '>' (a run resumed on another machine); None for runs
    that recorded no kernels. The same AVX2 pin gives other bits on another vendor's CPU (docs/results.md,
    'Reproducibility'), so tables name it beside the code. Reads a ``summary.json`` or a results file (the same
    ``provenance`` record)."""
    record = summary.get("provenance") or {}
    cpus = [c for c in record.get("cpus") or [(record.get("kernels") or {}).get("cpu")] if c]
    return ">".join(cpus) if cpus else None


def provenance() -> Dict[str, Any]:
    """This process's record: code state, library versions, Python, platform, torch threads and device."""
    import torch

    return {**code_state(), "python": platform.python_version(), "libraries": library_versions(),
            "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "kernels": kernels(), "argv": list(sys.argv)}


def record_start(run_dir: pathlib.Path) -> Dict[str, Any]:
    """Append this process's record to ``<run_dir>/provenance.json`` (a list: the first run, each resume)."""
    path = pathlib.Path(run_dir) / FILE
    records = read_records(run_dir)
    record = provenance()
    path.write_text(json.dumps(records + [record], indent=1) + "\n")
    return record


def read_records(run_dir: pathlib.Path) -> List[Dict[str, Any]]:
    path = pathlib.Path(run_dir) / FILE
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return records if isinstance(records, list) else []


def summary_provenance(run_dir: pathlib.Path) -> Dict[str, Any]:
    """``summary.json``'s ``provenance``: this process's record, ``commits`` (every commit the run trained at) and
    ``cpus`` (every CPU it trained on), in the order of the processes that trained it."""
    record = provenance()
    records = [*read_records(run_dir), record]
    commits = [r.get("commit") for r in records]
    cpus = [c for r in records if (c := (r.get("kernels") or {}).get("cpu"))]
    return {**record, "commits": list(dict.fromkeys(commits)), "cpus": list(dict.fromkeys(cpus))}


def code_label(summary: Dict[str, Any]) -> str:
    """A run's code as a table names it: the short commit, '+dirty:<diff hash>' when the tree had changes, 'unknown'
    for a run that recorded no provenance (older runs), several commits joined with '>' (a resumed run)."""
    record = summary.get("provenance") or {}
    commits = [c for c in record.get("commits") or [record.get("commit")] if c]
    if not commits:
        return "unknown"
    label = ">".join(c[:10] for c in commits)
    if record.get("dirty"):
        label += "+dirty" + (f":{record['diff_sha256'][:8]}" if record.get("diff_sha256") else "")
    return label


def run_origin(summary: Dict[str, Any]) -> Dict[str, Any]:
    """A run row's ``code`` (``analysis.provenance.code_label``) and ``cpu`` (``cpu_label``): what a run is
    bit-identical to a rerun under, beside the seed; ``origin_lines`` names them under a table."""
    return {"code": code_label(summary), "cpu": cpu_label(summary)}


def origin_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The code every run trained at and the CPUs they trained on, with how many runs each (none for rows stored
    before runs recorded them), and a warning when the CPUs differ: across CPUs an (entry, seed) differs like
    another seed, so the table compares its entries in distribution only."""
    lines = []
    for key, what, unknown in (("code", "Code the runs trained at", "their file's provenance names its commit"),
                               ("cpu", "CPUs the runs trained on", "unknown")):
        counts = Counter(r[key] for r in rows if r.get(key))
        if not counts:
            continue
        missing = sum(not r.get(key) for r in rows)
        lines += [f"{what}: " + ", ".join(f"`{label}` ({n} run{'s' * (n != 1)})" for label, n in counts.items())
                  + (f"; {missing} stored before runs recorded it ({unknown})" if missing else "") + ".", ""]
    cpus = sorted({cpu for r in rows if r.get("cpu") for cpu in r["cpu"].split(">")})
    if len(cpus) > 1:
        lines += [f"Warning: the runs were computed on different CPUs ({', '.join(cpus)}); a run is bit-identical "
                  "only on the same CPU and kernel path, so across them an entry's seed differs like another seed "
                  "and the entries compare in distribution only.", ""]
    return lines
