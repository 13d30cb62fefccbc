"""A training loader with ``persistent_workers=True`` keeps one iterator for the whole run: only the first epoch's
``iter(loader)`` draws the base seed of the workers, the later epochs reset that iterator and draw nothing. A run that
continues (from a checkpoint, after an exception, after ``lr_find`` or a SpikeRollback rollback) must iterate as the
uninterrupted run's persistent iterator would: the same draws, the same worker seeds, the same samples (issue 33,
item 2)."""
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from aitoolbox.torchtrain.callbacks import SpikeRollback
from aitoolbox.torchtrain.train_loop.data_position import resumed_epoch
from aitoolbox.torchtrain.train_loop.train_state import capture_rng_state, restore_rng_state
from tests.helpers import assert_params_equal, single_torch_thread
from tests.torchtrain.data.support import (  # noqa: F401 (shut_down_workers: an autouse fixture)
    BATCH_SIZE, NUM_SAMPLES, CrashAt, IndexedSamples, RecordingMLP, SaveAt, assert_same_run, make_loop,
    shut_down_workers, straight_and_resumed)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

BATCHES = NUM_SAMPLES // BATCH_SIZE  # per epoch


def persistent_loader(generator: bool = True, num_workers: int = 2) -> DataLoader:
    """Shuffling with the loader's generator (the base seed and the permutation both draw from it) or, without one,
    from the global RNG (which the dropout masks draw from too)."""
    return DataLoader(IndexedSamples(), batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers,
                      persistent_workers=True, generator=torch.Generator().manual_seed(1) if generator else None)


def build(generator: bool = True):
    return lambda: make_loop(persistent_loader(generator))


@pytest.mark.parametrize("generator", [True, False], ids=["loader generator", "global RNG"])
@pytest.mark.parametrize("after, mid_epoch", [(9, True), (BATCHES, False), (2 * BATCHES + 1, True)],
                         ids=["mid-epoch 1", "end of epoch 0", "mid-epoch 2"])
def test_a_resumed_run_trains_the_samples_of_the_straight_run(generator, after, mid_epoch):
    saver = SaveAt(after, mid_epoch=mid_epoch)
    straight, resumed = straight_and_resumed(build(generator), saver, num_epochs=3)
    assert resumed.model.trained == straight.model.trained[after:]
    assert_same_run(straight, resumed)


def test_fit_after_an_exception_goes_on_as_the_straight_run():
    straight = build()()
    straight.fit(num_epochs=3)
    crashed = build()()
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(num_epochs=3, callbacks=[CrashAt(3)])  # inside epoch 0, where the straight run drew the seed
    crashed.fit(num_epochs=3)
    assert sum(crashed.model.trained[3:], []) != [] and crashed.model.trained[:3] == straight.model.trained[:3]
    assert crashed.model.trained[3:] == straight.model.trained[3:]
    assert_same_run(straight, crashed)


def test_two_fits_equal_one():
    one = build()()
    one.fit(num_epochs=3)
    two = build()()
    two.fit(num_epochs=1)
    two.fit(num_epochs=3)
    assert two.model.trained == one.model.trained
    assert_same_run(one, two)


@pytest.mark.parametrize("generator", [True, False], ids=["loader generator", "global RNG"])
def test_fit_after_lr_find_is_bitwise_fit_alone(generator):
    alone = build(generator)()
    alone.fit(num_epochs=2)
    searched = build(generator)()
    searched.lr_find(num_iterations=8)  # more than an epoch: the search made the persistent iterator
    searched.model.trained.clear()
    searched.fit(num_epochs=2)
    assert searched.model.trained == alone.model.trained
    assert_same_run(alone, searched)


class SpikingMLP(RecordingMLP):
    """Its loss on the batch of samples ``spiking`` is huge (through the model: the persistent workers hold their own
    copy of the data set)."""

    spiking = None

    def get_loss(self, batch_data, criterion, device):
        loss = super().get_loss(batch_data, criterion, device)
        return loss * 1e4 if batch_data[2].tolist() == self.spiking else loss


class LeavingOut(BatchSampler):
    """The batches of :func:`persistent_loader`'s sampler (same generator, same permutations), without the one at
    ``position`` of ``epoch``."""

    def __init__(self, generator, epoch: int, position: int):
        super().__init__(RandomSampler(range(NUM_SAMPLES), generator=generator), BATCH_SIZE, False)
        self.epoch, self.position, self.epochs_started = epoch, position, 0

    def __len__(self):  # the loop reads the length before each epoch's iteration
        return super().__len__() - (self.epochs_started == self.epoch)

    def __iter__(self):
        epoch, self.epochs_started = self.epochs_started, self.epochs_started + 1
        for position, batch in enumerate(super().__iter__()):
            if (epoch, position) != (self.epoch, self.position):
                yield batch


@pytest.mark.parametrize("epoch", [0, 1], ids=["spike in epoch 0", "spike in epoch 1"])
def test_a_rollback_with_persistent_workers_equals_the_run_without_the_batch(epoch):
    """SpikeRollback's guarantee with persistent workers: the run ends bitwise as the run whose (persistent) loader
    never yielded the spiking batch, having trained that run's batches after the replay."""
    def data() -> IndexedSamples:
        return IndexedSamples(worker_noise=False)  # a left-out batch shifts which worker loads the next ones

    clean = make_loop(DataLoader(data(), batch_size=BATCH_SIZE, shuffle=True, num_workers=2, persistent_workers=True,
                                 generator=torch.Generator().manual_seed(1)))
    clean.fit(num_epochs=3)
    spiking_batch = clean.model.trained[epoch * BATCHES + 4]

    rolled = make_loop(DataLoader(data(), batch_size=BATCH_SIZE, shuffle=True, num_workers=2, persistent_workers=True,
                                  generator=torch.Generator().manual_seed(1)), model_class=SpikingMLP)
    rolled.model.spiking = spiking_batch
    rolled.fit(num_epochs=3, callbacks=[SpikeRollback(factor=10.0, window=3, warmup=2, snapshot_every=2)])
    assert len(rolled.rollbacks) == 1 and rolled.rollbacks[0]["epoch"] == epoch

    generator = torch.Generator().manual_seed(1)
    reference = make_loop(DataLoader(data(), batch_sampler=LeavingOut(generator, epoch, 4), generator=generator,
                                     num_workers=2, persistent_workers=True))
    reference.fit(num_epochs=3)
    assert spiking_batch not in reference.model.trained
    restored = rolled.rollbacks[0]["restored"]  # the last batch trained before the point the run went back to
    kept = restored["epoch"] * BATCHES + restored["iteration"] + 1
    assert kept <= epoch * BATCHES + 4
    replayed = len(reference.model.trained) - kept
    assert rolled.model.trained[:kept] == reference.model.trained[:kept]
    assert rolled.model.trained[-replayed:] == reference.model.trained[kept:]
    assert_params_equal(reference.model, rolled.model)
    assert reference.train_history["accumulated_loss"] == rolled.train_history["accumulated_loss"]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_the_iterator_state_travels_with_the_rng_state(num_workers):
    """What a checkpoint's RNG state says about the persistent iterator makes a fresh loader iterate as the loader
    it was captured from: no base seed drawn, the same worker seed. One worker persists as several do (the mutation
    run: a loader with one worker counted as one without persisting workers)."""
    straight = persistent_loader(num_workers=num_workers)
    torch.manual_seed(3)
    list(straight)  # epoch 0 starts the workers
    state = capture_rng_state(straight)
    second_epoch = list(straight)

    fresh = persistent_loader(num_workers=num_workers)
    restore_rng_state(state, fresh)
    got = list(resumed_epoch(fresh, 0))
    assert all(torch.equal(a, b) for one, other in zip(second_epoch, got) for a, b in zip(one, other))
    assert fresh._iterator._base_seed == straight._iterator._base_seed
