"""Which loaders keep their position themselves: only one that can both save and restore it (a loader with
``state_dict`` alone would be asked to load a position it cannot). Written for the mutation run (tests/mutation/):
this mutant survived the rest of its selection."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.train_loop.data_position import has_own_state


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
