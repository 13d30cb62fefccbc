"""The base class of all metrics: compute once on construction, then read, compare and combine the result."""
import numbers
from abc import ABC, abstractmethod
from typing import Any, Dict, Tuple, Union

import numpy as np

from aitoolbox.experiment.result_package.inputs import to_numpy


def _is_scalar(value: Any) -> bool:
    """True for int / float results (Python or NumPy), which are the only ones that can be ordered.

    ``bool`` is excluded: a True/False result is a flag, not a score to rank.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


class AbstractBaseMetric(ABC):
    """A named metric whose value is computed as soon as the object is built.

    Subclasses implement :meth:`calculate_metric`, reading ``self.y_true`` and ``self.y_predicted`` and
    returning the result (a number, or a dict / list for multi-part metrics). The result is stored in
    ``self.metric_result``.

    Scalar metrics compare with each other and with plain numbers (``metric_a < metric_b``, ``metric >= 0.5``);
    ``metric_name in metric`` and ``metric[key]`` reach the result (or one entry of a dict result); and
    ``metric_a + metric_b`` merges the two into one ``{name: result}`` dict.

    Args:
        y_true: ground truth targets.
        y_predicted: predicted targets.
        metric_name: name under which the result is reported.
        np_array: convert both targets to ``numpy.ndarray`` before computing; pass False for inputs
            that must stay as they are (e.g. lists of token strings).
    """

    def __init__(self, y_true: Any, y_predicted: Any, metric_name: str, np_array: bool = True):
        # Tensors through to_numpy: numpy 2 deprecates np.array(tensor) (its __array__ lacks the copy keyword).
        self.y_true = np.array(to_numpy(y_true)) if np_array else y_true
        self.y_predicted = np.array(to_numpy(y_predicted)) if np_array else y_predicted
        self.metric_name = metric_name
        # Set before computing so that calculate_metric may read (or build on) the attribute.
        self.metric_result: Any = None
        self.metric_result = self.calculate_metric()

    @abstractmethod
    def calculate_metric(self) -> Any:
        """Compute the metric from ``self.y_true`` and ``self.y_predicted``.

        Returns:
            The metric result (usually a float, or a dict of named sub-results).
        """

    def get_metric(self) -> Any:
        """Return the computed result."""
        return self.metric_result

    def get_metric_dict(self) -> Dict[str, Any]:
        """Return ``{metric_name: result}``."""
        return {self.metric_name: self.metric_result}

    def __str__(self) -> str:
        return f"{self.metric_name}: {self.metric_result}"

    def __len__(self) -> int:
        result = self.metric_result
        if result is None:
            return 0
        if isinstance(result, (list, dict)):
            return len(result)
        if _is_scalar(result):
            return 1
        raise TypeError(f"len() of metric '{self.metric_name}' needs a list, dict, int or float result, "
                        f"got {type(result).__name__}")

    def _comparable_values(self, other: Union["AbstractBaseMetric", float, int]) -> Tuple[Any, Any]:
        """The two numbers to compare: this metric's result and ``other`` (a metric's result or a number)."""
        other_value = other.metric_result if isinstance(other, AbstractBaseMetric) else other
        if _is_scalar(self.metric_result) and _is_scalar(other_value):
            return self.metric_result, other_value
        raise ValueError(f"Metrics can only be compared when both results are int or float; got "
                         f"{type(self.metric_result).__name__} for '{self.metric_name}' and "
                         f"{type(other_value).__name__} for the other side")

    def __lt__(self, other: Union["AbstractBaseMetric", float, int]) -> bool:
        mine, theirs = self._comparable_values(other)
        return mine < theirs

    def __le__(self, other: Union["AbstractBaseMetric", float, int]) -> bool:
        mine, theirs = self._comparable_values(other)
        return mine <= theirs

    def __gt__(self, other: Union["AbstractBaseMetric", float, int]) -> bool:
        mine, theirs = self._comparable_values(other)
        return mine > theirs

    def __ge__(self, other: Union["AbstractBaseMetric", float, int]) -> bool:
        mine, theirs = self._comparable_values(other)
        return mine >= theirs

    def __contains__(self, item: Any) -> bool:
        if item == self.metric_name:
            return True
        return isinstance(self.metric_result, dict) and item in self.metric_result

    def __getitem__(self, item: Any) -> Any:
        if item == self.metric_name:
            return self.metric_result
        if isinstance(self.metric_result, dict) and item in self.metric_result:
            return self.metric_result[item]
        raise KeyError(f"'{item}' is neither the metric name '{self.metric_name}' nor a key of its result")

    def __add__(self, other: Union["AbstractBaseMetric", Dict[str, Any]]) -> Dict[str, Any]:
        return self.concat_metric(other)

    def __radd__(self, other: Union["AbstractBaseMetric", Dict[str, Any]]) -> Dict[str, Any]:
        return self.concat_metric(other)

    def concat_metric(self, other: Union["AbstractBaseMetric", Dict[str, Any]]) -> Dict[str, Any]:
        """Merge this metric with another metric or a ``{name: result}`` dict.

        Args:
            other: a metric, or a dict of already computed results.

        Returns:
            A new dict with this metric's entry and then ``other``'s (``other`` wins on equal names).

        Raises:
            TypeError: ``other`` is neither a metric nor a dict.
        """
        if isinstance(other, AbstractBaseMetric):
            other_dict = other.get_metric_dict()
        elif isinstance(other, dict):
            other_dict = other
        else:
            raise TypeError(f"A metric can only be combined with another metric or a dict, "
                            f"got {type(other).__name__}")
        return {**self.get_metric_dict(), **other_dict}
