"""Regression metrics over scikit-learn: mean squared and mean absolute error."""
from aitoolbox.experiment.core_metrics.sklearn_score import SklearnScoreMetric


class MeanSquaredErrorMetric(SklearnScoreMetric):
    """Mean squared error (``'Mean_squared_error'``).

    Args:
        y_true: ground truth values.
        y_predicted: predicted values, of the same shape.
    """

    METRIC_NAME = "Mean_squared_error"
    SKLEARN_SCORE = "mean_squared_error"


class MeanAbsoluteErrorMetric(SklearnScoreMetric):
    """Mean absolute error (``'Mean_absolute_error'``).

    Args:
        y_true: ground truth values.
        y_predicted: predicted values, of the same shape.
    """

    METRIC_NAME = "Mean_absolute_error"
    SKLEARN_SCORE = "mean_absolute_error"
