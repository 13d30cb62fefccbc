"""aitoolbox 1.x's experiment savers: save a model together with its evaluated results in one call.

The local savers are in :mod:`aitoolbox.experiment.local_experiment_saver`. The cloud savers here (AWS S3,
Google Cloud Storage, aitoolbox 1.x's classes) write the same files into the local experiment folder, then upload
them under aitoolbox 1.x's keys (see :doc:`cloud_storage`); the service clients are imported when a saver is
built (``pip install aitoolbox[aws]`` / ``aitoolbox[gcs]``).
"""
import datetime
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional, Tuple

from aitoolbox.experiment.local_save.experiment_folder import timestamp_now

if TYPE_CHECKING:
    from aitoolbox.cloud.uploader import CloudUploader

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


def _cloud_saver_classes(service: str, keras: bool) -> Tuple[Any, Any]:
    """The (model saver, results saver) classes of ``service``."""
    # Imported here: the cloud savers import the local savers, which import this module.
    if service == "s3":
        from aitoolbox.cloud.AWS.model_save import KerasS3ModelSaver as KerasSaver
        from aitoolbox.cloud.AWS.model_save import PyTorchS3ModelSaver as PyTorchSaver
        from aitoolbox.cloud.AWS.results_save import S3ResultsSaver as ResultsSaver
    else:
        from aitoolbox.cloud.GoogleCloud.model_save import KerasGoogleStorageModelSaver as KerasSaver
        from aitoolbox.cloud.GoogleCloud.model_save import PyTorchGoogleStorageModelSaver as PyTorchSaver
        from aitoolbox.cloud.GoogleCloud.results_save import GoogleStorageResultsSaver as ResultsSaver
    return (KerasSaver if keras else PyTorchSaver), ResultsSaver


class _CloudExperimentSaver(BaseFullExperimentSaver):
    """A full experiment saver whose model saver and results saver write locally, then upload to one bucket.

    Subclasses set ``service`` (``'s3'`` / ``'gcs'``) and ``keras``.
    """

    service = "s3"
    keras = False

    def __init__(self, model_saver: Any, project_name: str, experiment_name: str, bucket_name: str = "model-result",
                 cloud_dir_prefix: str = "", local_model_result_folder_path: str = "~/project/model_result", *,
                 uploader: Optional["CloudUploader"] = None):
        model_saver_class, results_saver_class = _cloud_saver_classes(self.service, self.keras)
        if model_saver is None:
            model_saver = model_saver_class(bucket_name, cloud_dir_prefix, local_model_result_folder_path,
                                            uploader=uploader)
        results_saver = results_saver_class(bucket_name, cloud_dir_prefix, local_model_result_folder_path,
                                            uploader=uploader)
        super().__init__(model_saver, results_saver, project_name, experiment_name)
        self.bucket_name = bucket_name
        self.cloud_dir_prefix = cloud_dir_prefix
        self.local_model_result_folder_path = local_model_result_folder_path


class _SaverOfItsOwnModelSaver:
    """The full savers' signature: no ``model_saver`` argument, the saver makes its own (PyTorch or Keras)."""

    def __init__(self, project_name: str, experiment_name: str, bucket_name: str = "model-result",
                 cloud_dir_prefix: str = "", local_model_result_folder_path: str = "~/project/model_result", *,
                 uploader: Optional["CloudUploader"] = None):
        super().__init__(None, project_name, experiment_name, bucket_name, cloud_dir_prefix,
                         local_model_result_folder_path, uploader=uploader)


class BaseFullExperimentS3Saver(_CloudExperimentSaver):
    """Save a model and its results into the local experiment folder and upload both to AWS S3.

    The results go up with :class:`aitoolbox.cloud.AWS.results_save.S3ResultsSaver`; keys follow aitoolbox 1.x's
    layout (``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/model/...`` and ``.../results/...``, see
    :mod:`aitoolbox.cloud.layout`). Needs ``pip install aitoolbox[aws]``; endpoint and credentials come from
    boto3's standard configuration (see :doc:`cloud_storage`). The local files are always kept.

    Args:
        model_saver: the cloud model saver (an S3 model saver of the same bucket); None: the PyTorch one.
        project_name: the project's name.
        experiment_name: the experiment's name.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: upload in the background through this :class:`~aitoolbox.cloud.uploader.CloudUploader` (of the
            same bucket; its ``wait()`` reports failures) instead of at once. Not in aitoolbox 1.x.
    """

    service = "s3"


class FullPyTorchExperimentS3Saver(_SaverOfItsOwnModelSaver, BaseFullExperimentS3Saver):
    """Save a PyTorch experiment (checkpoint dict and results) locally and to AWS S3.

    ``save_experiment(model, result_package, training_history, ...)`` returns
    ``(<bucket>/<key> of the model, <bucket>/<key> of the main results file)``.

    Args:
        project_name: the project's name.
        experiment_name: the experiment's name.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """


class FullKerasExperimentS3Saver(_SaverOfItsOwnModelSaver, BaseFullExperimentS3Saver):
    """Save a Keras experiment (the model as ``.h5``, through its own ``save``, and the results) locally and to
    AWS S3. Keras is not imported by this package: any model with a ``save(path)`` method is saved.

    Arguments as :class:`FullPyTorchExperimentS3Saver`.
    """

    keras = True


class BaseFullExperimentGoogleStorageSaver(_CloudExperimentSaver):
    """Save a model and its results into the local experiment folder and upload both to Google Cloud Storage.

    As :class:`BaseFullExperimentS3Saver`, with
    :class:`aitoolbox.cloud.GoogleCloud.results_save.GoogleStorageResultsSaver`. Needs
    ``pip install aitoolbox[gcs]``; credentials come from Google's application default credentials
    (``STORAGE_EMULATOR_HOST`` selects an emulator).

    Args:
        model_saver: the cloud model saver (a GCS model saver of the same bucket); None: the PyTorch one.
        project_name: the project's name.
        experiment_name: the experiment's name.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    service = "gcs"


class FullPyTorchExperimentGoogleStorageSaver(_SaverOfItsOwnModelSaver, BaseFullExperimentGoogleStorageSaver):
    """Save a PyTorch experiment (checkpoint dict and results) locally and to Google Cloud Storage.

    Arguments and ``save_experiment`` as :class:`FullPyTorchExperimentS3Saver`.
    """


class FullKerasExperimentGoogleStorageSaver(_SaverOfItsOwnModelSaver, BaseFullExperimentGoogleStorageSaver):
    """Save a Keras experiment (the model as ``.h5`` and the results) locally and to Google Cloud Storage.

    Arguments as :class:`FullPyTorchExperimentS3Saver`.
    """

    keras = True
