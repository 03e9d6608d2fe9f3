"""Routing probes: generated data with exact difficulty labels, per-difficulty metrics, the experiment."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from datamodules import probe
from datamodules.corpora import DataError, get_corpus
from datamodules.lm import DataConfig, LMDataModule
from tests.conftest import REPO

SMALL = 64 * probe.EPISODE_LEN  # 64 episodes: a few milliseconds to generate


def _datamodule(tmp_path, task="probe", batch_size=4, block_size=128, seed=0, tokens=SMALL):
    dm = LMDataModule(DataConfig(name=task, batch_size=batch_size, max_tokens=tokens, cache_dir=str(tmp_path)),
                      block_size=block_size, seed=seed)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _labels(levels):
    return {i: v for i, v in enumerate(levels) if v != probe.NO_LABEL}


# ---------------------------------------------------------------------------- generator and labels
@pytest.mark.parametrize("task", sorted(probe.TASKS))
def test_labels_match_the_brute_force_solver(task):
    seen_levels = set()
    for index in range(150):
        family, (data, levels) = probe.episode(task, index)
        assert len(data) == len(levels) == probe.EPISODE_LEN - 1
        solved = probe.solve_episode(family, data)
        assert {i: (data[i], level) for i, level in _labels(levels).items()} == solved, (task, index)
        seen_levels |= {level for _, level in solved.values()}
    if task in ("probe", "probe/arith"):
        assert seen_levels == set(range(probe.MAX_DEPTH + 1))  # d in 0..D mixed in the sequences
    if task == "probe/recall":
        assert seen_levels == set(range(probe.MAX_HOPS + 1))


def test_solver_catches_a_wrong_label():
    family, (data, levels) = probe.episode("probe/arith", 3)
    answer = next(i for i, level in enumerate(levels) if level > 0)
    wrong = bytearray(data)
    wrong[answer] = ord("0") + (data[answer] - ord("0") + 1) % 10
    assert probe.solve_episode(family, bytes(wrong))[answer][0] != wrong[answer]


def _stream_digest(task: str) -> str:
    script = ("import hashlib, numpy as np; from datamodules.probe import episode; h = hashlib.sha256()\n"
              f"for i in range(40): f, (d, l) = episode({task!r}, i); h.update(d); h.update(np.asarray(l, np.int8).tobytes())\n"
              "print(h.hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                          cwd=REPO).stdout.strip()


def test_generator_is_identical_across_processes():
    h = hashlib.sha256()
    for i in range(40):
        _, (data, levels) = probe.episode("probe", i)
        h.update(data)
        h.update(np.asarray(levels, np.int8).tobytes())
    assert _stream_digest("probe") == h.hexdigest()


def test_cache_holds_labels_beside_tokens_and_is_rank_independent(tmp_path):
    dm = _datamodule(tmp_path / "a")
    folder = dm._folder(dm.corpus)
    assert {"tokens.bin", "meta.json", "levels.npy", "families.npy"} <= {p.name for p in folder.iterdir()}
    assert dm.vocab_size == 257
    tokens = np.asarray(dm.train_set.tokens)
    levels, families = probe.open_labels(folder, len(tokens))
    assert len(tokens) == SMALL and (tokens[:: probe.EPISODE_LEN] == 256).all()  # every episode opens with EOT
    assert set(np.unique(families)) == {0, 1, 2} and levels.max() == probe.MAX_DEPTH
    # another process (a DDP rank) building the same corpus writes byte-identical files
    other = _datamodule(tmp_path / "b")
    assert other._folder(other.corpus).name == folder.name
    for name in ("tokens.bin", "levels.npy", "families.npy"):
        assert (folder / name).read_bytes() == (other._folder(other.corpus) / name).read_bytes()


class _Trainer:
    def __init__(self, rank, world):
        self.global_rank, self.world_size = rank, world


def test_ddp_ranks_read_disjoint_shards_of_the_same_stream(tmp_path):
    batches = {}
    for rank in (0, 1):
        dm = _datamodule(tmp_path)
        dm.trainer = _Trainer(rank, 2)
        it = iter(dm.train_dataloader())
        batches[rank] = [next(it) for _ in range(3)]
    rows = lambda bs: {tuple(r.tolist()) for b in bs for r in b}  # noqa: E731
    assert not rows(batches[0]) & rows(batches[1])


def test_probe_datamodule_resumes_mid_epoch_exactly(tmp_path):
    dm = _datamodule(tmp_path, batch_size=4)  # ~60 training blocks: 15 batches per epoch
    it = iter(dm.train_dataloader())
    straight = [next(it) for _ in range(20)]  # crosses the epoch boundary
    resumed_dm = _datamodule(tmp_path, batch_size=4)
    resumed_dm.load_state_dict({"samples_consumed": 7 * 4})
    it = iter(resumed_dm.train_dataloader())
    for expected in straight[7:]:
        assert torch.equal(next(it), expected)


def test_unknown_probe_and_wrong_tokenizer_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="valid datasets"):
        get_corpus("probe/nope")
    with pytest.raises(DataError, match="max_tokens"):
        get_corpus("probe", max_tokens=100)
    assert get_corpus("probe/arith").default_tokenizer == "bytes"
    from datamodules.tokenizer import TextTokenizer, train_bpe

    bpe = TextTokenizer(train_bpe(["the cat sat on the mat"] * 50, vocab_size=300), "bpe")
    with pytest.raises(DataError, match="bytes"):
        probe.byte_ids(bpe)


def test_labelled_blocks_drop_labels_whose_episode_started_before_the_block(tmp_path):
    dm = _datamodule(tmp_path, block_size=96)  # not a multiple of the episode length
    tokens, levels, _ = probe.labelled_blocks(dm, 8)
    assert tokens.shape == (len(levels), 97)
    starts = np.asarray(dm.val_sets["val"].indices[:8]) * 96
    for row, start in enumerate(starts):
        targets = np.arange(start + 1, start + 97)
        cut = targets - targets % probe.EPISODE_LEN < start
        assert (levels[row][cut] == probe.NO_LABEL).all()
