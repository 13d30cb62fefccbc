"""Where the optimizer steps: every batch trained has its gradients stepped, exactly where the hand-written loop
(:func:`tests.helpers.reference_fit`) steps: every ``grad_accumulation`` batches, at an epoch's last batch (known
from ``len`` or, without it, when the loader is exhausted), and at the batch where ``num_iterations`` is reached.

The conditions are tested near their boundaries (windows that end on and off the epoch's end, ``num_iterations``
on and off a window's end), where an off-by-one in any of them changes what is trained (issue 32 item 15: the two
tests of the unsized path used 8 and 5 batches with accumulation 3, where ``(iteration + 1) % k`` and
``iteration % k`` agree; 9 batches with accumulation 2 tell them apart)."""
import warnings
from typing import Iterator

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, TRAIN_SEED, IterableTensorData, StepCounter, assert_params_equal, classification_data, model_pair,
    reference_fit, single_torch_thread)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


def _loaders(num_batches: int, sized: bool):
    """Two identical loaders of ``num_batches`` batches of 2 samples (no shuffling): sized, or without len."""
    data = classification_data(2 * num_batches)
    if sized:
        return DataLoader(data, batch_size=2), DataLoader(data, batch_size=2)
    return DataLoader(IterableTensorData(data), batch_size=2), DataLoader(IterableTensorData(data), batch_size=2)


def _train_both(num_batches, sized, grad_accumulation, num_epochs=0, num_iterations=0, callbacks=()):
    model, reference = model_pair(MLP, dropout=0.0)
    loader, reference_loader = _loaders(num_batches, sized)
    counter = StepCounter()
    tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=num_epochs, num_iterations=num_iterations, grad_accumulation=grad_accumulation,
           callbacks=[counter, *callbacks])
    result = reference_fit(reference, reference_loader, [torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)],
                           nn.CrossEntropyLoss(), num_epochs=num_epochs, num_iterations=num_iterations,
                           grad_accumulation=grad_accumulation)
    return tl, model, reference, counter, result


@settings(max_examples=20, deadline=None)
@given(num_batches=st.integers(1, 10), grad_accumulation=st.integers(1, 4), sized=st.booleans(),
       num_iterations=st.one_of(st.just(0), st.integers(1, 25)))
@example(num_batches=9, grad_accumulation=2, sized=False, num_iterations=0)  # issue 32 item 15
@example(num_batches=9, grad_accumulation=2, sized=True, num_iterations=0)
@example(num_batches=8, grad_accumulation=2, sized=False, num_iterations=0)  # the last window ends with the epoch
@example(num_batches=5, grad_accumulation=3, sized=True, num_iterations=7)  # the limit inside a window, epoch 2
@example(num_batches=5, grad_accumulation=2, sized=False, num_iterations=6)  # the limit ends a window
def test_the_loop_steps_where_the_hand_written_loop_steps(num_batches, grad_accumulation, sized, num_iterations):
    """Two epochs (or ``num_iterations`` batches) of any length and accumulation, with and without len: the steps
    are the hand loop's (same count, bitwise the same weights) and no gradient is left behind."""
    tl, model, reference, counter, result = _train_both(num_batches, sized, grad_accumulation,
                                                        num_epochs=0 if num_iterations else 2,
                                                        num_iterations=num_iterations)
    assert len(counter.step_iterations) == result["optimizer_steps"]
    assert tl.iterations_done == result["batches"]
    assert_params_equal(model, reference)
    assert all(param.grad is None for param in model.parameters())


def test_nine_unsized_batches_with_accumulation_two_step_five_times_an_epoch():
    """The named example: windows end at batches 2, 4, 6, 8 and, with the loader's end, at batch 9 (a window of one
    batch): ``iteration % k`` instead of ``(iteration + 1) % k`` would leave it unstepped."""
    tl, model, reference, counter, _ = _train_both(9, sized=False, grad_accumulation=2, num_epochs=2)
    assert counter.step_iterations == [(epoch, index) for epoch in range(2) for index in (1, 3, 5, 7, 8)]
    assert_params_equal(model, reference)


# --- a loader whose len() says something else (issue 32 item 8) -------------------------------------------------
class ApproximateLength(IterableDataset):
    """Streams ``dataset`` with a ``__len__`` of ``length`` samples (an estimate, as a streaming data set gives)."""

    def __init__(self, dataset: TensorDataset, length: int):
        self.dataset, self.length = dataset, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator:
        for index in range(len(self.dataset)):
            yield self.dataset[index]


@pytest.mark.parametrize("claimed_samples", [20, 11, 9], ids=["overstated", "understated", "understated-mid-window"])
def test_a_loader_whose_len_is_wrong_steps_every_window_and_warns_once(claimed_samples):
    """15 samples in batches of 2 (8 batches), len() saying 10 batches or 6, accumulation 3. Overstated: the epoch's
    last window never stepped (no batch was the len()-th) and its gradient leaked into the next epoch, then was
    dropped at the end. Now the loop steps where the loader ends, as for a loader without len, and warns once.
    Understated: batch 6, which len() calls the last, is not a window's end (an extra step on a partial window there
    was review of issue 32's D6): an IterableDataset's windows end every 3 batches and where the data ends."""
    data = classification_data(15)
    model, reference = model_pair(MLP, dropout=0.0)
    tl = TrainLoop(model, DataLoader(ApproximateLength(data, claimed_samples), batch_size=2), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.fit(num_epochs=2, grad_accumulation=3)
    messages = [str(w.message) for w in caught if "yielded 8" in str(w.message)]
    assert len(messages) == 1 and f"len() is {(claimed_samples + 1) // 2}" in messages[0]
    assert all(param.grad is None for param in model.parameters())

    # The hand loop that steps every window, the last one where the data ends, whatever len() says.
    optimizer, criterion = torch.optim.SGD(reference.parameters(), lr=0.1), nn.CrossEntropyLoss()
    for _ in range(2):
        batches = list(DataLoader(data, batch_size=2))
        for index, (x, y) in enumerate(batches):
            (criterion(reference(x), y) / 3).backward()
            if (index + 1) % 3 == 0 or index + 1 == len(batches):
                optimizer.step()
                optimizer.zero_grad()
    assert_params_equal(model, reference)


# --- a stop requested inside a window steps on it, as num_iterations there does (issue 32 item 13) -------------
class StopAtBatch(AbstractCallback):
    def __init__(self, at: int):
        super().__init__("stop at batch")
        self.at = at

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.at:
            self.train_loop_obj.stop_training("test")


@pytest.mark.parametrize("stop_at", [4, 5, 6])
def test_a_stop_inside_a_window_trains_as_num_iterations_at_that_batch(stop_at):
    """``stop_training()`` after batch 4 or 5 (inside the window 4-6 of accumulation 3) dropped the window's
    gradients, while ``num_iterations`` at the same batch steps on them: the two runs now end bitwise equal (the
    epoch is closed in both, with the same accumulated loss)."""
    runs = []
    for kwargs, callbacks in (({"num_epochs": 3}, [StopAtBatch(stop_at)]), ({"num_iterations": stop_at}, [])):
        model, _ = model_pair(MLP, dropout=0.0)
        tl = TrainLoop(model, DataLoader(classification_data(30), batch_size=2), None, None,
                       torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                       end_auto_eval=False, show_progress=False)
        tl.fit(grad_accumulation=3, callbacks=callbacks, **kwargs)
        assert all(param.grad is None for param in model.parameters())
        runs.append((model, tl))
    (stopped, stopped_tl), (limited, limited_tl) = runs
    assert_params_equal(stopped, limited)
    assert dict(stopped_tl.train_history) == dict(limited_tl.train_history)
    assert stopped_tl.iterations_done == limited_tl.iterations_done == stop_at


# --- the graph a MultiLoss's losses share is kept until the last backward ----------------------------------------
class SharedTrunk(TTModel):
    """A trunk stepped by optimizer 1 feeding two heads: ``first`` (optimizer 0) and ``second`` (optimizer 1). Both
    losses back-propagate through the trunk's graph, so the first backward must keep it for the second."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.first = nn.Linear(8, 3)
        self.second = nn.Linear(8, 3)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return self.first(hidden), self.second(hidden)

    def get_loss(self, batch_data, criterion, device):
        first, second = self(batch_data[0])
        return MultiLoss({"first": criterion(first, batch_data[1]), "second": criterion(second, batch_data[1])})

    def get_predictions(self, batch_data, device):
        return self(batch_data[0])[0].argmax(dim=1), batch_data[1], None


def test_a_multiloss_whose_losses_share_a_graph_trains_as_the_hand_loop():
    """aitoolbox 1.x's order with two optimizers: backward of the first loss (keeping the shared graph), step of
    optimizer 0, backward of the second loss, step of optimizer 1; bitwise the hand loop."""
    torch.manual_seed(0)
    model = SharedTrunk()
    reference = SharedTrunk()
    reference.load_state_dict(model.state_dict())

    def optimizers(net):
        return [torch.optim.SGD(net.first.parameters(), lr=0.1),
                torch.optim.SGD([*net.trunk.parameters(), *net.second.parameters()], lr=0.1)]

    data = classification_data(12)
    tl = TrainLoop(model, DataLoader(data, batch_size=4), None, None, optimizers(model), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=2)
    reference_optimizers = optimizers(reference)
    criterion = nn.CrossEntropyLoss()
    for _ in range(2):
        for x, y in DataLoader(data, batch_size=4):
            first, second = reference(x)
            criterion(first, y).backward(retain_graph=True)
            reference_optimizers[0].step()
            reference_optimizers[0].zero_grad()
            criterion(second, y).backward()
            reference_optimizers[1].step()
            reference_optimizers[1].zero_grad()
    assert_params_equal(model, reference)


def test_optimizers_stepped_together_also_step_together_at_the_loaders_end():
    """Two optimizers of one plain loss step together, also on the last window of a loader without len (found only
    when it is exhausted): one ``on_after_optimizer_step`` for both, as at every other step, and the weights of the
    hand loop."""
    model, reference = model_pair(MLP, dropout=0.0)
    loader, reference_loader = _loaders(3, sized=False)
    seen = []

    class StepRecorder(AbstractCallback):
        def on_after_optimizer_step(self):
            seen.append(self.train_loop_obj.stepped_optimizers)

    def optimizers_for(m):
        return [torch.optim.SGD(m.fc1.parameters(), lr=0.1), torch.optim.Adam(m.fc2.parameters(), lr=0.01)]

    tl = TrainLoop(model, loader, None, None, optimizers_for(model), nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False)
    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[StepRecorder("steps")])
    reference_fit(reference, reference_loader, optimizers_for(reference), nn.CrossEntropyLoss(), num_epochs=2,
                  grad_accumulation=2)
    assert seen == [(0, 1)] * 4  # batches 2 and 3 (the loader's end) of each epoch
    assert_params_equal(model, reference)


def test_the_window_the_loaders_end_cuts_short_is_synchronised_before_its_step():
    """A loader without len: the last window's batches were back-propagated without synchronising their gradients
    (under DDP, no_sync: the loop did not know the window ended there). Its step first asks the strategy to
    synchronise them, once per such step; the windows whose end was known need nothing."""
    model, reference = model_pair(MLP, dropout=0.0)
    loader, reference_loader = _loaders(3, sized=False)
    tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    synchronised = []
    tl.strategy.sync_skipped_gradients = lambda: synchronised.append(tl.iteration)  # the strategy of one process
    tl.fit(num_epochs=2, grad_accumulation=2)
    reference_fit(reference, reference_loader, [torch.optim.SGD(reference.parameters(), lr=0.1)],
                  nn.CrossEntropyLoss(), num_epochs=2, grad_accumulation=2)
    assert synchronised == [2, 2]  # each epoch's batch 3, its window cut short by the loader's end
    assert_params_equal(model, reference)


def test_a_multiloss_window_cut_short_by_the_loaders_end_is_stepped_in_turn():
    """Two optimizers stepped one after another, accumulation 2, 3 batches without len: the last window (batch 3)
    is found only when the loader is exhausted and is stepped then, each optimizer in turn: bitwise the same run
    over the loader with len, where that window's end is known."""
    def run(sized):
        torch.manual_seed(0)
        model = SharedTrunk()
        loader, _ = _loaders(3, sized)
        optimizers = [torch.optim.SGD(model.first.parameters(), lr=0.1),
                      torch.optim.SGD([*model.trunk.parameters(), *model.second.parameters()], lr=0.1)]
        tl = TrainLoop(model, loader, None, None, optimizers, nn.CrossEntropyLoss(), end_auto_eval=False,
                       show_progress=False)
        counter = StepCounter()
        tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[counter])
        return model, counter.step_iterations

    (unsized, unsized_steps), (sized, sized_steps) = run(False), run(True)
    assert len(unsized_steps) == len(sized_steps) == 8  # 2 windows an epoch, 2 optimizers each
    assert_params_equal(unsized, sized)
    assert all(param.grad is None for param in unsized.parameters())


def test_after_the_step_at_the_loaders_end_no_step_is_due():
    """The step at an unsized loader's end is the batch's last event: the epoch's end sees ``optimizer_step_due``
    False, as after every other batch."""
    model, _ = model_pair(MLP, dropout=0.0)
    loader, _ = _loaders(3, sized=False)
    seen = []

    class EpochEnd(AbstractCallback):
        def on_epoch_end(self):
            seen.append(self.train_loop_obj.optimizer_step_due)

    tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=2, grad_accumulation=2, callbacks=[EpochEnd("epoch end")])
    assert seen == [False, False]


def test_each_optimizer_stepped_in_turn_gets_every_callbacks_hooks():
    """Two optimizers stepped one after another: every callback's ``on_after_gradient_update`` runs for each
    optimizer (a clipping callback clips both), and ``on_after_optimizer_step`` after each optimizer's step."""
    torch.manual_seed(0)
    model = SharedTrunk()
    seen = []

    class Hooks(AbstractCallback):
        def on_after_gradient_update(self, optimizer_idx):
            seen.append(("gradient", self.train_loop_obj.total_iteration_idx, optimizer_idx))

        def on_after_optimizer_step(self):
            seen.append(("step", self.train_loop_obj.total_iteration_idx, self.train_loop_obj.stepped_optimizers))

    optimizers = [torch.optim.SGD(model.first.parameters(), lr=0.1),
                  torch.optim.SGD([*model.trunk.parameters(), *model.second.parameters()], lr=0.1)]
    tl = TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None, optimizers,
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1, callbacks=[Hooks("first"), Hooks("second")])
    assert seen == [(kind, batch, which) for batch in range(2) for index in (0, 1)
                    for kind, which in (("gradient", index),) * 2 + (("step", (index,)),) * 2]
