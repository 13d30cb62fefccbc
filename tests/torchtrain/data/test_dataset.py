"""BasicDataset and ListDataset, on their own and through a DataLoader."""
import pytest
import torch
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.data.dataset import BasicDataset, ListDataset


def test_basic_dataset_indexes_rows_of_a_tensor():
    data = torch.arange(12).reshape(6, 2)
    dataset = BasicDataset(data)
    assert len(dataset) == 6
    assert torch.equal(dataset[4], torch.tensor([8, 9]))
    batches = list(DataLoader(dataset, batch_size=4))
    assert torch.equal(torch.cat(batches), data)


def test_basic_dataset_over_a_list():
    dataset = BasicDataset(['a', 'b', 'c'])
    assert [dataset[i] for i in range(len(dataset))] == ['a', 'b', 'c']


def test_list_dataset_zips_ragged_lists():
    tokens = [[1], [2, 3], [4, 5, 6]]
    labels = [0, 1, 0]
    dataset = ListDataset(tokens, labels)
    assert len(dataset) == 3
    assert dataset[1] == ([2, 3], 1)

    loader = DataLoader(dataset, batch_size=2, collate_fn=lambda batch: list(zip(*batch)))
    batch_tokens, batch_labels = next(iter(loader))
    assert list(batch_tokens) == [[1], [2, 3]] and list(batch_labels) == [0, 1]


def test_list_dataset_rejects_lists_of_different_length():
    with pytest.raises(ValueError, match=r'\[2, 3\]'):
        ListDataset([1, 2], [1, 2, 3])


def test_list_dataset_needs_a_list():
    with pytest.raises(ValueError, match='at least one'):
        ListDataset()
