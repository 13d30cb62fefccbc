"""Temporaries of interrupted saves: whose they are, and removing those whose writer is gone.

Every save writes a temporary first (``.tmp-<name>...``) and renames it when complete; a process killed midway
leaves it behind, full size. Each temporary says who writes it: a file in its name
(``.tmp-<name>.<pid>-<token>[-j<job>]@<host>.<random>``, ``<job>`` a short hash of the job id), a sharded
checkpoint's folder in an :data:`OWNER_FILE` inside.
:func:`remove_stale_temporaries` removes those of writers that are gone, never one a live process may still
write, so that it can run at the start of every save, even with another job writing into the same folder;
:func:`remove_stale_temporaries_under` does so in a run folder and every folder in it (hyperparameters, results,
plots and logs are written the same way as checkpoints).
"""
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
#: Inside a temporary folder: who is writing it (host, process id and token, job id).
OWNER_FILE = ".owner.json"
#: A temporary nobody can tell the owner of (another host, an older aitoolbox) is stale once nothing in it has
#: changed for this long: a save in flight keeps writing into it.
STALE_AFTER_S = 3600.0
# An owner record holds a host name, two numbers and a job id: anything longer was not written by us.
_MAX_OWNER_RECORD_BYTES = 4096


def _job_id() -> str:
    """The job this process belongs to, as the scheduler names it ('' when unknown); a requeued SLURM job keeps its
    id, so its new processes know the temporaries of its killed ones."""
    return os.environ.get("AITOOLBOX_RUN_ID") or os.environ.get("SLURM_JOB_ID") or ""


class _ProcessIdentity:
    """This process's id and a random token of its own: in a container restarted on the same host a new process
    often gets the pid of the killed one, and only the token tells them apart."""

    _pid = -1
    _token = ""

    @classmethod
    def token(cls) -> str:
        if cls._pid != os.getpid():  # a new process (a fork too) gets a token of its own
            cls._pid, cls._token = os.getpid(), os.urandom(4).hex()
        return cls._token


def _job_tag(job: str) -> str:
    """A short hash of a job id for file names ('' for none): ids may be long or hold characters a name cannot."""
    return hashlib.sha256(job.encode("utf-8")).hexdigest()[:12] if job else ""


def owner_token() -> str:
    """``<pid>-<token>[-j<job>]@<host>``: put into the names of temporary files (a file cannot hold a marker). The
    job lets a requeued job on another host recognise the temporaries its killed processes left."""
    tag = _job_tag(_job_id())
    return f"{os.getpid()}-{_ProcessIdentity.token()}{f'-j{tag}' if tag else ''}@{socket.gethostname()}"


# .tmp-<name>.<pid>-<token>[-j<job>]@<host>.<random>: mkstemp's random part has no dot, host names may have some.
_OWNED_TEMP_FILE = re.compile(r"^" + re.escape(TEMP_PREFIX)
                              + r".+\.(\d+)-([0-9a-f]+)(?:-j([0-9a-f]+))?@([^@/]+)\.[A-Za-z0-9_]+$")


def create_temporary_folder(path: str) -> None:
    """Create the temporary folder ``path`` holding the record of who writes it, never one without: it is made under
    a name that says who writes it (``<path>.<owner_token()>.<random>``, as a temporary file's), the record written
    into it, then renamed to ``path``. A process killed in between leaves a folder :func:`remove_stale_temporaries`
    knows the owner of, removed at the next save rather than kept for :data:`STALE_AFTER_S`."""
    staging = f"{path}.{owner_token()}.{os.urandom(4).hex()}"
    os.makedirs(staging)
    with open(os.path.join(staging, OWNER_FILE), "w", encoding="utf-8") as handle:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": _ProcessIdentity.token(),
                   "job": _job_id()}, handle)
    os.rename(staging, path)


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def _quiet_for(path: str, seconds: float) -> bool:
    """Nothing in ``path`` (a file or folder, recursively) changed in the last ``seconds``."""
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        for root, folders, files in os.walk(path):
            for name in folders + files:
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return time.time() - newest > seconds


def _is_stale(path: str) -> bool:
    """Whether the temporary ``path`` was left by a writer that is gone: never one of this process (its saves may
    be in flight), never one a live process on this host owns, and one of another host only when it is of this
    same job (restarted: its old processes are gone) or has not changed for :data:`STALE_AFTER_S`."""
    name = os.path.basename(path)
    if os.path.isdir(path) and name.endswith(".old"):
        return True  # a replaced or removed checkpoint moved aside: its deletion was all that was left to do
    owner = None
    if os.path.isdir(path):
        owner = _read_owner_record(os.path.join(path, OWNER_FILE))
    if owner is None:  # a file, or a folder killed while created (create_temporary_folder): its name says whose
        match = _OWNED_TEMP_FILE.match(name)
        if match:  # a file without a job in its name: no job id, or an older aitoolbox (None: unknown)
            owner = (match.group(4), int(match.group(1)), match.group(2), match.group(3))
    if owner is None:  # no owner recorded (an older aitoolbox, or killed before it was written)
        return _quiet_for(path, STALE_AFTER_S)
    host, pid, token, job = owner  # job: the tag of the writer's job id ('': none; None: not recorded)
    same_job = job is not None and job == _job_tag(_job_id())
    if host == socket.gethostname():
        if pid == os.getpid():
            return token is not None and token != _ProcessIdentity.token()  # an earlier process with our pid
        if _process_running(pid):
            return False
        # Process ids are per host and container: another job on a host of the same name might own it.
        return same_job or job is None or _quiet_for(path, STALE_AFTER_S)
    return (same_job and job != "") or _quiet_for(path, STALE_AFTER_S)


def _read_owner_record(path: str) -> Optional[Tuple[str, int, Optional[str], str]]:
    """``(host, pid, token, job tag)`` of the owner record ``path``, or None when it is missing or not one that
    :func:`create_temporary_folder` writes.

    The folder is shared, so the record may be planted: it is opened without waiting and without following a
    link (a named pipe would block ``open`` forever, a link could lead anywhere), must be a regular file, and only
    its first few KiB are read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        data = os.read(descriptor, _MAX_OWNER_RECORD_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    if len(data) > _MAX_OWNER_RECORD_BYTES:
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
        return None
    if not isinstance(record, dict):
        return None
    host, pid, token, job = record.get("host"), record.get("pid"), record.get("token"), record.get("job", "")
    if not (isinstance(host, str) and type(pid) is int and 0 < pid < 2 ** 31 and isinstance(job, str)
            and (token is None or isinstance(token, str))):
        return None  # e.g. a pid os.kill cannot take, or 0 and -1, which name process groups
    return host, pid, token, _job_tag(job)


def remove_stale_temporaries(folder: str) -> list:
    """Remove from ``folder`` the ``.tmp-*`` files and folders of saves whose writer was killed; return their paths.

    Killed saves leave full-size temporaries: a sharded checkpoint's ``.tmp-<name>/`` folder (its owner is recorded
    in it) or a file's ``.tmp-<name>.<pid>@<host>.<random>``. What a live process may still be writing is kept:
    see :func:`_is_stale`. Errors are logged, never raised (a leftover is only wasted space).
    """
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(TEMP_PREFIX):
            continue
        path = os.path.join(folder, name)
        try:
            if not _is_stale(path):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue  # removed meanwhile (by its writer, or another cleaner)
        except Exception as error:  # noqa: BLE001 - a leftover is only wasted space: a save must not fail for it
            logger.warning("could not remove %s, left by an interrupted save: %s", path, error)
            continue
        logger.info("removed %s, left by an interrupted save", path)
        removed.append(path)
    return removed


def remove_stale_temporaries_under(folder: str) -> list:
    """:func:`remove_stale_temporaries` in ``folder`` and every folder under it; return the paths removed.

    A temporary folder (``.tmp-*``, a sharded checkpoint being written) is judged as a whole, never entered, and
    symbolic links to folders are not followed (the run folder may be shared: a link could lead anywhere). One
    listing per folder: a few milliseconds for a run folder of thousands of files.
    """
    removed = []
    for current, folders, _ in os.walk(folder, followlinks=False):
        removed.extend(remove_stale_temporaries(current))
        folders[:] = [name for name in folders if not name.startswith(TEMP_PREFIX)]
    return removed
