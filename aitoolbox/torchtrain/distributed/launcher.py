"""Starting the processes of ``fit_distributed``, watching them, and bringing rank 0's result home.

Processes are forked when the program has no script file (a notebook, ``python -``, ``python -c``) and CUDA is
not yet initialised in the parent: classes defined interactively then need no import. Scripts get fresh
interpreters (spawn), which need the TrainLoop to pickle and the script to guard its entry point with
``if __name__ == "__main__":``; both are checked before any process starts.
"""
import ast
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch

from aitoolbox.torchtrain.distributed.signals import STOP_SIGNALS, SignalStop
from aitoolbox.torchtrain.distributed.worker import DistributedJob, worker_entry

logger = logging.getLogger(__name__)

START_METHODS = ("fork", "spawn", "forkserver")


def main_script_path() -> Optional[str]:
    """Path of the running script, or None in a notebook, ``python -`` or ``python -c``."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path if path and os.path.isfile(path) else None


def choose_start_method(requested: Optional[str]) -> str:
    """fork for interactive sessions (when safe), spawn for scripts; or what was asked for."""
    if requested is not None:
        if requested not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS} or None, got {requested!r}")
        if requested == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError("start_method='fork' needs CUDA untouched in the parent process, but CUDA is already "
                               "initialised here. Use start_method='spawn' from a script, or restart and call "
                               "fit_distributed before anything runs on the GPU.")
        return requested
    if main_script_path() is not None:
        return "spawn"
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("fit_distributed from an interactive session needs the 'fork' start method, which this "
                           "platform lacks. Put the code in a script (with an if __name__ == '__main__': guard) and "
                           "run it with python.")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("fit_distributed from a notebook starts its processes with fork, which is impossible once "
                           "CUDA is initialised in the notebook's process. Restart the kernel and call fit_distributed "
                           "before moving anything to the GPU (do not call .cuda()/.to('cuda') first), or run the code "
                           "as a script.")
    return "fork"


def check_main_guard(script_path: str) -> None:
    """A spawned process re-runs the script's top level: without a ``__main__`` guard it would train again."""
    with open(script_path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), script_path)
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return
    raise RuntimeError(f"{script_path} has no 'if __name__ == \"__main__\":' guard. fit_distributed starts fresh "
                       "Python processes that import the script, so put the training code under that guard (or "
                       "in a function called from it).")


def pickle_job(job: DistributedJob) -> bytes:
    """The job pickled for spawned processes; on failure, name the part of the TrainLoop that cannot be sent.

    Plain pickle copies tensor data. multiprocessing's own pickler would move the model's tensors into shared
    memory, and every process would then train the very same weights.
    """
    try:
        return pickle.dumps(job)
    except Exception as whole_error:
        tl = job.train_loop
        parts = {"model": tl.model, "train_loader": tl.train_loader, "validation_loader": tl.validation_loader,
                 "test_loader": tl.test_loader, "optimizer": tl.optimizer, "criterion": tl.criterion}
        if isinstance(tl.validation_loader, Mapping):  # several validation sets: name the one that fails
            del parts["validation_loader"]
            parts.update({f"validation_loader[{name!r}]": loader for name, loader in tl.validation_loader.items()})
        callbacks = list(tl.callbacks) + list(job.fit_arguments.callbacks or []) + list(job.in_process_data_load)
        parts.update({f"callback {type(cb).__name__}": cb for cb in callbacks})
        for name, value in parts.items():
            try:
                pickle.dumps(value)
            except Exception as error:
                raise TypeError(f"the {name} cannot be pickled, so it cannot be sent to the training processes: "
                                f"{type(error).__name__}: {error}. Define classes and functions at module level "
                                "(not inside functions or as lambdas), or build the object in each process with "
                                "an in_process_data_load callback.") from None
        raise TypeError(f"the TrainLoop cannot be pickled for the training processes: "
                        f"{type(whole_error).__name__}: {whole_error}") from None


class ProcessLauncher:
    """Starts ``job.processes_per_node`` processes, watches them, and stops all if one fails.

    SIGTERM, SIGHUP and SIGINT sent to the launcher (a scheduler's time limit, a closed terminal, Ctrl-C) are
    forwarded to the processes, as torchrun's agent does: they stop after their current optimizer step (with a
    resumable checkpoint on SIGTERM/SIGHUP, see :mod:`~aitoolbox.torchtrain.train_loop.interrupts`), and those
    still running ``job.signal_grace_s`` seconds later are killed. The launcher then raises
    :class:`~aitoolbox.torchtrain.distributed.signals.SignalStop` (KeyboardInterrupt for SIGINT). Should the
    launcher itself be killed outright, its processes die with it (see
    :func:`~aitoolbox.torchtrain.distributed.worker.die_with_parent`).

    Args:
        job: what every process runs.
        start_method: ``'fork'``, ``'spawn'`` or ``'forkserver'`` (see :func:`choose_start_method`).
        poll_interval_s: how often the parent checks on its processes.
        listen_socket: the reserved rendezvous port's socket, handed to the process of global rank 0 (its store
            serves on it); None: rank 0 is on another node, or binds the port itself.
    """

    def __init__(self, job: DistributedJob, start_method: str, poll_interval_s: float = 0.1,
                 listen_socket: Optional[socket.socket] = None):
        self.job = job
        self.listen_socket = listen_socket
        self.start_method = start_method
        self.poll_interval_s = poll_interval_s
        self._processes: List[multiprocessing.Process] = []
        self._stop_signal: Optional[int] = None  # forwarded to the processes, or reported by them
        self._stop_deadline = 0.0
        self._reports: Dict[int, tuple] = {}  # rank -> its first report: (kind, summary, traceback or saved paths)

    def run(self) -> None:
        """Run the job to the end; raise with the failing rank's traceback if any process fails."""
        previous = self._forward_signals()
        try:
            self._run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _forward_signals(self) -> dict:
        """Handle the stop signals that have their default handling here (an application's own handler stays)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        defaults = {signal.SIGINT: signal.default_int_handler, **{signum: signal.SIG_DFL for signum in STOP_SIGNALS}}
        return {signum: signal.signal(signum, self._on_signal) for signum, default in defaults.items()
                if signal.getsignal(signum) is default}

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C twice: stop now (the processes are killed)
            return  # the same request again: the grace period already bounds the wait
        if signum == signal.SIGINT:
            logger.warning("SIGINT: forwarded to the training processes, which stop after their current batch with "
                           "KeyboardInterrupt, without writing a checkpoint (Ctrl-C again kills them at once)")
        else:
            logger.warning("%s: forwarded to the training processes, which stop after their current optimizer step "
                           "and save a resumable checkpoint with each checkpoint callback (killed if still running in "
                           "%g s)", signal.Signals(signum).name, self.job.signal_grace_s)
        self._begin_stop(signum)
        for process in self._processes:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signum)  # not its group: its DataLoader workers keep serving the batch
                except ProcessLookupError:
                    pass

    def _begin_stop(self, signum: int) -> None:
        self._stop_signal = signum
        self._stop_deadline = time.monotonic() + self.job.signal_grace_s

    def _run(self) -> None:
        payload = None
        if self.start_method != "fork":
            script = main_script_path()
            if script is not None:
                check_main_guard(script)
            payload = pickle_job(self.job)
        context = multiprocessing.get_context(self.start_method)
        messages = context.Queue()
        senders = []
        try:
            for local_rank in range(self.job.processes_per_node):
                if payload is None:  # fork: the child inherits the job
                    job_source = self.job
                else:
                    job_source, sender = context.Pipe(duplex=False)
                    senders.append(sender)
                rank_0 = self.job.placement(local_rank).rank == 0
                process = context.Process(target=worker_entry,
                                          args=(local_rank, job_source, messages,
                                                self.listen_socket if rank_0 else None),
                                          name=f"aitoolbox-rank{self.job.placement(local_rank).rank}")
                process.start()
                self._processes.append(process)
                if self._stop_signal is not None:  # a stop signal came while the processes were being started
                    os.kill(process.pid, self._stop_signal)
                if payload is not None:
                    job_source.close()  # the child holds its own copy; a dead child then breaks the pipe
            if senders:
                self._send_in_background(payload, senders)
            self._watch(messages)
        finally:
            self._stop_all()

    @staticmethod
    def _send_in_background(payload: bytes, senders: list) -> None:
        """Hand each spawned process the pickled job, after all of them were started.

        The job (the model's weights included) is far larger than a pipe's buffer, so a write returns only once
        the child reads it, i.e. after the child has imported the main script. Passed as a ``Process`` argument,
        it would make every ``start()`` wait for that and the processes would start one after another. One
        thread per process writes, so no child waits for another to read and the parent keeps watching its
        processes; a child that died before reading breaks its pipe.
        """
        def send(sender):
            try:
                sender.send_bytes(payload)
            except OSError:
                pass  # that process is gone; the watcher reports why
            finally:
                sender.close()

        for local_rank, sender in enumerate(senders):
            threading.Thread(target=send, args=(sender,), name=f"aitoolbox-job-sender-{local_rank}",
                             daemon=True).start()

    def _watch(self, messages) -> None:
        """Return once every process has exited cleanly; raise at the first failure, naming its cause."""
        while True:
            if self._stop_signal is not None:
                self._wait_for_stop(messages)
            reported = self._next_error(messages, self.poll_interval_s)
            if self._stop_signal is not None:
                continue  # the processes are stopping: errors now follow from that (a peer that left first)
            if reported is not None:
                raise self._root_cause(dict([reported]), messages)
            for local_rank, process in enumerate(self._processes):
                if process.exitcode not in (None, 0):
                    self._raise_for_exit(local_rank, process, messages)
            if all(process.exitcode == 0 for process in self._processes):
                return

    def _receive(self, messages, timeout_s: float) -> Optional[tuple]:
        """The next report of a process within ``timeout_s`` (0: only what is already there), recorded as its
        rank's outcome when it is the rank's first; None when there is none."""
        try:
            message = messages.get(timeout=timeout_s) if timeout_s > 0 else messages.get(False)
        except queue.Empty:
            return None
        kind, rank, summary, trace = message
        self._reports.setdefault(rank, (kind, summary, trace))
        if kind == "stopped" and self._stop_signal is None:  # a process was signalled directly
            self._begin_stop(summary)
        return message

    def _next_error(self, messages, timeout_s: float) -> Optional[Tuple[int, RuntimeError]]:
        """``(rank, error)`` reported by a process within ``timeout_s`` (0: only what is already there)."""
        message = self._receive(messages, timeout_s)
        if message is None or message[0] != "error":
            return None
        _, rank, summary, trace = message
        return rank, RuntimeError(f"fit_distributed: rank {rank} failed with {summary}\n\n"
                                  f"Traceback of rank {rank}:\n{trace}")

    def _wait_for_stop(self, messages) -> None:
        """After a stop signal: wait for the processes until the grace period ends, then raise what happened.

        SIGTERM / SIGHUP: :class:`SignalStop` when every process stopped as asked (or was killed after the grace
        period, which the log says); the error of a rank that failed meanwhile (a full disk while saving the
        checkpoint), with its traceback, or of one that died: a ``SignalStop`` would claim a checkpoint that may not
        have been written. SIGINT: KeyboardInterrupt (the processes stopped without a checkpoint).
        """
        signum = self._stop_signal
        killed_after_grace = False
        while any(process.exitcode is None for process in self._processes):
            if time.monotonic() >= self._stop_deadline:
                logger.error("%s: training processes still running after the %g s grace period are killed",
                             signal.Signals(signum).name, self.job.signal_grace_s)
                killed_after_grace = True
                break
            self._receive(messages, self.poll_interval_s)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not killed_after_grace:
            failure = self._stop_failure(signum, messages)
            if failure is not None:
                raise failure
        saved = [path for kind, _, paths in self._reports.values() if kind == "stopped" for path in paths]
        if saved:
            logger.warning("%s: the training processes stopped; saved %s", signal.Signals(signum).name,
                           ", ".join(saved))
        raise SignalStop(signum, saved)

    def _stop_failure(self, signum: int, messages) -> Optional[RuntimeError]:
        """The error of a rank that did not stop as asked (every process has exited), or None."""
        while self._receive(messages, 0.0) is not None:
            pass  # every report is in self._reports now (a process reports before it exits)
        name = signal.Signals(signum).name
        errors = {rank: report for rank, report in self._reports.items() if report[0] == "error"}
        if errors:
            # Rank 0 saves the checkpoint and the others learn its outcome (they raise its error too): its error is
            # the cause. Otherwise the first reported; the later ones follow from it (a peer that left).
            rank = 0 if 0 in errors else next(iter(errors))
            _, summary, trace = errors[rank]
            return RuntimeError(f"fit_distributed: after {name}, rank {rank} failed with {summary} while stopping; "
                                f"the resumable checkpoint may not have been written\n\nTraceback of rank {rank}:\n"
                                f"{trace}")
        # A process kills itself when its grace period is over (InterruptGuard): its timer started when the signal
        # reached it, which may be a little before it reached this launcher (a scheduler signals every process).
        grace_over = time.monotonic() >= self._stop_deadline - min(1.0, self.job.signal_grace_s / 2)
        for local_rank, process in enumerate(self._processes):
            rank = self.job.placement(local_rank).rank
            if process.exitcode in (0, 128 + signum) or rank in self._reports:
                continue
            if grace_over and process.exitcode == -getattr(signal, "SIGKILL", signal.SIGTERM):
                logger.error("%s: rank %d did not stop within the %g s grace period and was killed", name, rank,
                             self.job.signal_grace_s)
                continue
            return RuntimeError(f"after {name}: {self._exit_error(local_rank, process)}")
        return None

    def _root_cause(self, reported: Dict[int, RuntimeError], messages) -> RuntimeError:
        """The error to raise once a rank has reported one.

        A rank killed by a signal (the OOM killer) or leaving through ``os._exit`` cannot report; its peers then
        fail in a collective ("connection closed by peer") and do. So a rank that died without a report is the
        cause: give such a death a moment to show before blaming the first reporter.
        """
        first = next(iter(reported.values()))
        deadline = time.monotonic() + 0.5
        while True:
            exited = [(i, process) for i, process in enumerate(self._processes) if process.exitcode not in (None, 0)]
            # Read the queue after taking the exits: a rank reports before it exits, so its report is there now.
            while self._receive(messages, 0.0) is not None:
                pass  # recorded in self._reports
            for local_rank, process in exited:
                if self.job.placement(local_rank).rank not in self._reports:
                    return self._exit_error(local_rank, process)
            if time.monotonic() >= deadline:
                return first
            time.sleep(0.02)

    def _exit_error(self, local_rank: int, process) -> RuntimeError:
        rank = self.job.placement(local_rank).rank
        code = process.exitcode
        if code < 0:
            name = signal.Signals(-code).name
            hint = " (SIGKILL often means the system ran out of memory)" if name == "SIGKILL" else ""
            return RuntimeError(f"fit_distributed: rank {rank} was killed by signal {name}{hint}; the other "
                                "processes were stopped")
        return RuntimeError(f"fit_distributed: rank {rank} exited with code {code} without reporting an error; the "
                            "other processes were stopped")

    def _raise_for_exit(self, local_rank: int, process, messages) -> None:
        # A process that raised put its traceback on the queue just before exiting: prefer that message. A
        # process killed by a signal sent nothing. Errors of the other ranks are consequences (a lost peer).
        rank = self.job.placement(local_rank).rank
        deadline = time.monotonic() + (2.0 if process.exitcode > 0 else 0.0)
        while time.monotonic() < deadline:
            reported = self._next_error(messages, self.poll_interval_s)
            if reported is not None and reported[0] == rank:
                raise reported[1]
        raise self._exit_error(local_rank, process)

    def _stop_all(self) -> None:
        """Kill what is still running (with its DataLoader workers), then make sure it is gone.

        Only processes whose run is over are left here: a peer failed (their collectives cannot complete, and
        a process waiting in one would never see a gentler signal), or the grace period after a stop signal
        ended. So they are killed, not asked to stop.
        """
        for process in self._processes:
            if process.exitcode is None:
                self._signal_group(process, getattr(signal, "SIGKILL", signal.SIGTERM))
        for process in self._processes:
            process.join(timeout=5.0)
        for process in self._processes:
            if process.exitcode not in (None, 0) and hasattr(os, "killpg"):
                # A rank that died abruptly (a signal, os._exit) leaves its DataLoader workers in its group.
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    @staticmethod
    def _signal_group(process, sig) -> None:
        try:
            if hasattr(os, "killpg"):
                os.killpg(process.pid, sig)  # the worker made itself a process-group leader
            else:  # pragma: no cover - non-POSIX
                process.terminate()
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass
