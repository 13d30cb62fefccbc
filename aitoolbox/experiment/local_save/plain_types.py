"""What a checkpoint file may hold, for :mod:`~aitoolbox.experiment.local_save.restricted_pickle`: the table of
globals it may name and the states it may set.

Torch's own types (tensors rebuilt over the file's storages, sizes, dtypes, devices, layouts), plain containers,
and the plain data types aitoolbox 1.x checkpoints hold in their hyperparameters: numpy scalars and arrays,
``argparse.Namespace``, ``pathlib`` paths, ``datetime`` values, sets. Each is built by a function here from plain
data that it checks first: a numpy value from a numeric, boolean or fixed-width text dtype name, a byte order, a
shape and its bytes (never an object field or a dtype state of the file's choosing); a tensor from a storage of
this file, with its offset, size and stride inside that storage.
"""
import argparse
import collections
import datetime
import math
import pathlib
import re
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from aitoolbox.experiment.local_save.restricted_pickle import Allowed, Malformed, Refused, check_key, short

Table = Dict[Tuple[str, str], Any]


def _ints(values: Any, what: str, minimum: Optional[int] = 0) -> Tuple[int, ...]:
    if type(values) not in (tuple, list, torch.Size) or not all(type(value) is int for value in values) \
            or (minimum is not None and any(value < minimum for value in values)):
        raise Malformed(f"{what} is not a sequence of integers >= {minimum}: {short(values)}")
    return tuple(values)


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise Malformed(f"{what} is not an integer >= {minimum}: {short(value)}")
    return value


def _empty(value: Any) -> bool:
    """None or an empty dict (what torch pickles for no hooks, no metadata, no attributes)."""
    return value is None or (type(value) in (dict, collections.OrderedDict) and not value)


# --- torch ----------------------------------------------------------------------------------------------------------
class StorageKind:
    """A storage class named in a persistent id (``torch.FloatStorage``, ``torch.UntypedStorage``): its dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _storage_kinds() -> Table:
    table: Table = {}
    for name in dir(torch):
        if name.endswith("Storage") and not name.startswith("_"):
            try:
                dtype = torch.serialization.StorageType(name).dtype
            except (KeyError, AttributeError, RuntimeError):
                continue
            table[("torch", name)] = StorageKind(dtype)
    for name in ("UntypedStorage", "TypedStorage"):
        table[("torch.storage", name)] = StorageKind(torch.uint8)
    table[("torch", "UntypedStorage")] = StorageKind(torch.uint8)
    return table


class TensorBuilder:
    """Builds tensors over the storages one file's persistent ids gave (``is_ours``), inside their bounds.

    Args:
        is_ours: whether a storage is one of the file's.
        budget: how many bytes (``numel * itemsize``) all tensors built may hold together. A view repeating its
            storage (stride 0, e.g. a model's ``torch.ones(1).expand(512, 512)`` buffer) costs nothing to build,
            but any copy of it costs its full size, and a file can hold many views of one storage.
        budget_text: the bound in words, for the error.
    """

    def __init__(self, is_ours: Callable[[Any], bool], budget: int = 1 << 30, budget_text: str = ""):
        self._is_ours = is_ours
        self._budget_left = budget
        self._budget_text = budget_text or f"more than {budget} bytes in all"

    def _storage(self, storage: Any) -> Any:
        if not self._is_ours(storage):
            raise Malformed("a tensor over something that is not one of the file's storages")
        return storage

    def tensor(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
               hooks: Any = None, metadata: Any = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        storage = self._storage(storage)
        dtype = storage.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise Malformed(f"a tensor of dtype {short(dtype)}")
        offset, size, stride = _int(offset, "a tensor's offset"), _ints(size, "a tensor's size"), \
            _ints(stride, "a tensor's stride")
        if len(size) != len(stride) or type(requires_grad) is not bool:
            raise Malformed(f"a tensor of size {size} and stride {stride}")
        if not _empty(hooks):
            raise Malformed("a tensor with backward hooks")
        if not _empty(metadata) and (type(metadata) is not dict or not all(
                key in ("conj", "neg") and type(value) is bool for key, value in metadata.items())
                or (metadata.get("conj") and not dtype.is_complex) or (metadata.get("neg") and dtype == torch.bool)):
            raise Malformed("a tensor with metadata other than torch's conjugate and negative flags")
        element = torch._utils._element_size(dtype)
        nbytes = storage._untyped_storage.nbytes()
        elements = nbytes // element
        last = offset + sum((length - 1) * step for length, step in zip(size, stride)) if all(size) else -1
        if last >= elements:
            raise Malformed(f"a tensor reaches element {last} of a storage of {elements}")
        # A view may repeat its storage (stride 0) as much as it likes; what is bounded is the total of what the
        # file's tensors hold, which is what copying them all (loading them into a model, casting them) costs.
        self._budget_left -= math.prod(size) * element
        if self._budget_left < 0:
            raise Malformed(f"its tensors hold {self._budget_text}")
        tensor = torch.empty((0,), dtype=dtype, device=storage._untyped_storage.device)
        tensor.set_(storage._untyped_storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        if metadata:
            torch._utils.set_tensor_metadata(tensor, metadata)
        return tensor

    def rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                   hooks: Any = None, metadata: Any = None) -> torch.Tensor:
        return self.tensor(storage, offset, size, stride, requires_grad, hooks, metadata)

    def rebuild_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                   dtype: Any, metadata: Any = None) -> torch.Tensor:
        return self.tensor(storage, offset, size, stride, requires_grad, hooks, metadata, dtype=dtype)

    def rebuild_v1(self, storage: Any, offset: Any, size: Any, stride: Any) -> torch.Tensor:
        return self.tensor(storage, offset, size, stride)

    @staticmethod
    def parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> torch.nn.Parameter:
        if type(data) is not torch.Tensor or type(requires_grad) is not bool or not _empty(hooks):
            raise Malformed("a parameter of other than a tensor and a flag, or with backward hooks")
        attributes = _tensor_attributes(state)
        parameter = torch.nn.Parameter(data, requires_grad)
        for name, value in attributes.items():
            setattr(parameter, name, value)
        return parameter

    @staticmethod
    def meta_tensor(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> torch.Tensor:
        if not isinstance(dtype, torch.dtype) or type(requires_grad) is not bool:
            raise Malformed("a meta tensor of other than a dtype and a flag")
        return torch.empty_strided(_ints(size, "a meta tensor's size"), _ints(stride, "a meta tensor's stride"),
                                   dtype=dtype, device="meta", requires_grad=requires_grad)


_PLAIN_TENSOR = Allowed("torch.Tensor")


def _tensor_attributes(state: Any) -> Dict[str, Any]:
    """The Python attributes torch pickles with a tensor (e.g. ``_dynamo_static_input_type``, which a compiled
    training sets on its optimizer's state): plain names that do not hide anything of ``torch.Tensor``, plain
    values."""
    if type(state) is tuple and len(state) == 2 and _empty(state[1]):
        state = state[0]
    if _empty(state):
        return {}
    if type(state) is not dict or not all(
            isinstance(name, str) and re.fullmatch(r"_?[A-Za-z][A-Za-z0-9_]*", name) and not name.endswith("hooks")
            and not hasattr(torch.Tensor, name) and type(value) in (str, int, float, bool, type(None))
            for name, value in state.items()):
        raise Refused(["a tensor with attributes other than plain values"])
    return state


def _from_type(builder_calls: Dict[int, Allowed]) -> Callable[..., Any]:
    def rebuild(function: Any, new_type: Any, args: Any, state: Any) -> Any:
        if id(function) not in builder_calls or new_type is not _PLAIN_TENSOR or type(args) is not tuple:
            raise Refused([f"a tensor subclass ({getattr(new_type, 'name', short(new_type))})"])
        attributes = _tensor_attributes(state)
        tensor = function.call(*args)
        for name, value in attributes.items():
            setattr(tensor, name, value)
        return tensor
    return rebuild


def torch_table(builder: TensorBuilder) -> Table:
    """torch's globals a checkpoint names: tensor rebuilding (over ``builder``'s storages), dtypes, sizes,
    devices, layouts."""
    rebuilds = {"_rebuild_tensor_v2": builder.rebuild_v2, "_rebuild_tensor_v3": builder.rebuild_v3,
                "_rebuild_tensor": builder.rebuild_v1, "_rebuild_parameter": builder.parameter,
                "_rebuild_parameter_with_state": builder.parameter,
                "_rebuild_meta_tensor_no_storage": builder.meta_tensor}
    table: Table = {("torch._utils", name): Allowed(f"torch._utils.{name}", call=call)
                    for name, call in rebuilds.items()}
    calls = {id(allowed): allowed for allowed in table.values()}
    table[("torch._tensor", "_rebuild_from_type_v2")] = Allowed("torch._tensor._rebuild_from_type_v2",
                                                                call=_from_type(calls))
    table[("torch", "Tensor")] = _PLAIN_TENSOR
    table.update(_storage_kinds())
    table.update(constant_table())
    return table


def _device(kind: Any, index: Any = None) -> torch.device:
    if not isinstance(kind, str) or not re.fullmatch(r"[a-z_]+(:\d+)?", kind) or \
            (index is not None and type(index) is not int):
        raise Malformed(f"a device {short(kind)}, {short(index)}")
    return torch.device(kind) if index is None else torch.device(kind, index)


def _layout(name: Any) -> Any:
    if not isinstance(name, str):
        raise Malformed(f"a layout named {short(name)}")
    return torch.serialization._get_layout(name)


def constant_table() -> Table:
    """torch's dtypes, layouts and memory formats (by name), ``torch.Size``, ``torch.device``."""
    table: Table = {("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}
    table[("torch", "Size")] = Allowed("torch.Size", call=lambda values=(): torch.Size(_ints(values, "a size")))
    table[("torch", "device")] = Allowed("torch.device", call=_device)
    table[("torch.serialization", "_get_layout")] = Allowed("torch.serialization._get_layout", call=_layout)
    return table


# --- plain Python ---------------------------------------------------------------------------------------------------
def _encode(text: Any, encoding: Any) -> bytes:
    """``_codecs.encode``, which protocol 2 pickles bytes with: only text to latin-1 bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Malformed(f"_codecs.encode of {type(text).__name__} with {short(encoding)}")
    return text.encode("latin-1")


def _bytes_like(kind: type) -> Callable[..., Any]:
    def build(source: Any = b"", encoding: Any = None) -> Any:
        if encoding is not None:
            source = _encode(source, encoding)
        if type(source) not in (bytes, bytearray):
            raise Malformed(f"{kind.__name__} of {type(source).__name__}")
        return kind(source)
    return build


def _collection(kind: type) -> Callable[..., Any]:
    def build(items: Any = ()) -> Any:
        if type(items) not in (list, tuple, set, frozenset, dict, collections.OrderedDict):
            raise Malformed(f"{kind.__name__} of {type(items).__name__}")
        if isinstance(items, dict) or kind in (set, frozenset, collections.Counter):
            keys = items  # a dict's keys; the elements of a set, or those a Counter counts
        else:  # the (key, value) pairs of an OrderedDict
            keys = [pair[0] for pair in items if type(pair) in (tuple, list) and len(pair) == 2]
        for key in keys:
            check_key(key)
        return kind(items)
    return build


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise Malformed("complex of other than two numbers")
    return complex(real, imag)


def _attributes(names: Any) -> bool:
    """Plain attribute names: text, none of Python's own (``__class__``, ``__dict__``)."""
    return all(isinstance(name, str) and not name.startswith("__") for name in names)


def _namespace(*args: Any, **kwargs: Any) -> argparse.Namespace:
    if args or not _attributes(kwargs):
        raise Malformed("argparse.Namespace with positional arguments or attributes of Python's own")
    return argparse.Namespace(**kwargs)


def _datetime_value(kind: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        if kind is datetime.timedelta:
            if len(args) > 3 or not all(type(arg) is int for arg in args):
                raise Malformed("timedelta of other than days, seconds, microseconds")
            try:
                return kind(*args)
            except OverflowError as error:
                raise Malformed(f"timedelta{short(args)} out of range: {error}") from None
        if not args or len(args) > 2 or (len(args) == 2 and args[1] is not None):
            raise Malformed(f"{kind.__name__} with a time zone or without its state")
        state = args[0].encode("latin-1") if isinstance(args[0], str) else args[0]
        if type(state) is not bytes:
            raise Malformed(f"{kind.__name__} of {type(state).__name__}")
        try:
            value = kind(state)
            # CPython's unpickling constructor checks the month alone and copies the other fields unchecked (day
            # 255, hour 255): rebuilt from its fields by the checking constructor, such a value is refused.
            return _checked_datetime(value)
        except (TypeError, ValueError) as error:
            raise Malformed(f"{kind.__name__} from the bytes {state[:16].hex()}: {error}") from None
    return build


def _checked_datetime(value: Any) -> Any:
    """``value`` (a date, datetime or time) rebuilt from its fields by the constructor that checks their ranges."""
    if isinstance(value, datetime.datetime):
        return datetime.datetime(value.year, value.month, value.day, value.hour, value.minute, value.second,
                                 value.microsecond, fold=value.fold)
    if isinstance(value, datetime.date):
        return datetime.date(value.year, value.month, value.day)
    return datetime.time(value.hour, value.minute, value.second, value.microsecond, fold=value.fold)


def _path(kind: type) -> Callable[..., Any]:
    def build(*parts: Any) -> Any:
        if not all(isinstance(part, str) for part in parts):
            raise Malformed(f"{kind.__name__} of other than text")
        return kind(*parts)
    return build


def python_table() -> Table:
    """Containers and the plain types of aitoolbox 1.x hyperparameters."""
    table: Table = {
        ("collections", "OrderedDict"): Allowed("collections.OrderedDict", call=_collection(collections.OrderedDict)),
        ("collections", "Counter"): Allowed("collections.Counter", call=_collection(collections.Counter)),
        ("builtins", "set"): Allowed("builtins.set", call=_collection(set)),
        ("builtins", "frozenset"): Allowed("builtins.frozenset", call=_collection(frozenset)),
        ("builtins", "complex"): Allowed("builtins.complex", call=_complex),
        ("builtins", "bytes"): Allowed("builtins.bytes", call=_bytes_like(bytes)),
        ("builtins", "bytearray"): Allowed("builtins.bytearray", call=_bytes_like(bytearray)),
        ("_codecs", "encode"): Allowed("_codecs.encode", call=_encode),
        ("argparse", "Namespace"): Allowed("argparse.Namespace", call=_namespace),
    }
    for kind in (datetime.datetime, datetime.date, datetime.time, datetime.timedelta):
        table[("datetime", kind.__name__)] = Allowed(f"datetime.{kind.__name__}", call=_datetime_value(kind))
    for kind in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath):
        for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved them to pathlib._local
            table[(module, kind.__name__)] = Allowed(f"pathlib.{kind.__name__}", call=_path(kind))
    return table


# --- numpy ----------------------------------------------------------------------------------------------------------
_DTYPE_NAME = re.compile(r"[<>|=]?(b1|[iu][1248]|f(2|4|8|12|16)|c(8|16|24|32)|[US]\d{0,9})")
_NDARRAY = Allowed("numpy.ndarray")


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch in practice
        return None
    return numpy


def plain_dtype(dtype: Any, what: str = "a numpy value") -> Any:
    """``dtype`` when it is a numpy dtype of numbers, booleans or fixed-width text, else refused."""
    numpy = _numpy()
    if not isinstance(dtype, numpy.dtype):
        raise Malformed(f"{what} of dtype {short(dtype)}")
    if dtype.kind not in "biufcUS" or dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise Refused([f"numpy values of dtype {dtype!r}, which hold Python objects or fields"[:200]])
    return dtype


def _check_text(dtype: Any, raw: Any, what: str) -> None:
    """Refuse fixed-width text (dtype ``U``) holding a code point beyond Unicode's last, 0x10FFFF: numpy stores it,
    but every later ``str()`` or ``repr()`` of the value fails (a SystemError), far from the file."""
    if dtype.kind != "U" or not raw:
        return
    numpy = _numpy()
    points = numpy.frombuffer(bytes(raw), dtype=numpy.dtype("u4").newbyteorder(dtype.byteorder))
    if points.size and int(points.max()) > 0x10FFFF:
        raise Malformed(f"{what} of dtype {dtype} holding the code point {int(points.max()):#x}, beyond Unicode's "
                        f"last (0x10ffff)")


def _numpy_dtype(name: Any, align: Any = False, copy: Any = False) -> Any:
    if not isinstance(name, str) or not _DTYPE_NAME.fullmatch(name) or type(align) is not bool:
        raise Refused([f"numpy.dtype({short(name)}), not a dtype of numbers, booleans or fixed-width text"])
    return plain_dtype(_numpy().dtype(name))


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    dtype = plain_dtype(dtype, "a numpy scalar")
    if dtype.itemsize == 0 and data == b"":  # an empty text scalar, of dtype U0 or S0
        return dtype.type()
    if type(data) is not bytes or len(data) != dtype.itemsize:
        raise Malformed(f"a numpy scalar of {dtype} from {type(data).__name__} of other than {dtype.itemsize} bytes")
    _check_text(dtype, data, "a numpy scalar")
    return _numpy().frombuffer(data, dtype=dtype, count=1)[0]


def _numpy_frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any, axis_order: Any = None) -> Any:
    """An array as numpy pickles it under protocol 5 (``numpy._core.numeric._frombuffer``), checked as the
    arrays of protocol 2 are: a plain dtype, a shape, and exactly as many bytes as they need."""
    numpy = _numpy()
    dtype = plain_dtype(dtype, "a numpy array")
    shape = _ints(shape, "a numpy array's shape")
    if type(buffer) not in (bytes, bytearray):
        raise Refused([f"numpy arrays of dtype {dtype} stored as {type(buffer).__name__}"])
    if order not in ("C", "F", "K") or (axis_order is not None and (
            order != "K" or type(axis_order) not in (tuple, list)
            or sorted(axis_order) != list(range(len(shape))))):
        raise Malformed(f"a numpy array of order {short(order)} and axis order {short(axis_order)}")
    if len(buffer) != math.prod(shape) * dtype.itemsize or dtype.itemsize == 0:
        raise Malformed(f"a numpy array of shape {short(shape)} and dtype {dtype} from {len(buffer)} bytes")
    _check_text(dtype, buffer, "a numpy array")
    array = numpy.frombuffer(bytearray(buffer), dtype=dtype)  # a copy of its own, writable as numpy's
    if order == "K" and axis_order is not None:
        return array.reshape(shape, order="C").transpose(axis_order)
    return array.reshape(shape, order=order)


class NumpyBuilder:
    """Arrays start empty (numpy's ``_reconstruct``); their one ``BUILD`` gives shape, dtype and bytes."""

    def __init__(self) -> None:
        self._fresh: Dict[int, Any] = {}

    def reconstruct(self, kind: Any, shape: Any, typecode: Any) -> Any:
        if kind is not _NDARRAY:
            raise Refused([f"numpy arrays of subclass {getattr(kind, 'name', kind)}"])
        array = _numpy().empty((0,), dtype="b")
        self._fresh[id(array)] = array
        return array

    def build_array(self, array: Any, state: Any) -> None:
        if self._fresh.pop(id(array), None) is not array:
            raise Malformed("sets the state of a numpy array twice")
        if type(state) is not tuple or len(state) not in (4, 5):
            raise Malformed("a numpy array's state is not numpy's")
        version, shape, dtype, fortran, raw = state if len(state) == 5 else (1,) + state
        shape = _ints(shape, "a numpy array's shape")
        dtype = plain_dtype(dtype, "a numpy array")
        if type(fortran) is not bool or type(raw) not in (bytes, bytearray) or version != 1:
            raise Refused([f"numpy arrays of dtype {dtype} stored as {type(raw).__name__}"])
        if len(raw) != math.prod(shape) * dtype.itemsize or (dtype.itemsize == 0 and math.prod(shape) > 1 << 20):
            raise Malformed(f"a numpy array of shape {short(shape)} and dtype {dtype} from {len(raw)} bytes")
        _check_text(dtype, raw, "a numpy array")
        array.__setstate__((1, shape, dtype, fortran, bytes(raw)))

    @staticmethod
    def build_dtype(dtype: Any, state: Any) -> Any:
        """numpy's dtype state: only its byte order is taken (the rest must be what a plain dtype has)."""
        if type(state) is not tuple or len(state) not in (8, 9) or state[0] not in (3, 4):
            raise Malformed("a numpy dtype's state is not numpy's")
        byteorder, subarray, names, fields, size, alignment, flags = state[1:8]
        if subarray is not None or names is not None or fields is not None \
                or (len(state) == 9 and state[8] not in (None, {})):
            raise Refused([f"numpy dtype {dtype} with fields, subarrays or metadata"])
        # The dtype is the one its name gives: the rest of the state must be what numpy writes for it (nothing of
        # it is handed to numpy).
        if byteorder not in ("<", ">", "|", "=") or size not in (-1, dtype.itemsize) \
                or alignment not in (-1, dtype.alignment) or flags != dtype.flags:
            raise Malformed(f"a numpy dtype {dtype} with the state {short(state)}")
        return dtype if byteorder in "|=" else plain_dtype(dtype.newbyteorder(byteorder))


def numpy_table(numpy_builder: NumpyBuilder) -> Table:
    if _numpy() is None:  # pragma: no cover
        return {}
    table: Table = {("numpy", "dtype"): Allowed("numpy.dtype", call=_numpy_dtype), ("numpy", "ndarray"): _NDARRAY}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1.x's name and numpy 2's
        table[(module, "scalar")] = Allowed("numpy.core.multiarray.scalar", call=_numpy_scalar)
        table[(module, "_reconstruct")] = Allowed("numpy.core.multiarray._reconstruct",
                                                  call=numpy_builder.reconstruct)
    for module in ("numpy.core.numeric", "numpy._core.numeric"):  # protocol 5's arrays
        table[(module, "_frombuffer")] = Allowed(f"{module}._frombuffer", call=_numpy_frombuffer)
    return table


def build_state(numpy_builder: NumpyBuilder) -> Callable[[Any, Any], Any]:
    """The ``BUILD`` of a checkpoint file: numpy arrays and dtypes, a state dict's ``_metadata``, a Namespace."""
    numpy = _numpy()

    def build(instance: Any, state: Any) -> Any:
        if numpy is not None and type(instance) is numpy.ndarray:
            return numpy_builder.build_array(instance, state)
        if numpy is not None and isinstance(instance, numpy.dtype):
            return numpy_builder.build_dtype(instance, state)
        if type(instance) in (collections.OrderedDict, argparse.Namespace):
            if type(state) is tuple and len(state) == 2 and state[1] is None:
                state = state[0]
            if type(state) is not dict or not _attributes(state):
                raise Malformed(f"the state of a {type(instance).__name__} is not a dict of plain attribute names")
            vars(instance).update(state)
            return None
        raise Malformed(f"sets the state of a {type(instance).__name__}, which a checkpoint never does")
    return build
