"""The callbacks page names every metric ClassificationResultPackage computes (review of issue 35, friction 1: it
said Accuracy only, while the package also gives F1_score, Precision and Recall)."""
import os
import re

import numpy as np

from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "callbacks.rst")


def test_the_callbacks_page_lists_every_classification_metric():
    package = ClassificationResultPackage()
    package.prepare_result_package(np.array([0, 1, 1, 0, 2]), np.array([0, 1, 0, 0, 2]))
    with open(DOCS) as handle:
        text = " ".join(handle.read().split())
    listed = re.search(r"``ClassificationResultPackage`` \(([^)]*)\)", text)
    assert listed is not None
    names = {name.strip() for name in listed.group(1).split(",")}
    assert set(package.get_results()) <= names, (sorted(package.get_results()), listed.group(1))
