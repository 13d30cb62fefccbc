"""aitoolbox 1.x's ``cloud.GoogleCloud.model_save``: save a model into the local experiment folder, then upload
it to Google Cloud Storage, under the same keys as the S3 savers (see :mod:`aitoolbox.cloud.layout`)."""
from typing import Optional

from aitoolbox.cloud.AWS.model_save import KerasS3ModelSaver, PyTorchS3ModelSaver
from aitoolbox.cloud.GoogleCloud.data_access import BaseGoogleStorageDataSaver
from aitoolbox.cloud.savers import ModelFolderMixin
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.local_save.local_model_save import KerasLocalModelSaver, PyTorchLocalModelSaver

__all__ = ["BaseModelGoogleStorageSaver", "PyTorchGoogleStorageModelSaver", "KerasGoogleStorageModelSaver"]


class BaseModelGoogleStorageSaver(ModelFolderMixin, BaseGoogleStorageDataSaver):
    """Google Cloud Storage model saving: the bucket and the folder of the models in it.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        checkpoint_model: save into ``checkpoint_model/`` (mid-training checkpoints) instead of ``model/``.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "", checkpoint_model: bool = False,
                 *, uploader: Optional[CloudUploader] = None):
        BaseGoogleStorageDataSaver.__init__(self, bucket_name, uploader=uploader)
        self.cloud_dir_prefix = cloud_dir_prefix
        self.checkpoint_model = checkpoint_model


class PyTorchGoogleStorageModelSaver(BaseModelGoogleStorageSaver, PyTorchS3ModelSaver):
    """Save a PyTorch checkpoint dict with :class:`PyTorchLocalModelSaver`, then upload the file to GCS.

    ``save_model`` is :meth:`PyTorchS3ModelSaver.save_model`, uploading to Google Cloud Storage.

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
        BaseModelGoogleStorageSaver.__init__(self, bucket_name, cloud_dir_prefix, checkpoint_model, uploader=uploader)
        self.pytorch_local_saver = PyTorchLocalModelSaver(local_model_result_folder_path, checkpoint_model)


class KerasGoogleStorageModelSaver(BaseModelGoogleStorageSaver, KerasS3ModelSaver):
    """Save a Keras model with :class:`KerasLocalModelSaver` (``.h5``), then upload the file to GCS.

    Arguments as :class:`PyTorchGoogleStorageModelSaver`.
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result", checkpoint_model: bool = False,
                 *, uploader: Optional[CloudUploader] = None):
        BaseModelGoogleStorageSaver.__init__(self, bucket_name, cloud_dir_prefix, checkpoint_model, uploader=uploader)
        self.keras_local_saver = KerasLocalModelSaver(local_model_result_folder_path, checkpoint_model)
