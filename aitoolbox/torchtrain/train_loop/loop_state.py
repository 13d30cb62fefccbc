"""Where a training run is: the loop's counters and flags, in one object with one ``state_dict``.

:class:`TrainLoop` keeps a :class:`LoopState` as ``tl.state`` and offers its fields as the attributes aitoolbox
users and callbacks know (``tl.epoch``, ``tl.iteration``, ``tl.total_iteration_idx``, ...). Checkpoints, the
distributed launcher and the resume code save and restore the counters through :meth:`LoopState.state_dict` and
:meth:`LoopState.load_state_dict`, so that there is a single place that knows which counters a continuation needs.
"""
import dataclasses
from typing import Dict, Tuple, Union


@dataclasses.dataclass
class LoopState:
    """The counters and flags of a TrainLoop.

    Attributes:
        epoch: index of the current epoch (of the last one trained, after ``fit``).
        epochs_completed: epochs trained to their end over the life of the TrainLoop.
        iteration: index of the current batch within its epoch.
        total_iteration_idx: index of the last batch trained over the life of the TrainLoop (-1 before any).
        num_epochs: the epochs the current ``fit`` trains up to (a total).
        num_iterations: the batches the current ``fit`` trains up to (a total; 0 when training by epochs).
        grad_accumulation: batches per optimizer step in the current ``fit``.
        optimizer_step_due: the current batch ends with an optimizer step.
        optimizer_step_skipped: the last optimizer step was skipped (loss-scale overflow).
        stepped_optimizers: indices (into the loop's ``optimizers``) of the optimizers whose step the current
            ``on_after_optimizer_step`` follows: all of them, or, with a MultiLoss stepping its optimizers one
            after another, the one that just stepped (the hook then runs once per optimizer).
        early_stop: training was asked to stop (``TrainLoop.stop_training``: early stopping, a NaN loss...). The
            run is then finished: the request stays after ``fit`` and is saved in epoch-end checkpoints, so that a
            later ``fit``, also one resuming the run from a checkpoint, trains nothing (``tl.early_stop = False``
            trains on).
    """

    epoch: int = 0
    epochs_completed: int = 0
    iteration: int = 0
    total_iteration_idx: int = -1
    num_epochs: int = 0
    num_iterations: int = 0
    grad_accumulation: int = 1
    optimizer_step_due: bool = False
    optimizer_step_skipped: bool = False
    stepped_optimizers: Tuple[int, ...] = ()
    early_stop: bool = False

    # The position in the run; the other fields describe the current fit call and are set again by it.
    COUNTERS = ("epoch", "epochs_completed", "iteration", "total_iteration_idx")
    # Whether the run has ended, saved with the counters; states from before a flag existed leave it False.
    FLAGS = ("early_stop",)

    @property
    def iterations_done(self) -> int:
        """Batches trained over the life of the TrainLoop."""
        return self.total_iteration_idx + 1

    def state_dict(self) -> Dict[str, Union[int, bool]]:
        """The counters, as plain ints, and the flags, as bools."""
        state: Dict[str, Union[int, bool]] = {name: int(getattr(self, name)) for name in self.COUNTERS}
        state.update({name: bool(getattr(self, name)) for name in self.FLAGS})
        return state

    def load_state_dict(self, state: Dict[str, Union[int, bool]]) -> None:
        """Put back what :meth:`state_dict` returned. Counters missing from ``state`` keep their value; a flag
        missing from it (a state saved before the flag existed) is False.

        Raises:
            ValueError: ``state`` has keys that are not counters or flags of the loop.
        """
        known = self.COUNTERS + self.FLAGS
        unknown = sorted(set(state) - set(known))
        if unknown:
            raise ValueError(f"unknown loop counter(s) {unknown}: a loop state holds {list(known)}")
        for name in self.COUNTERS:
            if name in state:
                setattr(self, name, int(state[name]))
        for name in self.FLAGS:
            setattr(self, name, bool(state.get(name, False)))


class LoopStateField:
    """A TrainLoop attribute that reads and writes the field of the same name of ``tl.state``."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return getattr(instance.state, self.name)

    def __set__(self, instance, value) -> None:
        setattr(instance.state, self.name, value)
