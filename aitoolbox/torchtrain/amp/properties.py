"""apex's optimization levels O0-O3 and the validation of ``amp.initialize``'s keyword overrides."""
import dataclasses
import warnings
from typing import Any, Optional, Union

import torch

from aitoolbox.torchtrain.precision.factory import default_low_precision_dtype

HALF = "half"  # the cast type of O2/O3: float16 on CUDA, bfloat16 on CPU, unless ``dtype=`` says otherwise

OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=HALF, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=HALF, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}
OPT_LEVEL_DESCRIPTIONS = {
    "O0": "pure float32 training",
    "O1": "mixed precision: forward under torch.autocast, float32 weights, dynamic loss scaling for float16",
    "O2": "almost low precision: model cast (BatchNorm kept float32), float32 master weights, dynamic loss scaling "
          "for float16",
    "O3": "pure low precision training",
}
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class AmpProperties:
    """The resolved settings of one ``amp.initialize`` call.

    Attributes:
        opt_level: ``'O0'`` .. ``'O3'``.
        cast_model_type: dtype the model is cast to, or None to leave it.
        patch_torch_functions: run the forward under ``torch.autocast`` (what apex did by patching torch).
        keep_batchnorm_fp32: keep affine BatchNorm layers in float32 when the model is cast.
        master_weights: the optimizer steps float32 copies of low-precision parameters.
        loss_scale: ``'dynamic'`` or a float; 1.0 is no scaling at all (bfloat16's default, see
            :func:`resolve_properties`).
        low_precision_dtype: the dtype ``'half'`` stands for, and the autocast dtype.
        cast_model_outputs: dtype of the model's floating outputs, or None to leave them.
    """

    opt_level: str
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: Union[str, float]
    low_precision_dtype: torch.dtype
    cast_model_outputs: Optional[torch.dtype]

    @property
    def uses_loss_scaling(self) -> bool:
        """False when the loss scale is a static 1.0: then no step scales, unscales or checks for overflow."""
        return self.loss_scale == "dynamic" or self.loss_scale != 1.0


def parse_keep_batchnorm_fp32(value: Any) -> Optional[bool]:
    """True, False, 'True', 'False' (the command-line spellings) or None."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"keep_batchnorm_fp32 must be True, False, 'True', 'False' or None, got {value!r}")


def parse_loss_scale(value: Any) -> Union[str, float]:
    """'dynamic' or anything ``float()`` accepts (e.g. '128.0')."""
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be 'dynamic' or a number such as 128.0, got {value!r}") from None
    if not scale > 0:
        raise ValueError(f"loss_scale must be positive, got {value!r}")
    return scale


def parse_dtype(value: Any, name: str) -> Optional[torch.dtype]:
    if value is None or value is False:
        return None
    if value == HALF:
        return value
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    raise TypeError(f"{name} must be a floating torch.dtype (torch.float16, torch.bfloat16, torch.float32) or "
                    f"None, got {value!r}")


def resolve_properties(device_type: str, opt_level: str = "O1", cast_model_type: Any = None,
                       patch_torch_functions: Optional[bool] = None, keep_batchnorm_fp32: Any = None,
                       master_weights: Optional[bool] = None, loss_scale: Any = None,
                       cast_model_outputs: Any = None, dtype: Optional[torch.dtype] = None) -> AmpProperties:
    """Start from the opt level's table row and apply every keyword that is not None, checking each.

    One deliberate difference from apex's table: unless ``loss_scale`` is given, O1 and O2 scale the loss
    only when they compute in float16 (the autocast type under O1, the model's type under O2). bfloat16 has
    float32's exponent range, so its gradients do not underflow and scaling would only cost time.

    Raises:
        ValueError: unknown opt level, or an override that contradicts the level.
        TypeError: a dtype argument that is not a floating dtype.
    """
    if opt_level not in OPT_LEVELS:
        zero_hint = (" The prefix is the capital letter O, not the number zero."
                     if isinstance(opt_level, str) and opt_level[:1] == "0" else "")
        raise ValueError(f"unknown opt_level {opt_level!r}: use one of 'O0', 'O1', 'O2', 'O3'.{zero_hint}")
    if dtype is not None and dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    cast_model_type = parse_dtype(cast_model_type, "cast_model_type")
    cast_model_outputs = parse_dtype(cast_model_outputs, "cast_model_outputs")
    keep_batchnorm_fp32 = parse_keep_batchnorm_fp32(keep_batchnorm_fp32)
    if opt_level == "O1":
        if cast_model_type not in (None, torch.float32):
            raise ValueError("O1 runs the forward under autocast and keeps the model's weights in float32, so "
                             f"cast_model_type must be None (got {cast_model_type!r}). Use O2 or O3 to cast the model.")
        if keep_batchnorm_fp32 is not None or master_weights is not None:
            raise ValueError("O1 keeps the whole model in float32, so keep_batchnorm_fp32 and master_weights must be "
                             f"None with O1 (got keep_batchnorm_fp32={keep_batchnorm_fp32!r}, "
                             f"master_weights={master_weights!r}). Use O2 for a cast model with master weights.")
    if patch_torch_functions and opt_level != "O1":
        raise ValueError(f"patch_torch_functions=True is only valid with opt_level 'O1', got {opt_level!r}")

    settings = dict(OPT_LEVELS[opt_level])
    overrides = dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                     loss_scale=None if loss_scale is None else parse_loss_scale(loss_scale))
    settings.update({key: value for key, value in overrides.items() if value is not None})
    if opt_level == "O0" and settings["loss_scale"] != 1.0:
        warnings.warn("loss scaling with opt_level O0 (pure float32) has no benefit; it is applied anyway",
                      stacklevel=3)

    low_precision = dtype or default_low_precision_dtype(device_type)
    model_type = low_precision if settings["cast_model_type"] == HALF else settings["cast_model_type"]
    computes_in_float16 = model_type == torch.float16 or (settings["patch_torch_functions"]
                                                           and low_precision == torch.float16)
    if loss_scale is None and not computes_in_float16:
        settings["loss_scale"] = 1.0  # bfloat16 (or float32) gradients do not underflow: no scaling work
    if cast_model_outputs == HALF:
        cast_model_outputs = low_precision
    if cast_model_outputs is None and (settings["patch_torch_functions"] or model_type in LOW_PRECISION_DTYPES):
        # The loss is usually computed outside the model: give it float32 logits, as apex's patched loss
        # functions did, so the loss and its gradient are not computed in low precision.
        cast_model_outputs = torch.float32
    properties = AmpProperties(
        opt_level=opt_level, cast_model_type=model_type,
        patch_torch_functions=bool(settings["patch_torch_functions"]),
        keep_batchnorm_fp32=settings["keep_batchnorm_fp32"], master_weights=bool(settings["master_weights"]),
        loss_scale=settings["loss_scale"], low_precision_dtype=low_precision, cast_model_outputs=cast_model_outputs)
    return properties
