"""TrainLoop's mixed precision against hand-written PyTorch loops, bitwise, and TrainLoop(use_amp=...) with amp.

* ``use_amp=True`` on CPU is bfloat16 autocast without loss scaling: equal to a ``torch.autocast`` loop;
* float16 autocast with dynamic loss scaling equals ``torch.autocast`` + ``torch.amp.GradScaler``, including
  the skipped step of an overflowing batch;
* a model the user passed through ``amp.initialize`` (aitoolbox's apex guide, seed 000) trains with
  ``use_amp=True`` on that configuration without a second initialize, like an apex ``scale_loss`` loop;
* ``use_amp={...}`` runs ``amp.initialize`` with those arguments (O1 float16, O2 with master weights).
"""
import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.precision.factory import autocast_precision
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, TRAIN_SEED, SmallCNN, assert_params_equal, classification_data, image_data, model_pair, params_differ,
    reference_fit, seeded_loader,
)

NUM_EPOCHS = 2


@pytest.fixture(autouse=True)
def quiet_logs():
    logger = logging.getLogger("aitoolbox")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


class SkipRecorder(AbstractCallback):
    """Records ``optimizer_step_skipped`` after every optimizer step."""

    def __init__(self):
        super().__init__("skip recorder")
        self.skipped = []

    def on_after_optimizer_step(self):
        self.skipped.append(self.train_loop_obj.optimizer_step_skipped)


def train_loop(model, dataset, optimizer, use_amp, criterion=None, batch_size=8):
    return TrainLoop(model, seeded_loader(dataset, batch_size), None, None, optimizer,
                     criterion or nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False, use_amp=use_amp)


def fit(tl, precision=None):
    if precision is not None:
        tl.precision = precision
    recorder = SkipRecorder()
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=NUM_EPOCHS, callbacks=[recorder])
    return recorder.skipped


def scaler_fit(model, loader, optimizer, dtype, cast_output=False):
    """torch.autocast + torch.amp.GradScaler, as the PyTorch AMP recipe writes it. Returns the skipped steps."""
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    model.train()
    torch.manual_seed(TRAIN_SEED)
    for _ in range(NUM_EPOCHS):
        for x, y in loader:
            with torch.autocast(device_type="cpu", dtype=dtype):
                output = model(x)
                loss = F.cross_entropy(output.float() if cast_output else output, y)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
            optimizer.zero_grad(set_to_none=True)
    return skipped


def with_overflowing_sample(dataset, index=13):
    """One huge feature: beyond float16's range, so the batch holding it overflows (once per epoch)."""
    x, y = dataset.tensors
    x = x.clone()
    x.view(len(x), -1)[index, 0] = 1e6
    return TensorDataset(x, y)


# --- use_amp=True: bfloat16 autocast ----------------------------------------------------------------------
@pytest.mark.parametrize("model_class, make_data", [(MLP, classification_data), (SmallCNN, image_data)],
                         ids=["mlp", "cnn"])
def test_use_amp_on_cpu_equals_a_bfloat16_autocast_loop(model_class, make_data):
    data = make_data()
    model, reference = model_pair(model_class)
    fp32_model = copy.deepcopy(model)
    tl = train_loop(model, data, torch.optim.Adam(model.parameters(), lr=0.01), use_amp=True)
    skipped = fit(tl)

    def autocast_loss(net, batch, criterion):
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return criterion(net(batch[0]), batch[1])

    torch.manual_seed(TRAIN_SEED)
    reference_fit(reference, seeded_loader(data), [torch.optim.Adam(reference.parameters(), lr=0.01)],
                  nn.CrossEntropyLoss(), num_epochs=NUM_EPOCHS, loss_fn=autocast_loss)
    assert_params_equal(model, reference)
    assert tl.precision.autocast_dtype == torch.bfloat16 and tl.precision.loss_scaler is None
    assert not any(skipped) and all(p.dtype == torch.float32 for p in model.parameters())
    torch.manual_seed(TRAIN_SEED)
    reference_fit(fp32_model, seeded_loader(data), [torch.optim.Adam(fp32_model.parameters(), lr=0.01)],
                  nn.CrossEntropyLoss(), num_epochs=NUM_EPOCHS)
    assert params_differ(model, fp32_model)  # autocast was really on


# --- float16 with dynamic loss scaling --------------------------------------------------------------------
def test_float16_autocast_precision_equals_autocast_with_grad_scaler_including_a_skipped_step():
    data = with_overflowing_sample(classification_data())
    model, reference = model_pair(MLP)
    tl = train_loop(model, data, torch.optim.Adam(model.parameters(), lr=0.01), use_amp=True)
    skipped = fit(tl, precision=autocast_precision("cpu", torch.float16))
    reference_skipped = scaler_fit(reference, seeded_loader(data), torch.optim.Adam(reference.parameters(), lr=0.01),
                                   torch.float16)
    assert skipped == reference_skipped and sum(skipped) == NUM_EPOCHS  # the overflowing batch, once per epoch
    assert_params_equal(model, reference)
    assert tl.precision.loss_scaler.loss_scale == 2.0 ** 16 / 2 ** NUM_EPOCHS


def test_use_amp_o1_float16_equals_autocast_with_grad_scaler_including_a_skipped_step():
    """amp's O1 casts the model's outputs to float32: the hand loop does so with ``output.float()``."""
    data = with_overflowing_sample(classification_data())
    model, reference = model_pair(MLP)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    tl = train_loop(model, data, optimizer, use_amp={"opt_level": "O1", "dtype": torch.float16})
    skipped = fit(tl)
    reference_skipped = scaler_fit(reference, seeded_loader(data), torch.optim.Adam(reference.parameters(), lr=0.01),
                                   torch.float16, cast_output=True)
    assert skipped == reference_skipped and sum(skipped) == NUM_EPOCHS
    assert_params_equal(model, reference)
    state = amp.state_of(optimizer)
    assert state is not None and state.properties.low_precision_dtype == torch.float16
    assert tl.precision.loss_scaler is state.loss_scalers[0]


# --- a model the user passed through amp.initialize (seed 000) -----------------------------------------------
class CNNModel(TTModel):
    """A TTModel-based CNN ending in log_softmax, for nn.NLLLoss as in the guide."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).argmax(dim=1).cpu(), y, None


def test_seed_000_single_device_pattern_trains_without_initializing_twice():
    from torch import optim
    torch.manual_seed(0)
    data = image_data(24)
    # ---- from aitoolbox's apex guide; "from apex import amp" became the amp import above, the loaders are
    # filled in and .to('cuda') is left out (CPU) ----
    train_loader = DataLoader(data, batch_size=8, shuffle=True)
    val_loader = DataLoader(image_data(8, seed=12), batch_size=8)
    test_loader = DataLoader(image_data(8, seed=13), batch_size=8)

    model = CNNModel()  # TTModel based neural model

    optimizer = optim.Adam(model.parameters(), lr=0.001, betas=(0.9, 0.999))
    criterion = nn.NLLLoss()

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

    state = amp.state_of(optimizer)
    initial = copy.deepcopy(model.state_dict())
    tl = TrainLoop(model,
                   train_loader, val_loader, test_loader,
                   optimizer, criterion,
                   use_amp=True)

    model = tl.fit(num_epochs=NUM_EPOCHS)
    # ---- end of the guide's code ----
    assert amp.state_of(optimizer) is state  # not initialized a second time
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    # bfloat16 on the CPU: O1 does no loss scaling, and amp reports apex's format with a static scale of 1.0.
    assert tl.precision.loss_scaler is None and tl.precision.autocast_dtype == torch.bfloat16
    assert state.loss_scalers[0].state_dict() == {"loss_scale": 1.0, "unskipped": 0}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    assert len(tl.train_history["val_loss"]) == NUM_EPOCHS and "train_end_test_loss" in tl.train_history


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_train_loop_on_an_amp_initialized_model_equals_an_apex_scale_loss_loop(opt_level):
    data = image_data(24)
    model, reference = model_pair(CNNModel)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    reference, ref_optimizer = amp.initialize(reference, ref_optimizer, opt_level=opt_level, verbosity=0)
    fit(train_loop(model, data, optimizer, use_amp=True, criterion=nn.NLLLoss()))
    torch.manual_seed(TRAIN_SEED)
    reference.train()
    loader = seeded_loader(data)
    for _ in range(NUM_EPOCHS):
        for x, y in loader:
            with amp.scale_loss(F.nll_loss(reference(x), y), ref_optimizer) as scaled_loss:
                scaled_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(amp.master_params(optimizer), amp.master_params(ref_optimizer)):
        assert torch.equal(a, b)
    assert amp.state_of(optimizer).state_dict()["loss_scaler0"] == amp.state_of(ref_optimizer).state_dict()[
        "loss_scaler0"]


def apex_o2_accumulation_reference(data, reference, delay_unscale: bool):
    """apex O2 with two batches per optimizer step: ``delay_unscale`` keeps the window's gradients scaled in
    the model's bfloat16 ``.grad``; apex's default unscales every block into the float32 masters' ``.grad``."""
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    reference, ref_optimizer = amp.initialize(reference, ref_optimizer, opt_level="O2", verbosity=0)
    torch.manual_seed(TRAIN_SEED)
    reference.train()
    loader = seeded_loader(data)
    for _ in range(NUM_EPOCHS):
        for index, (x, y) in enumerate(loader):
            window_ends = (index + 1) % 2 == 0 or index + 1 == len(loader)
            with amp.scale_loss(F.nll_loss(reference(x), y) / 2, ref_optimizer,
                                delay_unscale=delay_unscale and not window_ends) as scaled_loss:
                scaled_loss.backward()
            if window_ends:
                ref_optimizer.step()
                ref_optimizer.zero_grad()
    return reference, ref_optimizer


def test_train_loop_grad_accumulation_under_o2_sums_in_the_float32_masters_like_apex():
    """Every backward moves its bfloat16 gradients, unscaled, into the masters' float32 ``.grad``, so an
    accumulation window sums in float32, as apex's default ``scale_loss`` does; summing in the bfloat16
    ``.grad`` (apex's ``delay_unscale=True``) rounds and ends with different weights."""
    data = image_data(24)
    model, reference = model_pair(CNNModel)
    delayed_reference = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tl = train_loop(model, data, optimizer, use_amp={"opt_level": "O2", "verbosity": 0}, criterion=nn.NLLLoss())
    torch.manual_seed(TRAIN_SEED)
    tl.fit(num_epochs=NUM_EPOCHS, grad_accumulation=2)
    reference, ref_optimizer = apex_o2_accumulation_reference(data, reference, delay_unscale=False)
    for a, b in zip(amp.master_params(optimizer), amp.master_params(ref_optimizer)):
        assert torch.equal(a, b)
    assert_params_equal(model, reference)
    _, delayed_optimizer = apex_o2_accumulation_reference(data, delayed_reference, delay_unscale=True)
    assert any(not torch.equal(a, b) for a, b in zip(amp.master_params(optimizer),
                                                     amp.master_params(delayed_optimizer)))


# --- use_amp as a dict of amp.initialize arguments -----------------------------------------------------------
def test_use_amp_o2_trains_with_master_weights():
    data = classification_data()
    model, initial = model_pair(MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tl = train_loop(model, data, optimizer, use_amp={"opt_level": "O2"})
    skipped = fit(tl)
    assert tl.precision.master_weights is not None and not any(skipped)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    masters = tl.precision.stepped_parameters(optimizer)
    assert all(m.dtype == torch.float32 for m in masters)
    for master, param in zip(masters, model.parameters()):
        assert torch.equal(master.to(torch.bfloat16), param)
    assert params_differ(model, initial.to(torch.bfloat16))
    assert all(torch.isfinite(torch.tensor(v)) for v in tl.train_history["accumulated_loss"])
    assert model.state_dict()["fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize("use_amp, error", [
    ({"opt_levle": "O2"}, TypeError), ({"opt_level": "O2", "scaler": 1}, TypeError), ("O1", TypeError),
    ({"opt_level": "02"}, ValueError), ({"opt_level": "O1", "keep_batchnorm_fp32": True}, ValueError)])
def test_bad_use_amp_fails_at_construction(use_amp, error):
    model = MLP()
    with pytest.raises(error, match="opt_levle|scaler|use_amp must be|number zero|keep_batchnorm_fp32"):
        train_loop(model, classification_data(), torch.optim.SGD(model.parameters(), lr=0.1), use_amp=use_amp)
    assert amp.state_of(model) is None  # nothing was initialized


def test_use_amp_dict_with_an_already_initialized_model_is_rejected():
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, verbosity=0)
    tl = train_loop(model, classification_data(), optimizer, use_amp={"opt_level": "O2"})
    with pytest.raises(ValueError, match="already went through amp.initialize"):
        tl.fit(num_epochs=1)
