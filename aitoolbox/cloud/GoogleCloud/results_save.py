"""aitoolbox 1.x's ``cloud.GoogleCloud.results_save``: save experiment results locally, then upload them to
Google Cloud Storage under ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/results/``."""
from typing import Optional

from aitoolbox.cloud.AWS.results_save import S3ResultsSaver
from aitoolbox.cloud.GoogleCloud.data_access import BaseGoogleStorageDataSaver
from aitoolbox.cloud.savers import ResultsFolderMixin
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.local_save.local_results_save import LocalResultsSaver

__all__ = ["BaseResultsGoogleStorageSaver", "GoogleStorageResultsSaver"]


class BaseResultsGoogleStorageSaver(ResultsFolderMixin, BaseGoogleStorageDataSaver):
    """Google Cloud Storage results saving: the bucket and the results folder in it.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "", *,
                 uploader: Optional[CloudUploader] = None):
        BaseGoogleStorageDataSaver.__init__(self, bucket_name, uploader=uploader)
        self.cloud_dir_prefix = cloud_dir_prefix


class GoogleStorageResultsSaver(BaseResultsGoogleStorageSaver, S3ResultsSaver):
    """Save results with :class:`LocalResultsSaver`, then upload each file to Google Cloud Storage.

    ``save_experiment_results`` is :meth:`S3ResultsSaver.save_experiment_results`, uploading to GCS.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result", *,
                 uploader: Optional[CloudUploader] = None):
        BaseResultsGoogleStorageSaver.__init__(self, bucket_name, cloud_dir_prefix, uploader=uploader)
        self.local_results_saver = LocalResultsSaver(local_model_result_folder_path)
