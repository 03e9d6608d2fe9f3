"""Save the run's ``checkpoints/last.ckpt`` when the job is preempted, so it can resume.

What Lightning (2.6) already does, read in ``lightning/pytorch/trainer/connectors/signal_connector.py``:

* SIGTERM, in every environment: its handler only sets ``trainer.received_sigterm``; the loops finish
  the current batch (or validation batch), raise ``SIGTERMException`` (a ``SystemExit``), call the
  callbacks' ``on_exception`` and exit. No checkpoint is written. Under DDP rank 0's flag is broadcast
  to every rank at the start of each step.
* On SLURM (``SLURMEnvironment`` is detected and built with ``auto_requeue=True``, the Trainer's
  default): the requeue signal (SIGUSR1; ``#SBATCH --signal=SIGUSR1@90`` has SLURM send it 90 s
  before the time limit) saves ``hpc_ckpt_<n>.ckpt`` in ``trainer.default_root_dir`` (the run
  folder, as ``experiments.run`` sets it) and calls ``scontrol requeue $SLURM_JOB_ID``. A restarted
  ``fit`` without ``ckpt_path`` on SLURM resumes from the newest ``hpc_ckpt_*.ckpt`` there.
* Outside SLURM nothing handles SIGUSR1: its default action kills the process without a checkpoint.

``PreemptionCheckpoint`` adds what is missing: on SIGTERM (anywhere), and on SIGUSR1 where Lightning
has not taken that signal, the run stops at the end of the current step and writes
``<run folder>/checkpoints/last.ckpt`` (the file ``ModelCheckpoint(save_last=True)`` keeps), so
``python -m experiments.run ... --ckpt_path last`` (or the SLURM template's requeued job) continues
from the interrupted step with the same data order. A validation under way when the stop comes is finished
first (the resumed run would not redo it). On SLURM the requeue terminates the job with
SIGTERM after SIGUSR1, so both ``hpc_ckpt_<n>.ckpt`` and a newer ``last.ckpt`` exist;
``experiments/slurm/train.sbatch`` resumes from the newer.
The process then exits through Lightning's ``SIGTERMException`` with status ``128 + signal``
(``PREEMPTED_STATUS``: 143 after SIGTERM, 138 after SIGUSR1, the shell's convention for "ended by that
signal"), never 0, so ``train && evaluate`` stops after a preempted run; SLURM's requeue does not look
at the status. No ``summary.json`` is written for the interrupted part. Under DDP every rank stops
after the same step and ``last.ckpt`` is written once (by rank 0, after all ranks reached it).
"""
from __future__ import annotations

import pathlib
import signal
import threading
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def preempted_status(signum: int) -> int:
    """Exit status of a run stopped by ``signum`` after saving its checkpoint."""
    return 128 + int(signum)


PREEMPTED_STATUS = {signal.SIGTERM: preempted_status(signal.SIGTERM), signal.SIGUSR1: preempted_status(signal.SIGUSR1)}


def stop_after_this_step(trainer) -> None:
    """Stop as Lightning's SIGTERM handler does: its flag makes the loop raise ``SIGTERMException`` once the step
    is over (its scalars logged, the loggers flushed, a due validation run). Raising here, in
    ``on_train_batch_end``, skipped the step's logging and the later callbacks: its figures never reached
    TensorBoard. (Lightning's only handle on this is its signal connector's flag.)"""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "received_sigterm"):
        raise SIGTERMException()
    connector.received_sigterm = True


def align_log_step_after_resume(trainer) -> None:
    """Keep Lightning's logging step (``_batches_that_stepped``, the x value of every scalar) at
    ``global_step`` when a batch starts, where it always is in an uninterrupted run. On resume Lightning
    guesses where the checkpoint was saved and adds 1 when it guesses "before the step's counter moved"; a
    checkpoint saved after an interrupted checkpoint write (SIGTERM during a save) made it guess wrong, and
    the resumed run's scalars sat one step late in TensorBoard."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is not None and getattr(loop, "_batches_that_stepped", None) not in (None, trainer.global_step):
        loop._batches_that_stepped = trainer.global_step


class PreemptionCheckpoint(L.Callback):
    def __init__(self, dirpath, filename: str = "last.ckpt", signum: int = signal.SIGUSR1):
        self.path = pathlib.Path(dirpath) / filename
        self.signum = signum
        self.requested: Optional[int] = None
        self._previous = None
        self._held = False  # a stop waiting for the validation under way to end

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registers its handlers just before training starts: take SIGUSR1 only if it left it free.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(self.signum) in (signal.SIG_DFL, None):
            self._previous = signal.signal(self.signum, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_modules.steps import completes_step, is_logging_step

        if not completes_step(trainer):
            return  # never stop inside a gradient-accumulation step
        requested = float(self.requested or 0)
        if trainer.world_size > 1:  # every rank stops at the same step, or the others hang in the next all-reduce
            if not is_logging_step(trainer, trainer.global_step):  # the flag's all-reduce is a host sync: logging steps only
                return
            flag = torch.tensor(requested, device=pl_module.device)
            requested = float(trainer.strategy.reduce(flag, reduce_op="max"))
        if requested:
            self.requested = int(requested)  # ranks that did not get the signal exit with the same status
            rank_zero_info(f"preemption: signal {self.requested} received, stopping after step {trainer.global_step}")
            stop_after_this_step(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        align_log_step_after_resume(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        """Finish a validation under way before stopping. Lightning's evaluation loop stops after the batch when
        the flag is up, its checkpoint is then saved at a step whose validation never ran, and the resumed run
        does not redo it: that point was missing from TensorBoard and ``val_history`` for good. The flag is held
        down until the validation ends (the stop waits for one validation: ``--val_blocks`` blocks)."""
        connector = getattr(trainer, "_signal_connector", None)
        if trainer.state.fn == "fit" and getattr(connector, "received_sigterm", False):
            connector.received_sigterm = False
            self._held = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._held:  # the training loop stops right after this validation
            self._held = False
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        signum = self.requested or signal.SIGTERM  # None: Lightning's own SIGTERM handler stopped the run
        self._restore()  # Lightning skips the callbacks' teardown after an exception
        if not isinstance(exception, SIGTERMException):
            return
        trainer.save_checkpoint(str(self.path))
        exception.code = preempted_status(signum)  # a non-zero exit: the run did not finish
        rank_zero_info(f"preemption: saved {self.path} at step {trainer.global_step}; resume with --ckpt_path last "
                       f"(exit status {exception.code})")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous)
        self._previous = None
        self.requested = None
