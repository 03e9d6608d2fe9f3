"""Text corpora for language-model pre-training: the ``Corpus`` base, the local corpora and file readers.

A corpus yields documents (strings) and a fingerprint that identifies its content, so the token
cache can be keyed by corpus + tokenizer. ``embedded`` needs no network and no files: it is the
English prose that ships with Python itself (``pydoc_data.topics`` plus the docstrings of the
standard-library modules, read with ``ast`` without importing them).

The corpora by name (``data.name``) are in ``datamodules/catalog.py``.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import pathlib
import socket
import sys
import sysconfig
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from datamodules.files import atomic_text, default_cache_dir

_SKIP_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo"}
_MIN_DOCSTRING_CHARS = 40


class DataError(ValueError):
    """Bad data source or data files; the message names the file/dataset and what to do."""


class Corpus:
    """A named text source. Subclasses implement ``documents`` and ``fingerprint``."""

    name: str = "corpus"
    default_tokenizer: str = "gpt2"

    def documents(self) -> Iterator[str]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def cache_is_complete(self, folder: pathlib.Path) -> bool:
        """Whether the files this corpus writes beside a verified token cache (``write_tokens``) are intact;
        False makes ``prepare_data`` rebuild the cache."""
        return True

    def validation_sets(self) -> Optional[Dict[str, "Corpus"]]:
        """Named held-out corpora (e.g. SlimPajama's out-of-distribution subsets).

        ``None`` means: hold out a deterministic fraction of this corpus's blocks instead.
        """
        return None


class EmbeddedCorpus(Corpus):
    """English text shipped with the running Python: pydoc topics + stdlib docstrings (~2 MB)."""

    name = "embedded"
    default_tokenizer = "bpe"

    def __init__(self) -> None:
        self._docs: Optional[List[str]] = None

    def _load(self) -> List[str]:
        if self._docs is None:
            import pydoc_data.topics

            docs = [pydoc_data.topics.topics[k].strip() for k in sorted(pydoc_data.topics.topics)]
            docs.extend(_stdlib_docstrings())
            self._docs = [d for d in docs if d]
        return self._docs

    def documents(self) -> Iterator[str]:
        return iter(self._load())

    def size_bytes(self) -> int:
        return sum(len(doc.encode("utf-8")) for doc in self._load())

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for doc in self._load():
            digest.update(doc.encode("utf-8"))
            digest.update(b"\0")
        return f"embedded-py{sys.version_info.major}.{sys.version_info.minor}-{digest.hexdigest()[:16]}"


#: bump when what ``_parse_docstrings`` keeps changes: the cached docstrings of the old rule are then not read
_DOCSTRINGS_FORMAT = 1


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings() -> Tuple[str, ...]:
    """Module, class and function docstrings of the stdlib, parsed (never imported), sorted by path.

    Parsing the ~1,000 files takes ~8 s of CPU, and every run on ``embedded`` needs the documents (the corpus
    fingerprint keys the token cache): they are kept in the cache folder under a key of every file's path,
    size and mtime (plus the Python version and the rule above), so a changed stdlib is parsed again."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    cached = _docstrings_cache_file(root, files)
    try:
        docs = json.loads(cached.read_text(encoding="utf-8"))
        if isinstance(docs, list) and all(isinstance(doc, str) for doc in docs):
            return tuple(docs)
    except (OSError, ValueError):
        pass  # absent, unreadable or torn: parse
    docs = _parse_docstrings(files)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_text(cached, json.dumps(docs))
    except OSError:
        pass  # a read-only cache folder costs the parse on every run, nothing else
    return docs


def _stdlib_files(root: pathlib.Path) -> List[pathlib.Path]:
    return [path for path in sorted(root.rglob("*.py")) if not _SKIP_STDLIB_DIRS.intersection(path.relative_to(root).parts)]


def _docstrings_cache_file(root: pathlib.Path, files: Sequence[pathlib.Path]) -> pathlib.Path:
    digest = hashlib.sha256(f"{_DOCSTRINGS_FORMAT}|{sys.version}|{root}|{_MIN_DOCSTRING_CHARS}".encode())
    for path in files:
        try:
            stat = path.stat()
        except OSError:
            continue  # a file that vanished is skipped by the parse too
        digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return default_cache_dir() / "embedded" / f"stdlib-docstrings-{digest.hexdigest()[:20]}.json"


def _parse_docstrings(files: Sequence[pathlib.Path]) -> Tuple[str, ...]:
    docs: List[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                    docs.append(doc)
    return tuple(docs)


class TextFilesCorpus(Corpus):
    """Local files: .txt (one document per file, or split on blank-line runs), .jsonl (``text`` key)."""

    name = "text"
    default_tokenizer = "gpt2"

    def __init__(self, paths: Sequence[str], text_key: str = "text"):
        self.paths = [pathlib.Path(p) for p in _expand(paths)]
        if not self.paths:
            raise DataError(f"data.path: no files matched {list(paths)!r}")
        for path in self.paths:
            if not path.is_file():
                raise DataError(f"data.path: {path} does not exist or is not a file")
        self.text_key = text_key

    def documents(self) -> Iterator[str]:
        found = False
        for path in self.paths:
            if path.suffix == ".jsonl":
                for text in _jsonl_texts(path, self.text_key):
                    found = True
                    yield text
            else:
                text = read_utf8(path)
                if text.strip():
                    found = True
                    yield text
        if not found:
            names = ", ".join(str(p) for p in self.paths[:3]) + (" ..." if len(self.paths) > 3 else "")
            raise DataError(f"data.path: {names} hold no text (empty or whitespace only)")

    def size_bytes(self) -> int:
        """Bytes of the input files: a byte-level tokenizer makes at most this many tokens."""
        return sum(p.stat().st_size for p in self.paths)

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for path in self.paths:
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode())
        return f"text-{digest.hexdigest()[:16]}"


def _expand(paths: Sequence[str]) -> List[str]:
    out: List[str] = []
    for p in paths:
        path = pathlib.Path(p)
        if path.is_dir():
            out.extend(str(x) for x in sorted(path.iterdir()) if x.suffix in (".txt", ".jsonl"))
        elif any(ch in p for ch in "*?["):
            out.extend(str(x) for x in sorted(pathlib.Path().glob(p)))
        else:
            out.append(p)
    return out


def decode_utf8(data: bytes, where: str, first_line: int = 1, base_offset: int = 0) -> str:
    """``data`` as text; binary or non-UTF-8 bytes are a DataError naming the line and byte offset."""
    nul = data.find(b"\0")
    if nul >= 0:
        line = first_line + data.count(b"\n", 0, nul)
        raise DataError(f"{where}:{line}: NUL byte at byte offset {base_offset + nul}: a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        raise DataError(f"{where}:{line}: not UTF-8 text (byte {data[err.start:err.start + 1]!r} at byte offset "
                        f"{base_offset + err.start}); re-encode the file as UTF-8 (e.g. iconv -t UTF-8)") from None


def read_parquet(path: pathlib.Path):
    """A parquet file as a pyarrow Table; a truncated or foreign file is a DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        reason = (str(err).strip().splitlines() or ["unreadable"])[0][:160]
        raise DataError(f"{path}: not a readable parquet file ({reason})") from None


def read_utf8(path: pathlib.Path) -> str:
    """A whole text file, checked: see ``decode_utf8``."""
    return decode_utf8(pathlib.Path(path).read_bytes(), str(path))


def jsonl_rows(path: pathlib.Path) -> Iterator[Tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line is a DataError naming file and line."""
    offset = 0
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            line = decode_utf8(raw, str(path), line_no, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: expected one JSON object per line")
            yield line_no, row


def _jsonl_texts(path: pathlib.Path, key: str) -> Iterator[str]:
    for line_no, row in jsonl_rows(path):
        if key not in row:
            raise DataError(f"{path}:{line_no}: missing column {key!r} (has {sorted(row)})")
        if row[key]:
            yield row[key]


# ---------------------------------------------------------------------------- hub reachability
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hugging Face Hub can be reached now (and offline mode is not forced)."""
    import os

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or os.environ.get(
        "HF_DATASETS_OFFLINE", "0"
    ).lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False
