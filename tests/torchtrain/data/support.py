"""Data, models and loops shared by the data-order tests (samplers, persistent workers, sampler state).

The samples carry their index, and the model records the indices of every batch it trains on, so a test can say
exactly which samples a run trained in which order; noise drawn from the loading process's seed and the index makes
a batch loaded by another worker (or with another worker seed) differ in its values too.
"""
import io
import random
from typing import Callable, Iterator, List, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data

NUM_SAMPLES, BATCH_SIZE = 24, 4  # 6 batches an epoch


class IndexedSamples(Dataset):
    """Classification samples ``(x, y, index)``; ``x`` has noise drawn from the loading process's seed and the index
    (a common way of making augmentation reproducible), so it also tells which worker seed loaded it."""

    def __init__(self, num_samples: int = NUM_SAMPLES, worker_noise: bool = True):
        self.data = classification_data(num_samples)
        self.worker_noise = worker_noise

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        seed = torch.initial_seed() if get_worker_info() is not None and self.worker_noise else 0
        x, y = self.data[index]
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed((seed + index) % 2 ** 63))
        return x + 0.01 * noise, y, index


class BucketBatchSampler(Sampler[List[int]]):
    """Batches of neighbouring indices (a bucket of similar lengths), shuffled with the sampler's own
    ``random.Random``, as bucketing samplers for text do."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0):
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        indices = list(range(self.num_samples))
        self.rng.shuffle(indices)  # within the buckets...
        buckets = [sorted(indices[start:start + 2 * self.batch_size])
                   for start in range(0, self.num_samples, 2 * self.batch_size)]
        batches = [bucket[i:i + self.batch_size] for bucket in buckets for i in range(0, len(bucket), self.batch_size)]
        self.rng.shuffle(batches)  # ... and the batches
        return iter(batches)


class RecordingMLP(MLP):
    """Records the sample indices of every training batch it sees, in order."""

    def __init__(self):
        super().__init__()
        self.trained: List[List[int]] = []

    def get_loss(self, batch_data, criterion, device):
        if self.training:
            self.trained.append(batch_data[2].tolist())
        return super().get_loss(batch_data, criterion, device)


# The loops the current test made (see shut_down_workers).
_LOOPS: List[TrainLoop] = []


def make_loop(loader: DataLoader, seed: int = 0, model_class=None, **options) -> TrainLoop:
    """A TrainLoop over ``loader`` with a :class:`RecordingMLP` (dropout: the global RNG matters) and Adam."""
    torch.manual_seed(seed)
    model = (model_class or RecordingMLP)()
    tl = TrainLoop(model, loader, None, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                   nn.CrossEntropyLoss(), show_progress=False, end_auto_eval=False, **options)
    _LOOPS.append(tl)
    return tl


@pytest.fixture(autouse=True)
def shut_down_workers():
    """After each test, stop the persistent DataLoader workers of the loops it made. (Left to the garbage collector,
    which frees a TrainLoop as part of a reference cycle, their shutdown waits 5 s per worker for workers that never
    see the stop message: torch's own DataLoader iterator does the same.)"""
    yield
    for tl in _LOOPS:
        iterator = getattr(tl.train_loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
    _LOOPS.clear()


class SaveAt(AbstractCallback):
    """Keeps the checkpoint (as bytes: what a file holds) written after the run's ``after``-th batch; ``mid_epoch``
    False saves an epoch-end checkpoint at the end of the epoch that batch closes."""

    def __init__(self, after: int, mid_epoch: bool = True):
        super().__init__("save", execution_order=100)
        self.after, self.mid_epoch = after, mid_epoch
        self.saved: Optional[bytes] = None

    def _save(self) -> None:
        buffer = io.BytesIO()
        torch.save(self.train_loop_obj.checkpoint_state(mid_epoch=self.mid_epoch), buffer)
        self.saved = buffer.getvalue()

    def on_batch_end(self):
        if self.mid_epoch and self.train_loop_obj.total_iteration_idx + 1 == self.after:
            self._save()

    def on_epoch_end(self):
        if not self.mid_epoch and self.saved is None and self.train_loop_obj.total_iteration_idx + 1 >= self.after:
            self._save()

    def checkpoint(self) -> dict:
        return torch.load(io.BytesIO(self.saved), weights_only=True)


class CrashAt(AbstractCallback):
    """Raises once, after the run's ``after``-th batch."""

    def __init__(self, after: int):
        super().__init__("crash", execution_order=1000)
        self.after = after

    def on_batch_end(self):
        if self.after is not None and self.train_loop_obj.total_iteration_idx + 1 == self.after:
            self.after = None
            raise RuntimeError("simulated crash")


def assert_same_run(expected: TrainLoop, got: TrainLoop) -> None:
    """Bitwise the same weights and the same history."""
    for key, value in expected.model.state_dict().items():
        assert torch.equal(value, got.model.state_dict()[key]), f"parameter {key} differs"
    assert expected.train_history == got.train_history


def straight_and_resumed(build: Callable[[], TrainLoop], saver: SaveAt, num_epochs: int):
    """The straight run (saving with ``saver``) and a run resumed from that checkpoint in a fresh TrainLoop."""
    straight = build()
    straight.fit(num_epochs=num_epochs, callbacks=[saver])
    resumed = build()
    resumed.load_checkpoint(saver.checkpoint())
    resumed.fit(num_epochs=num_epochs)
    return straight, resumed
