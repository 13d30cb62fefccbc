"""The termination signals training stops for, the exception that ends a run they stopped, and the exit status
of a script that Ctrl-C ended.

Shared by the ``fit_distributed`` launcher (which forwards them), its processes (which report a stop) and the
training loop's :class:`~aitoolbox.torchtrain.train_loop.interrupts.InterruptGuard` (which handles them).
"""
import atexit
import signal
import sys
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


def _keep_ctrl_c_exit_status() -> None:
    """At exit, after a script ended on an uncaught ``KeyboardInterrupt``: make sure Python still ends it by SIGINT.

    CPython ends such a script by SIGINT after finalizing (the shell's ``$?`` is 130, and a shell loop running it
    stops), remembering the interrupt in a flag that any ``exec``/``eval`` of source text resets. torch registers an
    exit handler once ``torch._dynamo`` is imported (an optimizer's first step imports it) that imports ``tabulate``,
    whose named tuples are made by ``eval``: the flag is lost and the script exits with status 1, as though it had
    failed. Raising the interrupt again from source text sets the flag again (CPython sets it when such code ends
    on a ``KeyboardInterrupt``). This handler is registered when aitoolbox's training loop is imported, before torch's
    (handlers run last-registered first), so it runs after it. Where torch's came first (``torch._dynamo`` imported,
    or ``torch.compile`` called, before aitoolbox), this one runs before it: it imports ``tabulate`` first, so that
    torch's handler finds it imported and evaluates nothing.

    Only for the uncaught exception of a script (``python script.py``, ``-m``, ``-c``), not for an interactive
    session, where the same flag is never set (``python -i``, IPython and Jupyter keep their own last exception).
    """
    if sys.flags.inspect or getattr(sys, "last_type", None) is not KeyboardInterrupt:
        return
    traceback = getattr(sys, "last_traceback", None)
    if traceback is None or traceback.tb_frame.f_globals.get("__name__") not in ("__main__", "runpy"):
        return
    try:
        import tabulate  # noqa: F401 - see above (an optional dependency of torch's exit handler)
    except ImportError:
        pass
    try:
        exec("raise KeyboardInterrupt")  # noqa: S102 - constant source text: what CPython's flag is set from
    except KeyboardInterrupt:
        pass


atexit.register(_keep_ctrl_c_exit_status)
