"""Save the run's ``checkpoints/last.ckpt`` when the job is preempted, so it can resume.

What Lightning (2.6) already does, read in ``lightning/pytorch/trainer/connectors/signal_connector.py``:

* SIGTERM, in every environment: its handler only sets ``trainer.received_sigterm``; the loops finish
  the current batch (or validation batch), raise ``SIGTERMException`` (a ``SystemExit``), call the
  callbacks' ``on_exception`` and exit. No checkpoint is written. Under DDP rank 0's flag is broadcast
  to every rank at the start of each step.
* On SLURM with ``SLURMEnvironment(auto_requeue=True)`` (the Trainer's default): the requeue signal (SIGUSR1)
  saves ``hpc_ckpt_<n>.ckpt`` *inside the signal handler*, wherever the step is, and calls ``scontrol requeue``.
  That save makes collectives (Lightning's barrier, the RNG states' all-gather of ``rng_state.py``) on each
  rank at whatever point the signal found it: one rank in its handler's barrier while another is in the
  step's gradient all-reduce is a mismatch that can hang the job until its time limit, and the checkpoint is
  of a half-done step. ``experiments.run`` therefore builds the environment with ``auto_requeue=False``
  (``slurm_requeue_job``), and this callback does the requeue instead, below.
* Outside SLURM nothing handles SIGUSR1: its default action kills the process without a checkpoint.

``PreemptionCheckpoint`` adds what is missing: on SIGTERM (anywhere), and on SIGUSR1 where Lightning
has not taken that signal, the run stops at the end of the current step (under DDP: the first logging step,
every ``--trainer.log_every_n_steps``, after any rank got it, the same step on every rank) and writes
``<run folder>/checkpoints/last.ckpt`` (the file ``ModelCheckpoint(save_last=True)`` keeps), so
``python -m experiments.run ... --ckpt_path last`` (or the SLURM template's requeued job) continues
from the interrupted step with the same data order. A validation under way when the stop comes is finished
first (the resumed run would not redo it). With ``requeue_job`` (a SLURM job, from ``slurm_requeue_job``) a
SIGUSR1 stop then has rank 0 run ``scontrol requeue <job>`` after the checkpoint is written: SLURM's
``--signal=SIGUSR1@90`` warning before the time limit gives a consistent checkpoint and a requeued job.
The process then exits through Lightning's ``SIGTERMException`` with status ``128 + signal``
(``PREEMPTED_STATUS``: 143 after SIGTERM, 138 after SIGUSR1, the shell's convention for "ended by that
signal"), never 0, so ``train && evaluate`` stops after a preempted run; SLURM's requeue does not look
at the status. No ``summary.json`` is written for the interrupted part. Under DDP every rank stops
after the same step and ``last.ckpt`` is written once (by rank 0, after all ranks reached it).
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import threading
from typing import Dict, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


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


def slurm_requeue_job() -> Optional[str]:
    """The SLURM job that a SIGUSR1 stop requeues (``<array job>_<task>`` for an array task, as Lightning names
    it); None outside a SLURM-launched job (Lightning's ``SLURMEnvironment.detect``: an interactive job named
    ``bash`` / ``interactive`` is not one)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array is not None else os.environ["SLURM_JOB_ID"]


def requeue(job: str) -> bool:
    """``scontrol requeue JOB``; a failure is a warning (the checkpoint is written; the user can resubmit)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        rank_zero_warn(f"preemption: scontrol is not on PATH; job {job} was not requeued (resubmit it to resume)")
        return False
    result = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        rank_zero_warn(f"preemption: scontrol requeue {job} failed ({result.stderr.strip() or result.returncode}); "
                       "resubmit the job to resume")
        return False
    rank_zero_info(f"preemption: requeued SLURM job {job}")
    return True


class PreemptionCheckpoint(L.Callback):
    def __init__(self, dirpath, filename: str = "last.ckpt", signum: int = signal.SIGUSR1,
                 requeue_job: Optional[str] = None):
        self.path = pathlib.Path(dirpath) / filename
        self.signum = signum
        self.requeue_job = requeue_job  # requeued after a SIGUSR1 stop's checkpoint (SLURM's time-limit warning)
        self.requested: Optional[int] = None
        self._previous: Dict[int, object] = {}  # the handlers this callback replaced, put back at the end
        self._held = False  # a stop waiting for the validation under way to end

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registers its handlers just before training starts: take SIGUSR1 only if it left it free.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(self.signum) in (signal.SIG_DFL, None):
            self._previous[self.signum] = signal.signal(self.signum, self._request)
        if trainer.world_size > 1:
            # Lightning's SIGTERM handler broadcasts rank 0's flag *inside the handler*, wherever the step is: with
            # SIGTERM on every rank (SLURM, torchrun) a rank's broadcast met another's gradient all-reduce and the
            # job hung (tests/test_cluster.py, 2 of 7 tries). Here the handler only sets the flag; every rank
            # agrees on it at a step's end (on_train_batch_end). What ran before Lightning's handler still runs.
            original = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", {}).get(signal.SIGTERM)
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._chained(original))

    def _request(self, signum, frame) -> None:
        self.requested = signum

    def _chained(self, original):
        def request_then_original(signum, frame):
            self._request(signum, frame)
            if callable(original):
                original(signum, frame)
        return request_then_original

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
        if self.requeue_job is not None and signum == signal.SIGUSR1 and trainer.is_global_zero:
            requeue(self.requeue_job)  # after the checkpoint: the requeue's SIGTERM may come at once

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                if handler is not None:  # None: installed outside Python, left as it was
                    signal.signal(signum, handler)
        self._previous = {}
        self.requested = None
