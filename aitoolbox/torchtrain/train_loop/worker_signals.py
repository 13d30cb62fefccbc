"""DataLoader worker processes leave SIGTERM, SIGHUP and SIGINT to their training process while it trains.

A terminal's Ctrl-C, SLURM (``scancel``, a time limit) and torchrun's agent signal every process of a group, the
workers of a DataLoader included. A worker killed by SIGTERM makes torch raise in the training process wherever it
is (in the middle of the checkpoint a stop writes), and one that ends on SIGINT can no longer serve the batches
the stop still needs. So the loaders of a training run start their workers:

* with the stop signals blocked from the moment they exist (the start of a worker process is wrapped in a
  blocked signal mask, which a forked or spawned process inherits): torch's worker loop installs a SIGTERM
  handler that kills the worker, and a signal arriving before ``worker_init_fn`` runs would meet it;
* then, in :class:`WorkerLeavesStopSignals` (run as ``worker_init_fn``, before the loader's own), with handlers
  of their own, after which the signals are unblocked (one that came meanwhile is handled now). While the
  training process trains (a flag in memory shared with it), a handler does nothing: the training process stops
  the run and closes its workers. Afterwards it ends the worker quietly, as torch's workers end on Ctrl-C, so that
  the clean-up at exit, which terminates workers with SIGTERM, still works.

The loader is changed for the time of training only (its ``worker_init_fn`` and ``multiprocessing_context``), and
given back as it was (:func:`unshield_loader_workers`).
"""
import contextlib
import multiprocessing
import multiprocessing.context as mp_context
import multiprocessing.sharedctypes
import os
import signal
from typing import Any, Callable, Iterator, Optional

from aitoolbox.torchtrain.distributed.signals import STOP_SIGNALS

#: What the workers leave to the training process.
WORKER_SIGNALS = STOP_SIGNALS + (signal.SIGINT,)


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# A worker process starts with the stop signals blocked (fork and exec keep the signal mask). Module-level
# classes: a spawned worker unpickles its process object by name.
class _ShieldedForkProcess(mp_context.ForkProcess):
    def start(self) -> None:
        with _stop_signals_blocked():
            super().start()


class _ShieldedSpawnProcess(mp_context.SpawnProcess):
    def start(self) -> None:
        with _stop_signals_blocked():
            super().start()


class _ShieldedForkContext(mp_context.ForkContext):
    Process = _ShieldedForkProcess


class _ShieldedSpawnContext(mp_context.SpawnContext):
    Process = _ShieldedSpawnProcess


# (A forkserver worker is forked by the fork server, whose signal mask it inherits: it gets the handlers of
# WorkerLeavesStopSignals only, and a signal in its first moments, before they are set, still ends it.)
_SHIELDED_CONTEXTS = {mp_context.ForkContext: _ShieldedForkContext, mp_context.SpawnContext: _ShieldedSpawnContext}


class WorkerLeavesStopSignals:
    """A DataLoader ``worker_init_fn``: in the worker, leave SIGTERM, SIGHUP and SIGINT to the training process
    while it trains, then run the loader's own ``worker_init_fn``.

    Replaces torch's SIGTERM handler (installed when the worker loop starts) with one that does nothing while
    ``training`` (memory shared with the training process) is set and otherwise ends the worker quietly (exit code
    0, as torch's workers end on Ctrl-C), then unblocks the signals the worker started with blocked.

    Args:
        worker_init_fn: the loader's own (None: none).
        training: a shared ``ctypes`` value, non-zero while the training process handles stop signals.
        multiprocessing_context: the loader's own (None: torch's default), given back when training ends.
    """

    def __init__(self, worker_init_fn: Optional[Callable[[int], Any]], training: Any,
                 multiprocessing_context: Any = None):
        self.worker_init_fn = worker_init_fn
        self.training = training
        self.multiprocessing_context = multiprocessing_context

    def __getstate__(self) -> dict:  # the loader's own context need not travel to the worker (a spawned one)
        return {"worker_init_fn": self.worker_init_fn, "training": self.training, "multiprocessing_context": None}

    def __call__(self, worker_id: int) -> None:
        for signum in WORKER_SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_SIGNALS)  # one that came meanwhile is handled now
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def _on_signal(self, signum, frame) -> None:
        if self.training.value:
            return  # the training process stops the run and closes this worker
        # End at once and quietly. Dying by the signal would make torch raise "DataLoader worker ... is killed" in
        # the training process, e.g. in its clean-up at exit, which terminates its workers with SIGTERM; an
        # exception could meet the worker's own exit path.
        os._exit(0)


def shared_training_flag() -> Any:
    """A flag in shared memory (``.value``) that forked and spawned workers read."""
    return multiprocessing.sharedctypes.RawValue("b", 0)


def shield_loader_workers(loader: Any, training: Any) -> bool:
    """Make the workers ``loader`` starts from now on leave stop signals to this process while ``training`` is set
    (see the module); True when the loader was changed (give it back with :func:`unshield_loader_workers`).
    Loaders without workers, without a settable ``worker_init_fn`` or already shielded are left as they are; a
    context other than fork and spawn is kept (its workers get the handlers only)."""
    if not getattr(loader, "num_workers", 0) or not hasattr(loader, "worker_init_fn"):
        return False
    if isinstance(loader.worker_init_fn, WorkerLeavesStopSignals):
        return False
    own_context = getattr(loader, "multiprocessing_context", None)
    if own_context is None:  # torch's default: the default start method's context
        own_kind = type(multiprocessing.get_context(multiprocessing.get_context().get_start_method()))
    else:
        own_kind = type(own_context)
    wrapper = WorkerLeavesStopSignals(loader.worker_init_fn, training, own_context)
    try:
        loader.worker_init_fn = wrapper
        if own_kind in _SHIELDED_CONTEXTS:
            loader.multiprocessing_context = _SHIELDED_CONTEXTS[own_kind]()
    except (AttributeError, ValueError, TypeError):  # a loader class that does not let them be set
        with contextlib.suppress(AttributeError, ValueError, TypeError):
            loader.worker_init_fn = wrapper.worker_init_fn
        return False
    return True


def unshield_loader_workers(loader: Any) -> None:
    """Give ``loader`` its own ``worker_init_fn`` and multiprocessing context back (workers already started keep
    their handlers, which end them on a stop signal from now on)."""
    wrapper = getattr(loader, "worker_init_fn", None)
    if isinstance(wrapper, WorkerLeavesStopSignals):
        loader.worker_init_fn = wrapper.worker_init_fn
        loader.multiprocessing_context = wrapper.multiprocessing_context
