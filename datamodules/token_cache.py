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
from typing import Iterable, Iterator, List, Optional, Tuple

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
    max_tokens: Optional[int] = None,
) -> pathlib.Path:
    """Tokenise ``documents`` (EOT after each) into ``folder/tokens.bin`` + ``meta.json``, atomically.

    ``max_tokens`` stops after that many tokens (streamed corpora larger than the disk).
    """
    dtype = token_dtype(tokenizer.vocab_size)
    eot = tokenizer.eot_id

    def chunks() -> Iterator[Tuple[np.ndarray, int]]:
        with tqdm(desc=description, unit=" docs", mininterval=1.0) as bar:
            for batch in _batched(documents, _ENCODE_BATCH_DOCS):
                ids: List[int] = []
                for doc_ids in tokenizer.encode_batch(batch):
                    ids.extend(doc_ids)
                    ids.append(eot)
                bar.update(len(batch))
                yield np.asarray(ids, dtype=dtype), len(batch)

    return _write_chunks(chunks(), tokenizer, folder, description, max_tokens)


def build_tokens_from_dataset(
    dataset,
    column: str,
    tokenizer: TextTokenizer,
    folder: pathlib.Path,
    description: str = "tokenising",
    num_proc: Optional[int] = None,
) -> pathlib.Path:
    """Like ``build_tokens`` for a ``datasets.Dataset``: one batched ``map`` with the fast tokenizer
    (``num_proc`` worker processes, progress bar), then a sequential copy into the memmap file.

    The map's Arrow output lives in a scratch folder inside ``folder`` and is deleted afterwards, so
    nothing but ``tokens.bin`` + ``meta.json`` stays on disk.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    eot = tokenizer.eot_id

    def encode(batch):
        return {"ids": [np.asarray(ids + [eot], dtype=dtype) for ids in tokenizer.encode_batch(batch[column])]}

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix="map.tmp") as scratch:
        mapped = dataset.map(
            encode, batched=True, batch_size=1000, num_proc=num_proc, remove_columns=dataset.column_names,
            desc=description, cache_file_name=str(pathlib.Path(scratch) / "ids.arrow"),
            # naming the output ourselves skips hashing the tokenizer object
            new_fingerprint=hashlib.sha256(folder.name.encode()).hexdigest()[:32],
        )

        def chunks() -> Iterator[Tuple[np.ndarray, int]]:
            column_ids = mapped.data.table.column("ids")
            with tqdm(desc=f"{description} (writing)", total=len(mapped), unit=" docs", mininterval=1.0) as bar:
                for chunk in column_ids.chunks:
                    bar.update(len(chunk))
                    yield chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False), len(chunk)

        try:
            return _write_chunks(chunks(), tokenizer, folder, description)
        finally:
            del mapped  # release the memory map before the scratch folder is removed


def _write_chunks(
    chunks: Iterable[Tuple[np.ndarray, int]],
    tokenizer: TextTokenizer,
    folder: pathlib.Path,
    description: str,
    max_tokens: Optional[int] = None,
) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    count = 0
    docs = 0
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix="tokens.bin.tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            for array, n_docs in chunks:
                if max_tokens is not None:
                    array = array[: max_tokens - count]
                handle.write(array.tobytes())
                count += array.size
                docs += n_docs
                if max_tokens is not None and count >= max_tokens:
                    break
        if count < 2:
            raise ValueError(f"{description}: the corpus produced {count} tokens; nothing to train on")
        tmp = pathlib.Path(tmp_name)
        meta = {
            "num_tokens": count,
            "num_documents": docs,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "sha256": file_checksum(tmp),
        }
        if max_tokens is not None:
            meta["max_tokens"] = max_tokens
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
