"""EarlyStopping, TerminateOnNaN, FunctionOnTrainLoop and DataSubsetTestRun, run inside real TrainLoops."""
import math
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

from aitoolbox.torchtrain.callbacks.basic import (DataSubsetTestRun, EarlyStopping, FirstBatchesIterable,
                                                  FunctionOnTrainLoop, TerminateOnNaN, first_batches_loader)
from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.train_loop import TrainLoop


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
                                         r"'accumulated_loss', 'loss', 'val_loss'\)"):
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
    with pytest.raises(ValueError, match=r"'loss' is not in train_history \(recorded metrics: 'accumulated_loss'\)"):
        tl.fit(num_epochs=1, callbacks=[TerminateOnNaN()])


@pytest.mark.parametrize("monitor", ["", 3])
def test_terminate_on_nan_rejects_bad_monitor(monitor):
    with pytest.raises(ValueError, match="monitor must be the name of a train_history metric"):
        TerminateOnNaN(monitor)


# --- FunctionOnTrainLoop ------------------------------------------------------------------------------------
HOOK_FLAGS = ("tl_registration", "train_begin", "train_end", "epoch_begin", "epoch_end", "batch_begin", "batch_end",
              "after_gradient_update", "after_optimizer_step")


def test_function_on_train_loop_calls_at_the_selected_hooks(make_model, make_loader):
    model = make_model()
    optimizers = [torch.optim.SGD(model.hidden.parameters(), lr=0.01), torch.optim.SGD(model.out.parameters(), lr=0.01)]
    tl = TrainLoop(model, make_loader(num_samples=20), None, None, optimizers, nn.MSELoss(), end_auto_eval=False,
                   show_progress=False)
    counts = Counter()
    seen_loops = set()

    def counter(flag):
        def fn(train_loop):
            seen_loops.add(id(train_loop))
            counts[flag] += 1
        return FunctionOnTrainLoop(fn, **{flag: True})

    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[counter(flag) for flag in HOOK_FLAGS])
    # 2 epochs of 5 batches; steps after batches 2, 4 and 5; two optimizers
    assert counts == {"tl_registration": 1, "train_begin": 1, "train_end": 1, "epoch_begin": 2, "epoch_end": 2,
                      "batch_begin": 10, "batch_end": 10, "after_gradient_update": 20, "after_optimizer_step": 6}
    assert seen_loops == {id(tl)}


def test_function_on_train_loop_order_of_hooks(make_model, make_loader):
    tl = make_loop(make_model(), make_loader(num_samples=4))  # a single batch
    events = []
    callbacks = [FunctionOnTrainLoop(lambda t, flag=flag: events.append(flag), **{flag: True}) for flag in HOOK_FLAGS]
    tl.fit(num_epochs=1, callbacks=callbacks[::-1])
    assert events == ["tl_registration", "train_begin", "epoch_begin", "batch_begin", "after_gradient_update",
                      "after_optimizer_step", "batch_end", "epoch_end", "train_end"]
    assert FunctionOnTrainLoop(print, epoch_end=True, execution_order=7).execution_order == 7


def test_function_on_train_loop_rejects_bad_arguments():
    with pytest.raises(TypeError, match="fn_to_execute must be a function taking the TrainLoop, got 'abc'"):
        FunctionOnTrainLoop("abc", epoch_end=True)
    with pytest.raises(ValueError, match="FunctionOnTrainLoop would never run: set at least one of"):
        FunctionOnTrainLoop(print)


# --- DataSubsetTestRun --------------------------------------------------------------------------------------
def my_collate(batch):
    return default_collate(batch)


def test_data_subset_trains_on_the_first_batches_like_a_hand_loop(make_model, make_loader, hand_train,
                                                                   assert_params_equal):
    tl_model, hand_model = make_model(), make_model()
    tl = make_loop(tl_model, make_loader(shuffle=True, seed=3, collate_fn=my_collate))
    batches = Counter()
    tl.fit(num_epochs=3, grad_accumulation=2,
           callbacks=[DataSubsetTestRun(num_train_batches=3), FunctionOnTrainLoop(lambda t: batches.update([t.epoch]),
                                                                                  batch_begin=True)])
    assert batches == {0: 3, 1: 3, 2: 3}
    optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.05)
    hand_train(hand_model, make_loader(shuffle=True, seed=3), [optimizer], num_epochs=3, grad_accumulation=2,
               max_batches=3)
    assert_params_equal(tl_model, hand_model)


def test_data_subset_keeps_the_loader_options(make_loader):
    loader = make_loader(shuffle=True, num_workers=2, prefetch_factor=3, persistent_workers=True,
                         collate_fn=my_collate, drop_last=True)
    subset = first_batches_loader(loader, 2)
    assert isinstance(subset, DataLoader) and len(subset) == 2
    for option in ("dataset", "num_workers", "prefetch_factor", "persistent_workers", "collate_fn", "generator",
                   "pin_memory", "timeout", "worker_init_fn"):
        assert getattr(subset, option) is getattr(loader, option), option
    assert len(first_batches_loader(loader, 100)) == len(loader) == 9  # drop_last: 38 // 4


def test_data_subset_of_unbatched_and_plain_iterable_loaders(make_loader):
    unbatched = make_loader(batch_size=None)
    subset = first_batches_loader(unbatched, 5)
    assert len(subset) == 5 and [x for x, _ in subset][4].shape == (4,)
    batches = [(torch.full((2, 4), float(i)), torch.zeros(2, 1)) for i in range(6)]
    subset = first_batches_loader(batches, 2)
    assert isinstance(subset, FirstBatchesIterable) and len(subset) == 2
    assert [x[0, 0].item() for x, _ in subset] == [0.0, 1.0] == [x[0, 0].item() for x, _ in subset]


def test_data_subset_validation_and_test_loaders(make_model, make_loader):
    model = make_model()
    val_loader, test_loader = make_loader(num_samples=20, seed=1), make_loader(num_samples=20, seed=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tl = TrainLoop(model, make_loader(), val_loader, test_loader, optimizer, nn.MSELoss(), show_progress=False)
    tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_train_batches=2, num_val_batches=2, num_test_batches=1)])
    assert (len(tl.train_loader), len(tl.validation_loader), len(tl.test_loader)) == (2, 2, 1)
    with torch.no_grad():
        x, y = val_loader.dataset.tensors
        expected_val_loss = nn.functional.mse_loss(model(x[:8]), y[:8]).item()
    assert tl.train_history["val_loss"][0] == pytest.approx(expected_val_loss, rel=1e-6)


def test_data_subset_needs_the_loaders_it_subsets(make_model, make_loader):
    tl = make_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match="keep 1 batch\\(es\\) of the validation_loader, but the TrainLoop has no "
                                         "validation_loader"):
        tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_val_batches=1)])
    tl = make_loop(make_model(), make_loader())
    with pytest.raises(ValueError, match="TrainLoop has no test_loader"):
        tl.fit(num_epochs=1, callbacks=[DataSubsetTestRun(num_test_batches=2)])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_train_batches": 0}, "num_train_batches must be an int >= 1, got 0"),
    ({"num_train_batches": 2.0}, "num_train_batches must be an int >= 1, got 2.0"),
    ({"num_val_batches": -1}, "num_val_batches must be an int >= 0, got -1"),
    ({"num_test_batches": None}, "num_test_batches must be an int >= 0, got None"),
])
def test_data_subset_rejects_bad_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataSubsetTestRun(**kwargs)


def test_monitoring_callbacks_wait_for_the_first_auto_evaluation_with_end_auto_eval_every_n_epochs():
    """With end_auto_eval=2 the loss is first recorded at epoch 1: epoch 0 is not an error."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from aitoolbox.torchtrain.callbacks.basic import EarlyStopping, TerminateOnNaN
    from aitoolbox.torchtrain.model import TTBasicModel
    from aitoolbox.torchtrain.train_loop import TrainLoop

    class Linear(TTBasicModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, x):
            return self.linear(x)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model = Linear()
    tl = TrainLoop(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), end_auto_eval=2, show_progress=False)
    tl.fit(num_epochs=4, callbacks=[EarlyStopping(monitor="val_loss", patience=5), TerminateOnNaN(monitor="loss")])
    assert len(tl.train_history["val_loss"]) == 2
    assert tl.epochs_completed == 4
