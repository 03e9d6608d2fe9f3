"""XSUM: data layout and bad input, beam search with KV-cache reordering on every variant, ROUGE, end to end."""
from __future__ import annotations

import itertools
import json
import math
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from architectures import KVCache, ModelConfig, build_model, variant_names
from datamodules.corpora import DataError
from datamodules.tokenizer import get_tokenizer
from datamodules.xsum import (IGNORE, SEPARATOR, SummaryTrainSet, XSumDataModule, encode, load_split, prompt_ids,
                              training_sequence)
from lightning_modules.xsum import beam_search, greedy_summaries, make_rouge
from tests.conftest import tiny_layers

SEP = [90, 91, 92]
EOT = 99


pytestmark = pytest.mark.usefixtures("offline", "one_thread")  # fixtures in tests/conftest.py


def write_xsum(folder, train, validation):
    """train.jsonl and validation-00000-of-00001.parquet in the Hub's schema (document, summary, id)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    table = pa.table({k: [r[k] for r in validation] for k in ("document", "summary", "id")})
    pq.write_table(table, folder / "validation-00000-of-00001.parquet")
    return folder


def _row(i, document, summary):
    return {"document": document, "summary": summary, "id": str(30_000_000 + i)}


# ---------------------------------------------------------------------------- layout
def test_loss_covers_exactly_the_summary_and_eot():
    doc = torch.arange(10, 30).numpy()
    summary = torch.tensor([40, 41, 42]).numpy()
    inputs, targets = training_sequence(doc, SEP, summary, EOT, block_size=64)
    assert inputs.tolist() == doc.tolist() + SEP + [40, 41, 42]
    assert targets.tolist() == [IGNORE] * (len(doc) + len(SEP) - 1) + [40, 41, 42, EOT]


def test_long_documents_are_cut_from_their_end_never_the_summary():
    doc = torch.arange(100, 200).numpy()
    summary = torch.arange(1, 11).numpy()
    inputs, targets = training_sequence(doc, SEP, summary, EOT, block_size=32)
    assert len(inputs) == 32
    assert inputs[:15].tolist() == doc[:15].tolist()  # the beginning of the document survives
    assert [t for t in targets.tolist() if t != IGNORE] == summary.tolist() + [EOT]
    assert training_sequence(doc, SEP, torch.arange(1, 30).numpy(), EOT, block_size=32) is None
    prompt = prompt_ids(doc, SEP, block_size=32, max_new_tokens=8)
    assert len(prompt) + 8 == 32 and prompt[-3:].tolist() == SEP and prompt[:5].tolist() == doc[:5].tolist()
    with pytest.raises(DataError, match="max_new_tokens"):
        prompt_ids(doc, SEP, block_size=32, max_new_tokens=29)


def test_examples_whose_summary_cannot_fit_are_skipped_and_counted(tmp_path, capsys):
    tok = get_tokenizer("bytes", tmp_path)
    rows = [_row(0, "short doc", "ok"), _row(1, "doc", "x" * 80), _row(2, "another doc", "fine")]
    folder = write_xsum(tmp_path / "x", rows, rows)
    data = load_split("train", [str(folder)])
    train = SummaryTrainSet(encode(data, tok, 48), tok.encode(SEPARATOR), tok.eot_id, 48, "xsum/train")
    assert len(train) == 2
    err = capsys.readouterr().err
    assert "skipped 1 of 3 examples" in err and "(ids 30000001)" in err


def test_local_files_in_the_hub_schema_and_bad_input(tmp_path, capsys):
    rows = [_row(i, f"document {i} text", f"summary {i}") for i in range(4)]
    folder = write_xsum(tmp_path / "ok", rows, rows[:2])
    train, val = load_split("train", [str(folder)]), load_split("validation", [str(folder)])
    assert train.documents == [r["document"] for r in rows] and val.ids == ["30000000", "30000001"]
    with pytest.raises(DataError, match="no test file"):
        load_split("test", [str(folder)])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text(json.dumps({"document": "d", "id": "1"}) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl:1: missing column\(s\) \['summary'\]"):
        load_split("train", [str(bad)])
    pq.write_table(pa.table({"document": ["d"], "summary": ["s"]}), bad / "validation.parquet")
    with pytest.raises(DataError, match=r"validation\.parquet: missing column\(s\) \['id'\]"):
        load_split("validation", [str(bad)])
    (bad / "train.jsonl").write_text("".join(json.dumps(_row(i, " " if i == 1 else "d", "s")) + "\n" for i in range(3)))
    with pytest.raises(DataError, match=r"train\.jsonl: row 1 \(id 30000001\) has an empty document.*--data\.drop_empty"):
        load_split("train", [str(bad)])
    assert len(load_split("train", [str(bad)], drop_empty=True)) == 2
    assert "dropped 1 of 3 rows with an empty document or summary (ids 30000001)" in capsys.readouterr().err
    (bad / "articles.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="cannot tell the split of .*articles.jsonl"):
        load_split("train", [str(bad)])


def test_offline_hub_xsum_fails_fast_naming_dataset_and_option():
    start = time.time()
    with pytest.raises(DataError, match=r"EdinburghNLP/xsum.*refs/convert/parquet.*offline.*--data\.path"):
        load_split("train")
    assert time.time() - start < 5


# ---------------------------------------------------------------------------- KV cache and beam search
def test_kv_cache_reorder_follows_rows_including_per_row_entries():
    cache = KVCache()
    k = torch.arange(3 * 2 * 4 * 1, dtype=torch.float).view(3, 2, 4, 1)
    cache.append("block0", k, -k)
    cache.append("block1.row0", torch.full((1, 2, 2, 1), 10.0), torch.zeros(1, 2, 2, 1))
    cache.append("block1.row2", torch.full((1, 2, 5, 1), 12.0), torch.zeros(1, 2, 5, 1))
    cache.state("key_valid")["block0"] = torch.tensor([[1, 0], [1, 1], [0, 1]], dtype=torch.bool)
    cache.offset = 4
    cache.reorder(torch.tensor([2, 2, 0, 1]))
    assert torch.equal(cache.layers["block0"][0], k[[2, 2, 0, 1]]) and torch.equal(cache.layers["block0"][1], -k[[2, 2, 0, 1]])
    assert sorted(cache.layers) == ["block0", "block1.row0", "block1.row1", "block1.row2"]
    assert cache.length("block1.row0") == cache.length("block1.row1") == 5 and cache.length("block1.row2") == 2
    assert cache.length("block1.row3") == 0  # old row 1 had processed nothing in block 1
    assert cache.state("key_valid")["block0"].tolist() == [[0, 1], [0, 1], [1, 0], [1, 1]] and cache.offset == 4


def test_beam_search_with_enough_beams_is_exhaustive_search():
    torch.manual_seed(3)
    model = build_model(ModelConfig(vocab_size=6, d_model=16, n_layer=1, n_head=2, block_size=16)).eval()
    prompt = torch.tensor([1, 4, 2])
    best, best_score = None, -math.inf
    torch.set_grad_enabled(False)
    for seq in itertools.product(range(6), repeat=3):
        full = torch.cat([prompt, torch.tensor(seq)])[None]
        logp = F.log_softmax(model(full).logits[0, 2:-1].float(), dim=-1)
        score = sum(float(logp[i, t]) for i, t in enumerate(seq))
        if score > best_score:
            best, best_score = list(seq), score
    torch.set_grad_enabled(True)
    assert beam_search(model, prompt, num_beams=36, max_new_tokens=3) == best
    assert beam_search(model, prompt, num_beams=36, max_new_tokens=3, use_cache=False) == best


def test_beam_search_on_every_variant_matches_the_uncached_search_and_greedy(monkeypatch):
    reorders = []
    real = KVCache.reorder
    monkeypatch.setattr(KVCache, "reorder", lambda self, index: reorders.append(index.tolist()) or real(self, index))
    checked = []
    for variant in variant_names():
        torch.manual_seed(0)
        model = build_model(ModelConfig(variant=variant, vocab_size=40, d_model=32, n_layer=tiny_layers(variant, 2),
                                        n_head=2, block_size=32))
        prompt = torch.randint(0, 40, (9,))
        cached = beam_search(model, prompt, num_beams=3, max_new_tokens=6, eos_token_id=5)
        assert cached == beam_search(model, prompt, num_beams=3, max_new_tokens=6, eos_token_id=5, use_cache=False), variant
        greedy = model.generate(prompt[None], 6, greedy=True)[0, 9:].tolist()
        assert beam_search(model, prompt, num_beams=1, max_new_tokens=6) == greedy, variant
        checked.append(variant)
    assert checked == variant_names()
    assert any(r != sorted(r) for r in reorders)  # beams really were reordered, not only extended


def test_greedy_summaries_batch_equal_lengths_and_cut_at_eos():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=30, d_model=16, n_layer=1, n_head=2, block_size=32))
    prompts = [torch.randint(0, 30, (n,)) for n in (5, 7, 5)]
    outs = greedy_summaries(model, prompts, max_new_tokens=6, eos=3)
    for prompt, out in zip(prompts, outs):
        single = model.generate(prompt[None], 6, greedy=True, eos_token_id=3)[0, len(prompt):].tolist()
        assert out == (single[: single.index(3)] if 3 in single else single) and 3 not in out


# ---------------------------------------------------------------------------- ROUGE
def test_rouge_equals_a_hand_computation_offline():
    rouge = make_rouge(stemmer=False)
    scores = rouge(["The cat sat on the mat."], ["the cat was on the mat"])
    # unigrams: 5 of 6 shared; bigrams: "the cat", "on the", "the mat" of 5; LCS "the cat on the mat" = 5
    assert float(scores["rouge1_fmeasure"]) == pytest.approx(5 / 6, abs=1e-4)
    assert float(scores["rouge2_fmeasure"]) == pytest.approx(3 / 5, abs=1e-4)
    assert float(scores["rougeL_fmeasure"]) == pytest.approx(5 / 6, abs=1e-4)
    scores = make_rouge(stemmer=False)(["a b c d"], ["a x c"])
    p, r = 2 / 4, 2 / 3
    assert float(scores["rouge1_fmeasure"]) == pytest.approx(2 * p * r / (p + r), abs=1e-4)
    assert float(scores["rouge2_fmeasure"]) == 0.0


# ---------------------------------------------------------------------------- end to end
def test_xsum_end_to_end_memorises_and_generates_the_summaries(tmp_path, capsys):
    from experiments.finetune import main

    rows = [_row(0, "The cat sat on the mat all day long.", "A lazy cat."),
            _row(1, "Rain fell on the town for a week.", "Wet week.")]
    folder = write_xsum(tmp_path / "xsum", rows * 4, rows)
    run_dir = main(["--task", "xsum", "--variant", "vanilla", "--tokenizer", "bytes", "--data.path", str(folder),
                    "--model.d_model", "64", "--model.n_layer", "2", "--model.n_head", "2", "--model.block_size", "64",
                    "--batch_size", "8", "--max_steps", "80", "--epochs", "100", "--lr", "3e-3", "--dropout", "0",
                    "--warmup_ratio", "0", "--num_beams", "2", "--max_new_tokens", "12", "--log_dir", str(tmp_path / "runs"),
                    "--trainer.enable_progress_bar", "false"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run_dir)
    result = json.loads((run_dir / "results.json").read_text())
    predictions = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions] == ["30000000", "30000001"]
    assert [p["prediction"] for p in predictions] == ["A lazy cat.", "Wet week."]
    assert result["rouge"] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0} and result["decoding"] == "beam2"
    assert result["steps"] == 80 and result["val_summary_loss"] < 0.1


def test_xsum_generation_runs_on_a_routed_variant(tmp_path):
    from experiments.finetune import main

    rows = [_row(i, f"Document number {i} says something.", f"Summary {i}.") for i in range(3)]
    folder = write_xsum(tmp_path / "xsum", rows, rows)
    run_dir = main(["--task", "xsum", "--variant", "mod", "--tokenizer", "bytes", "--data.path", str(folder),
                    "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2", "--model.block_size", "64",
                    "--max_steps", "2", "--batch_size", "2", "--max_new_tokens", "6", "--log_dir", str(tmp_path / "runs"),
                    "--trainer.enable_progress_bar", "false"])
    result = json.loads((run_dir / "results.json").read_text())
    assert result["variant"] == "mod" and set(result["rouge"]) == {"rouge1", "rouge2", "rougeL"}
    assert all(0.0 <= v <= 1.0 for v in result["rouge"].values()) and result["eval_examples"] == 3


# ---------------------------------------------------------------------------- real files (optional)
def test_real_xsum_sample_with_real_gpt2_tokenizer(shared_data, tmp_path):
    lines = (shared_data / "xsum" / "xsum_test_sample.jsonl").read_text().splitlines()
    folder = tmp_path / "xsum"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(lines[:6]) + "\n")
    (folder / "validation.jsonl").write_text("\n".join(lines[6:10]) + "\n")
    gpt2 = get_tokenizer(str(shared_data / "gpt2_tokenizer"), tmp_path)
    dm = XSumDataModule(gpt2, block_size=256, path=[str(folder)], max_new_tokens=40)
    dm.setup("fit")
    sep = gpt2.encode(SEPARATOR)
    rows = [json.loads(line) for line in lines[:6]]
    for (inputs, targets), row in zip(dm.train_set.items, rows):
        summary = [t for t in targets.tolist() if t != IGNORE]
        assert gpt2.decode(summary[:-1]).strip() == row["summary"].strip() and summary[-1] == 50256
        start = len(inputs) + 1 - len(summary) - len(sep)
        assert inputs[start:start + len(sep)].tolist() == sep and len(inputs) <= 256
        assert row["document"].strip().startswith(gpt2.decode(inputs[:start].tolist()))  # cut from the end only
    for prompt, row in zip(dm.eval_set.prompts, [json.loads(line) for line in lines[6:10]]):
        assert len(prompt) + 40 <= 256 and prompt[-len(sep):].tolist() == sep
        assert row["document"].strip().startswith(gpt2.decode(prompt[:-len(sep)].tolist()))
    shutil.rmtree(folder)
