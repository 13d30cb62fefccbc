"""aitoolbox 1.x's local model savers: write a model (checkpoint dict) into the experiment folder.

Files are named as aitoolbox 1.x named them, inside ``<root>/<project>/<experiment>_<timestamp>/``:

- ``checkpoint_model/model_<experiment>_<timestamp>_E<epoch>.pth`` for a checkpoint at the end of an epoch,
- ``checkpoint_model/model_<experiment>_<timestamp>_E<epoch>_ITER<iteration_idx>.pth`` for one mid-epoch,
- ``model/model_<experiment>_<timestamp>.pth`` for the final model (``.h5`` for Keras models).

Every file is written crash-safely: into a temporary file that replaces the target only once it is complete.
"""
import contextlib
import datetime
import logging
import os
import tempfile
import time
from abc import ABC, abstractmethod
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, _fsync_directory, torch_save_atomic
from aitoolbox.experiment.local_save.checkpoints import checkpoint_file_name
from aitoolbox.experiment.local_save.experiment_folder import timestamp_now
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder

# Besides its own names, ``import *`` gives what it gave in aitoolbox 1.x, whose modules had no __all__ (1.x
# scripts and tests use e.g. ``os`` and ``datetime`` after ``from <module> import *``).
__all__ = ["AbstractLocalModelSaver", "BaseLocalModelSaver", "PyTorchLocalModelSaver", "KerasLocalModelSaver",
           "LocalSubOptimalModelRemover", "model_file_name",
           "os", "time", "datetime", "ExperimentFolder"]

logger = logging.getLogger(__name__)

# What a model dict needs so that training can be continued from it (aitoolbox 1.x's check).
REQUIRED_MODEL_KEYS = ("model_state_dict", "optimizer_state_dict", "epoch", "hyperparams")


def model_file_name(experiment_name: str, experiment_timestamp: str, epoch: Optional[int] = None,
                    iteration_idx: Optional[int] = None, extension: str = ".pth") -> str:
    """aitoolbox 1.x's model file name: ``model_<experiment>_<timestamp>[_E<epoch>[_ITER<iteration_idx>]]<ext>``.

    Without ``epoch`` it is the final model's name and ``iteration_idx`` is ignored, as in aitoolbox 1.x.
    """
    if epoch is None:
        return f"model_{experiment_name}_{experiment_timestamp}{extension}"
    name = checkpoint_file_name(experiment_name, experiment_timestamp, epoch, iteration_idx)
    return name[:-len(".pth")] + extension


class AbstractLocalModelSaver(ABC):
    """The interface of local model savers, used by the experiment savers."""

    @abstractmethod
    def save_model(self, model: Any, project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str]:
        """Save ``model`` into the experiment folder.

        Args:
            model: what to save: a checkpoint dict for PyTorch, the model itself for Keras.
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            epoch: the epoch of a checkpoint; None for the final model.
            iteration_idx: the training iteration of a mid-epoch checkpoint, or None.
            protect_existing_folder: keep an existing experiment folder (it is never removed or emptied).

        Returns:
            ``(file name, file path)``.
        """


class BaseLocalModelSaver:
    """Shared parts of the local model savers: the root folder and the models sub-folder.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
        checkpoint_model: save into ``checkpoint_model/`` (mid-training checkpoints) instead of ``model/``.
    """

    def __init__(self, local_model_result_folder_path: str = "~/project/model_result",
                 checkpoint_model: bool = False):
        self.local_model_result_folder_path = os.path.expanduser(local_model_result_folder_path)
        self.checkpoint_model = checkpoint_model

    def create_experiment_local_models_folder(self, project_name: str, experiment_name: str,
                                              experiment_timestamp: str) -> str:
        """Create the run folder and its ``model/`` (or ``checkpoint_model/``) folder where missing.

        Existing folders and the files in them are kept.

        Returns:
            The path of the models folder.
        """
        experiment_path = ExperimentFolder.create_base_folder(project_name, experiment_name, experiment_timestamp,
                                                              self.local_model_result_folder_path)
        models_path = os.path.join(experiment_path, "checkpoint_model" if self.checkpoint_model else "model")
        os.makedirs(models_path, exist_ok=True)
        return models_path

    def model_file_path(self, project_name: str, experiment_name: str, experiment_timestamp: Optional[str],
                        epoch: Optional[int], iteration_idx: Optional[int],
                        extension: str = ".pth") -> Tuple[str, str, str]:
        """Create the models folder and name the model file in it (see :func:`model_file_name`).

        Args:
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            epoch: the epoch of a checkpoint; None for the final model.
            iteration_idx: the training iteration of a mid-epoch checkpoint, or None.
            extension: the file's extension.

        Returns:
            ``(models folder path, file name, file path)``.
        """
        experiment_timestamp = experiment_timestamp or timestamp_now()
        models_path = self.create_experiment_local_models_folder(project_name, experiment_name,
                                                                 experiment_timestamp)
        name = model_file_name(experiment_name, experiment_timestamp, epoch, iteration_idx, extension=extension)
        return models_path, name, os.path.join(models_path, name)


class PyTorchLocalModelSaver(AbstractLocalModelSaver, BaseLocalModelSaver):
    """Save a PyTorch checkpoint dict with ``torch.save`` into the experiment folder, crash-safely.

    The dict holds at least ``model_state_dict``, ``optimizer_state_dict``, ``epoch`` and ``hyperparams``; every
    other entry (``schedulers_state_dict``, ``iteration_idx``, ``amp``, ...) is saved as given.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
        checkpoint_model: save into ``checkpoint_model/`` (mid-training checkpoints) instead of ``model/``.
    """

    def save_model(self, model: Mapping[str, Any], project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str]:
        """Write the checkpoint dict ``model`` as ``model_<experiment>_<timestamp>[_E<epoch>[_ITER<i>]].pth``.

        A file of the same name is replaced (atomically: readers see the old or the new file, never a part).

        Args:
            model: the checkpoint dict.
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            epoch: the epoch of a checkpoint; None for the final model.
            iteration_idx: the training iteration of a mid-epoch checkpoint, or None.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility: an existing experiment folder is
                always kept as it is, with the files in it.

        Returns:
            ``(file name, file path)``.

        Raises:
            ValueError: ``model`` lacks one of the required entries.
            OSError: the file could not be written; an earlier file of the same name is left as it was.
        """
        self.check_model_dict_contents(model)
        _, name, path = self.model_file_path(project_name, experiment_name, experiment_timestamp, epoch,
                                             iteration_idx)
        torch_save_atomic(model, path)
        return name, path

    @staticmethod
    def check_model_dict_contents(model: Mapping[str, Any]) -> None:
        """Check that the checkpoint dict holds what continuing the training needs.

        Raises:
            ValueError: an entry of ``model_state_dict``, ``optimizer_state_dict``, ``epoch``, ``hyperparams``
                is missing, or ``model`` is not a dict.
        """
        if not isinstance(model, Mapping):
            raise ValueError(f"the model to save must be a checkpoint dict with the entries "
                             f"{list(REQUIRED_MODEL_KEYS)}, got {type(model).__name__}")
        missing = [key for key in REQUIRED_MODEL_KEYS if key not in model]
        if missing:
            raise ValueError(f"the checkpoint dict lacks {missing}: it needs {list(REQUIRED_MODEL_KEYS)} to continue "
                             f"training from it, and has {list(model.keys())}")


class KerasLocalModelSaver(AbstractLocalModelSaver, BaseLocalModelSaver):
    """Save a Keras model with its own ``model.save`` into the experiment folder as ``.h5``, crash-safely.

    Keras itself is not imported by this package: any object with a ``save(path)`` method is saved.

    Args:
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
        checkpoint_model: save into ``checkpoint_model/`` (mid-training checkpoints) instead of ``model/``.
    """

    def save_model(self, model: Any, project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str]:
        """Write the Keras model as ``model_<experiment>_<timestamp>[_E<epoch>[_ITER<i>]].h5``.

        Args:
            model: the Keras model.
            project_name: the project folder's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            epoch: the epoch of a checkpoint; None for the final model.
            iteration_idx: the training iteration of a mid-epoch checkpoint, or None.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility: an existing experiment folder is
                always kept as it is, with the files in it.

        Returns:
            ``(file name, file path)``.

        Raises:
            TypeError: ``model`` has no ``save`` method.
        """
        if not callable(getattr(model, "save", None)):
            raise TypeError(f"KerasLocalModelSaver saves Keras models (with a save(path) method), got "
                            f"{type(model).__name__}; use PyTorchLocalModelSaver for PyTorch checkpoint dicts")
        models_path, name, path = self.model_file_path(project_name, experiment_name, experiment_timestamp, epoch,
                                                       iteration_idx, extension=".h5")
        # Keras writes to a path, not a handle: save under a temporary .h5 name (Keras picks the format by the
        # extension), then rename it over the target so a crash never leaves a partial model file.
        handle, temp_path = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{name}.", suffix=".h5", dir=models_path)
        os.close(handle)
        try:
            model.save(temp_path)
            with open(temp_path, "rb") as written:  # on disk before the rename makes it the model file
                os.fsync(written.fileno())
            os.replace(temp_path, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_path)
            raise
        _fsync_directory(models_path)
        return name, path


class LocalSubOptimalModelRemover:
    """Delete saved models that are no longer among the ``num_best_kept`` best by a training-history metric.

    Call :meth:`decide_if_remove_suboptimal_model` after each save. The TrainLoop's own metrics (``loss``,
    ``accumulated_loss``, ``val_loss``) already hold the saved model's value when it is saved. Other metrics are
    computed by callbacks after the save, so the paths wait until the next call, when the metric's newest value
    belongs to them. A metric with ``loss`` in its name is better when lower, others when higher.

    Args:
        metric_name: the training-history metric that ranks the models.
        num_best_kept: how many of the best models to keep.
    """

    def __init__(self, metric_name: str, num_best_kept: int = 2):
        self.metric_name = metric_name
        self.decrease_metric = "loss" in metric_name
        self.num_best_kept = num_best_kept
        self.default_metrics_list = ["loss", "accumulated_loss", "val_loss"]
        self.is_default_metric = metric_name in self.default_metrics_list
        self.non_default_metric_buffer: Optional[List[str]] = None
        # (paths of one save, its metric value), best first after each removal
        self.model_save_history: List[Tuple[List[str], Any]] = []

    def decide_if_remove_suboptimal_model(self, history: Mapping[str, Sequence[Any]],
                                          new_model_dump_paths: List[str]) -> None:
        """Track the newly saved files and delete those of the worst save once more than ``num_best_kept`` exist.

        Args:
            history: the training history (``{metric name: [values]}``).
            new_model_dump_paths: the files of the model just saved.
        """
        if self.is_default_metric:
            self.model_save_history.append((new_model_dump_paths, history[self.metric_name][-1]))
        else:
            if self.non_default_metric_buffer is not None:
                if self.metric_name in history:
                    self.model_save_history.append((self.non_default_metric_buffer, history[self.metric_name][-1]))
                else:
                    logger.warning("LocalSubOptimalModelRemover: metric %r is not in the training history (it has "
                                   "%s); the models saved are not ranked", self.metric_name, list(history.keys()))
            self.non_default_metric_buffer = new_model_dump_paths

        if len(self.model_save_history) > self.num_best_kept:
            self.model_save_history.sort(key=lambda saved: saved[1], reverse=not self.decrease_metric)
            worst_paths, _ = self.model_save_history.pop()
            logger.info("Removing suboptimal models: %s", worst_paths)
            self.rm_suboptimal_model(worst_paths)

    @staticmethod
    def rm_suboptimal_model(rm_model_paths: List[str]) -> None:
        """Delete the files ``rm_model_paths``."""
        for path in rm_model_paths:
            os.remove(path)
