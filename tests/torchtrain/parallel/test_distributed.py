"""apex-style DistributedDataParallel over 2 real gloo processes, against single-process gradients."""
import warnings
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from aitoolbox.torchtrain.parallel import DistributedDataParallel, convert_syncbn_model
from tests.distributed_helpers import run_distributed

WORLD_SIZE = 2
BATCH = 8  # split evenly, so the mean of the ranks' mean losses is the global mean loss
TOL = dict(rtol=1e-12, atol=1e-12)
BF16_PREDIVIDE = 3.0

# name -> DistributedDataParallel arguments; float64 models.
CONFIGS: Dict[str, dict] = {
    "default": {},
    "predivide": dict(gradient_predivide_factor=2.0),
    "sum": dict(gradient_average=False),
    "sum_predivide": dict(gradient_average=False, gradient_predivide_factor=4.0),
    "delay_allreduce": dict(delay_allreduce=True),
    "fp32_allreduce_on_float64": dict(allreduce_always_fp32=True),
}


def make_mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def make_data(batch: int = BATCH):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, generator=gen, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def local_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
    """Gradients of the mean squared error on (x, y); through a DDP wrapper they come out reduced."""
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    params = model.module.parameters() if isinstance(model, nn.parallel.DistributedDataParallel) else model.parameters()
    return [p.grad.clone() for p in params]


def buckets_in_second_pass(**ddp_kwargs) -> int:
    """Count the buckets torch reduces in the second backward pass (it puts every parameter in one bucket
    for the first pass and rebuilds the buckets after it)."""
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    x, y = make_data()
    model = DistributedDataParallel(make_mlp(), **ddp_kwargs)
    model.register_comm_hook(None, counting_hook)
    local_gradients(model, x, y)
    calls.clear()
    local_gradients(model, x, y)
    return len(calls)


def ddp_worker(rank: int, world_size: int) -> dict:
    x, y = make_data()
    share = BATCH // world_size
    x_local, y_local = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    result = {"grads": {}}
    for name, kwargs in CONFIGS.items():
        model = DistributedDataParallel(make_mlp(), **kwargs)
        result["grads"][name] = local_gradients(model, x_local, y_local)
        result.setdefault("device_ids", model.device_ids)
        result.setdefault("bucket_bytes_cap", {})[name] = model.bucket_bytes_cap

    # bfloat16 gradients reduced in float32: compared with this rank's own (unreduced) gradients. A
    # predivide factor of 3 makes every step round differently in bfloat16 than in float32.
    model = make_mlp(torch.bfloat16)
    result["bf16_local"] = local_gradients(model, x_local.bfloat16(), y_local.bfloat16())
    ddp = DistributedDataParallel(make_mlp(torch.bfloat16), allreduce_always_fp32=True,
                                  gradient_predivide_factor=BF16_PREDIVIDE)
    result["bf16_reduced"] = local_gradients(ddp, x_local.bfloat16(), y_local.bfloat16())

    result["buckets"] = {"message_size_8": buckets_in_second_pass(message_size=8),
                         "delay_allreduce": buckets_in_second_pass(message_size=8, delay_allreduce=True)}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DistributedDataParallel(make_mlp(), prof=True, num_allreduce_streams=2, retain_allreduce_buffers=True,
                                        allreduce_trigger_params=[], allreduce_communicators=("a", "b"))
        split = DistributedDataParallel(make_mlp(), gradient_average_split_factor=2.0)
    result["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    result["split_factor"] = split.gradient_predivide_factor

    result["syncbn_training"] = syncbn_training(rank)
    return result


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).double()


SYNCBN_SPLIT = (5, 3)


def train_bn_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> None:
    """SGD on the SUM of squared errors: the sum over ranks of local gradients is the global gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        optimizer.step()


def syncbn_training(rank: int) -> Dict[str, torch.Tensor]:
    """convert_syncbn_model + DistributedDataParallel(gradient_average=False) on uneven batches."""
    x, y = make_data(sum(SYNCBN_SPLIT))
    lo = sum(SYNCBN_SPLIT[:rank])
    hi = lo + SYNCBN_SPLIT[rank]
    model = DistributedDataParallel(convert_syncbn_model(bn_model()), gradient_average=False)
    train_bn_model(model, x[lo:hi], y[lo:hi])
    return {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.fixture(scope="module")
def results() -> List[dict]:
    return run_distributed(ddp_worker, WORLD_SIZE)


@pytest.fixture(scope="module")
def mean_loss_gradients() -> List[torch.Tensor]:
    """Single-process gradient of the mean loss over the global batch."""
    return local_gradients(make_mlp(), *make_data())


@pytest.mark.parametrize("name, factor", [("default", 1.0), ("predivide", 1.0), ("delay_allreduce", 1.0),
                                          ("fp32_allreduce_on_float64", 1.0),
                                          ("sum", WORLD_SIZE), ("sum_predivide", WORLD_SIZE / 4.0)])
def test_gradients_equal_single_process_gradient(results, mean_loss_gradients, name, factor):
    # Averaging gives the global mean-loss gradient; gradient_average=False leaves the sum over ranks
    # (divided by the predivide factor, as in apex).
    for result in results:
        for got, expected in zip(result["grads"][name], mean_loss_gradients):
            torch.testing.assert_close(got, expected * factor, **TOL)


def test_cpu_module_gets_no_device_ids(results):
    assert results[0]["device_ids"] is None


def test_message_size_is_converted_from_elements_to_bytes(results):
    float64_bytes = 8
    assert results[0]["bucket_bytes_cap"]["default"] == 10_000_000 * float64_bytes
    model_bytes = sum(p.numel() * p.element_size() for p in make_mlp().parameters())
    assert results[0]["bucket_bytes_cap"]["delay_allreduce"] >= model_bytes


def test_delay_allreduce_reduces_all_gradients_in_one_bucket(results):
    assert results[0]["buckets"]["message_size_8"] > 1
    assert results[0]["buckets"]["delay_allreduce"] == 1


def test_allreduce_always_fp32_on_bfloat16_parameters(results, mean_loss_gradients):
    # apex's arithmetic, all in float32: predivide, sum, divide by world_size / predivide.
    expected = [((g0.float() / BF16_PREDIVIDE + g1.float() / BF16_PREDIVIDE) / (WORLD_SIZE / BF16_PREDIVIDE)).bfloat16()
                for g0, g1 in zip(results[0]["bf16_local"], results[1]["bf16_local"])]
    for result in results:
        for got, exact, reference in zip(result["bf16_reduced"], expected, mean_loss_gradients):
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, exact)
            torch.testing.assert_close(got.double(), reference, rtol=0.05, atol=0.02)


def test_options_without_torch_equivalent_warn(results):
    messages = [message for category, message in results[0]["warnings"] if category == "UserWarning"]
    for option in ("prof", "num_allreduce_streams", "retain_allreduce_buffers", "allreduce_trigger_params",
                   "allreduce_communicators"):
        assert any(message.startswith(option + "=") for message in messages), option


def test_gradient_average_split_factor_is_a_deprecated_alias(results):
    assert ("DeprecationWarning", ) == tuple({c for c, m in results[0]["warnings"] if "split_factor" in m})
    assert results[0]["split_factor"] == 2.0


def test_syncbn_with_ddp_trains_like_batchnorm_on_the_global_batch(results):
    x, y = make_data(sum(SYNCBN_SPLIT))
    reference = bn_model()
    train_bn_model(reference, x, y)
    for result in results:
        assert result["syncbn_training"].keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(result["syncbn_training"][key], value, rtol=1e-10, atol=1e-10)


# --- argument checks (they run before any process group is needed) --------------------------------------

def test_shared_param_is_rejected():
    with pytest.raises(ValueError, match="shared_param"):
        DistributedDataParallel(make_mlp(), shared_param=True)


@pytest.mark.parametrize("kwargs, match", [(dict(message_size=0), "message_size"),
                                           (dict(message_size=2.5), "message_size"),
                                           (dict(gradient_predivide_factor=0.0), "gradient_predivide_factor"),
                                           (dict(message_size=100, bucket_cap_mb=5), "bucket_cap_mb"),
                                           (dict(delay_allreduce=True, bucket_cap_mb=5), "bucket_cap_mb")])
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedDataParallel(make_mlp(), **kwargs)
