"""Build the Precision object for TrainLoop's ``use_amp`` argument."""
from typing import Optional, Union

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.precision import Precision


def default_low_precision_dtype(device_type: str) -> torch.dtype:
    """bfloat16 on CPUs (float16 matmuls are ~10x slower there), float16 on CUDA GPUs."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def autocast_precision(device_type: str, dtype: Optional[torch.dtype] = None,
                       loss_scale: Union[str, float, None] = None,
                       loss_scaler: Optional[LossScaler] = None) -> Precision:
    """Autocast in ``dtype`` (the device default when None), with loss scaling where the dtype needs it.

    float16 has a narrow exponent range, so small gradients underflow without scaling: it gets dynamic
    scaling by default. bfloat16 has float32's range and is not scaled (no scaling work at all) unless
    ``loss_scale`` (``'dynamic'`` or a number) or a ``loss_scaler`` is given.
    """
    dtype = dtype or default_low_precision_dtype(device_type)
    if loss_scaler is None and loss_scale is None and dtype == torch.float16:
        loss_scale = "dynamic"
    if loss_scaler is None and loss_scale is not None:
        loss_scaler = LossScaler(loss_scale)
    return Precision(device_type, autocast_dtype=dtype, loss_scaler=loss_scaler)


def full_precision(device_type: str) -> Precision:
    """Plain float32 training: the same object with autocast and scaling off."""
    return Precision(device_type)
