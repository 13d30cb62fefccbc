"""aitoolbox 1.x's experiment savers: save a model together with its evaluated results in one call.

The local savers are in :mod:`aitoolbox.experiment.local_experiment_saver`. The cloud savers of aitoolbox 1.x
(AWS S3, Google Cloud Storage) keep their names here, but building one raises ``NotImplementedError``: cloud
storage is not supported yet. Save locally with ``FullPyTorchExperimentLocalSaver`` and copy the experiment
folder to the bucket with your own tools.
"""
import datetime
import time
from abc import ABC, abstractmethod
from typing import Any, Optional, Tuple

from aitoolbox.experiment.local_save.experiment_folder import timestamp_now

# Besides its own names, ``import *`` gives what it gave in aitoolbox 1.x, whose modules had no __all__ (1.x
# scripts and tests use e.g. ``datetime`` after ``from <module> import *``).
__all__ = ["AbstractExperimentSaver", "BaseFullExperimentSaver", "BaseFullExperimentS3Saver",
           "FullPyTorchExperimentS3Saver", "FullKerasExperimentS3Saver", "BaseFullExperimentGoogleStorageSaver",
           "FullPyTorchExperimentGoogleStorageSaver", "FullKerasExperimentGoogleStorageSaver",
           "time", "datetime"]


class AbstractExperimentSaver(ABC):
    """The interface of experiment savers: save the model and the experiment's results together."""

    @abstractmethod
    def save_experiment(self, model: Any, result_package: Any, training_history: Any,
                        experiment_timestamp: Optional[str] = None, save_true_pred_labels: bool = False,
                        separate_files: bool = False, protect_existing_folder: bool = True) -> Any:
        """Save the model and its results.

        Args:
            model: the model representation (a checkpoint dict for PyTorch).
            result_package: the evaluated result package.
            training_history: the TrainLoop's training history.
            experiment_timestamp: the run's timestamp; the current time when None.
            save_true_pred_labels: save the ground truth and predicted labels too.
            separate_files: results, hyperparameters and history in separate files instead of one.
            protect_existing_folder: keep an existing experiment folder.

        Returns:
            Where the files were saved.
        """


class BaseFullExperimentSaver(AbstractExperimentSaver):
    """An experiment saver made of a model saver and a results saver with aitoolbox 1.x's cloud-saver interface.

    ``model_saver.save_model(...)`` returns ``(model path, ..., ...)`` and
    ``results_saver.save_experiment_results(..., separate_files=...)`` returns ``(results path, ...)``.

    Args:
        model_saver: saves the model.
        results_saver: saves the results.
        project_name: the project folder's name.
        experiment_name: the experiment's name.
    """

    def __init__(self, model_saver: Any, results_saver: Any, project_name: str, experiment_name: str):
        self.model_saver = model_saver
        self.results_saver = results_saver
        self.project_name = project_name
        self.experiment_name = experiment_name

    def save_experiment(self, model: Any, result_package: Any, training_history: Any,
                        experiment_timestamp: Optional[str] = None, save_true_pred_labels: bool = False,
                        separate_files: bool = False, protect_existing_folder: bool = True) -> Tuple[Any, Any]:
        """Save the model, then the results, under one timestamp.

        Returns:
            ``(model path, results path)`` as the two savers report them.
        """
        experiment_timestamp = experiment_timestamp or timestamp_now()
        model_path = self.model_saver.save_model(
            model=model, project_name=self.project_name, experiment_name=self.experiment_name,
            experiment_timestamp=experiment_timestamp, protect_existing_folder=protect_existing_folder)[0]
        results_path = self.results_saver.save_experiment_results(
            result_package=result_package, training_history=training_history, project_name=self.project_name,
            experiment_name=self.experiment_name, experiment_timestamp=experiment_timestamp,
            save_true_pred_labels=save_true_pred_labels, separate_files=separate_files,
            protect_existing_folder=protect_existing_folder)[0]
        return model_path, results_path


def _cloud_not_supported(saver_name: str, storage: str) -> NotImplementedError:
    local_name = "FullKerasExperimentLocalSaver" if "Keras" in saver_name else "FullPyTorchExperimentLocalSaver"
    return NotImplementedError(
        f"{saver_name}: saving experiments to {storage} is not supported yet. Use "
        f"aitoolbox.experiment.local_experiment_saver.{local_name} (same arguments without bucket_name and "
        "cloud_dir_prefix) and copy the experiment folder to the bucket with your own tools")


class BaseFullExperimentS3Saver(BaseFullExperimentSaver):
    """aitoolbox 1.x's AWS S3 experiment saver: not supported yet.

    Raises:
        NotImplementedError: always, naming the local saver to use instead.
    """

    def __init__(self, model_saver: Any = None, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "AWS S3")


class FullPyTorchExperimentS3Saver(BaseFullExperimentS3Saver):
    """aitoolbox 1.x's AWS S3 saver of PyTorch experiments: not supported yet.

    Raises:
        NotImplementedError: always; use ``FullPyTorchExperimentLocalSaver``.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "AWS S3")


class FullKerasExperimentS3Saver(BaseFullExperimentS3Saver):
    """aitoolbox 1.x's AWS S3 saver of Keras experiments: not supported yet.

    Raises:
        NotImplementedError: always; use ``FullKerasExperimentLocalSaver``.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "AWS S3")


class BaseFullExperimentGoogleStorageSaver(BaseFullExperimentSaver):
    """aitoolbox 1.x's Google Cloud Storage experiment saver: not supported yet.

    Raises:
        NotImplementedError: always, naming the local saver to use instead.
    """

    def __init__(self, model_saver: Any = None, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "Google Cloud Storage")


class FullPyTorchExperimentGoogleStorageSaver(BaseFullExperimentGoogleStorageSaver):
    """aitoolbox 1.x's Google Cloud Storage saver of PyTorch experiments: not supported yet.

    Raises:
        NotImplementedError: always; use ``FullPyTorchExperimentLocalSaver``.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "Google Cloud Storage")


class FullKerasExperimentGoogleStorageSaver(BaseFullExperimentGoogleStorageSaver):
    """aitoolbox 1.x's Google Cloud Storage saver of Keras experiments: not supported yet.

    Raises:
        NotImplementedError: always; use ``FullKerasExperimentLocalSaver``.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result"):
        raise _cloud_not_supported(type(self).__name__, "Google Cloud Storage")
