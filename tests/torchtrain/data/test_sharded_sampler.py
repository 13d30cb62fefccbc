"""Sharding the user's sampler across ranks, without processes: each rank's loader is built by
``distributed_train_loader`` as the DDP strategy builds it, and the ranks' global random states differ on purpose.

The invariants, for sampler kinds x world sizes x data-set lengths x batch sizes x drop_last (hypothesis): every rank
draws the same order; rank r trains positions r, r + W, ... of it, padded with its first positions to a multiple of
W; every rank has as many batches, and ``len(loader)`` says how many; the global random states are as before.
"""
import collections
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import (
    BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)

from aitoolbox.torchtrain.distributed.data import distributed_train_loader
from aitoolbox.torchtrain.distributed.sharding import ShardedBatchSampler, ShardedSampler, padded
from tests.torchtrain.data.support import BucketBatchSampler

KINDS = ["sequential", "random", "random, generator", "random with replacement", "subset", "weighted",
         "bucketing batch sampler", "batch sampler over random"]


class Recorded(Sampler):
    """A user's sampler that keeps what the sampler it wraps drew, epoch by epoch."""

    def __init__(self, sampler):
        self.sampler, self.drawn = sampler, []

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        self.drawn.append([list(map(int, item)) if isinstance(item, list) else int(item) for item in self.sampler])
        return iter(self.drawn[-1])


def user_loader(kind: str, length: int, batch_size: int, drop_last: bool) -> DataLoader:
    data = list(range(length))
    generator = torch.Generator().manual_seed(11)
    if kind == "bucketing batch sampler":
        return DataLoader(data, batch_sampler=Recorded(BucketBatchSampler(length, batch_size, seed=3)))
    if kind == "batch sampler over random":
        return DataLoader(data, batch_sampler=Recorded(BatchSampler(RandomSampler(data), batch_size, drop_last)))
    sampler = {
        "sequential": lambda: SequentialSampler(data),
        "random": lambda: RandomSampler(data),
        "random, generator": lambda: RandomSampler(data, generator=generator),
        "random with replacement": lambda: RandomSampler(data, replacement=True, num_samples=length + 3),
        "subset": lambda: SubsetRandomSampler(list(range(0, length, 2))),
        "weighted": lambda: WeightedRandomSampler([float(i % 3 != 2) for i in range(length)], num_samples=length),
    }[kind]()
    return DataLoader(data, batch_size=batch_size, sampler=Recorded(sampler), drop_last=drop_last,
                      generator=generator if kind == "random, generator" else None)


def ranks_epoch(kind, world_size, length, batch_size, drop_last, epoch=0):
    """Each rank's loader (a copy of the user's, as each process has) and the batches it yields in ``epoch``."""
    user = user_loader(kind, length, batch_size, drop_last)
    loaders, batches = [], []
    for rank in range(world_size):
        torch.manual_seed(1000 + rank)  # the processes' global random states differ
        loader = distributed_train_loader(copy.deepcopy(user), rank, world_size, seed=5)
        shard = loader.batch_sampler if loader.batch_size is None else loader.sampler
        shard.set_epoch(epoch)
        loaders.append(loader)
        batches.append([[int(i) for i in batch] for batch in loader])
    return loaders, batches


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), world_size=st.integers(1, 4), length=st.integers(1, 23),
       batch_size=st.integers(1, 5), drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_every_rank_trains_its_share_of_one_order(kind, world_size, length, batch_size, drop_last, epoch):
    loaders, batches = ranks_epoch(kind, world_size, length, batch_size, drop_last, epoch)
    shards = [loader.batch_sampler if loader.batch_size is None else loader.sampler for loader in loaders]
    orders = [shard.sampler.drawn for shard in shards]
    assert all(len(order) == 1 for order in orders), "one draw an epoch"
    orders = [order[0] for order in orders]
    assert all(order == orders[0] for order in orders), "the ranks drew different orders"
    order = orders[0]
    counts = {len(rank_batches) for rank_batches in batches}
    assert len(counts) == 1, f"the ranks have different numbers of batches: {counts}"
    assert all(len(loader) == len(rank_batches) for loader, rank_batches in zip(loaders, batches))
    whole = padded(order, world_size)
    assert len(whole) - len(order) < world_size
    for rank, rank_batches in enumerate(batches):
        share = whole[rank::world_size]
        if isinstance(shards[rank], ShardedBatchSampler):  # whole batches
            assert rank_batches == share
        else:
            expected = share[:len(share) // batch_size * batch_size] if drop_last else share
            assert sum(rank_batches, []) == expected
    if not drop_last or kind.startswith("bucketing") or kind.startswith("batch sampler"):
        trained = collections.Counter(i for rank_batches in batches for batch in rank_batches for i in batch)
        flat = [i for item in whole for i in (item if isinstance(item, list) else [item])]
        assert trained == collections.Counter(flat)  # the draw, and the padding, nothing else
    if kind == "subset":
        assert set(order) == set(range(0, length, 2))
    if kind == "weighted":
        assert not [i for i in order if i % 3 == 2]


def test_the_draw_leaves_the_global_random_state_alone_and_changes_with_the_epoch():
    sampler = ShardedSampler(RandomSampler(range(50)), rank=0, world_size=2, seed=1)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = list(sampler)
    assert torch.equal(torch.get_rng_state(), before)
    assert list(sampler) == first  # the same epoch: the same order
    sampler.set_epoch(1)
    assert list(sampler) != first
    other_seed = ShardedSampler(RandomSampler(range(50)), rank=0, world_size=2, seed=2)
    assert list(other_seed) != first


def test_every_loader_option_is_kept():
    def collate(batch):
        return torch.tensor(batch) * 10

    def init(worker_id):
        pass

    generator = torch.Generator().manual_seed(3)
    user = DataLoader(list(range(12)), batch_size=3, shuffle=True, num_workers=2, collate_fn=collate,
                      drop_last=True, timeout=7, worker_init_fn=init, generator=generator, prefetch_factor=3,
                      persistent_workers=True, in_order=False)
    loader = distributed_train_loader(user, 1, 2, seed=0)
    for name in ("batch_size", "num_workers", "collate_fn", "drop_last", "timeout", "worker_init_fn", "generator",
                 "prefetch_factor", "persistent_workers", "in_order"):
        assert getattr(loader, name) == getattr(user, name), name
    assert isinstance(loader.sampler, ShardedSampler) and loader.sampler.sampler is user.sampler
    batches = list(loader)
    assert len(batches) == len(loader) == 2 and all(int(i) % 10 == 0 for batch in batches for i in batch)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_data_loader_stays_stateful():
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    user = stateful_dataloader.StatefulDataLoader(list(range(10)), batch_size=2, shuffle=True,
                                                  snapshot_every_n_steps=3)
    loader = distributed_train_loader(copy.deepcopy(user), 0, 2, seed=0)
    assert type(loader) is stateful_dataloader.StatefulDataLoader and loader.snapshot_every_n_steps == 3
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    rest = [batch.tolist() for batch in iterator]
    again = distributed_train_loader(copy.deepcopy(user), 0, 2, seed=0)  # a resumed process's
    again.load_state_dict(state)
    assert [batch.tolist() for batch in again] == rest


def test_a_user_s_distributed_sampler_and_a_sharded_loader_are_used_as_given():
    from torch.utils.data import DistributedSampler
    user = DataLoader(list(range(10)), batch_size=2, sampler=DistributedSampler(range(10), num_replicas=2, rank=1))
    assert distributed_train_loader(user, 1, 2) is user
    sharded = distributed_train_loader(DataLoader(list(range(10)), batch_size=2), 1, 2)
    assert distributed_train_loader(sharded, 1, 2) is sharded


def test_writing_the_user_s_sampler_s_attributes_through_the_wrapper_changes_what_is_drawn():
    """Issue 33 (review D2): a callback setting tl.train_loader.sampler.weights / .indices (hard-example mining, a
    curriculum) set them on the sharding wrapper under DDP, where they were ignored silently."""
    weighted = WeightedRandomSampler([1.0] * 30, 12, generator=torch.Generator().manual_seed(2))
    subset = SubsetRandomSampler(list(range(30)), generator=torch.Generator().manual_seed(2))
    for user, name, value in ((weighted, "weights", torch.tensor([1.0] * 6 + [0.0] * 24, dtype=torch.double)),
                              (subset, "indices", list(range(6)))):
        ranks = [ShardedSampler(user, rank, 2) for rank in range(2)]
        setattr(ranks[0], name, value)
        assert getattr(user, name) is value and getattr(ranks[1], name) is value
        assert set(index for sharded in ranks for index in sharded) <= set(range(6))
        assert "sampler" not in vars(user)  # the wrapper's own attributes stay its own
    sharded = ShardedSampler(subset, 0, 2)
    sharded.epoch = 3
    assert sharded.epoch == 3 and not hasattr(subset, "epoch")
    assert not hasattr(sharded, "state_dict")  # methods do not read through (torchdata would take it for a position)
    copy.deepcopy(sharded)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_loader_without_automatic_batching_is_sharded_item_by_item(world_size):
    """Issue 33 (review D12): batch_size=None (each item a whole batch) was refused with "batch sampler NoneType
    has no __len__". Its sampler is sharded as any other: every item (batch) of the epoch's order once, padded."""
    batches = torch.utils.data.TensorDataset(torch.arange(28).reshape(7, 4))
    user = DataLoader(batches, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(0))
    # (Each process holds its own copy of the loader and its generator.)
    ranks = [distributed_train_loader(copy.deepcopy(user), rank, world_size) for rank in range(world_size)]
    trained = [tuple(batch[0].tolist()) for loader in ranks for batch in loader]
    assert all(loader.batch_size is None for loader in ranks)
    assert len(trained) == -(-7 // world_size) * world_size
    assert set(trained) == {tuple(range(4 * item, 4 * item + 4)) for item in range(7)}
