"""Data loaders for distributed training: every DataLoader option kept, the user's sampler sharded across ranks."""
import copy
import hashlib
import itertools
import logging
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler,
    SubsetRandomSampler)

from aitoolbox.torchtrain.distributed.sharding import ShardedBatchSampler, ShardedSampler, shared_global_random_state
from aitoolbox.torchtrain.data.sampler_state import (
    capture_sampler_states, keyed_samplers, loader_samplers, preserved_random_states)

logger = logging.getLogger(__name__)

# DataLoader options carried over to the rebuilt loader, when the installed torch knows them.
_LOADER_OPTIONS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                   "pin_memory_device", "in_order")


class ContiguousDistributedSampler(Sampler[int]):
    """Rank r gets one contiguous block of the data set (or of ``indices``), without padding or shuffling.

    Concatenating the ranks' outputs in rank order gives every sample exactly once, in data-set order (the order of
    ``indices``), which is what exact evaluation needs (DistributedSampler repeats samples to even out the ranks).
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int, indices: Optional[List[int]] = None,
                 full_batches_of: Optional[int] = None):
        self.indices = indices
        size = dataset_size if indices is None else len(indices)
        if full_batches_of:  # a loader that drops its incomplete last batch evaluates its full batches' samples only
            size -= size % full_batches_of
        self.start = size * rank // world_size
        self.stop = size * (rank + 1) // world_size

    def __iter__(self) -> Iterator[int]:
        if self.indices is not None:
            return iter(self.indices[self.start:self.stop])
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def _loader_options(loader: DataLoader, plain: bool = False) -> dict:
    """The options to rebuild ``loader`` with; ``plain``: only those torch's DataLoader takes (an evaluation loader
    is a plain DataLoader whatever the user's class: it has no position to save, so torchdata's
    ``snapshot_every_n_steps`` has no use there and DataLoader would refuse it)."""
    options = {}
    names = _LOADER_OPTIONS if plain else _LOADER_OPTIONS + ("snapshot_every_n_steps",)  # (torchdata's option)
    for name in names:
        if hasattr(loader, name):
            options[name] = getattr(loader, name)
    if options.get("num_workers", 0) == 0:
        # DataLoader refuses these with num_workers=0 even at their defaults on some versions.
        options.pop("prefetch_factor", None)
        options.pop("persistent_workers", None)
    return options


def _is_shardable(loader) -> bool:
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return False
    default_batching = loader.batch_size is not None
    if not default_batching:
        logger.warning("a DataLoader with a custom batch_sampler is used as is under distributed training: every "
                       "rank sees all of its batches. Shard it yourself, or pass batch_size and a sampler instead.")
    return default_batching


def _rank_aware(sampler: Any) -> bool:
    """A sampler that shards by itself: torch's DistributedSampler, or one with its ``num_replicas`` and ``rank``."""
    return isinstance(sampler, DistributedSampler) or (
        sampler is not None and hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"))


def _user_sampler(loader: DataLoader) -> Tuple[Any, bool]:
    """The sampler that decides the loader's order and whether it is a batch sampler (the loader's own
    ``batch_sampler``, given instead of ``batch_size`` and ``sampler``). A loader without automatic batching
    (``batch_size=None`` and no batch sampler: each item is a batch) has its ``sampler``, sharded item by item."""
    if loader.batch_size is None and loader.batch_sampler is not None:
        return loader.batch_sampler, True
    return loader.sampler, False


def _rank_aware_part(sampler: Any, is_batch_sampler: bool) -> Any:
    if _rank_aware(sampler):
        return sampler
    inner = getattr(sampler, "sampler", None) if is_batch_sampler else None
    return inner if _rank_aware(inner) else None


def _plain_random(sampler: Any) -> bool:
    """A RandomSampler drawing a permutation of its whole data set (``DataLoader(shuffle=True)``'s)."""
    return isinstance(sampler, RandomSampler) and not sampler.replacement and \
        sampler.num_samples == len(sampler.data_source)


def check_train_loader(loader: Any, world_size: int, shuffle: Optional[bool] = None, rank: Optional[int] = None
                       ) -> None:
    """Refuse a training loader that ``fit_distributed`` cannot shard as its sampler draws; nothing else is checked
    (a loader that is not a map-style DataLoader is used as it is, see :func:`distributed_train_loader`).

    Args:
        loader: the user's training loader.
        world_size: the number of processes.
        shuffle: ``False``: train in data-set order (``train_data_shuffle=False``); None: as the sampler draws.
        rank: this process's rank; None in the launching process, whose loader every process gets a copy of.

    Raises:
        ValueError: what cannot be sharded, and what to do instead.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return
    sampler, is_batch_sampler = _user_sampler(loader)
    kind = "batch sampler" if is_batch_sampler else "sampler"
    name = type(sampler).__name__
    own_shards = _rank_aware_part(sampler, is_batch_sampler)
    if own_shards is not None:
        _check_rank_aware(own_shards, world_size, rank)
        if shuffle is False and getattr(own_shards, "shuffle", False):
            raise ValueError(f"train_data_shuffle=False, but the training loader's {type(own_shards).__name__} "
                             "shuffles (shuffle=True), and fit_distributed uses a sampler that shards by itself as "
                             "given: build it with shuffle=False, or leave train_data_shuffle=True")
        return
    if type(loader) not in _rebuildable_loader_classes():
        raise ValueError(f"the training loader is a {type(loader).__name__}, which fit_distributed cannot rebuild "
                         f"with its {kind} sharded across the processes (it rebuilds torch's DataLoader and "
                         "torchdata's StatefulDataLoader only, keeping every option). Pass a DataLoader, or build the "
                         "loader in each process (in_process_data_load=InMultiProcessDataLoad(...)) with a "
                         "DistributedSampler, which is used as given")
    if not callable(getattr(sampler, "__len__", None)):
        raise ValueError(f"the training loader's {kind} {name} has no __len__: fit_distributed must know the length "
                         "of an epoch's order to give every process as many batches (DDP's processes step "
                         f"together). Give {name} a __len__, or shard it yourself (a {kind} taking num_replicas and "
                         "rank, used as given)")
    if shuffle is False and not (_plain_random(sampler) or isinstance(sampler, SequentialSampler) or (
            isinstance(sampler, BatchSampler) and isinstance(sampler.sampler, SequentialSampler))):
        raise ValueError(f"train_data_shuffle=False trains in data-set order in place of a RandomSampler's "
                         f"permutation (DataLoader(shuffle=True)); the training loader's {kind} is a {name}, whose "
                         "order fit_distributed keeps as it is: leave train_data_shuffle=True (the default) and give "
                         f"the loader the {kind} you want")


def _check_rank_aware(sampler: Any, world_size: int, rank: Optional[int]) -> None:
    name = type(sampler).__name__
    if sampler.num_replicas != world_size:
        raise ValueError(f"the training loader's {name} was built for {sampler.num_replicas} processes (num_replicas) "
                         f"and this job has {world_size}: build it in each process with the job's world size, "
                         "e.g. DistributedSampler(dataset) once the process group exists (in_process_data_load="
                         "InMultiProcessDataLoad(...)), or give the loader a plain sampler, which fit_distributed "
                         "shards itself")
    if (rank is None and world_size > 1) or (rank is not None and sampler.rank != rank):
        where = f"process of rank {rank}" if rank is not None else "launching process"
        raise ValueError(f"the training loader's {name} was built for rank {sampler.rank} of {sampler.num_replicas} "
                         f"and is used in the {where}: every process would train rank {sampler.rank}'s share. Build "
                         "it in each process (in_process_data_load=InMultiProcessDataLoad(...)), where "
                         "DistributedSampler(dataset) takes the process's own rank, or give the loader a plain "
                         "sampler, which fit_distributed shards itself")


def _rebuildable_loader_classes() -> Tuple[type, ...]:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is optional
        return (DataLoader,)
    return DataLoader, StatefulDataLoader


def distributed_train_loader(loader: Optional[DataLoader], rank: int, world_size: int,
                             shuffle: Optional[bool] = None, seed: int = 0) -> Optional[DataLoader]:
    """The training loader of one rank: the user's loader with its sampler sharded (:mod:`.sharding`).

    * a sampler that shards by itself (a ``DistributedSampler``, or one with ``num_replicas`` and ``rank``; as a
      batch sampler's ``sampler`` too) is used as given, the loader unchanged;
    * any other sampler (or batch sampler) is wrapped in a :class:`~.sharding.ShardedSampler` (a
      :class:`~.sharding.ShardedBatchSampler`) and the loader rebuilt around it with every other option kept, as
      a ``DataLoader`` or a torchdata ``StatefulDataLoader`` (still stateful);
    * a loader over an ``IterableDataset``, or an iterable that is no DataLoader, has no sampler to shard: it is
      used as it is, with a warning (each process reads all of it unless it shards itself).

    Args:
        loader: the user's loader.
        rank: global rank.
        world_size: number of processes.
        shuffle: False trains a ``RandomSampler``'s data set in its order instead (``train_data_shuffle=False``);
            None keeps the sampler's order.
        seed: the seed, the same in every process, of the global random state the user's sampler draws with.

    Raises:
        ValueError: a loader that cannot be sharded (see :func:`check_train_loader`).
    """
    if loader is None:
        return None
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        what = "an IterableDataset" if isinstance(loader, DataLoader) else f"a {type(loader).__name__}"
        logger.warning("the training loader iterates %s, which has no sampler to split: each process reads all of "
                       "it, so shard it yourself (e.g. by torch.distributed.get_rank() in __iter__)", what)
        return loader
    check_train_loader(loader, world_size, shuffle, rank)
    sampler, is_batch_sampler = _user_sampler(loader)
    if _rank_aware_part(sampler, is_batch_sampler) is not None:
        return loader
    options = _loader_options(loader)
    if is_batch_sampler:
        for name in ("batch_size", "drop_last"):  # given by the batch sampler
            options.pop(name, None)
        return type(loader)(loader.dataset, batch_sampler=ShardedBatchSampler(sampler, rank, world_size, seed),
                            **options)
    if shuffle is False and _plain_random(sampler):
        sampler = SequentialSampler(sampler.data_source)
    return type(loader)(loader.dataset, sampler=ShardedSampler(sampler, rank, world_size, seed), **options)


def equal_batch_counts_by_construction(loader: Any) -> bool:
    """Whether every process's ``loader`` yields as many batches by construction: its sampler (batch sampler) is
    the sharding wrapper, which pads the order to a multiple of the processes, or torch's ``DistributedSampler``,
    which pads or drops to an equal share. Any other loader (an ``IterableDataset`` the user shards, a sampler of
    the user's with ``num_replicas`` and ``rank``, an iterable that is no DataLoader) may give uneven counts."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return False
    sampler, _ = _user_sampler(loader)
    return isinstance(sampler, (ShardedSampler, DistributedSampler)) or (
        isinstance(sampler, BatchSampler) and isinstance(sampler.sampler, (ShardedSampler, DistributedSampler)))


def evaluation_indices(loader: DataLoader) -> Optional[List[int]]:
    """The samples an evaluation loader's sampler covers, in its order; None: the whole data set in order.

    A sampler that visits the whole data set (sequential, a permutation, one that shards itself or the wrapper of
    the training loader's sampler around one of those) gives None; a ``SubsetRandomSampler`` (a validation split)
    its indices as listed; any other sampler the order it draws, from a seed every process shares (its own random
    state as it was afterwards, so evaluating does not change a training order).
    """
    sampler = loader.sampler
    if isinstance(sampler, ShardedSampler):  # the training loader, evaluated: the user's sampler
        sampler = sampler.sampler
    if _rank_aware(sampler) or isinstance(sampler, SequentialSampler) or _plain_random(sampler):
        return None
    if isinstance(sampler, SubsetRandomSampler):
        return [_plain_key(index) for index in sampler.indices]
    return [_plain_key(index) for index in _drawn_alike(loader, sampler)]


def _plain_key(key: Any) -> Any:
    """``key`` as the dataset receives it, a one-element tensor or numpy number made a Python number (a list of
    them is cheaper to split and pickle); any other key (a string, an ``(index, scale)`` pair) kept as it is."""
    if isinstance(key, torch.Tensor) and key.numel() == 1:
        return key.item()
    if isinstance(key, np.generic):
        return key.item()
    return key


def _drawn_alike(loader: DataLoader, sampler: Any) -> List[Any]:
    """The order ``sampler`` (of ``loader``) draws from a seed every process shares; every random state it draws
    from is as before afterwards."""
    with preserved_random_states(loader), shared_global_random_state(0):
        return list(sampler)


def _batch_sampler_eval_loader(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    """An evaluation loader with a batch sampler of its own: this rank's contiguous block of the batches it draws
    (from a seed every process shares; the training loader's sharding wrapper is looked through), whole."""
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, ShardedBatchSampler):
        batch_sampler = batch_sampler.sampler
    batches = [[_plain_key(index) for index in batch] for batch in _drawn_alike(loader, batch_sampler)]
    block = batches[len(batches) * rank // world_size:len(batches) * (rank + 1) // world_size]
    options = _loader_options(loader, plain=True)
    for name in ("batch_size", "drop_last"):  # given by the batch sampler
        options.pop(name, None)
    return DataLoader(loader.dataset, batch_sampler=block, **options)


def _unbatched_eval_loader(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    """An evaluation loader without automatic batching (``batch_size=None``: each item the sampler draws is one
    batch, e.g. a dataset whose items are whole batches): this rank's contiguous block of the items, each loaded as
    the user's loader loads it. A sampler that shards by itself (not a DistributedSampler: split exactly) is used
    as it is."""
    if _rank_aware(loader.sampler) and not isinstance(loader.sampler, (DistributedSampler, ShardedSampler)):
        _check_eval_rank_aware(loader.sampler, rank, world_size)
        return loader
    indices = evaluation_indices(loader)
    block = ContiguousDistributedSampler(len(loader.dataset), rank, world_size, indices)
    options = _loader_options(loader, plain=True)
    for name in ("batch_size", "drop_last"):  # no automatic batching: one item is one batch
        options.pop(name, None)
    return DataLoader(loader.dataset, sampler=block, batch_size=None, **options)


def peek_seed() -> int:
    """A seed drawn from this process's global torch random state, which is left as it was (the run's random
    stream is the same with one process or several)."""
    state = torch.get_rng_state()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.set_rng_state(state)
    return seed


def sampler_random_state_digest(loader: Any) -> str:
    """A digest of what the training loader's samplers draw their orders from: the torch generators they hold,
    their own random states (:mod:`~aitoolbox.torchtrain.data.sampler_state`) and a DistributedSampler's
    seed. Processes whose digests differ would draw different orders."""
    digest = hashlib.sha256()
    if not isinstance(loader, DataLoader):
        return digest.hexdigest()
    for sampler in loader_samplers(loader):
        if isinstance(sampler, DistributedSampler):
            _feed(digest, ("DistributedSampler", sampler.seed, sampler.shuffle))
        generator = getattr(sampler, "generator", None)
        if isinstance(generator, torch.Generator) and not _rank_aware(sampler):
            _feed(digest, generator.get_state())
    # (A sampler that shards by itself may keep its rank in its state: only the others' states must agree.)
    rank_aware = [key for key, sampler in keyed_samplers(loader).items()
                  if _rank_aware(sampler) and not isinstance(sampler, ShardedSampler)]
    states = capture_sampler_states(loader)
    _feed(digest, {key: state for key, state in states.items() if key not in rank_aware})
    return digest.hexdigest()


_ORDER_HEAD = 4096  # keys of the sampler's order compared between the processes (sharded_order_digest)


def sharded_order_digest(loader: Any) -> Tuple[str, int, str]:
    """The class name, the length and a digest of the first keys of the order the user's sampler inside ``loader``'s sharding
    wrapper draws in this process, drawn as the wrapper draws it (from the shared seed); ``("", 0, "")`` for a
    loader used as given.

    Sharding positions ``r, r + W, ...`` of that order is right only when every process draws the same order. A
    sampler that shards by itself without saying so (it reads ``torch.distributed.get_rank()`` in ``__iter__``, or
    wraps a ``DistributedSampler`` it builds itself, with no ``num_replicas`` and ``rank``) draws its own part in
    each process, and sharding that again would train a fraction of it silently: the processes' digests tell.
    The draw is made on a deep copy of the sampler (sharing the data set and the loader, which it may hold), so
    that the check advances nothing of the sampler's, however deep its random state or counters lie; one that
    cannot be deep-copied is drawn from a shallow copy, with its random states put back afterwards.
    """
    wrappers = [sampler for sampler in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None))
                if isinstance(sampler, ShardedSampler)]
    if not wrappers:
        return "", 0, ""
    wrapper = wrappers[0]
    user_sampler = _private_copy(wrapper.sampler, loader)
    with preserved_random_states(loader), shared_global_random_state(wrapper.seed % 2 ** 63):
        # The order's head tells a sampler drawing per process; drawing all of it (and hashing each key in Python)
        # would cost seconds to minutes at the start of every fit on a data set of millions of samples.
        head = [_plain_key(key) if not isinstance(key, (list, tuple)) else [_plain_key(item) for item in key]
                for key in itertools.islice(iter(user_sampler), _ORDER_HEAD)]
    try:
        length = len(user_sampler)
    except TypeError:
        length = len(head)
    digest = hashlib.sha256()
    _feed(digest, head)
    return type(wrapper.sampler).__name__, length, digest.hexdigest()


def _private_copy(sampler: Any, loader: Any) -> Any:
    """A copy of ``sampler`` to draw from without changing it: deep (its generators and counters its own, at any
    depth), sharing the loader and its data set; else shallow (a counter it advances in ``__iter__`` stays the
    user's own); else the sampler itself (its random states are put back by the caller)."""
    shared = {id(loader): loader}
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        shared[id(dataset)] = dataset
    for make_copy in (lambda: copy.deepcopy(sampler, shared), lambda: copy.copy(sampler)):
        try:
            return make_copy()
        except Exception:  # e.g. a lock or an open file inside: the next, shallower way
            continue
    return sampler


def _feed(digest: Any, value: Any) -> None:
    """Feed ``value`` to ``digest`` in a form that is the same in every process for equal values."""
    if isinstance(value, torch.Tensor):
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode() + value.tobytes())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    else:
        text = repr(value)
        digest.update((text if " at 0x" not in text else type(value).__name__).encode())  # no memory addresses


def check_eval_loader(loader: Any, which: str) -> None:
    """Refuse an evaluation loader that ``fit_distributed`` cannot split across the processes without changing what
    it yields: a subclass of ``DataLoader`` (other than torchdata's ``StatefulDataLoader``) whose sampler does not
    shard by itself. Each process evaluates a ``DataLoader`` rebuilt around its share of the samples, and the
    subclass's own behaviour (its ``__iter__``, its own arguments) would be lost silently.

    Args:
        loader: the evaluation loader (anything; only a DataLoader subclass over a map-style dataset is checked).
        which: what the loader is, for the message (e.g. "validation").

    Raises:
        ValueError: naming the loader's class and what to do instead.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) \
            or type(loader) in _rebuildable_loader_classes():
        return
    if _rank_aware_part(*_user_sampler(loader)) is not None:
        return  # it shards by itself: evaluated as it is
    name = type(loader).__name__
    raise ValueError(f"the {which} loader is a {name}, a DataLoader subclass: fit_distributed evaluates with a "
                     f"DataLoader rebuilt around each process's share of the samples, which would drop what {name} "
                     "does itself (and give another loss than one process). Pass a torch DataLoader (move the "
                     "subclass's work into the dataset or a collate_fn), or build the loader in each process "
                     "(in_process_data_load=InMultiProcessDataLoad(...)) with a sampler that shards by itself "
                     "(DistributedSampler(dataset, shuffle=False)), which is evaluated as it is")


def _shards_a_choice_of_its_own(loader: Any) -> bool:
    """Whether ``loader``'s sampler shards by itself (``num_replicas`` and ``rank``) and is not torch's
    ``DistributedSampler``, whose shards together are the whole data set (evaluated split exactly instead, without
    its padding): the union of such a sampler's shards is its own choice (a subset), so it is evaluated as it shards."""
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset) \
        and loader.batch_size is not None and _rank_aware(loader.sampler) \
        and not isinstance(loader.sampler, (DistributedSampler, ShardedSampler))


def _check_eval_rank_aware(sampler: Any, rank: int, world_size: int) -> None:
    name = type(sampler).__name__
    if sampler.num_replicas != world_size or sampler.rank != rank:
        raise ValueError(f"an evaluation loader's {name} shards by itself for rank {sampler.rank} of "
                         f"{sampler.num_replicas}, and is used in the process of rank {rank} of {world_size}: the "
                         "processes would evaluate the wrong parts. Build it in each process (in_process_data_load="
                         "InMultiProcessDataLoad(...)) with the process's rank and the job's world size, or give the "
                         "loader a plain sampler, which fit_distributed splits itself")


def distributed_eval_loader(loader: Optional[DataLoader], rank: int, world_size: int) -> Optional[DataLoader]:
    """An evaluation loader of one rank: a contiguous block of the samples the loader's sampler covers, in order,
    no sample repeated (see :func:`evaluation_indices`); with ``drop_last`` only the samples of the full batches, as
    one process evaluates them; with a batch sampler of its own, a contiguous block of the batches it makes. A
    ``DataLoader`` subclass whose sampler shards by itself is used as it is; one whose sampler does not is refused
    (:func:`check_eval_loader`). A sampler that shards by itself (``num_replicas`` and ``rank``; not torch's
    ``DistributedSampler``, whose shards are the whole data set) is evaluated as it shards: each process its part.

    Raises:
        ValueError: a ``DataLoader`` subclass that cannot be split (see :func:`check_eval_loader`); a sampler that
            shards by itself for another rank or number of processes.
    """
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset) \
            and type(loader) not in _rebuildable_loader_classes():
        check_eval_loader(loader, "evaluation")
        return loader  # a subclass whose sampler shards by itself: its behaviour kept
    if _shards_a_choice_of_its_own(loader):
        _check_eval_rank_aware(loader.sampler, rank, world_size)
        return loader  # each process evaluates its own part, the sums of all combined
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset) \
            and loader.batch_size is None and loader.batch_sampler is None:
        return _unbatched_eval_loader(loader, rank, world_size)
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset) \
            and loader.batch_size is None and _rank_aware_part(loader.batch_sampler, True) is None:
        return _batch_sampler_eval_loader(loader, rank, world_size)
    if loader is None or not _is_shardable(loader):
        return loader
    sampler = ContiguousDistributedSampler(len(loader.dataset), rank, world_size, evaluation_indices(loader),
                                           full_batches_of=loader.batch_size if loader.drop_last else None)
    options = _loader_options(loader, plain=True)
    options["drop_last"] = False  # the sampler kept the full batches' samples only
    return DataLoader(loader.dataset, sampler=sampler, **options)

