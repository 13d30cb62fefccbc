"""Ctrl-C during training stops between batches, never inside one.

A KeyboardInterrupt raised in the middle of a batch could leave an optimizer step half applied (torch's
optimizers update the parameters one by one) or applied without the loop knowing, and a later ``fit`` could then
not continue exactly. While ``fit`` trains, :class:`InterruptGuard` therefore handles SIGINT itself: one that
arrives while a batch is being trained is held until the batch is done, and then raised as the usual
KeyboardInterrupt; a second Ctrl-C within the same batch raises at once, for a batch that takes too long. Outside
batches (evaluation, callbacks at the epoch end) Ctrl-C acts immediately, as always.

The guard is active only in the main thread and only where SIGINT has Python's default handler (a terminal, a
Jupyter kernel); an application that installed its own handler keeps it.
"""
import logging
import signal
import threading
from typing import Optional

logger = logging.getLogger(__name__)


class InterruptGuard:
    """Holds a Ctrl-C that arrives inside a batch until the batch is done (a context manager around training).

    Attributes:
        in_batch: True while a batch is being trained; the loop sets it.
        pending: a Ctrl-C arrived during the batch; the loop calls :meth:`raise_pending` when the batch is done.
    """

    def __init__(self):
        self.in_batch = False
        self.pending = False
        self._previous_handler: Optional[object] = None

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None
        self.in_batch = False
        self.pending = False

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
