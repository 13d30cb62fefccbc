"""One scikit-learn score wrapped as a metric: the shared body of the classification and regression metrics."""
from typing import Any, Tuple

from aitoolbox.experiment.core_metrics.abstract_metric import AbstractBaseMetric


class SklearnScoreMetric(AbstractBaseMetric):
    """A metric whose result is one ``sklearn.metrics`` function applied to ``(y_true, y_predicted)``.

    Subclasses name the reported metric in ``METRIC_NAME`` and the ``sklearn.metrics`` function in
    ``SKLEARN_SCORE``; scikit-learn is imported only when the metric is computed.

    Args:
        y_true: ground truth.
        y_predicted: predictions.
    """

    METRIC_NAME: str = ""
    SKLEARN_SCORE: str = ""

    def __init__(self, y_true: Any, y_predicted: Any):
        super().__init__(y_true, y_predicted, metric_name=self.METRIC_NAME)

    def score_inputs(self) -> Tuple[Any, Any]:
        """The two arguments handed to the scikit-learn function; subclasses may transform the predictions."""
        return self.y_true, self.y_predicted

    def calculate_metric(self) -> float:
        from sklearn import metrics

        return float(getattr(metrics, self.SKLEARN_SCORE)(*self.score_inputs()))
