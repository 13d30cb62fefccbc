"""Continue a loader that keeps its own position (torchdata's ``StatefulDataLoader``) with the epoch's own order.

Such a loader saves where its sampler stood and, resumed, restores that position: a sampler with a ``state_dict``
of its own (torchdata's samplers) is loaded and iterated; one without is iterated anew and the indices it yielded
are passed over. Either way the sampler's order of the resumed epoch is drawn when its resumed iterator is built,
and that is another draw than the epoch's: the iterator has iterated the sampler once already (twice with worker
processes) and drawn a base seed, and the sampler draws from the random states these left (Python's or numpy's
global state, torch's, its own generator), or, drawing only at its first index, after the caller has put back
the random state of the save. The rest of the epoch would then follow another order than the one trained.

While the resumed iterator is built, the sampler the loader iterates again is stood in for by
:class:`_EpochStartReplay`: the loader's sampler (or batch sampler), or, where its iterator restores itself
(torchdata's ``BatchSampler``), the sampler that iterator batches. Every iteration after those a fresh iterator
makes starts from the random states the epoch's order was drawn from, and the states are as before it afterwards,
so the run's random numbers are drawn as the uninterrupted run drew them.

With ``persistent_workers=True`` the uninterrupted run made its worker iterator in its first epoch and reset it in
the later ones: a reset iterates the sampler once and draws no base seed. Which of the two the saved epoch did
shows in the saved base seed: the one the resumed iterator draws (from the epoch's starting state, as a new
iterator of that epoch drew it) or an earlier one.
"""
import itertools
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _DatasetKind

from aitoolbox.torchtrain.data.loader_info import has_own_state
from aitoolbox.torchtrain.data.sampler_state import (
    keyed_samplers, loader_generators, loader_samplers, sampler_draw_states)

# What a StatefulDataLoader's iterator saves about its sampler (torchdata 0.8 to 0.11): how many items it had
# drawn from it, and the state of the sampler's iterator where that iterator has one (then it restores itself).
_YIELDED_KEY = "_sampler_iter_yielded"
_ITERATOR_STATE_KEY = "_sampler_iter_state"
_BASE_SEED_KEY = "_base_seed"  # a multi-process iterator's: its workers' seeds follow from it
# Which iterator saved the state: a multi-process one keeps its main process's part in a snapshot, with its number
# of workers (torchdata asserts, bare, that the loading iterator has as many); a single-process one its count.
_SNAPSHOT_KEY, _MAIN_SNAPSHOT_KEY, _NUM_WORKERS_KEY = "_snapshot", "_main_snapshot", "_num_workers"
_NUM_YIELDED_KEY = "_num_yielded"


def continued_from_own_state(loader: Any, loader_state: Any) -> Iterator[Any]:
    """The iterator of ``loader`` (one with ``state_dict`` and ``load_state_dict``) continuing from ``loader_state``,
    the sampler's order drawn again as the epoch drew it.

    Args:
        loader: the training loader, its random states set to the epoch's start.
        loader_state: the loader's ``state_dict()`` saved with the mid-epoch checkpoint.
    """
    loader.load_state_dict(loader_state)
    target = _replayed_sampler(loader, loader_state)
    if target is None:
        # no sampler it iterates again (an iterable dataset), or not a DataLoader we know
        return _resumed_iterator(loader)
    owner, attribute, drawn, saved_base_seed = target
    sampler = getattr(owner, attribute)
    replay_class = _StatefulEpochStartReplay if has_own_state(sampler) else _EpochStartReplay
    replay = replay_class(sampler, loader, drawn, fresh_iterations=1 if loader.num_workers == 0 else 2,
                          saved_base_seed=saved_base_seed if loader.persistent_workers else None)
    # DataLoader refuses a new sampler once built; for the iterator's construction only (its iterations of the
    # sampler happen there), then the user's sampler is back in place. The iterator keeps the replay, which passes
    # through from then on.
    object.__setattr__(owner, attribute, replay)
    try:
        return _resumed_iterator(loader)
    finally:
        object.__setattr__(owner, attribute, sampler)
        replay.armed = False


def _resumed_iterator(loader: Any) -> Iterator[Any]:
    """``iter(loader)`` of a loader whose saved state is loaded; a sampler that yields fewer indices than the saved
    iterator had drawn is refused with what to do (torchdata passes over them with ``next`` and stops with a bare
    ``StopIteration``: review 49d r13).

    Raises:
        RuntimeError: the sampler ran out while the loader passed over the trained indices; the samplers whose
            ``state_dict`` was restored as their random state are named.
    """
    try:
        return iter(loader)
    except StopIteration:
        pass
    # Outside the except block: the bare StopIteration says nothing, and is not shown as the cause.
    positioned = [key for key, sampler in keyed_samplers(loader).items()
                  if all(callable(getattr(sampler, name, None)) for name in ("state_dict", "load_state_dict"))
                  and not callable(getattr(sampler, "random_state_dict", None))]
    cause = (f"the checkpoint restored the state_dict() of {', '.join(positioned)} as its random state, before the "
             "epoch's order is drawn again: a state_dict() that is a position in the epoch (how many indices were "
             "yielded) starts that order at the position, with fewer indices (under fit_distributed's sharding "
             "sampler, which draws the whole order at once: none). Keep the position in state_dict() and give "
             f"{', '.join(key.rsplit(':', 1)[0] for key in positioned)} random_state_dict() and "
             "load_random_state_dict() that save its random generator (an empty dict when it draws from the global "
             "random state), then train again from the start or from a checkpoint saved with them"
             if positioned else "the sampler draws fewer indices now than in the saved run (a smaller dataset, "
             "another sampler): build the training loader as in the saved run, or resume from an epoch-end "
             "checkpoint")
    raise RuntimeError(f"cannot resume the epoch of the training loader {type(loader).__name__} from the checkpoint's "
                       "mid-epoch loader state: its sampler yields fewer indices than the saved loader had drawn in "
                       f"this epoch, so the loader cannot pass over the trained ones. Likely: {cause}")


def check_loader_state_fits(loader: Any, loader_state: Any) -> None:
    """Refuse a saved state of a ``StatefulDataLoader`` that ``loader`` cannot continue from: one its iterator saved
    with another number of worker processes (torchdata's loading fails on it with a bare ``AssertionError`` once
    the resumed epoch starts; and the workers' share of the batches and their seeds were the saved number's).

    Raises:
        ValueError: the saved and the current ``num_workers``, and what to do instead.
    """
    saved = saved_num_workers(loader_state)
    current = getattr(loader, "num_workers", None)
    if saved is None or not isinstance(current, int) or saved == current:
        return
    raise ValueError(f"the checkpoint's training loader state was saved by a {type(loader).__name__} with "
                     f"num_workers={saved} in the middle of an epoch, and the training loader now has "
                     f"num_workers={current}: a mid-epoch resume continues the saved loader's iterator, which needs "
                     f"the same number of worker processes. Build the training loader with num_workers={saved} to "
                     "resume from this checkpoint, or resume from an epoch-end checkpoint (which "
                     "continues with any num_workers, in the order that number of workers draws: not the saved "
                     "run's)")


def saved_num_workers(loader_state: Any) -> Optional[int]:
    """The ``num_workers`` of the ``StatefulDataLoader`` iterator that saved ``loader_state`` (0: a single-process
    one); None where the state is not one of those (another loader class, no iterator saved)."""
    if not isinstance(loader_state, dict):
        return None
    snapshot = loader_state.get(_SNAPSHOT_KEY)
    if isinstance(snapshot, dict):
        main = snapshot.get(_MAIN_SNAPSHOT_KEY)
        saved = main.get(_NUM_WORKERS_KEY) if isinstance(main, dict) else None
        return saved if isinstance(saved, int) and not isinstance(saved, bool) else None
    return 0 if isinstance(loader_state.get(_NUM_YIELDED_KEY), int) else None


def _replayed_sampler(loader: Any, loader_state: Any) -> Optional[Tuple[Any, str, int, Optional[int]]]:
    """``(owner, attribute, drawn, base seed)``: the sampler the resumed iterator iterates again is
    ``owner.attribute``, the replay draws its first ``drawn`` items at once (those the loader passes over), and the
    saved iterator's workers had that base seed (None: not saved). None: nothing to replay."""
    if not isinstance(loader, DataLoader) or getattr(loader, "_dataset_kind", None) != _DatasetKind.Map:
        return None
    saved = _iterator_main_state(loader_state)
    if saved is None:
        return None
    attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    index_sampler = getattr(loader, attribute)
    base_seed = saved.get(_BASE_SEED_KEY) if isinstance(saved.get(_BASE_SEED_KEY), int) else None
    if saved.get(_ITERATOR_STATE_KEY) is None:
        # The loader iterates its index sampler again: it loads the sampler's own position (a stateful sampler),
        # or passes over the items the saved iterator had drawn, which the replay draws at once.
        return loader, attribute, 0 if has_own_state(index_sampler) else saved[_YIELDED_KEY], base_seed
    # The index sampler's iterator restores itself (torchdata's BatchSampler): it iterates the sampler it batches
    # again and passes over the samples it had yielded (or loads that sampler's position).
    inner = getattr(index_sampler, "sampler", None)
    if inner is None or not callable(getattr(inner, "__iter__", None)):
        return None
    return index_sampler, "sampler", 0, base_seed


def _iterator_main_state(state: Any) -> Optional[dict]:
    """The part of a saved StatefulDataLoader iterator state that describes its sampler: the single-process
    iterator's state, or the main process's snapshot of a multi-process one; None if absent."""
    if isinstance(state, dict):
        if isinstance(state.get(_YIELDED_KEY), int):
            return state
        for value in state.values():
            found = _iterator_main_state(value)
            if found is not None:
                return found
    return None


class _EpochStartReplay:
    """Stands in for a sampler while a resumed iterator is built.

    A fresh iterator of the loader iterates the sampler ``fresh_iterations`` times while it is built (torch's and
    torchdata's: once in one process, twice with workers, whose first ``_reset`` iterates it again); the order the
    epoch trains is the last of those, and they draw as the uninterrupted run's did. A resumed iterator then
    iterates it again, to load its position or fast-forward it. Each of those later iterations:

    * starts from the random states the last fresh one started from (Python's, numpy's and torch's global
      states, the loader's generators, the samplers' own states: :func:`sampler_draw_states`), so that a sampler
      drawing in ``__iter__`` draws the epoch's order again;
    * then puts back the states it found, which are the uninterrupted run's where it first asked the sampler for
      an index (the fresh iterations and the base seed drawn), so that a sampler drawing only at its first index
      draws as it did there: the first ``drawn`` items are drawn at once (the loader passes over them), and an
      iterator the loader does not fast-forward (a sampler restoring its own position) draws its first index from
      those states whenever the loader asks (:class:`_FirstIndexDrawnAt`), without changing the random states it
      then finds.

    With ``saved_base_seed`` (the saved iterator's, its workers persisting) the first iteration finds out whether
    the uninterrupted run made its iterator in this epoch: then the base seed the iterator draws next is the saved
    one. If not, the run reset an iterator made earlier, which iterated the sampler once and drew no base seed:
    only the first iteration is fresh, and the states the later ones put back are those after it (the base seed
    drawn since undone).

    After the iterator is built (``armed`` False) it passes through to the sampler.
    """

    def __init__(self, sampler: Any, loader: Any, drawn: int, fresh_iterations: int,
                 saved_base_seed: Optional[int] = None):
        self.sampler = sampler
        self.drawn = drawn
        self.armed = True
        self._fresh_iterations = fresh_iterations
        self._iterations = 0
        self._epoch_start: Optional[Callable[[], None]] = None
        self._first_index_states: Optional[Callable[[], None]] = None  # None: those the iteration finds
        self._saved_base_seed = saved_base_seed
        self._base_seed_generator: Optional[torch.Generator] = getattr(loader, "generator", None)
        # Fixed now, before the replay stands in for one of them.
        self._samplers = loader_samplers(loader)
        self._generators = loader_generators(loader)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        # Only for attributes the replay lacks (a sampler's own, e.g. a DistributedSampler's ``epoch``).
        if name == "sampler":  # not set yet (copying an object skips __init__): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def _draw_states(self) -> Callable[[], None]:
        return sampler_draw_states(self._samplers, self._generators)

    def _next_base_seed(self) -> int:
        """The base seed a new iterator draws next (as ``_BaseDataLoaderIter`` does), drawn from a copy."""
        copy = torch.Generator()
        source = self._base_seed_generator
        copy.set_state(source.get_state() if source is not None else torch.get_rng_state())
        return int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())

    def __iter__(self) -> Iterator[Any]:
        if not self.armed:
            return iter(self.sampler)
        self._iterations += 1
        if self._iterations <= self._fresh_iterations:
            self._epoch_start = self._draw_states()
            iterator = iter(self.sampler)
            if self._iterations == 1 and self._saved_base_seed is not None \
                    and self._next_base_seed() != self._saved_base_seed:
                self._fresh_iterations = 1  # the run reset its persistent iterator (see the class's description)
                self._first_index_states = self._draw_states()
            return iterator
        put_back = self._first_index_states or self._draw_states()
        if self._epoch_start is not None:
            self._epoch_start()
        iterator = iter(self.sampler)
        put_back()
        if self.drawn > 0:
            first = list(itertools.islice(iterator, self.drawn))
            return itertools.chain(first, iterator)
        if not has_own_state(self.sampler) or has_own_state(iterator):
            # The loader passes over the indices drawn at once (it asks for them now), or restores the iterator
            # itself (torchdata's RandomSampler, which drew in its __init__).
            return iterator
        return _FirstIndexDrawnAt(iterator, self._draw_states(), self._draw_states)


class _StatefulEpochStartReplay(_EpochStartReplay):
    """The replay of a sampler with a position of its own: the loader saves and loads it through the replay (which
    the iterator keeps for the epoch), as it would through the sampler."""

    def state_dict(self) -> Any:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state)


class _FirstIndexDrawnAt:
    """A sampler's iterator whose first ``next`` runs under the random states ``at`` puts back, after which those
    it found are put back (``capture`` takes them): where it draws the epoch's order then, it draws it as the
    uninterrupted run did, and the random numbers of the rest of the run stay as they were."""

    def __init__(self, iterator: Iterator[Any], at: Callable[[], None], capture: Callable[[], Callable[[], None]]):
        self._iterator = iterator
        self._at: Optional[Callable[[], None]] = at
        self._capture = capture

    def __iter__(self) -> "_FirstIndexDrawnAt":
        return self

    def __next__(self) -> Any:
        if self._at is None:
            return next(self._iterator)
        at, self._at = self._at, None
        put_back = self._capture()
        at()
        try:
            return next(self._iterator)
        finally:
            put_back()
