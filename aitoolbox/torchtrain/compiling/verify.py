"""The check that a compiled model computes the gradients the eager model computes.

A miscompiled forward or backward can train silently wrong: the loss still falls through the layers that were
compiled right (seen with torch 2.13's inductor on the CPU: exactly zero convolution gradients). So, on the first
training batch, TrainLoop runs the batch once eagerly and once compiled, without stepping, and compares each
parameter's gradient. Everything the two passes change is put back: the gradients, the buffers (BatchNorm's
running statistics) and the random state, so training then runs as if the check had not happened.

Randomness: both passes start from the same random state, and the Dropout layers are switched off for both
(compiled code draws its random numbers differently, so the masks would differ). With Dropout in the model the
compiled pass therefore compiles one more graph (its forward without dropout).

Tolerance: the relative difference of each gradient, ``||compiled - eager|| / ||eager||``, must stay below 1e-3
in float32 and 5e-2 under autocast to a 16-bit type (the two runs round differently there); a gradient that is
all zero where the eager one is not, or not finite where the eager one is, always fails.
"""
from typing import Any, Callable, Dict, List

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

FLOAT32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 5e-2


class CompiledGradientsDiffer(RuntimeError):
    """The compiled model's gradients are not the eager model's (raised by :func:`verify_compiled_gradients`)."""


def verify_compiled_gradients(model: nn.Module, compute_loss: Callable[[], Any], autocast_dtype: Any) -> None:
    """Compare the gradients of ``compute_loss()`` compiled and eager; put back what the passes changed.

    Args:
        model: the user's module, compiled in place (its ``_compiled_call_impl`` is the compiled call).
        compute_loss: runs the batch's forward and returns the loss to back-propagate (a scalar tensor).
        autocast_dtype: the low dtype autocast runs in, or None (float32): sets the tolerance.

    Raises:
        CompiledGradientsDiffer: naming the parameters whose gradients differ and the way out.
    """
    params = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    saved_grads = [param.grad for _, param in params]
    saved_buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    dropouts = [module for module in model.modules() if isinstance(module, _DropoutNd) and module.training]
    compiled_call = model._compiled_call_impl

    def gradients(compiled: bool) -> Dict[str, torch.Tensor]:
        for _, param in params:
            param.grad = None
        torch.set_rng_state(cpu_rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
        model._compiled_call_impl = compiled_call if compiled else None
        try:
            compute_loss().float().backward()
        finally:
            model._compiled_call_impl = compiled_call
            with torch.no_grad():
                for buffer, value in saved_buffers:
                    buffer.copy_(value)
        return {name: param.grad.detach().clone() for name, param in params if param.grad is not None}

    try:
        for module in dropouts:
            module.eval()
        eager = gradients(compiled=False)
        compiled = gradients(compiled=True)
    finally:
        for module in dropouts:
            module.train()
        for (_, param), grad in zip(params, saved_grads):
            param.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
    tolerance = FLOAT32_TOLERANCE if autocast_dtype in (None, torch.float32) else LOW_PRECISION_TOLERANCE
    problems = gradient_differences(eager, compiled, tolerance)
    if problems:
        raise CompiledGradientsDiffer(
            f"torch_compile: on the first training batch the compiled {type(model).__name__} computed other "
            f"gradients than the eager model (relative tolerance {tolerance:g}): {'; '.join(problems)}. The "
            "compiled code is wrong for this model (a torch.compile bug), and training it would go silently "
            "wrong. Train with torch_compile={'backend': 'aot_eager'} or without torch_compile; "
            "torch_compile={'verify': False} skips this check.")


def gradient_differences(eager: Dict[str, torch.Tensor], compiled: Dict[str, torch.Tensor],
                         tolerance: float) -> List[str]:
    """One line per parameter whose compiled gradient is missing, all zero, not finite, or too far off."""
    problems = []
    for name, expected in eager.items():
        actual = compiled.get(name)
        if actual is None:
            problems.append(f"{name} (no gradient when compiled)")
            continue
        expected, actual = expected.float(), actual.float()
        if torch.isfinite(expected).all() and not torch.isfinite(actual).all():
            problems.append(f"{name} (not finite when compiled)")
            continue
        scale = float(expected.norm())
        if scale > 0 and float(actual.abs().max()) == 0:
            problems.append(f"{name} (all zero when compiled)")
            continue
        difference = float((actual - expected).norm()) / max(scale, 1e-12)
        if scale > 0 and difference > tolerance:
            problems.append(f"{name} (relative difference {difference:.3g})")
    return problems[:10] + ([f"... {len(problems) - 10} more"] if len(problems) > 10 else [])
