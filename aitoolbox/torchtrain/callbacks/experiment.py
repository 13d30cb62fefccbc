"""The base of callbacks that write files into an experiment folder (plots, result files, tensorboard logs).

Such a callback finds its :class:`~aitoolbox.experiment.local_save.ExperimentFolder` when it is registered
with a TrainLoop: from its own ``project_name`` / ``experiment_name`` / ``local_model_result_folder_path``
arguments, or else from the folder of an experiment-tracking preset (``TrainLoopCheckpoint``,
``TrainLoopEndSave``, ``TrainLoopCheckpointEndSave``), which sets ``train_loop_obj.experiment_folder``.
Files are written only in the main process.
"""
import numbers
import os
from typing import Any, Optional, Tuple

import torch

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

_FOLDER_ARGUMENTS = ("project_name", "experiment_name", "local_model_result_folder_path")
# aitoolbox 1.x's cloud_save_mode values that meant an upload to S3 or Google Cloud Storage.
_CLOUD_MODES = ("s3", "aws_s3", "aws", "gcs", "google_storage", "google storage")


def check_local_save_mode(cloud_save_mode: Optional[str], callback_name: str) -> None:
    """Accept aitoolbox 1.x's ``cloud_save_mode`` argument for local saving; refuse cloud uploads plainly."""
    if isinstance(cloud_save_mode, str) and cloud_save_mode.lower() in _CLOUD_MODES:
        raise ValueError(f"{callback_name}: cloud_save_mode={cloud_save_mode!r} is not supported, files are written "
                         "to the local experiment folder only. Leave cloud_save_mode None (or 'local') and copy "
                         "the folder to cloud storage with your own tools")


def scalar_value(value: Any) -> Optional[float]:
    """``value`` as a float when it is a single number (Python, numpy or a one-element tensor), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if getattr(value, "size", None) == 1 and callable(getattr(value, "item", None)):  # numpy 0-d / 1-element
        try:
            return float(value.item())
        except (TypeError, ValueError):
            return None
    return None


def _folder_key(folder: ExperimentFolder) -> Tuple[str, str, str]:
    return folder.root, folder.project_name, folder.experiment_name


class AbstractExperimentCallback(AbstractCallback):
    """A callback that writes into an experiment folder, resolved at registration.

    Give either all three folder arguments or none of them. With all three, files go to
    ``<local_model_result_folder_path>/<project_name>/<experiment_name>_<timestamp>/``; callbacks on the same
    TrainLoop that name the same folder (or the preset's folder) share one run folder and timestamp. With none,
    the folder of the experiment-tracking preset the callback is used with is taken.

    Subclasses that override :meth:`on_train_loop_registration` call ``super().on_train_loop_registration()``
    first, then use ``self.experiment_folder`` and write only when :attr:`is_main_process` is True.

    Args:
        callback_name: a name for messages.
        project_name: the project folder, or None to use the preset's folder.
        experiment_name: prefix of the run folder, or None to use the preset's folder.
        local_model_result_folder_path: root folder of all projects, or None to use the preset's folder.
        execution_order: position among the callbacks.
        device_idx_execution: under distributed training, run only in the process of this global rank.

    Raises:
        ValueError: only some of the three folder arguments are given, or one is not a usable folder name.
    """

    def __init__(self, callback_name: str, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, execution_order: int = 0,
                 device_idx_execution: Optional[int] = None):
        super().__init__(callback_name, execution_order=execution_order, device_idx_execution=device_idx_execution)
        given = {"project_name": project_name, "experiment_name": experiment_name,
                 "local_model_result_folder_path": local_model_result_folder_path}
        missing = [name for name, value in given.items() if value is None]
        if missing and len(missing) < len(given):
            raise ValueError(f"{type(self).__name__} got only some of the experiment folder arguments "
                             f"({', '.join(f'{k}={v!r}' for k, v in given.items())}): give all three of "
                             f"{', '.join(_FOLDER_ARGUMENTS)}, or none of them to use the folder of "
                             "TrainLoopCheckpoint / TrainLoopEndSave / TrainLoopCheckpointEndSave")
        if not missing:  # check the names now (nothing is created on disk) rather than at registration
            ExperimentFolder(local_model_result_folder_path, project_name, experiment_name)
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.local_model_result_folder_path = local_model_result_folder_path
        self.experiment_folder: Optional[ExperimentFolder] = None

    @property
    def has_folder_arguments(self) -> bool:
        """True when the callback was given its own project / experiment / root folder."""
        return self.project_name is not None

    @property
    def is_main_process(self) -> bool:
        """True in the process that writes files (always True without distributed training)."""
        return self.train_loop_obj is not None and self.train_loop_obj.is_main_process

    def on_train_loop_registration(self) -> None:
        self.experiment_folder = self.resolve_experiment_folder()

    def resolve_experiment_folder(self) -> ExperimentFolder:
        """The folder this callback writes to (nothing is created on disk yet).

        Raises:
            ValueError: no folder arguments were given and the TrainLoop has no experiment folder.
        """
        loop_folder = getattr(self.train_loop_obj, "experiment_folder", None)
        if not self.has_folder_arguments:
            if loop_folder is None:
                raise ValueError(
                    f"{type(self).__name__} does not know where to write: pass project_name, experiment_name and "
                    "local_model_result_folder_path to the callback, or use it with an experiment-tracking "
                    "TrainLoop (TrainLoopCheckpoint, TrainLoopEndSave or TrainLoopCheckpointEndSave), which "
                    "provides the experiment folder")
            return loop_folder
        folder = ExperimentFolder(self.local_model_result_folder_path, self.project_name, self.experiment_name)
        # Reuse a folder naming the same experiment, so that several callbacks (and the preset) write into one
        # run folder with one timestamp instead of each creating its own.
        others = [loop_folder] + [getattr(callback, "experiment_folder", None)
                                  for callback in getattr(self.train_loop_obj, "callbacks", [])]
        for other in others:
            if isinstance(other, ExperimentFolder) and _folder_key(other) == _folder_key(folder):
                return other
        return folder

    def ensure_folder(self, sub_folder: str) -> str:
        """Create the run folder and ``sub_folder`` (e.g. ``self.experiment_folder.results_dir``) when missing."""
        return self.experiment_folder.ensure(os.path.abspath(sub_folder))
