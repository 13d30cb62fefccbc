"""Where the training time goes: samples and tokens per second, the share spent waiting for data, MFU, peak memory.

:class:`ThroughputMonitor` measures every training epoch and records, in ``train_history`` (so the epoch's summary
line, the CSV logger, TensorBoard, W&B and MLflow show them):

- ``samples_per_sec``: samples trained per second of the epoch, summed over all processes of a distributed run;
- ``tokens_per_sec``: the same for the counts of a ``tokens_fn`` (e.g. non-padding tokens), when one is given;
- ``data_wait_fraction``: the share of the epoch spent getting batches from the training loader (starting its
  iteration, and each ``next``: loading, collating, waiting for worker processes), measured by the loop around the
  loader alone, so the work of callbacks, checkpoints, evaluation and the progress bar never counts as waiting:
  near 1, the data pipeline is the bottleneck;
- ``mfu``: the model FLOPs utilisation: the FLOP/s of the model's forward and backward (each counted once, see
  :mod:`.flop_count`) over the devices' peak for the math they ran in, when both are known;
- ``hfu``: the hardware FLOPs utilisation, when it differs from ``mfu``: the same with the forward segments that
  activation checkpointing computes again during the backward counted too;
- ``peak_memory_mib``: the peak memory of the epoch (CUDA: ``torch.cuda.max_memory_allocated``, reset at each
  epoch's start; CPU: the process's peak resident set size, which the operating system keeps over its life), the
  largest of all processes.

Every ``window`` batches the progress bar shows the window's numbers.

Times are the host's (``time.perf_counter``): nothing is synchronised with the device per batch. On a GPU the host
runs ahead of the device by what it has queued, which a window of many batches averages out; at the epoch's end
the device is synchronised once, so the epoch's numbers are exact. The FLOPs are counted once, on one real batch,
with ``torch.utils.flop_counter.FlopCounterMode`` (see :class:`ThroughputMonitor` and :mod:`.flop_count`).
"""
import logging
import math
import numbers
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.flop_count import BatchFlopCounter, BatchFlops
from aitoolbox.torchtrain.callbacks.peak_flops import TABLE_SOURCE, effective_peak, precision_key
from aitoolbox.torchtrain.data.loader_info import batch_size_of

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover (Windows)
    resource = None

logger = logging.getLogger(__name__)

#: The names ThroughputMonitor records in ``train_history`` (``tokens_per_sec`` and ``mfu`` only when known).
HISTORY_KEYS = ("samples_per_sec", "tokens_per_sec", "data_wait_fraction", "mfu", "hfu", "peak_memory_mib")
MIB = 2 ** 20


def first_dimension(batch: Any) -> int:
    """The samples of a batch such as ``(inputs, labels)`` or ``{'input_ids': ..., 'labels': ...}``: the first
    dimension of its first tensor, searched depth first through tuples, lists and dicts (values in order), as the
    loop's evaluation counts them (:func:`~aitoolbox.torchtrain.data.loader_info.batch_size_of`).

    Raises:
        ValueError: ``batch`` holds no tensor.
    """
    size = batch_size_of(batch)
    if size is None:
        raise ValueError(f"ThroughputMonitor found no tensor in the batch (a {type(batch).__name__}) to count its "
                         "samples by: pass batch_size_fn=lambda batch: <the number of samples in it>")
    return size


def process_peak_memory_mib(device: torch.device) -> Optional[float]:
    """This process's peak memory in MiB: CUDA's peak allocated on ``device``, else the peak resident set size
    (None where the operating system does not report it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak <= 0:
        return None
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # macOS reports bytes, Linux KiB


class _Meter:
    """What one epoch (or one window of it) measured so far; host numbers, and the token counts still on the
    device."""

    def __init__(self, start: float, loader_wait_s: float):
        self.start = start
        self.loader_wait_at_start = loader_wait_s  # the loop's running total of loader time when the meter started
        self.batches = 0
        self.samples = 0
        self.tokens = 0.0  # read from the device
        self.device_tokens: List[torch.Tensor] = []  # tensors tokens_fn returned, not yet read

    def read_tokens(self) -> float:
        """The token count, reading the tensors still on the device at once (one synchronisation)."""
        if self.device_tokens:
            self.tokens += torch.cat([count.reshape(-1) for count in self.device_tokens]).sum().item()
            self.device_tokens = []
        return self.tokens


class ThroughputMonitor(AbstractCallback):
    """Record training throughput, data-loading wait, MFU and peak memory per epoch (see the module docstring).

    Samples are counted per batch (``batch_size_fn``), so a smaller last batch and batches of varying size count
    right, and under ``grad_accumulation`` every micro-batch counts once. In a distributed run the counts of all
    processes are summed at each epoch's end (one collective per epoch) and the epoch lasts as long as its slowest
    process; the progress bar, drawn by the main process, shows its own rates times the number of processes.

    Waiting for data: the loop times its training loader (starting each epoch's iteration, every ``next``) while a
    ThroughputMonitor is registered; ``data_wait_fraction`` is that time over the epoch's.

    FLOPs: with ``flops_per_batch='auto'`` the first training batch of a ``fit`` runs under
    ``torch.utils.flop_counter.FlopCounterMode``, which counts the matrix multiplications, convolutions and attention
    as they run (``2 * m * n * k`` for an ``(m, k) @ (k, n)`` product; element-wise operations count nothing)
    without changing what they compute: the trained weights are bitwise those of a run without the monitor. The
    model's forward and backward are counted once each (:attr:`flops_per_batch`, for a batch of
    :attr:`flops_batch_size` samples); the optimizer steps are not counted (an optimizer whose step multiplies
    matrices does no model work), and what activation checkpointing computes again during the backward counts only
    in :attr:`hardware_flops_per_batch` (see :mod:`.flop_count`). Each batch counts ``flops_per_batch * its samples
    / flops_batch_size``. Under ``torch_compile`` nothing is counted (a batch counted would run outside the compiled
    graphs, and round differently): pass the number, e.g. the :attr:`flops_per_batch` of a monitor after an epoch
    without ``torch_compile``.

    MFU divides the achieved model FLOP/s by ``peak_flops`` per device (times the number of processes) or, on a GPU
    in the table of :mod:`~aitoolbox.torchtrain.callbacks.peak_flops`, by its dense peak for the math the counted
    FLOPs ran in: bfloat16 or float16 (autocast, amp's O2/O3), or for float32 TF32 where torch allows it for that
    operation (``cudnn.allow_tf32`` for convolutions, on by default; ``cuda.matmul.allow_tf32`` for matrix
    multiplications), else float32; work in several precisions divides by the peak of their mix (the time the device
    would take for each part at its peak). The denominator and its source are logged once. ``hfu`` divides the
    hardware FLOP/s by the same peak; it is recorded when the hardware count differs from the model's.

    Args:
        window: batches per progress-bar update of the rates.
        batch_size_fn: ``fn(batch) -> int``, the samples in a batch (default: :func:`first_dimension`). Return a
            Python int: reading a CUDA tensor would wait for the device at every batch.
        tokens_fn: ``fn(batch) -> int or tensor``, e.g. ``lambda batch: batch['attention_mask'].sum()``; tensors
            (of any shape: all their elements count) are summed where they are and read once per window.
        flops_per_batch: ``'auto'`` (count them), a number (the model FLOPs of forward and backward of a batch the
            size of the first batch), or None (no FLOPs, no MFU).
        peak_flops: the peak FLOP/s of one device for MFU; None looks the GPU up in the table (no MFU on the CPU).

    Raises:
        ValueError / TypeError: an argument out of range or of the wrong type.
    """

    def __init__(self, window: int = 50, batch_size_fn: Optional[Callable[[Any], int]] = None,
                 tokens_fn: Optional[Callable[[Any], Union[int, torch.Tensor]]] = None,
                 flops_per_batch: Union[str, float, None] = "auto", peak_flops: Optional[float] = None):
        super().__init__("Throughput monitor")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (batches per progress-bar update), got {window!r}")
        for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_fn", tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function of the batch or None, got {type(fn).__name__}: {fn!r}")
        if not (flops_per_batch is None or flops_per_batch == "auto" or _positive_number(flops_per_batch)):
            raise ValueError("flops_per_batch must be 'auto' (count them on a batch), a positive number (the FLOPs of "
                             f"forward and backward of one batch) or None (no MFU), got {flops_per_batch!r}")
        if peak_flops is not None and not _positive_number(peak_flops):
            raise ValueError(f"peak_flops must be a positive number (FLOP/s of one device) or None, got {peak_flops!r}")
        self.window = window
        self.batch_size_fn = batch_size_fn or first_dimension
        self.tokens_fn = tokens_fn
        self.peak_flops = peak_flops
        #: Model FLOPs (forward and backward once) of a batch of :attr:`flops_batch_size` samples: the given number,
        #: the count once made (``'auto'`` until then), or None.
        self.flops_per_batch: Union[str, float, None] = flops_per_batch
        #: The samples of the batch :attr:`flops_per_batch` is for (the first batch's).
        self.flops_batch_size: Optional[int] = None
        #: What the counted batch's FLOPs were (model, hardware, by precision), for a batch of flops_batch_size; None
        #: when not counted (a given number, torch_compile, nothing counted yet).
        self.counted_flops: Optional[BatchFlops] = None
        self._peaks: Optional[Tuple[Optional[float], bool]] = None  # (peak per device, for hfu too), once resolved
        self._announced = False
        self._world_size = 1
        self._first_batch_due = False  # the next batch is the first of a fit: checked, and its FLOPs counted
        self._counter: Optional[Tuple[BatchFlopCounter, int]] = None  # counting a batch of so many samples
        self._epoch_meter: Optional[_Meter] = None
        self._window_meter: Optional[_Meter] = None
        self._postfix: Dict[str, str] = {}
        #: The numbers of the last complete window (``samples_per_sec``, ``data_wait_fraction``, ...).
        self.last_window: Dict[str, float] = {}
        #: What the last epoch measured over all processes: ``samples``, ``tokens``, ``seconds`` (the slowest
        #: process's), ``wait_s`` (summed over the processes), ``flops`` and ``hardware_flops`` (None when unknown).
        self.last_epoch: Dict[str, Any] = {}

    @property
    def hardware_flops_per_batch(self) -> Optional[float]:
        """The FLOPs the hardware computed for the counted batch's forward and backward (activation checkpointing's
        recomputation included), for a batch of :attr:`flops_batch_size`; None when not counted."""
        return self.counted_flops.hardware if self.counted_flops is not None else None

    # --- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The FLOP count (a resumed run need not count again); the rates are measured afresh by every run."""
        counted = self.flops_per_batch if _positive_number(self.flops_per_batch) else None
        return {"flops_per_batch": counted, "flops_batch_size": self.flops_batch_size,
                "counted_flops": self.counted_flops.state_dict() if self.counted_flops is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if state.get("flops_batch_size") is not None:
            self.flops_batch_size = state["flops_batch_size"]
        if self.flops_per_batch == "auto" and state.get("flops_per_batch") is not None:
            self.flops_per_batch = state["flops_per_batch"]
            self.counted_flops = BatchFlops.from_state(state.get("counted_flops"))
            self._peaks = None

    # --- the run -----------------------------------------------------------------------------------------------
    def on_train_begin(self) -> None:
        tl = self.train_loop_obj
        self._world_size = len(tl.all_gather_objects(None))  # the only collective outside the epochs' ends
        tl.run_state.time_loader = True
        self._first_batch_due = True
        if self.flops_per_batch == "auto" and tl.compile_stats is not None:
            self._announce("ThroughputMonitor: FLOPs are not counted under torch_compile (the counted batch would run "
                           "outside the compiled graphs, and train differently): no mfu. Pass flops_per_batch, e.g. "
                           "the monitor's flops_per_batch after an epoch trained without torch_compile")

    def on_epoch_begin(self) -> None:
        tl = self.train_loop_obj
        if tl.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(tl.device)
        now, waited = time.perf_counter(), tl.run_state.loader_wait_s
        self._epoch_meter, self._window_meter = _Meter(now, waited), _Meter(now, waited)

    def on_batch_begin(self) -> None:
        epoch, window = self._epoch_meter, self._window_meter
        if epoch is None:  # registered in the middle of an epoch: measure from the next one
            return
        batch = self.train_loop_obj.current_batch
        samples = self.batch_size_fn(batch)
        if self._first_batch_due:
            self._check_first_batch(samples)
        epoch.samples += samples
        window.samples += samples
        if self.tokens_fn is not None:
            tokens = self.tokens_fn(batch)
            if isinstance(tokens, torch.Tensor):
                window.device_tokens.append(tokens)
            else:
                window.tokens += tokens

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        if self._counter is not None and self.train_loop_obj.optimizer_step_due:
            self._counter[0].pause()  # the optimizer step that follows is not the model's work

    def on_after_optimizer_step(self) -> None:
        if self._counter is not None:
            self._counter[0].resume()  # another optimizer's backward may follow (a MultiLoss)

    def on_batch_end(self) -> None:
        if self._counter is not None:
            self._finish_count()
        self._first_batch_due = False
        window = self._window_meter
        if window is None:
            return
        window.batches += 1
        if window.batches >= self.window:
            self._close_window()

    def progress_bar_postfix(self) -> Optional[Dict[str, str]]:
        return self._postfix

    def on_epoch_train_end(self) -> None:
        tl = self.train_loop_obj
        epoch = self._epoch_meter
        if epoch is None:  # no epoch started under this monitor (an epoch's end done again after an exception)
            return
        if tl.device.type == "cuda":
            torch.cuda.synchronize(tl.device)  # once per epoch: the epoch's time includes its queued work
        seconds = time.perf_counter() - epoch.start
        window = self._window_meter
        epoch.tokens += window.read_tokens()
        flops = self._flops_for(epoch.samples)
        local = {"samples": epoch.samples, "tokens": epoch.tokens, "seconds": seconds,
                 "wait_s": tl.run_state.loader_wait_s - epoch.loader_wait_at_start,
                 "flops": flops[0] if flops else None, "hardware_flops": flops[1] if flops else None,
                 "peak_mib": process_peak_memory_mib(tl.device)}
        every = tl.all_gather_objects(local)
        seconds = max(rank["seconds"] for rank in every)
        self.last_epoch = {name: sum(rank[name] for rank in every) for name in ("samples", "tokens", "wait_s")}
        self.last_epoch["seconds"] = seconds
        for name in ("flops", "hardware_flops"):
            values = [rank[name] for rank in every]
            self.last_epoch[name] = None if None in values else sum(values)
        results = {"samples_per_sec": self.last_epoch["samples"] / seconds}
        if self.tokens_fn is not None:
            results["tokens_per_sec"] = self.last_epoch["tokens"] / seconds
        results["data_wait_fraction"] = self.last_epoch["wait_s"] / sum(rank["seconds"] for rank in every)
        peak, with_hfu = self._peak()
        if peak is not None and self.last_epoch["flops"] is not None:
            results["mfu"] = self.last_epoch["flops"] / seconds / (peak * len(every))
            if with_hfu:
                results["hfu"] = self.last_epoch["hardware_flops"] / seconds / (peak * len(every))
        peaks = [rank["peak_mib"] for rank in every if rank["peak_mib"] is not None]
        if peaks:
            results["peak_memory_mib"] = max(peaks)
        for name, value in results.items():
            tl.insert_metric_result_into_history(name, value)
        self._epoch_meter = self._window_meter = None

    def on_exception(self, exception: BaseException) -> None:
        if self._counter is not None:  # never leave the counting mode active after training stopped
            self._counter[0].stop()
            self._counter = None
        self._epoch_meter = self._window_meter = None

    # --- parts -------------------------------------------------------------------------------------------------
    def _check_first_batch(self, samples: Any) -> None:
        """The first batch of a fit: check what ``batch_size_fn`` returns, note the first batch's size and start
        counting FLOPs when they are to be counted."""
        if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 0:
            raise TypeError(f"ThroughputMonitor's batch_size_fn must return the batch's number of samples as a Python "
                            f"int, got {type(samples).__name__}: {samples!r}")
        if self.flops_batch_size is None:
            self.flops_batch_size = samples
        if self.flops_per_batch == "auto" and self.train_loop_obj.compile_stats is None:
            counter = BatchFlopCounter()
            counter.start()
            self._counter = (counter, samples)

    def _finish_count(self) -> None:
        (counter, samples), self._counter = self._counter, None
        counted = counter.stop()
        tl = self.train_loop_obj
        if counted.model <= 0 or samples <= 0:
            if tl.is_main_process:
                logger.warning("ThroughputMonitor counted no FLOPs in the first training batch (no matrix "
                               "multiplication or convolution ran through torch's dispatcher): no mfu; pass "
                               "flops_per_batch=<the FLOPs of forward and backward of a batch of %s samples>",
                               self.flops_batch_size)
            self.flops_per_batch = None
            return
        self.counted_flops = counted.scaled(self.flops_batch_size / samples)
        self.flops_per_batch = self.counted_flops.model
        self._peaks = None
        if tl.is_main_process:
            extra = "" if counted.hardware == counted.model else \
                f"; {self.counted_flops.hardware:.4g} with activation checkpointing's recomputation"
            logger.info("ThroughputMonitor: forward and backward of a batch of %d samples take %.4g model FLOPs "
                        "(counted by FlopCounterMode)%s", self.flops_batch_size, self.flops_per_batch, extra)

    def _flops_for(self, samples: int) -> Optional[Tuple[float, float]]:
        """Model and hardware FLOPs of ``samples`` samples; None when unknown."""
        if not _positive_number(self.flops_per_batch) or not self.flops_batch_size:
            return None
        scale = samples / self.flops_batch_size
        hardware = self.counted_flops.hardware if self.counted_flops is not None else self.flops_per_batch
        return self.flops_per_batch * scale, hardware * scale

    def _close_window(self) -> None:
        window, now = self._window_meter, time.perf_counter()
        seconds = max(now - window.start, 1e-9)
        waited = self.train_loop_obj.run_state.loader_wait_s - window.loader_wait_at_start
        measured = {"samples_per_sec": window.samples / seconds * self._world_size,
                    "data_wait_fraction": waited / seconds}
        postfix = {"samples/s": f"{measured['samples_per_sec']:.4g}"}
        if self.tokens_fn is not None:
            measured["tokens_per_sec"] = window.read_tokens() / seconds * self._world_size
            postfix["tokens/s"] = f"{measured['tokens_per_sec']:.4g}"
        postfix["data wait"] = f"{measured['data_wait_fraction']:.0%}"
        flops = self._flops_for(window.samples)
        peak, _ = self._peak()
        if flops is not None and peak is not None:
            measured["mfu"] = flops[0] / seconds / peak
            postfix["mfu"] = f"{measured['mfu']:.1%}"
        self.last_window, self._postfix = measured, postfix
        self._epoch_meter.tokens += window.tokens
        self._window_meter = _Meter(now, self.train_loop_obj.run_state.loader_wait_s)

    def _peak(self) -> Tuple[Optional[float], bool]:
        """``(peak FLOP/s of one device for MFU, whether hfu differs)``, resolved once the FLOPs are known and the
        denominator logged once; ``(None, False)`` when unknown."""
        if self._peaks is None and _positive_number(self.flops_per_batch):
            counted = self.counted_flops
            self._peaks = (self._resolve_peak(), counted is not None and counted.hardware != counted.model)
        return self._peaks or (None, False)

    def _resolve_peak(self) -> Optional[float]:
        tl = self.train_loop_obj
        if self.peak_flops is not None:
            self._announce("ThroughputMonitor: mfu divides by peak_flops=%.4g FLOP/s per device (given)",
                           self.peak_flops)
            return float(self.peak_flops)
        if tl.device.type != "cuda":
            self._announce("ThroughputMonitor: no mfu on the %s: its peak FLOP/s is unknown; pass peak_flops to "
                           "ThroughputMonitor to record it", tl.device.type.upper())
            return None
        device_name = torch.cuda.get_device_name(tl.device)
        if self.counted_flops is not None:
            split = self.counted_flops.model_by_precision
        else:  # a given count: the precision of the forward's matrix multiplications
            split = {precision_key(_compute_dtype(tl)): float(self.flops_per_batch)}
        found = effective_peak(device_name, split)
        if found is None:
            self._announce("ThroughputMonitor: no mfu: %s computing in %s is not in the table of peak FLOP/s; pass "
                           "peak_flops", device_name, ", ".join(sorted(split)))
            return None
        peak, description = found
        self._announce("ThroughputMonitor: mfu divides by %.4g FLOP/s per device: the dense peak of the %s (%s)", peak,
                       description, TABLE_SOURCE)
        return peak

    def _announce(self, message: str, *args: Any) -> None:
        if not self._announced and self.train_loop_obj.is_main_process:
            logger.info(message, *args)
        self._announced = True


def _compute_dtype(tl: Any) -> Optional[torch.dtype]:
    """The dtype of the forward's matrix multiplications: autocast's, else the model's floating parameters' (amp's
    O2/O3 cast the model), None for float32."""
    autocast_dtype = getattr(tl.precision, "autocast_dtype", None)
    if autocast_dtype is not None:
        return autocast_dtype
    for parameter in tl.model.parameters():  # O2 keeps BatchNorm in float32: any 16-bit parameter decides
        if parameter.dtype in (torch.float16, torch.bfloat16):
            return parameter.dtype
    return None


def _positive_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
