"""A training run kept in host memory, to return to later in the same processes.

A :class:`RunSnapshot` is the checkpoint :meth:`.RunState.capture` builds (model, optimizers, loss scaler and
amp's master weights, LR schedulers, callbacks' states, RNG states of every rank, counters, history), with every
tensor copied to the CPU, plus the loop's own progress that a checkpoint file does not need (a checkpoint loaded
and waiting for ``fit``, the point a ``fit`` stopped by an exception continues from). Restoring it goes through
the same code as resuming from a checkpoint file, so what holds for resume (bitwise equal to the run that never
stopped) holds for a snapshot too.

Used by what has to undo training inside one process: the LR finder (the run is as before the search) and
``SpikeRollback`` (the run goes back to the last clean interval).
"""
from typing import TYPE_CHECKING, Optional

from aitoolbox.torchtrain.host_copy import host_copy
from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume, apply_pending_states, restore_train_state

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop


class RunSnapshot:
    """The whole run at the moment :meth:`take` was called, in host memory.

    Take it in every process of a distributed run at the same point (capturing gathers the ranks' RNG states),
    either between epochs (``mid_epoch=False``: before ``fit``, or after an epoch's end) or inside an epoch right
    after an optimizer step (``mid_epoch=True``: where a mid-epoch checkpoint is saved).

    Not for a sharded model (FSDP): its full state lives whole only on rank 0; keep a checkpoint instead.
    """

    def __init__(self, checkpoint: dict, counters: dict, progress: dict, mid_epoch: bool):
        self._checkpoint = checkpoint
        self._counters = counters
        self._progress = progress
        self.mid_epoch = mid_epoch

    @classmethod
    def take(cls, tl: "TrainLoop", mid_epoch: bool) -> "RunSnapshot":
        """Copy the run of ``tl`` into host memory (setting ``tl`` up first, as ``fit`` would).

        Raises:
            ValueError: the model is sharded (FSDP).
        """
        if tl.strategy.shards_parameters:
            raise ValueError("an in-memory snapshot of a sharded (FSDP) run is not possible: each process holds only "
                             "its shards and the full state only on rank 0. Keep a checkpoint instead (for "
                             "SpikeRollback: snapshot='checkpoint' with a checkpoint callback registered)")
        tl.set_up()
        progress = tl.run_state.progress_beyond_checkpoint()
        checkpoint = host_copy(tl.run_state.capture(tl, mid_epoch=mid_epoch, include_pending=False))
        return cls(checkpoint, tl.state.state_dict(), progress, mid_epoch)

    def restore(self, tl: "TrainLoop") -> Optional[MidEpochResume]:
        """Put the run of ``tl`` back as it was when the snapshot was taken (a call in every process). The snapshot
        stays as it is: it can be restored again.

        Returns:
            For a snapshot taken inside an epoch, where the epoch continues (give it to the loop: its data order is
            drawn again and the batches trained skipped); None for one taken between epochs.
        """
        # A fresh copy each time: loading may keep the given tensors (an optimizer's state already on the right
        # device and dtype is not copied), and training would then change the snapshot.
        restore_train_state(tl, host_copy(self._checkpoint))
        resume = apply_pending_states(tl)
        tl.state.load_state_dict(self._counters)  # before fit, "epochs_completed" is not the checkpoint's epoch + 1
        tl.run_state.restore_progress_beyond_checkpoint(self._progress)
        return resume
