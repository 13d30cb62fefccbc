"""The experiment folder: ``<root>/<project>/<experiment>_<timestamp>/`` and its sub-folders."""
import datetime
import errno
import json
import logging
import os
import re
import shutil
import sys
from typing import Any, List, Optional, Tuple

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.names import check_name
from aitoolbox.experiment.local_save.run_identity import (
    RunIdentity, adoption_refusal, read_run_identity, write_run_identity)
from aitoolbox.experiment.redaction import redact_hyperparams

logger = logging.getLogger(__name__)


# Runs of one experiment started within the same second get suffixed folders, up to this many.
MAX_SAME_SECOND_RUNS = 1000


ROOT_ARGUMENT = "local_model_result_folder_path"

#: A plain TrainLoop's file-writing callbacks given no experiment details write into one run folder
#: ``<working directory>/aitoolbox_runs/run_<timestamp>/`` (as Lightning writes to ``lightning_logs/version_N``):
#: the project folder and the experiment name of :func:`default_run_folder`.
DEFAULT_RUNS_FOLDER = "aitoolbox_runs"
DEFAULT_EXPERIMENT_NAME = "run"


def json_keys(value: Any) -> Any:
    """``value`` with every dict key JSON has no key for (a tuple, an object) written as its ``repr`` and the others
    as the text JSON writes for them, so that ``json.dumps(..., sort_keys=True)`` takes any hyperparameters; the
    values are left to ``default=repr``."""
    if isinstance(value, dict):
        return {key if isinstance(key, str) else json.dumps(key) if key is None or isinstance(key, (bool, int, float))
                else repr(key): json_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_keys(item) for item in value]
    return value


def _unusable_folder(error_number: int, root: str, reason: str, in_working_dir: bool = False) -> OSError:
    # OSError(errno, ...) becomes the matching subclass: PermissionError, NotADirectoryError, ...
    if in_working_dir:
        # The default run folder: the user passed no folder argument, so the message names the working directory
        # and the arguments that choose another place.
        return OSError(error_number, f"the working directory {root!r} cannot hold {DEFAULT_RUNS_FOLDER}/, where "
                                     f"callbacks given no experiment details write: {reason}. Run from a folder "
                                     "you can write to, or give the callback project_name, experiment_name and "
                                     f"{ROOT_ARGUMENT} (a folder you can write to)")
    return OSError(error_number, f"{ROOT_ARGUMENT}={root!r} cannot hold the experiment folders: {reason}. Pass a "
                                 f"folder you can write to as {ROOT_ARGUMENT}")


def check_folder_creatable(path: str, root: Optional[str] = None, in_working_dir: bool = False) -> None:
    """Raise now if the folder ``path`` could not be created or written; creates nothing.

    Looks at the nearest existing folder on the way to ``path``: it must be a folder the process may write
    into (a process running as root may write anywhere, as it would when the folder is created).

    Args:
        path: the folder to be created later, e.g. an experiment's run folder.
        root: the ``local_model_result_folder_path`` it lies in, named in the error; ``path`` when None.
        in_working_dir: ``root`` is the working directory of the default run folder (:func:`default_run_folder`):
            the error names it and the arguments that choose another folder.

    Raises:
        NotADirectoryError: a regular file stands where a folder on the way must be.
        PermissionError: the nearest existing folder is not writable.
        FileNotFoundError: a symbolic link on the way leads to nothing (its missing end is named).
        OSError: (``errno.ELOOP``) a symbolic link on the way is part of a loop of links (named), or of a chain of
            more links than the system follows.
    """
    path = os.path.abspath(os.path.expanduser(path))
    root = path if root is None else root
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        if os.path.islink(existing):  # a link to nothing (an unmounted disk): creating the folders would fail
            code, reason = _broken_link(existing)
            raise _unusable_folder(code, root, reason, in_working_dir)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise _unusable_folder(errno.ENOTDIR, root, f"{existing} is a file, not a folder", in_working_dir)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unusable_folder(errno.EACCES, root, f"the folder {existing} is not writable", in_working_dir)


# As many links as Linux follows in one path before it gives up with ELOOP.
_MAX_LINK_HOPS = 40


def _broken_link(link: str) -> Tuple[int, str]:
    """Why the symbolic link ``link`` leads nowhere, with the errno: the missing end of its chain of links and the
    links passed through, or the loop it is part of (review 48m L3). Resolved as the system does (review 49l F6): a
    link's target relative to the link's folder, through the links on its way, before a ``..`` after them."""
    try:
        os.stat(link)
        looping = False
    except OSError as error:
        looping = error.errno == errno.ELOOP
    chain, current = [link], link
    while os.path.islink(current) and len(chain) <= _MAX_LINK_HOPS:
        current = _resolved_folder(os.path.join(os.path.dirname(current), os.readlink(current)))
        if current in chain:
            loop = " -> ".join(chain[chain.index(current):] + [current])
            return errno.ELOOP, f"{link} leads to a symbolic link loop: {loop} (fix or remove a link)"
        chain.append(current)
    if len(chain) > _MAX_LINK_HOPS:  # no loop among them: a chain longer than the system follows
        return errno.ELOOP, (f"{link} is a symbolic link to {os.readlink(link)}, which leads through more than "
                             f"{_MAX_LINK_HOPS} symbolic links (too many levels for the system: shorten the chain)")
    if looping:  # through a link on the way of a target (not found by the hops above)
        return errno.ELOOP, (f"{link} is a symbolic link to {os.readlink(link)}, which leads to a symbolic link loop "
                             "(fix or remove a link)")
    through = f" (through {', '.join(chain[1:-1])})" if len(chain) > 2 else ""
    return errno.ENOENT, (f"{link} is a symbolic link to {current}{through}, which does not exist (create it, or "
                          "remove the link)")


def _resolved_folder(path: str) -> str:
    """``path`` with every link in its folder resolved (not its last part, which may be a link: a hop of a chain)."""
    name = os.path.basename(path)
    if name in ("", ".", ".."):
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), name)


def _creation_failure(path: str, error: OSError) -> str:
    """Why creating the folder ``path`` failed, for :func:`_unusable_folder`: a link to nothing on the way named."""
    current = path
    while os.path.dirname(current) != current:
        if os.path.islink(current) and not os.path.exists(current):
            return f"cannot create {path}: {_broken_link(current)[1]}"
        current = os.path.dirname(current)
    return f"cannot create {path} ({error.strerror or error})"


def default_run_folder(timestamp: Optional[str] = None) -> "ExperimentFolder":
    """The run folder of a plain TrainLoop's callbacks that were given no experiment details:
    ``<working directory>/aitoolbox_runs/run_<timestamp>/`` (:data:`DEFAULT_RUNS_FOLDER`,
    :data:`DEFAULT_EXPERIMENT_NAME`). Nothing is created on disk before the first file is written into it."""
    folder = ExperimentFolder(os.getcwd(), DEFAULT_RUNS_FOLDER, DEFAULT_EXPERIMENT_NAME, timestamp=timestamp)
    folder.in_working_dir = True
    return folder


def timestamp_now() -> str:
    """A folder-name-safe timestamp, e.g. ``2026-11-23_14-05-09``."""
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


_TIMESTAMP = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(?:_(\d+))?"


def run_folder_name_pattern() -> "re.Pattern":
    """Matches a run folder's name, ``<experiment>_<timestamp>`` (groups ``name`` and ``timestamp``)."""
    return re.compile(rf"^(?P<name>.+?)_(?P<timestamp>{_TIMESTAMP})$")


def run_timestamps(root: str, project_name: str, experiment_name: str) -> List[str]:
    """Timestamps of the run folders ``<root>/<project>/<experiment>_<timestamp>`` of an experiment, newest first
    (``<timestamp>`` as :func:`timestamp_now` makes it, with the ``_<n>`` of same-second runs)."""
    check_name(project_name, "project_name")
    check_name(experiment_name, "experiment_name")
    project_folder = os.path.join(os.path.abspath(os.path.expanduser(root)), project_name)
    if not os.path.isdir(project_folder):
        return []
    pattern = re.compile(rf"^{re.escape(experiment_name)}_(?P<timestamp>{_TIMESTAMP})$")
    runs: List[Tuple[Tuple[str, int], str]] = []
    for name in os.listdir(project_folder):
        match = pattern.match(name)
        if match and os.path.isdir(os.path.join(project_folder, name)):
            timestamp = match.group("timestamp")
            runs.append(((timestamp[:19], int(match.group(2) or 0)), timestamp))
    return [timestamp for _, timestamp in sorted(runs, reverse=True)]


def run_checkpoints(run_folder: str) -> List[str]:
    """Complete checkpoints of a run folder, oldest progress first (``checkpoint_model/``, then a finished run's
    final model in ``model/``, which comes after every checkpoint)."""
    from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, list_checkpoints
    found = (list_checkpoints(os.path.join(run_folder, "checkpoint_model"))
             + list_checkpoints(os.path.join(run_folder, "model")))
    return sorted(found, key=checkpoint_path_position)


def newest_resumable_run(root: str, project_name: str, experiment_name: str,
                         identity: Optional[RunIdentity] = None) -> Optional[Tuple[str, str]]:
    """The newest run of an experiment that holds a complete checkpoint, for continuing it (``auto_resume``).

    Runs are the folders ``<root>/<project>/<experiment>_<timestamp>``, newest timestamp first; the first with a
    checkpoint in ``checkpoint_model/`` (or, for a finished run, a final model in ``model/``) wins.

    Args:
        root, project_name, experiment_name: where the runs are.
        identity: this job's identity: only runs it may continue count (see
            :func:`~aitoolbox.experiment.local_save.run_identity.adoption_refusal`); each one passed over is
            logged with the reason. None: every run counts.

    Returns:
        ``(timestamp, checkpoint path)`` of its newest complete checkpoint (a file or a sharded checkpoint's
        folder), or None when no run of the experiment has one.
    """
    project_folder = os.path.join(os.path.abspath(os.path.expanduser(root)), project_name)
    for timestamp in run_timestamps(root, project_name, experiment_name):
        run_folder = os.path.join(project_folder, f"{experiment_name}_{timestamp}")
        found = run_checkpoints(run_folder)
        if not found:
            continue
        if identity is not None:
            refusal = adoption_refusal(identity, read_run_identity(run_folder))
            if refusal is not None:
                logger.info("auto_resume: not continuing %s: %s", run_folder, refusal)
                continue
        return timestamp, found[-1]
    return None


class ExperimentFolder:
    """Paths of one experiment run; created on first use and never overwritten.

    Layout (each sub-folder is created when the first file goes into it, so none is left empty)::

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
        identity: the run's :class:`~aitoolbox.experiment.local_save.run_identity.RunIdentity`, recorded in the
            folder when it is created (what ``auto_resume`` checks before continuing the run).

    Raises:
        ValueError: ``root`` is empty, or the project name, experiment name or timestamp is not a plain name
            (see :mod:`~aitoolbox.experiment.local_save.names`).
    """

    def __init__(self, root: str, project_name: str, experiment_name: str, timestamp: Optional[str] = None,
                 hyperparams: Optional[dict] = None, identity: Optional[RunIdentity] = None):
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
        self.identity = identity
        self._created = False
        self._reserved = False  # the name is this run's: creating the folder never changes it
        # The default run folder under the working directory (default_run_folder): errors name that, not root.
        self.in_working_dir = False

    def __repr__(self) -> str:
        return f"ExperimentFolder({self.path!r})"

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.project_name, f"{self.experiment_name}_{self.timestamp}")

    @property
    def created(self) -> bool:
        """The run folder exists as this run's (created by this object, or by another process of the run)."""
        return self._created

    @property
    def reserved(self) -> bool:
        """The folder's name is decided for good (claimed, adopted or created)."""
        return self._reserved or self._created

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
        """Create the run folder (once), with the name :meth:`reserve` decided. An existing run folder is never
        reused or overwritten: a run started within the same second as another gets the timestamp
        ``<timestamp>_1`` (``_2``, ...) and that folder. Its sub-folders are created by :meth:`ensure`, when a file
        goes into them.

        Raises:
            PermissionError / NotADirectoryError / OSError: the folder cannot be created; the message names
                ``local_model_result_folder_path`` and the folder.
        """
        if self._created:
            return self.path
        self.reserve()
        try:
            if os.path.lexists(self.path) and not os.path.isdir(self.path):
                raise NotADirectoryError(errno.ENOTDIR, f"{self.path} is a file, not a folder")
            os.makedirs(self.path, exist_ok=True)  # reserved: no other run takes this name
        except OSError as error:
            raise _unusable_folder(error.errno or errno.EIO, self.root, _creation_failure(self.path, error),
                                   self.in_working_dir) from error
        self._created = True
        self._release_claim()  # the folder itself holds the name from now on
        if self.identity is not None:
            write_run_identity(self.path, self.identity)
        if self.hyperparams is not None:
            self.save_hyperparams(self.hyperparams)
        return self.path

    def reserve(self) -> str:
        """Decide the run folder's name now, for good, without creating the folder (``lazy_experiment_save``):
        returns the timestamp, suffixed (``<timestamp>_1``, ...) when another run has taken the name.

        The name is claimed by an empty marker file ``.<experiment>_<timestamp>.claim`` in the project folder,
        created exclusively, so two jobs started in the same second never decide on the same folder; the marker
        is removed when the folder is created. Every path this object gives out afterwards stays the run's.

        Raises:
            FileExistsError: the name and :data:`MAX_SAME_SECOND_RUNS` suffixed ones are all taken.
            OSError: the project folder cannot be created (the message names ``local_model_result_folder_path``).
        """
        if self._reserved or self._created:
            return self.timestamp
        project_folder = os.path.dirname(self.path)
        try:
            os.makedirs(project_folder, exist_ok=True)
        except OSError as error:
            raise _unusable_folder(error.errno or errno.EIO, self.root, _creation_failure(project_folder, error),
                                   self.in_working_dir) from error
        base_timestamp = self.timestamp
        for suffix in range(MAX_SAME_SECOND_RUNS + 1):
            self.timestamp = f"{base_timestamp}_{suffix}" if suffix else base_timestamp
            try:
                os.close(os.open(self._claim_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                continue  # another run (or job) holds this name
            except OSError as error:  # e.g. a project folder this process may not write into
                raise _unusable_folder(error.errno or errno.EIO, self.root,
                                       f"cannot claim a run folder's name in {project_folder} "
                                       f"({error.strerror or error})", self.in_working_dir) from error
            # Claimed; the folder may still exist from a run that created it (its claim then removed).
            if os.path.lexists(self.path):
                self._release_claim()
                continue
            self._reserved = True
            return self.timestamp
        self.timestamp = base_timestamp
        raise FileExistsError(f"experiment folders {self.path} and {MAX_SAME_SECOND_RUNS} more of the same "
                              "timestamp exist already; they are never overwritten")

    @property
    def _claim_path(self) -> str:
        return os.path.join(os.path.dirname(self.path), f".{os.path.basename(self.path)}.claim")

    def _release_claim(self) -> None:
        try:
            os.remove(self._claim_path)
        except FileNotFoundError:
            pass

    def check_creatable(self) -> None:
        """Raise now if the run folder could not be created (see :func:`check_folder_creatable`); creates nothing.

        Raises:
            NotADirectoryError / PermissionError: the message names ``local_model_result_folder_path``.
        """
        check_folder_creatable(self.path, self.root, self.in_working_dir)

    def adopt(self, timestamp: str, created: bool) -> None:
        """Take the run folder another process decided on (its timestamp) as this run's: rank 0 of a distributed
        run decides, and every process writes into that folder, never one derived anew from a clock.

        Args:
            timestamp: the run folder's timestamp, as the deciding process has it.
            created: the folder exists (created or continued by that process): it is not created again. A folder
                this object created itself stays created when the timestamp is its own.
        """
        check_name(timestamp, "timestamp")
        self._created = created or (self._created and timestamp == self.timestamp)
        self.timestamp = timestamp
        self._reserved = True  # decided by its owner

    def adopt_if_created_elsewhere(self) -> None:
        """Accept the run folder as this run's own when another process of the run created it.

        Only for a folder whose name this run decided (a continued run's, or one :meth:`reserve` claimed or
        :meth:`adopt` took): the existence of a folder of that name alone never makes it this run's.
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
                          json.dumps(json_keys(written), indent=2, sort_keys=True, default=repr))
        script = hyperparams.get("experiment_file_path") or getattr(sys.modules.get("__main__"), "__file__", None)
        if copy_script and script and os.path.isfile(script):
            shutil.copy2(script, os.path.join(self.path, os.path.basename(script)))

    def save_json(self, relative_path: str, content: Any) -> str:
        """Write JSON atomically under the run folder and return its path."""
        path = os.path.join(self.path, relative_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # json_keys: a result keyed by tuples (per-class pairs) or mixed key types is written, not a crash at the end
        atomic_write_text(path, json.dumps(json_keys(content), indent=2, sort_keys=True, default=repr))
        return path
