"""What the run's progress says inside a training batch, on the direct batch path and on the general one: the epoch's
batch count (``run_state.batches_done``) and loss sum (``tl.epoch_loss_sum``) seen from ``get_loss``, from a tensor
hook in the backward pass, from the optimizer's step pre- and post-hooks and from ``on_batch_end``; and where a
``fit`` that an exception left at each of those points continues (the step point: the batch count and loss sum the
next ``fit`` starts from).

The direct path (``TrainLoop._train_direct_batches``) does the loss sum's bookkeeping in other calls than the general
one, to save microseconds a batch (benchmarks/overhead.py). These tests pin the views, so that moving that bookkeeping
(e.g. folding the loss sum's append and commit into the step point) cannot change what user code sees: the batch
counts and is summed from its backward on; it is committed (an exception continues after it) once every optimizer
stepped."""
from typing import List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

BATCHES = 4
POINTS = ("get_loss", "backward", "step_pre", "step_post")


class Views:
    """Records ``(where, batch, batches_done, epoch_loss_sum)`` at each point; raises at ``fail_at`` once."""

    def __init__(self, fail_at: Optional[Tuple[str, int]] = None):
        self.seen: List[tuple] = []
        self.losses: List[torch.Tensor] = []  # each batch's loss, in training order (a batch trained again twice)
        self.fail_at = fail_at
        self.batch = -1  # the batch in training (counted over the whole test, from 0)
        self.train_loop: Optional[TrainLoop] = None

    def record(self, where: str) -> None:
        tl = self.train_loop
        self.seen.append((where, self.batch, tl.run_state.batches_done, tl.epoch_loss_sum.clone()))
        if self.fail_at == (where, self.batch):
            self.fail_at = None
            raise RuntimeError(f"planned failure in {where}")


class ViewedNet(TTModel):
    def __init__(self, views: Views):
        super().__init__()
        self.views = views
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x)

    def get_loss(self, batch_data, criterion, device):
        views = self.views
        views.batch += 1
        views.record("get_loss")
        x, y = batch_data
        loss = criterion(self(x.to(device)), y.to(device))
        views.losses.append(loss.detach().clone())
        loss.register_hook(lambda grad: views.record("backward"))
        return loss

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).argmax(dim=1), y, {}


class BatchEndViews(AbstractCallback):
    """A batch hook (the loop takes the general path) that records the views at ``on_batch_end``."""

    def __init__(self, views: Views):
        super().__init__("batch end views")
        self.views = views

    def on_batch_end(self):
        self.views.record("batch_end")


def _train(general: bool, fail_at: Optional[Tuple[str, int]] = None) -> Views:
    torch.manual_seed(0)
    views = Views(fail_at)
    model = ViewedNet(views)
    data = TensorDataset(torch.randn(2 * BATCHES, 4), torch.randint(0, 3, (2 * BATCHES,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *_: views.record("step_pre"))
    optimizer.register_step_post_hook(lambda *_: views.record("step_post"))
    tl = TrainLoop(model, DataLoader(data, batch_size=2), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    views.train_loop = tl
    callbacks = [BatchEndViews(views)] if general else None
    try:
        tl.fit(num_epochs=1, callbacks=callbacks)
    except RuntimeError as error:
        assert "planned failure" in str(error)
        tl.fit(num_epochs=1)
    return views


def _without_batch_end(seen: List[tuple]) -> List[tuple]:
    return [view for view in seen if view[0] != "batch_end"]


def _assert_same_views(direct: List[tuple], general: List[tuple]) -> None:
    assert [view[:3] for view in direct] == [view[:3] for view in general]
    for direct_view, general_view in zip(direct, general):
        assert torch.equal(direct_view[3], general_view[3]), direct_view[:3]


def test_inside_a_batch_it_counts_and_is_summed_from_its_backward_on_on_both_paths():
    direct, general = _train(general=False), _train(general=True)
    _assert_same_views(direct.seen, _without_batch_end(general.seen))
    expected = []
    for batch in range(BATCHES):
        before = torch.stack(direct.losses[:batch]).sum() if batch else torch.zeros(())
        with_it = torch.stack(direct.losses[:batch + 1]).sum()
        expected += [("get_loss", batch, batch, before)] + [(where, batch, batch + 1, with_it) for where in POINTS[1:]]
    assert [view[:3] for view in direct.seen] == [view[:3] for view in expected]
    for view, (_, _, _, value) in zip(direct.seen, expected):
        torch.testing.assert_close(view[3], value)
    batch_ends = [view for view in general.seen if view[0] == "batch_end"]
    assert [view[1:3] for view in batch_ends] == [(batch, batch + 1) for batch in range(BATCHES)]


@pytest.mark.parametrize("where", POINTS)
@pytest.mark.parametrize("batch", [0, 2])
def test_a_fit_an_exception_left_inside_a_batch_continues_at_the_same_point_on_both_paths(where, batch):
    """The next fit's first view (and all after it) on the direct path are the general path's: an exception before
    the batch is done (every optimizer's step returned) trains the batch again, from the batch count and loss sum of
    the batches before it."""
    direct, general = _train(False, (where, batch)), _train(True, (where, batch))
    _assert_same_views(direct.seen, _without_batch_end(general.seen))
    failed_at = next(index for index, view in enumerate(direct.seen) if view[:2] == (where, batch))
    continued = direct.seen[failed_at + 1]
    assert continued[:3] == ("get_loss", batch + 1, batch)  # (the views' batch counter counts the batch again)
    before = torch.stack(direct.losses[:batch]).sum() if batch else torch.zeros(())
    torch.testing.assert_close(continued[3], before)
    if where != "step_post":  # (there the optimizer had changed the weights: the batch trains on others again)
        # The batch trained again is summed as the uninterrupted run summed it: the same accumulated loss.
        straight = _train(general=False).train_loop.train_history["accumulated_loss"]
        assert direct.train_loop.train_history["accumulated_loss"] == straight
