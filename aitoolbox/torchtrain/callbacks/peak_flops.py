"""Dense peak FLOP/s of common NVIDIA GPUs per precision: the denominator of the model FLOPs utilisation (MFU).

The numbers are those of NVIDIA's datasheets for the GPU's main form factor, without structured sparsity (the
datasheets print sparse tensor-core numbers twice as large, marked with an asterisk: halved here). ``fp32`` is
plain float32 on the CUDA cores; ``tf32`` is float32 matrix multiplications on the tensor cores, what torch does
for float32 convolutions by default (``torch.backends.cudnn.allow_tf32``) and for float32 matrix multiplications when
``torch.backends.cuda.matmul.allow_tf32`` is True (``torch.set_float32_matmul_precision('high')``).
A GPU missing from the table, or a precision a GPU lacks (bfloat16 before Ampere), gives no peak: pass
``peak_flops`` to :class:`~aitoolbox.torchtrain.callbacks.throughput.ThroughputMonitor` instead.
"""
from typing import Dict, Optional, Sequence, Tuple

import torch

TABLE_SOURCE = "NVIDIA datasheets, dense (no sparsity)"

TERA = 1e12
# (lower-case substrings that must all be in torch.cuda.get_device_name(), lower-cased; substrings that must not
# be), name shown in the log, {precision: TFLOP/s}. The first matching row wins: the specific ones come first.
_ROWS: Sequence[Tuple[Tuple[str, ...], Tuple[str, ...], str, Dict[str, float]]] = (
    (("h100", "pcie"), (), "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (("h100",), ("nvl", "pcie"), "H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (("h200",), ("nvl",), "H200 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (("a100",), (), "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (("l40s",), (), "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05}),
    (("l4",), ("l40",), "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (("a10g",), (), "A10G (A10 datasheet)", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (("a10",), ("a100", "a10g"), "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (("v100", "pcie"), (), "V100 PCIe", {"fp32": 14.0, "tf32": 14.0, "fp16": 112.0}),
    (("v100",), ("pcie",), "V100 SXM2", {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0}),
    (("t4",), (), "T4", {"fp32": 8.1, "tf32": 8.1, "fp16": 65.0}),
)

PRECISION_NAMES = {"fp32": "float32", "tf32": "TF32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64",
                   "fp8": "float8"}


def precision_key(compute_dtype: Optional[torch.dtype]) -> str:
    """The table's precision for CUDA matrix multiplications in ``compute_dtype`` (None or float32: ``tf32`` when
    torch lets float32 matmuls use TF32, else ``fp32``)."""
    return math_precision("matmul", compute_dtype or torch.float32, "cuda")


def tf32_allowed(kind: str) -> bool:
    """Whether torch lets float32 ``kind`` (``'conv'`` or ``'matmul'``) math on CUDA run in TF32. Reads the
    ``fp32_precision`` settings of torch >= 2.9 first (mixing them with the older ``allow_tf32`` makes reading
    ``allow_tf32`` raise), then ``allow_tf32``."""
    backend = torch.backends.cudnn.conv if kind == "conv" else torch.backends.cuda.matmul
    setting = getattr(backend, "fp32_precision", "none")
    if setting in ("tf32", "ieee"):
        return setting == "tf32"
    legacy = torch.backends.cudnn if kind == "conv" else torch.backends.cuda.matmul
    try:
        return bool(legacy.allow_tf32)
    except RuntimeError:  # a mix of both APIs: the new one said nothing, so no TF32
        return False


def math_precision(kind: str, dtype: torch.dtype, device_type: str) -> str:
    """The precision math of ``kind`` (``'conv'`` or ``'matmul'``) on inputs of ``dtype`` runs in on a device of
    ``device_type``: ``'bf16'``, ``'fp16'``, ``'fp64'``, ``'fp8'``, or for float32 ``'tf32'`` on CUDA where torch
    allows it for ``kind`` (:func:`tf32_allowed`), else ``'fp32'``."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float64:
        return "fp64"
    if dtype.is_floating_point and dtype.itemsize == 1:
        return "fp8"
    if dtype == torch.float32:
        return "tf32" if device_type == "cuda" and tf32_allowed(kind) else "fp32"
    return str(dtype).replace("torch.", "")


def effective_peak(device_name: str, flops_by_precision: Dict[str, float]) -> Optional[Tuple[float, str]]:
    """The peak FLOP/s of one ``device_name`` GPU for work split as ``flops_by_precision`` (FLOPs per precision):
    the FLOPs over the time the device would take at each precision's peak, ``sum(F) / sum(F_p / peak_p)``, so that
    MFU is the ideal time over the time taken. Returns ``(peak, a description such as 'A100: TF32 80 %, float32
    20 %')``; None when the table lacks the GPU or one of the precisions."""
    total = sum(flops_by_precision.values())
    if total <= 0:
        return None
    ideal_seconds, parts, row = 0.0, [], None
    for precision, flops in sorted(flops_by_precision.items(), key=lambda item: -item[1]):
        found = lookup_peak_flops(device_name, precision)
        if found is None:
            return None
        peak, row = found
        ideal_seconds += flops / peak
        parts.append(f"{PRECISION_NAMES.get(precision, precision)} {flops / total:.0%}")
    return total / ideal_seconds, f"{row}: {', '.join(parts)}"


def lookup_peak_flops(device_name: str, precision: str) -> Optional[Tuple[float, str]]:
    """``(dense peak FLOP/s of one device, the table row's name)`` for a GPU named ``device_name`` (as
    ``torch.cuda.get_device_name`` says) computing in ``precision`` (``'fp32'``, ``'tf32'``, ``'bf16'``,
    ``'fp16'``); None when the table does not know it."""
    name = device_name.lower()
    for needed, excluded, row_name, peaks in _ROWS:
        if all(part in name for part in needed) and not any(part in name for part in excluded):
            tflops = peaks.get(precision)
            return (tflops * TERA, row_name) if tflops is not None else None
    return None
