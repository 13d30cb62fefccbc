"""Result packages: turn ``(y_true, y_predicted)`` into a dict of named metrics computed with scikit-learn.

The wrappers of optional metric libraries live in their own modules, which import those libraries lazily:
``torch_metrics_packages.TorchMetricsPackage`` (torchmetrics) and ``hf_evaluate_packages.HFEvaluateResultPackage``
(HuggingFace evaluate).
"""
from aitoolbox.experiment.result_package.abstract_result_packages import (
    AbstractResultPackage,
    MultipleResultPackageWrapper,
    PreCalculatedResultPackage,
)
from aitoolbox.experiment.result_package.basic_packages import (
    BinaryClassificationResultPackage,
    ClassificationResultPackage,
    GeneralResultPackage,
    RegressionResultPackage,
)

__all__ = [
    "AbstractResultPackage", "MultipleResultPackageWrapper", "PreCalculatedResultPackage",
    "ClassificationResultPackage", "BinaryClassificationResultPackage", "RegressionResultPackage",
    "GeneralResultPackage",
]
