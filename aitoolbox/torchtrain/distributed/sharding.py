"""Each process's share of the order the user's own sampler draws.

``fit_distributed`` does not replace the training loader's sampler: it wraps it. Every process draws the user's
sampler's whole order for the epoch, alike, and process ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of
it (the interleaving of torch's ``DistributedSampler``). So a ``SubsetRandomSampler`` still trains only its
subset, a ``WeightedRandomSampler`` still draws by its weights, a bucketing batch sampler still makes its batches
(sharded as whole batches), and the union of what the processes train in an epoch is what the sampler drew.

The order is padded at its end with its own first positions, so that every process gets as many samples (batches)
and DDP's processes take as many steps, as ``DistributedSampler`` pads: ``ceil(N / W) * W - N < W`` of them.

The draw must be the same in every process. A sampler that draws from its own generator (``RandomSampler(...,
generator=g)``, a bucketing sampler's ``random.Random``) does, as every process starts with the same copy of it
(``fit_distributed`` checks that the copies agree). A sampler that draws from the global random state
(``RandomSampler`` without a generator, ``SubsetRandomSampler``, ``WeightedRandomSampler``) would not: the processes'
global states differ (dropout on batches of another size, a per-rank seed). So the draw runs with the global
states of torch, ``random`` and numpy set, for its duration only, from a seed every process shares and the epoch
(``seed + epoch``); the processes' own global states are put back afterwards, untouched.
"""
import contextlib
import random
from typing import Any, Iterator, List

import numpy as np
import torch
from torch.utils.data import Sampler


@contextlib.contextmanager
def shared_global_random_state(seed: int) -> Iterator[None]:
    """Within the block, the global random states of torch (CPU), ``random`` and numpy are seeded with ``seed``;
    afterwards they are as before the block."""
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def padded(order: List[Any], world_size: int) -> List[Any]:
    """``order`` with its first items appended (again, if needed) up to a multiple of ``world_size``."""
    if not order:
        return order
    total = -(-len(order) // world_size) * world_size
    return (order * (total // len(order) + 1))[:total]


class ShardedSampler(Sampler):
    """Process ``rank``'s share of the order ``sampler`` draws (see the module's description).

    Setting an attribute the user's sampler has (other than this wrapper's own ``sampler``, ``rank``,
    ``world_size``, ``seed`` and ``epoch``) sets it on the user's sampler, and its instance attributes read
    through: ``tl.train_loader.sampler.weights = ...`` changes what is drawn, as in one process.

    Args:
        sampler: the user's sampler (or batch sampler: then the shares are whole batches); it must have ``__len__``.
        rank: this process's rank.
        world_size: the number of processes.
        seed: the seed, the same in every process, of the global random state the sampler draws with.
    """

    def __init__(self, sampler: Any, rank: int, world_size: int, seed: int = 0):
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.epoch = 0

    # The wrapper's own attributes; any other the user's sampler has is the user's (see __setattr__).
    _OWN_ATTRIBUTES = ("sampler", "rank", "world_size", "seed", "epoch")

    def __setattr__(self, name: str, value: Any) -> None:
        # Code written for one process changes the training sampler through tl.train_loader.sampler (hard-example
        # weights, a curriculum's indices); under fit_distributed that is this wrapper, and the value must reach
        # the sampler that draws, or it would be ignored silently.
        wrapped = self.__dict__.get("sampler")
        if name not in self._OWN_ATTRIBUTES and not name.startswith("__") and wrapped is not None \
                and hasattr(wrapped, name):
            setattr(wrapped, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Called only for names the wrapper lacks: the user's sampler's own data attributes (its instance
        # attributes; not its methods, such as a state_dict torchdata would take for a position) read through.
        wrapped = self.__dict__.get("sampler")
        if wrapped is not None and not name.startswith("_") and name in getattr(wrapped, "__dict__", {}):
            return getattr(wrapped, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sampler!r}, rank={self.rank}, world_size={self.world_size})"

    @property
    def num_replicas(self) -> int:
        """The number of processes (DistributedSampler's name: a loader sharded already is not sharded again)."""
        return self.world_size

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next order is drawn for (the loop sets it at every epoch's start)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.world_size)

    def epoch_order(self) -> List[Any]:
        """The whole order the user's sampler draws this epoch, as every process draws it."""
        with shared_global_random_state((self.seed + self.epoch) % 2 ** 63):
            return list(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the order is drawn at the first index, as torch's samplers draw theirs (after iter(loader)
        # drew the workers' base seed).
        yield from padded(self.epoch_order(), self.world_size)[self.rank::self.world_size]

    # Not state_dict(): torchdata's StatefulDataLoader would take it for the position in the epoch.
    def random_state_dict(self) -> dict:
        """The shared seed (saved with the run's random state, so that a resumed run draws the same orders)."""
        return {"seed": self.seed}

    def load_random_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])


class ShardedBatchSampler(ShardedSampler):
    """Process ``rank``'s share of the batches a user's batch sampler draws: whole batches, batch ``r``, ``r + W``,
    ... of the epoch (the loader's ``batch_sampler``)."""
