"""Distributed evaluation evaluates exactly the samples one process evaluates (issue 32 item 9).

Before, every rank's evaluation loader had ``drop_last=False`` forced and covered the whole data set: a loader
with ``drop_last=True`` (or a sampler of the user's own, choosing a subset) gave one loss in one process and
another under DDP (1.4359 vs 1.4119 in the report), against the docs' promise of equality.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.distributed.data import distributed_eval_loader, distributed_train_loader


def _indexed(num_samples: int) -> TensorDataset:
    return TensorDataset(torch.arange(num_samples))


def _samples(loader) -> list:
    return [int(index) for (batch,) in loader for index in batch]


@settings(max_examples=150, deadline=None)
@given(num_samples=st.integers(1, 40), batch_size=st.integers(1, 9), drop_last=st.booleans(),
       world_size=st.integers(1, 4), sampler=st.sampled_from(["sequential", "shuffle", "subset", "process_train"]))
def test_the_ranks_together_evaluate_what_one_process_evaluates(num_samples, batch_size, drop_last, world_size,
                                                                  sampler):
    """In rank order, every sample one process evaluates, once: in its order, except that a shuffling loader's
    samples come in data-set order (what a shuffling loader with drop_last leaves out is random in one process:
    here the last ones in data-set order, as many as one process leaves out). ``process_train``: the set is the
    training loader, which each process holds already split (a DistributedSampler): the whole set is evaluated."""
    dataset = _indexed(num_samples)
    options = {"batch_size": batch_size, "drop_last": drop_last}
    if sampler == "shuffle":
        loader = DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(0), **options)
    elif sampler == "subset":
        loader = DataLoader(dataset, sampler=list(range(num_samples - 1, -1, -3)), **options)  # a deterministic one
    else:
        loader = DataLoader(dataset, **options)
    one_process = _samples(loader)
    if sampler == "process_train":
        ranks = [distributed_eval_loader(distributed_train_loader(loader, rank, world_size), rank, world_size)
                 for rank in range(world_size)]
    else:
        ranks = [distributed_eval_loader(loader, rank, world_size) for rank in range(world_size)]
    joined = [index for rank_loader in ranks for index in _samples(rank_loader)]
    if sampler == "shuffle":
        assert joined == list(range(len(one_process)))
    else:
        assert joined == one_process
    assert [len(rank_loader.sampler) for rank_loader in ranks] == [len(_samples(r)) for r in ranks]
    sizes = [len(rank_loader.sampler) for rank_loader in ranks]
    assert max(sizes) - min(sizes) <= 1  # an even split


def _ddp_evaluation_worker(rank, world_size):
    from tests.combinations.support import Cell, build_loop, join_as_torchrun
    join_as_torchrun(rank, world_size)
    tl = _evaluated_loop(build_loop)
    tl.fit_distributed(num_epochs=1, train_data_shuffle=False)
    return {"loss": tl.evaluate_loss_on_validation_set(), "predictions": tl.predict_on_validation_set()[0],
            "test_loss": tl.evaluate_loss_on_test_set(), "weights": tl.model.state_dict()}


def _evaluated_loop(build_loop, strategy="ddp"):
    from tests.combinations.support import Cell, dataset
    tl = build_loop(Cell(strategy=strategy))
    data = dataset()  # 40 samples: batches of 6 leave 4 out with drop_last
    tl.validation_loader = DataLoader(data, batch_size=6, drop_last=True)
    tl.test_loader = DataLoader(data, batch_size=6, sampler=list(range(0, 40, 3)))  # a subset of the user's choice
    return tl


@pytest.mark.slow
def test_ddp_evaluation_equals_one_process_with_drop_last_and_a_sampler_of_the_users():
    from tests.combinations.support import build_loop
    from tests.distributed_helpers import run_distributed
    results = run_distributed(_ddp_evaluation_worker, 2)
    reference = _evaluated_loop(build_loop, strategy="single")
    reference.model.load_state_dict(results[0]["weights"])
    expected_loss = reference.evaluate_loss_on_validation_set()
    expected_predictions = reference.predict_on_validation_set()[0]
    expected_test_loss = reference.evaluate_loss_on_test_set()
    assert expected_predictions.shape == (36,)
    for result in results:
        # The per-sample losses are the same; only the order of the sums differs.
        torch.testing.assert_close(result["loss"], expected_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(result["test_loss"], expected_test_loss, rtol=1e-6, atol=0)
        assert torch.equal(result["predictions"], expected_predictions)


def _buffers_worker(rank, world_size):
    from tests.combinations.support import Cell, build_loop, join_as_torchrun
    join_as_torchrun(rank, world_size)
    tl = _evaluated_loop(build_loop)
    tl.fit_distributed(num_epochs=1, train_data_shuffle=False)
    own = {name: buffer.clone() for name, buffer in tl.model.named_buffers()}
    first = tl.evaluate_loss_on_validation_set()
    calls = []
    original = tl.model.get_loss_eval
    tl.model.get_loss_eval = lambda *args: calls.append(1) or original(*args)
    again = tl.evaluate_loss_on_validation_set()  # from the cache: the buffers went back to their values
    kept = all(torch.equal(own[name], buffer) for name, buffer in tl.model.named_buffers())
    return {"cached": torch.equal(first, again) and not calls, "kept": kept, "running_mean": own["bn.running_mean"]}


@pytest.mark.slow
def test_ddp_evaluation_uses_rank0s_buffers_and_gives_each_rank_its_own_back():
    """After training each rank holds its own BatchNorm statistics (its last batch's update): the evaluation uses
    rank 0's in every rank, puts each rank's own back (training goes on as without it) and is still cached."""
    from tests.distributed_helpers import run_distributed
    results = run_distributed(_buffers_worker, 2)
    assert not torch.equal(results[0]["running_mean"], results[1]["running_mean"])  # the case this is about
    for result in results:
        assert result["kept"] and result["cached"]


@pytest.mark.parametrize("as_training_loader", [False, True])
def test_a_stateful_loader_is_evaluated_as_a_plain_dataloader(as_training_loader):
    """Issue 33 (review D8): a torchdata StatefulDataLoader, as validation loader or as the training loader
    evaluated at the epoch's end, was rebuilt as a DataLoader with ``snapshot_every_n_steps``, which DataLoader
    refuses (TypeError in every rank)."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(_indexed(11), batch_size=3, shuffle=as_training_loader,
                                         generator=torch.Generator().manual_seed(0))
    world_size = 2
    if as_training_loader:
        ranks = [distributed_eval_loader(distributed_train_loader(loader, rank, world_size), rank, world_size)
                 for rank in range(world_size)]
    else:
        ranks = [distributed_eval_loader(loader, rank, world_size) for rank in range(world_size)]
    assert sorted(index for rank_loader in ranks for index in _samples(rank_loader)) == list(range(11))


class ShardedSubset(torch.utils.data.Sampler):
    """A validation sampler that shards a subset of its own choice by itself (num_replicas, rank)."""

    def __init__(self, indices, num_replicas, rank):
        self.indices, self.num_replicas, self.rank = indices, num_replicas, rank

    def __len__(self):
        return len(self.indices[self.rank::self.num_replicas])

    def __iter__(self):
        return iter(self.indices[self.rank::self.num_replicas])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_sampler_that_shards_itself_is_evaluated_as_it_shards(world_size):
    """Issue 33 (review D6): a validation sampler sharding a subset (20-29) by itself was evaluated as the whole
    data set. Each rank evaluates its own part: together, the samples one process evaluates over the subset."""
    subset = list(range(20, 30))
    ranks = [distributed_eval_loader(DataLoader(_indexed(30), batch_size=4,
                                                sampler=ShardedSubset(subset, world_size, rank)), rank, world_size)
             for rank in range(world_size)]
    assert sorted(index for rank_loader in ranks for index in _samples(rank_loader)) == subset
    with pytest.raises(ValueError, match=r"ShardedSubset.*rank 0 of 2.*rank 1 of 2.*in_process_data_load"):
        distributed_eval_loader(DataLoader(_indexed(30), sampler=ShardedSubset(subset, 2, 0)), 1, 2)


class KeyedSamples(torch.utils.data.Dataset):
    """Samples keyed by strings (``"k3"``) or by ``(index, scale)`` pairs; each returns its index."""

    def __len__(self):
        return 30

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, scale = key
            return torch.tensor(index * scale)
        return torch.tensor(int(key[1:]))


class ScaledBatches(torch.utils.data.Sampler):
    """A batch sampler yielding ``(index, scale)`` pairs (multi-scale training)."""

    def __len__(self):
        return 5

    def __iter__(self):
        for batch in range(5):
            yield [(index, 1 + batch % 2) for index in range(6 * batch, 6 * batch + 6)]


def _flat(loader) -> list:
    return [int(index) for batch in loader for index in batch.reshape(-1)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_samplers_of_keys_that_are_not_indices_are_split_as_they_are(world_size):
    """Issue 33 (review D9): a sampler yielding string keys, or a batch sampler yielding (index, scale) pairs,
    crashed in the evaluation split (int(key))."""
    keys = DataLoader(KeyedSamples(), batch_size=4, sampler=[f"k{i}" for i in range(20, 30)])
    pairs = DataLoader(KeyedSamples(), batch_sampler=ScaledBatches())
    for loader in (keys, pairs):
        joined = [value for rank in range(world_size)
                  for value in _flat(distributed_eval_loader(loader, rank, world_size))]
        assert joined == _flat(loader)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_loader_without_automatic_batching_is_split_by_items(world_size):
    """Issue 33 (review D10): ``batch_size=None`` (each item a whole batch) crashed in the evaluation split. Each
    rank gets a contiguous block of the items, each loaded as one batch."""
    batches = TensorDataset(torch.arange(28).reshape(7, 4))
    loader = DataLoader(batches, batch_size=None)
    ranks = [distributed_eval_loader(loader, rank, world_size) for rank in range(world_size)]
    joined = [batch[0].tolist() for rank_loader in ranks for batch in rank_loader]
    assert joined == [batch[0].tolist() for batch in loader]
    sizes = [len(rank_loader.sampler) for rank_loader in ranks]
    assert max(sizes) - min(sizes) <= 1
