"""What the loop and the callbacks ask of a loader and its batches, below both: a batch's size, a loader's length,
and its generators' random states kept across a pass that must not change the run's data order."""
import contextlib
from typing import Any, Iterator, List, Optional

import torch


def batch_size_of(batch_data: Any) -> Optional[int]:
    """Number of samples in a batch: the first dimension of its first tensor, searched depth first."""
    if isinstance(batch_data, torch.Tensor):
        return batch_data.shape[0] if batch_data.dim() > 0 else 1
    if isinstance(batch_data, dict):
        batch_data = list(batch_data.values())
    if isinstance(batch_data, (list, tuple)):
        for element in batch_data:
            size = batch_size_of(element)
            if size is not None:
                return size
    return None


def loader_length(loader: Any) -> Optional[int]:
    """``len(loader)`` when the loader knows it (an IterableDataset may not)."""
    try:
        return len(loader)
    except TypeError:
        return None


@contextlib.contextmanager
def preserved_generator_states(generators: List[torch.Generator]) -> Iterator[None]:
    """Restore the generators' states on exit."""
    states = [generator.get_state() for generator in generators]
    try:
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
