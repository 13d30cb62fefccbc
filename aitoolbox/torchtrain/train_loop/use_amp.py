"""Turn TrainLoop's ``use_amp`` argument into the Precision object the loop calls."""
import inspect
import logging
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import nn

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.amp.properties import resolve_properties
from aitoolbox.torchtrain.model import FeedDefinitionModel
from aitoolbox.torchtrain.precision.factory import (
    autocast_precision, default_low_precision_dtype, default_mixed_precision_helps, full_precision,
    warn_float32_fallback)
from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.model_cast import register_upcast_state_dict
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)

_AMP_INIT_KEYWORDS = [name for name in inspect.signature(amp.initialize).parameters
                      if name not in ("models", "optimizers")]
# aitoolbox 1.8 passed a use_amp dict to torch.amp.GradScaler; 1.0 (and apex users) to amp.initialize.
_GRAD_SCALER_KEYWORDS = ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"]


def use_amp_meaning(use_amp: Union[bool, dict, None]) -> str:
    """What a ``use_amp`` value asks for: ``'off'``, ``'default'``, ``'grad_scaler'`` or ``'amp_initialize'``.

    A dict is read by its keys: ``torch.amp.GradScaler`` arguments (aitoolbox 1.8, e.g. ``{'init_scale': 2.**16,
    'growth_interval': 1000}``) or ``amp.initialize`` arguments (aitoolbox 1.0 and apex, e.g.
    ``{'opt_level': 'O2'}``). ``enabled`` belongs to both.

    Raises:
        TypeError: ``use_amp`` is neither a bool nor a dict, or a dict has keys of neither kind.
        ValueError: a dict mixes the two kinds.
    """
    if use_amp is None or isinstance(use_amp, bool):
        return "default" if use_amp else "off"
    if isinstance(use_amp, str):
        hint = (f" To choose an opt level pass use_amp={{'opt_level': {use_amp!r}}}."
                if use_amp.upper() in amp.OPT_LEVELS else "")
        raise TypeError(f"use_amp must be True, False or a dict, got the string {use_amp!r}.{hint}")
    if not isinstance(use_amp, dict):
        raise TypeError(f"use_amp must be True, False or a dict of amp.initialize (or torch.amp.GradScaler) keyword "
                        f"arguments, got {use_amp!r}")
    unknown = sorted(set(use_amp) - set(_AMP_INIT_KEYWORDS) - set(_GRAD_SCALER_KEYWORDS))
    if unknown:
        raise TypeError(f"use_amp has unknown key(s) {unknown}; it takes amp.initialize arguments {_AMP_INIT_KEYWORDS} "
                        f"or torch.amp.GradScaler arguments {_GRAD_SCALER_KEYWORDS}")
    if use_amp.get("enabled", True) is False:
        return "off"
    scaler_keys = sorted(set(use_amp) & (set(_GRAD_SCALER_KEYWORDS) - {"enabled"}))
    amp_keys = sorted(set(use_amp) & (set(_AMP_INIT_KEYWORDS) - {"enabled"}))
    if scaler_keys and amp_keys:
        raise ValueError(f"use_amp mixes torch.amp.GradScaler arguments {scaler_keys} with amp.initialize arguments "
                         f"{amp_keys}: pass one kind, e.g. {{'opt_level': 'O1', 'loss_scale': 'dynamic'}} or "
                         "{'init_scale': 2.**16, 'growth_interval': 2000}")
    if scaler_keys:
        return "grad_scaler"
    return "amp_initialize" if amp_keys else "default"


def _quiet(use_amp: dict) -> dict:
    """``use_amp`` for ``amp.initialize`` without its own summary line (``verbosity=0``) unless the dict asks for it:
    the loop says which precision it chose in one message of its own."""
    return {"verbosity": 0, **use_amp}


def falls_back_to_float32(meaning: str, device: torch.device) -> bool:
    """Whether a ``use_amp`` that names no precision (True, or a GradScaler dict) trains in float32 on ``device``
    because mixed precision would slow it down (a CPU without native bfloat16); warns once when so. An explicit
    ``amp.initialize`` dict (an opt level, ``cast_model_type``...) is always honoured as given."""
    if meaning not in ("default", "grad_scaler") or default_mixed_precision_helps(device.type):
        return False
    warn_float32_fallback()
    return True


def check_use_amp(use_amp: Union[bool, dict, None], device: torch.device) -> None:
    """Validate ``use_amp`` in the constructor, so a bad setting fails before any training."""
    meaning = use_amp_meaning(use_amp)
    if meaning == "grad_scaler":
        LossScaler.from_grad_scaler_args(**{k: v for k, v in use_amp.items() if k != "enabled"})
    elif meaning == "amp_initialize":
        property_keys = inspect.signature(resolve_properties).parameters
        resolve_properties(device.type, **{k: v for k, v in use_amp.items() if k in property_keys})


def initial_loss_scaler(use_amp: Union[bool, dict, None], model: nn.Module,
                        optimizers: List[torch.optim.Optimizer], device: torch.device) -> Optional[LossScaler]:
    """The loss scaler :func:`create_precision` will start with (None: no scaling), found without touching the
    model: what ``tl.amp_scaler`` reports before the model is set up (1.x built its GradScaler in the
    constructor, so 1.x code may read it, or load a state into it, before ``fit``)."""
    meaning = use_amp_meaning(use_amp)
    existing = (amp.state_of(optimizers[0]) if optimizers else None) or amp.state_of(model)
    if existing is not None:
        return existing.precision().loss_scaler
    if meaning == "off" or (meaning in ("default", "grad_scaler") and not default_mixed_precision_helps(device.type)):
        return None
    if meaning == "grad_scaler":
        return LossScaler.from_grad_scaler_args(**{key: value for key, value in use_amp.items() if key != "enabled"})
    if meaning == "default":
        return autocast_precision(device.type).loss_scaler
    property_keys = inspect.signature(resolve_properties).parameters
    props = resolve_properties(device.type, **{k: v for k, v in use_amp.items() if k in property_keys})
    return LossScaler(props.loss_scale) if props.uses_loss_scaling else None


def create_precision(use_amp: Union[bool, dict, None], model: nn.Module, optimizers: List[torch.optim.Optimizer],
                     device: torch.device) -> Precision:
    """The precision of a TrainLoop, created once the model is on its device (and before any parallel wrap).

    Args:
        use_amp: False for float32; True for autocast in the device's default low-precision dtype with
            dynamic loss scaling where the dtype needs it, on a device where that is faster (a CPU without
            native bfloat16 trains in float32, with a warning) (or the configuration of a model the user already
            passed through ``amp.initialize``); a dict of ``amp.initialize`` keyword arguments (with bfloat16
            no loss scaling unless the dict has ``loss_scale``); or a dict of
            ``torch.amp.GradScaler`` arguments (aitoolbox 1.8): autocast with dynamic scaling set that way.
        model: the model being trained (on its device).
        optimizers: its optimizers.
        device: the device it trains on.
    """
    meaning = use_amp_meaning(use_amp)
    wrappers = [type(opt).__name__ for opt in optimizers if not isinstance(opt, torch.optim.Optimizer)]
    if wrappers and meaning != "off":
        raise TypeError(f"mixed precision needs torch.optim.Optimizer instances (it unscales their param_groups' "
                        f"gradients), got {', '.join(wrappers)}: pass the torch optimizer itself, or use_amp=False")
    existing = (amp.state_of(optimizers[0]) if optimizers else None) or amp.state_of(model)
    if existing is not None:
        if meaning in ("amp_initialize", "grad_scaler"):
            raise ValueError("the model/optimizer already went through amp.initialize, so use_amp cannot hold "
                             "amp.initialize arguments as well: pass use_amp=True")
        if not use_amp:
            logger.warning("the optimizer went through amp.initialize (%s) but use_amp=False; training with that "
                           "amp configuration anyway (pass use_amp=True to silence this)",
                           existing.properties.opt_level)
        return existing.precision()
    if falls_back_to_float32(meaning, device):
        return full_precision(device.type)
    if meaning == "grad_scaler":
        scaler_args = {key: value for key, value in use_amp.items() if key != "enabled"}
        return autocast_precision(device.type, loss_scaler=LossScaler.from_grad_scaler_args(**scaler_args))
    if meaning == "amp_initialize" and not optimizers:
        # A TrainLoop built for prediction only: the opt level's casts apply, nothing is ever stepped.
        amp.initialize(model, **_quiet(use_amp))
        return amp.state_of(model).precision()
    if meaning == "amp_initialize":
        state_optimizers = amp.initialize(model, optimizers, **_quiet(use_amp))[1]
        if isinstance(model, FeedDefinitionModel):
            # Checkpoints save the user's wrapped module: it must return float32 weights too.
            register_upcast_state_dict(model.model)
        return amp.state_of(state_optimizers[0]).precision()
    if meaning == "default":
        return autocast_precision(device.type)
    return full_precision(device.type)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_precision(precision: Precision, model: nn.Module, policy: Any = None) -> str:
    """What a precision does, in words: ``'bfloat16 autocast on cpu, no loss scaling'``, ``'float16 model weights
    with float32 master weights on cuda, dynamic loss scaling'``, ... (``policy``: FSDP's mixed precision policy)."""
    if policy is not None and getattr(policy, "param_dtype", None) is not None:
        computed = f"{_dtype_name(policy.param_dtype)} compute (FSDP mixed precision)"
    elif precision.master_weights is not None or precision.autocast_dtype is None:
        weights = next((parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()),
                       torch.float32)
        computed = (f"{_dtype_name(weights)} model weights"
                    + (" with float32 master weights" if precision.master_weights is not None else ""))
        if weights == torch.float32 and precision.master_weights is None:
            computed = "float32"
    else:
        computed = f"{_dtype_name(precision.autocast_dtype)} autocast"
    scaler = precision.loss_scaler
    scaling = ("no loss scaling" if scaler is None
               else "dynamic loss scaling" if scaler.dynamic else f"static loss scale {scaler.loss_scale:g}")
    return f"{computed} on {precision.device_type}, {scaling}"


def create_sharded_precision(use_amp: Union[bool, dict, None], model: nn.Module,
                             optimizers: List[torch.optim.Optimizer], device: torch.device) -> Tuple[Precision, Any]:
    """The precision of a fully sharded (FSDP) run, and FSDP's ``MixedPrecisionPolicy`` for it (None: none).

    FSDP keeps the sharded parameters in float32 and casts them when it gathers them, so the opt levels map onto
    its policy instead of casting the model:

    ==========================  ===========================================  =======================================
    ``use_amp``                 FSDP policy                                  the loop
    ==========================  ===========================================  =======================================
    False, O0                   none: everything in float32                  float32
    True, O1, GradScaler dict   compute in the low dtype, reduce gradients   autocast (float32 where autocast keeps
                                in float32                                   it), loss scaling as without FSDP
    O2                          compute and reduce in the low dtype (the     no autocast, loss scaling as
                                float32 shards are O2's master weights)      without FSDP
    O3                          none: the model is cast to the low dtype     no autocast, no master weights
    ==========================  ===========================================  =======================================

    Loss scaling (float16, or asked for) works on the sharded gradients; whether any rank found an overflow is
    agreed across the ranks by the loop (``Precision.agree_on_overflow``), so all skip a step together.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    meaning = use_amp_meaning(use_amp)
    if meaning == "off" or falls_back_to_float32(meaning, device):
        return full_precision(device.type), None
    if meaning == "grad_scaler":
        scaler_args = {key: value for key, value in use_amp.items() if key != "enabled"}
        low = default_low_precision_dtype(device.type)
        return (autocast_precision(device.type, loss_scaler=LossScaler.from_grad_scaler_args(**scaler_args)),
                MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
    if meaning == "default":
        low = default_low_precision_dtype(device.type)
        return autocast_precision(device.type), MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    property_keys = inspect.signature(resolve_properties).parameters
    props = resolve_properties(device.type, **{k: v for k, v in use_amp.items() if k in property_keys})
    low = props.low_precision_dtype
    loss_scaler = LossScaler(props.loss_scale) if props.uses_loss_scaling else None
    if props.opt_level == "O0":
        return full_precision(device.type), None
    if props.opt_level == "O3":
        amp.initialize(model, optimizers, **_quiet(use_amp))
        return amp.state_of(model).precision(), None
    if props.opt_level == "O2":
        return (Precision(device.type, loss_scaler=loss_scaler),
                MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low))
    return (Precision(device.type, autocast_dtype=low, loss_scaler=loss_scaler),
            MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
