"""amp.initialize: which ops run in low precision at each opt level, what it returns, and what a prepared model
still supports (eval passes, state dicts, deepcopy, pickling, master params, added param groups).

Modelled on what apex's own amp suite checked (test_basic_casts, test_cache, test_promotion,
test_add_param_group, test_multiple_models_optimizers_losses), on CPU where the low-precision dtype is bfloat16.
"""
import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp

LOW = torch.bfloat16  # the CPU default for "half"


class OpRecorder(nn.Module):
    """Conv -> BatchNorm -> matmul -> LayerNorm -> softmax -> Linear, recording the dtype of every result."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(2)
        self.plain_bn = nn.BatchNorm1d(8, affine=False)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)
        self.dtypes = {}

    def forward(self, x):
        self.dtypes["input"] = x.dtype
        h = self.bn(self.conv(x))
        self.dtypes["conv"] = self.conv(x).dtype
        self.dtypes["batch_norm"] = h.dtype
        h = h.flatten(1)[:, :8]
        self.dtypes["matmul"] = torch.matmul(h, h.t()).dtype
        self.dtypes["relu"] = torch.relu(h).dtype
        h = self.ln(self.plain_bn(h))
        self.dtypes["layer_norm"] = h.dtype
        h = torch.softmax(h, dim=-1)
        self.dtypes["softmax"] = h.dtype
        out = self.fc(h)
        self.dtypes["linear"] = out.dtype
        return out


def prepared(opt_level, **kwargs):
    torch.manual_seed(0)
    model = OpRecorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kwargs)


def images(n=4):
    return torch.randn(n, 1, 4, 4, generator=torch.Generator().manual_seed(5))


# --- which ops run in which precision -----------------------------------------------------------------------
def test_o0_runs_everything_in_float32():
    model, _ = prepared("O0")
    out = model(images())
    assert set(model.dtypes.values()) == {torch.float32}
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_o1_autocasts_matmul_conv_linear_and_keeps_weights_and_outputs_float32():
    model, _ = prepared("O1")
    out = model(images())
    # CPU autocast: conv / matmul / linear in bfloat16; BatchNorm, relu, LayerNorm and softmax follow their input.
    assert model.dtypes == {"input": torch.float32, "conv": LOW, "batch_norm": LOW, "matmul": LOW, "relu": LOW,
                            "layer_norm": LOW, "softmax": LOW, "linear": LOW}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    assert out.dtype == torch.float32  # cast_model_outputs defaults to float32 ...
    target = torch.randint(0, 3, (4,))
    assert F.cross_entropy(out, target).dtype == torch.float32  # ... so a loss outside the model is float32
    # softmax and layer_norm only follow their input: given float32 they stay float32 under autocast.
    with torch.autocast("cpu", dtype=LOW):
        x = torch.randn(2, 8)
        assert torch.softmax(x, -1).dtype == torch.float32
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.mse_loss(x.to(LOW), x.to(LOW)).dtype == torch.float32  # losses run in float32 under autocast


def test_o1_cast_model_outputs_override():
    model, _ = prepared("O1", cast_model_outputs=LOW)
    assert model(images()).dtype == LOW


def test_o1_autocast_is_left_when_forward_raises():
    model, _ = prepared("O1")
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 3, 4, 4))  # wrong channel count
    assert not torch.is_autocast_enabled("cpu")
    assert model(images()).dtype == torch.float32


def test_o1_an_exception_in_a_forward_pre_hook_before_amps_reaches_the_caller():
    """A pre-hook that runs before amp's (prepended) raises: amp's hook that leaves autocast still runs (it always
    does), finds nothing entered for that call and fails on nothing (the mutation run, mut47: popping an autocast it
    had not entered survived; torch turns that error into a warning)."""
    model, _ = prepared("O1")

    def refuse(module, args):
        raise ValueError("refused by the user's hook")
    handle = model.register_forward_pre_hook(refuse, prepend=True)
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(ValueError, match="refused by the user's hook") as raised:
        warnings.simplefilter("always")
        model(images())
    assert raised.value.__context__ is None
    # (torch silences an exception of an always-called hook while forward's own propagates, with a warning)
    assert [str(warning.message) for warning in caught] == []
    assert not torch.is_autocast_enabled("cpu")
    handle.remove()
    assert model(images()).dtype == torch.float32 and model.dtypes["matmul"] == LOW


@pytest.mark.parametrize("opt_level, keep_batchnorm_fp32, batchnorm_dtype", [
    ("O2", None, torch.float32), ("O2", False, LOW), ("O3", None, LOW), ("O3", True, torch.float32),
    ("O3", "True", torch.float32), ("O2", "False", LOW)])
def test_cast_levels_cast_weights_inputs_and_outputs(opt_level, keep_batchnorm_fp32, batchnorm_dtype):
    model, _ = prepared(opt_level, keep_batchnorm_fp32=keep_batchnorm_fp32)
    assert model.conv.weight.dtype == model.fc.weight.dtype == model.ln.weight.dtype == LOW
    # Affine BatchNorm keeps weights and running statistics in float32 when asked; a non-affine one is cast.
    bn_tensors = [model.bn.weight, model.bn.bias, model.bn.running_mean, model.bn.running_var]
    assert {t.dtype for t in bn_tensors} == {batchnorm_dtype}
    assert model.plain_bn.running_mean.dtype == LOW
    assert model.bn.num_batches_tracked.dtype == torch.int64
    out = model(images())
    assert model.dtypes["input"] == LOW  # the float32 input was cast to the model's dtype
    assert model.dtypes["linear"] == model.dtypes["matmul"] == model.dtypes["conv"] == LOW
    assert out.dtype == torch.float32
    out.float().sum().backward()  # float32 BatchNorm parameters with bfloat16 activations train too
    assert model.bn.weight.grad.dtype == batchnorm_dtype


def test_cast_model_casts_nested_floating_inputs_only():
    seen = {}

    class NestedInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, pair, mapping, scale=None):
            seen.update(a=pair[0].dtype, b=pair[1][0].dtype, c=mapping["x"].dtype, idx=mapping["idx"].dtype,
                        scale=scale.dtype)
            return {"out": self.fc(pair[0]) * scale, "idx": mapping["idx"]}

    model = amp.initialize(NestedInput(), opt_level="O2", verbosity=0)
    result = model((torch.randn(2, 3), [torch.randn(1)]), {"x": torch.randn(2), "idx": torch.arange(2)},
                   scale=torch.tensor(2.0))
    assert seen == dict(a=LOW, b=LOW, c=LOW, idx=torch.int64, scale=LOW)  # keyword arguments too
    assert result["out"].dtype == torch.float32 and result["idx"].dtype == torch.int64


def test_dtype_keyword_chooses_float16_on_cpu():
    model, _ = prepared("O2", dtype=torch.float16)
    assert model.fc.weight.dtype == torch.float16 and model.bn.weight.dtype == torch.float32
    assert model(images()).dtype == torch.float32


# --- train -> eval -> train ------------------------------------------------------------------------------
@pytest.mark.parametrize("outer_autocast", [False, True], ids=["hooks-only", "inside-autocast-region"])
def test_train_eval_train_gives_the_same_grads_as_float32(outer_autocast):
    """apex's test_cache: a no_grad eval pass between two training passes must not leave stale casts behind."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def training_grads():
        optimizer.zero_grad(set_to_none=True)
        model.train()
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled:
            scaled.backward()
        return [p.grad.clone() for p in model.parameters()]

    region = torch.autocast("cpu", dtype=LOW) if outer_autocast else torch.autocast("cpu", enabled=False)
    with region:
        before = training_grads()
        model.eval()
        with torch.no_grad():
            model(x)
        after = training_grads()
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    F.mse_loss(reference(x), y).backward()
    for grad, expected in zip(after, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


# --- what initialize returns --------------------------------------------------------------------------------
def models_and_optimizers(n_models=2):
    models = [nn.Linear(3, 2) for _ in range(n_models)]
    return models, [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]


def test_returns_model_and_optimizer():
    (model,), (optimizer,) = models_and_optimizers(1)
    result = amp.initialize(model, optimizer, verbosity=0)
    assert isinstance(result, tuple) and result[0] is model and result[1] is optimizer


def test_returns_model_and_list_of_optimizers():
    model = nn.Linear(3, 2)
    optimizers = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.Adam([model.bias])]
    out_model, out_optimizers = amp.initialize(model, optimizers, verbosity=0)
    assert out_model is model and isinstance(out_optimizers, list) and out_optimizers == optimizers


def test_returns_list_of_models_and_optimizer():
    models, _ = models_and_optimizers()
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    out_models, out_optimizer = amp.initialize(models, optimizer, verbosity=0)
    assert isinstance(out_models, list) and out_models == models and out_optimizer is optimizer


def test_returns_lists_of_models_and_optimizers_and_tuples_stay_tuples():
    models, optimizers = models_and_optimizers()
    out_models, out_optimizers = amp.initialize(models, optimizers, verbosity=0)
    assert out_models == models and out_optimizers == optimizers
    models, optimizers = models_and_optimizers()
    out_models, out_optimizers = amp.initialize(tuple(models), tuple(optimizers), verbosity=0)
    assert isinstance(out_models, tuple) and isinstance(out_optimizers, tuple)


def test_without_optimizers_returns_only_the_models():
    model = nn.Linear(3, 2)
    assert amp.initialize(model, opt_level="O2", verbosity=0) is model
    assert model.weight.dtype == LOW
    models = [nn.Linear(3, 2), nn.Linear(3, 2)]
    assert amp.initialize(models, None, opt_level="O3", verbosity=0) == models


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_enabled_false_returns_inputs_untouched(opt_level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params_before = list(optimizer.param_groups[0]["params"])
    out_model, out_optimizer = amp.initialize(model, optimizer, opt_level=opt_level, enabled=False, verbosity=0)
    assert out_model is model and out_optimizer is optimizer
    assert optimizer.param_groups[0]["params"] == params_before
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model._forward_pre_hooks and not model._forward_hooks
    x = torch.randn(2, 3)
    assert model(x).dtype == torch.float32
    loss = model(x).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
        scaled.backward()


def test_each_initialize_call_keeps_its_own_state():
    (model_a,), (opt_a,) = models_and_optimizers(1)
    (model_b,), (opt_b,) = models_and_optimizers(1)
    amp.initialize(model_a, opt_a, opt_level="O1", loss_scale="dynamic", verbosity=0)
    amp.initialize(model_b, opt_b, opt_level="O2", loss_scale=128.0, verbosity=0)
    state_a, state_b = amp.state_of(opt_a), amp.state_of(opt_b)
    assert state_a is not state_b and amp.state_of(model_a) is state_a
    assert state_a.properties.opt_level == "O1" and state_b.properties.opt_level == "O2"
    with amp.scale_loss(model_a(torch.ones(1, 3)).sum(), opt_a) as scaled:
        scaled.backward()
    assert state_a.loss_scalers[0].unskipped == 1 and state_b.loss_scalers[0].unskipped == 0


# --- a prepared model stays an ordinary module --------------------------------------------------------------
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_cast_model_state_dict_is_float32_and_loads_into_a_float32_model(opt_level):
    torch.manual_seed(0)
    model = BNNet()
    model = amp.initialize(model, opt_level=opt_level, verbosity=0)
    model(torch.randn(5, 4))  # update the running statistics
    state = model.state_dict()
    assert {v.dtype for k, v in state.items() if "num_batches" not in k} == {torch.float32}
    fresh = BNNet()
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert value.dtype == (torch.int64 if "num_batches" in key else torch.float32)
        assert torch.equal(value, state[key])
    assert model.fc1.weight.dtype == LOW  # the hook changes what state_dict returns, not the model


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_deepcopy_of_a_prepared_model_works_and_is_independent(opt_level):
    torch.manual_seed(0)
    model = BNNet().eval()
    model = amp.initialize(model, opt_level=opt_level, verbosity=0)
    ema = copy.deepcopy(model)
    x = torch.randn(3, 4)
    out, out_copy = model(x), ema(x)
    assert torch.equal(out, out_copy) and out_copy.dtype == torch.float32
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    assert not torch.equal(model(x), ema(x))
    assert torch.equal(model(x), out)
    assert ema.state_dict()["fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_save_pickles_a_prepared_model(opt_level):
    torch.manual_seed(0)
    model = amp.initialize(BNNet().eval(), opt_level=opt_level, verbosity=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 4)
    assert torch.equal(loaded(x), model(x)) and loaded(x).dtype == torch.float32
    assert loaded.state_dict()["fc1.weight"].dtype == torch.float32


# --- master params (O2) -----------------------------------------------------------------------------------
def test_master_params_are_float32_masters_and_clipping_them_works():
    torch.manual_seed(0)
    model = BNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(optimizer))
    model_params = list(model.parameters())
    assert len(masters) == len(model_params)
    assert all(m.dtype == torch.float32 for m in masters)
    for master, param in zip(masters, model_params):
        assert master is not param if param.dtype == LOW else master is param  # BatchNorm stays float32
        assert torch.equal(master, param.float())
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled:
        scaled.backward()
    assert all(p.grad is None for p in model_params if p.dtype == LOW)  # moved into the masters
    true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    max_norm = 0.1 * true_norm.item()
    returned = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
    assert torch.equal(returned, true_norm)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    assert clipped.item() == pytest.approx(max_norm, rel=1e-5)
    expected = [(m - 0.5 * m.grad).detach() for m in masters]
    optimizer.step()
    for master, param, value in zip(masters, model_params, expected):
        assert torch.equal(master, value)
        assert torch.equal(param, master.to(param.dtype))  # copied back into the model after the step


def test_master_params_without_master_weights_are_the_model_params():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    assert list(amp.master_params(optimizer)) == list(model.parameters())


# --- optimizer.add_param_group after initialize --------------------------------------------------------------
def grads_of(loss_fn, optimizer):
    with amp.scale_loss(loss_fn(), optimizer) as scaled:
        scaled.backward()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_param_group_added_after_initialize_is_unscaled_and_stepped(opt_level):
    """A float32 module added later (e.g. a new head) is stepped as it is, with true (unscaled) gradients."""
    torch.manual_seed(0)
    model, extra = nn.Linear(4, 2), nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    optimizer.add_param_group({"params": extra.parameters(), "lr": 0.5})
    x = torch.randn(5, 4)
    weight_before = extra.weight.detach().clone()
    grads_of(lambda: model(x).sum() + extra(x).sum(), optimizer)
    assert torch.equal(extra.weight.grad, torch.ones(2, 1) * x.sum(0))  # d(sum(Wx+b))/dW, unscaled
    optimizer.step()
    assert optimizer.param_groups[1]["params"][0] is extra.weight  # float32: no master, stepped as it is
    assert torch.equal(extra.weight.detach(), weight_before - 0.5 * torch.ones(2, 1) * x.sum(0))


def test_low_precision_param_group_added_after_initialize_gets_float32_masters_under_o2():
    """As apex's patched add_param_group did: bfloat16 parameters of a later group get float32 masters."""
    torch.manual_seed(0)
    model, extra = nn.Linear(4, 2), nn.Linear(4, 2).to(LOW)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    optimizer.add_param_group({"params": extra.parameters()})
    x = torch.randn(5, 4)
    master_before = extra.weight.detach().float()
    grads_of(lambda: model(x).sum() + extra(x.to(LOW)).float().sum(), optimizer)
    masters = optimizer.param_groups[1]["params"]
    assert masters[0].dtype == torch.float32 and masters[0] is not extra.weight
    expected_grad = torch.ones(2, 1) * x.to(LOW).float().sum(0)
    torch.testing.assert_close(masters[0].grad, expected_grad, rtol=1e-2, atol=1e-2)
    optimizer.step()
    assert torch.equal(masters[0].detach(), master_before.add(masters[0].grad, alpha=-0.1))  # SGD's update
    assert torch.equal(extra.weight.detach(), masters[0].detach().to(LOW))


def test_model_wrap_module_saves_float32_weights_under_o2():
    """Checkpoints hold the user's own module of a ModelWrap: under O2 its state_dict must be float32 too."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition
    from aitoolbox.torchtrain.model import ModelWrap
    from aitoolbox.torchtrain.train_loop import TrainLoop

    class Feed(AbstractModelFeedDefinition):
        def get_loss(self, model, batch_data, criterion, device):
            x, y = batch_data
            return criterion(model(x), y)

        def get_predictions(self, model, batch_data, device):
            x, y = batch_data
            return model(x), y, None

    net = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    tl = TrainLoop(ModelWrap(net, Feed()), DataLoader(data, batch_size=4), None, None,
                   torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss(), use_amp={"opt_level": "O2", "verbosity": 0},
                   show_progress=False)
    tl.fit(num_epochs=1)
    assert net.weight.dtype == torch.bfloat16
    assert {value.dtype for value in net.state_dict().values()} == {torch.float32}
