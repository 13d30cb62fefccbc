"""Helpers of the callbacks that write into an experiment folder (plots, result files, tensorboard logs).

The base class, :class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractExperimentCallback`, lives in
:mod:`aitoolbox.torchtrain.callbacks.abstract` (where aitoolbox 1.x has it) and is re-exported here.
"""
import numbers
from typing import Any, Optional

import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractExperimentCallback, MissingExperimentDetailsError
from aitoolbox.torchtrain.callbacks.cloud_upload import check_cloud_save_mode

__all__ = ["AbstractExperimentCallback", "MissingExperimentDetailsError", "check_cloud_save_mode",
           "check_local_save_mode", "scalar_value"]


def check_local_save_mode(cloud_save_mode: Optional[str], callback_name: str) -> Optional[str]:
    """The earlier name of :func:`~aitoolbox.torchtrain.callbacks.cloud_upload.check_cloud_save_mode`: checks
    ``cloud_save_mode`` and returns ``'s3'``, ``'gcs'`` or None (local). Cloud modes are accepted now.

    Raises:
        ValueError: an unknown ``cloud_save_mode``.
    """
    return check_cloud_save_mode(cloud_save_mode, callback_name)


def scalar_value(value: Any) -> Optional[float]:
    """``value`` as a float when it is a single number (Python, numpy or a one-element tensor), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if getattr(value, "size", None) == 1 and callable(getattr(value, "item", None)):  # numpy 0-d / 1-element
        try:
            return float(value.item())
        except (TypeError, ValueError):
            return None
    return None
