"""Continue an epoch's data where a run stopped, without loading the batches it already trained on.

A mid-epoch resume must give the rest of the epoch exactly as the uninterrupted run saw it: the same data order
(drawn again from the RNG state at the epoch's start) and the same batches after the ones trained. Loading and
discarding those batches does that but costs what they cost (``dataset[i]`` for every trained sample: most of
an epoch of I/O when resuming near its end). Three ways, the cheapest the loader allows:

* a loader with its own resumable state (torchdata's ``StatefulDataLoader``: ``state_dict`` and
  ``load_state_dict``) whose state a mid-epoch checkpoint saved: that state is loaded and the loader goes on
  from it, its sampler's order drawn again as the epoch drew it (:mod:`.sampler_replay`);
* a plain ``torch.utils.data.DataLoader`` over a map-style dataset: the sampler (or batch sampler) draws the
  trained batches' indices, so it consumes the random numbers the run consumed, but nothing is fetched; with
  worker processes (``num_workers > 0``) the workers get the same seeds and each remaining batch goes to the
  worker that loaded it in the uninterrupted run;
* anything else (an ``IterableDataset``, a loader class with its own iteration): the trained batches are loaded
  and discarded, as there is no index to skip to.

A DataLoader with ``persistent_workers=True`` keeps one worker iterator for the run (:class:`_WorkerIterator`,
made by the first epoch): only the first epoch draws the workers' base seed; the later ones reset the iterator and
draw nothing. That iterator's base seed is part of the run's RNG state (:func:`persistent_iterator_state`), and
restoring the state makes the loader's next epoch iterate as the uninterrupted run's would
(:func:`continue_persistent_iterator`).
"""
import logging
from typing import Any, Iterator, List, Optional, Sequence

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _DatasetKind, _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from aitoolbox.torchtrain.data.loader_info import has_own_state  # noqa: F401 (importable from here)
from aitoolbox.torchtrain.train_loop.random_state import capture_draw_state, restore_draw_state
from aitoolbox.torchtrain.train_loop.sampler_replay import continued_from_own_state

logger = logging.getLogger(__name__)

# The key of the persistent worker iterator's state in a run's RNG state (train_state.capture_rng_state).
ITERATOR_KEY = "loader_iterator"

# The DataLoader iterator internals the index skipping builds on (torch 2.x): another torch that lacks them gets
# the skipping by loading, slower but right.
_ITERATOR_INTERNALS_KNOWN = all(callable(getattr(iterator_class, name, None)) for iterator_class, name in (
    (_SingleProcessDataLoaderIter, "_next_index"), (_MultiProcessingDataLoaderIter, "_next_index"),
    (_MultiProcessingDataLoaderIter, "_try_put_index"), (_MultiProcessingDataLoaderIter, "_reset")))


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
    if batches_done > 0 and loader_state is not None and has_own_state(loader):
        return continued_from_own_state(loader, loader_state)
    if keeps_workers(loader):
        return _persistent_epoch(loader, batches_done)
    if batches_done <= 0:
        return iter(loader)
    if skips_by_index(loader):
        return _index_skipping_iterator(loader, batches_done)
    logger.debug("resuming the epoch by loading and discarding its first %d batch(es) (%s)", batches_done,
                 type(loader).__name__)
    return _loaded_and_discarded(iter(loader), batches_done)


def _loaded_and_discarded(iterator: Iterator[Any], count: int) -> Iterator[Any]:
    for _ in range(count):
        next(iterator)
    return iterator


def _index_skipping_iterator(loader: DataLoader, batches_done: int) -> Iterator[Any]:
    """The iterator ``iter(loader)`` would return (a loader whose workers do not persist), its first
    ``batches_done`` batches drawn but not fetched."""
    if loader.num_workers == 0:
        iterator = _IndexSkippingSingleProcessIter(loader)
        iterator.skip_batches(batches_done)  # now: the draws must precede the caller's RNG restore
        return iterator
    loader.check_worker_number_rationality()
    return _WorkerIterator(loader, skip=batches_done)


def _persistent_epoch(loader: DataLoader, skip: int) -> Iterator[Any]:
    """The epoch's iterator of a loader whose workers persist: the loader's one worker iterator (started now by the
    first epoch, else reset to the epoch's start as ``iter(loader)`` resets it), its first ``skip`` batches drawn
    but not sent to a worker."""
    iterator = loader._iterator
    if iterator is None:
        loader.check_worker_number_rationality()
        loader._iterator = _WorkerIterator(loader, skip=skip)  # the later epochs reset it
        return loader._iterator
    if isinstance(iterator, _WorkerIterator):
        iterator.skip_at_next_reset(skip)
        return iter(loader)  # DataLoader resets it (or starts it: a restored iterator starts on first use)
    # An iterator made by iterating the loader elsewhere (a user's loop before fit): the loader resets it, and the
    # skipped batches are loaded and discarded.
    return _loaded_and_discarded(iter(loader), skip)


def keeps_workers(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader (iterating as ``torch.utils.data.DataLoader`` does) whose worker processes
    persist from one epoch to the next (``persistent_workers=True``): then only its first ``iter`` starts workers and
    draws their base seed; the later ones reset that iterator and draw nothing."""
    return skips_by_index(loader) and loader.num_workers > 0 and bool(loader.persistent_workers)


def persistent_iterator_state(loader: Any) -> Optional[dict]:
    """What the RNG state of a run keeps of ``loader``'s persistent worker iterator (see :func:`keeps_workers`):
    ``{"base_seed": the iterator's base seed}``, or None as the seed before the first epoch started the workers;
    None for a loader whose workers do not persist."""
    if not keeps_workers(loader):
        return None
    iterator = loader._iterator
    return {"base_seed": None if iterator is None else int(iterator._base_seed)}


def continue_persistent_iterator(loader: Any, state: Optional[dict]) -> None:
    """Make the next ``iter(loader)`` what it was where ``state`` (:func:`persistent_iterator_state`) was captured.

    Before the run's first epoch started the workers (``base_seed`` None), ``iter(loader)`` starts them and draws
    their base seed: a worker iterator left from later in the run (an LR search, a rolled-back epoch, an interrupted
    ``fit``) is shut down. Afterwards, ``iter(loader)`` resets the run's iterator and draws nothing: a loader without
    it (a resumed run, another process) gets an iterator that starts on first use with the saved base seed (the same
    worker seeds), drawing nothing.
    """
    if state is None or not keeps_workers(loader):
        return
    wanted, current = state["base_seed"], loader._iterator
    if current is not None and wanted is not None:
        # The run's iterator goes on (it may be the one the current epoch iterates: never replaced).
        if int(current._base_seed) != int(wanted):
            logger.warning("the training loader's persistent workers run with base seed %d, the saved run's had %d: "
                           "their random state differs from the saved run's", current._base_seed, wanted)
        return
    if current is not None:
        current._shutdown_workers()
        loader._iterator = None
    if wanted is not None:
        loader._iterator = _WorkerIterator(loader, base_seed=int(wanted), start=False)


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


class _WorkerIterator(_MultiProcessingDataLoaderIter):
    """DataLoader's own multi-process iterator that can pass over an epoch's first batches and can continue a
    persistent iterator of an earlier run.

    Skipped batches (``skip``, or :meth:`skip_at_next_reset` before ``iter(loader)`` resets it) are drawn but never
    sent to a worker; the remaining batches are handed out round-robin from the worker that would have had the first
    of them, so each batch is loaded by the same worker (same seed, same ``get_worker_info().id``) as in the
    uninterrupted run.

    With ``base_seed`` the iterator is the uninterrupted run's persistent iterator going on: its workers get that base
    seed, and starting it draws nothing (the run reset its iterator here, which draws no base seed). With
    ``start=False`` the workers start when the loader first resets it (``iter(loader)``).
    """

    def __init__(self, loader: DataLoader, skip: int = 0, base_seed: Optional[int] = None, start: bool = True):
        self._batches_to_skip = skip  # read by _next_index, which the constructor's prefetching calls
        self._continued_seed = base_seed
        self._drawn_seed: Optional[int] = None
        self._draws_to_undo: Optional[dict] = None
        self._started = False
        if start:
            self._start(loader)

    def _start(self, loader: DataLoader) -> None:
        self._started = True
        if self._continued_seed is not None:
            self._draws_to_undo = capture_draw_state(loader)
        super().__init__(loader)

    # DataLoader's constructor assigns the base seed it draws; a continued iterator keeps the saved one instead.
    @property
    def _base_seed(self) -> Optional[int]:
        return self._continued_seed if self._continued_seed is not None else self._drawn_seed

    @_base_seed.setter
    def _base_seed(self, value: int) -> None:
        self._drawn_seed = value

    def skip_at_next_reset(self, count: int) -> None:
        """Pass over the first ``count`` batches of the epoch the next reset (``iter(loader)``) starts."""
        self._batches_to_skip = count

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        if not self._started:
            self._start(loader)  # its first reset primes the epoch
            return
        if first_iter and self._draws_to_undo is not None:
            # The constructor drew a base seed (and any draws of iter(sampler)): the run being continued did not.
            state, self._draws_to_undo = self._draws_to_undo, None
            restore_draw_state(state, loader)
        super()._reset(loader, first_iter)

    def _next_index(self) -> Any:
        if self._batches_to_skip:
            skip, self._batches_to_skip = self._batches_to_skip, 0
            _draw_indices(self._sampler_iter, skip)
            self._num_yielded += skip
            for _ in range(skip % self._num_workers):
                next(self._worker_queue_idx_cycle)
        return super()._next_index()

    def _shutdown_workers(self) -> None:
        if self._started:  # an iterator that never started has no workers (nor the attributes shutting down reads)
            super()._shutdown_workers()


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
