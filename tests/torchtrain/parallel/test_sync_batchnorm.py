"""SyncBatchNorm over 2 real gloo processes against one nn.BatchNorm over the global batch, and
convert_syncbn_model.

The ranks hold uneven shares of the global batch (5 and 3 samples; 6 and 0 in one case). The loss is a
weighted SUM over samples, so the sum over ranks of the local weight / bias gradients is the global one.
"""
import copy
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aitoolbox.torchtrain.parallel import SyncBatchNorm, convert_syncbn_model
from tests.distributed_helpers import run_distributed

WORLD_SIZE = 2
NUM_STEPS = 2
TOL = dict(rtol=1e-9, atol=1e-9)  # float64 throughout

# name -> per-sample shape (C first), the ranks' shares of the global batch, SyncBatchNorm options.
CASES: Dict[str, dict] = {
    "bn1d_nc": dict(shape=(4,), split=(5, 3)),
    "bn1d_ncl": dict(shape=(3, 5), split=(5, 3)),
    "bn2d": dict(shape=(3, 4, 5), split=(5, 3)),
    "bn3d": dict(shape=(2, 3, 2, 2), split=(5, 3)),
    "bn1d_cumulative_average": dict(shape=(3, 5), split=(5, 3), options=dict(momentum=None)),
    "bn2d_empty_rank": dict(shape=(3, 2, 2), split=(6, 0)),
    "bn2d_no_affine": dict(shape=(3, 4, 5), split=(5, 3), options=dict(affine=False)),
    "bn2d_channel_last": dict(shape=(3, 4, 5), split=(5, 3), options=dict(channel_last=True)),
    "bn2d_fuse_relu_with_z": dict(shape=(3, 4, 5), split=(5, 3), options=dict(fuse_relu=True), add_z=True),
}
REFERENCE_CLASS = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}


def case_data(name: str) -> dict:
    """The global batches of every step (N, C, *), loss weights, the optional residual z and affine init."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(sorted(CASES).index(name))
    batch = sum(case["split"])
    shape = (batch,) + case["shape"]
    # A large mean next to a small spread exercises the variance formula (E[x^2] - E[x]^2).
    inputs = [3.0 + 2.0 * torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(NUM_STEPS)]
    loss_weights = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(NUM_STEPS)]
    z = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(NUM_STEPS)]
    channels = case["shape"][0]
    return dict(inputs=inputs, loss_weights=loss_weights, z=z if case.get("add_z") else None,
                weight=1.0 + 0.5 * torch.randn(channels, generator=gen, dtype=torch.float64),
                bias=0.5 * torch.randn(channels, generator=gen, dtype=torch.float64))


def run_case(name: str, module: nn.Module, lo: int, hi: int, channel_last: bool) -> dict:
    """Train ``module`` NUM_STEPS steps on samples ``lo:hi`` of each global batch; record what we compare."""
    data = case_data(name)
    if module.weight is not None:
        with torch.no_grad():
            module.weight.copy_(data["weight"])
            module.bias.copy_(data["bias"])
    layout = (lambda t: t.movedim(1, -1).contiguous()) if channel_last else (lambda t: t)
    record: Dict[str, List[Optional[torch.Tensor]]] = dict(output=[], input_grad=[], weight_grad=[], bias_grad=[])
    module.train()
    for step in range(NUM_STEPS):
        x = layout(data["inputs"][step][lo:hi]).requires_grad_()
        z = None if data["z"] is None else layout(data["z"][step][lo:hi])
        output = module(x) if z is None else module(x, z)
        (output * layout(data["loss_weights"][step][lo:hi])).sum().backward()
        record["output"].append(output.detach())
        record["input_grad"].append(x.grad)
        record["weight_grad"].append(None if module.weight is None else module.weight.grad.clone())
        record["bias_grad"].append(None if module.bias is None else module.bias.grad.clone())
        module.zero_grad()
    record["running_mean"] = module.running_mean.clone()
    record["running_var"] = module.running_var.clone()
    record["num_batches_tracked"] = module.num_batches_tracked.clone()
    module.eval()
    with torch.no_grad():
        record["eval_output"] = module(layout(data["inputs"][0]))
    return record


def sync_bn_worker(rank: int, world_size: int) -> Dict[str, dict]:
    records = {}
    for name, case in CASES.items():
        options = case.get("options", {})
        lo = sum(case["split"][:rank])
        module = SyncBatchNorm(case["shape"][0], **options).double()
        records[name] = run_case(name, module, lo, lo + case["split"][rank], options.get("channel_last", False))
    records["bfloat16_input"] = bfloat16_step(SyncBatchNorm(3), 5 * rank, 5 + 3 * rank)
    return records


def bfloat16_step(module: nn.Module, lo: int, hi: int) -> Dict[str, torch.Tensor]:
    """bfloat16 activations through float32 BatchNorm parameters (amp's keep_batchnorm_fp32)."""
    data = case_data("bn2d")
    x = data["inputs"][0][lo:hi].bfloat16().requires_grad_()
    output = module.train()(x)
    (output.float() * data["loss_weights"][0][lo:hi].float()).sum().backward()
    return dict(output=output.detach(), input_grad=x.grad, weight_grad=module.weight.grad,
                running_var=module.running_var)


class ReferenceBatchNorm(nn.Module):
    """torch's BatchNorm with SyncBatchNorm's channel_last / fuse_relu / z, written out plainly."""

    def __init__(self, bn: nn.Module, channel_last: bool, fuse_relu: bool):
        super().__init__()
        self.bn, self.channel_last, self.fuse_relu = bn, channel_last, fuse_relu
        self.weight, self.bias = bn.weight, bn.bias
        self.running_mean, self.running_var, self.num_batches_tracked = (
            bn.running_mean, bn.running_var, bn.num_batches_tracked)

    def forward(self, x, z=None):
        if self.channel_last:
            x = x.movedim(-1, 1)
        out = self.bn(x)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out


@pytest.fixture(scope="module")
def distributed_records() -> List[Dict[str, dict]]:
    return run_distributed(sync_bn_worker, WORLD_SIZE)


@pytest.mark.parametrize("name", list(CASES))
def test_sync_batchnorm_matches_batchnorm_over_global_batch(distributed_records, name):
    case = CASES[name]
    options = case.get("options", {})
    batch = sum(case["split"])
    bn = REFERENCE_CLASS[len(case["shape"])](case["shape"][0], momentum=options.get("momentum", 0.1),
                                             affine=options.get("affine", True)).double()
    reference = run_case(name, ReferenceBatchNorm(bn, options.get("channel_last", False),
                                                  options.get("fuse_relu", False)),
                         0, batch, options.get("channel_last", False))
    records = [ranks[name] for ranks in distributed_records]
    for step in range(NUM_STEPS):
        lo = 0
        for rank, record in enumerate(records):
            hi = lo + case["split"][rank]
            torch.testing.assert_close(record["output"][step], reference["output"][step][lo:hi], **TOL)
            torch.testing.assert_close(record["input_grad"][step], reference["input_grad"][step][lo:hi], **TOL)
            lo = hi
        for key in ("weight_grad", "bias_grad"):
            if reference[key][step] is None:
                assert all(record[key][step] is None for record in records)
            else:
                # What DistributedDataParallel's all-reduce sum would make of the local gradients.
                torch.testing.assert_close(sum(record[key][step] for record in records), reference[key][step], **TOL)
    for record in records:
        for key in ("running_mean", "running_var", "eval_output"):
            torch.testing.assert_close(record[key], reference[key], **TOL)
        assert record["num_batches_tracked"].item() == NUM_STEPS


def test_rank_without_samples_gets_empty_output_and_zero_parameter_gradients(distributed_records):
    record = distributed_records[1]["bn2d_empty_rank"]
    assert record["output"][0].shape == (0, 3, 2, 2)
    assert record["input_grad"][0].shape == (0, 3, 2, 2)
    assert torch.count_nonzero(record["weight_grad"][0]) == 0


def test_bfloat16_input_with_float32_parameters(distributed_records):
    reference = bfloat16_step(nn.BatchNorm2d(3), 0, 8)
    records = [ranks["bfloat16_input"] for ranks in distributed_records]
    for rank, record in enumerate(records):
        assert (record["output"].dtype, record["input_grad"].dtype) == (torch.bfloat16, torch.bfloat16)
        assert (record["weight_grad"].dtype, record["running_var"].dtype) == (torch.float32, torch.float32)
        lo, hi = 5 * rank, 5 + 3 * rank
        torch.testing.assert_close(record["output"], reference["output"][lo:hi], rtol=0.02, atol=0.02)
        torch.testing.assert_close(record["input_grad"], reference["input_grad"][lo:hi], rtol=0.02, atol=0.02)
        torch.testing.assert_close(record["running_var"], reference["running_var"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(records[0]["weight_grad"] + records[1]["weight_grad"], reference["weight_grad"],
                               rtol=1e-2, atol=1e-2)


# --- single process: no process group means plain BatchNorm ----------------------------------------------

def test_without_process_group_it_is_batchnorm_bitwise():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    sync = SyncBatchNorm(3)
    sync.load_state_dict(bn.state_dict())
    x = torch.randn(4, 3, 5, 5)
    for module in (bn, sync):
        module(x).square().sum().backward()
    assert torch.equal(sync(x), bn(x))
    for got, expected in zip(list(sync.parameters()) + list(sync.buffers()),
                             list(bn.parameters()) + list(bn.buffers())):
        assert torch.equal(got, expected)
    assert torch.equal(sync.weight.grad, bn.weight.grad)
    bn.eval(), sync.eval()
    assert torch.equal(sync(x), bn(x))


def test_channel_last_and_fuse_relu_without_process_group():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    sync = SyncBatchNorm(3, channel_last=True, fuse_relu=True)
    x = torch.randn(4, 3, 5, 6)
    out = sync(x.permute(0, 2, 3, 1))
    assert out.shape == (4, 5, 6, 3)
    torch.testing.assert_close(out, F.relu(bn(x)).permute(0, 2, 3, 1))


@pytest.mark.parametrize("shape, channel_last", [((4,), False), ((4, 2, 3), False), ((4, 3, 2), True)])
def test_rejects_inputs_of_wrong_rank_or_channel_count(shape, channel_last):
    with pytest.raises(ValueError, match="expected"):
        SyncBatchNorm(3, channel_last=channel_last)(torch.randn(shape))


@pytest.mark.parametrize("kwargs", [dict(num_features=0), dict(num_features=2.0), dict(num_features=3, momentum=2.0)])
def test_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="must be"):
        SyncBatchNorm(**kwargs)


# --- convert_syncbn_model -----------------------------------------------------------------------------------

def trained_model() -> nn.Module:
    """Conv + nested BatchNorm layers (with non-trivial running statistics), in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Sequential(nn.Linear(12, 5), nn.BatchNorm1d(5, momentum=None)),
                          nn.BatchNorm1d(5, affine=False, track_running_stats=False))
    model[1].weight.requires_grad_(False)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(6, 2, 4, 4))
    return model.eval()


def test_convert_syncbn_model_keeps_state_and_eval_output():
    model = trained_model()
    original = copy.deepcopy(model)
    x = torch.randn(7, 2, 4, 4)
    converted = convert_syncbn_model(model)
    assert converted is model
    layers = [converted[1], converted[4][1], converted[5]]
    assert all(type(layer) is SyncBatchNorm for layer in layers)
    assert not any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for m in converted.modules())
    assert converted.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key
    assert [p.requires_grad for p in converted.parameters()] == [p.requires_grad for p in original.parameters()]
    assert not any(m.training for m in converted.modules())
    assert converted[4][1].momentum is None and converted[5].running_mean is None
    assert torch.equal(converted(x), original(x))


def test_convert_syncbn_model_shares_parameters_so_optimizers_keep_working():
    bn = nn.BatchNorm1d(4)
    converted = convert_syncbn_model(bn, channel_last=True)
    assert type(converted) is SyncBatchNorm and converted.channel_last
    assert converted.weight is bn.weight and converted.running_var is bn.running_var
    assert converted.training


def test_convert_syncbn_model_converts_torch_sync_batchnorm_and_passes_process_group():
    marker = object()  # any group object is stored; it is only used once training runs distributed
    torch_sync = nn.SyncBatchNorm(3, eps=1e-3, momentum=0.2)
    converted = convert_syncbn_model(nn.Sequential(torch_sync, nn.InstanceNorm1d(3)), process_group=marker)
    assert type(converted[0]) is SyncBatchNorm and type(converted[1]) is nn.InstanceNorm1d
    assert converted[0].process_group is marker
    assert (converted[0].eps, converted[0].momentum) == (1e-3, 0.2)


def test_convert_syncbn_model_rejects_uninitialised_lazy_batchnorm():
    with pytest.raises(ValueError, match="forward"):
        convert_syncbn_model(nn.Sequential(nn.LazyBatchNorm1d()))
