"""Which samples an epoch's batches hold, drawn again from the epoch's random state without loading anything.

:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` names the samples of the batches it leaves out (through the
loop's :meth:`~aitoolbox.torchtrain.train_loop.train_loop.TrainLoop.batch_indices`): the sampler draws the epoch's
order again from the random state the epoch started with, and every random state is put back afterwards.
"""
from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.data.sampler_state import loader_samplers
from aitoolbox.torchtrain.train_loop.data_position import ITERATOR_KEY, skips_by_index
from aitoolbox.torchtrain.train_loop.random_state import capture_draw_state, restore_draw_state


def batch_indices(loader: Any, epoch: int, epoch_start_rng: Optional[dict], positions: Sequence[int]
                  ) -> Optional[List[int]]:
    """The dataset indices of the batches at ``positions`` of epoch ``epoch`` of ``loader``, whose data order was
    drawn from ``epoch_start_rng`` (see :func:`~.train_state.capture_rng_state`; samplers with ``set_epoch``, such
    as DistributedSampler, are set to ``epoch``), drawn again from the sampler without fetching anything; None where
    the loader has no sampler to ask (an iterable dataset, a loader class with its own iteration) or the state is
    unknown. Every RNG state, the samplers' epochs and the loader's worker iterator are as before afterwards."""
    if epoch_start_rng is None or not skips_by_index(loader) or not positions:
        return None
    saved = capture_draw_state(loader)
    with_epoch = [(sampler, sampler.epoch) for sampler in loader_samplers(loader)
                  if callable(getattr(sampler, "set_epoch", None)) and hasattr(sampler, "epoch")]
    try:
        for sampler, _ in with_epoch:
            sampler.set_epoch(epoch)
        restore_draw_state(epoch_start_rng, loader)
        sampler_iterator = _epoch_index_iterator(loader, epoch_start_rng)
        wanted, indices = set(positions), []
        for position in range(max(positions) + 1):
            try:
                drawn = next(sampler_iterator)
            except StopIteration:
                break
            if position in wanted:
                indices.extend(int(index) for index in (drawn if isinstance(drawn, (list, tuple)) else [drawn]))
        return indices
    finally:
        restore_draw_state(saved, loader)
        for sampler, sampler_epoch in with_epoch:
            sampler.set_epoch(sampler_epoch)


def _epoch_index_iterator(loader: DataLoader, epoch_start_rng: dict) -> Iterator[Any]:
    """The index (or batch) iterator of the epoch, with the draws ``iter(loader)`` made before it, in its order:
    ``iter(sampler)``, the base seed (unless a persistent iterator was reset, which draws none) and, for a worker
    iterator starting, ``iter(sampler)`` again (its constructor resets itself)."""
    sampler_iterator = iter(loader._index_sampler)
    if (epoch_start_rng.get(ITERATOR_KEY) or {}).get("base_seed") is not None:
        return sampler_iterator
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    return iter(loader._index_sampler) if loader.num_workers > 0 else sampler_iterator
