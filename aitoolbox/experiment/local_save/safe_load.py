"""Reading torch files without running code from them.

A ``.pth`` file is a pickle: loaded with full unpickling, it can make Python call any function it names (a
file planted in a shared bucket whose ``__reduce__`` returns ``os.system`` runs a shell command on the training
machine). aitoolbox therefore loads every checkpoint with ``torch.load(weights_only=True)``, which builds only
tensors, numbers, strings, containers and the few types torch allows, and refuses anything else before calling
it.

aitoolbox 1.x wrote the hyperparameters into each checkpoint as the user gave them, so its files may hold some
plain data types beyond torch's list: numpy scalars and arrays, ``argparse.Namespace``, paths, dates. These are
allowed here (:data:`CHECKPOINT_SAFE_TYPES`) while a checkpoint is read, and only then: building them runs no
code taken from the file. A file that holds anything else is refused with :class:`UntrustedCheckpointError`,
which names the file and the refused types. Loading such a file anyway takes ``weights_only=False`` on the
loading call, which is meant only for files you trust (your own experiments): it runs whatever the file says.

Sharded checkpoints are folders written by torch's DCP, which unpickles two things fully when it loads: its
index ``.metadata`` and the non-tensor entries of the ``.distcp`` files. :func:`check_dcp_metadata` reads the
index first building only DCP's own metadata types, and :func:`weights_only_load_planner` reads each entry with
the rules above before DCP does.
"""
import argparse
import contextlib
import datetime
import logging
import os
import pathlib
import pickle
import re
import threading
from typing import Any, Iterator, List, Sequence, Tuple, Union

import torch

logger = logging.getLogger(__name__)

_SafeGlobal = Union[Any, Tuple[Any, str]]


def _named(obj: Any, *names: str) -> List[_SafeGlobal]:
    """``obj`` under its own name and under ``names`` (where other library versions pickled it)."""
    own = f"{obj.__module__}.{obj.__qualname__}"
    return [obj] + [(obj, name) for name in names if name != own]


def _checkpoint_safe_types() -> List[_SafeGlobal]:
    types: List[_SafeGlobal] = [argparse.Namespace, datetime.datetime, datetime.date, datetime.time,
                                datetime.timedelta, frozenset]
    for path_type in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath):
        # Python 3.13 moved the classes to pathlib._local; files written by 3.12 and older say pathlib.<name>.
        types += _named(path_type, f"pathlib.{path_type.__name__}")
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch in practice
        return types
    multiarray = numpy.core.multiarray if not hasattr(numpy, "_core") else numpy._core.multiarray
    # numpy 2 moved numpy.core to numpy._core; files written with numpy 1.x (aitoolbox 1.8's time) name the old
    # module. _reconstruct builds an empty array of a subtype that must itself be allowed (only ndarray is), and
    # an object array's items are unpickled, under the same rules, before numpy sees them.
    types += _named(multiarray.scalar, "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar")
    types += _named(multiarray._reconstruct, "numpy.core.multiarray._reconstruct",
                    "numpy._core.multiarray._reconstruct")
    types += [numpy.ndarray, numpy.dtype]
    types += [getattr(numpy.dtypes, name) for name in dir(getattr(numpy, "dtypes", None))
              if name.endswith("DType")]
    return types


# The plain data types aitoolbox 1.x checkpoints legitimately hold beside what torch allows by default.
CHECKPOINT_SAFE_TYPES: List[_SafeGlobal] = _checkpoint_safe_types()


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
        return f"cannot load {self.path}: {self.reason}"

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
        return (f"cannot load {self.path}: it is corrupt or not a checkpoint: {self.reason}. Nothing from it was "
                "run; use another copy of it or an earlier checkpoint")


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


class _ScopedSafeGlobals:
    """Allow :data:`CHECKPOINT_SAFE_TYPES` in ``torch.load(weights_only=True)`` while at least one load runs.

    torch's allow-list is one set for the whole process, so the scope is counted across threads: the types are
    added by the first load that starts and removed when the last one ends, and types the user had allowed
    already are never removed.
    """

    def __init__(self, types: List[_SafeGlobal]):
        self._types = types
        self._lock = threading.Lock()
        self._depth = 0
        self._scope: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                present = set(torch.serialization.get_safe_globals())
                self._scope = torch.serialization.safe_globals([t for t in self._types if t not in present])
                self._scope.__enter__()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._scope.__exit__(None, None, None)
                    self._scope = None


checkpoint_types_allowed = _ScopedSafeGlobals(CHECKPOINT_SAFE_TYPES)

_TORCH_REFUSAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL|global:?) +([\w.]+)", re.IGNORECASE)


def _refused_globals(path: str, error: BaseException) -> List[str]:
    """The globals of ``path`` that ``weights_only`` loading refuses (call it with the types allowed)."""
    try:
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint (torch's legacy format): take what torch's message names
        refused = []
    return sorted(refused) or sorted(set(_TORCH_REFUSAL.findall(str(error))))


def is_weights_only_refusal(error: BaseException) -> bool:
    """True when ``error`` (from ``torch.load(weights_only=True)``) refused the file's content, not its format."""
    text = str(error)
    return isinstance(error, pickle.UnpicklingError) and ("Weights only load failed" in text
                                                          or "WeightsUnpickler" in text
                                                          or "weights_only" in text)


def load_torch_file(path: str, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load`` of ``path`` that never runs code from the file unless ``weights_only=False``.

    Args:
        path: a file written by ``torch.save``.
        map_location: where to put the tensors (``torch.load``'s argument).
        weights_only: True (the default) builds only tensors, plain data and :data:`CHECKPOINT_SAFE_TYPES`.
            False unpickles fully: only for files you trust, as it runs whatever code the file names.

    Raises:
        UntrustedCheckpointError: the file holds other objects (with ``weights_only=True``).
        CorruptCheckpointError: the file is truncated, damaged or not a torch file.
        FileNotFoundError: there is no file at ``path``.
    """
    # Imported here: atomic imports nothing of this package, and this module must not import it at its top
    # either (checkpoints imports both).
    from aitoolbox.experiment.local_save.atomic import torch_load_checked

    if not weights_only:
        logger.info("Loading %s with full unpickling (weights_only=False): it may run code the file names", path)
        return torch_load_checked(path, map_location=map_location, weights_only=False)
    with checkpoint_types_allowed():
        try:
            return torch_load_checked(path, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise
        except RuntimeError as error:
            cause = error.__cause__
            refused = _refused_globals(path, cause) if cause is not None and is_weights_only_refusal(cause) else []
            if not refused:
                raise CorruptCheckpointError(path, str(cause or error).strip().splitlines()[-1]) from error
            raise UntrustedCheckpointError(path, refused, str(cause).strip().splitlines()[-1]) from cause


# What torch's DCP pickles into a sharded checkpoint's ``.metadata`` (its index of tensors and where their pieces
# are): dataclasses and an enum of torch.distributed.checkpoint, torch sizes, dtypes and layouts, paths.
_DCP_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
       ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"),
       ("pathlib._local", "PurePosixPath")])
DCP_METADATA_FILE = ".metadata"


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Builds only the types of :data:`_DCP_METADATA_GLOBALS` (and torch dtypes); refuses every other global."""

    def __init__(self, handle: Any, path: str):
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS \
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(self._path, [f"{module}.{name}"])


def check_dcp_metadata(folder: str) -> None:
    """Refuse a sharded checkpoint folder whose DCP index (``.metadata``) holds other objects than DCP's own.

    torch's DCP reads that file with full unpickling; it is read here first, building only DCP's metadata types,
    so that a planted index is refused before DCP runs anything from it.

    Raises:
        UntrustedCheckpointError: the index names another global; nothing from it was run.
        FileNotFoundError: the folder has no ``.metadata``.
        RuntimeError: the index is truncated or not a pickle.
    """
    path = os.path.join(folder, DCP_METADATA_FILE)
    with open(path, "rb") as handle:
        try:
            _DCPMetadataUnpickler(handle, path).load()
        except UntrustedCheckpointError:
            raise
        except Exception as error:
            raise RuntimeError(f"cannot read checkpoint index {path}: it is truncated or not DCP's metadata "
                               f"({type(error).__name__}: {error})") from error


def weights_only_load_planner(folder: str) -> Any:
    """A DCP load planner that reads the non-tensor entries of the sharded checkpoint ``folder`` with
    ``weights_only=True``.

    DCP's default planner unpickles them fully (``torch.load(weights_only=False)``). Each entry is first read with
    the same rules as a checkpoint file (:func:`load_torch_file`); only an entry that passes is handed on to
    the default planner, which then builds the same plain objects and puts them in place.

    Raises (from ``dcp.load``):
        UntrustedCheckpointError: an entry holds other objects; nothing from it was run.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            where = f"{folder} (its entry {read_item.dest_index.fqn!r})"
            with checkpoint_types_allowed():
                try:
                    torch.load(value, weights_only=True)
                except pickle.UnpicklingError as error:
                    if not is_weights_only_refusal(error):
                        raise
                    raise UntrustedCheckpointError(where, sorted(set(_TORCH_REFUSAL.findall(str(error)))),
                                                   str(error).strip().splitlines()[-1]) from error
            value.seek(0)
            super().load_bytes(read_item, value)

    return WeightsOnlyLoadPlanner()


@contextlib.contextmanager
def dcp_refusals_raised() -> Iterator[None]:
    """Raise an :class:`UntrustedCheckpointError` that DCP wrapped into its ``CheckpointException`` as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        for failure in error.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, UntrustedCheckpointError):
                raise cause from error
        raise
