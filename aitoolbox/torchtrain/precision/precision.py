"""The precision object: the one place where TrainLoop's numerics differ between fp32 and mixed precision.

TrainLoop calls it at fixed points of every iteration and never asks which precision is active::

    with precision.autocast():
        loss = model.get_loss(batch, criterion, device)
    precision.backward(loss)              # scaled when a loss scaler is set
    precision.unscale_(optimizer)         # optional, e.g. before gradient clipping; once per step
    stepped = precision.step(optimizers)  # False when the step was skipped on inf/NaN gradients
    precision.zero_grad(optimizers)

Full precision is the same object with autocast and scaling disabled, so the code path is identical.
"""
import contextlib
from typing import ContextManager, List, Optional, Sequence

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler


class Precision:
    """Autocast, loss scaling and the optimizer step of one training run.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (the device the model runs on).
        autocast_dtype: low-precision dtype of the forward pass under autocast; None disables autocast.
        loss_scaler: scales the loss and skips steps on overflow; None disables scaling.
    """

    def __init__(self, device_type: str = "cpu", autocast_dtype: Optional[torch.dtype] = None,
                 loss_scaler: Optional[LossScaler] = None):
        self.device_type = device_type
        self.autocast_dtype = autocast_dtype
        self.loss_scaler = loss_scaler
        self.last_step_skipped = False
        self._unscaled_optimizers: set = set()
        self._found_inf = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device_type={self.device_type!r}, autocast_dtype={self.autocast_dtype}, "
                f"loss_scaler={self.loss_scaler})")

    @property
    def is_mixed(self) -> bool:
        """True when anything differs from plain float32 training."""
        return self.autocast_dtype is not None or self.loss_scaler is not None

    def autocast(self) -> ContextManager:
        """Context for the forward pass and the loss (not for backward)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, multiplied by the loss scale when scaling is on."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward()

    @staticmethod
    def stepped_parameters(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
        """The parameters ``optimizer`` updates: clip and inspect the gradients of these."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the gradients of ``optimizer``'s parameters into true (unscaled) values.

        Safe to call more than once per step: only the first call divides by the scale.
        """
        if self.loss_scaler is None or id(optimizer) in self._unscaled_optimizers:
            return
        grads = [p.grad for p in self.stepped_parameters(optimizer) if p.grad is not None]
        self._found_inf |= self.loss_scaler.unscale_grads(grads)
        self._unscaled_optimizers.add(id(optimizer))

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Step every optimizer unless the gradients overflowed; update the loss scale.

        Returns:
            True if the optimizers stepped, False if the step was skipped.
        """
        for optimizer in optimizers:
            self.unscale_(optimizer)
        skip = self._found_inf
        if not skip:
            for optimizer in optimizers:
                optimizer.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skip)
        self._unscaled_optimizers.clear()
        self._found_inf = False
        self.last_step_skipped = skip
        return not skip

    def zero_grad(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Clear the gradients before the next accumulation window."""
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """State to checkpoint: the loss scaler's, if any."""
        return {"loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("loss_scaler") is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
