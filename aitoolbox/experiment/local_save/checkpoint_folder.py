"""A sharded checkpoint's folder, opened once: each of its files is opened at most once, by its name inside the
open folder, never through a symbolic link, and must be a regular file.

A name that is not a plain name inside the folder (an absolute path, ``..``, several parts) is refused: what the
folder's files say about other files (DCP's index names the file of each entry) cannot lead outside it, and the
file checked is the file read.
"""
import os
import re
from typing import Any, BinaryIO, Dict, Optional, Tuple

from aitoolbox.experiment.local_save.restricted_pickle import short
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError, open_regular_file

_NAME = re.compile(r"[^/\\\x00]+")


class CheckpointFolder:
    """A sharded checkpoint's folder, opened once; its files are opened by name inside it, each at most once.

    Args:
        path: the folder.
        expected_identity: the :attr:`identity` the folder had when it was opened before (a checkpoint whose
            training state was read at ``load_checkpoint`` and whose weights are read later, at ``fit``): the
            folder opened now must be that same folder, not one swapped into its place (e.g. by a symbolic link
            to another run's checkpoint) in between.

    Attributes:
        identity: ``(st_dev, st_ino)`` of the folder as opened (None where folders cannot be opened, on Windows).

    Raises (from the constructor):
        FileNotFoundError: there is no such folder.
        CorruptCheckpointError: ``path`` is not a folder, or not the folder of ``expected_identity``.
    """

    def __init__(self, path: str, expected_identity: Optional[Tuple[int, int]] = None):
        self.path = path
        self._files: Dict[str, BinaryIO] = {}
        self._descriptor: Optional[int] = None
        self.identity: Optional[Tuple[int, int]] = None
        if os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY"):
            try:
                self._descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise FileNotFoundError(f"there is no checkpoint folder {path}") from None
            except NotADirectoryError:
                raise CorruptCheckpointError(path, "it is not a folder") from None
            opened = os.fstat(self._descriptor)
            self.identity = (opened.st_dev, opened.st_ino)  # of the open folder: what is read, not what the path names
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"there is no checkpoint folder {path}")
        else:  # pragma: no cover - systems without dir_fd (Windows): the path, checked as close to the reads as can be
            named = os.stat(path)
            self.identity = (named.st_dev, named.st_ino)
        if expected_identity is not None and tuple(expected_identity) != self.identity:
            self.close()
            raise CorruptCheckpointError(path, "it is no longer the folder whose training state was read (it was "
                                               "replaced, e.g. by a symbolic link to another checkpoint, after it "
                                               "was checked): its weights are not loaded. Load the checkpoint again")

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str) -> BinaryIO:
        """The file ``name`` of the folder, open for reading (the same open file for every call)."""
        if name in self._files:
            return self._files[name]
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
            raise CorruptCheckpointError(self.path, f"it names the file {short(name)}, which is not a name inside its "
                                                    "folder (an absolute path, '..', or a path of several parts): "
                                                    "a checkpoint reads nothing outside its folder")
        try:
            if self._descriptor is not None:
                handle = open_regular_file(name, dir_fd=self._descriptor, follow_symlinks=False,
                                           shown=self.where(name))
            else:  # pragma: no cover - systems without dir_fd (Windows)
                if os.path.islink(self.where(name)):
                    raise CorruptCheckpointError(self.where(name), "it is a symbolic link; the files of a checkpoint "
                                                                   "must be regular files inside its folder")
                handle = open_regular_file(self.where(name))
        except FileNotFoundError:
            raise CorruptCheckpointError(self.where(name), "it is missing from the checkpoint's folder") from None
        self._files[name] = handle
        return handle

    def size(self, name: str) -> int:
        return os.fstat(self.open(name).fileno()).st_size

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """``length`` bytes (all to the end: None) of file ``name`` from ``offset``, which must lie inside it."""
        size = self.size(name)
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptCheckpointError(self.where(name), f"bytes {offset} to {offset + length} are asked for and "
                                                           f"the file holds {size}")
        handle = self.open(name)
        handle.seek(offset)
        data = handle.read(length)
        if len(data) != length:
            raise CorruptCheckpointError(self.where(name), "it changed size while it was read")
        return data

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> "CheckpointFolder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
