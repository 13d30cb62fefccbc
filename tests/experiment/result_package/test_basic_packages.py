"""The basic result packages: every metric equals scikit-learn's own, with aitoolbox 1.x's definitions."""
import copy
import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np
import pytest
import torch
from sklearn import metrics

from aitoolbox.experiment.core_metrics.classification import (
    AccuracyMetric,
    F1ScoreMetric,
    PrecisionRecallCurveAUCMetric,
    ROCAUCMetric,
)
from aitoolbox.experiment.result_package.basic_packages import (
    BinaryClassificationResultPackage,
    ClassificationResultPackage,
    GeneralResultPackage,
    RegressionResultPackage,
)

RNG = np.random.default_rng(0)
NUM_SAMPLES = 50


@pytest.fixture
def multiclass():
    y_true = RNG.integers(0, 4, NUM_SAMPLES)
    scores = RNG.normal(size=(NUM_SAMPLES, 4)).astype(np.float32)
    return y_true, scores


@pytest.fixture
def binary():
    y_true = RNG.integers(0, 2, NUM_SAMPLES)
    # Scores correlated with the labels, so the metrics are neither trivial nor degenerate.
    probabilities = np.clip(0.3 * y_true + RNG.uniform(0, 0.7, NUM_SAMPLES), 0, 1).astype(np.float32)
    return y_true, probabilities


def assert_plain_floats(results: dict) -> None:
    assert all(type(value) is float for value in results.values()), results
    json.dumps(results)  # JSON-serialisable as it is


# --- ClassificationResultPackage ---------------------------------------------------------------------------
def test_classification_accuracy_from_labels_matches_sklearn(multiclass):
    y_true, scores = multiclass
    labels = scores.argmax(axis=1)
    results = ClassificationResultPackage().prepare_result_package(y_true, labels).get_results()
    assert results["Accuracy"] == metrics.accuracy_score(y_true, labels)
    assert_plain_floats(results)


def test_classification_takes_argmax_of_2d_scores(multiclass):
    y_true, scores = multiclass
    from_scores = ClassificationResultPackage().prepare_result_package(y_true, scores).get_results()
    assert from_scores["Accuracy"] == metrics.accuracy_score(y_true, scores.argmax(axis=1))


def test_classification_accepts_tensors_and_column_vectors(multiclass):
    y_true, scores = multiclass
    expected = metrics.accuracy_score(y_true, scores.argmax(axis=1))
    logits = torch.from_numpy(scores).requires_grad_()  # a tensor still attached to the graph
    package = ClassificationResultPackage().prepare_result_package(torch.from_numpy(y_true).unsqueeze(1), logits)
    assert package.get_results()["Accuracy"] == expected
    assert isinstance(package.y_true, np.ndarray) and isinstance(package.y_predicted, np.ndarray)
    labels_column = torch.from_numpy(scores.argmax(axis=1)).unsqueeze(1)
    results = ClassificationResultPackage().prepare_result_package(y_true.tolist(), labels_column).get_results()
    assert results["Accuracy"] == expected


def test_classification_accepts_one_hot_targets(multiclass):
    y_true, scores = multiclass
    one_hot = np.eye(4)[y_true]
    results = ClassificationResultPackage().prepare_result_package(one_hot, scores).get_results()
    assert results == ClassificationResultPackage().prepare_result_package(y_true, scores).get_results()
    assert results["Accuracy"] == metrics.accuracy_score(y_true, scores.argmax(axis=1))


# F1_score, Precision and Recall: aitoolbox 1.8's metric names (its binary package's F1_score, its PrecisionMetric
# and RecallMetric), averaged over the classes (macro) for a multi-class problem, of the positive class for a binary one.
def sklearn_prf(y_true, labels, average):
    options = dict(average=average, zero_division=0)
    return {"F1_score": metrics.f1_score(y_true, labels, **options),
            "Precision": metrics.precision_score(y_true, labels, **options),
            "Recall": metrics.recall_score(y_true, labels, **options)}


def test_classification_reports_macro_f1_precision_recall_for_several_classes(multiclass):
    y_true, scores = multiclass
    labels = scores.argmax(axis=1)
    results = ClassificationResultPackage().prepare_result_package(y_true, scores).get_results()
    assert set(results) == {"Accuracy", "F1_score", "Precision", "Recall"}
    expected = sklearn_prf(y_true, labels, "macro")
    assert {name: results[name] for name in expected} == expected
    # Macro: the plain mean of the per-class values, so a rare class counts as much as a frequent one.
    per_class = metrics.f1_score(y_true, labels, average=None, zero_division=0)
    assert results["F1_score"] == pytest.approx(float(np.mean(per_class)))
    assert_plain_floats(results)


def test_classification_of_two_classes_reports_the_positive_class_as_the_binary_package(binary):
    y_true, probabilities = binary
    labels = (probabilities > 0.5).astype(int)
    results = ClassificationResultPackage().prepare_result_package(y_true, labels).get_results()
    assert {name: results[name] for name in ("F1_score", "Precision", "Recall")} == sklearn_prf(y_true, labels,
                                                                                               "binary")
    binary_package = BinaryClassificationResultPackage(positive_class_thresh=None)
    assert results["F1_score"] == binary_package.prepare_result_package(y_true, labels).get_results()["F1_score"]
    # Two score columns are a binary problem too, whatever labels the set happens to hold.
    two_columns = np.stack([1 - probabilities, probabilities], axis=1)
    from_scores = ClassificationResultPackage().prepare_result_package(y_true, two_columns).get_results()
    assert from_scores["F1_score"] == metrics.f1_score(y_true, two_columns.argmax(axis=1), zero_division=0)


def test_classification_average_can_be_chosen(multiclass, binary):
    y_true, scores = multiclass
    labels = scores.argmax(axis=1)
    for average in ("micro", "weighted", "macro"):
        results = ClassificationResultPackage(average=average).prepare_result_package(y_true, labels).get_results()
        assert results["Recall"] == metrics.recall_score(y_true, labels, average=average, zero_division=0)
    y_binary, probabilities = binary
    binary_labels = (probabilities > 0.5).astype(int)
    macro = ClassificationResultPackage(average="macro").prepare_result_package(y_binary, binary_labels).get_results()
    assert macro["F1_score"] == metrics.f1_score(y_binary, binary_labels, average="macro", zero_division=0)


@pytest.mark.parametrize("bad", ["mean", "", None, 3])
def test_classification_rejects_an_unknown_average(bad):
    with pytest.raises(ValueError, match="average"):
        ClassificationResultPackage(average=bad)


def test_classification_never_predicting_a_class_gives_zero_without_warnings(recwarn):
    y_true = np.array([0, 1, 2, 2, 1, 0])
    labels = np.array([0, 0, 0, 0, 0, 0])  # classes 1 and 2 never predicted: their precision is 0 / 0
    results = ClassificationResultPackage().prepare_result_package(y_true, labels).get_results()
    assert results["Precision"] == pytest.approx((2 / 6) / 3)
    assert not [warning for warning in recwarn if "ill-defined" in str(warning.message)]


def test_low_precision_tensors_are_converted(multiclass):
    y_true, scores = multiclass
    bf16_scores = torch.from_numpy(scores).bfloat16()
    results = ClassificationResultPackage().prepare_result_package(torch.from_numpy(y_true), bf16_scores).get_results()
    assert results["Accuracy"] == metrics.accuracy_score(y_true, bf16_scores.float().argmax(dim=1).numpy())


# --- BinaryClassificationResultPackage --------------------------------------------------------------------
def pr_curve_auc(y_true, scores):
    # aitoolbox 1.x's PrecisionRecall_AUC: the trapezoidal area under the precision-recall curve.
    precision, recall, _ = metrics.precision_recall_curve(y_true, scores)
    return metrics.auc(recall, precision)


def expected_binary(y_true, scores, thresh):
    # Each 1.x rule: accuracy counts a score equal to the threshold as positive, F1 does not.
    return {
        "Accuracy": metrics.accuracy_score(y_true, (scores >= thresh).astype(int)),
        "ROC_AUC": metrics.roc_auc_score(y_true, scores),
        "PrecisionRecall_AUC": pr_curve_auc(y_true, scores),
        "F1_score": metrics.f1_score(y_true, (scores > thresh).astype(int)),
    }


def standalone_metrics(y_true, scores, thresh):
    """What the metric classes of the same names give: the package must agree with each."""
    return {
        "Accuracy": AccuracyMetric(y_true, scores, positive_class_thresh=thresh).get_metric(),
        "ROC_AUC": ROCAUCMetric(y_true, scores).get_metric(),
        "PrecisionRecall_AUC": PrecisionRecallCurveAUCMetric(y_true, scores).get_metric(),
        "F1_score": F1ScoreMetric(y_true, scores, positive_class_thresh=thresh).get_metric(),
    }


def test_binary_f1_of_a_score_at_the_threshold_equals_the_f1_metric():
    # 0.5 is a positive for accuracy (>=) and a negative for F1 (>), as in aitoolbox 1.x.
    y_true, scores = np.array([1, 0, 1, 0]), np.array([0.5, 0.2, 0.9, 0.1])
    results = BinaryClassificationResultPackage().prepare_result_package(y_true, scores).get_results()
    assert results["F1_score"] == F1ScoreMetric(y_true, scores).get_metric() == pytest.approx(2 / 3)
    assert results["Accuracy"] == AccuracyMetric(y_true, scores).get_metric() == 1.0
    assert results == standalone_metrics(y_true, scores, 0.5)


@pytest.mark.parametrize("thresh", [0.25, 0.5, 0.75])
def test_binary_with_ties_at_the_threshold_equals_each_metric_class(thresh):
    # Scores on a grid that holds every threshold: many samples of both classes lie exactly on it.
    rng = np.random.default_rng(1)
    y_true = np.tile([0, 1], 20)
    scores = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=y_true.size)
    assert np.sum(scores == thresh) >= 4
    results = BinaryClassificationResultPackage(positive_class_thresh=thresh).prepare_result_package(
        y_true, scores).get_results()
    assert results == standalone_metrics(y_true, scores, thresh)
    assert results == pytest.approx(expected_binary(y_true, scores, thresh), abs=0, rel=0)
    # The same through the other input shapes: a column tensor, and a score per class.
    column = torch.from_numpy(scores).unsqueeze(1)
    assert BinaryClassificationResultPackage(positive_class_thresh=thresh).prepare_result_package(
        torch.from_numpy(y_true), column).get_results() == results
    two_columns = np.stack([1 - scores, scores], axis=1)
    assert BinaryClassificationResultPackage(positive_class_thresh=thresh).prepare_result_package(
        y_true, two_columns).get_results() == results


@pytest.mark.parametrize("thresh", [0.5, 0.3])
def test_binary_matches_sklearn(binary, thresh):
    y_true, probabilities = binary
    results = BinaryClassificationResultPackage(positive_class_thresh=thresh).prepare_result_package(
        y_true, probabilities).get_results()
    assert results == pytest.approx(expected_binary(y_true, probabilities, thresh), abs=0, rel=0)
    assert list(results) == ["Accuracy", "ROC_AUC", "PrecisionRecall_AUC", "F1_score"]
    assert_plain_floats(results)


def test_binary_accepts_tensor_column_and_two_class_scores(binary):
    y_true, probabilities = binary
    expected = expected_binary(y_true, probabilities, 0.5)
    column = torch.from_numpy(probabilities).unsqueeze(1)
    assert BinaryClassificationResultPackage().prepare_result_package(
        torch.from_numpy(y_true), column).get_results() == expected
    two_columns = np.stack([1 - probabilities, probabilities], axis=1)
    assert BinaryClassificationResultPackage().prepare_result_package(y_true, two_columns).get_results() == expected


def test_binary_with_label_predictions(binary):
    y_true, probabilities = binary
    labels = (probabilities >= 0.5).astype(int)
    results = BinaryClassificationResultPackage(positive_class_thresh=None).prepare_result_package(
        y_true, labels).get_results()
    assert results["Accuracy"] == metrics.accuracy_score(y_true, labels)
    assert results["F1_score"] == metrics.f1_score(y_true, labels)


@pytest.mark.parametrize("bad", ["0.5", True, [0.5]])
def test_binary_rejects_bad_threshold(bad):
    with pytest.raises(TypeError, match="positive_class_thresh"):
        BinaryClassificationResultPackage(positive_class_thresh=bad)


def test_non_finite_metric_warns_or_raises_when_strict(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    single_class = np.ones(6, dtype=int)
    scores = np.linspace(0.1, 0.9, 6)
    with caplog.at_level(logging.WARNING):
        results = BinaryClassificationResultPackage().prepare_result_package(single_class, scores).get_results()
    assert np.isnan(results["ROC_AUC"])  # undefined with one class in y_true
    assert results["Accuracy"] == metrics.accuracy_score(single_class, scores >= 0.5)
    assert "ROC_AUC" in caplog.text
    with pytest.raises(ValueError, match="ROC_AUC"):
        BinaryClassificationResultPackage(strict_content_check=True).prepare_result_package(single_class, scores)


# --- RegressionResultPackage ----------------------------------------------------------------------------
def test_regression_matches_sklearn():
    y_true = RNG.normal(size=NUM_SAMPLES)
    y_pred = y_true + RNG.normal(scale=0.3, size=NUM_SAMPLES)
    results = RegressionResultPackage().prepare_result_package(y_true, y_pred).get_results()
    assert results == {"Mean_squared_error": metrics.mean_squared_error(y_true, y_pred),
                       "Mean_absolute_error": metrics.mean_absolute_error(y_true, y_pred)}
    assert_plain_floats(results)
    # (N, 1) model outputs against (N,) targets, as tensors: the same values.
    column = torch.from_numpy(y_pred).unsqueeze(1)
    assert RegressionResultPackage().prepare_result_package(torch.from_numpy(y_true), column).get_results() == results


def test_regression_multi_output_averages():
    y_true = RNG.normal(size=(NUM_SAMPLES, 3))
    y_pred = RNG.normal(size=(NUM_SAMPLES, 3))
    results = RegressionResultPackage().prepare_result_package(y_true, y_pred).get_results()
    assert results["Mean_squared_error"] == metrics.mean_squared_error(y_true, y_pred)


# --- GeneralResultPackage --------------------------------------------------------------------------------
def test_general_package_names_functions_and_pairs(multiclass):
    y_true, scores = multiclass
    labels = scores.argmax(axis=1)
    package = GeneralResultPackage([metrics.balanced_accuracy_score, ("MCC", metrics.matthews_corrcoef)])
    results = package.prepare_result_package(torch.from_numpy(y_true), torch.from_numpy(labels)).get_results()
    assert results == {"balanced_accuracy_score": metrics.balanced_accuracy_score(y_true, labels),
                       "MCC": metrics.matthews_corrcoef(y_true, labels)}
    assert_plain_floats(results)


def test_general_package_without_numpy_conversion():
    seen = []

    def kind(y_true, y_pred):
        seen.append((type(y_true), type(y_pred)))
        return 1

    GeneralResultPackage([kind], np_array=False).prepare_result_package(torch.zeros(3), [0, 1, 2])
    assert seen == [(torch.Tensor, list)]


@pytest.mark.parametrize("metrics_list, error, match", [
    ([], ValueError, "non-empty"),
    ("accuracy", ValueError, "non-empty list"),
    ([42], TypeError, r"metrics_list\[0\]"),
    ([metrics.accuracy_score, ("accuracy_score", metrics.f1_score)], ValueError, "unique"),
])
def test_general_package_rejects_bad_metric_lists(metrics_list, error, match):
    with pytest.raises(error, match=match):
        GeneralResultPackage(metrics_list)


def test_general_package_rejects_non_scalar_metric():
    package = GeneralResultPackage([("per_sample", lambda y_true, y_pred: y_true == y_pred)])
    with pytest.raises(TypeError, match="per_sample"):
        package.prepare_result_package([1, 2], [1, 0])


def test_general_package_takes_metric_objects_and_dicts(binary):
    """aitoolbox 1.x passes metric classes: called with (y_true, y_pred), they name their own results."""
    y_true, probabilities = binary

    class MaxErrorMetric:  # the shape of an aitoolbox 1.x metric class
        def __init__(self, y_true, y_predicted):
            self.value = metrics.max_error(y_true, y_predicted)

        def get_metric_dict(self):
            return {"Max_error": np.float64(self.value)}

    package = GeneralResultPackage([
        MaxErrorMetric,
        lambda y, p: {"MSE": metrics.mean_squared_error(y, p), "MAE": metrics.mean_absolute_error(y, p)},
    ])
    results = package.prepare_result_package(y_true, probabilities).get_results()
    assert results == {"Max_error": metrics.max_error(y_true, probabilities),
                       "MSE": metrics.mean_squared_error(y_true, probabilities),
                       "MAE": metrics.mean_absolute_error(y_true, probabilities)}
    assert type(results["Max_error"]) is float  # numpy numbers become plain floats
    assert package.pkg_name == "GeneralResultPackage" and package.metrics_list[0] is MaxErrorMetric


def test_general_package_result_name_problems():
    unnamed = GeneralResultPackage([lambda y, p: 0.5])
    with pytest.raises(ValueError, match=r"\(name, function\)"):
        unnamed.prepare_result_package([1, 0], [1, 1])
    clashing = GeneralResultPackage([("Accuracy", metrics.accuracy_score), lambda y, p: {"Accuracy": 1.0}])
    with pytest.raises(ValueError, match="both named 'Accuracy'"):
        clashing.prepare_result_package([1, 0], [1, 1])


def test_constructor_arguments_follow_aitoolbox_1x():
    # strict_content_check is the first positional argument (after the threshold for binary); extra keywords
    # are kept as metadata; pkg_name is keyword-only.
    assert ClassificationResultPackage(True).strict_content_check is True
    assert RegressionResultPackage(True, note="x").package_metadata == {"note": "x"}
    binary = BinaryClassificationResultPackage(0.3, True, pkg_name="B")
    assert (binary.positive_class_thresh, binary.strict_content_check, binary.pkg_name) == (0.3, True, "B")
    general = GeneralResultPackage([metrics.max_error], True)
    assert general.strict_content_check is True and general.pkg_name == "GeneralResultPackage"
    assert [ClassificationResultPackage().pkg_name, BinaryClassificationResultPackage().pkg_name,
            RegressionResultPackage().pkg_name] == ["ClassificationResult", "BinaryClassificationResult",
                                                    "RegressionResult"]
    with pytest.raises(TypeError):
        ClassificationResultPackage(False, "name")  # pkg_name cannot be given by position


def test_classification_auto_average_is_decided_once():
    """Review of issue 35, D7: average='auto' decided at the first evaluation, never flipping to macro because a
    later epoch predicts a class the set does not hold (a better epoch must not score lower)."""
    y_true = np.array([0] * 10 + [1] * 10)
    worse = np.array([0] * 8 + [1] * 2 + [1] * 8 + [0] * 2)   # 16/20 right
    better = np.array([0] * 9 + [2] + [1] * 9 + [0])          # 18/20 right, one '2' predicted
    package = ClassificationResultPackage()
    first = package.prepare_result_package(y_true, worse).get_results()
    second = package.prepare_result_package(y_true, better).get_results()
    assert package.resolved_average == "binary"
    assert first["F1_score"] == metrics.f1_score(y_true, worse, zero_division=0)
    # Class 1's F1 with the '2' counted as a wrong prediction: 9 true positives, 0 false positives, 1 miss.
    assert second["F1_score"] == pytest.approx(metrics.f1_score(y_true, better, labels=[1], average="micro"))
    assert second["F1_score"] > first["F1_score"]
    # A copy made after the decision (a further validation set's package) keeps it.
    assert copy.deepcopy(package).resolved_average == "binary"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_classification_metrics_equal_sklearns_own_functions_exactly(data):
    """Precision, Recall and F1_score are computed together (one scikit-learn call): each equals, bitwise, what
    scikit-learn's own precision_score / recall_score / f1_score give for the same labels and averaging, whatever
    labels are drawn (absent classes, a binary set, one class), in every averaging mode."""
    num_classes = data.draw(st.integers(1, 6), label="classes")
    size = data.draw(st.integers(1, 40), label="size")
    label_lists = st.lists(st.integers(0, num_classes - 1), min_size=size, max_size=size)
    y_true = np.array(data.draw(label_lists, label="y_true"))
    predicted = np.array(data.draw(label_lists, label="predicted"))
    average = data.draw(st.sampled_from(["auto", "macro", "micro", "weighted"]), label="average")
    package = ClassificationResultPackage(average=average)
    results = package.prepare_result_package(y_true, predicted).get_results()
    if package.resolved_average == "binary":
        options = dict(average="micro", labels=[1], zero_division=0)
    else:
        options = dict(average=package.resolved_average or average, zero_division=0)
    assert results["Accuracy"] == metrics.accuracy_score(y_true, predicted)
    assert results["F1_score"] == metrics.f1_score(y_true, predicted, **options)
    assert results["Precision"] == metrics.precision_score(y_true, predicted, **options)
    assert results["Recall"] == metrics.recall_score(y_true, predicted, **options)
