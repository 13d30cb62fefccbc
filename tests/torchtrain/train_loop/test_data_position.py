"""A mid-epoch resume continues the epoch's data without loading the batches already trained on.

Every sample fetched is logged to a file (``__getitem__`` also runs in DataLoader worker processes), so the tests
count what a resume loads: nothing of the trained part of the epoch, for num_workers 0 and 2, after a mid-epoch
checkpoint and after an exception; and the resumed run stays bitwise the uninterrupted one. The samples carry the
loading worker's id and seed (and are perturbed by noise drawn from that seed), so equal batches also mean that the
same worker with the same seed loaded them. torchdata's StatefulDataLoader continues from its own saved state.
"""
import io
import random
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, DistributedSampler, IterableDataset, get_worker_info

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.data_position import epoch_without, resumed_epoch, skips_by_index
from aitoolbox.torchtrain.train_loop.train_state import capture_rng_state, restore_rng_state
from tests.helpers import MLP, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

NUM_SAMPLES, BATCH_SIZE = 24, 4  # 6 batches an epoch


class LoggedSamples(Dataset):
    """Classification samples ``(x, y, index, worker)``; each fetch appends its index to ``log``.

    ``x`` gets noise drawn from the loading process's seed and the index (a common way of making augmentation
    reproducible), and ``worker`` holds the worker's id and seed: -1 and 0 in the main process.
    """

    def __init__(self, log: Path, num_samples: int = NUM_SAMPLES):
        self.data = classification_data(num_samples)
        self.log = str(log)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        with open(self.log, "a") as log:
            log.write(f"{index}\n")
        info = get_worker_info()
        seed = torch.initial_seed()
        x, y = self.data[index]
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + index))
        worker = torch.tensor([-1 if info is None else info.id, 0 if info is None else info.seed])
        return x + 0.01 * noise, y, index, worker


def fetched(log: Path) -> List[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def rng_states_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(rng_states_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(rng_states_equal(x, y) for x, y in zip(a, b))
    return a == b


def batches_equal(expected, got) -> bool:
    return len(expected) == len(got) and all(
        all(torch.equal(x, y) for x, y in zip(one, other)) for one, other in zip(expected, got))


# --- the iterator itself -------------------------------------------------------------------------------------------
LOADERS = {
    "no-workers, loader generator": dict(num_workers=0, generator=True),
    "no-workers, global RNG": dict(num_workers=0, generator=False),
    "2 workers, loader generator": dict(num_workers=2, generator=True),
    "2 workers, global RNG": dict(num_workers=2, generator=False),
    "2 persistent workers": dict(num_workers=2, generator=True, persistent_workers=True),
    "3 workers, drop_last": dict(num_workers=3, generator=True, drop_last=True, batch_size=5),
    "distributed sampler": dict(num_workers=0, distributed=True),
    "distributed sampler, 2 workers": dict(num_workers=2, distributed=True),
}


def build_loader(dataset, num_workers=0, generator=True, distributed=False, batch_size=BATCH_SIZE, **options):
    if distributed:  # what the DDP strategy builds for rank 1 of 2, at its epoch 3
        sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
        sampler.set_epoch(3)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, **options)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(1) if generator else None, **options)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("batches_done", [1, 3])
@pytest.mark.parametrize("options", list(LOADERS.values()), ids=list(LOADERS))
def test_the_rest_of_the_epoch_without_fetching_the_trained_batches(tmp_path, options, batches_done):
    log = tmp_path / "fetched.txt"
    loader = build_loader(LoggedSamples(log), **options)
    assert skips_by_index(loader)
    torch.manual_seed(7)
    start = capture_rng_state(loader)

    # What skipping by loading (aitoolbox 1.8's way) gives: the batches, and the RNG state after the skipped part.
    iterator = iter(loader)
    trained = [next(iterator) for _ in range(batches_done)]
    rng_after_loading = capture_rng_state(loader)
    rest = list(iterator)

    loader = build_loader(LoggedSamples(log), **options)  # a new one: persistent workers would be reused
    restore_rng_state(start, loader)
    log.unlink()
    iterator = resumed_epoch(loader, batches_done)
    assert rng_states_equal(capture_rng_state(loader), rng_after_loading)  # the same draws, nothing fetched
    resumed = list(iterator)
    assert batches_equal(rest, resumed)
    trained_indices = {int(i) for batch in trained for i in batch[2]}
    assert sorted(fetched(log)) == sorted(int(i) for batch in rest for i in batch[2])
    assert not trained_indices & set(fetched(log))
    if options.get("num_workers"):  # batch i of the epoch comes from worker i % num_workers, as in a straight run
        assert [set(batch[3][:, 0].tolist()) for batch in resumed] == \
            [{i % options["num_workers"]} for i in range(batches_done, batches_done + len(resumed))]


class LoaderWithOwnState(DataLoader):
    """Iterates as DataLoader does, with a state of its own (saved by a mid-epoch checkpoint, if any)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("loader_class", [DataLoader, LoaderWithOwnState])
@pytest.mark.parametrize("start", [0, 2], ids=["from the epoch's start", "from batch 2"])
def test_a_batch_left_out_of_a_single_process_epoch_is_never_fetched(tmp_path, start, loader_class):
    """A batch a rollback left out (``epoch_without``) is passed over by its indices, as a loader that never yielded
    it: nothing fetched (a ``__getitem__`` that augments from the global RNG would draw for it), also when the epoch
    is replayed from its start, and for a loader with a state of its own when no state of it was saved. Written for
    the mutation run: from the start it was loaded and discarded."""
    log = tmp_path / "fetched.txt"
    loader = loader_class(LoggedSamples(log), batch_size=BATCH_SIZE, shuffle=True,
                          generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    epoch_start = capture_rng_state(loader)
    whole = list(loader)
    restore_rng_state(epoch_start, loader)
    log.unlink()
    kept = list(epoch_without(loader, start, [start + 1]))
    expected = whole[start:start + 1] + whole[start + 2:]
    assert batches_equal(expected, kept)
    assert sorted(fetched(log)) == sorted(int(i) for batch in expected for i in batch[2])


def test_persistent_workers_go_on_to_the_next_epoch_as_without_a_resume(tmp_path):
    """The resumed epoch's iterator keeps the workers for the next epochs, which are not skipped."""
    def two_epochs(resume_at):
        loader = build_loader(LoggedSamples(tmp_path / f"log{resume_at}.txt"), num_workers=2, persistent_workers=True)
        torch.manual_seed(3)
        first = list(resumed_epoch(loader, resume_at))
        return first, list(loader)

    first, second = two_epochs(0)
    first_resumed, second_resumed = two_epochs(2)
    assert batches_equal(first[2:], first_resumed)
    assert batches_equal(second, second_resumed) and len(second) == NUM_SAMPLES // BATCH_SIZE


class Stream(IterableDataset):
    def __init__(self, log: Path):
        self.log = log

    def __iter__(self):
        for index in range(NUM_SAMPLES):
            with open(self.log, "a") as log:
                log.write(f"{index}\n")
            yield torch.tensor([index])


def test_an_iterable_dataset_is_skipped_by_reading_it(tmp_path):
    log = tmp_path / "fetched.txt"
    loader = DataLoader(Stream(log), batch_size=BATCH_SIZE)
    assert not skips_by_index(loader)
    rest = list(resumed_epoch(loader, 2))
    assert [int(batch[0]) for batch in rest] == list(range(2 * BATCH_SIZE, NUM_SAMPLES, BATCH_SIZE))
    assert fetched(log) == list(range(NUM_SAMPLES))  # what an IterableDataset costs: the skipped part is read


# --- in a TrainLoop ----------------------------------------------------------------------------------------------------
class SaveAt(AbstractCallback):
    """A mid-epoch checkpoint (as bytes) after ``after`` batches of the run."""

    def __init__(self, after: int):
        super().__init__("save", execution_order=100)
        self.after = after
        self.saved = None

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.after:
            buffer = io.BytesIO()
            torch.save(self.train_loop_obj.checkpoint_state(mid_epoch=True), buffer)
            self.saved = buffer.getvalue()


class CrashAt(AbstractCallback):
    def __init__(self, after: int):
        super().__init__("crash", execution_order=1000)
        self.after = after

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.after:
            self.after = None
            raise RuntimeError("simulated crash")


class RecordingMLP(MLP):
    """Records the indices of the samples of every batch it trains on."""

    def __init__(self):
        super().__init__()
        self.trained: List[List[int]] = []

    def get_loss(self, batch_data, criterion, device):
        self.trained.append(batch_data[2].tolist())
        return super().get_loss(batch_data, criterion, device)


def assert_resumes_3_batches_into_epoch_1_as_straight(loop, tmp_path) -> None:
    """``loop(log_path)`` fitted 3 epochs straight, and resumed from its mid-epoch checkpoint 3 batches into epoch 1:
    the resumed run trains the straight run's remaining batches, bitwise the same run."""
    saver = SaveAt(9)
    straight = loop(tmp_path / "straight.txt")
    straight.fit(num_epochs=3, callbacks=[saver])
    resumed = loop(tmp_path / "resumed.txt")
    resumed.load_checkpoint(torch.load(io.BytesIO(saver.saved), weights_only=True))
    resumed.fit(num_epochs=3)
    assert resumed.model.trained == straight.model.trained[9:]
    assert_same_run(straight, resumed)


def samples_of(batches: List[List[int]]) -> List[int]:
    return sorted(index for batch in batches for index in batch)


def train_loop(log: Path, num_workers: int, loader_class=DataLoader) -> TrainLoop:
    torch.manual_seed(0)
    model = RecordingMLP()
    train = loader_class(LoggedSamples(log), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                         generator=torch.Generator().manual_seed(1))
    return TrainLoop(model, train, None, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                     nn.CrossEntropyLoss(), show_progress=False, end_auto_eval=False)


def assert_same_run(expected: TrainLoop, got: TrainLoop):
    for key, value in expected.model.state_dict().items():
        assert torch.equal(value, got.model.state_dict()[key]), f"parameter {key} differs"
    assert expected.train_history == got.train_history


def resume_from_a_mid_epoch_checkpoint(tmp_path: Path, num_workers: int, loader_class=DataLoader,
                                       saved_after: int = 9):
    """The straight run (saving after ``saved_after`` batches: 9 is 3 into epoch 1) and the run resumed from that
    checkpoint in a new TrainLoop; what each fetched in epoch 1."""
    saver = SaveAt(saved_after)
    straight = train_loop(tmp_path / "straight.txt", num_workers, loader_class)
    straight.fit(num_epochs=2, callbacks=[saver])
    checkpoint = torch.load(io.BytesIO(saver.saved), weights_only=True)
    resumed = train_loop(tmp_path / "resumed.txt", num_workers, loader_class)
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=2)
    return straight, resumed, checkpoint


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_a_mid_epoch_checkpoint_fetches_only_the_rest_and_is_bitwise(tmp_path, num_workers):
    straight, resumed, checkpoint = resume_from_a_mid_epoch_checkpoint(tmp_path, num_workers)
    assert checkpoint["iteration"] == 3 and "train_loader_state" not in checkpoint
    assert_same_run(straight, resumed)
    assert resumed.model.trained == straight.model.trained[9:]
    # Only the 3 remaining batches of epoch 1 (none of the 12 samples its first 3 batches trained on).
    assert sorted(fetched(tmp_path / "resumed.txt")) == samples_of(straight.model.trained[9:])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fit_after_an_exception_fetches_only_the_rest_of_the_epoch(tmp_path, num_workers):
    straight = train_loop(tmp_path / "straight.txt", num_workers)
    straight.fit(num_epochs=2)
    log = tmp_path / "crashed.txt"
    crashed = train_loop(log, num_workers)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(num_epochs=2, callbacks=[CrashAt(8)])  # 2 batches into epoch 1
    log.unlink()
    crashed.fit(num_epochs=2)
    assert_same_run(straight, crashed)
    assert sorted(fetched(log)) == samples_of(straight.model.trained[8:])


# --- torchdata's StatefulDataLoader ------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on a newer torch
@pytest.mark.parametrize("num_workers, saved_after", [(0, 9), (2, 9), (0, 7)])
def test_a_stateful_data_loader_continues_from_its_saved_state(tmp_path, num_workers, saved_after):
    """Also one batch into the epoch (7), where its state is as much the position as later (the mutation run: a
    resume after one batch loaded and discarded it)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    straight, resumed, checkpoint = resume_from_a_mid_epoch_checkpoint(
        tmp_path, num_workers, stateful_dataloader.StatefulDataLoader, saved_after)
    assert len(checkpoint["train_loader_state"]) == 1  # one process; it loaded with weights_only=True
    assert_same_run(straight, resumed)
    assert resumed.model.trained == straight.model.trained[saved_after:]
    assert sorted(fetched(tmp_path / "resumed.txt")) == samples_of(straight.model.trained[saved_after:])


class OwnRandomBuckets:
    """A bucketing batch sampler shuffling with its own ``random.Random`` in ``__iter__`` (no state_dict)."""

    def __init__(self, num_samples: int = NUM_SAMPLES, batch_size: int = BATCH_SIZE):
        self.num_samples, self.batch_size, self.rng = num_samples, batch_size, random.Random(0)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def __iter__(self):
        order = list(range(self.num_samples))
        self.rng.shuffle(order)
        return iter([order[start:start + self.batch_size] for start in range(0, self.num_samples, self.batch_size)])


class NumpyShuffled:
    """A sampler drawing from a numpy Generator of its own, lazily (a generator function)."""

    def __init__(self, num_samples: int = NUM_SAMPLES):
        self.num_samples, self.rng = num_samples, np.random.default_rng(3)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        yield from (int(index) for index in self.rng.permutation(self.num_samples))


class GlobalShuffled:
    """A sampler shuffling in ``__iter__`` with Python's global ``random`` (``module="python"``) or numpy's global
    state (``"numpy"``)."""

    def __init__(self, module: str, num_samples: int = NUM_SAMPLES):
        self.shuffle = random.shuffle if module == "python" else np.random.shuffle
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        order = list(range(self.num_samples))
        self.shuffle(order)
        return iter(order)


class GlobalShuffledBatches(GlobalShuffled):
    """A batch sampler of :class:`GlobalShuffled`'s order (Python's or numpy's global state)."""

    def __len__(self) -> int:
        return -(-self.num_samples // BATCH_SIZE)

    def __iter__(self):
        order = list(super().__iter__())
        return iter([order[start:start + BATCH_SIZE] for start in range(0, self.num_samples, BATCH_SIZE)])


def _foreign_sampler_loader(loader_class, log: Path, kind: str, num_workers: int):
    dataset = LoggedSamples(log)
    if kind == "batch_sampler":
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
        return loader_class(dataset, batch_sampler=BatchSampler(sampler, BATCH_SIZE, False), num_workers=num_workers)
    if kind == "buckets":
        return loader_class(dataset, batch_sampler=OwnRandomBuckets(), num_workers=num_workers)
    if kind in ("python global batches", "numpy global batches"):
        return loader_class(dataset, batch_sampler=GlobalShuffledBatches(kind.split()[0]), num_workers=num_workers)
    if kind in ("python global", "numpy global"):
        return loader_class(dataset, sampler=GlobalShuffled(kind.split()[0]), batch_size=BATCH_SIZE,
                            num_workers=num_workers)
    return loader_class(dataset, sampler=NumpyShuffled(), batch_size=BATCH_SIZE, num_workers=num_workers)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["batch_sampler", "buckets", "numpy", "python global batches", "numpy global batches",
                                  "python global", "numpy global"])
def test_a_stateful_data_loader_with_a_sampler_of_its_users_resumes_bitwise(tmp_path, kind, num_workers):
    """Issue 33 (review D1): a StatefulDataLoader fast-forwards a sampler without a state of its own by iterating
    it again, which drew the rest of the epoch from another shuffle (the iterator had iterated it once already,
    and a lazy sampler drew only after the saved random state was put back). A sampler shuffling with Python's or
    numpy's global state is fast-forwarded from the state its epoch began with too, also inside torchdata's own
    BatchSampler (found by the mutation run; every kind of random state: test_stateful_loader_samplers.py)."""
    if num_workers and kind != "buckets":
        pytest.skip("one multi-process case is enough for the quick tier")
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def loop(log):
        torch.manual_seed(0)
        model = RecordingMLP()
        loader = _foreign_sampler_loader(stateful_dataloader.StatefulDataLoader, log, kind, num_workers)
        return TrainLoop(model, loader, None, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                         nn.CrossEntropyLoss(), show_progress=False, end_auto_eval=False)

    assert_resumes_3_batches_into_epoch_1_as_straight(loop, tmp_path)


class OwnRandomBucketsReportingState(OwnRandomBuckets):
    """:class:`OwnRandomBuckets` with a ``state_dict`` but no ``load_state_dict``: a state it cannot be given back,
    so the loader fast-forwards it as a sampler without state (torchdata asks for both)."""

    def state_dict(self) -> dict:
        return {"num_samples": self.num_samples}


class TorchGeneratorBuckets:
    """A batch sampler drawing the epoch's whole order from a torch generator of its own (its ``generator``) when
    ``__iter__`` is called, not at the first batch."""

    def __init__(self, num_samples: int = NUM_SAMPLES):
        self.num_samples, self.generator = num_samples, torch.Generator().manual_seed(11)

    def __len__(self) -> int:
        return -(-self.num_samples // BATCH_SIZE)

    def __iter__(self):
        order = torch.randperm(self.num_samples, generator=self.generator).tolist()
        return iter([order[start:start + BATCH_SIZE] for start in range(0, self.num_samples, BATCH_SIZE)])


class TorchGeneratorShuffled(TorchGeneratorBuckets):
    """:class:`TorchGeneratorBuckets`'s order as a sampler of indices (the loader batches it)."""

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        return iter(torch.randperm(self.num_samples, generator=self.generator).tolist())


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", [
    "buckets with state_dict only", "torch generator batches",
    # slow: its persistent workers take some 20 s to shut down
    pytest.param("buckets, persistent workers", marks=pytest.mark.slow),
    "torch generator"])  # both failed before the sampler replay (mut47's defects 2 and 3)
def test_a_stateful_data_loader_fast_forwards_a_sampler_from_the_state_its_epoch_began_with(tmp_path, kind):
    """The samplers the test above leaves out: one with a ``state_dict`` alone (it is not put back, so it is drawn
    again like one without state), and one drawing its order at once in ``__iter__`` from its own torch generator
    (the fast-forward's draw must start from that generator's state at the epoch's start, not after the iterator's
    first draw); and with persistent workers, the next epoch, which resets the resumed epoch's iterator (the
    fast-forward must not be replayed there). Written for the mutation run (mut47: these survived)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def loop(log):
        torch.manual_seed(0)
        model = RecordingMLP()
        dataset = LoggedSamples(log)
        if kind == "buckets with state_dict only":
            loader = stateful_dataloader.StatefulDataLoader(dataset, batch_sampler=OwnRandomBucketsReportingState())
        elif kind == "torch generator batches":
            loader = stateful_dataloader.StatefulDataLoader(dataset, batch_sampler=TorchGeneratorBuckets())
        elif kind == "buckets, persistent workers":  # the resumed epoch's iterator is reset for the next epoch
            loader = stateful_dataloader.StatefulDataLoader(dataset, batch_sampler=OwnRandomBuckets(), num_workers=2,
                                                            persistent_workers=True)
        else:
            loader = stateful_dataloader.StatefulDataLoader(dataset, sampler=TorchGeneratorShuffled(),
                                                            batch_size=BATCH_SIZE)
        return TrainLoop(model, loader, None, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                         nn.CrossEntropyLoss(), show_progress=False, end_auto_eval=False)

    assert_resumes_3_batches_into_epoch_1_as_straight(loop, tmp_path)


def test_a_stateful_data_loaders_persistent_iterator_resumed_mid_epoch_draws_the_next_epochs_order_anew(tmp_path):
    """The data-level half of the slow case above, fast: a StatefulDataLoader with persistent workers resumed
    3 batches into its first epoch from its own state, its batch sampler shuffling with its own ``random.Random``.
    The next epoch resets the resumed iterator, which iterates the sampler once more: that iteration draws the next
    epoch's order as the uninterrupted loader's did, not the resumed epoch's again (the sampler's stand-in, which
    draws from the epoch's starting random state while the resumed iterator is built, passes through after that),
    and the loader holds the user's batch sampler again (mut48: the stand-in's disarming and the put-back survived)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def loader(log):
        torch.manual_seed(3)  # the base seed the iterator of the epoch draws
        return stateful_dataloader.StatefulDataLoader(LoggedSamples(log), batch_sampler=OwnRandomBuckets(),
                                                      num_workers=1, persistent_workers=True)

    straight = loader(tmp_path / "straight.txt")
    first_epoch = iter(straight)
    trained = [next(first_epoch) for _ in range(3)]
    saved = straight.state_dict()
    first = trained + list(first_epoch)
    second = list(straight)
    assert not batches_equal(first, second)  # each epoch its own order

    resumed = loader(tmp_path / "resumed.txt")  # its sampler's random state is the epoch's start
    users_sampler = resumed.batch_sampler
    first_resumed = list(resumed_epoch(resumed, 3, saved))
    assert resumed.batch_sampler is users_sampler  # the user's own object again (isinstance checks, identity)
    second_resumed = list(resumed)
    for persisting in (straight, resumed):  # now, not at the interpreter's exit (some 15 s there)
        persisting._iterator._shutdown_workers()
    assert batches_equal(first[3:], first_resumed)
    assert batches_equal(second, second_resumed)


def test_a_stateful_data_loaders_persistent_iterator_resumed_in_a_reset_epoch_goes_on_as_the_reset_one(tmp_path):
    """As above, resumed 3 batches into the second epoch, whose order the uninterrupted loader drew by resetting its
    persistent iterator (one iteration of the sampler, no new base seed): the resumed loader's new iterator tells
    that from the saved base seed and draws the epoch's order from the epoch's starting random states as the reset
    did; the third epoch follows as the uninterrupted one. Written for the mutation run (mut48: the base seed
    check survived)."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def loader(log):
        torch.manual_seed(3)
        return stateful_dataloader.StatefulDataLoader(LoggedSamples(log), batch_sampler=OwnRandomBuckets(),
                                                      num_workers=1, persistent_workers=True)

    straight = loader(tmp_path / "straight.txt")
    list(straight)
    epoch_start = capture_rng_state(straight)
    second_epoch = iter(straight)
    trained = [next(second_epoch) for _ in range(3)]
    saved = straight.state_dict()
    second = trained + list(second_epoch)
    third = list(straight)

    resumed = loader(tmp_path / "resumed.txt")
    restore_rng_state(epoch_start, resumed)  # as the loop does before resuming the epoch
    second_resumed = list(resumed_epoch(resumed, 3, saved))
    third_resumed = list(resumed)
    for persisting in (straight, resumed):  # now, not at the interpreter's exit
        persisting._iterator._shutdown_workers()
    assert batches_equal(second[3:], second_resumed)
    assert batches_equal(third, third_resumed)


def test_the_capture_with_the_loaders_generators_handed_in_is_the_capture_that_looks_them_up():
    """An epoch's start hands the loader's generators it holds to the capture (its samplers not walked twice): the
    same state, the samplers' own random states included."""
    from aitoolbox.torchtrain.data.sampler_state import loader_generators

    class OwnRngSampler(RandomSampler):
        def __init__(self, data):
            super().__init__(data, generator=torch.Generator().manual_seed(1))
            self.rng = np.random.RandomState(2)

    data = classification_data(12)
    loader = DataLoader(data, batch_size=4, sampler=OwnRngSampler(data), generator=torch.Generator().manual_seed(3))
    handed = capture_rng_state(loader, loader_generators(loader))
    looked_up = capture_rng_state(loader)
    assert len(handed["loader_generators"]) == 2 and "samplers" in handed
    assert rng_states_equal(handed, looked_up)
