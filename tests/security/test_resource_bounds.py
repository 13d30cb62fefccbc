"""Issue 31, items 4-7 as a reviewer found them again: bounds on what a hostile file may cost in all, not only per
tensor, per record or per opcode.

Each refusal happens before the memory it would cost is allocated, so these run in the test process.
"""
import io
import os

import numpy as np
import pytest
import torch

from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError, checkpoint_limits, load_torch_file
from aitoolbox.experiment.local_save.sharded_checkpoints import read_full_model_state_dict
from tests.security import hostile

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


# --- 1: the tensors of a file are bounded in all ------------------------------------------------------------------
def _save(tmp_path, obj, name="file.pth"):
    path = str(tmp_path / name)
    torch.save(obj, path)
    return path


def test_many_views_of_one_storage_are_refused_in_all(tmp_path):
    base = torch.zeros(1 << 19, dtype=torch.float16)  # 1 MiB stored
    views = {f"v{i}": base.expand(100, 1 << 19) for i in range(12)}  # 100 MiB each, 1.2 GiB in all
    path = _save(tmp_path, {"model_state_dict": views})
    with pytest.raises(CorruptCheckpointError, match=r"max_tensor_bytes=1073741824.*checkpoint_limits") as error:
        load_torch_file(path)
    assert path in str(error.value)
    with checkpoint_limits(max_tensor_bytes=2 << 30):  # a file the user trusts
        assert load_torch_file(path)["model_state_dict"]["v11"].shape == (100, 1 << 19)


def test_an_expanded_buffer_of_a_small_storage_loads(tmp_path):
    mask = torch.ones(1).expand(512, 512)  # a constant buffer, as some models keep one
    path = _save(tmp_path, {"model_state_dict": {"mask": mask, "w": torch.randn(3)}})
    loaded = load_torch_file(path)["model_state_dict"]["mask"]
    assert torch.equal(loaded, mask) and loaded.stride() == (0, 0)


def test_the_bound_on_tensor_bytes_is_checked_when_set():
    with pytest.raises(ValueError, match="max_tensor_bytes must be an int >= 0, got -1"):
        with checkpoint_limits(max_tensor_bytes=-1):
            pass


def test_dcp_entries_sharing_bytes_count_them_once(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata)

    folder = str(tmp_path / "model_exp_2024-01-01_00-00-00_E1")
    hostile.sharded_checkpoint(folder)
    buffer = io.BytesIO()
    torch.save(torch.zeros(1 << 19, dtype=torch.float16).expand(100, 1 << 19), buffer)  # 1 MiB on disk
    with open(os.path.join(folder, "evil.distcp"), "wb") as handle:
        handle.write(buffer.getvalue())
    size = torch.Size((100, 1 << 19))

    def change(metadata):
        for i in range(12):  # 100 MiB each from the same bytes
            fqn = f"model.evil{i}"
            metadata.state_dict_metadata[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch.float16), size, [ChunkStorageMetadata(torch.Size((0, 0)), size)])
            metadata.storage_data[MetadataIndex(fqn, torch.Size((0, 0)))] = _StorageInfo(
                "evil.distcp", i % 3, len(buffer.getvalue()) - 3)  # overlapping ranges count once too

    hostile.rewrite_metadata(folder, change)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata.*max_tensor_bytes=1073741824"):
        read_full_model_state_dict(folder)


def test_covered_counts_overlapping_ranges_once():
    from aitoolbox.experiment.local_save.dcp_index import _covered

    assert _covered([(0, 10), (0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert _covered([]) == 0


# --- 2: a sharded checkpoint's index and entries are bounded before they are read -------------------------------
def test_a_sparse_index_is_refused_before_it_is_read(tmp_path):
    from aitoolbox.experiment.local_save.checkpoints import load_checkpoint_file

    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    os.truncate(os.path.join(folder, ".metadata"), 300 << 20)  # free to create: no disk is used
    for load in (load_checkpoint_file, read_full_model_state_dict):
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata.*max_index_bytes=268435456.*checkpoint_limits"):
            load(folder)


def test_a_storage_entry_over_a_sparse_file_is_refused_before_it_is_read(tmp_path):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    name = hostile.distcp_files(folder)[0]
    os.truncate(os.path.join(folder, name), 3 << 30)  # sparse: 3 GiB stated, nothing on disk

    def change(metadata):
        index = next(index for index, info in hostile.storage_entries(metadata) if info.relative_path == name)
        hostile.set_storage_entry(metadata, index, length=(3 << 30) - 8)

    hostile.rewrite_metadata(folder, change)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata.*more than the \d+ it can need"):
        read_full_model_state_dict(folder)


def test_the_bound_on_the_index_is_settable(tmp_path):
    folder = hostile.sharded_checkpoint(str(tmp_path / "model_exp_ts_E1"))
    with checkpoint_limits(max_index_bytes=64):
        with pytest.raises(CorruptCheckpointError, match="max_index_bytes=64"):
            read_full_model_state_dict(folder)
    assert read_full_model_state_dict(folder)
    with pytest.raises(ValueError, match="max_index_bytes must be an int >= 1, got 0"):
        with checkpoint_limits(max_index_bytes=0):
            pass


# --- 3: what a pickle memoizes, and how far a compressed pickle expands, are bounded -----------------------------
def _memoizing_pickle(count):
    return b"\x80\x04N" + b"\x94" * count + b"."  # each MEMOIZE: one byte of pickle, a memo entry of ~100 bytes


def _write_zip(tmp_path, pickled, deflate_in_pieces=False):
    """A torch-like zip of ``pickled``: stored, or deflated with full flushes every 900 bytes, which keep the ratio
    near 90, under the records' bound (max_expansion=100)."""
    import zipfile
    import zlib

    compressed = b""
    if deflate_in_pieces:
        compressor, pieces = zlib.compressobj(9, zlib.DEFLATED, -15), []
        for start in range(0, len(pickled), 900):
            pieces += [compressor.compress(pickled[start:start + 900]), compressor.flush(zlib.Z_FULL_FLUSH)]
        compressed = b"".join(pieces) + compressor.flush()

    class Precompressed:  # hands zipfile the bytes made above instead of compressing them itself
        def compress(self, data):
            return b""

        def flush(self):
            return compressed

    path, original = str(tmp_path / "memo.pth"), zipfile._get_compressor
    try:
        zipfile._get_compressor = lambda kind, *args, **kwargs: (
            Precompressed() if kind == zipfile.ZIP_DEFLATED else original(kind, *args, **kwargs))
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("archive/byteorder", b"little")
            archive.writestr("archive/version", b"3\n")
            archive.writestr("archive/data.pkl", pickled,
                             compress_type=zipfile.ZIP_DEFLATED if deflate_in_pieces else zipfile.ZIP_STORED)
    finally:
        zipfile._get_compressor = original
    return path


def test_a_memo_bomb_is_refused(tmp_path):
    path = _write_zip(tmp_path, _memoizing_pickle(1_500_000))  # 1.5 MiB stored: about 150 MiB of memo unbounded
    with pytest.raises(CorruptCheckpointError, match="memoizes more objects than 1375001"):
        load_torch_file(path)


def test_a_compressed_pickle_expanding_far_is_refused_before_it_is_run(tmp_path):
    path = _write_zip(tmp_path, _memoizing_pickle(2_000_000), deflate_in_pieces=True)
    with pytest.raises(CorruptCheckpointError, match=r"data\.pkl.*max_expansion/10=10 .*checkpoint_limits") as error:
        load_torch_file(path)
    assert path in str(error.value)


# --- 4: keys whose hash the file chooses ----------------------------------------------------------------------------
_COLLIDING = [3.0 * 2 ** (61 * t) for t in range(17)]  # all hash to 3: floats are hashed modulo 2**61 - 1


@pytest.mark.parametrize("keys", [
    _COLLIDING * 1 + [(a, b) for a in _COLLIDING for b in _COLLIDING],  # pairs of them share one hash too
    [frozenset([a, 1.5]) for a in _COLLIDING] * 3 + [(a, b) for a in _COLLIDING for b in _COLLIDING[:3]],
], ids=["floats-and-pairs", "frozensets-and-pairs"])
def test_dict_keys_sharing_a_hash_are_refused(tmp_path, keys):
    path = _save(tmp_path, {"model_state_dict": {}, "hyperparams": {key: 0 for key in keys}})
    with pytest.raises(CorruptCheckpointError, match="more than 32 distinct dict or set keys share one hash"):
        load_torch_file(path)
    path = _save(tmp_path, {"model_state_dict": {}, "hyperparams": {"sets": [set(keys)]}}, "set.pth")
    with pytest.raises(CorruptCheckpointError, match="share one hash"):
        load_torch_file(path)


def test_float_and_tuple_keys_of_a_real_file_load(tmp_path):
    grid = {lr: {(beta, 0.999): lr * beta for beta in (0.8, 0.9, 0.95)} for lr in (1e-4, 3e-4, 1e-3, 0.1)}
    repeated = [{0.5: i, (1, 2.0): i} for i in range(100)]  # the same keys in many dicts: one key each
    path = _save(tmp_path, {"model_state_dict": {}, "hyperparams": {"grid": grid, "repeated": repeated}})
    assert load_torch_file(path)["hyperparams"] == {"grid": grid, "repeated": repeated}


# --- 5: protocol 5's numpy arrays, and a refusal names only what the file asks for -------------------------------
@pytest.mark.parametrize("array", [
    np.arange(6.0).reshape(2, 3), np.arange(6, dtype=">i4").reshape(2, 3).T, np.array(["ab", "c"]),
    np.zeros((0, 3), dtype=np.float32), np.asfortranarray(np.arange(12).reshape(3, 4))[:, ::2],
], ids=["float", "transposed-big-endian", "text", "empty", "strided"])
def test_numpy_arrays_of_protocol_5_load_as_saved(tmp_path, array):
    path = str(tmp_path / "p5.pth")
    torch.save(hostile.small_checkpoint(hyperparams={"array": array}), path, pickle_protocol=5)
    loaded = load_torch_file(path)["hyperparams"]["array"]
    assert loaded.dtype == array.dtype and np.array_equal(loaded, array) and loaded.flags.writeable


@pytest.mark.parametrize("value", [np.arange(3.0), np.array([object()], dtype=object)], ids=["lying", "objects"])
def test_a_protocol_5_array_is_checked_as_protocol_2_ones_are(tmp_path, value):
    import pickle

    path = str(tmp_path / "p5.pth")
    torch.save(hostile.small_checkpoint(hyperparams={"array": value}), path, pickle_protocol=5)
    if value.dtype != object:  # a buffer of other than the bytes its shape needs
        records = hostile.zip_records(open(path, "rb").read())
        name = next(name for name in records if name.endswith("data.pkl"))
        records[name] = records[name].replace(b"K\x03\x85", b"K\x04\x85")  # shape (3,) -> (4,)
        with open(path, "wb") as handle:
            handle.write(hostile.make_zip(records))
    with pytest.raises((CorruptCheckpointError, pickle.UnpicklingError)):
        load_torch_file(path)


class _Planted:
    def __reduce__(self):
        return os.system, ("true",)


def test_a_refusal_names_only_the_globals_the_file_asks_for(tmp_path):
    from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError

    # Strings the pickle memoizes (dict keys) and names the global with again: a guess pairing the last two strings
    # seen names globals the file never asks for.
    checkpoint = hostile.small_checkpoint(hyperparams={os.system.__module__: 1, "system": 2, "when": _Planted(),
                                                       "later": _Planted()})
    path = str(tmp_path / "planted.pth")
    torch.save(checkpoint, path, pickle_protocol=4)
    with pytest.raises(UntrustedCheckpointError) as refused:
        load_torch_file(path)
    assert refused.value.refused == [f"{os.system.__module__}.system"]
