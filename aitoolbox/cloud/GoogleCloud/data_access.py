"""aitoolbox 1.x's ``cloud.GoogleCloud.data_access``: upload files to and download files from a Google Cloud
Storage bucket.

The client is :class:`~aitoolbox.cloud.gcs.GCSStorage` (google-cloud-storage, configured the standard Google
way or through ``STORAGE_EMULATOR_HOST``; retries transient errors, raises
:class:`~aitoolbox.cloud.storage.CloudStorageError` naming bucket and key). Needs ``pip install aitoolbox[gcs]``.
Unlike aitoolbox 1.x, constructing a saver or loader makes no request: a missing bucket is reported by the
first upload or download, with its name.
"""
import os
from typing import Any, List, Optional

from aitoolbox.cloud.gcs import GCSStorage
from aitoolbox.cloud.savers import CloudDataLoader, CloudDataSaver
from aitoolbox.cloud.storage import CloudStorage
from aitoolbox.cloud.uploader import CloudUploader

__all__ = ["BaseGoogleStorageDataSaver", "BaseGoogleStorageDataLoader"]


class _GoogleStorageClients:
    storage: GCSStorage

    @property
    def gcs_client(self) -> Any:
        """The ``google.cloud.storage.Client`` (made on first use)."""
        return self.storage.client

    @property
    def gcs_bucket(self) -> Any:
        """The client's ``Bucket`` object of the bucket."""
        return self.storage.bucket


class BaseGoogleStorageDataSaver(_GoogleStorageClients, CloudDataSaver):
    """Upload files and folders to a Google Cloud Storage bucket.

    Args:
        bucket_name: the bucket.
        uploader: upload in the background through this :class:`~aitoolbox.cloud.uploader.CloudUploader` (of
            the same bucket) instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", *, uploader: Optional[CloudUploader] = None):
        CloudDataSaver.__init__(self, bucket_name, uploader)

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        return GCSStorage(bucket_name)


class BaseGoogleStorageDataLoader(_GoogleStorageClients, CloudDataLoader):
    """Download files from a Google Cloud Storage bucket into a local data folder.

    Args:
        bucket_name: the bucket.
        local_dataset_folder_path: the local folder that holds the data sets (``~`` is expanded).
    """

    def __init__(self, bucket_name: str = "dataset-store", local_dataset_folder_path: str = "~/project/data"):
        CloudDataLoader.__init__(self, bucket_name, local_dataset_folder_path)
        self.local_dataset_folder_path = os.path.expanduser(local_dataset_folder_path)
        self.available_prepocessed_datasets: List[str] = []

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        return GCSStorage(bucket_name)
