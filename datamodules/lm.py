"""Pre-training DataModule: corpus -> tokenizer -> memmap cache -> packed blocks of T+1 tokens.

* ``prepare_data`` (rank 0 only, Lightning's guarantee) trains/loads the tokenizer and builds the
  token cache if missing or corrupt (``datamodules/cache_build.py``; under DDP only a small corpus:
  ``python -m experiments.prepare`` builds the others first). ``setup`` (every rank) opens the verified memmap.
* Blocks: block i is tokens[i*T : i*T + T + 1] (inputs = [:-1], targets = [1:]).
* Validation: a deterministic hash-based fraction of the blocks, or the corpus's own named
  validation sets (one loader each, e.g. SlimPajama's out-of-distribution subsets).
* Training order: an endless, seeded stream of permutations, sharded by rank. Its position is
  part of the checkpoint (``state_dict``), so resuming continues with exactly the next batches.
* Labels (``data.labels``, or the probe data's own; ``datamodules/probe_labels.py``): a level per token
  of the stream, -1 = unlabelled. With ``data.loss_mask labelled`` a block comes with the loss weight of
  each target, ``(tokens (T+1,), weights (T,))``: 1 where labelled, ``data.unlabelled_weight`` elsewhere.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules import probe_labels, token_cache
from datamodules.cache_build import build_corpus_cache, build_generated_cache
from datamodules.catalog import get_corpus
from datamodules.corpora import Corpus, DataError
from datamodules.files import atomic_npy, default_cache_dir
from datamodules.tokenizer import TextTokenizer, ensure_tokenizer

_GOLDEN = 2654435761  # Knuth's multiplicative hash: a fixed, seed-independent validation split


@dataclass
class DataConfig:
    name: str = "embedded"
    tokenizer: Optional[str] = None  # None: the corpus's default (bpe for embedded, gpt2 otherwise)
    # local files for data.name=text (and hub corpora): one path/glob/folder, or a list of them
    path: Union[str, List[str]] = field(default_factory=list)
    batch_size: int = 16
    val_fraction: float = 0.05
    num_workers: int = 0
    cache_dir: Optional[str] = None
    # Hub corpora (openwebtext, slimpajama; see datamodules/hub.py):
    hub_id: Optional[str] = None  # another hub dataset with the same schema, e.g. cerebras/SlimPajama-627B
    revision: Optional[str] = None  # hub revision (default: the corpus's, e.g. refs/convert/parquet)
    streaming: bool = False  # stream from the hub instead of downloading the raw files first
    max_tokens: Optional[int] = None  # stop tokenising the training corpus after this many tokens
    num_proc: Optional[int] = None  # tokenisation processes (None: every CPU available to the process)
    # Bring your own probe (docs/probes.md): a level per token of the token stream, -1 = unlabelled: a .npy
    # (one integer per token) or a .jsonl (character spans per document, converted at the cache build)
    labels: Optional[str] = None
    loss_mask: str = "none"  # none | labelled: the loss averages over the labelled targets only
    unlabelled_weight: float = 0.0  # with loss_mask=labelled: the loss weight of the unlabelled targets

    @property
    def paths(self) -> List[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def corpus_options(self) -> dict:
        return {"path": self.paths, "hub_id": self.hub_id, "revision": self.revision, "streaming": self.streaming,
                "max_tokens": self.max_tokens, "num_proc": self.num_proc}

    def validate(self) -> None:
        if self.batch_size <= 0:
            raise DataError(f"data.batch_size: must be a positive integer, got {self.batch_size}")
        if not 0.0 < self.val_fraction < 0.5:
            raise DataError(f"data.val_fraction: must be in (0, 0.5), got {self.val_fraction}")
        if self.num_workers < 0:
            raise DataError(f"data.num_workers: must be >= 0, got {self.num_workers}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise DataError(f"data.max_tokens: must be an integer >= 2, got {self.max_tokens}")
        if self.num_proc is not None and self.num_proc < 1:
            raise DataError(f"data.num_proc: must be a positive integer, got {self.num_proc}")
        self.validate_labels()

    def validate_labels(self) -> None:
        if self.loss_mask not in LOSS_MASKS:
            raise DataError(f"data.loss_mask: must be one of {', '.join(LOSS_MASKS)}, got {self.loss_mask!r}")
        if not 0.0 <= self.unlabelled_weight <= 1.0:
            raise DataError(f"data.unlabelled_weight: must be in [0, 1], got {self.unlabelled_weight}")
        if self.unlabelled_weight and self.loss_mask == "none":
            raise DataError("data.unlabelled_weight: weighs the loss of unlabelled targets under a loss mask; "
                            "add --data.loss_mask labelled or drop it")
        if self.labels is not None:
            path = pathlib.Path(self.labels)
            if path.suffix not in probe_labels.FORMATS or not path.is_file():
                probe_labels.check_label_file(self.labels)  # the error naming what is wrong

    @property
    def masked(self) -> bool:
        return self.loss_mask != "none"


LOSS_MASKS = ("none", "labelled")


class PackedBlocks(Dataset):
    """Blocks of ``block_size + 1`` tokens at stride ``block_size`` from a flat token array; with per-token
    ``levels`` (a loss mask) each block comes with its targets' loss weights (module docstring)."""

    def __init__(self, tokens: np.ndarray, block_size: int, indices: Optional[np.ndarray] = None,
                 verifier: Optional[token_cache.ChunkVerifier] = None, levels: Optional[np.ndarray] = None,
                 unlabelled_weight: float = 0.0):
        self.tokens = tokens
        self.levels, self.unlabelled_weight = levels, unlabelled_weight
        self.verifier = verifier  # large caches: each chunk's sha256 is checked when first read
        self.block_size = block_size
        total = (len(tokens) - 1) // block_size
        self.indices = np.arange(total) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        start = int(self.indices[i]) * self.block_size
        if self.verifier is not None:
            self.verifier.check_tokens(start, start + self.block_size + 1)
        block = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        if self.levels is None:
            return block
        labelled = np.asarray(self.levels[start + 1 : start + self.block_size + 1]) >= 0
        return block, torch.from_numpy(np.where(labelled, 1.0, self.unlabelled_weight).astype(np.float32))


class ResumableShardSampler(Sampler[int]):
    """Endless seeded permutations, each rank taking its own ``batch_size`` slice of every global batch.

    ``start`` is the number of samples this rank already consumed, so a resumed run continues with
    the exact next indices.
    """

    def __init__(self, size: int, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0):
        if size < batch_size * world_size:
            raise DataError(
                f"the training split has {size} blocks, fewer than one global batch "
                f"({batch_size} x {world_size} ranks); use a larger corpus or a smaller data.batch_size"
            )
        self.size, self.batch_size, self.rank, self.world = size, batch_size, rank, world_size
        self.seed, self.start = seed, start

    def __iter__(self) -> Iterator[int]:
        global_batch = self.batch_size * self.world
        batches_per_epoch = self.size // global_batch  # drop the ragged tail: every rank same shapes
        step = self.start // self.batch_size
        while True:
            epoch, within = divmod(step, batches_per_epoch)
            perm = self._permutation(epoch)
            begin = within * global_batch + self.rank * self.batch_size
            yield from perm[begin : begin + self.batch_size].tolist()
            step += 1

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)


def validation_indices(num_blocks: int, fraction: float) -> np.ndarray:
    scores = (np.arange(num_blocks, dtype=np.uint64) * np.uint64(_GOLDEN)) % np.uint64(1_000_003)
    chosen = np.nonzero(scores < np.uint64(int(fraction * 1_000_003)))[0]
    if len(chosen) == 0:
        chosen = np.array([num_blocks - 1])
    return chosen


def validation_share(count: int, rank: int, world: int) -> np.ndarray:
    """Positions, among the ``count`` blocks one validation evaluates, of those rank ``rank`` of ``world``
    evaluates: contiguous shares (sizes may differ by one block) that together are every block once,
    whatever the world size and the per-rank batch."""
    return np.array_split(np.arange(count), world)[rank]


class LMDataModule(L.LightningDataModule):
    def __init__(self, config: DataConfig, block_size: int, seed: int = 0, val_blocks: Optional[int] = None,
                 val_batches: Optional[int] = None):
        super().__init__()
        config.validate()
        if val_batches is not None:  # deprecated: the count then depended on the per-rank batch
            if val_blocks is not None:
                raise DataError("val_batches: deprecated alias of val_blocks; give only val_blocks")
            if val_batches <= 0:
                raise DataError(f"val_batches: must be a positive integer, got {val_batches}")
            val_blocks = val_batches * config.batch_size
        if val_blocks is not None and val_blocks <= 0:
            raise DataError(f"val_blocks: must be a positive integer, got {val_blocks}")
        self.config = config
        self.block_size = block_size
        self.seed = seed
        # global: validation evaluates the first val_blocks blocks of each set, split across the ranks
        # (None: every block), so the loss is the same for any number of processes and any per-rank batch
        self.val_blocks_count = val_blocks
        self.cache_dir = pathlib.Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        self.corpus: Corpus = get_corpus(config.name, cache_dir=self.cache_dir, **config.corpus_options())
        self._tokenizer: Optional[TextTokenizer] = None
        self.samples_consumed = 0  # per rank, restored from checkpoints
        self.train_set: Optional[PackedBlocks] = None
        self.val_sets: Dict[str, PackedBlocks] = {}
        self._fingerprints: Optional[Dict[str, str]] = None
        self.token_levels: Optional[np.ndarray] = None  # per token of the training stream (labels / probe data)
        self._check_label_options()

    # ------------------------------------------------------------------ tokenizer and cache
    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = ensure_tokenizer(self.config.tokenizer, self.corpus, self.cache_dir)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _folder(self, corpus: Corpus) -> pathlib.Path:
        return token_cache.cache_folder(self.cache_dir, corpus.fingerprint(), self.tokenizer)

    def _corpora(self) -> Dict[str, Corpus]:
        named = self.corpus.validation_sets() or {}
        return {"train": self.corpus, **named}

    def prepare_data(self) -> None:
        for split, corpus in self._corpora().items():
            folder = self._folder(corpus)
            if not self._complete(corpus, folder):
                description = f"tokenising {corpus.name}/{split}"
                write_tokens = getattr(corpus, "write_tokens", None)  # generated corpora write their own files
                if write_tokens is not None:
                    build_generated_cache(folder, lambda: write_tokens(self.tokenizer, folder, description),
                                          lambda: self._complete(corpus, folder), description, self._rank_world()[1])
                else:  # every core, resumable; under DDP only small corpora (datamodules/cache_build.py)
                    build_corpus_cache(corpus, self.tokenizer, folder, description, self.config.num_proc,
                                       self._rank_world()[1], hint=f"python -m experiments.prepare --data "
                                       f"{self.config.name} (plus this run's --data.* / --tokenizer options)")
        self._convert_span_labels()

    @staticmethod
    def _complete(corpus: Corpus, folder: pathlib.Path) -> bool:
        """The token cache verifies its own files; a corpus verifies what it writes beside them (probe labels)."""
        return token_cache.open_tokens(folder) is not None and corpus.cache_is_complete(folder)

    def _check_label_options(self) -> None:
        from datamodules.probe import ProbeCorpus

        probe = isinstance(self.corpus, ProbeCorpus)
        if self.config.labels and probe:
            raise DataError(f"data.labels: the probe data {self.corpus.name!r} carry their own labels; drop "
                            "--data.labels (or train on --data text with your label file)")
        if self.config.masked and not (self.config.labels or probe):
            raise DataError("data.loss_mask: needs labels: add --data.labels PATH (or use probe data)")
        if (self.config.labels or self.config.masked) and self.corpus.validation_sets():
            raise DataError(f"data.labels: dataset {self.corpus.name!r} validates on separate validation sets, "
                            "which a label file of its training stream does not cover; use local files "
                            "(--data text, or --data.path) whose validation is held out from the one stream")
        if str(self.config.labels or "").endswith(".jsonl") and hasattr(self.corpus, "write_tokens"):
            raise DataError(f"data.labels: dataset {self.corpus.name!r} is tokenised in batches (not document by "
                            "document); give a .npy of one level per token instead of a .jsonl span file")

    def _label_path(self) -> Optional[pathlib.Path]:
        """The per-token ``.npy`` of ``data.labels`` (a ``.jsonl`` span file: its converted copy in the cache)."""
        if not self.config.labels:
            return None
        path = pathlib.Path(self.config.labels)
        return probe_labels.converted_path(self._folder(self.corpus), path) if path.suffix == ".jsonl" else path

    def _convert_span_labels(self) -> None:
        """rank 0, after the token cache exists: a ``.jsonl`` span file -> per-token levels beside the tokens
        (rebuilt when missing or unreadable)."""
        if not str(self.config.labels or "").endswith(".jsonl"):
            return
        target, tokens = self._label_path(), self._open(self.corpus)
        try:
            probe_labels.open_token_labels(target, len(tokens))
            return
        except DataError:
            pass
        levels = probe_labels.levels_from_span_file(pathlib.Path(self.config.labels), self.corpus.documents(),
                                                    self.tokenizer, tokens)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_npy(target, levels)

    def _open_levels(self, tokens: np.ndarray) -> Optional[np.ndarray]:
        from datamodules.probe import ProbeCorpus, open_labels

        path = self._label_path()
        if path is not None:
            return probe_labels.open_token_labels(path, len(tokens))
        if self.config.masked and isinstance(self.corpus, ProbeCorpus):
            return open_labels(self._folder(self.corpus), len(tokens))[0]
        return None

    def _open(self, corpus: Corpus) -> np.ndarray:
        tokens = token_cache.open_tokens(self._folder(corpus))
        if tokens is None:
            raise DataError(
                f"token cache for {corpus.name!r} at {self._folder(corpus)} is missing or corrupt; "
                "prepare_data() rebuilds it (run through the Trainer, or call it first)"
            )
        return tokens

    def _blocks(self, corpus: Corpus, tokens: np.ndarray, indices: Optional[np.ndarray] = None) -> PackedBlocks:
        mask = self.token_levels if self.config.masked else None
        return PackedBlocks(tokens, self.block_size, indices, verifier=token_cache.verifier(self._folder(corpus)),
                            levels=mask, unlabelled_weight=self.config.unlabelled_weight)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        tokens = self._open(self.corpus)
        self.token_levels = self._open_levels(tokens)
        total = (len(tokens) - 1) // self.block_size
        if total < 2:
            source = ", ".join(self.config.paths) or f"the token cache {self._folder(self.corpus)}"
            raise DataError(f"dataset {self.corpus.name!r} ({source}) has {len(tokens)} tokens: fewer than two blocks "
                            f"of {self.block_size + 1} (a training and a validation block); use more text or a "
                            "smaller --model.block_size")
        named = self.corpus.validation_sets()
        if named:
            self.train_set = self._blocks(self.corpus, tokens)
            self.val_sets = {name: self._blocks(c, self._open(c)) for name, c in named.items()}
        else:
            val = validation_indices(total, self.config.val_fraction)
            train = np.setdiff1d(np.arange(total), val)
            self.train_set = self._blocks(self.corpus, tokens, train)
            self.val_sets = {"val": self._blocks(self.corpus, tokens, val)}

    def unigram_entropy(self, max_tokens: int = 50_000_000) -> float:
        """Entropy (nats) of the training tokens' unigram distribution: the loss of a model that
        ignores context. A trained LM's validation loss should sit well below it."""
        if self.train_set.verifier is not None:
            self.train_set.verifier.check_tokens(0, min(max_tokens, len(self.train_set.tokens)))
        tokens = np.asarray(self.train_set.tokens[:max_tokens])
        counts = np.bincount(tokens, minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    # ------------------------------------------------------------------ loaders
    def _rank_world(self):
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        sampler = ResumableShardSampler(
            len(self.train_set), self.config.batch_size, rank, world, self.seed, start=self.samples_consumed
        )
        return DataLoader(
            self.train_set,
            batch_size=self.config.batch_size,
            sampler=sampler,
            num_workers=self.config.num_workers,
            persistent_workers=self.config.num_workers > 0,
            drop_last=True,
        )

    def val_blocks(self, name: str) -> np.ndarray:
        """Positions (in ``val_sets[name]``) of the blocks one validation evaluates, the same for any world size
        and per-rank batch: the first ``val_blocks`` blocks (every block when it is None)."""
        size = len(self.val_sets[name])
        if self.val_blocks_count is not None:
            size = min(size, self.val_blocks_count)
        return np.arange(size)

    def val_dataloader(self):
        rank, world = self._rank_world()
        loaders = []
        for name, dataset in self.val_sets.items():
            # The global set of blocks is split into contiguous shares (sizes may differ by one block); the
            # module's metrics are token-weighted sums over every rank, hence the mean over exactly these blocks.
            blocks = self.val_blocks(name)
            if len(blocks) < world:
                raise DataError(f"validation set {name!r} evaluates {len(blocks)} blocks, fewer than the {world} ranks; "
                                "raise --val_blocks or data.val_fraction, or use fewer processes")
            share = blocks[validation_share(len(blocks), rank, world)]
            subset = torch.utils.data.Subset(dataset, share.tolist())
            loaders.append(DataLoader(subset, batch_size=self.config.batch_size, shuffle=False, num_workers=0))
        return loaders if len(loaders) > 1 else loaders[0]

    def fingerprints(self) -> Dict[str, str]:
        """What the token stream depends on besides the model: saved in every checkpoint (``state_dict``)
        so that ``experiments.run --ckpt_path`` resumes only a run trained on the same data and tokenizer."""
        if self._fingerprints is None:
            self._fingerprints = {
                "data": f"{self.corpus.name}:{self.corpus.fingerprint()}",
                "tokenizer": f"{self.tokenizer.name}:{self.tokenizer.fingerprint}",
                "val_fraction": str(self.config.val_fraction),
                # the blocks each validation evaluates (None: all): a resume keeps the validation set of the curve
                "val_blocks": str(self.val_blocks_count),
                "data_source": " ".join([self.config.name, *self.config.paths]),  # for messages only
                "labels": self._labels_fingerprint(),
            }
        return self._fingerprints

    def _labels_fingerprint(self) -> str:
        """The label file's content and the loss mask ("none" without either): a run resumes on the same."""
        if not self.config.labels and not self.config.masked:
            return "none"
        labels = probe_labels.file_fingerprint(pathlib.Path(self.config.labels)) if self.config.labels else "probe"
        return f"{labels}:{self.config.loss_mask}:{self.config.unlabelled_weight}"

    def val_names_from_corpus(self) -> List[str]:
        """Names of the validation loaders, known before ``setup`` (the LightningModule needs them)."""
        named = self.corpus.validation_sets()
        return list(named) if named else ["val"]

    # ------------------------------------------------------------------ resumable position
    def state_dict(self) -> dict:
        trainer = getattr(self, "trainer", None)
        consumed = self.samples_consumed
        if trainer is not None:
            consumed = trainer.global_step * trainer.accumulate_grad_batches * self.config.batch_size
        return {"samples_consumed": consumed, "fingerprints": self.fingerprints()}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = int(state.get("samples_consumed", 0))
