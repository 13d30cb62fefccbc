"""Atomic writes and checked loads: a reader sees the old file or the new one, never a partial one.

The write failures are real: a path whose parent is a regular file (NotADirectoryError; the tests run as root,
so permissions would not stop a write), and a child process whose file size limit (RLIMIT_FSIZE, with SIGXFSZ
ignored) makes a write fail with EFBIG as a full disk would. The kill test SIGKILLs a writing process.
"""
import errno
import io
import os
import resource
import signal
import threading

import pytest
import torch

from aitoolbox.experiment.local_save import atomic
from aitoolbox.experiment.local_save.atomic import (
    TEMP_PREFIX, atomic_write, atomic_write_bytes, atomic_write_text, torch_load_checked, torch_save_atomic)
from tests.experiment.local_save.crash_support import kill_at_random_moments, run_forked


def temp_files(folder) -> list:
    return [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)]


def test_writes_and_replaces_whole_files(tmp_path):
    path = tmp_path / "notes.txt"
    atomic_write_text(str(path), "first")
    atomic_write_text(str(path), "second")
    assert path.read_text() == "second"
    atomic_write_bytes(str(path), b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    with atomic_write(str(path), "w") as handle:
        handle.write("third")
        assert path.read_bytes() == b"\x00\x01"  # nothing visible before the write completes
    assert path.read_text() == "third"
    assert temp_files(tmp_path) == []


def test_an_error_while_writing_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    path = tmp_path / "state.txt"
    atomic_write_text(str(path), "complete")
    with pytest.raises(KeyError):
        with atomic_write(str(path), "w") as handle:
            handle.write("half of a new ver")
            raise KeyError("the serialiser failed")
    assert path.read_text() == "complete"
    assert temp_files(tmp_path) == []


def test_an_unsaveable_object_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "model.pth"
    torch_save_atomic({"w": torch.ones(3)}, str(path))
    with pytest.raises(Exception):
        torch_save_atomic({"w": torch.zeros(3), "f": lambda: None}, str(path))  # lambdas cannot be pickled
    assert torch.equal(torch_load_checked(str(path))["w"], torch.ones(3))
    assert temp_files(tmp_path) == []


def test_an_abandoned_save_keeps_the_old_checkpoint_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "model.pth"
    torch_save_atomic({"w": torch.ones(3)}, str(path))
    abandon = threading.Event()
    torch_save_atomic({"w": torch.full((3,), 2.0)}, str(path), abandon=abandon)  # not set: saved
    abandon.set()
    with pytest.raises(InterruptedError, match=f"cannot write {path}: the write was abandoned"):
        torch_save_atomic({"w": torch.zeros(3)}, str(path), abandon=abandon)
    assert torch.equal(torch_load_checked(str(path))["w"], torch.full((3,), 2.0))
    assert temp_files(tmp_path) == []


def test_invalid_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'a'"):
        with atomic_write(str(tmp_path / "x"), "a"):
            pass


def test_a_parent_that_is_a_file_gives_not_a_directory_naming_the_target(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where a folder should be")
    target = blocker / "model.pth"
    with pytest.raises(NotADirectoryError, match=str(target)):
        torch_save_atomic({"w": torch.ones(2)}, str(target))
    with pytest.raises(FileNotFoundError, match="missing"):
        atomic_write_text(str(tmp_path / "missing" / "x.txt"), "text")
    assert blocker.read_text() == "a regular file where a folder should be"


def test_save_and_load_round_trip_with_weights_only(tmp_path):
    state = {"model": {"w": torch.randn(4, 3)}, "epoch": 2, "history": {"loss": [0.5, 0.25]}, "name": "run"}
    path = str(tmp_path / "checkpoint.pth")
    torch_save_atomic(state, path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch_load_checked(path)["history"] == state["history"]


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "text"])
def test_damaged_checkpoints_give_a_runtime_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "model_E3.pth"
    torch_save_atomic({"w": torch.randn(64, 64)}, str(path))
    content = path.read_bytes()
    path.write_bytes({"truncated": content[: len(content) // 2], "empty": b"",
                      "garbage": bytes(range(256)) * 8, "text": b"not a checkpoint\n"}[damage])
    with pytest.raises(RuntimeError, match=f"cannot read checkpoint {path}"):
        torch_load_checked(str(path))


def test_objects_weights_only_refuses_give_a_runtime_error_naming_the_file(tmp_path):
    path = tmp_path / "pickled.pth"
    torch.save({"obj": ValueError("not a tensor")}, str(path))
    with pytest.raises(RuntimeError, match=f"{path}.*weights_only"):
        torch_load_checked(str(path))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.pth"):
        torch_load_checked(str(tmp_path / "nothing.pth"))


def _write_past_the_file_size_limit(folder: str) -> dict:
    """In a child: an 8 KB file size limit, then a 64 KB checkpoint over a small one (EFBIG, like a full disk)."""
    path = os.path.join(folder, "model.pth")
    torch_save_atomic({"w": torch.ones(10)}, path)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    errors = {}
    for name, write in (("torch_save_atomic", lambda: torch_save_atomic({"w": torch.zeros(16 * 1024)}, path)),
                        ("atomic_write_bytes", lambda: atomic_write_bytes(path, b"x" * 64 * 1024))):
        try:
            write()
        except OSError as error:
            errors[name] = (error.errno, str(error))
    return {"errors": errors, "files": sorted(os.listdir(folder)),
            "kept": torch_load_checked(path)["w"].tolist()}


def test_a_failed_write_past_the_file_size_limit_names_the_file_and_keeps_the_old_one(tmp_path):
    result = run_forked(_write_past_the_file_size_limit, str(tmp_path))
    path = str(tmp_path / "model.pth")
    assert set(result["errors"]) == {"torch_save_atomic", "atomic_write_bytes"}
    for error_number, message in result["errors"].values():
        # torch.save alone reports "unexpected pos ..."; the real cause and the file are what users need.
        assert error_number == errno.EFBIG
        assert path in message and "File too large" in message
    assert result["files"] == ["model.pth"]  # no temporary file left behind
    assert result["kept"] == [1.0] * 10


def test_a_save_flushed_to_disk_in_the_background_is_the_file_torch_save_writes(tmp_path, monkeypatch):
    """With a 64 KB write-behind stretch, a 2 MB checkpoint is flushed in the background some 30 times while
    torch.save writes it; the file must be byte for byte what torch.save alone writes, and no thread is left."""
    monkeypatch.setattr(atomic, "WRITE_BEHIND_BYTES", 64 * 1024)
    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(512, 512, generator=generator), "b": torch.randn(512, generator=generator),
             "step": 7}
    torch_save_atomic(state, str(tmp_path / "ours.pth"))
    assert [thread.name for thread in threading.enumerate() if thread.name == "aitoolbox-write-behind"] == []
    in_memory = io.BytesIO()  # a file object, like ours: the records are named archive/... in both
    torch.save(state, in_memory)
    assert (tmp_path / "ours.pth").read_bytes() == in_memory.getvalue()
    loaded = torch_load_checked(str(tmp_path / "ours.pth"))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 7
    assert temp_files(tmp_path) == []


def _write_behind_past_the_file_size_limit(folder: str) -> dict:
    """In a child: a 256 KB file size limit, then a 1 MB checkpoint written in 16 KB stretches."""
    atomic.WRITE_BEHIND_BYTES = 16 * 1024  # the forked child's own copy of the module
    path = os.path.join(folder, "model.pth")
    torch_save_atomic({"w": torch.ones(10)}, path)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        torch_save_atomic({"w": torch.zeros(256 * 1024)}, path)
        error = None
    except OSError as raised:
        error = (raised.errno, str(raised))
    return {"error": error, "files": sorted(os.listdir(folder)), "kept": torch_load_checked(path)["w"].tolist(),
            "threads_left": [thread.name for thread in threading.enumerate()
                             if thread.name == "aitoolbox-write-behind"]}


def test_a_failed_write_with_background_flushes_running_names_the_file_and_keeps_the_old_one(tmp_path):
    result = run_forked(_write_behind_past_the_file_size_limit, str(tmp_path))
    error_number, message = result["error"]
    assert error_number == errno.EFBIG
    assert str(tmp_path / "model.pth") in message and "File too large" in message
    assert result["files"] == ["model.pth"]
    assert result["kept"] == [1.0] * 10
    assert result["threads_left"] == []


def _save_forever(path: str, first_save_marker: str) -> None:
    """Write ~2 MB checkpoints whose every element equals the step number, until killed; create
    ``first_save_marker`` once the first one is complete."""
    step = 0
    while True:
        step += 1
        torch_save_atomic({"step": step, "w": torch.full((512, 1024), float(step))}, path)
        if step == 1:
            open(first_save_marker, "w").close()


@pytest.mark.slow
def test_a_writer_killed_at_random_moments_never_leaves_a_partial_file(tmp_path):
    folder = tmp_path / "checkpoints"
    markers = tmp_path / "markers"
    folder.mkdir()
    markers.mkdir()
    path = str(folder / "model.pth")
    seen = []

    def check(run: int) -> None:
        checkpoint = torch_load_checked(path)
        assert checkpoint["w"].shape == (512, 1024)
        assert torch.equal(checkpoint["w"], torch.full((512, 1024), float(checkpoint["step"])))
        seen.append(checkpoint["step"])

    kill_at_random_moments(_save_forever, lambda run: (path, str(markers / f"run{run}")), check,
                           ready=lambda run: (markers / f"run{run}").exists(), kills=10)
    assert len(seen) == 10
    # A kill mid-write leaves at most temporary files; they never replace or hide the complete checkpoint.
    assert set(os.listdir(folder)) - {"model.pth"} == set(temp_files(folder))
