"""Samplers that keep their own random state (bucketing samplers with a ``random.Random``, numpy generators): a
resumed run draws the epoch's order again from the state the sampler had at the epoch's start, through the sampler's
``state_dict()`` / ``load_state_dict()`` when it has them, else through its random-number-generator attributes; a
state that cannot be saved is named in a warning (issue 33, item 3)."""
import random
import warnings
from typing import Iterator, List

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from aitoolbox.torchtrain.data.sampler_state import capture_sampler_states, restore_sampler_states
from tests.helpers import single_torch_thread
from tests.torchtrain.data.support import (  # noqa: F401 (shut_down_workers: an autouse fixture)
    BATCH_SIZE, NUM_SAMPLES, BucketBatchSampler, IndexedSamples, SaveAt, assert_same_run, make_loop,
    shut_down_workers, straight_and_resumed)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


class NumpySampler(Sampler[int]):
    """A permutation from the sampler's own numpy Generator, drawn lazily, an index at a time."""

    def __init__(self, num_samples: int, seed: int = 0):
        self.num_samples = num_samples
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        remaining = list(range(self.num_samples))
        while remaining:
            yield remaining.pop(int(self.rng.integers(len(remaining))))


class LegacyNumpySampler(NumpySampler):
    def __init__(self, num_samples: int, seed: int = 0):
        super().__init__(num_samples)
        self.rng = np.random.RandomState(seed)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.permutation(self.num_samples).tolist())


class HiddenStateSampler(Sampler[int]):
    """Its random state is out of reach (inside a closure); ``state_dict`` / ``load_state_dict`` expose it."""

    def __init__(self, num_samples: int, seed: int = 0):
        self.num_samples = num_samples
        rng = random.Random(seed)
        self._draw = lambda: rng.sample(range(num_samples), num_samples)
        self._get, self._set = rng.getstate, rng.setstate
        self.loaded = 0

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self._draw())

    def state_dict(self) -> dict:
        return {"rng": self._get()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded += 1
        self._set(state["rng"])


class SystemRandomSampler(Sampler[int]):
    def __init__(self, num_samples: int):
        self.num_samples = num_samples
        self.rng = random.SystemRandom()

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.sample(range(self.num_samples), self.num_samples))


class ListOfGenerators(SystemRandomSampler):
    def __init__(self, num_samples: int):
        super().__init__(num_samples)
        self.rng = [random.Random(0)]  # (draws from none of them: only the warning matters here)


SAMPLERS = {
    "bucketing batch sampler with random.Random": lambda: dict(batch_sampler=BucketBatchSampler(NUM_SAMPLES, BATCH_SIZE)),
    "numpy Generator, lazy, 2 workers": lambda: dict(sampler=NumpySampler(NUM_SAMPLES), batch_size=BATCH_SIZE,
                                                     num_workers=2),
    "numpy RandomState": lambda: dict(sampler=LegacyNumpySampler(NUM_SAMPLES), batch_size=BATCH_SIZE),
    "state_dict of its own": lambda: dict(sampler=HiddenStateSampler(NUM_SAMPLES), batch_size=BATCH_SIZE),
}


@pytest.mark.parametrize("after, mid_epoch", [(8, True), (6, False)], ids=["mid-epoch 1", "end of epoch 0"])
@pytest.mark.parametrize("make", list(SAMPLERS.values()), ids=list(SAMPLERS))
def test_a_resumed_run_trains_the_samples_of_the_straight_run(make, after, mid_epoch):
    saver = SaveAt(after, mid_epoch=mid_epoch)
    straight, resumed = straight_and_resumed(lambda: make_loop(DataLoader(IndexedSamples(), **make())), saver,
                                             num_epochs=3)
    assert resumed.model.trained == straight.model.trained[after:]
    assert_same_run(straight, resumed)


def test_the_sampler_s_own_state_dict_is_used():
    loader = DataLoader(IndexedSamples(), sampler=HiddenStateSampler(NUM_SAMPLES), batch_size=BATCH_SIZE)
    saved = capture_sampler_states(loader)
    first = list(loader.sampler)
    restore_sampler_states(loader, saved)
    assert loader.sampler.loaded == 1 and list(loader.sampler) == first


@pytest.mark.parametrize("sampler, reason", [(SystemRandomSampler(8), "SystemRandom"),
                                             (ListOfGenerators(8), "inside")], ids=["SystemRandom", "in a list"])
def test_an_own_random_state_that_cannot_be_saved_is_named_in_a_warning(sampler, reason):
    loader = DataLoader(range(8), sampler=sampler, batch_size=2)
    with pytest.warns(UserWarning, match=f"{type(sampler).__name__}.*{reason}"):
        capture_sampler_states(loader)


def test_samplers_without_an_own_random_state_save_nothing_and_warn_nothing():
    loader = DataLoader(range(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capture_sampler_states(loader) == {}  # the generator is saved as one of the loader's generators


def test_the_states_load_with_weights_only():
    import io
    loader = DataLoader(range(8), batch_sampler=BucketBatchSampler(8, 2))
    others = [DataLoader(range(8), sampler=NumpySampler(8), batch_size=2),
              DataLoader(range(8), sampler=LegacyNumpySampler(8), batch_size=2)]
    for each in [loader] + others:
        buffer = io.BytesIO()
        torch.save(capture_sampler_states(each), buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        first = list(each.batch_sampler)
        restore_sampler_states(each, saved)
        assert list(each.batch_sampler) == first


@pytest.mark.parametrize("planted", [
    lambda rng: {"attributes": {"__class__": "planted", "data_source": [1, 2, 3]}},  # a shared class, the dataset
    lambda rng: {"attributes": {"rng": rng, "num_samples": 5}},  # the real generator and another attribute
    lambda rng: {"state_dict": {}},  # a kind this sampler's capture never writes
    lambda rng: {"attributes": ["rng"]},
], ids=["dunder_and_dataset", "other_attribute", "other_kind", "not_a_dict"])
def test_a_saved_state_restores_only_the_generators_the_sampler_owns(planted):
    sampler = NumpySampler(NUM_SAMPLES)
    loader = DataLoader(IndexedSamples(NUM_SAMPLES), sampler=sampler, batch_size=BATCH_SIZE)
    (key, captured), = capture_sampler_states(loader).items()
    rng_state = dict(sampler.rng.bit_generator.state)
    with pytest.raises(ValueError, match=key):
        restore_sampler_states(loader, {key: planted(captured["attributes"]["rng"])})
    assert sampler.num_samples == NUM_SAMPLES and sampler.rng.bit_generator.state == rng_state
    assert not hasattr(type(sampler), "state") and not hasattr(torch.utils.data.SequentialSampler, "state")
    assert not hasattr(loader.dataset, "state")
