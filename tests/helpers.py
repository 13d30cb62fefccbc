"""Small models, data sets and a hand-written PyTorch training loop shared by the TrainLoop tests.

The reference loop :func:`reference_fit` is the specification the golden tests hold TrainLoop to: it is
plain PyTorch, written independently of the package, and TrainLoop must produce bitwise identical
parameters when both start from the same weights, the same RNG state and identically seeded loaders.
"""
import copy
from typing import Callable, Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition
from aitoolbox.torchtrain.model import TTModel

IN_FEATURES = 6
NUM_CLASSES = 3
IMAGE_SIZE = 8

# Seeds: model initialisation, the global RNG during training (dropout), and the loaders' shuffling.
INIT_SEED = 0
TRAIN_SEED = 1
LOADER_SEED = 2

# GradScaler settings under which the loss scale changes within a few steps of the small tests.
SCALER_ARGS = {"init_scale": 2.0 ** 10, "growth_interval": 3}


def single_torch_thread() -> Iterator[None]:
    """Run with one torch thread, then restore the count; made a module fixture by the tests that need it.

    Tiny models: one thread avoids contention for the cores (and keeps these tests fast).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def default_device() -> torch.device:
    """The device a single-process TrainLoop trains on: the current CUDA GPU if there is one, else the CPU.

    The reference loop runs there too, so the bitwise comparisons also hold on a GPU machine.
    """
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# --- data ------------------------------------------------------------------------------------------------
def classification_data(num_samples: int = 30, seed: int = 10) -> TensorDataset:
    """Features of shape (N, IN_FEATURES) and integer labels in [0, NUM_CLASSES)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    return TensorDataset(x, y)


def image_data(num_samples: int = 30, seed: int = 11) -> TensorDataset:
    """Single-channel IMAGE_SIZE x IMAGE_SIZE images and integer labels in [0, NUM_CLASSES)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    return TensorDataset(x, y)


def indexed_classification_data(num_samples: int = 30, seed: int = 10) -> TensorDataset:
    """Like :func:`classification_data` with the sample index as a third element (for metadata tests)."""
    x, y = classification_data(num_samples, seed).tensors
    return TensorDataset(x, y, torch.arange(num_samples))


def seeded_loader(dataset, batch_size: int = 8, shuffle: bool = True, seed: int = LOADER_SEED) -> DataLoader:
    """A DataLoader whose shuffling comes from its own generator seeded with ``seed``."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


class IterableTensorData(IterableDataset):
    """The samples of a TensorDataset streamed in order, without ``__len__`` (so the DataLoader has none)."""

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __iter__(self) -> Iterator:
        for index in range(len(self.dataset)):
            yield self.dataset[index]


class EmptyIterableData(IterableDataset):
    """An IterableDataset that yields nothing."""

    def __iter__(self) -> Iterator:
        return iter(())


# --- models ------------------------------------------------------------------------------------------------
class ClassifierMixin:
    """``get_loss`` / ``get_predictions`` for batches ``(x, y)`` or ``(x, y, index)``."""

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0], batch_data[1]
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data[0], batch_data[1]
        metadata = {"index": batch_data[2]} if len(batch_data) > 2 else None
        return self(x.to(device)).argmax(dim=1).cpu(), y.cpu(), metadata


class MLP(ClassifierMixin, TTModel):
    """Two linear layers with dropout in between."""

    def __init__(self, hidden: int = 16, dropout: float = 0.3):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, hidden)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(self.dropout(torch.relu(self.fc1(x))))


class SmallCNN(ClassifierMixin, TTModel):
    """One convolution, max pooling, dropout and a linear classifier over 1 x 8 x 8 images."""

    def __init__(self, channels: int = 4, dropout: float = 0.25):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels * (IMAGE_SIZE // 2) ** 2, NUM_CLASSES)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv(x)))
        return self.fc(self.dropout(torch.flatten(x, 1)))


class PlainMLP(nn.Module):
    """The same network as :class:`MLP` as a plain ``nn.Module`` (for ModelWrap)."""

    def __init__(self, hidden: int = 16, dropout: float = 0.3):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, hidden)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(self.dropout(torch.relu(self.fc1(x))))


class ClassifierFeedDefinition(AbstractModelFeedDefinition):
    """The feed definition equivalent to :class:`ClassifierMixin`."""

    def get_loss(self, model, batch_data, criterion, device):
        x, y = batch_data[0], batch_data[1]
        return criterion(model(x.to(device)), y.to(device))

    def get_predictions(self, model, batch_data, device):
        x, y = batch_data[0], batch_data[1]
        return model(x.to(device)).argmax(dim=1).cpu(), y.cpu(), None


def model_pair(model_class=MLP, **kwargs):
    """Two models with identical initial weights: one for TrainLoop, one for the reference loop."""
    torch.manual_seed(INIT_SEED)
    model = model_class(**kwargs)
    return model, copy.deepcopy(model)


def assert_params_equal(model_a: nn.Module, model_b: nn.Module) -> None:
    """Bitwise equality of every parameter and buffer (same names, same values)."""
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name].cpu(), state_b[name].cpu()), f"{name} differs"


def params_differ(model_a: nn.Module, model_b: nn.Module) -> bool:
    return any(not torch.equal(a.cpu(), b.cpu())
               for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))


# --- the hand-written reference loop ---------------------------------------------------------------------
def classifier_loss(model: nn.Module, batch, criterion) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return criterion(model(x), y)


def reference_fit(model: nn.Module, loader, optimizers: Sequence[torch.optim.Optimizer], criterion: Callable,
                  num_epochs: int = 0, num_iterations: int = 0, grad_accumulation: int = 1,
                  loss_fn: Callable = classifier_loss, device: Optional[torch.device] = None) -> dict:
    """Plain PyTorch training with gradient accumulation, written without the package.

    The optimizers step (and then zero their gradients) after every ``grad_accumulation`` batches, after
    the last batch of each epoch (a final window that does not divide), and at the batch where
    ``num_iterations`` batches in total have run. The model and every tensor of a batch are moved to
    ``device`` (default: :func:`default_device`); the optimizers must hold the model's parameters.

    Returns:
        ``{'epoch_losses': [mean batch loss per epoch], 'optimizer_steps': int, 'batches': int}``
    """
    device = device or default_device()
    model.to(device)  # in place: the optimizers keep their parameters
    model.train()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)

    def step():
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    try:
        num_batches: Optional[int] = len(loader)
    except TypeError:
        num_batches = None
    epoch_losses: List[float] = []
    optimizer_steps = batches = 0
    epoch = 0
    while (epoch < num_epochs) if num_epochs > 0 else (batches < num_iterations):
        losses = []
        batch_idx = -1
        limit_hit = False
        for batch_idx, batch in enumerate(loader):
            loss = loss_fn(model, [tensor.to(device) for tensor in batch], criterion)
            (loss / grad_accumulation if grad_accumulation > 1 else loss).backward()
            losses.append(loss.detach())
            batches += 1
            limit_hit = num_iterations > 0 and batches >= num_iterations
            last_batch = num_batches is not None and batch_idx + 1 == num_batches
            if (batch_idx + 1) % grad_accumulation == 0 or last_batch or limit_hit:
                step()
                optimizer_steps += 1
            if limit_hit:
                break
        if not limit_hit and num_batches is None and (batch_idx + 1) % grad_accumulation != 0:
            step()  # a loader without len: the last, partial window is known only after the loop
            optimizer_steps += 1
        epoch_losses.append(torch.stack(losses).mean().item())
        epoch += 1
    return {"epoch_losses": epoch_losses, "optimizer_steps": optimizer_steps, "batches": batches}


# --- callbacks ---------------------------------------------------------------------------------------------
class HookRecorder(AbstractCallback):
    """Appends ``(callback_name, hook, details)`` to a shared list for every hook TrainLoop calls."""

    def __init__(self, log: list, callback_name: str = "recorder", execution_order: int = 0,
                 device_idx_execution: Optional[int] = None):
        super().__init__(callback_name, execution_order, device_idx_execution)
        self.log = log

    def _record(self, hook: str, details=None) -> None:
        self.log.append((self.callback_name, hook, details))

    def on_train_loop_registration(self):
        self._record("on_train_loop_registration")

    def on_train_begin(self):
        self._record("on_train_begin")

    def on_train_end(self):
        self._record("on_train_end")

    def on_epoch_begin(self):
        self._record("on_epoch_begin", self.train_loop_obj.epoch)

    def on_epoch_end(self):
        self._record("on_epoch_end", self.train_loop_obj.epoch)

    def on_batch_begin(self):
        self._record("on_batch_begin", (self.train_loop_obj.iteration, self.train_loop_obj.total_iteration_idx))

    def on_batch_end(self):
        self._record("on_batch_end", (self.train_loop_obj.iteration, self.train_loop_obj.total_iteration_idx))

    def on_after_gradient_update(self, optimizer_idx):
        self._record("on_after_gradient_update", (optimizer_idx, self.train_loop_obj.optimizer_step_due))

    def on_after_optimizer_step(self):
        self._record("on_after_optimizer_step", self.train_loop_obj.iteration)

    def on_after_batch_prediction(self, y_pred_batch, y_test_batch, metadata_batch, dataset_info):
        self._record("on_after_batch_prediction", (len(y_pred_batch), dataset_info["type"]))


class StepCounter(AbstractCallback):
    """Counts optimizer steps and remembers the in-epoch iteration of each."""

    def __init__(self):
        super().__init__("step counter")
        self.step_iterations: List[tuple] = []

    def on_after_optimizer_step(self):
        self.step_iterations.append((self.train_loop_obj.epoch, self.train_loop_obj.iteration))


class TrainEndCounter(AbstractCallback):
    """Counts the train begins and ends a loop runs (a train end run again, or lost, shows in the counts)."""

    def __init__(self):
        super().__init__("train end counter")
        self.begins, self.ends = 0, 0

    def on_train_begin(self):
        self.begins += 1

    def on_train_end(self):
        self.ends += 1


def distinct_records(caplog) -> list:
    """``caplog.records`` with each record once: when a test lets the package logger propagate, some pytest versions
    deliver a record to the capturing handler twice (once through the named logger, once through the root)."""
    return list({id(record): record for record in caplog.records}.values())
