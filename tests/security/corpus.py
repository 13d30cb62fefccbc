"""The hostile-file corpus: seeded, built at test time, fed to every loading entry point (see test_corpus.py).

:func:`file_cases` and :func:`folder_cases` return :class:`Hostile` builders: each writes one hostile checkpoint
file (or sharded checkpoint folder) at the path it is given, with the marker file a planted payload would create.
The corpus covers random bytes, truncated and damaged zips, every refused-type pickle (at each pickle protocol
torch can write), numpy dtype tricks, tensors outside their storage, decompression bombs, pickle-machine tricks
(deep nesting, DAGs, cycles, opcodes plain data never uses), entries of the wrong kind, other file types (pipes,
devices, links), and DCP folders with evil rank-local indexes, entries outside the folder, impossible lengths and
hostile markers.
"""
import dataclasses
import io
import json
import os
import pickle
import random
import shutil
from typing import Any, Callable, Dict, List

import numpy as np
import torch

from tests.security import hostile
from tests.security.hostile import NumpyArrayState, NumpyScalarState, PlantedPayload, Reduce, TensorRef


@dataclasses.dataclass
class Hostile:
    """One hostile checkpoint: ``build(path, marker)`` writes it at ``path``."""

    name: str
    build: Callable[[str, str], None]
    folder: bool = False
    may_load: bool = False  # a damaged byte may leave a loadable file (a weight changed)
    uploadable: bool = True  # a bucket can hold it (no links, pipes or devices)
    unread_by: frozenset = frozenset()  # entry points that never read the damaged part (they may load)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def _file(name: str, make: Callable[[str], bytes], **flags: Any) -> Hostile:
    return Hostile(name, lambda path, marker: _write(path, make(marker)), **flags)


def _checkpoint(**entries: Any) -> Callable[[str], bytes]:
    return lambda marker: hostile.torch_bytes(hostile.small_checkpoint(**_with_marker(entries, marker)))


def _with_marker(value: Any, marker: str) -> Any:
    """``value`` with every ``"{marker}"`` in its strings replaced by the marker's path."""
    if isinstance(value, str):
        return value.replace("{marker}", marker)
    if isinstance(value, dict):
        return {key: _with_marker(item, marker) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_with_marker(item, marker) for item in value)
    if isinstance(value, Reduce):
        return Reduce(value.func, _with_marker(value.args, marker), value.state)
    return value


def _torch_pickle(obj_for_marker: Callable[[str], Any], storages: Dict[str, bytes] = None,
                  **options: Any) -> Callable[[str], bytes]:
    return lambda marker: hostile.torch_file(obj_for_marker(marker), storages, **options)


def _raw_pickle(pickled_for_marker: Callable[[str], bytes]) -> Callable[[str], bytes]:
    """A torch zip whose data.pkl is the given bytes (a pickle written by hand)."""
    return lambda marker: hostile.make_zip({"archive/data.pkl": pickled_for_marker(marker),
                                            "archive/byteorder": b"little", "archive/version": b"3\n"})


# --- the refused globals ------------------------------------------------------------------------------------------
def _refused_globals() -> List[tuple]:
    """``(name, function, arguments)``: what an attacker's pickle calls. Running any of them creates the marker
    (or would do harm); none may be called."""
    import builtins
    import importlib
    import operator
    import functools
    import subprocess
    import runpy
    import collections
    import copyreg
    import shutil as shutil_module
    return [
        ("os.system", os.system, ("touch {marker}",)),
        ("subprocess.Popen", subprocess.Popen, (["touch", "{marker}"],)),
        ("subprocess.check_output", subprocess.check_output, (["touch", "{marker}"],)),
        ("builtins.eval", builtins.eval, ("open('{marker}', 'w')",)),
        ("builtins.exec", builtins.exec, ("open('{marker}', 'w')",)),
        ("builtins.open", builtins.open, ("{marker}", "w")),
        ("builtins.getattr", builtins.getattr, ("text", "upper")),
        ("builtins.__import__", builtins.__import__, ("os",)),
        ("builtins.compile", builtins.compile, ("1", "x", "eval")),
        ("importlib.import_module", importlib.import_module, ("os",)),
        ("runpy.run_path", runpy.run_path, ("{marker}.py",)),
        ("shutil.rmtree", shutil_module.rmtree, ("{marker}.nothing",)),
        ("os.remove", os.remove, ("{marker}.nothing",)),
        ("pickle.loads", pickle.loads, (b"N.",)),
        ("torch.load", torch.load, ("{marker}.nothing",)),
        ("numpy.load", np.load, ("{marker}.nothing",)),
        ("operator.attrgetter", operator.attrgetter, ("upper",)),
        ("functools.partial", functools.partial, (print,)),
        ("collections.defaultdict", collections.defaultdict, (list,)),
        ("copyreg._reconstructor", copyreg._reconstructor, (object, object, None)),
        ("torch.storage._load_from_bytes", torch.storage._load_from_bytes, (b"",)),
        ("torch._utils._rebuild_sparse_tensor", torch._utils._rebuild_sparse_tensor, (torch.sparse_coo, ())),
        ("torch._utils._rebuild_qtensor", torch._utils._rebuild_qtensor, ()),
        ("torch._utils._rebuild_device_tensor_from_numpy", torch._utils._rebuild_device_tensor_from_numpy, ()),
        ("torch._utils._rebuild_wrapper_subclass", torch._utils._rebuild_wrapper_subclass, ()),
        ("torch.nn.Module", torch.nn.Module, ()),
        ("numpy.frombuffer", np.frombuffer, (b"\x00" * 8,)),
        ("numpy.ma.core._mareconstruct", np.ma.core._mareconstruct, ()),
    ]


def _payload_places(reduce: Reduce) -> Dict[str, Callable[[], dict]]:
    return {"hyperparams": lambda: {"hyperparams": {"x": reduce}},
            "top": lambda: {"extra": reduce},
            "weights": lambda: {"model_state_dict": {"fc1.weight": reduce}},
            "optimizer": lambda: {"optimizer_state_dict": {"state": {}, "param_groups": [{"lr": reduce}]}}}


# --- pickle-machine tricks (hand-written pickles) -------------------------------------------------------------------
def _nested_lists(depth: int) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _dag(levels: int) -> bytes:
    """A list of two references to a list of two references to ... (2**levels paths, a few bytes each)."""
    out = io.BytesIO()
    out.write(b"\x80\x02]q\x00")  # []  memo 0
    for level in range(1, levels + 1):
        out.write(b"h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"\x86" + b"q" + bytes([level]))
    out.write(b"}q\xf0X\x10\x00\x00\x00model_state_dict}sX\x0b\x00\x00\x00hyperparamsh" + bytes([levels]) + b"s.")
    return out.getvalue()


def _colliding_keys(count: int) -> bytes:
    """A dict of ``count`` int keys that Python hashes alike (quadratic time to build with plain pickle)."""
    prime = (1 << 61) - 1
    return (b"\x80\x02}(" + b"".join(b"\x8a\x10" + (index * prime).to_bytes(16, "little", signed=True) + b"K\x00"
                                    for index in range(count)) + b"u.")


_VM_TRICKS: Dict[str, bytes] = {
    "colliding-keys": _colliding_keys(20_000),
    "set-bomb": b"\x80\x04](" + b"\x8f" * (4 << 20) + b"e.",
    "dict-bomb": b"\x80\x02](" + b"}" * (4 << 20) + b"e.",
    "self-containing-list": b"\x80\x02]q\x00h\x00a.",
    "self-containing-dict": b"\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s.",
    "dag": _dag(60),
    "deep-nesting": _nested_lists(50_000),
    "deeper-than-limit": _nested_lists(300),
    "memo-before-put": b"\x80\x02h\x07.",
    "stack-underflow": b"\x80\x02a.",
    "mark-underflow": b"\x80\x02e.",
    "extension-code": b"\x80\x02\x82\x01.",
    "next-buffer": b"\x80\x05\x97.",
    "protocol-6": b"\x80\x06N.",
    "no-stop": b"\x80\x02]",
    "build-on-list": b"\x80\x02]}b.",
    "setitem-on-list": b"\x80\x02]KaKbs.",
    "append-on-dict": b"\x80\x02}Kaa.",
    "unhashable-key": b"\x80\x02}]K\x01s.",
    "huge-binunicode": b"\x80\x02X\xff\xff\xff\x7fabc.",
    "huge-long4": b"\x80\x02\x8b\xff\xff\xff\x7f.",
    "huge-frame": b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7fN.",
    "text-long": b"L" + b"9" * 100_000 + b"\n.",
    "stack-global-not-strings": b"\x80\x04K\x01K\x02\x93.",
    "persid-text": b"Pstorage\n.",
    "persid-bad-tuple": b"\x80\x02(X\x07\x00\x00\x00storageK\x01tQ.",
    "inst-refused": b"(iposix\nsystem\n.",
    "obj-refused": b"\x80\x01(cposix\nsystem\no.",
    "global-no-newline": b"\x80\x02cposix",
    "empty": b"",
    "two-objects": b"\x80\x02NN.",
}


# --- builders -----------------------------------------------------------------------------------------------------
def file_cases(seed: int, extended: bool) -> List[Hostile]:
    """Hostile checkpoint files; the quick tier takes a representative part of each family."""
    rng = random.Random(seed)
    valid = hostile.torch_bytes(hostile.small_checkpoint(hyperparams={"lr": np.float64(0.1)}))
    cases: List[Hostile] = []

    # Random bytes, truncations and damaged bytes.
    for index in range(12 if extended else 2):
        size = rng.choice([0, 1, 30, 512, 4096])
        data = bytes(rng.getrandbits(8) for _ in range(size))
        cases.append(_file(f"random-{index}-{size}b", lambda marker, data=data: data))
    for index in range(16 if extended else 3):
        cut = rng.randrange(len(valid))
        cases.append(_file(f"truncated-{cut}", lambda marker, cut=cut: valid[:cut]))
    for index in range(16 if extended else 2):
        spot, value = rng.randrange(len(valid)), rng.getrandbits(8)
        cases.append(_file(f"flipped-{spot}-{value}", lambda marker, spot=spot, value=value:
                           valid[:spot] + bytes([value]) + valid[spot + 1:], may_load=True))
    cases.append(_file("zip-without-pickle", lambda marker: hostile.make_zip({"archive/version": b"3\n"})))
    cases.append(_file("zip-of-other-records", lambda marker: hostile.make_zip({"a.txt": b"x", "b/c": b"y"})))

    # Every refused global, in several places and at each pickle protocol torch writes.
    refused = _refused_globals()
    for index, (name, function, args) in enumerate(refused if extended else refused[:4]):
        places = _payload_places(Reduce(function, args))
        place_names = list(places) if extended else [list(places)[index % len(places)]]
        for place in place_names:
            for protocol in ([2, 4, 5] if extended and place == "hyperparams" else [2]):
                cases.append(_file(f"refused-{name}-{place}-p{protocol}",
                                   lambda marker, place=place, places=places, protocol=protocol: _saved(
                                       hostile.small_checkpoint(**_with_marker(places[place](), marker)), protocol)))

    # numpy: rebuilt from plain data only.
    numpy_tricks = {
        "object-field-array": lambda marker: hostile.object_field_array(),
        "object-array": lambda marker: NumpyArrayState((1,), np.dtype("O"), [PlantedPayload(marker)]),
        "object-scalar": lambda marker: NumpyScalarState(np.dtype("O"), PlantedPayload(marker)),
        "void-dtype": lambda marker: NumpyArrayState((1,), np.dtype("V8"), b"\x00" * 8),
        "structured-dtype": lambda marker: NumpyArrayState((1,), np.dtype([("a", "f8")]), b"\x00" * 8),
        "subarray-dtype": lambda marker: NumpyArrayState((1,), np.dtype(("f8", (2,))), b"\x00" * 16),
        "datetime-dtype": lambda marker: NumpyArrayState((1,), np.dtype("M8[s]"), b"\x00" * 8),
        "short-data": lambda marker: NumpyArrayState((4,), np.dtype("f8"), b"\x00" * 8),
        "huge-shape": lambda marker: NumpyArrayState((1 << 40,), np.dtype("f8"), b"\x00" * 8),
        "negative-shape": lambda marker: NumpyArrayState((-3,), np.dtype("f8"), b""),
        "object-flags": lambda marker: NumpyScalarState(
            hostile._StatefulDtype("f8", (3, "<", None, None, None, -1, -1, 63)), b"\x00" * 8),
        "field-state": lambda marker: NumpyScalarState(
            hostile._StatefulDtype("f8", (3, "<", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0)), b"\x00" * 8),
        "subclass": lambda marker: Reduce(hostile._multiarray()._reconstruct, (np.ma.MaskedArray, (0,), b"b")),
        "scalar-wrong-size": lambda marker: NumpyScalarState(np.dtype("f8"), b"\x00" * 3),
    }
    for index, (name, value) in enumerate(numpy_tricks.items()):
        if extended or index % 4 == 0:
            for key in (["hyperparams", "early_stop"] if extended else ["early_stop"]):
                cases.append(_file(f"numpy-{name}-in-{key}", lambda marker, value=value, key=key: hostile.torch_bytes(
                    hostile.small_checkpoint(**{key: {"v": value(marker)} if key == "hyperparams"
                                                else value(marker)}))))

    # Tensors over their storage.
    def tensor_file(ref: TensorRef, storage: bytes = bytes(16), record: str = None,
                    **options: Any) -> Callable[[str], bytes]:
        return _torch_pickle(lambda marker: {"model_state_dict": {"fc1.weight": ref}},
                             {record or ref.storage.key: storage}, **options)
    tensor_tricks = {
        "offset-beyond": tensor_file(TensorRef(offset=10)),
        "size-beyond": tensor_file(TensorRef(size=(5,))),
        "stride-beyond": tensor_file(TensorRef(size=(2,), stride=(4,))),
        "negative-stride": tensor_file(TensorRef(size=(2,), stride=(-1,))),
        "negative-offset": tensor_file(TensorRef(offset=-1)),
        "expanded-view": tensor_file(TensorRef(size=(1 << 40,), stride=(0,))),
        "numel-not-record": tensor_file(TensorRef(numel=1 << 30)),
        "record-missing": tensor_file(TensorRef(key="7"), record="0"),
        "key-climbing": tensor_file(TensorRef(key="../../x")),
        "location-unknown": tensor_file(TensorRef(location="evil_device")),
        "location-text": tensor_file(TensorRef(location="cpu; rm -rf /")),
        "hooks": tensor_file(TensorRef(hooks={0: Reduce(os.system, ("touch {marker}",))})),
        "size-and-stride-lengths": tensor_file(TensorRef(size=(2, 2), stride=(1,))),
        "byteorder-garbage": tensor_file(TensorRef(), byteorder=b"middle"),
        "storage-type-refused": tensor_file(TensorRef(storage_type=torch.nn.Module)),
    }
    for index, (name, make) in enumerate(tensor_tricks.items()):
        if extended or index % 3 == 0:  # an unknown device saved is harmless where the tensors are placed elsewhere
            cases.append(_file(f"tensor-{name}", make, may_load=name == "location-unknown"))

    # Decompression bombs (the honest one costs about a second to write: the extended tier only).
    small = hostile.torch_file({"model_state_dict": {"fc1.weight": TensorRef(numel=4, size=(4,))}},
                               {"0": bytes(16)}, deflated=["data/0"])
    cases.append(_file("bomb-lying-size", lambda marker: hostile.state_record_size(small, "archive/data/0", 1 << 30)))
    if extended:
        cases.append(_file("bomb-honest", lambda marker: hostile.deflate_bomb(128 << 20)))
        cases.append(_file("bomb-pickle", lambda marker: hostile.deflated_pickle_bomb(128 << 20)))
        cases.append(_file("bomb-stated-4gib", lambda marker: hostile.state_record_size(
            small, "archive/data/0", (1 << 32) - 1)))

    # The pickle machine.
    for index, (name, pickled) in enumerate(_VM_TRICKS.items()):
        if extended or index % 5 == 0:
            cases.append(_file(f"pickle-{name}", _raw_pickle(lambda marker, pickled=pickled: pickled)))

    # Entries of the wrong kind, and files that are not torch checkpoints.
    wrong_entries = {"model-not-dict": {"model_state_dict": 5}, "model-values": {"model_state_dict": {"w": "x"}},
                     "optimizer-int": {"optimizer_state_dict": 3}, "epoch-text": {"epoch": "one"},
                     "early-stop-array": {"early_stop": np.array([True, False])},
                     "history-list": {"train_history": [1, 2]}, "rng-dict": {"rng": {"python": 1}},
                     "param-groups-dict": {"optimizer_state_dict": {"state": {}, "param_groups": {"a": 1}}}}
    for index, (name, entries) in enumerate(wrong_entries.items()):
        if extended or index % 3 == 0:
            cases.append(_file(f"entry-{name}", _checkpoint(**entries)))
    cases.append(_file("top-level-list", lambda marker: hostile.torch_bytes([1, 2, 3])))
    if extended:
        cases.append(_file("torchscript", lambda marker: _torchscript()))
        cases.append(_file("legacy-format", lambda marker: _legacy()))
        cases.append(_file("plain-pickle", lambda marker: pickle.dumps(PlantedPayload(marker))))

    # Other kinds of file under a checkpoint's name.
    cases.append(Hostile("named-pipe", lambda path, marker: _make(path, os.mkfifo), uploadable=False))
    if extended:
        cases.append(Hostile("link-to-dev-zero", lambda path, marker: _make(path, lambda p: os.symlink("/dev/zero", p)),
                             uploadable=False))
        cases.append(Hostile("link-to-outside-checkpoint", _link_outside, uploadable=False))
    return cases


def _saved(obj: Any, protocol: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=protocol)
    return buffer.getvalue()


def _make(path: str, create: Callable[[str], None]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    create(path)


def _link_outside(path: str, marker: str) -> None:
    """A link named as the newest checkpoint, to another run's checkpoint outside the folder."""
    outside = os.path.join(os.path.dirname(marker), "outside", os.path.basename(path))
    _write(outside, hostile.torch_bytes(hostile.small_checkpoint()))
    _make(path, lambda p: os.symlink(outside, p))


def _torchscript() -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    return buffer.getvalue()


def _legacy() -> bytes:
    buffer = io.BytesIO()
    torch.save(hostile.small_checkpoint(), buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


# --- sharded checkpoint folders -----------------------------------------------------------------------------------
def folder_cases(seed: int, extended: bool, template: str) -> List[Hostile]:
    """Hostile sharded checkpoint folders, each a changed copy of the valid checkpoint ``template``."""
    rng = random.Random(seed)
    cases: List[Hostile] = []

    def folder(name: str, change: Callable[[str, str], None], **flags: Any) -> None:
        def build(path: str, marker: str) -> None:
            shutil.copytree(template, path)
            change(path, marker)
        cases.append(Hostile(name, build, folder=True, **flags))

    def write(name: str, content: Callable[[str], bytes]) -> Callable[[str, str], None]:
        return lambda path, marker: _write(os.path.join(path, name), content(marker))

    def index_entries(**fields: Any) -> Callable[[str, str], None]:
        return lambda path, marker: hostile.rewrite_metadata(path, lambda metadata: [
            hostile.set_storage_entry(metadata, index, **_with_marker(fields, path))
            for index, _ in hostile.storage_entries(metadata)] and None)

    # The index: planted, unusable beside an evil rank-local one, or not DCP's.
    payload = lambda marker: pickle.dumps(PlantedPayload(marker))  # noqa: E731
    folder("index-planted", write(".metadata", payload))
    for name, value in ({"int": 0, "none": None, "list": [], "text": "x"} if extended else {"int": 0}).items():
        folder(f"index-{name}-with-rank-local", lambda path, marker, value=value: (
            _write(os.path.join(path, ".metadata"), pickle.dumps(value)),
            _write(os.path.join(path, "__0.metadata"), payload(marker)),
            _write(os.path.join(path, "__1.metadata"), payload(marker))))
    folder("index-random", write(".metadata", lambda marker: bytes(rng.getrandbits(8) for _ in range(64))))
    if extended:
        folder("index-truncated", lambda path, marker: _truncate(os.path.join(path, ".metadata")))
        folder("index-planner-data-planted", lambda path, marker: hostile.rewrite_metadata(
            path, lambda metadata: setattr(metadata, "planner_data", PlantedPayload(marker))))
        folder("index-protocol-0-planted", write(".metadata", lambda marker: pickle.dumps(PlantedPayload(marker), 0)))
        folder("index-sizes-huge", lambda path, marker: hostile.rewrite_metadata(path, _huge_sizes))
        folder("index-chunk-outside", lambda path, marker: hostile.rewrite_metadata(path, _chunk_outside))

    # Storage entries outside the folder or beyond their file.
    folder("entry-absolute", lambda path, marker: index_entries(relative_path=os.path.join(
        _other_checkpoint(path, template), "__0_0.distcp"))(path, marker))
    folder("entry-dev-zero", index_entries(relative_path="/dev/zero", offset=0, length=16 << 30))
    folder("entry-length-beyond", index_entries(length=1 << 40))
    if extended:
        folder("entry-climbing", index_entries(relative_path="../../../x.distcp"))
        folder("entry-subfolder", index_entries(relative_path="sub/__0_0.distcp"))
        folder("entry-negative-offset", index_entries(offset=-100))
        folder("entry-transform", index_entries(transform_descriptors=["zstd"]))
        folder("entry-symlink-outside", _distcp_linked_outside(template), uploadable=False)
        folder("entry-named-pipe", lambda path, marker: _replace_with(path, "__0_0.distcp", os.mkfifo),
               uploadable=False)
        folder("entry-missing", lambda path, marker: os.remove(os.path.join(path, "__0_0.distcp")))

    # The shards' content.
    folder("shards-random", lambda path, marker: _scramble(path, rng))
    folder("shards-truncated", lambda path, marker: _truncate(os.path.join(path, "__0_0.distcp")))
    weights_only_readers = frozenset({"consolidate", "loader", "loader_parts", "bucket_load_model", "bucket_newest"})
    if extended:
        folder("shards-bomb", write("__0_0.distcp", lambda marker: hostile.deflate_bomb(64 << 20)))
        # In the optimizer's entries: what reads only the model's weights never reads it.
        folder("shards-planted-entry", lambda path, marker: _planted_entry(path, marker),
               unread_by=weights_only_readers)

    # The training state beside them (read_full_model_state_dict reads only weights), and the completion marker.
    state_unread = frozenset({"consolidate"})
    folder("extra-state-planted", unread_by=state_unread, change=write("extra_rank0.pt", lambda marker: (
        hostile.torch_bytes({**hostile.sharded_extra_state(), "hyperparams": {"x": PlantedPayload(marker)}}))))
    folder("marker-world-size-0", lambda path, marker: _marker(path, world_size=0))
    if extended:
        folder("extra-state-object-field", unread_by=state_unread, change=write("extra_rank0.pt", lambda marker: (
            hostile.torch_bytes({**hostile.sharded_extra_state(), "early_stop": hostile.object_field_array()}))))
        folder("extra-state-list", unread_by=state_unread,
               change=write("extra_rank0.pt", lambda marker: hostile.torch_bytes([1])))
        folder("extra-state-missing", unread_by=state_unread,
               change=lambda path, marker: os.remove(os.path.join(path, "extra_rank0.pt")))
        folder("extra-state-link", unread_by=state_unread, uploadable=False, change=lambda path, marker: _replace_with(
            path, "extra_rank0.pt", lambda p: os.symlink("/dev/zero", p)))
        for name, fields in {"world-size-negative": {"world_size": -1}, "world-size-text": {"world_size": "2"},
                             "optimizers-huge": {"num_optimizers": 1 << 40},
                             "stateless-outside": {"stateless_optimizers": [7]},
                             "version-future": {"version": 99}, "format-other": {"format": "x"}}.items():
            folder(f"marker-{name}", lambda path, marker, fields=fields: _marker(path, **fields))
        folder("marker-deep-json", write("checkpoint.json", lambda marker: b"[" * 100_000 + b"]" * 100_000))
        folder("marker-not-json", write("checkpoint.json", lambda marker: b"\xff\xfe not json"))
        folder("marker-huge", write("checkpoint.json", lambda marker: b" " * (3 << 20) + b"{}"))
    return cases


def _truncate(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


def _scramble(path: str, rng: random.Random) -> None:
    for name in hostile.distcp_files(path):
        size = os.path.getsize(os.path.join(path, name))
        _write(os.path.join(path, name), bytes(rng.getrandbits(8) for _ in range(size)))


def _replace_with(path: str, name: str, create: Callable[[str], None]) -> None:
    os.remove(os.path.join(path, name))
    create(os.path.join(path, name))


def _other_checkpoint(path: str, template: str) -> str:
    """Another run's checkpoint (the template's copy beside the case's folder), whose weights must not load."""
    other = os.path.join(os.path.dirname(os.path.dirname(path)), "other_run", os.path.basename(path))
    if not os.path.exists(other):
        shutil.copytree(template, other)
    return other


def _distcp_linked_outside(template: str) -> Callable[[str, str], None]:
    return lambda path, marker: _replace_with(
        path, "__0_0.distcp", lambda p: os.symlink(os.path.join(_other_checkpoint(path, template), "__0_0.distcp"), p))


def _huge_sizes(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
    for name, item in list(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            huge = torch.Size([1 << 20, 1 << 20])
            info = metadata.storage_data.pop(MetadataIndex(name, item.chunks[0].offsets))
            metadata.state_dict_metadata[name] = TensorStorageMetadata(item.properties, huge,
                                                                       [ChunkStorageMetadata(torch.Size([0, 0]), huge)])
            metadata.storage_data[MetadataIndex(name, torch.Size([0, 0]))] = info


def _chunk_outside(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata) and item.chunks:
            item.chunks[0].sizes = torch.Size([size + 5 for size in item.chunks[0].sizes])


def _planted_entry(path: str, marker: str) -> None:
    """A non-tensor entry of the shards replaced by a planted pickle of the same length."""
    def change(metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        for index, info in hostile.storage_entries(metadata):
            item = metadata.state_dict_metadata.get(index.fqn)
            if isinstance(item, BytesStorageMetadata) or item is None:
                data = hostile.torch_bytes(PlantedPayload(marker))
                with open(os.path.join(path, info.relative_path), "ab") as handle:
                    offset = handle.tell()
                    handle.write(data)
                hostile.set_storage_entry(metadata, index, offset=offset, length=len(data))
    hostile.rewrite_metadata(path, change)


def _marker(path: str, **fields: Any) -> None:
    with open(os.path.join(path, "checkpoint.json")) as handle:
        info = json.load(handle)
    info.update(fields)
    with open(os.path.join(path, "checkpoint.json"), "w") as handle:
        json.dump(info, handle)

