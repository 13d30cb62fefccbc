"""Result packages: every metric equals scikit-learn's own on the same data; combining with ``+``; errors."""
import json
import logging

import numpy as np
import pytest
import torch
from sklearn import metrics

from aitoolbox.experiment.result_package import (
    AbstractResultPackage,
    MultipleResultPackageWrapper,
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
    assert results == {"Accuracy": metrics.accuracy_score(y_true, labels)}
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
    assert package.get_results() == {"Accuracy": expected}
    assert isinstance(package.y_true, np.ndarray) and isinstance(package.y_predicted, np.ndarray)
    labels_column = torch.from_numpy(scores.argmax(axis=1)).unsqueeze(1)
    results = ClassificationResultPackage().prepare_result_package(y_true.tolist(), labels_column).get_results()
    assert results == {"Accuracy": expected}


def test_low_precision_tensors_are_converted(multiclass):
    y_true, scores = multiclass
    bf16_scores = torch.from_numpy(scores).bfloat16()
    results = ClassificationResultPackage().prepare_result_package(torch.from_numpy(y_true), bf16_scores).get_results()
    assert results["Accuracy"] == metrics.accuracy_score(y_true, bf16_scores.float().argmax(dim=1).numpy())


# --- BinaryClassificationResultPackage --------------------------------------------------------------------
def expected_binary(y_true, scores, thresh):
    labels = (scores >= thresh).astype(int)
    return {
        "Accuracy": metrics.accuracy_score(y_true, labels),
        "ROC_AUC": metrics.roc_auc_score(y_true, scores),
        "PrecisionRecall_AUC": metrics.average_precision_score(y_true, scores),
        "F1_score": metrics.f1_score(y_true, labels),
    }


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
    ([lambda a, b: 0.0], ValueError, r"\(name, function\)"),
    ([metrics.accuracy_score, ("accuracy_score", metrics.f1_score)], ValueError, "unique"),
])
def test_general_package_rejects_bad_metric_lists(metrics_list, error, match):
    with pytest.raises(error, match=match):
        GeneralResultPackage(metrics_list)


def test_general_package_rejects_non_scalar_metric():
    package = GeneralResultPackage([("per_sample", lambda y_true, y_pred: y_true == y_pred)])
    with pytest.raises(TypeError, match="per_sample"):
        package.prepare_result_package([1, 2], [1, 0])


# --- the common interface ---------------------------------------------------------------------------------
def test_get_results_before_prepare_is_a_clear_error():
    with pytest.raises(RuntimeError, match="prepare_result_package"):
        ClassificationResultPackage().get_results()


def test_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="4 samples.*3"):
        ClassificationResultPackage().prepare_result_package([0, 1, 1, 0], [0, 1, 1])


def test_prepare_returns_self_and_keeps_hyperparameters_and_history():
    hyperparameters = {"lr": 0.1}
    history = {"loss": [1.0, 0.5]}
    package = RegressionResultPackage()
    assert package.prepare_result_package([1.0], [2.0], hyperparameters=hyperparameters,
                                          training_history=history, note="x") is package
    assert package.get_hyperparameters() == hyperparameters
    assert package.training_history is history
    assert package.additional_results == {"note": "x"}
    assert len(package) == 2 and "Mean_squared_error" in str(package)


def test_get_results_returns_a_copy():
    package = ClassificationResultPackage().prepare_result_package([1, 0], [1, 1])
    package.get_results()["Accuracy"] = 99.0
    assert package.get_results() == {"Accuracy": 0.5}


def test_custom_subclass():
    class MaxError(AbstractResultPackage):
        def __init__(self):
            super().__init__("MaxError")

        def prepare_results_dict(self):
            return {"Max_error": float(metrics.max_error(self.y_true, self.y_predicted))}

    results = MaxError().prepare_result_package(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 4.0])).get_results()
    assert results == {"Max_error": 2.0}
    with pytest.raises(TypeError):
        AbstractResultPackage("abstract")  # prepare_results_dict is abstract


# --- combining with + ---------------------------------------------------------------------------------------
def test_adding_prepared_packages_merges_results(binary):
    y_true, probabilities = binary
    regression = RegressionResultPackage().prepare_result_package(y_true, probabilities)
    general = GeneralResultPackage([("Max_error", metrics.max_error)]).prepare_result_package(y_true, probabilities)
    combined = regression + general
    assert isinstance(combined, MultipleResultPackageWrapper)
    assert combined.get_results() == {**regression.get_results(), **general.get_results()}
    assert_plain_floats(combined.get_results())


def test_clashing_names_are_prefixed_by_package_name(binary):
    y_true, probabilities = binary
    labels = (probabilities >= 0.5).astype(int)
    combined = ClassificationResultPackage() + BinaryClassificationResultPackage()
    # Preparing the combination prepares every package with the same data (labels are valid scores too).
    results = combined.prepare_result_package(y_true, labels).get_results()
    accuracy = metrics.accuracy_score(y_true, labels)
    assert results == {
        "ClassificationResult_Accuracy": accuracy,
        "BinaryClassificationResult_Accuracy": accuracy,
        "ROC_AUC": metrics.roc_auc_score(y_true, labels),
        "PrecisionRecall_AUC": metrics.average_precision_score(y_true, labels),
        "F1_score": metrics.f1_score(y_true, labels),
    }


def test_chained_and_in_place_addition(binary):
    y_true, probabilities = binary
    mse = GeneralResultPackage([metrics.mean_squared_error], pkg_name="mse")
    mae = GeneralResultPackage([metrics.mean_absolute_error], pkg_name="mae")
    max_error = GeneralResultPackage([metrics.max_error], pkg_name="max")
    chained = (mse + mae) + max_error
    assert [p.pkg_name for p in chained.result_packages] == ["mse", "mae", "max"]  # flattened
    combined = mse + mae
    same_object = combined
    combined += max_error
    assert combined is same_object
    combined.prepare_result_package(y_true, probabilities)
    assert combined.get_results() == chained.prepare_result_package(y_true, probabilities).get_results()
    assert list(combined.get_results()) == ["mean_squared_error", "mean_absolute_error", "max_error"]
    plain = RegressionResultPackage()
    plain += mse
    assert isinstance(plain, MultipleResultPackageWrapper)
    assert sum([mse, mae, max_error]).prepare_result_package(y_true, probabilities).get_results() == \
        combined.get_results()


def test_addition_leaves_operands_unchanged(binary):
    y_true, probabilities = binary
    first, second = RegressionResultPackage(), GeneralResultPackage([metrics.max_error])
    combined = first + second
    combined.prepare_result_package(y_true, probabilities)
    assert not first.is_prepared and not second.is_prepared


def test_unprepared_combination_and_partly_prepared_in_place_addition(binary):
    y_true, probabilities = binary
    combined = RegressionResultPackage() + GeneralResultPackage([metrics.max_error])
    with pytest.raises(RuntimeError, match="prepare_result_package"):
        combined.get_results()
    combined.prepare_result_package(y_true, probabilities)
    combined += GeneralResultPackage([metrics.r2_score], pkg_name="r2")  # not prepared: results invalid now
    with pytest.raises(RuntimeError, match="prepare_result_package"):
        combined.get_results()


def test_addition_errors():
    with pytest.raises(TypeError):
        ClassificationResultPackage() + {"Accuracy": 1.0}
    with pytest.raises(ValueError, match="both named 'ClassificationResult'"):
        ClassificationResultPackage() + ClassificationResultPackage()
    combined = RegressionResultPackage() + GeneralResultPackage([metrics.max_error])
    with pytest.raises(ValueError, match="both named"):
        combined += RegressionResultPackage()
    assert len(combined.result_packages) == 2  # a failed += changes nothing
