"""The evaluation cache answers only for the weights it was computed with (issue 32 item 5).

Results are cached within one training iteration, so that callbacks asking for the same set at one epoch end share a
pass; anything that changes the weights or buffers in between (WeightAveraging putting the average in at train end,
a manual ``load_state_dict``, an in-place edit) must make the next call evaluate again.
"""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.weight_averaging import WeightAveraging
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.combinations.support import ComboNet, dataset


def _loop(end_auto_eval=True) -> TrainLoop:
    torch.manual_seed(0)
    model = ComboNet()
    loader = DataLoader(dataset(), batch_size=8)
    return TrainLoop(model, loader, loader, loader, torch.optim.SGD(model.parameters(), lr=0.3),
                     nn.CrossEntropyLoss(), end_auto_eval=end_auto_eval, show_progress=False)


class EvaluateAtTrainEnd(AbstractCallback):
    """What ModelTrainEndSave does at train end: the validation loss and predictions of the final model (after
    WeightAveraging, whose execution order is lower), cached and forced."""

    def __init__(self):
        super().__init__("evaluate at train end", execution_order=200)
        self.cached = self.forced = None

    def on_train_end(self):
        tl = self.train_loop_obj
        self.cached = (tl.evaluate_loss_on_validation_set(), tl.predict_on_validation_set()[0])
        self.forced = (tl.evaluate_loss_on_validation_set(force_prediction=True),
                       tl.predict_on_validation_set(force_prediction=True)[0])


def test_the_averaged_model_saved_at_train_end_is_evaluated_with_its_own_weights():
    """The average goes into the model at train end (save_average); the epoch end before had evaluated (and cached)
    the training weights at the same iteration. Before the fix the cached results were returned."""
    tl = _loop()
    probe = EvaluateAtTrainEnd()
    averaging = WeightAveraging(decay=0.5, eval_with_average=False, save_average=True)
    tl.fit(num_epochs=2, callbacks=[averaging, probe])
    assert averaging.average_in_model
    assert torch.equal(probe.cached[0], probe.forced[0])
    assert torch.equal(probe.cached[1], probe.forced[1])
    assert not torch.equal(probe.cached[0], torch.tensor(tl.train_history["val_loss"][-1], dtype=torch.float64))


def test_a_manual_load_state_dict_is_evaluated_anew():
    tl = _loop(end_auto_eval=False)
    tl.fit(num_epochs=1)
    trained = copy.deepcopy(tl.model.state_dict())
    before = (tl.evaluate_loss_on_validation_set(), tl.predict_on_test_set()[0])
    tl.model.load_state_dict(_loop().model.state_dict())  # the initial weights
    after = (tl.evaluate_loss_on_validation_set(), tl.predict_on_test_set()[0])
    assert not torch.equal(before[0], after[0])
    assert torch.equal(after[0], tl.evaluate_loss_on_validation_set(force_prediction=True))
    assert torch.equal(after[1], tl.predict_on_test_set(force_prediction=True)[0])
    tl.model.load_state_dict(trained)
    assert torch.equal(tl.evaluate_loss_on_validation_set(), before[0])


@pytest.mark.parametrize("edit", ["in_place", "data_assignment", "buffer"])
def test_other_changes_to_the_weights_are_evaluated_anew(edit):
    tl = _loop(end_auto_eval=False)
    tl.fit(num_epochs=1)
    before = tl.evaluate_loss_on_train_set()
    with torch.no_grad():
        if edit == "in_place":
            tl.model.fc2.weight.mul_(0.5)
        elif edit == "data_assignment":
            tl.model.fc2.weight.data = tl.model.fc2.weight.data * 0.5
        else:
            tl.model.bn.running_mean.add_(1.0)
    after = tl.evaluate_loss_on_train_set()
    assert not torch.equal(before, after)
    assert torch.equal(after, tl.evaluate_loss_on_train_set(force_prediction=True))


def test_callbacks_asking_at_one_epoch_end_still_share_one_pass():
    """The point of the cache: unchanged weights, one evaluation."""
    tl = _loop(end_auto_eval=False)
    tl.fit(num_epochs=1)
    calls = []
    original = tl.model.get_loss_eval
    tl.model.get_loss_eval = lambda *args: calls.append(1) or original(*args)
    first = tl.evaluate_loss_on_validation_set()
    batches = len(calls)
    assert torch.equal(tl.evaluate_loss_on_validation_set(), first) and len(calls) == batches
