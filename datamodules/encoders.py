"""Fast document encoding for the token cache build: ``tiktoken`` where its ids equal the tokenizer's, else
the Hugging Face tokenizer's batched encoding, single-threaded (the build runs one encoder per process).

``encoder_spec(tokenizer)`` is a small picklable description that each worker process turns into a
``DocumentEncoder`` once. Both paths encode a document's text as ordinary text: a literal
``<|endoftext|>`` inside a document becomes the ids of those 13 characters, never the separator; the
separator (the tokenizer's EOT id) is inserted by the pipeline after every document.

``tiktoken`` is used for byte-level BPE tokenizers laid out as GPT-2's (the 256 byte tokens in the
data-gym order, merge i -> id 256 + i, no normaliser, the GPT-2 split pattern, EOT the only added
token): exactly the condition tiktoken's own ``data_gym_to_mergeable_bpe_ranks`` asserts, so its ranks
are the tokenizer's ids. The suite's trained BPE (EOT at id 0) takes the Hugging Face path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from datamodules.tokenizer import EOT, TextTokenizer

_GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_PLAIN_BPE = {"dropout": None, "unk_token": None, "continuing_subword_prefix": (None, ""),
              "end_of_word_suffix": (None, ""), "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}


@dataclass(frozen=True)
class EncoderSpec:
    kind: str  # "tiktoken" | "hf"
    tokenizer_json: str
    eot_id: int
    vocab_size: int
    dtype: str


def encoder_spec(tokenizer: TextTokenizer, prefer_tiktoken: bool = True) -> EncoderSpec:
    from datamodules.token_cache import token_dtype

    text = tokenizer.tokenizer.to_str()
    kind = "tiktoken" if prefer_tiktoken and tiktoken_ranks(json.loads(text)) is not None else "hf"
    return EncoderSpec(kind, text, tokenizer.eot_id, tokenizer.vocab_size, np.dtype(token_dtype(tokenizer.vocab_size)).name)


def data_gym_chars() -> Dict[str, int]:
    """GPT-2's byte -> printable character table (HF's ``bytes_to_unicode``), inverted, in tiktoken's rank
    order: printable bytes as themselves, the others as chr(256 + n); the position is the byte's rank."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]
    return dict(zip(chars, printable + others))


def tiktoken_ranks(config: dict) -> Optional[Dict[bytes, int]]:
    """tiktoken's mergeable ranks for a ``tokenizers`` JSON config whose ids they equal, else None."""
    model, pre = config.get("model") or {}, config.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or config.get("normalizer") is not None:
        return None
    if any(pre.get(k) != v for k, v in _GPT2_PRE_TOKENIZER.items()):
        return None
    if any(model.get(k) not in (v if isinstance(v, tuple) else (v,)) for k, v in _PLAIN_BPE.items()):
        return None
    if [t["content"] for t in config.get("added_tokens") or []] != [EOT]:
        return None
    chars = data_gym_chars()
    vocab, merges = dict(model["vocab"]), [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    if any(vocab.get(ch) != rank for ch, rank in zip(chars, range(256))):
        return None
    if any(vocab.get(a + b) != 256 + i for i, (a, b) in enumerate(merges)):
        return None
    vocab.pop(EOT, None)
    if len(vocab) != 256 + len(merges):
        return None
    try:
        return {bytes(chars[c] for c in token): rank for token, rank in vocab.items()}
    except KeyError:  # a token outside the byte alphabet
        return None


class DocumentEncoder:
    """Encodes a list of documents into one id array, the EOT separator after each document."""

    def __init__(self, spec: EncoderSpec):
        self.spec = spec
        self.eot = np.array([spec.eot_id], dtype=np.uint32)
        if spec.kind == "tiktoken":
            self._tiktoken = gpt2_style_encoding(spec)
        else:
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_str(spec.tokenizer_json)
            self._hf.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, as in tiktoken
            self._hf_batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # no offsets needed

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        pieces: List[np.ndarray] = []
        if self.spec.kind == "tiktoken":
            for text in texts:
                # allowed_special empty + disallowed_special () = special strings are ordinary text
                pieces += [self._tiktoken.encode_to_numpy(text, disallowed_special=()), self.eot]
        else:
            for encoding in self._hf_batch(list(texts), add_special_tokens=False):
                pieces += [np.asarray(encoding.ids, dtype=np.uint32), self.eot]
        if not pieces:
            return np.zeros(0, dtype=self.spec.dtype)
        return np.concatenate(pieces).astype(self.spec.dtype, copy=False)


def gpt2_style_encoding(spec: EncoderSpec):
    """A ``tiktoken.Encoding`` built from the tokenizer's own vocabulary and merges (never downloaded)."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern (the same regex as ByteLevel's)

    ranks = tiktoken_ranks(json.loads(spec.tokenizer_json))
    return tiktoken.Encoding(name="dyncomp-gpt2-style", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: spec.eot_id}, explicit_n_vocab=spec.vocab_size)
