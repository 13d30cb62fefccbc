"""The result-package interface: predictions in, a dict of named metric values out.

A result package is prepared once per evaluation with ``prepare_result_package(y_true, y_predicted)`` and
then answers ``get_results()`` (e.g. ``{'Accuracy': 0.97}``). Two packages combine with ``+`` into a
:class:`MultipleResultPackageWrapper` whose results are the union of both.
"""
import copy
import logging
import math
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


def to_numpy(data: Any) -> np.ndarray:
    """Convert predictions or targets (a tensor on any device, a list, an array) to a numpy array.

    Tensors are detached and moved to the CPU; low-precision floats (bfloat16 has no numpy dtype) are
    widened to float32 first.
    """
    if isinstance(data, torch.Tensor):
        data = data.detach()
        if data.is_floating_point() and data.dtype in (torch.bfloat16, torch.float16):
            data = data.float()
        return data.cpu().numpy()
    if isinstance(data, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in data):
        return np.asarray([to_numpy(item) for item in data])
    return np.asarray(data)


class AbstractResultPackage(ABC):
    """Base class of result packages: subclasses implement :meth:`prepare_results_dict`.

    Args:
        pkg_name: the package's name; used to prefix metric names when combined packages clash.
        strict_content_check: raise ``ValueError`` when a computed metric is NaN or infinite (otherwise
            such a value is kept and a warning is logged).
        np_array: convert ``y_true`` and ``y_predicted`` to numpy arrays (tensors are moved to the CPU).
            Set False for a custom package whose metrics want the raw objects.
    """

    def __init__(self, pkg_name: str, strict_content_check: bool = False, np_array: bool = True):
        if not isinstance(pkg_name, str) or not pkg_name:
            raise TypeError(f"pkg_name must be a non-empty string, got {pkg_name!r}")
        self.pkg_name = pkg_name
        self.strict_content_check = bool(strict_content_check)
        self.np_array = bool(np_array)
        self.y_true: Any = None
        self.y_predicted: Any = None
        self.hyperparameters: Optional[dict] = None
        self.training_history: Any = None
        self.additional_results: Dict[str, Any] = {}
        self.results_dict: Optional[Dict[str, Any]] = None

    @abstractmethod
    def prepare_results_dict(self) -> Dict[str, Any]:
        """Compute the metrics from ``self.y_true`` and ``self.y_predicted``; return ``{name: value}``."""

    def prepare_result_package(self, y_true: Any, y_predicted: Any, hyperparameters: Optional[dict] = None,
                               training_history: Any = None, **kwargs) -> "AbstractResultPackage":
        """Store the data of one evaluation and compute its results.

        Args:
            y_true: the targets (tensor, array or list).
            y_predicted: the model's predictions, aligned with ``y_true`` along the first dimension.
            hyperparameters: the experiment's hyperparameters, kept for saving with the results.
            training_history: the training history, kept for saving with the results.
            **kwargs: any additional results to keep alongside (available as ``additional_results``).

        Returns:
            The package itself, so ``pkg.prepare_result_package(y, p).get_results()`` reads naturally.

        Raises:
            ValueError: when ``y_true`` and ``y_predicted`` hold different numbers of samples, or (with
                ``strict_content_check``) when a metric is not finite.
        """
        if self.np_array:
            y_true, y_predicted = to_numpy(y_true), to_numpy(y_predicted)
        check_same_length(y_true, y_predicted, self.pkg_name)
        self.y_true = y_true
        self.y_predicted = y_predicted
        self.hyperparameters = hyperparameters
        self.training_history = training_history
        self.additional_results = dict(kwargs)
        results = self.prepare_results_dict()
        if not isinstance(results, dict):
            raise TypeError(f"{type(self).__name__}.prepare_results_dict must return a dict, "
                            f"got {type(results).__name__}")
        self._check_finite(results)
        self.results_dict = results
        return self

    def _check_finite(self, results: Dict[str, Any]) -> None:
        bad = {name: value for name, value in results.items()
               if isinstance(value, float) and not math.isfinite(value)}
        if not bad:
            return
        message = (f"{self.pkg_name}: metrics {sorted(bad)} are not finite ({bad}); check the predictions "
                   "(e.g. only one class present in y_true makes ROC_AUC undefined)")
        if self.strict_content_check:
            raise ValueError(message)
        logger.warning(message)

    @property
    def is_prepared(self) -> bool:
        """True once :meth:`prepare_result_package` has computed the results."""
        return self.results_dict is not None

    def get_results(self) -> Dict[str, Any]:
        """Return a copy of the ``{metric name: value}`` dict.

        Raises:
            RuntimeError: when called before :meth:`prepare_result_package`.
        """
        if self.results_dict is None:
            raise RuntimeError(f"{type(self).__name__} ({self.pkg_name!r}) has no results yet: call "
                               "prepare_result_package(y_true, y_predicted) before get_results()")
        return dict(self.results_dict)

    def get_hyperparameters(self) -> Optional[dict]:
        """The hyperparameters given to :meth:`prepare_result_package` (None if none were given)."""
        return self.hyperparameters

    def __len__(self) -> int:
        return 0 if self.results_dict is None else len(self.results_dict)

    def __str__(self) -> str:
        if self.results_dict is None:
            return f"{self.pkg_name}: not prepared"
        return f"{self.pkg_name}: " + ", ".join(f"{name}: {value}" for name, value in self.results_dict.items())

    def __add__(self, other: Any) -> "MultipleResultPackageWrapper":
        """Combine two packages; copies are combined, so neither operand changes."""
        if not isinstance(other, AbstractResultPackage):
            return NotImplemented
        return MultipleResultPackageWrapper([self, other])

    def __radd__(self, other: Any) -> "AbstractResultPackage":
        # ``sum(packages)`` starts from 0; treat it as the empty package.
        if isinstance(other, int) and other == 0:
            return copy.deepcopy(self)
        return NotImplemented


def check_same_length(y_true: Any, y_predicted: Any, pkg_name: str) -> None:
    """Raise ValueError when both sides have a length and the lengths differ."""
    try:
        len_true, len_pred = len(y_true), len(y_predicted)
    except TypeError:  # scalars or custom objects: leave it to the metrics
        return
    if len_true != len_pred:
        raise ValueError(f"{pkg_name}: y_true has {len_true} samples but y_predicted has {len_pred}; they must "
                         "be aligned along the first dimension")


class MultipleResultPackageWrapper(AbstractResultPackage):
    """Several result packages evaluated on the same predictions, with their results merged.

    Usually made with ``+``: ``ClassificationResultPackage() + GeneralResultPackage([...])``. The wrapper
    holds copies of the packages, so combining never changes the operands. Preparing the wrapper prepares
    every package with the same data. In the merged results a metric name used by more than one package
    is prefixed by the package's name (``'ClassificationResult_Accuracy'``); other names stay as they are.

    Args:
        result_packages: the packages to combine (wrappers among them are flattened); their ``pkg_name``
            must differ.
        pkg_name: the wrapper's own name.
        strict_content_check: as in :class:`AbstractResultPackage`.
    """

    def __init__(self, result_packages: Sequence[AbstractResultPackage], pkg_name: str = "MultipleResultWrapper",
                 strict_content_check: bool = False):
        super().__init__(pkg_name, strict_content_check=strict_content_check, np_array=False)
        self.result_packages: List[AbstractResultPackage] = []
        for package in result_packages:
            self._append(package)
        if self.result_packages and all(package.is_prepared for package in self.result_packages):
            self.results_dict = self.prepare_results_dict()

    def _append(self, package: AbstractResultPackage) -> None:
        if not isinstance(package, AbstractResultPackage):
            raise TypeError(f"only result packages can be combined, got {type(package).__name__}")
        new_packages = (package.result_packages if isinstance(package, MultipleResultPackageWrapper)
                        else [package])
        names = [known.pkg_name for known in self.result_packages]
        for new_package in new_packages:  # check all before adding any, so a failed ``+=`` changes nothing
            if new_package.pkg_name in names:
                raise ValueError(
                    f"cannot combine two result packages both named {new_package.pkg_name!r}: their metric "
                    "names could not be told apart. Give one a different name, e.g. "
                    f"{type(new_package).__name__}(pkg_name='{new_package.pkg_name}2')")
            names.append(new_package.pkg_name)
        self.result_packages.extend(copy.deepcopy(new_package) for new_package in new_packages)

    def prepare_result_package(self, y_true: Any, y_predicted: Any, hyperparameters: Optional[dict] = None,
                               training_history: Any = None, **kwargs) -> "MultipleResultPackageWrapper":
        """Prepare every combined package with the same data, then merge their results."""
        for package in self.result_packages:
            package.prepare_result_package(y_true, y_predicted, hyperparameters=hyperparameters,
                                           training_history=training_history, **kwargs)
        self.y_true, self.y_predicted = y_true, y_predicted
        self.hyperparameters = hyperparameters
        self.training_history = training_history
        self.additional_results = dict(kwargs)
        self.results_dict = self.prepare_results_dict()
        return self

    def prepare_results_dict(self) -> Dict[str, Any]:
        """Merge the packages' results, prefixing the clashing metric names by the package name."""
        all_results = [(package.pkg_name, package.get_results()) for package in self.result_packages]
        name_counts: Dict[str, int] = {}
        for _, results in all_results:
            for name in results:
                name_counts[name] = name_counts.get(name, 0) + 1
        merged: Dict[str, Any] = {}
        for pkg_name, results in all_results:
            for name, value in results.items():
                merged[f"{pkg_name}_{name}" if name_counts[name] > 1 else name] = value
        return merged

    def __add__(self, other: Any) -> "MultipleResultPackageWrapper":
        if not isinstance(other, AbstractResultPackage):
            return NotImplemented
        return MultipleResultPackageWrapper([self, other], pkg_name=self.pkg_name,
                                            strict_content_check=self.strict_content_check)

    def __iadd__(self, other: Any) -> "MultipleResultPackageWrapper":
        """Add a package (a copy of it) to this wrapper in place."""
        if not isinstance(other, AbstractResultPackage):
            return NotImplemented
        self._append(other)
        # Results stay valid only if every package, the new one included, has been prepared.
        prepared = all(package.is_prepared for package in self.result_packages)
        self.results_dict = self.prepare_results_dict() if prepared else None
        return self
