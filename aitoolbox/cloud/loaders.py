"""What aitoolbox 1.8's S3 and Google Cloud Storage model loaders share: download a saved model, then load it
with a local loader (:class:`~aitoolbox.experiment.local_load.local_model_load.PyTorchLocalModelLoader` by
default).

Whatever is in the bucket, loading runs no code from it: the local loader reads the downloaded file with
aitoolbox's restricted reader and refuses other pickled objects (``weights_only=False`` on the loading call
allows them: only for files you trust); damaged files raise ``CorruptCheckpointError`` (see the Security page). Downloads stay inside the local experiment folder (see
:meth:`~aitoolbox.cloud.storage.CloudStorage.download_folder`).

The model is downloaded into the same place of the local experiment folder that the savers wrote it to, so a
model saved on this machine is not downloaded again.
"""
import os
from typing import Any, List, Optional

from aitoolbox.cloud.layout import ExperimentKeys, download_checkpoint, find_newest_cloud_checkpoint
from aitoolbox.cloud.storage import CloudStorage
from aitoolbox.experiment.local_load.local_model_load import AbstractLocalModelLoader
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder
from aitoolbox.experiment.local_save.local_model_save import model_file_name


class ModelLoaderMixin:
    """``load_model`` of 1.8's cloud model loaders and the ``init_*`` methods handed to the local loader.

    Needs ``storage``, ``cloud_dir_prefix``, ``local_model_result_folder_path``, ``local_model_loader`` and
    ``load_file``.
    """

    storage: CloudStorage
    cloud_dir_prefix: str
    local_model_result_folder_path: str
    local_model_loader: AbstractLocalModelLoader

    def _check_local_loader(self) -> None:
        if not isinstance(self.local_model_loader, AbstractLocalModelLoader):
            raise TypeError(f"local_model_loader must be an AbstractLocalModelLoader (e.g. PyTorchLocalModelLoader), "
                            f"got {type(self.local_model_loader).__name__}")

    def load_model(self, project_name: str, experiment_name: str, experiment_timestamp: str,
                   model_save_dir: str = "checkpoint_model", epoch_num: Optional[int] = None, *,
                   weights_only: bool = True, **kwargs: Any) -> Any:
        """Download the saved model (unless it is already local) and load it with the local loader.

        The model is ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/<model_save_dir>/`` +
        ``model_<experiment>_<timestamp>[_E<epoch_num>[_ITER<iteration_idx>]].pth``, downloaded to the same
        path inside ``local_model_result_folder_path``. A sharded checkpoint (a folder of that name without
        ``.pth``) is downloaded whole, once complete, and loaded with the local loader's ``load_model_from_path``.

        Args:
            project_name: the project's name.
            experiment_name: the experiment's name.
            experiment_timestamp: the run's timestamp.
            model_save_dir: ``'checkpoint_model'`` (checkpoints) or ``'model'`` (the final model).
            epoch_num: the checkpoint's epoch; None for the final model.
            weights_only: False lets the local loader unpickle the file fully, which runs whatever code it names:
                only for files you trust (passed on to the local loader only when False).
            **kwargs: for the local loader's ``load_model`` (``map_location``, ``iteration_idx``).

        Returns:
            The model representation (the checkpoint dict for PyTorch).

        Raises:
            CloudNotFoundError: the bucket (or the model in it) does not exist; the message names both.
            CloudStorageError: the download failed.
            ValueError: a sharded checkpoint's folder marker in the bucket lists a name outside the folder.
            UntrustedCheckpointError: the file holds objects only full unpickling can build (nothing was run).
            CorruptCheckpointError: the downloaded file (or folder) is damaged or not a checkpoint.
            CheckpointLoadError: see :mod:`~aitoolbox.experiment.local_save.safe_load`.
        """
        trust = {} if weights_only else {"weights_only": False}
        keys = ExperimentKeys(self.cloud_dir_prefix, project_name, experiment_name, experiment_timestamp)
        name = model_file_name(experiment_name, experiment_timestamp, epoch_num, kwargs.get("iteration_idx"))
        experiment_path = ExperimentFolder.create_base_folder(project_name, experiment_name, experiment_timestamp,
                                                              self.local_model_result_folder_path)
        local_folder = os.path.join(experiment_path, model_save_dir)
        local_path = os.path.join(local_folder, name)
        cloud_path = keys.experiment_file(f"{model_save_dir}/{name}")
        if name.endswith(".pth") and not os.path.isfile(local_path) and not self.storage.exists(cloud_path):
            # No such file: a sharded checkpoint is the folder of that name without .pth, once complete.
            folder_key = cloud_path[:-len(".pth")]
            if self.storage.folder_manifest(folder_key) is not None:
                folder = self.load_folder(folder_key, local_path[:-len(".pth")])
                return self.local_model_loader.load_model_from_path(folder, kwargs.get("map_location"), **trust)
        self.load_file(cloud_path, local_path)  # raises CloudNotFoundError naming the key when it is missing
        return self.local_model_loader.load_model(project_name, experiment_name, experiment_timestamp,
                                                  model_save_dir, epoch_num, **trust, **kwargs)

    def load_newest_checkpoint(self, project_name: str, experiment_name: str, experiment_timestamp: str,
                               map_location: Any = None, *, weights_only: bool = True) -> Any:
        """Download the newest complete checkpoint of a run from the bucket and load it (not in aitoolbox 1.8).

        Args:
            weights_only: as for :meth:`load_model`.

        Returns:
            The model representation, as :meth:`load_model`.

        Raises:
            CloudNotFoundError: the run has no complete checkpoint in the bucket.
            CloudStorageError / ValueError / UntrustedCheckpointError / CorruptCheckpointError /
            CheckpointLoadError: as :meth:`load_model`.
        """
        keys = ExperimentKeys(self.cloud_dir_prefix, project_name, experiment_name, experiment_timestamp)
        key = find_newest_cloud_checkpoint(self.storage, keys.experiment)
        experiment_path = ExperimentFolder.create_base_folder(project_name, experiment_name, experiment_timestamp,
                                                              self.local_model_result_folder_path)
        relative_folder = os.path.dirname(key[len(keys.experiment) + 1:])
        local_path = download_checkpoint(self.storage, key, os.path.join(experiment_path, relative_folder))
        trust = {} if weights_only else {"weights_only": False}
        return self.local_model_loader.load_model_from_path(local_path, map_location, **trust)

    def init_model(self, model: Any, used_data_parallel: bool = False) -> Any:
        """Put the loaded weights into ``model`` (see the local loader)."""
        return self.local_model_loader.init_model(model, used_data_parallel)

    def init_optimizer(self, optimizer: Any, device: str = "cuda") -> Any:
        """Put the loaded optimizer state into ``optimizer`` (see the local loader)."""
        return self.local_model_loader.init_optimizer(optimizer, device)

    def init_scheduler(self, scheduler_callbacks_list: List[Any], ignore_saved: bool = False,
                       ignore_missing_saved: bool = False) -> List[Any]:
        """Put the loaded LR scheduler states into the scheduler callbacks (see the local loader)."""
        return self.local_model_loader.init_scheduler(scheduler_callbacks_list, ignore_saved, ignore_missing_saved)

    def init_amp(self, amp_scaler: Any) -> Any:
        """Put the loaded AMP GradScaler state into ``amp_scaler`` (see the local loader)."""
        return self.local_model_loader.init_amp(amp_scaler)
