"""aitoolbox 1.x's ``cloud.AWS.results_save``: save experiment results locally, then upload them to S3.

Keys: ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/results/<file>`` (plots in ``results/plots/``).
"""
from abc import ABC, abstractmethod
from typing import Any, Optional, Tuple

from aitoolbox.cloud.AWS.data_access import BaseDataSaver
from aitoolbox.cloud.savers import ResultsFolderMixin
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.local_save.local_results_save import LocalResultsSaver

__all__ = ["AbstractResultsSaver", "BaseResultsSaver", "S3ResultsSaver"]


class AbstractResultsSaver(ABC):
    """The interface of the cloud results savers."""

    @abstractmethod
    def save_experiment_results(self, result_package: Any, training_history: Any, project_name: str,
                                experiment_name: str, experiment_timestamp: Optional[str] = None,
                                save_true_pred_labels: bool = False, separate_files: bool = False,
                                protect_existing_folder: bool = True) -> Tuple[str, str]:
        """Save the results locally and upload them.

        Returns:
            ``(<bucket>/<key> of the main results file, experiment timestamp)``.
        """


class BaseResultsSaver(ResultsFolderMixin, BaseDataSaver):
    """S3 results saving: the bucket and the results folder in it.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "", *,
                 uploader: Optional[CloudUploader] = None):
        BaseDataSaver.__init__(self, bucket_name, uploader=uploader)
        self.cloud_dir_prefix = cloud_dir_prefix


class S3ResultsSaver(AbstractResultsSaver, BaseResultsSaver):
    """Save results with :class:`LocalResultsSaver` (JSON files and plots), then upload each file to S3.

    Args:
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: upload in the background through this uploader instead of at once (not in aitoolbox 1.x).
    """

    def __init__(self, bucket_name: str = "model-result", cloud_dir_prefix: str = "",
                 local_model_result_folder_path: str = "~/project/model_result", *,
                 uploader: Optional[CloudUploader] = None):
        BaseResultsSaver.__init__(self, bucket_name, cloud_dir_prefix, uploader=uploader)
        self.local_results_saver = LocalResultsSaver(local_model_result_folder_path)

    def save_experiment_results(self, result_package: Any, training_history: Any, project_name: str,
                                experiment_name: str, experiment_timestamp: Optional[str] = None,
                                save_true_pred_labels: bool = False, separate_files: bool = False,
                                protect_existing_folder: bool = True) -> Tuple[str, str]:
        """Save the results locally, then upload every file written (results, extra files, plots).

        Args:
            result_package: the evaluated result package.
            training_history: the TrainLoop's training history.
            project_name: the project's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp; the current time when None.
            save_true_pred_labels: save the ground truth and predicted labels too.
            separate_files: results, hyperparameters and history in separate files instead of one.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility (folders are never emptied).

        Returns:
            ``(<bucket>/<key> of the main results file, experiment timestamp)``.
        """
        return self._save_and_upload_results(self.local_results_saver, result_package, training_history,
                                             project_name, experiment_name, experiment_timestamp,
                                             save_true_pred_labels, separate_files, protect_existing_folder)
