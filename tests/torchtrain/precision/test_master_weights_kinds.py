"""Which parameters get float32 masters, and which values the loss scaler refuses.

Written for the mutation run (tests/mutation/): these mutants survived the rest of its selection."""
import pytest
import torch

from aitoolbox.torchtrain.precision import LossScaler, Precision
from aitoolbox.torchtrain.precision.master_weights import MasterWeights, is_low_precision


@pytest.mark.parametrize("dtype, low", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False),
                                        (torch.float64, False), (torch.complex64, False), (torch.int64, False)])
def test_only_16_bit_floating_tensors_are_low_precision(dtype, low):
    assert is_low_precision(torch.zeros(2, dtype=dtype)) is low


def test_a_complex_parameter_is_stepped_as_it_is_beside_a_bfloat16_one():
    """A float32 master of a complex parameter would drop its imaginary part."""
    low = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    complex_param = torch.nn.Parameter(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    optimizer = torch.optim.SGD([low, complex_param], lr=0.5)
    masters = MasterWeights([optimizer])
    (model_low, stepped_low), (model_complex, stepped_complex) = masters.grad_pairs(optimizer)
    assert stepped_low is not low and stepped_low.dtype == torch.float32
    assert stepped_complex is complex_param
    stepped_complex.grad = torch.tensor([1j, 1.0], dtype=torch.complex64)
    stepped_low.grad = torch.ones(3)
    optimizer.step()
    assert torch.equal(complex_param.detach(), torch.tensor([1 + 1.5j, 2.5 - 1j], dtype=torch.complex64))


@pytest.mark.parametrize("growth_factor, backoff_factor", [(1.0, 0.5), (2.0, 1.0), (2.0, 0.0)])
def test_a_scale_that_does_not_move_both_ways_is_refused(growth_factor, backoff_factor):
    with pytest.raises(ValueError, match="growth_factor must be > 1 and backoff_factor in"):
        LossScaler(growth_factor=growth_factor, backoff_factor=backoff_factor)


def _bfloat16_sgd():
    param = torch.nn.Parameter(torch.linspace(-1, 1, 5).to(torch.bfloat16))
    optimizer = torch.optim.SGD([param], lr=0.01)
    return param, optimizer, MasterWeights([optimizer])


def _step(param, optimizer, masters):
    (_, stepped), = masters.grad_pairs(optimizer)
    stepped.grad = torch.full((5,), 0.337)
    optimizer.step()


def test_loading_the_masters_alone_puts_the_model_back_at_their_rounding():
    param, optimizer, masters = _bfloat16_sgd()
    _step(param, optimizer, masters)
    saved = masters.state_dict()
    for _ in range(3):
        _step(param, optimizer, masters)
    masters.load_state_dict(saved)
    assert torch.equal(masters.state_dict()[0][0], saved[0][0])
    assert torch.equal(param.detach(), saved[0][0].to(torch.bfloat16))


def test_loading_the_masters_keeps_a_model_weight_written_since_the_last_step():
    param, optimizer, masters = _bfloat16_sgd()
    _step(param, optimizer, masters)
    saved = masters.state_dict()
    with torch.no_grad():
        param.fill_(0.25)  # e.g. an average put in, or a model state loaded
    masters.load_state_dict(saved)
    assert torch.equal(param.detach(), torch.full((5,), 0.25, dtype=torch.bfloat16))
    assert torch.equal(masters.state_dict()[0][0], saved[0][0])
    _step(param, optimizer, masters)  # the next step takes the write as the weights, as after any write
    assert torch.equal(masters.state_dict()[0][0], torch.full((5,), 0.25) - 0.01 * torch.full((5,), 0.337))



def test_a_write_of_the_model_before_the_first_step_is_the_weights_the_first_step_steps_from():
    """The masters are made (amp set up), then the model's weights are written (``model.load_state_dict`` of
    pre-trained weights) before any step: the first step takes the write, as after any later write. Written for the
    mutation run: the versions of the first group's parameters were never recorded, so no write before the first
    step was seen and the step went on from the masters' stale values."""
    param, optimizer, masters = _bfloat16_sgd()
    with torch.no_grad():
        param.fill_(0.25)
    _step(param, optimizer, masters)
    assert torch.equal(masters.state_dict()[0][0], torch.full((5,), 0.25) - 0.01 * torch.full((5,), 0.337))

def test_the_second_of_two_loads_of_the_masters_before_a_step_is_what_the_step_steps_from():
    """Loading the masters writes the model (their rounding): that write is the load's own, not a user's, so a second
    load before any step (a rollback, then a checkpoint loaded) puts the model at its values too, and the step
    steps from them. Written for the mutation run: the load did not record its own writes."""
    param, optimizer, masters = _bfloat16_sgd()
    first = [[torch.full((5,), 0.5)]]
    second = [[torch.full((5,), 0.75 + 2.0 ** -12)]]
    masters.load_state_dict(first)
    masters.load_state_dict(second)
    assert torch.equal(param.detach(), second[0][0].to(torch.bfloat16))
    _step(param, optimizer, masters)
    assert torch.equal(masters.state_dict()[0][0], second[0][0] - 0.01 * torch.full((5,), 0.337))

def test_loading_the_masters_after_a_write_they_took_puts_the_model_at_the_loaded_values():
    """A write the masters took (``grad_pairs`` adopts it: a step skipped on an overflow leaves it there) is no longer
    a write: loading masters afterwards puts the model at their rounding, and the next step steps from them."""
    param, optimizer, masters = _bfloat16_sgd()
    _step(param, optimizer, masters)
    saved = masters.state_dict()
    with torch.no_grad():
        param.fill_(0.25)
    masters.grad_pairs(optimizer)  # adopts 0.25
    masters.load_state_dict(saved)
    assert torch.equal(param.detach(), saved[0][0].to(torch.bfloat16))
    _step(param, optimizer, masters)
    assert torch.equal(masters.state_dict()[0][0], saved[0][0] - 0.01 * torch.full((5,), 0.337))


def test_masters_load_into_a_parameter_group_added_since_they_were_made():
    """``optimizer.add_param_group`` after the masters were made (unfreezing layers as training goes on): loading a
    state saved with that group fills its masters too, rather than refusing the state as another model's."""
    param, optimizer, masters = _bfloat16_sgd()
    added = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    optimizer.add_param_group({"params": [added]})
    saved = [[torch.full((5,), 0.5 + 2.0 ** -12), torch.full((2,), 2.0 + 2.0 ** -10)]]  # finer than bfloat16
    masters.load_state_dict(saved)
    assert all(torch.equal(got, want) for got, want in zip(masters.state_dict()[0], saved[0]))
    assert torch.equal(added.detach(), saved[0][1].to(torch.bfloat16))

# --- accumulated master gradients averaged over processes (DDP), the overflow verdict read from the average ----------
def _accumulated_step(other_process_grad: torch.Tensor):
    """Two micro-batches of one bfloat16 parameter (gradient 1 each) under float32 masters and a dynamic scale of 4,
    beside an optimizer whose parameter gets no gradient (nothing of it is averaged). The average over processes is a stand-in for DDP's: a second process whose accumulating micro-batch left
    ``other_process_grad`` in its masters. Returns (stepped, the parameter, the scale after the step, the calls)."""
    from aitoolbox.torchtrain.precision import Precision
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([param], lr=1.0)
    unused = torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1.0)  # no gradient
    precision = Precision(loss_scaler=LossScaler("dynamic", init_scale=4.0),
                          master_weights=MasterWeights([optimizer, unused]))
    calls = []

    def average(tensors):
        calls.append(len(tensors))
        for tensor in tensors:
            tensor.add_(other_process_grad).div_(2)

    precision.average_across_processes = average
    precision.backward(param.float().sum(), accumulating=True)  # into the masters, unscaled: 1 each
    precision.backward(param.float().sum())  # the window's last: the model's scaled .grad (DDP synchronised it)
    stepped = precision.step([optimizer])
    return stepped, param.detach().float(), precision.loss_scaler.loss_scale, calls


def test_the_accumulated_master_gradients_are_averaged_once_and_stepped_on():
    stepped, param, scale, calls = _accumulated_step(torch.full((4,), 3.0))
    assert stepped and calls == [1]
    # (1 + 3) / 2 from the accumulating micro-batches, + 1 from the last: SGD with lr 1 from 1.
    assert torch.equal(param, torch.full((4,), -2.0)) and scale == 4.0


def test_an_overflow_in_another_process_accumulated_gradients_skips_the_step_here_too():
    """The verdict is read from the averaged gradients (an inf of any process survives the average), so every process
    skips, also the one whose own gradients were finite."""
    stepped, param, scale, _ = _accumulated_step(torch.tensor([0.0, float("inf"), 0.0, 0.0]))
    assert not stepped
    assert torch.equal(param, torch.ones(4)) and scale == 2.0


def test_a_checkpoint_of_other_master_weights_is_refused():
    """A checkpoint saved from another model or opt_level: zip would load part of it silently."""
    _, optimizer, masters = _bfloat16_sgd()
    saved = masters.state_dict()
    with pytest.raises(ValueError, match="holds master weights for 2 optimizer"):
        masters.load_state_dict(saved + saved)
    with pytest.raises(ValueError, match="holds 2 master weights for an optimizer that has 1"):
        masters.load_state_dict([saved[0] + saved[0]])


def test_optimizers_stepped_together_average_the_accumulated_master_gradients_once():
    """Two optimizers in one step (each unscaled in turn): the first ``unscale_`` averages every optimizer's
    accumulated master gradients, the second averages nothing again (a second all-reduce of averaged gradients costs
    a collective, and over three processes or more is not exact). Written for the mutation run."""
    from aitoolbox.torchtrain.precision import Precision
    params = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(2)]
    optimizers = [torch.optim.SGD([param], lr=1.0) for param in params]
    precision = Precision(loss_scaler=LossScaler("dynamic", init_scale=4.0), master_weights=MasterWeights(optimizers))
    calls = []

    def average(tensors):  # a second process whose accumulating micro-batch left 3 in each master gradient
        calls.append(len(tensors))
        for tensor in tensors:
            tensor.add_(3.0).div_(2)

    precision.average_across_processes = average
    precision.backward(sum(param.float().sum() for param in params), accumulating=True)
    precision.backward(sum(param.float().sum() for param in params))
    assert precision.step(optimizers)
    assert calls == [2]
    assert all(torch.equal(param.detach().float(), torch.full((4,), -2.0)) for param in params)


def test_a_precision_state_with_masters_loads_into_a_precision_without_them_and_back():
    """An O2 checkpoint continued in float32 (or O1), and a float32 one continued under O2: the masters a side lacks
    are left out, not loaded into nothing (written for the mutation run: either way the load raised)."""
    from aitoolbox.torchtrain.precision import Precision
    _, optimizer, masters = _bfloat16_sgd()
    with_masters = Precision(master_weights=masters)
    saved = with_masters.state_dict()
    Precision().load_state_dict(saved)
    with_masters.load_state_dict(Precision().state_dict())
    assert torch.equal(masters.state_dict()[0][0], saved["master_weights"][0][0])


def test_a_step_finished_later_keeps_the_overflow_verdict_of_the_optimizers_left():
    """Two optimizers stepped in turn under float32 masters and a dynamic scale; an early micro-batch of the window
    overflowed in optimizer 1's gradients (its masters hold the inf), optimizer 0 stepped, then an exception: the
    step is finished later (``step_state`` kept, ``reset`` at the next fit's start, ``load_step_state``), and
    optimizer 1 still skips on its verdict instead of stepping on the inf. Written for the mutation run: the
    verdicts were not put back."""
    from aitoolbox.torchtrain.precision import Precision
    params = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(2)]
    optimizers = [torch.optim.SGD([param], lr=1.0) for param in params]
    precision = Precision(loss_scaler=LossScaler("dynamic", init_scale=4.0), master_weights=MasterWeights(optimizers))
    overflowing = params[1].float() * torch.tensor([float("inf"), 1.0, 1.0, 1.0])
    precision.backward(params[0].float().sum() + overflowing.sum(), accumulating=True)
    precision.backward(sum(param.float().sum() for param in params))  # the window's last micro-batch: finite
    assert precision.step([optimizers[0]], update_scale=False)
    kept = precision.step_state()  # the exception: the step is kept for the next fit
    precision.reset()  # the next fit starts
    precision.load_step_state(kept)
    assert not precision.step([optimizers[1]])
    assert torch.equal(params[1].detach(), torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(params[0].detach().float(), torch.full((4,), -1.0))


def test_zero_grad_clears_a_gradient_left_on_the_low_precision_model():
    """A gradient on the bfloat16 model that no step moved into the masters (a backward before fit, cleared by the
    loop's zero_grad at fit start) is cleared by zero_grad, not added to the next step's. (The mutation run, mut50:
    zero_grad's ``model_param.grad = None`` dropped survived.)"""
    param, optimizer, masters = _bfloat16_sgd()
    precision = Precision(master_weights=masters)
    param.grad = torch.full((5,), 100.0, dtype=torch.bfloat16)
    precision.zero_grad([optimizer])
    assert param.grad is None
    (_, master), = masters.grad_pairs(optimizer)
    expected = master.detach() - 0.01 * 0.5
    param.grad = torch.full((5,), 0.5, dtype=torch.bfloat16)
    assert precision.step([optimizer])
    assert torch.equal(master.detach(), expected)
