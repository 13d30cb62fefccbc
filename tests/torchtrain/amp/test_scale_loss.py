"""amp.scale_loss: overflow skipping with several models, optimizers and losses, dynamic and static scales,
gradient accumulation and delay_unscale.

Loss scales are powers of two and bfloat16 has float32's exponent range, so scaling and unscaling are exact
here: a run with a different scale history gives bitwise the same gradients, which lets the references below
be the same training without the injected overflow, skipping the same optimizer steps by hand. With bfloat16
O1 and O2 do no loss scaling by default, so the tests of scaling ask for ``loss_scale='dynamic'``.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.model import TTModel

LOW = torch.bfloat16
INITIAL_SCALE = 2.0 ** 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def batch(iteration, n=6):
    generator = torch.Generator().manual_seed(50 + iteration)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 1, generator=generator)


def inject_inf(model):
    """What an overflowing backward leaves behind: an inf in one gradient (of the low-precision model)."""
    model.fc1.weight.grad[0, 0] = float("inf")


def snapshot(models):
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def same(params_a, params_b):
    return all(torch.equal(a, b) for a, b in zip(params_a, params_b))


# --- several models, optimizers and losses with one injected overflow ------------------------------------
# scenario -> (number of optimizers, number of losses, which optimizers skip when loss 1 overflows)
SCENARIOS = {
    "2models-1optimizer-2losses": (1, 2, {0}),
    "2models-2optimizers-2losses": (2, 2, {1}),
    "2models-2optimizers-1loss": (2, 1, {0, 1}),
}
NUM_ITERATIONS = 5
OVERFLOW_AT = 2


def train_models(opt_level, scenario, overflow_at=None, skip_by_hand_at=None):
    num_optimizers, num_losses, skipped = SCENARIOS[scenario]
    torch.manual_seed(0)
    models = [Net(), Net()]
    if num_optimizers == 1:
        optimizers = [torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.05, momentum=0.9)]
    else:
        optimizers = [torch.optim.Adam(models[0].parameters(), lr=0.01),
                      torch.optim.SGD(models[1].parameters(), lr=0.05, momentum=0.9)]
    models, optimizers = amp.initialize(models, optimizers, opt_level=opt_level, num_losses=num_losses,
                                        loss_scale="dynamic", verbosity=0)
    history = [snapshot(models)]
    for iteration in range(NUM_ITERATIONS):
        x, y = batch(iteration)
        losses = [F.mse_loss(models[0](x), y), F.mse_loss(models[1](x), y)]
        if num_losses == 1:
            plan = [(losses[0] + losses[1], optimizers, 0)]
        else:
            plan = [(losses[0], optimizers[0], 0), (losses[1], optimizers[-1], 1)]
        for loss, loss_optimizers, loss_id in plan:
            with amp.scale_loss(loss, loss_optimizers, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward()
                if iteration == overflow_at and loss_id == num_losses - 1:
                    inject_inf(models[1])
        for index, optimizer in enumerate(optimizers):
            if not (iteration == skip_by_hand_at and index in skipped):
                optimizer.step()
            optimizer.zero_grad()
        history.append(snapshot(models))
    return models, optimizers, history


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_injected_overflow_skips_exactly_that_iteration(opt_level, scenario):
    num_optimizers, num_losses, skipped = SCENARIOS[scenario]
    models, optimizers, history = train_models(opt_level, scenario, overflow_at=OVERFLOW_AT)
    ref_models, _, ref_history = train_models(opt_level, scenario, skip_by_hand_at=OVERFLOW_AT)
    # The whole run equals the same training with those optimizer steps left out by hand.
    for step, (got, expected) in enumerate(zip(history, ref_history)):
        assert same(got[0], expected[0]) and same(got[1], expected[1]), f"iteration {step} differs"
    # The skipped optimizers left their parameters unchanged at that iteration; the others stepped.
    skipped_models = {0, 1} if num_optimizers == 1 else skipped
    before, after = history[OVERFLOW_AT], history[OVERFLOW_AT + 1]
    for index in range(2):
        assert same(before[index], after[index]) == (index in skipped_models)
        assert not same(history[-2][index], history[-1][index])  # later steps proceed
    state = amp.state_of(optimizers[0])
    overflowed = num_losses - 1
    assert state.loss_scalers[overflowed].state_dict() == {
        "loss_scale": INITIAL_SCALE / 2, "unskipped": NUM_ITERATIONS - OVERFLOW_AT - 1}
    if num_losses == 2:
        assert state.loss_scalers[0].state_dict() == {"loss_scale": INITIAL_SCALE, "unskipped": NUM_ITERATIONS}
    if num_optimizers == 2 and opt_level == "O1":  # Adam's step count did not advance on the skipped step
        adam_steps = optimizers[0].state[models[0].fc1.weight]["step"].item()
        assert adam_steps == NUM_ITERATIONS - (0 in skipped)


def test_last_step_skipped_reports_the_skip_so_a_scheduler_can_hold_back():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    skips = []
    for iteration in range(4):
        x, y = batch(iteration)
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if iteration == 1:
                inject_inf(model)
        optimizer.step()
        skips.append(amp.last_step_skipped(optimizer))
        if not amp.last_step_skipped(optimizer):
            scheduler.step()
        optimizer.zero_grad()
    assert skips == [False, True, False, False]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


def overflowing_steps(num_steps, **initialize_kwargs):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, verbosity=0, **{"loss_scale": "dynamic", **initialize_kwargs})
    initial = snapshot([model])
    scales = []
    for iteration in range(num_steps):
        x, y = batch(iteration)
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            inject_inf(model)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
    assert same(initial[0], snapshot([model])[0])  # every step was skipped
    assert not optimizer.state  # the optimizer never ran
    return scales


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_forced_overflows_halve_the_scale_exactly(opt_level):
    assert overflowing_steps(4, opt_level=opt_level) == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 12]


def test_min_loss_scale_floors_the_halving():
    assert overflowing_steps(4, min_loss_scale=2.0 ** 14) == [2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14]


def test_max_loss_scale_caps_the_initial_scale():
    model, optimizer = amp.initialize(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), max_loss_scale=1024.0,
                                      loss_scale="dynamic", verbosity=0)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 0}


def test_overflow_in_the_first_of_two_accumulated_blocks_skips_the_step():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic", verbosity=0)
    initial = snapshot([model])
    for part in range(2):
        x, y = batch(part)
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
            if part == 0:
                inject_inf(model)
    optimizer.step()
    assert same(initial[0], snapshot([model])[0])
    assert amp.last_step_skipped(optimizer)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": INITIAL_SCALE / 2, "unskipped": 1}


# --- static scales ---------------------------------------------------------------------------------------
def plain_grads(model, x, y):
    """Gradients of the same prepared model (a deepcopy keeps its autocast hooks) without any scaling."""
    copied = copy.deepcopy(model)
    F.mse_loss(copied(x), y).float().backward()
    return [p.grad for p in copied.parameters()]


@pytest.mark.parametrize("loss_scale", [128.0, "128.0", 128])
def test_static_loss_scale_scales_unscales_and_never_skips(loss_scale):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=loss_scale, verbosity=0)
    x, y = batch(0)
    expected = plain_grads(model, x, y)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert torch.equal(scaled_loss, loss * 128.0)
        scaled_loss.backward()
    for param, grad in zip(model.parameters(), expected):
        assert torch.equal(param.grad, grad)
    with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
        inject_inf(model)
    optimizer.step()
    assert not amp.last_step_skipped(optimizer)  # a static scale never skips (apex)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


@pytest.mark.parametrize("opt_level, outputs", [("O0", None), ("O3", None), ("O3", LOW)])
def test_static_scale_of_one_yields_the_loss_in_float32_and_does_nothing_else(opt_level, outputs):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, cast_model_outputs=outputs,
                                      verbosity=0)
    x, y = batch(0)
    copied = copy.deepcopy(model)
    out = copied(x)
    F.mse_loss(out, y.to(out.dtype)).backward()
    out = model(x)
    loss = F.mse_loss(out, y.to(out.dtype))
    assert loss.dtype == (outputs or torch.float32)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss.dtype == torch.float32 and torch.equal(scaled_loss, loss.float())
        scaled_loss.backward()
    for param, expected in zip(model.parameters(), copied.parameters()):
        assert torch.equal(param.grad, expected.grad)  # untouched: no unscaling, no master copies
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}


# --- gradient accumulation --------------------------------------------------------------------------------
def prepared_net(opt_level):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    return reference, model, optimizer


def stepped_grads(optimizer):
    return [p.grad for p in amp.master_params(optimizer)]


def scaled_grads_by_hand(model, batches, scale):
    """Backward of ``loss * scale`` for each batch into one copy of the prepared model, accumulating."""
    copied = copy.deepcopy(model)
    for x, y in batches:
        (F.mse_loss(copied(x), y).float() * scale).backward()
    return [p.grad for p in copied.parameters()]


def unscale_by_hand(grads, scale):
    inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
    return [g.float() * inverse for g in grads]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_scale_loss_blocks_before_one_step_sum_the_true_grads(opt_level):
    reference, model, optimizer = prepared_net(opt_level)
    batches = [batch(0), batch(1)]
    # Each block is unscaled on its own exit, then added to what earlier blocks left.
    by_hand = [unscale_by_hand(scaled_grads_by_hand(model, [b], INITIAL_SCALE), INITIAL_SCALE) for b in batches]
    expected = [second + first for first, second in zip(*by_hand)]
    for x, y in batches:
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
    grads = stepped_grads(optimizer)
    for grad, hand in zip(grads, expected):
        assert grad.dtype == torch.float32 and torch.equal(grad, hand)
    for x, y in batches:
        F.mse_loss(reference(x), y).backward()
    for grad, fp32 in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(grad, fp32, rtol=3e-2, atol=3e-2 * fp32.abs().max().item())
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 2  # apex updates once per scale_loss exit


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_unscale_keeps_grads_scaled_until_the_last_block(opt_level):
    reference, model, optimizer = prepared_net(opt_level)
    batches = [batch(0), batch(1)]
    scaled_by_hand = scaled_grads_by_hand(model, batches[:1], INITIAL_SCALE)
    expected = unscale_by_hand(scaled_grads_by_hand(model, batches, INITIAL_SCALE), INITIAL_SCALE)
    x, y = batches[0]
    with amp.scale_loss(F.mse_loss(model(x), y), optimizer, delay_unscale=True) as scaled_loss:
        scaled_loss.backward()
    for param, grad in zip(model.parameters(), scaled_by_hand):  # still scaled, still in the model's dtype
        assert torch.equal(param.grad, grad)
    x, y = batches[1]
    with amp.scale_loss(F.mse_loss(model(x), y), optimizer, model=model, delay_overflow_check=False) as scaled_loss:
        scaled_loss.backward()
    for grad, hand in zip(stepped_grads(optimizer), expected):
        assert torch.equal(grad, hand)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


def test_accumulated_grads_step_like_one_large_batch_within_tolerance():
    reference, model, optimizer = prepared_net("O2")
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        for part in range(2):
            x, y = batch(2 * step + part)
            with amp.scale_loss(F.mse_loss(model(x), y) / 2, optimizer) as scaled_loss:
                scaled_loss.backward()
            (F.mse_loss(reference(x), y) / 2).backward()
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    for master, param in zip(amp.master_params(optimizer), reference.parameters()):
        torch.testing.assert_close(master, param, rtol=2e-2, atol=2e-2)


class LinearTTModel(TTModel):
    """A linear regression whose loss is infinite at its ``inf_at_call``-th get_loss (never when None)."""

    def __init__(self, inf_at_call=None):
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.calls, self.inf_at_call = 0, inf_at_call

    def forward(self, x):
        return self.linear(x)

    def get_loss(self, batch_data, criterion, device):
        self.calls += 1
        x, y = batch_data
        loss = criterion(self(x), y)
        return loss * float("inf") if self.calls == self.inf_at_call else loss

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x), y, None


def steps_seen_by_amp(dtype, inf_at_call=None):
    """``(amp.last_step_skipped, tl.optimizer_step_skipped)`` after each step of a 2-epoch TrainLoop fit (2 batches
    an epoch) of an O1 model in ``dtype``."""
    from torch.utils.data import DataLoader, TensorDataset

    from aitoolbox.torchtrain.callbacks.basic import FunctionOnTrainLoop
    from aitoolbox.torchtrain.train_loop import TrainLoop

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    model = LinearTTModel(inf_at_call)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
    seen = []
    record = FunctionOnTrainLoop(lambda tl: seen.append((amp.last_step_skipped(optimizer), tl.optimizer_step_skipped)),
                                 after_optimizer_step=True)
    tl = TrainLoop(model, DataLoader(data, batch_size=4), None, None, optimizer, nn.MSELoss(), use_amp=True,
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=2, callbacks=[record])
    return seen


def test_last_step_skipped_reports_a_step_the_train_loop_skipped():
    """TrainLoop skips an overflow step without calling optimizer.step(); amp must still report it."""
    seen = steps_seen_by_amp(torch.float16, inf_at_call=2)
    assert [amp_says for amp_says, _ in seen] == [loop_says for _, loop_says in seen]
    assert seen[1] == (True, True)  # the infinite loss
    assert not all(skipped for skipped, _ in seen)


def test_last_step_skipped_is_false_at_every_train_loop_step_without_loss_scaling():
    """O1 in bfloat16 scales no loss, so nothing skips: amp says so after each step TrainLoop takes (the mutation
    run, mut47: telling amp "skipped" on that road survived; a scheduler held back on skipped steps never steps)."""
    assert [amp_says for amp_says, _ in steps_seen_by_amp(torch.bfloat16)] == [False] * 4
