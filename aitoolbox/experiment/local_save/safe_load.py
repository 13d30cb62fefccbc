"""Reading checkpoint files without running code from them: aitoolbox's one reader of untrusted torch files.

A ``.pth`` file is a pickle: loaded with full unpickling, it can make Python call any function it names (a file
planted in a shared bucket whose ``__reduce__`` returns ``os.system`` runs a shell command on the training
machine). aitoolbox therefore reads every checkpoint with a reader of its own
(:mod:`~aitoolbox.experiment.local_save.torch_file`), which builds tensors, numbers, strings, containers, torch's
sizes, dtypes and devices, and the plain data types aitoolbox 1.x checkpoints hold in their hyperparameters (numpy
scalars and arrays of numbers, booleans or text, ``argparse.Namespace``, paths, dates), each from plain data
it checks; it refuses everything else before building anything. It changes nothing global: a ``torch.load`` of
another thread is as strict as torch makes it, whatever aitoolbox loads meanwhile.

A file is opened once, must be a regular file (not a pipe or a device), and is read once: the object it gives is
what every later step uses. What a file may cost is bounded (:func:`checkpoint_limits`): its records may not
state more than ``max_expansion`` times its size (a decompression bomb), its tensors hold more than
``max_tensor_bytes`` (or ``max_expansion`` times its size) in all, nor nest containers deeper than
``max_nesting``.

Errors (all ``Exception`` subclasses naming the file):

- :class:`UntrustedCheckpointError`: the file holds objects only full unpickling can build (it names them).
  Loading it anyway takes ``weights_only=False`` on the loading call, meant only for files you trust (your own
  experiments): it runs whatever the file says.
- :class:`CorruptCheckpointError`: the file is damaged, truncated, not a checkpoint, or beyond the limits.
- :class:`CheckpointMismatchError`: a sound checkpoint does not fit the model, optimizers or loaders it is loaded
  into.
- :class:`CheckpointLoadError`: the base of these, raised as itself when a sound file cannot be loaded here (its
  tensors were saved on a device this machine lacks).
"""
import contextlib
import logging
import os
import pickle
import stat
from typing import Any, BinaryIO, Iterator, Optional, Sequence

import torch

from aitoolbox.experiment.local_save.restricted_pickle import Malformed, Refused, Unavailable
from aitoolbox.experiment.local_save.torch_file import LIMITS, ReadLimits, read_torch_file

logger = logging.getLogger(__name__)


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded; the base of aitoolbox's loading errors, and raised as itself for a
    failure that is neither of the two below (e.g. the file's tensors were saved on a device this machine lacks).

    A ``RuntimeError``, as unreadable checkpoints raised before. The message names the file and what is wrong.

    Attributes:
        path: the file (or a sharded checkpoint's folder, or one file in it).
        reason: what is wrong, in words.
    """

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        return f"cannot read checkpoint {self.path}: {self.reason}"

    def __reduce__(self) -> Any:  # DCP sends a process's error to the others pickled
        return type(self), (self.path, self.reason)


class CorruptCheckpointError(CheckpointLoadError, ValueError):
    """The file is damaged, truncated, not a checkpoint, or beyond what the reader accepts (a decompressed size far
    beyond the file's, a storage entry outside its folder, nesting too deep).

    Nothing from the file was run. Loading it with ``weights_only=False`` would not help: use another copy, or an
    earlier checkpoint. A ``RuntimeError`` and a ``ValueError`` (what aitoolbox raised before for unreadable and for
    non-checkpoint files).
    """

    def _message(self) -> str:
        return (f"cannot read checkpoint {self.path}: it is corrupt or not a checkpoint: {self.reason}. Nothing from "
                "it was run; use another copy of it or an earlier checkpoint")


class CheckpointMismatchError(CheckpointLoadError, ValueError):
    """A checkpoint read from a file does not fit what it is loaded into: another model's weights (missing keys,
    other shapes), another number of optimizers, a training loader built otherwise.

    The message names the file and gives the reason (the error of the loading code, e.g. torch's
    ``load_state_dict``, is chained). A ``RuntimeError`` and a ``ValueError``, as those reasons are.
    """

    def _message(self) -> str:
        return f"cannot load checkpoint {self.path}: it does not fit: {self.reason}"


class UntrustedCheckpointError(CheckpointLoadError, pickle.UnpicklingError):
    """A file holds Python objects that loading it would have to build by running code named in the file.

    Nothing from the file was run. A ``RuntimeError`` (as other unreadable checkpoints) and a
    ``pickle.UnpicklingError`` (as torch's own refusal).

    Attributes:
        path: the file.
        refused: the refused globals, ``module.name`` (at least one).
    """

    def __init__(self, path: str, refused: Sequence[str], detail: str = ""):
        self.refused = list(refused)
        self.detail = detail
        super().__init__(path, f"it holds objects of {', '.join(self.refused) or detail}")

    def _message(self) -> str:
        return (f"refusing to load {self.path}: {self.reason}, which only full unpickling can build, and full "
                "unpickling runs whatever code the file names. Nothing from the file was run. If you trust this "
                "file (you wrote it yourself, e.g. with aitoolbox 1.x and custom objects in the hyperparameters), "
                "load it with weights_only=False; only for files you trust")

    def __reduce__(self) -> Any:
        return type(self), (self.path, self.refused, self.detail)


@contextlib.contextmanager
def checkpoint_limits(max_expansion: Optional[float] = None, max_nesting: Optional[int] = None,
                      max_tensor_bytes: Optional[int] = None,
                      max_index_bytes: Optional[int] = None) -> Iterator[None]:
    """Change what reading a checkpoint may cost, for the loads inside the ``with`` block (of this thread).

    Args:
        max_expansion: a file's records (its pickle and storages) may state at most this many times the file's
            size, and a compressed record this many times its compressed size (default 100; ``torch.save`` writes
            records uncompressed, so a real checkpoint is about 1). Raise it only for a file you trust that was
            compressed, e.g. mostly zeros.
        max_nesting: containers in a file may nest at most this deep (default 100).
        max_tensor_bytes: the tensors of a file (or of a sharded checkpoint) may hold, in all, the larger of this
            many bytes and ``max_expansion`` times the bytes stored for them (default 1 GiB). A tensor may be a
            view repeating a small storage (an expanded buffer), which costs nothing until it is copied.
        max_index_bytes: a sharded checkpoint's index (``.metadata``), and each of its non-tensor entries, may be at
            most this large (default 256 MiB); it is read whole into memory, so it is checked before reading.

    Raises:
        ValueError: a bound that is not a number >= 1 (``max_tensor_bytes``: an int >= 0; the byte counts ints).
    """
    current = LIMITS.get()
    limits = ReadLimits(current.max_expansion if max_expansion is None else max_expansion,
                        current.max_nesting if max_nesting is None else max_nesting,
                        current.max_tensor_bytes if max_tensor_bytes is None else max_tensor_bytes,
                        current.max_index_bytes if max_index_bytes is None else max_index_bytes)
    token = LIMITS.set(limits)
    try:
        yield
    finally:
        LIMITS.reset(token)


def is_weights_only_refusal(error: BaseException) -> bool:
    """True when ``error`` (from ``torch.load(weights_only=True)``) refused the file's content, not its format."""
    text = str(error)
    return isinstance(error, pickle.UnpicklingError) and ("Weights only load failed" in text
                                                          or "WeightsUnpickler" in text
                                                          or "weights_only" in text)


def open_regular_file(path: str, dir_fd: Optional[int] = None, follow_symlinks: bool = True,
                      shown: Optional[str] = None) -> BinaryIO:
    """``path`` opened for reading, once; it must be a regular file.

    Opened without waiting (a named pipe planted in its place would block ``open`` until someone writes to it),
    then checked on the open file: a pipe, a device (``/dev/zero``) or a folder is refused. With ``dir_fd``,
    ``path`` is a name inside that open folder; without ``follow_symlinks`` a symbolic link is refused. Errors name
    ``shown`` (default: ``path``).

    Raises:
        FileNotFoundError: nothing is there.
        CorruptCheckpointError: not a regular file, or (``follow_symlinks=False``) a symbolic link.
        CheckpointLoadError: it cannot be opened (permissions).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    where = shown or path
    try:
        descriptor = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {where} does not exist") from None
    except OSError as error:
        if not follow_symlinks and os.path.islink(path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{path}"):
            raise CorruptCheckpointError(where, "it is a symbolic link; the files of a checkpoint must be regular "
                                                "files inside its folder") from None
        raise CheckpointLoadError(where, f"it cannot be opened ({error.strerror or error})") from error
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else \
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file"
            raise CorruptCheckpointError(where, f"it is not a regular file ({kind})")
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_torch_source(source: BinaryIO, what: str, map_location: Any = "cpu") -> Any:
    """What ``torch.save`` wrote into ``source`` (an open file or bytes), read by aitoolbox's reader; errors name
    ``what``.

    Raises:
        UntrustedCheckpointError: it holds objects only full unpickling can build (nothing was run).
        CorruptCheckpointError: it is damaged, not a torch file, or beyond :func:`checkpoint_limits`.
        CheckpointLoadError: its tensors were saved on a device this machine lacks.
    """
    try:
        return read_torch_file(source, map_location)
    except Refused as refused:
        raise UntrustedCheckpointError(what, refused.names) from None
    except Malformed as malformed:
        raise CorruptCheckpointError(what, str(malformed)) from None
    except Unavailable as unavailable:
        raise CheckpointLoadError(what, str(unavailable)) from None


def load_torch_file(path: str, map_location: Any = "cpu", weights_only: bool = True, *,
                    follow_symlinks: bool = True) -> Any:
    """Read the file ``path`` (written by ``torch.save``) without running code from it, unless ``weights_only=False``.

    Args:
        path: a file written by ``torch.save``.
        map_location: where to put the tensors (``torch.load``'s argument: a device, a string, a dict from saved
            to new locations, a function, or None for where they were saved).
        weights_only: True (the default) builds only tensors and plain data (see the module's description).
            False unpickles fully, with ``torch.load``: only for files you trust, as it runs whatever code the file
            names.
        follow_symlinks: False refuses a symbolic link at ``path``.

    Raises:
        UntrustedCheckpointError: the file holds other objects (with ``weights_only=True``); nothing was run.
        CorruptCheckpointError: the file is truncated, damaged, not a torch file, or beyond
            :func:`checkpoint_limits`.
        CheckpointLoadError: its tensors were saved on a device this machine lacks; or, with
            ``weights_only=False``, full unpickling failed.
        FileNotFoundError: there is no file at ``path``.
    """
    with open_regular_file(path, follow_symlinks=follow_symlinks) as source:
        if weights_only:
            return read_torch_source(source, path, map_location)
        logger.info("Loading %s with full unpickling (weights_only=False): it may run code the file names", path)
        try:
            return torch.load(source, map_location=map_location, weights_only=False)
        except Exception as error:  # noqa: BLE001 - whatever full unpickling met, named with the file
            raise CheckpointLoadError(path, f"full unpickling failed ({type(error).__name__}: {error})") from error
