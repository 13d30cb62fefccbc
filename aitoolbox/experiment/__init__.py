"""Experiment tracking: result packages with evaluation metrics, experiment folders, savers and loaders.

aitoolbox 1.x's exports stay importable: ``from aitoolbox.experiment import ClassificationResultPackage``.
"""
from aitoolbox.experiment.result_package.basic_packages import (
    BinaryClassificationResultPackage, ClassificationResultPackage, RegressionResultPackage)

__all__ = ["BinaryClassificationResultPackage", "ClassificationResultPackage", "RegressionResultPackage"]
