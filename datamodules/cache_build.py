"""Build a token cache on every core, resumably: ordered shards of documents, one encoder per process.

The documents are cut into shards of ``SHARD_DOCS`` (shard i = documents [i*S, (i+1)*S)), each encoded by a
worker process (``datamodules/encoders.py``: tiktoken for GPT-2-style BPE, else the Hugging Face tokenizer)
and appended in shard order to ``tokens.partial`` by this process, so the ids are written once and the
result is bit-identical for any number of processes. ``build.json`` records the finished shards (written after
the data is flushed to disk), so a killed build continues from them: the partial file is cut back to the
recorded length (a torn last write is dropped) and the documents of the finished shards are skipped. At the
end the file is renamed to ``tokens.bin`` and ``meta.json`` is written last, as ``token_cache.write_chunks``
does: a reader never sees a torn cache.

One build per cache folder at a time: ``build.lock`` (host, pid; its time is refreshed while the build runs)
makes a second builder (another job, another node's rank 0 on a shared disk) wait, logging the first one's
progress, until that build ends, then use its cache. Under DDP that wait is bounded (``DDP_WAIT_S``), and a
large cache is not built in ``prepare_data`` at all: the other ranks would sit at Lightning's 30-minute
barrier; the error says to run ``python -m experiments.prepare`` first.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import pathlib
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np
from tqdm.auto import tqdm

from datamodules import token_cache
from datamodules.corpora import DataError
from datamodules.encoders import DocumentEncoder, EncoderSpec, encoder_spec
from datamodules.tokenizer import TextTokenizer

SHARD_DOCS = 512  # part of a partial build's key: a resumed build uses the same shard boundaries
CHECKPOINT_S = 2.0  # build.json is rewritten (after an fsync of the data) at most this often
LOCK_STALE_S = 600.0  # a lock not refreshed for this long belongs to a dead build (another host)
HEARTBEAT_S = 30.0
POLL_S = 30.0  # a waiting builder logs the other build's progress this often
CHECK_S = 0.5  # and looks whether it has ended this often
DDP_WAIT_S = 20 * 60.0  # under DDP, below Lightning's 30-minute barrier timeout
DDP_BUILD_LIMIT_BYTES = 256 << 20  # under DDP, prepare_data builds caches of corpora up to this much text
ONE_PROCESS_BYTES = 16 << 20  # a corpus known to be smaller is encoded in this process: starting workers costs more
PARTIAL, MANIFEST, LOCK = "tokens.partial", "build.json", "build.lock"  # never "tokens.bin*": not a cache

ShardResult = Tuple[int, np.ndarray, int, float]  # shard index, ids (EOT after each document), documents, CPU s


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def available_cpus() -> int:
    """The CPUs this process may run on (a SLURM or container CPU set), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def resolve_num_proc(num_proc: Optional[int]) -> int:
    return available_cpus() if num_proc is None else num_proc


@dataclass
class BuildStats:
    folder: pathlib.Path
    num_tokens: int = 0  # tokens written by this call (0: the cache was built by another process)
    num_documents: int = 0
    cpu_s: float = 0.0  # the encoders' process time (every worker's), for tokens per CPU-second
    wall_s: float = 0.0
    num_proc: int = 1
    resumed_shards: int = 0
    encoder: str = ""
    expected_bytes: Optional[int] = None  # tokens.bin's estimated size (the disk-full message names it)

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_tokens / self.cpu_s if self.cpu_s else 0.0


# ---------------------------------------------------------------------------- the lock
class BuildLock:
    """``build.lock``, created exclusively (works on shared file systems, unlike flock on some); stale when its
    process is gone (same host) or it was not refreshed for ``LOCK_STALE_S`` (another host)."""

    def __init__(self, folder: pathlib.Path):
        self.path = folder / LOCK
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def holder(self) -> Optional[dict]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def is_stale(self) -> bool:
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return True
        holder = self.holder() or {}
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return not _pid_alive(holder["pid"])
        return age > LOCK_STALE_S

    def held_by_other(self) -> bool:
        return self.path.exists() and not self.is_stale()

    def try_acquire(self) -> bool:
        if self.path.exists() and self.is_stale():
            self.path.unlink(missing_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}, handle)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True)
        self._thread.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        self.path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def wait_for_builder(lock: BuildLock, wait_s: Optional[float], description: str, hint: str) -> None:
    """Return once no live build holds ``lock`` (checked every ``CHECK_S``: a probe's cache takes seconds);
    log its progress every ``POLL_S``; give up after ``wait_s``."""
    start = time.monotonic()
    logged = None
    while lock.held_by_other():
        waited = time.monotonic() - start
        holder = lock.holder() or {}
        if wait_s is not None and waited >= wait_s:
            raise DataError(f"{description}: the token cache {lock.path.parent} is still being built by pid "
                            f"{holder.get('pid')} on {holder.get('host')} after {waited / 60:.0f} min of waiting; "
                            f"let it finish, or build it before training: {hint}")
        if logged is None or waited - logged >= POLL_S:
            done = _read_manifest(lock.path.parent)
            progress = f"{done.get('shards', 0)} shards, {done.get('tokens', 0):,} tokens so far; " if done else ""
            log(f"{description}: waiting for pid {holder.get('pid')} on {holder.get('host')} to finish the token "
                f"cache {lock.path.parent} ({progress}waited {waited:.0f} s)")
            logged = waited
        time.sleep(CHECK_S if wait_s is None else max(0.01, min(CHECK_S, wait_s - waited)))


@contextlib.contextmanager
def locked_build(folder: pathlib.Path, wait_s: Optional[float], description: str, hint: str,
                 complete: Callable[[], bool], keep_complete: bool = True) -> Iterator[bool]:
    """Hold ``folder``'s ``build.lock`` for the block, waiting (at most ``wait_s``) while another live process
    builds there; yields whether this process must build: False when the cache is ``complete()`` after a wait
    (the other build made it) or, with ``keep_complete``, once the lock is held (finished between the caller's
    check and the lock)."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = BuildLock(folder)
    while not lock.try_acquire():
        wait_for_builder(lock, wait_s, description, hint)
        if complete():
            yield False
            return
    try:
        yield not (keep_complete and complete())
    finally:
        lock.release()


# ---------------------------------------------------------------------------- resumable progress
def build_key(tokenizer: TextTokenizer, dtype: str, shard_docs: int, max_tokens: Optional[int]) -> dict:
    """What a partial build's bytes depend on (the corpus is the folder's own key)."""
    # the cache format too (above 1: format-1 partial builds keep their key): a build killed under one format is
    # not resumed under another, which would mix the two in one tokens.bin
    return {"tokenizer_fingerprint": tokenizer.fingerprint, "eot_id": tokenizer.eot_id, "dtype": dtype,
            "shard_docs": shard_docs, "max_tokens": max_tokens,
            **({"format": token_cache.FORMAT} if token_cache.FORMAT > 1 else {})}


@dataclass
class Progress:
    shards: int = 0
    tokens: int = 0
    docs: int = 0


def _read_manifest(folder: pathlib.Path) -> Optional[dict]:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def load_progress(folder: pathlib.Path, key: dict, itemsize: int) -> Progress:
    """The finished shards of a killed build with the same key whose bytes are all on disk, else none."""
    manifest, partial = _read_manifest(folder), folder / PARTIAL
    if manifest and manifest.get("key") == key and partial.is_file():
        done = Progress(int(manifest["shards"]), int(manifest["tokens"]), int(manifest["docs"]))
        if partial.stat().st_size >= done.tokens * itemsize:
            return done
    partial.unlink(missing_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)
    return Progress()


def save_progress(folder: pathlib.Path, key: dict, done: Progress) -> None:
    token_cache._atomic_json(folder / MANIFEST, {"key": key, "shards": done.shards, "tokens": done.tokens,
                                                  "docs": done.docs})


# ---------------------------------------------------------------------------- encoding in worker processes
_ENCODER: Optional[DocumentEncoder] = None


def _init_worker(spec: EncoderSpec) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _ENCODER = DocumentEncoder(spec)


def _encode_shard(shard: Tuple[int, List[str]]) -> ShardResult:
    index, texts = shard
    start = time.process_time()
    ids = _ENCODER.encode(texts)
    return index, ids, len(texts), time.process_time() - start


def shards_of(documents: Iterable[str], shard_docs: int, first_shard: int = 0) -> Iterator[Tuple[int, List[str]]]:
    """(index, texts) from shard ``first_shard`` on; the documents of earlier shards are skipped."""
    docs = itertools.islice(iter(documents), first_shard * shard_docs, None)
    for index in itertools.count(first_shard):
        texts = list(itertools.islice(docs, shard_docs))
        if not texts:
            return
        yield index, texts


def encoded_shards(shards: Iterable[Tuple[int, List[str]]], spec: EncoderSpec, num_proc: int) -> Iterator[ShardResult]:
    """The shards encoded in order, by ``num_proc`` processes (1: in this process), at most 2 per process in
    flight so that a stream is never read far ahead. A worker that dies (killed, out of memory) raises
    ``BrokenProcessPool`` here instead of hanging the build."""
    shards = iter(shards)
    second = next(shards, None)  # a corpus of one shard needs no workers
    if second is None:
        return
    shards = itertools.chain([second], shards)
    if num_proc == 1:
        _init_worker_here(spec)
        yield from map(_encode_shard, shards)
        return
    # spawn: the caller may hold CUDA, threads or a forked tokenizer; a fork would copy them
    from concurrent.futures import ProcessPoolExecutor  # here: experiments.run imports this module

    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(spec,))
    try:
        pending: deque = deque()
        for shard in shards:
            pending.append(pool.submit(_encode_shard, shard))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _init_worker_here(spec: EncoderSpec) -> None:
    global _ENCODER
    _ENCODER = DocumentEncoder(spec)


# ---------------------------------------------------------------------------- progress and disk space
class ProgressBar:
    """Documents (when their number is known) or tokens (up to ``max_tokens``), with tokens/s and ETA."""

    def __init__(self, description: str, total_docs: Optional[int], max_tokens: Optional[int], done: Progress,
                 start: float):
        self.by_docs = total_docs is not None or max_tokens is None
        total, initial = (total_docs, done.docs) if self.by_docs else (max_tokens, done.tokens)
        self.bar = tqdm(desc=description, total=total, initial=initial, unit=" docs" if self.by_docs else " tok",
                        unit_scale=True, mininterval=1.0, dynamic_ncols=True)
        self.start, self.tokens = start, 0

    def advance(self, docs: int, tokens: int, cpu_s: float) -> None:
        self.tokens += tokens
        self.bar.update(docs if self.by_docs else tokens)
        wall = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / wall / 1e6:.2f}M tok/s, {self.tokens / max(cpu_s, 1e-9) / 1e3:.0f}k "
                                 "tok/CPU-s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def estimate_bytes(first: ShardResult, texts: List[str], text_bytes: Optional[int], max_tokens: Optional[int],
                   itemsize: int) -> Optional[int]:
    """``tokens.bin``'s expected size: the corpus's text bytes at the first shard's bytes per token (capped by
    ``max_tokens``); None when neither is known (a stream without a cap)."""
    per_token = sum(len(t.encode("utf-8")) for t in texts) / max(len(first[1]), 1)
    estimates = [int(text_bytes / per_token) if text_bytes else None, max_tokens]
    known = [n for n in estimates if n is not None]
    return min(known) * itemsize if known else None


def announce_disk(folder: pathlib.Path, description: str, need: Optional[int], written: int) -> None:
    import shutil

    free = shutil.disk_usage(folder).free
    if need is None:
        log(f"{description}: the token cache's size is unknown until the corpus is read (a stream without "
            f"--data.max_tokens); {_gib(free)} free at {folder}")
        return
    log(f"{description}: the token cache needs about {_gib(need)} at {folder} ({_gib(max(need - written, 0))} "
        f"more; {_gib(free)} free)")
    if need - written > free:
        raise DataError(f"{description}: not enough disk space for the token cache at {folder}: needs about "
                        f"{_gib(need - written)} more, {_gib(free)} free; free space there or point DYNCOMP_CACHE / "
                        "--data.cache_dir at a larger disk")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.1f} MiB"


# ---------------------------------------------------------------------------- the build
def build_cache(documents: Iterable[str], tokenizer: TextTokenizer, folder: pathlib.Path,
                description: str = "tokenising", *, max_tokens: Optional[int] = None, num_proc: Optional[int] = None,
                text_bytes: Callable[[], Optional[int]] = lambda: None,
                total_docs: Callable[[], Optional[int]] = lambda: None, shard_docs: int = SHARD_DOCS,
                wait_s: Optional[float] = None, hint: str = "python -m experiments.prepare",
                prefer_tiktoken: bool = True, refusal: Optional[DataError] = None,
                only_if_missing: bool = False) -> BuildStats:
    """Tokenise ``documents`` (EOT after each) into ``folder/tokens.bin`` + ``meta.json`` with ``num_proc``
    processes (None: every available CPU), resuming a killed build of the same cache.

    ``text_bytes`` / ``total_docs`` (asked after the first shard, when a Hub dataset is loaded) size the disk
    estimate and the progress bar. When another process is building this cache, waits for it (at most
    ``wait_s``; the error names ``hint``, the prepare command) and returns its cache. ``refusal``: raised
    instead of building here (a large cache under DDP), when no other build made the cache.
    ``only_if_missing``: a cache that is complete once the lock is held is kept (the caller found it missing,
    and another process finished it since; rebuilding would take it away from that process's readers)."""
    def built() -> bool:
        return token_cache.open_tokens(folder) is not None

    with locked_build(folder, wait_s, description, hint, built, keep_complete=only_if_missing) as needed:
        if not needed:
            return BuildStats(folder)
        if refusal is not None:  # the other build died: rebuilding here would keep the ranks at the barrier
            raise refusal
        return _build_locked(documents, tokenizer, folder, description, max_tokens, resolve_num_proc(num_proc),
                             text_bytes, total_docs, shard_docs, prefer_tiktoken)


def _build_locked(documents, tokenizer, folder, description, max_tokens, num_proc, text_bytes, total_docs,
                  shard_docs, prefer_tiktoken) -> BuildStats:
    token_cache.invalidate(folder)  # a rebuild: the old meta.json must not vouch for the new file meanwhile
    token_cache.remove_orphans(folder, scratch_dirs=True)
    spec = encoder_spec(tokenizer, prefer_tiktoken)
    itemsize = np.dtype(spec.dtype).itemsize
    key = build_key(tokenizer, spec.dtype, shard_docs, max_tokens)
    done = load_progress(folder, key, itemsize)
    if done.shards:
        log(f"{description}: resuming a killed build after its {done.shards} finished shards ({done.tokens:,} tokens)")
    stats = BuildStats(folder, num_proc=num_proc, resumed_shards=done.shards, encoder=spec.kind)
    start = time.monotonic()
    shards = shards_of(documents, shard_docs, done.shards)
    first = next(shards, None)
    encoded: Iterator[ShardResult] = iter(())
    if first is not None:
        _init_worker_here(spec)
        head = _encode_shard(first)  # in this process: it calibrates the disk estimate before the pool starts
        size = text_bytes()
        stats.expected_bytes = estimate_bytes(head, first[1], size, max_tokens, itemsize)
        announce_disk(folder, description, stats.expected_bytes, done.tokens * itemsize)
        stats.num_proc = 1 if size is not None and size < ONE_PROCESS_BYTES else num_proc
        encoded = encoded_shards(shards, spec, stats.num_proc)
        results = itertools.chain([head], encoded)
    else:
        results = iter(())
    bar = ProgressBar(description, total_docs(), max_tokens, done, start)
    try:
        _append_shards(results, folder, key, done, max_tokens, bar, stats, itemsize)
    finally:
        bar.close()
        getattr(encoded, "close", lambda: None)()  # stops the pool when max_tokens ended the build early
    stats.wall_s = time.monotonic() - start
    _finish(folder, tokenizer, done, max_tokens, description)
    log(f"{description}: {stats.num_tokens:,} tokens from {stats.num_documents:,} documents in {stats.wall_s:.1f} s "
        f"({stats.num_tokens / max(stats.wall_s, 1e-9):,.0f} tokens/s with {stats.num_proc} processes, "
        f"{stats.tokens_per_cpu_s:,.0f} per CPU-second, {spec.kind})")
    return stats


def _append_shards(results: Iterable[ShardResult], folder: pathlib.Path, key: dict, done: Progress,
                   max_tokens: Optional[int], bar: ProgressBar, stats: BuildStats, itemsize: int) -> None:
    """Append each shard's ids in order to the partial file; record finished shards after an fsync."""
    path = folder / PARTIAL
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # 0o666 & ~umask, as the cache's other files
    with os.fdopen(fd, "r+b") as handle:
        handle.truncate(done.tokens * itemsize)  # drops a torn write after the last recorded shard
        handle.seek(0, os.SEEK_END)
        last_save = time.monotonic()
        for index, ids, n_docs, cpu_s in results:
            if max_tokens is not None:
                ids = ids[: max(max_tokens - done.tokens, 0)]
            _write(handle, ids, folder, done.tokens * itemsize, stats.expected_bytes)
            done.shards, done.tokens, done.docs = index + 1, done.tokens + ids.size, done.docs + n_docs
            stats.num_tokens, stats.num_documents, stats.cpu_s = (stats.num_tokens + ids.size,
                                                                  stats.num_documents + n_docs, stats.cpu_s + cpu_s)
            bar.advance(n_docs, ids.size, stats.cpu_s)
            if time.monotonic() - last_save >= CHECKPOINT_S:
                _checkpoint(handle, folder, key, done, stats.expected_bytes)
                last_save = time.monotonic()
            if max_tokens is not None and done.tokens >= max_tokens:
                break
        _checkpoint(handle, folder, key, done, stats.expected_bytes)


def _write(handle, ids: np.ndarray, folder: pathlib.Path, written: int, expected: Optional[int]) -> None:
    try:
        handle.write(ids.tobytes())
    except OSError as err:
        raise token_cache._disk_full(err, folder, written, expected) from None


def _checkpoint(handle, folder: pathlib.Path, key: dict, done: Progress, expected: Optional[int]) -> None:
    try:
        handle.flush()
        os.fsync(handle.fileno())  # the bytes first: build.json never counts tokens that are not on disk
    except OSError as err:
        raise token_cache._disk_full(err, folder, handle.tell(), expected) from None
    save_progress(folder, key, done)


def _finish(folder: pathlib.Path, tokenizer: TextTokenizer, done: Progress, max_tokens: Optional[int],
            description: str) -> None:
    if done.tokens < 2:
        (folder / PARTIAL).unlink(missing_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)
        raise DataError(f"{description}: the corpus produced {done.tokens} tokens; nothing to train on "
                        "(empty or whitespace-only input?)")
    partial = folder / PARTIAL
    meta = token_cache.cache_meta(partial, tokenizer, done.tokens, done.docs, max_tokens)
    os.replace(partial, folder / "tokens.bin")
    token_cache._atomic_json(folder / "meta.json", meta)
    (folder / MANIFEST).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- a corpus's cache
def build_corpus_cache(corpus, tokenizer: TextTokenizer, folder: pathlib.Path, description: str,
                       num_proc: Optional[int] = None, world_size: int = 1,
                       hint: str = "python -m experiments.prepare") -> BuildStats:
    """The cache of ``corpus`` (its ``documents()``, ``max_tokens``, and when known ``size_bytes()`` and
    ``num_documents()``). Under DDP (``world_size`` > 1) only a small corpus is built here, and a build by
    another process is waited for at most ``DDP_WAIT_S``: ``hint`` is the command that builds it first."""
    size = getattr(corpus, "size_bytes", lambda: None)
    refusal = None
    if world_size > 1 and (size() is None or size() > DDP_BUILD_LIMIT_BYTES):
        refusal = DataError(f"{description}: the token cache {folder} is missing; under DDP the other "
                            f"{world_size - 1} ranks would wait at Lightning's 30-minute barrier while rank 0 builds "
                            f"it: build it first with {hint}, then start training")
        if not BuildLock(folder).held_by_other():
            raise refusal
    return build_cache(corpus.documents(), tokenizer, folder, description,
                       max_tokens=getattr(corpus, "max_tokens", None), num_proc=num_proc, text_bytes=size,
                       total_docs=getattr(corpus, "num_documents", lambda: None),
                       wait_s=DDP_WAIT_S if world_size > 1 else None, hint=hint, refusal=refusal,
                       only_if_missing=True)


def build_generated_cache(folder: pathlib.Path, write: Callable[[], object], complete: Callable[[], bool],
                          description: str, world_size: int = 1) -> None:
    """A generated corpus's cache (the probes' ``write_tokens``: tokens and labels in one go) under the same
    ``build.lock`` as ``build_cache``: of the processes that find it missing at once (``repro --jobs 2``'s first
    runs, two shells), one writes it and the others wait and use it. Unlocked, a second writer's rebuild
    removed ``meta.json`` under a third process that had found the cache complete: that run failed with
    'missing or corrupt'."""
    wait_s = DDP_WAIT_S if world_size > 1 else None
    with locked_build(folder, wait_s, description, "the same command on one process", complete) as needed:
        if needed:
            write()


def build_tokens(
    documents: Iterable[str],
    tokenizer: TextTokenizer,
    folder: pathlib.Path,
    description: str = "tokenising",
    max_tokens: Optional[int] = None,
    input_bytes: Optional[int] = None,
    num_proc: Optional[int] = 1,
) -> pathlib.Path:
    """Tokenise ``documents`` (EOT after each) into ``folder/tokens.bin`` + ``meta.json``, atomically and
    resumably, with ``num_proc`` processes (None: every CPU): ``datamodules/cache_build.py``.

    ``max_tokens`` stops after that many tokens (streamed corpora larger than the disk).
    ``input_bytes`` (the corpus's text size, when known) sizes the disk estimate printed before the build.
    """
    return build_cache(documents, tokenizer, folder, description, max_tokens=max_tokens, num_proc=num_proc,
                       text_bytes=lambda: input_bytes).folder
