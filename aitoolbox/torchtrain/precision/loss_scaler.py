"""Loss scaling for low-precision gradients: static, or dynamic with apex's halve-on-overflow rule."""
from typing import Dict, Iterable, Optional, Union

import torch

DEFAULT_INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000


class LossScaler:
    """Multiplies a loss by a scale before backward and checks and unscales the gradients afterwards.

    Dynamic scaling follows apex's rules: it starts at ``min(max_loss_scale, 2**16)``; a step whose
    gradients hold inf or NaN is skipped, the scale halves (never below ``min_loss_scale``) and the count of
    unskipped steps restarts; after 2000 unskipped steps in a row the scale doubles (never above
    ``max_loss_scale``). A static scaler never skips and never changes its scale.

    The arithmetic uses the same kernels as ``torch.amp.GradScaler`` so both give bitwise equal gradients.

    The factors and the interval default to apex's and can be set as ``torch.amp.GradScaler``'s
    (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``).

    Args:
        loss_scale: ``"dynamic"`` or a number (anything ``float()`` accepts, e.g. ``"128.0"``).
        min_loss_scale: floor of the dynamic scale; None for no floor.
        max_loss_scale: ceiling of the dynamic scale.
        init_scale: first dynamic scale; None for ``min(max_loss_scale, 2**16)``.
        growth_factor: the dynamic scale is multiplied by this after ``growth_interval`` unskipped steps.
        backoff_factor: and by this after an overflow.
        growth_interval: unskipped steps in a row before the scale grows.
    """

    def __init__(self, loss_scale: Union[str, float] = "dynamic", min_loss_scale: Optional[float] = None,
                 max_loss_scale: float = 2.0 ** 24, init_scale: Optional[float] = None, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = GROWTH_INTERVAL):
        self.dynamic = loss_scale == "dynamic"
        if self.dynamic:
            self.loss_scale = float(init_scale) if init_scale is not None else min(float(max_loss_scale),
                                                                                   DEFAULT_INITIAL_SCALE)
        else:
            try:
                self.loss_scale = float(loss_scale)
            except (TypeError, ValueError):
                raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}") from None
        if not self.loss_scale > 0:
            name = "init_scale" if self.dynamic else "loss_scale"
            raise ValueError(f"{name} must be positive, got {self.loss_scale!r}")
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"growth_factor must be > 1 and backoff_factor in (0, 1), got {growth_factor!r} and "
                             f"{backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.min_loss_scale = None if min_loss_scale is None else float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.unskipped = 0

    @classmethod
    def from_grad_scaler_args(cls, init_scale: float = DEFAULT_INITIAL_SCALE, growth_factor: float = 2.0,
                              backoff_factor: float = 0.5, growth_interval: int = GROWTH_INTERVAL) -> "LossScaler":
        """A dynamic scaler with ``torch.amp.GradScaler``'s arguments (aitoolbox 1.x's ``use_amp`` dict).

        Unlike apex's scaler, GradScaler has no ceiling on the scale.
        """
        return cls("dynamic", max_loss_scale=float("inf"), init_scale=init_scale, growth_factor=growth_factor,
                   backoff_factor=backoff_factor, growth_interval=growth_interval)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self.loss_scale}, unskipped={self.unskipped})"

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * loss_scale`` in float32 (the scaled loss is what backward runs on)."""
        return loss.float() * self.loss_scale

    def unscale_grads(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients by the scale in place; return True if any of them holds inf or NaN.

        The verdict is read from the device with a blocking copy, so on a GPU it waits for the check to finish
        (one host sync per device and step; deciding to skip the optimizer step is a host-side decision).
        """
        grads_by_key: Dict[tuple, list] = {}
        for grad in grads:
            grad = values_of(local_part(grad))
            grads_by_key.setdefault((grad.device, grad.dtype), []).append(grad)
        if not grads_by_key:
            return False
        # One flag per device, shared by its dtype groups: the kernel only ever sets it, never clears it.
        found_inf_by_device: Dict[torch.device, torch.Tensor] = {}
        inv_scale_by_device: Dict[torch.device, torch.Tensor] = {}
        for (device, _), group in grads_by_key.items():
            if device not in found_inf_by_device:
                found_inf_by_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
                inv_scale_by_device[device] = torch.full((1,), self.loss_scale, dtype=torch.float64,
                                                         device=device).reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf_by_device[device],
                                                             inv_scale_by_device[device])
        # .item() copies synchronously: a non_blocking copy read at once could still hold the zero it started as.
        return any(found_inf.item() != 0.0 for found_inf in found_inf_by_device.values())

    @staticmethod
    def has_overflow(grads: Iterable[torch.Tensor]) -> bool:
        """Return True if any gradient holds inf or NaN, without changing them."""
        return any(not torch.isfinite(values_of(local_part(grad))).all() for grad in grads)

    def update(self, found_inf: bool) -> None:
        """Apply the dynamic-scaling rule after one step (a static scaler ignores it)."""
        if not self.dynamic:
            return
        if found_inf:
            self.loss_scale *= self.backoff_factor
            if self.min_loss_scale is not None:
                self.loss_scale = max(self.loss_scale, self.min_loss_scale)
            self.unskipped = 0
        else:
            self.unskipped += 1
            if self.unskipped == self.growth_interval:
                self.loss_scale = min(self.loss_scale * self.growth_factor, self.max_loss_scale)
                self.unskipped = 0

    def state_dict(self) -> dict:
        """Return apex's checkpoint keys: ``loss_scale`` and ``unskipped``."""
        return {"loss_scale": self.loss_scale, "unskipped": self.unskipped}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scale and the count of unskipped steps saved by :meth:`state_dict`."""
        self.loss_scale = float(state["loss_scale"])
        self.unskipped = int(state["unskipped"])

    def grad_scaler_state_dict(self) -> dict:
        """The state in ``torch.amp.GradScaler.state_dict()``'s keys (aitoolbox 1.x checkpoints store it as ``amp``)."""
        return {"scale": self.loss_scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.unskipped}

    def load_grad_scaler_state_dict(self, state: dict) -> None:
        """Restore a ``torch.amp.GradScaler``-style state (from :meth:`grad_scaler_state_dict` or a 1.x file)."""
        if "scale" not in state:
            raise ValueError(f"not a GradScaler state dict (no 'scale' key): keys {sorted(state)}")
        self.loss_scale = float(state["scale"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.unskipped = int(state.get("_growth_tracker", 0))


def values_of(grad: torch.Tensor) -> torch.Tensor:
    """The tensor holding a gradient's numbers: a sparse gradient's values (a view: unscaling them in place unscales
    the gradient; the fused unscaling kernel takes only dense tensors), any other gradient itself."""
    return grad._values() if grad.is_sparse else grad


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this process holds: a sharded gradient's (a DTensor under FSDP) local shard, whose
    in-place unscaling is the DTensor's; any other tensor itself. Whether some rank found an overflow is then
    agreed by the precision object (``Precision.agree_on_overflow``)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
