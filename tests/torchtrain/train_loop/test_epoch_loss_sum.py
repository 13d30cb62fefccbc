"""The epoch's loss sum (``accumulated_loss``): summed in blocks of batches, so that an epoch continued from any step
(a mid-epoch checkpoint, the fit after an exception) sums to the straight run's value bit for bit."""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.losses import EpochLossSum
from tests.helpers import MLP, classification_data, model_pair, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


def _fed(sums: EpochLossSum, values, windows):
    """Feed ``values`` to ``sums``, committing after each window (lengths in ``windows``, cycled)."""
    position, window = 0, 0
    while position < len(values):
        length = windows[window % len(windows)]
        for value in values[position:position + length]:
            sums.add(value)
        sums.commit()
        position, window = position + length, window + 1
    return sums


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 200), stop_window=st.integers(0, 120), windows=st.lists(st.integers(1, 5), min_size=1,
                                                                                      max_size=4),
       multi=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_a_sum_continued_from_any_step_is_the_straight_sum(count, stop_window, windows, multi, seed):
    """Random losses, committed in windows of random lengths; the sum's state taken after any window and continued
    in a new object equals the sum that went straight through, bitwise (and it is the sum, to rounding)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (3,) if multi else ()
    values = [torch.rand(shape, generator=generator) * 10 for _ in range(count)]
    straight = _fed(EpochLossSum(), values, windows)

    stop = min(sum(windows[i % len(windows)] for i in range(stop_window)), count)
    first = _fed(EpochLossSum(), values[:stop], windows)
    continued = EpochLossSum(first.state())
    # The continuation commits the same windows as the straight run (it went on from a window's end).
    rest_windows = [windows[(stop_window + i) % len(windows)] for i in range(len(windows))]
    _fed(continued, values[stop:], rest_windows)
    assert torch.equal(continued.total(), straight.total())
    torch.testing.assert_close(straight.total(), torch.stack(values).sum(dim=0), rtol=1e-5, atol=1e-4)


def test_the_state_holds_the_pending_values_when_asked_and_older_sums_load():
    sums = EpochLossSum()
    sums.add(torch.tensor(1.0))
    sums.add(torch.tensor(2.0))
    assert sums.state()["values"] is None and torch.equal(sums.state(include_pending=True)["values"],
                                                          torch.tensor([1.0, 2.0]))
    assert torch.equal(EpochLossSum(3.5).total(), torch.tensor(3.5))  # a checkpoint of an older version: the sum
    assert torch.equal(EpochLossSum([1.0, 2.0]).total(), torch.tensor([1.0, 2.0]))


class SaveAndFail(AbstractCallback):
    """Saves a mid-epoch checkpoint after batch ``save_at``, raises once after batch ``fail_at`` (run-wide counts)."""

    def __init__(self, save_at=None, fail_at=None):
        super().__init__("save and fail")
        self.save_at, self.fail_at, self.saved, self.failed = save_at, fail_at, None, False

    def on_batch_end(self):
        tl = self.train_loop_obj
        if tl.total_iteration_idx == self.save_at:
            self.saved = copy.deepcopy(tl.checkpoint_state(mid_epoch=True))  # its tensors are the live run's
        if tl.total_iteration_idx == self.fail_at and not self.failed:
            self.failed = True
            raise RuntimeError("stopped")


def _long_epoch_loop():
    model, _ = model_pair(MLP, dropout=0.0)
    return TrainLoop(model, DataLoader(classification_data(300), batch_size=2), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(), end_auto_eval=False,
                     show_progress=False)


def test_the_accumulated_loss_of_a_long_epoch_resumed_or_continued_is_the_straight_runs():
    """150 batches in the epoch (two blocks of 64 and an open one): continued after an exception at batch 100, and
    resumed from a mid-epoch checkpoint of batch 70 in a new loop, the history is bitwise the straight run's."""
    straight = _long_epoch_loop()
    saver = SaveAndFail(save_at=70)
    straight.fit(num_epochs=1, callbacks=[saver])

    continued = _long_epoch_loop()
    with pytest.raises(RuntimeError, match="stopped"):
        continued.fit(num_epochs=1, callbacks=[SaveAndFail(fail_at=100)])
    continued.fit(num_epochs=1)

    resumed = _long_epoch_loop()
    resumed.load_checkpoint(saver.saved)
    resumed.fit(num_epochs=1)
    assert continued.train_history["accumulated_loss"] == straight.train_history["accumulated_loss"]
    assert resumed.train_history["accumulated_loss"] == straight.train_history["accumulated_loss"]
