"""Where a training run is: the loop's counters and flags, in one object with one ``state_dict``.

:class:`TrainLoop` keeps a :class:`LoopState` as ``tl.state`` and offers its fields as the attributes aitoolbox
users and callbacks know (``tl.epoch``, ``tl.iteration``, ``tl.total_iteration_idx``, ...). Checkpoints, the
distributed launcher and the resume code save and restore the counters through :meth:`LoopState.state_dict` and
:meth:`LoopState.load_state_dict`, so that there is a single place that knows which counters a continuation needs.
"""
import dataclasses
from typing import Dict


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
        early_stop: a request to stop training (``TrainLoop.stop_training``).
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
    early_stop: bool = False

    # The position in the run; the other fields describe the current fit call and are set again by it.
    COUNTERS = ("epoch", "epochs_completed", "iteration", "total_iteration_idx")

    @property
    def iterations_done(self) -> int:
        """Batches trained over the life of the TrainLoop."""
        return self.total_iteration_idx + 1

    def state_dict(self) -> Dict[str, int]:
        """The counters, as plain ints."""
        return {name: int(getattr(self, name)) for name in self.COUNTERS}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Put back what :meth:`state_dict` returned (counters missing from ``state`` keep their value).

        Raises:
            ValueError: ``state`` has keys that are not counters of the loop.
        """
        unknown = sorted(set(state) - set(self.COUNTERS))
        if unknown:
            raise ValueError(f"unknown loop counter(s) {unknown}: a loop state holds {list(self.COUNTERS)}")
        for name, value in state.items():
            setattr(self, name, int(value))


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
