"""EarlyStopping(restore_best_weights=True), Keras's option (issue 35, item 1): when training ends, the model holds
the weights (and buffers) of the best epoch, whether the callback stopped the run or the epochs ran out."""
import copy
import csv
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# --- review of issue 35, D5: the end of training describes the model returned ------------------------------------
class WeightsAtTrainEnd(AbstractCallback):
    """The model's state when the ``on_train_end`` callbacks that run first (order 0) see it."""

    def __init__(self):
        super().__init__("weights at train end")
        self.state = None

    def on_train_end(self):
        self.state = copy.deepcopy(self.train_loop_obj.model.state_dict())


def accuracy(y_pred, y_true):
    return float((y_pred == y_true).float().mean())


def test_the_end_of_training_metrics_reports_and_trackers_describe_the_returned_model(tmp_path):
    """Metrics computed at on_train_end by callbacks that run before EarlyStopping (ModelPerformanceEvaluation,
    order 0), the test loss the trackers log, and what the on_train_end callbacks see: all of the restored weights."""
    from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
    from aitoolbox.torchtrain.callbacks import CSVLogger, ModelPerformanceEvaluation
    tl = make_loop()
    scripted, seen = Scripted(VALUES), WeightsAtTrainEnd()
    tl.fit(num_epochs=5, callbacks=[
        ModelPerformanceEvaluation(ClassificationResultPackage(), on_val_data=True, on_test_data=True), scripted,
        seen, CSVLogger(log_dir=str(tmp_path / "csv"), is_project=False),
        EarlyStopping("val_score", patience=1, restore_best_weights=True)])
    assert_state_equal(seen.state, scripted.states[1])
    y_val, t_val, _ = tl.predict_on_validation_set()
    y_test, t_test, _ = tl.predict_on_test_set()
    history = tl.train_history
    assert history["train_end_val_Accuracy"] == [accuracy(y_val, t_val)]
    assert history["train_end_test_Accuracy"] == [accuracy(y_test, t_test)]
    assert history["train_end_test_loss"] == [tl.evaluate_loss_on_test_set(float_dict_format=True)]
    (csv_file,) = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "csv") for name in names
                   if name.endswith(".csv") and "epoch" in name]
    with open(csv_file) as handle:
        logged = [row["train_end_test_loss"] for row in csv.DictReader(handle) if row.get("train_end_test_loss")]
    assert [float(value) for value in logged] == history["train_end_test_loss"]


def test_tensorboard_logs_the_test_loss_of_the_restored_weights(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from aitoolbox.torchtrain.callbacks import TensorboardFullTracking
    tl = make_loop()
    tracking = TensorboardFullTracking(project_name="p", experiment_name="e",
                                       local_model_result_folder_path=str(tmp_path))
    tl.fit(num_epochs=4, callbacks=[Scripted([0.1, 0.9, 0.2, 0.3]), tracking,
                                    EarlyStopping("val_score", patience=10, restore_best_weights=True)])
    events = EventAccumulator(tracking.experiment_folder.tensorboard_dir)
    events.Reload()
    (logged,) = [event.value for event in events.Scalars("loss/train_end_test_loss")]
    assert logged == pytest.approx(tl.evaluate_loss_on_test_set(float_dict_format=True), rel=1e-6)


# --- review of issue 35, D6: the restored weights are a view; two fits train as one --------------------------------
class EpochEndWeights(AbstractCallback):
    """The weights at every epoch end (after the checkpoints: what the next epoch starts from)."""

    def __init__(self):
        super().__init__("epoch-end weights", execution_order=150)
        self.states = {}

    def on_epoch_end(self):
        self.states[self.train_loop_obj.epoch] = copy.deepcopy(self.train_loop_obj.model.state_dict())


SIX = [0.1, 0.9, 0.2, 0.3, 0.4, 0.5]  # the best is epoch 1; patience 10 never stops


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for epoch in a:
        assert_state_equal(a[epoch], b[epoch], epoch)


def assert_state_equal(a, b, where=""):
    assert a.keys() == b.keys(), where
    for key in a:
        assert torch.equal(a[key], b[key]), (where, key)


def test_two_fits_train_as_one_and_each_returns_the_best_weights():
    straight, straight_weights = make_loop(), EpochEndWeights()
    straight.fit(num_epochs=6, callbacks=[Scripted(SIX), straight_weights,
                                          EarlyStopping("val_score", patience=10, restore_best_weights=True)])
    split, split_weights = make_loop(), EpochEndWeights()
    scripted = Scripted(SIX)
    callbacks = [scripted, split_weights, EarlyStopping("val_score", patience=10, restore_best_weights=True)]
    split.fit(num_epochs=3, callbacks=callbacks)
    assert_state(split.model, scripted.states[1])  # the first fit returns the best weights, as Keras
    split.fit(num_epochs=6)
    assert_same_states(split_weights.states, straight_weights.states)  # the second trained on from epoch 2's
    assert_state(split.model, straight.model.state_dict())
    assert_state(split.model, scripted.states[1])
    per_epoch = {name: values for name, values in straight.train_history.items() if not name.startswith("train_end")}
    assert {name: split.train_history[name] for name in per_epoch} == per_epoch
    # Each fit records its own end: the second one's is the straight run's.
    assert split.train_history["train_end_test_loss"][-1] == straight.train_history["train_end_test_loss"][-1]


def test_a_checkpoint_of_the_returned_model_continues_as_one_fit():
    """The final model's checkpoint (what ModelTrainEndSave writes: the best weights) holds the weights training
    ended with in EarlyStopping's state: a new loop continuing from it trains as the first one would have."""
    straight, straight_weights = make_loop(), EpochEndWeights()
    straight.fit(num_epochs=6, callbacks=[Scripted(SIX), straight_weights,
                                          EarlyStopping("val_score", patience=10, restore_best_weights=True)])
    first = make_loop()
    first.fit(num_epochs=3, callbacks=[Scripted(SIX), EarlyStopping("val_score", patience=10,
                                                                    restore_best_weights=True)])
    final = first.checkpoint_state()
    continued, continued_weights = make_loop(), EpochEndWeights()
    continued.load_checkpoint(final)
    assert_state(continued.model, first.model.state_dict())  # loaded: the best weights, as saved
    continued.fit(num_epochs=6, callbacks=[Scripted(SIX), continued_weights,
                                           EarlyStopping("val_score", patience=10, restore_best_weights=True)])
    assert_same_states(continued_weights.states, {e: w for e, w in straight_weights.states.items() if e >= 3})
    assert_state(continued.model, straight.model.state_dict())


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scores=st.lists(st.floats(0, 1, allow_nan=False), min_size=2, max_size=5), data=st.data())
def test_any_split_of_a_run_with_restored_weights_trains_as_one_fit(scores, data):
    """Two fits equal one, whatever the scores and wherever the first fit ends (also after an early stop)."""
    split_at = data.draw(st.integers(1, len(scores) - 1), label="split_at")
    patience = data.draw(st.integers(0, 2), label="patience")

    def run(*totals):
        tl, weights = make_loop(), EpochEndWeights()
        callbacks = [Scripted(scores), weights, EarlyStopping("val_score", patience=patience,
                                                              restore_best_weights=True)]
        for total in totals:
            tl.fit(num_epochs=total, callbacks=callbacks)
        return tl, weights.states

    straight, straight_states = run(len(scores))
    split, split_states = run(split_at, len(scores))
    assert split.epochs_completed == straight.epochs_completed
    assert_same_states(split_states, straight_states)
    assert_state(split.model, straight.model.state_dict())


def test_weights_loaded_after_training_are_kept_by_the_next_fit(tmp_path):
    """The view is undone only while it is in the model: a checkpoint loaded after training (even the best epoch's,
    whose weights equal the view), load_best_model() and keep_best_weights() all make the next fit train from the
    weights put in."""
    def epoch_three(how):
        tl = make_loop()
        stopping = EarlyStopping("val_score", patience=10, restore_best_weights=True)
        checkpoint = ModelCheckpoint(project_name="p", experiment_name=how, local_model_result_folder_path=str(tmp_path),
                                     rm_subopt_local_models="val_score", num_best_checkpoints_kept=1)
        tl.fit(num_epochs=3, callbacks=[Scripted(SIX), stopping, checkpoint])
        if how == "load_checkpoint":
            tl.load_checkpoint(checkpoint.best_model_path)  # epoch 1's: the run as it stood then
        elif how == "load_best_model":
            checkpoint.load_best_model()
        elif how == "keep_best_weights":
            stopping.keep_best_weights()
        weights = EpochEndWeights()
        tl.fit(num_epochs=4, callbacks=[weights])
        return weights.states, checkpoint.best_model_path

    undone, _ = epoch_three("nothing")  # the view undone: epoch 3 trained from epoch 2's weights
    kept, _ = epoch_three("keep_best_weights")
    loaded_best, _ = epoch_three("load_best_model")
    loaded, best_path = epoch_three("load_checkpoint")
    assert_state_equal(kept[3], loaded_best[3])  # both: the best weights, the optimizer state training ended with
    assert not all(torch.equal(kept[3][key], undone[3][key]) for key in kept[3])
    continued, weights = make_loop(), EpochEndWeights()
    continued.load_checkpoint(best_path)
    continued.fit(num_epochs=4, callbacks=[weights])
    assert sorted(loaded) == [2, 3] and all(assert_state_equal(loaded[e], weights.states[e]) is None for e in (2, 3))
