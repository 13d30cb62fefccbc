"""Build the Precision object for TrainLoop's ``use_amp`` argument."""
from typing import Optional

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.precision import Precision


def default_low_precision_dtype(device_type: str) -> torch.dtype:
    """bfloat16 on CPUs (float16 matmuls are ~10x slower there), float16 on CUDA GPUs."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def autocast_precision(device_type: str, dtype: Optional[torch.dtype] = None,
                       loss_scale="dynamic", loss_scaler: Optional[LossScaler] = None) -> Precision:
    """Autocast in ``dtype`` (the device default when None), with loss scaling where the dtype needs it.

    float16 has a narrow exponent range, so small gradients underflow without scaling; bfloat16 has
    float32's range and is not scaled unless ``loss_scale`` is given as a number or a ``loss_scaler`` is given.
    """
    dtype = dtype or default_low_precision_dtype(device_type)
    needs_scaling = dtype == torch.float16 or loss_scale not in ("dynamic", None)
    scaler = LossScaler(loss_scale if loss_scale is not None else "dynamic") if needs_scaling else None
    if loss_scaler is not None:
        scaler = loss_scaler
    return Precision(device_type, autocast_dtype=dtype, loss_scaler=scaler)


def full_precision(device_type: str) -> Precision:
    """Plain float32 training: the same object with autocast and scaling off."""
    return Precision(device_type)
