"""Optimizers stepped one after another (a MultiLoss with one loss per optimizer, aitoolbox 1.x's order) accumulate
gradients as optimizers stepped together do: under O2's master weights, every accumulating micro-batch's gradients
go into the float32 masters, and only the window's last backward leaves that to the step.

Two heads on the same input, each trained by its own loss and optimizer, train each parameter exactly as one
optimizer over both heads stepping on the sum of the losses (the gradient of a sum of losses over disjoint
parameters is each loss's own gradient; Adam updates each parameter alone): the per-optimizer road is compared
with the together road bit for bit. (The mutation run's survivor at step_runner.py's per-optimizer backward,
``accumulating=not work.step_due`` inverted, summed the accumulating micro-batches in bfloat16.)"""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import IterableTensorData, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


class TwoHeads(TTModel):
    """Two independent linear heads; ``get_loss`` returns one cross-entropy per head."""

    def __init__(self):
        super().__init__()
        self.head_a = nn.Linear(6, 3)
        self.head_b = nn.Linear(6, 3)

    def forward(self, x):
        return self.head_a(x), self.head_b(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0].to(device), batch_data[1].to(device)
        out_a, out_b = self(x)
        return MultiLoss({"a": criterion(out_a.float(), y), "b": criterion(out_b.float(), y)})

    def get_predictions(self, batch_data, device):
        out_a, _ = self(batch_data[0].to(device))
        return out_a.argmax(dim=1), batch_data[1], {}


def _train(per_optimizer: bool, use_amp, grad_accumulation: int) -> TwoHeads:
    torch.manual_seed(0)
    model = TwoHeads()
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(28, 6, generator=generator), torch.randint(0, 3, (28,), generator=generator))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    if per_optimizer:
        optimizer = MultiOptimizer([torch.optim.Adam(model.head_a.parameters(), lr=0.05),
                                    torch.optim.Adam(model.head_b.parameters(), lr=0.05)])
    else:
        optimizer = torch.optim.Adam(list(model.head_a.parameters()) + list(model.head_b.parameters()), lr=0.05)
    tl = TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False, use_amp=use_amp)
    tl.fit(num_epochs=2, grad_accumulation=grad_accumulation)
    return model


@pytest.mark.parametrize("use_amp", [False, {"opt_level": "O2", "dtype": torch.bfloat16},
                                     {"opt_level": "O2", "dtype": torch.bfloat16, "loss_scale": "dynamic"}],
                         ids=["fp32", "O2", "O2 dynamic scale"])
@pytest.mark.parametrize("grad_accumulation", [1, 3])
def test_optimizers_stepped_in_turn_accumulate_as_optimizers_stepped_together(use_amp, grad_accumulation):
    in_turn = _train(True, use_amp, grad_accumulation)
    together = _train(False, use_amp, grad_accumulation)
    for (name, value), (_, expected) in zip(in_turn.state_dict().items(), together.state_dict().items()):
        assert torch.equal(value, expected), name


# --- a plain loss after optimizers stepped in turn -------------------------------------------------------------
class SwitchableHeads(TwoHeads):
    """TwoHeads whose ``get_loss`` returns the sum of its two losses (a plain tensor) once ``plain`` is set."""

    plain = False

    def get_loss(self, batch_data, criterion, device):
        loss = super().get_loss(batch_data, criterion, device)
        return loss["a"] + loss["b"] if self.plain else loss


class GlobalNormClip(AbstractCallback):
    """A user's clipping of the whole model's gradient norm, once both optimizers' gradients are in (at the
    hook of the last optimizer); it records the hooks of each step: ``("clip", idx)`` and the optimizers each
    ``on_after_optimizer_step`` reports stepped."""

    def __init__(self):
        super().__init__("global norm clip")
        self.events = []

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if tl.should_execute_optimizer_update():
            self.events.append(("clip", optimizer_idx))
            if optimizer_idx == len(tl.optimizers) - 1:
                torch.nn.utils.clip_grad_norm_(tl.model.parameters(), 0.05)

    def on_after_optimizer_step(self):
        self.events.append(("stepped", tuple(self.train_loop_obj.stepped_optimizers)))


def _multi_loss_then_plain(with_len: bool):
    torch.manual_seed(0)
    model = SwitchableHeads()
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(28, 6, generator=generator), torch.randint(0, 3, (28,), generator=generator))
    loader = DataLoader(data if with_len else IterableTensorData(data), batch_size=4)  # 7 batches an epoch
    optimizer = MultiOptimizer([torch.optim.SGD(model.head_a.parameters(), lr=0.5),
                                torch.optim.SGD(model.head_b.parameters(), lr=0.5)])
    clip = GlobalNormClip()
    tl = TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False)
    tl.fit(num_epochs=1, grad_accumulation=2, callbacks=[clip])  # the optimizers stepped in turn
    model.plain = True
    clip.events.clear()
    tl.fit(num_epochs=2, grad_accumulation=2)  # one loss: both optimizers step together
    return model, clip.events


def test_a_plain_loss_after_a_multiloss_steps_its_epoch_end_window_with_every_optimizer_together():
    """A fit of a MultiLoss (optimizers stepped in turn), then one of a plain loss: the plain loss's last, partial
    window, stepped at the epoch's end of a loader without len, steps both optimizers together, as the loader
    with len steps it at its last batch: both optimizers' gradients clipped as one before either steps (a
    step in turn stepped head a unclipped: the mutation run's survivor at step_runner.py's
    ``_per_optimizer_last = False`` dropped for a plain loss)."""
    without_len, events = _multi_loss_then_plain(with_len=False)
    with_len, expected_events = _multi_loss_then_plain(with_len=True)
    step = [("clip", 0), ("clip", 1), ("stepped", (0, 1))]
    assert events == expected_events == step * 4  # the windows of batches 1-2, 3-4, 5-6 and 7
    for (name, value), (_, expected) in zip(without_len.state_dict().items(), with_len.state_dict().items()):
        assert torch.equal(value, expected), name
