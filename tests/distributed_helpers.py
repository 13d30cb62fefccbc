"""Run a test function in several real processes joined by a gloo process group, and collect its results.

``run_distributed(fn, world_size=2, args=(...))`` starts ``world_size`` fresh Python processes (forked
from a fork server that has torch imported); each one joins a gloo group, calls
``fn(rank, world_size, *args)`` and hands back what it returns (anything ``torch.save`` can write:
tensors travel bitwise). The caller gets the list ordered by rank.

``fn`` must be importable by name from a child: a module-level function of a test module or helper.
Children never outlive the call: when one fails the others (likely blocked in a collective) are killed,
and all are killed at the timeout. A failing rank's traceback is part of the raised error.
"""
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist

# A hang detector, not a speed requirement: generous, since a busy 2-core machine can make a run ten times slower.
DEFAULT_TIMEOUT_S = 180.0
_POLL_S = 0.02


def _child_main(fn: Callable, rank: int, world_size: int, init_method: str, args: Sequence[Any],
                result_path: str, timeout_s: float) -> None:
    # Two ranks on a small machine: more intra-op threads per process only oversubscribe the cores.
    torch.set_num_threads(1)
    ok = True
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # the parent shows every failure, including SystemExit and KeyboardInterrupt
        ok, value = False, traceback.format_exc()
    torch.save({"ok": ok, "value": value}, result_path)
    sys.exit(0 if ok else 1)


def run_distributed(fn: Callable, world_size: int = 2, args: Sequence[Any] = (),
                    timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return the results by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died without a result.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
    """
    context = multiprocessing.get_context("forkserver")
    # The fork server imports torch once per test session; each rank then starts in well under a second
    # instead of importing torch afresh. Preload nothing more: with torch._dynamo preloaded (which
    # DistributedDataParallel imports, two seconds) forked ranks sometimes abort ("Resource deadlock avoided").
    context.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory(prefix="aitoolbox_dist_") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        paths = [os.path.join(tmp, f"result_{rank}.pt") for rank in range(world_size)]
        processes = [context.Process(target=_child_main, daemon=True,
                                     args=(fn, rank, world_size, init_method, tuple(args), paths[rank], timeout))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            timed_out = _wait(processes, time.monotonic() + timeout)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
            for process in processes:
                process.join(5)
        results = [_load_result(path) for path in paths]

    errors = [f"rank {rank} raised:\n{result['value']}" for rank, result in enumerate(results)
              if result is not None and not result["ok"]]
    if errors:
        raise RuntimeError(f"{fn.__name__} failed in {len(errors)} of {world_size} processes\n" + "\n".join(errors))
    if timed_out:
        raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s on all {world_size} processes")
    missing = [rank for rank, result in enumerate(results) if result is None]
    if missing:
        codes = [processes[rank].exitcode for rank in missing]
        raise RuntimeError(f"{fn.__name__}: ranks {missing} died without a result (exit codes {codes})")
    return [result["value"] for result in results]


def _load_result(path: str) -> Any:
    try:
        return torch.load(path, weights_only=False)  # written by _child_main: trusted
    except (FileNotFoundError, EOFError, RuntimeError):  # absent, or cut short by a kill
        return None


def _wait(processes: List[multiprocessing.Process], deadline: float) -> bool:
    """Wait until all processes exit or one fails; return True if the deadline passed first."""
    while any(process.is_alive() for process in processes):
        if any(process.exitcode not in (None, 0) for process in processes):
            # A failed rank leaves the others waiting in a collective: give them a moment, then stop.
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace and any(process.is_alive() for process in processes):
                time.sleep(_POLL_S)
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(_POLL_S)
    return False
