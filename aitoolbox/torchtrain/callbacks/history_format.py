"""Callbacks that derive new training-history metrics from recorded ones (importable from :mod:`.performance_eval`).

:class:`TrainHistoryFormatter` applies any function to a metric's history and records the result under a
new name; :class:`MetricHistoryRename` copies a metric's newest value under another name.
"""
import logging
from typing import Any, Callable, List, Tuple, Union

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

logger = logging.getLogger(__name__)

MetricGetter = Callable[[Any], List[Any]]
MetricSetter = Callable[[List[Any]], Tuple[str, Any]]


class TrainHistoryFormatter(AbstractCallback):
    """Record ``output_metric_setter(input_metric_getter(train_history))`` in the training history.

    Runs either at every epoch end or once at the end of training. Before it records, it checks that the
    input metric is up to date: at an epoch end it must hold one value per epoch so far (``epoch + 1``), at the
    end of training exactly one (a ``train_end_*`` metric).

    Args:
        input_metric_getter: takes the training history, returns the whole history (a list) of the input metric.
        output_metric_setter: takes that list, returns ``(new_metric_name, value)`` to record.
        epoch_end: run at every epoch end.
        train_end: run at the end of training (exactly one of ``epoch_end`` and ``train_end`` must be True).
        strict_metric_extract: raise an error when the input metric is not up to date (otherwise log a
            warning and skip).

    Raises:
        ValueError: ``epoch_end`` and ``train_end`` are both True or both False; with
            ``strict_metric_extract``, an input metric that is not up to date.
        TypeError: a getter or setter that is not callable.
    """

    def __init__(self, input_metric_getter: MetricGetter, output_metric_setter: MetricSetter,
                 epoch_end: bool = True, train_end: bool = False, strict_metric_extract: bool = True):
        if epoch_end == train_end:
            raise ValueError(f"exactly one of epoch_end and train_end must be True, got epoch_end={epoch_end} and "
                             f"train_end={train_end}")
        for name, fn in (("input_metric_getter", input_metric_getter), ("output_metric_setter", output_metric_setter)):
            if not callable(fn):
                raise TypeError(f"{name} must be a function, got {fn!r}")
        super().__init__("Train history general formatter engine")
        self.input_metric_getter = input_metric_getter
        self.output_metric_setter = output_metric_setter
        self.epoch_end = epoch_end
        self.train_end = train_end
        self.strict_metric_extract = strict_metric_extract

    def on_epoch_end(self) -> None:
        if self.epoch_end and self.check_if_history_updated(train_end_phase=False):
            self.format_history()

    def on_train_end(self) -> None:
        if self.train_end and self.check_if_history_updated(train_end_phase=True):
            self.format_history()

    def format_history(self) -> None:
        """Compute the new metric from the current history and record it."""
        history = self.train_loop_obj.train_history
        new_name, value = self.output_metric_setter(self.input_metric_getter(history))
        self.train_loop_obj.insert_metric_result_into_history(new_name, value)

    def check_if_history_updated(self, train_end_phase: bool) -> bool:
        """True when the input metric holds the expected number of values (see the class description).

        Raises:
            ValueError: with ``strict_metric_extract``, when it does not.
        """
        expected = 1 if train_end_phase else self.train_loop_obj.epoch + 1
        found = len(self.input_metric_getter(self.train_loop_obj.train_history))
        if found == expected:
            return True
        message = (f"{type(self).__name__}: the input metric is not up to date: expected {expected} value(s) in its "
                   f"history, found {found}. Run the callback that records it before this one (lower "
                   "execution_order), or pass strict_metric_extract=False to skip such epochs")
        if self.strict_metric_extract:
            raise ValueError(message)
        logger.warning(message)
        return False


class MetricHistoryRename(TrainHistoryFormatter):
    """Record a metric's newest value under a new name (e.g. ``val_Accuracy`` -> ``accuracy``).

    Args:
        input_metric_path: the metric's name in the training history, or a function taking the history and
            returning the metric's whole history (a list).
        new_metric_name: the name to record the value under.
        epoch_end: run at every epoch end.
        train_end: run at the end of training (exactly one of the two must be True).
        strict_metric_extract: raise an error when the input metric is not up to date (otherwise warn and skip).

    Raises:
        ValueError: as :class:`TrainHistoryFormatter`, or an empty ``new_metric_name``.
    """

    def __init__(self, input_metric_path: Union[str, MetricGetter], new_metric_name: str,
                 epoch_end: bool = True, train_end: bool = False, strict_metric_extract: bool = True):
        if not isinstance(new_metric_name, str) or not new_metric_name:
            raise ValueError(f"new_metric_name must be a non-empty string, got {new_metric_name!r}")
        if callable(input_metric_path):
            getter = input_metric_path
        elif isinstance(input_metric_path, str) and input_metric_path:
            getter = _HistoryLookup(input_metric_path)
        else:
            raise TypeError(f"input_metric_path must be a metric name or a function taking the training history, "
                            f"got {input_metric_path!r}")
        super().__init__(getter, _NewestUnder(new_metric_name), epoch_end=epoch_end, train_end=train_end,
                         strict_metric_extract=strict_metric_extract)
        self.input_metric_path = input_metric_path
        self.new_metric_name = new_metric_name


class _HistoryLookup:
    """``history[metric_name]`` (empty when missing); a class rather than a lambda so the callback pickles."""

    def __init__(self, metric_name: str):
        self.metric_name = metric_name

    def __call__(self, history: Any) -> List[Any]:
        return history.get(self.metric_name, []) if hasattr(history, "get") else history[self.metric_name]


class _NewestUnder:
    """``(new_name, values[-1])``; picklable, for distributed training."""

    def __init__(self, new_name: str):
        self.new_name = new_name

    def __call__(self, values: List[Any]) -> Tuple[str, Any]:
        return self.new_name, values[-1]
