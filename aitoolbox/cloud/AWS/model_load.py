"""aitoolbox 1.x's ``cloud.AWS.model_load``: download a saved model from S3 and load it with a local loader.

The model is found where the S3 model savers put it (see :mod:`aitoolbox.cloud.layout`) and downloaded to the
same place in the local experiment folder; a model already there is not downloaded again.
"""
from typing import Any

from aitoolbox.cloud.AWS.data_access import BaseDataLoader
from aitoolbox.cloud.loaders import ModelLoaderMixin
from aitoolbox.experiment.local_load.local_model_load import AbstractLocalModelLoader, PyTorchLocalModelLoader

__all__ = ["BaseModelLoader", "PyTorchS3ModelLoader"]


class BaseModelLoader(ModelLoaderMixin, BaseDataLoader):
    """Download a model from S3 and load it with ``local_model_loader``.

    Args:
        local_model_loader: loads the downloaded file (e.g. :class:`PyTorchLocalModelLoader`).
        local_model_result_folder_path: the local folder that holds the projects.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
    """

    def __init__(self, local_model_loader: AbstractLocalModelLoader,
                 local_model_result_folder_path: str = "~/project/model_result", bucket_name: str = "model-result",
                 cloud_dir_prefix: str = ""):
        BaseDataLoader.__init__(self, bucket_name, local_model_result_folder_path)
        self.local_model_result_folder_path = self.local_base_data_folder_path
        self.cloud_dir_prefix = cloud_dir_prefix
        self.local_model_loader: Any = local_model_loader
        self._check_local_loader()


class PyTorchS3ModelLoader(BaseModelLoader):
    """Download a PyTorch model or checkpoint from S3 and load it with :class:`PyTorchLocalModelLoader`.

    Call :meth:`load_model` first, then ``init_model``, ``init_optimizer``, ``init_scheduler``, ``init_amp``.

    Args:
        local_model_result_folder_path: the local folder that holds the projects.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
    """

    def __init__(self, local_model_result_folder_path: str = "~/project/model_result",
                 bucket_name: str = "model-result", cloud_dir_prefix: str = ""):
        BaseModelLoader.__init__(self, PyTorchLocalModelLoader(local_model_result_folder_path),
                                 local_model_result_folder_path, bucket_name, cloud_dir_prefix)
