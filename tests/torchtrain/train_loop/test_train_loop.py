"""Golden tests: TrainLoop against the hand-written PyTorch loop of tests.helpers, bitwise."""
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import ModelWrap
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, TRAIN_SEED, ClassifierFeedDefinition, IterableTensorData, PlainMLP, SmallCNN, StepCounter,
    assert_params_equal, classification_data, image_data, model_pair, params_differ, reference_fit, seeded_loader,
)


@pytest.fixture(autouse=True)
def deterministic_cudnn():
    """Bitwise comparisons on a GPU need deterministic convolution kernels (no effect on the CPU)."""
    previous = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = previous


def make_train_loop(model, dataset, batch_size=8, optimizers=None, end_auto_eval=False, validation_loader=None,
                    test_loader=None, loader=None):
    optimizers = optimizers or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = loader if loader is not None else seeded_loader(dataset, batch_size)
    return TrainLoop(model, loader, validation_loader, test_loader, optimizers, nn.CrossEntropyLoss(),
                     end_auto_eval=end_auto_eval, show_progress=False)


def run_reference(model, dataset, batch_size=8, loader=None, **fit_kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = loader if loader is not None else seeded_loader(dataset, batch_size)
    torch.manual_seed(TRAIN_SEED)
    return reference_fit(model, loader, [optimizer], nn.CrossEntropyLoss(), **fit_kwargs)


def run_train_loop(model, dataset, batch_size=8, callbacks=None, **fit_kwargs):
    tl = make_train_loop(model, dataset, batch_size)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(callbacks=callbacks, **fit_kwargs)
    return tl


# --- epochs, iterations, accumulation ---------------------------------------------------------------------
@pytest.mark.parametrize("model_class, make_data", [(MLP, classification_data), (SmallCNN, image_data)],
                         ids=["mlp", "cnn"])
def test_epochs_match_hand_written_loop(model_class, make_data):
    model, reference = model_pair(model_class)
    data = make_data()
    initial = model_pair(model_class)[0]
    tl = run_train_loop(model, data, num_epochs=3)
    result = run_reference(reference, data, num_epochs=3)
    assert params_differ(model, initial)  # it trained
    assert_params_equal(model, reference)
    assert tl.epoch == 2
    assert tl.total_iteration_idx + 1 == 3 * 4 == result["batches"]
    assert tl.train_history["accumulated_loss"] == pytest.approx(result["epoch_losses"], rel=1e-6)


@pytest.mark.parametrize("grad_accumulation, expected_steps", [(1, list(range(8))), (2, [1, 3, 5, 7]),
                                                               (3, [2, 5, 7]), (5, [4, 7]), (8, [7]), (20, [7])])
def test_grad_accumulation_steps_on_windows_and_last_batch(grad_accumulation, expected_steps):
    # 30 samples in batches of 4: 8 batches, the last one of 2 samples; windows that do not divide 8.
    model, reference = model_pair()
    data = classification_data(30)
    counter = StepCounter()
    run_train_loop(model, data, batch_size=4, callbacks=[counter], num_epochs=2, grad_accumulation=grad_accumulation)
    result = run_reference(reference, data, batch_size=4, num_epochs=2, grad_accumulation=grad_accumulation)
    assert_params_equal(model, reference)
    assert counter.step_iterations == [(epoch, i) for epoch in range(2) for i in expected_steps]
    assert result["optimizer_steps"] == len(counter.step_iterations)


@pytest.mark.parametrize("num_iterations, grad_accumulation", [(5, 1), (6, 3), (9, 2), (13, 3), (8, 3)])
def test_num_iterations_stops_mid_epoch_and_steps_pending_gradients(num_iterations, grad_accumulation):
    # 4 batches per epoch (8, 8, 8, 6 samples).
    model, reference = model_pair()
    data = classification_data(30)
    counter = StepCounter()
    tl = run_train_loop(model, data, callbacks=[counter], num_iterations=num_iterations,
                        grad_accumulation=grad_accumulation)
    result = run_reference(reference, data, num_iterations=num_iterations, grad_accumulation=grad_accumulation)
    assert_params_equal(model, reference)
    assert tl.iterations_done == tl.total_iteration_idx + 1 == num_iterations
    assert tl.epoch == (num_iterations - 1) // 4
    last_iteration = (num_iterations - 1) % 4
    assert counter.step_iterations[-1] == (tl.epoch, last_iteration)  # the pending window was stepped
    assert len(counter.step_iterations) == result["optimizer_steps"]
    assert len(tl.train_history["accumulated_loss"]) == tl.epoch + 1
    assert all(p.grad is None for p in model.parameters())


def test_second_fit_continues_to_the_new_epoch_total():
    model, reference = model_pair()
    data = classification_data()
    tl = make_train_loop(model, data)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2)
    assert tl.epoch == 1
    tl.fit(num_epochs=5)
    result = run_reference(reference, data, num_epochs=5)
    assert_params_equal(model, reference)
    assert tl.epoch == 4
    assert tl.total_iteration_idx == 20 - 1
    assert tl.train_history["accumulated_loss"] == pytest.approx(result["epoch_losses"], rel=1e-6)


class RecordingHandler(logging.Handler):
    """Collects log records; attached to the module's logger since the library's logger may not propagate."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fit_to_a_reached_target_trains_nothing():
    model, _ = model_pair()
    tl = run_train_loop(model, classification_data(), num_epochs=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handler = RecordingHandler()
    logger = logging.getLogger("aitoolbox.torchtrain.train_loop.train_loop")
    logger.addHandler(handler)
    try:
        returned = tl.fit(num_epochs=2)
    finally:
        logger.removeHandler(handler)
    assert returned is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any("Nothing to train" in message for message in handler.messages)
    assert tl.total_iteration_idx == 8 - 1


def test_epoch_start_rng_state_is_none_before_the_first_epoch_and_the_epochs_state_from_then_on():
    """The property callbacks read (TrainLoopView): None before any epoch began (the mutation run, mut47: the initial
    value dropped survived); then the state the current epoch's data order was drawn from, which a second fit's
    epoch replaces."""
    model, _ = model_pair()
    tl = make_train_loop(model, classification_data())
    assert tl.epoch_start_rng_state is None
    seen = []

    class RecordsEpochStart(AbstractCallback):
        def on_batch_begin(self):
            seen.append(self.train_loop_obj.epoch_start_rng_state)

    torch.manual_seed(TRAIN_SEED)
    expected = torch.get_rng_state()
    tl.fit(num_epochs=1, callbacks=[RecordsEpochStart("records")])
    assert len(seen) == 4 and all(state is seen[0] for state in seen)
    assert torch.equal(seen[0]["torch"], expected)
    tl.fit(num_epochs=2)
    assert tl.epoch_start_rng_state is not seen[0] and not torch.equal(tl.epoch_start_rng_state["torch"], expected)


def test_stale_gradients_are_cleared_at_fit_start():
    model, reference = model_pair()
    data = classification_data()
    x, y = data.tensors
    nn.CrossEntropyLoss()(model(x), y).backward()  # e.g. left over from a user's experiment
    assert all(p.grad is not None for p in model.parameters())
    run_train_loop(model, data, num_epochs=1, grad_accumulation=3)
    run_reference(reference, data, num_epochs=1, grad_accumulation=3)
    assert_params_equal(model, reference)


def test_multiple_optimizers_step_together():
    model, reference = model_pair()
    data = classification_data()

    def optimizers_for(m):
        return [torch.optim.SGD(m.fc1.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(m.fc2.parameters(), lr=0.01)]

    tl = TrainLoop(model, seeded_loader(data, 8), None, None, optimizers_for(model), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, grad_accumulation=3)
    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, seeded_loader(data, 8), optimizers_for(reference), nn.CrossEntropyLoss(),
                  num_epochs=2, grad_accumulation=3)
    assert_params_equal(model, reference)
    assert tl.optimizers[1].state_dict()["state"][0]["step"] == 4  # Adam stepped at batches 2 and 3 of 2 epochs


def test_model_wrap_trains_like_the_equivalent_tt_model():
    tt_model, reference = model_pair(MLP)
    module = PlainMLP()
    module.load_state_dict(tt_model.state_dict())
    data = classification_data()
    tl = make_train_loop(ModelWrap(module, ClassifierFeedDefinition()), data,
                         optimizers=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(TRAIN_SEED)
    returned = tl.fit(num_epochs=2, grad_accumulation=3)
    run_train_loop(tt_model, data, num_epochs=2, grad_accumulation=3)
    run_reference(reference, data, num_epochs=2, grad_accumulation=3)
    assert returned is module
    assert tl.model is module  # the loop drives the user's module itself, not a copy (tl.model as in 1.x)
    assert_params_equal(module, tt_model)
    assert_params_equal(module, reference)


def test_fit_and_call_return_the_users_model():
    model, _ = model_pair()
    tl = make_train_loop(model, classification_data())
    assert tl.fit(num_epochs=1) is model
    assert tl(num_epochs=2) is model
    assert tl.epoch == 1


def test_loader_without_len_steps_last_partial_window():
    # 30 samples, batches of 4: 8 batches; with grad_accumulation=3 the last window (batches 6, 7) is partial
    # and, without len(loader), is only known to be the last one after the loop.
    model, reference = model_pair()
    stream = IterableTensorData(classification_data(30))
    with pytest.raises(TypeError):
        len(DataLoader(stream, batch_size=4))
    counter = StepCounter()
    tl = TrainLoop(model, DataLoader(stream, batch_size=4), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=2, grad_accumulation=3, callbacks=[counter])
    result = run_reference(reference, None, loader=DataLoader(stream, batch_size=4), num_epochs=2,
                           grad_accumulation=3)
    assert_params_equal(model, reference)
    assert counter.step_iterations == [(e, i) for e in range(2) for i in (2, 5, 7)]
    assert result["optimizer_steps"] == 6
    assert all(p.grad is None for p in model.parameters())


def test_loader_without_len_with_num_iterations():
    model, reference = model_pair()
    stream = IterableTensorData(classification_data(30))
    tl = TrainLoop(model, DataLoader(stream, batch_size=4), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_iterations=11, grad_accumulation=2)
    run_reference(reference, None, loader=DataLoader(stream, batch_size=4), num_iterations=11, grad_accumulation=2)
    assert_params_equal(model, reference)
    assert tl.total_iteration_idx == 11 - 1


# --- evaluation does not disturb training -------------------------------------------------------------------
@pytest.mark.parametrize("model_class, make_data", [(MLP, classification_data), (SmallCNN, image_data)],
                         ids=["mlp", "cnn"])
def test_auto_evaluation_does_not_change_training(model_class, make_data):
    """Evaluation runs inside a forked RNG: shuffled evaluation loaders and the train-set pass (which
    iterates the seeded train loader) must leave the trained parameters bitwise unchanged."""
    data = make_data()
    trained = []
    for end_auto_eval in (False, True, 2):
        model, _ = model_pair(model_class)
        # Shuffled evaluation loaders without a generator draw from the global RNG (as dropout does).
        validation_loader = DataLoader(make_data(13, seed=20), batch_size=4, shuffle=True)
        test_loader = DataLoader(make_data(9, seed=21), batch_size=4, shuffle=True)
        tl = make_train_loop(model, data, end_auto_eval=end_auto_eval, validation_loader=validation_loader,
                             test_loader=test_loader)
        torch.manual_seed(TRAIN_SEED)
        tl.fit(num_epochs=3, grad_accumulation=3)
        trained.append(model)
        if end_auto_eval is True:
            assert len(tl.train_history["loss"]) == len(tl.train_history["val_loss"]) == 3
    assert_params_equal(trained[0], trained[1])
    assert_params_equal(trained[0], trained[2])


def test_evaluation_between_fits_does_not_change_training():
    data = classification_data()
    model_a, model_b = model_pair()
    tl_a = make_train_loop(model_a, data)
    tl_b = make_train_loop(model_b, data, validation_loader=DataLoader(data, batch_size=8, shuffle=True))
    torch.manual_seed(TRAIN_SEED)
    tl_a.fit(num_epochs=1)
    tl_a.fit(num_epochs=2)
    torch.manual_seed(TRAIN_SEED)
    tl_b.fit(num_epochs=1)
    tl_b.evaluate_loss_on_train_set()
    tl_b.evaluate_loss_on_validation_set()
    tl_b.predict_on_train_set()
    tl_b.predict_on_validation_set()
    tl_b.fit(num_epochs=2)
    assert_params_equal(model_a, model_b)


# --- history ------------------------------------------------------------------------------------------------
def test_history_after_five_epochs_with_auto_evaluation():
    model, reference = model_pair()
    data = classification_data()
    validation_loader = DataLoader(classification_data(13, seed=20), batch_size=4)
    test_loader = DataLoader(classification_data(9, seed=21), batch_size=4)
    tl = make_train_loop(model, data, end_auto_eval=True, validation_loader=validation_loader,
                         test_loader=test_loader)
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=5)
    result = run_reference(reference, data, num_epochs=5)
    assert tl.epoch == 4
    history = tl.train_history
    assert set(history) == {"accumulated_loss", "loss", "val_loss", "train_end_test_loss"}
    assert len(history["accumulated_loss"]) == len(history["loss"]) == len(history["val_loss"]) == 5
    assert history["accumulated_loss"] == pytest.approx(result["epoch_losses"], rel=1e-6)
    # The last epoch's evaluation saw the final weights, as does an evaluation now.
    assert history["loss"][-1] == tl.evaluate_loss_on_train_set()
    assert history["val_loss"][-1] == tl.evaluate_loss_on_validation_set()
    assert history["train_end_test_loss"] == [tl.evaluate_loss_on_test_set(float_dict_format=True)]
    assert model.training  # evaluation restored train mode


def test_end_auto_eval_every_n_epochs():
    model, _ = model_pair()
    tl = make_train_loop(model, classification_data(), end_auto_eval=2,
                         validation_loader=DataLoader(classification_data(13, seed=20), batch_size=4),
                         test_loader=DataLoader(classification_data(9, seed=21), batch_size=4))
    tl.fit(num_epochs=5)
    assert len(tl.train_history["accumulated_loss"]) == 5
    assert len(tl.train_history["loss"]) == len(tl.train_history["val_loss"]) == 2  # after epochs 1 and 3
    assert len(tl.train_history["train_end_test_loss"]) == 1


def test_no_auto_evaluation_records_only_the_accumulated_loss():
    model, _ = model_pair()
    tl = make_train_loop(model, classification_data(), end_auto_eval=False,
                         validation_loader=DataLoader(classification_data(13, seed=20), batch_size=4),
                         test_loader=DataLoader(classification_data(9, seed=21), batch_size=4))
    tl.fit(num_epochs=2)
    assert {name for name, values in tl.train_history.items() if values} == {"accumulated_loss"}


def test_auto_evaluation_without_validation_loader_records_train_loss_only():
    model, _ = model_pair()
    tl = make_train_loop(model, classification_data(), end_auto_eval=True)
    tl.fit(num_epochs=2)
    assert {name for name, values in tl.train_history.items() if values} == {"accumulated_loss", "loss"}


# --- stopping -------------------------------------------------------------------------------------------------
class StopAt(AbstractCallback):
    def __init__(self, total_iteration):
        super().__init__("stop at")
        self.total_iteration = total_iteration

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.total_iteration:
            self.train_loop_obj.stop_training("test")


def test_stop_training_from_a_callback_ends_after_the_current_batch():
    model, _ = model_pair()
    counter = StepCounter()
    tl = run_train_loop(model, classification_data(), callbacks=[StopAt(5), counter], num_epochs=10)
    assert tl.total_iteration_idx == 5  # batches 0..5 ran; total_iteration_idx is the last one's index (1.x)
    assert tl.epoch == 1
    assert len(tl.train_history["accumulated_loss"]) == 2  # the interrupted epoch is closed
    assert counter.step_iterations == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
