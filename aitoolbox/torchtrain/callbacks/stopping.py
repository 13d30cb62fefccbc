"""Callbacks that stop training, judging by the training history or the predictions.

:class:`EarlyStopping` stops when a metric stops improving, :class:`ThresholdEarlyStopping` when it does not
reach a threshold, :class:`TerminateOnNaN` when it becomes NaN or infinite, and :class:`AllPredictionsSame`
when the model predicts one value for the whole validation set. aitoolbox 1.x code imports them from
:mod:`aitoolbox.torchtrain.callbacks.basic`, which re-exports them.
"""
import logging
import math
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.best_weights import capture_weights, holds_weights, restore_weights

logger = logging.getLogger(__name__)

EARLY_STOPPING_MODES = ("auto", "min", "max")


def _validation_set_names(train_loop) -> List[str]:
    return getattr(train_loop, "validation_set_names", None) or []


def not_evaluated_yet(train_loop, metric_name: str) -> bool:
    """True for the losses the loop evaluates itself ('loss', 'val_loss', 'val_<set name>_loss') in an epoch where
    ``end_auto_eval=N`` skipped the evaluation, and for a data set's metric ('train_', 'val_', 'test_') in an epoch
    where a metric callback evaluating every few epochs (``eval_frequency=N``) skipped its evaluation."""
    end_auto_eval = getattr(train_loop, "end_auto_eval", True)
    loop_losses = ("loss", "val_loss") + tuple(f"val_{name}_loss" for name in _validation_set_names(train_loop))
    if metric_name in loop_losses:
        return end_auto_eval is not False and not train_loop.auto_eval_due
    # The metric's name is known only once its callback has evaluated: until then any data set's metric may be one
    # of a callback that skipped this epoch (a misspelt name is then reported at that callback's first evaluation).
    return metric_name.startswith(("train_", "val_", "test_")) and any(
        callable(getattr(callback, "skips_this_epoch", None)) and callback.skips_this_epoch()
        for callback in getattr(train_loop, "callbacks", ()))


def missing_metric_message(metric_name: str, history: Any, hint: str, set_names: Sequence[str] = ()) -> str:
    """The error text for a metric a callback needs but the training history lacks."""
    present = ", ".join(repr(name) for name in history) or "none"
    message = f"metric {metric_name!r} is not in train_history (recorded metrics: {present}). {hint}"
    if set_names and metric_name.startswith("val_"):
        message += (f" The validation sets are {list(set_names)}: their values are named val_<set>_loss and "
                    f"val_<set>_<metric> (e.g. 'val_{set_names[-1]}_loss'), the first set's also val_loss and "
                    "val_<metric>.")
    return message


def monitored_values(train_loop, metric_name: str, hint: str) -> Optional[List[Any]]:
    """The recorded values of ``metric_name``; None in an epoch that skipped the loop's own evaluation.

    Raises:
        ValueError: the metric was never recorded; the message lists the recorded metrics and ends with ``hint``.
    """
    history = train_loop.train_history
    if not history.get(metric_name):
        if not_evaluated_yet(train_loop, metric_name):
            return None
        raise ValueError(missing_metric_message(metric_name, history, hint, _validation_set_names(train_loop)))
    return history[metric_name]


def resolve_mode(mode: str, monitor: str) -> str:
    """``'min'`` or ``'max'``; ``'auto'`` is ``'min'`` for names containing 'loss' or 'error' (aitoolbox 1.x rule)."""
    if mode not in EARLY_STOPPING_MODES:
        raise ValueError(f"mode must be one of {EARLY_STOPPING_MODES}, got {mode!r}")
    if mode == "auto":
        return "min" if "loss" in monitor.lower() or "error" in monitor.lower() else "max"
    return mode


def _check_monitor(monitor: Any, example: str) -> None:
    if not isinstance(monitor, str) or not monitor:
        raise ValueError(f"monitor must be the name of a train_history metric such as {example!r}, got {monitor!r}")


def _check_patience(patience: Any) -> None:
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
        raise ValueError(f"patience must be an int >= 0 (epochs to tolerate), got {patience!r}")


def _watches_another_metric(callback: Any, state: Dict[str, Any]) -> bool:
    """True (with a warning) when a saved stopping state was of another metric or mode than ``callback``'s: its
    counts mean nothing for this one."""
    saved = (state.get("monitor", callback.monitor), state.get("mode", callback.mode))
    if saved == (callback.monitor, callback.mode):
        return False
    logger.warning("%s watches %s (mode %r) but the checkpoint's state is of %s (mode %r): it starts afresh",
                   type(callback).__name__, callback.monitor, callback.mode, saved[0], saved[1])
    return True


class EarlyStopping(AbstractCallback):
    """Stop training when a metric in ``train_history`` has stopped improving.

    At every epoch end the newest value of ``train_history[monitor]`` is compared with the best so far. After
    more than ``patience`` epochs in a row without an improvement larger than ``min_delta`` the loop stops.
    As in Keras, the best starts at +inf (``mode='min'``) or -inf, and a NaN never improves on it: a NaN epoch counts
    as one without improvement and is never the best one (nor restored), even at the first epoch.
    Epochs in which no new value was recorded (e.g. evaluation every N epochs) are not counted. Checkpoints hold
    the count and the best value (:meth:`state_dict`), so a resumed run stops where the uninterrupted run would.

    With ``restore_best_weights=True`` (Keras's option) the model gets the weights and buffers it had at the end of
    the best epoch back when training ends, whether this callback stopped it or the epochs ran out (as Keras 3
    does), before the end-of-training evaluations (``on_before_train_end``): ``train_end_test_loss``, the
    ``train_end_*`` metrics, their reports and trackers, and the final-model callbacks (``ModelTrainEndSave``) all
    describe these weights, the model ``fit`` returns. A copy of the best weights is kept in host memory and in the
    checkpoints (in :meth:`state_dict`), so a resumed run restores the same weights.

    The restored weights are a view of the run, not its state: the weights training ended with are kept aside (in
    host memory, and in the state of checkpoints taken while the view is in the model, e.g. the final model), and a
    later ``fit`` on the loop (or on a loop that loaded such a checkpoint) puts them back when it starts, so two
    ``fit`` calls train exactly as one (where Keras continues from the restored weights).

    Args:
        monitor: the ``train_history`` metric to watch, e.g. ``'val_loss'`` or ``'val_Accuracy'``.
        min_delta: the smallest change that counts as an improvement (>= 0).
        patience: how many epochs without improvement to tolerate before stopping (0 stops at the first).
        mode: ``'min'`` (lower is better), ``'max'`` (higher is better) or ``'auto'``: ``'min'`` when the
            metric name contains ``'loss'`` or ``'error'``, ``'max'`` otherwise.
        restore_best_weights: put the best epoch's weights back into the model when training ends (see above).

    Raises:
        TypeError: ``restore_best_weights`` is not a bool.
        ValueError: on a bad argument, at an epoch end when ``monitor`` was never recorded, or with
            ``restore_best_weights`` under ``gpu_mode='fsdp'`` (each process holds only shards of the weights).
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0., patience: int = 0, mode: str = "auto",
                 restore_best_weights: bool = False):
        # Runs late (99) so that metrics computed by other epoch-end callbacks are already in the history.
        super().__init__("EarlyStopping", execution_order=99)
        _check_monitor(monitor, "val_loss")
        if isinstance(min_delta, bool) or not isinstance(min_delta, Real) or not min_delta >= 0:
            raise ValueError(f"min_delta must be a number >= 0, got {min_delta!r}")
        _check_patience(patience)
        if not isinstance(restore_best_weights, bool):
            raise TypeError(f"restore_best_weights must be True or False, got {restore_best_weights!r}")
        self.restore_best_weights = restore_best_weights
        self.best_weights: Optional[Dict[str, Any]] = None  # with restore_best_weights: the best epoch's, in host memory
        # While the best weights are in the model after training: the weights training ended with, for the next fit.
        self.weights_after_training: Optional[Dict[str, Any]] = None
        self._training = False  # between on_train_begin and the end of training: a loaded view is undone at once
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self.mode = resolve_mode(mode, monitor)
        self.patience_count = patience
        self.best_performance: Optional[float] = None
        self.best_epoch = 0
        self._values_at_epoch_begin = 0

    def on_train_begin(self) -> None:
        if self.restore_best_weights and getattr(self.train_loop_obj, "shards_parameters", False):
            raise ValueError("EarlyStopping(restore_best_weights=True) keeps a copy of the whole model, and under "
                             "gpu_mode='fsdp' each process holds shards of it: rank the epoch checkpoints instead "
                             "(ModelCheckpoint(rm_subopt_local_models=...)) and load checkpoint.best_model_path")
        self._training = True
        if self.train_loop_obj.pending_restore is not None:
            self.weights_after_training = None  # a loaded checkpoint decides (its state is loaded next)
        self._put_back_weights_after_training(self.best_weights)

    def _put_back_weights_after_training(self, view: Optional[Dict[str, Any]]) -> None:
        """Undo the view of the best weights: training goes on from the weights it ended with. Weights put into the
        model since (``load_checkpoint``, ``ModelCheckpoint.load_best_model()``, ``load_state_dict``) are kept."""
        weights, self.weights_after_training = self.weights_after_training, None
        if weights is not None and view is not None and holds_weights(self.train_loop_obj, view):
            restore_weights(self.train_loop_obj, weights)

    def keep_best_weights(self) -> None:
        """Make the restored best weights the run's own: the next ``fit`` trains on from them (as Keras does),
        instead of from the weights training ended with."""
        self.weights_after_training = None

    def on_epoch_begin(self) -> None:
        self._values_at_epoch_begin = len(self.train_loop_obj.train_history.get(self.monitor, []))

    def on_epoch_end(self) -> None:
        values = monitored_values(
            self.train_loop_obj, self.monitor,
            "EarlyStopping needs it at every epoch end: for 'loss'/'val_loss' keep TrainLoop's end_auto_eval on "
            "(and pass a validation_loader), for other metrics register a callback that records them, e.g. "
            "ModelPerformanceEvaluation.")
        if values is None or len(values) <= self._values_at_epoch_begin:
            return  # nothing new was evaluated in this epoch
        current = values[-1]
        epoch = self.train_loop_obj.epoch
        if self._improves(current):
            self.best_performance = current
            self.best_epoch = epoch
            self.patience_count = self.patience
            if self.restore_best_weights:
                self.best_weights = capture_weights(self.train_loop_obj)
            return
        self.patience_count -= 1
        if self.patience_count < 0:
            best = (f"best epoch {self.best_epoch + 1} ({self.monitor}={self.best_performance:.6g})"
                    if self.best_performance is not None else f"no epoch had a finite {self.monitor}")
            self.train_loop_obj.stop_training(
                f"EarlyStopping: {self.monitor} has not improved for {self.patience + 1} epoch(s); stopped at epoch "
                f"{epoch + 1}, {best}")

    def on_before_train_end(self) -> None:
        """Put the best epoch's weights into the model, before the loop and the callbacks evaluate and save it."""
        tl = self.train_loop_obj
        self._training = False
        if not self.restore_best_weights or self.best_weights is None or self.best_epoch == tl.epoch:
            return  # the model holds the best epoch's weights already
        if self.weights_after_training is None:  # else this hook, interrupted after taking them, runs again (48l F5)
            self.weights_after_training = capture_weights(tl)
        restore_weights(tl, self.best_weights)
        if tl.is_main_process:
            logger.info("EarlyStopping: restored the weights of epoch %d, the best (%s=%.6g)", self.best_epoch + 1,
                        self.monitor, self.best_performance)

    def on_train_end(self) -> None:
        # A callback that ran in between (WeightAveraging(save_average=True) copies its average in at
        # on_train_end) does not replace the weights asked for here: this callback runs after it (order 99).
        if self.weights_after_training is not None:
            restore_weights(self.train_loop_obj, self.best_weights)

    def on_exception(self, exception: BaseException) -> None:
        self._training = False

    def _improves(self, current: float) -> bool:
        # As Keras: the best starts at +-inf, and a NaN compares False, so it never improves on anything.
        if self.mode == "min":
            best = math.inf if self.best_performance is None else self.best_performance
            return current < best - self.min_delta
        best = -math.inf if self.best_performance is None else self.best_performance
        return current > best + self.min_delta

    def state_dict(self) -> Dict[str, Any]:
        """The count of epochs without improvement, the best value and its epoch: what a resumed run needs to stop
        at the epoch the uninterrupted run would have (checkpoints store it under ``callbacks``); with
        ``restore_best_weights`` also the best epoch's weights (the size of the model's state dict)."""
        state = {"monitor": self.monitor, "mode": self.mode,
                 "epochs_without_improvement": self.patience - self.patience_count,
                 "best_performance": None if self.best_performance is None else float(self.best_performance),
                 "best_epoch": int(self.best_epoch), "values_at_epoch_begin": int(self._values_at_epoch_begin)}
        if self.restore_best_weights:  # tensors: a checkpoint holds them (read with weights_only)
            state["best_weights"] = self.best_weights
        if self.weights_after_training is not None:  # a checkpoint of the view: the next fit trains from these
            state["weights_after_training"] = self.weights_after_training
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. The epochs without improvement are counted against this
        callback's ``patience`` (a resumed run may change it); a state of another metric or mode is not loaded (a
        warning says so) and the callback starts afresh. A state saved while the best weights were in the model after
        training puts the weights training ended with back: now in a ``fit`` (which then trains from them), else when
        the next ``fit`` starts."""
        self.weights_after_training = state.get("weights_after_training")
        if self._training:  # the view the state describes: its best weights, saved as model_state_dict too
            self._put_back_weights_after_training(state.get("best_weights"))
        if _watches_another_metric(self, state):
            return
        self.patience_count = self.patience - int(state["epochs_without_improvement"])
        self.best_performance = state["best_performance"]
        self.best_epoch = int(state["best_epoch"])
        self._values_at_epoch_begin = int(state.get("values_at_epoch_begin", 0))
        if self.restore_best_weights:
            # A state saved without restore_best_weights has no weights: the best epoch's are then unknown, and
            # nothing is restored unless a later epoch improves.
            self.best_weights = state.get("best_weights")


class ThresholdEarlyStopping(AbstractCallback):
    """Stop training when a metric does not reach a threshold for more than ``patience`` epochs in a row.

    A metric where lower is better (``mode='min'``) misses the threshold when it is above it; one where higher
    is better when it is below it; a NaN misses it either way. Reaching the threshold again resets the count
    (``patience_count``), which checkpoints hold (:meth:`state_dict`).

    Args:
        monitor: the ``train_history`` metric to watch.
        threshold: the value the metric has to reach.
        patience: how many epochs missing the threshold to tolerate (0 stops at the first).
        mode: ``'min'``, ``'max'`` or ``'auto'`` (``'min'`` for names containing ``'loss'`` or ``'error'``).

    Raises:
        ValueError: on a bad argument, or at an epoch end when ``monitor`` was never recorded.
    """

    def __init__(self, monitor: str, threshold: float, patience: int = 0, mode: str = "auto"):
        super().__init__("ThresholdEarlyStopping", execution_order=99)
        _check_monitor(monitor, "val_loss")
        if isinstance(threshold, bool) or not isinstance(threshold, Real):
            raise ValueError(f"threshold must be a number, got {threshold!r}")
        _check_patience(patience)
        self.monitor = monitor
        self.threshold = threshold
        self.patience = patience
        self.mode = resolve_mode(mode, monitor)
        self.patience_count = patience

    def on_epoch_end(self) -> None:
        values = monitored_values(self.train_loop_obj, self.monitor,
                                  "ThresholdEarlyStopping needs it at every epoch end: register a callback "
                                  "that records it, e.g. ModelPerformanceEvaluation.")
        if values is None:
            return
        current = values[-1]
        # Written as "not reached" so that a NaN, which reaches nothing, misses the threshold.
        reached = current <= self.threshold if self.mode == "min" else current >= self.threshold
        missed = not reached
        self.patience_count = self.patience_count - 1 if missed else self.patience
        if self.patience_count < 0:
            self.train_loop_obj.stop_training(
                f"ThresholdEarlyStopping: {self.monitor}={current} has not reached {self.threshold} for "
                f"{self.patience + 1} epoch(s); stopped at epoch {self.train_loop_obj.epoch + 1}")

    def state_dict(self) -> Dict[str, Any]:
        """The count of epochs in a row that missed the threshold (checkpoints store it under ``callbacks``)."""
        return {"monitor": self.monitor, "mode": self.mode, "epochs_missed": self.patience - self.patience_count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, counted against this callback's ``patience``; a state of another
        metric or mode is not loaded (a warning says so)."""
        if not _watches_another_metric(self, state):
            self.patience_count = self.patience - int(state["epochs_missed"])


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
        _check_monitor(monitor, "loss")
        self.monitor = monitor

    def on_epoch_end(self) -> None:
        values = monitored_values(
            self.train_loop_obj, self.monitor,
            "TerminateOnNaN checks it at every epoch end: keep TrainLoop's end_auto_eval on to record 'loss' "
            "and 'val_loss', or monitor 'accumulated_loss', which the loop always records.")
        if values is None:
            return
        last_value = values[-1]
        if last_value is not None and not math.isfinite(float(last_value)):
            self.train_loop_obj.stop_training(
                f"TerminateOnNaN: {self.monitor} = {last_value} at epoch {self.train_loop_obj.epoch + 1}")


def all_equal_to(predictions: Any, value: float) -> bool:
    """True when every prediction equals ``value`` (tensors, numpy arrays and lists of numbers)."""
    if isinstance(predictions, torch.Tensor):
        return bool((predictions == value).all())
    if isinstance(predictions, np.ndarray):
        return bool(np.all(predictions == value))
    return all(element == value for element in predictions)


class AllPredictionsSame(AbstractCallback):
    """At every epoch end, check whether all validation-set predictions equal ``value``.

    Useful with very unbalanced classes, where a model may learn to predict only the majority class. Uses
    the TrainLoop's validation predictions (shared with other callbacks within an epoch).

    Args:
        value: the prediction to look for.
        stop_training: stop the training when all predictions equal ``value``.
        verbose: log a warning when they do.
    """

    def __init__(self, value: float = 0., stop_training: bool = False, verbose: bool = True):
        super().__init__("All predictions have the same value")
        self.value = value
        self.stop_training = stop_training
        self.verbose = verbose

    def on_epoch_end(self) -> None:
        predictions, _, _ = self.train_loop_obj.predict_on_validation_set()
        if not all_equal_to(predictions, self.value):
            return
        if self.verbose and self.train_loop_obj.is_main_process:
            logger.warning("All the validation predictions at epoch %d are %s", self.train_loop_obj.epoch + 1,
                           self.value)
        if self.stop_training:
            self.train_loop_obj.stop_training(f"AllPredictionsSame: all predictions are {self.value}")
