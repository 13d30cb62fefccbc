"""Folders in a bucket: the local files of a folder opened for upload, and the completion marker.

A folder counts as complete only once its marker object (:data:`FOLDER_MARKER`) is there: a manifest of the
folder's files and their sizes, uploaded after every file. A reader that finds no marker, or a file the marker
lists missing or of another size, treats the folder as an interrupted upload.

A marker comes from the bucket, so whoever can write there chooses the names it lists: each must be a relative
path that stays inside the folder it is downloaded into (:func:`parse_folder_marker` refuses ``..``, absolute
names and the like; :func:`local_path_inside` also refuses a path that a symbolic link in the local folder
would lead outside). The sizes it lists bound the downloads (see
:meth:`~aitoolbox.cloud.storage.CloudStorage.download_folder`).

An upload takes regular files only and never follows a symbolic link: a link planted in a folder could point at
any file of the machine (a credentials file), so a link, to a file or to a folder, is uploaded as nothing, and so
is anything else that is not a regular file (a FIFO, which would block the upload, a socket, a device); one
warning names what was left out (:func:`open_folder`, :func:`open_for_upload`). Where the system allows it
(POSIX), files are opened relative to their already opened folder without following links, so a file replaced by
a link between the listing and the opening is not followed either.
"""
import errno
import json
import logging
import os
import stat
from typing import IO, Dict, List, Optional, Tuple

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.names import check_relative_path
from aitoolbox.experiment.local_save.sharded_checkpoints import MARKER_FILE as _SHARDED_MARKER

# The completion marker of a folder uploaded by :meth:`CloudStorage.upload_folder`: written after every file.
FOLDER_MARKER = ".aitoolbox-folder-complete.json"
FOLDER_MARKER_FORMAT = "aitoolbox-cloud-folder"
FOLDER_MARKER_VERSION = 1
# A sharded checkpoint's own marker (_SHARDED_MARKER) goes up after the folder's other files, so that a reader of
# the bucket that checks only it still never sees a partial folder.
#: The most bytes a folder marker may have: a marker listing tens of thousands of files is far smaller; a larger
#: object at a marker's key is refused before it is read into memory.
MAX_MARKER_BYTES = 16 * 1024 * 1024

logger = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
    getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_OPENS_RELATIVE = os.open in os.supports_dir_fd and hasattr(os, "fwalk") and hasattr(os, "O_NOFOLLOW")


class OpenFolder:
    """The files of a local folder, opened for reading (so later changes of the folder do not reach an upload
    queued now: a file replaced or deleted after opening is still read as it was). A context manager: closes them.

    Attributes:
        folder: the folder's path.
        handles: ``(path inside the folder with '/' separators, open binary file)``, in upload order.
        sizes: ``{path inside the folder: size}``.
    """

    def __init__(self, folder: str, handles: List[Tuple[str, IO[bytes]]]):
        self.folder = folder
        self.handles = handles
        self.sizes = {path: os.fstat(handle.fileno()).st_size for path, handle in handles}

    def close(self) -> None:
        for _, handle in self.handles:
            handle.close()

    def __enter__(self) -> "OpenFolder":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_for_upload(path: str, dir_fd: Optional[int] = None) -> Optional[IO[bytes]]:
    """Open ``path`` for reading if it is a regular file, without following a symbolic link.

    Args:
        path: the file (relative to ``dir_fd`` when that is given).
        dir_fd: an open folder ``path`` is relative to (POSIX).

    Returns:
        The open binary file, or None when ``path`` is a symbolic link or not a regular file.

    Raises:
        FileNotFoundError: there is no such file.
    """
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # no O_NOFOLLOW (Windows): check, then open
        return None
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd) if dir_fd is not None else os.open(path, _READ_FLAGS)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EOPNOTSUPP):  # a link; a socket
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_folder(local_folder: str, shown_as: Optional[str] = None) -> OpenFolder:
    """Open every regular file below ``local_folder`` except ``.tmp-*`` ones and an old :data:`FOLDER_MARKER`.

    Symbolic links (to files or folders) and entries that are not regular files are left out, with one warning
    naming them (see the module). A sharded checkpoint's own marker comes after its other files.

    Args:
        local_folder: the folder.
        shown_as: the folder's name in the warning (the folder as submitted, when ``local_folder`` is its pin).

    Raises:
        NotADirectoryError: ``local_folder`` is not a folder.
        ValueError: ``local_folder`` is a symbolic link (an upload never follows one).
    """
    local_folder = os.path.expanduser(local_folder)
    shown = shown_as or local_folder
    if os.path.islink(local_folder):
        raise ValueError(f"refusing to upload the folder {shown}: it is a symbolic link, and an upload never "
                         "follows one (its target could be any folder of this machine); upload the folder it "
                         "points to by its own path")
    if not os.path.isdir(local_folder):
        raise NotADirectoryError(f"cannot upload the folder {local_folder}: it is not a folder")
    handles: List[Tuple[str, IO[bytes]]] = []
    left_out: List[str] = []
    try:
        (_open_relative if _OPENS_RELATIVE else _open_by_path)(local_folder, handles, left_out)
    except BaseException:
        for _, handle in handles:
            handle.close()
        raise
    if left_out:
        logger.warning("Not uploading %d entr%s of %s: %s. An upload takes regular files only and never follows a "
                       "symbolic link (its target could be any file of this machine)", len(left_out),
                       "y" if len(left_out) == 1 else "ies", shown, ", ".join(sorted(left_out)))
    handles.sort(key=lambda item: (item[0] == _SHARDED_MARKER, item[0]))
    return OpenFolder(local_folder, handles)


def _relative(root: str, name: str, folder: str) -> str:
    return os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")


def _open_relative(folder: str, handles: List[Tuple[str, IO[bytes]]], left_out: List[str]) -> None:
    # Each folder is opened once, without following links (fwalk), and its files relative to it: no path is
    # resolved again after it was checked.
    for root, dirs, names, root_fd in os.fwalk(folder, follow_symlinks=False):
        kept = []
        for name in dirs:
            if name.startswith(TEMP_PREFIX):
                continue
            if stat.S_ISLNK(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode):
                left_out.append(f"{_relative(root, name, folder)} (a symbolic link)")
            else:
                kept.append(name)
        dirs[:] = sorted(kept)
        for name in sorted(names):
            if name.startswith(TEMP_PREFIX) or name == FOLDER_MARKER:
                continue
            _add(name, _relative(root, name, folder), root_fd, handles, left_out)


def _open_by_path(folder: str, handles: List[Tuple[str, IO[bytes]]], left_out: List[str]) -> None:
    for root, dirs, names in os.walk(folder):  # does not descend into linked folders
        kept = []
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                left_out.append(f"{_relative(root, name, folder)} (a symbolic link)")
            elif not name.startswith(TEMP_PREFIX):
                kept.append(name)
        dirs[:] = sorted(kept)
        for name in sorted(names):
            if not (name.startswith(TEMP_PREFIX) or name == FOLDER_MARKER):
                _add(os.path.join(root, name), _relative(root, name, folder), None, handles, left_out)


def _add(path: str, relative: str, dir_fd: Optional[int], handles: List[Tuple[str, IO[bytes]]],
         left_out: List[str]) -> None:
    handle = open_for_upload(path, dir_fd)
    if handle is not None:
        handles.append((relative, handle))
        return
    is_link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode) if dir_fd is not None \
        else os.path.islink(path)
    left_out.append(f"{relative} ({'a symbolic link' if is_link else 'not a regular file'})")


def parse_folder_marker(data: bytes, where: str) -> Dict[str, int]:
    """The files (path inside the folder -> size) a marker lists; ``where`` names the marker in errors.

    Raises:
        ValueError: it is not a marker, it lists a path that would leave the folder (``..``, absolute names,
            see :func:`~aitoolbox.experiment.local_save.names.check_relative_path`) or a size that is not a whole
            number of bytes.
    """
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:  # RecursionError: nested too deep
        raise ValueError(f"{where} is not a folder marker written by aitoolbox: {type(error).__name__}: "
                         f"{str(error)[:200]}") from None
    version = manifest.get("version", 0) if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != FOLDER_MARKER_FORMAT \
            or type(version) is not int or version > FOLDER_MARKER_VERSION \
            or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{where} is not a {FOLDER_MARKER_FORMAT} marker of version <= {FOLDER_MARKER_VERSION}")
    sizes = {}
    for path, size in manifest["files"].items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{where} lists the file {path!r} with the size {size!r}: a marker's sizes are whole "
                             "numbers of bytes >= 0, so this is not a marker aitoolbox wrote")
        sizes[check_relative_path(path, where)] = size
    return sizes


def local_path_inside(folder: str, relative_path: str, where: str) -> str:
    """``folder`` joined with the ``/``-separated ``relative_path`` read from storage, checked to stay inside.

    Args:
        folder: the local folder files are downloaded into.
        relative_path: a path inside it, as a marker or a bucket listing names it.
        where: where the name was read, named in the error.

    Raises:
        ValueError: the name is absolute or climbs out (``..``), or a symbolic link already in ``folder`` leads
            the path outside it.
    """
    check_relative_path(relative_path, where)
    path = os.path.join(folder, *relative_path.split("/"))
    root = os.path.realpath(folder)
    resolved = os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root:
        raise ValueError(f"{where} names the file {relative_path!r}, which a symbolic link in {folder} leads to "
                         f"{resolved}, outside the folder: refused")
    return path


def folder_marker(files: OpenFolder) -> bytes:
    """The marker of a folder of ``files``: JSON naming the format and each file with its size."""
    manifest = {"format": FOLDER_MARKER_FORMAT, "version": FOLDER_MARKER_VERSION, "files": dict(files.sizes)}
    return json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
