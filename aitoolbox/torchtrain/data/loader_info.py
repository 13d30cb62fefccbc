"""What the loop and the callbacks ask of a loader and its batches, below both: a batch's size, a loader's length,
its generators' random states kept across a pass that must not change the run's data order, and whether it
resets its own worker iterator between epochs."""
import contextlib
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader


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


def has_own_state(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own state (``state_dict`` and ``load_state_dict``): a loader its
    position in the epoch (torchdata's ``StatefulDataLoader``), a sampler its position or its random state."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def resets_own_iterator(loader: Any) -> bool:
    """Whether ``loader`` keeps its own position (:func:`has_own_state`) and resets its worker
    iterator for the next epoch (``persistent_workers=True``, the iterator made): the next epoch iterates its
    sampler once and its workers keep their seeds. A run resumed at that epoch's start cannot do the same: the
    loader it builds makes a new iterator (its sampler iterated twice, a new base seed drawn), so its data order and
    the workers' random states differ from the uninterrupted run's. A mid-epoch checkpoint holds the iterator's
    state and resumes bitwise."""
    return isinstance(loader, DataLoader) and has_own_state(loader) and loader.num_workers > 0 \
        and bool(loader.persistent_workers) and getattr(loader, "_iterator", None) is not None
