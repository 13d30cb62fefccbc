"""Rolling a run back inside ``fit``: the loop's side of :class:`~aitoolbox.torchtrain.callbacks.SpikeRollback`.

A callback that finds the run has gone wrong since a point it kept (a :class:`~.run_snapshot.RunSnapshot`, or a
mid-epoch checkpoint) asks the loop to return there: at the end of an optimizer step, after every callback's
``on_batch_end`` (:meth:`.RunState.call_after_step`), it raises
:class:`~aitoolbox.torchtrain.callbacks.rollback_request.RollBack`. ``TrainLoop._train``'s epoch
loop catches it, lets :func:`roll_back` put the kept point back, and continues from there with the
:class:`~.train_state.MidEpochResume` it returns (the point may lie in an earlier epoch: the history, counters and
callbacks' states go back with it).

What a rollback must not undo lives in :class:`RollbackHistory` (``tl.run_state.rollbacks``): the batches left
out since (their positions in their epoch's batch order), which the replay and every later epoch leave out as if
the loader never yielded them, and the record of each rollback. Both are part of the run's state and of its
checkpoints (key ``"rollbacks"``; a checkpoint without it has nothing left out), so that a run resumed from a
checkpoint written after a rollback skips the same batches.
"""
import bisect
import copy
import dataclasses
import logging
from typing import TYPE_CHECKING, Dict, List, Optional

from aitoolbox.torchtrain.callbacks.rollback_request import RollBack  # noqa: F401 (the loop catches it from here)
from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

#: The checkpoint key of :meth:`RollbackHistory.state_dict`.
CHECKPOINT_KEY = "rollbacks"


@dataclasses.dataclass
class RollbackHistory:
    """The rollbacks of a run: the batches left out and a record of each rollback (survives the rollbacks).

    Attributes:
        skipped: epoch -> sorted positions (in that epoch's batch order, as the loader yields them) left out.
        records: one dict per rollback, oldest first (see ``SpikeRollback`` for the keys).
    """

    skipped: Dict[int, List[int]] = dataclasses.field(default_factory=dict)
    records: List[dict] = dataclasses.field(default_factory=list)

    def positions(self, epoch: int) -> List[int]:
        """The positions left out of ``epoch`` (sorted; empty for most epochs)."""
        return self.skipped.get(epoch, [])

    def skip(self, epoch: int, position: int) -> None:
        positions = self.skipped.setdefault(epoch, [])
        if position not in positions:
            bisect.insort(positions, position)

    def loader_position(self, epoch: int, iteration: int) -> int:
        """The loader position (in the epoch's full batch order) of the batch the loop numbers ``iteration``."""
        position = iteration
        for skipped in self.positions(epoch):
            if skipped <= position:
                position += 1
            else:
                break
        return position

    def loader_start(self, epoch: int, batches_done: int) -> int:
        """The loader position after ``batches_done`` batches of ``epoch`` were trained (those left out in
        between passed over too)."""
        return self.loader_position(epoch, batches_done - 1) + 1 if batches_done > 0 else 0

    def epoch_length(self, epoch: int, num_batches: Optional[int]) -> Optional[int]:
        """The epoch's number of batches without those left out (None: the loader's length is unknown)."""
        if num_batches is None:
            return None
        return num_batches - sum(1 for position in self.positions(epoch) if position < num_batches)

    def state_dict(self) -> dict:
        """Plain lists and numbers (loads with ``torch.load(weights_only=True)``)."""
        return {"skipped": [[epoch, position] for epoch in sorted(self.skipped) for position in self.skipped[epoch]],
                "records": copy.deepcopy(self.records)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Put back what :meth:`state_dict` returned; None (a checkpoint from before rollbacks existed): nothing."""
        self.skipped, self.records = {}, []
        for epoch, position in (state or {}).get("skipped", []):
            self.skip(int(epoch), int(position))
        self.records = copy.deepcopy(list((state or {}).get("records", [])))


def roll_back(tl: "TrainLoop", request: RollBack) -> Optional[MidEpochResume]:
    """Put the point ``request`` names back into ``tl`` (a call in every process) and return where training goes on.

    What the restore puts back is the run as it was then, its rollback history included: the history as it is now
    (earlier rollbacks, their skipped batches) is kept, with this rollback's added.
    """
    kept = tl.run_state.rollbacks.state_dict()
    resume = request.restore(tl)
    history = tl.run_state.rollbacks
    history.load_state_dict(kept)
    for epoch, position in request.skip:
        history.skip(epoch, position)
    if request.record is not None:  # (None: a return that leaves nothing out, e.g. before a stop signal's checkpoint)
        history.records.append(request.record)
    return resume

