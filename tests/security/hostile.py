"""Builders of hostile checkpoint files, made at test time (no committed binaries).

What an attacker with write access to a shared results folder or bucket can plant: pickles that name code to run,
numpy values whose dtype carries an object field (file bytes become object pointers), torch zip files whose
records state sizes far beyond the file's (decompression bombs), truncated or damaged files, and sharded (DCP)
checkpoint folders whose index points outside the folder or hands DCP a rank-local index of its own.
"""
import collections
import io
import os
import pickle
import struct
import zipfile
import zlib
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np
import torch
from torch import nn


class PlantedPayload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _StatefulDtype:
    """Pickles as ``numpy.dtype(name)`` followed by ``__setstate__(state)``: the file chooses the dtype's fields."""

    def __init__(self, name: str, state: tuple):
        self.name, self.state = name, state

    def __reduce__(self):
        return np.dtype, (self.name, False, True), self.state


def _multiarray() -> Any:
    return np._core.multiarray if hasattr(np, "_core") else np.core.multiarray


class NumpyArrayState:
    """Pickles as numpy's own array reconstruction with a state the test chooses (shape, dtype, raw data)."""

    def __init__(self, shape: tuple, dtype: Any, raw: Any, fortran: bool = False):
        self.shape, self.dtype, self.raw, self.fortran = shape, dtype, raw, fortran

    def __reduce__(self):
        return (_multiarray()._reconstruct, (np.ndarray, (0,), b"b"),
                (1, self.shape, self.dtype, self.fortran, self.raw))


def object_field_dtype() -> _StatefulDtype:
    """A void dtype whose one field is a Python object, declared without numpy's "holds objects" flags."""
    return _StatefulDtype("V8", (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0))


def object_field_array(pointer: bytes = b"\x41" * 8) -> NumpyArrayState:
    """An array of one element whose object field is ``pointer``: numpy copies the bytes into the object slot,
    and the first use of the element dereferences them (plain ``pickle`` segfaults on ``bool()`` of it)."""
    return NumpyArrayState((1,), object_field_dtype(), pointer)


class NumpyScalarState:
    """Pickles as ``numpy.core.multiarray.scalar(dtype, data)``."""

    def __init__(self, dtype: Any, data: Any):
        self.dtype, self.data = dtype, data

    def __reduce__(self):
        return _multiarray().scalar, (self.dtype, self.data)


class Reduce:
    """Pickles as ``func(*args)`` (then ``BUILD state`` when given): any global the test names."""

    def __init__(self, func: Any, args: tuple, state: Any = None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


# --- checkpoints ------------------------------------------------------------------------------------------------
def small_model() -> nn.Module:
    """The model every hostile checkpoint claims to be of (the test suite's MLP, small)."""
    from tests.helpers import MLP

    torch.manual_seed(0)
    return MLP(hidden=4, dropout=0.0)


def small_checkpoint(**extra: Any) -> dict:
    """A valid checkpoint of :func:`small_model` as aitoolbox 1.8 wrote it (plus ``extra`` entries)."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                  "schedulers_state_dict": [], "epoch": 1, "iteration_idx": 3, "hyperparams": {"lr": 0.1}}
    checkpoint.update(extra)
    return checkpoint


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def zip_records(data: bytes) -> Dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename: archive.read(info.filename) for info in archive.infolist()}


def make_zip(records: Dict[str, bytes], deflated: Iterable[str] = ()) -> bytes:
    """A zip of ``records`` in their order; those named in ``deflated`` compressed."""
    deflated = set(deflated)
    output = io.BytesIO()
    with zipfile.ZipFile(output, "w") as archive:
        for name, content in records.items():
            archive.writestr(zipfile.ZipInfo(name), content,
                             compress_type=zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED)
    return output.getvalue()


class _StorageRef:
    def __init__(self, key: str, numel: int, storage_type: Any, location: str):
        self.key, self.numel, self.storage_type, self.location = key, numel, storage_type, location


class TensorRef:
    """A tensor as ``torch.save`` pickles it, with every field the test's choice (record key, element count,
    storage offset, size, stride, storage class, location)."""

    def __init__(self, key: str = "0", numel: int = 4, offset: int = 0, size: tuple = (4,), stride: tuple = (1,),
                 storage_type: Any = torch.FloatStorage, location: str = "cpu", hooks: Any = None):
        self.storage = _StorageRef(key, numel, storage_type, location)
        self.offset, self.size, self.stride = offset, size, stride
        self.hooks = collections.OrderedDict() if hooks is None else hooks

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (self.storage, self.offset, self.size, self.stride, False,
                                                 self.hooks)


class _TorchLikePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if isinstance(obj, _StorageRef):
            return "storage", obj.storage_type, obj.key, obj.location, obj.numel
        return None


def torch_file(obj: Any, storages: Optional[Dict[str, bytes]] = None, deflated: Iterable[str] = (),
               archive: str = "archive", byteorder: bytes = b"little") -> bytes:
    """A torch zip file holding ``obj`` (with :class:`TensorRef` values) and the storage records ``storages``
    (record key -> bytes)."""
    buffer = io.BytesIO()
    _TorchLikePickler(buffer, protocol=2).dump(obj)
    records = {f"{archive}/data.pkl": buffer.getvalue(), f"{archive}/byteorder": byteorder}
    for key, content in (storages or {}).items():
        records[f"{archive}/data/{key}"] = content
    records[f"{archive}/version"] = b"3\n"
    return make_zip(records, {f"{archive}/{name}" for name in deflated})


def state_record_size(data: bytes, name: str, size: int) -> bytes:
    """``data`` (a zip) with the uncompressed size its directory and local header state for record ``name`` set to
    ``size`` (below 4 GiB): a lie about the record's size that costs nothing to write."""
    data = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.getinfo(name)
    struct.pack_into("<I", data, info.header_offset + 22, size)
    position = data.find(b"PK\x01\x02")
    while position != -1:
        name_length = struct.unpack_from("<H", data, position + 28)[0]
        if bytes(data[position + 46:position + 46 + name_length]).decode() == name:
            struct.pack_into("<I", data, position + 24, size)
            break
        position = data.find(b"PK\x01\x02", position + 4)
    return bytes(data)


def deflate_bomb(size: int, archive: str = "archive") -> bytes:
    """A torch file of one uint8 tensor of ``size`` zeros, its storage record deflated (about size / 1000 bytes)."""
    buffer = io.BytesIO()
    _TorchLikePickler(buffer, protocol=2).dump(
        {"model_state_dict": {"layer.weight": TensorRef("0", size, size=(size,), storage_type=torch.ByteStorage)}})
    output = io.BytesIO()
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(output, "w") as zipped:
        zipped.writestr(zipfile.ZipInfo(f"{archive}/data.pkl"), buffer.getvalue())
        info = zipfile.ZipInfo(f"{archive}/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zipped.open(info, "w", force_zip64=size >= (1 << 31)) as record:
            written = 0
            while written < size:
                record.write(chunk[:min(len(chunk), size - written)])
                written += min(len(chunk), size - written)
        zipped.writestr(zipfile.ZipInfo(f"{archive}/version"), b"3\n")
    return output.getvalue()


def deflated_pickle_bomb(size: int, archive: str = "archive") -> bytes:
    """A torch file whose ``data.pkl`` record inflates to ``size`` bytes (no-op MARK / POP_MARK pairs)."""
    pickled = pickle.dumps({"model_state_dict": {}}, protocol=2)
    output = io.BytesIO()
    pairs = b"(1" * (1 << 19)
    with zipfile.ZipFile(output, "w") as zipped:
        info = zipfile.ZipInfo(f"{archive}/data.pkl")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zipped.open(info, "w", force_zip64=size >= (1 << 31)) as record:
            record.write(pickled[:-1])  # everything but STOP
            for _ in range(max(1, size // len(pairs))):
                record.write(pairs)
            record.write(b".")
        zipped.writestr(zipfile.ZipInfo(f"{archive}/version"), b"3\n")
    return output.getvalue()


# --- sharded (DCP) checkpoints ---------------------------------------------------------------------------------
def sharded_checkpoint(folder: str, seed: int = 0) -> str:
    """A sharded checkpoint of :func:`small_model` (and its SGD optimizer) written by one process into ``folder``;
    ``seed`` chooses the weights."""
    import warnings
    from aitoolbox.experiment.local_save.sharded_checkpoints import save_sharded_checkpoint

    model = small_model()
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded_checkpoint(folder, model, optimizer, sharded_extra_state()).wait()
    return folder


def sharded_extra_state() -> dict:
    """The training state a sharded checkpoint keeps beside its DCP files, as a TrainLoop writes it (1.8's keys)."""
    return {"optimizer_state_dict": {"param_groups": [{"lr": 0.1, "momentum": 0.9}]}, "schedulers_state_dict": [],
            "epoch": 1, "iteration_idx": 3, "hyperparams": {}}


def rewrite_metadata(folder: str, change: Callable[[Any], Any]) -> None:
    """Rewrite the DCP index of ``folder`` (the test's own file): ``change(metadata)`` edits it in place or
    returns what to pickle instead."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)  # noqa: S301 - the test's own file
    replaced = change(metadata)
    with open(path, "wb") as handle:
        pickle.dump(metadata if replaced is None else replaced, handle)


def storage_entries(metadata: Any) -> list:
    """``(index, info)`` of every storage entry of a DCP index."""
    return list(metadata.storage_data.items())


def set_storage_entry(metadata: Any, index: Any, **fields: Any) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    info = metadata.storage_data[index]
    values = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length,
              "transform_descriptors": info.transform_descriptors}
    values.update(fields)
    metadata.storage_data[index] = _StorageInfo(**values)


def distcp_files(folder: str) -> list:
    return sorted(name for name in os.listdir(folder) if name.endswith(".distcp"))


def deflate(data: bytes) -> bytes:
    return zlib.compress(data)
