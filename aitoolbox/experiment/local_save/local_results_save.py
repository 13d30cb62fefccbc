"""aitoolbox 1.x's local results saver: an experiment's results, hyperparameters and training history as files.

Results are written as JSON, never pickled (a deliberate change from aitoolbox 1.x, which pickled them by
default): a results file is readable by any tool and loading it cannot run code. The files keep aitoolbox
1.x's names with the extension ``.json``, in ``<root>/<project>/<experiment>_<timestamp>/results/``:

- ``results_hyperParams_hist_<experiment>_<timestamp>.json``: everything in one file;
- with ``separate_files``: ``results_<...>.json``, ``hyperparams_<...>.json``, ``train_history_<...>.json``
  and ``true_pred_labels_<...>.json`` (with ``save_true_pred_labels``).

``file_format='pickle'`` (aitoolbox 1.x's default) is accepted and also writes JSON, after a warning. numpy
arrays and tensors become (nested) lists, numpy and tensor scalars numbers, dict keys strings. Metrics with more
than one value in the training history are also plotted into ``results/plots/<metric>.png`` when matplotlib
is installed.
"""
import datetime
import json
import logging
import math
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

from aitoolbox.experiment.local_save.atomic import atomic_write, atomic_write_text
from aitoolbox.experiment.local_save.experiment_folder import timestamp_now
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder
from aitoolbox.experiment.redaction import redact_hyperparams

# Besides its own names, ``import *`` gives what it gave in aitoolbox 1.x, whose modules had no __all__ (1.x
# scripts and tests use e.g. ``os`` and ``datetime`` after ``from <module> import *``).
__all__ = ["AbstractLocalResultsSaver", "BaseLocalResultsSaver", "LocalResultsSaver", "json_ready",
           "plot_training_history", "os", "time", "datetime", "json", "ExperimentFolder"]

logger = logging.getLogger(__name__)

FILE_FORMATS = ("json", "pickle")


def json_ready(value: Any) -> Any:
    """``value`` with every part JSON can hold: dicts (string keys), lists, strings, numbers, booleans, None.

    numpy arrays and tensors become (nested) lists, their scalars Python numbers, tuples and sets lists; other
    objects their ``str``.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {key if isinstance(key, str) else str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_ready(item) for item in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, tensors
    if callable(tolist):
        return json_ready(tolist())
    return str(value)


def written_hyperparameters(result_package: Any) -> Optional[dict]:
    """The package's hyperparameters as the results files hold them: secrets redacted (see
    :mod:`aitoolbox.experiment.redaction`), None when it has none."""
    hyperparameters = result_package.get_hyperparameters()
    return None if hyperparameters is None else redact_hyperparams(hyperparameters)


def history_dict(training_history: Any) -> Dict[str, Any]:
    """The ``{metric name: [values]}`` dict of a TrainingHistory (or of a plain dict)."""
    if callable(getattr(training_history, "get_train_history", None)):
        return training_history.get_train_history()
    return dict(training_history)


def _numeric_series(history: Dict[str, Any]) -> Dict[str, List[float]]:
    """Each metric's values as floats; dict-valued metrics split into ``<metric>_<key>`` series (as 1.x did)."""
    series: Dict[str, List[float]] = {}
    for name, values in history.items():
        values = json_ready(values)
        if not isinstance(values, list):
            continue
        if values and all(isinstance(value, dict) for value in values):
            for key in values[0]:
                series.update(_numeric_series({f"{name}_{key}": [value.get(key) for value in values]}))
        elif all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
            series[name] = [float(value) for value in values]
    return series


def plot_training_history(training_history: Any, results_path: str,
                          plots_folder_name: str = "plots") -> List[List[str]]:
    """Plot every metric with more than one value into ``<results_path>/<plots_folder_name>/<metric>.png``.

    Returns:
        ``[[<plots_folder_name>/<metric>.png, file path], ...]``; empty when nothing is plotted, or when
        matplotlib is not installed (a warning says so).
    """
    series = {name: values for name, values in _numeric_series(history_dict(training_history)).items()
              if len(values) > 1}
    if not series:
        return []
    try:
        # Imported here: matplotlib is optional and slow to import. Figure with the Agg canvas leaves pyplot's
        # global state (a notebook's backend) alone.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("The training history is not plotted: matplotlib is not installed (pip install matplotlib)")
        return []
    plots_path = os.path.join(results_path, plots_folder_name)
    os.makedirs(plots_path, exist_ok=True)
    saved = []
    for name, values in series.items():
        figure = Figure(figsize=(10, 8))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        # The axis and the title count from 1, as the epoch's summary line counts (the values are 1.8's).
        axes.plot(range(1, len(values) + 1), values, marker="o")
        finite = [value for value in values if math.isfinite(value)] or values
        best_high, best_low = max(finite), min(finite)
        axes.set_title(f"{name}\nmax {best_high} (epoch {values.index(best_high) + 1}), "
                       f"min {best_low} (epoch {values.index(best_low) + 1})")
        axes.set_xlabel("Epoch")
        axes.set_ylabel(name)
        file_name = f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.png"  # a metric name may hold '/'...
        file_path = os.path.join(plots_path, file_name)
        with atomic_write(file_path, "wb") as handle:
            figure.savefig(handle, format="png")
        saved.append([os.path.join(plots_folder_name, file_name), file_path])
    return saved


class AbstractLocalResultsSaver(ABC):
    """The interface of local results savers, used by the experiment savers."""

    @abstractmethod
    def save_experiment_results(self, result_package: Any, training_history: Any, project_name: str,
                                experiment_name: str, experiment_timestamp: Optional[str] = None,
                                save_true_pred_labels: bool = False,
                                protect_existing_folder: bool = True) -> List[List[str]]:
        """Save the results into one file (plus plots and the package's extra files).

        Returns:
            ``[[file name, file path], ...]``, the main results file first.
        """

    @abstractmethod
    def save_experiment_results_separate_files(self, result_package: Any, training_history: Any, project_name: str,
                                               experiment_name: str, experiment_timestamp: Optional[str] = None,
                                               save_true_pred_labels: bool = False,
                                               protect_existing_folder: bool = True) -> List[List[str]]:
        """Save results, hyperparameters and training history into separate files (plus plots and extra files).

        Returns:
            ``[[file name, file path], ...]``, the results file first.
        """


class BaseLocalResultsSaver:
    """Shared parts of local results savers: the results folder and writing one file.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
        file_format: ``'json'``; ``'pickle'`` is accepted for aitoolbox 1.x compatibility and writes JSON too
            (after a warning). Another value is replaced by ``'pickle'`` after a warning, as aitoolbox 1.x
            replaced it, and results are written as JSON.
    """

    def __init__(self, local_model_result_folder_path: str = "~/project/model_result", file_format: str = "json"):
        self.local_model_result_folder_path = os.path.expanduser(local_model_result_folder_path)
        if file_format not in FILE_FORMATS:
            logger.warning("Results file_format %r is not supported (use 'json'): results are written as JSON",
                           file_format)
            file_format = "pickle"  # aitoolbox 1.x's fallback value, kept for code that reads it; JSON all the same
        elif file_format == "pickle":
            logger.warning("Results are written as JSON (<name>.json), not pickled: file_format='pickle' of "
                           "aitoolbox 1.x is read as 'json'")
        self.file_format = file_format

    def create_experiment_local_folder_structure(self, project_name: str, experiment_name: str,
                                                 experiment_timestamp: str) -> str:
        """Create the run folder and its ``results/`` folder where missing; return the results folder's path."""
        return self.create_experiment_local_results_folder(project_name, experiment_name, experiment_timestamp,
                                                           self.local_model_result_folder_path)

    @staticmethod
    def create_experiment_local_results_folder(project_name: str, experiment_name: str, experiment_timestamp: str,
                                               local_model_result_folder_path: str) -> str:
        """Create the run folder and its ``results/`` folder where missing; return the results folder's path.

        Existing folders and the files in them are kept.
        """
        ExperimentFolder.create_base_folder(project_name, experiment_name, experiment_timestamp,
                                            local_model_result_folder_path)
        _, _, results_path = BaseLocalResultsSaver.get_experiment_local_results_folder_paths(
            project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)
        os.makedirs(results_path, exist_ok=True)
        return results_path

    @staticmethod
    def get_experiment_local_results_folder_paths(project_name: str, experiment_name: str, experiment_timestamp: str,
                                                  local_model_result_folder_path: str) -> Tuple[str, str, str]:
        """Paths of the project folder, the run folder and its ``results/`` folder; nothing is created."""
        project_path, experiment_path = ExperimentFolder.get_base_folder_paths(
            project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)
        return project_path, experiment_path, os.path.join(experiment_path, "results")

    def save_file(self, result_dict: Dict[str, Any], file_name_w_type: str,
                  file_local_path_w_type: str) -> Tuple[str, str]:
        """Write ``result_dict`` as JSON to ``<file_local_path_w_type>.json``, atomically.

        Args:
            result_dict: what to save.
            file_name_w_type: the file's name without extension.
            file_local_path_w_type: the file's path without extension.

        Returns:
            ``(file name, file path)``, both with ``.json``.

        Raises:
            ValueError: ``file_format`` was set to a format other than ``'json'`` / ``'pickle'``.
        """
        if self.file_format not in FILE_FORMATS:
            raise ValueError(f"file_format {self.file_format!r} is not supported: set it to 'json'")
        text = json.dumps(json_ready(result_dict), sort_keys=True, indent=4)
        atomic_write_text(file_local_path_w_type + ".json", text)
        return file_name_w_type + ".json", file_local_path_w_type + ".json"


class LocalResultsSaver(AbstractLocalResultsSaver, BaseLocalResultsSaver):
    """Save an experiment's results, hyperparameters and training history into its ``results/`` folder.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
        file_format: ``'json'`` (``'pickle'`` is accepted and writes JSON too, see the module documentation).
    """

    def _prepare(self, result_package: Any, training_history: Any, project_name: str, experiment_name: str,
                 experiment_timestamp: Optional[str]):
        experiment_timestamp = experiment_timestamp or timestamp_now()
        results_path = self.create_experiment_local_folder_structure(project_name, experiment_name,
                                                                     experiment_timestamp)
        # Extra files and plots are listed after the saved files, but gathered first as aitoolbox 1.x did.
        extra_paths = list(result_package.get_additional_results_dump_paths() or [])
        extra_paths += plot_training_history(training_history, results_path)
        return experiment_timestamp, results_path, extra_paths

    def save_experiment_results(self, result_package: Any, training_history: Any, project_name: str,
                                experiment_name: str, experiment_timestamp: Optional[str] = None,
                                save_true_pred_labels: bool = False,
                                protect_existing_folder: bool = True) -> List[List[str]]:
        """Save results, hyperparameters and training history into ``results_hyperParams_hist_<...>.json``.

        Args:
            result_package: the evaluated result package.
            training_history: the TrainLoop's training history.
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            save_true_pred_labels: save the package's ``y_true`` and ``y_predicted`` too.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility: an existing experiment folder is
                always kept as it is, with the files in it.

        Returns:
            ``[[file name, file path], ...]``: the results file, the package's extra files, the plots
            (``plots/<metric>.png``).
        """
        experiment_timestamp, results_path, extra_paths = self._prepare(
            result_package, training_history, project_name, experiment_name, experiment_timestamp)
        content = {"experiment_name": experiment_name, "experiment_results_local_path": results_path,
                   "results": result_package.get_results(), "hyperparameters": written_hyperparameters(result_package),
                   "training_history": history_dict(training_history)}
        if save_true_pred_labels:
            content.update(y_true=result_package.y_true, y_predicted=result_package.y_predicted)
        name = f"results_hyperParams_hist_{experiment_name}_{experiment_timestamp}"
        return [list(self.save_file(content, name, os.path.join(results_path, name)))] + extra_paths

    def save_experiment_results_separate_files(self, result_package: Any, training_history: Any, project_name: str,
                                               experiment_name: str, experiment_timestamp: Optional[str] = None,
                                               save_true_pred_labels: bool = False,
                                               protect_existing_folder: bool = True) -> List[List[str]]:
        """Save results, hyperparameters, training history (and labels) into one JSON file each.

        Args:
            result_package: the evaluated result package.
            training_history: the TrainLoop's training history.
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            save_true_pred_labels: save the package's ``y_true`` and ``y_predicted`` into
                ``true_pred_labels_<experiment>_<timestamp>.json``.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility: an existing experiment folder is
                always kept as it is, with the files in it.

        Returns:
            ``[[file name, file path], ...]``: the results, hyperparameters, training history (and labels)
            files, the package's extra files, the plots.
        """
        experiment_timestamp, results_path, extra_paths = self._prepare(
            result_package, training_history, project_name, experiment_name, experiment_timestamp)
        header = {"experiment_name": experiment_name, "experiment_results_local_path": results_path}
        files = [("results", {"results": result_package.get_results()}),
                 ("hyperparams", {"hyperparameters": written_hyperparameters(result_package)}),
                 ("train_history", {"training_history": history_dict(training_history)})]
        if save_true_pred_labels:
            files.append(("true_pred_labels", {"y_true": result_package.y_true,
                                               "y_predicted": result_package.y_predicted}))
        saved = []
        for prefix, content in files:
            name = f"{prefix}_{experiment_name}_{experiment_timestamp}"
            # The labels file holds only the labels, as in aitoolbox 1.x.
            content = content if prefix == "true_pred_labels" else {**header, **content}
            saved.append(list(self.save_file(content, name, os.path.join(results_path, name))))
        return saved + extra_paths
