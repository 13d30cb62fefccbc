"""TorchMetricsPackage: results named with the '_PTLMetrics' suffix, compute/reset passed to the metric."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from aitoolbox.experiment.result_package.torch_metrics_packages import TorchMetricsPackage


class CountingMeanError:
    """Behaves like a torchmetrics Metric: called per batch, accumulates, compute() over all, reset()."""

    def __init__(self, as_dict=False):
        self.as_dict = as_dict
        self.errors = []

    def __call__(self, preds, target):
        batch_error = (preds - target).abs().float().mean()
        self.errors.append(batch_error)
        return {"mae": batch_error, "count": torch.tensor(len(self.errors))} if self.as_dict else batch_error

    def compute(self):
        return torch.stack(self.errors).mean()

    def reset(self):
        self.errors = []


def test_single_metric_is_named_by_its_class_and_gets_tensors():
    metric = CountingMeanError()
    package = TorchMetricsPackage(metric)
    results = package.prepare_result_package(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.5])).get_results()
    assert results == {"CountingMeanError_PTLMetrics": torch.tensor(0.5)}
    assert isinstance(package.y_true, torch.Tensor)  # no numpy conversion


def test_collection_results_keep_their_names_with_the_suffix():
    package = TorchMetricsPackage(CountingMeanError(as_dict=True))
    results = package.prepare_result_package(torch.zeros(3), torch.ones(3)).get_results()
    assert results == {"mae_PTLMetrics": torch.tensor(1.0), "count_PTLMetrics": torch.tensor(1)}


def test_compute_and_reset_reach_the_metric():
    metric = CountingMeanError()
    package = TorchMetricsPackage(metric)
    package.prepare_result_package(torch.zeros(2), torch.ones(2))
    package.prepare_result_package(torch.zeros(2), torch.full((2,), 3.0))
    assert package.metric_compute() == torch.tensor(2.0)
    package.metric_reset()
    assert metric.errors == []


def test_rejects_a_non_metric():
    with pytest.raises(TypeError, match="pip install torchmetrics"):
        TorchMetricsPackage({"accuracy": 1.0})


def test_optional_libraries_are_not_imported_with_the_packages():
    code = ("import sys, aitoolbox.experiment.result_package.torch_metrics_packages, "
            "aitoolbox.experiment.result_package.hf_evaluate_packages; "
            "print(sorted({'torchmetrics', 'evaluate'} & set(sys.modules)))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("torchmetrics") is None, reason="torchmetrics is not installed")
def test_with_a_real_torchmetrics_metric():
    import torchmetrics

    package = TorchMetricsPackage(torchmetrics.MeanAbsoluteError())
    results = package.prepare_result_package(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 3.0])).get_results()
    assert results["MeanAbsoluteError_PTLMetrics"].item() == pytest.approx(0.75)
