"""aitoolbox 1.x's ``cloud.AWS.model_save``: save a model into the local experiment folder, then upload it to S3.

Keys follow aitoolbox 1.x's layout (see :mod:`aitoolbox.cloud.layout`):
``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/model/model_<experiment>_<timestamp>.pth`` for the
final model and ``.../checkpoint_model/model_<experiment>_<timestamp>_E<epoch>[_ITER<i>].pth`` for checkpoints.
"""
from abc import ABC, abstractmethod
from typing import Any, Optional, Tuple

from aitoolbox.cloud.AWS.data_access import BaseDataSaver
from aitoolbox.cloud.savers import ModelFolderMixin
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.local_save.local_model_save import KerasLocalModelSaver, PyTorchLocalModelSaver

__all__ = ["AbstractModelSaver", "BaseModelSaver", "PyTorchS3ModelSaver", "KerasS3ModelSaver"]


class AbstractModelSaver(ABC):
    """The interface of the cloud model savers."""

    @abstractmethod
    def save_model(self, model: Any, project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str, str]:
        """Save the model locally and upload it.

        Returns:
            ``(<bucket>/<key> of the model, experiment timestamp, local path of the model)``.
        """


class BaseModelSaver(ModelFolderMixin, BaseDataSaver):
    """S3 model saving: the bucket and the folder of the models in it.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        checkpoint_model: save into ``checkpoint_model/`` (mid-training checkpoints) instead of ``model/``.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "", checkpoint_model: bool = False,
                 *, uploader: Optional[CloudUploader] = None):
        BaseDataSaver.__init__(self, bucket_name, uploader=uploader)
        self.cloud_dir_prefix = cloud_dir_prefix
        self.checkpoint_model = checkpoint_model


class PyTorchS3ModelSaver(AbstractModelSaver, BaseModelSaver):
    """Save a PyTorch checkpoint dict with :class:`PyTorchLocalModelSaver`, then upload the file to S3.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        checkpoint_model: a mid-training checkpoint (``checkpoint_model/``) rather than the final model.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result", checkpoint_model: bool = False,
                 *, uploader: Optional[CloudUploader] = None):
        BaseModelSaver.__init__(self, bucket_name, cloud_dir_prefix, checkpoint_model, uploader=uploader)
        self.pytorch_local_saver = PyTorchLocalModelSaver(local_model_result_folder_path, checkpoint_model)

    def save_model(self, model: dict, project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str, str]:
        """Save the checkpoint dict locally (crash-safely), then upload it.

        Args:
            model: the checkpoint dict (``model_state_dict``, ``optimizer_state_dict``, ``epoch``, ``hyperparams``).
            project_name: the project's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            epoch: the checkpoint's epoch; None for the final model.
            iteration_idx: the training iteration of a mid-epoch checkpoint, or None.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility (folders are never emptied).

        Returns:
            ``(<bucket>/<key> of the model, experiment timestamp, local path of the model)``.

        Raises:
            ValueError: the dict lacks a required entry (nothing is written).
            CloudStorageError: the upload failed (without an uploader); the local file is kept.
        """
        PyTorchLocalModelSaver.check_model_dict_contents(model)
        return self._save_and_upload(self.pytorch_local_saver, model, project_name, experiment_name,
                                     experiment_timestamp, epoch, iteration_idx, protect_existing_folder)


class KerasS3ModelSaver(AbstractModelSaver, BaseModelSaver):
    """Save a Keras model with :class:`KerasLocalModelSaver` (``.h5``), then upload the file to S3.

    Arguments as :class:`PyTorchS3ModelSaver`.
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result", checkpoint_model: bool = False,
                 *, uploader: Optional[CloudUploader] = None):
        BaseModelSaver.__init__(self, bucket_name, cloud_dir_prefix, checkpoint_model, uploader=uploader)
        self.keras_local_saver = KerasLocalModelSaver(local_model_result_folder_path, checkpoint_model)

    def save_model(self, model: Any, project_name: str, experiment_name: str,
                   experiment_timestamp: Optional[str] = None, epoch: Optional[int] = None,
                   iteration_idx: Optional[int] = None, protect_existing_folder: bool = True) -> Tuple[str, str, str]:
        """Save the Keras model locally, then upload it; arguments and result as
        :meth:`PyTorchS3ModelSaver.save_model`."""
        return self._save_and_upload(self.keras_local_saver, model, project_name, experiment_name,
                                     experiment_timestamp, epoch, iteration_idx, protect_existing_folder)
