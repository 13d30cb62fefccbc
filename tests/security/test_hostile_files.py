"""Each defect of issue 31 (items 1-7) as found by an attacker who can write to a shared folder or bucket.

Sharded checkpoints: a planted rank-local index is never read, each file is read once, and a storage entry can
name only a file inside its folder, within that file's size. Checkpoint files: numpy values are rebuilt from plain
data (no object fields), nothing global changes while a file loads, a decompression bomb is refused before memory
is allocated, and a damaged file is reported as corrupt (never as untrusted, never with the advice to unpickle it
fully), by a documented ``Exception`` naming it.
"""
import datetime
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from aitoolbox.experiment.local_save.checkpoints import load_checkpoint_file
from aitoolbox.experiment.local_save.safe_load import (
    CheckpointLoadError, CorruptCheckpointError, UntrustedCheckpointError, checkpoint_limits, load_torch_file)
from aitoolbox.experiment.local_save.sharded_checkpoints import (
    load_sharded_checkpoint, read_full_model_state_dict)
from tests.security import hostile
from tests.security.isolated import ROOT, assert_safe, run_cases

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def load_into_model(folder):
    model = hostile.small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_sharded_checkpoint(folder, model, optimizer)
    return model


SHARDED_LOADS = {"load_sharded_checkpoint": load_into_model, "read_full_model_state_dict": read_full_model_state_dict}


# --- item 1: a planted rank-local index ---------------------------------------------------------------------------
@pytest.mark.parametrize("load", SHARDED_LOADS.values(), ids=SHARDED_LOADS.keys())
@pytest.mark.parametrize("index", [0, None, [], "text"], ids=["int", "none", "list", "str"])
def test_a_rank_local_index_planted_beside_an_unusable_one_is_never_read(tmp_path, load, index):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    marker = tmp_path / "code-was-run"
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        pickle.dump(index, handle)
    for rank in range(2):
        with open(os.path.join(folder, f"__{rank}.metadata"), "wb") as handle:
            pickle.dump(hostile.PlantedPayload(str(marker)), handle)
    with pytest.raises(CorruptCheckpointError, match="not DCP's index") as refused:
        load(folder)
    assert os.path.join(folder, ".metadata") in str(refused.value)
    assert not marker.exists()


# --- item 2: every file of a checkpoint is read once --------------------------------------------------------------
_COUNT_OPENS = """
import collections, json, os, sys, warnings
import torch
opened = collections.Counter()
folder = sys.argv[1]
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        name = os.fsdecode(args[0])
        if os.path.basename(name) in names or os.path.abspath(name).startswith(folder + os.sep):
            opened[os.path.basename(name)] += 1
names = set(os.listdir(folder))
sys.addaudithook(hook)
warnings.simplefilter("ignore")
from tests.security.test_hostile_files import SHARDED_LOADS
SHARDED_LOADS[sys.argv[2]](folder)
print(json.dumps(dict(opened)))
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.parametrize("load", SHARDED_LOADS.keys())
def test_each_file_of_a_sharded_checkpoint_is_opened_once(tmp_path, load):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    process = subprocess.run([sys.executable, "-c", _COUNT_OPENS, folder, load], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert process.returncode == 0, process.stderr[-3000:]
    opened = json.loads(process.stdout.strip().splitlines()[-1])
    assert opened.get(".metadata") == 1 and max(opened.values()) == 1, opened


def _serve_good_then_evil(fifo, good, evil, stop):
    """The writer of a named pipe that hands the first reader ``good`` and every later one ``evil``."""
    served = 0
    while not stop.is_set():
        try:
            descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            time.sleep(0.001)
            continue
        os.set_blocking(descriptor, True)
        try:
            os.write(descriptor, good if served == 0 else evil)
        except OSError:
            pass
        finally:
            os.close(descriptor)
        served += 1
        time.sleep(0.05)  # let the reader see the end of this copy before the next one opens


@pytest.mark.parametrize("load", SHARDED_LOADS.values(), ids=SHARDED_LOADS.keys())
def test_an_index_that_changes_between_two_reads_runs_nothing(tmp_path, load):
    """The check-then-reread race, made certain: the index is a named pipe that serves DCP's genuine index to
    the first reader and a planted one to the next."""
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    marker = tmp_path / "code-was-run"
    metadata = os.path.join(folder, ".metadata")
    with open(metadata, "rb") as handle:
        good = handle.read()
    os.remove(metadata)
    os.mkfifo(metadata)
    stop = threading.Event()
    writer = threading.Thread(target=_serve_good_then_evil,
                              args=(metadata, good, pickle.dumps(hostile.PlantedPayload(str(marker))), stop))
    writer.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="not a regular file") as refused:
            load(folder)
        assert metadata in str(refused.value)
    finally:
        stop.set()
        writer.join(timeout=10)
    assert not marker.exists()


# --- item 3: storage entries outside the folder or beyond their file ----------------------------------------------
@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoint A (the one loaded) and B (another run's, elsewhere), of the same model with other weights."""
    a = hostile.sharded_checkpoint(str(tmp_path / "run_a" / "model_exp_ts_E1"), seed=1)
    b = hostile.sharded_checkpoint(str(tmp_path / "run_b" / "model_exp_ts_E1"), seed=2)
    return a, b


def _entries_point_to(folder, target):
    hostile.rewrite_metadata(folder, lambda metadata: [
        hostile.set_storage_entry(metadata, index, relative_path=target(info.relative_path))
        for index, info in hostile.storage_entries(metadata)] and None)


@pytest.mark.parametrize("load", SHARDED_LOADS.values(), ids=SHARDED_LOADS.keys())
@pytest.mark.parametrize("where", ["absolute", "climbing", "symlink", "subfolder_symlink"])
def test_a_storage_entry_outside_its_folder_is_refused_before_reading(two_checkpoints, load, where):
    a, b = two_checkpoints
    weights_b = read_full_model_state_dict(b)
    if where == "absolute":
        _entries_point_to(a, lambda name: os.path.join(b, name))
    elif where == "climbing":
        _entries_point_to(a, lambda name: os.path.join("..", "..", "run_b", os.path.basename(b), name))
    elif where == "symlink":
        for name in hostile.distcp_files(a):
            os.remove(os.path.join(a, name))
            os.symlink(os.path.join(b, name), os.path.join(a, name))
    else:
        os.symlink(b, os.path.join(a, "shards"))
        _entries_point_to(a, lambda name: os.path.join("shards", name))
    with pytest.raises(CorruptCheckpointError) as refused:
        load(a)
    assert a in str(refused.value) and ("outside" in str(refused.value) or "symbolic link" in str(refused.value))
    model = hostile.small_model()
    assert not any(torch.equal(model.state_dict()[key], value) for key, value in weights_b.items())


@pytest.mark.parametrize("load", SHARDED_LOADS.values(), ids=SHARDED_LOADS.keys())
@pytest.mark.parametrize("change", ["length", "offset", "negative", "transform"])
def test_a_storage_entry_beyond_its_file_is_refused_before_reading(tmp_path, load, change):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    size = os.path.getsize(os.path.join(folder, hostile.distcp_files(folder)[0]))
    fields = {"length": {"length": size + 1}, "offset": {"offset": size}, "negative": {"offset": -8},
              "transform": {"transform_descriptors": ["zstd"]}}[change]
    hostile.rewrite_metadata(folder, lambda metadata: hostile.set_storage_entry(
        metadata, hostile.storage_entries(metadata)[-1][0], **fields))
    with pytest.raises(CorruptCheckpointError) as refused:
        load(folder)
    assert folder in str(refused.value)


@pytest.mark.slow  # a process of its own
def test_a_storage_entry_naming_a_device_file_reads_nothing(tmp_path):
    """``/dev/zero`` with a 16 GiB length: refused before a byte is read (in a process with a memory limit)."""
    cases = []
    for entry in ("sharded", "consolidate", "loader"):
        folder = hostile.sharded_checkpoint(str(tmp_path / entry / "model_exp_ts_E1"))
        hostile.rewrite_metadata(folder, lambda metadata: [
            hostile.set_storage_entry(metadata, index, relative_path="/dev/zero", offset=0, length=16 << 30)
            for index, _ in hostile.storage_entries(metadata)] and None)
        cases.append({"id": entry, "entry": entry, "path": folder, "root": str(tmp_path / entry), "names": [folder]})
    results = run_cases(cases, str(tmp_path / "work"))
    for case in cases:
        assert_safe(case, results[case["id"]])
        assert "CorruptCheckpointError" in results[case["id"]]["bases"]


# --- item 4: numpy values rebuilt from plain data only -----------------------------------------------------------
@pytest.mark.slow  # a process of its own
def test_a_numpy_dtype_with_an_object_field_is_refused_and_the_process_survives(tmp_path):
    cases = []
    for entry, key in (("loop", "early_stop"), ("file", "hyperparams"), ("loader", "epoch")):
        path = str(tmp_path / f"{entry}.pth")
        torch.save(hostile.small_checkpoint(**{key: hostile.object_field_array()}), path)
        cases.append({"id": entry, "entry": entry, "path": path, "root": str(tmp_path), "names": [path]})
    results = run_cases(cases, str(tmp_path / "work"))
    for case in cases:
        assert_safe(case, results[case["id"]])
        assert results[case["id"]]["type"] == "UntrustedCheckpointError", results[case["id"]]
        assert "object" in results[case["id"]]["message"]


@pytest.mark.parametrize("value", [
    hostile.object_field_array(),
    hostile.NumpyArrayState((1,), np.dtype("O"), [hostile.PlantedPayload("/nonexistent/x")]),
    hostile.NumpyArrayState((2,), np.dtype("f8"), b"\x00" * 8),  # fewer bytes than the shape needs
    hostile.NumpyArrayState((-1,), np.dtype("f8"), b""),
    hostile.NumpyScalarState(np.dtype("O"), hostile.PlantedPayload("/nonexistent/x")),
    hostile.NumpyScalarState(np.dtype("f8"), b"\x00"),
    hostile.NumpyScalarState(hostile._StatefulDtype("f8", (3, "<", None, None, None, -1, -1, 63)), b"\x00" * 8),
], ids=["object-field", "object-array", "short-data", "negative-shape", "object-scalar", "short-scalar",
        "object-flags"])
def test_numpy_values_that_could_choose_memory_are_refused(tmp_path, value):
    path = str(tmp_path / "hostile.pth")
    torch.save(hostile.small_checkpoint(hyperparams={"value": value}), path)
    with pytest.raises((UntrustedCheckpointError, CorruptCheckpointError)) as refused:
        load_checkpoint_file(path)
    assert path in str(refused.value)


class _DatetimeState:
    """Pickles as ``datetime`` class called with ``state``, the bytes CPython's unpickling constructor takes."""

    def __init__(self, kind, state):
        self.kind, self.state = kind, state

    def __reduce__(self):
        return self.kind, (self.state,)


@pytest.mark.parametrize("value", [
    _DatetimeState(datetime.datetime, b"\x07\xe4\x01\xff\xff\xff\xff\xff\xff\xff"),  # day, hour... 255
    _DatetimeState(datetime.datetime, b"\x07\xe4\x02\x1e\x00\x00\x00\x00\x00\x00"),  # 30 February
    _DatetimeState(datetime.date, b"\x07\xe4\x01\x00"),  # day 0
    _DatetimeState(datetime.time, b"\x18\x00\x00\x00\x00\x00"),  # hour 24
    hostile.NumpyArrayState((1,), np.dtype("<U1"), b"\xff\xff\xff\xff"),
    hostile.NumpyArrayState((2,), np.dtype(">U1"), b"\x00\x00\x00\x41\x00\x11\x00\x00"),
    hostile.NumpyScalarState(np.dtype("<U1"), b"\x00\x00\x11\x00"),
], ids=["datetime-255", "february-30", "date-day-0", "time-hour-24", "U-0xffffffff", "U-big-endian", "U-scalar"])
def test_plain_values_out_of_their_range_are_refused_as_corrupt_naming_the_file(tmp_path, value):
    # CPython's datetime unpickling checks the month only; numpy stores any 32-bit code point. Each would load as
    # a broken value (a later str() raises SystemError); both are refused when the file is read.
    path = str(tmp_path / "hostile.pth")
    torch.save(hostile.small_checkpoint(hyperparams={"value": value}), path)
    with pytest.raises(CorruptCheckpointError) as refused:
        load_checkpoint_file(path)
    message = str(refused.value)
    assert path in message and ("code point" in message or getattr(value, "kind", None).__name__ in message)


def test_plain_values_in_their_range_load_as_saved(tmp_path):
    values = {"when": datetime.datetime(2024, 2, 29, 23, 59, 59, 999999), "day": datetime.date(1, 1, 1),
              "at": datetime.time(0, 0, 0, 1), "span": datetime.timedelta(days=-5, seconds=3),
              "names": np.array(["a\U0010ffff", "\u00e9"]), "name": np.str_("\U0010ffff")}
    path = str(tmp_path / "plain.pth")
    torch.save(hostile.small_checkpoint(hyperparams=values), path)
    loaded = load_checkpoint_file(path)["hyperparams"]
    assert {key: loaded[key] for key in ("when", "day", "at", "span", "name")} == {
        key: values[key] for key in ("when", "day", "at", "span", "name")}
    assert loaded["names"].tolist() == values["names"].tolist()
    # The fold, in the month's (or hour's) top bit as protocol 4 writes it, is kept.
    torch.save({"when": _DatetimeState(datetime.datetime, b"\x07\xe8\x8b\x03\x01\x30\x00\x00\x00\x00"),
                "at": _DatetimeState(datetime.time, b"\x81\x30\x00\x00\x00\x00")}, path)
    loaded = load_torch_file(path)
    assert (loaded["when"], loaded["when"].fold) == (datetime.datetime(2024, 11, 3, 1, 48), 1)
    assert (loaded["at"], loaded["at"].fold) == (datetime.time(1, 48), 1)


_NUMERIC_DTYPES = ["b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "U3", "S5"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(_NUMERIC_DTYPES), byteorder=st.sampled_from("<>="),
       shape=st.lists(st.integers(0, 4), max_size=3), fortran=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_plain_numpy_values_load_exactly_as_saved(tmp_path, dtype, byteorder, shape, fortran, seed):
    dtype = np.dtype(dtype).newbyteorder(byteorder) if np.dtype(dtype).byteorder not in "|" else np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "U":  # code points of Unicode only (0 to 0x10FFFF): others are refused, see below
        order = np.dtype("u4").newbyteorder(dtype.byteorder)
        raw = (raw.view(order) % 0x110000).astype(order)  # the remainder comes in native order
    array = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(shape)
    array = np.asfortranarray(array) if fortran else array
    scalar = array.reshape(-1)[0] if array.size else dtype.type(0) if dtype.kind not in "US" else dtype.type("")
    values = {"array": array, "scalar": scalar, "dtype": dtype}
    path = str(tmp_path / "numpy.pth")
    torch.save(values, path)
    loaded = load_torch_file(path)
    expected = pickle.loads(pickle.dumps(values, protocol=2))  # what numpy's own unpickling gives
    assert loaded["array"].dtype == expected["array"].dtype and loaded["array"].shape == array.shape
    assert loaded["array"].tobytes() == expected["array"].tobytes() and loaded["array"].flags.writeable
    assert np.array_equal(loaded["array"], array, equal_nan=dtype.kind in "fc")
    assert type(loaded["scalar"]) is type(expected["scalar"])
    assert loaded["scalar"].tobytes() == expected["scalar"].tobytes()
    assert loaded["dtype"] == expected["dtype"]


def test_an_18_checkpoint_keeps_loading_with_numpy_1_names(tmp_path):
    """aitoolbox 1.8 wrote the hyperparameters as the user gave them: numpy float64 scalars and float32 arrays,
    pickled under numpy 1.x's module names (``numpy.core.multiarray``)."""
    from tests.experiment.local_save.test_safe_load import saved_like_18
    path = str(tmp_path / "model_exp_ts_E1.pth")
    saved_like_18(path, {"lr": np.float64(0.001), "weights": np.array([0.5, 2.0], dtype=np.float32),
                         "steps": np.arange(3), "flag": np.bool_(False), "name": np.str_("adam")})
    hyperparams = load_checkpoint_file(path)["hyperparams"]
    assert type(hyperparams["lr"]) is np.float64 and hyperparams["lr"] == 0.001
    assert hyperparams["weights"].dtype == np.float32 and hyperparams["weights"].tolist() == [0.5, 2.0]
    assert hyperparams["steps"].tolist() == [0, 1, 2] and hyperparams["flag"] == np.False_
    assert hyperparams["name"] == "adam"


# --- item 5: nothing global changes while a file loads ---------------------------------------------------------
def test_loading_changes_nothing_another_torch_load_sees(tmp_path):
    numpy_file = str(tmp_path / "numpy.pth")
    torch.save({"lr": np.float64(0.1)}, numpy_file)
    checkpoint = str(tmp_path / "checkpoint.pth")
    torch.save(hostile.small_checkpoint(hyperparams={"lr": np.float64(0.1), "sizes": np.arange(3)}), checkpoint)
    before = set(map(str, torch.serialization.get_safe_globals()))
    seen = {}

    def during_the_load(storage, location):  # torch's map_location callable: runs while the checkpoint loads
        if seen:
            return storage
        seen["safe_globals"] = set(map(str, torch.serialization.get_safe_globals()))
        try:
            torch.load(numpy_file, weights_only=True)
            seen["other_load"] = "accepted numpy"
        except pickle.UnpicklingError:
            seen["other_load"] = "refused numpy"
        torch.serialization.add_safe_globals([np.dtype])  # the user's own, added meanwhile
        return storage

    try:
        load_torch_file(checkpoint, map_location=during_the_load)
        assert seen == {"safe_globals": before, "other_load": "refused numpy"}
        assert np.dtype in torch.serialization.get_safe_globals()  # not taken away when the load ended
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals([item for item in torch.serialization.get_safe_globals()
                                              if str(item) in before])


# --- item 6: decompression bombs ------------------------------------------------------------------------------------
@pytest.mark.slow  # a process of its own
def test_a_decompression_bomb_is_refused_before_memory_is_allocated(tmp_path):
    cases = []
    honest = hostile.deflate_bomb(256 << 20)  # 256 MiB of zeros in about 256 KiB
    small = hostile.torch_file({"model_state_dict": {"w": hostile.TensorRef(numel=16, size=(16,))}},
                               {"0": bytes(64)}, deflated=["data/0"])
    lying = hostile.state_record_size(small, "archive/data/0", 1 << 30)  # states 1 GiB, holds 64 bytes
    pickle_bomb = hostile.deflated_pickle_bomb(256 << 20)
    for name, data in (("honest", honest), ("lying", lying), ("pickle", pickle_bomb)):
        for entry in ("file", "loop"):
            path = str(tmp_path / f"{name}-{entry}.pth")
            with open(path, "wb") as handle:
                handle.write(data)
            cases.append({"id": f"{name}-{entry}", "entry": entry, "path": path, "names": [path]})
    results = run_cases(cases, str(tmp_path / "work"))
    for case in cases:
        assert_safe(case, results[case["id"]])
        assert "CorruptCheckpointError" in results[case["id"]]["bases"]
    assert "checkpoint_limits" in results["honest-file"]["message"]


def test_the_bound_on_decompressed_size_is_settable(tmp_path):
    path = str(tmp_path / "compressible.pth")
    with open(path, "wb") as handle:
        handle.write(hostile.deflate_bomb(8 << 20))  # a legitimate, highly compressible file of 8 MiB
    with pytest.raises(CorruptCheckpointError, match=r"max_expansion=\d+"):
        load_torch_file(path)
    with checkpoint_limits(max_expansion=2000):
        assert load_torch_file(path)["model_state_dict"]["layer.weight"].numel() == 8 << 20
    with pytest.raises(CorruptCheckpointError):  # the setting ends with its block
        load_torch_file(path)
    with pytest.raises(ValueError, match="max_expansion must be a number >= 1, got 0"):
        with checkpoint_limits(max_expansion=0):
            pass


# --- item 7: corrupt is not untrusted, and every failure is a documented Exception naming the file -------------
_VALID = hostile.torch_bytes(hostile.small_checkpoint(hyperparams={"lr": np.float64(0.1)}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=2048),
    st.integers(0, len(_VALID) - 1).map(lambda cut: _VALID[:cut]),
    st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)).map(
        lambda flip: _VALID[:flip[0]] + bytes([flip[1]]) + _VALID[flip[0] + 1:])))
def test_a_damaged_file_is_reported_as_corrupt_naming_it(tmp_path, data):
    path = str(tmp_path / "model_exp_ts_E1.pth")
    with open(path, "wb") as handle:
        handle.write(data)
    try:
        loaded = load_checkpoint_file(path)
    except CorruptCheckpointError as error:
        assert path in str(error) and "weights_only=False" not in str(error) and error.path == path
    except UntrustedCheckpointError as error:  # a flipped byte can turn a name into another global
        assert error.refused and path in str(error)
    else:
        assert "model_state_dict" in loaded  # a byte of the weights, or of a name, changed


def test_every_damaged_byte_of_the_zip_directory_is_reported_as_corrupt(tmp_path):
    """Exhaustive over the zip's central directory and end record, where one flipped byte reaches zipfile's parser
    (a version field it does not know once raised NotImplementedError through our reader)."""
    import io
    import zipfile
    start = zipfile.ZipFile(io.BytesIO(_VALID)).start_dir
    path = str(tmp_path / "model_exp_ts_E1.pth")
    for position in range(start, len(_VALID)):
        for value in {0x00, 0xff, 0x40, _VALID[position] ^ 0x40, (_VALID[position] + 1) & 0xff} - {_VALID[position]}:
            with open(path, "wb") as handle:
                handle.write(_VALID[:position] + bytes([value]) + _VALID[position + 1:])
            try:
                load_checkpoint_file(path)
            except CorruptCheckpointError as error:
                assert error.path == path, (position, value)
            except UntrustedCheckpointError as error:
                assert error.refused and path in str(error), (position, value)


@pytest.mark.parametrize("damage", ["truncated_shards", "garbage_shards", "truncated_index", "missing_shards"])
@pytest.mark.parametrize("load", SHARDED_LOADS.values(), ids=SHARDED_LOADS.keys())
def test_a_failed_sharded_load_is_a_documented_exception_naming_the_checkpoint(tmp_path, damage, load):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    for name in hostile.distcp_files(folder) if damage != "truncated_index" else [".metadata"]:
        path = os.path.join(folder, name)
        data = open(path, "rb").read()
        if damage == "missing_shards":
            os.remove(path)
            continue
        with open(path, "wb") as handle:
            handle.write(data[:len(data) // 2] if damage.startswith("truncated") else os.urandom(len(data)))
    try:
        load(folder)
    except Exception as error:  # noqa: BLE001 - what matters is that it is one (DCP's own is a BaseException)
        assert isinstance(error, CheckpointLoadError), repr(error)
        assert folder in str(error)
    else:
        pytest.fail("a damaged sharded checkpoint loaded")
