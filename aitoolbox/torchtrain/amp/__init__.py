"""NVIDIA apex's ``amp`` API on native ``torch.autocast``: change ``from apex import amp`` to
``from aitoolbox.torchtrain import amp`` and nothing else.

Differences from apex, all deliberate:

* the low-precision dtype is bfloat16 on CPUs and float16 on CUDA GPUs (``dtype=`` chooses);
* O1 runs the model's forward under ``torch.autocast`` (a forward hook) instead of patching torch
  functions, and returns float32 outputs so a loss computed outside the model runs in float32;
* O1 and O2 do no loss scaling with bfloat16 unless ``loss_scale`` is given (bfloat16 has float32's
  exponent range); ``amp.state_dict()`` then reports a static scale of 1.0;
* O2 master weights are part of ``amp.state_dict()``, so resuming is bitwise exact;
* nothing is patched: a prepared model survives ``copy.deepcopy`` and pickling, and the state of each
  ``initialize`` call is its own object, found again from the optimizer.

A skipped (overflow) step is carried out by clearing the optimizer's gradients: every torch optimizer
leaves parameters without gradients untouched, so the following ``optimizer.step()`` changes nothing.
"""
import contextlib
import logging
from typing import Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from aitoolbox.torchtrain.amp.properties import OPT_LEVELS, AmpProperties, resolve_properties
from aitoolbox.torchtrain.amp.state import AmpRegistry, AmpState

__all__ = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "last_step_skipped",
           "state_of", "AmpProperties", "AmpState", "OPT_LEVELS"]

logger = logging.getLogger(__name__)
_registry = AmpRegistry()

ModelArg = Union[nn.Module, Sequence[nn.Module]]
OptimizerArg = Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


def _as_model_list(models) -> List[nn.Module]:
    items = list(models) if isinstance(models, (list, tuple)) else [models]
    for model in items:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or \
                type(model).__name__ == "DistributedDataParallel":
            raise RuntimeError("amp.initialize got a model already wrapped in a parallel wrapper "
                               f"({type(model).__name__}). Call amp.initialize first and wrap the model it returns.")
        if not isinstance(model, nn.Module):
            raise TypeError(f"models must be an nn.Module or a list of them, got {type(model).__name__}")
    return items


def _as_optimizer_list(optimizers) -> List[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for optimizer in items:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizers must be a torch.optim.Optimizer, a list of them, or None; got "
                            f"{type(optimizer).__name__}")
        if _registry.for_optimizer(optimizer) is not None:
            raise RuntimeError("this optimizer was already passed through amp.initialize; call initialize once "
                               "per optimizer (create a new optimizer to start over)")
    return items


def initialize(models: ModelArg, optimizers: OptimizerArg = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type=None, patch_torch_functions: Optional[bool] = None, keep_batchnorm_fp32=None,
               master_weights: Optional[bool] = None, loss_scale=None, cast_model_outputs=None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0 ** 24,
               dtype: Optional[torch.dtype] = None):
    """Prepare models and optimizers for mixed precision at an apex optimization level.

    Move the models to their device first, and wrap them in DistributedDataParallel only afterwards.

    Args:
        models: a model or a list of models.
        optimizers: an optimizer, a list of them, or None (inference).
        enabled: False returns the arguments untouched and makes ``scale_loss`` a no-op.
        opt_level: ``'O0'`` float32, ``'O1'`` autocast (recommended), ``'O2'`` cast model with float32 master
            weights, ``'O3'`` pure low precision.
        cast_model_type: override: the dtype to cast the model to.
        patch_torch_functions: override: run the forward under autocast (O1 only).
        keep_batchnorm_fp32: override: True/False/'True'/'False' - keep BatchNorm float32 in a cast model.
        master_weights: override: float32 master weights in the optimizer.
        loss_scale: override: ``'dynamic'`` or a number. Default: the opt level's, except that O1 and O2
            scale only when they compute in float16 (no scaling with bfloat16, unlike apex).
        cast_model_outputs: dtype of the model's floating outputs (default float32 when the model is cast
            or autocast).
        num_losses: the number of loss scalers, one per ``loss_id`` of :func:`scale_loss`.
        verbosity: 0 silences the summary message.
        min_loss_scale: floor of dynamic loss scaling.
        max_loss_scale: ceiling of dynamic loss scaling.
        dtype: the low-precision dtype (default bfloat16 on CPU, float16 on CUDA).

    Returns:
        The models and optimizers in the shapes they were given (only the models when optimizers is None).
    """
    model_list = _as_model_list(models)
    optimizer_list = _as_optimizer_list(optimizers)
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, got {num_losses!r}")
    device_type = AmpState._device_type(model_list)
    properties = resolve_properties(device_type, opt_level, cast_model_type, patch_torch_functions,
                                    keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, dtype)
    state = AmpState(properties, model_list, optimizer_list, num_losses, min_loss_scale, max_loss_scale, enabled)
    _registry.register(state)
    if enabled and verbosity > 0:
        logger.info("amp: %s on %s, low-precision dtype %s, loss scale %s", opt_level, device_type,
                    properties.low_precision_dtype, properties.loss_scale if properties.uses_loss_scaling else "none")
    if optimizers is None:
        return models
    return models, optimizers


def state_of(optimizer_or_model: Union[torch.optim.Optimizer, nn.Module]) -> Optional[AmpState]:
    """The :class:`AmpState` an optimizer or model was initialized with, or None."""
    if isinstance(optimizer_or_model, torch.optim.Optimizer):
        return _registry.for_optimizer(optimizer_or_model)
    return _registry.for_model(optimizer_or_model)


def _state_for(optimizers: Sequence[torch.optim.Optimizer], caller: str) -> AmpState:
    states = {id(s): s for s in (_registry.for_optimizer(opt) for opt in optimizers)}
    if None in states.values() or not states:
        raise RuntimeError(f"amp.{caller} was given an optimizer that did not go through amp.initialize. Call "
                           "model, optimizer = amp.initialize(model, optimizer, opt_level='O1') first.")
    if len(states) > 1:
        raise RuntimeError(f"amp.{caller} was given optimizers from different amp.initialize calls; pass the "
                           "optimizers of one call")
    return next(iter(states.values()))


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers, loss_id: int = 0, model: Optional[nn.Module] = None,
               delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yield ``loss`` times the loss scale; call ``.backward()`` on it inside the block.

    On exit the gradients are unscaled into the parameters the optimizers step (float32 masters under O2)
    and checked for inf/NaN; on overflow the next ``optimizer.step()`` of every optimizer given changes
    nothing and the dynamic scale halves. Gradients of several blocks add up, unscaled.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer(s) that will step on these gradients.
        loss_id: which loss scaler to use (``0 <= loss_id < num_losses``).
        model: accepted for apex compatibility; unused.
        delay_unscale: leave the gradients scaled until the next block without it (all blocks in between
            must use the same ``loss_id``).
        delay_overflow_check: accepted for apex compatibility; the check always runs on exit.
    """
    optimizer_list = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    state = _state_for(optimizer_list, "scale_loss")
    with state.scale_loss(loss, optimizer_list, loss_id, delay_unscale) as scaled_loss:
        yield scaled_loss


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` steps (float32 masters under O2): clip these after ``scale_loss``."""
    for group in optimizer.param_groups:
        yield from group["params"]


def last_step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """True if the last ``optimizer.step()`` was a no-op because of a gradient overflow.

    Use it to hold back an LR scheduler on skipped steps.
    """
    return _state_for([optimizer], "last_step_skipped").last_step_skipped[id(optimizer)]


def _latest_state(caller: str) -> AmpState:
    state = _registry.latest()
    if state is None and _registry.had_state():
        raise RuntimeError(f"amp.{caller} refers to the most recent amp.initialize call, whose models and optimizers "
                           "have all been freed: keep a reference to the model and optimizer it returned")
    if state is None:
        raise RuntimeError(f"amp.{caller} needs amp.initialize to be called first")
    return state


def state_dict(destination: Optional[dict] = None) -> dict:
    """Loss-scaler state (and O2 master weights) of the most recent ``amp.initialize`` call."""
    state = _latest_state("state_dict").state_dict()
    if destination is not None:
        destination.update(state)
        return destination
    return state


def load_state_dict(state: dict) -> None:
    """Restore :func:`state_dict` output; call it after ``amp.initialize`` and the model/optimizer loads."""
    _latest_state("load_state_dict").load_state_dict(state)
