"""Classification metrics over scikit-learn: accuracy, ROC-AUC, PR-AUC, F1, precision and recall."""
import logging
from typing import Any, Optional, Tuple

import numpy as np

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric
from aitoolbox.experiment.core_metrics.sklearn_score import SklearnScoreMetric

logger = logging.getLogger(__name__)


# aitoolbox 1.x turned probabilities into labels with two rules, kept here as they were: accuracy counts a
# score equal to the threshold as positive, F1, precision and recall do not. Everything that thresholds for
# these metrics (the metric classes and BinaryClassificationResultPackage) goes through these two functions,
# so a package's metric always equals the metric class of the same name.
def labels_at_or_above(scores: np.ndarray, positive_class_thresh: float) -> np.ndarray:
    """0/1 labels, 1 where ``score >= positive_class_thresh``: :class:`AccuracyMetric`'s rule."""
    return (np.asarray(scores) >= positive_class_thresh).astype(int)


def labels_above(scores: np.ndarray, positive_class_thresh: float) -> np.ndarray:
    """0/1 labels, 1 where ``score > positive_class_thresh``: the rule of :class:`F1ScoreMetric`,
    :class:`PrecisionMetric` and :class:`RecallMetric`."""
    return (np.asarray(scores) > positive_class_thresh).astype(int)


class AccuracyMetric(AbstractBaseMetric):
    """Share of correct predictions (``'Accuracy'``).

    Predictions are turned into labels first: a 2-D array with several columns (scores or probabilities
    per class) is arg-maxed, and otherwise, when ``positive_class_thresh`` is set and every prediction lies in
    ``[0, 1]``, predictions at or above the threshold become the positive class. One-hot targets are
    arg-maxed too.

    Args:
        y_true: ground truth labels (or one-hot rows).
        y_predicted: predicted labels, positive-class probabilities or per-class scores.
        positive_class_thresh: the probability from which a binary prediction counts as positive; None for
            predictions that already are labels (e.g. multi-class labels).
    """

    def __init__(self, y_true: Any, y_predicted: Any, positive_class_thresh: Optional[float] = 0.5):
        self.positive_class_thresh = positive_class_thresh
        super().__init__(y_true, y_predicted, metric_name="Accuracy")

    def calculate_metric(self) -> float:
        from sklearn.metrics import accuracy_score

        if self.y_predicted.ndim > 1 and self.y_predicted.shape[1] > 1:
            self.y_predicted = np.argmax(self.y_predicted, axis=1)
        elif self.positive_class_thresh is not None:
            if self.y_predicted.size and (self.y_predicted.min() < 0. or self.y_predicted.max() > 1.):
                logger.warning("AccuracyMetric: predictions outside [0, 1] are not probabilities, so "
                               "positive_class_thresh=%s is not applied; pass positive_class_thresh=None "
                               "for predicted labels", self.positive_class_thresh)
            else:
                self.y_predicted = labels_at_or_above(self.y_predicted, self.positive_class_thresh)

        if self.y_true.ndim > 1 and self.y_true.shape[1] > 1:
            self.y_true = np.argmax(self.y_true, axis=1)
        return float(accuracy_score(self.y_true, self.y_predicted))


class ROCAUCMetric(SklearnScoreMetric):
    """Area under the ROC curve (``'ROC_AUC'``) of predicted positive-class scores.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted scores or probabilities of the positive class.
    """

    METRIC_NAME = "ROC_AUC"
    SKLEARN_SCORE = "roc_auc_score"


class PrecisionRecallCurveAUCMetric(AbstractBaseMetric):
    """Area under the precision-recall curve (``'PrecisionRecall_AUC'``), by the trapezoidal rule.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted scores or probabilities of the positive class.
    """

    def __init__(self, y_true: Any, y_predicted: Any):
        super().__init__(y_true, y_predicted, metric_name="PrecisionRecall_AUC")

    def calculate_metric(self) -> float:
        from sklearn.metrics import auc, precision_recall_curve

        precision, recall, _ = precision_recall_curve(self.y_true, self.y_predicted)
        return float(auc(recall, precision))


class _ThresholdedBinaryMetric(SklearnScoreMetric):
    """A binary scikit-learn score of positive-class probabilities turned into 0/1 labels.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted probabilities of the positive class.
        positive_class_thresh: predictions strictly above it are positive.
    """

    def __init__(self, y_true: Any, y_predicted: Any, positive_class_thresh: float = 0.5):
        # Set before the base class computes the metric, which reads it.
        self.positive_class_thresh = positive_class_thresh
        super().__init__(y_true, y_predicted)

    def score_inputs(self) -> Tuple[Any, np.ndarray]:
        return self.y_true, labels_above(self.y_predicted, self.positive_class_thresh)


class F1ScoreMetric(_ThresholdedBinaryMetric):
    """Binary F1 score (``'F1_score'``) of thresholded positive-class probabilities.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted probabilities of the positive class.
        positive_class_thresh: predictions strictly above it are positive.
    """

    METRIC_NAME = "F1_score"
    SKLEARN_SCORE = "f1_score"


class PrecisionMetric(_ThresholdedBinaryMetric):
    """Binary precision (``'Precision'``) of thresholded positive-class probabilities.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted probabilities of the positive class.
        positive_class_thresh: predictions strictly above it are positive.
    """

    METRIC_NAME = "Precision"
    SKLEARN_SCORE = "precision_score"


class RecallMetric(_ThresholdedBinaryMetric):
    """Binary recall (``'Recall'``) of thresholded positive-class probabilities.

    Args:
        y_true: ground truth binary labels.
        y_predicted: predicted probabilities of the positive class.
        positive_class_thresh: predictions strictly above it are positive.
    """

    METRIC_NAME = "Recall"
    SKLEARN_SCORE = "recall_score"
