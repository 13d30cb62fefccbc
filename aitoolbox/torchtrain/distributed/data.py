"""Data loaders for distributed training: every DataLoader option kept, the sampler split across ranks."""
import logging
from typing import Iterable, Iterator, Optional, Tuple

from torch.utils.data import (
    DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler)

logger = logging.getLogger(__name__)

# DataLoader options carried over to the rebuilt loader, when the installed torch knows them.
_LOADER_OPTIONS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                   "pin_memory_device", "in_order")


class ContiguousDistributedSampler(Sampler[int]):
    """Rank r gets one contiguous block of the samples one process evaluates, without padding or shuffling.

    Concatenating the ranks' outputs in rank order gives every evaluated sample exactly once, in the order one
    process evaluates them, which is what exact evaluation needs (DistributedSampler repeats samples to even out
    the ranks).

    Args:
        dataset_size: the data set's length.
        rank: this process's rank.
        world_size: the number of processes.
        order: the indices one process evaluates, in order (the loader's own sampler, iterated afresh each time:
            it must yield the same indices in every process); None: the whole data set in order.
        full_batches_of: the loader's ``batch_size`` when it drops an incomplete last batch (``drop_last``): only
            the samples of its full batches are evaluated, as in one process; None: all of them.
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int, order: Optional[Iterable[int]] = None,
                 full_batches_of: Optional[int] = None):
        self.dataset_size = dataset_size
        self.rank, self.world_size = rank, world_size
        self.order = order
        self.full_batches_of = full_batches_of

    def _block(self, count: int) -> Tuple[int, int]:
        if self.full_batches_of:
            count -= count % self.full_batches_of
        return count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size

    def __iter__(self) -> Iterator[int]:
        if self.order is None:
            return iter(range(*self._block(self.dataset_size)))
        indices = list(self.order)
        start, stop = self._block(len(indices))
        return iter(indices[start:stop])

    def __len__(self) -> int:
        start, stop = self._block(self.dataset_size if self.order is None else len(self.order))
        return stop - start


def _loader_options(loader: DataLoader) -> dict:
    options = {}
    for name in _LOADER_OPTIONS:
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


def distributed_train_loader(loader: Optional[DataLoader], rank: int, world_size: int,
                             shuffle: Optional[bool] = None) -> Optional[DataLoader]:
    """The training loader of one rank: a DistributedSampler (equal batch counts on every rank, as DDP needs).

    Args:
        loader: the user's loader.
        rank: global rank.
        world_size: number of processes.
        shuffle: shuffle the data each epoch; None follows the loader's own sampler (RandomSampler or not).
    """
    if loader is None or not _is_shardable(loader):
        if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
            logger.warning("an IterableDataset cannot be split by a sampler: each rank reads it as it is, so shard "
                           "it yourself (e.g. using torch.distributed.get_rank() in __iter__)")
        return loader
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    seed = loader.generator.initial_seed() if loader.generator is not None else 0
    # The sampler pads rather than drops so that every sample is trained on; the loader's own drop_last
    # (dropping an incomplete last batch) is kept.
    sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed % 2 ** 63, drop_last=False)
    return DataLoader(loader.dataset, sampler=sampler, **_loader_options(loader))


def distributed_eval_loader(loader: Optional[DataLoader], rank: int, world_size: int) -> Optional[DataLoader]:
    """An evaluation loader of one rank: a contiguous block of the samples one process evaluates, no sample
    repeated.

    The samples are those the loader yields in one process: the data set in order for the default sampler and
    for a shuffling one (the order does not change a loss, and predictions come back in data-set order), and for a
    DistributedSampler (the training loader in a process is already split: the set is still the whole); the
    indices of a sampler of the user's own, as it yields them; with ``drop_last`` only the samples of the full
    batches. The ranks' batches then hold those samples without dropping any more of them.
    """
    if loader is None or not _is_shardable(loader):
        return loader
    sampler = loader.sampler
    # A DistributedSampler: the training loader of a process (its own share of the user's loader), or one the user
    # made; either way the data set is what is evaluated.
    in_dataset_order = isinstance(sampler, (SequentialSampler, DistributedSampler)) or (
        isinstance(sampler, RandomSampler) and not sampler.replacement
        and sampler.num_samples == len(loader.dataset))
    sampler = ContiguousDistributedSampler(len(loader.dataset), rank, world_size,
                                           order=None if in_dataset_order else sampler,
                                           full_batches_of=loader.batch_size if loader.drop_last else None)
    options = _loader_options(loader)
    options["drop_last"] = False  # the sampler kept the full batches' samples only
    return DataLoader(loader.dataset, sampler=sampler, **options)

