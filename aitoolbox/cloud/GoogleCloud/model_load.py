"""aitoolbox 1.x's ``cloud.GoogleCloud.model_load``: download a saved model from Google Cloud Storage and load
it with a local loader (keys as the savers write them, see :mod:`aitoolbox.cloud.layout`)."""
from typing import Any

from aitoolbox.cloud.AWS.model_load import PyTorchS3ModelLoader
from aitoolbox.cloud.GoogleCloud.data_access import BaseGoogleStorageDataLoader
from aitoolbox.cloud.loaders import ModelLoaderMixin
from aitoolbox.experiment.local_load.local_model_load import AbstractLocalModelLoader, PyTorchLocalModelLoader

__all__ = ["BaseModelGoogleStorageLoader", "PyTorchGoogleStorageModelLoader"]


class BaseModelGoogleStorageLoader(ModelLoaderMixin, BaseGoogleStorageDataLoader):
    """Download a model from Google Cloud Storage and load it with ``local_model_loader``.

    Args:
        local_model_loader: loads the downloaded file (e.g. :class:`PyTorchLocalModelLoader`).
        local_model_result_folder_path: the local folder that holds the projects.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
    """

    def __init__(self, local_model_loader: AbstractLocalModelLoader,
                 local_model_result_folder_path: str = "~/project/model_result", bucket_name: str = "model-result",
                 cloud_dir_prefix: str = ""):
        BaseGoogleStorageDataLoader.__init__(self, bucket_name, local_model_result_folder_path)
        self.local_model_result_folder_path = self.local_dataset_folder_path
        self.cloud_dir_prefix = cloud_dir_prefix
        self.local_model_loader: Any = local_model_loader
        self._check_local_loader()


class PyTorchGoogleStorageModelLoader(BaseModelGoogleStorageLoader, PyTorchS3ModelLoader):
    """Download a PyTorch model or checkpoint from Google Cloud Storage and load it with
    :class:`PyTorchLocalModelLoader`.

    Call :meth:`load_model` first, then ``init_model``, ``init_optimizer``, ``init_scheduler``, ``init_amp``.

    Args:
        local_model_result_folder_path: the local folder that holds the projects.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
    """

    def __init__(self, local_model_result_folder_path: str = "~/project/model_result",
                 bucket_name: str = "model-result", cloud_dir_prefix: str = ""):
        BaseModelGoogleStorageLoader.__init__(self, PyTorchLocalModelLoader(local_model_result_folder_path),
                                              local_model_result_folder_path, bucket_name, cloud_dir_prefix)
