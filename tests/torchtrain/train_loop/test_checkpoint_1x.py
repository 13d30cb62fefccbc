"""Checkpoint files in aitoolbox 1.8's format, both ways: 1.8 files continue here, our files load in 1.8-style code.

A 1.8 checkpoint is ``torch.save`` of ``{'model_state_dict', 'optimizer_state_dict', 'schedulers_state_dict': [...],
'epoch', 'iteration_idx', 'hyperparams'}`` (plus ``'amp'``, a GradScaler state, under AMP) at
``<root>/<project>/<experiment>_<timestamp>/checkpoint_model/model_<experiment>_<timestamp>_E<epoch>.pth``.
The 1.8 runs below are hand-written PyTorch loops whose states are saved under those keys.
"""
import copy
import logging
import os
import re

import pytest
import torch
from torch import nn

from aitoolbox.experiment.local_save.checkpoints import MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.multi_loss_optim import MultiOptimizer
from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import (
    INIT_SEED, MLP, SCALER_ARGS, TRAIN_SEED, assert_params_equal, classification_data, default_device,
    TrainEndCounter, params_differ, seeded_loader, single_torch_thread,
)

NUM_SAMPLES, BATCH_SIZE, BATCHES_PER_EPOCH = 30, 8, 4
SAVED_TIMESTAMP = "2024-03-05_10-20-30"
PROJECT, EXPERIMENT = "proj", "exp"


one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


class LogRecorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    """The warnings the package logs (its ``aitoolbox`` logger does not propagate to the root logger)."""
    handler = LogRecorder()
    logger = logging.getLogger("aitoolbox")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


# --- 1.8 runs, written out in plain PyTorch -----------------------------------------------------------------
def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_loader():
    return seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE)


def low_precision_dtype(device):
    return torch.float16 if device.type == "cuda" else torch.bfloat16


class Run18:
    """Model, optimizer, StepLR scheduler and GradScaler of a run, trained epoch by epoch as 1.8 does.

    The scheduler steps at each epoch end (1.8's StepLRScheduler callback); with ``amp`` the forward runs under
    autocast and the GradScaler scales, steps and updates.
    """

    def __init__(self, model, amp=False):
        self.device = default_device()
        self.model = model.to(self.device)
        self.optimizer = sgd(model)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.scaler = torch.amp.GradScaler(self.device.type, **SCALER_ARGS, enabled=amp)
        self.amp = amp
        self.criterion = nn.CrossEntropyLoss()
        self.loader = train_loader()

    def train_epoch(self):
        self.model.train()
        for x, y in self.loader:
            with torch.autocast(device_type=self.device.type, dtype=low_precision_dtype(self.device),
                                enabled=self.amp):
                loss = self.criterion(self.model(x.to(self.device)), y.to(self.device))
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
        self.scheduler.step()

    def checkpoint(self, epoch, model_state=None):
        """1.8's checkpoint dict after epoch ``epoch`` (all epochs of BATCHES_PER_EPOCH batches)."""
        checkpoint = {
            "model_state_dict": model_state if model_state is not None else self.model.state_dict(),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "schedulers_state_dict": [self.scheduler.state_dict()],
            "epoch": epoch,
            "iteration_idx": (epoch + 1) * BATCHES_PER_EPOCH - 1,
            "hyperparams": {"lr": 0.1, "batch_size": BATCH_SIZE},
        }
        if self.amp:
            checkpoint["amp"] = self.scaler.state_dict()
        return checkpoint


def saved_18_run(root, epochs=2, amp=False, data_parallel=False):
    """A 1.8 run trained ``epochs`` epochs, its checkpoint of the last epoch written in 1.8's layout."""
    torch.manual_seed(INIT_SEED)
    run = Run18(MLP(), amp=amp)
    torch.manual_seed(TRAIN_SEED)
    for _ in range(epochs):
        run.train_epoch()
    model_state = nn.DataParallel(run.model).state_dict() if data_parallel else None
    folder = os.path.join(root, PROJECT, f"{EXPERIMENT}_{SAVED_TIMESTAMP}", "checkpoint_model")
    os.makedirs(folder)
    path = os.path.join(folder, f"model_{EXPERIMENT}_{SAVED_TIMESTAMP}_E{epochs - 1}.pth")
    torch.save(run.checkpoint(epochs - 1, model_state), path)
    return run, path


def continue_18_run(run, epochs=1):
    """The 1.8 run continued in plain PyTorch from its saved state (what the resumed TrainLoop must do)."""
    state = copy.deepcopy(run.checkpoint(epoch=1))
    torch.manual_seed(12345)
    reference = Run18(MLP(), amp=run.amp)
    reference.model.load_state_dict(state["model_state_dict"])
    reference.optimizer.load_state_dict(state["optimizer_state_dict"])
    reference.scheduler.load_state_dict(state["schedulers_state_dict"][0])
    if run.amp:
        reference.scaler.load_state_dict(state["amp"])
    torch.manual_seed(TRAIN_SEED)
    for _ in range(epochs):
        reference.train_epoch()
    return reference


def assert_optimizer_states_equal(state_a, state_b):
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for index, values in state_a["state"].items():
        assert values.keys() == state_b["state"][index].keys()
        for key, value in values.items():
            other = state_b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.cpu(), other.cpu()), (index, key)
            else:
                assert value == other, (index, key)


class FirstEpochProbe(AbstractCallback):
    """What the loop holds when its first epoch begins (after a loaded checkpoint was fully applied)."""

    def __init__(self):
        super().__init__("probe", execution_order=50)
        self.epochs = []
        self.seen = None

    def on_epoch_begin(self):
        tl = self.train_loop_obj
        self.epochs.append(tl.epoch)
        if self.seen is None:
            schedulers = tl.get_schedulers()
            self.seen = {"model": copy.deepcopy(tl.model.state_dict()),
                         "optimizer": copy.deepcopy(tl.optimizer.state_dict()),
                         "last_epoch": schedulers[0].scheduler.last_epoch if schedulers else None,
                         "amp": tl.amp_scaler.state_dict()}


def fresh_loop(**kwargs):
    torch.manual_seed(999)  # other initial weights than the saved run's
    model = MLP()
    kwargs.setdefault("end_auto_eval", False)
    return TrainLoop(model, train_loader(), None, None, sgd(model), nn.CrossEntropyLoss(), show_progress=False,
                     **kwargs)


def load_18_callback(root, **kwargs):
    return ModelLoadContinueTraining(saved_experiment_timestamp=SAVED_TIMESTAMP, saved_model_dir="checkpoint_model",
                                     epoch_num=1, project_name=PROJECT, experiment_name=EXPERIMENT,
                                     local_model_result_folder_path=str(root), **kwargs)


# --- 10. a 1.8 checkpoint continues here -----------------------------------------------------------------------
def test_a_18_checkpoint_continues_from_the_next_epoch(tmp_path, warnings_logged):
    run, _ = saved_18_run(tmp_path)
    tl = fresh_loop()
    probe = FirstEpochProbe()
    torch.manual_seed(TRAIN_SEED)  # 1.8 files hold no random state: the run goes on with the current one
    tl.fit(num_epochs=3, callbacks=[load_18_callback(tmp_path), StepLRScheduler(step_size=1, gamma=0.5), probe])
    assert probe.epochs == [2]  # epochs 0 and 1 were done: one epoch left
    saved = run.checkpoint(1)
    assert probe.seen["model"].keys() == saved["model_state_dict"].keys()
    assert all(torch.equal(probe.seen["model"][k], v) for k, v in saved["model_state_dict"].items())
    assert_optimizer_states_equal(probe.seen["optimizer"], saved["optimizer_state_dict"])
    assert probe.seen["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    assert probe.seen["last_epoch"] == 2  # the StepLR state of the file
    assert any("not bitwise" in message for message in warnings_logged)

    reference = continue_18_run(run)
    assert_params_equal(tl.model, reference.model)
    assert tl.get_schedulers()[0].scheduler.state_dict() == reference.scheduler.state_dict()
    assert tl.epoch == 2


def test_a_18_checkpoint_restores_the_grad_scaler_state(tmp_path):
    run, _ = saved_18_run(tmp_path, amp=True)
    saved_amp = run.checkpoint(1)["amp"]
    assert saved_amp["scale"] == 2.0 ** 10 * 2 ** 2  # 8 steps with growth_interval 3
    tl = fresh_loop(use_amp=dict(SCALER_ARGS))
    probe = FirstEpochProbe()
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=3, callbacks=[load_18_callback(tmp_path), StepLRScheduler(step_size=1, gamma=0.5), probe])
    assert probe.seen["amp"] == saved_amp
    reference = continue_18_run(run)
    assert_params_equal(tl.model, reference.model)
    assert tl.amp_scaler.state_dict() == reference.scaler.state_dict()


def test_inside_a_checkpoint_preset_the_folder_arguments_are_inferred(tmp_path):
    run, _ = saved_18_run(tmp_path)
    torch.manual_seed(999)
    model = MLP()
    tl = TrainLoopCheckpoint(model, train_loader(), None, None, sgd(model), nn.CrossEntropyLoss(),
                             project_name=PROJECT, experiment_name=EXPERIMENT,
                             local_model_result_folder_path=str(tmp_path), hyperparams={}, end_auto_eval=False,
                             show_progress=False)
    probe = FirstEpochProbe()
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=3, callbacks=[ModelLoadContinueTraining(SAVED_TIMESTAMP, epoch_num=1),
                                    StepLRScheduler(step_size=1, gamma=0.5), probe])
    assert probe.epochs == [2]
    assert all(torch.equal(probe.seen["model"][k], v) for k, v in run.checkpoint(1)["model_state_dict"].items())
    assert_params_equal(model, continue_18_run(run).model)
    # The continued run writes into its own new folder; the 1.8 run's folder is left as it was.
    assert tl.experiment_timestamp != SAVED_TIMESTAMP
    assert os.listdir(os.path.join(tl.experiment_folder.path, "checkpoint_model")) == [
        f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E2.pth"]
    assert os.listdir(tmp_path / PROJECT / f"{EXPERIMENT}_{SAVED_TIMESTAMP}" / "checkpoint_model") == [
        f"model_{EXPERIMENT}_{SAVED_TIMESTAMP}_E1.pth"]


def test_a_data_parallel_saved_18_checkpoint_loads(tmp_path):
    run, path = saved_18_run(tmp_path, data_parallel=True)
    assert all(key.startswith("module.") for key in torch.load(path)[MODEL_KEY])
    tl = fresh_loop()
    probe = FirstEpochProbe()
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=3, callbacks=[load_18_callback(tmp_path, used_data_parallel=True),
                                    StepLRScheduler(step_size=1, gamma=0.5), probe])
    assert all(torch.equal(probe.seen["model"][k], v) for k, v in run.model.state_dict().items())
    assert_params_equal(tl.model, continue_18_run(run).model)


# --- 11. our checkpoints read by 1.8-style code ----------------------------------------------------------------
def checkpoint_preset(root, **kwargs):
    torch.manual_seed(INIT_SEED)
    model = MLP()
    hyperparams = {"lr": 0.1, "batch_size": BATCH_SIZE}
    return TrainLoopCheckpoint(model, train_loader(), None, None, sgd(model),
                               nn.CrossEntropyLoss(), project_name=PROJECT, experiment_name=EXPERIMENT,
                               local_model_result_folder_path=str(root), hyperparams=hyperparams,
                               end_auto_eval=False, show_progress=False, **kwargs)


def test_our_epoch_checkpoints_load_in_18_style_code(tmp_path):
    tl = checkpoint_preset(tmp_path, use_amp=dict(SCALER_ARGS))
    tl.fit(num_epochs=2, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])
    folder = tmp_path / PROJECT / f"{EXPERIMENT}_{tl.experiment_timestamp}" / "checkpoint_model"
    assert sorted(os.listdir(folder)) == [f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E{epoch}.pth"
                                          for epoch in (0, 1)]
    # 1.8's loader: torch.load(path, map_location=...), then the entries by key.
    checkpoint = torch.load(folder / f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E1.pth", map_location="cpu")

    model = MLP()
    model.load_state_dict(checkpoint["model_state_dict"])
    assert_params_equal(model, tl.model)
    optimizer = sgd(model)
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    assert_optimizer_states_equal(optimizer.state_dict(), tl.optimizer.state_dict())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    (scheduler_state,) = checkpoint["schedulers_state_dict"]
    scheduler.load_state_dict(scheduler_state)
    assert scheduler.last_epoch == 2
    assert checkpoint["epoch"] == 1 and checkpoint["iteration_idx"] == 2 * BATCHES_PER_EPOCH - 1
    assert checkpoint["hyperparams"] == {"lr": 0.1, "batch_size": BATCH_SIZE}
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(checkpoint["amp"])
    assert scaler.get_scale() == tl.amp_scaler.get_scale() == 2.0 ** 10 * 2 ** 2
    assert scaler.state_dict() == tl.amp_scaler.state_dict()


def test_without_amp_our_checkpoints_have_no_amp_entry(tmp_path):
    tl = checkpoint_preset(tmp_path)
    tl.fit(num_epochs=1)
    (name,) = os.listdir(os.path.join(tl.experiment_folder.path, "checkpoint_model"))
    checkpoint = torch.load(os.path.join(tl.experiment_folder.path, "checkpoint_model", name))
    assert "amp" not in checkpoint and checkpoint[SCHEDULERS_KEY] == []


def test_a_multi_optimizer_checkpoint_loads_into_a_18_multi_optimizer(tmp_path):
    torch.manual_seed(INIT_SEED)
    model = MLP()
    optimizers = MultiOptimizer([torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.9),
                                 torch.optim.Adam(model.fc2.parameters(), lr=0.01)])
    tl = TrainLoopCheckpoint(model, train_loader(), None, None, optimizers, nn.CrossEntropyLoss(), PROJECT,
                             EXPERIMENT, str(tmp_path), {}, end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1)
    (name,) = os.listdir(os.path.join(tl.experiment_folder.path, "checkpoint_model"))
    checkpoint = torch.load(os.path.join(tl.experiment_folder.path, "checkpoint_model", name))
    assert isinstance(checkpoint[OPTIMIZER_KEY], list) and len(checkpoint[OPTIMIZER_KEY]) == 2
    fresh = MLP()
    loaded = MultiOptimizer([torch.optim.SGD(fresh.fc1.parameters(), lr=0.1, momentum=0.9),
                             torch.optim.Adam(fresh.fc2.parameters(), lr=0.01)])
    loaded.load_state_dict(checkpoint[OPTIMIZER_KEY])
    for ours, theirs in zip(optimizers, loaded):
        assert_optimizer_states_equal(theirs.state_dict(), ours.state_dict())


def test_iteration_checkpoints_are_named_with_epoch_and_iteration_index(tmp_path):
    tl = checkpoint_preset(tmp_path, iteration_save_freq=3)
    tl.fit(num_epochs=2)
    folder = os.path.join(tl.experiment_folder.path, "checkpoint_model")
    iteration_files = sorted(name for name in os.listdir(folder) if "_ITER" in name)
    assert len(iteration_files) == 2  # 8 batches, every 3rd
    for name in iteration_files:
        checkpoint = torch.load(os.path.join(folder, name))
        assert name == (f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E{checkpoint['epoch']}"
                        f"_ITER{checkpoint['iteration_idx']}.pth")
        assert checkpoint["epoch"] == checkpoint["iteration_idx"] // BATCHES_PER_EPOCH
    epoch_files = sorted(name for name in os.listdir(folder) if "_ITER" not in name)
    assert epoch_files == [f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E{epoch}.pth" for epoch in (0, 1)]


# --- 12. files of this package's first format ------------------------------------------------------------------
def first_format(checkpoint: dict) -> dict:
    """A checkpoint of the current format with the keys of this package's first format (before 1.8's keys)."""
    old = {key: value for key, value in checkpoint.items()
           if key not in (MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, "iteration_idx", "amp")}
    old["format_version"] = 1
    old["model"] = checkpoint[MODEL_KEY]
    old["optimizers"] = [checkpoint[OPTIMIZER_KEY]]
    old["total_iteration_idx"] = checkpoint["iteration_idx"] + 1  # it counted the batches done
    # LR schedulers were stored with the other stateful callbacks, by class name and position.
    old["callbacks"] = dict(checkpoint["callbacks"], **{f"StepLRScheduler:{i}": state
                                                       for i, state in enumerate(checkpoint[SCHEDULERS_KEY])})
    return old


def test_a_file_of_our_first_format_still_resumes_exactly(tmp_path):
    def loop():
        torch.manual_seed(INIT_SEED)
        model = MLP()
        return TrainLoop(model, train_loader(), None, None, sgd(model), nn.CrossEntropyLoss(), show_progress=False)

    straight = loop()
    torch.manual_seed(TRAIN_SEED)
    straight.fit(num_epochs=4, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])

    first_half = loop()
    torch.manual_seed(TRAIN_SEED)
    first_half.fit(num_epochs=2, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])
    path = tmp_path / "old_format.pth"
    torch.save(first_format(first_half.checkpoint_state()), path)

    resumed = fresh_loop(end_auto_eval=True)
    torch.manual_seed(4321)  # the file's random state wins
    resumed.fit(num_epochs=4, callbacks=[ModelLoadContinueTraining(saved_model_path=str(path)),
                                         StepLRScheduler(step_size=1, gamma=0.5)])
    assert params_differ(resumed.model, first_half.model)
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history
    assert resumed.total_iteration_idx == straight.total_iteration_idx == 4 * BATCHES_PER_EPOCH - 1
    assert resumed.get_schedulers()[0].scheduler.last_epoch == 4


# --- 13. runs started in the same second ---------------------------------------------------------------------
def test_two_checkpoint_runs_constructed_in_the_same_second_get_two_folders(tmp_path):
    for attempt in range(3):  # constructed across a second boundary the test proves nothing: try again
        root = tmp_path / str(attempt)
        first, second = checkpoint_preset(root), checkpoint_preset(root)
        if second.experiment_timestamp.startswith(first.experiment_timestamp):
            break
    assert re.fullmatch(re.escape(first.experiment_timestamp) + r"_\d+", second.experiment_timestamp)
    assert first.experiment_folder.path != second.experiment_folder.path
    for tl in (first, second):
        tl.fit(num_epochs=1)
    for tl in (first, second):
        folder = os.path.join(root, PROJECT, f"{EXPERIMENT}_{tl.experiment_timestamp}", "checkpoint_model")
        assert os.listdir(folder) == [f"model_{EXPERIMENT}_{tl.experiment_timestamp}_E0.pth"]


def test_a_18_final_checkpoint_loaded_at_its_target_trains_nothing_and_runs_no_train_end(tmp_path, warnings_logged):
    """Issue 32: a 1.8 folder has no record of finished train ends, and its checkpoints no key saying an end follows
    them: its final checkpoint loaded with the run's target is a finished run, as before (nothing to train, no end
    run again: no final save overwritten, no test evaluation repeated)."""
    _, path = saved_18_run(tmp_path)

    tl, counter = fresh_loop(), TrainEndCounter()
    tl.load_checkpoint(path)
    tl.fit(num_epochs=2, callbacks=[counter])
    assert counter.ends == 0 and tl.epochs_completed == 2
    assert any("Nothing to train" in message for message in warnings_logged)
    assert not any("records no finished train end" in message for message in warnings_logged)
