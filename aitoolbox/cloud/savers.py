"""What aitoolbox 1.8's S3 and Google Cloud Storage savers and loaders share, for any :class:`CloudStorage`.

The classes at 1.8's import paths (``aitoolbox.cloud.AWS.*``, ``aitoolbox.cloud.GoogleCloud.*``) are these
with the service chosen. A saver writes locally with this package's local savers (crash-safe files in the
experiment folder), then uploads: at once, retrying transient errors, or through a :class:`CloudUploader` given
as ``uploader`` (in the background; its ``wait()`` reports failures). The local copy is always kept.
"""
import logging
import os
from typing import Any, List, Optional, Tuple

from aitoolbox.cloud.layout import CHECKPOINT_DIR, FINAL_MODEL_DIR, RESULTS_DIR, ExperimentKeys
from aitoolbox.cloud.storage import CloudStorage, join_key
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.local_save.experiment_folder import timestamp_now

logger = logging.getLogger(__name__)


class CloudDataSaver:
    """Upload files and folders to one bucket (1.8's ``BaseDataSaver`` / ``BaseGoogleStorageDataSaver``).

    Args:
        bucket_name: the bucket.
        uploader: upload in the background through this uploader (of the same bucket) instead of at once.
    """

    def __init__(self, bucket_name: str = "model-result", uploader: Optional[CloudUploader] = None):
        if uploader is not None and uploader.storage.bucket_name != bucket_name:
            raise ValueError(f"the uploader writes to the bucket {uploader.storage.bucket_name!r}, not to "
                             f"bucket_name={bucket_name!r}: pass an uploader of the same bucket")
        self.bucket_name = bucket_name
        self.uploader = uploader
        self.storage: CloudStorage = uploader.storage if uploader is not None else self._make_storage(bucket_name)

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        raise NotImplementedError(f"{type(self).__name__} does not say which cloud service to use")

    def save_file(self, local_file_path: str, cloud_file_path: str) -> None:
        """Upload the local file to ``cloud_file_path`` in the bucket (in the background with an uploader).

        Raises:
            FileNotFoundError: the local file does not exist.
            CloudStorageError: the upload failed (without an uploader; with one, its ``wait()`` raises).
        """
        local_file_path = os.path.expanduser(local_file_path)
        if self.uploader is not None:
            self.uploader.submit(local_file_path, cloud_file_path)
        else:
            self.storage.upload_file(local_file_path, cloud_file_path)

    def save_folder(self, local_folder_path: str, cloud_folder_path: str) -> None:
        """Upload what is inside the local folder to ``cloud_folder_path/...`` (the folder's own name is not
        added: end ``cloud_folder_path`` with it to keep it), with a completion marker written last."""
        local_folder_path = os.path.expanduser(local_folder_path)
        if self.uploader is not None:
            self.uploader.submit_folder(local_folder_path, cloud_folder_path)
        else:
            self.storage.upload_folder(local_folder_path, cloud_folder_path)


class CloudDataLoader:
    """Download files from one bucket, skipping files already on the local disk (1.8's ``BaseDataLoader``).

    Args:
        bucket_name: the bucket.
        local_folder_path: the local folder the files belong in (``~`` is expanded).
    """

    def __init__(self, bucket_name: str, local_folder_path: str):
        self.bucket_name = bucket_name
        self.storage: CloudStorage = self._make_storage(bucket_name)
        self._local_folder_path = os.path.expanduser(local_folder_path)

    def _make_storage(self, bucket_name: str) -> CloudStorage:
        raise NotImplementedError(f"{type(self).__name__} does not say which cloud service to use")

    def load_file(self, cloud_file_path: str, local_file_path: str) -> str:
        """Download ``cloud_file_path`` to ``local_file_path`` unless that file already exists.

        The file appears only once complete, so an existing file is a complete earlier download.

        Returns:
            The local path.

        Raises:
            CloudNotFoundError: the bucket has no such object (1.8 printed a message and went on).
        """
        local_file_path = os.path.expanduser(local_file_path)
        if os.path.isfile(local_file_path):
            logger.info("%s is already on the local disk: not downloading %s", local_file_path,
                        self.storage.uri(cloud_file_path))
            return local_file_path
        logger.info("Downloading %s to %s", self.storage.uri(cloud_file_path), local_file_path)
        return self.storage.download_file(cloud_file_path, local_file_path)

    def load_folder(self, cloud_folder_path: str, local_folder_path: str) -> str:
        """Download a complete folder (one uploaded with its completion marker) unless it is already local."""
        local_folder_path = os.path.expanduser(local_folder_path)
        if os.path.isdir(local_folder_path):
            logger.info("%s is already on the local disk: not downloading %s/", local_folder_path,
                        self.storage.uri(cloud_folder_path))
            return local_folder_path
        return self.storage.download_folder(cloud_folder_path, local_folder_path)


class ModelFolderMixin:
    """1.8's model savers' folder in the bucket; needs ``cloud_dir_prefix``, ``checkpoint_model``, ``bucket_name``
    and ``save_file``."""

    cloud_dir_prefix: str
    checkpoint_model: bool
    bucket_name: str

    def create_experiment_cloud_storage_folder_structure(self, project_name: str, experiment_name: str,
                                                         experiment_timestamp: str) -> str:
        """``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/model`` (``checkpoint_model`` for
        checkpoints): the key of the folder the models go in. Nothing is created: buckets have no folders."""
        keys = ExperimentKeys(self.cloud_dir_prefix, project_name, experiment_name, experiment_timestamp)
        return keys.folder(CHECKPOINT_DIR if self.checkpoint_model else FINAL_MODEL_DIR)

    def _save_and_upload(self, local_saver: Any, model: Any, project_name: str, experiment_name: str,
                         experiment_timestamp: Optional[str], epoch: Optional[int], iteration_idx: Optional[int],
                         protect_existing_folder: bool) -> Tuple[str, str, str]:
        experiment_timestamp = experiment_timestamp or timestamp_now()
        model_name, model_local_path = local_saver.save_model(model, project_name, experiment_name,
                                                              experiment_timestamp, epoch, iteration_idx,
                                                              protect_existing_folder)
        model_key = join_key(self.create_experiment_cloud_storage_folder_structure(
            project_name, experiment_name, experiment_timestamp), model_name)
        self.save_file(local_file_path=model_local_path, cloud_file_path=model_key)
        return join_key(self.bucket_name, model_key), experiment_timestamp, model_local_path


class ResultsFolderMixin:
    """1.8's results savers' folder in the bucket; needs ``cloud_dir_prefix``, ``bucket_name`` and ``save_file``."""

    cloud_dir_prefix: str
    bucket_name: str

    def create_experiment_cloud_storage_folder_structure(self, project_name: str, experiment_name: str,
                                                         experiment_timestamp: str) -> str:
        """``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/results``: the key of the results folder."""
        return ExperimentKeys(self.cloud_dir_prefix, project_name, experiment_name,
                              experiment_timestamp).folder(RESULTS_DIR)

    def _save_and_upload_results(self, local_results_saver: Any, result_package: Any, training_history: Any,
                                 project_name: str, experiment_name: str, experiment_timestamp: Optional[str],
                                 save_true_pred_labels: bool, separate_files: bool,
                                 protect_existing_folder: bool) -> Tuple[str, str]:
        experiment_timestamp = experiment_timestamp or timestamp_now()
        save = local_results_saver.save_experiment_results_separate_files if separate_files \
            else local_results_saver.save_experiment_results
        saved: List[List[str]] = save(result_package, training_history, project_name, experiment_name,
                                      experiment_timestamp, save_true_pred_labels, protect_existing_folder)
        results_folder_key = self.create_experiment_cloud_storage_folder_structure(project_name, experiment_name,
                                                                                   experiment_timestamp)
        for path_in_results_dir, local_path in saved:
            self.save_file(local_file_path=local_path, cloud_file_path=join_key(results_folder_key,
                                                                                path_in_results_dir))
        # The first entry is the main results file; the package's extra files and the plots follow it.
        return join_key(self.bucket_name, results_folder_key, saved[0][0]), experiment_timestamp
