"""Tokenizers: ``bpe`` (byte-level BPE trained on the corpus), ``bytes``, ``gpt2``, or a local folder.

All are Hugging Face ``tokenizers.Tokenizer`` objects with an end-of-text token appended
after every document, so one code path tokenises everything. ``fingerprint`` identifies the
exact vocabulary and merges, and keys the token cache.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from datamodules.corpora import DataError, hub_reachable
from datamodules.files import follow_umask

EOT = "<|endoftext|>"
BPE_VOCAB_SIZE = 4096


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    name: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eot_id(self) -> int:
        eot = self.tokenizer.token_to_id(EOT)
        if eot is None:
            raise DataError(f"tokenizer {self.name!r} has no {EOT!r} token")
        return eot

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()[:16]

    def encode_batch(self, texts):
        return [enc.ids for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def byte_level_tokenizer(model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int = BPE_VOCAB_SIZE) -> Tokenizer:
    tok = byte_level_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bytes_tokenizer() -> Tokenizer:
    """256 byte tokens + EOT: a BPE with the byte alphabet and no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOT] = len(vocab)
    tok = byte_level_tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOT])
    return tok


def load_folder(path: pathlib.Path) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        return _checked(path / "tokenizer.json", lambda: Tokenizer.from_file(str(path / "tokenizer.json")))
    vocab, merges = path / "vocab.json", path / "merges.txt"
    if vocab.is_file() and merges.is_file():
        tok = byte_level_tokenizer(_checked(vocab, lambda: models.BPE.from_file(str(vocab), str(merges)), merges))
        tok.add_special_tokens([EOT])
        return tok
    raise DataError(f"data.tokenizer: folder {path} has neither tokenizer.json nor vocab.json + merges.txt")


def _checked(path: pathlib.Path, load, *others: pathlib.Path):
    """``load()``, with a corrupt file reported as one DataError line naming it (the tokenizers library
    raises a bare Exception whose text does not say which file)."""
    try:
        return load()
    except Exception as err:  # noqa: BLE001
        names = " / ".join(str(p) for p in (path, *others))
        reason = (str(err).strip().splitlines() or ["unreadable"])[0][:160]
        raise DataError(f"data.tokenizer: {names} is not a valid tokenizer file ({reason}); "
                        "replace it, or use --tokenizer bpe / bytes") from None


def load_gpt2() -> Tokenizer:
    """The real GPT-2 tokenizer: from the HF cache first, else the Hub; fails fast offline."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache("openai-community/gpt2", "tokenizer.json") or try_to_load_from_cache(
        "gpt2", "tokenizer.json"
    )
    if isinstance(cached, str) and os.path.isfile(cached):
        return Tokenizer.from_file(cached)
    if not hub_reachable():
        raise DataError(
            "data.tokenizer: 'gpt2' is not in the Hugging Face cache and the Hub is unreachable (offline). "
            "Pass --tokenizer PATH to a folder with vocab.json + merges.txt (or tokenizer.json), "
            "or use --tokenizer bpe / bytes."
        )
    return Tokenizer.from_pretrained("openai-community/gpt2")


def get_tokenizer(spec: str, cache_dir: pathlib.Path, corpus=None) -> TextTokenizer:
    """Resolve ``bpe`` / ``bytes`` / ``gpt2`` / a folder path to a tokenizer (BPE trained once, cached)."""
    if spec == "bytes":
        return TextTokenizer(bytes_tokenizer(), "bytes")
    if spec == "gpt2":
        return TextTokenizer(load_gpt2(), "gpt2")
    if spec == "bpe":
        if corpus is None:
            raise DataError("data.tokenizer: 'bpe' is trained on a corpus; none was given")
        path = cache_dir / "tokenizers" / f"bpe{BPE_VOCAB_SIZE}-{corpus.fingerprint()}.json"
        tok = _cached_bpe(path)
        if tok is None:
            tok = train_bpe(corpus.documents())
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, tok.to_str())
        return TextTokenizer(tok, "bpe")
    folder = pathlib.Path(spec).expanduser()
    if folder.is_dir():
        return TextTokenizer(load_folder(folder), str(folder))
    raise DataError(
        f"data.tokenizer: {spec!r} is not a known tokenizer (bpe, bytes, gpt2) nor an existing folder "
        "with vocab.json + merges.txt"
    )


def _cached_bpe(path: pathlib.Path) -> Optional[Tokenizer]:
    """The trained BPE cached at ``path``; None when absent or unreadable (it is then retrained)."""
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt, not reported
        return None


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    follow_umask(tmp)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def ensure_tokenizer(spec: Optional[str], corpus, cache_dir: pathlib.Path) -> TextTokenizer:
    return get_tokenizer(spec or corpus.default_tokenizer, cache_dir, corpus)
