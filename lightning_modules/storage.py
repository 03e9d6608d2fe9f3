"""Writing run folders safely: claim a fresh folder atomically, find an unwritable log dir before any
work, write checkpoints atomically, and turn a full disk or a permission error into one line.

* ``claim_next_version``: ``os.mkdir`` of ``version_N`` is exclusive, so two jobs started at once into one
  ``--log_dir`` never share a folder (the loser retries with the next N).
* ``check_writable``: creates (and removes) a file in the log dir before the data are prepared.
* ``AtomicCheckpointIO``: Lightning's default writes a temp file through fsspec and "renames" it across
  filesystems (a copy, which a full disk truncates under the final name). Here the temp file is in the
  checkpoint folder itself, fsynced, then ``os.replace``d: the final name holds a whole checkpoint or the
  previous one, never a truncated file.
"""
from __future__ import annotations

import errno
import os
import pathlib
import re
import tempfile
from typing import Any, Callable, Optional

# errnos that mean "this place cannot be written": the user must free space or choose another folder
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EFBIG}

# mkstemp creates files 0600; the renamed file gets the permissions an ordinary open() would give it
_UMASK = os.umask(0o022)
os.umask(_UMASK)


class StorageError(RuntimeError):
    """A write failed because of the disk or the permissions; the message names the path and the remedy."""


def storage_message(path: Any, err: OSError, what: str = "write") -> str:
    """One line: what failed where, why, and what to do."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        remedy = "free space on that disk (or raise the quota) or choose another --log_dir"
        return f"disk full: cannot {what} {path} ({reason}); {remedy}"
    remedy = "make it writable or choose another --log_dir"
    return f"cannot {what} {path} ({reason}); {remedy}"


def is_storage_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


def probe_writable(folder: pathlib.Path) -> None:
    """Create ``folder`` and a probe file in it, then remove both (and the folders this created): the
    ``OSError`` of a place that cannot be written, found in seconds, with nothing left behind."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        fd, probe = retry_if_removed(lambda: _mkstemp_in(folder))
        os.close(fd)
        os.unlink(probe)
    finally:
        for created in missing:  # deepest first; a folder another job has written to meanwhile stays
            release_if_empty(created)


def _mkstemp_in(folder: pathlib.Path):
    folder.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=".write-probe-", dir=folder)


def retry_if_removed(make, attempts: int = 20):
    """``make()``, again if a folder it needs vanished under it: a job started at the same moment into the same
    fresh folder probes it too, and removes the (still empty) folders it created. A vanished folder shows as
    ``FileNotFoundError``, or as ``FileExistsError`` from ``mkdir(exist_ok=True)`` when it existed at the mkdir
    and was gone at the check after it."""
    for attempt in range(attempts):
        try:
            return make()
        except (FileNotFoundError, FileExistsError):
            if attempt == attempts - 1:
                raise


def check_writable(folder: pathlib.Path) -> None:
    """``probe_writable`` for the log dir: an unwritable or read-only one fails here, in seconds, instead of
    after the corpus is tokenised; a run that fails later leaves no folder."""
    try:
        probe_writable(folder)
    except OSError as err:
        if err.errno in STORAGE_ERRNOS or err.errno == errno.EEXIST:
            raise StorageError(f"log_dir: {storage_message(err.filename or folder, err, 'write to')}") from None
        raise


def claim_next_version(root: pathlib.Path, prefix: str = "version_") -> str:
    """Create ``root/<prefix>N`` for the smallest N above every existing one, exclusively: if another job
    created it first (``FileExistsError``), try the next N. Returns the folder name."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    existing = retry_if_removed(lambda: _numbers_in(root, pattern))
    number = max(existing) + 1 if existing else 0
    while True:
        try:
            (root / f"{prefix}{number}").mkdir()
            return f"{prefix}{number}"
        except FileExistsError:
            number += 1
        except FileNotFoundError:  # another job's writability probe released the fresh root: make it again
            retry_if_removed(lambda: root.mkdir(parents=True, exist_ok=True))
        except OSError as err:
            if err.errno in STORAGE_ERRNOS:
                raise StorageError(f"log_dir: {storage_message(root / f'{prefix}{number}', err, 'create')}") from None
            raise


def _numbers_in(root: pathlib.Path, pattern: "re.Pattern") -> list:
    root.mkdir(parents=True, exist_ok=True)
    return [int(m.group(1)) for p in root.iterdir() if (m := pattern.fullmatch(p.name))]


def release_if_empty(folder: pathlib.Path) -> None:
    """Remove a claimed run folder that nothing was written to (the run failed before it started)."""
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (or already gone): keep it


# what a run writes into its folder before its first optimiser step: the resolved config and provenance,
# Lightning's hparams.yaml and TensorBoard's (scalar-free) events file
# what a run's start writes (``repro_started``: experiments.repro's mark of the command that owns the folder)
START_FILES = ("config.yaml", "provenance.json", "hparams.yaml", "events.out.tfevents.*", "repro_started")


def release_unstarted(folder: pathlib.Path) -> None:
    """Remove a claimed run folder whose run failed before its first optimiser step: it holds only what the start
    wrote (``START_FILES``, an empty ``checkpoints/``), nothing a resume or an analysis could use, and left there
    it would push the next run to ``version_N+1`` and show as an empty run in TensorBoard. Anything else in the
    folder (a file the user put there) keeps it."""
    if not folder.is_dir():
        return
    for pattern in START_FILES:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
    release_if_empty(folder / "checkpoints")
    release_if_empty(folder)


def remove_killed_checkpoint_writes(folder: pathlib.Path) -> list:
    """Remove the temp files (``.NAME.ckpt.XXXX.tmp``) that a checkpoint write killed mid-way left in ``folder``;
    returns their paths. Called when a run starts, before it saves: nothing else writes into its folder."""
    removed = []
    for tmp in sorted(folder.glob(".*.ckpt.*.tmp")) if folder.is_dir() else []:
        try:
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


def fsync_folder(folder: pathlib.Path) -> None:
    """Make a rename durable (best effort: not every filesystem lets a folder be opened and synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: pathlib.Path, write: Callable[[Any], None], mode: str, what: str, hint: str = "") -> None:
    """``write(handle)`` into a temp file beside ``path``, fsync, rename, sync the folder: ``path`` is whole or
    untouched. A full disk or a permission / read-only error is a ``StorageError`` (one line, ``hint`` added)."""
    tmp: Optional[str] = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_folder(path.parent)
    except OSError as err:
        if err.errno in STORAGE_ERRNOS:
            raise StorageError(storage_message(path, err, what) + hint) from None
        raise
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


class _WriteRecorder:
    """A binary handle that keeps the first ``OSError`` its writes raise: torch's zip writer turns a failed write
    (a full disk: ENOSPC) into ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``."""

    def __init__(self, handle) -> None:
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.handle.flush()


def _torch_save(obj: Any, handle) -> None:
    """``torch.save`` that raises the write's own ``OSError`` (errno and all) when a write failed."""
    import torch

    recorder = _WriteRecorder(handle)
    try:
        torch.save(obj, recorder)
    except RuntimeError as err:
        if recorder.error is not None:
            raise recorder.error from err
        raise


def atomic_torch_save(obj: Any, path: Any, what: str = "save checkpoint") -> None:
    """``torch.save`` to a temp file beside ``path``, fsync, rename: ``path`` is whole or untouched."""
    hint = ", then resume with --ckpt_path last" if "checkpoint" in what else ""
    _write_atomic(pathlib.Path(path), lambda handle: _torch_save(obj, handle), "wb", what, hint)


def atomic_checkpoint_io():
    """A Lightning ``CheckpointIO`` that saves with ``atomic_torch_save`` (loading and removal unchanged)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if storage_options is not None:
                raise TypeError("AtomicCheckpointIO.save_checkpoint: storage_options is not supported")
            atomic_torch_save(checkpoint, path)

    return AtomicCheckpointIO()


def write_text_atomic(path: pathlib.Path, text: str, what: str = "write") -> None:
    """Small files (summary.json): temp file beside ``path``, then rename; a storage error is one line."""
    _write_atomic(pathlib.Path(path), lambda handle: handle.write(text), "w", what)
