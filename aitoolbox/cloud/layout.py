"""Where an experiment's files go in a bucket (aitoolbox 1.8's key layout) and finding checkpoints there.

The bucket mirrors the local experiment folder under ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/``
(keys joined as 1.8 joined them, with ``os.path.join`` on POSIX: an empty prefix vanishes)::

    checkpoint_model/model_<experiment>_<timestamp>_E<epoch>.pth         checkpoints (ModelCheckpoint)
    checkpoint_model/model_<experiment>_<timestamp>_E<epoch>_ITER<i>.pth  mid-epoch checkpoints
    checkpoint_model/model_<experiment>_<timestamp>_E<epoch>/...         a sharded checkpoint (a folder)
    model/model_<experiment>_<timestamp>.pth                             the final model (ModelTrainEndSave)
    results/<file>                                                       results files, results/plots/*.png,
                                                                         gradient plots results/<plots dir>/...
    <tensorboard dir>/<project>_<experiment>/<event files>               TensorBoard logs
    hyperparams_list.txt, <experiment script>.py, <source zip>, <log>    files at the top of the run folder

So the key of any file of the local experiment folder is the run's key plus the file's path inside the folder
(:meth:`ExperimentKeys.for_local_path`).

A folder in the bucket counts as a checkpoint only with its completion marker (uploaded after its files, see
:meth:`~aitoolbox.cloud.storage.CloudStorage.upload_folder`): :func:`list_cloud_checkpoints` skips a folder
whose upload was interrupted, as :func:`~aitoolbox.experiment.local_save.checkpoints.list_checkpoints` skips
an interrupted local save.
"""
import logging
import os
import posixpath
import re
from typing import Dict, List, Optional, Tuple

from aitoolbox.cloud.errors import CloudIntegrityError
from aitoolbox.cloud.folders import FOLDER_MARKER, MAX_MARKER_BYTES, local_path_inside, parse_folder_marker
from aitoolbox.cloud.storage import CloudNotFoundError, CloudStorage, join_key
from aitoolbox.experiment.local_save.checkpoints import checkpoint_position
from aitoolbox.experiment.local_save.names import check_key_prefix, check_name
from aitoolbox.experiment.local_save.run_identity import (
    RUN_IDENTITY_FILE, RunIdentity, adoption_refusal, parse_run_identity)

CHECKPOINT_DIR = "checkpoint_model"
FINAL_MODEL_DIR = "model"
# A run record (aitoolbox_run.json) is a few hundred bytes: a larger object there is refused unread.
_MAX_RUN_RECORD_BYTES = 64 * 1024
RESULTS_DIR = "results"

logger = logging.getLogger(__name__)


class ExperimentKeys:
    """The keys of one run's files in the bucket (aitoolbox 1.8's layout).

    Args:
        cloud_dir_prefix: the folder inside the bucket that holds the projects (``''``: the bucket's top).
        project_name: the project's name.
        experiment_name: the experiment's name.
        experiment_timestamp: the run's timestamp.

    Raises:
        ValueError: a name is not a plain name, or the prefix climbs out (see
            :mod:`~aitoolbox.experiment.local_save.names`); the message names the value and what is allowed.
    """

    def __init__(self, cloud_dir_prefix: Optional[str], project_name: str, experiment_name: str,
                 experiment_timestamp: str):
        for name, value in (("project_name", project_name), ("experiment_name", experiment_name),
                            ("experiment_timestamp", experiment_timestamp)):
            check_name(value, name)
        self.cloud_dir_prefix = check_key_prefix(cloud_dir_prefix)
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.experiment_timestamp = experiment_timestamp

    @property
    def experiment(self) -> str:
        """``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>``: the run folder's key."""
        return join_key(self.cloud_dir_prefix, self.project_name,
                        f"{self.experiment_name}_{self.experiment_timestamp}")

    def folder(self, model_save_dir: str) -> str:
        """A sub-folder of the run (``checkpoint_model``, ``model``, ``results``)."""
        return join_key(self.experiment, model_save_dir)

    def checkpoint(self, file_name: str) -> str:
        """``.../checkpoint_model/<file_name>`` (a checkpoint file, or a sharded checkpoint's folder)."""
        return join_key(self.folder(CHECKPOINT_DIR), file_name)

    def final_model(self, file_name: str) -> str:
        """``.../model/<file_name>``."""
        return join_key(self.folder(FINAL_MODEL_DIR), file_name)

    def model(self, file_name: str, checkpoint_model: bool) -> str:
        """A checkpoint's key with ``checkpoint_model``, else the final model's (as 1.8's model savers chose)."""
        return self.checkpoint(file_name) if checkpoint_model else self.final_model(file_name)

    def results(self, path_in_results_dir: str) -> str:
        """``.../results/<path>`` (e.g. ``plots/loss.png``)."""
        return join_key(self.folder(RESULTS_DIR), path_in_results_dir)

    def experiment_file(self, path_in_experiment_folder: str) -> str:
        """``.../<path>``: any file of the run folder by its path inside the folder ('/'-separated)."""
        return join_key(self.experiment, path_in_experiment_folder)

    def for_local_path(self, local_path: str, local_experiment_folder: str) -> str:
        """The key of the file (or folder) ``local_path`` of the local run folder ``local_experiment_folder``.

        Raises:
            ValueError: ``local_path`` is not inside ``local_experiment_folder``.
        """
        local_path = os.path.abspath(os.path.expanduser(local_path))
        folder = os.path.abspath(os.path.expanduser(local_experiment_folder))
        relative = os.path.relpath(local_path, folder)
        if relative == os.curdir or relative.startswith(os.pardir + os.sep) or relative == os.pardir:
            raise ValueError(f"{local_path} is not inside the experiment folder {folder}")
        return self.experiment_file(relative.replace(os.sep, "/"))

    def __repr__(self) -> str:
        return f"ExperimentKeys({self.experiment!r})"


def list_cloud_checkpoints(storage: CloudStorage, prefix: str) -> List[str]:
    """Complete checkpoints directly inside the bucket folder ``prefix``, oldest training progress first.

    Mirrors :func:`~aitoolbox.experiment.local_save.checkpoints.list_checkpoints`: checkpoint files
    (``model_*_E<epoch>[_ITER<i>].pth`` and the final ``model_*.pth``), and folders of the same names without
    ``.pth`` (sharded checkpoints) that hold their completion marker with every file it lists. Folders whose
    upload was interrupted and other files are left out.

    Returns:
        Keys: of files, and of folders without a trailing ``/``.
    """
    prefix = prefix.rstrip("/")
    listing = storage.list(prefix + "/" if prefix else "")
    files: List[Tuple[str, int]] = []
    folders: Dict[str, Dict[str, int]] = {}
    for obj in listing:
        relative = obj.key[len(prefix) + 1:] if prefix else obj.key
        name, _, inside = relative.partition("/")
        if inside:
            folders.setdefault(name, {})[inside] = obj.size
        else:
            files.append((name, obj.size))
    named = []
    for name, _ in files:
        position = checkpoint_position(name)
        if position is not None:
            named.append((position, join_key(prefix, name)))
    for name, contents in folders.items():
        position = checkpoint_position(f"{name}.pth")
        if position is not None and FOLDER_MARKER in contents \
                and _folder_complete(storage, join_key(prefix, name), contents):
            named.append((position, join_key(prefix, name)))
    return [key for _, key in sorted(named)]


def _folder_complete(storage: CloudStorage, folder_key: str, contents: Dict[str, int]) -> bool:
    marker_key = join_key(folder_key, FOLDER_MARKER)
    try:
        manifest = parse_folder_marker(storage.download_bytes(marker_key, max_size=MAX_MARKER_BYTES),
                                       storage.uri(marker_key))
    except (CloudNotFoundError, ValueError):  # removed since the listing, or not our marker (too large included)
        return False
    return all(contents.get(path) == size for path, size in manifest.items())


def find_newest_cloud_checkpoint(storage: CloudStorage, prefix: str) -> str:
    """The newest complete checkpoint in the bucket folder ``prefix`` or in its ``checkpoint_model/`` folder.

    Mirrors :func:`~aitoolbox.experiment.local_save.checkpoints.find_checkpoint` for a folder: ``prefix`` may
    be a run's key (:attr:`ExperimentKeys.experiment`) or its checkpoint folder's.

    Raises:
        CloudNotFoundError: no complete checkpoint is there; the message names the bucket and prefix.
    """
    prefix = prefix.rstrip("/")
    for folder in (prefix, join_key(prefix, CHECKPOINT_DIR)):
        found = list_cloud_checkpoints(storage, folder)
        if found:
            return found[-1]
    raise CloudNotFoundError(
        f"{storage.service}: no complete checkpoint (model_*_E<epoch>.pth, a sharded checkpoint folder with its "
        f"completion marker, or a final model_*.pth) under {storage.uri(prefix)} or its {CHECKPOINT_DIR}/ folder "
        f"(bucket {storage.bucket_name!r}, prefix {prefix!r})", service=storage.service, bucket=storage.bucket_name,
        key=prefix, operation="list", reason="NoCheckpoint")


def download_checkpoint(storage: CloudStorage, key: str, local_folder: str, replace: bool = True) -> str:
    """Download the checkpoint ``key`` (a file, or a sharded checkpoint's complete folder) into ``local_folder``.

    Args:
        storage: the bucket.
        key: the checkpoint's key (a file, or a folder without a trailing ``/``).
        local_folder: where to put it.
        replace: replace an existing local file or folder of that name (once the download is complete); with
            False an existing sharded checkpoint folder is kept (files are always replaced atomically).

    Returns:
        The local path: ``<local_folder>/<name>``.

    Raises:
        CloudNotFoundError: there is no such file, nor a complete folder.
        ValueError: the key's last part (``..``) or a symbolic link in ``local_folder`` would put it outside
            ``local_folder``.
    """
    key = key.rstrip("/")
    local_path = local_path_inside(os.path.expanduser(local_folder), posixpath.basename(key), storage.uri(key))
    if storage.exists(key):
        return storage.download_file(key, local_path)
    return storage.download_folder(key, local_path, replace=replace)


# A run folder's timestamp as aitoolbox writes it (``%Y-%m-%d_%H-%M-%S``), with the ``_<n>`` of runs started in
# the same second.
_RUN_TIMESTAMP = r"(?P<timestamp>\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(?:_(?P<same_second>\d+))?)"


def newest_cloud_run(storage: CloudStorage, cloud_dir_prefix: Optional[str], project_name: str,
                     experiment_name: str, identity: Optional[RunIdentity] = None) -> Optional[Tuple[str, str]]:
    """The newest run of an experiment in the bucket that holds a complete checkpoint (for ``auto_resume``).

    Mirrors :func:`~aitoolbox.experiment.local_save.experiment_folder.newest_resumable_run`: the runs are the
    folders ``<cloud_dir_prefix>/<project>/<experiment>_<timestamp>/``, newest timestamp first; the first one
    with a complete checkpoint in ``checkpoint_model/`` (or a final model in ``model/``) wins. With ``identity``,
    only a run this job may continue counts (its uploaded ``aitoolbox_run.json``, see
    :mod:`~aitoolbox.experiment.local_save.run_identity`); each one passed over is logged with the reason.

    Returns:
        ``(timestamp, key of its newest complete checkpoint)``, or None when no run of the experiment has one.
    """
    check_name(project_name, "project_name")
    check_name(experiment_name, "experiment_name")
    project_key = join_key(check_key_prefix(cloud_dir_prefix), project_name)
    pattern = re.compile(rf"^{re.escape(experiment_name)}_{_RUN_TIMESTAMP}$")
    runs: Dict[str, Tuple[str, int]] = {}
    for obj in storage.list(f"{project_key}/{experiment_name}_"):
        run_name = obj.key[len(project_key) + 1:].split("/", 1)[0]
        match = pattern.match(run_name)
        if match:
            timestamp = match.group("timestamp")
            runs[timestamp] = (timestamp[:19], int(match.group("same_second") or 0))
    for timestamp in sorted(runs, key=runs.get, reverse=True):
        run_key = join_key(project_key, f"{experiment_name}_{timestamp}")
        found = (list_cloud_checkpoints(storage, join_key(run_key, CHECKPOINT_DIR))
                 + list_cloud_checkpoints(storage, join_key(run_key, FINAL_MODEL_DIR)))
        if not found:
            continue
        if identity is not None:
            refusal = adoption_refusal(identity, _cloud_run_identity(storage, run_key))
            if refusal is not None:
                logger.info("auto_resume: not continuing %s: %s", storage.uri(run_key), refusal)
                continue
        return timestamp, max(found, key=_key_position)
    return None


def _cloud_run_identity(storage: CloudStorage, run_key: str) -> Optional[RunIdentity]:
    key = join_key(run_key, RUN_IDENTITY_FILE)
    if not storage.exists(key):
        return None
    try:
        data = storage.download_bytes(key, max_size=_MAX_RUN_RECORD_BYTES)
    except CloudIntegrityError as error:  # not a record aitoolbox wrote: as unreadable as a broken one
        logger.warning("auto_resume: %s cannot be read (%s); the run is treated as one without a record",
                       storage.uri(key), error)
        return None
    return parse_run_identity(data.decode("utf-8", errors="replace"), storage.uri(key))


def _key_position(key: str) -> Tuple[int, int, int]:
    name = posixpath.basename(key)
    return checkpoint_position(name if name.endswith(".pth") else f"{name}.pth")
