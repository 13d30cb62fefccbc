"""No loss scaling where the dtype does not need it (a deliberate difference from apex).

bfloat16 has float32's exponent range: O1 and O2 do no scaling work with it unless ``loss_scale`` is given,
and then train bitwise like a hand-written ``torch.autocast`` loop without a scaler. float16 keeps apex's
dynamic scaling, and so does an explicit ``loss_scale='dynamic'``. ``amp.state_dict()`` keeps apex's format.
Whether scaling work happens is read from the torch profiler: the unscale-and-check kernel
(``_amp_foreach_non_finite_check_and_unscale_``) runs at every scaled step and never without scaling.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.amp.properties import resolve_properties

UNSCALE_KERNEL = "aten::_amp_foreach_non_finite_check_and_unscale_"
NUM_STEPS = 4


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.max_pool2d(torch.relu(self.conv(x)), 2), 1))


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def model_and_optimizer():
    torch.manual_seed(0)
    model = ConvNet()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def amp_training(opt_level, steps=NUM_STEPS, **initialize_kwargs):
    model, optimizer = model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **initialize_kwargs)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for step in range(steps):
            x, y = batch(step)
            with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    ran = {event.name for event in profiler.events()}
    return model, optimizer, ran


# --- the defaults -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device_type, opt_level, kwargs, expected", [
    ("cpu", "O1", {}, 1.0),
    ("cpu", "O2", {}, 1.0),
    ("cuda", "O1", {"dtype": torch.bfloat16}, 1.0),
    ("cuda", "O2", {"dtype": torch.bfloat16}, 1.0),
    ("cuda", "O1", {}, "dynamic"),
    ("cuda", "O2", {}, "dynamic"),
    ("cpu", "O1", {"dtype": torch.float16}, "dynamic"),
    ("cpu", "O2", {"cast_model_type": torch.float16}, "dynamic"),  # a float16 model, bfloat16 elsewhere
    ("cpu", "O1", {"loss_scale": "dynamic"}, "dynamic"),
    ("cpu", "O2", {"loss_scale": 1.0}, 1.0),
    ("cpu", "O2", {"loss_scale": "128"}, 128.0),
    ("cuda", "O0", {}, 1.0),
    ("cuda", "O3", {}, 1.0),
], ids=lambda value: str(value).replace("torch.", "") if not isinstance(value, dict) else
    "-".join(f"{k}={v}".replace("torch.", "") for k, v in value.items()) or "defaults")
def test_loss_scale_default_follows_the_dtype(device_type, opt_level, kwargs, expected):
    properties = resolve_properties(device_type, opt_level, **kwargs)
    assert properties.loss_scale == expected
    assert properties.uses_loss_scaling == (expected != 1.0)


# --- bfloat16: no scaling work, bitwise a plain autocast loop -----------------------------------------------
def test_o1_bfloat16_equals_an_autocast_loop_without_scaler_bitwise():
    model, optimizer, ran = amp_training("O1")
    reference, ref_optimizer = model_and_optimizer()
    for step in range(NUM_STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(reference(x), y)
        loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert param.dtype == torch.float32 and torch.equal(param, expected)
    assert UNSCALE_KERNEL not in ran


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_bfloat16_does_no_scaling_work_and_reports_apex_format(opt_level):
    model, optimizer, ran = amp_training(opt_level)
    assert UNSCALE_KERNEL not in ran and "aten::reciprocal" not in ran
    state = amp.state_of(optimizer)
    assert not state.properties.uses_loss_scaling
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}
    if opt_level == "O2":
        assert all(m.dtype == torch.float32 for m in amp.master_params(optimizer))
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss is loss  # float32 already: nothing multiplied
        scaled_loss.backward()
    optimizer.zero_grad()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("kwargs", [{"loss_scale": "dynamic"}, {"dtype": torch.float16}], ids=["explicit", "fp16"])
def test_explicit_dynamic_and_float16_keep_dynamic_scaling(opt_level, kwargs):
    model, optimizer, ran = amp_training(opt_level, **kwargs)
    assert UNSCALE_KERNEL in ran
    scaler = amp.state_of(optimizer).loss_scalers[0]
    assert scaler.dynamic and amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": NUM_STEPS}
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert torch.equal(scaled_loss, loss * 2.0 ** 16)
        scaled_loss.backward()
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    assert amp.last_step_skipped(optimizer) and scaler.loss_scale == 2.0 ** 15


# --- checkpoints --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_old_dynamic_amp_state_loads_into_a_bfloat16_run(opt_level, tmp_path):
    """A checkpoint of dynamic scaling (apex, or an earlier version of this package) still loads; the run
    stays without scaling, and O2's saved float32 masters are restored."""
    saved_model, saved_optimizer, _ = amp_training(opt_level, steps=2, loss_scale="dynamic")
    checkpoint = {"model": saved_model.state_dict(), "optimizer": saved_optimizer.state_dict(),
                  "amp": amp.state_dict()}
    assert checkpoint["amp"]["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 2}
    torch.save(checkpoint, tmp_path / "old.pt")
    checkpoint = torch.load(tmp_path / "old.pt", weights_only=True)

    model, optimizer = model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}
    for master, saved in zip(amp.master_params(optimizer), amp.master_params(saved_optimizer)):
        assert torch.equal(master, saved)
    x, y = batch(5)
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss is loss
        scaled_loss.backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
