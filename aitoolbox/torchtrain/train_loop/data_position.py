"""Continue an epoch's data where a run stopped, without loading the batches it already trained on.

A mid-epoch resume must give the rest of the epoch exactly as the uninterrupted run saw it: the same data order
(drawn again from the RNG state at the epoch's start) and the same batches after the ones trained. Loading and
discarding those batches does that but costs what they cost (``dataset[i]`` for every trained sample: most of
an epoch of I/O when resuming near its end). Three ways, the cheapest the loader allows:

* a loader with its own resumable state (torchdata's ``StatefulDataLoader``: ``state_dict`` and
  ``load_state_dict``) whose state a mid-epoch checkpoint saved: that state is loaded and the loader goes on
  from it;
* a plain ``torch.utils.data.DataLoader`` over a map-style dataset: the sampler (or batch sampler) draws the
  trained batches' indices, so it consumes the random numbers the run consumed, but nothing is fetched; with
  worker processes (``num_workers > 0``) the workers get the same seeds and each remaining batch goes to the
  worker that loaded it in the uninterrupted run;
* anything else (an ``IterableDataset``, a loader class with its own iteration): the trained batches are loaded
  and discarded, as there is no index to skip to.
"""
import logging
from typing import Any, Iterator, List, Optional, Sequence

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter, _DatasetKind, _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter)

logger = logging.getLogger(__name__)

# The DataLoader iterator internals the index skipping builds on (torch 2.x): another torch that lacks them gets
# the skipping by loading, slower but right.
_ITERATOR_INTERNALS_KNOWN = all(callable(getattr(iterator_class, name, None)) for iterator_class, name in (
    (_SingleProcessDataLoaderIter, "_next_index"), (_MultiProcessingDataLoaderIter, "_next_index"),
    (_MultiProcessingDataLoaderIter, "_try_put_index"), (_MultiProcessingDataLoaderIter, "_reset")))


def has_own_state(loader: Any) -> bool:
    """Whether ``loader`` saves and restores its position itself (e.g. torchdata's ``StatefulDataLoader``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def skips_by_index(loader: Any) -> bool:
    """Whether the trained batches of ``loader`` can be skipped by their indices alone: a DataLoader that iterates
    as ``torch.utils.data.DataLoader`` does (a subclass may change how) over a map-style dataset."""
    if not _ITERATOR_INTERNALS_KNOWN or not isinstance(loader, DataLoader) \
            or getattr(loader, "_dataset_kind", None) != _DatasetKind.Map:
        return False
    loader_class = type(loader)
    return loader_class.__iter__ is DataLoader.__iter__ and loader_class._get_iterator is DataLoader._get_iterator


def resumed_epoch(loader: Any, batches_done: int, loader_state: Optional[Any] = None) -> Iterator[Any]:
    """An iterator over the batches of ``loader``'s epoch after its first ``batches_done``.

    The random numbers the skipped part of the epoch drew are drawn now, before returning (the caller puts the
    saved RNG state back afterwards, which must find the draws done).

    Args:
        loader: the training loader, its RNG state set to the epoch's start.
        batches_done: batches of the epoch already trained.
        loader_state: the loader's own state saved with them (a loader with :func:`has_own_state`), or None.
    """
    if batches_done <= 0:
        return iter(loader)
    if loader_state is not None and has_own_state(loader):
        loader.load_state_dict(loader_state)
        return iter(loader)
    if skips_by_index(loader):
        iterator = _index_skipping_iterator(loader, batches_done)
        if iterator is not None:
            return iterator
    logger.debug("resuming the epoch by loading and discarding its first %d batch(es) (%s)", batches_done,
                 type(loader).__name__)
    iterator = iter(loader)
    for _ in range(batches_done):
        next(iterator)
    return iterator


def _index_skipping_iterator(loader: DataLoader, batches_done: int) -> Optional[Iterator[Any]]:
    """The iterator ``iter(loader)`` would return, its first ``batches_done`` batches drawn but not fetched;
    None where the loader's persistent workers already run an iterator (it is reset, not built, so the
    fetching path serves)."""
    if loader.num_workers == 0:
        iterator = _IndexSkippingSingleProcessIter(loader)
        iterator.skip_batches(batches_done)  # now: the draws must precede the caller's RNG restore
        return iterator
    if loader.persistent_workers:
        if loader._iterator is not None:
            return None
        loader.check_worker_number_rationality()
        loader._iterator = _IndexSkippingMultiProcessIter(loader, batches_done)  # later epochs reuse its workers
        return loader._iterator
    loader.check_worker_number_rationality()
    return _IndexSkippingMultiProcessIter(loader, batches_done)


def _draw_indices(sampler_iterator: Iterator[Any], count: int) -> None:
    for _ in range(count):
        try:
            next(sampler_iterator)
        except StopIteration:  # past the epoch's end: the iterator's next draw ends the epoch, as fetching would
            return


class _IndexSkippingSingleProcessIter(_SingleProcessDataLoaderIter):
    """DataLoader's own single-process iterator that can pass over batches without fetching them."""

    def skip_batches(self, count: int) -> None:
        _draw_indices(self._sampler_iter, count)
        self._num_yielded += count


class _IndexSkippingMultiProcessIter(_MultiProcessingDataLoaderIter):
    """DataLoader's own multi-process iterator, its first ``skip`` batches drawn but never sent to a worker.

    The workers start with the same base seed as in the uninterrupted run (it is drawn where the DataLoader
    draws it), and the remaining batches are handed out round-robin from the worker that would have had the
    first of them, so each batch is loaded by the same worker (same seed, same ``get_worker_info().id``).
    """

    def __init__(self, loader: DataLoader, skip: int):
        self._batches_to_skip = skip  # read by _next_index, which the constructor's prefetching calls
        super().__init__(loader)

    def _next_index(self) -> Any:
        if self._batches_to_skip:
            skip, self._batches_to_skip = self._batches_to_skip, 0
            _draw_indices(self._sampler_iter, skip)
            self._num_yielded += skip
            for _ in range(skip % self._num_workers):
                next(self._worker_queue_idx_cycle)
        return super()._next_index()


def epoch_without(loader: Any, start: int, skipped: Sequence[int], loader_state: Optional[Any] = None
                  ) -> Iterator[Any]:
    """The batches of ``loader``'s epoch from loader position ``start`` on, without those at the positions
    ``skipped`` (positions in the epoch's own batch order; a rollback of
    :class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` removed them): the loop sees an epoch that never held
    them. Draws the random numbers of the part before ``start`` now, as :func:`resumed_epoch` does.

    A skipped batch is passed over by its indices where the loader allows (single-process DataLoader over a
    map-style dataset: nothing is fetched, as a loader that never yields it); otherwise it is loaded and discarded.
    """
    pending = sorted(position for position in set(skipped) if position >= start)
    if not pending:
        return resumed_epoch(loader, start, loader_state)
    if skips_by_index(loader) and loader.num_workers == 0 and not (loader_state is not None and has_own_state(loader)):
        iterator: Any = _IndexSkippingSingleProcessIter(loader)
        iterator.skip_batches(start)
    else:
        iterator = resumed_epoch(loader, start, loader_state)
    return _leaving_out(iterator, start, pending)


def _leaving_out(iterator: Iterator[Any], position: int, pending: List[int]) -> Iterator[Any]:
    skip_by_index = isinstance(iterator, _IndexSkippingSingleProcessIter)
    pending_set = set(pending)
    last_skipped = pending[-1]
    while True:
        if position > last_skipped:  # nothing left to leave out: the loader's own iteration from here
            yield from iterator
            return
        if position in pending_set:
            if skip_by_index:
                iterator.skip_batches(1)
            else:
                try:
                    next(iterator)
                except StopIteration:
                    return
        else:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
        position += 1


def batch_indices(loader: Any, epoch: int, epoch_start_rng: Optional[dict], positions: Sequence[int]
                  ) -> Optional[List[int]]:
    """The dataset indices of the batches at ``positions`` of epoch ``epoch`` of ``loader``, whose data order was
    drawn from ``epoch_start_rng`` (see :func:`~.train_state.capture_rng_state`; a sampler with ``set_epoch``, such
    as DistributedSampler, is set to ``epoch``), drawn again from the sampler without fetching anything; None where
    the loader has no sampler to ask (an iterable dataset, a loader class with its own iteration) or the state is
    unknown. Every RNG state, and the sampler's epoch, is as before afterwards."""
    from aitoolbox.torchtrain.train_loop.train_state import capture_rng_state, restore_rng_state
    if epoch_start_rng is None or not skips_by_index(loader) or not positions:
        return None
    saved = capture_rng_state(loader)
    sampler = getattr(loader, "sampler", None)
    sampler_epoch = getattr(sampler, "epoch", None) if callable(getattr(sampler, "set_epoch", None)) else None
    try:
        if sampler_epoch is not None:
            sampler.set_epoch(epoch)
        restore_rng_state(epoch_start_rng, loader)
        iterator = _BaseDataLoaderIter(loader)  # draws the base seed where iter(loader) does: same sampler draws
        wanted, indices = set(positions), []
        for position in range(max(positions) + 1):
            try:
                drawn = iterator._next_index()
            except StopIteration:
                break
            if position in wanted:
                indices.extend(int(index) for index in (drawn if isinstance(drawn, (list, tuple)) else [drawn]))
        return indices
    finally:
        restore_rng_state(saved, loader)
        if sampler_epoch is not None:
            sampler.set_epoch(sampler_epoch)
