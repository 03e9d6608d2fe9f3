"""The training order of a fine-tuning run (GLUE, XSUM): resumable in the middle of an epoch.

A shuffled ``DataLoader`` draws its order from a generator that a resumed run does not have: after a preemption
the resumed epoch started over with another permutation, so some examples were trained on twice in that epoch
and others never, and Lightning warned "your dataloader is not resumable". ``ResumableEpochSampler`` is torch's
``DistributedSampler`` (a permutation seeded by ``seed + epoch``, dealt to the ranks): in one process it is the
order Lightning's own distributed sampler gives under DDP, and Lightning, finding a distributed sampler already in
place, leaves it alone. ``resume_at(step)`` makes the epoch that a checkpoint of ``step`` optimiser steps was
saved in skip the batches it already trained on (one batch per step: fine-tuning does not accumulate), so a
resumed run sees exactly the batches the uninterrupted run would have. The training loader's iterator (one per
epoch) draws its base seed from its own generator, not from the global one that dropout draws from and that a
checkpoint keeps (``lightning_modules/rng_state.py``): a run resumed from a checkpoint at an epoch's end starts
that iterator after the generators are saved, the uninterrupted run before, and the dropout masks parted there.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ResumableEpochSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.batch_size = batch_size
        self._resume: Optional[Tuple[int, int]] = None  # (epoch, batches of it already trained on)

    @property
    def batches_per_epoch(self) -> int:
        """This rank's batches per epoch (the last one may be short; every rank has the same count)."""
        return math.ceil(self.num_samples / self.batch_size)

    def resume_at(self, step: int) -> None:
        """A run resumed from a checkpoint saved after ``step`` optimiser steps: skip, in the epoch it was saved
        in, the batches already trained on (none when it was saved at an epoch's end)."""
        epoch, done = divmod(step, self.batches_per_epoch)
        self._resume = (epoch, done) if done else None

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] * self.batch_size:]
            self._resume = None  # the next epochs are whole
        return iter(indices)


def resumable_train_loader(dataset: Dataset, batch_size: int, seed: int, trainer=None, **loader_options) -> DataLoader:
    """The training loader of a fine-tuning data module: this rank's share of each epoch's permutation, continuing
    after the batches a resumed run (``trainer.global_step`` restored from its checkpoint) already trained on."""
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    sampler = ResumableEpochSampler(dataset, batch_size, seed, rank, world)
    if trainer is not None and trainer.global_step:
        sampler.resume_at(trainer.global_step)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed),
                      **loader_options)

