"""Every error of spec/amp.md: each fails fast, with a message that names the bad value and says the fix."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from aitoolbox.torchtrain import amp


def model_and_optimizer():
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# --- opt levels and overrides ------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O4", "o1", "", None, 1])
def test_unknown_opt_level_names_the_four_levels(opt_level):
    with pytest.raises(ValueError, match=r"'O0', 'O1', 'O2', 'O3'") as error:
        amp.initialize(*model_and_optimizer(), opt_level=opt_level)
    assert "number zero" not in str(error.value)


@pytest.mark.parametrize("opt_level", ["02", "00", "01", "03"])
def test_zero_prefixed_opt_level_says_the_prefix_is_the_letter_o(opt_level):
    with pytest.raises(ValueError, match="capital letter O, not the number zero") as error:
        amp.initialize(*model_and_optimizer(), opt_level=opt_level)
    assert repr(opt_level) in str(error.value)


@pytest.mark.parametrize("cast_model_type", [torch.bfloat16, torch.float16, "half"])
def test_o1_rejects_a_cast_model_type(cast_model_type):
    with pytest.raises(ValueError, match="cast_model_type must be None"):
        amp.initialize(*model_and_optimizer(), opt_level="O1", cast_model_type=cast_model_type)


@pytest.mark.parametrize("cast_model_type", [None, False, torch.float32])
def test_o1_accepts_no_cast_or_float32(cast_model_type):
    model, _ = amp.initialize(*model_and_optimizer(), opt_level="O1", cast_model_type=cast_model_type, verbosity=0)
    assert model.weight.dtype == torch.float32


@pytest.mark.parametrize("override", [dict(keep_batchnorm_fp32=True), dict(keep_batchnorm_fp32=False),
                                      dict(master_weights=True), dict(master_weights=False)])
def test_o1_rejects_keep_batchnorm_fp32_and_master_weights(override):
    name = next(iter(override))
    with pytest.raises(ValueError, match=f"{name}={override[name]!r}"):
        amp.initialize(*model_and_optimizer(), opt_level="O1", **override)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_patch_torch_functions_is_only_valid_with_o1(opt_level):
    with pytest.raises(ValueError, match=f"patch_torch_functions=True is only valid with opt_level 'O1'.*{opt_level}"):
        amp.initialize(*model_and_optimizer(), opt_level=opt_level, patch_torch_functions=True)


@pytest.mark.parametrize("value", ["yes", "true", 1, "1"])
def test_bad_keep_batchnorm_fp32_names_the_value(value):
    with pytest.raises(ValueError, match=f"keep_batchnorm_fp32 must be True, False, 'True', 'False' or None, got "
                                         f"{value!r}"):
        amp.initialize(*model_and_optimizer(), opt_level="O2", keep_batchnorm_fp32=value)


@pytest.mark.parametrize("value", ["fast", "", -1.0, 0])
def test_bad_loss_scale_names_the_value(value):
    with pytest.raises(ValueError, match="loss_scale"):
        amp.initialize(*model_and_optimizer(), loss_scale=value)


def test_bad_dtype_arguments():
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        amp.initialize(*model_and_optimizer(), dtype=torch.float32)
    with pytest.raises(TypeError, match="cast_model_type must be a floating torch.dtype"):
        amp.initialize(*model_and_optimizer(), opt_level="O2", cast_model_type=torch.int8)
    with pytest.raises(TypeError, match="cast_model_outputs"):
        amp.initialize(*model_and_optimizer(), cast_model_outputs="float")


@pytest.mark.parametrize("num_losses", [0, -1, 1.5, True, "2"])
def test_bad_num_losses(num_losses):
    with pytest.raises(ValueError, match="num_losses must be an int >= 1"):
        amp.initialize(*model_and_optimizer(), num_losses=num_losses)


def test_o0_with_loss_scaling_warns_that_it_is_pointless():
    model, optimizer = model_and_optimizer()
    with pytest.warns(UserWarning, match="O0"):
        amp.initialize(model, optimizer, opt_level="O0", loss_scale=128)
    with amp.scale_loss(model(torch.ones(1, 3)).sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    assert torch.equal(model.weight.grad, torch.ones(2, 3))  # legal, and unscaled on exit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.initialize(*model_and_optimizer(), opt_level="O0", verbosity=0)  # the default scale of 1.0 is quiet


# --- models and optimizers -----------------------------------------------------------------------------------
def test_data_parallel_wrapped_model_is_rejected():
    wrapped = nn.DataParallel(nn.Linear(3, 2), device_ids=[])  # constructible without GPUs
    with pytest.raises(RuntimeError, match="DataParallel.*amp.initialize first"):
        amp.initialize(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="DataParallel"):
        amp.initialize([nn.Linear(3, 2), wrapped])


def test_distributed_data_parallel_wrapped_model_is_rejected(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
        with pytest.raises(RuntimeError, match="DistributedDataParallel.*amp.initialize first"):
            amp.initialize(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("models", ["model", None, [nn.Linear(3, 2), "model"], (nn.Linear(3, 2), 3),
                                    {"model": nn.Linear(3, 2)}])
def test_models_must_be_modules(models):
    with pytest.raises(TypeError, match="models must be an nn.Module or a list of them"):
        amp.initialize(models, None)


@pytest.mark.parametrize("optimizers", ["sgd", [torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), "adam"],
                                        {"opt": 1}, 0.1])
def test_optimizers_must_be_optimizers(optimizers):
    with pytest.raises(TypeError, match="optimizers must be a torch.optim.Optimizer, a list of them, or None"):
        amp.initialize(nn.Linear(3, 2), optimizers)


def test_the_same_optimizer_twice_is_rejected():
    model, optimizer = model_and_optimizer()
    amp.initialize(model, optimizer, verbosity=0)
    with pytest.raises(RuntimeError, match="already passed through amp.initialize"):
        amp.initialize(model, optimizer)
    other_model, other_optimizer = model_and_optimizer()
    with pytest.raises(RuntimeError, match="already passed through amp.initialize"):
        amp.initialize([model, other_model], [other_optimizer, optimizer])


# --- scale_loss ----------------------------------------------------------------------------------------------
def test_scale_loss_before_initialize_says_what_to_call_first():
    model, optimizer = model_and_optimizer()
    loss = model(torch.ones(1, 3)).sum()
    with pytest.raises(RuntimeError, match=r"did not go through amp.initialize.*amp.initialize\(model, optimizer"):
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.last_step_skipped(optimizer)


def test_scale_loss_with_optimizers_of_two_initialize_calls_is_rejected():
    (model_a, opt_a), (model_b, opt_b) = model_and_optimizer(), model_and_optimizer()
    amp.initialize(model_a, opt_a, verbosity=0)
    amp.initialize(model_b, opt_b, verbosity=0)
    with pytest.raises(RuntimeError, match="different amp.initialize calls"):
        with amp.scale_loss(model_a(torch.ones(1, 3)).sum(), [opt_a, opt_b]):
            pass


@pytest.mark.parametrize("loss_id", [2, -1])
def test_loss_id_out_of_range(loss_id):
    model, optimizer = amp.initialize(*model_and_optimizer(), num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=f"loss_id={loss_id} is out of range.*num_losses=2"):
        with amp.scale_loss(model(torch.ones(1, 3)).sum(), optimizer, loss_id=loss_id):
            pass
