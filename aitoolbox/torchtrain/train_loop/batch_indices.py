"""Which samples an epoch's batches hold, drawn again from the epoch's random state without loading anything.

:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` names the samples of the batches it leaves out (through the
loop's :meth:`~aitoolbox.torchtrain.train_loop.train_loop.TrainLoop.batch_indices`): the sampler draws the epoch's
order again from the random state the epoch started with, and every random state is put back afterwards. Before it
returns to a kept point, it asks whether the epoch's order can be drawn again from that state at all
(:func:`order_not_drawn_again`: a sampler whose order the state does not hold would replay another one).
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
    if not positions:
        return None
    drawn = _drawn_batches(loader, epoch, epoch_start_rng, max(positions) + 1)
    if drawn is None:
        return None
    wanted = set(positions)
    return [index for position, batch in enumerate(drawn) if position in wanted for index in batch]


def order_not_drawn_again(loader: Any, epoch: int, epoch_start_rng: Optional[dict], batches: int) -> Optional[str]:
    """Why the first ``batches`` batches of epoch ``epoch`` (which the run trained) cannot be drawn again from
    ``epoch_start_rng``, as a rollback or a resume draws them; None where they can (or the loader cannot tell).

    Drawn twice from that state, a sampler whose order is all in the saved state gives the same batches, as many as
    the epoch had. One that shuffles with a generator of its own that its ``state_dict`` does not hold (saved as
    its random state in place of the generator) draws another order each time; one whose ``state_dict`` is its
    position in the epoch starts the order again at the position saved with the epoch's start (no batches after an
    epoch's end). Each draw puts every random state back afterwards, but a sampler's own state goes back only as far
    as its saved state reaches."""
    if batches <= 0:
        return None
    first = _drawn_batches(loader, epoch, epoch_start_rng, batches)
    if first is None:
        return None
    if len(first) < batches:
        return (f"from the random state saved at the start of epoch {epoch + 1} it gives {len(first)} batch(es) "
                f"where the epoch trained {batches} or more")
    if _drawn_batches(loader, epoch, epoch_start_rng, batches) != first:
        return (f"drawn twice from the random state saved at the start of epoch {epoch + 1} it gives two "
                "different orders")
    return None


def _drawn_batches(loader: Any, epoch: int, epoch_start_rng: Optional[dict], count: int
                   ) -> Optional[List[List[int]]]:
    """The dataset indices of each of the first ``count`` batches of epoch ``epoch`` drawn from ``epoch_start_rng``
    (fewer where the sampler ends first); None where the loader cannot tell (see :func:`batch_indices`)."""
    if epoch_start_rng is None or not skips_by_index(loader):
        return None
    saved = capture_draw_state(loader)
    with_epoch = [(sampler, sampler.epoch) for sampler in loader_samplers(loader)
                  if callable(getattr(sampler, "set_epoch", None)) and hasattr(sampler, "epoch")]
    try:
        for sampler, _ in with_epoch:
            sampler.set_epoch(epoch)
        restore_draw_state(epoch_start_rng, loader)
        sampler_iterator = _epoch_index_iterator(loader, epoch_start_rng)
        drawn: List[List[int]] = []
        for _ in range(count):
            try:
                batch = next(sampler_iterator)
            except StopIteration:
                break
            drawn.append([int(index) for index in (batch if isinstance(batch, (list, tuple)) else [batch])])
        return drawn
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
