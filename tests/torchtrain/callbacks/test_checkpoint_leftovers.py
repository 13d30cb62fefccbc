"""The temporary file of a checkpoint save killed with SIGKILL midway (full size: what was written so far) is
removed by the next checkpoint the run saves; one a live process is still writing is kept."""
import multiprocessing
import os
import time

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, torch_save_atomic
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.torchtrain.callbacks.test_model_save import folder_arguments, loop_arguments, only_run_folder
from tests.killed_writes import BlockWhenPickled


def _write_until_blocked(path: str, started: str) -> None:
    torch_save_atomic({"weights": list(range(100_000)), "blocks": BlockWhenPickled(started)}, path)


def _temporaries(folder: str) -> list:
    return sorted(name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX))


def test_the_next_checkpoint_removes_the_temporary_file_of_a_killed_save(tmp_path):
    tl = TrainLoop(*loop_arguments(), show_progress=False)
    tl.fit(num_epochs=1, callbacks=[ModelCheckpoint(**folder_arguments(tmp_path))])
    checkpoints = os.path.join(only_run_folder(tmp_path), "checkpoint_model")
    context = multiprocessing.get_context("fork")
    writers = []
    for name in ("killed", "alive"):
        started = str(tmp_path / f"{name}_started")
        writer = context.Process(target=_write_until_blocked,
                                 args=(os.path.join(checkpoints, f"model_{name}.pth"), started))
        writer.start()
        deadline = time.monotonic() + 120
        while not os.path.exists(started):
            assert writer.is_alive() and time.monotonic() < deadline, "the save did not start writing"
            time.sleep(0.02)
        writers.append(writer)
    killed, alive = writers
    try:
        killed.kill()  # SIGKILL mid-write, as the OOM killer would
        killed.join()
        left = _temporaries(checkpoints)
        assert len(left) == 2, left
        tl.fit(num_epochs=2)  # the same run goes on: its checkpoint callback saves epoch 1
        (kept,) = _temporaries(checkpoints)  # before: both stayed, and one more with every killed save
        assert f".{alive.pid}-" in kept  # a live process may still be writing it
        assert sorted(name for name in os.listdir(checkpoints) if not name.startswith(TEMP_PREFIX))[-1].endswith(
            "_E1.pth")
    finally:
        alive.kill()
        alive.join()
