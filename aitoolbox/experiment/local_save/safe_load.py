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
"""
import argparse
import contextlib
import datetime
import logging
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


class UntrustedCheckpointError(pickle.UnpicklingError, RuntimeError):
    """A file holds Python objects that loading it would have to build by running code named in the file.

    Nothing from the file was run. A ``RuntimeError`` (as other unreadable checkpoints) and a
    ``pickle.UnpicklingError`` (as torch's own refusal).

    Attributes:
        path: the file.
        refused: the refused globals, ``module.name``; empty when torch did not say.
    """

    def __init__(self, path: str, refused: Sequence[str], detail: str = ""):
        self.path = path
        self.refused = list(refused)
        what = f"objects of {', '.join(self.refused)}" if self.refused else f"objects torch refuses ({detail})"
        super().__init__(
            f"refusing to load {path}: it holds {what}, which only full unpickling can build, and full unpickling "
            "runs whatever code the file names. Nothing from the file was run. If you trust this file (you wrote "
            "it yourself, e.g. with aitoolbox 1.x and custom objects in the hyperparameters), load it with "
            "weights_only=False; only for files you trust")


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
        FileNotFoundError / RuntimeError: as :func:`~aitoolbox.experiment.local_save.atomic.torch_load_checked`.
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
        except RuntimeError as error:
            cause = error.__cause__
            if cause is None or not is_weights_only_refusal(cause):
                raise
            raise UntrustedCheckpointError(path, _refused_globals(path, cause),
                                           str(cause).strip().splitlines()[-1]) from cause
