"""Turn TrainLoop's ``use_amp`` argument into the Precision object the loop calls."""
from typing import List, Union

import torch
from torch import nn

from aitoolbox.torchtrain.precision.factory import autocast_precision, full_precision
from aitoolbox.torchtrain.precision.precision import Precision


def create_precision(use_amp: Union[bool, dict], model: nn.Module, optimizers: List[torch.optim.Optimizer],
                     device: torch.device) -> Precision:
    """The precision of a TrainLoop.

    Args:
        use_amp: False for float32; True for autocast in the device's default low-precision dtype with
            dynamic loss scaling where the dtype needs it.
        model: the model being trained.
        optimizers: its optimizers.
        device: the device it trains on.
    """
    if use_amp is False or use_amp is None:
        return full_precision(device.type)
    if use_amp is True:
        return autocast_precision(device.type)
    raise TypeError(f"use_amp must be True, False or a dict of amp.initialize keyword arguments, got {use_amp!r}")
