"""fit_distributed trains what the user's training sampler draws (issue 33, item 1; DESIGN.md principle 19).

Two real gloo processes, each building the same loader (as a torchrun job's processes do) and recording the sample
indices of every batch it trains. Every rank draws the user's sampler's whole order alike; rank r trains positions r,
r + 2, ... of it (padded at the end by its first positions, so that the ranks have as many batches); a user's
DistributedSampler is used as given; a batch sampler is sharded by whole batches; a loader that cannot be sharded is
refused before training.
"""
import os
import random
import types
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler, SubsetRandomSampler,
    WeightedRandomSampler)

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.distributed.data import equal_batch_counts_by_construction
from aitoolbox.torchtrain.distributed.sharding import ShardedSampler
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.combinations.support import join_as_torchrun
from tests.distributed_helpers import run_distributed
from tests.torchtrain.data.support import BucketBatchSampler, SaveAt
from tests.torchtrain.distributed.support import IndexRecordingRegressor, make_model, regression_data

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")

NUM_SAMPLES, BATCH, EPOCHS = 30, 4, 2


class Recording:
    """Mixed into a sampler class: keeps every order the sampler draws (``drawn``, one list per iteration)."""

    def __iter__(self):
        drawn = [int(index) for index in super().__iter__()]
        self.drawn = getattr(self, "drawn", []) + [drawn]
        return iter(drawn)


class RecordingRandom(Recording, RandomSampler):
    pass


class RecordingSubset(Recording, SubsetRandomSampler):
    pass


class RecordingWeighted(Recording, WeightedRandomSampler):
    pass


class RecordingSequential(Recording, SequentialSampler):
    pass


class RecordingBuckets(Recording, BucketBatchSampler):
    def __iter__(self):
        drawn = [list(batch) for batch in BucketBatchSampler.__iter__(self)]
        self.drawn = getattr(self, "drawn", []) + [drawn]
        return iter(drawn)


def loader_of(kind: str) -> DataLoader:
    """The user's training loader of ``kind``, built alike in every process."""
    data = regression_data(NUM_SAMPLES)
    if kind == "random, global RNG":
        return DataLoader(data, batch_size=BATCH, sampler=RecordingRandom(data))
    if kind == "random, own generator":
        generator = torch.Generator().manual_seed(7)
        return DataLoader(data, batch_size=BATCH, sampler=RecordingRandom(data, generator=generator),
                          generator=generator)
    if kind == "subset (a train/validation split)":
        return DataLoader(data, batch_size=BATCH, sampler=RecordingSubset(list(range(17))))
    if kind == "weighted, with replacement":
        weights = torch.tensor([0.0 if index % 3 == 0 else 1.0 + index for index in range(NUM_SAMPLES)])
        return DataLoader(data, batch_size=BATCH, sampler=RecordingWeighted(weights, num_samples=26))
    if kind == "sequential, drop_last":
        return DataLoader(data, batch_size=BATCH, sampler=RecordingSequential(data), drop_last=True)
    if kind == "bucketing batch sampler":
        return DataLoader(data, batch_sampler=RecordingBuckets(NUM_SAMPLES, BATCH))
    raise ValueError(kind)


def train_in_rank(rank: int, world_size: int, kind: str) -> dict:
    join_as_torchrun(rank, world_size)
    torch.manual_seed(rank)  # the processes' global RNGs differ (as in a torchrun job that seeds by rank)
    model = make_model(IndexRecordingRegressor)
    torch.manual_seed(100 + rank)
    loader = loader_of(kind)
    user_sampler = loader.batch_sampler if loader.batch_size is None else loader.sampler
    tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(),
                   show_progress=False, end_auto_eval=False, gpu_mode="ddp")
    tl.fit(num_epochs=EPOCHS)
    return {"trained": model.trained_indices, "drawn": user_sampler.drawn, "loader": type(tl.train_loader).__name__}


def padded(order: list, world_size: int) -> list:
    total = -(-len(order) // world_size) * world_size
    return (order * (total // max(len(order), 1) + 1))[:total]


KINDS = ["random, global RNG", "random, own generator", "subset (a train/validation split)",
         "weighted, with replacement", "sequential, drop_last", "bucketing batch sampler"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_trains_its_share_of_the_user_sampler_s_order(kind):
    ranks = run_distributed(train_in_rank, world_size=2, args=(kind,))
    assert ranks[0]["drawn"] == ranks[1]["drawn"], "the ranks drew different orders"
    assert len(ranks[0]["drawn"]) == EPOCHS  # one draw an epoch, nothing more
    assert len(ranks[0]["trained"]) == len(ranks[1]["trained"])  # as many batches (DDP steps) on every rank
    batches = len(ranks[0]["trained"]) // EPOCHS
    for epoch, order in enumerate(ranks[0]["drawn"]):
        for rank, result in enumerate(ranks):
            trained = result["trained"][epoch * batches:(epoch + 1) * batches]
            if kind == "bucketing batch sampler":  # whole batches: rank r trains batches r, r + 2, ...
                assert trained == padded(order, 2)[rank::2]
            else:
                share = padded(order, 2)[rank::2]
                if kind == "sequential, drop_last":  # the loader's drop_last drops each rank's incomplete batch
                    share = share[:len(share) // BATCH * BATCH]
                assert sum(trained, []) == share
    if kind.startswith("subset"):
        assert {index for result in ranks for batch in result["trained"] for index in batch} == set(range(17))
    if kind.startswith("weighted"):
        assert not {index for result in ranks for batch in result["trained"] for index in batch if index % 3 == 0}
    if kind.startswith("random"):
        first, second = ranks[0]["drawn"]
        assert sorted(first) == sorted(second) == list(range(NUM_SAMPLES)) and first != second
    assert ranks[0]["loader"] == "DataLoader"


def user_distributed_sampler(rank: int, world_size: int) -> dict:
    join_as_torchrun(rank, world_size)
    model = make_model(IndexRecordingRegressor)
    data = regression_data(NUM_SAMPLES)
    sampler = DistributedSampler(data, shuffle=True, seed=3)  # the torchrun recipe: built after the group exists
    tl = TrainLoop(model, DataLoader(data, batch_size=BATCH, sampler=sampler), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), show_progress=False,
                   end_auto_eval=False, gpu_mode="ddp")
    tl.fit(num_epochs=EPOCHS)
    expected = []
    for epoch in range(EPOCHS):
        twin = DistributedSampler(data, shuffle=True, seed=3)
        twin.set_epoch(epoch)
        expected.append(list(twin))
    return {"trained": model.trained_indices, "expected": expected, "kept": tl.train_loader.sampler is sampler}


@pytest.mark.slow
def test_a_user_s_distributed_sampler_is_used_as_given_and_reshuffled_each_epoch():
    ranks = run_distributed(user_distributed_sampler, world_size=2)
    for result in ranks:
        assert result["kept"]
        per_epoch = len(result["trained"]) // EPOCHS
        for epoch in range(EPOCHS):
            assert sum(result["trained"][epoch * per_epoch:(epoch + 1) * per_epoch], []) == result["expected"][epoch]
        assert result["expected"][0] != result["expected"][1]  # set_epoch was called: a new order each epoch


def stateful_loader(rank: int, world_size: int) -> dict:
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    join_as_torchrun(rank, world_size)
    model = make_model(IndexRecordingRegressor)
    data = regression_data(NUM_SAMPLES)
    loader = stateful_dataloader.StatefulDataLoader(data, batch_size=BATCH, shuffle=True)
    tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(),
                   show_progress=False, end_auto_eval=False, gpu_mode="ddp")
    tl.fit(num_epochs=1)
    return {"trained": model.trained_indices, "loader": type(tl.train_loader).__name__,
            "has_state": callable(getattr(tl.train_loader, "state_dict", None))}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_data_loader_stays_one():
    pytest.importorskip("torchdata.stateful_dataloader")
    ranks = run_distributed(stateful_loader, world_size=2)
    assert [result["loader"] for result in ranks] == ["StatefulDataLoader"] * 2
    assert all(result["has_state"] for result in ranks)
    trained = sorted(index for result in ranks for batch in result["trained"] for index in batch)
    assert trained == list(range(NUM_SAMPLES))


class SaveTrained(AbstractCallback):
    """At train end, in every rank: writes the indices the rank trained to ``<folder>/rank<r>.pt``."""

    def __init__(self, folder):
        super().__init__("save trained indices")
        self.folder = str(folder)

    def on_train_end(self):
        tl = self.train_loop_obj
        torch.save(tl.model.trained_indices, os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


@pytest.mark.slow
def test_the_issue_s_train_validation_split_trains_only_the_training_indices(tmp_path):
    """The launcher's own processes (forked), the loader built in the launching process: a SubsetRandomSampler
    split trained the validation samples (16-31) before."""
    data = regression_data(32)
    model = make_model(IndexRecordingRegressor)
    train = DataLoader(data, batch_size=BATCH, sampler=SubsetRandomSampler(list(range(16)),
                                                                            generator=torch.Generator().manual_seed(1)))
    validation = DataLoader(data, batch_size=BATCH, sampler=SubsetRandomSampler(list(range(16, 32))))
    tl = TrainLoop(model, train, validation, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(),
                   show_progress=False, end_auto_eval=False)
    tl.fit_distributed(num_epochs=2, callbacks=[SaveTrained(tmp_path)], num_gpus=2, start_method="fork")
    trained = [index for rank in range(2) for batch in torch.load(tmp_path / f"rank{rank}.pt") for index in batch]
    assert sorted(trained) == sorted(list(range(16)) * 2)


class NoLength(torch.utils.data.Sampler):
    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        return iter(range(self.count))


class LoaderSubclass(DataLoader):
    pass


@pytest.mark.parametrize("loader, message", [
    (DataLoader(range(8), batch_size=2, sampler=NoLength(8)), r"NoLength.*has no __len__"),
    (DataLoader(range(8), batch_sampler=NoLength(4)), r"NoLength.*has no __len__"),
    (LoaderSubclass(range(8), batch_size=2, shuffle=True), r"LoaderSubclass.*cannot rebuild"),
    (DataLoader(range(8), batch_size=2, sampler=DistributedSampler(range(8), num_replicas=2, rank=0)),
     r"DistributedSampler.*rank 0 of 2.*in_process_data_load"),
    (DataLoader(range(8), batch_size=2, sampler=DistributedSampler(range(8), num_replicas=4, rank=0)),
     r"DistributedSampler.*4 processes.*2"),
], ids=["sampler without len", "batch sampler without len", "DataLoader subclass", "DistributedSampler of rank 0",
        "DistributedSampler of another world size"])
def test_a_loader_that_cannot_be_sharded_is_refused_before_any_process_starts(loader, message):
    tl = TrainLoop(make_model(), loader, None, None, torch.optim.SGD(make_model().parameters(), lr=0.01),
                   nn.MSELoss(), show_progress=False, end_auto_eval=False)
    with pytest.raises(ValueError, match=message):
        tl.fit_distributed(num_epochs=1, num_gpus=2, start_method="fork")


class DoublingLoader(DataLoader):
    """A DataLoader subclass with behaviour of its own, which a rebuilt DataLoader would lose."""

    def __iter__(self):
        for batch in super().__iter__():
            yield 2 * batch


@pytest.mark.parametrize("which", ["validation", "test"])
def test_an_evaluation_loader_subclass_is_refused_before_any_process_starts(which):
    """Issue 33 (review D5): a DataLoader subclass as validation loader was rebuilt as a plain DataLoader under DDP,
    its behaviour lost (another loss than in one process), silently."""
    loaders = {"validation": None, "test": None}
    loaders[which] = DoublingLoader(range(8), batch_size=2)
    model = make_model()
    tl = TrainLoop(model, DataLoader(range(8), batch_size=2), loaders["validation"], loaders["test"],
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), show_progress=False,
                   end_auto_eval=False)
    with pytest.raises(ValueError, match=rf"the {which} loader is a DoublingLoader.*DataLoader subclass"):
        tl.fit_distributed(num_epochs=1, num_gpus=2, start_method="fork")


def test_an_evaluation_loader_subclass_in_a_process_is_refused_unless_it_shards_itself():
    from aitoolbox.torchtrain.distributed.data import distributed_eval_loader
    with pytest.raises(ValueError, match=r"DoublingLoader.*in_process_data_load"):
        distributed_eval_loader(DoublingLoader(range(8), batch_size=2), 0, 2)
    sharding_itself = DoublingLoader(range(8), batch_size=2, sampler=DistributedSampler(range(8), 2, 1, shuffle=False))
    assert distributed_eval_loader(sharding_itself, 1, 2) is sharding_itself  # its behaviour kept
    assert [batch.tolist() for batch in sharding_itself] == [[2, 6], [10, 14]]


def test_train_data_shuffle_false_cannot_unshuffle_another_sampler():
    loader = DataLoader(range(8), batch_size=2, sampler=SubsetRandomSampler(range(4)))
    tl = TrainLoop(make_model(), loader, None, None, torch.optim.SGD(make_model().parameters(), lr=0.01),
                   nn.MSELoss(), show_progress=False, end_auto_eval=False)
    with pytest.raises(ValueError, match=r"train_data_shuffle=False.*SubsetRandomSampler"):
        tl.fit_distributed(num_epochs=1, num_gpus=2, start_method="fork", train_data_shuffle=False)


def resume_loader(kind: str) -> DataLoader:
    data = regression_data(NUM_SAMPLES)
    if kind == "random, global RNG":
        return DataLoader(data, batch_size=BATCH, shuffle=True)
    if kind == "bucketing batch sampler":  # its own random.Random
        return DataLoader(data, batch_sampler=BucketBatchSampler(NUM_SAMPLES, BATCH))
    if kind == "StatefulDataLoader":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(data, batch_size=BATCH, shuffle=True)
    if kind.startswith("StatefulDataLoader, position sampler"):
        from torchdata.stateful_dataloader import StatefulDataLoader
        sampler_class = PositionAndRandomState if "random_state_dict" in kind else PositionOwnRandom
        return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler_class(NUM_SAMPLES))
    raise ValueError(kind)


class PositionOwnRandom(Sampler):
    """Review 48d's D3 sampler: a position ``state_dict`` (how many indices it yielded) and its own random.Random."""

    def __init__(self, n: int, seed: int = 7):
        self.n, self.rng, self.yielded, self.next_yielded = n, random.Random(seed), 0, None

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        start, self.next_yielded = self.next_yielded or 0, None
        self.yielded = start
        for index in order[start:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.next_yielded = state["yielded"]


class PositionAndRandomState(PositionOwnRandom):
    """The same with its generator saved apart from its position, as docs/checkpointing.rst asks."""

    def random_state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_random_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def straight_and_resumed_in_rank(rank: int, world_size: int, kind: str, after: int) -> dict:
    join_as_torchrun(rank, world_size)

    def build(seed: int) -> TrainLoop:
        model = make_model(IndexRecordingRegressor)
        loader = resume_loader(kind)  # alike in every process (a StatefulDataLoader seeds its sampler from the RNG)
        torch.manual_seed(seed + rank)  # the resumed processes' global random states differ from the straight run's
        return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.01),
                         nn.MSELoss(), show_progress=False, end_auto_eval=False, gpu_mode="ddp")

    saver = SaveAt(after)
    straight = build(1)
    straight.fit(num_epochs=3, callbacks=[saver])
    resumed = build(2)
    resumed.load_checkpoint(saver.checkpoint())
    resumed.fit(num_epochs=3)
    return {"straight": straight.model.trained_indices, "resumed": resumed.model.trained_indices,
            "weights": [straight.model.state_dict(), resumed.model.state_dict()]}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", ["random, global RNG", "bucketing batch sampler", "StatefulDataLoader"])
def test_a_resumed_ddp_run_trains_exactly_the_straight_run_s_samples(kind):
    if kind == "StatefulDataLoader":
        pytest.importorskip("torchdata.stateful_dataloader")
    after = 6  # 4 batches an epoch per rank: inside epoch 1
    for result in run_distributed(straight_and_resumed_in_rank, world_size=2, args=(kind, after)):
        assert result["resumed"] == result["straight"][after:]
        straight, resumed = result["weights"]
        assert all(torch.equal(value, resumed[key]) for key, value in straight.items())


class SaveCheckpointAt(AbstractCallback):
    """Writes a mid-epoch checkpoint (rank 0; a collective) to ``path`` after the run's ``after``-th batch."""

    def __init__(self, path, after: int):
        super().__init__("save a checkpoint", execution_order=100)
        self.path, self.after = str(path), after

    def on_batch_end(self):
        tl = self.train_loop_obj
        if tl.total_iteration_idx + 1 == self.after:
            state = tl.checkpoint_state(mid_epoch=True)
            if tl.is_main_process:
                torch.save(state, self.path)


def persistent_workers_loop() -> TrainLoop:
    model = make_model(IndexRecordingRegressor)
    loader = DataLoader(regression_data(NUM_SAMPLES), batch_size=BATCH, shuffle=True, num_workers=2,
                        persistent_workers=True, generator=torch.Generator().manual_seed(4))
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(),
                     show_progress=False, end_auto_eval=False)


@pytest.mark.slow
def test_a_resumed_ddp_run_with_persistent_workers_trains_the_straight_run_s_samples(tmp_path):
    """The launcher's own processes (they may start DataLoader workers); the checkpoint inside epoch 1, after the
    first epoch made the persistent workers."""
    after = 6
    straight, resumed = persistent_workers_loop(), persistent_workers_loop()
    (tmp_path / "straight").mkdir()
    (tmp_path / "resumed").mkdir()
    straight.fit_distributed(num_epochs=3, callbacks=[SaveCheckpointAt(tmp_path / "mid.pt", after),
                                                      SaveTrained(tmp_path / "straight")],
                             num_gpus=2, start_method="fork")
    resumed.load_checkpoint(str(tmp_path / "mid.pt"))
    resumed.fit_distributed(num_epochs=3, callbacks=[SaveTrained(tmp_path / "resumed")], num_gpus=2,
                            start_method="fork")
    for rank in range(2):
        trained = [torch.load(tmp_path / run / f"rank{rank}.pt") for run in ("straight", "resumed")]
        assert trained[1] == trained[0][after:]
    assert all(torch.equal(value, resumed.model.state_dict()[key]) for key, value in straight.model.state_dict().items())


def evaluate_a_split_in_rank(rank: int, world_size: int) -> dict:
    join_as_torchrun(rank, world_size)
    data = regression_data(32)
    model = make_model(IndexRecordingRegressor)
    validation = DataLoader(data, batch_size=BATCH, sampler=SubsetRandomSampler(list(range(16, 32))))
    tl = TrainLoop(model, DataLoader(data, batch_size=BATCH, sampler=SubsetRandomSampler(list(range(16)))),
                   validation, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), show_progress=False,
                   end_auto_eval=False, gpu_mode="ddp")
    tl.fit(num_epochs=1)
    loss = tl.evaluate_loss_on_validation_set(float_dict_format=True)
    _, _, metadata = tl.predict_on_validation_set()
    with torch.no_grad():
        x, y, _ = data[16:32]
        expected = nn.MSELoss()(model(x), y).item()
    result = {"loss": loss, "expected": expected, "indices": list(metadata["index"])}

    # The training set of a loader with a batch sampler (sharded by whole batches for training): every sample once.
    buckets = DataLoader(data, batch_sampler=BucketBatchSampler(32, BATCH))
    tl = TrainLoop(model, buckets, None, None, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(),
                   show_progress=False, end_auto_eval=False, gpu_mode="ddp")
    tl.fit(num_epochs=1)
    _, _, metadata = tl.predict_on_train_set()
    with torch.no_grad():
        x, y, _ = data[:]
        result["train"] = (tl.evaluate_loss_on_train_set(float_dict_format=True), nn.MSELoss()(model(x), y).item(),
                           sorted(metadata["index"]))
    return result


@pytest.mark.slow
def test_a_validation_split_is_evaluated_on_its_own_samples():
    """A SubsetRandomSampler validation loader: under DDP each rank evaluates a block of the split's indices (the
    whole data set was evaluated before), the loss and the predictions those of the split. A training loader with a
    batch sampler is evaluated on every sample once."""
    for result in run_distributed(evaluate_a_split_in_rank, world_size=2):
        assert result["indices"] == list(range(16, 32))
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-5)
        loss, expected, indices = result["train"]
        assert indices == list(range(32)) and loss == pytest.approx(expected, rel=1e-5)


class SeededOneObjectDown(torch.utils.data.Sampler):
    """Its generator one object down (``self.cfg.generator``), where the comparison looks too."""

    def __init__(self, data, seed: int):
        self.cfg = types.SimpleNamespace(generator=torch.Generator().manual_seed(seed))
        self.size = len(data)

    def __len__(self):
        return self.size

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=self.cfg.generator).tolist())


def fit_in_rank(rank: int, world_size: int, sampler_of: Callable[[Any], Any]) -> Tuple[TrainLoop, Any]:
    """A one-epoch DDP fit in this process over the loader of ``sampler_of(data)``: the loop, and what fit raised
    (None if nothing)."""
    join_as_torchrun(rank, world_size)
    model = make_model(IndexRecordingRegressor)
    data = regression_data(NUM_SAMPLES)
    tl = TrainLoop(model, DataLoader(data, batch_size=BATCH, sampler=sampler_of(data)), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), show_progress=False,
                   end_auto_eval=False, gpu_mode="ddp")
    try:
        tl.fit(num_epochs=1)
    except ValueError as error:
        return tl, error
    return tl, None


def refused_in_rank(rank: int, world_size: int, sampler_of: Callable[[Any], Any]) -> str:
    """The message of the ValueError fit raised before training any batch."""
    tl, error = fit_in_rank(rank, world_size, sampler_of)
    assert error is not None and tl.model.trained_indices == []
    return str(error)


def seeded_by_rank(rank: int, world_size: int, nested: bool = False) -> str:
    def sampler_of(data):  # a per-rank seed: a mistake here
        return SeededOneObjectDown(data, rank) if nested else RandomSampler(
            data, generator=torch.Generator().manual_seed(rank))
    return refused_in_rank(rank, world_size, sampler_of)


@pytest.mark.slow
@pytest.mark.parametrize("nested", [False, True], ids=["sampler.generator", "sampler.cfg.generator"])
def test_samplers_whose_random_states_differ_between_the_processes_are_refused_in_every_process(nested):
    for message in run_distributed(seeded_by_rank, world_size=2, args=(nested,)):
        assert "random state differs between the processes (ranks [1] differ from rank 0)" in message


class ShardsByRank(torch.utils.data.Sampler):
    """Shards itself by torch.distributed's rank in ``__iter__``, with no num_replicas and rank attributes."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size // 2

    def __iter__(self):
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank, self.size, world_size))


class WrapsItsOwnDistributedSampler(torch.utils.data.Sampler):
    """Builds a DistributedSampler itself, at the first draw, and hides it (no ``sampler`` attribute)."""

    def __init__(self, data):
        self.data, self.inner = data, None

    def _inner(self):
        if self.inner is None:
            self.inner = DistributedSampler(self.data, shuffle=False)
        return self.inner

    def __len__(self):
        return len(self._inner()) if dist.is_initialized() else len(self.data)

    def __iter__(self):
        return iter(self._inner())


def self_sharding_in_rank(rank: int, world_size: int, kind: str) -> str:
    return refused_in_rank(rank, world_size, lambda data: ShardsByRank(NUM_SAMPLES) if kind == "by rank"
                           else WrapsItsOwnDistributedSampler(data))


class ShufflesFourDown(torch.utils.data.Sampler):
    """Shuffles with a ``random.Random`` four attributes down (``self.a.b.c.rng``), which the set-up check of the
    order draws from too."""

    def __init__(self, size: int):
        self.size = size
        self.a = types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(rng=random.Random(7))))

    def __len__(self):
        return self.size

    def __iter__(self):
        order = list(range(self.size))
        self.a.b.c.rng.shuffle(order)
        return iter(order)


def first_epoch_in_rank(rank: int, world_size: int) -> list:
    tl, error = fit_in_rank(rank, world_size, lambda data: ShufflesFourDown(NUM_SAMPLES))
    assert error is None
    return [index for batch in tl.model.trained_indices for index in batch]


@pytest.mark.filterwarnings("ignore:the training sampler ShufflesFourDown keeps a random state")
def test_the_order_check_at_set_up_leaves_the_sampler_s_state_as_it_was():
    """The check that a sampler draws the same order in every process draws from a deep copy: a random state it
    cannot put back (four attributes down) is not advanced, so epoch 0 trains the sampler's first order (second
    review of issue 33, defect 2: it trained the second)."""
    first_order = list(range(NUM_SAMPLES))
    random.Random(7).shuffle(first_order)
    for rank, trained in enumerate(run_distributed(first_epoch_in_rank, world_size=2)):
        assert trained == first_order[rank::2]


@pytest.mark.parametrize("kind", ["by rank", "hidden DistributedSampler"])
def test_a_sampler_that_shards_by_itself_unannounced_is_refused_not_sharded_again(kind):
    """Sharding its per-process part again would train a fraction of the data set silently (review of issue 33, D4)."""
    for message in run_distributed(self_sharding_in_rank, world_size=2, args=(kind,)):
        assert "draws another order in each process" in message and "num_replicas and rank" in message


class RankShardedStream(torch.utils.data.IterableDataset):
    """Shards itself by rank (as the docs suggest for an IterableDataset); 33 samples: rank 0 gets one more."""

    def __init__(self, size: int):
        self.data = regression_data(size)

    def __iter__(self):
        for index in range(dist.get_rank(), len(self.data), dist.get_world_size()):
            yield self.data[index]


def uneven_stream_in_rank(rank: int, world_size: int, size: int):
    join_as_torchrun(rank, world_size)
    model = make_model(IndexRecordingRegressor)
    tl = TrainLoop(model, DataLoader(RankShardedStream(size), batch_size=BATCH), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), show_progress=False,
                   end_auto_eval=False, gpu_mode="ddp")
    try:
        tl.fit(num_epochs=1)
    except ValueError as error:
        return str(error)
    return len(model.trained_indices)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the training loader iterates an IterableDataset")
def test_an_iterable_dataset_sharded_unevenly_stops_every_process_with_the_counts_not_a_collective_abort():
    """33 samples in batches of 4: 5 batches in rank 0, 4 in rank 1 (review of issue 33, D11); 32 train evenly."""
    for message in run_distributed(uneven_stream_in_rank, world_size=2, args=(33,), timeout=60):
        assert "different numbers of batches this epoch (rank 0: more than 4, rank 1: 4)" in message
    assert run_distributed(uneven_stream_in_rank, world_size=2, args=(32,), timeout=60) == [4, 4]


def test_loaders_sharded_into_equal_parts_need_no_agreement_per_batch():
    data = regression_data(NUM_SAMPLES)
    sharded = ShardedSampler(RandomSampler(data), rank=0, world_size=2)
    assert equal_batch_counts_by_construction(DataLoader(data, batch_size=BATCH, sampler=sharded))
    assert equal_batch_counts_by_construction(DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(
        data, num_replicas=2, rank=0)))
    assert not equal_batch_counts_by_construction(DataLoader(data, batch_size=BATCH))
    assert not equal_batch_counts_by_construction([data[0]])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_position_sampler_in_a_stateful_loader_resumed_mid_epoch_under_ddp_is_refused_with_what_to_do():
    """Review 49d (r13): a sampler whose state_dict is a position (and no random_state_dict) under DDP's sharding
    sampler: the position restored is the end of the whole order the sharding sampler drew, so the loader had
    nothing to pass its trained indices over, and torchdata crashed with a bare StopIteration. Refused, naming
    the sampler and what to do; with random_state_dict() (as docs/checkpointing.rst asks) it resumes exactly."""
    pytest.importorskip("torchdata.stateful_dataloader")
    with pytest.raises(Exception, match=r"(?s)PositionOwnRandom.*random_state_dict\(\)") as raised:
        run_distributed(straight_and_resumed_in_rank, world_size=2,
                        args=("StatefulDataLoader, position sampler", 6))
    assert "StopIteration" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_position_sampler_with_random_state_dict_resumes_mid_epoch_under_ddp_exactly():
    pytest.importorskip("torchdata.stateful_dataloader")
    after = 6
    for result in run_distributed(straight_and_resumed_in_rank, world_size=2,
                                  args=("StatefulDataLoader, position sampler with random_state_dict", after)):
        assert result["resumed"] == result["straight"][after:]
        straight, resumed = result["weights"]
        assert all(torch.equal(value, resumed[key]) for key, value in straight.items())
