"""Turn TrainLoop's ``use_amp`` argument into the Precision object the loop calls."""
import inspect
import logging
from typing import List, Union

import torch
from torch import nn

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.amp.properties import resolve_properties
from aitoolbox.torchtrain.model import FeedDefinitionModel
from aitoolbox.torchtrain.precision.factory import autocast_precision, full_precision
from aitoolbox.torchtrain.precision.model_cast import register_upcast_state_dict
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)

_AMP_INIT_KEYWORDS = [name for name in inspect.signature(amp.initialize).parameters
                      if name not in ("models", "optimizers")]


def check_use_amp(use_amp: Union[bool, dict, None], device: torch.device) -> None:
    """Validate ``use_amp`` in the constructor, so a bad setting fails before any training."""
    if use_amp is None or isinstance(use_amp, bool):
        return
    if not isinstance(use_amp, dict):
        raise TypeError(f"use_amp must be True, False or a dict of amp.initialize keyword arguments, got {use_amp!r}")
    unknown = sorted(set(use_amp) - set(_AMP_INIT_KEYWORDS))
    if unknown:
        raise TypeError(f"use_amp has unknown key(s) {unknown}; amp.initialize accepts {_AMP_INIT_KEYWORDS}")
    property_keys = inspect.signature(resolve_properties).parameters
    resolve_properties(device.type, **{k: v for k, v in use_amp.items() if k in property_keys})


def create_precision(use_amp: Union[bool, dict, None], model: nn.Module, optimizers: List[torch.optim.Optimizer],
                     device: torch.device) -> Precision:
    """The precision of a TrainLoop, created once the model is on its device (and before any parallel wrap).

    Args:
        use_amp: False for float32; True for autocast in the device's default low-precision dtype with
            dynamic loss scaling where the dtype needs it (or the configuration of a model the user already
            passed through ``amp.initialize``); a dict of ``amp.initialize`` keyword arguments.
        model: the model being trained (on its device).
        optimizers: its optimizers.
        device: the device it trains on.
    """
    existing = amp.state_of(optimizers[0]) or amp.state_of(model)
    if existing is not None:
        if isinstance(use_amp, dict):
            raise ValueError("the model/optimizer already went through amp.initialize, so use_amp cannot hold "
                             "amp.initialize arguments as well: pass use_amp=True")
        if not use_amp:
            logger.warning("the optimizer went through amp.initialize (%s) but use_amp=False; training with that "
                           "amp configuration anyway (pass use_amp=True to silence this)",
                           existing.properties.opt_level)
        return existing.precision()
    if isinstance(use_amp, dict):
        state_optimizers = amp.initialize(model, optimizers, **use_amp)[1]
        if isinstance(model, FeedDefinitionModel):
            # Checkpoints save the user's wrapped module: it must return float32 weights too.
            register_upcast_state_dict(model.model)
        return amp.state_of(state_optimizers[0]).precision()
    if use_amp:
        return autocast_precision(device.type)
    return full_precision(device.type)
