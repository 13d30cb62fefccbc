"""Classification metrics: names, thresholds and label handling, checked against hand-computed values."""
import logging

import numpy as np
import pytest

from aitoolbox.experiment.core_metrics.classification import (AccuracyMetric, F1ScoreMetric,
                                                              PrecisionMetric, PrecisionRecallCurveAUCMetric,
                                                              RecallMetric, ROCAUCMetric)

Y_TRUE = [1, 0, 1, 1, 0, 0]
Y_PROB = [0.9, 0.6, 0.4, 0.8, 0.1, 0.5]  # at 0.5: labels 1 1 0 1 0 0 -> tp 2, fp 1, fn 1


def test_accuracy_thresholds_probabilities_at_or_above_the_threshold():
    metric = AccuracyMetric(Y_TRUE, Y_PROB)  # labels 1 1 0 1 0 1
    assert metric.get_metric_dict() == {"Accuracy": 0.5}
    assert AccuracyMetric([1, 0], [0.5, 0.49]).get_metric() == 1.0  # 0.5 itself is positive
    assert AccuracyMetric(Y_TRUE, Y_PROB, positive_class_thresh=0.85).get_metric() == pytest.approx(4 / 6)


def test_accuracy_argmaxes_class_scores_and_one_hot_targets():
    scores = [[0.1, 2.0, 0.3], [3.0, 0.0, 0.1], [0.0, 0.1, 0.9]]
    assert AccuracyMetric([1, 0, 1], scores).get_metric() == pytest.approx(2 / 3)
    one_hot = np.eye(3)[[1, 0, 2]]
    assert AccuracyMetric(one_hot, scores).get_metric() == 1.0


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


def test_accuracy_of_multi_class_labels_needs_no_threshold(warnings_log):
    assert AccuracyMetric([0, 2, 1, 3], [0, 2, 2, 3], positive_class_thresh=None).get_metric() == 0.75
    assert AccuracyMetric([0, 2, 1, 3], [0, 2, 2, 3]).get_metric() == 0.75
    assert "not applied" in warnings_log.text


def test_threshold_based_binary_scores_use_strictly_greater():
    # 0.5 is not above the 0.5 threshold here (unlike accuracy): labels 1 1 0 1 0 0.
    assert PrecisionMetric(Y_TRUE, Y_PROB).get_metric_dict() == {"Precision": pytest.approx(2 / 3)}
    assert RecallMetric(Y_TRUE, Y_PROB).get_metric_dict() == {"Recall": pytest.approx(2 / 3)}
    assert F1ScoreMetric(Y_TRUE, Y_PROB).get_metric_dict() == {"F1_score": pytest.approx(2 / 3)}
    assert RecallMetric(Y_TRUE, Y_PROB, positive_class_thresh=0.3).get_metric() == 1.0


def test_ranking_metrics():
    # Pairs (positive, negative) ranked correctly: 7 of 9 (0.4 beats only 0.1).
    assert ROCAUCMetric(Y_TRUE, Y_PROB).get_metric_dict() == {"ROC_AUC": pytest.approx(7 / 9)}
    perfect = PrecisionRecallCurveAUCMetric([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9])
    assert perfect.metric_name == "PrecisionRecall_AUC" and perfect.get_metric() == pytest.approx(1.0)
    assert isinstance(ROCAUCMetric(Y_TRUE, Y_PROB).get_metric(), float)
