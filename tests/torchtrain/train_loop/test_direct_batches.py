"""The direct batch path (``TrainLoop._train_direct_batches``: no callback with a batch hook, no context around a
batch, a plain precision, every batch steps) against the general one, which a callback with an empty batch hook
forces: the same weights, buffers, optimizer state, history, counters and random state, bit for bit, through the
things that happen inside an epoch (an exception in ``get_loss`` or in the optimizer's step and the ``fit`` that
continues, a stop, ``num_iterations``, a MultiLoss, a callback registered or a precision assigned mid-epoch, a
loader without ``len``). The direct path exists for speed alone (benchmarks/overhead.py); nothing it trains may
differ."""
from typing import List, Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import IterableTensorData, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

BATCH_SIZE = 3


class EmptyBatchHook(AbstractCallback):
    """Does nothing, in a batch hook: the loop takes the general path for every batch."""

    def __init__(self):
        super().__init__("empty batch hook")

    def on_batch_end(self):
        pass


class ClipsAndCounts(AbstractCallback):
    """Clips the gradients before each step (so a missed hook changes the weights) and counts its hooks, with the
    step flags each ``on_after_optimizer_step`` sees; raises in the ``fail_at``-th of those (counted from 0)."""

    def __init__(self, fail_at: Optional[int] = None):
        super().__init__("clips and counts")
        self.calls: List[str] = []
        self.fail_at, self.steps_seen = fail_at, 0

    def on_after_gradient_update(self, optimizer_idx):
        self.calls.append("gradient")
        torch.nn.utils.clip_grad_norm_(self.train_loop_obj.model.parameters(), max_norm=0.05)

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        self.calls.append(f"step skipped={tl.optimizer_step_skipped} stepped={tl.stepped_optimizers}")
        self.steps_seen += 1
        if self.steps_seen - 1 == self.fail_at:
            raise RuntimeError("planned failure in on_after_optimizer_step")

    def on_batch_end(self):
        self.calls.append("batch_end")


class HalvingPrecision(Precision):
    """A user's precision whose own step halves the gradients first."""

    def step(self, optimizers, update_scale=True):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(0.5)
        return super().step(optimizers, update_scale)


PRECISIONS = {
    "plain": lambda: Precision(device_type="cpu"),
    "own step": lambda: HalvingPrecision(device_type="cpu"),
    "dynamic scale": lambda: Precision(device_type="cpu", loss_scaler=LossScaler("dynamic", growth_interval=2)),
}


class Plan:
    """What happens at which training batch (counted over the whole test, from 0; the continuing fit counts on)."""

    def __init__(self, fail_in_loss: Optional[int] = None, fail_in_step: Optional[int] = None,
                 stop_at: Optional[int] = None, register_at: Optional[int] = None,
                 precision_at: Optional[int] = None, precision: str = "plain", criterion_at: Optional[int] = None,
                 multi_loss: bool = False, register_in_backward_at: Optional[int] = None,
                 register_in_step_at: Optional[int] = None, precision_in_backward_at: Optional[int] = None,
                 fail_in_after_step_at: Optional[int] = None):
        self.fail_in_loss, self.fail_in_step, self.stop_at = fail_in_loss, fail_in_step, stop_at
        self.register_at, self.precision_at, self.precision = register_at, precision_at, precision
        self.criterion_at, self.multi_loss = criterion_at, multi_loss
        self.register_in_backward_at, self.register_in_step_at = register_in_backward_at, register_in_step_at
        self.precision_in_backward_at = precision_in_backward_at
        self.registered = ClipsAndCounts(fail_at=fail_in_after_step_at)
        self.batches = 0
        self.steps = 0
        self.train_loop: Optional[TrainLoop] = None


class PlannedNet(TTModel):
    """Dropout (random draws) and BatchNorm (buffers), with the plan's events in ``get_loss``."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x)

    def get_loss(self, batch_data, criterion, device):
        plan, tl = self.plan, self.plan.train_loop
        batch = plan.batches
        plan.batches += 1
        if batch == plan.register_at:
            tl.callbacks_handler.register_callbacks([plan.registered])
        if batch == plan.precision_at:
            tl.precision = PRECISIONS[plan.precision]()
        if batch == plan.criterion_at:
            tl.criterion = criterion = nn.CrossEntropyLoss(label_smoothing=0.2)
        if batch == plan.stop_at:
            tl.stop_training("planned stop")
        x, y = batch_data
        outputs = self(x.to(device))
        loss = criterion(outputs, y.to(device))
        if batch == plan.fail_in_loss:
            raise RuntimeError("planned failure in get_loss")
        if batch == plan.register_in_backward_at:  # from inside the batch's backward pass
            loss.register_hook(lambda grad: tl.callbacks_handler.register_callbacks([plan.registered]))
        if batch == plan.precision_in_backward_at:

            def assign_precision(grad):
                tl.precision = PRECISIONS[plan.precision]()
            loss.register_hook(assign_precision)
        if plan.multi_loss:
            return MultiLoss({"main": loss, "small": 0.1 * outputs.pow(2).mean()})
        return loss

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).argmax(dim=1), y, {}


class PlannedSGD(torch.optim.SGD):
    """Raises in the step the plan says (before changing anything)."""

    def __init__(self, params, plan: Plan):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.plan = plan

    def step(self, closure=None):
        step = self.plan.steps
        self.plan.steps += 1
        if step == self.plan.fail_in_step:
            raise RuntimeError("planned failure in the optimizer's step")
        if step == self.plan.register_in_step_at:
            self.plan.train_loop.callbacks_handler.register_callbacks([self.plan.registered])
        return super().step(closure)


def _train(plan: Plan, general: bool, num_samples: int, sized: bool, shuffle: bool, num_epochs: int,
           num_iterations: int) -> dict:
    torch.manual_seed(0)
    model = PlannedNet(plan)
    generator = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(num_samples, 4, generator=generator),
                         torch.randint(0, 3, (num_samples,), generator=generator))
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=shuffle, generator=torch.Generator().manual_seed(3)) \
        if sized else DataLoader(IterableTensorData(data), batch_size=BATCH_SIZE)
    tl = TrainLoop(model, loader, None, None, PlannedSGD(model.parameters(), plan), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False)
    plan.train_loop = tl
    callbacks: List[AbstractCallback] = [EmptyBatchHook()] if general else []
    targets = {"num_iterations": num_iterations} if num_iterations else {"num_epochs": num_epochs}
    failures = 0
    for attempt in range(3):
        try:
            tl.fit(callbacks=callbacks if attempt == 0 else None, **targets)
            break
        except RuntimeError as error:
            assert "planned failure" in str(error)
            failures += 1
    return {"state": {name: value.clone() for name, value in model.state_dict().items()},
            "precision": tl.precision.state_dict(), "hooks": list(plan.registered.calls),
            "optimizer": tl.optimizer.state_dict()["state"], "history": dict(tl.train_history),
            "counters": (tl.epoch, tl.iteration, tl.total_iteration_idx, tl.early_stop, failures),
            "rng": torch.get_rng_state(), "batches": plan.batches, "steps": plan.steps}


def _assert_same(direct: dict, general: dict) -> None:
    assert direct["counters"] == general["counters"]
    assert (direct["batches"], direct["steps"]) == (general["batches"], general["steps"])
    for name, value in general["state"].items():
        assert torch.equal(direct["state"][name], value), name
    for index, state in general["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(direct["optimizer"][index][key], value), (index, key)
    assert direct["history"] == general["history"]
    assert direct["hooks"] == general["hooks"]
    assert direct["precision"] == general["precision"]
    assert torch.equal(direct["rng"], general["rng"])


def _both(plan_args: dict, **run) -> None:
    direct = _train(Plan(**plan_args), general=False, **run)
    general = _train(Plan(**plan_args), general=True, **run)
    _assert_same(direct, general)


events = st.none() | st.integers(0, 14)
QUICK = settings(max_examples=15, deadline=None, derandomize=True, database=None)
EXTENDED = settings(max_examples=250, deadline=None, database=None)


@st.composite
def runs(draw) -> dict:
    """A loader of whole batches and maybe a tail of 2 (BatchNorm refuses a batch of one sample), how long to train,
    and a plan of events."""
    sized = draw(st.booleans())
    run = dict(num_samples=BATCH_SIZE * draw(st.integers(1, 5)) + draw(st.sampled_from([0, 2])), sized=sized,
               shuffle=sized and draw(st.booleans()), num_epochs=draw(st.integers(1, 3)),
               num_iterations=draw(st.sampled_from([0, 0, 1, 4, 7])))
    plan = dict(fail_in_loss=draw(events), fail_in_step=draw(events), stop_at=draw(events),
                register_at=draw(events), precision_at=draw(events), precision=draw(st.sampled_from(sorted(PRECISIONS))),
                criterion_at=draw(events), multi_loss=draw(st.booleans()), register_in_backward_at=draw(events),
                register_in_step_at=draw(events), precision_in_backward_at=draw(events))
    return {"plan_args": plan, **run}


@QUICK
@given(drawn=runs())
def test_the_direct_path_trains_what_the_general_path_trains(drawn):
    _both(**drawn)


@pytest.mark.extended
@pytest.mark.slow
@EXTENDED
@given(drawn=runs())
def test_the_direct_path_trains_what_the_general_path_trains_extended(drawn):
    _both(**drawn)


@pytest.mark.parametrize("plan_args", [
    {},
    {"fail_in_loss": 4},
    {"fail_in_step": 2},
    {"stop_at": 3},
    {"register_at": 2, "fail_in_loss": 5},
    {"precision_at": 1, "fail_in_step": 4},
    {"precision_at": 3, "precision": "own step"},
    {"precision_at": 2, "precision": "dynamic scale"},
    {"register_at": 3},
    {"criterion_at": 3},
    {"register_in_backward_at": 3},
    {"register_in_step_at": 2, "fail_in_loss": 6},
    {"precision_in_backward_at": 2, "precision": "own step"},
    {"multi_loss": True, "fail_in_loss": 3},
    {"register_in_step_at": 2, "fail_in_after_step_at": 0},
], ids=["plain", "get_loss raises", "step raises", "stop", "callback registered", "precision assigned",
        "own precision step from a batch", "loss scaling from a batch", "clipping callback from a batch",
        "criterion replaced", "callback registered in the backward", "callback registered in the step",
        "precision assigned in the backward", "MultiLoss", "callback registered in the step raises after it"])
def test_named_cases_of_the_direct_path(plan_args):
    _both(plan_args, num_samples=20, sized=True, shuffle=True, num_epochs=2, num_iterations=0)


def _three_batch_loop() -> TrainLoop:
    """A PlannedNet with nothing planned, over 3 batches an epoch."""
    plan = Plan()
    torch.manual_seed(0)
    model = PlannedNet(plan)
    loader = DataLoader(TensorDataset(torch.randn(9, 4), torch.randint(0, 3, (9,))), batch_size=BATCH_SIZE)
    plan.train_loop = TrainLoop(model, loader, None, None, PlannedSGD(model.parameters(), plan), nn.CrossEntropyLoss(),
                                end_auto_eval=False, show_progress=False)
    return plan.train_loop


def test_the_common_case_takes_the_direct_path_and_a_batch_hook_the_general_one():
    """(What the test above compares is two paths: a loop that took the general one in both runs would pass it.)"""
    taken = {}
    for general in (False, True):
        tl = _three_batch_loop()
        calls = []
        tl._run_batch = lambda batch, step, run=tl._run_batch: (calls.append(1), run(batch, step))[1]
        tl.fit(num_epochs=1, callbacks=[EmptyBatchHook()] if general else None)
        taken[general] = len(calls)
    assert taken == {False: 0, True: 3}


def test_a_precision_whose_instance_has_its_own_step_takes_the_general_path():
    """``passes_through`` looks at the instance too: a step replaced on the object is the step that runs."""
    results = []
    for general in (False, True):
        tl = _three_batch_loop()
        model = tl.model
        precision = Precision(device_type="cpu")
        calls = []

        def clamped_step(optimizers, update_scale=True, plain_step=precision.step):
            calls.append(1)
            for param in model.parameters():
                param.grad.clamp_(-0.01, 0.01)
            return plain_step(optimizers, update_scale)

        precision.step = clamped_step
        tl.precision = precision
        tl.fit(num_epochs=1, callbacks=[EmptyBatchHook()] if general else None)
        results.append((len(calls), [value.clone() for value in model.state_dict().values()]))
    (calls_direct, direct), (calls_general, general) = results
    assert calls_direct == calls_general == 3
    assert all(torch.equal(a, b) for a, b in zip(direct, general))


def test_a_float32_unscale_is_forgotten_at_the_step_and_the_direct_path_comes_back():
    """In float32 ``unscale_`` (a clipping callback's) only records the call; the step forgets it, or no later batch
    of the run would take the direct path (written for the mutation run: dropping the step's ``clear`` trains the
    same, a few microseconds a batch slower)."""
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    precision = Precision()
    assert precision.passes_through()
    parameter.grad = torch.ones(2)
    precision.unscale_(optimizer)
    assert not precision.passes_through()  # a step in progress
    assert precision.step([optimizer])
    assert precision.passes_through()
