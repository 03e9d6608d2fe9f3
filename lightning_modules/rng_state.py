"""Each rank's torch generators in the checkpoint, so that a resumed run continues the random stream of the run it
resumes (``early_exit``'s layer dropout, ``mot``'s random activation, ``model.dropout``).

Lightning's checkpoints hold no generator state, and ``experiments.run`` seeds every start afresh (the initial
weights must not depend on a resume), so a resumed run replayed the stream from step 0. Only the torch generators
are kept: the models draw from nothing else, and the data order is the sampler's own (``ResumableShardSampler``).
They are set when training starts (``on_train_start``), after Lightning has restored the loop, run the sanity
validation and started the train loader's iterator (each iterator draws its base seed from the global generator),
so those draws do not shift the stream. That is exact because the train loader is one endless epoch (the sampler
never ends): no iterator starts between a checkpoint and the next step in the uninterrupted run. A finite loader
would start one at an epoch boundary, which a resume from a checkpoint at that boundary would miss: the
fine-tuning train loader (``datamodules/epoch_order.py``) draws its base seeds from its own generator instead, and
``KeepRandomStream`` does for the fine-tuning modules what ``LanguageModelModule``'s hooks do.
``tests/test_resume_exact.py`` checks every variant that draws, bit for bit, and ``tests/test_cluster.py`` each
rank's generator under DDP.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import lightning as L
import torch.distributed
from lightning.pytorch.utilities import rank_zero_warn


def rank_rng_states(trainer) -> List[Dict[str, torch.Tensor]]:
    """This rank's generators, or under DDP every rank's in rank order (``on_save_checkpoint`` runs on every rank,
    and only rank 0 writes the file)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        states: List[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(states, state)
        return states
    return [state]


def restore_rank_rng_states(states: Optional[List[Dict[str, torch.Tensor]]], trainer) -> None:
    """Set this rank's generators from a checkpoint's ``rng_states`` (None: a checkpoint from before they were
    saved; the stream then starts from the seed, as it did)."""
    if not states:
        return
    if len(states) != trainer.world_size:
        rank_zero_warn(f"the checkpoint holds the random generators of {len(states)} ranks and this run has "
                       f"{trainer.world_size}: they start from the seed, so a variant that draws random numbers while "
                       "training (early_exit, dropout) continues differently from the run it resumes")
        return
    state = states[trainer.global_rank]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class KeepRandomStream(L.Callback):
    """Each rank's generators in every checkpoint, set again when a resumed run's training starts (for modules
    without hooks of their own: the GLUE and XSUM modules, whose dropout draws at every step)."""

    def __init__(self):
        self.resumed: Optional[List[Dict[str, torch.Tensor]]] = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        checkpoint["rng_states"] = rank_rng_states(trainer)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        self.resumed = checkpoint.get("rng_states")

    def on_train_start(self, trainer, pl_module) -> None:
        restore_rank_rng_states(self.resumed, trainer)
        self.resumed = None
