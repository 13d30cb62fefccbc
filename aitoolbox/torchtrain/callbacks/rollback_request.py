"""The request a callback raises to return the run to a point it kept (:class:`RollBack`).

Callbacks raise it (:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback`); the loop catches it and carries it out
(:mod:`aitoolbox.torchtrain.train_loop.rollback`). It lives with the callbacks, below the loop, so that raising it
needs nothing of the loop's modules. With it, the words its records are named in (logs, errors, trackers' marks).
"""
import math
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


def describe_spike(record: dict) -> str:
    """What a rollback record (``tl.rollbacks``; or the spike of a ``SpikeRollbackError``) undid, named as what it
    was, epochs counted from 1 as the epoch's summary line counts them (the record keeps the 0-based index): a loss
    spike, a non-finite loss, or weights or optimizer states that a step left non-finite (review 49s R7).

    A record of a non-finite state says what is known, not a guess (review 50s W1): with a finite loss, a step was
    blamed, named by the batch whose gradients it took (with gradient accumulation, the first of its window; the
    state is known not finite after some step, which the blame puts on this one); with a non-finite loss, that
    batch was left out with the state not finite at the check (its own data, or the step before it, which a second
    rollback then blames: the two look alike)."""
    at = f"epoch {record['epoch'] + 1}, iteration {record['iteration']}"
    if record.get("non_finite_state"):
        if not math.isfinite(record["loss"]):
            return f"non-finite loss at {at}, with the weights or optimizer states not finite"
        return f"weights or optimizer states not finite after a step; blamed: the step with the gradients of {at}"
    if not math.isfinite(record["loss"]):
        return f"non-finite loss at {at}"
    return f"loss spike at {at}"


def spike_numbers(record: dict) -> str:
    """The numbers the judgement of :func:`describe_spike`'s batch went by: its loss, and for a loss spike the
    centre and limit it was judged against (which say nothing about a non-finite loss or state: NaN in the
    warmup)."""
    text = f"loss {record['loss']:.6g}"
    if describe_spike(record).startswith("loss spike"):
        text += f", median {record['median']:.6g}"
        if record.get("limit") is not None:
            text += f", limit {record['limit']:.6g}"
    return text


def describe_point(where: dict) -> str:
    """A kept point (``epoch``, ``iteration`` of the last batch trained before it; a record's ``restored``): a fit's
    start at an epoch's beginning (iteration -1, nothing of the epoch trained) is named as such (review 49x X4)."""
    if where["iteration"] < 0:
        return f"the fit's start (before epoch {where['epoch'] + 1}'s first batch)"
    return f"epoch {where['epoch'] + 1}, iteration {where['iteration']}"
