"""General-purpose callbacks: early stopping, stopping on NaN, running a function at hooks, smoke runs on a subset."""
import inspect
import itertools
import logging
import math
from numbers import Real
from typing import Any, Callable, Iterable, Iterator, Optional

from torch.utils.data import DataLoader, IterableDataset, Sampler

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

logger = logging.getLogger(__name__)

EARLY_STOPPING_MODES = ("auto", "min", "max")


def not_evaluated_yet(train_loop, metric_name: str) -> bool:
    """True for 'loss'/'val_loss' in an epoch where ``end_auto_eval=N`` skipped the evaluation."""
    return metric_name in ("loss", "val_loss") and train_loop.end_auto_eval is not False and not train_loop.auto_eval_due


def missing_metric_message(metric_name: str, history: dict, hint: str) -> str:
    """The error text for a metric a callback needs but the training history lacks."""
    present = ", ".join(repr(name) for name in history) or "none"
    return f"metric {metric_name!r} is not in train_history (recorded metrics: {present}). {hint}"


class EarlyStopping(AbstractCallback):
    """Stop training when a metric in ``train_history`` has stopped improving.

    At every epoch end the newest value of ``train_history[monitor]`` is compared with the best so far. After
    more than ``patience`` epochs in a row without an improvement larger than ``min_delta`` the loop stops.
    Epochs in which no new value was recorded (e.g. evaluation every N epochs) are not counted.

    Args:
        monitor: the ``train_history`` metric to watch, e.g. ``'val_loss'`` or ``'val_Accuracy'``.
        min_delta: the smallest change that counts as an improvement (>= 0).
        patience: how many epochs without improvement to tolerate before stopping (0 stops at the first).
        mode: ``'min'`` (lower is better), ``'max'`` (higher is better) or ``'auto'``: ``'min'`` when the
            metric name contains ``'loss'`` or ``'error'``, ``'max'`` otherwise.

    Raises:
        ValueError: on a bad argument, or at an epoch end when ``monitor`` was never recorded.
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0., patience: int = 0, mode: str = "auto"):
        # Runs late (99) so that metrics computed by other epoch-end callbacks are already in the history.
        super().__init__("EarlyStopping", execution_order=99)
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"monitor must be the name of a train_history metric such as 'val_loss', got {monitor!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, Real) or not min_delta >= 0:
            raise ValueError(f"min_delta must be a number >= 0, got {min_delta!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"patience must be an int >= 0 (epochs without improvement to tolerate), got {patience!r}")
        if mode not in EARLY_STOPPING_MODES:
            raise ValueError(f"mode must be one of {EARLY_STOPPING_MODES}, got {mode!r}")
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        if mode == "auto":
            mode = "min" if "loss" in monitor.lower() or "error" in monitor.lower() else "max"
        self.mode = mode
        self.patience_count = patience
        self.best_performance: Optional[float] = None
        self.best_epoch = 0
        self._values_at_epoch_begin = 0

    def on_epoch_begin(self) -> None:
        self._values_at_epoch_begin = len(self.train_loop_obj.train_history.get(self.monitor, []))

    def on_epoch_end(self) -> None:
        history = self.train_loop_obj.train_history
        if self.monitor not in history and not_evaluated_yet(self.train_loop_obj, self.monitor):
            return
        if self.monitor not in history:
            raise ValueError(missing_metric_message(
                self.monitor, history,
                "EarlyStopping needs it at every epoch end: for 'loss'/'val_loss' keep TrainLoop's end_auto_eval on "
                "(and pass a validation_loader), for other metrics register a callback that records them, e.g. "
                "ModelPerformanceEvaluation."))
        values = history[self.monitor]
        if len(values) <= self._values_at_epoch_begin:
            return  # nothing new was evaluated in this epoch
        current = values[-1]
        epoch = self.train_loop_obj.epoch
        if self.best_performance is None or self._improves(current):
            self.best_performance = current
            self.best_epoch = epoch
            self.patience_count = self.patience
            return
        self.patience_count -= 1
        if self.patience_count < 0:
            self.train_loop_obj.stop_training(
                f"EarlyStopping: {self.monitor} has not improved for {self.patience + 1} epoch(s); stopped at epoch "
                f"{epoch}, best epoch {self.best_epoch} ({self.monitor}={self.best_performance:.6g})")

    def _improves(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best_performance - self.min_delta
        return current > self.best_performance + self.min_delta


class TerminateOnNaN(AbstractCallback):
    """Stop training when the newest value of a ``train_history`` metric is NaN or infinite.

    It reads the history, which holds losses evaluated over whole data sets (``'loss'`` with end_auto_eval
    on), so a batch whose scaled fp16 gradients overflowed (and whose optimizer step was skipped) does not
    trigger it; ``'accumulated_loss'``, the mean of the training batches' losses, would.

    Args:
        monitor: the ``train_history`` metric to check at every epoch end.

    Raises:
        ValueError: on a bad argument, or at an epoch end when ``monitor`` was never recorded.
    """

    def __init__(self, monitor: str = "loss"):
        super().__init__("TerminateOnNaN", execution_order=98)
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"monitor must be the name of a train_history metric such as 'loss', got {monitor!r}")
        self.monitor = monitor

    def on_epoch_end(self) -> None:
        history = self.train_loop_obj.train_history
        if self.monitor not in history and not_evaluated_yet(self.train_loop_obj, self.monitor):
            return
        if self.monitor not in history:
            raise ValueError(missing_metric_message(
                self.monitor, history,
                "TerminateOnNaN checks it at every epoch end: keep TrainLoop's end_auto_eval on to record 'loss' "
                "and 'val_loss', or monitor 'accumulated_loss', which the loop always records."))
        last_value = history[self.monitor][-1]
        if last_value is not None and not math.isfinite(float(last_value)):
            self.train_loop_obj.stop_training(
                f"TerminateOnNaN: {self.monitor} = {last_value} at epoch {self.train_loop_obj.epoch}")


class FunctionOnTrainLoop(AbstractCallback):
    """Call ``fn_to_execute(train_loop)`` at the hooks whose flag is True.

    ``after_gradient_update`` runs once per optimizer after every backward pass.

    Args:
        fn_to_execute: a function taking the TrainLoop as its only argument.
        tl_registration: when the callback is registered with the loop.
        epoch_begin, epoch_end, train_begin, train_end: at the hook of that name.
        batch_begin, batch_end, after_gradient_update, after_optimizer_step: at the hook of that name.
        execution_order: position among the callbacks (increasing).

    Raises:
        TypeError: ``fn_to_execute`` is not callable.
        ValueError: no hook flag is set.
    """

    def __init__(self, fn_to_execute: Callable[[Any], Any], tl_registration: bool = False,
                 epoch_begin: bool = False, epoch_end: bool = False, train_begin: bool = False,
                 train_end: bool = False, batch_begin: bool = False, batch_end: bool = False,
                 after_gradient_update: bool = False, after_optimizer_step: bool = False, execution_order: int = 0):
        super().__init__("Execute the provided function at the selected hooks", execution_order=execution_order)
        if not callable(fn_to_execute):
            raise TypeError(f"fn_to_execute must be a function taking the TrainLoop, got {fn_to_execute!r}")
        self.fn_to_execute = fn_to_execute
        self.tl_registration = tl_registration
        self.epoch_begin = epoch_begin
        self.epoch_end = epoch_end
        self.train_begin = train_begin
        self.train_end = train_end
        self.batch_begin = batch_begin
        self.batch_end = batch_end
        self.after_gradient_update = after_gradient_update
        self.after_optimizer_step = after_optimizer_step
        if not any((tl_registration, epoch_begin, epoch_end, train_begin, train_end, batch_begin, batch_end,
                    after_gradient_update, after_optimizer_step)):
            raise ValueError("FunctionOnTrainLoop would never run: set at least one of tl_registration, epoch_begin, "
                             "epoch_end, train_begin, train_end, batch_begin, batch_end, after_gradient_update, "
                             "after_optimizer_step to True")

    # The handler calls only the hooks a class overrides, so every hook is overridden and checks its flag.
    def on_train_loop_registration(self) -> None:
        if self.tl_registration:
            self.fn_to_execute(self.train_loop_obj)

    def on_epoch_begin(self) -> None:
        if self.epoch_begin:
            self.fn_to_execute(self.train_loop_obj)

    def on_epoch_end(self) -> None:
        if self.epoch_end:
            self.fn_to_execute(self.train_loop_obj)

    def on_train_begin(self) -> None:
        if self.train_begin:
            self.fn_to_execute(self.train_loop_obj)

    def on_train_end(self) -> None:
        if self.train_end:
            self.fn_to_execute(self.train_loop_obj)

    def on_batch_begin(self) -> None:
        if self.batch_begin:
            self.fn_to_execute(self.train_loop_obj)

    def on_batch_end(self) -> None:
        if self.batch_end:
            self.fn_to_execute(self.train_loop_obj)

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        if self.after_gradient_update:
            self.fn_to_execute(self.train_loop_obj)

    def on_after_optimizer_step(self) -> None:
        if self.after_optimizer_step:
            self.fn_to_execute(self.train_loop_obj)


class FirstItemsSampler(Sampler):
    """Yields only the first ``num_items`` items of another sampler (or batch sampler).

    The wrapped sampler is iterated as usual, so a shuffling sampler still reshuffles every epoch and
    consumes its random generator exactly as the full loader would.
    """

    def __init__(self, sampler: Iterable, num_items: int):
        self.sampler = sampler
        self.num_items = num_items

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.sampler), self.num_items)

    def __len__(self) -> int:
        return min(self.num_items, len(self.sampler))

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to a DistributedSampler inside (directly, or inside a BatchSampler)."""
        for candidate in (self.sampler, getattr(self.sampler, "sampler", None)):
            if hasattr(candidate, "set_epoch"):
                candidate.set_epoch(epoch)
                return


class FirstBatchesIterable:
    """Any iterable of batches cut to its first ``num_batches`` batches (for loaders without a sampler)."""

    def __init__(self, loader: Iterable, num_batches: int):
        self.loader = loader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.num_batches)

    def __len__(self) -> int:
        return min(self.num_batches, len(self.loader))  # TypeError when the loader has no length, like it


def first_batches_loader(loader: Iterable, num_batches: int) -> Iterable:
    """A loader that yields the first ``num_batches`` batches ``loader`` would yield, in each epoch.

    For a ``DataLoader`` over a map-style dataset the result is a new ``DataLoader`` with every option of the
    original (workers, collate_fn, pin_memory, generator, ...) and a batch sampler that stops early; other
    iterables are wrapped in :class:`FirstBatchesIterable`.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return FirstBatchesIterable(loader, num_batches)
    accepted = inspect.signature(DataLoader.__init__).parameters
    option_names = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                    "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                    "pin_memory_device", "in_order")
    options = {name: getattr(loader, name) for name in option_names if name in accepted and hasattr(loader, name)}
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=FirstItemsSampler(loader.batch_sampler, num_batches),
                          **options)
    # batch_size=None: the loader yields single samples drawn from its sampler
    return DataLoader(loader.dataset, batch_size=None, sampler=FirstItemsSampler(loader.sampler, num_batches),
                      **options)


class DataSubsetTestRun(AbstractCallback):
    """Train (and evaluate) on only the first few batches: a quick smoke run of a new model or pipeline.

    When registered it replaces the loop's loaders with loaders that yield the first N batches of the
    originals in every epoch, keeping all DataLoader options (see :func:`first_batches_loader`).

    Args:
        num_train_batches: training batches per epoch (>= 1).
        num_val_batches: validation batches to keep; 0 keeps the whole validation loader.
        num_test_batches: test batches to keep; 0 keeps the whole test loader.

    Raises:
        ValueError: on a bad count, or at registration when a loader to subset was not given to the TrainLoop.
    """

    def __init__(self, num_train_batches: int = 1, num_val_batches: int = 0, num_test_batches: int = 0):
        super().__init__("Run on a small subset of the data")
        for name, value, minimum in (("num_train_batches", num_train_batches, 1),
                                     ("num_val_batches", num_val_batches, 0),
                                     ("num_test_batches", num_test_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.num_train_batches = num_train_batches
        self.num_val_batches = num_val_batches
        self.num_test_batches = num_test_batches

    def on_train_loop_registration(self) -> None:
        tl = self.train_loop_obj
        for count, name in ((self.num_val_batches, "validation_loader"), (self.num_test_batches, "test_loader")):
            if count > 0 and getattr(tl, name) is None:
                raise ValueError(f"DataSubsetTestRun was asked to keep {count} batch(es) of the {name}, but the "
                                 f"TrainLoop has no {name}: pass one to TrainLoop or set the count to 0")
        tl.train_loader = first_batches_loader(tl.train_loader, self.num_train_batches)
        if self.num_val_batches > 0:
            tl.validation_loader = first_batches_loader(tl.validation_loader, self.num_val_batches)
        if self.num_test_batches > 0:
            tl.test_loader = first_batches_loader(tl.test_loader, self.num_test_batches)
        if tl.is_main_process:
            logger.info("DataSubsetTestRun: training on the first %d batch(es) per epoch", self.num_train_batches)
