"""XSUM for fine-tuning a causal LM: ``document SEP summary EOT``, loss on the summary only.

Source: EdinburghNLP/xsum at revision ``refs/convert/parquet`` (its loading script does not run on
datasets >= 4), or ``--data.path`` with local jsonl / parquet files holding ``document``,
``summary`` and ``id``: a folder whose files are named by split (``train*``, ``validation*`` /
``val*`` / ``dev*``, ``test*``), or such files given one by one.

Layout of a training sequence (T = the model's context): ``doc[:k] + SEP + summary + EOT`` with
``k = T + 1 - len(SEP) - len(summary) - 1``: a document longer than its room loses tokens from its
end, the summary is never cut; an example whose summary leaves no room for one document token is
skipped and counted. Targets are -100 except on the summary and the final EOT. For generation the
prompt is ``doc[:T - len(SEP) - max_new_tokens] + SEP``.
"""
from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.corpora import DataError, hub_reachable, jsonl_rows, read_parquet
from datamodules.epoch_order import resumable_train_loader
from datamodules.tokenizer import TextTokenizer

XSUM_HUB_ID = "EdinburghNLP/xsum"
XSUM_REVISION = "refs/convert/parquet"
COLUMNS = ("document", "summary", "id")
SEPARATOR = "\nTL;DR:"  # GPT-2's zero-shot summarisation cue; the summary follows with a leading space
IGNORE = -100
_SPLIT_PREFIXES = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                   "val": "validation", "dev": "validation", "test": "test"}
_SUFFIXES = (".jsonl", ".parquet")
_MAX_REPORTED = 5


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class XSumSplit:
    documents: List[str]
    summaries: List[str]
    ids: List[str]
    source: str

    def __len__(self) -> int:
        return len(self.ids)


# ---------------------------------------------------------------------------- reading
def split_of(path: pathlib.Path) -> Optional[str]:
    word = path.name.lower().replace("_", "-").split("-")[0].split(".")[0]
    return _SPLIT_PREFIXES.get(word)


def local_files(paths: Sequence[str]) -> Dict[str, List[pathlib.Path]]:
    """Files by split from folders and/or files; a file whose name names no split is an error."""
    files: List[pathlib.Path] = []
    for raw in paths:
        path = pathlib.Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES))
            if not found:
                raise DataError(f"data.path: folder {path} holds no {'/'.join(_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"data.path: {path} does not exist")
    by_split: Dict[str, List[pathlib.Path]] = {}
    for path in files:
        if not path.name.endswith(_SUFFIXES):
            raise DataError(f"data.path: {path} is not jsonl or parquet")
        split = split_of(path)
        if split is None:
            raise DataError(f"data.path: cannot tell the split of {path}: name files train*, validation* (or val*, dev*), test*")
        by_split.setdefault(split, []).append(path)
    return by_split


def read_records(path: pathlib.Path) -> List[dict]:
    if path.suffix == ".parquet":
        table = read_parquet(path)
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing} (has {table.column_names})")
        return table.select(list(COLUMNS)).to_pylist()
    records = []
    for line_no, row in jsonl_rows(path):
        missing = [c for c in COLUMNS if c not in row]
        if missing:
            raise DataError(f"{path}:{line_no}: missing column(s) {missing} (has {sorted(row)})")
        records.append(row)
    return records


def to_split(records: Sequence[dict], where: str, drop_empty: bool) -> XSumSplit:
    docs, sums, ids, empty = [], [], [], []
    for i, row in enumerate(records):
        document, summary = str(row["document"] or ""), str(row["summary"] or "")
        if not document.strip() or not summary.strip():
            what = "document" if not document.strip() else "summary"
            if not drop_empty:
                raise DataError(f"{where}: row {i} (id {row['id']}) has an empty {what}; "
                                "pass --data.drop_empty true to drop such rows (they are counted)")
            empty.append(str(row["id"]))
            continue
        docs.append(document.strip())
        sums.append(summary.strip())
        ids.append(str(row["id"]))
    if empty:
        shown = ", ".join(empty[:_MAX_REPORTED]) + (" ..." if len(empty) > _MAX_REPORTED else "")
        log(f"xsum: {where}: dropped {len(empty)} of {len(records)} rows with an empty document or summary (ids {shown})")
    if not ids:
        raise DataError(f"{where}: no usable XSUM examples")
    return XSumSplit(docs, sums, ids, where)


def load_split(split: str, path: Optional[Sequence[str]] = None, drop_empty: bool = False) -> XSumSplit:
    if path:
        files = local_files(path).get(split)
        if not files:
            raise DataError(f"data.path: no {split} file among {list(path)} (name it {split}.jsonl or {split}-*.parquet)")
        records = [r for f in files for r in read_records(f)]
        return to_split(records, ", ".join(str(f) for f in files), drop_empty)
    if not hub_reachable():
        raise DataError(
            f"dataset {XSUM_HUB_ID!r} (revision {XSUM_REVISION!r}) cannot be downloaded: the Hugging Face Hub is "
            "unreachable or offline mode is set (HF_HUB_OFFLINE=1). Pass --data.path FOLDER with train / validation "
            "jsonl or parquet files holding document, summary and id."
        )
    import datasets

    dataset = datasets.load_dataset(XSUM_HUB_ID, revision=XSUM_REVISION, split=split)
    missing = [c for c in COLUMNS if c not in dataset.column_names]
    if missing:
        raise DataError(f"{XSUM_HUB_ID}/{split}: missing column(s) {missing} (has {dataset.column_names})")
    return to_split(dataset.select_columns(list(COLUMNS)).to_list(), f"{XSUM_HUB_ID}/{split}", drop_empty)


# ---------------------------------------------------------------------------- tokenisation
@dataclass
class Encoded:
    """Tokenised documents (already cut to the longest prefix any layout can use) and summaries."""

    documents: List[np.ndarray]
    summaries: List[np.ndarray]
    references: List[str]
    ids: List[str]


def encode(split: XSumSplit, tokenizer: TextTokenizer, block_size: int, batch: int = 1000) -> Encoded:
    docs, sums = [], []
    for start in range(0, len(split), batch):
        for ids in tokenizer.encode_batch(split.documents[start:start + batch]):
            docs.append(np.asarray(ids[:block_size], dtype=np.int64))
        for ids in tokenizer.encode_batch([" " + s for s in split.summaries[start:start + batch]]):
            sums.append(np.asarray(ids, dtype=np.int64))
    return Encoded(docs, sums, split.summaries, split.ids)


def training_sequence(doc: np.ndarray, sep: Sequence[int], summary: np.ndarray, eot: int, block_size: int):
    """(inputs, targets) of length <= block_size, or None when the summary leaves no document room."""
    room = block_size + 1 - len(sep) - len(summary) - 1
    if room < 1:
        return None
    seq = np.concatenate([doc[:room], np.asarray(sep, dtype=np.int64), summary, [eot]]).astype(np.int64)
    targets = seq[1:].copy()
    prompt = min(len(doc), room) + len(sep)
    targets[: prompt - 1] = IGNORE  # position i predicts token i+1: the first target is the summary's first token
    return seq[:-1], targets


def prompt_ids(doc: np.ndarray, sep: Sequence[int], block_size: int, max_new_tokens: int) -> np.ndarray:
    room = block_size - len(sep) - max_new_tokens
    if room < 1:
        raise DataError(f"max_new_tokens: {max_new_tokens} + separator leaves no room for the document "
                        f"in a context of {block_size}")
    return np.concatenate([doc[:room], np.asarray(sep, dtype=np.int64)]).astype(np.int64)


class SummaryTrainSet(Dataset):
    def __init__(self, encoded: Encoded, sep: Sequence[int], eot: int, block_size: int, name: str = "xsum"):
        self.items = []
        skipped, cut = [], 0
        for doc, summary, ident in zip(encoded.documents, encoded.summaries, encoded.ids):
            pair = training_sequence(doc, sep, summary, eot, block_size)
            if pair is None:
                skipped.append(ident)
                continue
            cut += len(pair[0]) + 1 < len(doc) + len(sep) + len(summary) + 1
            self.items.append(pair)
        if skipped:
            log(f"{name}: skipped {len(skipped)} of {len(encoded.ids)} examples whose summary leaves no room for "
                f"the document in {block_size} tokens (ids {', '.join(skipped[:_MAX_REPORTED])})")
        if cut:
            log(f"{name}: {cut} of {len(self.items)} documents were cut from their end to fit {block_size} tokens")
        if not self.items:
            raise DataError(f"{name}: no example fits in a context of {block_size} tokens")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        inputs, targets = self.items[i]
        return torch.from_numpy(inputs), torch.from_numpy(targets)


class SummaryEvalSet(Dataset):
    """Prompts for generation with their reference summaries (and teacher-forced pairs for the loss)."""

    def __init__(self, encoded: Encoded, sep: Sequence[int], eot: int, block_size: int, max_new_tokens: int):
        self.prompts = [prompt_ids(d, sep, block_size, max_new_tokens) for d in encoded.documents]
        self.references = encoded.references
        self.ids = encoded.ids

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.prompts[i]), self.references[i], self.ids[i]


def pad_train(items, pad_id: int) -> Dict[str, torch.Tensor]:
    inputs, targets = zip(*items)
    T = max(len(x) for x in inputs)
    idx = torch.full((len(inputs), T), pad_id, dtype=torch.long)
    tgt = torch.full((len(inputs), T), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(inputs), T), dtype=torch.long)
    for row, (x, y) in enumerate(zip(inputs, targets)):
        idx[row, : len(x)], tgt[row, : len(y)], mask[row, : len(x)] = x, y, 1
    return {"idx": idx, "targets": tgt, "attention_mask": mask}


def eval_batch(items) -> Dict[str, list]:
    prompts, refs, ids = zip(*items)
    return {"prompts": list(prompts), "references": list(refs), "ids": list(ids)}


@dataclass
class _PadTrain:
    pad_id: int

    def __call__(self, items):
        return pad_train(items, self.pad_id)


class XSumDataModule(L.LightningDataModule):
    """Train loader (teacher forcing) and an evaluation loader of prompts + references."""

    def __init__(self, tokenizer: TextTokenizer, block_size: int, batch_size: int = 8, path: Optional[Sequence[str]] = None,
                 max_new_tokens: int = 64, eval_split: str = "validation", drop_empty: bool = False,
                 max_train_examples: Optional[int] = None, max_eval_examples: Optional[int] = None,
                 eval_batch_size: int = 8, seed: int = 0, num_workers: int = 0):
        super().__init__()
        if eval_split not in ("validation", "test"):
            raise DataError(f"eval_split: must be 'validation' or 'test', got {eval_split!r}")
        self.tokenizer, self.block_size, self.batch_size = tokenizer, block_size, batch_size
        self.path, self.max_new_tokens, self.eval_split = path, max_new_tokens, eval_split
        self.drop_empty, self.seed, self.num_workers = drop_empty, seed, num_workers
        self.max_train_examples, self.max_eval_examples = max_train_examples, max_eval_examples
        self.eval_batch_size = eval_batch_size
        self.separator = tokenizer.encode(SEPARATOR)
        self.train_set: Optional[SummaryTrainSet] = None
        self.eval_set: Optional[SummaryEvalSet] = None
        self.val_set: Optional[SummaryTrainSet] = None

    def _split(self, split: str, limit: Optional[int]) -> XSumSplit:
        data = load_split(split, self.path, self.drop_empty)
        if limit is not None and limit < len(data):
            keep = np.sort(np.random.default_rng(self.seed).permutation(len(data))[:limit])
            log(f"xsum/{split}: using {limit} of {len(data)} examples (a seeded random subset)")
            data = XSumSplit(*([getattr(data, f)[i] for i in keep] for f in ("documents", "summaries", "ids")), data.source)
        return data

    def setup(self, stage: Optional[str] = None) -> None:
        """Every split; ``validate`` / ``test`` (``--eval_only``) read only the evaluation split."""
        eot = self.tokenizer.eot_id
        if self.train_set is None and stage not in ("validate", "test"):
            train = encode(self._split("train", self.max_train_examples), self.tokenizer, self.block_size)
            self.train_set = SummaryTrainSet(train, self.separator, eot, self.block_size, "xsum/train")
        if self.eval_set is not None:
            return
        held = encode(self._split(self.eval_split, self.max_eval_examples), self.tokenizer, self.block_size)
        self.val_set = SummaryTrainSet(held, self.separator, eot, self.block_size, f"xsum/{self.eval_split}")
        self.eval_set = SummaryEvalSet(held, self.separator, eot, self.block_size, self.max_new_tokens)

    def train_dataloader(self) -> DataLoader:
        return resumable_train_loader(self.train_set, self.batch_size, self.seed, self.trainer,
                                      num_workers=self.num_workers, collate_fn=_PadTrain(self.tokenizer.eot_id))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=_PadTrain(self.tokenizer.eot_id))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.eval_set, batch_size=self.eval_batch_size, shuffle=False, collate_fn=eval_batch)
