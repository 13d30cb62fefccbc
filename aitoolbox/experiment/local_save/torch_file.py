"""Reading a file written by ``torch.save`` (a zip of a pickle and its tensors' storages) without torch's loader.

The zip's directory is read with Python's ``zipfile`` (which reads no more than the file holds); every record
is checked before a byte of it is allocated: stored or deflated only, inside the file, and, deflated, stating no
more than ``max_expansion`` times its compressed size (the whole file's records no more than ``max_expansion``
times the file). The pickle (``data.pkl``) is read by
:class:`~aitoolbox.experiment.local_save.restricted_pickle.RestrictedUnpickler` with the table of
:mod:`~aitoolbox.experiment.local_save.plain_types`; each storage it names is read once from its record into
memory of exactly the size the pickle states, which must be the record's size. Every record read (the pickle and
each storage) must have the CRC-32 the zip directory states, computed as it is read: torch's own loader checks
none, and a bit flipped on disk would load as another weight. Records the pickle does not name are not read, so
not checked: nothing built comes from them. What was built is then bounded by
:func:`~aitoolbox.experiment.local_save.object_bounds.check_shape`.

Failures are :class:`~aitoolbox.experiment.local_save.restricted_pickle.Refused`,
:class:`~aitoolbox.experiment.local_save.restricted_pickle.Malformed` or
:class:`~aitoolbox.experiment.local_save.restricted_pickle.Unavailable`; the caller names the file.
"""
import contextvars
import dataclasses
import io
import re
import struct
import sys
import zipfile
import zlib
from typing import Any, BinaryIO, Dict, Optional

import torch

from aitoolbox.experiment.local_save.plain_types import (
    NumpyBuilder, StorageKind, TensorBuilder, build_state, numpy_table, python_table, torch_table)
from aitoolbox.experiment.local_save.object_bounds import check_shape, refused_names
from aitoolbox.experiment.local_save.restricted_pickle import (
    CallerError, Malformed, Refused, RestrictedUnpickler, Unavailable, short)

_CHUNK = 1 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


@dataclasses.dataclass(frozen=True)
class ReadLimits:
    """Bounds on what reading one file may cost (see :func:`~aitoolbox.experiment.local_save.safe_load.
    checkpoint_limits`)."""

    max_expansion: float = 100.0
    max_nesting: int = 100
    max_tensor_bytes: int = 1 << 30
    max_index_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if isinstance(self.max_expansion, bool) or not isinstance(self.max_expansion, (int, float)) \
                or not self.max_expansion >= 1:
            raise ValueError(f"max_expansion must be a number >= 1, got {self.max_expansion!r}")
        if isinstance(self.max_nesting, bool) or not isinstance(self.max_nesting, int) or self.max_nesting < 1:
            raise ValueError(f"max_nesting must be an int >= 1, got {self.max_nesting!r}")
        if isinstance(self.max_tensor_bytes, bool) or not isinstance(self.max_tensor_bytes, int) \
                or self.max_tensor_bytes < 0:
            raise ValueError(f"max_tensor_bytes must be an int >= 0, got {self.max_tensor_bytes!r}")
        if isinstance(self.max_index_bytes, bool) or not isinstance(self.max_index_bytes, int) \
                or self.max_index_bytes < 1:
            raise ValueError(f"max_index_bytes must be an int >= 1, got {self.max_index_bytes!r}")

    def tensor_budget(self, stored: int) -> int:
        """How many bytes the tensors built from ``stored`` bytes of a file may hold in all: views of one storage
        cost nothing to build, but any copy of them (an optimizer casting its state) costs their full size."""
        return max(self.max_tensor_bytes, int(self.max_expansion * stored))

    def tensor_budget_text(self, stored: int) -> str:
        """The bound of :meth:`tensor_budget`, in words, with what to do when the file is trusted."""
        return (f"more than max(max_tensor_bytes={self.max_tensor_bytes}, max_expansion={self.max_expansion:g} "
                f"times its {stored} bytes) in all (views repeating the same bytes: a memory bomb?). If you trust "
                "the file, raise the bound with aitoolbox's checkpoint_limits(max_tensor_bytes=...)")

    def max_visits(self, pickle_size: int) -> int:
        """How many objects a walk over what a pickle of ``pickle_size`` bytes built may meet."""
        return 1_000_000 + 16 * pickle_size


LIMITS: "contextvars.ContextVar[ReadLimits]" = contextvars.ContextVar("aitoolbox_checkpoint_limits",
                                                                     default=ReadLimits())


def _size_of(source: BinaryIO) -> int:
    position = source.tell()
    size = source.seek(0, io.SEEK_END)
    source.seek(position)
    return size


def _not_a_zip(source: BinaryIO) -> str:
    source.seek(0)
    head = source.read(16)
    if head.startswith(b"\x80\x02\x8a\x0a") and int.from_bytes(head[4:14], "little") == _LEGACY_MAGIC:
        return ("it is in torch's format of before 1.6 (not a zip file), which aitoolbox does not read: load it "
                "with torch 2's torch.load(path, weights_only=True) and torch.save it again")
    if not head:
        return "it is empty"
    return "it is not a zip file (torch.save writes one): truncated, damaged or another kind of file"


class TorchZip:
    """The records of a torch zip file in ``source``, each read at most once, within ``limits``."""

    def __init__(self, source: BinaryIO, limits: ReadLimits):
        self._source = source
        self._size = _size_of(source)
        self.file_size = self._size
        try:
            archive = zipfile.ZipFile(source)
        # zipfile raises NotImplementedError for a version field it does not know, KeyError or RuntimeError for
        # some damaged directory entries: a flipped byte in the directory may produce any of them.
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error,
                UnicodeDecodeError, IndexError, NotImplementedError, KeyError, RuntimeError, TypeError) as error:
            raise Malformed(_not_a_zip(source) if isinstance(error, zipfile.BadZipFile) else
                            f"its zip directory is damaged ({type(error).__name__}: {error})") from None
        infos = archive.infolist()
        if not infos:
            raise Malformed("it is an empty zip file")
        self.records: Dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            if info.filename in self.records:
                raise Malformed(f"its zip holds two records named {short(info.filename)}")
            self._check(info, limits)
            self.records[info.filename] = info
        stated = sum(info.file_size for info in infos)
        if stated > limits.max_expansion * max(self._size, 1):
            raise Malformed(f"its records state {stated} bytes in all, more than "
                            f"max_expansion={limits.max_expansion:g} times its {self._size} bytes (a decompression "
                            "bomb?). If you trust the file, raise the bound with aitoolbox's "
                            "checkpoint_limits(max_expansion=...)")
        self.prefix = infos[0].filename.split("/", 1)[0]
        if f"{self.prefix}/constants.pkl" in self.records \
                or any(name.startswith(f"{self.prefix}/code/") for name in self.records):
            raise Malformed("it is a TorchScript archive (torch.jit.save), not a checkpoint")
        if f"{self.prefix}/data.pkl" not in self.records:
            raise Malformed(f"its zip has no {self.prefix}/data.pkl record: not a torch.save file")
        pickle_record = self.records[f"{self.prefix}/data.pkl"]
        # Every byte of a pickle is an opcode the reader runs (a microsecond each): a compressed pickle may expand
        # less than the storages (torch never compresses it; opcodes repeating nothing compress a thousandfold).
        pickle_expansion = max(1.0, limits.max_expansion / 10)
        if pickle_record.file_size > max(_CHUNK, pickle_expansion * pickle_record.compress_size):
            raise Malformed(f"its pickle {pickle_record.filename!r} states {pickle_record.file_size} bytes from "
                            f"{pickle_record.compress_size} compressed, more than max_expansion/10="
                            f"{pickle_expansion:g} times (a pickle bomb?). If you trust the file, raise the bound with "
                            "aitoolbox's checkpoint_limits(max_expansion=...)")

    def _check(self, info: zipfile.ZipInfo, limits: ReadLimits) -> None:
        if info.flag_bits & 0x1:
            raise Malformed(f"record {info.filename!r} is encrypted")
        if info.compress_type == zipfile.ZIP_STORED:
            if info.compress_size != info.file_size:
                raise Malformed(f"stored record {info.filename!r} states {info.file_size} bytes and holds "
                                f"{info.compress_size}")
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            if info.file_size > limits.max_expansion * max(info.compress_size, 1):
                raise Malformed(f"record {info.filename!r} states {info.file_size} bytes from {info.compress_size} "
                                f"compressed, more than max_expansion={limits.max_expansion:g} times (a "
                                "decompression bomb?). If you trust the file, raise the bound with aitoolbox's "
                                "checkpoint_limits(max_expansion=...)")
        else:
            raise Malformed(f"record {info.filename!r} is compressed with method {info.compress_type}, which torch "
                            "never writes")
        if info.header_offset < 0 or info.header_offset + _LOCAL_HEADER.size + info.compress_size > self._size:
            raise Malformed(f"record {info.filename!r} lies beyond the end of the file")

    def has(self, name: str) -> bool:
        return f"{self.prefix}/{name}" in self.records

    def size(self, name: str) -> int:
        return self.records[f"{self.prefix}/{name}"].file_size

    def stored_size(self, name: str) -> int:
        """The bytes record ``name`` takes in the file (compressed or not)."""
        return self.records[f"{self.prefix}/{name}"].compress_size

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        self._source.seek(info.header_offset)
        header = self._source.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise Malformed(f"record {info.filename!r} is cut off")
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if signature != b"PK\x03\x04" or start + info.compress_size > self._size:
            raise Malformed(f"record {info.filename!r} has a damaged header or lies beyond the end of the file")
        return start

    def read_into(self, name: str, target: memoryview) -> None:
        """Fill ``target`` (exactly the record's size) with record ``name``, checking its CRC-32 on the way.

        Torch's own zip reader checks no CRC-32, so a bit flipped on disk or in a copy would load silently as
        another weight: the checksum is computed over the bytes as they are read (a few percent of the read's time),
        never by reading the file again.
        """
        info = self.records[f"{self.prefix}/{name}"]
        if len(target) != info.file_size:
            raise Malformed(f"record {info.filename!r} holds {info.file_size} bytes, {len(target)} are expected")
        self._source.seek(self._data_start(info))
        if info.compress_type == zipfile.ZIP_STORED:
            filled, checksum = 0, 0
            while filled < len(target):
                count = self._source.readinto(target[filled:filled + 64 * _CHUNK])
                if not count:
                    raise Malformed(f"record {info.filename!r} is cut off")
                checksum = zlib.crc32(target[filled:filled + count], checksum)
                filled += count
            _check_crc(info, checksum)
            return
        checksum = 0
        inflater, filled, remaining = zlib.decompressobj(-zlib.MAX_WBITS), 0, info.compress_size
        while not inflater.eof:
            if inflater.unconsumed_tail:
                compressed = inflater.unconsumed_tail
            elif remaining:
                compressed = self._source.read(min(_CHUNK, remaining))
                remaining -= len(compressed)
            else:
                compressed = b""
            if not compressed:
                break
            try:
                out = inflater.decompress(compressed, max(1, min(_CHUNK, len(target) - filled + 1)))
            except zlib.error as error:  # e.g. a stored record whose compression method a flipped bit changed
                raise Malformed(f"record {info.filename!r} cannot be inflated ({error})") from error
            if filled + len(out) > len(target):
                raise Malformed(f"record {info.filename!r} inflates beyond the {info.file_size} bytes it states")
            target[filled:filled + len(out)] = out
            checksum = zlib.crc32(out, checksum)
            filled += len(out)
        if filled != len(target) or not inflater.eof:
            raise Malformed(f"record {info.filename!r} inflates to {filled} bytes, not the {info.file_size} it states")
        _check_crc(info, checksum)

    def read(self, name: str) -> bytes:
        data = bytearray(self.size(name))
        self.read_into(name, memoryview(data))
        return bytes(data)


def _check_crc(info: zipfile.ZipInfo, checksum: int) -> None:
    """Refuse a record whose bytes do not have the CRC-32 its zip directory states.

    A stated CRC-32 of 0 is taken as "not computed": ``torch.serialization.set_crc32_options(False)`` makes
    ``torch.save`` write 0 for every record (which torch's loader accepts). A record whose true checksum is 0 then
    goes unchecked, one in 2**32.
    """
    if info.CRC != 0 and checksum != info.CRC:
        raise Malformed(f"record {info.filename!r} does not hold the bytes it was written with: its CRC-32 is "
                        f"{checksum:08x}, its zip directory states {info.CRC:08x} (a bit flipped on disk or in a copy)")


class _Storages:
    """The storages a file's pickle names (persistent ids), each read once and placed as ``map_location`` says."""

    def __init__(self, archive: TorchZip, map_location: Any):
        self._archive = archive
        self._map_location = map_location
        self._loaded: Dict[str, Any] = {}
        self._ours: Dict[int, Any] = {}
        self._swap = archive.has("byteorder") and self._byteorder() != sys.byteorder

    def _byteorder(self) -> str:
        if self._archive.size("byteorder") > 16:
            raise Malformed("its byteorder record is not 'little' or 'big'")
        order = self._archive.read("byteorder").decode("ascii", "replace").strip()
        if order not in ("little", "big"):
            raise Malformed(f"its byteorder record is {order!r}, not 'little' or 'big'")
        return order

    def is_ours(self, storage: Any) -> bool:
        return self._ours.get(id(storage)) is storage

    def load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5:
            raise Malformed(f"a persistent id {short(pid)} that is not torch's storage reference")
        typename, kind, key, location, numel = pid
        typename = typename.decode("ascii") if isinstance(typename, bytes) else typename
        if typename != "storage" or not isinstance(kind, StorageKind) or not isinstance(key, str) \
                or not re.fullmatch(r"\w{1,64}", key) or not isinstance(location, str) or type(numel) is not int \
                or numel < 0:
            raise Malformed(f"a storage reference {short(pid)} that is not torch's")
        if key in self._loaded:
            storage = self._loaded[key]
            if storage.dtype != kind.dtype:
                raise Malformed(f"storage {key} is referenced with two dtypes")
            return storage
        if not self._archive.has(f"data/{key}"):
            raise Malformed(f"its pickle names storage {key}, which has no record")
        element = torch._utils._element_size(kind.dtype)
        if numel * element != self._archive.size(f"data/{key}"):
            raise Malformed(f"storage {key} is said to hold {numel} elements of {element} bytes, its record holds "
                            f"{self._archive.size(f'data/{key}')} bytes")
        raw = torch.empty(numel * element, dtype=torch.uint8)
        self._archive.read_into(f"data/{key}", memoryview(raw.numpy()))
        untyped = raw.untyped_storage()
        if self._swap and element > 1:
            untyped.byteswap(kind.dtype)
        storage = torch.storage.TypedStorage(wrap_storage=self._placed(untyped, location),
                                             dtype=kind.dtype, _internal=True)
        self._loaded[key] = storage
        self._ours[id(storage)] = storage
        return storage

    def _placed(self, untyped: Any, location: str) -> Any:
        if not isinstance(location, str) or not re.fullmatch(r"[a-z_]+(:\d+)?", location):
            raise Malformed(f"a storage saved at location {short(location)}, which is not a device")
        target: Any = location
        mapping = self._map_location
        if isinstance(mapping, dict):
            target = mapping.get(location, location)
        elif isinstance(mapping, (str, torch.device)):
            target = mapping
        elif callable(mapping):  # as torch.load calls it: with the storage on the CPU and the saved location
            try:
                placed = mapping(untyped, location)
            except Exception as error:  # the caller's own function: its error is raised as it is
                raise CallerError(error) from error
            if placed is not None:
                return placed._untyped_storage if isinstance(placed, torch.storage.TypedStorage) else placed
        elif mapping is not None:
            raise TypeError(f"map_location must be None, a string, a torch.device, a dict or a function, got "
                            f"{type(mapping).__name__}")
        if not isinstance(target, (str, torch.device)) or not re.fullmatch(r"[a-z_]+(:\d+)?", str(target)):
            raise Malformed(f"a storage placed at {short(str(target))}, which is not a device")
        device = torch.device(target)
        if device.type == "cpu":
            return untyped
        if device.type == "meta":  # shapes only, as torch.load places them
            return torch.UntypedStorage(untyped.nbytes(), device="meta")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise Unavailable(f"its tensors were saved on {device}, and this machine has no CUDA device: load it with "
                              "map_location='cpu'")
        try:
            return untyped.to(device=device)
        except (RuntimeError, AssertionError) as error:
            raise Unavailable(f"its tensors were saved on {device}, which cannot be used here ({error}): load it "
                              "with map_location='cpu'") from error


def read_torch_file(source: BinaryIO, map_location: Any = "cpu", limits: Optional[ReadLimits] = None) -> Any:
    """The object ``torch.save`` wrote into ``source`` (a file opened by the caller, or bytes in memory).

    Raises:
        Refused: the pickle names globals outside the table (nothing was called).
        Malformed: the file is damaged, not a torch file, or beyond ``limits``.
        Unavailable: its tensors were saved on a device this machine lacks.
        Exception: what a ``map_location`` function raised, unchanged.
    """
    limits = limits or LIMITS.get()
    archive = TorchZip(source, limits)
    storages = _Storages(archive, map_location)
    numpy_builder = NumpyBuilder()
    table = torch_table(TensorBuilder(storages.is_ours, limits.tensor_budget(archive.file_size),
                                      limits.tensor_budget_text(archive.file_size)))
    table.update(python_table())
    table.update(numpy_table(numpy_builder))
    pickled = archive.read("data.pkl")
    try:
        loaded = RestrictedUnpickler(pickled, table, persistent_load=storages.load, build=build_state(numpy_builder),
                                     stored_size=archive.stored_size("data.pkl")).load()
    except CallerError as error:
        raise error.error from None
    except Refused as refused:  # list every global the file names that the table lacks, not only the first
        known = {f"{module}.{name}" for module, name in table}
        raise Refused(list(dict.fromkeys(refused.names + [name for name in refused_names(pickled)
                                                           if name not in known]))) from None
    check_shape(loaded, limits.max_nesting, limits.max_visits(len(pickled)))
    return loaded
