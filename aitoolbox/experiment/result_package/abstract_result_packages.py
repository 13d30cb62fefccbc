"""The result-package interface: predictions in, a dict of named metric values out.

A result package is prepared once per evaluation with ``prepare_result_package(y_true, y_predicted)`` and
then answers ``get_results()`` (e.g. ``{'Accuracy': 0.97}``). Prepared packages combine as in aitoolbox 1.x:

- ``pkg_a + pkg_b`` (or ``pkg_a + {'metric': value}``) makes a :class:`MultipleResultPackageWrapper` whose
  results are nested by package name: ``{'ClassificationResult': {...}, 'RegressionResult': {...}}``;
- ``pkg_a += pkg_b`` merges ``pkg_b``'s metrics into ``pkg_a``'s own flat results dict.
"""
import copy
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Union

from aitoolbox.experiment.result_package.inputs import (
    NP_ARRAY_OPTIONS,
    auto_array,
    check_same_length,
    to_numpy,
)
from aitoolbox.experiment.training_history import TrainingHistory
from aitoolbox.utils.file_system import zip_folder

logger = logging.getLogger(__name__)


class AbstractResultPackage(ABC):
    """Base class of result packages: subclasses implement :meth:`prepare_results_dict`.

    Subclasses may also override :meth:`list_additional_results_dump_paths` (files the package wrote, to be
    kept with the experiment) and :meth:`set_experiment_dir_path_for_additional_results`.

    Args:
        pkg_name: the package's name; names the package's results when packages are combined.
        strict_content_check: raise ``ValueError`` on a problem with the results (a metric that is NaN or
            infinite, results asked for before they exist...) instead of logging a warning.
        np_array: how ``y_true`` and ``y_predicted`` reach the metrics: True converts them to numpy arrays
            (tensors are moved to the CPU), False leaves them as given, ``'auto'`` converts tensors and
            lists whose elements all have the same length and leaves ragged lists alone.
        **kwargs: additional metadata of the package, kept as ``package_metadata``.
    """

    # Packages that compare y_true and y_predicted sample by sample set this, so that misaligned inputs fail
    # plainly; others may take placeholder targets (e.g. QA packages read the references from the metadata).
    aligned_inputs = False

    def __init__(self, pkg_name: Optional[str] = None, strict_content_check: bool = False,
                 np_array: Union[bool, str] = True, **kwargs):
        if pkg_name is not None and not isinstance(pkg_name, str):
            raise TypeError(f"pkg_name must be a string or None, got {pkg_name!r}")
        if not (np_array is True or np_array is False or np_array == "auto"):
            raise ValueError(f"np_array must be one of {NP_ARRAY_OPTIONS}, got {np_array!r}")
        self.pkg_name = pkg_name
        self.strict_content_check = strict_content_check
        self.np_array = np_array
        self.y_true: Any = None
        self.y_predicted: Any = None
        self.additional_results: Optional[Dict[str, Any]] = None
        self.additional_results_dump_paths: Optional[List[List[str]]] = None
        self.results_dict: Optional[Dict[str, Any]] = None
        # Set True in a package whose metrics need the loss: the evaluation callbacks then put the evaluated
        # loss into ``additional_results['additional_results']['loss']``.
        self.requires_loss = False
        self.hyperparameters: Optional[dict] = None
        self.training_history: Any = None
        self.package_metadata: Dict[str, Any] = kwargs

    @abstractmethod
    def prepare_results_dict(self) -> Dict[str, Any]:
        """Compute the metrics from ``self.y_true`` and ``self.y_predicted``; return ``{name: value}``."""

    def prepare_result_package(self, y_true: Any, y_predicted: Any, hyperparameters: Optional[dict] = None,
                               additional_results: Optional[dict] = None, training_history: Any = None,
                               **kwargs) -> "AbstractResultPackage":
        """Store the data of one evaluation and compute its results.

        Args:
            y_true: the targets (tensor, array or list).
            y_predicted: the model's predictions, aligned with ``y_true`` along the first dimension.
            hyperparameters: the experiment's hyperparameters, kept for saving with the results.
            additional_results: the metadata returned with the predictions (``predict_on_*_set``); available
                to the metrics as ``self.additional_results['additional_results']``, as in aitoolbox 1.x.
            training_history: the training history, kept as ``training_history``.
            **kwargs: any other additional results, kept in ``self.additional_results``.

        Returns:
            The package itself, so ``pkg.prepare_result_package(y, p).get_results()`` reads naturally.

        Raises:
            ValueError: ``y_true`` and ``y_predicted`` hold different numbers of samples, or (with
                ``strict_content_check``) a metric is not finite.
            TypeError: :meth:`prepare_results_dict` did not return a dict.
        """
        y_true, y_predicted = self._convert_input(y_true), self._convert_input(y_predicted)
        if self.aligned_inputs:
            check_same_length(y_true, y_predicted, self.pkg_name)
        self.y_true, self.y_predicted = y_true, y_predicted
        self.results_dict = None
        self.hyperparameters = hyperparameters
        self.training_history = training_history
        self.additional_results = dict(kwargs)
        if additional_results is not None:
            self.additional_results["additional_results"] = additional_results
        self.results_dict = self._checked_results(self.prepare_results_dict())
        return self

    def _convert_input(self, data: Any) -> Any:
        if self.np_array is True:
            try:
                return to_numpy(data)
            except ValueError as error:  # numpy refuses ragged nesting
                raise ValueError(f"{self.pkg_name}: could not convert the targets or predictions to a numpy array "
                                 f"({error}); pass np_array=False (or 'auto') to the result package to hand them "
                                 "to the metrics as they are") from error
        if self.np_array == "auto":
            return self.auto_y_input_array_convert(data)
        return data

    def _checked_results(self, results: Any) -> Dict[str, Any]:
        if not isinstance(results, Mapping):
            raise TypeError(f"{type(self).__name__}.prepare_results_dict must return a dict of metric name -> "
                            f"value, got {type(results).__name__}")
        results = dict(results)
        bad = {name: value for name, value in results.items()
               if isinstance(value, float) and not math.isfinite(value)}
        if bad:
            self.warn_about_result_data_problem(
                f"{self.pkg_name}: metrics {sorted(bad)} are not finite ({bad}); check the predictions (e.g. only "
                "one class present in y_true makes ROC_AUC undefined)")
        return results

    @staticmethod
    def auto_y_input_array_convert(y_array: Any) -> Any:
        """Convert to a numpy array when that is lossless, else return ``y_array`` unchanged.

        Tensors, arrays and lists whose elements all have the same length (or no length) are converted;
        ragged lists (e.g. token sequences of different lengths) stay lists.
        """
        return auto_array(y_array)

    @property
    def is_prepared(self) -> bool:
        """True once results exist (after :meth:`prepare_result_package`)."""
        return self.results_dict is not None

    def get_results(self) -> Optional[Dict[str, Any]]:
        """Return a copy of the ``{metric name: value}`` dict.

        Before :meth:`prepare_result_package` there are no results: a warning is logged and None returned
        (``ValueError`` with ``strict_content_check``).
        """
        if self.results_dict is None:
            self.warn_about_result_data_problem(
                f"{type(self).__name__} ({self.pkg_name!r}) has no results yet: call "
                "prepare_result_package(y_true, y_predicted) before get_results()")
            return None
        return dict(self.results_dict)

    def get_hyperparameters(self) -> Optional[dict]:
        """Return the hyperparameters given to :meth:`prepare_result_package`.

        :meth:`qa_check_hyperparameters_dict` checks them first (a warning, or ``ValueError`` when strict).
        """
        self.qa_check_hyperparameters_dict()
        return self.hyperparameters

    def get_additional_results_dump_paths(self) -> Optional[List[List[str]]]:
        """Return ``[[file name, local path], ...]`` of the extra files the package wrote (or None).

        Raises:
            ValueError: :meth:`list_additional_results_dump_paths` returned something of another shape.
        """
        self.additional_results_dump_paths = self.list_additional_results_dump_paths()
        self.qa_check_additional_results_dump_paths()
        return self.additional_results_dump_paths

    def list_additional_results_dump_paths(self) -> Optional[List[List[str]]]:
        """Override to list files to keep with the experiment's results, as ``[[file name, local path], ...]``.

        To keep a whole folder, zip it with :meth:`zip_additional_results_dump` and list the zip file.
        """
        return None

    def set_experiment_dir_path_for_additional_results(self, project_name: str, experiment_name: str,
                                                       experiment_timestamp: str,
                                                       local_model_result_folder_path: str) -> None:
        """Override to place the package's extra output files inside the experiment folder.

        Called by the callbacks once the experiment folder (with its timestamp) is known. Does nothing by
        default.
        """

    def qa_check_hyperparameters_dict(self) -> None:
        """Warn (raise when strict) when hyperparameters are missing or lack the script paths aitoolbox records."""
        if self.hyperparameters is None:
            self.warn_about_result_data_problem(f"{self.pkg_name}: hyperparameters are missing")
            return
        for key in ("bash_script_path", "experiment_file_path"):
            if self.hyperparameters.get(key) is None:
                self.warn_about_result_data_problem(
                    f"{self.pkg_name}: {key!r} is missing from the hyperparameters dict; add it to the experiment "
                    "configuration (e.g. parse it with argparse) so the results record how they were produced")

    def qa_check_additional_results_dump_paths(self) -> None:
        """Check that the dump paths are None or a list of ``[file name, path]`` string pairs.

        Raises:
            ValueError: when they are not.
        """
        paths = self.additional_results_dump_paths
        if paths is None:
            return
        if not isinstance(paths, list):
            raise ValueError(f"additional results dump paths must be a list of [file name, path] pairs, got {paths!r}")
        for element in paths:
            if not (isinstance(element, list) and len(element) == 2 and all(isinstance(part, str) for part in element)):
                raise ValueError("each additional results dump path must be a list of two strings "
                                 f"[file name, path], got {element!r}")

    def warn_about_result_data_problem(self, msg: str) -> None:
        """Log ``msg`` as a warning, or raise it as a ``ValueError`` with ``strict_content_check``."""
        if self.strict_content_check:
            raise ValueError(msg)
        logger.warning(msg)

    @staticmethod
    def zip_additional_results_dump(source_dir_path: str, zip_path: str) -> str:
        """Zip the folder ``source_dir_path`` into ``zip_path`` (``.zip`` is appended when missing); return its path."""
        return zip_folder(os.fspath(source_dir_path), zip_path)

    def warn_if_results_dict_not_defined(self) -> None:
        """Raise ``ValueError`` when the package has no results yet."""
        if self.results_dict is None:
            raise ValueError(f"{type(self).__name__} ({self.pkg_name!r}) has no results yet: call "
                             "prepare_result_package(y_true, y_predicted) first")

    def __str__(self) -> str:
        self.warn_if_results_dict_not_defined()
        return "\n".join(f"{name}: {value}" for name, value in self.results_dict.items())

    def __len__(self) -> int:
        self.warn_if_results_dict_not_defined()
        return len(self.results_dict)

    def __contains__(self, metric_name: object) -> bool:
        self.warn_if_results_dict_not_defined()
        return metric_name in self.results_dict

    def __getitem__(self, metric_name: str) -> Any:
        self.warn_if_results_dict_not_defined()
        if metric_name not in self.results_dict:
            raise KeyError(f"{metric_name!r} is not among the results of {self.pkg_name!r}; "
                           f"present: {list(self.results_dict)}")
        return self.results_dict[metric_name]

    # --- combining packages --------------------------------------------------------------------------------------
    def __add__(self, other: Any) -> "MultipleResultPackageWrapper":
        """Combine copies of two prepared packages (or a package and a results dict) into a wrapper.

        Raises:
            ValueError: either side has no results yet, or ``other`` is neither a package nor a dict.
        """
        self.warn_if_results_dict_not_defined()
        others = _packages_to_add(other)
        combined = MultipleResultPackageWrapper(strict_content_check=self.strict_content_check)
        combined.prepare_result_package([copy.deepcopy(self)] + others, self.hyperparameters)
        return combined

    def __radd__(self, other: Any) -> "AbstractResultPackage":
        # ``sum(packages)`` starts from 0: that adds nothing.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return copy.deepcopy(self)
        return self.__add__(other)

    def __iadd__(self, other: Any) -> "AbstractResultPackage":
        """Merge ``other``'s metrics (a prepared package or a dict) into this package's own results.

        Raises:
            ValueError: either side has no results yet, a metric name is in both, or ``other`` is neither a
                package nor a dict.
        """
        self.warn_if_results_dict_not_defined()
        if isinstance(other, AbstractResultPackage):
            other.warn_if_results_dict_not_defined()
            other_results = other.results_dict
        elif isinstance(other, dict):
            other_results = other
        else:
            raise ValueError(f"only a result package or a dict of results can be added, got {type(other).__name__}")
        clashing = sorted(set(self.results_dict) & set(other_results))
        if clashing:
            raise ValueError(f"cannot merge results: metrics {clashing} are in both; use + to keep them apart "
                             "(the results are then nested by package name)")
        self.results_dict = {**self.results_dict, **other_results}
        return self


def _packages_to_add(other: Any) -> List[AbstractResultPackage]:
    """Copies of the packages ``other`` stands for: its sub-packages when it is a wrapper."""
    if isinstance(other, AbstractResultPackage):
        other.warn_if_results_dict_not_defined()
        other = copy.deepcopy(other)
        return list(other.result_packages) if isinstance(other, MultipleResultPackageWrapper) else [other]
    if isinstance(other, dict):
        return [PreCalculatedResultPackage(copy.deepcopy(other))]
    raise ValueError(f"only a result package or a dict of results can be added, got {type(other).__name__}")


class PreCalculatedResultPackage(AbstractResultPackage):
    """A package holding results computed elsewhere, e.g. to add a dict of results to other packages.

    Args:
        results_dict: the results, ``{metric name: value}``.
        strict_content_check: as in :class:`AbstractResultPackage`.
        **kwargs: additional metadata of the package.
    """

    def __init__(self, results_dict: Dict[str, Any], strict_content_check: bool = False, **kwargs):
        super().__init__(pkg_name="PreCalculatedResult", strict_content_check=strict_content_check, **kwargs)
        if not isinstance(results_dict, dict):
            raise TypeError(f"results_dict must be a dict of metric name -> value, got {type(results_dict).__name__}")
        self._given_results = results_dict
        self.results_dict = results_dict
        self.training_history = TrainingHistory()
        self.hyperparameters = {}

    def prepare_results_dict(self) -> Dict[str, Any]:
        # Nothing to compute: preparing again (e.g. inside a wrapper given new data) keeps the given results.
        return self._given_results


class MultipleResultPackageWrapper(AbstractResultPackage):
    """Several prepared result packages kept side by side, their results nested by package name.

    Usually made by adding packages (``pkg_a + pkg_b``); directly::

        wrapper = MultipleResultPackageWrapper()
        wrapper.prepare_result_package([pkg_a, pkg_b])
        wrapper.get_results()  # {'ClassificationResult': {...}, 'RegressionResult': {...}}

    A name that is already taken gets the package's position appended (``'GeneralResultPackage1'``); a
    package without a name is called ``'ResultPackage<position>'``. ``y_true``, ``y_predicted`` and
    ``additional_results`` are dicts keyed the same way.

    Given data instead of packages, ``wrapper.prepare_result_package(y_true, y_predicted, ...)`` prepares
    every held package on that data (an addition to aitoolbox 1.x, so that a combination can be handed to
    the evaluation callbacks).

    Args:
        strict_content_check: as in :class:`AbstractResultPackage`.
        **kwargs: additional metadata of the package.
    """

    def __init__(self, strict_content_check: bool = False, **kwargs):
        super().__init__(pkg_name="MultipleResultWrapper", strict_content_check=strict_content_check, np_array=False,
                         **kwargs)
        self.result_packages: Optional[List[AbstractResultPackage]] = None

    def prepare_result_package(self, result_packages: Any, *args: Any, **kwargs: Any) -> "MultipleResultPackageWrapper":
        """Combine packages: ``prepare_result_package(result_packages, hyperparameters=None, **kwargs)``.

        ``result_packages`` is a list of result packages; to add a results dict, wrap it first in a
        :class:`PreCalculatedResultPackage`. Called as ``prepare_result_package(y_true, y_predicted,
        hyperparameters=None, ...)`` instead (anything but a list of packages first), it prepares every
        held package on that data and combines their results again.

        Returns:
            The wrapper itself.

        Raises:
            ValueError: data given to a wrapper that holds no packages yet.
        """
        if _is_package_list(result_packages):
            return self._combine(list(result_packages), *args, **kwargs)
        if not self.result_packages:
            raise ValueError("this MultipleResultPackageWrapper holds no result packages to prepare on the data; "
                             "give it the packages first: prepare_result_package([package, ...])")
        for package in self.result_packages:
            package.prepare_result_package(result_packages, *args, **kwargs)
        hyperparameters = args[1] if len(args) > 1 else kwargs.get("hyperparameters")
        return self._combine(self.result_packages, hyperparameters)

    def _combine(self, result_packages: List[AbstractResultPackage], hyperparameters: Optional[dict] = None,
                 **kwargs: Any) -> "MultipleResultPackageWrapper":
        self.results_dict = None
        self.result_packages = result_packages
        self.hyperparameters = hyperparameters
        self.additional_results = dict(kwargs)
        self.results_dict = self.prepare_results_dict()
        return self

    def prepare_results_dict(self) -> Dict[str, Any]:
        """Nest every package's results under its (made unique) name."""
        results: Dict[str, Any] = {}
        own_additional = self.additional_results or {}
        self.y_true, self.y_predicted = {}, {}
        self.additional_results = {self.pkg_name: own_additional} if own_additional else {}
        for position, package in enumerate(self.result_packages):
            name = _unique_name(package.pkg_name, position, results)
            results[name] = package.get_results()
            self.y_true[name] = package.y_true
            self.y_predicted[name] = package.y_predicted
            self.additional_results[name] = package.additional_results
        return results

    def get_additional_results_dump_paths(self) -> Optional[List[List[str]]]:
        """The wrapper's own dump paths followed by those of every package (None when there are none)."""
        paths = self.list_additional_results_dump_paths()
        for package in self.result_packages or []:
            package_paths = package.get_additional_results_dump_paths()
            if package_paths:
                paths = (paths or []) + package_paths
        self.additional_results_dump_paths = paths
        self.qa_check_additional_results_dump_paths()
        return paths

    def __str__(self) -> str:
        return "\n".join(f"--> {package.pkg_name}:\n{package}" for package in self.result_packages or [])

    def __len__(self) -> int:
        """The number of packages in the wrapper."""
        return len(self.result_packages or [])

    def __add__(self, other: Any) -> "MultipleResultPackageWrapper":
        """A copy of this wrapper with (copies of) ``other``'s packages appended."""
        self.warn_if_results_dict_not_defined()
        combined = copy.deepcopy(self)
        combined._combine(combined.result_packages + _packages_to_add(other), combined.hyperparameters,
                          **combined.package_metadata)
        return combined

    def __iadd__(self, other: Any) -> "MultipleResultPackageWrapper":
        """Append (copies of) ``other``'s packages to this wrapper."""
        self.warn_if_results_dict_not_defined()
        return self._combine(self.result_packages + _packages_to_add(other), self.hyperparameters,
                             **self.package_metadata)


def _is_package_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(item, AbstractResultPackage) for item in value)


def _unique_name(pkg_name: Optional[str], position: int, taken: Sequence[str]) -> str:
    """``pkg_name``, or with ``position`` appended when taken (aitoolbox 1.x's rule), kept unique."""
    name = pkg_name if pkg_name is not None else f"ResultPackage{position}"
    if name in taken:
        name = f"{name}{position}"
    while name in taken:  # only when a package was already named like a renamed duplicate
        name = f"{name}_"
    return name
