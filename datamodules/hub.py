"""Hugging Face Hub pre-training corpora: ``openwebtext`` and ``slimpajama`` (SPEC §4).

* ``openwebtext``: Skylion007/openwebtext at revision ``refs/convert/parquet`` (the repo's loading
  script does not run on datasets >= 4), column ``text``, train split only. 0.05% of the documents
  (a fixed hash of the row index, as nanoGPT's 0.0005 split) are held out as ``val``.
  ``--data.path`` reads local parquet / jsonl / txt files instead (a .txt file is one document); local
  files use the block-level ``data.val_fraction`` hold-out, as ``--data text`` does.
* ``slimpajama``: DKYoon/SlimPajama-6B (parquet) by default, ``--data.hub_id cerebras/SlimPajama-627B``
  (or ``627B``; jsonl.zst, best with ``--data.streaming``). Training uses the RedPajamaCommonCrawl and
  RedPajamaC4 documents of the train split; ``validation_sets()`` gives ``val`` (those two subsets in
  the validation split) and one set per other subset (out-of-distribution), each logged under its
  own name. Local files need ``text`` and ``meta.redpajama_set_name``; their split comes from the
  file or folder name (train / validation / test). Without validation files, 1% of the CC + C4
  documents (hashed) become ``val`` and the other subsets are read from all files.

Tokenisation goes through ``datamodules/cache_build.py``: ordered shards of documents encoded by
``--data.num_proc`` processes (default every CPU), resumable, with a progress bar, into the memmap cache
keyed by the corpus fingerprint
(dataset id + revision + selection, or the local files' paths, sizes and times) and the tokenizer.
``--data.streaming`` streams rows from the Hub instead of downloading the raw files, and
``--data.max_tokens`` stops the training corpus after that many tokens (for corpora larger than
the disk). Offline (``HF_HUB_OFFLINE=1`` or no route to the Hub) without a local path or a built
cache, construction fails at once with a message naming the dataset and ``--data.path``.
"""
from __future__ import annotations

import hashlib
import pathlib
import sys
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from datamodules.corpora import Corpus, DataError, hub_reachable, jsonl_rows
from datamodules.files import default_cache_dir

OPENWEBTEXT_ID = "Skylion007/openwebtext"
OPENWEBTEXT_REVISION = "refs/convert/parquet"
OPENWEBTEXT_VAL_FRACTION = 0.0005
OPENWEBTEXT_STREAM_VAL_DOCS = 4000  # ~0.05% of its 8M documents
STREAM_VAL_TOKENS = 5_000_000  # streamed validation sets stop here (a 627B validation split is huge)

SLIMPAJAMA_IDS = {"6B": "DKYoon/SlimPajama-6B", "627B": "cerebras/SlimPajama-627B"}
SLIMPAJAMA_TRAIN_SETS = ("RedPajamaCommonCrawl", "RedPajamaC4")
SLIMPAJAMA_OOD_SETS = ("RedPajamaGithub", "RedPajamaBook", "RedPajamaArXiv", "RedPajamaWikipedia",
                       "RedPajamaStackExchange")
SLIMPAJAMA_LOCAL_VAL_FRACTION = 0.01
SET_FIELD = "redpajama_set_name"

_GOLDEN = 2654435761
_MODULUS = 1_000_003
_LOCAL_SUFFIXES = (".parquet", ".jsonl", ".txt", ".jsonl.zst", ".jsonl.gz")
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "val": "validation", "dev": "validation", "test": "test"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def holdout_mask(num_rows: int, fraction: float) -> np.ndarray:
    """Rows whose index hashes below ``fraction``: the same rows on every machine and every run."""
    scores = (np.arange(num_rows, dtype=np.uint64) * np.uint64(_GOLDEN)) % np.uint64(_MODULUS)
    return scores < np.uint64(int(fraction * _MODULUS))


def in_holdout(index: int, fraction: float) -> bool:
    return (index * _GOLDEN) % _MODULUS < int(fraction * _MODULUS)


def offline_error(dataset: str, revision: Optional[str], what: str) -> DataError:
    at = f" (revision {revision!r})" if revision else ""
    return DataError(
        f"dataset {dataset!r}{at} is not available: the Hugging Face Hub is unreachable or offline mode is set "
        f"(HF_HUB_OFFLINE=1), and no token cache of it exists yet. Pass local files with --data.path "
        f"FILE_OR_FOLDER ({what}), or run once with network access to build the cache."
    )


# ---------------------------------------------------------------------------- local files
def split_of(path: pathlib.Path) -> Optional[str]:
    """"train" / "validation" / "test" from the file name's first word, else the nearest folder name."""
    words = [path.name.lower().replace("_", "-").split("-")[0].split(".")[0]]
    words += [part.lower() for part in reversed(path.parent.parts)]
    for word in words:
        if word in _SPLIT_WORDS:
            return _SPLIT_WORDS[word]
    return None


def expand_files(paths: Sequence[str], option: str = "data.path") -> List[pathlib.Path]:
    files: List[pathlib.Path] = []
    for raw in paths:
        path = pathlib.Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(_LOCAL_SUFFIXES))
            if not found:
                raise DataError(f"{option}: folder {path} holds no {', '.join(_LOCAL_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if not path.name.endswith(_LOCAL_SUFFIXES):
                raise DataError(f"{option}: {path} is not one of {', '.join(_LOCAL_SUFFIXES)}")
            files.append(path)
        else:
            raise DataError(f"{option}: {path} does not exist")
    if not files:
        raise DataError(f"{option}: no files given")
    return files


def files_key(files: Sequence[pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}\n".encode())
    return digest.hexdigest()


def check_columns(path: pathlib.Path, columns: Sequence[str]) -> None:
    """Fail naming the file when a required column (``meta.x`` = field x of struct meta) is absent."""
    name = path.name
    if name.endswith(".txt"):
        missing = [c for c in columns if c != "text"]
        if missing:
            raise DataError(f"{path}: a .txt file holds only text; missing column(s) {missing} (use parquet or jsonl)")
        return
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        present = set(schema.names)
        for column in columns:
            top, _, sub = column.partition(".")
            if top not in present:
                raise DataError(f"{path}: missing column {column!r} (has {sorted(present)})")
            if sub:
                field_type = schema.field(top).type
                names = [field_type.field(i).name for i in range(field_type.num_fields)] if hasattr(field_type, "num_fields") else []
                if sub not in names:
                    raise DataError(f"{path}: column {top!r} has no field {sub!r} (type {field_type})")
        return
    if name.endswith(".jsonl"):
        row, line_no = _first_json_row(path)
        if row is None:
            raise DataError(f"{path}: the file has no rows")
        for column in columns:
            top, _, sub = column.partition(".")
            if top not in row:
                raise DataError(f"{path}:{line_no}: missing column {column!r} (has {sorted(row)})")
            if sub and not (isinstance(row[top], dict) and sub in row[top]):
                raise DataError(f"{path}:{line_no}: {top!r} is not an object with field {sub!r} (got {str(row[top])[:80]!r})")
    # compressed jsonl is checked after loading, per file group


def _first_json_row(path: pathlib.Path) -> Tuple[Optional[dict], int]:
    for line_no, row in jsonl_rows(path):
        return row, line_no
    return None, 0


def load_local(files: Sequence[pathlib.Path], columns: Sequence[str], cache_dir: pathlib.Path):
    """One ``datasets.Dataset`` (memory-mapped Arrow) with the top-level ``columns`` of ``files``, in order."""
    import datasets

    for path in files:
        check_columns(path, columns)
    if any(p.name.endswith(".zst") for p in files):
        require_zstandard(f"{files[0].parent}/*.zst")
    tops = list(dict.fromkeys(c.partition(".")[0] for c in columns))
    parts = []
    for path in files:  # file by file keeps the given order across formats
        if path.name.endswith(".txt"):
            parts.append(datasets.Dataset.from_dict({"text": [path.read_text(encoding="utf-8")]}))
            continue
        builder = "parquet" if path.name.endswith(".parquet") else "json"
        part = datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                     cache_dir=str(cache_dir / "hf_datasets"))
        missing = [c for c in tops if c not in part.column_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing} (has {part.column_names})")
        parts.append(part.select_columns(tops))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def require_zstandard(what: str) -> None:
    try:
        import zstandard  # noqa: F401
    except ImportError as err:
        raise DataError(f"{what}: reading .zst files needs the zstandard package: pip install zstandard") from err


# ---------------------------------------------------------------------------- row selection
@dataclass(frozen=True)
class Selection:
    """Which rows of a split a corpus uses: subset names, then one side of a hold-out.

    The hold-out is a hashed ``fraction`` of the row indices (at least one eligible row), or, for
    streams whose length is unknown, the ``first`` N rows.
    """

    sets: Optional[Tuple[str, ...]] = None
    fraction: Optional[float] = None
    first: Optional[int] = None
    side: str = "keep"  # "keep": rows outside the hold-out; "take": the held-out rows

    @property
    def tag(self) -> str:
        parts = []
        if self.sets is not None:
            parts.append("sets=" + "+".join(self.sets))
        if self.fraction is not None:
            parts.append(f"holdout={self.fraction}:{self.side}")
        if self.first is not None:
            parts.append(f"first={self.first}:{self.side}")
        return ",".join(parts) or "all"

    def rows(self, dataset) -> np.ndarray:
        eligible = np.ones(len(dataset), dtype=bool) if self.sets is None else set_mask(dataset, self.sets)
        if self.fraction is None and self.first is None:
            return np.flatnonzero(eligible)
        if self.first is not None:
            held = np.arange(len(dataset)) < self.first
        else:
            held = holdout_mask(len(dataset), self.fraction) & eligible
            if not held.any() and eligible.any():
                held[np.flatnonzero(eligible)[-1]] = True  # tiny corpora still get a validation document
        return np.flatnonzero(eligible & (held if self.side == "take" else ~held))

    def keep(self, row: dict, index: int) -> bool:
        """The same decision for one streamed row (hashed hold-outs without the at-least-one rule)."""
        if self.sets is not None and _row_set(row) not in self.sets:
            return False
        if self.first is not None:
            return (index < self.first) == (self.side == "take")
        if self.fraction is not None:
            return in_holdout(index, self.fraction) == (self.side == "take")
        return True


def set_mask(dataset, sets: Sequence[str]) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    names = pc.struct_field(dataset.data.table.column("meta"), SET_FIELD)
    return pc.is_in(names, value_set=pa.array(list(sets))).to_numpy(zero_copy_only=False)


def set_counts(dataset) -> Dict[str, int]:
    import pyarrow.compute as pc

    names = pc.struct_field(dataset.data.table.column("meta"), SET_FIELD)
    counts = pc.value_counts(names).to_pylist()
    return {str(c["values"]): int(c["counts"]) for c in counts}


def _row_set(row: dict) -> Optional[str]:
    meta = row.get("meta")
    return meta.get(SET_FIELD) if isinstance(meta, dict) else None


# ---------------------------------------------------------------------------- sources and corpora
class Source:
    """Rows of one dataset, from the Hub (id + revision, optionally streamed) or local files.

    Each split is loaded once and shared by every corpus view of this source.
    """

    def __init__(self, label: str, hub_id: str, revision: Optional[str], files: Optional[List[pathlib.Path]],
                 columns: Sequence[str], cache_dir: pathlib.Path, streaming: bool, num_proc: Optional[int],
                 local_help: str):
        self.label, self.hub_id, self.revision = label, hub_id, revision
        self.files, self.columns, self.cache_dir = files, tuple(columns), cache_dir
        self.streaming = streaming and files is None
        self.num_proc, self.local_help = num_proc, local_help
        self._loaded: Dict[str, object] = {}

    @property
    def key(self) -> str:
        if self.files is not None:
            return f"local:{files_key(self.files)}"
        return f"hub:{self.hub_id}@{self.revision or 'main'}"

    def local_splits(self) -> Dict[str, List[pathlib.Path]]:
        out: Dict[str, List[pathlib.Path]] = {}
        for path in self.files or []:
            out.setdefault(split_of(path) or "train", []).append(path)
        return out

    def load(self, split: str):
        if split not in self._loaded:
            self._loaded[split] = self._load_local(split) if self.files is not None else self._load_hub(split)
        return self._loaded[split]

    def _load_local(self, split: str):
        files = self.files if split == "all" else self.local_splits().get(split)
        if not files:
            raise DataError(f"data.path: no {split} files among {[str(f) for f in self.files]}")
        return load_local(files, self.columns, self.cache_dir)

    def _load_hub(self, split: str):
        import datasets

        if not hub_reachable():
            raise offline_error(self.hub_id, self.revision, self.local_help)
        if self.hub_id.endswith("SlimPajama-627B"):
            require_zstandard(self.hub_id)
        name = self._hub_split(split)
        log(f"{self.label}: loading {self.hub_id} split {name!r}" + (" (streaming)" if self.streaming else ""))
        data = datasets.load_dataset(self.hub_id, revision=self.revision, split=name, streaming=self.streaming)
        missing = [c.partition(".")[0] for c in self.columns if c.partition(".")[0] not in (data.column_names or [])]
        if data.column_names is not None and missing:
            raise DataError(f"dataset {self.hub_id!r} split {name!r}: missing column(s) {missing} (has {data.column_names})")
        return data

    def _hub_split(self, split: str) -> str:
        """The split itself, or the Hub's partial parquet export of it (e.g. "partial_train")."""
        import datasets

        names = datasets.get_dataset_split_names(self.hub_id, revision=self.revision)
        if split in names:
            return split
        close = [n for n in names if split in n]
        if not close:
            raise DataError(f"dataset {self.hub_id!r} has no {split!r} split (has {names})")
        log(f"{self.label}: {self.hub_id} has no {split!r} split; using {close[0]!r} (the Hub's parquet export)")
        return close[0]


class HubCorpus(Corpus):
    """The ``text`` of the rows ``selection`` picks from one split of a ``Source``."""

    default_tokenizer = "gpt2"

    def __init__(self, name: str, source: Source, split: str, selection: Selection = Selection(),
                 max_tokens: Optional[int] = None,
                 validation: Optional[Callable[[], Optional[Dict[str, Corpus]]]] = None):
        self.name, self.source, self.split, self.selection = name, source, split, selection
        self.max_tokens = max_tokens
        self._validation = validation
        self._validation_sets: Optional[Dict[str, Corpus]] = None
        self._rows: Optional[np.ndarray] = None

    def fingerprint(self) -> str:
        key = f"{self.source.key}|{self.split}|{self.selection.tag}|max_tokens={self.max_tokens}"
        return f"{self.name}-{self.split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def validation_sets(self) -> Optional[Dict[str, Corpus]]:
        if self._validation is None:
            return None
        if self._validation_sets is None:
            self._validation_sets = self._validation()
        return self._validation_sets

    # ------------------------------------------------------------------ rows
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = self.selection.rows(self.source.load(self.split))
            if len(self._rows) == 0:
                raise DataError(f"{self.name}: no documents in split {self.split!r} for {self.selection.tag} "
                                f"({self.source.hub_id if self.source.files is None else 'data.path files'})")
        return self._rows

    def selected(self):
        data = self.source.load(self.split)
        if self.source.streaming:
            selection = self.selection
            if selection.first is not None:  # take/skip end where a filter would read the whole stream
                data = data.take(selection.first) if selection.side == "take" else data.skip(selection.first)
                selection = replace(selection, first=None)
            return data if selection.tag == "all" else data.filter(selection.keep, with_indices=True)
        rows = self.rows()
        return data if len(rows) == len(data) else data.select(rows)

    def documents(self) -> Iterator[str]:
        data = self.selected()
        if self.source.streaming:
            for row in data:
                yield row["text"]
            return
        for batch in data.select_columns(["text"]).iter(batch_size=1000):
            yield from batch["text"]

    def num_documents(self) -> Optional[int]:
        """Known for a loaded (not streamed) split; the progress bar's total."""
        return None if self.source.streaming else len(self.rows())

    def size_bytes(self) -> Optional[int]:
        """Text bytes of the selected rows once the split is loaded, the local files' size before; a Hub
        split not loaded yet or a stream: None (unknown without downloading it)."""
        if self.source.streaming:
            return None
        if self.split in self.source._loaded:
            data = self.source.load(self.split)
            return int(data.data.column("text").nbytes * len(self.rows()) / max(len(data), 1))
        return sum(p.stat().st_size for p in self.source.files) if self.source.files is not None else None


def stream_val_cap(source: Source) -> Optional[int]:
    return STREAM_VAL_TOKENS if source.streaming else None


def _has_cache(cache_dir: pathlib.Path, corpus: Corpus) -> bool:
    # a cache this code can read (its format, its full size), for some tokenizer: one of another format would be
    # rebuilt, and offline that rebuild fails only after the tokenizer and the model are built
    from datamodules.token_cache import complete_meta

    return any(complete_meta(meta.parent) is not None
               for meta in (cache_dir / "tokens").glob(f"{corpus.fingerprint()}-*/meta.json"))


def fail_fast_offline(corpora: Sequence[HubCorpus], cache_dir: pathlib.Path) -> None:
    """Raise now (before tokenizers and models are built) when a hub corpus can neither be read nor is cached."""
    hub = [c for c in corpora if c.source.files is None]
    if hub and not all(_has_cache(cache_dir, c) for c in hub) and not hub_reachable():
        source = hub[0].source
        raise offline_error(source.hub_id, source.revision, source.local_help)


# ---------------------------------------------------------------------------- factories
def _cache_dir(cache_dir) -> pathlib.Path:
    if cache_dir is None:
        return default_cache_dir()
    return pathlib.Path(cache_dir)


def openwebtext(path: Optional[Sequence[str]] = None, hub_id: Optional[str] = None, revision: Optional[str] = None,
                streaming: bool = False, max_tokens: Optional[int] = None, num_proc: Optional[int] = None,
                cache_dir=None, **_) -> HubCorpus:
    cache = _cache_dir(cache_dir)
    files = expand_files(path) if path else None
    dataset = hub_id or OPENWEBTEXT_ID
    rev = revision if revision is not None else (OPENWEBTEXT_REVISION if hub_id is None else None)
    source = Source("openwebtext", dataset, rev, files, ["text"], cache, streaming, num_proc,
                    "parquet, jsonl or txt with a 'text' column")
    if files is not None:  # local files: the DataModule's block-level val_fraction hold-out
        return HubCorpus("openwebtext", source, "all", Selection(), max_tokens)
    if source.streaming:  # a stream's length is unknown: hold out its first documents instead
        held = dict(first=OPENWEBTEXT_STREAM_VAL_DOCS)
    else:
        held = dict(fraction=OPENWEBTEXT_VAL_FRACTION)
    val = HubCorpus("openwebtext", source, "train", Selection(side="take", **held), stream_val_cap(source))
    train = HubCorpus("openwebtext", source, "train", Selection(side="keep", **held), max_tokens,
                      validation=lambda: {"val": val})
    fail_fast_offline([train, val], cache)
    return train


def slimpajama(path: Optional[Sequence[str]] = None, hub_id: Optional[str] = None, revision: Optional[str] = None,
               streaming: bool = False, max_tokens: Optional[int] = None, num_proc: Optional[int] = None,
               cache_dir=None, **_) -> HubCorpus:
    cache = _cache_dir(cache_dir)
    files = expand_files(path) if path else None
    dataset = SLIMPAJAMA_IDS.get(hub_id or "6B", hub_id)
    if files is None and dataset.endswith("SlimPajama-627B") and not streaming:
        log("slimpajama: cerebras/SlimPajama-627B is ~900 GB of jsonl.zst; consider --data.streaming true "
            "with --data.max_tokens N")
    source = Source("slimpajama", dataset, revision, files, ["text", f"meta.{SET_FIELD}"], cache, streaming, num_proc,
                    f"parquet or jsonl with 'text' and 'meta.{SET_FIELD}'; split from the file/folder name")
    if files is not None:
        return _local_slimpajama(source, max_tokens)
    cap = stream_val_cap(source)
    val_sets: Dict[str, Corpus] = {"val": HubCorpus("slimpajama", source, "validation", Selection(SLIMPAJAMA_TRAIN_SETS), cap)}
    for name in SLIMPAJAMA_OOD_SETS:
        val_sets[name] = HubCorpus("slimpajama", source, "validation", Selection((name,)), cap)
    train = HubCorpus("slimpajama", source, "train", Selection(SLIMPAJAMA_TRAIN_SETS), max_tokens,
                      validation=lambda: val_sets)
    fail_fast_offline([train, *val_sets.values()], cache)
    return train


def _local_slimpajama(source: Source, max_tokens: Optional[int]) -> HubCorpus:
    splits = source.local_splits()
    if "train" not in splits:
        raise DataError(f"data.path: no training files among {[str(f) for f in source.files]} "
                        "(a file whose name or folder says test is not used for training)")
    has_val = "validation" in splits
    if has_val:
        train_sel = Selection(SLIMPAJAMA_TRAIN_SETS)
        val_sel = Selection(SLIMPAJAMA_TRAIN_SETS)
    else:
        frac = SLIMPAJAMA_LOCAL_VAL_FRACTION
        train_sel = Selection(SLIMPAJAMA_TRAIN_SETS, fraction=frac, side="keep")
        val_sel = Selection(SLIMPAJAMA_TRAIN_SETS, fraction=frac, side="take")
    val_split = "validation" if has_val else "train"

    def validation() -> Dict[str, Corpus]:
        counts = set_counts(source.load(val_split))
        log(f"slimpajama: {val_split} documents per subset in data.path: {counts}")
        unknown = {k: v for k, v in counts.items() if k not in SLIMPAJAMA_TRAIN_SETS + SLIMPAJAMA_OOD_SETS}
        if unknown:
            log(f"slimpajama: {sum(unknown.values())} documents of unknown subsets {sorted(unknown)} are not used")
        if not has_val:
            log(f"slimpajama: no validation files; holding out {frac:.0%} of the CommonCrawl + C4 documents as 'val' "
                "and reading the out-of-distribution subsets from all files")
        sets: Dict[str, Corpus] = {"val": HubCorpus("slimpajama", source, val_split, val_sel)}
        absent = [n for n in SLIMPAJAMA_OOD_SETS if counts.get(n, 0) == 0]
        if absent:
            log(f"slimpajama: no {val_split} documents of {absent}: those out-of-distribution sets are skipped")
        for name in SLIMPAJAMA_OOD_SETS:
            if name not in absent:
                sets[name] = HubCorpus("slimpajama", source, val_split, Selection((name,)))
        return sets

    return HubCorpus("slimpajama", source, "train", train_sel, max_tokens, validation=validation)
