"""The training order of a fine-tuning run (GLUE, XSUM): resumable in the middle of an epoch.

A shuffled ``DataLoader`` draws its order from a generator that a resumed run does not have: after a preemption
the resumed epoch started over with another permutation, so some examples were trained on twice in that epoch
and others never, and Lightning warned "your dataloader is not resumable". ``ResumableEpochSampler`` is torch's
``DistributedSampler`` (a permutation seeded by ``seed + epoch``, dealt to the ranks): in one process it is the
order Lightning's own distributed sampler gives under DDP, and Lightning, finding a distributed sampler already in
place, leaves it alone.

Where an iterator starts is read from the optimiser steps done (``trainer.global_step``, restored from the
checkpoint on a resume; one batch per step: fine-tuning does not accumulate): the epoch is ``step // batches per
epoch`` and the batches of it already trained on are skipped, so a resumed run sees exactly the batches the
uninterrupted run would have. Not from Lightning's epoch counter or its ``set_epoch`` call: with data-loader
workers the iterator takes its indices before ``set_epoch`` is called, and with ``--max_steps`` (``max_epochs=-1``)
a run resumed from a checkpoint at an epoch's end counts one epoch too many.

The loader's iterator (one per epoch) draws its base seed from its own generator, not from the global one that
dropout draws from and that a checkpoint keeps (``lightning_modules/rng_state.py``): a run resumed from a checkpoint
at an epoch's end starts that iterator after the generators are saved, the uninterrupted run before, and the
dropout masks parted there.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ResumableEpochSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 steps_done: Optional[Callable[[], int]] = None):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.batch_size = batch_size
        self.steps_done = steps_done  # None: the epoch is set_epoch's and every epoch is whole

    @property
    def batches_per_epoch(self) -> int:
        """This rank's batches per epoch (the last one may be short; every rank has the same count)."""
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[int]:
        done = 0
        if self.steps_done is not None:
            self.epoch, done = divmod(self.steps_done(), self.batches_per_epoch)
        return iter(list(super().__iter__())[done * self.batch_size:])


def resumable_train_loader(dataset: Dataset, batch_size: int, seed: int, trainer=None, **loader_options) -> DataLoader:
    """The training loader of a fine-tuning data module: this rank's share of each epoch's permutation, each
    iterator starting at the trainer's optimiser step (after the batches a resumed run already trained on)."""
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    steps_done = (lambda: trainer.global_step) if trainer is not None else None
    sampler = ResumableEpochSampler(dataset, batch_size, seed, rank, world, steps_done)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed),
                      **loader_options)
