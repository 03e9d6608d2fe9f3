"""GLUE tasks for fine-tuning: the Hub's schema (nyu-mll/glue) or local files, tokenised for a causal LM.

Sources, for ``glue/<task>`` with ``--data.path ROOT`` (or the Hub when no path is given):

* the original GLUE distribution (``ROOT/<TASK>/train.tsv``, ``dev.tsv``; MNLI ``dev_matched.tsv`` /
  ``dev_mismatched.tsv``), with its quirks: every file is read with ``QUOTE_NONE``; MRPC's header
  starts with a byte-order mark; CoLA has no header (source, label, mark, sentence); STS-B has 10
  columns (score last); MNLI's label is ``gold_label``; QQP has id/qid columns; QNLI/RTE/WNLI start
  with an index column and QNLI/RTE use string labels. Lines with the wrong number of fields are
  skipped and counted (QQP's train.tsv has a few).
* the Hub's layout (``ROOT/<task>/<split>-*.parquet`` or ``<split>.jsonl``, columns as on the Hub
  with integer or label-name labels), e.g. what ``datasets``' ``to_parquet`` / ``to_json`` write.

Each example becomes ``text1 EOT [text2 EOT]``; the classifier reads the last (real) token. Pairs
longer than ``max_length`` lose tokens from the end of the longer text first.
Errors name the file: missing files or columns, labels outside the task's label set, empty
texts (unless ``drop_empty``, which drops and counts them).
"""
from __future__ import annotations

import csv
import io
import pathlib
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.corpora import DataError, hub_reachable, jsonl_rows, read_parquet, read_utf8
from datamodules.epoch_order import resumable_train_loader
from datamodules.tokenizer import TextTokenizer

GLUE_HUB_ID = "nyu-mll/glue"
_MAX_REPORTED_LINES = 5


@dataclass(frozen=True)
class GlueTask:
    name: str  # hub config name, e.g. "sst2"
    folder: str  # GLUE distribution folder, e.g. "SST-2"
    columns: Tuple[str, ...]  # text columns in the hub schema
    labels: Tuple[str, ...]  # label names in hub id order; () = regression (STS-B)
    tsv_columns: Tuple[str, ...]  # text columns in the GLUE TSV header
    tsv_label: str  # label column in the GLUE TSV header
    val_splits: Tuple[str, ...] = ("validation",)
    metrics: Tuple[str, ...] = ("accuracy",)

    @property
    def regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return 1 if self.regression else len(self.labels)

    @property
    def slug(self) -> str:
        return f"glue/{self.name}"


GLUE_TASKS: Dict[str, GlueTask] = {
    t.name: t
    for t in (
        # CoLA's TSVs have no header: (source, label, original mark, sentence), read by position
        GlueTask("cola", "CoLA", ("sentence",), ("unacceptable", "acceptable"), ("sentence",), "label",
                 metrics=("matthews", "accuracy")),
        GlueTask("sst2", "SST-2", ("sentence",), ("negative", "positive"), ("sentence",), "label"),
        GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"),
                 ("#1 String", "#2 String"), "Quality", metrics=("accuracy", "f1")),
        GlueTask("qqp", "QQP", ("question1", "question2"), ("not_duplicate", "duplicate"),
                 ("question1", "question2"), "is_duplicate", metrics=("accuracy", "f1")),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), (), ("sentence1", "sentence2"), "score",
                 metrics=("pearson", "spearman")),
        GlueTask("mnli", "MNLI", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 ("sentence1", "sentence2"), "gold_label", val_splits=("validation_matched", "validation_mismatched")),
        GlueTask("qnli", "QNLI", ("question", "sentence"), ("entailment", "not_entailment"),
                 ("question", "sentence"), "label"),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), ("entailment", "not_entailment"),
                 ("sentence1", "sentence2"), "label"),
        GlueTask("wnli", "WNLI", ("sentence1", "sentence2"), ("not_entailment", "entailment"),
                 ("sentence1", "sentence2"), "label"),
    )
}
COLA_FIELDS = 4  # source, label, original mark, sentence; no header
STSB_RANGE = (0.0, 5.0)
_FILE_STEMS = {  # the same names as XSUM accepts: validation / dev / val
    "train": ("train",),
    "validation": ("validation", "dev", "val"),
    "validation_matched": ("validation_matched", "dev_matched", "val_matched"),
    "validation_mismatched": ("validation_mismatched", "dev_mismatched", "val_mismatched"),
}
# SuperGLUE's RTE (val.jsonl) names the pair premise / hypothesis where GLUE's hub schema has sentence1 / 2
_COLUMN_ALIASES = {"sentence1": "premise", "sentence2": "hypothesis"}


def get_task(name: str) -> GlueTask:
    key = name.removeprefix("glue/").lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise DataError(f"task: unknown GLUE task {name!r}; valid: {', '.join('glue/' + t for t in GLUE_TASKS)}, glue/all")
    return GLUE_TASKS[key]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class GlueSplit:
    """Texts (one tuple per example) and labels (class ids, or STS-B scores) of one split."""

    texts: List[Tuple[str, ...]]
    labels: List[float]
    source: str

    def __len__(self) -> int:
        return len(self.labels)


# ---------------------------------------------------------------------------- labels and rows
def parse_label(task: GlueTask, value, where: str):
    if task.regression:
        try:
            score = float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where}: STS-B score {value!r} is not a number") from None
        if not STSB_RANGE[0] <= score <= STSB_RANGE[1]:
            raise DataError(f"{where}: STS-B score {score} is outside the task's range {list(STSB_RANGE)}")
        return score
    raw = value
    if isinstance(value, str):
        text = value.strip()
        if text in task.labels:
            return task.labels.index(text)
        try:
            value = int(text)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < len(task.labels):
        return int(value)
    hint = " (test splits carry no labels)" if value == -1 else ""
    valid = ", ".join(f"{i}={n}" for i, n in enumerate(task.labels))
    raise DataError(f"{where}: label {raw!r} is not in {task.slug}'s label set ({valid}){hint}")


class _Rows:
    """Collects parsed rows of one file, with the empty-text policy and counts of what was skipped."""

    def __init__(self, task: GlueTask, path: str, drop_empty: bool):
        self.task, self.path, self.drop_empty = task, path, drop_empty
        self.texts: List[Tuple[str, ...]] = []
        self.labels: List[float] = []
        self.empty: List[str] = []
        self.malformed: List[str] = []
        self.seen = 0

    def add(self, texts: Sequence, label, where: str) -> None:
        self.seen += 1
        texts = tuple("" if t is None else str(t) for t in texts)
        parsed = parse_label(self.task, label, f"{self.path}:{where}")
        if any(not t.strip() for t in texts):
            if not self.drop_empty:
                raise DataError(f"{self.path}:{where}: empty text in {self.task.slug} example; "
                                "pass --data.drop_empty true to drop such rows (they are counted)")
            self.empty.append(where)
            return
        self.texts.append(texts)
        self.labels.append(parsed)

    def finish(self) -> GlueSplit:
        for what, places in (("with the wrong number of fields", self.malformed), ("with an empty text", self.empty)):
            if places:
                shown = ", ".join(places[:_MAX_REPORTED_LINES]) + (" ..." if len(places) > _MAX_REPORTED_LINES else "")
                log(f"{self.task.slug}: {self.path}: skipped {len(places)} of {self.seen + len(self.malformed)} rows "
                    f"{what} (at {shown})")
        if not self.labels:
            raise DataError(f"{self.path}: no usable {self.task.slug} examples")
        return GlueSplit(self.texts, self.labels, self.path)


# ---------------------------------------------------------------------------- GLUE distribution TSV
def read_glue_tsv(task: GlueTask, path: pathlib.Path, drop_empty: bool = False) -> GlueSplit:
    csv.field_size_limit(sys.maxsize)
    rows = _Rows(task, str(path), drop_empty)
    text = read_utf8(path).removeprefix("\ufeff")  # MRPC's header has a byte-order mark
    # A TSV exported from the hub's datasets (pandas: header ends with ``idx``) CSV-quotes fields holding
    # quotes; the GLUE distribution's files must be read without quoting (their quotes are text).
    hub_export = task.name != "cola" and "idx" in text.partition("\n")[0].rstrip("\r").split("\t")
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_MINIMAL if hub_export else csv.QUOTE_NONE)
        if task.name == "cola":
            width, text_idx, label_idx, first = COLA_FIELDS, [3], 1, 1
        else:
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: the file is empty")
            missing = [c for c in (*task.tsv_columns, task.tsv_label) if c not in header]
            if missing:
                raise DataError(f"{path}: missing column(s) {missing} for {task.slug} (header: {header})")
            width, first = len(header), 2
            text_idx = [header.index(c) for c in task.tsv_columns]
            # MNLI's header has label1..label5 and gold_label; gold_label is the last column
            label_idx = len(header) - 1 - header[::-1].index(task.tsv_label)
        for line_no, fields in enumerate(reader, first):
            if len(fields) != width:
                if fields:  # a blank line (e.g. a trailing newline run) is not a row
                    rows.malformed.append(f"line {line_no}")
                continue
            rows.add([fields[i] for i in text_idx], fields[label_idx], f"line {line_no}")
    return rows.finish()


# ---------------------------------------------------------------------------- hub schema (parquet / jsonl)
def read_hub_file(task: GlueTask, path: pathlib.Path, drop_empty: bool = False) -> GlueSplit:
    records, columns = _records(path)
    aliases = {c: _COLUMN_ALIASES[c] for c in task.columns
               if c not in columns and _COLUMN_ALIASES.get(c) in columns}
    if aliases:
        records = [{**r, **{c: r.get(a) for c, a in aliases.items()}} for r in records]
        columns = sorted({*columns, *aliases})
    missing = [c for c in (*task.columns, "label") if c not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing} for {task.slug} (has {sorted(columns)})")
    rows = _Rows(task, str(path), drop_empty)
    for i, record in enumerate(records):
        rows.add([record[c] for c in task.columns], record["label"], f"row {i}")
    return rows.finish()


def _records(path: pathlib.Path) -> Tuple[List[dict], List[str]]:
    if path.suffix == ".parquet":
        table = read_parquet(path)
        return table.to_pylist(), table.column_names
    records = [row for _, row in jsonl_rows(path)]
    if not records:
        raise DataError(f"{path}: the file has no rows")
    return records, sorted(set().union(*(r.keys() for r in records)))


def dataset_split(task: GlueTask, dataset, where: str, drop_empty: bool = False) -> GlueSplit:
    """A ``datasets.Dataset`` in the hub schema (what ``load_dataset("nyu-mll/glue", task)`` returns)."""
    missing = [c for c in (*task.columns, "label") if c not in dataset.column_names]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing} for {task.slug} (has {dataset.column_names})")
    rows = _Rows(task, where, drop_empty)
    columns = dataset.select_columns([*task.columns, "label"]).to_dict()
    for i, label in enumerate(columns["label"]):
        rows.add([columns[c][i] for c in task.columns], label, f"row {i}")
    return rows.finish()


# ---------------------------------------------------------------------------- locating files
class AmbiguousFiles(DataError):
    """Two files could hold the same split: refused rather than picking one silently."""


def find_split_file(task: GlueTask, root: pathlib.Path, split: str) -> pathlib.Path:
    folders = [root / task.folder, root / task.name, root]
    stems = _FILE_STEMS[split]
    for folder in folders:
        if not folder.is_dir():
            continue
        # every name the split may have (dev.tsv and val.jsonl alike): two files would be a silent choice
        found = sorted({f for stem in stems
                        for pattern in (f"{stem}.tsv", f"{stem}.parquet", f"{stem}-*.parquet", f"{stem}.jsonl")
                        for f in folder.glob(pattern)})
        if len(found) > 1:
            raise AmbiguousFiles(f"{folder}: several {task.slug} {split} files ({', '.join(f.name for f in found)}); keep one "
                            "(move the others out of the folder)")
        if found:
            return found[0]
    expected = ", ".join(f"{s}.tsv" for s in stems) + f", {stems[0]}-*.parquet, {stems[0]}.jsonl"
    searched = ", ".join(str(f) for f in folders if f.is_dir()) or f"{root} (missing)"
    raise DataError(f"data.path: no {task.slug} {split} file in {searched}; expected one of {expected}")


def check_files(tasks: Sequence[str], path: Optional[str], splits: Sequence[str] = ("train", "validation")) -> None:
    """Before any training: every task's files exist (``--data.path``) or the Hub is reachable.

    ``splits``: "train" and/or "validation" (which means each task's own validation splits, MNLI's two).
    All missing files are named in one DataError."""
    specs = [get_task(t) for t in tasks]
    if not path:
        if not hub_reachable():
            _hub_split(specs[0], "train", False)  # raises the offline message with the --data.path layout
        return
    root = pathlib.Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"data.path: {root} is not a folder (expected a GLUE folder such as glue_data/)")
    problems = []  # (task and split, the finder's message)
    for spec in specs:
        wanted = [s for s in splits if s == "train"] + (list(spec.val_splits) if "validation" in splits else [])
        for split in wanted:
            try:
                find_split_file(spec, root, split)
            except AmbiguousFiles:
                raise
            except DataError as err:
                problems.append((f"{spec.slug} {split}", str(err)))
    if problems:
        raise DataError(f"data.path: missing GLUE files for {', '.join(p for p, _ in problems)} (nothing was "
                        f"trained); first: {problems[0][1]}")


def read_split_file(task: GlueTask, path: pathlib.Path, drop_empty: bool = False) -> GlueSplit:
    if path.suffix == ".tsv":
        return read_glue_tsv(task, path, drop_empty)
    return read_hub_file(task, path, drop_empty)


def load_split(task: GlueTask, split: str, path: Optional[str] = None, drop_empty: bool = False) -> GlueSplit:
    if path:
        root = pathlib.Path(path).expanduser()
        if not root.is_dir():
            raise DataError(f"data.path: {root} is not a folder (expected a GLUE folder such as glue_data/)")
        return read_split_file(task, find_split_file(task, root, split), drop_empty)
    return _hub_split(task, split, drop_empty)


def _hub_split(task: GlueTask, split: str, drop_empty: bool) -> GlueSplit:
    if not hub_reachable():
        raise DataError(
            f"dataset {GLUE_HUB_ID!r} ({task.name}) cannot be downloaded: the Hugging Face Hub is unreachable or "
            "offline mode is set (HF_HUB_OFFLINE=1). Pass --data.path ROOT with the GLUE distribution "
            f"(ROOT/{task.folder}/train.tsv, dev.tsv) or the Hub layout (ROOT/{task.name}/train-*.parquet)."
        )
    import datasets

    dataset = datasets.load_dataset(GLUE_HUB_ID, task.name, split=split)
    return dataset_split(task, dataset, f"{GLUE_HUB_ID}/{task.name}/{split}", drop_empty)


# ---------------------------------------------------------------------------- tokenisation
def fit_pair(len_a: int, len_b: int, budget: int) -> Tuple[int, int]:
    """Longest-first truncation (as Hugging Face tokenizers): drop the last token of the longer text,
    the second text on ties, until both fit in ``budget`` tokens."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if 2 * min(len_a, len_b) <= budget:  # the shorter text survives whole
        return (len_a, budget - len_a) if len_a <= len_b else (budget - len_b, len_b)
    return budget - budget // 2, budget // 2


def encode_split(split: GlueSplit, tokenizer: TextTokenizer, max_length: int, name: str = "") -> List[np.ndarray]:
    """Token ids per example: ``a EOT`` or ``a EOT b EOT``, at most ``max_length`` tokens."""
    eot = tokenizer.eot_id
    columns = list(zip(*split.texts))
    encoded = [tokenizer.encode_batch(list(col)) for col in columns]
    out, truncated = [], 0
    for parts in zip(*encoded):
        budget = max_length - len(parts)
        if budget < len(parts):
            raise DataError(f"max_length: {max_length} leaves no room for {len(parts)} text(s) and separators")
        if len(parts) == 1:
            lengths = (min(len(parts[0]), budget),)
        else:
            lengths = fit_pair(len(parts[0]), len(parts[1]), budget)
        truncated += sum(lengths) < sum(len(p) for p in parts)
        ids: List[int] = []
        for part, keep in zip(parts, lengths):
            ids.extend(part[:keep])
            ids.append(eot)
        out.append(np.asarray(ids, dtype=np.int64))
    if truncated:
        log(f"{name or split.source}: truncated {truncated} of {len(out)} examples to {max_length} tokens")
    return out


class GlueDataset(Dataset):
    def __init__(self, ids: List[np.ndarray], labels: Sequence[float], regression: bool):
        self.ids = ids
        self.labels = torch.tensor(labels, dtype=torch.float32 if regression else torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.ids[i]), self.labels[i]


def pad_batch(items, pad_id: int) -> Dict[str, torch.Tensor]:
    """Right padding: ``idx`` (B, T), ``attention_mask`` (B, T) with 1 on real tokens, ``labels`` (B,)."""
    seqs, labels = zip(*items)
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for row, seq in enumerate(seqs):
        idx[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return {"idx": idx, "attention_mask": mask, "labels": torch.stack(list(labels))}


def subsample(split: GlueSplit, limit: Optional[int], seed: int, name: str) -> GlueSplit:
    if limit is None or limit >= len(split):
        return split
    keep = np.sort(np.random.default_rng(seed).permutation(len(split))[:limit])
    log(f"{name}: using {limit} of {len(split)} examples (a seeded random subset)")
    return GlueSplit([split.texts[i] for i in keep], [split.labels[i] for i in keep], split.source)


class GlueDataModule(L.LightningDataModule):
    """One GLUE task: a shuffled train loader (resumable mid-epoch: datamodules/epoch_order.py) and one validation loader per validation split."""

    def __init__(self, task: str, tokenizer: TextTokenizer, max_length: int, batch_size: int = 32,
                 path: Optional[str] = None, drop_empty: bool = False, max_train_examples: Optional[int] = None,
                 max_eval_examples: Optional[int] = None, seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.task = get_task(task)
        self.tokenizer, self.max_length, self.batch_size = tokenizer, max_length, batch_size
        self.path, self.drop_empty, self.seed, self.num_workers = path, drop_empty, seed, num_workers
        self.max_train_examples, self.max_eval_examples = max_train_examples, max_eval_examples
        self.train_set: Optional[GlueDataset] = None
        self.val_sets: Dict[str, GlueDataset] = {}

    @property
    def val_names(self) -> List[str]:
        return list(self.task.val_splits)

    def _dataset(self, split: str, limit: Optional[int]) -> GlueDataset:
        name = f"{self.task.slug}/{split}"
        data = subsample(load_split(self.task, split, self.path, self.drop_empty), limit, self.seed, name)
        return GlueDataset(encode_split(data, self.tokenizer, self.max_length, name), data.labels, self.task.regression)

    def setup(self, stage: Optional[str] = None) -> None:
        """Every split; ``validate`` (``--eval_only``) reads only the validation splits."""
        if self.train_set is None and stage != "validate":
            self.train_set = self._dataset("train", self.max_train_examples)
        if not self.val_sets:
            self.val_sets = {s: self._dataset(s, self.max_eval_examples) for s in self.task.val_splits}

    def train_dataloader(self) -> DataLoader:
        return resumable_train_loader(self.train_set, self.batch_size, self.seed, self.trainer,
                                      num_workers=self.num_workers, collate_fn=_Collate(self.tokenizer.eot_id))

    def val_dataloader(self):
        return [DataLoader(self.val_sets[s], batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                           collate_fn=_Collate(self.tokenizer.eot_id)) for s in self.task.val_splits]


@dataclass
class _Collate:
    pad_id: int

    def __call__(self, items):
        return pad_batch(items, self.pad_id)
