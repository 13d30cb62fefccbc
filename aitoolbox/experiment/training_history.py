"""The training history: for every tracked metric, the list of its values in the order they were recorded.

The TrainLoop appends ``loss``, ``accumulated_loss`` and ``val_loss`` once per epoch, callbacks add their own
metrics (``val_Accuracy``...). :class:`TrainingHistory` reads like a dict (``history['val_loss']``,
``'val_loss' in history``, ``history.get(name, [])``, ``items()``...) and adds aitoolbox's helpers for
inserting, exporting and checking the results.
"""
import copy
import logging
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List

logger = logging.getLogger(__name__)

# Metrics every training run records; their (empty) lists exist from the start.
TRAIN_METRICS = ("loss", "accumulated_loss")
VALIDATION_METRICS = ("val_loss",)


class TrainingHistory(Mapping):
    """A mapping from metric name to the list of that metric's values.

    The lists of ``'loss'`` and ``'accumulated_loss'`` (and ``'val_loss'`` with ``has_validation``) exist from
    the start, empty until the first value arrives: test ``history.get(name)`` for truthiness, not
    ``name in history``, to learn whether a metric has a value yet.

    Assigning ``history[name] = value`` *appends* ``value`` to the metric's list (as in aitoolbox 1.x); use
    :meth:`update` to replace whole lists. ``history + {'metric': value}`` appends to a copy and ``+=`` in place.

    Args:
        has_validation: start with an empty ``'val_loss'`` list too (when a validation set is evaluated).
        strict_content_check: raise ``ValueError`` on a problem found by the quality checks instead of
            logging a warning.

    Attributes:
        train_history: the underlying ``{metric name: [values]}`` dict.
        empty_train_history: what ``train_history`` holds before any value is recorded.
    """

    def __init__(self, has_validation: bool = True, strict_content_check: bool = False):
        self.has_validation = has_validation
        self.strict_content_check = strict_content_check
        self.empty_train_history: Dict[str, List[Any]] = self._empty_history()
        self.train_history: Dict[str, List[Any]] = self._empty_history()

    def _empty_history(self) -> Dict[str, List[Any]]:
        names = TRAIN_METRICS + (VALIDATION_METRICS if self.has_validation else ())
        return {name: [] for name in names}

    def insert_single_result_into_history(self, metric_name: str, metric_result: Any) -> None:
        """Append one value to the list of ``metric_name``, starting the list if the metric is new.

        Args:
            metric_name: the metric, e.g. ``'val_Accuracy'``.
            metric_result: its newest value (a number, or a dict of numbers for grouped metrics).
        """
        self.train_history.setdefault(metric_name, []).append(metric_result)

    def get_train_history(self) -> Dict[str, List[Any]]:
        """Return the underlying dict itself (not a copy): changes to it change the history."""
        return self.train_history

    def get_train_history_dict(self, flatten_dict: bool = False) -> Dict[str, List[Any]]:
        """Return the history as a plain ``dict``, e.g. to save it with ``json`` or ``torch.save``.

        The dict and its lists are copies, so later training does not change what was returned.

        Args:
            flatten_dict: turn metrics whose values are dicts (``{'f1': {'a': 1, 'b': 2}}`` per epoch) into
                one list per leaf, named by joining the keys with ``'_'`` (``'f1_a'``, ``'f1_b'``).

        Returns:
            ``{metric name: [values]}``.
        """
        if self.train_history == self.empty_train_history:
            self.warn_about_result_data_problem("The training history is empty: no metric has a value yet")
        if flatten_dict:
            # Imported here: dict_util is only needed for this export.
            from aitoolbox.utils import dict_util
            return dict_util.flatten_combine_dict(self.train_history)
        return {name: list(values) if isinstance(values, list) else copy.copy(values)
                for name, values in self.train_history.items()}

    def wrap_pre_prepared_history(self, history: Dict[str, List[Any]]) -> "TrainingHistory":
        """Make an existing ``{metric name: [values]}`` dict the content of this history.

        The dict is used as it is (not copied), e.g. ``TrainingHistory().wrap_pre_prepared_history(
        {'loss': [0.9, 0.7], 'val_acc': [0.5, 0.6]})``.

        Args:
            history: the dict to wrap.

        Returns:
            This history, so the call can follow the constructor.

        Raises:
            TypeError: ``history`` is not a dict.
        """
        if not isinstance(history, dict):
            raise TypeError(f"history must be a dict of metric name -> list of values, got {type(history).__name__}")
        self.train_history = history
        return self

    def qa_check_history_records(self) -> None:
        """Check that all metrics hold the same number of values; warn (or raise when strict) if not.

        Unequal lengths are expected when metrics are recorded at different times (e.g. only at the end of
        training), so this check is for histories that should be aligned, such as a wrapped Keras history.

        Raises:
            ValueError: with ``strict_content_check``, when the lengths differ.
        """
        lengths = {name: len(values) for name, values in self.train_history.items()}
        if len(set(lengths.values())) > 1:
            self.warn_about_result_data_problem(
                f"The training history's metrics hold different numbers of values: {lengths}")

    def warn_about_result_data_problem(self, msg: str) -> None:
        """Log ``msg`` as a warning, or raise it as a ``ValueError`` with ``strict_content_check``."""
        if self.strict_content_check:
            raise ValueError(msg)
        logger.warning(msg)

    # --- the dict-like interface --------------------------------------------------------------------------------
    def __getitem__(self, metric_name: str) -> List[Any]:
        return self.train_history[metric_name]

    def __setitem__(self, metric_name: str, metric_result: Any) -> None:
        # aitoolbox 1.x semantics: assignment records a new value, it does not replace the list.
        self.insert_single_result_into_history(metric_name, metric_result)

    def __delitem__(self, metric_name: str) -> None:
        del self.train_history[metric_name]

    def __contains__(self, metric_name: object) -> bool:
        return metric_name in self.train_history

    def __iter__(self) -> Iterator[str]:
        return iter(self.train_history)

    def __len__(self) -> int:
        return len(self.train_history)

    def keys(self):
        """The metric names (a view of the underlying dict's keys)."""
        return self.train_history.keys()

    def items(self):
        """``(metric name, values)`` pairs (a view of the underlying dict's items)."""
        return self.train_history.items()

    def values(self):
        """The lists of values (a view of the underlying dict's values)."""
        return self.train_history.values()

    def update(self, other: Any = (), **kwargs: List[Any]) -> None:
        """Replace (or add) whole metric lists, as ``dict.update`` does; used e.g. to restore a checkpoint.

        Args:
            other: a mapping or an iterable of ``(metric name, values)`` pairs.
            **kwargs: more ``metric name=values`` pairs.
        """
        self.train_history.update(other, **kwargs)

    def clear(self) -> None:
        """Remove every metric, the pre-created empty ones included."""
        self.train_history.clear()

    def __str__(self) -> str:
        return str(self.train_history)

    def __repr__(self) -> str:
        return f"TrainingHistory({self.train_history!r})"

    # --- appending with + ---------------------------------------------------------------------------------------
    def __add__(self, other: Dict[str, Any]) -> "TrainingHistory":
        """Return a copy with one value per ``other`` entry appended (``history + {'val_f1': 0.7}``)."""
        combined = copy.deepcopy(self)
        combined.add_history_dict(other)
        return combined

    def __radd__(self, other: Dict[str, Any]) -> "TrainingHistory":
        return self.__add__(other)

    def __iadd__(self, other: Dict[str, Any]) -> "TrainingHistory":
        self.add_history_dict(other)
        return self

    def add_history_dict(self, other: Dict[str, Any]) -> None:
        """Append every value of ``{metric name: value}`` to its metric's list.

        Raises:
            TypeError: ``other`` is not a dict.
        """
        if not isinstance(other, dict):
            raise TypeError(f"only a dict of metric name -> value can be added to a TrainingHistory, "
                            f"got {type(other).__name__}")
        for metric_name, metric_result in other.items():
            self.insert_single_result_into_history(metric_name, metric_result)
