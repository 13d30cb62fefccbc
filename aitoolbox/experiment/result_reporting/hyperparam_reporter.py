"""Record what a run was started with: a hyperparameter text file, the experiment script and source folders."""
import logging
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder
from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.utils.file_system import zip_folder

logger = logging.getLogger(__name__)


class HyperParamSourceReporter:
    """Writes a run's hyperparameters and source code into its experiment folder.

    The folder ``<local_model_result_folder_path>/<project_name>/<experiment_name>_<experiment_timestamp>`` is
    created on construction (an existing one is reused).

    Args:
        project_name: the project folder's name.
        experiment_name: the experiment's name.
        experiment_timestamp: the run's start time stamp, part of the run folder's name.
        local_model_result_folder_path: the folder holding the projects (``~`` is expanded).
    """

    def __init__(self, project_name: str, experiment_name: str, experiment_timestamp: str,
                 local_model_result_folder_path: str):
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.experiment_timestamp = experiment_timestamp
        self.local_model_result_folder_path = os.path.expanduser(local_model_result_folder_path)

        self.experiment_dir_path = ExperimentFolder.create_base_folder(
            project_name, experiment_name, experiment_timestamp, self.local_model_result_folder_path)
        self.file_name = "hyperparams_list.txt"
        self.local_hyperparams_file_path = os.path.join(self.experiment_dir_path, self.file_name)

    def save_hyperparams_to_text_file(self, hyperparams: Mapping[str, Any], sort_names: bool = False) -> str:
        """Write one ``name:<TAB>value`` line per hyperparameter into ``hyperparams_list.txt``, secrets redacted
        (see :mod:`aitoolbox.experiment.redaction`).

        Args:
            hyperparams: the hyperparameters (not modified).
            sort_names: list the names alphabetically instead of in the dict's order.

        Returns:
            The written file's path.
        """
        written = redact_hyperparams(hyperparams)
        names = sorted(written) if sort_names else list(written)
        text = "".join(f"{name}:\t{written[name]}\n" for name in names)
        atomic_write_text(self.local_hyperparams_file_path, text)
        return self.local_hyperparams_file_path

    def copy_to_cloud_storage(self, local_hyperparams_file_path: str, cloud_saver: Any,
                              file_name: Optional[str] = None) -> str:
        """Upload a file of the run folder to the top of the run's folder in the bucket.

        The key is ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/<file name>``, next to the ``model/``
        and ``results/`` folders, as in aitoolbox 1.x. The local file is kept.

        Args:
            local_hyperparams_file_path: the local file (e.g. :attr:`local_hyperparams_file_path`).
            cloud_saver: one of the cloud model or results savers (``aitoolbox.cloud.AWS.model_save``,
                ``...results_save`` and their ``GoogleCloud`` twins): its bucket, ``cloud_dir_prefix`` and uploader
                (with an uploader the upload runs in the background and its ``wait()`` reports failures).
            file_name: the name in the bucket; None: ``hyperparams_list.txt``, as in aitoolbox 1.x.

        Returns:
            The file's key in the bucket.

        Raises:
            TypeError: ``cloud_saver`` is not a cloud saver.
            FileNotFoundError: the local file does not exist.
            aitoolbox.cloud.storage.CloudStorageError: the upload failed (a saver without an uploader).
        """
        if not (hasattr(cloud_saver, "create_experiment_cloud_storage_folder_structure")
                and hasattr(cloud_saver, "save_file")):
            raise TypeError(f"cloud_saver must be a cloud model or results saver (e.g. "
                            f"aitoolbox.cloud.AWS.results_save.BaseResultsSaver), not {type(cloud_saver).__name__}")
        if not os.path.isfile(os.path.expanduser(local_hyperparams_file_path)):
            raise FileNotFoundError(f"{local_hyperparams_file_path!r} does not exist: save it first "
                                    "(e.g. with save_hyperparams_to_text_file)")
        # The savers' folder is the run's model/ or results/ folder; the file goes one level up, in the run's.
        saver_folder_key = cloud_saver.create_experiment_cloud_storage_folder_structure(
            self.project_name, self.experiment_name, self.experiment_timestamp)
        cloud_file_path = f"{saver_folder_key.rsplit('/', 1)[0]}/{file_name or self.file_name}"
        cloud_saver.save_file(local_hyperparams_file_path, cloud_file_path)
        return cloud_file_path

    def save_experiment_python_file(self, hyperparams: Mapping[str, Any]) -> Optional[str]:
        """Copy the experiment's main script (``hyperparams['experiment_file_path']``) into the run folder.

        Args:
            hyperparams: must hold ``experiment_file_path``, the script that runs the TrainLoop.

        Returns:
            The copy's path, or None (with a warning) when the key is missing or the file does not exist,
            e.g. in a notebook, where the path has to be set by hand.
        """
        if "experiment_file_path" not in hyperparams:
            logger.warning("hyperparams has no 'experiment_file_path': the experiment script is not copied "
                           "into the experiment folder")
            return None
        source_path = os.path.expanduser(hyperparams["experiment_file_path"])
        if not os.path.isfile(source_path):
            logger.warning("experiment_file_path %r is not an existing file, so it is not copied (in a notebook, "
                           "set hyperparams['experiment_file_path'] to the script's path yourself)", source_path)
            return None
        destination_path = os.path.join(self.experiment_dir_path, os.path.basename(source_path))
        # Copied under a temporary name and renamed, so the folder never holds half a script.
        fd, temp_path = tempfile.mkstemp(prefix=".tmp-", dir=self.experiment_dir_path)
        os.close(fd)
        try:
            shutil.copyfile(source_path, temp_path)
            os.replace(temp_path, destination_path)
        finally:
            if os.path.exists(temp_path):
                os.remove(temp_path)
        return destination_path

    def save_experiment_source_files(self, hyperparams: Mapping[str, Any]) -> Optional[str]:
        """Zip the folders listed in ``hyperparams['source_dirs_paths']`` into ``source_code.zip``.

        Each folder is stored under its own name inside the archive.

        Args:
            hyperparams: may hold ``source_dirs_paths``, a non-empty list or tuple of folder paths.

        Returns:
            The archive's path, or None when no source folders are listed.
        """
        source_dirs = hyperparams.get("source_dirs_paths")
        if not isinstance(source_dirs, (list, tuple)) or len(source_dirs) == 0:
            return None
        # Gathered in a hidden scratch folder that is always removed, so a failed copy leaves nothing behind.
        with tempfile.TemporaryDirectory(prefix=".tmp-source-", dir=self.experiment_dir_path) as scratch:
            for source_dir in source_dirs:
                source_dir = os.path.expanduser(source_dir)
                shutil.copytree(source_dir, os.path.join(scratch, os.path.basename(os.path.normpath(source_dir))))
            return zip_folder(scratch, os.path.join(self.experiment_dir_path, "source_code"))
