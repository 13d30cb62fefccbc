"""Where a run's files go, said once when training starts: ``Run folder: <path>``, for a preset's experiment folder
and a plain TrainLoop's default run folder (``./aitoolbox_runs/run_<timestamp>/``) alike.

A run folder is in use when the loop is a preset (its experiment folder) or a registered callback resolved one
(checkpoints, TensorBoard, CSV logs, history files and plots, ...); it is created when training starts (with
``lazy_experiment_save`` at its first file). A plain TrainLoop whose callbacks write no files names none, and nothing
is created for it.
"""
import logging
import os
from typing import TYPE_CHECKING, Any, List, Set

from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, list_checkpoints
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, run_folder_name_pattern
from aitoolbox.torchtrain.distributed.environment import current_external_placement

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)


def decides_folder_names() -> bool:
    """False in the ranks other than 0 of a job started by torchrun, SLURM or OpenMPI: rank 0 names the folders
    (and alone writes into them)."""
    try:
        placement = current_external_placement()
    except ValueError:  # an incomplete launcher environment: fit_distributed reports it
        return True
    return placement is None or placement.rank == 0


def claim_default_run_folder(folder: ExperimentFolder, reserve: bool) -> None:
    """A callback will write into a plain TrainLoop's default run folder ``folder``.

    Args:
        folder: the loop's default run folder.
        reserve: decide the name now (a training in one process): callbacks derive their paths (the TensorBoard
            and CSV folders) from it when they are registered, and a run started within the same second as another
            must not write into that one's folder (``run_<timestamp>_1`` instead). False for a run of several
            processes, which all name the folder by the timestamp (the main process creates it).

    Raises:
        OSError: the working directory cannot hold ``aitoolbox_runs/``.
    """
    folder.check_creatable()
    if reserve and decides_folder_names():
        folder.reserve()


def continued_run_folder(checkpoint_path: str) -> ExperimentFolder:
    """The run folder that holds ``checkpoint_path`` (a checkpoint file or folder, the run's ``checkpoint_model/``, or
    the run folder itself: its newest checkpoint), for a plain TrainLoop that continues writing into it
    (``load_checkpoint(..., continue_run_folder=True)``).

    Raises:
        ValueError: the path lies in no run folder, or continuing there would overwrite what the run wrote after the
            checkpoint (later checkpoints, or the final model of a finished run); the message says what to do.
    """
    path = os.path.abspath(os.path.expanduser(checkpoint_path))
    candidate = path
    while True:
        match = run_folder_name_pattern().match(os.path.basename(candidate))
        if match and os.path.isdir(os.path.join(candidate, "checkpoint_model")):
            break
        parent = os.path.dirname(candidate)
        if parent == candidate:
            raise ValueError(f"continue_run_folder=True: {checkpoint_path} lies in no run folder (a folder "
                             "<experiment>_<timestamp>/ holding checkpoint_model/, as ./aitoolbox_runs/run_<timestamp>/); "
                             "load it without continue_run_folder to write into a new run folder")
        candidate = parent
    loaded = checkpoint_path_position(path)  # None for a folder: its newest checkpoint was loaded
    later = [os.path.basename(found) for found in list_checkpoints(os.path.join(candidate, "checkpoint_model"))
             if loaded is not None and checkpoint_path_position(found) > loaded]
    if later:
        raise ValueError(f"continue_run_folder=True: {candidate} holds checkpoints written after the one loaded "
                         f"({', '.join(later)}), which the continued run would overwrite; continue from the newest "
                         "checkpoint, or load without continue_run_folder to write into a new run folder")
    final_models = os.path.join(candidate, "model")
    if os.path.isdir(final_models) and os.listdir(final_models):
        raise ValueError(f"continue_run_folder=True: {candidate} holds the final model of a finished run "
                         f"({final_models}), which the continued run would replace; load without "
                         "continue_run_folder to write into a new run folder")
    project_folder = os.path.dirname(candidate)
    folder = ExperimentFolder(os.path.dirname(project_folder), os.path.basename(project_folder), match.group("name"),
                              timestamp=match.group("timestamp"))
    folder.adopt(match.group("timestamp"), created=True)
    return folder


def run_folders_in_use(tl: "TrainLoop") -> List[Any]:
    """The experiment folders the loop and its callbacks write into, each once, the loop's first."""
    candidates = [tl.experiment_folder] + [callback.experiment_folder for callback in tl.callbacks
                                           if getattr(callback, "has_experiment_folder", False)]
    folders: List[Any] = []
    for folder in candidates:
        if folder is not None and all(folder is not known for known in folders):
            folders.append(folder)
    return folders


class RunFolderAnnouncement:
    """Logs each run folder's path once per TrainLoop, when the first ``fit`` that writes into it starts, and creates
    the folder then, so the folder logged exists (also when that fit ends before its first file)."""

    def __init__(self):
        self._announced: Set[str] = set()

    def announced(self, folder: ExperimentFolder) -> bool:
        """The folder's path was logged (a fit wrote into it, or was about to)."""
        return folder.path in self._announced

    def announce(self, tl: "TrainLoop") -> None:
        """Create and log the folders not logged yet (main process). With ``lazy_experiment_save`` a folder is
        created at its first file, as promised, and the message says so.

        Raises:
            OSError: a run folder cannot be created; the message names the folder and what to change.
        """
        lazy = getattr(tl, "lazy_experiment_save", False)
        for folder in run_folders_in_use(tl):
            if folder.path in self._announced:
                continue
            if not folder.created and not lazy:
                # Created now rather than at the first file: an interruption before any file would otherwise leave
                # the name's hidden claim marker alone in the project folder and a logged path that never existed.
                folder.create()
            self._announced.add(folder.path)
            if folder.created:
                logger.info("Run folder: %s", folder.path)
            else:
                logger.info("Run folder: %s (lazy_experiment_save: created when the first file is written)",
                            folder.path)
