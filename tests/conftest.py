"""Shared test fixtures: a tiny regression model, its data, and a hand-written PyTorch training loop."""
import os
from typing import Callable, Optional, Sequence, Set

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.precision.factory import NATIVE_BFLOAT16_ENV

# use_amp=True means bfloat16 autocast on a CPU with native bfloat16 and float32 on one without (it would be ~10x
# slower there). The suite checks the bfloat16 path whatever CPU runs it, so it answers "native" for every test
# and for every process the tests start; the tests of the float32 fallback set "0" themselves.
os.environ[NATIVE_BFLOAT16_ENV] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (tests marked extended, e.g. the rest of the feature matrix's "
                          "full product): CI runs it as a second step, after the suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """The extended tier is left out unless ``--extended`` is given, so that ``python -m pytest`` keeps within the
    suite's time budget; CI runs the tier in a step of its own (``.ci/run``)."""
    if config.getoption("--extended"):
        return
    extended = [item for item in items if item.get_closest_marker("extended") is not None]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if item.get_closest_marker("extended") is None]


class TinyRegressor(TTModel):
    """4 -> 8 -> 1 MLP trained with the criterion handed to get_loss (MSE in the tests)."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).cpu(), y, None


@pytest.fixture
def make_model() -> Callable[..., TinyRegressor]:
    """``make_model(seed=0)``: the same initial weights for the same seed."""
    def make(seed: int = 0) -> TinyRegressor:
        torch.manual_seed(seed)
        return TinyRegressor()
    return make


@pytest.fixture
def make_loader() -> Callable[..., DataLoader]:
    """``make_loader(num_samples=38, batch_size=4, shuffle=False, seed=0)``; 38 / 4 leaves a last batch of 2."""
    def make(num_samples: int = 38, batch_size: int = 4, shuffle: bool = False, seed: int = 0, **options) -> DataLoader:
        data_gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(num_samples, 4, generator=data_gen)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(num_samples, 1, generator=data_gen)
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=generator, **options)
    return make


@pytest.fixture
def hand_train() -> Callable:
    """A plain PyTorch loop with TrainLoop's update rule (step every ``grad_accumulation`` batches and at the
    last batch of an epoch), with hooks right before/after each optimizer step and at each epoch end."""
    def train(model: nn.Module, loader, optimizers: Sequence[torch.optim.Optimizer], num_epochs: int,
              grad_accumulation: int = 1, before_step: Optional[Callable[[], None]] = None,
              after_step: Optional[Callable[[], None]] = None, epoch_end: Optional[Callable[[int], None]] = None,
              max_batches: Optional[int] = None) -> None:
        criterion = nn.MSELoss()
        model.train()
        num_batches = len(loader) if max_batches is None else min(max_batches, len(loader))
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        for epoch in range(num_epochs):
            for i, (x, y) in enumerate(loader):
                if i == num_batches:
                    break
                loss = criterion(model(x), y)
                (loss / grad_accumulation if grad_accumulation > 1 else loss).backward()
                if (i + 1) % grad_accumulation == 0 or i + 1 == num_batches:
                    if before_step is not None:
                        before_step()
                    for optimizer in optimizers:
                        optimizer.step()
                    if after_step is not None:
                        after_step()
                    for optimizer in optimizers:
                        optimizer.zero_grad(set_to_none=True)
            if epoch_end is not None:
                epoch_end(epoch)
    return train


@pytest.fixture
def inf_loss_on_batches() -> Callable[[TTModel, Set[int]], TTModel]:
    """``inf_loss_on_batches(model, {3})``: the training loss of those (0-based, counted over the whole run)
    training batches is multiplied by inf, as an fp16 overflow would; evaluation losses stay true."""
    def patch(model: TTModel, batch_indices: Set[int]) -> TTModel:
        true_loss = model.get_loss
        calls = []

        def get_loss(batch_data, criterion, device):
            loss = true_loss(batch_data, criterion, device)
            calls.append(None)
            return loss * float("inf") if len(calls) - 1 in batch_indices else loss

        model.get_loss_eval = true_loss
        model.get_loss = get_loss
        return model
    return patch


def assert_same_parameters(model_a: nn.Module, model_b: nn.Module) -> None:
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(a, b), f"parameter {name} differs"


@pytest.fixture
def assert_params_equal() -> Callable[[nn.Module, nn.Module], None]:
    """Bitwise comparison of two models' parameters."""
    return assert_same_parameters
