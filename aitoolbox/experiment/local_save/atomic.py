"""Atomic file writes: a reader sees the old complete file or the new complete file, never a partial one.

Data goes to a temporary file in the same folder, is flushed and fsync'ed, then renamed over the target
(``os.replace`` is atomic on POSIX and Windows), and the folder is fsync'ed so the rename itself survives a
power cut. A process killed mid-write leaves at most a ``.tmp-*`` file, which later writes ignore.
"""
import contextlib
import io
import os
import pickle
import tempfile
from typing import IO, Iterator, Optional

import torch

TEMP_PREFIX = ".tmp-"


def _fsync_directory(path: str) -> None:
    if os.name != "posix":  # pragma: no cover - directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file for writing; on success it replaces ``path`` atomically.

    On any error the temporary file is removed and ``path`` is left as it was. Errors such as a full disk
    (``OSError: [Errno 28] No space left on device``) or a missing permission propagate with the target named.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write supports modes 'w' and 'wb', got {mode!r}")
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    try:
        fd, temp_path = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{name}.", dir=directory)
    except OSError as error:
        raise OSError(error.errno, f"cannot write {path}: {error.strerror}") from error
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_path, path)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_path)
        if isinstance(error, OSError) and error.filename is None:
            raise OSError(error.errno, f"cannot write {path}: {error.strerror or error}") from error
        raise
    _fsync_directory(directory)


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str, text: str) -> None:
    with atomic_write(path, "w") as handle:
        handle.write(text)


class _WriteErrorRecorder:
    """The file handle given to ``torch.save``, remembering the OSError a write raised.

    torch.save replaces a failed write (disk full, file too large) with an unrelated RuntimeError
    ("unexpected pos ..."); the recorded error lets :func:`torch_save_atomic` report the real cause.
    """

    def __init__(self, handle: IO):
        self._handle = handle
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self._handle.flush()


def torch_save_atomic(obj, path: str) -> None:
    """``torch.save`` that never leaves a truncated file at ``path``.

    Raises:
        OSError: the file could not be written (disk full, file too large, no permission); the message names
            ``path``, which keeps its previous content.
    """
    with atomic_write(path, "wb") as handle:
        writer = _WriteErrorRecorder(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError as error:
            if writer.error is None:
                raise
            raise writer.error from error


def torch_load_checked(path: str, map_location="cpu", weights_only: bool = True):
    """``torch.load`` with an error that names the file when it is missing, truncated or not a checkpoint.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        RuntimeError: the file is truncated, corrupt, not a torch file, or holds objects ``weights_only``
            loading refuses; the message names the file and the cause.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise RuntimeError(f"cannot read checkpoint {path}: it is corrupt, or holds objects that "
                           f"torch.load(weights_only=True) refuses ({error})") from error
    except (RuntimeError, EOFError, ValueError, OSError, io.UnsupportedOperation) as error:
        raise RuntimeError(f"cannot read checkpoint {path}: the file is truncated or not a torch checkpoint "
                           f"({type(error).__name__}: {error})") from error
