"""The token cache build (datamodules/cache_build.py, datamodules/encoders.py): ids equal across the tiktoken and
Hugging Face paths and any number of processes, a killed build resumes to the identical cache, one build per
folder, and DDP never builds a large cache behind a barrier."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from datamodules import cache_build, token_cache
from datamodules.corpora import DataError, EmbeddedCorpus
from datamodules.encoders import DocumentEncoder, encoder_spec
from datamodules.tokenizer import EOT, TextTokenizer, get_tokenizer, load_folder
from tests.conftest import REPO

#: what a byte-level BPE must get exactly right: whitespace runs, unicode, contractions, digits, special strings
EDGE_CASES = [
    "Hello world", "  two leading spaces", "trailing spaces   ", "tabs\t\tand\nnew\n\n\nlines \n \n",
    "it's we'll they'RE I'm 'd", "12345678 3.14159 1,000,000", "naïve café — “quotes” ½ ° ©",
    "中文字符 日本語 한국어", "emoji 🎉👍🏽 and ZWJ 👨‍👩‍👧", "\u00a0non-breaking\u2009thin\u3000ideographic",
    "a <|endoftext|> inside a document", EOT, f"{EOT}{EOT}", "<|endoftext", "", " ", "\n",
]


def _gpt2(shared_data) -> TextTokenizer:
    return TextTokenizer(load_folder(shared_data / "gpt2_tokenizer"), "gpt2")


def _owt_documents(shared_data) -> list:
    text = (shared_data / "openwebtext" / "openwebtext_sample.txt").read_text(encoding="utf-8")
    return [doc for doc in text.split("\n\n") if doc.strip()]  # the sample marks no boundaries: paragraphs


def _reference(tokenizer: TextTokenizer, docs) -> np.ndarray:
    """The naive reference: the tokenizer's own single-text encoding with special tokens off, EOT after each."""
    hf = tokenizer.tokenizer
    hf.encode_special_tokens = True
    try:
        ids = [i for doc in docs for i in hf.encode(doc, add_special_tokens=False).ids + [tokenizer.eot_id]]
    finally:
        hf.encode_special_tokens = False
    return np.asarray(ids)


def test_gpt2_tiktoken_ids_equal_the_hf_tokenizer_on_real_text(shared_data):
    tok = _gpt2(shared_data)
    docs = _owt_documents(shared_data) + EDGE_CASES
    fast, slow = encoder_spec(tok), encoder_spec(tok, prefer_tiktoken=False)
    assert (fast.kind, slow.kind) == ("tiktoken", "hf")
    tiktoken_ids, hf_ids = DocumentEncoder(fast).encode(docs), DocumentEncoder(slow).encode(docs)
    assert len(tiktoken_ids) > 100_000
    np.testing.assert_array_equal(tiktoken_ids, hf_ids)
    np.testing.assert_array_equal(tiktoken_ids, _reference(tok, docs))
    # separators only where the pipeline put them: a literal "<|endoftext|>" is ordinary text
    assert np.count_nonzero(tiktoken_ids == tok.eot_id) == len(docs)
    literal = DocumentEncoder(fast).encode([EOT])
    assert literal.tolist()[:-1] != [tok.eot_id] and tok.decode(literal[:-1].tolist()) == EOT


def test_suites_trained_bpe_takes_the_hf_path_and_bytes_tiktoken_with_identical_ids(tmp_path):
    corpus = EmbeddedCorpus()
    tok = get_tokenizer("bpe", REPO / ".cache" / "dyncomp", corpus)
    docs = list(corpus.documents())[:300] + EDGE_CASES
    spec = encoder_spec(tok)
    assert spec.kind == "hf"  # EOT is id 0: its ids are not tiktoken's ranks
    np.testing.assert_array_equal(DocumentEncoder(spec).encode(docs), _reference(tok, docs))
    byte_tok = get_tokenizer("bytes", tmp_path)  # GPT-2's byte alphabet in GPT-2's order, no merges: tiktoken's layout
    assert encoder_spec(byte_tok).kind == "tiktoken"
    np.testing.assert_array_equal(DocumentEncoder(encoder_spec(byte_tok)).encode(docs), _reference(byte_tok, docs))


def _build(docs, tok, folder, **kw) -> np.ndarray:
    cache_build.build_cache(docs, tok, folder, **kw)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"]
    return np.array(token_cache.open_tokens(folder))


def test_cache_is_bit_identical_for_one_two_and_three_processes(tmp_path):
    tok = get_tokenizer("bytes", tmp_path)
    docs = [f"document {i}: " + "some words, " * (i % 13) + EDGE_CASES[i % len(EDGE_CASES)] for i in range(700)]
    builds = [_build(docs, tok, tmp_path / f"p{n}", num_proc=n, shard_docs=37) for n in (1, 2, 3)]
    for ids in builds:
        np.testing.assert_array_equal(ids, _reference(tok, docs))
    meta = [token_cache.read_meta(tmp_path / f"p{n}") for n in (1, 2, 3)]
    assert meta[0]["chunk_sha256"] == meta[1]["chunk_sha256"] == meta[2]["chunk_sha256"]
    assert meta[0]["num_documents"] == 700


def test_gpt2_cache_of_real_text_is_identical_for_one_and_two_processes(shared_data, tmp_path):
    tok, docs = _gpt2(shared_data), _owt_documents(shared_data)
    one = _build(docs, tok, tmp_path / "one", num_proc=1, shard_docs=128)
    two = _build(docs, tok, tmp_path / "two", num_proc=2, shard_docs=128)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, _reference(tok, docs))
    assert one.dtype == np.uint16


class Killed(BaseException):
    """Stands for SIGKILL inside the process: nothing after the raise runs but ``finally`` blocks."""


def _dies_after(docs, n):
    for i, doc in enumerate(docs):
        if i == n:
            raise Killed
        yield doc


def test_killed_build_resumes_from_its_finished_shards_to_the_identical_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache_build, "CHECKPOINT_S", 0.0)  # record every shard
    tok = get_tokenizer("bytes", tmp_path)
    docs = [f"doc {i} " + "text " * (i % 11) for i in range(400)]
    whole = _build(docs, tok, tmp_path / "whole", num_proc=1, shard_docs=25)
    folder = tmp_path / "killed"
    with pytest.raises(Killed):
        cache_build.build_cache(_dies_after(docs, 230), tok, folder, num_proc=1, shard_docs=25)
    assert not (folder / "tokens.bin").exists() and not (folder / "meta.json").exists()  # never a torn cache
    manifest = json.loads((folder / cache_build.MANIFEST).read_text())
    assert manifest["shards"] == 9 and manifest["docs"] == 225
    with (folder / cache_build.PARTIAL).open("ab") as handle:
        handle.write(b"\x07" * 33)  # a torn write after the last recorded shard
    seen = []
    stats = cache_build.build_cache((seen.append(d) or d for d in docs), tok, folder, num_proc=2, shard_docs=25)
    assert stats.resumed_shards == 9 and "resuming a killed build after its 9 finished shards" in capsys.readouterr().err
    np.testing.assert_array_equal(np.array(token_cache.open_tokens(folder)), whole)
    assert token_cache.read_meta(folder)["chunk_sha256"] == token_cache.read_meta(tmp_path / "whole")["chunk_sha256"]
    assert len(seen) == 400  # the finished shards' documents are read past, not encoded: the stats say so
    assert stats.num_documents == 400 - 225


_KILLED_BUILD = """
import sys, time, pathlib
from datamodules import cache_build
from datamodules.tokenizer import get_tokenizer
cache_build.CHECKPOINT_S = 0.0
folder = pathlib.Path(sys.argv[1])
def docs():
    for i in range(10_000):
        if i >= 200:
            time.sleep(0.01)  # slow after 200 documents: the test kills it mid-build
        yield f"doc {i} " + "text " * (i % 11)
cache_build.build_cache(docs(), get_tokenizer("bytes", folder.parent), folder, num_proc=1, shard_docs=25)
"""


def test_sigkilled_prepare_resumes_to_the_identical_cache(tmp_path):
    tok = get_tokenizer("bytes", tmp_path)
    docs = [f"doc {i} " + "text " * (i % 11) for i in range(10_000)]
    folder = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, str(folder)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (json.loads((folder / cache_build.MANIFEST).read_text()) if (folder / cache_build.MANIFEST).is_file()
           else {}).get("shards", 0) < 9:
        assert proc.poll() is None and time.monotonic() < deadline, "the build ended before it was killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / cache_build.LOCK).exists() and not (folder / "meta.json").exists()  # its lock outlives it
    stats = cache_build.build_cache(docs, tok, folder, num_proc=2, shard_docs=25)  # a dead pid's lock is taken over
    assert stats.resumed_shards >= 9
    np.testing.assert_array_equal(np.array(token_cache.open_tokens(folder)), _reference(tok, docs))


def _foreign_lock(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / cache_build.LOCK
    lock.write_text(json.dumps({"host": "other-node", "pid": 4242, "started": time.time()}))
    return lock


def test_a_second_builder_waits_for_the_first_and_uses_its_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache_build, "POLL_S", 0.1)
    tok = get_tokenizer("bytes", tmp_path)
    docs = [f"doc {i}" for i in range(50)]
    expected = _build(docs, tok, tmp_path / "elsewhere", num_proc=1)
    folder = tmp_path / "shared"
    lock = _foreign_lock(folder)

    def the_other_build_finishes():
        time.sleep(0.5)
        for name in ("tokens.bin", "meta.json"):
            (folder / name).write_bytes((tmp_path / "elsewhere" / name).read_bytes())
        lock.unlink()

    threading.Thread(target=the_other_build_finishes).start()
    stats = cache_build.build_cache(docs, tok, folder, num_proc=1)
    assert stats.num_tokens == 0  # built by the other process, not here
    np.testing.assert_array_equal(np.array(token_cache.open_tokens(folder)), expected)
    assert "waiting for pid 4242 on other-node" in capsys.readouterr().err


def test_a_generated_cache_waits_for_the_writer_holding_the_lock_and_does_not_write_again(tmp_path, monkeypatch):
    """The probes' caches take the same lock: while another live process writes, this one waits, then keeps
    what that process wrote."""
    monkeypatch.setattr(cache_build, "POLL_S", 0.1)
    folder = tmp_path / "probe"
    lock = _foreign_lock(folder)
    done = threading.Event()

    def the_other_writer_finishes():
        time.sleep(0.3)
        done.set()
        lock.unlink()

    threading.Thread(target=the_other_writer_finishes).start()
    written = []
    cache_build.build_generated_cache(folder, lambda: written.append(1), done.is_set, "generating")
    assert done.is_set() and written == [] and not lock.exists()


def test_the_wait_is_bounded_and_says_to_run_the_prepare_step(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_build, "POLL_S", 0.05)
    _foreign_lock(tmp_path / "c")
    with pytest.raises(DataError, match=r"still being built by pid 4242 on other-node after 0 min of waiting; let it "
                                         r"finish, or build it before training: python -m experiments.prepare --data x"):
        cache_build.build_cache(["abc"], get_tokenizer("bytes", tmp_path), tmp_path / "c", wait_s=0.2,
                                hint="python -m experiments.prepare --data x")


def test_a_stale_lock_of_a_dead_build_is_taken_over(tmp_path):
    lock = _foreign_lock(tmp_path / "c")
    then = time.time() - cache_build.LOCK_STALE_S - 5
    os.utime(lock, (then, then))
    cache_build.build_cache(["abc", "def"], get_tokenizer("bytes", tmp_path), tmp_path / "c", num_proc=1)
    assert token_cache.open_tokens(tmp_path / "c") is not None and not lock.exists()


class _HubLike:
    """A corpus whose size is unknown before it is downloaded (a Hub dataset)."""

    name, max_tokens = "hub", None

    def documents(self):  # a generator, as HubCorpus's: nothing is read until it is iterated
        raise AssertionError("under DDP nothing may be read: the refusal comes first")
        yield

    def size_bytes(self):
        return None


def test_under_ddp_a_large_cache_is_refused_in_one_line_naming_the_prepare_step(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_build, "POLL_S", 0.05)
    with pytest.raises(DataError) as err:
        cache_build.build_corpus_cache(_HubLike(), get_tokenizer("bytes", tmp_path), tmp_path / "c", "tokenising hub/train",
                                       world_size=4, hint="python -m experiments.prepare --data openwebtext")
    message = str(err.value)
    assert "\n" not in message and "the other 3 ranks would wait at Lightning's 30-minute barrier" in message
    assert message.endswith("build it first with python -m experiments.prepare --data openwebtext, then start training")
    lock = _foreign_lock(tmp_path / "c")  # another build of it is running, then dies without a cache

    def the_other_build_dies():
        time.sleep(0.3)
        lock.unlink()

    threading.Thread(target=the_other_build_dies).start()
    with pytest.raises(DataError, match="under DDP the other 3 ranks would wait"):  # waited, then not built here
        cache_build.build_corpus_cache(_HubLike(), get_tokenizer("bytes", tmp_path), tmp_path / "c", "t", world_size=4)
    assert not lock.exists() and token_cache.open_tokens(tmp_path / "c") is None
    corpus = EmbeddedCorpus()  # small: built in prepare_data even under DDP
    stats = cache_build.build_corpus_cache(corpus, get_tokenizer("bytes", tmp_path), tmp_path / "e", "e", world_size=4)
    assert stats.num_documents == len(list(corpus.documents()))


def test_num_proc_defaults_to_the_cpus_this_process_may_use():
    assert cache_build.resolve_num_proc(None) == len(os.sched_getaffinity(0)) >= 1
    assert cache_build.resolve_num_proc(1) == 1


def test_not_enough_disk_is_refused_before_the_build(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    with pytest.raises(DataError, match=r"not enough disk space for the token cache at .*: needs about [\d.,]+ MiB more"):
        cache_build.build_cache(["abc " * 100] * 20, get_tokenizer("bytes", tmp_path), tmp_path / "c",
                                text_bytes=lambda: 10**6)
    assert not (tmp_path / "c" / cache_build.PARTIAL).exists()  # refused before anything was written


def test_prepare_command_builds_every_split_and_a_second_run_reuses_them(tmp_path, capsys):
    from experiments import prepare

    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = ["--data", "text", "--data.path", str(text), "--tokenizer", "bytes", "--data.cache_dir", str(tmp_path / "cache")]
    folders = prepare.main(args)
    err = capsys.readouterr().err
    assert len(folders) == 1 and token_cache.open_tokens(folders[0]) is not None
    assert "the token cache needs about" in err and "tokens/s with 1 processes" in err
    stamp = (folders[0] / "tokens.bin").stat().st_mtime_ns
    assert prepare.main(args) == folders and (folders[0] / "tokens.bin").stat().st_mtime_ns == stamp


def test_data_benchmark_measures_ours_and_bare_hf_on_the_same_tokens(tmp_path, capsys):
    from experiments import bench_data

    text = tmp_path / "a.txt"
    text.write_text("\n\n".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog" for i in range(400)))
    table = bench_data.main(["--data", "text", "--data.path", str(text), "--tokenizer", "bytes",
                             "--split_blank_lines", "--procs", "1", "--repeats", "1", "--paths", "ours,hf"])
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "ours"), ("| 1", "hf")]
    assert rows[0][2] == rows[1][2]  # identical ids: the same number of text tokens on both paths
    assert int(rows[0][2].replace(",", "")) == sum(len(f"paragraph {i}: the quick brown fox jumps over the lazy dog")
                                                   for i in range(400))  # bytes: one token per byte
    assert "median of 1" in capsys.readouterr().out


def test_a_builder_that_gets_the_lock_after_another_finished_keeps_that_cache(tmp_path):
    """Two processes find the cache missing; the first builds it and releases the lock before the second asks
    for it: the second must not rebuild (its rebuild removed meta.json under a third process's reader)."""
    tok = get_tokenizer("bytes", tmp_path)
    folder = tmp_path / "c"
    cache_build.build_cache(["abc", "def"], tok, folder, num_proc=1)
    meta = (folder / "meta.json").stat()
    stats = cache_build.build_cache(["other", "text"], tok, folder, num_proc=1, only_if_missing=True)
    assert stats.num_tokens == 0 and (folder / "meta.json").stat().st_mtime_ns == meta.st_mtime_ns
    written = []
    cache_build.build_generated_cache(folder, lambda: written.append(1), lambda: True, "generating")
    assert written == [] and not (folder / cache_build.LOCK).exists()
    cache_build.build_generated_cache(tmp_path / "new", lambda: written.append(1), lambda: False, "generating")
    assert written == [1]


def test_a_probe_run_that_found_the_cache_missing_keeps_the_one_another_run_finished(tmp_path):
    """The race of ``repro probe --jobs 2``'s first runs, in order: run B finds the probe cache missing, run A
    writes it, run C finds it complete; B then takes the lock. B must keep A's cache: its rebuild removed
    meta.json while C opened the tokens, and C failed with 'missing or corrupt'."""
    from datamodules.lm import DataConfig, LMDataModule
    from datamodules.probe import EPISODE_LEN

    def datamodule():
        return LMDataModule(DataConfig(name="probe-v5/bounce", batch_size=4, max_tokens=64 * EPISODE_LEN,
                                       cache_dir=str(tmp_path)), block_size=128)

    late = datamodule()
    checks = []
    real = late._complete
    late._complete = lambda corpus, folder: bool(checks.append(1)) or (len(checks) > 1 and real(corpus, folder))
    first = datamodule()
    first.prepare_data()  # A writes the cache
    folder = first._folder(first.corpus)
    meta = (folder / "meta.json").stat().st_mtime_ns
    late.prepare_data()  # B: "missing" before the lock, complete under it
    assert len(checks) == 2 and (folder / "meta.json").stat().st_mtime_ns == meta
    late.setup("fit")
