"""Continue training from a saved checkpoint."""
import logging
import os
from typing import Optional

from aitoolbox.cloud.layout import ExperimentKeys, download_checkpoint, list_cloud_checkpoints
from aitoolbox.cloud.storage import CloudNotFoundError
from aitoolbox.experiment.local_save.checkpoints import (
    MODEL_KEY, SCHEDULERS_KEY, checkpoint_position, failures_named, list_checkpoints, load_checkpoint_file,
    upgrade_checkpoint_format)
from aitoolbox.experiment.local_save.local_model_save import model_file_name
from aitoolbox.experiment.local_save.names import check_name
from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint
from aitoolbox.torchtrain.callbacks.abstract import _CLOUD_ARGUMENTS, _FOLDER_ARGUMENTS, AbstractCallback
from aitoolbox.torchtrain.callbacks.cloud_upload import (
    CloudDestination, check_cloud_save_mode, cloud_destination, loop_cloud_destination)

logger = logging.getLogger(__name__)


def strip_data_parallel_prefix(state_dict: dict, model) -> dict:
    """``state_dict`` without the ``module.`` prefix a (Distributed)DataParallel wrapper adds, when the model's own
    keys have none (a 1.x file saved from a ``TTDataParallel`` model)."""
    model_keys = set(model.state_dict())
    if set(state_dict) == model_keys or not all(key.startswith("module.") for key in state_dict):
        return state_dict
    stripped = {key[len("module."):]: value for key, value in state_dict.items()}
    return stripped if set(stripped) == model_keys else state_dict


class ModelLoadContinueTraining(AbstractCallback):
    """Load a checkpoint into the TrainLoop when registered, so ``fit`` continues from it.

    A checkpoint written by this package continues bitwise (same data loaders and callbacks given); one written
    by aitoolbox 1.x continues from the epoch after the saved one, with its model, optimizer, LR scheduler and
    AMP scaler states.

    Name the checkpoint aitoolbox 1.x style by the experiment folder parts (the three folder arguments default to
    those of the experiment-tracking TrainLoop the callback is used with), or by its file or folder
    (``saved_model_path``).

    Args:
        saved_experiment_timestamp: timestamp of the run to continue.
        saved_model_dir: ``'checkpoint_model'`` (default) or ``'model'`` (the final model of a finished run).
        epoch_num: continue from the checkpoint of this epoch; None takes the newest file of ``saved_model_dir``.
        ignore_saved_schedulers: do not restore the LR schedulers' states.
        ignore_missing_saved_schedulers: when the checkpoint's schedulers do not match the registered ones, warn
            and leave the schedulers as they are instead of failing.
        used_data_parallel: accepted for 1.x compatibility; ``module.`` prefixes of a DataParallel-saved model are
            removed whenever the model's own keys have none.
        custom_local_loader_class: a class built as ``cls(local_model_result_folder_path)`` whose
            ``load_model(project_name, experiment_name, saved_experiment_timestamp, saved_model_dir, epoch_num,
            **kwargs)`` returns the checkpoint dict.
        project_name, experiment_name, local_model_result_folder_path: the saved run's experiment folder.
        cloud_save_mode: load from a bucket: ``'s3'`` / ``'aws_s3'`` / ``'aws'`` or ``'gcs'`` /
            ``'google_storage'`` / ``'google storage'``. The checkpoint (a file, or a sharded checkpoint's complete
            folder) is downloaded into the same place of the local experiment folder, unless it is there already,
            then loaded from there. With ``epoch_num=None`` the newest complete checkpoint in the bucket is taken
            (or the local one, when it is newer). None or ``'local'``: the local disk only. When
            ``cloud_save_mode``, ``bucket_name`` and ``cloud_dir_prefix`` are all None, the TrainLoop's are taken
            (an experiment-tracking preset's), as in aitoolbox 1.x.
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        saved_model_path: a checkpoint file, a run folder, or its checkpoint folder (instead of the above).
        weights_only: True (the default) reads the checkpoint with aitoolbox's restricted reader, which runs no
            code from the file and refuses files holding other Python objects than tensors and plain data
            (:class:`~aitoolbox.experiment.local_save.safe_load.UntrustedCheckpointError`, raised when the
            callback is registered; a damaged file raises ``CorruptCheckpointError``, a checkpoint that does not
            fit the loop ``CheckpointMismatchError``, both naming the file). False unpickles fully, which runs whatever code the file names: only for
            files you trust. With ``custom_local_loader_class`` it is passed to its ``load_model`` when False.
        **kwargs: passed to ``custom_local_loader_class.load_model``.
    """

    def __init__(self, saved_experiment_timestamp: Optional[str] = None, saved_model_dir: str = "checkpoint_model",
                 epoch_num: Optional[int] = None, ignore_saved_schedulers: bool = False,
                 ignore_missing_saved_schedulers: bool = False, used_data_parallel: bool = False,
                 custom_local_loader_class: Optional[type] = None, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, saved_model_path: Optional[str] = None, *,
                 weights_only: bool = True, **kwargs):
        super().__init__("Continue training from a checkpoint", execution_order=-100)
        check_cloud_save_mode(cloud_save_mode, type(self).__name__)
        if saved_model_path is None and saved_experiment_timestamp is None:
            raise ValueError("ModelLoadContinueTraining needs saved_experiment_timestamp (with the experiment folder "
                             "arguments, or used with a TrainLoopCheckpoint-style TrainLoop) or saved_model_path")
        if epoch_num is not None and (isinstance(epoch_num, bool) or not isinstance(epoch_num, int) or epoch_num < 0):
            raise ValueError(f"epoch_num must be None or a non-negative int, got {epoch_num!r}")
        self.saved_experiment_timestamp = saved_experiment_timestamp
        self.saved_model_dir = saved_model_dir
        self.epoch_num = epoch_num
        self.ignore_saved_schedulers = ignore_saved_schedulers
        self.ignore_missing_saved_schedulers = ignore_missing_saved_schedulers
        self.used_data_parallel = used_data_parallel
        self.custom_local_loader_class = custom_local_loader_class
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.local_model_result_folder_path = local_model_result_folder_path
        self.cloud_save_mode = cloud_save_mode
        self.bucket_name = bucket_name
        self.cloud_dir_prefix = cloud_dir_prefix
        self.saved_model_path = saved_model_path
        if not isinstance(weights_only, bool):
            raise TypeError(f"weights_only must be True or False, got {weights_only!r}")
        self.weights_only = weights_only
        self.local_loader_kwargs = kwargs
        self.checkpoint = None
        self._loaded_from: Optional[str] = None  # the file or folder the checkpoint was read from, for errors

    def on_train_loop_registration(self) -> None:
        checkpoint = self._load()
        with failures_named(self._loaded_from):  # what does not fit the loop names the file
            if MODEL_KEY in checkpoint:  # a sharded checkpoint keeps its weights on disk until the model is set up
                checkpoint[MODEL_KEY] = strip_data_parallel_prefix(checkpoint[MODEL_KEY], self.train_loop_obj.model)
            if self.ignore_saved_schedulers:
                checkpoint.pop(SCHEDULERS_KEY, None)
            self.checkpoint = self.train_loop_obj.load_checkpoint(checkpoint, source=self._loaded_from)

    def on_train_begin(self) -> None:
        # The scheduler callbacks are registered by now (fit's callbacks too); their states are restored next.
        pending = self.train_loop_obj.pending_restore
        if not self.ignore_missing_saved_schedulers or pending is None or SCHEDULERS_KEY not in pending:
            return
        registered = len(self.train_loop_obj.get_schedulers())
        if len(pending[SCHEDULERS_KEY]) != registered:
            logger.warning("the checkpoint holds %d LR scheduler state(s) and %d scheduler(s) are registered: the "
                           "schedulers start afresh (ignore_missing_saved_schedulers=True)",
                           len(pending[SCHEDULERS_KEY]), registered)
            pending.pop(SCHEDULERS_KEY)

    def _load(self) -> dict:
        self._loaded_from = self.saved_model_path
        if self.saved_model_path is not None and self.custom_local_loader_class is None:
            return load_checkpoint_file(self.saved_model_path, weights_only=self.weights_only)
        self._infer_folder_details()
        destination = self._cloud_destination()
        if destination is not None:
            self._download(destination)
        if self.custom_local_loader_class is not None:
            loader = self.custom_local_loader_class(self.local_model_result_folder_path)
            trust = {} if self.weights_only else {"weights_only": False}  # 1.x loaders know no such keyword
            return upgrade_checkpoint_format(dict(loader.load_model(
                self.project_name, self.experiment_name, self.saved_experiment_timestamp, self.saved_model_dir,
                self.epoch_num, **trust, **self.local_loader_kwargs)))
        folder = os.path.join(os.path.expanduser(self.local_model_result_folder_path), self.project_name,
                              f"{self.experiment_name}_{self.saved_experiment_timestamp}", self.saved_model_dir)
        self._loaded_from = folder
        if self.epoch_num is None:
            return load_checkpoint_file(folder, weights_only=self.weights_only)
        return load_checkpoint_file(os.path.join(
            folder, f"model_{self.experiment_name}_{self.saved_experiment_timestamp}_E{self.epoch_num}.pth"),
            weights_only=self.weights_only)

    def _infer_folder_details(self) -> None:
        """Fill the folder arguments left None from the experiment-tracking TrainLoop (as 1.x did)."""
        tl = self.train_loop_obj
        for name in _FOLDER_ARGUMENTS:
            if getattr(self, name) is None:
                setattr(self, name, getattr(tl, name, None))
        missing = [name for name in _FOLDER_ARGUMENTS if getattr(self, name) is None]
        if missing:
            raise ValueError(f"ModelLoadContinueTraining does not know {', '.join(missing)}: pass them to the "
                             "callback, use it with TrainLoopCheckpoint / TrainLoopEndSave / "
                             "TrainLoopCheckpointEndSave, or pass saved_model_path")
        for name in ("project_name", "experiment_name", "saved_experiment_timestamp", "saved_model_dir"):
            check_name(getattr(self, name), name)  # they name folders (and keys) the checkpoint is read from

    def _cloud_destination(self) -> Optional[CloudDestination]:
        """The bucket of the callback's cloud arguments or, when all three are None, the TrainLoop's."""
        from_loop = loop_cloud_destination(self.train_loop_obj)
        if all(getattr(self, name) is None for name in _CLOUD_ARGUMENTS):
            return from_loop
        own = cloud_destination(self.cloud_save_mode, self.bucket_name, self.cloud_dir_prefix,
                                owner=type(self).__name__)
        if own is not None and from_loop is not None \
                and (own.service, own.bucket_name) == (from_loop.service, from_loop.bucket_name):
            own = CloudDestination(own.cloud_save_mode, own.service, own.bucket_name, own.cloud_dir_prefix,
                                   from_loop.storage_options)
        return own

    def _download(self, destination: CloudDestination) -> None:
        """Bring the checkpoint to load from the bucket into the local experiment folder (unless it is there)."""
        storage = destination.storage()
        keys = ExperimentKeys(destination.cloud_dir_prefix, self.project_name, self.experiment_name,
                              self.saved_experiment_timestamp)
        folder_key = keys.folder(self.saved_model_dir)
        local_folder = os.path.join(os.path.expanduser(self.local_model_result_folder_path), self.project_name,
                                    f"{self.experiment_name}_{self.saved_experiment_timestamp}", self.saved_model_dir)
        if self.epoch_num is not None or self.custom_local_loader_class is not None:
            # A named file (1.x: the final model when epoch_num is None), or the sharded folder of that name.
            name = model_file_name(self.experiment_name, self.saved_experiment_timestamp, self.epoch_num,
                                   self.local_loader_kwargs.get("iteration_idx"))
            local_path = os.path.join(local_folder, name)
            if os.path.isfile(local_path) or is_sharded_checkpoint(local_path[:-len(".pth")]):
                return
            key = f"{folder_key}/{name}"
            if not storage.exists(key) and storage.folder_manifest(key[:-len(".pth")]) is not None:
                key = key[:-len(".pth")]
            logger.info("Downloading %s to %s", storage.uri(key), local_folder)
            # CloudNotFoundError names the bucket and key. A folder another process placed meanwhile is kept.
            download_checkpoint(storage, key, local_folder, replace=False)
            return
        local = list_checkpoints(local_folder)
        cloud = list_cloud_checkpoints(storage, folder_key)
        if not cloud:
            if local:
                logger.warning("%s has no complete checkpoint; continuing from the local %s", storage.uri(folder_key),
                               local[-1])
                return
            raise CloudNotFoundError(
                f"ModelLoadContinueTraining: no complete checkpoint in {storage.uri(folder_key)}/ (bucket "
                f"{storage.bucket_name!r}, prefix {folder_key!r}) nor in the local folder {local_folder}",
                service=storage.service, bucket=storage.bucket_name, key=folder_key, operation="list",
                reason="NoCheckpoint")
        newest_key = cloud[-1]
        cloud_name = os.path.basename(newest_key)
        if local and _position(os.path.basename(local[-1])) >= _position(cloud_name):
            return  # the newest checkpoint is on the local disk already (or a newer one)
        logger.info("Downloading %s to %s", storage.uri(newest_key), local_folder)
        download_checkpoint(storage, newest_key, local_folder, replace=False)


def _position(name: str):
    return checkpoint_position(name if name.endswith(".pth") else f"{name}.pth")
