"""EarlyStopping(restore_best_weights=True), Keras's option (issue 35, item 1): when training ends, the model holds
the weights (and buffers) of the best epoch, whether the callback stopped the run or the epochs ran out."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks import EarlyStopping, ModelCheckpoint
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import IN_FEATURES, NUM_CLASSES, ClassifierMixin, classification_data


class BatchNormMLP(ClassifierMixin, TTModel):
    """Buffers (BatchNorm's running statistics) are restored with the weights."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 12)
        self.norm = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class Scripted(AbstractCallback):
    """Record ``values[epoch]`` as ``val_score`` and keep the model's state at every epoch end."""

    def __init__(self, values):
        super().__init__("scripted", execution_order=50)
        self.values = values
        self.states = {}

    def on_epoch_end(self):
        tl = self.train_loop_obj
        tl.insert_metric_result_into_history("val_score", self.values[tl.epoch])
        self.states[tl.epoch] = copy.deepcopy(tl.model.state_dict())


def make_loop(**kwargs):
    torch.manual_seed(0)
    model = BatchNormMLP()
    train = DataLoader(classification_data(24), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    validation = DataLoader(classification_data(8, seed=3), batch_size=4)
    test = DataLoader(classification_data(8, seed=4), batch_size=4)
    return TrainLoop(model, train, validation, test, torch.optim.SGD(model.parameters(), lr=0.1),
                     nn.CrossEntropyLoss(), show_progress=False, **kwargs)


def assert_state(model, state):
    current = model.state_dict()
    assert current.keys() == state.keys()
    for key in state:
        assert torch.equal(current[key], state[key]), key


VALUES = [0.3, 0.8, 0.5, 0.6, 0.4]  # mode max: the best is epoch 1; patience 1 stops at epoch 3


def test_a_stopped_run_ends_with_the_best_epoch_weights_and_buffers():
    tl = make_loop()
    scripted = Scripted(VALUES)
    stopping = EarlyStopping("val_score", patience=1, restore_best_weights=True)
    tl.fit(num_epochs=5, callbacks=[scripted, stopping])
    assert tl.epoch == 3 and stopping.best_epoch == 1
    assert_state(tl.model, scripted.states[1])
    y_pred, _, _ = tl.predict_on_validation_set()  # not the last epoch's cached predictions
    probe = copy.deepcopy(tl.model).eval()
    with torch.no_grad():
        expected = torch.cat([probe(x).argmax(dim=1) for x, _ in tl.validation_loader])
    assert torch.equal(y_pred, expected)


def test_the_best_weights_are_restored_when_the_epochs_run_out_too():
    """Keras 3 restores at the end of training whether or not the callback stopped it."""
    tl = make_loop()
    scripted = Scripted([0.3, 0.8, 0.5])
    tl.fit(num_epochs=3, callbacks=[scripted, EarlyStopping("val_score", patience=5, restore_best_weights=True)])
    assert_state(tl.model, scripted.states[1])


def test_a_nan_first_epoch_is_never_restored():
    """Review of issue 35, D3: a NaN at the first epoch became the best, and its weights were restored."""
    tl = make_loop()
    scripted = Scripted([float("nan"), 0.5, 0.7, 0.9, 0.8, 0.6])
    stopping = EarlyStopping("val_score", patience=1, restore_best_weights=True)
    tl.fit(num_epochs=6, callbacks=[scripted, stopping])
    assert stopping.best_epoch == 3 and stopping.best_performance == 0.9
    assert_state(tl.model, scripted.states[3])


def test_without_the_option_the_last_weights_stay():
    tl = make_loop()
    scripted = Scripted(VALUES)
    tl.fit(num_epochs=5, callbacks=[scripted, EarlyStopping("val_score", patience=1)])
    assert_state(tl.model, scripted.states[3])


def test_the_test_loss_recorded_at_the_end_is_that_of_the_restored_weights():
    tl = make_loop()
    tl.fit(num_epochs=5, callbacks=[Scripted(VALUES), EarlyStopping("val_score", patience=1,
                                                                     restore_best_weights=True)])
    (recorded,) = tl.train_history["train_end_test_loss"]
    assert recorded == tl.evaluate_loss_on_test_set(force_prediction=True, float_dict_format=True)


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_restores_the_same_weights(tmp_path):
    folder = dict(project_name="p", experiment_name="e", local_model_result_folder_path=str(tmp_path))
    straight = make_loop()
    checkpoint = ModelCheckpoint(**folder)
    straight.fit(num_epochs=5, callbacks=[Scripted(VALUES), EarlyStopping("val_score", patience=1,
                                                                          restore_best_weights=True), checkpoint])
    resumed = make_loop()
    # The end of epoch 2: the best (epoch 1) lies before it, and only the checkpoint knows its weights.
    resumed.load_checkpoint(checkpoint.experiment_folder.checkpoint_dir + "/" +
                            f"model_e_{checkpoint.experiment_folder.timestamp}_E2.pth")
    resumed.fit(num_epochs=5, callbacks=[Scripted(VALUES), EarlyStopping("val_score", patience=1,
                                                                         restore_best_weights=True)])
    assert resumed.epoch == straight.epoch == 3
    assert_state(resumed.model, straight.model.state_dict())


@pytest.mark.parametrize("value", [1, "yes", None])
def test_restore_best_weights_must_be_a_bool(value):
    with pytest.raises(TypeError, match="restore_best_weights must be True or False"):
        EarlyStopping(restore_best_weights=value)


class ScriptedWithMasters(Scripted):
    """Also keeps amp O2's float32 master weights at every epoch end."""

    def __init__(self, values):
        super().__init__(values)
        self.masters = {}

    def on_epoch_end(self):
        super().on_epoch_end()
        tl = self.train_loop_obj
        self.masters[tl.epoch] = tl.precision.master_weights.state_dict()


def test_under_amp_o2_the_float32_master_weights_are_restored_too():
    """O2 steps float32 masters and copies them into the low-precision model: restoring only the model would let
    the next step put the last epoch's weights back (and lose the masters' precision)."""
    tl = make_loop(use_amp={"opt_level": "O2"})
    scripted = ScriptedWithMasters(VALUES)
    tl.fit(num_epochs=5, callbacks=[scripted, EarlyStopping("val_score", patience=1, restore_best_weights=True)])
    restored = tl.precision.master_weights.state_dict()
    expected = scripted.masters[1]
    assert len(restored) == len(expected)
    for group, expected_group in zip(restored, expected):
        assert all(torch.equal(a, b) for a, b in zip(group, expected_group))
    assert_state(tl.model, scripted.states[1])
