"""ProfilerCallback: ``torch.profiler`` over a few training batches, with traces for TensorBoard and Perfetto.

The profiler follows torch's schedule (``wait`` batches idle, ``warmup`` batches profiled and thrown away, ``active``
batches recorded, ``repeat`` times), writes one Chrome-trace JSON file per recorded cycle and process, and logs the
operators that took the most time. Once its schedule is over it leaves the loop exactly as a run without it: the
profiler is closed and the callback no longer takes part in the batch hooks.
"""
import contextlib
import logging
import os
import time
from numbers import Integral
from typing import Any, Dict, List, Optional, Union

import torch
from torch.profiler import ProfilerActivity

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

logger = logging.getLogger(__name__)

#: The sub-folder of an experiment's run folder that holds the traces.
TRACE_SUB_FOLDER = "profiler"
#: After the other callbacks: their batch-end work belongs to the batch's profiler step.
PROFILER_EXECUTION_ORDER = 100_000


class ProfilerCallback(AbstractCallback):
    """Profile a few training batches with :mod:`torch.profiler` and write traces TensorBoard and Perfetto open.

    One profiler *step* is one training batch, also under ``grad_accumulation`` (a batch that only accumulates
    gradients is a step of its own): that is the unit the trace shows as ``ProfilerStep#N`` rows. A step runs from
    the end of one batch to the end of the next, so it begins with the wait for the batch's data and ends after the
    batch's callbacks; a step that crosses an epoch's end also holds that epoch's evaluation and checkpoints.

    The schedule is torch's (:func:`torch.profiler.schedule`): ``wait`` batches without profiling, ``warmup``
    batches profiled and discarded (the profiler's own start-up cost), ``active`` batches recorded, the whole cycle
    ``repeat`` times. The callback counts the ``wait`` batches itself and starts a profiler for each cycle's
    ``warmup`` and ``active`` batches only, so ``N`` counts the batches of that cycle after its wait (the warm-up
    steps come first: with the defaults the recorded steps are ``ProfilerStep#1`` to ``#3``). Each recorded cycle
    becomes one file per process, ``<folder>/rank<r>.<time in ns>.pt.trace.json`` (the layout of
    :func:`torch.profiler.tensorboard_trace_handler`, named by the process's global rank), and the main process logs
    the cycle's top operators (sorted by their own CUDA time when CUDA was profiled, else by their own CPU time).
    CUDA activity is profiled when the model trains on a CUDA device. The folder is ``output_dir`` or, without one,
    ``profiler/`` in the run folder of an experiment-tracking TrainLoop (``TrainLoopCheckpoint``,
    ``TrainLoopEndSave``, ``TrainLoopCheckpointEndSave``), or of a plain TrainLoop's default run folder.

    Cost: until its last cycle is over the callback takes part in the batch hooks: a wait batch costs a counter, the
    ``warmup`` and ``active`` batches pay the profiler's own cost. After the last cycle the profiler is closed and
    the callback unsubscribes from the batch hooks, so the rest of the run costs what it costs without it
    (``benchmarks/profiler_overhead.py``). Training computes exactly what it computes without the callback.

    Across ``fit`` calls and checkpoints the schedule is one schedule over the run's batches: the cycles recorded
    are counted (:attr:`cycles_done`, in :meth:`state_dict`, so checkpoints keep it), and a later ``fit`` or a run
    resumed from a checkpoint profiles only the cycles left, each from its ``wait`` again (a rollback of
    :class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` keeps the count: what was recorded stays recorded, and no
    more than ``repeat`` traces are written). A cycle counts as done
    once its recording has begun and its trace is written: training that ends (or fails) during a cycle's
    ``active`` batches writes a shorter trace of what was recorded (its last step then holds what followed the last
    batch: the end of training, or the failing batch); one that ends before them records nothing (the log says so)
    and that cycle runs again in the next ``fit``. To profile a finished run again, register a new
    ``ProfilerCallback``.

    Args:
        wait: batches without profiling at the start of each cycle.
        warmup: batches profiled but not recorded before the active ones (0 is allowed; torch warns that the
            first active batch may then be skewed).
        active: batches recorded in each cycle.
        repeat: how many cycles to record.
        record_shapes: record the input shapes of the operators (``record_shapes`` of ``torch.profiler.profile``).
        profile_memory: record tensor memory allocations and releases.
        with_stack: record the Python source location of the operators (bigger traces).
        output_dir: the folder of the trace files; None: ``profiler/`` in the run folder (an experiment-tracking
            TrainLoop's, or a plain TrainLoop's default ``./aitoolbox_runs/run_<timestamp>/``).
        row_limit: how many operators the logged table shows.
        execution_order: position among the callbacks (by default after the others, so that their batch-end work
            belongs to the batch's step).

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range (at construction).
        ValueError: at registration, when there is neither ``output_dir`` nor a run folder of the TrainLoop.
    """

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False,
                 output_dir: Optional[Union[str, os.PathLike]] = None, row_limit: int = 15,
                 execution_order: int = PROFILER_EXECUTION_ORDER):
        super().__init__("ProfilerCallback", execution_order=execution_order)
        for name, value, minimum in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                     ("repeat", repeat, 1), ("row_limit", row_limit, 1)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name, value in (("record_shapes", record_shapes), ("profile_memory", profile_memory),
                            ("with_stack", with_stack)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if output_dir is not None and (not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir)):
            raise ValueError(f"output_dir must be None or a folder path, got {output_dir!r}")
        self.wait, self.warmup, self.active, self.repeat = int(wait), int(warmup), int(active), int(repeat)
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.output_dir = os.path.abspath(os.path.expanduser(os.fspath(output_dir))) if output_dir is not None else None
        self.row_limit = int(row_limit)
        #: The trace files this process wrote, in order.
        self.trace_files: List[str] = []
        self._cycles_done = 0
        self._run_folder: Optional[ExperimentFolder] = None  # the loop's, when there is no output_dir
        self._profiler: Optional[torch.profiler.profile] = None  # only during a cycle's warmup and active batches
        self._wait_left = self.wait  # batches to wait before the next cycle's profiler starts

    @property
    def cycles_done(self) -> int:
        """The cycles recorded so far in this run (over all ``fit`` calls and resumes)."""
        return self._cycles_done

    @property
    def trace_dir(self) -> Optional[str]:
        """The folder the traces go to (None before registration)."""
        if self.output_dir is not None:
            return self.output_dir
        return os.path.join(self._run_folder.path, TRACE_SUB_FOLDER) if self._run_folder is not None else None

    # --- hooks ----------------------------------------------------------------------------------------------------
    def on_train_loop_registration(self) -> None:
        if self.output_dir is not None:
            _check_writable(self.output_dir)
            return
        # A preset's experiment folder, or a plain TrainLoop's default run folder (./aitoolbox_runs/run_<timestamp>).
        claim = getattr(self.train_loop_obj, "claim_run_folder", None)
        self._run_folder = claim() if callable(claim) else getattr(self.train_loop_obj, "experiment_folder", None)
        if self._run_folder is None:
            raise ValueError(
                "ProfilerCallback has nowhere to write its traces: pass output_dir='<folder>' to it, or use it with an "
                "experiment-tracking TrainLoop (TrainLoopCheckpoint, TrainLoopEndSave or TrainLoopCheckpointEndSave), "
                f"whose run folder then holds them in {TRACE_SUB_FOLDER}/")

    def on_train_begin(self) -> None:
        # Each fit starts the next cycle with its wait. A fit after the schedule is over runs without the batch
        # hooks; a loaded checkpoint may still change that (load_state_dict, which fit calls after this hook).
        self._wait_left = self.wait
        self._take_batch_hooks(self._cycles_done < self.repeat)

    def on_batch_begin(self) -> None:
        if self._profiler is None and self._wait_left == 0:  # wait=0: the cycle starts with this batch
            self._start()

    def on_batch_end(self) -> None:
        profiler = self._profiler
        if profiler is None:  # waiting: a counter, no profiler
            if self._wait_left > 0:
                self._wait_left -= 1
                if self._wait_left == 0:
                    self._start()  # here, so that the first step begins with the wait for the next batch's data
            return
        profiler.step()  # the end of this batch's step; writes the trace after the cycle's last active batch
        if profiler.step_num < self.warmup + self.active:
            return
        self._close()
        if self._cycles_done < self.repeat and self.wait == 0:
            self._start()

    def on_train_end(self) -> None:
        if self._profiler is not None:
            batches = self.wait + self._profiler.step_num  # one step per batch done
            if self._close():  # the cycle's active batches began: their (shorter) trace is written
                return
        elif self._cycles_done < self.repeat and self._wait_left < self.wait:
            batches = self.wait - self._wait_left
        else:
            return
        if batches == 0:  # the cycle's profiler (wait=0) was started by the fit's last batch: nothing of it ran
            return
        logger.info("ProfilerCallback: training ended %d batch(es) into profiling cycle %d of %d, before its active "
                    "batches (wait=%d, warmup=%d): nothing was recorded in it; the next fit profiles it from its "
                    "start", batches, self._cycles_done + 1, self.repeat, self.wait, self.warmup)
        self._wait_left = self.wait

    def on_exception(self, exception: BaseException) -> None:
        # The profiler must not stay enabled: torch refuses to start another one in this process while it is.
        if self._profiler is not None:
            self._close()
        self._wait_left = self.wait

    # --- state ----------------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The cycles recorded so far, so that a resumed run profiles only those left (checkpoints keep it)."""
        return {"cycles_done": int(self._cycles_done)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; a cycle the saved run was in the middle of runs again. The
        traces are files already written: a state with fewer cycles (SpikeRollback returning the run to a point
        before them) does not lower the count, so the replay does not record them again."""
        self._cycles_done = max(self._cycles_done, int(state["cycles_done"]))
        if self._profiler is None:
            self._take_batch_hooks(self._cycles_done < self.repeat)

    # --- the profiler ---------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Start the profiler of the next cycle: ``warmup`` batches, then ``active`` recorded ones."""
        if torch.autograd._profiler_enabled():
            # Starting a second profiler would fail in the middle of training, at the first warm-up batch.
            logger.warning("ProfilerCallback: another torch profiler is running in this process; this fit is not "
                           "profiled by the callback")
            self._take_batch_hooks(False)
            return
        activities = [ProfilerActivity.CPU]
        if self.train_loop_obj.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._trace_ready, record_shapes=self.record_shapes, profile_memory=self.profile_memory,
            with_stack=self.with_stack)
        profiler.__enter__()
        self._profiler = profiler

    def _close(self) -> bool:
        """Stop and close the cycle's profiler (a cycle cut short in its active batches is written now); True if that
        wrote a trace. The batch hooks stay taken only while cycles are left; the next cycle starts with its wait."""
        profiler, self._profiler = self._profiler, None
        cycles_before = self._cycles_done
        self._wait_left = self.wait
        try:
            profiler.__exit__(None, None, None)
        finally:
            self._take_batch_hooks(self._cycles_done < self.repeat)
        return self._cycles_done > cycles_before

    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        """The end of a recorded cycle (``on_trace_ready``): write the trace, log the top operators."""
        self._cycles_done += 1
        tl = self.train_loop_obj
        path = self._write_trace(profiler, _process_rank())
        if not tl.is_main_process:
            return
        if ProfilerActivity.CUDA in profiler.activities:
            sort_by, measure = "self_device_time_total", "self CUDA time"
        else:
            sort_by, measure = "self_cpu_time_total", "self CPU time"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        logger.info("ProfilerCallback: profiling cycle %d of %d recorded%s. Top %d operators by %s:\n%s",
                    self._cycles_done, self.repeat, f", trace {path}" if path else "", self.row_limit, measure, table)

    def _write_trace(self, profiler: torch.profiler.profile, rank: int) -> Optional[str]:
        """Export the cycle's trace to the trace folder; returns its path, or None when it could not be written (the
        error is logged: a profiling failure does not stop training)."""
        folder = self.trace_dir
        path = os.path.join(folder, f"rank{rank}.{time.time_ns()}.pt.trace.json")
        partial = path + ".partial"  # not a name the viewers pick up until it is complete
        try:
            if self._run_folder is not None and self.train_loop_obj.is_main_process:
                self._run_folder.ensure(folder)  # creates the run folder as the other callbacks do
            else:
                os.makedirs(folder, exist_ok=True)
            profiler.export_chrome_trace(partial)
            os.replace(partial, path)
        except (OSError, RuntimeError) as error:  # a full disk, or the profiler's own export failing
            logger.error("ProfilerCallback: could not write the trace %s (%s); training goes on", path, error)
            with contextlib.suppress(OSError):
                os.remove(partial)
            return None
        self.trace_files.append(path)
        logger.debug("ProfilerCallback: trace written to %s", path)
        return path

    def _take_batch_hooks(self, take: bool) -> None:
        handler = getattr(self.train_loop_obj, "callbacks_handler", None)
        if handler is None or not any(callback is self for callback in handler.callbacks):
            return
        if take:
            handler.subscribe(self)
        else:
            handler.unsubscribe(self)


def _check_writable(folder: str) -> None:
    """Raise now, not after the first profiled cycle, when ``folder`` cannot be created or written."""
    existing = folder
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"ProfilerCallback output_dir={folder!r}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"ProfilerCallback output_dir={folder!r}: the folder {existing} is not writable; pass "
                              "a folder you can write to")


def _process_rank() -> int:
    """This process's rank in the training job (0 outside one): it names the trace file."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0
