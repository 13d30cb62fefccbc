"""aitoolbox 1.x's view of a TrainLoop: names 1.x callbacks and scripts call, served by this package's objects.

* :class:`MainProcessFlag`: ``tl.is_main_process`` reads as a bool (``if tl.is_main_process:``) and is also
  callable (``tl.is_main_process()``, as in 1.x).
* :class:`GradScalerView`: ``tl.amp_scaler``, the ``torch.amp.GradScaler`` methods 1.x code calls
  (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, ``is_enabled``, ``state_dict``...), carried out
  by the loop's :class:`~aitoolbox.torchtrain.precision.Precision`, so that a 1.x gradient-clipping callback
  that calls ``amp_scaler.unscale_(optimizer)`` unscales exactly once, as the loop expects.
* :func:`optimizer_update_due` and :func:`num_training_steps`: the answers of 1.x's
  ``should_execute_optimizer_update`` and ``get_num_training_steps``.
"""
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
    from aitoolbox.torchtrain.precision.precision import Precision
    from aitoolbox.torchtrain.train_loop.loop_state import LoopState


def optimizer_update_due(counters: "LoopState", num_batches: Optional[int]) -> bool:
    """True when the current batch ends with an optimizer step: every ``grad_accumulation`` batches, at the
    epoch's last batch (``num_batches``: the epoch's length, None if unknown), and at the last batch of a
    ``num_iterations`` run."""
    return counters.optimizer_step_due or (counters.iteration + 1) % counters.grad_accumulation == 0 \
        or (num_batches is not None and counters.iteration == num_batches - 1)


def num_training_steps(counters: "LoopState", num_batches: Optional[int]) -> int:
    """Optimizer steps the current ``fit`` takes over the whole run: exactly the steps the loop takes.

    The loop steps every ``grad_accumulation`` batches, at the last batch of every epoch (a window that does
    not divide the epoch) and at the last batch of a ``num_iterations`` run, so an epoch of ``n`` batches
    takes ``ceil(n / grad_accumulation)`` steps (aitoolbox 1.x floored, and undercounted). Training by epochs
    needs a sized train loader; by iterations without one, epochs are taken to be longer than the run.

    Raises:
        ValueError: training by epochs on a loader without a length.
    """
    accumulation = counters.grad_accumulation
    if counters.num_iterations > 0:
        if not num_batches:
            return -(-counters.num_iterations // accumulation)
        full_epochs, remainder = divmod(counters.num_iterations, num_batches)
        return full_epochs * -(-num_batches // accumulation) + -(-remainder // accumulation)
    if num_batches is None:
        raise ValueError("get_num_training_steps() needs len(train_loader) when training by num_epochs; the "
                         "loader has no length: train by num_iterations instead")
    return -(-num_batches // accumulation) * counters.num_epochs


class MainProcessFlag:
    """A truth value that can also be called: ``bool(flag)`` and ``flag()`` both give ``read()``.

    Args:
        read: returns the current value (the strategy may change when ``fit_distributed`` starts a process).
    """

    __slots__ = ("_read",)

    def __init__(self, read: Callable[[], bool]):
        self._read = read

    def __call__(self) -> bool:
        return self._read()

    def __bool__(self) -> bool:
        return self._read()

    def __eq__(self, other) -> bool:
        return self._read() == other

    def __hash__(self) -> int:
        return hash(self._read())

    def __repr__(self) -> str:
        return repr(self._read())

    def __reduce__(self):
        # Saved or sent to another process, the flag is the plain value it has in this process.
        return bool, (self._read(),)


class GradScalerView:
    """``torch.amp.GradScaler``'s methods over a TrainLoop's precision (``tl.amp_scaler`` of aitoolbox 1.x).

    aitoolbox 1.x built its GradScaler in the TrainLoop's constructor, so 1.x code may read it or load a state into
    it before ``fit``; the loop's precision exists only once the model is set up. Until then the view answers from
    the loss scaler the precision will start with, and a state loaded into it is handed over at set-up
    (:meth:`hand_over`). Reading the view never sets the model up.

    Args:
        precision_getter: returns the loop's Precision, or None before the model is set up.
        initial_scaler: returns the loss scaler the precision will start with (None: no loss scaling).
    """

    def __init__(self, precision_getter: Callable[[], Optional["Precision"]],
                 initial_scaler: Callable[[], Optional["LossScaler"]]):
        self._precision_getter = precision_getter
        self._initial_scaler = initial_scaler
        self._before_set_up: Optional["LossScaler"] = None
        self._loaded_before_set_up = False

    @property
    def _scaler(self) -> Optional["LossScaler"]:
        precision = self._precision_getter()
        if precision is not None:
            return precision.loss_scaler
        if self._before_set_up is None:
            self._before_set_up = self._initial_scaler()
        return self._before_set_up

    def _set_up_precision(self, method: str) -> "Precision":
        precision = self._precision_getter()
        if precision is None:
            raise RuntimeError(f"tl.amp_scaler.{method}() works on the gradients of a training step: call it from a "
                               "callback hook during fit (the model and its precision are set up when fit starts)")
        return precision

    def hand_over(self, precision: "Precision") -> None:
        """At set-up: a state loaded before (``load_state_dict``) goes to the precision's loss scaler."""
        if self._loaded_before_set_up and precision.loss_scaler is not None and self._before_set_up is not None:
            precision.loss_scaler.load_grad_scaler_state_dict(self._before_set_up.grad_scaler_state_dict())
        self._before_set_up, self._loaded_before_set_up = None, False

    def is_enabled(self) -> bool:
        """True when losses are scaled (float16, or a loss scale the user asked for)."""
        return self._scaler is not None

    def get_scale(self) -> float:
        """The current loss scale; 1.0 when no scaling is done (as a disabled GradScaler reports)."""
        scaler = self._scaler
        return 1.0 if scaler is None else float(scaler.loss_scale)

    def scale(self, outputs):
        """``outputs`` multiplied by the loss scale (a tensor, or a list/tuple/dict of tensors)."""
        scaler = self._scaler
        if scaler is None:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return scaler.scale(outputs)
        if isinstance(outputs, dict):
            return {key: self.scale(value) for key, value in outputs.items()}
        return type(outputs)(self.scale(value) for value in outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale (once per step, like GradScaler)."""
        self._set_up_precision("unscale_").unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Step ``optimizer`` unless its gradients overflowed; returns None as GradScaler does. The scale changes
        at the next :meth:`update`, as GradScaler's."""
        if args or kwargs:
            raise TypeError("amp_scaler.step(optimizer) takes no further arguments here: optimizer closures are not "
                            "supported with mixed precision")
        self._set_up_precision("step").step([optimizer], update_scale=False)

    def update(self, new_scale=None) -> None:
        """Update the scale for the steps since the last update; a ``new_scale`` sets it directly instead."""
        if new_scale is None:
            self._set_up_precision("update").update_scale()
            return
        scaler = self._scaler
        if scaler is not None:
            scaler.loss_scale = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            self._loaded_before_set_up = self._precision_getter() is None

    def state_dict(self) -> dict:
        """GradScaler's checkpoint keys (``scale``, ``growth_factor``, ...); empty when scaling is off."""
        scaler = self._scaler
        return {} if scaler is None else scaler.grad_scaler_state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` or by a ``torch.amp.GradScaler`` (aitoolbox 1.x files)."""
        scaler = self._scaler
        if scaler is not None and state:
            scaler.load_grad_scaler_state_dict(state)
            self._loaded_before_set_up = self._precision_getter() is None
