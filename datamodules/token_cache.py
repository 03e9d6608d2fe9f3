"""Tokenise a corpus once into a flat memmap of token ids (nanoGPT style), written atomically.

Layout of a cache folder ``<cache_dir>/tokens/<corpus fingerprint>-<tokenizer fingerprint>/``:
``tokens.bin`` (uint16 when the vocabulary fits, else uint32) and ``meta.json`` (count, dtype,
checksum). Both are written to temporary names and renamed into place, ``meta.json`` last, so a
reader never sees a half-written cache as complete. ``open_tokens`` verifies size and checksum
and returns ``None`` for a missing or corrupt cache, which the caller then rebuilds.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Iterable, List, Optional, Tuple

import numpy as np

from datamodules.corpora import DataError
from datamodules.files import follow_umask
from datamodules.tokenizer import TextTokenizer

CHUNK_BYTES = 64 << 20  # tokens.bin is hashed in chunks of this size at build time (all of it)
EAGER_VERIFY_BYTES = 1 << 30  # up to this size every chunk is verified when the cache is opened
_FULL_HASH_LIMIT = 1 << 30  # legacy caches (one "sha256"): above 1 GiB only sampled blocks were hashed
# What tokens.bin holds for a corpus and tokenizer (document order, separators, the probe generators' streams).
# The folder name keys the inputs, not the code that turned them into tokens: bump this when that code changes
# what it writes, and every older cache is rebuilt instead of read as if current. Caches written before the
# field existed (no "format" in meta.json) hold format 1.
FORMAT = 1
_SAMPLE_BLOCK = 1 << 20


def cache_folder(cache_dir: pathlib.Path, corpus_fingerprint: str, tokenizer: TextTokenizer) -> pathlib.Path:
    # formats above 1 get their own folder: two checkouts of different formats sharing a cache directory keep
    # one cache each instead of rebuilding each other's (format 1 keeps the names caches had before the field)
    suffix = f"-f{FORMAT}" if FORMAT > 1 else ""
    return cache_dir / "tokens" / f"{corpus_fingerprint}-{tokenizer.name.replace('/', '_')[-24:]}-{tokenizer.fingerprint}{suffix}"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def chunk_checksums(path: pathlib.Path, chunk_bytes: int = 0) -> List[str]:
    """sha256 of each ``chunk_bytes`` piece of the file (the last may be shorter): the whole file is covered."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    out = []
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            out.append(hashlib.sha256(chunk).hexdigest())
    return out


class ChunkVerifier:
    """Checks each chunk of ``tokens.bin`` against its build-time sha256 the first time it is read.

    Used for caches above ``EAGER_VERIFY_BYTES``, so opening a 100 GiB cache costs nothing and every
    byte training reads has still been verified. A mismatch removes ``meta.json`` (the next run
    rebuilds the cache) and raises a DataError naming the file and chunk."""

    def __init__(self, folder: pathlib.Path, meta: dict):
        self.folder, self.path = folder, folder / "tokens.bin"
        self.chunk_bytes = int(meta["chunk_bytes"])
        self.expected = list(meta["chunk_sha256"])
        self.itemsize = np.dtype(meta["dtype"]).itemsize
        self.verified = set()

    def check_tokens(self, start: int, stop: int) -> None:
        """Verify the chunks holding tokens [start, stop)."""
        if stop <= start:
            return
        first, last = start * self.itemsize // self.chunk_bytes, (stop * self.itemsize - 1) // self.chunk_bytes
        for index in range(first, last + 1):
            if index not in self.verified:
                self.check_chunk(index)

    def check_chunk(self, index: int) -> None:
        with self.path.open("rb") as handle:
            handle.seek(index * self.chunk_bytes)
            digest = hashlib.sha256(handle.read(self.chunk_bytes)).hexdigest()
        if digest != self.expected[index]:
            invalidate(self.folder)
            raise DataError(f"token cache {self.path} is corrupt (chunk {index} of {len(self.expected)}, bytes "
                            f"{index * self.chunk_bytes}+, fails its sha256); it is rebuilt on the next run")
        self.verified.add(index)

    def __getstate__(self):  # DataLoader workers re-verify what they read (cheap, and no shared state)
        return {**self.__dict__, "verified": set()}


def file_checksum(path: pathlib.Path) -> str:
    """Legacy caches: sha256 of the whole file, or of sampled 1 MiB blocks (first, last, 64 evenly spaced)
    above 1 GiB. New caches record per-chunk hashes of the whole file instead (``chunk_checksums``)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
        else:
            for offset in np.linspace(0, size - _SAMPLE_BLOCK, 66).astype(np.int64):
                handle.seek(int(offset))
                digest.update(handle.read(_SAMPLE_BLOCK))
    return digest.hexdigest()




def write_chunks(
    chunks: Iterable[Tuple[np.ndarray, int]],
    tokenizer: TextTokenizer,
    folder: pathlib.Path,
    description: str,
    max_tokens: Optional[int] = None,
    expected_bytes: Optional[int] = None,
    extra_meta: Optional[dict] = None,
) -> pathlib.Path:
    """``extra_meta``: more fields for ``meta.json`` (e.g. checksums of files written beside the tokens)."""
    folder.mkdir(parents=True, exist_ok=True)
    remove_orphans(folder)
    dtype = token_dtype(tokenizer.vocab_size)
    count = 0
    docs = 0
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix="tokens.bin.tmp")
    follow_umask(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            for array, n_docs in chunks:
                if max_tokens is not None:
                    array = array[: max_tokens - count]
                try:
                    handle.write(array.tobytes())
                except OSError as err:
                    raise _disk_full(err, folder, count * np.dtype(dtype).itemsize, expected_bytes) from None
                count += array.size
                docs += n_docs
                if max_tokens is not None and count >= max_tokens:
                    break
            try:
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as err:
                raise _disk_full(err, folder, count * np.dtype(dtype).itemsize, expected_bytes) from None
        if count < 2:
            raise DataError(f"{description}: the corpus produced {count} tokens; nothing to train on "
                            "(empty or whitespace-only input?)")
        tmp = pathlib.Path(tmp_name)
        meta = cache_meta(tmp, tokenizer, count, docs, max_tokens, extra_meta)
        os.replace(tmp, folder / "tokens.bin")
    except BaseException:
        pathlib.Path(tmp_name).unlink(missing_ok=True)
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # ends the progress bar's line before the error is printed
        raise
    _atomic_json(folder / "meta.json", meta)
    return folder


def cache_meta(data_path: pathlib.Path, tokenizer: TextTokenizer, count: int, docs: int,
               max_tokens: Optional[int] = None, extra_meta: Optional[dict] = None) -> dict:
    """``meta.json``'s fields for the finished ``data_path`` (its per-chunk sha256 are computed here)."""
    meta = {
        "num_tokens": count,
        "num_documents": docs,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "chunk_bytes": CHUNK_BYTES,
        "chunk_sha256": chunk_checksums(data_path),
        "format": FORMAT,
    }
    if max_tokens is not None:
        meta["max_tokens"] = max_tokens
    meta.update(extra_meta or {})
    return meta


def _disk_full(err: OSError, folder: pathlib.Path, written: int, expected: Optional[int]) -> Exception:
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return err
    free = shutil.disk_usage(folder).free
    need = f"up to {_mib(expected)} in all" if expected else f"more than the {_mib(written)} written"
    return DataError(f"disk full while building the token cache in {folder}: {_mib(written)} written, "
                     f"{_mib(free)} free, needs {need}; free space there or point DYNCOMP_CACHE / "
                     "--data.cache_dir at a larger disk")


def _mib(n: Optional[int]) -> str:
    n = n or 0
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


#: a temporary file untouched for this long belongs to no running build (a live build writes continuously)
ORPHAN_AGE_S = 600.0


def remove_orphans(folder: pathlib.Path, scratch_dirs: bool = False) -> None:
    """Delete what a killed build left behind (``tokens.bin.tmp*``, ``meta.json.tmp*``, ``map.tmp*/``).

    Within a run one build writes a cache folder (rank 0's ``prepare_data``), but separate jobs may share
    ``$DYNCOMP_CACHE`` (a sweep, two terminals) and build the same folder at once: a temporary file
    modified in the last ``ORPHAN_AGE_S`` seconds may be another live build's and is left alone."""
    stale = lambda path: time.time() - _newest_mtime(path) > ORPHAN_AGE_S  # noqa: E731
    for pattern in ("tokens.bin.tmp*", "meta.json.tmp*"):
        for orphan in folder.glob(pattern):
            if stale(orphan):
                orphan.unlink(missing_ok=True)
    for scratch in folder.glob("map.tmp*") if scratch_dirs else ():  # scratch of the datasets.map builds before the sharded one
        if scratch.is_dir() and stale(scratch):
            shutil.rmtree(scratch, ignore_errors=True)


def _newest_mtime(path: pathlib.Path) -> float:
    """Modification time of ``path``, or of the newest file inside it (a scratch folder being written)."""
    try:
        times = [path.stat().st_mtime] + ([p.stat().st_mtime for p in path.rglob("*")] if path.is_dir() else [])
    except FileNotFoundError:  # removed meanwhile by its own build
        return time.time()
    return max(times)


def complete_meta(folder: pathlib.Path) -> Optional[dict]:
    """``meta.json`` of a cache this code reads (it parses, has this code's ``FORMAT``) whose ``tokens.bin`` has the
    recorded size; None otherwise. No checksum is read: the cheap half of ``open_tokens``'s check, enough to tell
    a usable cache from a partial, stale or foreign one before anything is built."""
    meta_path, data_path = folder / "meta.json", folder / "tokens.bin"
    if not meta_path.is_file() or not data_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        expected_bytes = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    except (ValueError, KeyError, TypeError):
        return None
    if meta.get("format", 1) != FORMAT:  # written by code that produced other tokens: stale, rebuilt
        return None
    return meta if data_path.stat().st_size == expected_bytes else None


def open_tokens(folder: pathlib.Path) -> Optional[np.memmap]:
    """The verified token memmap, or ``None`` when the cache is missing, partial or corrupt.

    Verified here: ``meta.json`` parses and has this code's ``FORMAT``, the file has exactly the recorded size, and (up to
    ``EAGER_VERIFY_BYTES``) every chunk matches its build-time sha256. Above that, the first and last
    chunks are checked here and the others by ``verifier(folder)`` when first read."""
    meta = complete_meta(folder)
    if meta is None:
        return None
    data_path, dtype = folder / "tokens.bin", np.dtype(meta["dtype"])
    expected_bytes = meta["num_tokens"] * dtype.itemsize
    if "chunk_sha256" in meta:
        try:
            checker = ChunkVerifier(folder, meta)
            count = len(checker.expected)
            if count != -(-expected_bytes // checker.chunk_bytes):
                return None
            eager = range(count) if expected_bytes <= EAGER_VERIFY_BYTES else sorted({0, count - 1})
            for index in eager:
                checker.check_chunk(index)
        except (DataError, KeyError, TypeError, ValueError):
            return None
    elif file_checksum(data_path) != meta.get("sha256"):
        return None
    return np.memmap(data_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))


def verifier(folder: pathlib.Path) -> Optional[ChunkVerifier]:
    """The lazy chunk checker for a cache above ``EAGER_VERIFY_BYTES`` (None: verified in full at open)."""
    meta = read_meta(folder)
    if "chunk_sha256" not in meta or meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize <= EAGER_VERIFY_BYTES:
        return None
    return ChunkVerifier(folder, meta)


def read_meta(folder: pathlib.Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def invalidate(folder: pathlib.Path) -> None:
    (folder / "meta.json").unlink(missing_ok=True)


def _atomic_json(path: pathlib.Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    follow_umask(tmp)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)
