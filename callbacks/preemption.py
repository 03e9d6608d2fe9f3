"""Save the run's ``checkpoints/last.ckpt`` when the job is preempted, so it can resume.

What Lightning (2.6) already does, read in ``lightning/pytorch/trainer/connectors/signal_connector.py``:

* SIGTERM, in every environment: its handler sets ``trainer.received_sigterm``, forwards the signal to the
  processes its own launcher started, and under DDP broadcasts rank 0's flag *inside the handler*; the loops
  finish the current batch (or validation batch), raise ``SIGTERMException`` (a ``SystemExit``), call the
  callbacks' ``on_exception`` and exit. No checkpoint is written. Under DDP rank 0's flag is also broadcast
  to every rank at the start of each step (a host sync at every step).
* On SLURM with ``SLURMEnvironment(auto_requeue=True)`` (the Trainer's default): the requeue signal (SIGUSR1)
  saves ``hpc_ckpt_<n>.ckpt`` *inside the signal handler*, wherever the step is, and calls ``scontrol requeue``.
* Outside SLURM nothing handles SIGUSR1: its default action kills the process without a checkpoint.

A collective inside a signal handler runs at whatever point the signal found each rank: one rank in its
handler's barrier or broadcast while another is in the step's gradient all-reduce is a mismatch that can hang
the job (two srun-style tasks both sent SIGTERM hung in 2 of 7 tries: tests/test_cluster.py), and a checkpoint
saved there is of a half-done step. So ``experiments.run`` builds the SLURM environment with
``auto_requeue=False`` (``slurm_requeue_job``), and this callback's handler takes SIGTERM from Lightning's for
the run (from the sanity check on; the final validation too; before those, from Lightning's registration on,
its handler calls our flag instead of its broadcast): it only raises a flag and calls the handler that
was there before Lightning's (Lightning's forwarding to its launcher's processes is not needed: the ranks agree
on the flag below). In one process Lightning's flag also stopped the run after any micro-batch, inside a
gradient-accumulation step; the flag here is acted on at a step's or a validation's end only.

``PreemptionCheckpoint`` adds what is missing: on SIGTERM (anywhere), and on SIGUSR1 where Lightning
has not taken that signal, the run stops at the end of the current step, or of the validation under way (under
DDP the ranks all-reduce their flags at every completed step and validation, so every rank stops at the same
point; a signal during a validation's checkpoint write, which Lightning runs after every other callback, is seen
at the next step's end) and writes
``<run folder>/checkpoints/last.ckpt`` (the file ``ModelCheckpoint(save_last=True)`` keeps), so
``python -m experiments.run ... --ckpt_path last`` (or the SLURM template's requeued job) continues
from the interrupted step with the same data order. A validation under way when the stop comes is finished
first (the resumed run would not redo it). With ``requeue_job`` (a SLURM job, from ``slurm_requeue_job``) a
stop after a SIGUSR1 (on any rank, even if a SIGTERM followed) then has rank 0 run ``scontrol requeue <job>``
after the checkpoint is written: SLURM's ``--signal=SIGUSR1@90`` warning before the time limit gives a
consistent checkpoint and a requeued job. A signal during the final validation (``trainer.validate``) is noted
and the run finishes.
The process then exits through Lightning's ``SIGTERMException`` with status ``128 + signal``
(``PREEMPTED_STATUS``: 143 after SIGTERM, 138 after SIGUSR1, the shell's convention for "ended by that
signal"), never 0, so ``train && evaluate`` stops after a preempted run; SLURM's requeue does not look
at the status. No ``summary.json`` is written for the interrupted part. Under DDP every rank stops
after the same step and ``last.ckpt`` is written once (by rank 0, after all ranks reached it).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import threading
from typing import Dict, Optional, Tuple

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
    it); None outside a job whose tasks are the ranks (Lightning's ``SLURMEnvironment.detect``: an interactive job
    named ``bash`` / ``interactive`` is not one), and under torchrun inside a SLURM job (``torchrun.sh``: torchrun's
    workers are the ranks, and Lightning picks ``TorchElasticEnvironment`` before SLURM's)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if not SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array is not None else os.environ["SLURM_JOB_ID"]


def requeue(job: str) -> bool:
    """``scontrol requeue JOB``; a failure is a warning (the checkpoint is written; the user can resubmit)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        rank_zero_warn(f"preemption: scontrol is not on PATH; job {job} was not requeued (resubmit it to resume)")
        return False
    try:
        result = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        rank_zero_warn(f"preemption: scontrol requeue {job} failed ({err}); resubmit the job to resume")
        return False
    if result.returncode != 0:
        rank_zero_warn(f"preemption: scontrol requeue {job} failed ({result.stderr.strip() or result.returncode}); "
                       "resubmit the job to resume")
        return False
    rank_zero_info(f"preemption: requeued SLURM job {job}")
    return True


_usr1_noted: Optional[bool] = None  # inside time_limit_warning_noted: whether a SIGUSR1 came while it held it


def _note_usr1(signum, frame) -> None:
    global _usr1_noted
    _usr1_noted = True


@contextlib.contextmanager
def time_limit_warning_noted():
    """SIGUSR1 noted, never left to its default action, around a whole run (``experiments.run.main``): the default
    kills the process (before training: no checkpoint, no requeue; after it: the finished run would lose its final
    validation and summary; srun would count the task as failed). ``PreemptionCheckpoint`` takes the signal over
    for each stage and acts on one noted before it did (a stop after the first completed step, with a checkpoint);
    Lightning's teardown puts this handler back, so no moment of the run is uncovered. One that comes after
    training is noted and the run finishes. A handler installed by someone else is left alone."""
    global _usr1_noted
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        yield
        return
    _usr1_noted = False  # before the handler: a signal at once is not lost
    signal.signal(signal.SIGUSR1, _note_usr1)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        _usr1_noted = None  # after the default is back: no note is left for a later run


def _hand_back_usr1() -> None:
    """A SIGUSR1 that nothing acted on (it came in a final validation) goes back to ``time_limit_warning_noted``'s
    note, if one is held: what runs next under it (``experiments.two_phase``'s phase 2) stops after its first step,
    as for a SIGUSR1 that came between the two runs."""
    global _usr1_noted
    if _usr1_noted is not None:
        _usr1_noted = True


def _free_to_take(signum: int) -> bool:
    """Whether no one handles ``signum``: the default action, or ``time_limit_warning_noted``'s note."""
    return signal.getsignal(signum) in (signal.SIG_DFL, None, _note_usr1)


def _take_noted_usr1() -> bool:
    """Whether a SIGUSR1 came while ``time_limit_warning_noted`` held it (and forget it: it is acted on once)."""
    global _usr1_noted
    if not _usr1_noted:
        return False
    _usr1_noted = False
    return True


class PreemptionCheckpoint(L.Callback):
    def __init__(self, dirpath, filename: str = "last.ckpt", signum: int = signal.SIGUSR1,
                 requeue_job: Optional[str] = None):
        self.path = pathlib.Path(dirpath) / filename
        self.signum = signum
        self.requeue_job = requeue_job  # requeued after a SIGUSR1 stop's checkpoint (SLURM's time-limit warning)
        self.requested: Optional[int] = None  # the stopping signal: SIGTERM wins over SIGUSR1 for the exit status
        self.usr1 = False  # SIGUSR1 came (sticky: a SIGTERM after it still requeues the job)
        self._installed: Dict[int, Tuple[object, object]] = {}  # signal -> (our handler, the one it replaced)
        self._held = False  # a stop waiting for the validation under way to end
        self._voted: Optional[Tuple[int, bool]] = None  # (signal, SIGUSR1 came) as every rank agreed on them
        # a signal that came where nothing stops (the final validation, a test, after the last step's vote): the
        # stage finished; a caller with more work to do (experiments.finetune's glue/all) can stop before it
        self.noted: Optional[int] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Before Lightning registers its signal handlers for the stage (it does so after every setup hook, then
        builds the data loaders before the sanity check, the first step or the final validation, where ``_install``
        takes SIGTERM): its SIGTERM notifier, the part of its handler that broadcasts under DDP, becomes our flag.
        A SIGTERM in that window then makes no collective inside the handler either; it goes to the first vote."""
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and stage in ("fit", "validate"):  # the stages whose signals the callback votes on
            connector._sigterm_notifier_fn = self._request  # an instance attribute: Lightning looks it up at registration

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":  # the run's final validation: a signal then is noted, the run finishes
            self._install(trainer)

    def _install(self, trainer) -> None:
        """Take the signals for this stage (Lightning registers its own when a stage starts; idempotent): SIGUSR1
        where Lightning left it free, and SIGTERM. Lightning's SIGTERM handler broadcasts rank 0's flag *inside the
        handler* under DDP, wherever the step is: with SIGTERM on every rank (SLURM, torchrun) one rank's broadcast
        met another's gradient all-reduce and the job hung (tests/test_cluster.py, 2 of 7 tries); in one process its
        flag stopped the run after any micro-batch, inside a gradient-accumulation step (the accumulated gradients
        were lost to the resume). Ours only raises the flag (and calls what ran before Lightning's handler); the
        ranks agree on it at a step's end or a validation's end. What it replaced goes back at the end, and
        Lightning's own SIGTERM handler never again (its teardown puts back the handler from before the run)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if _free_to_take(self.signum):
            self._take(self.signum, self._request)
            if self.signum == signal.SIGUSR1 and _take_noted_usr1():  # came before this stage took it
                self._request(signal.SIGUSR1, None)
        if not self._is_ours(signal.SIGTERM):
            connector = getattr(trainer, "_signal_connector", None)
            original = getattr(connector, "_original_handlers", {}).get(signal.SIGTERM)
            self._take(signal.SIGTERM, self._chained(original), restore=original)
            if getattr(connector, "received_sigterm", False):  # came through Lightning's handler before this
                connector.received_sigterm = False  # (on some ranks only): the vote decides, for all of them
                self._request(signal.SIGTERM, None)

    def _take(self, signum: int, handler, restore=None) -> None:
        previous = signal.signal(signum, handler)
        self._installed[signum] = (handler, previous if restore is None else restore)

    def _is_ours(self, signum: int) -> bool:
        return signum in self._installed and signal.getsignal(signum) is self._installed[signum][0]

    def _request(self, signum, frame) -> None:
        self.usr1 = self.usr1 or signum == signal.SIGUSR1
        self.requested = max(self.requested or 0, int(signum))

    def _chained(self, original):
        def request_then_original(signum, frame):
            self._request(signum, frame)
            if callable(original):
                original(signum, frame)
        return request_then_original

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_modules.steps import completes_step

        if completes_step(trainer):  # never stop inside a gradient-accumulation step
            self._stop_if_requested(trainer, pl_module, f"after step {trainer.global_step}")

    def _stop_if_requested(self, trainer, pl_module, where: str) -> None:
        """Stop when any rank got a signal. Under DDP the ranks vote at every step (every rank stops at the same
        one, or the others hang in the next all-reduce): Lightning 2.6 syncs the host at every DDP step anyway (its
        own SIGTERM broadcast), and waiting for a logging step could pass SLURM's grace period (KillWait, 30 s)."""
        requested, usr1 = float(self.requested or 0), float(self.usr1)
        if trainer.world_size > 1:
            flags = torch.tensor([requested, usr1], device=pl_module.device)
            requested, usr1 = (float(v) for v in trainer.strategy.reduce(flags, reduce_op="max"))
        if requested:
            self.requested, self.usr1 = int(requested), bool(usr1)
            self._voted = (self.requested, self.usr1)  # every rank exits, and requeues, alike (later signals aside)
            rank_zero_info(f"preemption: signal {self.requested} received, stopping {where}")
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
        elif trainer.state.fn == "fit" and not trainer.sanity_checking:
            # a signal during the validation or its checkpoint write: stop before the next step (every rank ends
            # a validation together, so the vote is safe here)
            self._stop_if_requested(trainer, pl_module, f"after the validation at step {trainer.global_step}")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A stop: save ``last.ckpt``, then (after SIGUSR1 in a SLURM job) flush the loggers and requeue. Our signal
        handlers stay until Lightning's teardown puts back the ones from before the run, after its loggers are
        finalized: the requeue's SIGTERM then cannot kill the process before the stopping step's scalars are out."""
        if not isinstance(exception, SIGTERMException):
            self._restore()  # Lightning skips the callbacks' teardown after an exception
            return
        signum, usr1 = self._voted or (self.requested or signal.SIGTERM, self.usr1)  # None: Lightning's flag
        try:
            trainer.save_checkpoint(str(self.path))
        except BaseException:
            self._restore()  # Lightning's teardown will not run
            raise
        exception.code = preempted_status(signum)  # a non-zero exit: the run did not finish
        rank_zero_info(f"preemption: saved {self.path} at step {trainer.global_step}; resume with --ckpt_path "
                       f"last (exit status {exception.code})")
        if self.requeue_job is not None and usr1 and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()  # the requeue's SIGTERM may come at once
            requeue(self.requeue_job)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.requested and self._voted is None:
            self.noted = max(self.noted or 0, self.requested)
            if self.usr1:
                _hand_back_usr1()
        self._restore()

    def _restore(self) -> None:
        """Put back what each of our handlers replaced, where ours is still in place: after a normal end Lightning's
        teardown has already set its own originals back (and those stay)."""
        if threading.current_thread() is threading.main_thread():
            for signum in list(self._installed):
                previous = self._installed[signum][1]
                if self._is_ours(signum) and previous is not None:  # None: installed outside Python, left as it was
                    signal.signal(signum, previous)
        self._installed = {}
        self.requested, self.usr1, self._voted = None, False, None
