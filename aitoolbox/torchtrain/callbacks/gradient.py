"""Gradient clipping callbacks: clip true (unscaled) gradients once per optimizer step."""
import inspect
from numbers import Real
from typing import List

import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.precision.precision import Precision


def _check_positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


class GradientClipBase(AbstractCallback):
    """Clips the gradients of an optimizer's parameters right before that optimizer steps.

    With gradient accumulation the gradients of several batches are summed first, so clipping happens only
    in the ``on_after_gradient_update`` call of a batch that ends with an optimizer step
    (``optimizer_step_due``). Under loss scaling the gradients are unscaled first, so the thresholds apply to
    true gradient values. With several optimizers each one's parameters are clipped separately.
    """

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        tl = self.train_loop_obj
        if not tl.optimizer_step_due:
            return
        optimizer = tl.optimizers[optimizer_idx]
        tl.unscale_gradients(optimizer)
        self.clip(Precision.stepped_parameters(optimizer))

    def clip(self, parameters: List[torch.Tensor]) -> None:
        """Clip the ``.grad`` of these parameters in place."""
        raise NotImplementedError


class GradValueClip(GradientClipBase):
    """Clamp every gradient element to ``[-max_grad_value, max_grad_value]`` (``clip_grad_value_``).

    Args:
        max_grad_value: the largest absolute gradient value allowed (> 0).

    Raises:
        ValueError: ``max_grad_value`` is not a positive number.
    """

    def __init__(self, max_grad_value: float):
        super().__init__("Gradient value clipping")
        self.max_grad_value = _check_positive_number("max_grad_value", max_grad_value)

    def clip(self, parameters: List[torch.Tensor]) -> None:
        torch.nn.utils.clip_grad_value_(parameters, self.max_grad_value)


class GradNormClip(GradientClipBase):
    """Rescale the gradients so that their total norm is at most ``max_grad_norm`` (``clip_grad_norm_``).

    Args:
        max_grad_norm: the largest total gradient norm allowed (> 0).
        **kwargs: further ``torch.nn.utils.clip_grad_norm_`` arguments, e.g. ``norm_type=1.0``.

    Raises:
        ValueError: ``max_grad_norm`` is not a positive number.
        TypeError: a keyword argument ``clip_grad_norm_`` does not accept.
    """

    def __init__(self, max_grad_norm: float, **kwargs):
        super().__init__("Gradient norm clipping")
        self.max_grad_norm = _check_positive_number("max_grad_norm", max_grad_norm)
        accepted = set(inspect.signature(torch.nn.utils.clip_grad_norm_).parameters) - {"parameters", "max_norm"}
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(f"GradNormClip got keyword argument(s) {unknown} that torch.nn.utils.clip_grad_norm_ "
                            f"does not accept; valid ones: {sorted(accepted)}")
        self.clip_kwargs = kwargs

    def clip(self, parameters: List[torch.Tensor]) -> None:
        torch.nn.utils.clip_grad_norm_(parameters, self.max_grad_norm, **self.clip_kwargs)
