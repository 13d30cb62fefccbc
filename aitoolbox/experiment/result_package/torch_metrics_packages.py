"""A result package around a TorchMetrics metric (https://github.com/Lightning-AI/torchmetrics).

TorchMetrics itself is not imported here: the package only calls the metric object it is given, so this
module imports without it. Creating the metric needs ``pip install torchmetrics``.
"""
from typing import Any, Dict

from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage

RESULT_SUFFIX = "_PTLMetrics"


class TorchMetricsPackage(AbstractResultPackage):
    """Evaluate a ``torchmetrics.Metric`` or ``torchmetrics.MetricCollection`` as a result package.

    The predictions and targets reach the metric as they are (tensors, no numpy conversion), as
    ``metric(y_predicted, y_true)``. Result names get the suffix ``'_PTLMetrics'``: a collection's dict keys,
    or the metric's class name for a single metric (``{'MulticlassAccuracy_PTLMetrics': tensor(0.93)}``).

    The metric accumulates state across calls; the ``ModelPerformanceEvaluation`` callback resets it at every
    epoch end (:meth:`metric_reset`) and moves it to the TrainLoop's device.

    Args:
        torch_metrics: the metric or metric collection.

    Raises:
        TypeError: ``torch_metrics`` cannot be called like a metric.
    """

    def __init__(self, torch_metrics: Any):
        super().__init__(pkg_name="Torch Metrics", np_array=False)
        if not callable(torch_metrics):
            raise TypeError("torch_metrics must be a torchmetrics Metric or MetricCollection (pip install "
                            f"torchmetrics), got {type(torch_metrics).__name__}")
        self.metric = torch_metrics

    def prepare_results_dict(self) -> Dict[str, Any]:
        metric_result = self.metric(self.y_predicted, self.y_true)
        if not isinstance(metric_result, dict):
            metric_result = {type(self.metric).__name__: metric_result}
        # The suffix tells these results apart from aitoolbox's own metrics of the same name.
        return {f"{name}{RESULT_SUFFIX}": value for name, value in metric_result.items()}

    def metric_compute(self) -> Any:
        """Return the metric's value over everything it has seen since the last reset."""
        return self.metric.compute()

    def metric_reset(self) -> None:
        """Clear the metric's accumulated state."""
        self.metric.reset()
