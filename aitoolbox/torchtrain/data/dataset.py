"""Two small map-style datasets: one over an indexable collection, one zipping several lists."""
from typing import Any, Sequence, Tuple

from torch.utils.data import Dataset


class BasicDataset(Dataset):
    """A dataset whose samples are the rows (first dimension) of ``data``.

    Args:
        data: anything indexable with a length: a list, a tensor, a numpy array.
    """

    def __init__(self, data: Sequence[Any]):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> Any:
        return self.data[idx]


class ListDataset(Dataset):
    """The list counterpart of ``torch.utils.data.TensorDataset``: sample ``i`` is the tuple of every list's ``i``-th item.

    Useful for ragged data (sequences of different lengths) that cannot be stacked into one tensor; pair it with a
    ``collate_fn`` that keeps the items as lists, for example ``lambda batch: list(zip(*batch))``.

    Args:
        *data_lists: lists of equal length.

    Raises:
        ValueError: if no list is given or the lists differ in length.

    Example::

        dataset = ListDataset(token_ids, token_types, labels)
        ids, types, label = dataset[0]
    """

    def __init__(self, *data_lists: Sequence[Any]):
        if not data_lists:
            raise ValueError('ListDataset needs at least one data list.')
        lengths = [len(data_list) for data_list in data_lists]
        if len(set(lengths)) != 1:
            raise ValueError(f'ListDataset needs data lists of equal length, got lengths {lengths}.')
        self.data_lists = data_lists

    def __getitem__(self, index: int) -> Tuple[Any, ...]:
        return tuple(data_list[index] for data_list in self.data_lists)

    def __len__(self) -> int:
        return len(self.data_lists[0])
