"""The callback base classes: every hook TrainLoop calls, as plain methods to override.

:class:`AbstractCallback` is the base of all callbacks. :class:`AbstractExperimentCallback` adds the experiment
details (project, experiment, root folder) of callbacks that write files into an experiment folder.
"""
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.cloud_destination import (
    CloudDestination, check_cloud_save_mode, loop_cloud_destination)
from aitoolbox.torchtrain.callbacks.cloud_destination import cloud_destination as destination_of_arguments

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.callbacks.cloud_upload import CloudUploads
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

_FOLDER_ARGUMENTS = ("project_name", "experiment_name", "local_model_result_folder_path")
_CLOUD_ARGUMENTS = ("cloud_save_mode", "bucket_name", "cloud_dir_prefix")


class AbstractCallback:
    """Base class of all callbacks. Override the hooks you need; the others are never called.

    The loop a callback is registered with is ``self.train_loop_obj``. Read it through its documented
    properties (``epoch``, ``iteration``, ``total_iteration_idx``, ``model``, ``optimizer``,
    ``train_history``, ``device``, ``is_main_process``, ``precision``) and stop training with
    ``self.train_loop_obj.stop_training(reason)``.

    Args:
        callback_name: a name for messages.
        execution_order: callbacks run in increasing order of this number (ties keep registration order).
        device_idx_execution: under distributed training, run only in the process of this global rank;
            None runs in every process.
    """

    def __init__(self, callback_name: str, execution_order: int = 0, device_idx_execution: Optional[int] = None):
        self.callback_name = callback_name
        self.execution_order = execution_order
        self.device_idx_execution = device_idx_execution
        self.train_loop_obj: Optional["TrainLoop"] = None
        # aitoolbox 1.x's message channel between callbacks; set from the loop when it offers one.
        self.message_service: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(callback_name={self.callback_name!r}, execution_order={self.execution_order})"

    def register_train_loop_object(self, train_loop_obj: "TrainLoop") -> "AbstractCallback":
        """Attach the callback to a loop and run :meth:`on_train_loop_registration`.

        The loop's callback handler calls this; it returns the callback itself.
        """
        self.train_loop_obj = train_loop_obj
        self.message_service = getattr(train_loop_obj, "message_service", None)
        self.on_train_loop_registration()
        return self

    def on_train_loop_registration(self) -> None:
        """Right after the callback is attached to the loop: check settings, find what you need."""

    def on_multiprocess_start(self) -> None:
        """In each process of distributed training, once the process group is up and before training."""

    def on_train_begin(self) -> None:
        """Once, before the first epoch of a ``fit`` call."""

    def on_before_train_end(self) -> None:
        """Once, after the last epoch of a ``fit`` call, before the end-of-training evaluations (``train_end_test_loss``,
        the ``on_train_end`` metrics and saves): e.g. to put the weights ``fit`` returns into the model, as
        ``EarlyStopping(restore_best_weights=True)`` does."""

    def on_train_end(self) -> None:
        """Once, after the last epoch of a ``fit`` call (and after the final test-set evaluation)."""

    def on_exception(self, exception: BaseException) -> None:
        """Once, when ``fit`` stops on an exception (``KeyboardInterrupt`` included), before it re-raises it.

        Release what the callback holds: finish or abandon background work, flush and close files. The
        exception is the one the user will see; do not raise another. Should this hook raise all the same, the
        error is logged and the other callbacks' ``on_exception`` still run. A later ``fit`` call may continue
        the training, so leave the callback able to start again at ``on_train_begin``.

        Args:
            exception: what stopped training.
        """

    def on_stop_signal(self) -> None:
        """In every process, at the optimizer step where a stop signal (SIGTERM, SIGHUP: a scheduler's time limit)
        ends training, before the checkpoints for the resume are saved: settle what such a checkpoint must not hold
        half-done (``SpikeRollback`` judges its pending losses here). May raise ``RollBack`` (a rollback's request):
        the run returns to the kept point and stops there (the checkpoint is the point's)."""

    def on_epoch_begin(self) -> None:
        """At the start of every epoch."""

    def on_epoch_train_end(self) -> None:
        """After the last optimizer step of every epoch, before the epoch-end evaluation and ``on_epoch_end``
        (e.g. to put other weights in the model for the evaluation, as ``WeightAveraging`` does)."""

    def on_epoch_end(self) -> None:
        """At the end of every epoch, after the automatic loss evaluation."""

    def on_batch_begin(self) -> None:
        """Before the forward pass of every batch."""

    def on_batch_end(self) -> None:
        """After every batch, once the optimizer has stepped on update iterations."""

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        """After every backward pass (gradients may still be accumulating and scaled).

        Use ``self.train_loop_obj.should_execute_optimizer_update()`` to act only before an optimizer step,
        and ``self.train_loop_obj.unscale_gradients(optimizer)`` to get true gradient values first.
        """

    def on_after_optimizer_step(self) -> None:
        """After the optimizer step of an update iteration; ``optimizer_step_skipped`` tells an overflow skip."""

    def on_after_batch_prediction(self, y_pred_batch: Any, y_test_batch: Any, metadata_batch: Any,
                                  dataset_info: dict) -> None:
        """After each batch of a ``predict_on_*_set`` pass, with that batch's outputs.

        ``dataset_info`` holds ``{'type': 'train' | 'validation' | 'test'}``. The outputs are the loop's own
        objects: read them, do not change them.
        """

    def progress_bar_postfix(self) -> Optional[Dict[str, str]]:
        """Entries to show right of the training progress bar, after the loss (e.g. ``{'samples/s': '1.2e+04'}``),
        or None for none.

        Called between batches while the main process draws the bar, at most twice a second, and once at the
        epoch's end: return values already at hand (reading a CUDA tensor here would wait for the device).
        """
        return None


class MissingExperimentDetailsError(AttributeError, ValueError):
    """The experiment details (project, experiment, root folder) are neither given nor known to the TrainLoop.

    An ``AttributeError`` as in aitoolbox 1.x, and a ``ValueError`` (a bad combination of arguments).
    """


def _check_detail(name: str, value: Optional[str]) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
    if name != "local_model_result_folder_path" and (os.sep in value or value in (".", "..")):
        raise ValueError(f"{name} must be a plain folder name without {os.sep!r}, got {value!r}")


def _claimed_run_folder(tl: Any) -> Optional[ExperimentFolder]:
    """The loop's run folder for a callback that will write into it (a plain TrainLoop's default one), or None for
    a loop without one."""
    claim = getattr(tl, "claim_run_folder", None)
    return claim() if callable(claim) else None


def _folder_key(folder: ExperimentFolder) -> Tuple[str, str, str, str]:
    return folder.root, folder.project_name, folder.experiment_name, folder.timestamp


class AbstractExperimentCallback(AbstractCallback):
    """A callback that writes into an experiment folder ``<root>/<project>/<experiment>_<timestamp>/``.

    Each detail not given here is taken from the TrainLoop when the callback is registered: the
    experiment-tracking presets (``TrainLoopCheckpoint``, ``TrainLoopEndSave``, ``TrainLoopCheckpointEndSave``)
    know all three, and their folder is then shared. With a plain TrainLoop, a callback given none of the three
    writes into the loop's default run folder, ``<working directory>/aitoolbox_runs/run_<timestamp>/``
    (``train_loop_obj.run_folder``), shared by all such callbacks. The timestamp is always the loop's
    (``train_loop_obj.experiment_timestamp``), so callbacks naming the same experiment write into one run
    folder. The folder is created only when the first file is written, in the main process.

    Subclasses that override :meth:`on_train_loop_registration` call ``super().on_train_loop_registration()``
    first. ``self.experiment_folder`` is then the :class:`~aitoolbox.experiment.local_save.ExperimentFolder`
    (reading it raises :class:`MissingExperimentDetailsError` when only some details are given and the loop
    lacks the others). As in aitoolbox 1.x, :meth:`try_infer_experiment_details` fills the missing
    ``project_name`` / ``experiment_name`` / ``local_model_result_folder_path`` attributes from the loop (a plain
    loop's: those of its default run folder).

    Args:
        callback_name: a name for messages.
        project_name: the project folder, or None to take the loop's.
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: also upload the files to a bucket: ``'s3'`` / ``'aws_s3'`` / ``'aws'`` (AWS S3),
            ``'gcs'`` / ``'google_storage'`` / ``'google storage'`` (Google Cloud Storage); None or ``'local'``:
            local files only. When ``cloud_save_mode``, ``bucket_name`` and ``cloud_dir_prefix`` are all None,
            the loop's are taken (an experiment-tracking preset's), as in aitoolbox 1.x.
        bucket_name: the bucket (None with a cloud mode: aitoolbox 1.8's default ``'model-result'``).
        cloud_dir_prefix: the folder inside the bucket that holds the projects (None or ``''``: the top).
        execution_order: position among the callbacks.
        device_idx_execution: under distributed training, run only in the process of this global rank.

    Raises:
        ValueError: a given name is empty, ``project_name`` / ``experiment_name`` contains a path separator, or
            ``cloud_save_mode`` is not one of the values above.
        NotADirectoryError / PermissionError: at registration, in the main process, when the callback's own
            ``local_model_result_folder_path`` cannot hold the experiment folder (nothing is created to find out).
    """

    #: Subclasses that always write files set this True: their folder is resolved at registration (the loop's
    #: default run folder included), which fails when only some details are given. Others take the default run
    #: folder only when they first need a folder, so one that never writes neither names nor announces it.
    requires_experiment_folder: bool = False

    def __init__(self, callback_name: str, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 0, device_idx_execution: Optional[int] = None):
        super().__init__(callback_name, execution_order=execution_order, device_idx_execution=device_idx_execution)
        for name, value in zip(_FOLDER_ARGUMENTS, (project_name, experiment_name, local_model_result_folder_path)):
            _check_detail(name, value)
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.local_model_result_folder_path = (os.path.expanduser(local_model_result_folder_path)
                                               if local_model_result_folder_path is not None else None)
        check_cloud_save_mode(cloud_save_mode, type(self).__name__)
        self.cloud_save_mode = cloud_save_mode
        self.bucket_name = bucket_name
        self.cloud_dir_prefix = cloud_dir_prefix
        self._experiment_folder: Optional[ExperimentFolder] = None
        self._cloud_destination: Optional["CloudDestination"] = None
        self._cloud_uploads: Optional["CloudUploads"] = None

    @property
    def has_folder_arguments(self) -> bool:
        """True when the callback was given all three experiment details itself."""
        return None not in (self.project_name, self.experiment_name, self.local_model_result_folder_path)

    @property
    def is_main_process(self) -> bool:
        """True in the process that writes files (always True without distributed training)."""
        return self.train_loop_obj is not None and bool(self.train_loop_obj.is_main_process)

    @property
    def experiment_folder(self) -> ExperimentFolder:
        """The folder this callback writes to (nothing is created on disk until a file is written).

        Raises:
            MissingExperimentDetailsError: the callback has no details of its own and the loop has none.
        """
        if self._experiment_folder is None:
            self._experiment_folder = self.resolve_experiment_folder()
        return self._experiment_folder

    @experiment_folder.setter
    def experiment_folder(self, folder: Optional[ExperimentFolder]) -> None:
        self._experiment_folder = folder

    @property
    def has_experiment_folder(self) -> bool:
        """True when the experiment folder is known (resolved at registration, or set)."""
        return self._experiment_folder is not None

    def on_train_loop_registration(self) -> None:
        # Resolved now, so that callbacks registered later find and share this folder. When the details are
        # unknown, a callback that always writes (requires_experiment_folder) fails now, others on first use.
        self._experiment_folder = None
        try:
            self._experiment_folder = self.resolve_experiment_folder(default=self.requires_experiment_folder)
        except MissingExperimentDetailsError:
            if self.requires_experiment_folder:
                raise
        # A root folder of the callback's own is checked now, not when the first file is due after an epoch
        # (the loop's root was checked when the loop was made).
        if self._experiment_folder is not None and self.local_model_result_folder_path is not None \
                and self.is_main_process:
            self._experiment_folder.check_creatable()
        self.setup_cloud_destination()

    def try_infer_experiment_details(self, infer_cloud_details: bool) -> None:
        """Fill the experiment details left None from the registered TrainLoop (aitoolbox 1.x API).

        Call it after registration, e.g. in :meth:`on_train_loop_registration`.

        Args:
            infer_cloud_details: also take ``cloud_save_mode``, ``bucket_name`` and ``cloud_dir_prefix`` from
                the loop when all three are None here.

        Raises:
            MissingExperimentDetailsError: a detail is None here and the loop does not provide it (a plain
                TrainLoop provides those of its default run folder, to a callback given none of the three).
        """
        given_none = all(getattr(self, name) is None for name in _FOLDER_ARGUMENTS)
        values = {name: getattr(self, name) if getattr(self, name) is not None
                  else getattr(self.train_loop_obj, name, None) for name in _FOLDER_ARGUMENTS}
        if None in values.values() and given_none:
            run_folder = _claimed_run_folder(self.train_loop_obj)  # a plain loop's default run folder
            if run_folder is not None:
                values = {"project_name": run_folder.project_name, "experiment_name": run_folder.experiment_name,
                          "local_model_result_folder_path": run_folder.root}
        if None in values.values():
            raise MissingExperimentDetailsError(self._missing_details_message())
        for name, value in values.items():
            setattr(self, name, value)
        if infer_cloud_details and all(getattr(self, name) is None for name in _CLOUD_ARGUMENTS):
            for name in _CLOUD_ARGUMENTS:
                setattr(self, name, getattr(self.train_loop_obj, name, None))

    @property
    def cloud_destination(self) -> Optional["CloudDestination"]:
        """The bucket this callback uploads its files to (known after registration), or None: local files only."""
        return self._cloud_destination

    def resolve_cloud_destination(self) -> Optional["CloudDestination"]:
        """The bucket of this callback's cloud arguments or, when all three are None, the loop's.

        A callback writing to the loop's bucket uses the loop's storage options (``cloud_storage_options`` of
        the presets: endpoint, retries, ...).
        """
        from_loop = loop_cloud_destination(self.train_loop_obj)
        if all(getattr(self, name) is None for name in _CLOUD_ARGUMENTS):
            return from_loop
        own = destination_of_arguments(self.cloud_save_mode, self.bucket_name, self.cloud_dir_prefix,
                                owner=type(self).__name__)
        if own is not None and from_loop is not None \
                and (own.service, own.bucket_name) == (from_loop.service, from_loop.bucket_name):
            own = dataclasses.replace(own, storage_options=from_loop.storage_options)
        return own

    def setup_cloud_destination(self) -> None:
        """Resolve :attr:`cloud_destination` and, when there is one, make sure the loop has its
        :class:`~aitoolbox.torchtrain.callbacks.cloud_upload.CloudUploads` (called at registration)."""
        self._cloud_destination = self.resolve_cloud_destination()
        self._cloud_uploads = self.train_loop_obj.cloud_uploads() if self._cloud_destination is not None else None

    def cloud_upload(self, local_path: str, only_if_changed: bool = False) -> Any:
        """Queue the upload of a file (or folder) this callback wrote into the experiment folder, to the same place
        under the run's key in the bucket; returns at once (the upload's future, or None).

        Nothing happens without a :attr:`cloud_destination` or outside the main process. Failures are raised when
        ``fit`` ends (see :class:`~aitoolbox.torchtrain.callbacks.cloud_upload.CloudUploads`).

        Args:
            local_path: a file or folder inside :attr:`experiment_folder`.
            only_if_changed: skip a file unchanged (size, modification time) since its last upload.
        """
        if self._cloud_uploads is None or not self.is_main_process:
            return None
        return self._cloud_uploads.upload(self._cloud_destination, self.experiment_folder, local_path,
                                          only_if_changed)

    def cloud_upload_run_files(self) -> None:
        """Queue the files at the top of the run folder (hyperparameters, the script copy) that changed since
        their last upload (main process, with a :attr:`cloud_destination`)."""
        if self._cloud_uploads is not None and self.is_main_process:
            self._cloud_uploads.upload_run_files(self._cloud_destination, self.experiment_folder)

    def resolve_experiment_folder(self, default: bool = True) -> ExperimentFolder:
        """The folder for this callback's details completed by the loop's (nothing is created on disk).

        Args:
            default: given none of the details, with a loop that has none either, take the loop's default run
                folder (``train_loop_obj.run_folder``: ``./aitoolbox_runs/run_<timestamp>/`` of a plain TrainLoop).

        Raises:
            MissingExperimentDetailsError: a detail is missing here and in the loop (and no default applies).
        """
        tl = self.train_loop_obj
        loop_folder = getattr(tl, "experiment_folder", None)
        given_none = all(getattr(self, name) is None for name in _FOLDER_ARGUMENTS)
        if loop_folder is not None and given_none:
            return loop_folder
        details = {}
        for name in _FOLDER_ARGUMENTS:
            value = getattr(self, name)
            details[name] = value if value is not None else getattr(tl, name, None)
        if None in details.values():
            run_folder = _claimed_run_folder(tl) if given_none and default else None
            if run_folder is not None:
                return run_folder
            raise MissingExperimentDetailsError(self._missing_details_message())
        folder = ExperimentFolder(details["local_model_result_folder_path"], details["project_name"],
                                  details["experiment_name"],
                                  timestamp=getattr(tl, "experiment_timestamp", None))
        # One ExperimentFolder object per run folder: it is created once, by whichever callback writes first.
        # (A plain loop's default run folder once made, without making it: details given name another folder.)
        others = [loop_folder, getattr(tl, "_default_run_folder", None)] + [
            getattr(callback, "_experiment_folder", None) for callback in getattr(tl, "callbacks", [])]
        for other in others:
            if isinstance(other, ExperimentFolder) and _folder_key(other) == _folder_key(folder):
                return other
        return folder

    def ensure_folder(self, sub_folder: str) -> str:
        """Create the run folder and ``sub_folder`` (e.g. ``self.experiment_folder.results_dir``) when missing."""
        return self.experiment_folder.ensure(os.path.abspath(sub_folder))

    def _missing_details_message(self) -> str:
        given = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FOLDER_ARGUMENTS)
        return (f"{type(self).__name__} does not know where to write ({given}): pass all three of project_name, "
                "experiment_name and local_model_result_folder_path to the callback, or none of them, for the default "
                "run folder ./aitoolbox_runs/run_<timestamp> of a plain TrainLoop; or use it with an "
                "experiment-tracking TrainLoop (TrainLoopCheckpoint, TrainLoopEndSave or TrainLoopCheckpointEndSave), "
                "which provides them")
