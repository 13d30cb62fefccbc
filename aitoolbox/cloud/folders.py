"""Folders in a bucket: the local files of a folder opened for upload, and the completion marker.

A folder counts as complete only once its marker object (:data:`FOLDER_MARKER`) is there: a manifest of the
folder's files and their sizes, uploaded after every file. A reader that finds no marker, or a file the marker
lists missing or of another size, treats the folder as an interrupted upload.

A marker comes from the bucket, so whoever can write there chooses the names it lists: each must be a relative
path that stays inside the folder it is downloaded into (:func:`parse_folder_marker` refuses ``..``, absolute
names and the like; :func:`local_path_inside` also refuses a path that a symbolic link in the local folder
would lead outside).
"""
import json
import os
from typing import IO, Dict, List, Tuple

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.names import check_relative_path
from aitoolbox.experiment.local_save.sharded_checkpoints import MARKER_FILE as _SHARDED_MARKER

# The completion marker of a folder uploaded by :meth:`CloudStorage.upload_folder`: written after every file.
FOLDER_MARKER = ".aitoolbox-folder-complete.json"
FOLDER_MARKER_FORMAT = "aitoolbox-cloud-folder"
FOLDER_MARKER_VERSION = 1
# A sharded checkpoint's own marker (_SHARDED_MARKER) goes up after the folder's other files, so that a reader of
# the bucket that checks only it still never sees a partial folder.


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


def open_folder(local_folder: str) -> OpenFolder:
    """Open every file below ``local_folder`` except ``.tmp-*`` ones and an old :data:`FOLDER_MARKER`.

    A sharded checkpoint's own marker comes after its other files.

    Raises:
        NotADirectoryError: ``local_folder`` is not a folder.
    """
    local_folder = os.path.expanduser(local_folder)
    if not os.path.isdir(local_folder):
        raise NotADirectoryError(f"cannot upload the folder {local_folder}: it is not a folder")
    paths = []
    for root, dirs, names in os.walk(local_folder):
        dirs[:] = sorted(name for name in dirs if not name.startswith(TEMP_PREFIX))
        for name in names:
            if name.startswith(TEMP_PREFIX) or name == FOLDER_MARKER:
                continue
            relative = os.path.relpath(os.path.join(root, name), local_folder).replace(os.sep, "/")
            paths.append(relative)
    paths.sort(key=lambda path: (path == _SHARDED_MARKER, path))
    handles: List[Tuple[str, IO[bytes]]] = []
    try:
        for relative in paths:
            handles.append((relative, open(os.path.join(local_folder, relative), "rb")))
    except BaseException:
        for _, handle in handles:
            handle.close()
        raise
    return OpenFolder(local_folder, handles)


def parse_folder_marker(data: bytes, where: str) -> Dict[str, int]:
    """The files (path inside the folder -> size) a marker lists; ``where`` names the marker in errors.

    Raises:
        ValueError: it is not a marker, or it lists a path that would leave the folder (``..``, absolute names,
            see :func:`~aitoolbox.experiment.local_save.names.check_relative_path`).
    """
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where} is not a folder marker written by aitoolbox: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FOLDER_MARKER_FORMAT \
            or manifest.get("version", 0) > FOLDER_MARKER_VERSION or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{where} is not a {FOLDER_MARKER_FORMAT} marker of version <= {FOLDER_MARKER_VERSION}")
    return {check_relative_path(path, where): int(size) for path, size in manifest["files"].items()}


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
