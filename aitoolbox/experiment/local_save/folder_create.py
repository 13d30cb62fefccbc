"""aitoolbox 1.x's module path of the experiment folder, with its static path helpers.

``from aitoolbox.experiment.local_save.folder_create import ExperimentFolder`` gives this package's
:class:`~aitoolbox.experiment.local_save.experiment_folder.ExperimentFolder` extended by the two static methods
aitoolbox 1.x's savers and loaders call: :meth:`ExperimentFolder.get_base_folder_paths` and
:meth:`ExperimentFolder.create_base_folder`.
"""
import os
from typing import Tuple

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder as _ExperimentFolder
from aitoolbox.experiment.local_save.names import check_name

__all__ = ["ExperimentFolder"]


class ExperimentFolder(_ExperimentFolder):
    """The experiment folder of a run, plus aitoolbox 1.x's static helpers that name and create it by its parts.

    The static helpers address the folder ``<root>/<project>/<experiment>_<timestamp>`` directly: called again
    with the same parts they return the same folder, so the savers that call them once per epoch all write into
    one run folder. An instance (see the base class) instead never reuses the folder of another run.
    """

    @staticmethod
    def get_base_folder_paths(project_name: str, experiment_name: str, experiment_timestamp: str,
                              local_model_result_folder_path: str) -> Tuple[str, str]:
        """Paths of the project folder and of the run folder inside it; nothing is created.

        Args:
            project_name: the project folder's name.
            experiment_name: the experiment's name, the first part of the run folder's name.
            experiment_timestamp: the run's timestamp, the second part of the run folder's name.
            local_model_result_folder_path: the folder that holds the projects (``~`` is expanded).

        Returns:
            ``(project folder path, run folder path)``.

        Raises:
            ValueError: a name is not a plain name (see :mod:`~aitoolbox.experiment.local_save.names`).
        """
        check_name(project_name, "project_name")
        check_name(experiment_name, "experiment_name")
        check_name(experiment_timestamp, "experiment_timestamp")
        project_path = os.path.join(os.path.expanduser(local_model_result_folder_path), project_name)
        return project_path, os.path.join(project_path, f"{experiment_name}_{experiment_timestamp}")

    @staticmethod
    def create_base_folder(project_name: str, experiment_name: str, experiment_timestamp: str,
                           local_model_result_folder_path: str) -> str:
        """Create the project and run folders where missing and return the run folder's path.

        An existing run folder is used as it is: nothing in it is removed or replaced.

        Args:
            project_name: the project folder's name.
            experiment_name: the experiment's name, the first part of the run folder's name.
            experiment_timestamp: the run's timestamp, the second part of the run folder's name.
            local_model_result_folder_path: the folder that holds the projects; created too when missing.

        Returns:
            The run folder's path.

        Raises:
            ValueError: a name is not a plain name (see :mod:`~aitoolbox.experiment.local_save.names`).
        """
        _, experiment_path = ExperimentFolder.get_base_folder_paths(
            project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)
        os.makedirs(experiment_path, exist_ok=True)
        return experiment_path
