"""Ctrl-C and termination signals during training stop between batches, never inside one.

A KeyboardInterrupt raised in the middle of a batch could leave an optimizer step half applied (torch's
optimizers update the parameters one by one) or applied without the loop knowing, and a later ``fit`` could then
not continue exactly. While ``fit`` trains, :class:`InterruptGuard` therefore handles the signals itself:

* **SIGINT (Ctrl-C)**: one that arrives while a batch is being trained is held until the batch is done, and then
  raised as the usual KeyboardInterrupt; a second Ctrl-C within the same batch raises at once, for a batch that
  takes too long. Outside batches (evaluation, callbacks at the epoch end) Ctrl-C acts immediately, as always.
* **SIGTERM and SIGHUP** (a scheduler's time limit or ``scancel``, torchrun's agent stopping its workers, a
  closed terminal): training goes on to the end of the current optimizer step (the accumulation window's last
  batch), every process of a distributed run at the same step (agreed within about a quarter of a second, see
  :mod:`~aitoolbox.torchtrain.train_loop.stop_agreement`), and then (after the callbacks' ``on_stop_signal()``,
  e.g. SpikeRollback judging its pending losses) every registered checkpoint
  callback writes a resumable mid-epoch checkpoint (the pre-requeue pattern of SLURM jobs) before :class:`SignalStop`
  ends training. A signal that arrives outside the batches takes effect at the next step, or when ``fit``
  ends. ``grace_s`` seconds after the signal the process is killed if it has not stopped by then; the same
  signal again changes nothing (a scheduler may signal every process of a job while the launcher forwards it).

The guard is active only in the main thread and only for the signals that have their default handling there (a
terminal, a Jupyter kernel, the processes of ``fit_distributed`` and torchrun); an application that installed its
own handler keeps it.

DataLoader worker processes leave these signals to the training process while it trains (SLURM, torchrun's agent
and a terminal signal every process of a group): see :mod:`~aitoolbox.torchtrain.train_loop.worker_signals`.
"""
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Iterable, List, Optional

from aitoolbox.torchtrain.callbacks.rollback_request import RollBack
from aitoolbox.torchtrain.distributed.signals import (  # noqa: F401  (re-exported: part of this module's API)
    DEFAULT_SIGNAL_GRACE_S, STOP_SIGNALS, SignalStop)
from aitoolbox.torchtrain.train_loop.stop_agreement import StopAgreement
from aitoolbox.torchtrain.train_loop.worker_signals import (
    shared_training_flag, shield_loader_workers, unshield_loader_workers)

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


class InterruptGuard:
    """Holds a Ctrl-C or a termination signal that arrives inside a batch (a context manager around training).

    Attributes:
        in_batch: True while a batch is being trained; the loop sets it.
        pending: a Ctrl-C arrived during the batch; the loop calls :meth:`raise_pending` when the batch is done.
        stop_signal: the termination signal received (None: none); the loop stops at the next optimizer step.
        grace_s: seconds from a termination signal to the process being killed, if it has not stopped by then.
    """

    def __init__(self, grace_s: float = DEFAULT_SIGNAL_GRACE_S):
        self.in_batch = False
        self.pending = False
        self.stop_signal: Optional[int] = None
        self.grace_s = grace_s
        self._previous_handlers: dict = {}
        self._loaders: List[Any] = []
        self._shielded: List[Any] = []
        self._training: Any = None  # 1 while the guard is active, in memory shared with DataLoader workers
        self._strategy: Any = None
        self._agreement = StopAgreement()
        self._deadline: Optional[threading.Timer] = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_previous_handlers={}, _strategy=None, _deadline=None, stop_signal=None, _loaders=[],
                     _shielded=[], _training=None)
        return state

    def watching(self, loaders: Iterable[Any]) -> "InterruptGuard":
        """The guard, to be entered, with the data loaders whose workers leave stop signals to this process."""
        self._loaders = [loader for loader in loaders if loader is not None]
        return self

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is not threading.main_thread():
            return self
        if any(getattr(loader, "num_workers", 0) for loader in self._loaders):
            if self._training is None:  # shared with the workers: forked or spawned ones read it
                self._training = shared_training_flag()
            self._training.value = 1
            self._shielded = [loader for loader in self._loaders if shield_loader_workers(loader, self._training)]
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._previous_handlers[signum] = signal.signal(signum, self._on_stop_signal)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        stop = None
        try:
            if exc_type is None:  # training ended: a signal that came after the last step stops the run now
                stop = self._stop_agreed_at_end()
        finally:
            if self._deadline is not None:
                # Training has stopped: the grace period bounded the stop, not what the process does after it (a
                # notebook, a test suite or a script that uploads after fit would be killed grace_s later).
                self._deadline.cancel()
                self._deadline = None
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers = {}
            for loader in self._shielded:
                unshield_loader_workers(loader)
            self._shielded, self._loaders = [], []
            if self._training is not None:
                self._training.value = 0  # workers still running (persistent ones) react to signals again
            self.in_batch = False
            self.pending = False
            self.stop_signal = None
            self._strategy = None
        if stop is not None:
            raise SignalStop(stop)

    def _on_sigint(self, signum, frame) -> None:
        if self.in_batch and not self.pending:
            self.pending = True
            logger.warning("Ctrl-C: training stops when the current batch is done (Ctrl-C again stops it at once)")
            return
        raise KeyboardInterrupt

    def raise_pending(self) -> None:
        """Raise the KeyboardInterrupt held during the batch (the batch is complete)."""
        self.pending = False
        raise KeyboardInterrupt

    def _on_stop_signal(self, signum, frame) -> None:
        if self.stop_signal is not None:
            # The same request again (a scheduler signals every process of the job, and the launcher forwards
            # it too): the grace period's deadline already bounds the wait.
            logger.info("%s again: training already stops at the next optimizer step", signal.Signals(signum).name)
            return
        self.stop_signal = signum
        logger.warning("%s: training stops after the current optimizer step, once checkpoint callbacks have "
                       "saved a resumable checkpoint (killed in %g s if not done by then)",
                       signal.Signals(signum).name, self.grace_s)
        self._deadline = threading.Timer(self.grace_s, self._kill_after_grace, args=(signum,))
        self._deadline.daemon = True
        self._deadline.start()

    def _kill_after_grace(self, signum: int) -> None:
        logger.error("%s: training did not stop within the %g s grace period; killing the process",
                     signal.Signals(signum).name, self.grace_s)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))

    def stop_due(self, strategy: Any) -> bool:
        """After a batch that stepped the optimizer: whether training stops here (in every process alike)."""
        self._strategy = strategy
        if getattr(strategy, "is_distributed", False):
            return self._agreement.poll(strategy, self.stop_signal is not None)
        return self.stop_signal is not None

    def _stop_agreed_at_end(self) -> Optional[int]:
        strategy, requested = self._strategy, self.stop_signal is not None
        if getattr(strategy, "is_distributed", False):
            requested = self._agreement.settle(requested)
        if not requested:
            return None
        return self.stop_signal or signal.SIGTERM  # another process received it

    def stop(self, tl: "TrainLoop") -> None:
        """Save a resumable checkpoint with every checkpoint callback, then end training with :class:`SignalStop`.

        Called in every process at the same step (a checkpoint is a collective in a distributed run).
        """
        signum = self.stop_signal or signal.SIGTERM  # in a distributed run another process may have received it
        # What the checkpoint must not hold half-done (SpikeRollback judges its pending losses). It may raise
        # RollBack: the run goes back to the kept point and stops there, before the replay's on_epoch_begin (where
        # it stands at the point: the checkpoint is the point's, with nothing pending, review 48s F2, F11).
        try:
            tl.callbacks_handler.on_stop_signal()
        except RollBack as request:
            tl.roll_back_before_stop(request)
        saved = save_resume_checkpoints(tl)
        if tl.strategy.is_main_process:  # the one process that writes checkpoints knows what was saved
            if saved:
                logger.warning("%s: saved %s; stopping", signal.Signals(signum).name, ", ".join(saved))
            else:
                logger.warning("%s: stopping (no checkpoint callback is registered: the progress since the last "
                               "checkpoint is lost)", signal.Signals(signum).name)
        raise SignalStop(signum, saved)


def save_resume_checkpoints(tl: "TrainLoop") -> list:
    """One mid-epoch checkpoint per checkpoint folder of the registered checkpoint callbacks; their paths (in the
    main process)."""
    from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback
    saved, folders = [], set()
    for callback in tl.callbacks:
        if not isinstance(callback, CheckpointCallback) or not callback.has_experiment_folder:
            continue
        folder = callback.experiment_folder.checkpoint_dir
        if folder in folders:
            continue
        folders.add(folder)
        path = callback.save_resume_checkpoint()
        if path is not None:
            saved.append(path)
    return saved
