"""Result packages: turn ``(y_true, y_predicted)`` into a dict of named metrics computed with scikit-learn."""
from aitoolbox.experiment.result_package.abstract_result_packages import (
    AbstractResultPackage,
    MultipleResultPackageWrapper,
)
from aitoolbox.experiment.result_package.basic_packages import (
    BinaryClassificationResultPackage,
    ClassificationResultPackage,
    GeneralResultPackage,
    RegressionResultPackage,
)

__all__ = [
    "AbstractResultPackage", "MultipleResultPackageWrapper", "ClassificationResultPackage",
    "BinaryClassificationResultPackage", "RegressionResultPackage", "GeneralResultPackage",
]
