"""Run code in a forked child process, and kill such children with SIGKILL at random moments.

Forking (rather than starting a new interpreter) keeps these tests fast: the child has torch and the test's
objects already imported, and starts in milliseconds. Children train with one thread (a forked child must not
use the parent's OpenMP thread pool, and tiny models do not need more).
"""
import multiprocessing
import os
import pickle
import random
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, List, Sequence

import torch
from tqdm.auto import tqdm

_FORK = multiprocessing.get_context("fork")


def _own_tqdm_lock() -> None:
    """A forked child shares tqdm's write lock (a semaphore) with the parent: killed while writing, it would
    leave the lock taken and the parent's next log message would wait forever. Give the child its own."""
    tqdm.set_lock(threading.RLock())


def _child(fn: Callable, args: Sequence[Any], result_path: str) -> None:
    _own_tqdm_lock()
    torch.set_num_threads(1)
    try:
        outcome = ("ok", fn(*args))
    except BaseException:  # report everything to the parent, assertion errors included
        outcome = ("error", traceback.format_exc())
    with open(result_path, "wb") as handle:
        pickle.dump(outcome, handle)


def run_forked(fn: Callable, *args: Any, timeout: float = 60.0) -> Any:
    """Call ``fn(*args)`` in a forked child and return its (picklable) result; its exception fails the caller."""
    with tempfile.TemporaryDirectory(prefix="aitoolbox_fork_") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        process = _FORK.Process(target=_child, args=(fn, args, result_path), daemon=True)
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
        if not os.path.exists(result_path):
            raise RuntimeError(f"{fn.__name__} died without a result (exit code {process.exitcode})")
        with open(result_path, "rb") as handle:
            status, value = pickle.load(handle)
    if status == "error":
        raise AssertionError(f"{fn.__name__} failed in the child process:\n{value}")
    return value


def _writer_child(fn: Callable, args: Sequence[Any]) -> None:
    _own_tqdm_lock()
    torch.set_num_threads(1)
    fn(*args)


def kill_at_random_moments(writer: Callable, args_for_run: Callable[[int], Sequence[Any]],
                           after_kill: Callable[[int], None], ready: Callable[[int], bool], kills: int = 10,
                           min_delay: float = 0.0, max_delay: float = 0.5, seed: int = 0,
                           ready_timeout_s: float = 180.0) -> List[float]:
    """Start ``writer(*args_for_run(i))`` in a forked child, wait until ``ready(i)`` (something the writer made
    observable on disk, such as its first complete save), SIGKILL it after a further random delay, call
    ``after_kill(i)``; ``kills`` times, restarting the writer each time. Returns the delays used.

    The random delay is counted from ``ready``, not from the start, so on a busy machine, where the child takes
    longer to get going, every run still has something to check.

    Raises:
        AssertionError: a writer exited by itself before it was killed (it must write until killed), or it was
            not ready within ``ready_timeout_s`` (a hang fails the test, not the suite).
    """
    delays = []
    rng = random.Random(seed)
    for run in range(kills):
        delay = rng.uniform(min_delay, max_delay)
        process = _FORK.Process(target=_writer_child, args=(writer, tuple(args_for_run(run))), daemon=True)
        process.start()
        deadline = time.monotonic() + ready_timeout_s
        while not ready(run):
            if not process.is_alive() or time.monotonic() > deadline:
                process.kill()
                process.join()
                raise AssertionError(f"writer run {run} was not ready within {ready_timeout_s} s "
                                     f"(exit code {process.exitcode})")
            time.sleep(0.01)
        time.sleep(delay)
        assert process.is_alive(), f"writer run {run} ended by itself (exit code {process.exitcode}) before the kill"
        process.kill()  # SIGKILL: no cleanup, no atexit, no flushing
        process.join()
        assert process.exitcode == -9
        delays.append(delay)
        after_kill(run)
    return delays
