"""Which loaders keep their position themselves: only one that can both save and restore it (a loader with
``state_dict`` alone would be asked to load a position it cannot). Written for the mutation run (tests/mutation/):
this mutant survived the rest of its selection."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.train_loop.data_position import epoch_without, has_own_state, resumed_epoch


class _Saves(DataLoader):
    def state_dict(self):
        return {}


class _Loads(DataLoader):
    def load_state_dict(self, state):
        pass


class _SavesAndLoads(_Saves):
    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("loader_class, own", [(DataLoader, False), (_Saves, False), (_Loads, False),
                                               (_SavesAndLoads, True)])
def test_a_loader_keeps_its_position_itself_only_if_it_saves_and_restores_it(loader_class, own):
    assert has_own_state(loader_class(TensorDataset(torch.zeros(4, 1)), batch_size=2)) is own


class _CountingDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.fetched = []

    def __len__(self):
        return 8

    def __getitem__(self, index):
        self.fetched.append(index)
        return torch.tensor([float(index)])


def test_the_batches_an_epoch_leaves_out_are_not_fetched():
    """The single-process DataLoader over a map-style dataset passes over a left-out batch by its indices: a
    dataset that reads files or draws augmentations does no work for it (epoch_without's promise)."""
    dataset = _CountingDataset()
    loader = DataLoader(dataset, batch_size=2)
    batches = [batch.flatten().tolist() for batch in epoch_without(loader, start=1, skipped=[2])]
    assert batches == [[2.0, 3.0], [6.0, 7.0]]
    assert dataset.fetched == [2, 3, 6, 7]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_epoch_leaves_out_every_batch_it_is_told_to_not_only_the_first(num_workers):
    """Two left-out positions ahead (two rollbacks in one epoch): the loader's own iteration takes over only after
    the last of them (the mutation run, mut47: after the first, the second was yielded). By index in one process,
    loaded and discarded with a worker."""
    dataset = _CountingDataset()
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers)
    batches = [batch.flatten().tolist() for batch in epoch_without(loader, start=0, skipped=[1, 2])]
    assert batches == [[0.0, 1.0], [6.0, 7.0]]
    if num_workers == 0:
        assert dataset.fetched == [0, 1, 6, 7]


class _DoublesItsBatches(DataLoader):
    """A DataLoader subclass whose own ``__iter__`` changes what it yields (an augmentation, a collation)."""

    def __iter__(self):
        return (batch * 2 for batch in super().__iter__())


class _OwnIterator(DataLoader):
    def _get_iterator(self):
        return (batch * 3 for batch in super()._get_iterator())


@pytest.mark.parametrize("loader_class, factor", [(DataLoader, 1), (_DoublesItsBatches, 2), (_OwnIterator, 3)])
def test_a_resumed_epoch_goes_through_a_subclass_s_own_iteration(loader_class, factor):
    """Batches are passed over by their indices only where the loader iterates as DataLoader does: a subclass with
    its own ``__iter__`` or ``_get_iterator`` is resumed through them (loaded and discarded), so the rest of the epoch
    is what it yields (the mutation run, mut47: either override alone counted as iterating as DataLoader does)."""
    dataset = _CountingDataset()
    loader = loader_class(dataset, batch_size=2)
    batches = [batch.flatten().tolist() for batch in resumed_epoch(loader, 2)]
    assert batches == [[4.0 * factor, 5.0 * factor], [6.0 * factor, 7.0 * factor]]


class OwnPositionLoader:
    """Not a DataLoader: batches of 4 of ``data`` in order, resumable from its own state (its position)."""

    def __init__(self, data):
        self.data, self.position = data, 0

    def __len__(self):
        return -(-len(self.data) // 4)

    def __iter__(self):
        start, self.position = self.position, 0
        for index in range(start, len(self)):
            self.position = index + 1
            items = [self.data[i] for i in range(4 * index, min(4 * index + 4, len(self.data)))]
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_loader_that_is_not_a_dataloader_resumes_from_its_own_state():
    """A mid-epoch checkpoint of a training loader with state_dict/load_state_dict that is no DataLoader: the resume
    continues from its state, bitwise the straight run (it raised AttributeError reading ``batch_sampler``, mut47)."""
    import copy
    from torch import nn
    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
    from aitoolbox.torchtrain.train_loop import TrainLoop
    from tests.helpers import MLP, assert_params_equal, classification_data

    class SaveAtBatch3(AbstractCallback):
        saved = None

        def on_batch_end(self):
            if self.train_loop_obj.total_iteration_idx == 2:
                self.saved = copy.deepcopy(self.train_loop_obj.checkpoint_state(mid_epoch=True))

    def loop():
        torch.manual_seed(0)
        model = MLP()
        return TrainLoop(model, OwnPositionLoader(classification_data(20)), None, None,
                         torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), end_auto_eval=False,
                         show_progress=False)

    saver = SaveAtBatch3("save")
    straight = loop()
    straight.fit(num_epochs=2, callbacks=[saver])
    resumed = loop()
    resumed.load_checkpoint(saver.saved)
    resumed.fit(num_epochs=2)
    assert_params_equal(resumed.model, straight.model)
