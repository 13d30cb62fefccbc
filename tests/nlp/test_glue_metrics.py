"""GLUE and XNLI metrics (scikit-learn, SciPy) against values computed by hand and the libraries directly."""
import numpy as np
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import matthews_corrcoef

from aitoolbox.nlp.experiment_evaluation.NLP_metrics import GLUEMetric, XNLIMetric

LABELS = [1, 0, 1, 1, 0, 1]
PREDS = [1, 0, 0, 1, 1, 1]  # 4 of 6 right; class 1: TP 3, FP 1, FN 1 -> F1 3/4


@pytest.mark.parametrize("task", ["sst-2", "qnli", "rte", "wnli", "hans"])
def test_accuracy_tasks(task):
    metric = GLUEMetric(LABELS, PREDS, task)
    assert metric.metric_name == f"GLUE_{task}"
    assert metric.get_metric() == pytest.approx({"acc": 4 / 6})


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_accuracy_and_f1_tasks(task):
    assert GLUEMetric(LABELS, PREDS, task).get_metric() == pytest.approx(
        {"acc": 4 / 6, "f1": 3 / 4, "acc_and_f1": (4 / 6 + 3 / 4) / 2})


def test_cola_matthews_correlation():
    # TP 3, TN 1, FP 1, FN 1: (3*1 - 1*1) / sqrt(4 * 4 * 2 * 2) = 2 / 8
    assert GLUEMetric(LABELS, PREDS, "cola").get_metric() == pytest.approx({"mcc": 0.25})
    assert GLUEMetric(LABELS, PREDS, "cola")["mcc"] == pytest.approx(matthews_corrcoef(LABELS, PREDS))


def test_stsb_correlations():
    labels, preds = [0.5, 1.5, 2.0, 4.0, 5.0], [[0.7], [1.2], [2.4], [3.9], [4.1]]
    flat = [p[0] for p in preds]
    result = GLUEMetric(labels, preds, "sts-b").get_metric()
    assert result["pearson"] == pytest.approx(pearsonr(flat, labels)[0])
    assert result["spearmanr"] == pytest.approx(1.)  # same order
    assert result["spearmanr"] == pytest.approx(spearmanr(flat, labels)[0])
    assert result["corr"] == pytest.approx((result["pearson"] + 1.) / 2)


def test_mnli_names_and_class_scores_are_argmaxed():
    scores = torch.tensor([[2.0, 0.1, 0.3], [0.1, 0.2, 3.0], [0.0, 1.0, 0.5]])  # -> 0, 2, 1
    assert GLUEMetric([0, 2, 2], scores, "mnli").get_metric() == pytest.approx({"mnli_acc": 2 / 3})
    assert GLUEMetric([[0], [2], [1]], scores, "mnli-mm").get_metric() == {"mnli-mm_acc": 1.}


def test_xnli():
    metric = XNLIMetric(np.array([0, 1, 2, 1]), np.array([0, 1, 1, 1]))
    assert metric.get_metric_dict() == {"xnli_accuracy": {"acc": 0.75}}


def test_bad_input():
    with pytest.raises(ValueError, match="unknown GLUE task_name 'squad'; valid ones: .*'cola'"):
        GLUEMetric([1], [1], "squad")
    with pytest.raises(ValueError, match="y_true has 2 examples but y_predicted has 1"):
        GLUEMetric([1, 0], [1], "rte")
    with pytest.raises(ValueError, match="empty"):
        XNLIMetric([], [])
