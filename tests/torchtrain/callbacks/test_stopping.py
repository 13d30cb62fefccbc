"""EarlyStopping, ThresholdEarlyStopping, TerminateOnNaN and AllPredictionsSame, run inside real TrainLoops."""
import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.basic import FunctionOnTrainLoop
from aitoolbox.torchtrain.callbacks.stopping import (AllPredictionsSame, EarlyStopping, TerminateOnNaN,
                                                     ThresholdEarlyStopping)
from aitoolbox.torchtrain.model import TTBasicModel
from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.conftest import TinyRegressor
from tests.helpers import distinct_records


def make_loop(model, loader, val_loader=None, lr=0.05, end_auto_eval=False, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainLoop(model, loader, val_loader, None, optimizer, nn.MSELoss(), end_auto_eval=end_auto_eval,
                     show_progress=False, **kwargs)


def scripted_metric(name, values_by_epoch):
    """A callback recording ``values_by_epoch[epoch]`` as ``name`` at each epoch end (when the epoch has one)."""
    def record(tl):
        if tl.epoch in values_by_epoch:
            tl.insert_metric_result_into_history(name, values_by_epoch[tl.epoch])
    return FunctionOnTrainLoop(record, epoch_end=True)


# --- EarlyStopping ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, patience, stop_epoch, best_epoch", [
    ([1.0, 0.8, 0.9, 0.85, 0.7, 0.6], 1, 3, 1),
    ([1.0, 0.8, 0.9, 0.85, 0.7, 0.6], 0, 2, 1),
    ([1.0, 0.8, 0.9, 0.7, 0.75, 0.76, 0.77, 0.5], 2, 6, 3),
])
def test_early_stopping_stops_after_patience_epochs_without_improvement(make_model, make_loader, values, patience,
                                                                         stop_epoch, best_epoch):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    early_stopping = EarlyStopping(monitor="val_loss", patience=patience)
    # the scripted metric is registered after EarlyStopping: execution_order 99 still runs EarlyStopping last
    tl.fit(num_epochs=len(values), callbacks=[early_stopping, scripted_metric("val_loss", dict(enumerate(values)))])
    assert tl.epoch == stop_epoch
    assert len(tl.train_history["accumulated_loss"]) == stop_epoch + 1
    assert early_stopping.best_epoch == best_epoch
    assert early_stopping.best_performance == min(values[:stop_epoch + 1])


def test_early_stopping_runs_to_the_end_while_improving(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    tl.fit(num_epochs=4, callbacks=[EarlyStopping(), scripted_metric("val_loss", {0: 4., 1: 3., 2: 2., 3: 1.})])
    assert len(tl.train_history["accumulated_loss"]) == 4


def test_early_stopping_higher_is_better_for_other_metrics(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    early_stopping = EarlyStopping(monitor="val_Accuracy")
    assert early_stopping.mode == "max"
    tl.fit(num_epochs=5, callbacks=[early_stopping, scripted_metric("val_Accuracy", dict(enumerate([.5, .6, .6, .7])))])
    assert tl.epoch == 2 and early_stopping.best_performance == 0.6


def test_early_stopping_explicit_mode_overrides_the_name(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    early_stopping = EarlyStopping(monitor="val_Accuracy", mode="min")
    tl.fit(num_epochs=5, callbacks=[early_stopping, scripted_metric("val_Accuracy", dict(enumerate([.5, .4, .6])))])
    assert tl.epoch == 2 and early_stopping.best_performance == 0.4


def test_early_stopping_min_delta(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    tl.fit(num_epochs=5, callbacks=[EarlyStopping(min_delta=0.1), scripted_metric("val_loss", {0: 1., 1: .95, 2: .5})])
    assert tl.epoch == 1  # 0.95 is better than 1.0, but by less than min_delta


def test_early_stopping_ignores_epochs_without_a_new_value(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    tl.fit(num_epochs=8, callbacks=[EarlyStopping(patience=0), scripted_metric("val_loss", {0: 1., 2: .9, 4: .95})])
    assert tl.epoch == 4


def test_early_stopping_on_the_loops_val_loss(make_model, make_loader):
    # lr=0: the validation loss never changes, so it never improves
    tl = make_loop(make_model(), make_loader(num_samples=8), make_loader(num_samples=8, seed=1), lr=0.0,
                   end_auto_eval=True)
    tl.fit(num_epochs=10, callbacks=[EarlyStopping(patience=2)])
    assert len(tl.train_history["val_loss"]) == 4 and tl.epoch == 3


def test_early_stopping_missing_metric_names_the_recorded_ones(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=8), make_loader(num_samples=8, seed=1), end_auto_eval=True)
    with pytest.raises(ValueError, match=r"'val_Accuracy' is not in train_history \(recorded metrics: "
                                         r"'loss', 'accumulated_loss', 'val_loss'\)"):
        tl.fit(num_epochs=2, callbacks=[EarlyStopping(monitor="val_Accuracy")])


@pytest.mark.parametrize("kwargs, message", [
    ({"monitor": ""}, "monitor must be the name"),
    ({"monitor": None}, "monitor must be the name"),
    ({"min_delta": -0.1}, r"min_delta must be a number >= 0, got -0.1"),
    ({"min_delta": "0.1"}, r"min_delta must be a number >= 0, got '0.1'"),
    ({"patience": -1}, r"patience must be an int >= 0 .*got -1"),
    ({"patience": 1.5}, r"patience must be an int >= 0 .*got 1.5"),
    ({"mode": "bigger"}, r"mode must be one of \('auto', 'min', 'max'\), got 'bigger'"),
])
def test_early_stopping_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)


# --- TerminateOnNaN -----------------------------------------------------------------------------------------
def test_terminate_on_nan_stops_when_the_loss_diverges(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(), lr=1e18, end_auto_eval=True)
    tl.fit(num_epochs=20, callbacks=[TerminateOnNaN()])
    losses = tl.train_history["loss"]
    assert len(losses) < 20
    assert not math.isfinite(losses[-1]) and all(math.isfinite(loss) for loss in losses[:-1])
    assert tl.epoch == len(losses) - 1


def test_terminate_on_nan_is_not_fooled_by_a_skipped_fp16_step(make_model, make_loader, inf_loss_on_batches):
    tl = make_loop(inf_loss_on_batches(make_model(), {3}), make_loader(), end_auto_eval=True, use_amp=True)
    tl.precision = Precision("cpu", torch.bfloat16, LossScaler("dynamic"))
    tl.fit(num_epochs=3, callbacks=[TerminateOnNaN("loss")])
    assert tl.precision.loss_scaler.loss_scale == 2.0 ** 15  # the overflow step was skipped once
    assert math.isinf(tl.train_history["accumulated_loss"][0])
    assert len(tl.train_history["loss"]) == 3 and all(math.isfinite(v) for v in tl.train_history["loss"])

    # the running batch mean does see it
    tl = make_loop(inf_loss_on_batches(make_model(), {3}), make_loader(), end_auto_eval=True, use_amp=True)
    tl.precision = Precision("cpu", torch.bfloat16, LossScaler("dynamic"))
    tl.fit(num_epochs=3, callbacks=[TerminateOnNaN("accumulated_loss")])
    assert len(tl.train_history["accumulated_loss"]) == 1


def test_terminate_on_nan_missing_metric(make_model, make_loader):
    tl = make_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match=r"'loss' is not in train_history \(recorded metrics: 'loss', "
                                         r"'accumulated_loss'\)"):
        tl.fit(num_epochs=1, callbacks=[TerminateOnNaN()])


@pytest.mark.parametrize("monitor", ["", 3])
def test_terminate_on_nan_rejects_bad_monitor(monitor):
    with pytest.raises(ValueError, match="monitor must be the name of a train_history metric"):
        TerminateOnNaN(monitor)


def keras_early_stopping(values, patience, mode, min_delta=0.0):
    """Keras's rule, the reference: the best starts at +-inf and a NaN never improves on it. Returns (the epoch
    training stops at or None, the best epoch or None, the best value or None)."""
    best, best_epoch, wait = (math.inf if mode == "min" else -math.inf), None, 0
    for epoch, value in enumerate(values):
        improved = value + min_delta < best if mode == "min" else value - min_delta > best
        if improved and not math.isnan(value):
            best, best_epoch, wait = value, epoch, 0
            continue
        wait += 1
        if wait > patience:
            return epoch, best_epoch, (None if best_epoch is None else best)
    return None, best_epoch, (None if best_epoch is None else best)


def tiny_loop():
    torch.manual_seed(0)
    model = TinyRegressor()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    return make_loop(model, loader)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(st.one_of(st.just(math.nan), st.floats(-2, 2, allow_nan=False, allow_infinity=False)),
                       min_size=1, max_size=6),
       patience=st.integers(0, 2), mode=st.sampled_from(["min", "max"]))
def test_early_stopping_follows_keras_and_a_nan_is_never_the_best(values, patience, mode):
    """Review of issue 35, D3: a NaN first value became the best for good (and restore_best_weights restored it)."""
    tl = tiny_loop()
    early_stopping = EarlyStopping("val_score", patience=patience, mode=mode)
    tl.fit(num_epochs=len(values), callbacks=[early_stopping, scripted_metric("val_score", dict(enumerate(values)))])
    stop_epoch, best_epoch, best = keras_early_stopping(values, patience, mode)
    assert tl.epochs_completed == (len(values) if stop_epoch is None else stop_epoch + 1)
    assert early_stopping.best_performance == best
    if best_epoch is not None:
        assert early_stopping.best_epoch == best_epoch


def test_early_stopping_stopping_with_no_finite_value_says_so(make_model, make_loader, caplog):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    package_logger = logging.getLogger("aitoolbox")  # it need not propagate to the root logger caplog watches
    package_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="aitoolbox"):
            tl.fit(num_epochs=4, callbacks=[EarlyStopping("val_loss", patience=1),
                                            scripted_metric("val_loss", {0: math.nan, 1: math.nan, 2: 1.0})])
    finally:
        package_logger.removeHandler(caplog.handler)
    assert tl.epochs_completed == 2
    (stop,) = [record.getMessage() for record in caplog.records if "Stopping training" in record.getMessage()]
    assert stop.endswith("stopped at epoch 2, no epoch had a finite val_loss")


# --- ThresholdEarlyStopping ---------------------------------------------------------------------------------
@pytest.mark.parametrize("monitor, values, patience, stop_epoch, counts", [
    # lower is better: above the threshold misses it
    ("val_loss", [0.6, 0.8, 0.6, 0.75, 0.5], 0, 1, [0, -1]),
    ("val_loss", [0.9, 0.6, 0.8, 0.9, 0.95], 1, 3, [0, 1, 0, -1]),
    # higher is better: below the threshold misses it; reaching it resets the count
    ("val_Accuracy", [0.6, 0.8, 0.6, 0.6, 0.6], 1, 3, [0, 1, 0, -1]),
    ("val_Accuracy", [0.7, 0.71, 0.9], 0, None, [0, 0, 0]),
])
def test_threshold_early_stopping(make_model, make_loader, monitor, values, patience, stop_epoch, counts):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    stopper = ThresholdEarlyStopping(monitor, threshold=0.7, patience=patience)
    seen = []
    recorder = FunctionOnTrainLoop(lambda t: seen.append(stopper.patience_count), epoch_end=True, execution_order=100)
    tl.fit(num_epochs=len(values), callbacks=[stopper, scripted_metric(monitor, dict(enumerate(values))), recorder])
    assert seen == counts
    assert tl.epochs_completed == (len(values) if stop_epoch is None else stop_epoch + 1)


@pytest.mark.parametrize("monitor", ["val_loss", "val_Accuracy"])
def test_threshold_early_stopping_counts_a_nan_as_missing_the_threshold(make_model, make_loader, monitor):
    tl = make_loop(make_model(), make_loader(num_samples=8))
    tl.fit(num_epochs=3, callbacks=[ThresholdEarlyStopping(monitor, threshold=0.7, patience=0),
                                    scripted_metric(monitor, {0: math.nan, 1: 0.7, 2: 0.7})])
    assert tl.epochs_completed == 1


def test_threshold_early_stopping_mode_and_arguments():
    assert ThresholdEarlyStopping("val_error", 0.1).mode == "min"
    assert ThresholdEarlyStopping("val_error", 0.1, mode="max").mode == "max"
    with pytest.raises(ValueError, match="threshold must be a number"):
        ThresholdEarlyStopping("val_loss", "0.1")
    with pytest.raises(ValueError, match="patience must be an int >= 0"):
        ThresholdEarlyStopping("val_loss", 0.1, patience=-1)


# --- AllPredictionsSame -------------------------------------------------------------------------------------
class ConstantPredictor(TTBasicModel):
    """Predicts ``value`` for every sample, whatever its weights."""

    def __init__(self, value):
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.value = value

    def forward(self, x):
        return self.linear(x) * 0 + self.value


@pytest.mark.parametrize("value, stop_training, expect_stop", [(0.0, True, True), (0.0, False, False),
                                                                (1.0, True, False)])
def test_all_predictions_same(caplog, monkeypatch, value, stop_training, expect_stop):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger keeps to itself
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model = ConstantPredictor(0.0)
    tl = TrainLoop(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    with caplog.at_level("WARNING", logger="aitoolbox.torchtrain.callbacks.stopping"):
        tl.fit(num_epochs=3, callbacks=[AllPredictionsSame(value=value, stop_training=stop_training)])
    assert tl.epochs_completed == (1 if expect_stop else 3)
    warned = [record for record in distinct_records(caplog) if "All the validation predictions" in record.getMessage()]
    assert len(warned) == (0 if value == 1.0 else tl.epochs_completed)


def test_all_predictions_same_on_arrays_and_lists():
    from aitoolbox.torchtrain.callbacks.stopping import all_equal_to
    import numpy as np
    assert all_equal_to(np.zeros(4), 0.0) and not all_equal_to(np.array([0.0, 1.0]), 0.0)
    assert all_equal_to([2, 2], 2) and not all_equal_to([2, 3], 2)
    assert all_equal_to(torch.zeros(3, 1), 0.0)


class Linear(TTBasicModel):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x):
        return self.linear(x)


def test_monitoring_callbacks_wait_for_the_first_auto_evaluation_with_end_auto_eval_every_n_epochs():
    """With end_auto_eval=2 the loss is first recorded at epoch 1: epoch 0 is not an error."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model = Linear()
    tl = TrainLoop(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), end_auto_eval=2, show_progress=False)
    tl.fit(num_epochs=4, callbacks=[EarlyStopping(monitor="val_loss", patience=5), TerminateOnNaN(monitor="loss")])
    assert len(tl.train_history["val_loss"]) == 2
    assert tl.epochs_completed == 4
