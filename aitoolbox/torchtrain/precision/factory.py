"""Build the Precision object for TrainLoop's ``use_amp`` argument, and decide where mixed precision helps."""
import os
import warnings
from typing import Optional, Union

import torch

from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.precision import Precision


def default_low_precision_dtype(device_type: str) -> torch.dtype:
    """bfloat16 on CPUs (float16 matmuls are ~10x slower there), float16 on CUDA GPUs."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


# "1" or "0" overrides the CPU's answer to "does it compute bfloat16 natively?" (tests of both kinds of CPU, and a
# CPU the check misjudges); unset, or any other value, asks the CPU.
NATIVE_BFLOAT16_ENV = "AITOOLBOX_CPU_NATIVE_BF16"


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here, e.g. ``'AVX512'``, ``'AVX2'``, ``'DEFAULT'``."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):  # an old or unusual build
        return "unknown"


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matrix products in hardware (AVX512-BF16, AMX, Arm BF16).

    Without it, oneDNN emulates bfloat16 and autocast makes a step about 10x slower than float32. The environment
    variable ``AITOOLBOX_CPU_NATIVE_BF16`` (``1`` or ``0``) overrides the answer.
    """
    override = os.environ.get(NATIVE_BFLOAT16_ENV, "").strip()
    if override in ("0", "1"):
        return override == "1"
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: nothing fast to offer
        return False


def default_mixed_precision_helps(device_type: str) -> bool:
    """Whether ``use_amp=True`` ("the mixed precision that helps on this device") means autocast here.

    CUDA GPUs: always. CPUs: only with native bfloat16 (float16 is ~10x slower on every CPU, and emulated
    bfloat16 as slow); elsewhere the default trains in float32 and says so once (:func:`warn_float32_fallback`).
    """
    return device_type != "cpu" or cpu_has_native_bfloat16()


def warn_float32_fallback() -> None:
    """Say (once per process: the warning's text and place stay the same) that the default trains in float32."""
    warnings.warn(
        f"use_amp=True trains in float32 on this CPU (capability {cpu_capability()}, no native bfloat16): bfloat16 "
        "autocast is emulated here and makes training about 10x slower. To use bfloat16 anyway pass an explicit "
        "opt level, e.g. use_amp={'opt_level': 'O1'} (amp_init_args= for fit_distributed), or set "
        f"{NATIVE_BFLOAT16_ENV}=1.", UserWarning, stacklevel=2)


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
