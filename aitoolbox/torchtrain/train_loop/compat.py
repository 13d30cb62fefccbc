"""aitoolbox 1.x's view of a TrainLoop: names 1.x callbacks and scripts call, served by this package's objects.

* :class:`MainProcessFlag`: ``tl.is_main_process`` reads as a bool (``if tl.is_main_process:``) and is also
  callable (``tl.is_main_process()``, as in 1.x).
* :class:`GradScalerView`: ``tl.amp_scaler``, the ``torch.amp.GradScaler`` methods 1.x code calls
  (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, ``is_enabled``, ``state_dict``...), carried out
  by the loop's :class:`~aitoolbox.torchtrain.precision.Precision`, so that a 1.x gradient-clipping callback
  that calls ``amp_scaler.unscale_(optimizer)`` unscales exactly once, as the loop expects.
"""
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.precision.precision import Precision


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

    Args:
        precision_getter: returns the loop's current Precision (set up on first use).
    """

    def __init__(self, precision_getter: Callable[[], "Precision"]):
        self._precision_getter = precision_getter

    @property
    def _precision(self) -> "Precision":
        return self._precision_getter()

    def is_enabled(self) -> bool:
        """True when losses are scaled (float16, or a loss scale the user asked for)."""
        return self._precision.loss_scaler is not None

    def get_scale(self) -> float:
        """The current loss scale; 1.0 when no scaling is done (as a disabled GradScaler reports)."""
        scaler = self._precision.loss_scaler
        return 1.0 if scaler is None else float(scaler.loss_scale)

    def scale(self, outputs):
        """``outputs`` multiplied by the loss scale (a tensor, or a list/tuple/dict of tensors)."""
        scaler = self._precision.loss_scaler
        if scaler is None:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return scaler.scale(outputs)
        if isinstance(outputs, dict):
            return {key: self.scale(value) for key, value in outputs.items()}
        return type(outputs)(self.scale(value) for value in outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale (once per step, like GradScaler)."""
        self._precision.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Step ``optimizer`` unless its gradients overflowed; returns None as GradScaler does. The scale changes
        at the next :meth:`update`, as GradScaler's."""
        if args or kwargs:
            raise TypeError("amp_scaler.step(optimizer) takes no further arguments here: optimizer closures are not "
                            "supported with mixed precision")
        self._precision.step([optimizer], update_scale=False)

    def update(self, new_scale=None) -> None:
        """Update the scale for the steps since the last update; a ``new_scale`` sets it directly instead."""
        scaler = self._precision.loss_scaler
        if new_scale is None:
            self._precision.update_scale()
        elif scaler is not None:
            scaler.loss_scale = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)

    def state_dict(self) -> dict:
        """GradScaler's checkpoint keys (``scale``, ``growth_factor``, ...); empty when scaling is off."""
        scaler = self._precision.loss_scaler
        return {} if scaler is None else scaler.grad_scaler_state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict` or by a ``torch.amp.GradScaler`` (aitoolbox 1.x files)."""
        scaler = self._precision.loss_scaler
        if scaler is not None and state:
            scaler.load_grad_scaler_state_dict(state)
