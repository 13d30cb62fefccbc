"""aitoolbox's reader of torch files builds what torch's own loader builds, for everything a checkpoint holds.

Property: for plain data and tensors drawn at random (dtypes, shapes, views, shared storages, numpy values), at
every pickle protocol ``torch.save`` writes, :func:`load_torch_file` gives what ``torch.load`` gives (with full
unpickling: torch's ``weights_only`` loader itself reads protocol 2 only). And the
options of ``torch.load`` it takes (``map_location`` as a string, device, dict or function; files written on a
machine of the other byte order) work as torch's do.
"""
import collections
import io
import math
import sys
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from aitoolbox.experiment.local_save.object_bounds import check_shape
from aitoolbox.experiment.local_save.restricted_pickle import Malformed, RestrictedUnpickler
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError, load_torch_file, read_torch_source

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    base = torch.arange(max(1, math.prod(shape)) * 2).to(dtype) if dtype != torch.bool else \
        torch.arange(max(1, math.prod(shape)) * 2) % 2 == 0
    tensor = base[:math.prod(shape)].reshape(shape)
    view = draw(st.sampled_from(["plain", "transposed", "sliced", "expanded"]))
    if view == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "sliced" and tensor.dim() >= 1 and tensor.shape[0] > 1:
        tensor = tensor[1:]
    elif view == "expanded" and tensor.dim() >= 1 and tensor.shape[-1] == 1:
        tensor = tensor.expand(*tensor.shape[:-1], 3)
    return tensor


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8) | tensors(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    | st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)


def same(loaded, expected):
    if isinstance(expected, torch.Tensor):
        return (type(loaded) is type(expected) and loaded.dtype == expected.dtype and loaded.shape == expected.shape
                and loaded.stride() == expected.stride() and torch.equal(loaded, expected))
    if isinstance(expected, dict):
        return type(loaded) is type(expected) and list(loaded) == list(expected) and all(
            same(loaded[key], value) for key, value in expected.items())
    if isinstance(expected, (list, tuple)):
        return type(loaded) is type(expected) and len(loaded) == len(expected) and all(
            same(a, b) for a, b in zip(loaded, expected))
    return type(loaded) is type(expected) and loaded == expected


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=plain, protocol=st.integers(1, 5))
def test_what_torch_saves_loads_as_torch_loads_it(tmp_path, value, protocol):
    path = str(tmp_path / "value.pth")
    torch.save({"value": value}, path, pickle_protocol=protocol)
    expected = torch.load(path, weights_only=False)["value"]  # the test's own file: full unpickling as reference
    assert same(load_torch_file(path)["value"], expected)


def test_tensors_sharing_a_storage_still_share_it_and_parameters_stay_parameters(tmp_path):
    weight = torch.nn.Parameter(torch.randn(3, 4))
    path = str(tmp_path / "tied.pth")
    torch.save({"a": weight, "b": weight.data, "view": weight.data[1:]}, path)
    loaded = load_torch_file(path)
    assert type(loaded["a"]) is torch.nn.Parameter and torch.equal(loaded["a"].data, weight.data)
    assert loaded["b"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    assert loaded["view"].storage_offset() == 4 and torch.equal(loaded["view"], weight.data[1:])


@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"},
                                          lambda storage, location: storage, "meta"])
def test_map_location_is_torch_loads(tmp_path, map_location):
    path = str(tmp_path / "value.pth")
    torch.save({"w": torch.ones(3)}, path)
    loaded = load_torch_file(path, map_location=map_location)["w"]
    expected = torch.load(path, map_location=map_location, weights_only=True)["w"]
    assert loaded.device == expected.device and loaded.shape == expected.shape


def test_a_map_location_function_that_fails_raises_its_own_error(tmp_path):
    path = str(tmp_path / "value.pth")
    torch.save({"w": torch.ones(3)}, path)

    def refuse(storage, location):
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        load_torch_file(path, map_location=refuse)


def test_a_file_written_on_a_machine_of_the_other_byte_order_loads(tmp_path):
    values = {"f": torch.arange(5, dtype=torch.float64) / 3, "c": torch.tensor([1 + 2j], dtype=torch.complex64),
              "i": torch.tensor([1, -2, 300], dtype=torch.int16), "b": torch.tensor([True, False])}
    buffer = io.BytesIO()
    torch.save(values, buffer)
    other = "big" if sys.byteorder == "little" else "little"
    output = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(output, "w") as target:
        for info in source.infolist():
            content = source.read(info.filename)
            if info.filename.endswith("/byteorder"):
                content = other.encode()
            elif "/data/" in info.filename:
                content = _swapped(content, info.filename, values)
            target.writestr(info.filename, content)
    path = str(tmp_path / "other_order.pth")
    with open(path, "wb") as handle:
        handle.write(output.getvalue())
    loaded = load_torch_file(path)
    for key, value in values.items():
        assert torch.equal(loaded[key], value)


def _swapped(content, name, values):
    """The storage record ``name`` in the other byte order (torch numbers the records in the order it meets the
    tensors: that of ``values``)."""
    key = int(name.rsplit("/", 1)[1])
    tensor = list(values.values())[key]
    unit = tensor.element_size() // (2 if tensor.is_complex() else 1)
    return np.frombuffer(content, dtype=np.uint8).reshape(-1, unit)[:, ::-1].tobytes() if unit > 1 else content


def test_plain_attributes_of_tensors_load_and_others_are_refused(tmp_path):
    """A compiled training marks its optimizer's state tensors (``_dynamo_static_input_type``); a file must not
    hide a tensor's methods or set its hooks that way."""
    from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError

    marked = torch.ones(2)
    marked._dynamo_static_input_type = "guarded"
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.note = 3
    path = str(tmp_path / "marked.pth")
    torch.save({"step": marked, "p": parameter}, path)
    loaded = load_torch_file(path)
    assert loaded["step"]._dynamo_static_input_type == "guarded" and loaded["p"].note == 3
    for name, value in (("sum", 1), ("_backward_hooks", "x"), ("__class__", "x"), ("nested", [1])):
        hostile = torch.ones(2)
        hostile.__dict__[name] = value  # pickled as the tensor's state, as torch pickles attributes
        torch.save({"t": hostile}, path)
        with pytest.raises(UntrustedCheckpointError, match="attributes"):
            load_torch_file(path)


def test_numpy_values_of_aitoolbox_1_hyperparameters_load(tmp_path):
    values = {"lr": np.float64(0.1), "sizes": np.arange(3, dtype=np.int32), "flag": np.bool_(True),
              "text": np.array(["ab", "c"]), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3))}
    path = str(tmp_path / "numpy.pth")
    torch.save(values, path)
    loaded = load_torch_file(path)
    for key, value in values.items():
        assert type(loaded[key]) is type(value) and np.array_equal(loaded[key], value)
    assert loaded["fortran"].flags.f_contiguous


def test_bytes_in_memory_are_read_the_same_way():
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    assert torch.equal(read_torch_source(io.BytesIO(buffer.getvalue()), "in memory")["w"], torch.ones(2))
    with pytest.raises(CorruptCheckpointError, match="in memory"):
        read_torch_source(io.BytesIO(buffer.getvalue()[:50]), "in memory")


@pytest.mark.parametrize("pickled, reason", [
    (b"\x80\x02]q\x00h\x00a.", "contains itself"),
    (b"\x80\x02" + b"]" * 150 + b"a" * 149 + b".", "nest"),
])
def test_what_was_built_is_bounded(pickled, reason):
    with pytest.raises(Malformed, match=reason):
        check_shape(RestrictedUnpickler(pickled, {}).load(), max_depth=100, max_visits=10 ** 6)


def test_tensors_saved_on_a_gpu_load_where_map_location_says(tmp_path):
    from aitoolbox.experiment.local_save.safe_load import CheckpointLoadError
    from tests.security.hostile import TensorRef, torch_file

    path = str(tmp_path / "gpu.pth")
    with open(path, "wb") as handle:
        handle.write(torch_file({"w": TensorRef(location="cuda:0")}, {"0": bytes(16)}))
    assert load_torch_file(path, map_location="cpu")["w"].device.type == "cpu"
    if torch.cuda.is_available():
        assert load_torch_file(path, map_location=None)["w"].device.type == "cuda"
    else:  # a sound file this machine cannot place: not corrupt, and the message says what to do
        with pytest.raises(CheckpointLoadError, match="map_location='cpu'") as error:
            load_torch_file(path, map_location=None)
        assert type(error.value) is CheckpointLoadError and path in str(error.value)


def _flip_a_bit_of(path, record_suffix):
    """Flip one bit of the bytes of the record of the zip at ``path`` whose name ends with ``record_suffix``,
    leaving its zip container (sizes, offsets, directory) intact."""
    with zipfile.ZipFile(path) as archive:
        (record,) = [info for info in archive.infolist() if info.filename.endswith(record_suffix)]
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset + 26)
        name_length, extra_length = (int.from_bytes(handle.read(2), "little") for _ in range(2))
        where = record.header_offset + 30 + name_length + extra_length + record.compress_size // 2
        handle.seek(where)
        byte = handle.read(1)[0]
        handle.seek(where)
        handle.write(bytes([byte ^ 0x08]))
    return record.filename


@pytest.mark.parametrize("record_suffix", ["/data/0", "/data.pkl"])
def test_a_bit_flipped_in_a_record_is_found_and_named(tmp_path, record_suffix):
    """Torch's zip reader checks no CRC-32: the flipped weight (or pickle byte) would load silently."""
    path = str(tmp_path / "flipped.pth")
    torch.save({"weight": torch.arange(64, dtype=torch.float32), "note": "x" * 64}, path)
    name = _flip_a_bit_of(path, record_suffix)
    with pytest.raises(CorruptCheckpointError, match="CRC-32") as error:
        load_torch_file(path)
    assert path in str(error.value) and name in str(error.value)


def test_a_stored_record_marked_deflated_by_a_flipped_bit_is_named(tmp_path):
    """A flipped bit in the zip directory's compression method of a stored record (here the small ``byteorder``
    record) made the reader inflate raw bytes: a bare ``zlib.error`` naming no file (review of issue 33, stop 40)."""
    path = str(tmp_path / "deflated.pth")
    torch.save({"weight": torch.arange(64, dtype=torch.float32)}, path)
    with zipfile.ZipFile(path) as archive:
        (record,) = [info for info in archive.infolist() if info.filename.endswith("/byteorder")]
        directory = archive.start_dir
    with open(path, "r+b") as handle:
        content = bytearray(handle.read())
    entry = content.index(b"PK\x01\x02" + content[directory + 4:directory + 10], directory)
    while content[entry + 46:entry + 46 + len(record.filename)] != record.filename.encode():
        entry = content.index(b"PK\x01\x02", entry + 4)
    assert content[entry + 10] == zipfile.ZIP_STORED
    content[entry + 10] = zipfile.ZIP_DEFLATED
    with open(path, "wb") as handle:
        handle.write(content)
    with pytest.raises(CorruptCheckpointError, match="cannot be inflated") as error:
        load_torch_file(path)
    assert path in str(error.value) and record.filename in str(error.value)


def test_a_file_saved_without_crc32s_still_loads(tmp_path):
    """``torch.serialization.set_crc32_options(False)`` writes 0 as every record's CRC-32; torch loads such a file,
    and so does aitoolbox (unchecked)."""
    path = str(tmp_path / "no_crc.pth")
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"weight": torch.arange(8.0)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(load_torch_file(path)["weight"], torch.arange(8.0))
