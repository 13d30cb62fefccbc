"""The request a callback raises to return the run to a point it kept (:class:`RollBack`).

Callbacks raise it (:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback`); the loop catches it and carries it out
(:mod:`aitoolbox.torchtrain.train_loop.rollback`). It lives with the callbacks, below the loop, so that raising it
needs nothing of the loop's modules.
"""
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop
    from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume


class RollBack(Exception):
    """Control flow, not an error: the run returns to a kept point (raised at the end of an optimizer step, in
    every process of a distributed run alike, and caught by ``TrainLoop._train``).

    Args:
        restore: puts the kept point back into the loop (a call in every process); returns where its epoch
            continues (None: at an epoch's start).
        skip: ``(epoch, position)`` of each batch to leave out from now on (positions in the epoch's batch order).
        record: what happened, appended to ``tl.rollbacks`` (None: a return to the point that leaves nothing out and
            is no rollback of a spike, e.g. SpikeRollback's before a stop signal's checkpoint).
    """

    def __init__(self, restore: Callable[["TrainLoop"], Optional["MidEpochResume"]],
                 skip: Sequence[Tuple[int, int]], record: Optional[dict]):
        super().__init__(f"roll back: {record}")
        self.restore = restore
        self.skip = list(skip)
        self.record = record
