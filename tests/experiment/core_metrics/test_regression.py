"""Regression metrics: mean squared and mean absolute error."""
import pytest

from aitoolbox.experiment.core_metrics.regression import MeanAbsoluteErrorMetric, MeanSquaredErrorMetric


def test_errors_against_hand_computed_values():
    y_true, y_pred = [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 1.0, 4.5]  # errors 0, 1, -2, 0.5
    assert MeanSquaredErrorMetric(y_true, y_pred).get_metric_dict() == {
        "Mean_squared_error": pytest.approx((0 + 1 + 4 + 0.25) / 4)}
    assert MeanAbsoluteErrorMetric(y_true, y_pred).get_metric_dict() == {
        "Mean_absolute_error": pytest.approx(3.5 / 4)}


def test_multi_output_errors_average_over_all_outputs():
    assert MeanAbsoluteErrorMetric([[0, 0], [1, 1]], [[1, 0], [1, 3]]).get_metric() == pytest.approx(0.75)
    assert MeanSquaredErrorMetric([1, 2], [1, 2]) <= 0
