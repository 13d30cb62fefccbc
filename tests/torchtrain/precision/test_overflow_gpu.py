"""Overflow handling on a CUDA GPU, where the device runs behind the host.

The overflow check runs on the device; the decision to skip the step is taken on the host. Each test keeps the
GPU busy (``torch.cuda._sleep``) between backward and the check, so the check finishes long after the host
reaches the point where it reads the verdict: a read that does not wait for the device (a ``non_blocking``
copy read at once) sees "no overflow" and steps on inf gradients. The tests inject the overflow (an inf in a
gradient, or an infinite loss) and check that the step was skipped: parameters, float32 masters and momentum
unchanged, the dynamic scale halved, and that training then goes on.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Spin-loop cycles for torch.cuda._sleep: tens of milliseconds on any current GPU, far longer than the host
# needs to get from the backward call to reading the overflow verdict.
BUSY_CYCLES = 100_000_000


def cuda_batch():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(16, 32, generator=generator).cuda(),
            torch.randint(0, 4, (16,), generator=generator).cuda())


def initialized(opt_level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)


def amp_step(model, optimizer, x, y, overflow=None):
    """One apex-style step; ``overflow`` is None, ``'loss'`` or ``'gradient'``."""
    loss = F.cross_entropy(model(x), y)
    if overflow == "loss":
        loss = loss * float("inf")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        torch.cuda._sleep(BUSY_CYCLES)  # the gradient write and the check below queue behind this
        if overflow == "gradient":
            with torch.no_grad():
                model[0].weight.grad.view(-1)[7] = float("inf")
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model, optimizer):
    stepped = list(amp.master_params(optimizer))
    return ([t.detach().clone() for t in model.state_dict().values()],
            [p.detach().clone() for p in stepped],
            [optimizer.state[p]["momentum_buffer"].clone() for p in stepped])


def assert_same(before, after):
    for group_before, group_after in zip(before, after):
        assert len(group_before) == len(group_after)
        for a, b in zip(group_before, group_after):
            assert torch.equal(a, b)


@pytest.mark.parametrize("overflow", ["gradient", "loss"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_overflow_on_cuda_skips_the_step_and_halves_the_scale(opt_level, overflow):
    model, optimizer = initialized(opt_level)
    state = amp.state_of(optimizer)
    assert state.properties.low_precision_dtype == torch.float16 and state.loss_scalers[0].dynamic
    if opt_level == "O2":
        assert all(p.dtype == torch.float16 for p in model.parameters())
        assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))
    x, y = cuda_batch()
    amp_step(model, optimizer, x, y)  # a first, normal step: momentum buffers exist and must not move either
    scale = state.loss_scalers[0].loss_scale
    before = snapshot(model, optimizer)

    amp_step(model, optimizer, x, y, overflow=overflow)

    assert amp.last_step_skipped(optimizer)
    assert state.loss_scalers[0].loss_scale == scale / 2
    assert_same(before, snapshot(model, optimizer))
    amp_step(model, optimizer, x, y)  # training goes on at the halved scale
    assert not amp.last_step_skipped(optimizer)
    assert state.loss_scalers[0].loss_scale == scale / 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before[0][0], model.state_dict()["0.weight"])


class SlowDeviceOverflowCheck(AbstractCallback):
    """Delays the device before every step, injects an inf into one batch's gradient, and records for every
    step whether it was skipped and whether the parameters changed."""

    def __init__(self, overflow_iteration):
        super().__init__("slow device overflow check")
        self.overflow_iteration = overflow_iteration
        self.steps = []  # (skipped, parameters changed)
        self._before = None

    def on_batch_begin(self):
        self._before = [p.detach().clone() for p in self.train_loop_obj.model.parameters()]

    def on_after_gradient_update(self, optimizer_idx):
        torch.cuda._sleep(BUSY_CYCLES)
        if self.train_loop_obj.total_iteration_idx == self.overflow_iteration:
            with torch.no_grad():
                next(self.train_loop_obj.model.parameters()).grad.view(-1)[0] = float("inf")

    def on_after_optimizer_step(self):
        changed = any(not torch.equal(a, b) for a, b in zip(self._before, self.train_loop_obj.model.parameters()))
        self.steps.append((self.train_loop_obj.optimizer_step_skipped, changed))


@pytest.mark.parametrize("use_amp", [True, {"opt_level": "O1"}, {"opt_level": "O2"}], ids=["true", "O1", "O2"])
def test_train_loop_on_cuda_skips_exactly_the_overflowing_step(use_amp):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tl = TrainLoop(model, seeded_loader(classification_data(32)), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp=use_amp)
    check = SlowDeviceOverflowCheck(overflow_iteration=2)
    tl.fit(num_epochs=1, callbacks=[check])
    assert tl.device.type == "cuda"
    assert check.steps == [(False, True), (False, True), (True, False), (False, True)]
    assert tl.precision.loss_scaler.loss_scale == 2.0 ** 16 / 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
