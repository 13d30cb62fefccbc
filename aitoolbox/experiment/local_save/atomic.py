"""Atomic file writes: a reader sees the old complete file or the new complete file, never a partial one.

Data goes to a temporary file in the same folder, is flushed and fsync'ed, then renamed over the target
(``os.replace`` is atomic on POSIX and Windows), and the folder is fsync'ed so the rename itself survives a
power cut. A process killed mid-write leaves at most a ``.tmp-*`` file, which later writes ignore, and
:func:`~aitoolbox.experiment.local_save.leftovers.remove_stale_temporaries` removes once its writer is gone (the
name says which process wrote it).

Some file systems refuse to fsync a directory (EINVAL on /proc-like, FUSE and CIFS mounts; ENOTSUP or EBADF on
others): there the rename is as durable as the file system makes it, and the write still succeeds.
"""
import contextlib
import errno
import io
import logging
import os
import pickle
import tempfile
import threading
from typing import IO, Iterator, Optional

import torch

# The temporaries' names and owners are decided there (TEMP_PREFIX is imported from here too).
from aitoolbox.experiment.local_save.leftovers import TEMP_PREFIX, owner_token

logger = logging.getLogger(__name__)

# errnos of a directory fsync the file system does not support: not a failure of the write.
_FSYNC_UNSUPPORTED = frozenset(code for code in (errno.EINVAL, errno.EBADF, getattr(errno, "ENOTSUP", None),
                                                 getattr(errno, "EOPNOTSUPP", None)) if code is not None)
_fsync_unsupported_logged = threading.Event()  # the debug message is logged once per process


def _fsync_directory(path: str) -> None:
    """Make a rename in ``path`` durable; a file system that does not support directory fsync is no failure."""
    if os.name != "posix":  # pragma: no cover - directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _FSYNC_UNSUPPORTED:
            raise
        if not _fsync_unsupported_logged.is_set():
            _fsync_unsupported_logged.set()
            logger.debug("the file system of %s does not support fsync of a directory (%s): renames there are as "
                         "durable as it makes them", path, os.strerror(error.errno))
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
        fd, temp_path = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{name}.{owner_token()}.", dir=directory)
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


# How much torch.save writes between two background flushes to disk (see _WriteBehindFile).
WRITE_BEHIND_BYTES = 16 * 1024 * 1024
_sync_data = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


class _WriteBehindFile:
    """The file handle given to ``torch.save``: gets the data to disk while torch.save is still writing it.

    A checkpoint is durable only once fsync returns, and fsync of a file written in one go waits for all of it
    to reach the disk: for a large checkpoint that adds about half of torch.save's own time. Here, every
    :data:`WRITE_BEHIND_BYTES` a background thread flushes what has been written so far (fdatasync releases the
    GIL), so the disk works while torch.save serialises, and the final fsync has only the last stretch left.
    The flushed stretch is then dropped from the page cache: a checkpoint of gigabytes does not push the
    training data out of the cache, and torch.save keeps writing into recycled pages instead of new ones.

    It also remembers the first OSError of a write or of a background flush: torch.save replaces a failed write
    (disk full, file too large) with an unrelated RuntimeError ("unexpected pos ..."), and an I/O error that a
    background flush reported is not reported again by the final fsync (Linux reports it once per file).
    """

    def __init__(self, handle: IO, abandon: Optional[threading.Event] = None):
        self._handle = handle
        self._abandon = abandon
        self._write_behind_bytes = WRITE_BEHIND_BYTES
        self._bytes_written = 0
        self._in_page_cache_until = 0
        self._flush_wanted = threading.Event()
        self._finished = False
        self._flusher: Optional[threading.Thread] = None
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        if self._abandon is not None and self._abandon.is_set():
            self.error = self.error or InterruptedError(errno.EINTR, "the write was abandoned")
            raise self.error
        try:
            written = self._handle.write(data)
            self._bytes_written += written
            if self._bytes_written - self._in_page_cache_until >= self._write_behind_bytes:
                self._handle.flush()  # into the page cache, where the background flush finds it
                self._in_page_cache_until = self._bytes_written
                self._request_background_flush()
        except OSError as error:
            self.error = self.error or error
            raise
        if self.error is not None:  # a background flush failed: stop torch.save early
            raise self.error
        return written

    def flush(self) -> None:
        self._handle.flush()

    def _request_background_flush(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_in_background, name="aitoolbox-write-behind",
                                             daemon=True)
            self._flusher.start()
        self._flush_wanted.set()

    def _flush_in_background(self) -> None:
        descriptor = self._handle.fileno()
        on_disk_until = 0
        while True:
            self._flush_wanted.wait()
            self._flush_wanted.clear()
            if self._finished:
                return
            flushed_until = self._in_page_cache_until
            try:
                _sync_data(descriptor)
            except OSError as error:
                self.error = self.error or error
                return
            if hasattr(os, "posix_fadvise"):  # the pages are clean now: let the kernel reuse them
                with contextlib.suppress(OSError):  # only advice: a file system may not take it
                    os.posix_fadvise(descriptor, on_disk_until, flushed_until - on_disk_until,
                                     os.POSIX_FADV_DONTNEED)
            on_disk_until = flushed_until

    def finish(self) -> None:
        """Stop the background flushes (the caller's fsync makes the file durable); raise what one reported."""
        if self._flusher is not None:
            self._finished = True
            self._flush_wanted.set()
            self._flusher.join()
        if self.error is not None:
            raise self.error


def torch_save_atomic(obj, path: str, abandon: Optional[threading.Event] = None) -> None:
    """``torch.save`` that never leaves a truncated file at ``path``; returns once the file is on disk.

    Args:
        obj: what to save.
        path: the file to write.
        abandon: when given and set (from another thread) while the file is being written, the write stops at
            torch.save's next write call and raises ``InterruptedError``; the temporary file is removed and
            ``path`` keeps its previous content.

    Raises:
        OSError: the file could not be written (disk full, file too large, no permission); the message names
            ``path``, which keeps its previous content.
        InterruptedError: ``abandon`` was set (an ``OSError`` too).
    """
    with atomic_write(path, "wb") as handle:
        writer = _WriteBehindFile(handle, abandon)
        try:
            torch.save(obj, writer)
        finally:
            writer.finish()  # raises the OSError behind torch.save's RuntimeError, if there was one


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
