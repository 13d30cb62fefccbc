"""GLUE and XNLI benchmark metrics, computed with scikit-learn and SciPy.

aitoolbox 1.x called HuggingFace Transformers' ``glue_compute_metrics`` / ``xnli_compute_metrics``, which
Transformers has deprecated for removal; the same metrics are computed here under the same names, so
Transformers is not needed:

=================================================  ==============================================================
task                                               results
=================================================  ==============================================================
``cola``                                           ``mcc`` (Matthews correlation)
``sst-2``, ``qnli``, ``rte``, ``wnli``, ``hans``   ``acc``
``mrpc``, ``qqp``                                  ``acc``, ``f1`` (binary, class 1), ``acc_and_f1`` (their mean)
``sts-b``                                          ``pearson``, ``spearmanr``, ``corr`` (their mean)
``mnli``, ``mnli-mm``                              ``mnli_acc``, ``mnli-mm_acc``
=================================================  ==============================================================
"""
from typing import Any, Callable, Dict

import numpy as np

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.experiment.result_package.inputs import to_numpy


def _accuracy(labels: np.ndarray, preds: np.ndarray) -> Dict[str, float]:
    return {"acc": float((preds == labels).mean())}


def _matthews(labels: np.ndarray, preds: np.ndarray) -> Dict[str, float]:
    from sklearn.metrics import matthews_corrcoef
    return {"mcc": float(matthews_corrcoef(labels, preds))}


def _accuracy_and_f1(labels: np.ndarray, preds: np.ndarray) -> Dict[str, float]:
    from sklearn.metrics import f1_score
    acc = _accuracy(labels, preds)["acc"]
    f1 = float(f1_score(y_true=labels, y_pred=preds))
    return {"acc": acc, "f1": f1, "acc_and_f1": (acc + f1) / 2}


def _pearson_and_spearman(labels: np.ndarray, preds: np.ndarray) -> Dict[str, float]:
    from scipy.stats import pearsonr, spearmanr
    pearson, spearman = float(pearsonr(preds, labels)[0]), float(spearmanr(preds, labels)[0])
    return {"pearson": pearson, "spearmanr": spearman, "corr": (pearson + spearman) / 2}


def _prefixed_accuracy(prefix: str) -> Callable[[np.ndarray, np.ndarray], Dict[str, float]]:
    return lambda labels, preds: {f"{prefix}_acc": _accuracy(labels, preds)["acc"]}


GLUE_TASKS: Dict[str, Callable[[np.ndarray, np.ndarray], Dict[str, float]]] = {
    "cola": _matthews,
    "sst-2": _accuracy,
    "mrpc": _accuracy_and_f1,
    "sts-b": _pearson_and_spearman,
    "qqp": _accuracy_and_f1,
    "mnli": _prefixed_accuracy("mnli"),
    "mnli-mm": _prefixed_accuracy("mnli-mm"),
    "qnli": _accuracy,
    "rte": _accuracy,
    "wnli": _accuracy,
    "hans": _accuracy,
}
# The regression task: its predictions are scores, not class scores to arg-max.
_REGRESSION_TASKS = frozenset({"sts-b"})


def _predicted_values(y_predicted: np.ndarray, regression: bool) -> np.ndarray:
    """Labels from ``(N,)`` labels or ``(N, C)`` class scores (arg-maxed); scores of a regression task flattened."""
    if y_predicted.ndim == 2 and y_predicted.shape[1] > 1 and not regression:
        return y_predicted.argmax(axis=1)
    return y_predicted.reshape(len(y_predicted), -1)[:, 0] if y_predicted.ndim > 1 else y_predicted


def check_glue_task(task_name: str) -> None:
    """Raise ValueError unless ``task_name`` is one of :data:`GLUE_TASKS`."""
    if task_name not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task_name {task_name!r}; valid ones: {sorted(GLUE_TASKS)}")


def _check_aligned(y_true: np.ndarray, y_predicted: np.ndarray) -> None:
    if len(y_true) != len(y_predicted):
        raise ValueError(f"y_true has {len(y_true)} examples but y_predicted has {len(y_predicted)}")
    if len(y_true) == 0:
        raise ValueError("y_true and y_predicted are empty: there is nothing to score")


class GLUEMetric(AbstractBaseMetric):
    """The metrics of one GLUE task (``'GLUE_<task_name>'``): a dict such as ``{'acc': ..., 'f1': ...}``.

    Args:
        y_true: the gold labels (scores for ``sts-b``).
        y_predicted: the predicted labels, or ``(N, C)`` class scores which are arg-maxed (new: 1.x needed
            labels); scores for ``sts-b``.
        task_name: the GLUE task: ``cola``, ``sst-2``, ``mrpc``, ``sts-b``, ``qqp``, ``mnli``, ``mnli-mm``,
            ``qnli``, ``rte``, ``wnli`` or ``hans``.

    Raises:
        ValueError: an unknown task, or misaligned or empty inputs.
    """

    def __init__(self, y_true: Any, y_predicted: Any, task_name: str):
        check_glue_task(task_name)
        self.task_name = task_name
        # to_numpy: tensors (on any device) become arrays without numpy's deprecated __array__ path.
        super().__init__(to_numpy(y_true), to_numpy(y_predicted), metric_name=f"GLUE_{task_name}")

    def calculate_metric(self) -> Dict[str, float]:
        _check_aligned(self.y_true, self.y_predicted)
        regression = self.task_name in _REGRESSION_TASKS
        labels = self.y_true.reshape(-1) if self.y_true.ndim > 1 and self.y_true.shape[1] == 1 else self.y_true
        preds = _predicted_values(self.y_predicted, regression)
        return GLUE_TASKS[self.task_name](labels, preds)


class XNLIMetric(AbstractBaseMetric):
    """Accuracy on XNLI (``'xnli_accuracy'``): a dict ``{'acc': ...}``.

    Args:
        y_true: the gold labels.
        y_predicted: the predicted labels, or ``(N, C)`` class scores which are arg-maxed.

    Raises:
        ValueError: misaligned or empty inputs.
    """

    def __init__(self, y_true: Any, y_predicted: Any):
        super().__init__(to_numpy(y_true), to_numpy(y_predicted), metric_name="xnli_accuracy")

    def calculate_metric(self) -> Dict[str, float]:
        _check_aligned(self.y_true, self.y_predicted)
        labels = self.y_true.reshape(-1) if self.y_true.ndim > 1 and self.y_true.shape[1] == 1 else self.y_true
        return _accuracy(labels, _predicted_values(self.y_predicted, regression=False))
