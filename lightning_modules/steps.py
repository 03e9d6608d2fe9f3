"""Where the trainer is in an optimisation step: helpers shared by the LightningModules and the callbacks.

With gradient accumulation one optimisation step spans several batches; these say which batch completes a
step, which step a batch belongs to, which steps are logged, and the x value of a batch's scalars. Only
Lightning's public attributes are read.
"""
from __future__ import annotations

from lightning_modules.flops_budget import FlopsBudget


def is_logging_step(trainer, completed_steps: int) -> bool:
    """True on the steps whose metrics Lightning writes (every ``log_every_n_steps``) and on the last step.

    ``completed_steps``: optimisation steps done once the current batch is trained (``global_step + 1``
    inside ``training_step``, ``global_step`` in ``on_train_batch_end``). Only these steps may
    synchronise the host with the device or make collectives: the other steps run without a host sync. The one
    exception is DDP's stop vote (``callbacks/preemption.py``): a two-float all-reduce at every step, beside the
    broadcast and host sync Lightning 2.6 makes at every DDP step itself.
    """
    every = getattr(trainer, "log_every_n_steps", 0) or 0
    return (every > 0 and completed_steps % every == 0) or may_be_last_step(trainer, completed_steps)


def may_be_last_step(trainer, completed_steps: int) -> bool:
    """``trainer.max_steps``, or the step that reaches the FLOPs budget (``--max_train_flops``; before that
    step is counted, with gradient accumulation, the steps that may reach it: see ``FlopsBudget.may_end_at``).
    What is measured or flushed "at the last step" is measured on these steps."""
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and completed_steps == max_steps:
        return True
    budget = getattr(getattr(trainer, "lightning_module", None), "flops_budget", None)
    return isinstance(budget, FlopsBudget) and budget.may_end_at(completed_steps)


def completes_step(trainer) -> bool:
    """True for the batch that ends an optimisation step: every batch, unless gradients accumulate over
    ``trainer.accumulate_grad_batches`` micro-batches (the small..large size presets do). Valid in
    ``training_step`` and the batch hooks, where Lightning's own accumulation check is."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate <= 1:
        return True
    # Lightning's rule (its loop's private ``_should_accumulate``), from public attributes: the optimizer
    # steps after every ``accumulate`` batches and on the epoch's last batch (unless the strategy, e.g.
    # DeepSpeed, accumulates itself). ``batch_progress.current.ready`` counts this epoch's batches so far.
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    last = ready == trainer.num_training_batches or progress.is_last_batch
    return ready % accumulate == 0 or (last and not trainer.strategy.handles_gradient_accumulation)


def batch_step(trainer) -> int:
    """The optimisation step (1-based: steps completed once it is done) the current micro-batch belongs to;
    in ``on_train_batch_end`` of the last micro-batch Lightning has already advanced ``global_step``."""
    return trainer.global_step + (0 if completes_step(trainer) else 1)


def log_step(trainer) -> int:
    """The x-axis value Lightning gives the current batch's scalars (0-based index of the batch).

    Every scalar of one batch (Lightning's ``train/*``, ``val/*``, the learning rate, and the
    measurement callbacks') is written at this step, so one TensorBoard x value means one batch.
    """
    return max(0, trainer.global_step - 1)  # in on_train_batch_end and validation: the batch just trained
