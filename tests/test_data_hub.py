"""OpenWebText and SlimPajama corpora from local fixtures in the Hub's exact schema, offline.

Fixtures: SlimPajama-6B parquet (``text``, ``meta`` struct with ``redpajama_set_name``,
``__index_level_0__``) and SlimPajama-627B-style jsonl (``meta`` object); OpenWebText parquet/jsonl/txt.
"""
from __future__ import annotations

import json
import pathlib
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datamodules import cache_build, hub, lm, token_cache
from datamodules.cache_build import build_corpus_cache
from datamodules.catalog import get_corpus
from datamodules.corpora import DataError, TextFilesCorpus
from datamodules.lm import DataConfig, LMDataModule
from datamodules.tokenizer import get_tokenizer
from tests.conftest import TINY_RUN

SETS = hub.SLIMPAJAMA_TRAIN_SETS + hub.SLIMPAJAMA_OOD_SETS


pytestmark = pytest.mark.usefixtures("offline", "one_thread")  # fixtures in tests/conftest.py


def _rows(split: str, n: int, offset: int = 0):
    # distinct, recognisable text per row: "<split> <subset> <i>"
    return [{"text": f"{split} {SETS[i % 7]} {i} " + "lorem ipsum dolor sit amet. " * 3,
             "meta": {"redpajama_set_name": SETS[i % 7]}} for i in range(offset, offset + n)]


def write_parquet(path: pathlib.Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": [r["text"] for r in rows], "meta": [r["meta"] for r in rows],
                      "__index_level_0__": pa.array(range(len(rows)), pa.int64())})
    pq.write_table(table, path)
    return path


def write_jsonl(path: pathlib.Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def slimpajama_6b(tmp_path):
    root = tmp_path / "SlimPajama-6B" / "data"
    write_parquet(root / "train-00000-of-00002-aa.parquet", _rows("train", 28))
    write_parquet(root / "train-00001-of-00002-bb.parquet", _rows("train", 14, offset=28))
    write_parquet(root / "validation-00000-of-00001-cc.parquet", _rows("validation", 21))
    write_parquet(root / "test-00000-of-00001-dd.parquet", _rows("test", 7))
    return root


def test_slimpajama_trains_on_cc_and_c4_and_validates_per_other_subset(slimpajama_6b, tmp_path):
    corpus = get_corpus("slimpajama", path=[str(slimpajama_6b)], cache_dir=tmp_path / "cache")
    expected_train = [r["text"] for r in _rows("train", 42) if r["meta"]["redpajama_set_name"] in hub.SLIMPAJAMA_TRAIN_SETS]
    assert list(corpus.documents()) == expected_train  # file order, both shards, CC + C4 only
    sets = corpus.validation_sets()
    assert list(sets) == ["val", *hub.SLIMPAJAMA_OOD_SETS]
    validation = _rows("validation", 21)
    assert list(sets["val"].documents()) == [r["text"] for r in validation
                                             if r["meta"]["redpajama_set_name"] in hub.SLIMPAJAMA_TRAIN_SETS]
    for name in hub.SLIMPAJAMA_OOD_SETS:
        docs = list(sets[name].documents())
        assert docs == [r["text"] for r in validation if r["meta"]["redpajama_set_name"] == name] and len(docs) == 3
    fingerprints = {c.fingerprint() for c in [corpus, *sets.values()]}
    assert len(fingerprints) == 1 + len(sets)  # every set has its own cache


def test_slimpajama_jsonl_without_validation_files_holds_out_cc_c4(tmp_path, capsys):
    rows = [r for r in _rows("train", 70) if r["meta"]["redpajama_set_name"] != "RedPajamaBook"]
    write_jsonl(tmp_path / "sp" / "train" / "chunk1" / "example_train_0.jsonl", rows)
    corpus = get_corpus("slimpajama", path=[str(tmp_path / "sp")], cache_dir=tmp_path / "cache")
    sets = corpus.validation_sets()
    message = capsys.readouterr().err
    assert "RedPajamaBook" in message and "skipped" in message and "no validation files" in message
    assert list(sets) == ["val"] + [n for n in hub.SLIMPAJAMA_OOD_SETS if n != "RedPajamaBook"]
    cc_c4 = [r["text"] for r in rows if r["meta"]["redpajama_set_name"] in hub.SLIMPAJAMA_TRAIN_SETS]
    train, val = list(corpus.documents()), list(sets["val"].documents())
    assert val and not set(train) & set(val) and sorted(train + val) == sorted(cc_c4)
    assert list(sets["RedPajamaGithub"].documents()) == [r["text"] for r in rows
                                                         if r["meta"]["redpajama_set_name"] == "RedPajamaGithub"]


def test_slimpajama_datamodule_has_one_validation_loader_per_subset(slimpajama_6b, tmp_path):
    dm = LMDataModule(DataConfig(name="slimpajama", tokenizer="bytes", path=[str(slimpajama_6b)],
                                 cache_dir=str(tmp_path / "cache"), batch_size=2), block_size=16)
    assert dm.val_names_from_corpus() == ["val", *hub.SLIMPAJAMA_OOD_SETS]
    dm.prepare_data()
    dm.setup("fit")
    assert list(dm.val_sets) == ["val", *hub.SLIMPAJAMA_OOD_SETS]
    loaders = dm.val_dataloader()
    assert len(loaders) == 6
    github = dm.tokenizer.decode(np.asarray(dm.val_sets["RedPajamaGithub"].tokens).tolist())
    assert github.count("validation RedPajamaGithub") == 3 and "C4" not in github
    tokens = token_cache.open_tokens(dm._folder(dm.corpus))
    text = dm.tokenizer.decode(tokens[tokens != dm.tokenizer.eot_id].tolist())
    assert "train RedPajamaC4" in text and "train RedPajamaCommonCrawl" in text and "Github" not in text


def test_slimpajama_ood_losses_are_logged_under_their_own_names(slimpajama_6b, tmp_path):
    from experiments.run import main

    run_dir = main(["--data", "slimpajama", "--data.path", f"[{slimpajama_6b}]", "--tokenizer", "bytes",
                    "--data.cache_dir", str(tmp_path / "cache"), "--max_steps", "2", "--val_every", "2",
                    "--log_dir", str(tmp_path / "runs"), *TINY_RUN, "--model.block_size", "16"])
    metrics = json.loads((run_dir / "summary.json").read_text())["val_metrics"]
    for name in hub.SLIMPAJAMA_OOD_SETS:
        assert 0 < metrics[f"val/{name}/loss"] < 10
    assert 0 < metrics["val/loss"] < 10


def test_missing_or_malformed_columns_name_the_file(tmp_path):
    bad = write_jsonl(tmp_path / "a" / "train.jsonl", [{"text": "x", "meta": "{'redpajama_set_name': 'RedPajamaC4'}"}])
    with pytest.raises(DataError, match=re.escape(str(bad)) + ".*'meta' is not an object"):
        get_corpus("slimpajama", path=[str(bad)], cache_dir=tmp_path).documents().__next__()
    table = pa.table({"content": ["no text column"]})
    pq.write_table(table, tmp_path / "owt.parquet")
    with pytest.raises(DataError, match=r"owt\.parquet: missing column 'text'"):
        next(get_corpus("openwebtext", path=[str(tmp_path / "owt.parquet")], cache_dir=tmp_path).documents())
    with pytest.raises(DataError, match="does not exist"):
        get_corpus("openwebtext", path=[str(tmp_path / "nope")], cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        get_corpus("openwebtext", path=[str(tmp_path / "empty")], cache_dir=tmp_path)


@pytest.mark.parametrize("name,dataset", [("openwebtext", "Skylion007/openwebtext"), ("slimpajama", "DKYoon/SlimPajama-6B")])
def test_offline_hub_corpus_fails_fast_naming_dataset_and_path_option(tmp_path, name, dataset):
    start = time.time()
    with pytest.raises(DataError) as err:
        get_corpus(name, cache_dir=tmp_path)
    assert time.time() - start < 5
    assert dataset in str(err.value) and "--data.path" in str(err.value) and "offline" in str(err.value)


def test_offline_cli_run_names_dataset(tmp_path, capsys):
    from experiments.run import main

    with pytest.raises(DataError, match="Skylion007/openwebtext.*--data.path"):
        main(["--data", "openwebtext", "--tokenizer", "bytes", "--data.cache_dir", str(tmp_path),
              "--log_dir", str(tmp_path), *TINY_RUN])


def test_offline_with_a_built_cache_does_not_need_the_hub(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(DataError):
        get_corpus("openwebtext", cache_dir=cache)
    # what a previous online run leaves behind: one cache folder per corpus view
    train = hub.HubCorpus("openwebtext", hub.Source("openwebtext", hub.OPENWEBTEXT_ID, hub.OPENWEBTEXT_REVISION, None,
                                                     ["text"], cache, False, None, ""), "train",
                          hub.Selection(fraction=hub.OPENWEBTEXT_VAL_FRACTION))
    val = hub.HubCorpus("openwebtext", train.source, "train",
                        hub.Selection(fraction=hub.OPENWEBTEXT_VAL_FRACTION, side="take"))
    folders = [cache / "tokens" / f"{corpus.fingerprint()}-gpt2-0123" for corpus in (train, val)]

    def leave(meta, tokens=b"\0" * 4):
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "tokens.bin").write_bytes(tokens)
            (folder / "meta.json").write_text(json.dumps(meta))

    complete = {"num_tokens": 2, "dtype": "uint16", "format": token_cache.FORMAT}
    # a cache this code would not read (another format, cut short, no meta fields) is rebuilt, which offline
    # cannot happen: the fast error still comes first, before a tokenizer or a model is built
    for stale, tokens in (({**complete, "format": token_cache.FORMAT + 1}, b"\0" * 4), (complete, b"\0" * 3), ({}, b"")):
        leave(stale, tokens)
        with pytest.raises(DataError, match="offline"):
            get_corpus("openwebtext", cache_dir=cache)
    leave(complete)
    corpus = get_corpus("openwebtext", cache_dir=cache)
    assert corpus.fingerprint() == train.fingerprint() and corpus.validation_sets()["val"].fingerprint() == val.fingerprint()


def test_openwebtext_local_files_keep_order_across_formats(tmp_path):
    pq.write_table(pa.table({"text": ["parquet doc one", "parquet doc two"]}), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "jsonl doc", "url": "u"}])
    (tmp_path / "c.txt").write_text("a whole text file\n\nis one document")
    corpus = get_corpus("openwebtext", path=[str(tmp_path)], cache_dir=tmp_path / "cache")
    assert list(corpus.documents()) == ["parquet doc one", "parquet doc two", "jsonl doc",
                                        "a whole text file\n\nis one document"]
    assert corpus.validation_sets() is None  # local files: the DataModule's block hold-out
    before = corpus.fingerprint()
    time.sleep(1.1)
    (tmp_path / "c.txt").write_text("changed")
    assert get_corpus("openwebtext", path=[str(tmp_path)], cache_dir=tmp_path / "cache").fingerprint() != before


def test_openwebtext_holdout_is_fixed_disjoint_and_about_0_05_percent():
    class Rows:
        def __len__(self):
            return 200_000

    take = hub.Selection(fraction=hub.OPENWEBTEXT_VAL_FRACTION, side="take").rows(Rows())
    keep = hub.Selection(fraction=hub.OPENWEBTEXT_VAL_FRACTION).rows(Rows())
    assert 60 < len(take) < 140 and len(take) + len(keep) == 200_000 and not set(take) & set(keep)
    streamed = [i for i in range(200_000) if hub.Selection(fraction=hub.OPENWEBTEXT_VAL_FRACTION, side="take").keep({}, i)]
    assert streamed == take.tolist()  # the streaming decision is the same rule


def test_two_process_tokenisation_equals_the_one_process_path_and_the_cap_is_a_prefix(tmp_path):
    texts = [f"document {i}: " + "words and more words " * (i % 7) for i in range(300)]
    tok = get_tokenizer("bytes", tmp_path)
    cache_build.build_tokens(iter(texts), tok, tmp_path / "seq")
    cache_build.build_tokens(iter(texts), tok, tmp_path / "two", num_proc=2)
    seq, two = token_cache.open_tokens(tmp_path / "seq"), token_cache.open_tokens(tmp_path / "two")
    np.testing.assert_array_equal(seq, two)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["meta.json", "tokens.bin"]  # nothing else left
    cache_build.build_tokens(iter(texts), tok, tmp_path / "cap", max_tokens=1000, num_proc=2)
    capped = token_cache.open_tokens(tmp_path / "cap")
    assert len(capped) == 1000 and np.array_equal(capped, seq[:1000])


def test_cache_is_reused_and_rebuilt_when_the_tokenizer_changes(slimpajama_6b, tmp_path, monkeypatch):
    calls = []
    real = lm.build_corpus_cache
    monkeypatch.setattr(lm, "build_corpus_cache", lambda *a, **k: calls.append(a[3]) or real(*a, **k))

    def prepare(tokenizer):
        dm = LMDataModule(DataConfig(name="slimpajama", tokenizer=tokenizer, path=[str(slimpajama_6b)],
                                     cache_dir=str(tmp_path / "cache")), block_size=16)
        dm.prepare_data()
        return dm

    first = prepare("bytes")
    assert len(calls) == 7  # train, val and five out-of-distribution sets
    folder = first._folder(first.corpus)
    stamp = (folder / "tokens.bin").stat().st_mtime_ns
    prepare("bytes")
    assert len(calls) == 7 and (folder / "tokens.bin").stat().st_mtime_ns == stamp  # reused
    other = tmp_path / "tok"
    other.mkdir()
    bpe_corpus = TextFilesCorpus([str(_text(tmp_path / "t.txt"))])
    (other / "tokenizer.json").write_text(get_tokenizer("bpe", tmp_path, bpe_corpus).tokenizer.to_str())
    second = prepare(str(other))
    assert len(calls) == 14 and second._folder(second.corpus) != folder
    assert token_cache.read_meta(second._folder(second.corpus))["vocab_size"] == second.vocab_size != 257


def _text(path):
    path.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    return path


def test_streaming_and_max_tokens_options_are_validated():
    with pytest.raises(DataError, match="data.max_tokens"):
        DataConfig(max_tokens=1).validate()
    with pytest.raises(DataError, match="data.num_proc"):
        DataConfig(num_proc=0).validate()


# ---------------------------------------------------------------------------- real files (optional)
def test_real_openwebtext_sample_with_real_gpt2_tokenizer(shared_data, tmp_path):
    tok_dir = shared_data / "gpt2_tokenizer"
    dm = LMDataModule(DataConfig(name="openwebtext", tokenizer=str(tok_dir), cache_dir=str(tmp_path),
                                 path=[str(shared_data / "openwebtext" / "openwebtext_sample.txt")]), block_size=64)
    assert dm.tokenizer.encode("Hello world") == [15496, 995]
    dm.prepare_data()
    dm.setup("fit")
    tokens = token_cache.open_tokens(dm._folder(dm.corpus))
    meta = token_cache.read_meta(dm._folder(dm.corpus))
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and tokens[-1] == 50256
    assert dm.tokenizer.decode(tokens[:12].tolist()).startswith("Port-au-Prince, Haiti (CNN)")
    assert 100_000 < len(tokens) < 150_000  # ~500k characters of English


def test_real_redpajama_samples_without_set_names_are_refused(shared_data, tmp_path):
    sample = shared_data / "slimpajama" / "redpajama_fallback_data_juicer" / "redpajama-c4-refined.jsonl"
    with pytest.raises(DataError, match=re.escape(sample.name) + ".*missing column 'meta.redpajama_set_name'"):
        next(get_corpus("slimpajama", path=[str(sample)], cache_dir=tmp_path).documents())


def test_hub_loading_and_streaming_with_a_stubbed_hub(monkeypatch, tmp_path):
    import datasets

    rows, val_rows = _rows("train", 21), _rows("validation", 14)
    calls = []

    def fake_load(hub_id, revision=None, split=None, streaming=False, **_):
        calls.append((hub_id, revision, split, streaming))
        data = datasets.Dataset.from_list(rows if split == "train" else val_rows)
        return data.to_iterable_dataset() if streaming else data

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda hub_id, revision=None: ["train", "validation", "test"])
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    in_train = [r["text"] for r in rows if r["meta"]["redpajama_set_name"] in hub.SLIMPAJAMA_TRAIN_SETS]
    arxiv = [r["text"] for r in val_rows if r["meta"]["redpajama_set_name"] == "RedPajamaArXiv"]
    for streaming in (False, True):
        corpus = get_corpus("slimpajama", streaming=streaming, cache_dir=tmp_path)
        assert list(corpus.documents()) == in_train
        assert list(corpus.validation_sets()["RedPajamaArXiv"].documents()) == arxiv
    assert calls[0] == ("DKYoon/SlimPajama-6B", None, "train", False) and calls[-1][3] is True
    monkeypatch.setattr(hub, "OPENWEBTEXT_STREAM_VAL_DOCS", 3)
    owt = get_corpus("openwebtext", streaming=True, max_tokens=500, cache_dir=tmp_path)
    texts = [r["text"] for r in rows]
    assert list(owt.validation_sets()["val"].documents()) == texts[:3] and list(owt.documents()) == texts[3:]
    assert calls[-1] == ("Skylion007/openwebtext", "refs/convert/parquet", "train", True)
    tok = get_tokenizer("bytes", tmp_path)
    build_corpus_cache(owt, tok, tmp_path / "owt", "tokenising", num_proc=2)
    tokens = token_cache.open_tokens(tmp_path / "owt")
    assert len(tokens) == 500 and tok.decode(tokens[:40].tolist()) == texts[3][:40]
