"""GLUE: the original distribution's TSV layouts and the Hub schema, metrics, pooling, fine-tuning on every variant."""
from __future__ import annotations

import json
import math
import pathlib
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats

from architectures import ModelConfig, build_model, variant_names
from datamodules.corpora import DataError
from datamodules.glue import (GLUE_TASKS, GlueDataModule, encode_split, fit_pair, get_task, load_split,
                              read_hub_file)
from datamodules.tokenizer import get_tokenizer
from lightning_modules.glue import SEPARATOR, GlueModule, decode_input, glue_metrics, glue_score, last_token_features
from tests.conftest import tiny_layers

TINY = dict(vocab_size=257, d_model=32, n_layer=2, n_head=2, block_size=48)
N = 8


pytestmark = pytest.mark.usefixtures("offline", "one_thread")  # fixtures in tests/conftest.py


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return get_tokenizer("bytes", tmp_path_factory.mktemp("tok"))


def samples(task: str, split: str):
    """N examples per split in the Hub's terms: (texts, label id or STS-B score)."""
    spec = GLUE_TASKS[task]
    out = []
    for i in range(N):
        texts = tuple(f"{split} {task} {c} {i}" for c in spec.columns)
        if i == 1:  # GLUE files are read with QUOTE_NONE: a lone double quote is text
            texts = ('"' + texts[0] + " is quoted",) + texts[1:]
        label = round(i * 0.625, 3) if spec.regression else i % spec.num_labels
        out.append((texts, label))
    return out


def write_glue_dist(root: pathlib.Path, task: str, malformed: bool = True) -> pathlib.Path:
    """The classic download script's layout: ROOT/<TASK>/train.tsv + dev.tsv (MNLI: dev_matched/_mismatched)."""
    spec = GLUE_TASKS[task]
    folder = root / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    files = {"train": "train.tsv", "validation": "dev.tsv", "validation_matched": "dev_matched.tsv",
             "validation_mismatched": "dev_mismatched.tsv"}
    for split in ("train", *spec.val_splits):
        lines = _tsv_lines(task, split, samples(task, split))
        if malformed and task == "qqp" and split == "train":
            lines.insert(3, "123\t456\tbroken question without the other fields")
        (folder / files[split]).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _tsv_lines(task, split, rows):
    spec = GLUE_TASKS[task]
    names = spec.labels
    if task == "cola":
        return [f"gj04\t{y}\t{'' if y else '*'}\t{t[0]}" for t, y in rows]
    if task == "sst2":
        return ["sentence\tlabel"] + [f"{t[0]}\t{y}" for t, y in rows]
    if task == "mrpc":
        return ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
            f"{y}\t{100 + i}\t{200 + i}\t{t[0]}\t{t[1]}" for i, (t, y) in enumerate(rows)]
    if task == "qqp":
        return ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"] + [
            f"{i}\t{2 * i}\t{2 * i + 1}\t{t[0]}\t{t[1]}\t{y}" for i, (t, y) in enumerate(rows)]
    if task == "stsb":
        return ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"] + [
            f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{t[0]}\t{t[1]}\t{y:.3f}" for i, (t, y) in enumerate(rows)]
    if task == "mnli":
        dev = split != "train"
        extra = ["label2", "label3", "label4", "label5"] if dev else []
        header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                  "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", *extra, "gold_label"]
        out = ["\t".join(header)]
        for i, (t, y) in enumerate(rows):
            annotator = names[(y + 1) % 3]  # label1 disagrees with gold_label: only gold_label counts
            fields = [str(i), str(i), f"{i}n", "slate", "( x )", "( y )", "(ROOT x)", "(ROOT y)", t[0], t[1], annotator,
                      *([annotator] * len(extra)), names[y]]
            out.append("\t".join(fields))
        return out
    header = {"qnli": "index\tquestion\tsentence\tlabel"}.get(task, "index\tsentence1\tsentence2\tlabel")
    as_text = task in ("qnli", "rte")  # string labels; WNLI uses 0/1
    return [header] + [f"{i}\t{t[0]}\t{t[1]}\t{names[y] if as_text else y}" for i, (t, y) in enumerate(rows)]


def write_hub_layout(root: pathlib.Path, task: str, fmt: str) -> pathlib.Path:
    """The Hub's schema: ROOT/<task>/<split>-00000-of-00001.parquet or <split>.jsonl."""
    spec = GLUE_TASKS[task]
    folder = root / task
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", *spec.val_splits):
        rows = samples(task, split)
        columns = {c: [t[j] for t, _ in rows] for j, c in enumerate(spec.columns)}
        columns["label"] = [y for _, y in rows]
        columns["idx"] = list(range(len(rows)))
        if fmt == "parquet":
            pq.write_table(pa.table(columns), folder / f"{split}-00000-of-00001.parquet")
        else:
            records = [dict(zip(columns, values)) for values in zip(*columns.values())]
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue") / "glue_data"
    for task in GLUE_TASKS:
        write_glue_dist(root, task)
    return root


# ---------------------------------------------------------------------------- reading
@pytest.mark.parametrize("task", list(GLUE_TASKS))
def test_glue_distribution_layout_reads_as_the_hub_labels(glue_dir, task, capsys):
    spec = get_task(task)
    for split in ("train", *spec.val_splits):
        data = load_split(spec, split, str(glue_dir))
        expected = samples(task, split)
        assert data.texts == [t for t, _ in expected], split
        assert data.labels == pytest.approx([y for _, y in expected]), split
    err = capsys.readouterr().err
    if task == "qqp":
        assert "skipped 1 of 9 rows with the wrong number of fields (at line 4)" in err
    else:
        assert "skipped" not in err


@pytest.mark.parametrize("task,fmt", [("mrpc", "parquet"), ("mnli", "parquet"), ("stsb", "jsonl"), ("rte", "jsonl")])
def test_hub_schema_files_read_the_same_as_the_distribution(glue_dir, tmp_path, task, fmt):
    hub_root = write_hub_layout(tmp_path / "hub", task, fmt)
    spec = get_task(task)
    for split in ("train", *spec.val_splits):
        a, b = load_split(spec, split, str(hub_root)), load_split(spec, split, str(glue_dir))
        assert a.texts == b.texts and a.labels == pytest.approx(b.labels)


def test_hub_jsonl_with_label_names_is_accepted(tmp_path):
    path = tmp_path / "validation.jsonl"
    path.write_text('{"premise": "p", "hypothesis": "h", "label": "neutral"}\n'
                    '{"premise": "q", "hypothesis": "i", "label": 2}\n')
    assert read_hub_file(get_task("mnli"), path).labels == [1, 2]


@pytest.mark.parametrize("task,line,pattern", [
    ("sst2", "odd sentence\t2", r"dev\.tsv:line 2: label '2' is not in glue/sst2's label set \(0=negative, 1=positive\)"),
    ("rte", "0\ta\tb\tmaybe", r"dev\.tsv:line 2: label 'maybe' is not in glue/rte's label set"),
    ("stsb", "0\tg\tf\ty\t0\tn\tn\ta\tb\t7.5", r"dev\.tsv:line 2: STS-B score 7\.5 is outside"),
])
def test_label_outside_the_label_set_names_file_and_line(tmp_path, task, line, pattern):
    root = write_glue_dist(tmp_path, task)
    dev = root / GLUE_TASKS[task].folder / "dev.tsv"
    lines = dev.read_text().splitlines()
    dev.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")
    with pytest.raises(DataError, match=pattern):
        load_split(get_task(task), "validation", str(root))


def test_hub_test_split_labels_are_refused_with_a_hint(tmp_path):
    path = tmp_path / "validation.jsonl"
    path.write_text('{"sentence": "s", "label": -1, "idx": 0}\n')
    with pytest.raises(DataError, match=r"validation\.jsonl:row 0: label -1 .*test splits carry no labels"):
        read_hub_file(get_task("sst2"), path)


def test_missing_files_and_columns_name_the_file(tmp_path):
    (tmp_path / "glue_data" / "SST-2").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no glue/sst2 train file in .*SST-2.*expected one of train\.tsv"):
        load_split(get_task("sst2"), "train", str(tmp_path / "glue_data"))
    with pytest.raises(DataError, match="is not a folder"):
        load_split(get_task("sst2"), "train", str(tmp_path / "nowhere"))
    (tmp_path / "glue_data" / "SST-2" / "train.tsv").write_text("text\tlabel\nfine\t1\n")
    with pytest.raises(DataError, match=r"SST-2/train\.tsv: missing column\(s\) \['sentence'\]"):
        load_split(get_task("sst2"), "train", str(tmp_path / "glue_data"))
    (tmp_path / "glue_data" / "mrpc").mkdir()
    pq.write_table(pa.table({"sentence1": ["a"], "label": [0]}), tmp_path / "glue_data" / "mrpc" / "train-0.parquet")
    with pytest.raises(DataError, match=r"train-0\.parquet: missing column\(s\) \['sentence2'\]"):
        load_split(get_task("mrpc"), "train", str(tmp_path / "glue_data"))


def test_empty_text_fails_unless_dropped_and_counted(tmp_path, capsys):
    root = write_glue_dist(tmp_path, "sst2")
    train = root / "SST-2" / "train.tsv"
    train.write_text(train.read_text() + " \t1\n")
    with pytest.raises(DataError, match=r"train\.tsv:line 10: empty text.*--data\.drop_empty true"):
        load_split(get_task("sst2"), "train", str(root))
    data = load_split(get_task("sst2"), "train", str(root), drop_empty=True)
    assert len(data) == N
    assert "skipped 1 of 9 rows with an empty text (at line 10)" in capsys.readouterr().err


def test_offline_hub_glue_fails_fast_naming_dataset_and_option():
    start = time.time()
    with pytest.raises(DataError, match=r"nyu-mll/glue.*offline.*--data\.path"):
        load_split(get_task("cola"), "train")
    assert time.time() - start < 5


def test_unknown_task_lists_valid_tasks():
    with pytest.raises(DataError, match="glue/cola.*glue/all"):
        get_task("glue/nope")


# ---------------------------------------------------------------------------- tokenisation and pooling
@pytest.mark.parametrize("a,b,budget", [(3, 4, 10), (100, 10, 50), (30, 100, 50), (30, 100, 70), (100, 100, 51),
                                         (7, 7, 7), (1, 60, 2)])
def test_pair_truncation_is_longest_first(a, b, budget):
    la, lb = a, b  # the reference: remove one token at a time from the longer text (the second on ties)
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    assert fit_pair(a, b, budget) == (la, lb)


def test_encoded_examples_end_with_eot_and_fit(glue_dir, tok):
    data = load_split(get_task("mrpc"), "train", str(glue_dir))
    ids = encode_split(data, tok, max_length=20)
    eot = tok.eot_id
    for seq, texts in zip(ids, data.texts):
        assert len(seq) <= 20 and seq[-1] == eot and (seq == eot).sum() == 2
        first = seq[: list(seq).index(eot)]
        assert texts[0].startswith(tok.decode(first.tolist()))  # truncation cuts ends, never beginnings


@pytest.mark.parametrize("variant", ["vanilla", "moe", "mot"])
def test_features_come_from_the_last_real_token_and_ignore_padding(variant):
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant=variant, **TINY)).eval()
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 5, 12)]
    idx = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, s in enumerate(seqs):
        idx[row, : len(s)], mask[row, : len(s)] = s, 1
    batched, _ = last_token_features(model, idx, mask)
    for row, s in enumerate(seqs):
        alone, _ = last_token_features(model, s[None], torch.ones(1, len(s), dtype=torch.long))
        torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=1e-5)
        logits = model(s[None]).logits[0, -1]
        torch.testing.assert_close(model.lm_head(alone[0]), logits, atol=1e-5, rtol=1e-5)  # ln_f output = head input


def test_classifier_head_trains_on_every_variant_backbone():
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (4, 10))
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.tensor([0, 1, 2, 1])
    trained = []
    for variant in variant_names():
        shape = {**TINY, "n_layer": tiny_layers(variant, TINY["n_layer"])}
        module = GlueModule(model=dict(variant=variant, **shape), task="mnli")
        logits, aux = module(idx, mask)
        assert logits.shape == (4, 3) and torch.isfinite(logits).all(), variant
        (module.task_loss(logits, labels) + aux).backward()
        assert module.head.weight.grad.abs().sum() > 0, variant
        assert module.model.wte.weight.grad.abs().sum() > 0, variant  # the backbone is fine-tuned too
        trained.append(variant)
    assert trained == variant_names()


# ---------------------------------------------------------------------------- metrics
def test_metrics_equal_a_hand_computation():
    y = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1])
    p = torch.tensor([1, 0, 0, 1, 0, 1, 1, 0, 1, 0])
    tp, tn, fp, fn = 4, 3, 1, 2
    cola = {k: float(v) for k, v in glue_metrics(get_task("cola"))(p, y).items()}
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert cola["matthews"] == pytest.approx(mcc, abs=1e-6) and cola["accuracy"] == pytest.approx(0.7)
    mrpc = {k: float(v) for k, v in glue_metrics(get_task("mrpc"))(p, y).items()}
    assert mrpc["accuracy"] == pytest.approx(0.7) and mrpc["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert glue_score(get_task("mrpc"), mrpc) == pytest.approx((0.7 + 8 / 11) / 2)
    y3, p3 = torch.tensor([0, 1, 2, 2, 1, 0]), torch.tensor([0, 2, 2, 2, 1, 1])
    assert float(glue_metrics(get_task("mnli"))(p3, y3)["accuracy"]) == pytest.approx(4 / 6)
    gold = torch.tensor([0.0, 1.5, 2.2, 3.0, 4.8, 5.0, 2.5])
    pred = torch.tensor([0.3, 1.0, 2.9, 2.7, 4.0, 4.9, 1.1])
    sts = {k: float(v) for k, v in glue_metrics(get_task("stsb"))(pred, gold).items()}
    g, q = gold.numpy().astype(float), pred.numpy().astype(float)
    pearson = ((g - g.mean()) * (q - q.mean())).sum() / math.sqrt(((g - g.mean()) ** 2).sum() * ((q - q.mean()) ** 2).sum())
    rank = lambda v: np.argsort(np.argsort(v)).astype(float)  # noqa: E731  (no ties in this set)
    rg, rq = rank(g), rank(q)
    spearman = 1 - 6 * ((rg - rq) ** 2).sum() / (len(g) * (len(g) ** 2 - 1))
    assert sts["pearson"] == pytest.approx(pearson, abs=1e-5) and sts["spearman"] == pytest.approx(spearman, abs=1e-5)
    assert spearman == pytest.approx(stats.spearmanr(g, q).statistic)


# ---------------------------------------------------------------------------- fine-tuning
TINY_CLI = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.block_size", "48",
            "--batch_size", "4", "--trainer.enable_progress_bar", "false", "--tokenizer", "bytes"]


def test_one_finetuning_step_per_task_and_the_glue_table(glue_dir, tmp_path, capsys):
    from experiments.finetune import main

    run_dir = main(["--task", "glue/all", "--variant", "vanilla", "--data.path", str(glue_dir), "--max_steps", "1",
                    "--log_dir", str(tmp_path), "--lr", "1e-3", *TINY_CLI])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run_dir)
    results = json.loads((run_dir / "glue_results.json").read_text())
    assert [r["task"] for r in results] == [f"glue/{t}" for t in GLUE_TASKS]
    for r in results:
        spec = get_task(r["task"])
        assert r["steps"] == 1 and r["train_examples"] == N
        assert list(r["metrics"]) == list(spec.val_splits)
        for values in r["metrics"].values():
            assert sorted(values) == sorted(spec.metrics) and all(math.isfinite(v) for v in values.values())
        assert r["score"] == pytest.approx(np.mean([glue_score(spec, v) for v in r["metrics"].values()]))
    table = (run_dir / "glue_results.md").read_text().splitlines()
    assert table[0] == "| task | metrics (x100) | score |" and len(table) == 2 + 9 + 1
    assert "matched accuracy" in table[2 + 5] and "mismatched accuracy" in table[2 + 5]
    assert (run_dir / "cola").is_dir() and (run_dir / "wnli").is_dir()
    rows = [json.loads(line) for line in next((run_dir / "cola").rglob("predictions.jsonl")).read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(rows))) and rows
    assert set(rows[0]) == {"id", "inputs", "label", "prediction"} and rows[0]["inputs"]
    assert {r["label"] for r in rows} <= set(get_task("cola").labels)
    assert all(SEPARATOR not in r["inputs"] for r in rows)  # one text
    pairs = [json.loads(line) for line in next((run_dir / "rte").rglob("predictions.jsonl")).read_text().splitlines()]
    assert pairs and all(r["inputs"].count(SEPARATOR) == 1 for r in pairs)  # the two texts, visibly apart
    assert len(list((run_dir / "mnli").rglob("predictions-*.jsonl"))) == 2  # matched and mismatched


def test_finetuning_learns_a_task_on_a_routed_variant(tmp_path):
    from experiments.finetune import main

    root = tmp_path / "glue_data" / "SST-2"
    root.mkdir(parents=True)
    rows = [("good great fine", 1), ("bad awful poor", 0)] * 4
    for name in ("train.tsv", "dev.tsv"):
        (root / name).write_text("sentence\tlabel\n" + "".join(f"{s} {i}\t{y}\n" for i, (s, y) in enumerate(rows)))
    run_dir = main(["--task", "glue/sst2", "--variant", "mod", "--data.path", str(tmp_path / "glue_data"),
                    "--epochs", "20", "--lr", "3e-3", "--dropout", "0", "--log_dir", str(tmp_path / "runs"), *TINY_CLI,
                    "--model.n_layer", "2", "--batch_size", "8"])
    result = json.loads((run_dir / "results.json").read_text())
    assert result["variant"] == "mod" and result["metrics"]["validation"]["accuracy"] == 1.0


def test_init_from_a_pretraining_checkpoint_and_its_tokenizer(tmp_path):
    from experiments.finetune import backbone_config, build_parser, load_backbone, resolve_tokenizer
    from lightning_modules.lm import LanguageModelModule

    lm = LanguageModelModule(model=dict(variant="vanilla", **TINY))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    ckpt = ckpt_dir / "last.ckpt"
    torch.save({"state_dict": lm.state_dict(), "hyper_parameters": dict(lm.hparams)}, ckpt)
    (tmp_path / "run" / "config.yaml").write_text("data:\n  name: embedded\n  tokenizer: bytes\n")
    assert resolve_tokenizer(None, str(ckpt)).name == "bytes"
    for variant in ("vanilla", "moe"):
        cfg = build_parser().parse_args(["--task", "glue/rte", "--model.variant", variant, "--init_from", str(ckpt)])
        mcfg = backbone_config(cfg, 257)
        assert (mcfg.variant, mcfg.d_model, mcfg.n_layer, mcfg.block_size) == (variant, 32, 2, 48)
        module = GlueModule(model=mcfg.to_dict(), task="rte")
        load_backbone(module.model, str(ckpt))
        torch.testing.assert_close(module.model.wte.weight, lm.model.wte.weight)
        torch.testing.assert_close(module.model.blocks[0].attn.c_attn.weight, lm.model.blocks[0].attn.c_attn.weight)
    cfg = build_parser().parse_args(["--task", "glue/rte", "--init_from", str(ckpt)])
    with pytest.raises(Exception, match="do not fit the backbone's vocabulary"):
        backbone_config(cfg, 50257)


def test_bad_finetune_options_fail_before_any_work(tmp_path):
    from architectures.config import ConfigError
    from experiments.finetune import main

    with pytest.raises(DataError, match="unknown task 'summarise'"):
        main(["--task", "summarise", "--log_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="valid variants"):
        main(["--task", "glue/cola", "--variant", "nope", "--log_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="num_beams"):
        main(["--task", "xsum", "--num_beams", "0", "--log_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- real GLUE dev files (optional)
REAL = {  # task: (file under shared/data/glue, name in glue_data, rows, count of label 1)
    "sst2": ("SST-2/dev.tsv", "dev.tsv", 872, 444),
    "mrpc": ("MRPC/dev.tsv", "dev.tsv", 408, 279),
    "qnli": ("QNLI/dev.tsv", "dev.tsv", 5463, 2761),
    "wnli": ("WNLI/dev.tsv", "dev.tsv", 71, 31),
    "qqp": ("QQP/dev_first9.tsv", "dev.tsv", 9, 4),
    "rte": ("RTE/dev_first2_glue_layout.tsv", "dev.tsv", 2, 1),
    "mnli": ("MNLI/dev_matched_first2_glue_layout.tsv", "dev_matched.tsv", 2, 1),
}


def test_real_glue_dev_files(shared_data, tmp_path, capsys):
    root = tmp_path / "glue_data"
    for task, (source, name, rows, ones) in REAL.items():
        folder = root / GLUE_TASKS[task].folder
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared_data / "glue" / source, folder / name)
        split = "validation_matched" if task == "mnli" else "validation"
        data = load_split(get_task(task), split, str(root))
        assert len(data) == rows and sum(1 for y in data.labels if y == 1) == ones, task
    cola = root / "CoLA"
    cola.mkdir()
    parts = [(shared_data / "glue" / "CoLA" / f).read_text() for f in ("in_domain_dev.tsv", "out_of_domain_dev.tsv")]
    (cola / "dev.tsv").write_text(parts[0] + parts[1])  # GLUE's CoLA/dev.tsv = in-domain + out-of-domain
    data = load_split(get_task("cola"), "validation", str(root))
    assert len(data) == 1043 and sum(data.labels) == 365 + 354
    stsb = root / "STS-B"
    stsb.mkdir()
    shutil.copy(shared_data / "glue" / "STS-B" / "dev.tsv", stsb / "dev.tsv")
    data = load_split(get_task("stsb"), "validation", str(root))
    assert len(data) == 1500 and min(data.labels) == 0.0 and max(data.labels) == 5.0 and data.labels[0] == 5.0
    mrpc = load_split(get_task("mrpc"), "validation", str(root))
    assert mrpc.texts[0][1].startswith('"The foodservice pie business')  # QUOTE_NONE keeps the quote
    matched = read_hub_file(get_task("mnli"), shared_data / "glue" / "MNLI" / "dev_matched.jsonl")
    assert len(matched) == 9815 and [matched.labels.count(i) for i in range(3)] == [3479, 3123, 3213]
    two = load_split(get_task("mnli"), "validation_matched", str(root))
    assert two.labels == matched.labels[:2] and two.texts[0][0].startswith(matched.texts[0][0].strip())
    assert "skipped" not in capsys.readouterr().err


def test_real_gpt2_tokenizer_on_real_sst2(shared_data, tmp_path):
    gpt2 = get_tokenizer(str(shared_data / "gpt2_tokenizer"), tmp_path)
    assert gpt2.encode("Hello world") == [15496, 995]
    folder = tmp_path / "glue_data" / "SST-2"
    folder.mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        shutil.copy(shared_data / "glue" / "SST-2" / "dev.tsv", folder / name)
    dm = GlueDataModule("glue/sst2", gpt2, max_length=128, batch_size=16, path=str(tmp_path / "glue_data"))
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()[0]))
    first = batch["idx"][0, : int(batch["attention_mask"][0].sum())].tolist()
    assert first[-1] == 50256
    text = load_split(get_task("sst2"), "validation", str(tmp_path / "glue_data")).texts[0][0]
    assert gpt2.decode(first[:-1]) == text


# ---------------------------------------------------------------------------- honest downstream numbers
@pytest.mark.parametrize("task", GLUE_TASKS)
def test_constant_predictions_score_zero_correlation_for_every_metric(task):
    spec = get_task(task)
    labels = torch.tensor([0.5, 1.0, 4.0, 2.5]) if spec.regression else torch.tensor([0, 1, 1, 0]) % spec.num_labels
    for constant in ((torch.full((4,), 3.0),) if spec.regression else (torch.zeros(4, dtype=torch.long),
                                                                        torch.ones(4, dtype=torch.long))):
        values = {k: float(v) for k, v in glue_metrics(spec)(constant, labels).items()}
        assert all(math.isfinite(v) for v in values.values()), (task, values)
        for name in ("matthews", "pearson", "spearman"):
            if name in values:
                assert values[name] == 0.0, (task, name, values)
        if "accuracy" in values:
            assert values["accuracy"] == pytest.approx(float((constant == labels).float().mean()))
    if "matthews" in spec.metrics:  # constant labels too: sklearn / GLUE give 0 (torchmetrics gave 0.80)
        metric = glue_metrics(spec)["matthews"]
        metric.update(torch.tensor([1, 1, 1, 1, 1, 1, 1, 0]), torch.ones(8, dtype=torch.long))
        assert float(metric.compute()) == 0.0


def test_classification_does_not_compute_the_lm_head():
    torch.manual_seed(0)
    module = GlueModule(model=dict(variant="mod", **TINY), task="sst2").eval()
    calls = []
    module.model.lm_head.register_forward_hook(lambda *args: calls.append(1))
    idx, mask = torch.randint(0, 256, (2, 10)), torch.ones(2, 10, dtype=torch.long)
    logits, _ = module(idx, mask)
    assert logits.shape == (2, 2) and not calls
    assert "head" not in vars(module.model)  # the stand-in is removed again
    full = module.model(idx, return_residuals=True)
    features, _ = last_token_features(module.model, idx, mask)
    torch.testing.assert_close(features, module.model.ln_f(full.final_hidden()[:, -1]), atol=1e-5, rtol=1e-5)


def _gather_worker(rank: int, world: int, port: int, out: str) -> None:
    import os
    import types

    import torch.distributed as dist

    from lightning_modules.xsum import XSumModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = types.SimpleNamespace(world_size=world)
        # 5 examples over 2 ranks: rank 0 has ids 0, 2, 4; rank 1 has 1, 3 and the sampler's padding 0
        mine = [0, 2, 4] if rank == 0 else [1, 3, 0]
        xsum = types.SimpleNamespace(trainer=trainer, predictions=[{"id": f"doc{i}", "prediction": f"p{i}"} for i in mine])
        XSumModule._gather_predictions(xsum)
        glue = types.SimpleNamespace(trainer=trainer, predictions_by_split={
            "validation": [{"id": i, "label": i % 2, "prediction": 1} for i in mine]})
        GlueModule._gather_predictions(glue)
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps({"xsum": xsum.predictions, "glue": glue.predictions_by_split}))
    finally:
        dist.destroy_process_group()


def test_predictions_of_every_rank_are_gathered(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.json"
    mp.start_processes(_gather_worker, args=(2, port, str(out)), nprocs=2, join=True, start_method="spawn")
    gathered = json.loads(out.read_text())
    assert [r["id"] for r in gathered["xsum"]] == [f"doc{i}" for i in range(5)]
    assert [r["id"] for r in gathered["glue"]["validation"]] == [0, 1, 2, 3, 4]


def test_a_decoded_pair_shows_its_separator():
    decode = lambda ids: "".join(chr(i) for i in ids)
    assert decode_input([104, 105, 0, 121, 111, 0], decode, eot_id=0) == "hi" + SEPARATOR + "yo"
    assert decode_input([104, 105, 0], decode, eot_id=0) == "hi"
    assert decode_input([104, 105, 0], decode, eot_id=None) == "hi\x00"
