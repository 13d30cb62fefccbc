"""Ctrl-C and termination signals during training stop between batches, never inside one.

A KeyboardInterrupt raised in the middle of a batch could leave an optimizer step half applied (torch's
optimizers update the parameters one by one) or applied without the loop knowing, and a later ``fit`` could then
not continue exactly. While ``fit`` trains, :class:`InterruptGuard` therefore handles the signals itself:

* **SIGINT (Ctrl-C)**: one that arrives while a batch is being trained is held until the batch is done, and then
  raised as the usual KeyboardInterrupt; a second Ctrl-C within the same batch raises at once, for a batch that
  takes too long. Outside batches (evaluation, callbacks at the epoch end) Ctrl-C acts immediately, as always.
* **SIGTERM and SIGHUP** (a scheduler's time limit or ``scancel``, torchrun's agent stopping its workers, a
  closed terminal): training goes on to the end of the current optimizer step (the accumulation window's last
  batch), every process of a distributed run at the same step, and then every registered checkpoint callback
  writes a resumable mid-epoch checkpoint (the pre-requeue pattern of SLURM jobs) before :class:`SignalStop`
  ends training. A signal that arrives outside the batches takes effect at the next step, or when ``fit``
  ends. ``grace_s`` seconds after the signal the process is killed if it has not stopped by then; the same
  signal again changes nothing (a scheduler may signal every process of a job while the launcher forwards it).

The guard is active only in the main thread and only for the signals that have their default handling there (a
terminal, a Jupyter kernel, the processes of ``fit_distributed`` and torchrun); an application that installed its
own handler keeps it.

DataLoader worker processes leave these signals to the training process while it trains: a terminal's Ctrl-C,
SLURM and torchrun's agent signal every process of a group, and a worker killed by SIGTERM would make torch raise
in the training process wherever it is (in the middle of a checkpoint), while one that exits on SIGINT could not
serve the rest of the batch. The loaders the guard watches start their workers with a handler of their own for
SIGTERM, SIGHUP and SIGINT (set before the loader's own ``worker_init_fn`` runs): while the guard is active the
signal is left to the training process, which closes its workers when it is done; afterwards a worker reacts as
torch's workers do (it ends), so that the usual clean-up at exit, which terminates workers with SIGTERM, works.
"""
import datetime
import logging
import multiprocessing.sharedctypes
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional

import torch

from aitoolbox.torchtrain.distributed.signals import (  # noqa: F401  (re-exported: part of this module's API)
    DEFAULT_SIGNAL_GRACE_S, STOP_SIGNALS, SignalStop)

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


class StopAgreement:
    """All processes of a distributed run stop after the same optimizer step.

    At each step every process contributes whether it was asked to stop; the flags are combined in the
    background over a gloo group of their own and read at the next step, so training never waits for the
    exchange (and with CUDA never synchronises for it). Every process therefore sees the same answer at the
    same step, one step after the signal reached the last of them.
    """

    def __init__(self):
        self._group: Any = None
        self._flag: Optional[torch.Tensor] = None
        self._work: Any = None

    def __getstate__(self) -> dict:
        return {"_group": None, "_flag": None, "_work": None}  # a process group cannot travel

    def poll(self, strategy: Any, requested: bool) -> bool:
        """The agreed answer of the previous step's exchange (False at the first); starts this step's."""
        import torch.distributed as dist
        agreed = self._collect()
        if agreed:
            return True
        if self._group is None:  # every process gets here at the same step: new_group is a collective
            timeout = datetime.timedelta(seconds=getattr(strategy, "timeout_s", 600.0))
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._flag = torch.tensor([1 if requested else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def settle(self, requested: bool) -> bool:
        """At the end of training: whether any process was asked to stop (waits for the exchange)."""
        import torch.distributed as dist
        if self._collect():
            return True
        if self._group is None:
            return requested  # no step was trained: nothing was exchanged and nothing to agree on
        flag = torch.tensor([1 if requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _collect(self) -> bool:
        work, self._work = self._work, None
        if work is None:
            return False
        work.wait()
        return bool(self._flag.item())


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
                self._training = multiprocessing.sharedctypes.RawValue("b", 0)
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


class WorkerLeavesStopSignals:
    """A DataLoader ``worker_init_fn``: in the worker, leave SIGTERM, SIGHUP and SIGINT to the training process
    while it trains, then run the loader's own ``worker_init_fn``.

    torch's worker loop installs a SIGTERM handler that ends the worker before ``worker_init_fn`` runs; this
    replaces it with one that does nothing while ``training`` (memory shared with the training process) is set,
    and otherwise ends the worker quietly (exit code 0, as torch's workers end on Ctrl-C).
    A module-level class, so that loaders whose workers are spawned can send it.

    Args:
        worker_init_fn: the loader's own (None: none).
        training: a shared ``ctypes`` value, non-zero while the training process handles stop signals.
    """

    def __init__(self, worker_init_fn: Optional[Callable[[int], Any]], training: Any):
        self.worker_init_fn = worker_init_fn
        self.training = training

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS + (signal.SIGINT,):
            signal.signal(signum, self._on_signal)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def _on_signal(self, signum, frame) -> None:
        if self.training.value:
            return  # the training process stops the run and closes this worker
        # End at once and quietly (exit code 0), as torch's workers end on Ctrl-C. Dying by the signal would make
        # torch raise "DataLoader worker ... is killed" in the training process, e.g. in its clean-up at exit,
        # which terminates its workers with SIGTERM; an exception could meet the worker's own exit path.
        os._exit(0)


def shield_loader_workers(loader: Any, training: Any) -> bool:
    """Make the workers ``loader`` starts from now on leave stop signals to this process while ``training`` is set
    (see :class:`WorkerLeavesStopSignals`); True when it was changed (undo it with
    :func:`unshield_loader_workers`). Loaders without workers, without a settable ``worker_init_fn`` or already
    shielded are left as they are."""
    if not getattr(loader, "num_workers", 0) or not hasattr(loader, "worker_init_fn"):
        return False
    if isinstance(loader.worker_init_fn, WorkerLeavesStopSignals):
        return False
    try:
        loader.worker_init_fn = WorkerLeavesStopSignals(loader.worker_init_fn, training)
    except (AttributeError, ValueError, TypeError):  # a loader class that does not let it be set
        return False
    return True


def unshield_loader_workers(loader: Any) -> None:
    """Give ``loader`` its own ``worker_init_fn`` back (workers already started keep their handlers, which react
    to signals again once the guard is left)."""
    if isinstance(getattr(loader, "worker_init_fn", None), WorkerLeavesStopSignals):
        loader.worker_init_fn = loader.worker_init_fn.worker_init_fn
