"""aitoolbox 1.x's ``cloud.AWS.data_access``: upload files to and download files from an AWS S3 bucket.

The S3 client is :class:`~aitoolbox.cloud.s3.S3Storage` (boto3, configured the standard AWS way; retries
transient errors, raises :class:`~aitoolbox.cloud.storage.CloudStorageError` naming bucket and key). Needs
``pip install aitoolbox[aws]``.
"""
import logging
import os
import shutil
from abc import ABC, abstractmethod
from typing import Any, List, Optional

from aitoolbox.cloud.s3 import S3Storage
from aitoolbox.cloud.savers import CloudDataLoader, CloudDataSaver
from aitoolbox.cloud.storage import CloudStorage
from aitoolbox.cloud.uploader import CloudUploader

__all__ = ["BaseDataSaver", "BaseDataLoader", "AbstractDatasetFetcher"]

logger = logging.getLogger(__name__)


class BaseDataSaver(CloudDataSaver):
    """Upload files and folders to an S3 bucket.

    Args:
        bucket_name: the bucket.
        uploader: upload in the background through this :class:`~aitoolbox.cloud.uploader.CloudUploader` (of
            the same bucket) instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", *, uploader: Optional[CloudUploader] = None):
        CloudDataSaver.__init__(self, bucket_name, uploader)

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        return S3Storage(bucket_name)

    @property
    def s3_client(self) -> Any:
        """The boto3 S3 client (made on first use)."""
        return self.storage.client


class BaseDataLoader(CloudDataLoader):
    """Download files from an S3 bucket into a local data folder.

    Args:
        bucket_name: the bucket.
        local_base_data_folder_path: the local folder that holds the data sets (``~`` is expanded).
    """

    def __init__(self, bucket_name: str = "dataset-store", local_base_data_folder_path: str = "~/project/data"):
        CloudDataLoader.__init__(self, bucket_name, local_base_data_folder_path)
        self.local_base_data_folder_path = os.path.expanduser(local_base_data_folder_path)
        self.available_prepocessed_datasets: List[str] = []

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        return S3Storage(bucket_name)

    @property
    def s3_client(self) -> Any:
        """The boto3 S3 client (made on first use)."""
        return self.storage.client

    def exists_local_data_folder(self, data_folder_name: str, protect_local_folder: bool = True) -> bool:
        """Whether ``<local_base_data_folder_path>/<data_folder_name>`` is there to be used as it is.

        Returns:
            True when the folder exists and ``protect_local_folder``. Otherwise the folder is made empty (an
            existing one is deleted first, as in aitoolbox 1.x) and False is returned: the data must be fetched.
        """
        path = os.path.join(self.local_base_data_folder_path, data_folder_name)
        if os.path.exists(path):
            if protect_local_folder:
                logger.info("Local folder %s exists and protect_local_folder is True: using it as it is", path)
                return True
            logger.info("Local folder %s exists and protect_local_folder is False: deleting it", path)
            shutil.rmtree(path)
        os.makedirs(path)
        return False

    def preproc_dataset_available(self, preproc_dataset_name: str) -> bool:
        """Whether ``preproc_dataset_name`` is among :attr:`available_prepocessed_datasets`."""
        return preproc_dataset_name in self.available_prepocessed_datasets


class AbstractDatasetFetcher(ABC):
    """The interface of data set fetchers built on :class:`BaseDataLoader`."""

    @abstractmethod
    def fetch_dataset(self, dataset_name: Optional[str] = None, protect_local_folder: bool = True) -> None:
        """Download the data set into the local data folder.

        Args:
            dataset_name: which data set (for fetchers of several); None for the default.
            protect_local_folder: keep an existing local copy instead of downloading again.
        """
