"""Casting a model for mixed precision without patching its methods.

Everything here is a module hook held as a small picklable object, so a prepared model survives
``copy.deepcopy`` (e.g. for an EMA copy) and ``torch.save(model)``:

* :class:`ForwardCaster` casts floating inputs to the model's dtype and floating outputs to the requested
  output dtype, and can run the forward under ``torch.autocast`` (apex O1 without patching torch functions);
* :func:`upcast_state_dict` makes ``model.state_dict()`` return float32 tensors, so a checkpoint of a cast
  model loads into a float32 model.
"""
import threading
from typing import Any, List, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors inside ``value`` (tensors, tuples, lists, dicts) to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast the model's floating parameters and buffers to ``dtype`` in place.

    With ``keep_batchnorm_fp32``, affine BatchNorm layers keep float32 weights and running statistics:
    their statistics need the range, and torch's BatchNorm kernels accept low-precision inputs with float32
    parameters.
    """
    kept = {module for module in model.modules() if keep_batchnorm_fp32 and isinstance(module, _BatchNorm)
            and module.affine}
    for module in model.modules():
        if module in kept:
            continue  # never cast: a round trip through the low dtype would round its float32 values
        for param in module.parameters(recurse=False):
            param.data = cast_floating(param.data, dtype)  # the same Parameter: optimizers keep their references
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, cast_floating(buffer, dtype))


class _AutocastStacks(threading.local):
    """One stack of entered autocast contexts per thread, present from the thread's first access (a stack created
    on demand would make torch.compile recompile the forward once it exists)."""

    def __init__(self):
        super().__init__()
        self.stack: List[Any] = []


class ForwardCaster:
    """Forward hooks of a model prepared by ``amp.initialize``.

    Args:
        input_dtype: cast floating inputs to this dtype (None leaves them).
        output_dtype: cast floating outputs to this dtype (None leaves them).
        autocast_device_type: run the forward under ``torch.autocast`` on this device type (None: no autocast).
        autocast_dtype: the low-precision dtype of that autocast.
    """

    def __init__(self, input_dtype: Optional[torch.dtype], output_dtype: Optional[torch.dtype],
                 autocast_device_type: Optional[str] = None, autocast_dtype: Optional[torch.dtype] = None):
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.autocast_device_type = autocast_device_type
        self.autocast_dtype = autocast_dtype
        self._local = _AutocastStacks()  # DataParallel runs replicas in threads sharing these hooks

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = _AutocastStacks()

    def __deepcopy__(self, memo) -> "ForwardCaster":
        copied = ForwardCaster(self.input_dtype, self.output_dtype, self.autocast_device_type, self.autocast_dtype)
        memo[id(self)] = copied
        return copied

    def _autocast_stack(self) -> List[Any]:
        return self._local.stack

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.autocast_device_type is not None:
            # Under an autocast of the same kind already (TrainLoop's, around get_loss) there is nothing to enter;
            # the model then also compiles (dynamo cannot trace an autocast entered in one hook, left in another).
            context = None
            if not (torch.is_autocast_enabled(self.autocast_device_type)
                    and torch.get_autocast_dtype(self.autocast_device_type) == self.autocast_dtype):
                context = torch.autocast(device_type=self.autocast_device_type, dtype=self.autocast_dtype)
                context.__enter__()
            self._autocast_stack().append(context)
        if self.input_dtype is not None:
            return cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)
        return None

    def after_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # Registered with always_call=True: runs even when forward raised, so autocast is always left.
        if self.autocast_device_type is not None and self._autocast_stack():
            context = self._autocast_stack().pop()
            if context is not None:
                context.__exit__(None, None, None)
        if self.output_dtype is not None:
            return cast_floating(output, self.output_dtype)
        return None

    def attach(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.before_forward, with_kwargs=True)
        model.register_forward_hook(self.after_forward, always_call=True)


def upcast_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook: low-precision floating tensors are returned as float32."""
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype in (torch.float16,
                                                                                              torch.bfloat16):
            state_dict[key] = value.float()


def register_upcast_state_dict(model: nn.Module) -> None:
    if hasattr(model, "register_state_dict_post_hook"):
        model.register_state_dict_post_hook(upcast_state_dict)
    else:  # torch < 2.5 has only the private spelling of the same hook
        model._register_state_dict_hook(upcast_state_dict)
