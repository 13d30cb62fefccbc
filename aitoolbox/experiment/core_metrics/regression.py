"""Regression metrics over scikit-learn: mean squared and mean absolute error."""
from typing import Any

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric


class MeanSquaredErrorMetric(AbstractBaseMetric):
    """Mean squared error (``'Mean_squared_error'``).

    Args:
        y_true: ground truth values.
        y_predicted: predicted values, of the same shape.
    """

    def __init__(self, y_true: Any, y_predicted: Any):
        super().__init__(y_true, y_predicted, metric_name="Mean_squared_error")

    def calculate_metric(self) -> float:
        from sklearn.metrics import mean_squared_error

        return float(mean_squared_error(self.y_true, self.y_predicted))


class MeanAbsoluteErrorMetric(AbstractBaseMetric):
    """Mean absolute error (``'Mean_absolute_error'``).

    Args:
        y_true: ground truth values.
        y_predicted: predicted values, of the same shape.
    """

    def __init__(self, y_true: Any, y_predicted: Any):
        super().__init__(y_true, y_predicted, metric_name="Mean_absolute_error")

    def calculate_metric(self) -> float:
        from sklearn.metrics import mean_absolute_error

        return float(mean_absolute_error(self.y_true, self.y_predicted))
