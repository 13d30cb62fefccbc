"""Which parameters get float32 masters, and which values the loss scaler refuses.

Written for the mutation run (tests/mutation/): these mutants survived the rest of its selection."""
import pytest
import torch

from aitoolbox.torchtrain.precision import LossScaler
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
