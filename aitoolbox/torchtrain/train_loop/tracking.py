"""The experiment-tracking presets: TrainLoop plus the callbacks that fill an experiment folder.

``TrainLoopCheckpoint`` saves a checkpoint every epoch, ``TrainLoopEndSave`` saves the final model with its
evaluation results, plots and history files, and ``TrainLoopCheckpointEndSave`` does both. All keyword
arguments of :class:`TrainLoop` pass through. With ``cloud_save_mode`` ('s3' or 'gcs') every file also goes to
a bucket (see :doc:`cloud_storage`).
"""
import logging
import os
from typing import Optional, Tuple, Union

from aitoolbox.experiment.local_save.checkpoints import failures_named
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.experiment.local_save.run_identity import this_run_identity
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.cloud_upload import CloudDestination, cloud_destination
from aitoolbox.torchtrain.callbacks.history_output import ModelTrainHistoryFileWriter, ModelTrainHistoryPlot
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.distributed.environment import current_external_placement
from aitoolbox.torchtrain.train_loop import run_choice
from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


def writes_files_in_this_process() -> bool:
    """False in the ranks other than 0 of a job started by torchrun, SLURM or OpenMPI.

    Each rank of such a job constructs the preset; only rank 0 writes files, so only it creates the folder
    (the others would create folders of their own, or fail on rank 0's when started within the same second).
    """
    try:
        placement = current_external_placement()
    except ValueError:  # an incomplete launcher environment: fit_distributed reports it
        return True
    return placement is None or placement.rank == 0


def resume_from_bucket(destination: CloudDestination, root: str, project_name: str,
                       experiment_name: str) -> Optional[Tuple[str, str]]:
    """``auto_resume`` when no local run has a checkpoint: the newest run of the experiment in the bucket that holds
    a complete checkpoint, whose newest checkpoint is downloaded into the local run folder of the same name.

    Returns:
        ``(timestamp, local checkpoint path)`` as
        :func:`~aitoolbox.experiment.local_save.experiment_folder.newest_resumable_run`, or None.
    """
    found = run_choice.resume_from_bucket(destination, root, project_name, experiment_name)
    return None if found is None else found[:2]


def runs_in_several_processes(tl: TrainLoop) -> bool:
    """The run trains in a process group (gpu_mode 'ddp'/'fsdp', or a process of a torchrun/SLURM/OpenMPI job):
    which run it continues is decided once the group exists."""
    if tl.gpu_mode in ("ddp", "fsdp"):
        return True
    try:
        return current_external_placement() is not None
    except ValueError:  # an incomplete launcher environment: fit_distributed reports it
        return False


class _ExperimentTrainLoop(TrainLoop):
    """A TrainLoop with an experiment folder ``<root>/<project>/<experiment>_<timestamp>/``.

    Which folder the run writes to, and with ``auto_resume`` which run and checkpoint it continues, is decided
    once (see :mod:`~aitoolbox.torchtrain.train_loop.run_choice`): here in a single process; in a distributed run
    by rank 0 when the process group exists, broadcast to the other processes and handed back to the launcher.
    """

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict], cloud_save_mode: Optional[str], bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, source_dirs=(), auto_resume: bool = False,
                 cloud_storage_options: Optional[dict] = None, *, weights_only: bool = True, **kwargs):
        destination = cloud_destination(cloud_save_mode, bucket_name, cloud_dir_prefix, cloud_storage_options,
                                        type(self).__name__)
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, **kwargs)
        if hyperparams is not None and not isinstance(hyperparams, dict):
            raise TypeError(f"hyperparams must be a dict or None, got {type(hyperparams).__name__}")
        if not isinstance(auto_resume, bool):
            raise TypeError(f"auto_resume must be True or False, got {auto_resume!r}")
        if not isinstance(weights_only, bool):
            raise TypeError(f"weights_only must be True or False, got {weights_only!r}")
        self.hyperparams = dict(hyperparams or {})  # a copy: the caller's dict is never changed
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.local_model_result_folder_path = local_model_result_folder_path
        self.cloud_save_mode = cloud_save_mode
        self.bucket_name = bucket_name
        self.cloud_dir_prefix = cloud_dir_prefix
        self.cloud_storage_options = cloud_storage_options
        self.cloud_destination = destination
        self.source_dirs = source_dirs
        self.weights_only = weights_only
        self.auto_resume = auto_resume
        self.resumed_from: Optional[str] = None
        # The hyperparameters and the run's identity are written when the folder is created: now, or with
        # lazy_experiment_save at the first file written into it. Either way an unusable folder is reported now.
        self.experiment_folder = ExperimentFolder(local_model_result_folder_path, project_name, experiment_name,
                                                  hyperparams=self.hyperparams,
                                                  identity=this_run_identity(self.hyperparams, strict=auto_resume))
        self.experiment_folder.check_creatable()
        # auto_resume's choice still to be made (by rank 0 of a distributed run, when its process group exists).
        self._resume_undecided = auto_resume
        self._run_agreed_in_process: Optional[int] = None
        # auto_resume's choice made here, before any process group exists: provisional. Should the run go on with
        # fit_distributed, its group's rank 0 decides again (each node's launcher decided alone, maybe from another
        # disk) and every process follows.
        self._provisional_choice: Optional[run_choice.RunDecision] = None
        if not runs_in_several_processes(self):
            if auto_resume:
                decision, checkpoint = run_choice.decide_run(self.experiment_folder, destination, 1, weights_only,
                                                             self.lazy_experiment_save)
                self._continue_or_start(decision, checkpoint)
                self._provisional_choice = decision
            elif not self.lazy_experiment_save:
                self.experiment_folder.create()  # its path is logged when training starts (see run_folders)
            return
        if writes_files_in_this_process() and not auto_resume and not self.lazy_experiment_save:
            self.experiment_folder.create()

    def _continue_or_start(self, decision: run_choice.RunDecision, checkpoint) -> None:
        """Adopt the decided run folder and load what the run continues from (a path or a checkpoint dict)."""
        self._resume_undecided = False
        folder = self.experiment_folder
        folder.adopt(decision.timestamp, created=False)
        if decision.created:
            folder.adopt_if_created_elsewhere()
        if decision.checkpoint is not None:
            self.resumed_from = os.path.join(folder.path, decision.checkpoint)
        elif self._provisional_choice is not None:  # rank 0 starts a new run where the launcher had continued one
            self.resumed_from = None
        if checkpoint is None:  # a new run, or the checkpoint is loaded already (the provisional choice stood)
            return
        with failures_named(self.resumed_from):  # what does not fit names the file
            # The file named as its source (also of a dict read already): its errors name it, and the train-end
            # record beside it is read from its folder (see train_end_marker).
            self.load_checkpoint(checkpoint, weights_only=self.weights_only,
                                 source=self.resumed_from if isinstance(checkpoint, dict) else None)
        if self.strategy.is_main_process:
            logger.info("auto_resume: continuing %s from %s (epochs completed: %d)", folder.path,
                        decision.checkpoint, self.epochs_completed)

    def fit(self, num_epochs: int = 0, num_iterations: int = 0, callbacks=None, grad_accumulation: int = 1,
            **kwargs):
        """:meth:`TrainLoop.fit`; in each process of a distributed run it first agrees with the others on the run
        folder (and with ``auto_resume`` on the run to continue), once. With ``lazy_experiment_save`` the run
        folder's name is reserved now (nothing is created before the first file)."""
        if self.strategy.is_distributed and self._run_agreed_in_process != os.getpid():
            decide = self._resume_undecided or self._provisional_choice is not None
            self._continue_or_start(*run_choice.agree_on_run(self, decide, self._provisional_choice))
            self._provisional_choice = None
            self._run_agreed_in_process = os.getpid()
        elif not runs_in_several_processes(self) and self.lazy_experiment_save:
            self.experiment_folder.reserve()
        return super().fit(num_epochs, num_iterations, callbacks, grad_accumulation, **kwargs)

    @property
    def checkpoint_callback(self) -> Optional[ModelCheckpoint]:
        """The callback saving this run's epoch checkpoints (``TrainLoopCheckpoint`` and ``TrainLoopCheckpointEndSave``
        register one; else the first :class:`ModelCheckpoint` registered), or None. As Lightning's
        ``trainer.checkpoint_callback``: ``tl.checkpoint_callback.best_model_path``, ``.load_best_model()``."""
        checkpoints = [callback for callback in self.callbacks if isinstance(callback, ModelCheckpoint)]
        epoch_savers = [callback for callback in checkpoints if not isinstance(callback, ModelIterationCheckpoint)]
        return (epoch_savers or checkpoints or [None])[0]

    def run_record(self) -> dict:
        """What the launching process of ``fit_distributed`` adopts: the run folder rank 0 decided on and the
        checkpoint the run continued from (plain data)."""
        return {"timestamp": self.experiment_folder.timestamp, "resumed_from": self.resumed_from}

    def adopt_run_record(self, record: dict) -> None:
        """In the launching process: write into the run folder the processes wrote into (decided by rank 0, never
        derived again from a clock or from which folders exist)."""
        self._resume_undecided = False
        self._provisional_choice = None  # the processes agreed: a later call continues their run
        self.experiment_folder.adopt(record["timestamp"], created=False)
        self.experiment_folder.adopt_if_created_elsewhere()
        self.resumed_from = record.get("resumed_from")  # the processes', which rank 0's choice may have changed


class TrainLoopCheckpoint(_ExperimentTrainLoop):
    """TrainLoop that saves a checkpoint at every epoch end (and every ``iteration_save_freq`` iterations).

    Args:
        model, train_loader, validation_loader, test_loader, optimizer, criterion: as for :class:`TrainLoop`.
        project_name: project folder under ``local_model_result_folder_path``.
        experiment_name: prefix of this run's folder.
        local_model_result_folder_path: root folder of all experiments. A folder that cannot be created or
            written is an error of the constructor (also with ``lazy_experiment_save``, which only checks).
        hyperparams: saved with the experiment (copied, never modified); None (the default) saves an empty dict.
            Optional, unlike in aitoolbox 1.x.
        cloud_save_mode: also upload every file of the run (checkpoints, final model, results, plots, TensorBoard
            logs, hyperparameters) to a bucket, in the background: ``'s3'`` / ``'aws_s3'`` / ``'aws'`` (AWS S3)
            or ``'gcs'`` / ``'google_storage'`` / ``'google storage'`` (Google Cloud Storage). None (the default,
            unlike aitoolbox 1.x's ``'s3'``) or ``'local'``: local files only. See :doc:`cloud_storage`.
        bucket_name: the bucket; None: ``'model-result'`` (aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects (None or ``''``: its top).
        source_dirs: aitoolbox 1.x's source folders (kept in ``self.source_dirs``).
        rm_subopt_local_models, num_best_checkpoints_kept: see :class:`ModelCheckpoint`.
        iteration_save_freq: also checkpoint every this many iterations (0: only at epoch ends).
        background_save: write the checkpoints in a background thread (see :class:`ModelCheckpoint`).
        auto_resume: continue the newest run of this experiment that holds a complete checkpoint and belongs to
            this job (same job id, or without one the same hyperparameters; see :ref:`auto-resume`): its folder
            ``<experiment>_<timestamp>`` and newest checkpoint, chosen in a distributed job by rank 0 once
            the process group exists and used by every process; or start a new run when there is none. With a
            ``cloud_save_mode``, when no local run has a checkpoint, the newest run in the bucket with a complete
            checkpoint is continued: the checkpoint is downloaded into the local run folder of the same name.
        cloud_storage_options: keyword arguments of the storage class (``endpoint_url``, ``region_name``,
            ``retry`` (a :class:`~aitoolbox.cloud.storage.RetryPolicy`), timeouts...; see
            :class:`~aitoolbox.cloud.s3.S3Storage` and :class:`~aitoolbox.cloud.gcs.GCSStorage`); None: the
            service's standard configuration.
        weights_only: (keyword) False lets ``auto_resume`` unpickle a checkpoint in full, which runs whatever code
            the file names: only for files you trust. True (the default): a checkpoint holding anything but
            tensors and plain data stops the constructor with an error naming the file.
        **kwargs: any other :class:`TrainLoop` argument.
    """

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, source_dirs=(),
                 rm_subopt_local_models: Union[bool, str] = False, num_best_checkpoints_kept: int = 2,
                 iteration_save_freq: int = 0, background_save: bool = False, auto_resume: bool = False,
                 cloud_storage_options: Optional[dict] = None, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, cloud_storage_options, **kwargs)
        self.callbacks_handler.register_callbacks(checkpoint_callbacks(
            self.hyperparams, rm_subopt_local_models, num_best_checkpoints_kept, iteration_save_freq, background_save))


class TrainLoopEndSave(_ExperimentTrainLoop):
    """TrainLoop that, when training ends, saves the final model, its evaluation results, plots and history.

    Args:
        model, train_loader, validation_loader, test_loader, optimizer, criterion: as for :class:`TrainLoop`.
        project_name, experiment_name, local_model_result_folder_path, hyperparams: as for
            :class:`TrainLoopCheckpoint`.
        cloud_save_mode, bucket_name, cloud_dir_prefix, source_dirs, cloud_storage_options: as for
            :class:`TrainLoopCheckpoint`.
        val_result_package: metrics evaluated on the validation set at the end, or None.
        test_result_package: metrics evaluated on the test set at the end, or None.
        auto_resume: as for :class:`TrainLoopCheckpoint` (without checkpoints only a finished run's final model
            is found).
        **kwargs: any other :class:`TrainLoop` argument.
    """

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict] = None, val_result_package: Optional[AbstractResultPackage] = None,
                 test_result_package: Optional[AbstractResultPackage] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, source_dirs=(),
                 auto_resume: bool = False, cloud_storage_options: Optional[dict] = None, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, cloud_storage_options, **kwargs)
        self.callbacks_handler.register_callbacks(end_save_callbacks(self.hyperparams, val_result_package,
                                                                     test_result_package))


class TrainLoopCheckpointEndSave(_ExperimentTrainLoop):
    """TrainLoop with both: a checkpoint every epoch and the final save with results, plots and history.

    Args: as :class:`TrainLoopCheckpoint` and :class:`TrainLoopEndSave` together.
    """

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict] = None, val_result_package: Optional[AbstractResultPackage] = None,
                 test_result_package: Optional[AbstractResultPackage] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, source_dirs=(),
                 rm_subopt_local_models: Union[bool, str] = False, num_best_checkpoints_kept: int = 2,
                 iteration_save_freq: int = 0, background_save: bool = False, auto_resume: bool = False,
                 cloud_storage_options: Optional[dict] = None, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, cloud_storage_options, **kwargs)
        self.callbacks_handler.register_callbacks(
            checkpoint_callbacks(self.hyperparams, rm_subopt_local_models, num_best_checkpoints_kept,
                                 iteration_save_freq, background_save)
            + end_save_callbacks(self.hyperparams, val_result_package, test_result_package))


def checkpoint_callbacks(hyperparams: dict, rm_subopt_local_models, num_best_checkpoints_kept: int,
                         iteration_save_freq: int, background_save: bool = False) -> list:
    """The epoch checkpoints (and iteration checkpoints when ``iteration_save_freq`` > 0) of the Checkpoint presets."""
    callbacks = [ModelCheckpoint(hyperparams=hyperparams, rm_subopt_local_models=rm_subopt_local_models,
                                 num_best_checkpoints_kept=num_best_checkpoints_kept, background_save=background_save)]
    if iteration_save_freq:
        callbacks.append(ModelIterationCheckpoint(iteration_save_freq, hyperparams=hyperparams,
                                                  background_save=background_save))
    return callbacks


def end_save_callbacks(hyperparams: dict, val_result_package, test_result_package) -> list:
    """The final save, the history plots and the history file of the EndSave presets."""
    return [ModelTrainEndSave(hyperparams=hyperparams, val_result_package=val_result_package,
                              test_result_package=test_result_package),
            ModelTrainHistoryPlot(epoch_end=False, train_end=True),
            ModelTrainHistoryFileWriter(epoch_end=False, train_end=True, file_format="json")]
