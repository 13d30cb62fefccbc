"""The clean-up of callbacks when ``fit`` stops on an exception (``on_exception``).

The checkpoint callbacks complete the background save in flight (or, on a second Ctrl-C, abandon it leaving no
file), so the newest checkpoint is always a complete one and no writer thread is left; the tensorboard callbacks
flush and close their writers and open new ones in the next ``fit``.

A save is held "in flight" by an object in the model's ``get_extra_state`` that torch.save pickles in the writer
thread: it waits there until the test lets it go. The second Ctrl-C is a real SIGINT sent to the main thread.
"""
import collections
import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.checkpoints import list_checkpoints, load_checkpoint_file
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardTrainBatchLoss
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

HANG_GUARD_S = 60  # only to turn a hang into a failure


class SlowToSave:
    """Pickled by torch.save (in the writer thread of a background save): says so, then waits for ``gate``."""

    def __init__(self):
        self.started = threading.Event()
        self.gate = None  # None: pickled at once

    def __reduce__(self):
        self.started.set()
        if self.gate is not None:
            self.gate.wait(timeout=HANG_GUARD_S)
        return collections.OrderedDict, ()  # loads as an empty OrderedDict, also with weights_only=True


class MLPWithExtraState(MLP):
    """An MLP whose state_dict holds a :class:`SlowToSave` (``_extra_state``)."""

    def __init__(self, slow: SlowToSave):
        super().__init__()
        self.slow = slow

    def get_extra_state(self):
        return self.slow

    def set_extra_state(self, state):
        pass


def make_loop(model=None) -> TrainLoop:
    torch.manual_seed(0)
    model = model if model is not None else MLP()
    return TrainLoop(model, DataLoader(classification_data(20), batch_size=4), None, None,
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), end_auto_eval=False,
                     show_progress=False)


def folder_arguments(root) -> dict:
    return dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(root))


def saver_threads() -> list:
    return [thread.name for thread in threading.enumerate()
            if thread.name.startswith(("aitoolbox-checkpoint", "aitoolbox-write-behind"))]


def checkpoint_folder(root) -> str:
    (run,) = os.listdir(os.path.join(root, "proj"))
    return os.path.join(root, "proj", run, "checkpoint_model")


def epochs_on_disk(folder) -> list:
    """The epochs of the checkpoints in ``folder``, each loaded in full (so each is complete)."""
    assert [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)] == []
    return [load_checkpoint_file(path)["epoch"] for path in list_checkpoints(folder)]


def start_a_held_save(tmp_path, gate_of=lambda checkpoint: threading.Event()):
    """Epoch 0 trained and checkpointed; epoch 1's checkpoint is then started and held inside torch.save until
    the event ``gate_of(checkpoint)`` is set."""
    slow = SlowToSave()
    tl = make_loop(MLPWithExtraState(slow))
    checkpoint = ModelCheckpoint(**folder_arguments(tmp_path), background_save=True)
    tl.fit(num_epochs=1, callbacks=[checkpoint])
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0]
    slow.started.clear()
    slow.gate = gate_of(checkpoint)
    tl.epoch = 1
    checkpoint.on_epoch_end()
    assert slow.started.wait(timeout=HANG_GUARD_S)  # the writer thread is inside torch.save
    return tl, checkpoint, slow


def test_on_exception_completes_the_checkpoint_in_flight_and_stops_the_writer(tmp_path):
    tl, checkpoint, slow = start_a_held_save(tmp_path)
    release = threading.Timer(0.2, slow.gate.set)  # lets the save go on while on_exception waits for it
    release.start()
    checkpoint.on_exception(RuntimeError("a batch failed"))
    release.join()
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0, 1]
    assert saver_threads() == []
    # A later fit saves again (a new writer thread), and ends with none.
    slow.gate = None
    tl.fit(num_epochs=3)
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0, 1, 2]
    assert saver_threads() == []


def ctrl_c_once_waiting_in(function_name: str) -> None:
    """Send SIGINT to the main thread as soon as its stack is inside ``function_name`` (polled)."""
    main = threading.main_thread().ident
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != function_name:
            frame = frame.f_back
        if frame is not None:
            break
        time.sleep(0.005)
    signal.pthread_kill(main, signal.SIGINT)


@pytest.fixture
def ctrl_c_raises_keyboard_interrupt():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_abandons_the_checkpoint_in_flight_and_leaves_no_file(tmp_path,
                                                                              ctrl_c_raises_keyboard_interrupt):
    # The save stays held until it is abandoned, so it is certainly abandoned before it writes anything.
    tl, checkpoint, slow = start_a_held_save(tmp_path, gate_of=lambda checkpoint: checkpoint._abandon)
    # To the main thread itself (a signal the kernel gives another thread would not interrupt the wait), once it
    # is waiting for the save: however slow the machine, the second Ctrl-C comes during the wait.
    ctrl_c = threading.Thread(target=ctrl_c_once_waiting_in, args=("wait_for_pending_save",))
    ctrl_c.start()
    checkpoint.on_exception(KeyboardInterrupt())  # the first Ctrl-C; the second arrives while it waits
    ctrl_c.join()
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0]  # epoch 1's file abandoned: no file, no temp file
    assert saver_threads() == []
    slow.gate = None
    checkpoint.on_epoch_end()  # the next save is not abandoned
    checkpoint.on_train_end()
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0, 1]
    assert saver_threads() == []


def test_on_exception_without_a_save_in_flight_does_nothing_harmful(tmp_path):
    tl = make_loop()
    checkpoint = ModelCheckpoint(**folder_arguments(tmp_path), background_save=True)
    tl.callbacks_handler.register_callbacks([checkpoint])
    checkpoint.on_exception(KeyboardInterrupt())
    assert not os.path.exists(tmp_path / "proj") and saver_threads() == []
    tl.fit(num_epochs=1)
    assert epochs_on_disk(checkpoint_folder(tmp_path)) == [0]


# --- through fit --------------------------------------------------------------------------------------------------
class RaiseAfterIterationCheckpoint(AbstractCallback):
    """Raises ``exception`` at the end of ``at_iteration`` (counted over the run), right after the iteration
    checkpoint callback (order 100) has started that batch's save."""

    def __init__(self, exception: BaseException, at_iteration: int):
        super().__init__("raise after a checkpoint", execution_order=101)
        self.exception, self.at_iteration, self.calls_at_iteration = exception, at_iteration, 0

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at_iteration:
            self.calls_at_iteration += 1
            if self.calls_at_iteration == 1:  # the next fit finishes the batch's end: this hook runs again
                raise self.exception


class FailingBatchMLP(MLP):
    """An MLP whose ``fail_at``-th loss computation (counted from 1) raises."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at, self.losses = fail_at, 0

    def get_loss(self, batch_data, criterion, device):
        self.losses += 1
        if self.losses == self.fail_at:
            raise ValueError("this batch cannot be computed")
        return super().get_loss(batch_data, criterion, device)


def tracked_loop(tmp_path, model) -> TrainLoopCheckpoint:
    """Checkpoints every epoch and every 2 iterations (5 batches an epoch), written in the background."""
    torch.manual_seed(0)
    return TrainLoopCheckpoint(model, DataLoader(classification_data(20), batch_size=4), None, None,
                               torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                               "proj", "exp", str(tmp_path), iteration_save_freq=2, background_save=True,
                               end_auto_eval=False, show_progress=False)


@pytest.mark.parametrize("failure", ["callback RuntimeError", "callback KeyboardInterrupt", "batch ValueError"])
def test_a_fit_stopped_mid_epoch_leaves_complete_checkpoints_closed_writers_and_no_threads(tmp_path, failure):
    pytest.importorskip("tensorboard")
    threads_before = set(threading.enumerate())
    if failure == "batch ValueError":
        model, callbacks, expected = FailingBatchMLP(fail_at=8), [], ValueError  # the 3rd batch of epoch 1
    else:
        exception = RuntimeError("a callback failed") if "Runtime" in failure else KeyboardInterrupt()
        model, callbacks, expected = MLP(), [RaiseAfterIterationCheckpoint(exception, at_iteration=7)], type(exception)
    tl = tracked_loop(tmp_path, model)
    tensorboard = TensorboardTrainBatchLoss()
    with pytest.raises(expected):
        tl.fit(num_epochs=3, callbacks=callbacks + [tensorboard])

    assert tensorboard.tb_writer is None
    assert set(threading.enumerate()) <= threads_before  # writer thread, write-behind and tensorboard threads
    folder = tl.experiment_folder.checkpoint_dir
    names = os.listdir(folder)
    assert not [name for name in names if name.startswith(TEMP_PREFIX)]
    on_disk = {name: load_checkpoint_file(os.path.join(folder, name)) for name in names}  # each one complete
    assert len(on_disk) >= 2 and "_E0.pth" in "".join(names)
    newest = load_checkpoint_file(tl.experiment_folder.path)  # what a resume would load
    if failure != "batch ValueError":  # the save of the batch that raised right after it is complete too
        assert newest["iteration_idx"] == 7

    # The next fit continues, checkpoints and ends without threads.
    callbacks_before = list(tl.callbacks)
    tl.fit(num_epochs=3)
    assert tl.callbacks == callbacks_before and tl.epochs_completed == 3
    if failure != "batch ValueError":  # the hook that raised ran again for its batch, once
        assert callbacks[0].calls_at_iteration == 2
    assert load_checkpoint_file(tl.experiment_folder.path)["epoch"] == 2
    assert set(threading.enumerate()) <= threads_before
