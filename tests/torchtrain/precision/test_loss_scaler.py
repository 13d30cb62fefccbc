"""LossScaler (apex's dynamic and static rules), the Precision object's step protocol, and the factory."""
import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.precision.factory import autocast_precision, default_low_precision_dtype, full_precision
from aitoolbox.torchtrain.precision.loss_scaler import GROWTH_INTERVAL


# --- the dynamic rule --------------------------------------------------------------------------------------
def test_dynamic_scale_starts_at_2_16_capped_by_max():
    assert LossScaler().loss_scale == 2.0 ** 16
    assert LossScaler(max_loss_scale=2.0 ** 24).loss_scale == 2.0 ** 16
    assert LossScaler(max_loss_scale=1024).loss_scale == 1024.0


def test_overflow_halves_exactly_and_resets_unskipped():
    scaler = LossScaler()
    for _ in range(5):
        scaler.update(False)
    assert scaler.unskipped == 5
    expected = 2.0 ** 16
    for _ in range(20):
        scaler.update(True)
        expected /= 2
        assert scaler.loss_scale == expected and scaler.unskipped == 0


def test_min_loss_scale_floors_the_scale():
    scaler = LossScaler(min_loss_scale=2.0 ** 14)
    scales = []
    for _ in range(4):
        scaler.update(True)
        scales.append(scaler.loss_scale)
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14]


def test_2000_unskipped_steps_double_the_scale_and_restart_the_count():
    scaler = LossScaler()
    for _ in range(GROWTH_INTERVAL - 1):
        scaler.update(False)
    assert GROWTH_INTERVAL == 2000
    assert scaler.loss_scale == 2.0 ** 16 and scaler.unskipped == 1999
    scaler.update(False)
    assert scaler.loss_scale == 2.0 ** 17 and scaler.unskipped == 0


def test_an_overflow_restarts_the_growth_window():
    scaler = LossScaler()
    for _ in range(1500):
        scaler.update(False)
    scaler.update(True)
    for _ in range(1999):
        scaler.update(False)
    assert scaler.loss_scale == 2.0 ** 15
    scaler.update(False)
    assert scaler.loss_scale == 2.0 ** 16


def test_growth_is_capped_at_max_loss_scale():
    scaler = LossScaler(max_loss_scale=3.0 * 2 ** 16)
    for _ in range(2 * GROWTH_INTERVAL):
        scaler.update(False)
    assert scaler.loss_scale == 3.0 * 2 ** 16
    for _ in range(GROWTH_INTERVAL):
        scaler.update(False)
    assert scaler.loss_scale == 3.0 * 2 ** 16 and scaler.unskipped == 0


# --- static scales -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [128, 128.0, "128.0", "128"])
def test_static_scale_accepts_anything_float_accepts_and_never_changes(value):
    scaler = LossScaler(value)
    assert not scaler.dynamic and scaler.loss_scale == 128.0
    for found_inf in [True, False] * GROWTH_INTERVAL:
        scaler.update(found_inf)
    assert scaler.loss_scale == 128.0 and scaler.unskipped == 0


@pytest.mark.parametrize("value", ["fast", None, 0, -2.0])
def test_bad_static_scale_is_rejected(value):
    with pytest.raises(ValueError, match="loss_scale"):
        LossScaler(value)


def test_a_growth_interval_of_one_grows_the_scale_after_every_unskipped_step():
    """The smallest interval is allowed, as torch.amp.GradScaler(growth_interval=1) allows it (the mutation run,
    mut47: refusing it survived)."""
    scaler = LossScaler("dynamic", init_scale=4.0, growth_interval=1)
    scales = []
    for found_inf in [False, False, True, False]:
        scaler.update(found_inf)
        scales.append((scaler.loss_scale, scaler.unskipped))
    assert scales == [(8.0, 0), (16.0, 0), (8.0, 0), (16.0, 0)]


@pytest.mark.parametrize("growth_interval", [0, -1, 2.0, True])
def test_bad_growth_interval_is_rejected(growth_interval):
    with pytest.raises(ValueError, match="growth_interval must be a positive int"):
        LossScaler("dynamic", growth_interval=growth_interval)


def test_state_dict_round_trip():
    scaler = LossScaler()
    scaler.update(True)
    scaler.update(False)
    state = scaler.state_dict()
    assert state == {"loss_scale": 2.0 ** 15, "unskipped": 1}
    restored = LossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    restored.load_state_dict({"loss_scale": 4, "unskipped": 7.0})  # apex checkpoints: plain numbers
    assert isinstance(restored.loss_scale, float) and isinstance(restored.unskipped, int)


# --- scaling and unscaling ---------------------------------------------------------------------------------
def test_scale_returns_a_float32_loss_times_the_scale():
    scaled = LossScaler(8.0).scale(torch.tensor(1.5, dtype=torch.bfloat16))
    assert scaled.dtype == torch.float32 and scaled.item() == 12.0


@pytest.mark.parametrize("scale", [2.0 ** 16, 1000.0, 3.0])
def test_unscale_matches_torch_grad_scaler_bitwise(scale):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=generator) * 1e3, torch.randn(7, generator=generator)]
    ours = [g.clone() for g in grads]
    assert not LossScaler(scale).unscale_grads(ours)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    optimizer = torch.optim.SGD(params, lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    torch_scaler.scale(torch.zeros(()))  # creates the scaler's scale tensor
    torch_scaler.unscale_(optimizer)
    for mine, param in zip(ours, params):
        assert torch.equal(mine, param.grad)


@pytest.mark.parametrize("bad_index", [0, 1], ids=["float32_group", "bfloat16_group"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_reports_non_finite_gradients(bad, bad_index):
    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(4)]
    grads[bad_index][0] = bad
    assert LossScaler().unscale_grads(grads)  # one flag per device, shared by its dtype groups
    assert LossScaler.has_overflow(grads)
    assert not LossScaler.has_overflow([torch.ones(3)])
    assert not LossScaler().unscale_grads([])


# --- the Precision object --------------------------------------------------------------------------------
def linear_with_grads(grad_value):
    model = nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.full_like(model.weight, grad_value)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def test_full_precision_is_the_same_object_switched_off():
    precision = full_precision("cpu")
    assert precision.autocast_dtype is None and precision.loss_scaler is None and precision.master_weights is None
    with precision.autocast():
        assert not torch.is_autocast_enabled("cpu")
    model, optimizer = linear_with_grads(0.5)
    weight = model.weight.detach().clone()
    assert precision.step([optimizer])
    assert torch.equal(model.weight.detach(), weight - 0.5)
    precision.zero_grad([optimizer])
    assert model.weight.grad is None


def test_factory_defaults():
    assert default_low_precision_dtype("cpu") == torch.bfloat16
    assert default_low_precision_dtype("cuda") == torch.float16
    bf16 = autocast_precision("cpu")
    assert bf16.autocast_dtype == torch.bfloat16 and bf16.loss_scaler is None  # bfloat16 needs no scaling
    fp16 = autocast_precision("cpu", torch.float16)
    assert fp16.autocast_dtype == torch.float16 and fp16.loss_scaler.dynamic
    static = autocast_precision("cpu", torch.bfloat16, loss_scale=256.0)
    assert static.loss_scaler.loss_scale == 256.0 and not static.loss_scaler.dynamic
    asked = autocast_precision("cpu", torch.bfloat16, loss_scale="dynamic")  # an explicit request is honoured
    assert asked.loss_scaler.dynamic and asked.loss_scaler.loss_scale == 2.0 ** 16
    assert autocast_precision("cuda").loss_scaler.dynamic  # float16, CUDA's default
    assert autocast_precision("cuda", torch.bfloat16).loss_scaler is None
    with bf16.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_precision_scales_backward_unscales_once_and_steps():
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.tensor([[1.0, 2.0]])
    precision.backward(model(x).sum())
    assert torch.equal(model.weight.grad, x * 2.0 ** 16)
    precision.unscale_(optimizer)
    precision.unscale_(optimizer)  # idempotent within a step
    assert torch.equal(model.weight.grad, x)
    weight = model.weight.detach().clone()
    assert precision.step([optimizer]) and not precision.last_step_skipped
    assert torch.equal(model.weight.detach(), weight - x)
    assert precision.loss_scaler.unskipped == 1


def test_precision_skips_the_step_on_overflow_and_halves_the_scale():
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    model, optimizer = linear_with_grads(float("inf"))
    weight = model.weight.detach().clone()
    assert not precision.step([optimizer])
    assert precision.last_step_skipped and torch.equal(model.weight.detach(), weight)
    assert precision.loss_scaler.state_dict() == {"loss_scale": 2.0 ** 15, "unskipped": 0}
    model.weight.grad = torch.ones_like(model.weight) * 2.0 ** 15
    assert precision.step([optimizer]) and not precision.last_step_skipped
    assert torch.equal(model.weight.detach(), weight - 1.0)


def test_precision_with_a_static_scale_never_skips():
    precision = Precision("cpu", loss_scaler=LossScaler(4.0))
    model, optimizer = linear_with_grads(float("inf"))
    assert precision.step([optimizer]) and not precision.last_step_skipped
    assert torch.isinf(model.weight).all()


def test_precision_state_dict_round_trip():
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    precision.loss_scaler.update(True)
    state = precision.state_dict()
    assert state == {"loss_scaler": {"loss_scale": 2.0 ** 15, "unskipped": 0}, "master_weights": None}
    fresh = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    fresh.load_state_dict(state)
    assert fresh.loss_scaler.loss_scale == 2.0 ** 15
    full_precision("cpu").load_state_dict(state)  # nothing to restore into: ignored


def test_a_step_after_scaling_is_switched_off_is_reported_not_skipped():
    """A step without scaling (the road without a scaler or masters) reports "not skipped" to ``last_step_skipped``
    and the step listener, also after a skipped step of a scaler switched off since (a change of the attribute, which
    the loop takes from the next epoch). ``last_step_skipped`` is what the loop reads after a 1.x own optimizer step
    (a per-step scheduler holds back on it); the listener is amp's ``last_step_skipped``. (The mutation run, mut50:
    either statement dropped survived.)"""
    heard = []
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"),
                          step_listener=lambda skipped, optimizers: heard.append((skipped, list(optimizers))))
    model, optimizer = linear_with_grads(float("inf"))
    assert not precision.step([optimizer]) and precision.last_step_skipped
    precision.zero_grad([optimizer])
    precision.loss_scaler = None
    model.weight.grad = torch.full_like(model.weight, 0.5)
    weight = model.weight.detach().clone()
    assert precision.step([optimizer])
    assert torch.equal(model.weight.detach(), weight - 0.5)
    assert not precision.last_step_skipped
    assert heard == [(True, [optimizer]), (False, [optimizer])]


def test_reset_forgets_the_overflow_verdict_of_an_abandoned_step():
    """An overflow found by the unscale_ of a step abandoned since (an exception before its optimizer step) does not
    skip the next step, whose own gradients are finite. (The mutation run, mut50: reset's ``_found_inf.clear()``
    dropped survived.)"""
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    model, optimizer = linear_with_grads(float("inf"))
    precision.unscale_(optimizer)
    precision.reset()
    model.weight.grad = torch.full_like(model.weight, 2.0 ** 16)
    weight = model.weight.detach().clone()
    assert precision.step([optimizer]) and not precision.last_step_skipped
    assert torch.equal(model.weight.detach(), weight - 1.0)


def test_a_step_state_put_back_is_the_step_state_taken():
    """load_step_state puts back all of what step_state took, after another use of the precision object changed it:
    a skip since the last scale update (the per-optimizer steps of one iteration update the scale once, after the
    last) still backs the scale off at the update that finishes the step. (The mutation run, mut50: load_step_state's
    ``_masters_hold_local_grads`` and ``_skipped_since_update`` dropped survived.)"""
    precision = Precision("cpu", loss_scaler=LossScaler("dynamic"))
    _, optimizer = linear_with_grads(float("inf"))
    assert not precision.step([optimizer], update_scale=False)
    state = precision.step_state()
    precision.update_scale()  # another use meanwhile: the skip is applied and forgotten there
    assert precision.loss_scaler.loss_scale == 2.0 ** 15
    precision.load_step_state(state)
    assert precision.step_state() == state
    precision.update_scale()
    assert precision.loss_scaler.loss_scale == 2.0 ** 14
    held = {"unscaled": {7}, "found_inf": {7: True}, "masters_hold_local_grads": True, "skipped_since_update": False}
    precision.load_step_state(held)
    assert precision.step_state() == held
