"""Where a ``fit`` stopped by an exception continues: the interrupted epoch's last optimizer step.

The loop marks a step point at every optimizer step (a tuple: the batches done and the batch index; the
epoch's loss sum committed up to there). When an exception leaves ``fit``, the point becomes a
:class:`~aitoolbox.torchtrain.train_loop.train_state.MidEpochResume`, which the next ``fit`` takes as a
mid-epoch checkpoint's: the epoch's data order is drawn again, the batches trained are skipped, and the
batches of a partly accumulated window are trained again on cleared gradients.
"""
import logging
from typing import Optional

from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume, capture_rng_state

logger = logging.getLogger(__name__)


class ContinuationAfterException:
    """A mixin of :class:`~aitoolbox.torchtrain.train_loop.train_loop.TrainLoop` (it uses the loop's state,
    epoch loss sum and train loader)."""

    def _mark_step_point(self) -> None:
        """Remember the last optimizer step of the epoch: an exception continues from there. (A tuple: this runs
        at every step, and the MidEpochResume is only needed if an exception comes.)"""
        self.epoch_loss.commit()
        self._step_point = (self._batches_done, self.state.total_iteration_idx)

    def _interruption_point(self) -> Optional[MidEpochResume]:
        """Where the next ``fit`` continues after an exception: the interrupted epoch's last optimizer step (the
        batches of a partly accumulated window are trained again) or, stopped in the epoch's end, that end."""
        point = self._step_point
        if point is None or isinstance(point, MidEpochResume):  # nothing trained yet, or stopped in the epoch's end
            return point
        batches_done, total_iteration_idx = point
        self.state.total_iteration_idx = total_iteration_idx
        committed = self.epoch_loss.committed
        return MidEpochResume(batches_done, None if committed is None else committed.tolist(),
                              self.epoch_start_rng_state, capture_rng_state(self.train_loader))

    def _remember_interruption(self) -> None:
        try:
            self._interrupted_at = self._interruption_point()
        except Exception:  # e.g. a device in an error state: the user must see their own exception, not this one
            logger.exception("Could not record where training stopped; the next fit restarts the epoch")
            self._interrupted_at = None

    def _take_interruption_point(self) -> Optional[MidEpochResume]:
        point, self._interrupted_at, self._step_point = self._interrupted_at, None, None
        if point is not None and self.strategy.is_main_process:
            logger.info("Continuing epoch %d where the last fit stopped (batch %d)", self.state.epoch,
                        point.batches_done)
        return point
