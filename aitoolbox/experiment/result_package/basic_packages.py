"""Ready-made result packages for classification, binary classification and regression, plus one for any metrics.

All metrics come from :mod:`sklearn.metrics` and have aitoolbox 1.x's names and definitions; every result is
a plain Python ``float`` so the results can be written to JSON and put into the training history as they are.
The constructors take aitoolbox 1.x's arguments (``strict_content_check`` first, extra keywords kept as
``package_metadata``) plus a keyword-only ``pkg_name``.
"""
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from sklearn import metrics

from aitoolbox.experiment.core_metrics.classification import labels_above, labels_at_or_above
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage


def _flatten_column(array: np.ndarray, what: str) -> np.ndarray:
    """Turn an ``(N, 1)`` array into ``(N,)``; leave ``(N,)`` alone."""
    if array.ndim == 2 and array.shape[1] == 1:
        return array.reshape(-1)
    if array.ndim > 1:
        raise ValueError(f"{what} must have shape (N,) or (N, 1), got shape {array.shape}")
    return array


#: ``average`` values of :class:`ClassificationResultPackage` (scikit-learn's, plus ``'auto'``).
CLASSIFICATION_AVERAGES = ("auto", "macro", "micro", "weighted", "binary")


class ClassificationResultPackage(AbstractResultPackage):
    """Multi-class (or binary) classification from predicted labels: Accuracy, F1_score, Precision and Recall.

    ``y_predicted`` may hold class labels of shape ``(N,)``, or scores of shape ``(N, C)`` (logits or
    probabilities, one column per class), in which case the predicted label is the argmax over the classes
    (dimension 1). ``y_true`` holds class labels, ``(N,)`` or ``(N, 1)``, or one-hot rows ``(N, C)``.

    F1_score, Precision and Recall have aitoolbox 1.8's metric names. With ``average='auto'`` they are those of
    the positive class (label 1) for a binary problem, as :class:`BinaryClassificationResultPackage` reports
    them, and the unweighted mean over the classes (``'macro'``) otherwise. A problem counts as binary when the
    scores or the one-hot targets have two columns or, for labels, when every label is 0 or 1. The package decides
    this once, at its first evaluation, and keeps the decision for every later one (also for its copies made after
    it), so a metric means the same thing at every epoch: a binary package counts a later label other than 0 or 1
    as a negative (a wrong prediction of class 0), it never switches to macro averaging because one epoch predicted
    a class the set does not hold. Pass ``average='macro'`` (or give scores with a column per class) where a set of
    a multi-class problem may hold only the labels 0 and 1. A class that is never predicted (or never present) has
    a precision (recall) of 0, without a warning.

    Args:
        strict_content_check: raise ``ValueError`` on a non-finite metric instead of logging a warning.
        average: ``'auto'`` (above), or scikit-learn's ``'macro'``, ``'micro'``, ``'weighted'`` or ``'binary'``
            (keyword only). Pass ``'macro'`` to average over the classes whatever labels a set holds.
        pkg_name: the package's name (names its results when packages are combined).
        **kwargs: additional metadata of the package.

    Raises:
        ValueError: an unknown ``average``.
    """

    aligned_inputs = True

    def __init__(self, strict_content_check: bool = False, *, average: str = "auto",
                 pkg_name: str = "ClassificationResult", **kwargs):
        if not isinstance(average, str) or average not in CLASSIFICATION_AVERAGES:
            raise ValueError(f"average must be one of {CLASSIFICATION_AVERAGES}, got {average!r}")
        super().__init__(pkg_name, strict_content_check=strict_content_check, np_array=True, **kwargs)
        self.average = average
        # average='auto' resolved at the first evaluation and kept (see the class docstring).
        self.resolved_average: Optional[str] = None

    def predicted_labels(self) -> np.ndarray:
        """The predicted class labels: ``y_predicted``, or its argmax over dimension 1 when it holds scores."""
        y_predicted = self.y_predicted
        if y_predicted.ndim == 2 and y_predicted.shape[1] > 1:
            return y_predicted.argmax(axis=1)
        return _flatten_column(y_predicted, "y_predicted (labels) or (N, C) class scores")

    def _resolved_average(self, y_true: np.ndarray, labels: np.ndarray) -> str:
        if self.average != "auto":
            return self.average
        if self.resolved_average is None:
            # The number of classes, where a score or one-hot column per class gives it; else the labels seen.
            columns = {array.shape[1] for array in (self.y_predicted, self.y_true)
                       if array.ndim == 2 and array.shape[1] > 1}
            if columns:
                self.resolved_average = "binary" if columns == {2} else "macro"
            else:
                seen = set(np.unique(np.concatenate([y_true, labels])).tolist())
                self.resolved_average = "binary" if seen <= {0, 1} else "macro"
        return self.resolved_average

    def prepare_results_dict(self) -> Dict[str, float]:
        y_true = self.y_true
        if y_true.ndim == 2 and y_true.shape[1] > 1:  # one-hot targets
            y_true = y_true.argmax(axis=1)
        y_true = _flatten_column(y_true, "y_true")
        labels = self.predicted_labels()
        average = self._resolved_average(y_true, labels)
        options = {"average": average, "zero_division": 0}
        if average == "binary" and self.average == "auto":
            # Class 1's scores over every label, equal to scikit-learn's binary ones while the labels are 0 and 1,
            # where 'binary' would refuse a later evaluation that holds another label.
            options = {"average": "micro", "labels": [1], "zero_division": 0}
        # One call for the three (f1_score, precision_score and recall_score each make this same call and keep one
        # of its results: the same values, a third of the time).
        precision, recall, f1, _ = metrics.precision_recall_fscore_support(y_true, labels, **options)
        return {"Accuracy": float(metrics.accuracy_score(y_true, labels)), "F1_score": float(f1),
                "Precision": float(precision), "Recall": float(recall)}


class BinaryClassificationResultPackage(AbstractResultPackage):
    """Binary classification from positive-class scores: Accuracy, ROC_AUC, PrecisionRecall_AUC and F1_score.

    ``y_predicted`` holds the score (usually the probability) of the positive class, shape ``(N,)`` or
    ``(N, 1)``; with shape ``(N, 2)`` (a score per class) column 1 is the positive class. ROC_AUC and
    PrecisionRecall_AUC (the area under the precision-recall curve, trapezoidal as in aitoolbox 1.x) use the
    scores. Accuracy and F1_score turn the scores into labels with each metric's own aitoolbox 1.x rule, as 1.x's
    package (which called the metric classes) did, so each equals its metric class
    (:class:`~aitoolbox.experiment.core_metrics.classification.AccuracyMetric`,
    :class:`~aitoolbox.experiment.core_metrics.classification.F1ScoreMetric`): Accuracy counts
    ``score >= positive_class_thresh`` as positive, F1_score ``score > positive_class_thresh``, so a score equal
    to the threshold is a positive for Accuracy and a negative for F1_score. ``y_true`` holds 0/1 labels.

    One deliberate difference from aitoolbox 1.x: the threshold applies to any scores, also those outside
    ``[0, 1]`` (logits, with ``positive_class_thresh=0.0``), where 1.x's AccuracyMetric left them
    unthresholded and scikit-learn then refused the mix of labels and scores.

    Args:
        positive_class_thresh: the score that separates predicted positives from negatives (0.5 for
            probabilities, 0.0 for logits; see above for a score equal to it). None when ``y_predicted`` already
            holds 0/1 labels.
        strict_content_check: raise ``ValueError`` on a non-finite metric (e.g. ROC_AUC when ``y_true``
            holds a single class) instead of logging a warning.
        pkg_name: the package's name.
        **kwargs: additional metadata of the package.
    """

    aligned_inputs = True

    def __init__(self, positive_class_thresh: Optional[float] = 0.5, strict_content_check: bool = False, *,
                 pkg_name: str = "BinaryClassificationResult", **kwargs):
        if positive_class_thresh is not None and (isinstance(positive_class_thresh, bool)
                                                  or not isinstance(positive_class_thresh, numbers.Real)):
            raise TypeError("positive_class_thresh must be a number (e.g. 0.5 for probabilities) or None for "
                            f"predictions that are already labels, got {positive_class_thresh!r}")
        super().__init__(pkg_name, strict_content_check=strict_content_check, np_array=True, **kwargs)
        self.positive_class_thresh = positive_class_thresh

    def positive_scores(self) -> np.ndarray:
        """The positive-class score of every sample, shape ``(N,)``."""
        y_predicted = self.y_predicted
        if y_predicted.ndim == 2 and y_predicted.shape[1] == 2:
            return y_predicted[:, 1]
        return _flatten_column(y_predicted, "y_predicted (positive-class scores) or (N, 2) class scores")

    @staticmethod
    def _roc_auc(y_true: np.ndarray, scores: np.ndarray) -> float:
        # Undefined with a single class in y_true: NaN (older scikit-learn raised, newer ones warn).
        if np.unique(y_true).size < 2:
            return float("nan")
        return float(metrics.roc_auc_score(y_true, scores))

    @staticmethod
    def _pr_auc(y_true: np.ndarray, scores: np.ndarray) -> float:
        # Without positive samples the recall is undefined (0 / 0), and so is the curve.
        if not np.any(y_true == 1):
            return float("nan")
        precision, recall, _ = metrics.precision_recall_curve(y_true, scores)
        return float(metrics.auc(recall, precision))

    def prepare_results_dict(self) -> Dict[str, float]:
        y_true = _flatten_column(self.y_true, "y_true")
        scores = self.positive_scores()
        thresh = self.positive_class_thresh
        return {
            "Accuracy": float(metrics.accuracy_score(
                y_true, scores if thresh is None else labels_at_or_above(scores, thresh))),
            "ROC_AUC": self._roc_auc(y_true, scores),
            "PrecisionRecall_AUC": self._pr_auc(y_true, scores),
            "F1_score": float(metrics.f1_score(y_true, scores if thresh is None else labels_above(scores, thresh))),
        }


class RegressionResultPackage(AbstractResultPackage):
    """Regression: ``{'Mean_squared_error': ..., 'Mean_absolute_error': ...}``.

    With several outputs per sample (shape ``(N, K)``) the errors are averaged over the outputs.

    Args:
        strict_content_check: raise ``ValueError`` on a non-finite metric instead of logging a warning.
        pkg_name: the package's name.
        **kwargs: additional metadata of the package.
    """

    aligned_inputs = True

    def __init__(self, strict_content_check: bool = False, *, pkg_name: str = "RegressionResult", **kwargs):
        super().__init__(pkg_name, strict_content_check=strict_content_check, np_array=True, **kwargs)

    def prepare_results_dict(self) -> Dict[str, float]:
        y_true, y_predicted = self.y_true, self.y_predicted
        if y_true.shape != y_predicted.shape and y_true.size == y_predicted.size:
            # (N,) targets against (N, 1) outputs is the usual single-output case: compare them as (N,).
            y_true, y_predicted = y_true.reshape(-1), y_predicted.reshape(-1)
        return {
            "Mean_squared_error": float(metrics.mean_squared_error(y_true, y_predicted)),
            "Mean_absolute_error": float(metrics.mean_absolute_error(y_true, y_predicted)),
        }


MetricSpec = Union[Callable[[Any, Any], Any], Tuple[str, Callable[[Any, Any], Any]]]


class GeneralResultPackage(AbstractResultPackage):
    """Any metrics, each called as ``metric(y_true, y_predicted)``.

    A metric may return a number (recorded under the metric's name), a dict of named numbers, or an
    aitoolbox metric object (anything with ``get_metric_dict()``, such as aitoolbox 1.x's metric classes,
    which are given as the class itself). Example::

        from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef
        GeneralResultPackage([balanced_accuracy_score, ('MCC', matthews_corrcoef)])

    Args:
        metrics_list: the metrics, each a function or class (named by its ``__name__``) or a
            ``(name, function)`` pair; the names must be unique. Name a lambda with a pair when it returns
            a number.
        strict_content_check: raise ``ValueError`` on a non-finite metric instead of logging a warning.
        pkg_name: the package's name.
        np_array: hand the metrics numpy arrays (True), the predictions as given (False) or ``'auto'``.
        **kwargs: additional metadata of the package.
    """

    aligned_inputs = True

    def __init__(self, metrics_list: Sequence[MetricSpec], strict_content_check: bool = False, *,
                 pkg_name: str = "GeneralResultPackage", np_array: Union[bool, str] = True, **kwargs):
        super().__init__(pkg_name, strict_content_check=strict_content_check, np_array=np_array, **kwargs)
        self.metrics_list = metrics_list
        self.metrics: List[Tuple[Optional[str], Callable]] = self._named_metrics(metrics_list)

    @staticmethod
    def _named_metrics(metrics_list: Sequence[MetricSpec]) -> List[Tuple[Optional[str], Callable]]:
        if isinstance(metrics_list, (str, bytes)) or not isinstance(metrics_list, Sequence) or not metrics_list:
            raise ValueError("metrics_list must be a non-empty list of metric functions or (name, function) "
                             f"pairs, got {metrics_list!r}")
        named: List[Tuple[Optional[str], Callable]] = []
        for position, spec in enumerate(metrics_list):
            if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and callable(spec[1]):
                named.append(spec)
            elif callable(spec):
                name = getattr(spec, "__name__", None)
                # A lambda or partial may return a metric object, which names itself: checked on use.
                named.append((None if not name or name == "<lambda>" else name, spec))
            else:
                raise TypeError(f"metrics_list[{position}] must be a function metric(y_true, y_predicted) or a "
                                f"(name, function) pair, got {spec!r}")
        names = [name for name, _ in named if name is not None]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"metric names must be unique, {duplicates} appear more than once in metrics_list; "
                             "name them with (name, function) pairs")
        return named

    def qa_check_metrics_list(self) -> None:
        """Warn (raise when strict) when the list of metrics is empty."""
        if not self.metrics:
            self.warn_about_result_data_problem(f"{self.pkg_name}: the metrics list is empty")

    def prepare_results_dict(self) -> Dict[str, Any]:
        results: Dict[str, Any] = {}
        for position, (name, metric) in enumerate(self.metrics):
            for result_name, value in self._metric_results(position, name, metric(self.y_true, self.y_predicted)):
                if result_name in results:
                    raise ValueError(f"two metrics of {self.pkg_name!r} are both named {result_name!r}; name them "
                                     "apart with (name, function) pairs")
                results[result_name] = value
        return results

    @staticmethod
    def _metric_results(position: int, name: Optional[str], value: Any) -> List[Tuple[str, Any]]:
        if hasattr(value, "get_metric_dict"):  # an aitoolbox metric object
            value = value.get_metric_dict()
        if isinstance(value, Mapping):
            return [(str(key), _plain_number(item)) for key, item in value.items()]
        label = name or f"metrics_list[{position}]"
        try:
            number = float(value)
        except (TypeError, ValueError) as error:
            raise TypeError(f"metric {label!r} must return a single number, a dict of numbers or a metric object, "
                            f"got {value!r}") from error
        if name is None:
            raise ValueError(f"{label} returned a number but has no usable name; pass it as a (name, function) "
                             "pair, e.g. ('MyMetric', fn)")
        return [(name, number)]


def _plain_number(value: Any) -> Any:
    """A numpy or 0-d tensor number as a Python number (JSON-friendly); anything else unchanged."""
    if isinstance(value, np.generic) or (hasattr(value, "ndim") and getattr(value, "ndim") == 0
                                         and hasattr(value, "item")):
        return value.item()
    return value
