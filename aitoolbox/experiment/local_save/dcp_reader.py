"""Reading a sharded checkpoint's folder for torch's DCP, without DCP opening or unpickling any file itself.

DCP's own reader unpickles the index ``.metadata`` with plain ``pickle``, falls back to a rank-local
``__<rank>.metadata`` when that fails, reads each storage entry at whatever path and length the index says, and
unpickles non-tensor entries fully. Here instead:

- :class:`CheckpointFolder` opens the folder once; each file in it is opened once, by its name inside that open
  folder (a name with ``/``, ``..`` or an absolute path is refused), never through a symbolic link, and must be a
  regular file.
- :func:`read_dcp_metadata` reads ``.metadata`` once, with aitoolbox's restricted pickle reader, and rebuilds DCP's
  index from plain data: every storage entry names a file of the folder, within that file's size, without a
  transform (compression, encryption) of the file's choosing, and no tensor is larger than its stored pieces allow.
- :class:`FolderStorageReader` hands DCP that index (its ``read_metadata`` takes no rank: DCP never asks it for a
  rank-local one) and reads each entry's bytes itself, through aitoolbox's reader of torch files; a tensor is
  copied into DCP's target, any other value handed to :class:`RestrictedLoadPlanner`.
- :func:`dcp_errors` turns DCP's ``CheckpointException`` (a ``BaseException``) into aitoolbox's loading errors.
"""
import collections
import contextlib
import io
import math
import os
import re
from typing import Any, BinaryIO, Dict, Iterator, List, Optional

import torch

from aitoolbox.experiment.local_save.restricted_pickle import (
    Allowed, Malformed, Refused, RestrictedUnpickler, check_shape, short)
from aitoolbox.experiment.local_save.plain_types import constant_table, python_table
from aitoolbox.experiment.local_save.safe_load import (
    CheckpointLoadError, CorruptCheckpointError, UntrustedCheckpointError, open_regular_file, read_torch_source)
from aitoolbox.experiment.local_save.torch_file import LIMITS

METADATA_FILE = ".metadata"
_NAME = re.compile(r"[^/\\\x00]+")


class CheckpointFolder:
    """A sharded checkpoint's folder, opened once; its files are opened by name inside it, each at most once.

    Raises (from the constructor):
        FileNotFoundError: there is no such folder.
        CorruptCheckpointError: ``path`` is not a folder.
    """

    def __init__(self, path: str):
        self.path = path
        self._files: Dict[str, BinaryIO] = {}
        self._descriptor: Optional[int] = None
        if os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY"):
            try:
                self._descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise FileNotFoundError(f"there is no checkpoint folder {path}") from None
            except NotADirectoryError:
                raise CorruptCheckpointError(path, "it is not a folder") from None
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"there is no checkpoint folder {path}")

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


# --- the index ----------------------------------------------------------------------------------------------------
class _Record:
    """An object of DCP's index while it is read: its class's name and the state the pickle gives it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.state: Any = None
        self.built = False


_DCP_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


def _index_table() -> Dict:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    table = dict(constant_table())
    table.update(python_table())
    for module, name in _DCP_CLASSES:
        table[(module, name)] = Allowed(f"{module}.{name}", new=lambda name=name: _Record(name))
    table[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = Allowed(
        "_MEM_FORMAT_ENCODING", call=lambda value: _MEM_FORMAT_ENCODING(value))
    return table


def _build(instance: Any, state: Any) -> None:
    if type(instance) is _Record and not instance.built:
        instance.state, instance.built = state, True
        return None
    if type(instance) is collections.OrderedDict and type(state) is dict and not state:
        return None
    raise Malformed(f"sets the state of a {type(instance).__name__}, which DCP's index never does")


def _fields(value: Any, kind: str, allowed: set) -> dict:
    if type(value) is not _Record or value.kind != kind:
        raise Malformed(f"a {type(value).__name__ if type(value) is not _Record else value.kind} where DCP's index "
                        f"has a {kind}")
    state = value.state if value.state is not None else {}
    if type(state) is not dict or not set(state) <= allowed:
        raise Malformed(f"a {kind} with fields {sorted(state) if type(state) is dict else type(state).__name__}")
    return state


def _size(value: Any, what: str, dimensions: Optional[int] = None) -> torch.Size:
    if type(value) is not torch.Size or (dimensions is not None and len(value) != dimensions) \
            or any(item < 0 for item in value):
        raise Malformed(f"{what} {short(value)} is not a size")
    return value


def _optional(value: Any, kind: type, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise Malformed(f"{what} is a {type(value).__name__}")
    return value


def _tensor_properties(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    if type(value) is not _Record or value.kind != "TensorProperties" or type(value.state) is not tuple \
            or len(value.state) != 5:
        raise Malformed("a tensor's properties are not DCP's")
    dtype, layout, requires_grad, memory_format, pin_memory = value.state
    formats = {_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
               _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
               _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format}
    if not isinstance(dtype, torch.dtype) or layout is not torch.strided or type(requires_grad) is not bool \
            or memory_format not in formats or type(pin_memory) is not bool:
        raise Malformed("a tensor's properties are not DCP's")
    return TensorProperties(dtype=dtype, layout=layout, requires_grad=requires_grad,
                            memory_format=formats[memory_format], pin_memory=pin_memory)


def _item(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, TensorStorageMetadata)

    if type(value) is _Record and value.kind == "BytesStorageMetadata":
        _fields(value, "BytesStorageMetadata", set())
        return BytesStorageMetadata()
    state = _fields(value, "TensorStorageMetadata", {"properties", "size", "chunks"})
    size = _size(state.get("size"), "a tensor's size")
    if type(state.get("chunks")) is not list:
        raise Malformed("a tensor without its list of pieces")
    chunks = []
    for chunk in state["chunks"]:
        fields = _fields(chunk, "ChunkStorageMetadata", {"offsets", "sizes"})
        offsets = _size(fields.get("offsets"), "a piece's offsets", len(size))
        sizes = _size(fields.get("sizes"), "a piece's sizes", len(size))
        if any(start + length > whole for start, length, whole in zip(offsets, sizes, size)):
            raise Malformed(f"a piece at {tuple(offsets)} of size {tuple(sizes)} lies outside its tensor's "
                            f"{tuple(size)}")
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
    return TensorStorageMetadata(properties=_tensor_properties(state.get("properties")), size=size, chunks=chunks)


def _index(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    state = _fields(value, "MetadataIndex", {"fqn", "offset", "index"})
    if not isinstance(state.get("fqn"), str):
        raise Malformed("a storage key without its name")
    offset = state.get("offset")
    return MetadataIndex(state["fqn"], None if offset is None else _size(offset, "a storage key's offset"),
                         _optional(state.get("index"), int, "a storage key's index"))


def _storage_info(value: Any) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state = _fields(value, "_StorageInfo", {"relative_path", "offset", "length", "transform_descriptors"})
    path, offset, length = state.get("relative_path"), state.get("offset"), state.get("length")
    if not isinstance(path, str) or type(offset) is not int or type(length) is not int:
        raise Malformed("a storage entry without its file, offset and length")
    if state.get("transform_descriptors"):
        raise Malformed(f"storage entry in {short(path)} is stored with transforms "
                        f"{short(state['transform_descriptors'])}, which aitoolbox never writes nor applies")
    return _StorageInfo(relative_path=path, offset=offset, length=length)


def _storage_meta(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    if value is None:
        return None
    state = _fields(value, "StorageMeta", {"checkpoint_id", "save_id", "load_id", "modules"})
    modules = state.get("modules", [])
    if type(modules) is not list or not all(isinstance(module, str) for module in modules):
        raise Malformed("the index's list of modules is not text")
    return StorageMeta(checkpoint_id=_optional(state.get("checkpoint_id"), (str, os.PathLike), "the checkpoint id"),
                       save_id=_optional(state.get("save_id"), str, "the save id"),
                       load_id=_optional(state.get("load_id"), str, "the load id"), modules=modules)


def _metadata(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    state = _fields(value, "Metadata", {"state_dict_metadata", "planner_data", "storage_data", "storage_meta",
                                        "version"})
    items, storage = state.get("state_dict_metadata"), state.get("storage_data")
    if type(items) is not dict or type(storage) is not dict or not all(isinstance(key, str) for key in items):
        raise Malformed("its tables of tensors and of storage entries are not DCP's")
    return Metadata(state_dict_metadata={key: _item(item) for key, item in items.items()},
                    planner_data=state.get("planner_data"),
                    storage_data={_index(key): _storage_info(info) for key, info in storage.items()},
                    storage_meta=_storage_meta(state.get("storage_meta")),
                    version=_optional(state.get("version"), str, "the index's version"))


def _check_entries(folder: CheckpointFolder, metadata: Any) -> None:
    """Every storage entry inside its file, and no tensor larger than its stored pieces (``max_expansion``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    for index, info in metadata.storage_data.items():
        size = folder.size(info.relative_path)  # opens it: a name inside the folder, a regular file, no link
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CorruptCheckpointError(folder.where(METADATA_FILE), f"its entry for {short(index.fqn)} asks for bytes "
                                         f"{info.offset} to {info.offset + info.length} of {info.relative_path}, "
                                         f"which holds {size}")
    max_expansion = LIMITS.get().max_expansion
    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        stored = 0
        for chunk in item.chunks:
            info = metadata.storage_data.get(MetadataIndex(name, chunk.offsets))
            if info is None:
                raise CorruptCheckpointError(folder.where(METADATA_FILE), f"a piece of {short(name)} has no storage entry")
            stored += info.length
        wanted = math.prod(item.size) * torch._utils._element_size(item.properties.dtype)
        if wanted > max_expansion * stored + 4096:
            raise CorruptCheckpointError(folder.where(METADATA_FILE), f"it says {short(name)} has size "
                                         f"{tuple(item.size)} ({wanted} bytes) and stores {stored} bytes of it")


def read_dcp_metadata(folder: CheckpointFolder) -> Any:
    """DCP's index of ``folder``, read once and rebuilt from plain data, its entries checked against the files.

    Raises:
        UntrustedCheckpointError: the index names other globals than DCP's (nothing was run).
        CorruptCheckpointError: it is not DCP's index, or an entry lies outside its file or its folder.
        FileNotFoundError: there is no index.
    """
    where = folder.where(METADATA_FILE)
    data = folder.read(METADATA_FILE)
    limits = LIMITS.get()
    try:
        built = RestrictedUnpickler(data, _index_table(), build=_build).load()
        check_shape(built, limits.max_nesting, limits.max_visits(len(data)))
        metadata = _metadata(built)
    except Refused as refused:
        raise UntrustedCheckpointError(where, refused.names) from None
    except Malformed as malformed:
        raise CorruptCheckpointError(where, f"it is not DCP's index of a checkpoint ({malformed})") from None
    _check_entries(folder, metadata)
    return metadata


# --- DCP's reader and planner -----------------------------------------------------------------------------------------
def _storage_reader_base() -> type:
    from torch.distributed.checkpoint.storage import StorageReader
    return StorageReader


def _planner_base() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    return DefaultLoadPlanner


class RestrictedLoadPlanner(_planner_base()):  # type: ignore[misc]
    """DCP's default load planner, except that a non-tensor entry arrives already read (DCP's own unpickles it
    fully): it is only put in place."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value


class FolderStorageReader(_storage_reader_base()):  # type: ignore[misc]
    """A DCP storage reader over an open :class:`CheckpointFolder` and its index read by :func:`read_dcp_metadata`.

    Use it with :class:`RestrictedLoadPlanner`: ``dcp.load(state, storage_reader=..., planner=...)``.
    """

    def __init__(self, folder: CheckpointFolder, metadata: Any):
        super().__init__()
        self._folder = folder
        self._metadata = metadata

    @property
    def checkpoint_id(self) -> str:
        return self._folder.path

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self) -> Any:  # no rank: DCP's fallback to a rank-local index never happens
        return self._metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool) -> None:
        if metadata is not self._metadata:
            raise CorruptCheckpointError(self._folder.path, "DCP was handed an index this reader did not read")

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: List[Any]) -> List[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        for request in plan.items:
            info = self._metadata.storage_data.get(request.storage_index)
            if info is None:
                raise CorruptCheckpointError(self._folder.where(METADATA_FILE),
                                             f"it has no storage entry for {short(request.storage_index.fqn)}")
            where = f"{self._folder.where(info.relative_path)} (its entry {short(request.storage_index.fqn)})"
            data = self._folder.read(info.relative_path, info.offset, info.length)
            value = read_torch_source(io.BytesIO(data), where)
            del data
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, value)
                continue
            if type(value) is not torch.Tensor:
                raise CorruptCheckpointError(where, f"a tensor's entry holds a {type(value).__name__}")
            try:
                piece = narrow_tensor_by_index(value, request.storage_offsets, request.lengths)
            except (RuntimeError, IndexError) as error:
                raise CorruptCheckpointError(where, f"its piece does not hold the part the index says ({error})")
            target = planner.resolve_tensor(request).detach()
            if target.size() != piece.size() or target.dtype != piece.dtype:
                raise CorruptCheckpointError(where, f"it holds {tuple(piece.size())} {piece.dtype}, the index says "
                                                    f"{tuple(target.size())} {target.dtype}")
            target.copy_(piece)
            planner.commit_tensor(request, target)
        done: Any = Future()
        done.set_result(None)
        return done


@contextlib.contextmanager
def dcp_errors(path: str) -> Iterator[None]:
    """Raise what DCP met, wrapped in its ``CheckpointException`` (a ``BaseException``), as aitoolbox's errors: ours
    as they are, any other as a :class:`CheckpointLoadError` naming ``path``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        causes = {rank: failure[0] if isinstance(failure, tuple) else failure
                  for rank, failure in error.failures.items()}
        for cause in causes.values():
            if isinstance(cause, CheckpointLoadError):
                raise cause from error
        rank, first = next(iter(causes.items())) if causes else (None, error)
        raise CheckpointLoadError(path, f"it does not fit the model and optimizers given, or its files are damaged "
                                        f"(rank {rank}: {type(first).__name__}: {first})") from error
