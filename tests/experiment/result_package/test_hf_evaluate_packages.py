"""HFEvaluateResultPackage: metric inputs from the constructor and the model's metadata, '_HFEvaluate' suffix."""
import builtins
import importlib.util

import numpy as np
import pytest

from aitoolbox.experiment.result_package.hf_evaluate_packages import HFEvaluateResultPackage


class EchoMetric:
    """Returns the inputs it was computed with, like an evaluate.EvaluationModule returns its results."""

    def compute(self, **inputs):
        return inputs


def test_inputs_from_constructor_and_model_metadata():
    package = HFEvaluateResultPackage(EchoMetric(), average="macro")
    results = package.prepare_result_package([1, 0], [1, 1], additional_results={"weights": [2, 3]}).get_results()
    assert set(results) == {"references_HFEvaluate", "predictions_HFEvaluate", "average_HFEvaluate",
                            "weights_HFEvaluate"}
    assert results["average_HFEvaluate"] == "macro" and results["weights_HFEvaluate"] == [2, 3]
    assert isinstance(results["references_HFEvaluate"], np.ndarray)  # np_array=True, as in aitoolbox 1.x


def test_model_metadata_can_be_left_out():
    package = HFEvaluateResultPackage(EchoMetric(), use_models_additional_results=False, np_array=False)
    results = package.prepare_result_package(["a b"], ["a c"], additional_results={"weights": [2]}).get_results()
    assert results == {"references_HFEvaluate": ["a b"], "predictions_HFEvaluate": ["a c"]}
    assert package.package_metadata == {}  # np_array went to the package, not to the metric
    assert HFEvaluateResultPackage(EchoMetric()).prepare_result_package([1], [1]).get_results() == {
        "references_HFEvaluate": np.array([1]), "predictions_HFEvaluate": np.array([1])}


def test_no_result_on_a_non_main_process():
    class MainProcessOnly:
        def compute(self, **inputs):
            return None  # what evaluate returns on the processes other than the main one

    assert HFEvaluateResultPackage(MainProcessOnly()).prepare_result_package([1], [1]).get_results() == {}


def test_rejects_a_non_metric():
    with pytest.raises(TypeError, match="HuggingFace Evaluate metric"):
        HFEvaluateResultPackage(lambda y, p: 1.0)


def test_metric_name_without_evaluate_installed_is_a_clear_import_error(monkeypatch):
    real_import = builtins.__import__

    def no_evaluate(name, *args, **kwargs):
        if name == "evaluate":
            raise ImportError("No module named 'evaluate'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_evaluate)
    with pytest.raises(ImportError, match="pip install evaluate"):
        HFEvaluateResultPackage("accuracy")


@pytest.mark.skipif(importlib.util.find_spec("evaluate") is None, reason="evaluate is not installed")
def test_metric_name_is_loaded_with_evaluate(monkeypatch):
    import evaluate

    monkeypatch.setattr(evaluate, "load", lambda name: EchoMetric() if name == "echo" else None)
    package = HFEvaluateResultPackage("echo")
    assert isinstance(package.metric, EchoMetric)
