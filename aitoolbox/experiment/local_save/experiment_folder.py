"""The experiment folder: ``<root>/<project>/<experiment>_<timestamp>/`` and its sub-folders."""
import datetime
import errno
import json
import os
import re
import shutil
import sys
from typing import Any, List, Optional, Tuple

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.names import check_name
from aitoolbox.experiment.redaction import redact_hyperparams


# Runs of one experiment started within the same second get suffixed folders, up to this many.
MAX_SAME_SECOND_RUNS = 1000


ROOT_ARGUMENT = "local_model_result_folder_path"


def _unusable_folder(error_number: int, root: str, reason: str) -> OSError:
    # OSError(errno, ...) becomes the matching subclass: PermissionError, NotADirectoryError, ...
    return OSError(error_number, f"{ROOT_ARGUMENT}={root!r} cannot hold the experiment folders: {reason}. Pass a "
                                 f"folder you can write to as {ROOT_ARGUMENT}")


def check_folder_creatable(path: str, root: Optional[str] = None) -> None:
    """Raise now if the folder ``path`` could not be created or written; creates nothing.

    Looks at the nearest existing folder on the way to ``path``: it must be a folder the process may write
    into (a process running as root may write anywhere, as it would when the folder is created).

    Args:
        path: the folder to be created later, e.g. an experiment's run folder.
        root: the ``local_model_result_folder_path`` it lies in, named in the error; ``path`` when None.

    Raises:
        NotADirectoryError: a regular file stands where a folder on the way must be.
        PermissionError: the nearest existing folder is not writable.
    """
    path = os.path.abspath(os.path.expanduser(path))
    root = path if root is None else root
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise _unusable_folder(errno.ENOTDIR, root, f"{existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unusable_folder(errno.EACCES, root, f"the folder {existing} is not writable")


def timestamp_now() -> str:
    """A folder-name-safe timestamp, e.g. ``2026-11-23_14-05-09``."""
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


_TIMESTAMP = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(?:_(\d+))?"


def newest_resumable_run(root: str, project_name: str, experiment_name: str) -> Optional[Tuple[str, str]]:
    """The newest run of an experiment that holds a complete checkpoint, for continuing it (``auto_resume``).

    Runs are the folders ``<root>/<project>/<experiment>_<timestamp>`` (``<timestamp>`` as
    :func:`timestamp_now` makes it, with the ``_<n>`` of same-second runs), newest timestamp first; the first
    with a checkpoint in ``checkpoint_model/`` (or, for a finished run, a final model in ``model/``) wins.

    Returns:
        ``(timestamp, checkpoint path)`` of its newest complete checkpoint (a file or a sharded checkpoint's
        folder), or None when no run of the experiment has one.
    """
    from aitoolbox.experiment.local_save.checkpoints import checkpoint_position, list_checkpoints

    check_name(project_name, "project_name")
    check_name(experiment_name, "experiment_name")
    project_folder = os.path.join(os.path.abspath(os.path.expanduser(root)), project_name)
    if not os.path.isdir(project_folder):
        return None
    pattern = re.compile(rf"^{re.escape(experiment_name)}_(?P<timestamp>{_TIMESTAMP})$")
    runs: List[Tuple[Tuple[str, int], str]] = []
    for name in os.listdir(project_folder):
        match = pattern.match(name)
        if match and os.path.isdir(os.path.join(project_folder, name)):
            timestamp = match.group("timestamp")
            runs.append(((timestamp[:19], int(match.group(2) or 0)), timestamp))
    for _, timestamp in sorted(runs, reverse=True):
        run_folder = os.path.join(project_folder, f"{experiment_name}_{timestamp}")
        found = (list_checkpoints(os.path.join(run_folder, "checkpoint_model"))
                 + list_checkpoints(os.path.join(run_folder, "model")))
        if found:
            newest = max(found, key=lambda path: checkpoint_position(
                os.path.basename(path) + ("" if path.endswith(".pth") else ".pth")))
            return timestamp, newest
    return None


class ExperimentFolder:
    """Paths of one experiment run; created on first use and never overwritten.

    Layout::

        <root>/<project>/<experiment>_<timestamp>/
            hyperparams_list.txt, hyperparams.json, <script copy>
            checkpoint_model/   model/   results/ (plots/)   tensorboard/

    Args:
        root: the ``local_model_result_folder_path``.
        project_name: the project folder.
        experiment_name: prefix of the run folder.
        timestamp: run identifier; the current time when None.
        hyperparams: written into the folder (:meth:`save_hyperparams`) when it is created, so that a folder
            created lazily, by its first file, holds them too.

    Raises:
        ValueError: ``root`` is empty, or the project name, experiment name or timestamp is not a plain name
            (see :mod:`~aitoolbox.experiment.local_save.names`).
    """

    def __init__(self, root: str, project_name: str, experiment_name: str, timestamp: Optional[str] = None,
                 hyperparams: Optional[dict] = None):
        if not isinstance(root, str) or not root:
            raise ValueError(f"local_model_result_folder_path must be a non-empty string, got {root!r}")
        check_name(project_name, "project_name")
        check_name(experiment_name, "experiment_name")
        if timestamp:  # None or '' take the current time
            check_name(timestamp, "timestamp")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.timestamp = timestamp or timestamp_now()
        self.hyperparams = hyperparams
        self._created = False

    def __repr__(self) -> str:
        return f"ExperimentFolder({self.path!r})"

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.project_name, f"{self.experiment_name}_{self.timestamp}")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.path, "checkpoint_model")

    @property
    def model_dir(self) -> str:
        return os.path.join(self.path, "model")

    @property
    def results_dir(self) -> str:
        return os.path.join(self.path, "results")

    @property
    def plots_dir(self) -> str:
        return os.path.join(self.results_dir, "plots")

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.path, "tensorboard")

    def create(self) -> str:
        """Create the run folder (once). An existing run folder is never reused or overwritten: a run started
        within the same second as another gets the timestamp ``<timestamp>_1`` (``_2``, ...) and that folder.

        Raises:
            PermissionError / NotADirectoryError / OSError: the folder cannot be created; the message names
                ``local_model_result_folder_path`` and the folder.
        """
        if self._created:
            return self.path
        try:
            self._make_run_folder()
        except OSError as error:
            if error.errno is None:
                raise  # the never-overwrite limit: already says what is wrong
            raise _unusable_folder(error.errno, self.root, f"cannot create {self.path} "
                                                           f"({error.strerror or error})") from error
        self._created = True
        if self.hyperparams is not None:
            self.save_hyperparams(self.hyperparams)
        return self.path

    def check_creatable(self) -> None:
        """Raise now if the run folder could not be created (see :func:`check_folder_creatable`); creates nothing.

        Raises:
            NotADirectoryError / PermissionError: the message names ``local_model_result_folder_path``.
        """
        check_folder_creatable(self.path, self.root)

    def _make_run_folder(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        base_timestamp = self.timestamp
        for suffix in range(1, MAX_SAME_SECOND_RUNS + 1):
            try:
                os.mkdir(self.path)
                break
            except FileExistsError:
                self.timestamp = f"{base_timestamp}_{suffix}"
        else:
            raise FileExistsError(f"experiment folders {self.path} and {MAX_SAME_SECOND_RUNS} more of the same "
                                  "timestamp exist already; they are never overwritten")
        for sub in (self.checkpoint_dir, self.model_dir, self.results_dir, self.tensorboard_dir):
            os.makedirs(sub, exist_ok=True)

    def adopt_if_created_elsewhere(self) -> None:
        """Accept the run folder as this run's own when another process of the run created it.

        After ``fit_distributed``, rank 0 may have created the folder (``lazy_experiment_save``) in its own
        process; the launching process then writes into it instead of refusing it as an existing run.
        """
        if os.path.isdir(self.path):
            self._created = True

    def ensure(self, sub_folder: str) -> str:
        """Create the run folder if needed and return ``sub_folder`` (one of the properties), created too."""
        self.create()
        os.makedirs(sub_folder, exist_ok=True)
        return sub_folder

    def save_hyperparams(self, hyperparams: dict, copy_script: bool = True) -> None:
        """Write ``hyperparams_list.txt`` and ``hyperparams.json``, secrets redacted (see
        :mod:`aitoolbox.experiment.redaction`); copy the running script when known."""
        self.create()
        written = redact_hyperparams(hyperparams)  # the files are uploaded with cloud_save_mode
        lines = [f"{key}:\t{value}" for key, value in written.items()]
        atomic_write_text(os.path.join(self.path, "hyperparams_list.txt"), "\n".join(lines) + "\n")
        atomic_write_text(os.path.join(self.path, "hyperparams.json"),
                          json.dumps(written, indent=2, sort_keys=True, default=repr))
        script = hyperparams.get("experiment_file_path") or getattr(sys.modules.get("__main__"), "__file__", None)
        if copy_script and script and os.path.isfile(script):
            shutil.copy2(script, os.path.join(self.path, os.path.basename(script)))

    def save_json(self, relative_path: str, content: Any) -> str:
        """Write JSON atomically under the run folder and return its path."""
        path = os.path.join(self.path, relative_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(content, indent=2, sort_keys=True, default=repr))
        return path
