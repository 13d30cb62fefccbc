"""TrainLoop's ``use_amp``: nothing of a finished TrainLoop stays in memory, and bfloat16 does no loss scaling.

Whether scaling work happens is read from the torch profiler: the unscale-and-check kernel
(``_amp_foreach_non_finite_check_and_unscale_``) runs at every scaled step and never without scaling.
"""
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, TRAIN_SEED, assert_params_equal, classification_data, model_pair, reference_fit, seeded_loader,
)


def short_fit(use_amp):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tl = TrainLoop(model, seeded_loader(classification_data()), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp=use_amp)
    tl.fit(num_epochs=1)
    return tl, model, optimizer


@pytest.mark.parametrize("use_amp", [True, {"opt_level": "O1"}, {"opt_level": "O2"}, {"init_scale": 2.0 ** 10}],
                         ids=["true", "O1", "O2", "grad_scaler"])
def test_train_loop_model_optimizer_and_amp_state_are_freed_after_fit(use_amp):
    tl, model, optimizer = short_fit(use_amp)
    refs = {"train_loop": weakref.ref(tl), "model": weakref.ref(model), "optimizer": weakref.ref(optimizer),
            "precision": weakref.ref(tl.precision)}
    refs.update({f"stepped{i}": weakref.ref(p) for i, p in enumerate(optimizer.param_groups[0]["params"])})
    state = amp.state_of(optimizer)
    if isinstance(use_amp, dict) and "opt_level" in use_amp:
        refs["amp_state"] = weakref.ref(state)
        if use_amp["opt_level"] == "O2":
            assert state.master_weights is not None  # the stepped tensors above are its float32 masters
    else:
        assert state is None
    del tl, model, optimizer, state
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after del + gc.collect(): {alive}"


# --- bfloat16: no loss scaling unless asked for ---------------------------------------------------------------
UNSCALE_KERNEL = "aten::_amp_foreach_non_finite_check_and_unscale_"
NUM_EPOCHS = 2
# A TrainLoop trains on the GPU when there is one, where use_amp's default type is float16.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="bfloat16 is use_amp's default on the CPU only")


def profiled_fit(model, optimizer, use_amp):
    """Train NUM_EPOCHS epochs; returns the TrainLoop and the names of the torch operators that ran."""
    tl = TrainLoop(model, seeded_loader(classification_data()), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp=use_amp)
    torch.manual_seed(TRAIN_SEED)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        tl.fit(num_epochs=NUM_EPOCHS)
    return tl, {event.name for event in profiler.events()}


@cpu_only
@pytest.mark.parametrize("use_amp", [True, {"opt_level": "O1"}], ids=["true", "O1"])
def test_bfloat16_use_amp_equals_an_autocast_loop_without_scaler_bitwise(use_amp):
    model, reference = model_pair(MLP)
    tl, ran = profiled_fit(model, torch.optim.Adam(model.parameters(), lr=0.01), use_amp)

    def autocast_loss(net, batch, criterion):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return criterion(net(batch[0]), batch[1])

    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, seeded_loader(classification_data()), [torch.optim.Adam(reference.parameters(), lr=0.01)],
                  nn.CrossEntropyLoss(), num_epochs=NUM_EPOCHS, loss_fn=autocast_loss, device=torch.device("cpu"))
    assert_params_equal(model, reference)
    assert tl.precision.autocast_dtype == torch.bfloat16 and tl.precision.loss_scaler is None
    assert UNSCALE_KERNEL not in ran


@cpu_only
def test_bfloat16_o2_does_no_scaling_work():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tl, ran = profiled_fit(model, optimizer, {"opt_level": "O2"})
    assert tl.precision.loss_scaler is None and tl.precision.master_weights is not None
    assert UNSCALE_KERNEL not in ran
    assert amp.state_of(optimizer).state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("use_amp", [{"opt_level": "O1", "loss_scale": "dynamic"}, {"loss_scale": "dynamic"},
                                     {"opt_level": "O2", "loss_scale": "dynamic"},
                                     {"opt_level": "O1", "dtype": torch.float16},
                                     {"init_scale": 2.0 ** 10, "growth_interval": 1000}],
                         ids=["O1-dynamic", "dynamic", "O2-dynamic", "O1-float16", "grad_scaler"])
def test_asked_for_or_float16_scaling_stays_on(use_amp):
    model = MLP()
    tl, ran = profiled_fit(model, torch.optim.SGD(model.parameters(), lr=0.1), use_amp)
    scaler = tl.precision.loss_scaler
    assert scaler is not None and scaler.dynamic
    assert scaler.loss_scale == use_amp.get("init_scale", 2.0 ** 16)
    assert UNSCALE_KERNEL in ran
