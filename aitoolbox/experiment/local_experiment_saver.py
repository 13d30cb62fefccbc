"""aitoolbox 1.x's local experiment savers: the final model and its evaluated results into the experiment folder.

``FullPyTorchExperimentLocalSaver(project, experiment, root).save_experiment(checkpoint, result_package,
history)`` writes ``model/model_<experiment>_<timestamp>.pth`` and the results files of
:class:`~aitoolbox.experiment.local_save.local_results_save.LocalResultsSaver` (JSON, see there) into
``<root>/<project>/<experiment>_<timestamp>/``.
"""
import datetime
import time
from typing import Any, List, Optional

from aitoolbox.experiment.experiment_saver import AbstractExperimentSaver
from aitoolbox.experiment.local_save.experiment_folder import timestamp_now
from aitoolbox.experiment.local_save.local_model_save import (
    AbstractLocalModelSaver, KerasLocalModelSaver, PyTorchLocalModelSaver)
from aitoolbox.experiment.local_save.local_results_save import LocalResultsSaver

# Besides its own names, ``import *`` gives what it gave in aitoolbox 1.x, whose modules had no __all__ (1.x
# scripts and tests use e.g. ``os`` and ``datetime`` after ``from <module> import *``).
__all__ = ["BaseFullExperimentLocalSaver", "FullPyTorchExperimentLocalSaver", "FullKerasExperimentLocalSaver",
           "datetime", "time", "AbstractExperimentSaver", "AbstractLocalModelSaver", "PyTorchLocalModelSaver",
           "KerasLocalModelSaver", "LocalResultsSaver"]


class BaseFullExperimentLocalSaver(AbstractExperimentSaver):
    """Save a model with the given local model saver and its results with a :class:`LocalResultsSaver`.

    Args:
        model_saver: the local model saver (e.g. ``PyTorchLocalModelSaver``).
        project_name: the project folder's name.
        experiment_name: the experiment's name.
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).

    Raises:
        TypeError: ``model_saver`` is not an ``AbstractLocalModelSaver``.
    """

    def __init__(self, model_saver: AbstractLocalModelSaver, project_name: str, experiment_name: str,
                 local_model_result_folder_path: str = "~/project/model_result"):
        if not isinstance(model_saver, AbstractLocalModelSaver):
            raise TypeError(f"model_saver must be an AbstractLocalModelSaver (e.g. PyTorchLocalModelSaver), got "
                            f"{type(model_saver).__name__}")
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.model_saver = model_saver
        self.results_saver = LocalResultsSaver(local_model_result_folder_path)

    def save_experiment(self, model: Any, result_package: Any, training_history: Any,
                        experiment_timestamp: Optional[str] = None, save_true_pred_labels: bool = False,
                        separate_files: bool = False, protect_existing_folder: bool = True) -> List[str]:
        """Save the final model, then the results, into the run folder of ``experiment_timestamp``.

        Args:
            model: the model representation (a checkpoint dict for PyTorch, the model for Keras).
            result_package: the evaluated result package.
            training_history: the TrainLoop's training history.
            experiment_timestamp: the run's timestamp; the current time when None.
            save_true_pred_labels: save the package's ``y_true`` and ``y_predicted`` too.
            separate_files: results, hyperparameters and history in separate files instead of one.
            protect_existing_folder: accepted for aitoolbox 1.x compatibility: an existing experiment folder is
                always kept as it is, with the files in it.

        Returns:
            The paths of the saved files: the model first, then the results files, the result package's extra
            files and the plots.
        """
        experiment_timestamp = experiment_timestamp or timestamp_now()
        _, model_path = self.model_saver.save_model(
            model=model, project_name=self.project_name, experiment_name=self.experiment_name,
            experiment_timestamp=experiment_timestamp, protect_existing_folder=protect_existing_folder)
        save_results = (self.results_saver.save_experiment_results_separate_files if separate_files
                        else self.results_saver.save_experiment_results)
        results = save_results(result_package=result_package, training_history=training_history,
                               project_name=self.project_name, experiment_name=self.experiment_name,
                               experiment_timestamp=experiment_timestamp, save_true_pred_labels=save_true_pred_labels,
                               protect_existing_folder=protect_existing_folder)
        return [model_path] + [path for _, path in results]


class FullPyTorchExperimentLocalSaver(BaseFullExperimentLocalSaver):
    """Save a PyTorch experiment (checkpoint dict and results) locally.

    Args:
        project_name: the project folder's name.
        experiment_name: the experiment's name.
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
    """

    def __init__(self, project_name: str, experiment_name: str,
                 local_model_result_folder_path: str = "~/project/model_result"):
        super().__init__(PyTorchLocalModelSaver(local_model_result_folder_path), project_name, experiment_name,
                         local_model_result_folder_path=local_model_result_folder_path)


class FullKerasExperimentLocalSaver(BaseFullExperimentLocalSaver):
    """Save a Keras experiment (model ``.h5`` and results) locally.

    Args:
        project_name: the project folder's name.
        experiment_name: the experiment's name.
        local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).
    """

    def __init__(self, project_name: str, experiment_name: str,
                 local_model_result_folder_path: str = "~/project/model_result"):
        super().__init__(KerasLocalModelSaver(local_model_result_folder_path), project_name, experiment_name,
                         local_model_result_folder_path=local_model_result_folder_path)
