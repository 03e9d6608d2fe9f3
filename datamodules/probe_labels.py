"""Bring your own probe: per-token difficulty labels for any corpus (``--data.labels PATH``; docs/probes.md).

A label is an integer level per token of the corpus's token stream (the stream ``tokens.bin`` holds:
each document's tokens, then one EOT), ``-1`` = unlabelled. Two file formats:

* ``.npy``: a 1-D integer array with exactly one entry per token of the stream (any corpus whose
  validation is held out from that one stream). ``label_tokens`` makes it from documents and
  character spans for a given tokenizer.
* ``.jsonl``: one object per document of the corpus, in the corpus's order, ``{"spans": [[start, end,
  level], ...]}`` with character offsets into the document (end exclusive), and optionally the document's
  ``"text"`` (then it must equal the corpus's document; a row whose ``text`` is empty is skipped, as the
  ``text`` corpus skips it, so the corpus file itself can carry the spans). The cache build converts it
  with ``label_tokens`` through the tokenizer's offsets and checks that its tokens are the cache's; the
  result is stored beside ``tokens.bin`` as ``labels-<file fingerprint>/levels.npy``. Only corpora tokenised
  from their documents (``text``, ``embedded``) take this format.

A token takes the highest level among the spans its characters overlap (a byte-level BPE token such as
``"Ġ42"`` overlaps a span ``"42"``); EOT and tokens outside every span are unlabelled.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from architectures.config import ConfigError
from datamodules.corpora import DataError, jsonl_rows

NO_LABEL = -1
FORMATS = (".npy", ".jsonl")
Span = Tuple[int, int, int]  # (start character, end character (exclusive), level)


# ---------------------------------------------------------------------------- spans -> per-token levels
def label_tokens(documents: Iterable[str], spans: Iterable[Sequence[Span]], tokenizer) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids int64, levels int8) of the stream ``cache_build.build_tokens`` writes for ``documents`` (each document's
    tokens, then EOT), each token labelled with the highest level of the character spans it overlaps."""
    ids: List[np.ndarray] = []
    levels: List[np.ndarray] = []
    eot = tokenizer.eot_id
    for text, doc_spans in zip(documents, spans, strict=True):
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        ids.append(np.asarray(encoding.ids + [eot], dtype=np.int64))
        levels.append(np.append(span_levels(encoding.offsets, doc_spans), NO_LABEL).astype(np.int8))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int8)
    return np.concatenate(ids), np.concatenate(levels)


def span_levels(offsets: Sequence[Tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """Per token (character range ``offsets[i]``): the highest level of the spans it overlaps, else -1."""
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    ends = np.asarray([o[1] for o in offsets], dtype=np.int64)
    out = np.full(len(offsets), NO_LABEL, dtype=np.int64)
    for start, end, level in spans:
        overlaps = (starts < end) & (ends > start)
        out[overlaps] = np.maximum(out[overlaps], level)
    return out


def read_span_file(path: pathlib.Path, levels: Optional[int] = None) -> Iterator[Tuple[Optional[str], List[Span]]]:
    """(text or None, spans) per document row of a ``.jsonl`` label file, each span checked."""
    for line_no, row in jsonl_rows(path):
        text = row.get("text")
        if text is not None and not text:
            continue  # the text corpus skips empty documents
        spans = row.get("spans")
        if not isinstance(spans, list):
            raise DataError(f"data.labels: {path}:{line_no}: needs a 'spans' list of [start, end, level]")
        yield text, [_checked_span(span, path, line_no, levels) for span in spans]


def _checked_span(span, path: pathlib.Path, line_no: int, levels: Optional[int]) -> Span:
    ok = isinstance(span, (list, tuple)) and len(span) == 3 and all(isinstance(v, int) for v in span)
    if not ok or span[0] < 0 or span[1] <= span[0]:
        raise DataError(f"data.labels: {path}:{line_no}: span {span!r} is not [start, end, level] with "
                        "0 <= start < end (character offsets, end exclusive)")
    top = f"{levels - 1}" if levels else "the number of levels - 1"
    if span[2] < 0 or (levels is not None and span[2] >= levels):
        raise DataError(f"data.labels: {path}:{line_no}: span level {span[2]} is outside 0..{top} "
                        "(--callbacks.probe_levels sets the number of levels; by default the file's own)")
    return int(span[0]), int(span[1]), int(span[2])


def levels_from_span_file(path: pathlib.Path, documents: Iterable[str], tokenizer, expected: np.ndarray) -> np.ndarray:
    """Per-token levels of the corpus's stream from a ``.jsonl`` span file; its tokens must be ``expected``."""
    rows = list(read_span_file(path))
    docs = list(documents)
    if len(rows) != len(docs):
        raise DataError(f"data.labels: {path} has {len(rows)} documents, the corpus {len(docs)}; one row per "
                        "document, in the corpus's order")
    for index, ((text, _), doc) in enumerate(zip(rows, docs)):
        if text is not None and text != doc:
            raise DataError(f"data.labels: {path}: row {index + 1}'s text differs from the corpus's document "
                            f"{index + 1}; the rows must follow the corpus's documents in order")
    tokens, levels = label_tokens(docs, [spans for _, spans in rows], tokenizer)
    if not np.array_equal(tokens, np.asarray(expected, dtype=np.int64)):
        raise DataError(f"data.labels: {path}: the documents tokenise to {len(tokens)} tokens that differ from the "
                        f"token cache's {len(expected)}; the label file does not belong to this corpus")
    return levels


# ---------------------------------------------------------------------------- checks
def check_label_file(path: str, levels: Optional[int] = None) -> None:
    """Up-front checks of ``--data.labels`` (before any tokenisation): it exists, has a known format and,
    for ``.npy``, holds integers in -1..levels-1 in one dimension (its length is checked once the cache exists)."""
    file = pathlib.Path(path)
    if file.suffix not in FORMATS:
        raise DataError(f"data.labels: {path} must be a .npy (one level per token) or a .jsonl (character spans "
                        "per document) file")
    if not file.is_file():
        raise DataError(f"data.labels: {path} does not exist or is not a file")
    if file.suffix == ".npy":
        bounds = npy_range(file)
        if bounds is not None:
            _check_range(*bounds, levels, where=f"{path}: ")
    else:
        for _ in read_span_file(file, levels):
            pass


def too_few_levels(labels: str, top: int, levels: int) -> ConfigError:
    """The refusal of a ``--callbacks.probe_levels`` below the levels ``labels`` use (0..top), in the same words at
    both stages that check it: from a probe dataset's name, and from the data at fit start. (A label file's
    up-front check names its file and line instead: ``check_levels``, ``_checked_span``.)"""
    return ConfigError(f"callbacks.probe_levels: {labels} use levels 0..{top}, more than the {levels} given; raise it "
                       f"to {top + 1} or drop it (the default is the labels' own count)")


def label_file_levels(path: str) -> Optional[int]:
    """The number of levels a label file uses (its top level + 1; None if it labels no token): the default of
    ``--callbacks.probe_levels`` with ``--data.labels``. Cached per file version: a label file may be as large as
    the token stream, and programmes that parse many runs' options (sweep, repro) would read it once per run."""
    file = pathlib.Path(path)
    if file.suffix == ".npy":
        bounds = npy_range(file)
        top = bounds[1] if bounds is not None else NO_LABEL
    else:
        top = _span_file_top(*_file_version(file))
    return top + 1 if top > NO_LABEL else None


def npy_range(path: pathlib.Path) -> Optional[Tuple[int, int]]:
    """(lowest, highest) level of a ``.npy`` label file, None when it is empty: one pass over the file, shared by
    the default of ``--callbacks.probe_levels`` and the up-front check (cached per file version)."""
    return _npy_range(*_file_version(path))


def _file_version(path: pathlib.Path) -> Tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _npy_range(path: str, mtime_ns: int, size: int) -> Optional[Tuple[int, int]]:
    array = load_npy(pathlib.Path(path))
    return (int(array.min()), int(array.max())) if len(array) else None


@functools.lru_cache(maxsize=4)
def _span_file_top(path: str, mtime_ns: int, size: int) -> int:
    return max((level for _, spans in read_span_file(pathlib.Path(path)) for _, _, level in spans), default=NO_LABEL)


def load_npy(path: pathlib.Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"data.labels: {path} is not a readable .npy file ({err})") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"data.labels: {path} holds a {array.dtype} array of shape {array.shape}; it must be a 1-D "
                        "integer array (one level per token, -1 = unlabelled)")
    return array


def _check_range(low: int, high: int, levels: Optional[int], where: str) -> None:
    """Levels in -1..levels-1 (``levels`` None: only the lower bound)."""
    if low < NO_LABEL or (levels is not None and high >= levels):
        top = levels - 1 if levels is not None else "levels - 1"
        raise DataError(f"data.labels: {where}levels run from {low} to {high}; allowed are -1 (unlabelled) and "
                        f"0..{top} (--callbacks.probe_levels sets the number of levels; by default the file's own)")


def open_token_labels(path: pathlib.Path, num_tokens: int) -> np.ndarray:
    """The per-token levels memmap of a ``.npy``, checked against the token stream's length."""
    array = load_npy(path)
    if len(array) != num_tokens:
        raise DataError(f"data.labels: {path} has {len(array)} levels for the {num_tokens} tokens of the corpus's "
                        "token stream; it needs one per token (make it with datamodules.probe_labels.label_tokens)")
    bounds = npy_range(path)  # the pass the start-up check already made, when it ran in this process
    if bounds is not None:
        _check_range(*bounds, None, where=f"{path}: ")
    return array


def file_fingerprint(path: pathlib.Path) -> str:
    with pathlib.Path(path).open("rb") as handle:  # streamed: a label file may be as large as the token cache
        return hashlib.file_digest(handle, "sha256").hexdigest()[:16]




def converted_path(cache_folder: pathlib.Path, label_file: pathlib.Path) -> pathlib.Path:
    """Where the cache build keeps the per-token levels converted from a ``.jsonl`` span file."""
    return cache_folder / f"labels-{file_fingerprint(label_file)}" / "levels.npy"


# ---------------------------------------------------------------------------- evaluation blocks
def labelled_blocks(datamodule, count: int, rank: int = 0, world: int = 1):
    """This rank's share of the first ``count`` validation blocks of an ``LMDataModule`` with a label file:
    (tokens (N, T+1) int64, levels (N, T) int64 of the targets)."""
    dataset = next(iter(datamodule.val_sets.values()))
    T = dataset.block_size
    chosen = np.array_split(np.asarray(dataset.indices[:count]), world)[rank]
    starts = [int(block) * T for block in chosen.tolist()]
    tokens = [np.asarray(dataset.tokens[s : s + T + 1], dtype=np.int64) for s in starts]
    levels = [np.asarray(datamodule.token_levels[s + 1 : s + T + 1], dtype=np.int64) for s in starts]
    return (np.stack(tokens) if tokens else np.zeros((0, T + 1), np.int64),
            np.stack(levels) if levels else np.zeros((0, T), np.int64))


def evaluation_blocks(datamodule, count: int, rank: int = 0, world: int = 1):
    """(tokens, levels, families, family names) the probe metrics evaluate: the probe data's own labels and
    task families, or a label file's levels (one family: none)."""
    if getattr(datamodule.config, "labels", None):
        tokens, levels = labelled_blocks(datamodule, count, rank, world)
        return tokens, levels, np.zeros_like(levels), ()
    from datamodules import probe

    tokens, levels, families = probe.labelled_blocks(datamodule, count, rank, world)
    return tokens, levels, families, probe.FAMILIES
