"""Data loaders for distributed training: every DataLoader option kept, the sampler split across ranks."""
import logging
from typing import Iterator, Optional

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

logger = logging.getLogger(__name__)

# DataLoader options carried over to the rebuilt loader, when the installed torch knows them.
_LOADER_OPTIONS = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                   "pin_memory_device", "in_order")


class ContiguousDistributedSampler(Sampler[int]):
    """Rank r gets one contiguous block of the data set, without padding or shuffling.

    Concatenating the ranks' outputs in rank order gives every sample exactly once, in data-set order, which
    is what exact evaluation needs (DistributedSampler repeats samples to even out the ranks).
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int):
        self.start = dataset_size * rank // world_size
        self.stop = dataset_size * (rank + 1) // world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


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
    """An evaluation loader of one rank: a contiguous block of the data, in order, no sample repeated."""
    if loader is None or not _is_shardable(loader):
        return loader
    sampler = ContiguousDistributedSampler(len(loader.dataset), rank, world_size)
    options = _loader_options(loader)
    options["drop_last"] = False
    return DataLoader(loader.dataset, sampler=sampler, **options)

