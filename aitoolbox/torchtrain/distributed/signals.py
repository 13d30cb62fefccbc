"""The termination signals training stops for, and the exception that ends a run they stopped.

Shared by the ``fit_distributed`` launcher (which forwards them), its processes (which report a stop) and the
training loop's :class:`~aitoolbox.torchtrain.train_loop.interrupts.InterruptGuard` (which handles them).
"""
import signal
from typing import Sequence

DEFAULT_SIGNAL_GRACE_S = 60.0
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class SignalStop(SystemExit):
    """Training stopped because the process was asked to terminate (SIGTERM, SIGHUP).

    A ``SystemExit`` with the shell's code for that signal (``128 + signum``: 143 for SIGTERM), so that a
    script ends as a scheduler expects while ``finally`` blocks still run.

    Attributes:
        signum: the signal received.
        saved: the resumable checkpoints written before stopping (in the process that wrote them; empty in the
            other processes of a distributed run, and when no checkpoint callback is registered).
    """

    def __init__(self, signum: int, saved: Sequence[str] = ()):
        super().__init__(128 + signum)
        self.signum = signum
        self.saved = tuple(saved)

    def __str__(self) -> str:
        return f"training stopped by {signal.Signals(self.signum).name}"

    def __reduce__(self):  # travels between processes with its signal number and checkpoints
        return type(self), (self.signum, self.saved)
