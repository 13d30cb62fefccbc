"""Samplers that keep their own random state (bucketing samplers with a ``random.Random``, numpy generators): a
resumed run draws the epoch's order again from the state the sampler had at the epoch's start, through the sampler's
``state_dict()`` / ``load_state_dict()`` when it has them, else through its random-number-generator attributes; a
state that cannot be saved is named in a warning (issue 33, item 3)."""
import random
import types
import warnings
from typing import Iterator, List

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

from aitoolbox.torchtrain.data.sampler_state import capture_sampler_states, restore_sampler_states, sampler_draw_states
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


class FourDown(SystemRandomSampler):
    """Its ``random.Random`` four attributes down (``self.a.b.c.rng``): beyond the depth states are saved from."""

    def __init__(self, num_samples: int):
        super().__init__(num_samples)
        self.rng = None
        self.a = types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(rng=random.Random(0))))


class NestedRandomSampler(Sampler[int]):
    """Its ``random.Random`` one object down (``self.cfg.rng``), the config holding a cycle back to the sampler."""

    def __init__(self, num_samples: int, rng: random.Random = None):
        self.num_samples = num_samples
        self.cfg = types.SimpleNamespace(rng=rng if rng is not None else random.Random(0), owner=self, module=random)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self.cfg.rng.sample(range(self.num_samples), self.num_samples))


class WrappedAsBase(Sampler[int]):
    """A wrapper holding its inner sampler as ``.base`` (not ``.sampler``: the loader's chain does not reach it)."""

    def __init__(self, base: Sampler):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[int]:
        return iter(self.base)


class TwoSources(Sampler[int]):
    """A mixer over two RandomSamplers drawing from generators of their own."""

    def __init__(self, num_samples: int):
        half = num_samples // 2
        self.first = RandomSampler(range(half), generator=torch.Generator().manual_seed(1))
        self.second = RandomSampler(range(num_samples - half), generator=torch.Generator().manual_seed(2))
        self.half = half

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.first) + [self.half + index for index in self.second])


SAMPLERS = {
    "bucketing batch sampler with random.Random": lambda: dict(batch_sampler=BucketBatchSampler(NUM_SAMPLES, BATCH_SIZE)),
    "numpy Generator, lazy, 2 workers": lambda: dict(sampler=NumpySampler(NUM_SAMPLES), batch_size=BATCH_SIZE,
                                                     num_workers=2),
    "numpy RandomState": lambda: dict(sampler=LegacyNumpySampler(NUM_SAMPLES), batch_size=BATCH_SIZE),
    "state_dict of its own": lambda: dict(sampler=HiddenStateSampler(NUM_SAMPLES), batch_size=BATCH_SIZE),
    # Random states one object down (review of issue 33, D3): found through the sampler's attributes.
    "random.Random at cfg.rng": lambda: dict(sampler=NestedRandomSampler(NUM_SAMPLES), batch_size=BATCH_SIZE),
    "wrapper's base.rng (numpy)": lambda: dict(sampler=WrappedAsBase(NumpySampler(NUM_SAMPLES)),
                                                     batch_size=BATCH_SIZE),
    "two torch generators, first/second": lambda: dict(sampler=TwoSources(NUM_SAMPLES), batch_size=BATCH_SIZE),
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
                                             (ListOfGenerators(8), "inside"),
                                             (FourDown(8), "'a.b.c.rng' is a random number generator more than 3")],
                         ids=["SystemRandom", "in a list", "four attributes down"])
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


def test_random_states_one_object_down_are_keyed_by_their_path_and_cycles_end():
    """The loop never looks into a module (``random``'s attributes hold the global generator)."""
    loader = DataLoader(range(8), sampler=WrappedAsBase(NestedRandomSampler(8)), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = capture_sampler_states(loader)
    assert list(saved["WrappedAsBase:0"]["attributes"]) == ["base.cfg.rng"]
    first = list(loader.sampler)
    restore_sampler_states(loader, saved)
    assert list(loader.sampler) == first


def test_an_unsaveable_random_state_one_object_down_is_named_by_its_path():
    loader = DataLoader(range(8), sampler=NestedRandomSampler(8, rng=random.SystemRandom()), batch_size=2)
    with pytest.warns(UserWarning, match="NestedRandomSampler.*'cfg.rng' is a random.SystemRandom"):
        capture_sampler_states(loader)


class PositionAndRandom(NestedRandomSampler):
    """A position ``state_dict`` (torchdata's reading) beside a ``random.Random`` of its own."""

    def __init__(self, num_samples: int):
        super().__init__(num_samples)
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class PositionAndRandomStateDict(PositionAndRandom):
    """Its random state saved apart from its position (``random_state_dict``), as the docs ask of such a sampler."""

    def random_state_dict(self) -> dict:
        return {"rng": self.cfg.rng.getstate()}

    def load_random_state_dict(self, state: dict) -> None:
        self.cfg.rng.setstate(state["rng"])


def test_sampler_draw_states_puts_back_every_random_state_but_not_a_position():
    """What a resumed StatefulDataLoader's sampler replay undoes: the global states, the loader's generators and the
    samplers' own random states (by attribute, or ``random_state_dict``); a position ``state_dict`` is the loader's."""
    generator = torch.Generator().manual_seed(3)
    own = NestedRandomSampler(NUM_SAMPLES)
    positioned = PositionAndRandom(NUM_SAMPLES)
    separated = PositionAndRandomStateDict(NUM_SAMPLES)

    def draw():
        return (random.random(), float(np.random.random()), float(torch.rand(1)),
                float(torch.rand(1, generator=generator)), own.cfg.rng.random(), separated.cfg.rng.random())

    put_back = sampler_draw_states([own, positioned, separated], [generator])
    first = draw()
    positioned_draw = positioned.cfg.rng.random()
    positioned.position = 5
    put_back()
    assert draw() == first
    assert positioned.position == 5  # the loader restores a position itself
    assert positioned.cfg.rng.random() != positioned_draw  # behind a state_dict: neither saved nor put back
