"""Tokenise a corpus once into a flat memmap of token ids (nanoGPT style), written atomically.

Layout of a cache folder ``<cache_dir>/tokens/<corpus fingerprint>-<tokenizer fingerprint>/``:
``tokens.bin`` (uint16 when the vocabulary fits, else uint32) and ``meta.json`` (count, dtype,
checksum). Both are written to temporary names and renamed into place, ``meta.json`` last, so a
reader never sees a half-written cache as complete. ``open_tokens`` verifies size and checksum
and returns ``None`` for a missing or corrupt cache, which the caller then rebuilds.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from typing import Iterable, Iterator, List, Optional

import numpy as np
from tqdm.auto import tqdm

from datamodules.tokenizer import TextTokenizer

_ENCODE_BATCH_DOCS = 512
_FULL_HASH_LIMIT = 1 << 30  # files above 1 GiB are checked on sampled blocks
_SAMPLE_BLOCK = 1 << 20


def cache_folder(cache_dir: pathlib.Path, corpus_fingerprint: str, tokenizer: TextTokenizer) -> pathlib.Path:
    return cache_dir / "tokens" / f"{corpus_fingerprint}-{tokenizer.name.replace('/', '_')[-24:]}-{tokenizer.fingerprint}"


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def file_checksum(path: pathlib.Path) -> str:
    """sha256 of the whole file, or of sampled 1 MiB blocks (first, last, 64 evenly spaced) above 1 GiB."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
        else:
            for offset in np.linspace(0, size - _SAMPLE_BLOCK, 66).astype(np.int64):
                handle.seek(int(offset))
                digest.update(handle.read(_SAMPLE_BLOCK))
    return digest.hexdigest()


def build_tokens(
    documents: Iterable[str],
    tokenizer: TextTokenizer,
    folder: pathlib.Path,
    description: str = "tokenising",
) -> pathlib.Path:
    """Tokenise ``documents`` (EOT after each) into ``folder/tokens.bin`` + ``meta.json``, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eot = tokenizer.eot_id
    count = 0
    docs = 0
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix="tokens.bin.tmp")
    try:
        with os.fdopen(fd, "wb") as handle, tqdm(desc=description, unit=" docs", mininterval=1.0) as bar:
            for batch in _batched(documents, _ENCODE_BATCH_DOCS):
                ids: List[int] = []
                for doc_ids in tokenizer.encode_batch(batch):
                    ids.extend(doc_ids)
                    ids.append(eot)
                array = np.asarray(ids, dtype=dtype)
                handle.write(array.tobytes())
                count += array.size
                docs += len(batch)
                bar.update(len(batch))
        if count < 2:
            raise ValueError(f"{description}: the corpus produced {count} tokens; nothing to train on")
        tmp = pathlib.Path(tmp_name)
        meta = {
            "num_tokens": count,
            "num_documents": docs,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": eot,
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "sha256": file_checksum(tmp),
        }
        os.replace(tmp, folder / "tokens.bin")
    except BaseException:
        pathlib.Path(tmp_name).unlink(missing_ok=True)
        raise
    _atomic_json(folder / "meta.json", meta)
    return folder


def open_tokens(folder: pathlib.Path) -> Optional[np.memmap]:
    """The verified token memmap, or ``None`` when the cache is missing, partial or corrupt."""
    meta_path, data_path = folder / "meta.json", folder / "tokens.bin"
    if not meta_path.is_file() or not data_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        expected_bytes = meta["num_tokens"] * dtype.itemsize
    except (ValueError, KeyError, TypeError):
        return None
    if data_path.stat().st_size != expected_bytes or file_checksum(data_path) != meta.get("sha256"):
        return None
    return np.memmap(data_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))


def read_meta(folder: pathlib.Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def invalidate(folder: pathlib.Path) -> None:
    (folder / "meta.json").unlink(missing_ok=True)


def _atomic_json(path: pathlib.Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


def _batched(items: Iterable[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
