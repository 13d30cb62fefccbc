"""TrainLoop as an aitoolbox 1.8 user drives it: the loop's attributes and methods that 1.x scripts and callbacks
call, ``use_amp`` as a dict of ``torch.amp.GradScaler`` arguments, and MultiLoss with MultiOptimizer.

The numerical checks compare with hand-written PyTorch loops in 1.x's order of operations, bitwise.
"""
import copy
import datetime
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler, StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    INIT_SEED, MLP, SCALER_ARGS, TRAIN_SEED, assert_params_equal, classification_data, default_device,
    model_pair, params_differ, reference_fit, seeded_loader, single_torch_thread,
)

# 30 samples in batches of 8: 4 batches per epoch, the last of 6 samples.
NUM_SAMPLES, BATCH_SIZE, BATCHES_PER_EPOCH = 30, 8, 4


one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make_loop(model, optimizer=None, validation=False, test=False, **kwargs):
    data = classification_data(NUM_SAMPLES)
    kwargs.setdefault("end_auto_eval", False)
    return TrainLoop(model, seeded_loader(data, BATCH_SIZE),
                     seeded_loader(classification_data(14, seed=3), 5, shuffle=False) if validation else None,
                     seeded_loader(classification_data(11, seed=4), 4, shuffle=False) if test else None,
                     optimizer if optimizer is not None else sgd(model), nn.CrossEntropyLoss(), show_progress=False,
                     **kwargs)


def low_precision_dtype(device: torch.device) -> torch.dtype:
    """The dtype TrainLoop autocasts to for a GradScaler-arguments ``use_amp``: bfloat16 on CPUs, float16 on GPUs."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


class Recorder(AbstractCallback):
    """A 1.x-style callback that reads the loop's state through ``self.train_loop_obj`` at every hook."""

    def __init__(self):
        super().__init__("1.x-style recorder")
        self.at_registration = {}
        self.batch_begin_indices = []
        self.update_flags = []
        self.steps = []
        self.scales = []
        self.main_process_calls = []

    def on_train_loop_registration(self):
        tl = self.train_loop_obj
        self.at_registration = {"num_training_steps": tl.get_num_training_steps(), "num_epochs": tl.num_epochs,
                                "num_iterations": tl.num_iterations, "grad_accumulation": tl.grad_accumulation}

    def on_batch_begin(self):
        self.batch_begin_indices.append(self.train_loop_obj.total_iteration_idx)
        self.main_process_calls.append(self.train_loop_obj.is_main_process())

    def on_after_gradient_update(self, optimizer_idx):
        self.update_flags.append((self.train_loop_obj.epoch, self.train_loop_obj.iteration,
                                  self.train_loop_obj.should_execute_optimizer_update()))

    def on_after_optimizer_step(self):
        self.steps.append((self.train_loop_obj.epoch, self.train_loop_obj.iteration))

    def on_batch_end(self):
        self.scales.append(self.train_loop_obj.amp_scaler.get_scale())


# --- 1. is_main_process ----------------------------------------------------------------------------------------
def test_is_main_process_is_callable_truthy_and_pickles_as_a_plain_bool():
    tl = make_loop(MLP())
    assert tl.is_main_process() is True  # 1.x: a method
    if not tl.is_main_process:  # 1.x code also reads it as an attribute
        pytest.fail("is_main_process reads as False in a single process")
    assert bool(tl.is_main_process) and tl.is_main_process == True  # noqa: E712 (what 1.x code writes)
    restored = pickle.loads(pickle.dumps(tl.is_main_process))
    assert restored is True
    recorder = Recorder()
    tl.fit(num_epochs=1, callbacks=[recorder])
    assert recorder.main_process_calls == [True] * BATCHES_PER_EPOCH


# --- 2. counters -----------------------------------------------------------------------------------------------
def test_counters_before_and_after_fit_by_epochs():
    tl = make_loop(MLP())
    assert tl.total_iteration_idx == -1  # 1.x: incremented at the start of each batch
    recorder = Recorder()
    tl.fit(num_epochs=3, callbacks=[recorder])
    assert recorder.batch_begin_indices == list(range(3 * BATCHES_PER_EPOCH))
    assert tl.total_iteration_idx == 3 * BATCHES_PER_EPOCH - 1  # the index of the last batch
    assert tl.epoch == 2
    assert tl.iteration == BATCHES_PER_EPOCH - 1
    assert (tl.num_epochs, tl.num_iterations, tl.grad_accumulation) == (3, 0, 1)


def test_counters_after_fit_by_iterations():
    tl = make_loop(MLP())
    recorder = Recorder()
    tl.fit(num_iterations=6, callbacks=[recorder], grad_accumulation=2)
    assert recorder.batch_begin_indices == list(range(6))
    assert tl.total_iteration_idx == 5
    assert tl.epoch == 1 and tl.iteration == 1  # the sixth batch is the second of epoch 1
    assert (tl.num_iterations, tl.grad_accumulation) == (6, 2)


def test_num_epochs_after_fit_by_iterations_is_the_number_of_epochs_touched():
    tl = make_loop(MLP())
    tl.fit(num_iterations=6)
    assert tl.num_epochs == math.ceil(6 / BATCHES_PER_EPOCH) == 2


# --- 3. should_execute_optimizer_update, get_schedulers, get_num_training_steps, experiment_timestamp ----------
def test_should_execute_optimizer_update_in_a_1x_callback_with_grad_accumulation():
    tl = make_loop(MLP())
    recorder = Recorder()
    tl.fit(num_epochs=2, callbacks=[recorder], grad_accumulation=3)
    # aitoolbox 1.8's rule: every grad_accumulation-th batch, and the last batch of the epoch.
    expected = [(epoch, i, (i + 1) % 3 == 0 or i == BATCHES_PER_EPOCH - 1)
                for epoch in range(2) for i in range(BATCHES_PER_EPOCH)]
    assert recorder.update_flags == expected
    assert recorder.steps == [(epoch, i) for epoch, i, update in expected if update]
    assert tl.should_execute_optimizer_update() is True  # as in 1.x: tl.iteration is the last batch of the epoch


def test_get_schedulers_returns_the_scheduler_callbacks_in_order():
    tl = make_loop(MLP())
    step_lr = StepLRScheduler(step_size=1, gamma=0.5)
    lambda_lr = LambdaLRScheduler(lr_lambda=lambda epoch: 1.0)
    tl.fit(num_epochs=1, callbacks=[Recorder(), step_lr, lambda_lr])
    schedulers = tl.get_schedulers()
    assert len(schedulers) == 2
    assert schedulers[0] is step_lr and schedulers[1] is lambda_lr
    assert step_lr.scheduler.last_epoch == 1  # stepped at the end of the epoch


@pytest.mark.parametrize("fit_kwargs", [
    {"num_epochs": 2}, {"num_epochs": 2, "grad_accumulation": 3}, {"num_epochs": 2, "grad_accumulation": 4},
    {"num_epochs": 3, "grad_accumulation": 5}, {"num_iterations": 10}, {"num_iterations": 10, "grad_accumulation": 3},
    {"num_iterations": 7, "grad_accumulation": 2}, {"num_iterations": 3, "grad_accumulation": 4}])
def test_get_num_training_steps_equals_the_steps_the_loop_takes(fit_kwargs):
    """Known when fit registers the callbacks, and equal to the optimizer steps counted during training (an epoch
    of 4 batches with accumulation 3 takes 2 steps: aitoolbox 1.x's floor said 1, and 0 for accumulation 5)."""
    tl = make_loop(MLP())
    recorder = Recorder()
    tl.fit(callbacks=[recorder], **fit_kwargs)
    assert recorder.at_registration["num_training_steps"] == len(recorder.steps) > 0
    assert recorder.at_registration["grad_accumulation"] == fit_kwargs.get("grad_accumulation", 1)
    assert tl.get_num_training_steps() == len(recorder.steps)


def test_experiment_timestamp_on_a_plain_train_loop():
    before = datetime.datetime.now().replace(microsecond=0)
    tl = make_loop(MLP())
    after = datetime.datetime.now()
    stamp = tl.experiment_timestamp
    assert before <= datetime.datetime.strptime(stamp, "%Y-%m-%d_%H-%M-%S") <= after
    tl.fit(num_epochs=1)
    assert tl.experiment_timestamp == stamp  # one run, one timestamp


# --- 4. use_amp: torch.amp.GradScaler arguments -----------------------------------------------------------------
def reference_grad_scaler_fit(model, num_epochs, scaler_args, grad_accumulation=1, clip=None):
    """1.8's AMP loop written out: autocast forward, scaled backward, unscale_ + clipping, scaler.step, update.

    Returns the loss scale after every batch and the gradient norms seen at each clipping.
    """
    device = default_device()
    model.to(device).train()
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler(device.type, **scaler_args)
    criterion = nn.CrossEntropyLoss()
    loader = seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE)
    scales, norms = [], []
    torch.manual_seed(TRAIN_SEED)
    for _ in range(num_epochs):
        for i, (x, y) in enumerate(loader):
            with torch.autocast(device_type=device.type, dtype=low_precision_dtype(device)):
                loss = criterion(model(x.to(device)), y.to(device)) / grad_accumulation
            scaler.scale(loss).backward()
            if (i + 1) % grad_accumulation == 0 or i == len(loader) - 1:
                if clip is not None:
                    scaler.unscale_(optimizer)
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
                    torch.nn.utils.clip_grad_value_(model.parameters(), clip / 20)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            scales.append(scaler.get_scale())
    return scaler, scales, norms


def test_grad_scaler_arguments_train_like_autocast_with_a_grad_scaler():
    model, reference = model_pair()
    tl = make_loop(model, use_amp=dict(SCALER_ARGS))
    assert tl.amp_scaler.is_enabled()
    assert tl.amp_scaler.get_scale() == 2.0 ** 10
    recorder = Recorder()
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, callbacks=[recorder])
    scaler, reference_scales, _ = reference_grad_scaler_fit(reference, 2, SCALER_ARGS)
    assert params_differ(model, model_pair()[0])
    # The power-of-two scale cancels exactly, and both unscale with the same kernel: bitwise equal.
    assert_params_equal(model, reference)
    # GradScaler's rule: x2 after every 3 steps without inf/NaN (8 steps here, one per batch).
    assert recorder.scales == [2.0 ** 10 * 2 ** (step // 3) for step in range(1, 9)] == reference_scales
    state = tl.amp_scaler.state_dict()
    assert state == scaler.state_dict()  # same keys and values: scale, factors, interval, _growth_tracker
    assert state["_growth_tracker"] == 8 % 3


def test_grad_scaler_state_dict_loads_into_torch_grad_scaler():
    tl = make_loop(MLP(), use_amp={"init_scale": 2.0 ** 12, "growth_factor": 4.0, "backoff_factor": 0.25,
                                   "growth_interval": 2})
    tl.fit(num_epochs=1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(tl.amp_scaler.state_dict())
    assert scaler.get_scale() == 2.0 ** 12 * 4 ** 2  # 4 steps, grown twice by 4
    assert scaler.get_growth_factor() == 4.0 and scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 2


@pytest.mark.parametrize("saved", [
    {"scale": 2.0 ** 9, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 1},
    {"scale": 2.0 ** 9}], ids=["GradScaler state", "scale only"])
def test_a_grad_scaler_state_loaded_before_fit_is_where_the_scaling_goes_on(saved):
    """1.x's ``tl.amp_scaler.load_state_dict(GradScaler state)`` before fit: the fit's scaling goes on from that scale,
    those factors, interval and growth tracker (a key the state lacks keeps the loop's value; the tracker starts at 0),
    as GradScaler's rule: after 4 steps without overflow the state is the one computed here by hand."""
    tl = make_loop(MLP(), use_amp=dict(SCALER_ARGS))
    tl.amp_scaler.load_state_dict(dict(saved))
    tl.fit(num_epochs=1)  # 4 steps, none skipped
    expected = {"scale": saved["scale"], "growth_factor": saved.get("growth_factor", 2.0),
                "backoff_factor": saved.get("backoff_factor", 0.5),
                "growth_interval": saved.get("growth_interval", SCALER_ARGS["growth_interval"]),
                "_growth_tracker": saved.get("_growth_tracker", 0)}
    for _ in range(BATCHES_PER_EPOCH):
        expected["_growth_tracker"] += 1
        if expected["_growth_tracker"] == expected["growth_interval"]:
            expected["scale"] *= expected["growth_factor"]
            expected["_growth_tracker"] = 0
    assert tl.amp_scaler.state_dict() == expected


def test_a_state_without_a_scale_is_refused():
    tl = make_loop(MLP(), use_amp=dict(SCALER_ARGS))
    with pytest.raises(ValueError, match="no 'scale' key"):
        tl.amp_scaler.load_state_dict({"loss_scale": 2.0 ** 9})


def test_grad_scaler_and_amp_initialize_keys_together_are_refused():
    with pytest.raises(ValueError, match="opt_level"):
        make_loop(MLP(), use_amp={"init_scale": 2.0 ** 10, "opt_level": "O1"})


def test_an_opt_level_string_is_refused_with_the_dict_to_pass():
    with pytest.raises(TypeError, match=r"\{'opt_level': 'O1'\}"):
        make_loop(MLP(), use_amp="O1")


@pytest.mark.parametrize("use_amp", [{"enabled": False}, {"init_scale": 2.0 ** 10, "enabled": False}])
def test_a_disabled_grad_scaler_trains_in_full_precision(use_amp):
    model, reference = model_pair()
    tl = make_loop(model, use_amp=use_amp)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2)
    loader = seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE)
    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, loader, [sgd(reference)], nn.CrossEntropyLoss(), num_epochs=2)
    assert_params_equal(model, reference)
    assert not tl.amp_scaler.is_enabled()
    assert tl.amp_scaler.get_scale() == 1.0 and tl.amp_scaler.state_dict() == {}  # as a disabled GradScaler


def test_amp_initialize_arguments_still_work():
    model = MLP()
    initial = copy.deepcopy(model)
    tl = make_loop(model, use_amp={"opt_level": "O2"}, validation=True, end_auto_eval=True)
    tl.fit(num_epochs=2)
    assert params_differ(model, initial)
    assert all(math.isfinite(value) for value in tl.train_history["val_loss"])
    assert len(tl.train_history["loss"]) == 2
    assert all(value.dtype == torch.float32 for value in model.state_dict().values())  # float32 weights to save


# --- 5. a 1.8-style gradient clipping callback under loss scaling ----------------------------------------------
class ClipGradNorm18(AbstractCallback):
    """Gradient clipping as 1.8's callbacks do it: unscale through ``amp_scaler``, then clip, before the step."""

    def __init__(self, max_norm):
        super().__init__("1.8-style gradient norm clipping")
        self.max_norm = max_norm
        self.norms = []

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if tl.should_execute_optimizer_update():
            tl.amp_scaler.unscale_(tl.optimizer)
            self.norms.append(torch.nn.utils.clip_grad_norm_(tl.model.parameters(), self.max_norm))


class ClipGradValue18(AbstractCallback):
    """A second clipping callback that unscales again: the gradients must not be divided twice."""

    def __init__(self, max_value):
        super().__init__("1.8-style gradient value clipping", execution_order=1)
        self.max_value = max_value

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if tl.should_execute_optimizer_update():
            tl.amp_scaler.unscale_(tl.optimizer)
            torch.nn.utils.clip_grad_value_(tl.model.parameters(), self.max_value)


def test_a_1x_clipping_callback_unscales_the_gradients_exactly_once():
    model, reference = model_pair()
    max_norm = 0.05  # well below the gradient norms (~0.5): clipping changes every step
    tl = make_loop(model, use_amp=dict(SCALER_ARGS))
    norm_clip = ClipGradNorm18(max_norm)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, callbacks=[norm_clip, ClipGradValue18(max_norm / 20)], grad_accumulation=2)
    scaler, _, reference_norms = reference_grad_scaler_fit(reference, 2, SCALER_ARGS, grad_accumulation=2,
                                                           clip=max_norm)
    assert len(norm_clip.norms) == 4 and all(norm > max_norm for norm in norm_clip.norms)
    assert [n.item() for n in norm_clip.norms] == [n.item() for n in reference_norms]  # true (unscaled) norms
    assert_params_equal(model, reference)
    assert tl.amp_scaler.state_dict() == scaler.state_dict()


# --- 6. evaluate and predict -----------------------------------------------------------------------------------
class CountingMLP(MLP):
    """Counts ``get_loss_eval`` calls (one per evaluated batch)."""

    def __init__(self):
        super().__init__()
        self.eval_batches = 0

    def get_loss_eval(self, batch_data, criterion, device):
        self.eval_batches += 1
        return self.get_loss(batch_data, criterion, device)


def expected_loss(model, loader) -> float:
    """The mean loss per sample over ``loader``, computed in one pass over all its samples."""
    batches = list(loader)  # one pass: a shuffling loader draws a new order each time
    x = torch.cat([batch[0] for batch in batches])
    y = torch.cat([batch[1] for batch in batches])
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    model.train()
    return loss.item()


@pytest.mark.parametrize("which", ["train", "validation", "test"])
def test_evaluate_loss_returns_a_float64_scalar_tensor_or_a_float(which):
    torch.manual_seed(INIT_SEED)
    model = MLP()
    tl = make_loop(model, validation=True, test=True)
    evaluate = getattr(tl, f"evaluate_loss_on_{which}_set")
    loss = evaluate()
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.dtype == torch.float64
    as_float = evaluate(float_dict_format=True)
    assert type(as_float) is float and as_float == loss.item()
    loader = {"train": tl.train_loader, "validation": tl.validation_loader, "test": tl.test_loader}[which]
    assert as_float == pytest.approx(expected_loss(model, loader), rel=1e-6)


def test_the_evaluated_loss_is_cached_within_an_iteration():
    model = CountingMLP()
    tl = make_loop(model, validation=True)  # 14 validation samples in batches of 5: 3 batches
    first = tl.evaluate_loss_on_validation_set()
    assert model.eval_batches == 3
    assert torch.equal(tl.evaluate_loss_on_validation_set(), first) and model.eval_batches == 3  # cached
    tl.evaluate_loss_on_validation_set(float_dict_format=True)
    assert model.eval_batches == 3
    assert torch.equal(tl.evaluate_loss_on_validation_set(force_prediction=True), first)
    assert model.eval_batches == 6  # recomputed
    tl.fit(num_epochs=1)  # a new iteration: the cache no longer applies
    assert model.eval_batches == 6  # end_auto_eval=False: no evaluation during fit
    after = tl.evaluate_loss_on_validation_set()
    assert model.eval_batches == 9 and not torch.equal(after, first)


def test_a_callback_evaluating_at_epoch_end_shares_the_automatic_evaluation():
    class ValLossReader(AbstractCallback):
        def __init__(self):
            super().__init__("reads val_loss", execution_order=5)
            self.values = []

        def on_epoch_end(self):
            self.values.append(self.train_loop_obj.evaluate_loss_on_validation_set(float_dict_format=True))

    model = CountingMLP()
    tl = make_loop(model, validation=True, end_auto_eval=True)
    reader = ValLossReader()
    tl.fit(num_epochs=2, callbacks=[reader])
    assert reader.values == tl.train_history["val_loss"]
    assert model.eval_batches == 2 * (BATCHES_PER_EPOCH + 3)  # train and validation sets, once per epoch


def test_evaluate_model_loss_on_any_loader():
    model = CountingMLP()
    tl = make_loop(model, test=True)
    loss = tl.evaluate_model_loss(tl.test_loader, move_to_cpu=True)
    assert loss.dim() == 0 and loss.dtype == torch.float64 and loss.device.type == "cpu"
    assert model.eval_batches == 3  # 11 samples in batches of 4
    assert torch.equal(tl.evaluate_model_loss(tl.test_loader, dataset_info={"type": "test"}).cpu(), loss)
    assert model.eval_batches == 6  # not cached
    assert loss.item() == pytest.approx(expected_loss(model, tl.test_loader), rel=1e-6)


class PredictionCounter(AbstractCallback):
    def __init__(self):
        super().__init__("counts predicted batches")
        self.calls = []

    def on_after_batch_prediction(self, y_pred_batch, y_test_batch, metadata_batch, dataset_info):
        self.calls.append((len(y_pred_batch), dataset_info))


def test_predict_on_a_set_calls_on_after_batch_prediction_only_when_asked():
    torch.manual_seed(INIT_SEED)
    model = MLP()
    tl = make_loop(model, validation=True)
    counter = PredictionCounter()
    tl.callbacks_handler.register_callbacks([counter])
    y_pred, y_true, metadata = tl.predict_on_validation_set(execute_callbacks=True)
    assert [size for size, _ in counter.calls] == [5, 5, 4]
    assert all(info["type"] == "validation" for _, info in counter.calls)
    x, y = classification_data(14, seed=3).tensors
    model.eval()
    with torch.no_grad():
        assert torch.equal(y_pred, model(x.to(tl.device)).argmax(dim=1).cpu())
    assert torch.equal(y_true, y) and metadata is None
    tl.predict_on_validation_set(force_prediction=True)  # execute_callbacks=False is the default
    tl.predict_on_train_set()
    assert len(counter.calls) == 3


def test_predict_with_model_on_any_loader():
    model = MLP()
    tl = make_loop(model)
    counter = PredictionCounter()
    tl.callbacks_handler.register_callbacks([counter])
    loader = seeded_loader(classification_data(9, seed=5), 4, shuffle=False)
    y_pred, y_true, _ = tl.predict_with_model(loader)
    assert y_pred.shape == y_true.shape == (9,) and counter.calls == []
    again, _, _ = tl.predict_with_model(loader, execute_callbacks=True, move_to_cpu=True,
                                        dataset_info={"type": "custom"})
    assert torch.equal(again, y_pred)
    assert counter.calls == [(4, {"type": "custom"}), (4, {"type": "custom"}), (1, {"type": "custom"})]


# --- 7. a TrainLoop that only predicts -------------------------------------------------------------------------
def test_a_predict_only_train_loop_predicts_and_evaluates_but_does_not_fit():
    model = MLP()
    initial = copy.deepcopy(model)
    test_loader = seeded_loader(classification_data(11, seed=4), 4, shuffle=False)
    tl = TrainLoop(model, None, None, test_loader, None, nn.CrossEntropyLoss())
    assert tl.model is model
    y_pred, y_true, _ = tl.predict_on_test_set()
    assert y_pred.shape == (11,)
    loss = tl.evaluate_loss_on_test_set()
    assert loss.dtype == torch.float64 and loss.item() == pytest.approx(expected_loss(model, test_loader), rel=1e-6)
    with pytest.raises(ValueError, match="train_loader and no optimizer"):
        tl.fit(num_epochs=1)
    assert_params_equal(model, initial)


def test_a_train_loop_without_an_optimizer_names_only_that():
    tl = make_loop(MLP())
    tl_no_optimizer = TrainLoop(tl.model, tl.train_loader, None, None, None, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="no optimizer") as error:
        tl_no_optimizer.fit(num_epochs=1)
    assert "train_loader" not in str(error.value)


# --- 8. MultiLoss and MultiOptimizer -------------------------------------------------------------------------
class TwoLossMLP(MLP):
    """Returns two losses of the same output: both depend on every parameter."""

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0].to(device), batch_data[1].to(device)
        out = self(x)
        return MultiLoss({"loss_1": criterion(out, y), "loss_2": (out.float() ** 2).mean()})

    def get_loss_eval(self, batch_data, criterion, device):
        return self.get_loss(batch_data, criterion, device)


def two_optimizers(model):
    """Disjoint parameter groups: the first layer for optimizer 0, the second for optimizer 1."""
    return [torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(model.fc2.parameters(), lr=0.01)]


def two_loss_pair():
    torch.manual_seed(INIT_SEED)
    model = TwoLossMLP()
    return model, copy.deepcopy(model)


def reference_multi_loss_fit(model, optimizers, num_epochs, grad_accumulation=1, scaler_args=None,
                             loss_weights=None):
    """1.x's MultiLoss order: per optimizer i: backward(loss_i) (graph kept while more follow), step_i, zero_grad_i;
    with a GradScaler, ``update`` once per iteration after all optimizers stepped. ``loss_weights``: loss i is
    back-propagated times ``loss_weights[i]`` (after the division by ``grad_accumulation``, as a MultiLoss subclass's
    backward weighs the loss the loop divided)."""
    device = default_device()
    model.to(device).train()
    scaler = torch.amp.GradScaler(device.type, **(scaler_args or {}), enabled=scaler_args is not None)
    criterion = nn.CrossEntropyLoss()
    loader = seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE)
    torch.manual_seed(TRAIN_SEED)
    for _ in range(num_epochs):
        for i, (x, y) in enumerate(loader):
            with torch.autocast(device_type=device.type, dtype=low_precision_dtype(device),
                                enabled=scaler_args is not None):
                out = model(x.to(device))
                losses = [criterion(out, y.to(device)), (out.float() ** 2).mean()]
            update = (i + 1) % grad_accumulation == 0 or i == len(loader) - 1
            for k, (loss, optimizer) in enumerate(zip(losses, optimizers)):
                if grad_accumulation > 1:
                    loss = loss / grad_accumulation
                if loss_weights is not None:
                    loss = loss_weights[k] * loss
                scaler.scale(loss).backward(retain_graph=k < len(optimizers) - 1)
                if update:
                    scaler.step(optimizer)
                    optimizer.zero_grad()
            if update:
                scaler.update()
    return scaler


@pytest.mark.parametrize("grad_accumulation", [1, 2, 3])  # 2: where "> 1" and "> 2" differ
def test_multi_loss_with_multi_optimizer_trains_in_1x_order(grad_accumulation):
    model, reference = two_loss_pair()
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)), validation=True, end_auto_eval=True)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, grad_accumulation=grad_accumulation)
    reference_multi_loss_fit(reference, two_optimizers(reference), 2, grad_accumulation)
    assert params_differ(model, two_loss_pair()[0])
    assert_params_equal(model, reference)
    history = tl.train_history
    for key in ("accumulated_loss_loss_1", "accumulated_loss_loss_2", "loss_loss_1", "loss_loss_2",
                "val_loss_loss_1", "val_loss_loss_2"):
        assert len(history[key]) == 2 and all(math.isfinite(v) for v in history[key]), key


def test_evaluating_a_multi_loss_gives_a_multi_loss_or_a_dict():
    model, _ = two_loss_pair()
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)), validation=True, end_auto_eval=True)
    tl.fit(num_epochs=1)
    loss = tl.evaluate_loss_on_validation_set()
    assert isinstance(loss, MultiLoss) and sorted(loss) == ["loss_1", "loss_2"]
    assert all(value.dim() == 0 and value.dtype == torch.float64 for value in loss.values())
    as_dict = tl.evaluate_loss_on_validation_set(float_dict_format=True)
    assert type(as_dict) is dict and as_dict == {name: value.item() for name, value in loss.items()}
    assert as_dict == {"loss_1": tl.train_history["val_loss_loss_1"][-1],
                       "loss_2": tl.train_history["val_loss_loss_2"][-1]}
    assert isinstance(tl.evaluate_model_loss(tl.validation_loader), MultiLoss)


def test_a_multi_loss_with_one_plain_optimizer_steps_on_the_sum_of_the_losses():
    model, reference = two_loss_pair()
    tl = make_loop(model, sgd(model))
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2)

    def summed_loss(m, batch, criterion):
        out = m(batch[0])
        return criterion(out, batch[1]) + (out.float() ** 2).mean()

    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE), [sgd(reference)],
                  nn.CrossEntropyLoss(), num_epochs=2, loss_fn=summed_loss)
    assert_params_equal(model, reference)
    assert len(tl.train_history["accumulated_loss_loss_1"]) == 2


class RecordingMultiOptimizer(MultiOptimizer):
    """1.8 lets a MultiOptimizer subclass decide how each optimizer steps (e.g. alternating GAN updates)."""

    def __init__(self, optimizer_list):
        super().__init__(optimizer_list)
        self.calls = []

    def step(self, optimizer_idx, iteration, amp_grad_scaler):
        self.calls.append(("step", optimizer_idx, iteration))
        super().step(optimizer_idx, iteration, amp_grad_scaler)

    def zero_grad(self, optimizer_idx, iteration):
        self.calls.append(("zero_grad", optimizer_idx, iteration))
        super().zero_grad(optimizer_idx, iteration)


def test_a_multi_optimizer_subclass_is_called_as_in_1x():
    model, _ = two_loss_pair()
    optimizers = RecordingMultiOptimizer(two_optimizers(model))
    tl = make_loop(model, optimizers)
    assert tl.optimizer is optimizers and tl.optimizer[1] is optimizers.optimizer_list[1]
    tl.fit(num_epochs=1)
    assert optimizers.calls == [(name, idx, i) for i in range(BATCHES_PER_EPOCH) for idx in (0, 1)
                                for name in ("step", "zero_grad")]


class StepOnlyMultiOptimizer(MultiOptimizer):
    calls = []

    def step(self, optimizer_idx, iteration, amp_grad_scaler):
        self.calls.append(("step", optimizer_idx, iteration))
        super().step(optimizer_idx, iteration, amp_grad_scaler)


class ZeroGradOnlyMultiOptimizer(MultiOptimizer):
    calls = []

    def zero_grad(self, optimizer_idx, iteration):
        self.calls.append(("zero_grad", optimizer_idx, iteration))
        super().zero_grad(optimizer_idx, iteration)


@pytest.mark.parametrize("subclass, name", [(StepOnlyMultiOptimizer, "step"),
                                            (ZeroGradOnlyMultiOptimizer, "zero_grad")])
def test_a_multi_optimizer_subclass_overriding_one_method_has_it_called(subclass, name):
    model, _ = two_loss_pair()
    subclass.calls.clear()
    tl = make_loop(model, subclass(two_optimizers(model)))
    tl.fit(num_epochs=1)
    assert subclass.calls == [(name, idx, i) for i in range(BATCHES_PER_EPOCH) for idx in (0, 1)]


class RecordingMultiLoss(MultiLoss):
    """1.x lets a MultiLoss subclass decide how each optimizer's loss is back-propagated."""

    calls = []  # (optimizer_idx, iteration), over every batch's MultiLoss

    def backward(self, optimizer_idx, iteration, amp_grad_scaler):
        RecordingMultiLoss.calls.append((optimizer_idx, iteration))
        super().backward(optimizer_idx, iteration, amp_grad_scaler)


class RecordingTwoLossMLP(TwoLossMLP):
    def get_loss(self, batch_data, criterion, device):
        return RecordingMultiLoss(dict(super().get_loss(batch_data, criterion, device)))


def test_a_multi_loss_subclass_backward_is_called_as_in_1x():
    """The subclass's own ``backward`` is what back-propagates each optimizer's loss, with the iteration: the
    weights are those of 1.x's order (the subclass here does what the base class does)."""
    model, reference = two_loss_pair()
    model.__class__ = RecordingTwoLossMLP
    RecordingMultiLoss.calls.clear()
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)))
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=1)
    reference_multi_loss_fit(reference, two_optimizers(reference), 1)
    assert RecordingMultiLoss.calls == [(idx, i) for i in range(BATCHES_PER_EPOCH) for idx in (0, 1)]
    assert_params_equal(model, reference)


class WeightedMultiLoss(MultiLoss):
    """A subclass with its own constructor, attributes and backward, which weighs each optimizer's loss: were the
    base class's backward called instead, the weights would differ from the hand-written loop's."""

    def __init__(self, loss_dict, weights, calls):
        super().__init__(loss_dict)
        self.weights, self.calls = weights, calls

    def backward(self, optimizer_idx, iteration, amp_grad_scaler):
        self.calls.append((optimizer_idx, iteration))
        loss = self.weights[optimizer_idx] * self.loss_dict[self.optimizer_loss_map[optimizer_idx]]
        amp_grad_scaler.scale(loss).backward(retain_graph=self.loss_backward_remaining > 1)
        self.loss_backward_remaining -= 1


class WeightedTwoLossMLP(TwoLossMLP):
    LOSS_WEIGHTS = (0.5, 3.0)

    def get_loss(self, batch_data, criterion, device):
        return WeightedMultiLoss(dict(super().get_loss(batch_data, criterion, device)), self.LOSS_WEIGHTS,
                                 self.backward_calls)


@pytest.mark.parametrize("grad_accumulation", [1, 2, 3])
def test_a_multi_loss_subclass_backward_is_called_under_grad_accumulation(grad_accumulation):
    """1.8 documents overriding MultiLoss.backward. The loop divides the loss by grad_accumulation (> 1) before the
    backward passes, and the division returned a plain MultiLoss: the subclass's backward was not called (1.8's own
    division, made at every batch, lost it too; 1.7's returned the subclass itself). Once per optimizer per batch,
    on the divided losses, as the hand-written loop does."""
    model, reference = two_loss_pair()
    model.__class__ = WeightedTwoLossMLP
    model.backward_calls = []
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)))
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, grad_accumulation=grad_accumulation)
    reference_multi_loss_fit(reference, two_optimizers(reference), 2, grad_accumulation,
                             loss_weights=WeightedTwoLossMLP.LOSS_WEIGHTS)
    assert model.backward_calls == [(idx, i) for _ in range(2) for i in range(BATCHES_PER_EPOCH) for idx in (0, 1)]
    assert_params_equal(model, reference)


class BadMultiLossMLP(TwoLossMLP):
    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def get_loss(self, batch_data, criterion, device):
        losses = dict(super().get_loss(batch_data, criterion, device))
        if self.mistake == "unmapped":  # both losses mapped to optimizer 0: none for optimizer 1
            return MultiLoss(losses, {"loss_1": 0, "loss_2": 0})
        return MultiLoss({"loss_1": losses["loss_1"], "loss_2": losses["loss_2"].detach()})


@pytest.mark.parametrize("mistake, message", [("unmapped", "maps no loss to optimizer 1"),
                                              ("detached", "'loss_2'.*does not require grad")])
def test_a_multi_loss_without_a_loss_for_an_optimizer_is_refused_naming_it(mistake, message):
    model = BadMultiLossMLP(mistake)
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)))
    with pytest.raises(ValueError, match=message):
        tl.fit(num_epochs=1)


def test_multi_optimizer_under_grad_scaler_arguments_updates_the_scale_once_per_iteration():
    model, reference = two_loss_pair()
    tl = make_loop(model, MultiOptimizer(two_optimizers(model)), use_amp=dict(SCALER_ARGS))
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=1)
    scaler = reference_multi_loss_fit(reference, two_optimizers(reference), 1, scaler_args=SCALER_ARGS)
    assert tl.amp_scaler.state_dict() == scaler.state_dict()  # 4 iterations: grown once, tracker at 1
    assert_params_equal(model, reference)


# --- 9. gpu_mode='dp' without CUDA -------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel is used where CUDA is available")
def test_data_parallel_mode_without_cuda_trains_on_the_cpu_with_a_warning():
    model, reference = model_pair()
    with pytest.warns(UserWarning, match="gpu_mode='dp'"):
        tl = make_loop(model, gpu_mode="dp")
    torch.manual_seed(TRAIN_SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning while training
        tl.fit(num_epochs=2, dp_model_args={"dim": 0})
    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, seeded_loader(classification_data(NUM_SAMPLES), BATCH_SIZE), [sgd(reference)],
                  nn.CrossEntropyLoss(), num_epochs=2)
    assert_params_equal(model, reference)
    assert tl.device.type == "cpu"


class EpochRecorder(AbstractCallback):
    def __init__(self):
        super().__init__("epochs")
        self.epochs = []

    def on_epoch_begin(self):
        self.epochs.append(self.train_loop_obj.epoch)


def test_setting_epoch_before_fit_continues_from_that_epoch_as_in_1x():
    """1.x scripts continue a run by setting ``tl.epoch`` and calling fit with the final epoch count."""
    recorder = EpochRecorder()
    tl = make_loop(MLP())
    tl.epoch = 2
    tl.fit(num_epochs=4, callbacks=[recorder])
    assert recorder.epochs == [2, 3] and tl.epoch == 3 and tl.epochs_completed == 4
    assert len(tl.train_history["accumulated_loss"]) == 2


@pytest.mark.parametrize("num_samples, expected", [(100, [4, 9]), (103, [4, 9, 10]), (115, [4, 9, 11])])
def test_should_execute_optimizer_update_outside_training_follows_1x(num_samples, expected):
    """1.x code also asks with tl.iteration set by hand: every grad_accumulation batches and at the last batch."""
    loader = torch.utils.data.DataLoader(classification_data(num_samples), batch_size=10)
    tl = TrainLoop(MLP(), loader, None, None, sgd(MLP()), nn.CrossEntropyLoss(), show_progress=False)
    tl.grad_accumulation = 5
    due = []
    for iteration in range(len(loader)):
        tl.iteration = iteration
        if tl.should_execute_optimizer_update():
            due.append(iteration)
    assert due == expected
