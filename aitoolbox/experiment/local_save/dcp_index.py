"""DCP's index (``.metadata``) of a sharded checkpoint, read once by aitoolbox's restricted pickle reader.

The reader may build DCP's metadata classes only (as records, from the state the pickle gives them), which are
then rebuilt from plain data, each field checked. Every storage entry must name a file of the folder, lie within
that file's size and carry no transform (compression, encryption) of the file's choosing; the tensors together may
not hold more than the larger of ``max_tensor_bytes`` and ``max_expansion`` times the bytes stored for them (each
byte counted once, however many entries point at it). The index returned is what DCP is handed
(:class:`~aitoolbox.experiment.local_save.dcp_reader.FolderStorageReader`): DCP reads no index itself.
"""
import collections
import math
import os
from typing import Any, Dict, Optional

import torch

from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder
from aitoolbox.experiment.local_save.object_bounds import check_shape
from aitoolbox.experiment.local_save.plain_types import constant_table, python_table
from aitoolbox.experiment.local_save.restricted_pickle import Allowed, Malformed, Refused, RestrictedUnpickler, short
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError, UntrustedCheckpointError
from aitoolbox.experiment.local_save.torch_file import LIMITS

METADATA_FILE = ".metadata"


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
            or type(memory_format) is not _MEM_FORMAT_ENCODING or type(pin_memory) is not bool:
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
    """Every storage entry inside its file, and the tensors together no larger than the bytes stored for them allow
    (:meth:`~aitoolbox.experiment.local_save.torch_file.ReadLimits.tensor_budget`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    for index, info in metadata.storage_data.items():
        size = folder.size(info.relative_path)  # opens it: a name inside the folder, a regular file, no link
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CorruptCheckpointError(folder.where(METADATA_FILE), f"its entry for {short(index.fqn)} asks for bytes "
                                         f"{info.offset} to {info.offset + info.length} of {info.relative_path}, "
                                         f"which holds {size}")
    _check_entry_lengths(folder, metadata)
    # The bound is on the total: many entries may point at the same bytes (each passing a bound of its own), so
    # what is stored counts each byte of each file once, whatever number of entries read it.
    ranges: Dict[str, list] = collections.defaultdict(list)
    wanted = 0
    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        for chunk in item.chunks:
            info = metadata.storage_data.get(MetadataIndex(name, chunk.offsets))
            if info is None:
                raise CorruptCheckpointError(folder.where(METADATA_FILE), f"a piece of {short(name)} has no storage entry")
            ranges[info.relative_path].append((info.offset, info.offset + info.length))
        wanted += math.prod(item.size) * torch._utils._element_size(item.properties.dtype)
    stored = sum(_covered(spans) for spans in ranges.values())
    limits = LIMITS.get()
    if wanted > limits.tensor_budget(stored):
        raise CorruptCheckpointError(folder.where(METADATA_FILE), f"its tensors state {wanted} bytes, "
                                     f"{limits.tensor_budget_text(stored)}")


# What torch.save adds to a tensor's bytes in an entry (its pickle, zip headers and the alignment of its records).
_ENTRY_OVERHEAD = 1 << 20


def _check_entry_lengths(folder: CheckpointFolder, metadata: Any) -> None:
    """Every storage entry no longer than what it holds needs: an entry is read whole into memory, and a sparse
    file can state any length for free. DCP writes a tensor's piece as one contiguous tensor, so its entry holds
    the piece's bytes and a small overhead; any other value is bounded as the index is (``max_index_bytes``)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    limits = LIMITS.get()
    needed: Dict[Any, int] = {}
    for name, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            element = torch._utils._element_size(item.properties.dtype)
            for chunk in item.chunks:
                needed[MetadataIndex(name, chunk.offsets)] = math.prod(chunk.sizes) * element + _ENTRY_OVERHEAD
    for index, info in metadata.storage_data.items():
        bound = needed.get(index, limits.max_index_bytes)
        if info.length > bound:
            raise CorruptCheckpointError(folder.where(METADATA_FILE), f"its entry for {short(index.fqn)} is "
                                         f"{info.length} bytes of {info.relative_path}, more than the {bound} it can "
                                         "need (a sparse file?). If you trust the checkpoint and the entry is not a "
                                         "tensor, raise the bound with aitoolbox's checkpoint_limits(max_index_bytes=...)")


def _covered(spans: list) -> int:
    """How many bytes the ``(start, end)`` ranges cover together (overlaps counted once)."""
    covered, reached = 0, 0
    for start, end in sorted(spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return covered


def read_dcp_metadata(folder: CheckpointFolder) -> Any:
    """DCP's index of ``folder``, read once and rebuilt from plain data, its entries checked against the files.

    Raises:
        UntrustedCheckpointError: the index names other globals than DCP's (nothing was run).
        CorruptCheckpointError: it is not DCP's index, or an entry lies outside its file or its folder.
        FileNotFoundError: there is no index.
    """
    where = folder.where(METADATA_FILE)
    limits = LIMITS.get()
    size = folder.size(METADATA_FILE)
    if size > limits.max_index_bytes:  # read whole into memory: checked first (a sparse file costs no disk)
        raise CorruptCheckpointError(where, f"it holds {size} bytes, more than max_index_bytes="
                                            f"{limits.max_index_bytes} (DCP's index of a checkpoint is far smaller). "
                                            "If you trust the file, raise the bound with aitoolbox's "
                                            "checkpoint_limits(max_index_bytes=...)")
    data = folder.read(METADATA_FILE)
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
