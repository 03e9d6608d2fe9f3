"""Embedded corpus, tokenizers, the token cache and the resumable sampler."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from datamodules import cache_build, token_cache
from datamodules.catalog import get_corpus
from datamodules.corpora import DataError, EmbeddedCorpus, TextFilesCorpus
from datamodules.lm import DataConfig, LMDataModule, PackedBlocks, ResumableShardSampler, validation_indices
from datamodules.tokenizer import EOT, get_tokenizer


def test_embedded_corpus_is_english_prose_of_a_few_megabytes():
    corpus = EmbeddedCorpus()
    docs = list(corpus.documents())
    chars = sum(len(d) for d in docs)
    assert 1_000_000 < chars < 10_000_000 and len(docs) > 1000
    text = " ".join(docs[:200]).lower()
    for word in (" the ", " and ", " is "):
        assert word in text
    assert corpus.fingerprint() == EmbeddedCorpus().fingerprint()


def test_bytes_tokenizer_round_trips_and_has_eot(tmp_path):
    tok = get_tokenizer("bytes", tmp_path)
    assert tok.vocab_size == 257 and tok.eot_id == 256
    text = "héllo wörld\n\tdone"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text


def test_bpe_is_trained_once_and_cached(tmp_path):
    corpus = TextFilesCorpus([str(_write_text(tmp_path / "a.txt", "the cat sat on the mat. " * 200))])
    first = get_tokenizer("bpe", tmp_path, corpus)
    files = list((tmp_path / "tokenizers").iterdir())
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    second = get_tokenizer("bpe", tmp_path, corpus)
    assert second.fingerprint == first.fingerprint and files[0].stat().st_mtime_ns == mtime
    assert first.decode(first.encode("the cat sat")) == "the cat sat"
    assert first.tokenizer.token_to_id(EOT) == first.eot_id


def test_gpt2_tokenizer_from_local_folder(shared_data):
    tok = get_tokenizer(str(shared_data / "gpt2_tokenizer"), shared_data)
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("The quick brown fox jumps over the lazy dog.") == [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]


def test_gpt2_tokenizer_offline_fails_fast_with_advice(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", "from datamodules.tokenizer import get_tokenizer; import pathlib;"
                           "get_tokenizer('gpt2', pathlib.Path('.'))"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and time.time() - start < 30
    assert "vocab.json + merges.txt" in proc.stderr and "--tokenizer" in proc.stderr


def test_unknown_tokenizer_and_dataset_list_valid_names(tmp_path):
    with pytest.raises(DataError, match="bpe, bytes, gpt2"):
        get_tokenizer("no-such-tokenizer", tmp_path)
    with pytest.raises(DataError, match="embedded"):
        get_corpus("no-such-dataset")


def _write_text(path, text):
    path.write_text(text)
    return path


def _build(tmp_path, text="alpha beta gamma delta. " * 400):
    corpus = TextFilesCorpus([str(_write_text(tmp_path / "c.txt", text))])
    tok = get_tokenizer("bytes", tmp_path)
    folder = token_cache.cache_folder(tmp_path, corpus.fingerprint(), tok)
    cache_build.build_tokens(corpus.documents(), tok, folder)
    return corpus, tok, folder


def test_token_cache_contents_and_atomic_layout(tmp_path):
    corpus, tok, folder = _build(tmp_path)
    tokens = token_cache.open_tokens(folder)
    text = next(corpus.documents())
    assert tokens.dtype == np.uint16 and len(tokens) == len(text.encode()) + 1
    assert tokens[-1] == tok.eot_id and tok.decode(tokens[:-1].tolist()) == text
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"]  # no temp files left


def test_a_cache_records_its_format_and_one_written_before_the_field_is_format_1(tmp_path):
    _, _, folder = _build(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == token_cache.FORMAT
    del meta["format"]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert (token_cache.open_tokens(folder) is not None) == (token_cache.FORMAT == 1)


def test_a_later_cache_format_keys_its_own_folder_and_its_own_partial_builds(tmp_path, monkeypatch):
    corpus = TextFilesCorpus([str(_write_text(tmp_path / "c.txt", "alpha beta. " * 50))])
    tok = get_tokenizer("bytes", tmp_path)
    first = token_cache.cache_folder(tmp_path, corpus.fingerprint(), tok)
    key = cache_build.build_key(tok, "uint16", 8, None)
    assert not first.name.endswith("-f1") and "format" not in key  # format 1: the names and keys of before
    monkeypatch.setattr(token_cache, "FORMAT", 2)
    assert token_cache.cache_folder(tmp_path, corpus.fingerprint(), tok).name == first.name + "-f2"
    assert cache_build.build_key(tok, "uint16", 8, None) == {**key, "format": 2}  # a format-1 partial build: not resumed


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta", "bad_meta", "other_format"])
def test_corrupt_or_partial_cache_is_detected_and_rebuilt(tmp_path, damage):
    corpus, tok, folder = _build(tmp_path)
    good = np.array(token_cache.open_tokens(folder))
    data = folder / "tokens.bin"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "no_meta":
        (folder / "meta.json").unlink()
    elif damage == "other_format":  # written by code whose tokens differ: intact, but not this code's cache
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "format": token_cache.FORMAT + 1}))
    else:
        (folder / "meta.json").write_text("{not json")
    assert token_cache.open_tokens(folder) is None
    dm = LMDataModule(DataConfig(name="text", tokenizer="bytes", path=[str(tmp_path / "c.txt")], cache_dir=str(tmp_path)),
                      block_size=16)
    dm.prepare_data()
    np.testing.assert_array_equal(np.array(token_cache.open_tokens(folder)), good)


def test_validation_split_is_deterministic_disjoint_and_sized():
    val = validation_indices(10_000, 0.05)
    assert np.array_equal(val, validation_indices(10_000, 0.05))
    assert 400 < len(val) < 600
    assert len(validation_indices(3, 0.05)) == 1


def test_packed_blocks_overlap_by_one_token():
    tokens = np.arange(50, dtype=np.uint16)
    blocks = PackedBlocks(tokens, 8)
    assert len(blocks) == 6
    assert blocks[0].tolist() == list(range(9)) and blocks[1].tolist() == list(range(8, 17))


def test_sampler_shards_ranks_disjointly_and_resumes_exactly():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it) for _ in range(n)]

    r0 = take(ResumableShardSampler(100, 4, 0, 2, seed=3), 48)
    r1 = take(ResumableShardSampler(100, 4, 1, 2, seed=3), 48)
    first_epoch = [i for b in range(12) for i in r0[4 * b:4 * b + 4] + r1[4 * b:4 * b + 4]]
    assert len(set(first_epoch)) == 96  # one epoch: 12 global batches of 8 distinct blocks
    resumed = take(ResumableShardSampler(100, 4, 0, 2, seed=3, start=20), 28)
    assert resumed == r0[20:48]
    with pytest.raises(DataError, match="batch_size"):
        ResumableShardSampler(5, 4, 0, 2, seed=0)


def test_datamodule_end_to_end_on_embedded_corpus():
    dm = LMDataModule(DataConfig(batch_size=4), block_size=64, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 65) and batch.max() < dm.vocab_size
    train = set(dm.train_set.indices.tolist())
    val = set(dm.val_sets["val"].indices.tolist())
    assert not train & val and len(val) > 0
    meta = json.loads((dm._folder(dm.corpus) / "meta.json").read_text())
    assert meta["vocab_size"] == dm.vocab_size == 4096


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("val_fraction", 0.9), ("num_workers", -1)])
def test_bad_data_config_names_field(field, value):
    with pytest.raises(DataError, match=f"data.{field}"):
        DataConfig(**{field: value}).validate()


# ---------------------------------------------------------------------------- faults (issue 14)
def test_orphan_temporary_files_of_a_killed_build_are_removed_by_the_next_build(tmp_path):
    corpus, tok, folder = _build(tmp_path)
    (folder / "meta.json").unlink()  # as if the build had been killed before meta.json
    orphans = [folder / "tokens.bin.tmpa1b2c3", folder / "tokens.bin.tmpzz", folder / "meta.json.tmpq"]
    for orphan in orphans:
        orphan.write_bytes(b"\0" * 1000)
        _age(orphan)
    live = folder / "tokens.bin.tmplive"  # another job building the same shared cache right now
    live.write_bytes(b"\0" * 1000)
    cache_build.build_tokens(corpus.documents(), tok, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin", "tokens.bin.tmplive"]


def _age(path, seconds=token_cache.ORPHAN_AGE_S + 60):
    """Back-date a file (and what a folder holds) as a build killed long ago would have left it."""
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        then = time.time() - seconds
        os.utime(p, (then, then))


def test_orphan_scratch_folder_of_a_killed_dataset_build_is_removed(tmp_path):
    """``map.tmp*``: the scratch of the datasets.map build before the sharded one."""
    tok = get_tokenizer("bytes", tmp_path)
    folder = tmp_path / "cache"
    (folder / "map.tmpdead" / "ids.arrow").parent.mkdir(parents=True)
    (folder / "map.tmpdead" / "ids.arrow").write_bytes(b"\0" * 100)
    (folder / "tokens.bin.tmpdead").write_bytes(b"\0" * 100)
    _age(folder / "map.tmpdead")
    _age(folder / "tokens.bin.tmpdead")
    cache_build.build_tokens(["abc", "def"] * 10, tok, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokens.bin"]


def test_cache_files_follow_the_users_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        _, _, folder = _build(tmp_path)
    finally:
        os.umask(previous)
    for name in ("tokens.bin", "meta.json"):
        assert (folder / name).stat().st_mode & 0o777 == 0o640, name  # 0o666 & ~0o027, not mkstemp's 0o600


def test_checksum_covers_every_chunk_and_large_caches_verify_each_chunk_when_first_read(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 256)
    corpus, tok, folder = _build(tmp_path)  # 9601 tokens x 2 bytes: 76 chunks of 256 bytes (the last short)
    meta = token_cache.read_meta(folder)
    assert meta["chunk_bytes"] == 256 and len(meta["chunk_sha256"]) == -(-meta["num_tokens"] * 2 // 256)
    data = folder / "tokens.bin"
    raw = bytearray(data.read_bytes())
    raw[40 * 256 + 7] ^= 0x01  # one bit in the middle of the file
    data.write_bytes(bytes(raw))
    assert token_cache.open_tokens(folder) is None  # small cache: every chunk checked when opened
    cache_build.build_tokens(corpus.documents(), tok, folder)
    data.write_bytes(bytes(raw))
    monkeypatch.setattr(token_cache, "EAGER_VERIFY_BYTES", 1024)  # "large": only first and last chunk at open
    tokens = token_cache.open_tokens(folder)
    assert tokens is not None
    blocks = PackedBlocks(tokens, 16, verifier=token_cache.verifier(folder))
    blocks[0], blocks[len(blocks) - 1]  # clean chunks read fine
    corrupt_block = 40 * 256 // 2 // 16
    with pytest.raises(DataError, match=r"tokens\.bin is corrupt \(chunk 40 of 76.*rebuilt on the next run"):
        blocks[corrupt_block]
    assert not (folder / "meta.json").exists()  # the next prepare_data rebuilds it
