"""The experiment-tracking presets: TrainLoop plus the callbacks that fill an experiment folder.

``TrainLoopCheckpoint`` saves a checkpoint every epoch, ``TrainLoopEndSave`` saves the final model with its
evaluation results, plots and history files, and ``TrainLoopCheckpointEndSave`` does both. All keyword
arguments of :class:`TrainLoop` pass through.
"""
import logging
import os
from typing import Optional, Union

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, newest_resumable_run
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.experiment import check_local_save_mode
from aitoolbox.torchtrain.callbacks.history_output import ModelTrainHistoryFileWriter, ModelTrainHistoryPlot
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.distributed.environment import current_external_placement
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


class _ExperimentTrainLoop(TrainLoop):
    """A TrainLoop with an experiment folder ``<root>/<project>/<experiment>_<timestamp>/``."""

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict], cloud_save_mode: Optional[str], bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, source_dirs=(), auto_resume: bool = False, **kwargs):
        check_local_save_mode(cloud_save_mode, type(self).__name__)
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, **kwargs)
        if hyperparams is not None and not isinstance(hyperparams, dict):
            raise TypeError(f"hyperparams must be a dict or None, got {type(hyperparams).__name__}")
        if not isinstance(auto_resume, bool):
            raise TypeError(f"auto_resume must be True or False, got {auto_resume!r}")
        self.hyperparams = dict(hyperparams or {})  # a copy: the caller's dict is never changed
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.local_model_result_folder_path = local_model_result_folder_path
        self.cloud_save_mode = cloud_save_mode
        self.bucket_name = bucket_name
        self.cloud_dir_prefix = cloud_dir_prefix
        self.source_dirs = source_dirs
        # The hyperparameters are written when the folder is created: now, or with lazy_experiment_save at the
        # first file written into it. Either way an unusable folder is reported now, not after an epoch.
        self.auto_resume = auto_resume
        self.resumed_from: Optional[str] = None
        found = newest_resumable_run(local_model_result_folder_path, project_name, experiment_name) \
            if auto_resume else None
        self.experiment_folder = ExperimentFolder(local_model_result_folder_path, project_name, experiment_name,
                                                  timestamp=found[0] if found else None, hyperparams=self.hyperparams)
        if found:
            # Every process of the job finds the same run; its folder is this run's again.
            self.experiment_folder.adopt_if_created_elsewhere()
            self.resumed_from = found[1]
            self.load_checkpoint(found[1])
            if writes_files_in_this_process():
                logger.info("auto_resume: continuing %s from %s (epochs completed: %d)", self.experiment_folder.path,
                            os.path.basename(found[1]), self.epochs_completed)
            return
        if not writes_files_in_this_process():
            return
        if self.lazy_experiment_save:
            self.experiment_folder.check_creatable()
        else:
            self.experiment_folder.create()
            logger.info("Experiment folder: %s", self.experiment_folder.path)


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
        cloud_save_mode: None or 'local'; files stay on the local disk.
        rm_subopt_local_models, num_best_checkpoints_kept: see :class:`ModelCheckpoint`.
        iteration_save_freq: also checkpoint every this many iterations (0: only at epoch ends).
        background_save: write the checkpoints in a background thread (see :class:`ModelCheckpoint`).
        auto_resume: continue the newest run of this experiment that holds a complete checkpoint (its folder
            ``<experiment>_<timestamp>`` and newest checkpoint, found anew by every process of a restarted job),
            or start a new run when there is none. See :ref:`auto-resume`.
        **kwargs: any other :class:`TrainLoop` argument.
    """

    def __init__(self, model, train_loader, validation_loader, test_loader, optimizer, criterion,
                 project_name: str, experiment_name: str, local_model_result_folder_path: str,
                 hyperparams: Optional[dict] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, source_dirs=(),
                 rm_subopt_local_models: Union[bool, str] = False, num_best_checkpoints_kept: int = 2,
                 iteration_save_freq: int = 0, background_save: bool = False, auto_resume: bool = False, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, **kwargs)
        self.callbacks_handler.register_callbacks(checkpoint_callbacks(
            self.hyperparams, rm_subopt_local_models, num_best_checkpoints_kept, iteration_save_freq, background_save))


class TrainLoopEndSave(_ExperimentTrainLoop):
    """TrainLoop that, when training ends, saves the final model, its evaluation results, plots and history.

    Args:
        model, train_loader, validation_loader, test_loader, optimizer, criterion: as for :class:`TrainLoop`.
        project_name, experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode: as for
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
                 auto_resume: bool = False, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, **kwargs)
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
                 iteration_save_freq: int = 0, background_save: bool = False, auto_resume: bool = False, **kwargs):
        super().__init__(model, train_loader, validation_loader, test_loader, optimizer, criterion, project_name,
                         experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name,
                         cloud_dir_prefix, source_dirs, auto_resume, **kwargs)
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
