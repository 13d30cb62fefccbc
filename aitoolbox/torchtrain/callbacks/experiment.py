"""Helpers of the callbacks that write into an experiment folder (plots, result files, tensorboard logs).

The base class, :class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractExperimentCallback`, lives in
:mod:`aitoolbox.torchtrain.callbacks.abstract` (where aitoolbox 1.x has it) and is re-exported here.
"""
import numbers
from typing import Any, Optional

import torch

from aitoolbox.cloud import gcs_available_options, s3_available_options
from aitoolbox.torchtrain.callbacks.abstract import AbstractExperimentCallback, MissingExperimentDetailsError

__all__ = ["AbstractExperimentCallback", "MissingExperimentDetailsError", "check_local_save_mode", "scalar_value"]

# aitoolbox 1.x's cloud_save_mode values that meant an upload to S3 or Google Cloud Storage.
_CLOUD_MODES = tuple(s3_available_options + gcs_available_options)


def check_local_save_mode(cloud_save_mode: Optional[str], callback_name: str) -> None:
    """Accept aitoolbox 1.x's ``cloud_save_mode`` argument for local saving; refuse cloud uploads plainly.

    Raises:
        ValueError: ``cloud_save_mode`` names S3 or Google Cloud Storage, which are not supported yet.
    """
    if isinstance(cloud_save_mode, str) and cloud_save_mode.lower() in _CLOUD_MODES:
        raise ValueError(f"{callback_name}: cloud_save_mode={cloud_save_mode!r} is not supported yet, files are "
                         "written to the local experiment folder only. Leave cloud_save_mode None (or 'local') and "
                         "copy the folder to cloud storage with your own tools")


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
