"""Turning the targets and predictions handed to a result package into what its metrics read."""
from typing import Any, Optional

import numpy as np
import torch

NP_ARRAY_OPTIONS = (True, False, "auto")


def to_numpy(data: Any) -> np.ndarray:
    """Convert predictions or targets (a tensor on any device, a list, an array) to a numpy array.

    Tensors are detached and moved to the CPU; low-precision floats (bfloat16 has no numpy dtype) are
    widened to float32 first.
    """
    if isinstance(data, torch.Tensor):
        data = data.detach()
        if data.is_floating_point() and data.dtype in (torch.bfloat16, torch.float16):
            data = data.float()
        return data.cpu().numpy()
    if isinstance(data, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in data):
        return np.asarray([to_numpy(item) for item in data])
    return np.asarray(data)


def check_same_length(y_true: Any, y_predicted: Any, pkg_name: Optional[str]) -> None:
    """Raise ValueError when both sides have a length and the lengths differ."""
    try:
        len_true, len_pred = len(y_true), len(y_predicted)
    except TypeError:  # scalars or custom objects: leave it to the metrics
        return
    if len_true != len_pred:
        raise ValueError(f"{pkg_name}: y_true has {len_true} samples but y_predicted has {len_pred}; they must "
                         "be aligned along the first dimension")


def auto_array(y_array: Any) -> Any:
    """Convert to a numpy array when that is lossless, else return ``y_array`` unchanged.

    Tensors, arrays and sequences whose elements all have the same length (or no length) are converted;
    ragged sequences (e.g. token lists of different lengths) are returned as they are.
    """
    if isinstance(y_array, (torch.Tensor, np.ndarray)):
        return to_numpy(y_array)
    try:
        lengths = {len(element) for element in y_array}
    except TypeError:  # scalars inside, or y_array itself is not a sequence
        return to_numpy(y_array)
    return to_numpy(y_array) if len(lengths) <= 1 else y_array
