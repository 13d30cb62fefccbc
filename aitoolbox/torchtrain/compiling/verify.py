"""The check that a compiled model computes the gradients the eager model computes.

A miscompiled forward or backward can train silently wrong: the loss still falls through the layers that were
compiled right (seen with torch 2.13's inductor on the CPU: exactly zero convolution gradients). So, on the first
training batch, TrainLoop runs the batch once eagerly and once compiled, without stepping, and compares each
parameter's gradient. Everything the passes change is put back: the gradients, the buffers (BatchNorm's running
statistics), the modules' train/eval modes and the random state, so training then runs as if the check had not
happened.

Randomness: every pass starts from the same random state, and the Dropout layers are switched off. That is not
enough for every model: compiled code may draw its random numbers in another way than eager code (inductor does:
its own random kernels, seeded from torch's generator), so a random operation the Dropout layers do not cover
(``F.dropout``, as Hugging Face models call it; stochastic depth; added noise) gives the two passes different
masks. So when the gradients differ, the check asks whether the eager loss is random at all (one more eager pass
from another random state): a deterministic one means the compiled code is wrong. A random one is compared again
with every module in eval mode except the normalization layers (which keep computing batch statistics), which
switches off what ``self.training`` gates (``F.dropout(x, p, self.training)``); a model that still draws random
numbers then (noise added whatever the mode) cannot be compared, and the check is skipped with a warning rather
than blaming torch.compile. Each mode the passes use is one more compiled graph.

Tolerance: the relative difference of each gradient, ``||compiled - eager|| / ||eager||``, must stay below 1e-3
in float32 and 5e-2 under autocast to a 16-bit type (the two runs round differently there); a gradient that is
all zero where the eager one is not, or not finite where the eager one is, always fails. A gradient far smaller
than the others (below the tolerance times the norm of all gradients together: one that is zero in exact
arithmetic, as the bias of a layer a BatchNorm follows) is rounding noise, compared against that bound instead.
"""
import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.dropout import _DropoutNd

logger = logging.getLogger(__name__)

FLOAT32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 5e-2
_OTHER_SEED = 0x5EED  # the random state of the pass that tells a random loss from a deterministic one


class CompiledGradientsDiffer(RuntimeError):
    """The compiled model's gradients are not the eager model's (raised by :func:`verify_compiled_gradients`)."""


class _RandomState:
    """The CPU and (initialised) CUDA generators' states, to start a pass from."""

    def __init__(self, cpu: torch.Tensor, cuda: List[torch.Tensor]):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def current(cls) -> "_RandomState":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        return cls(torch.get_rng_state(), cuda)

    def other(self) -> "_RandomState":
        """Another state: from a generator seeded apart (``torch.manual_seed`` would also queue a seed for a CUDA
        not initialised yet, which the run would then start from)."""
        cpu = torch.Generator().manual_seed(_OTHER_SEED).get_state()
        cuda = [torch.Generator(device=f"cuda:{index}").manual_seed(_OTHER_SEED).get_state()
                for index in range(len(self.cuda))]
        return _RandomState(cpu, cuda)

    def set(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


class _Passes:
    """Forward and backward passes of one batch, eager or compiled, each leaving the model as it found it."""

    def __init__(self, model: nn.Module, compute_loss: Callable[[], Any]):
        self.model = model
        self.compute_loss = compute_loss
        self.params = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
        self.compiled_call = model._compiled_call_impl

    def gradients(self, compiled: bool, random_state: _RandomState) -> Dict[str, torch.Tensor]:
        for _, param in self.params:
            param.grad = None
        random_state.set()
        self.model._compiled_call_impl = self.compiled_call if compiled else None
        try:
            self.compute_loss().float().backward()
        finally:
            self.model._compiled_call_impl = self.compiled_call
            with torch.no_grad():
                for buffer, value in self.buffers:
                    buffer.copy_(value)
        return {name: param.grad.detach().clone() for name, param in self.params if param.grad is not None}

    def eager_is_random(self, eager: Dict[str, torch.Tensor], random_state: _RandomState) -> bool:
        """Whether an eager pass from another random state computes other gradients than ``eager``."""
        again = self.gradients(False, random_state.other())
        return again.keys() != eager.keys() or not all(torch.equal(again[name], eager[name]) for name in eager)


@contextlib.contextmanager
def _in_eval_mode(modules: List[nn.Module]) -> Iterator[None]:
    """``modules`` (each by itself, not its children) in eval mode, their modes put back on exit."""
    saved = [module.training for module in modules]
    try:
        for module in modules:
            module.training = False
        yield
    finally:
        for module, training in zip(modules, saved):
            module.training = training


def verify_compiled_gradients(model: nn.Module, compute_loss: Callable[[], Any], autocast_dtype: Any) -> bool:
    """Compare the gradients of ``compute_loss()`` compiled and eager; put back what the passes changed.

    Args:
        model: the user's module, compiled in place (its ``_compiled_call_impl`` is the compiled call).
        compute_loss: runs the batch's forward and returns the loss to back-propagate (a scalar tensor).
        autocast_dtype: the low dtype autocast runs in, or None (float32): sets the tolerance.

    Returns:
        True when the gradients were compared (and agree); False when the model's randomness left nothing to
        compare (a warning said so).

    Raises:
        CompiledGradientsDiffer: naming the parameters whose gradients differ and the way out.
    """
    tolerance = FLOAT32_TOLERANCE if autocast_dtype in (None, torch.float32) else LOW_PRECISION_TOLERANCE
    passes = _Passes(model, compute_loss)
    saved_grads = [param.grad for _, param in passes.params]
    random_state = _RandomState.current()
    dropouts = [module for module in model.modules() if isinstance(module, _DropoutNd) and module.training]
    try:
        with _in_eval_mode(dropouts):
            eager = passes.gradients(False, random_state)
            problems = gradient_differences(eager, passes.gradients(True, random_state), tolerance)
            random = bool(problems) and passes.eager_is_random(eager, random_state)
        if random:
            problems = _compare_without_training_randomness(model, passes, random_state, tolerance)
            if problems is None:
                return False
    finally:
        for (_, param), grad in zip(passes.params, saved_grads):
            param.grad = grad
        random_state.set()
    if problems:
        raise CompiledGradientsDiffer(
            f"torch_compile: on the first training batch the compiled {type(model).__name__} computed other "
            f"gradients than the eager model (relative tolerance {tolerance:g}): {'; '.join(problems)}. The "
            "compiled code is wrong for this model (a torch.compile bug), and training it would go silently "
            "wrong. Train with torch_compile={'backend': 'aot_eager'} or without torch_compile; "
            "torch_compile={'verify': False} skips this check.")
    return True


def _compare_without_training_randomness(model: nn.Module, passes: _Passes, random_state: _RandomState,
                                         tolerance: float) -> Optional[List[str]]:
    """The comparison for a model whose loss is random beyond its Dropout layers: with every module but the
    normalization layers in eval mode. None when it cannot compare (the loss is random still, or the model cannot
    run so), after a warning."""
    # Normalization layers keep training mode: their batch statistics are part of the training graph's backward.
    others = [module for module in model.modules() if not isinstance(module, _NormBase)]
    with _in_eval_mode(others):
        try:
            eager = passes.gradients(False, random_state)
            if passes.eager_is_random(eager, random_state):
                logger.warning("torch_compile: the check of the compiled gradients is skipped: %s draws random "
                               "numbers that eval mode does not switch off, and compiled code draws them in "
                               "another way than eager code, so the two cannot be compared",
                               type(model).__name__)
                return None
            compiled = passes.gradients(True, random_state)
        except Exception as error:  # the model's own code, in a mode it is not trained in
            logger.warning("torch_compile: the check of the compiled gradients is skipped: %s draws random numbers "
                           "besides its Dropout layers, and its loss could not be computed with them switched off "
                           "(eval mode): %s: %s", type(model).__name__, type(error).__name__, error)
            return None
    return gradient_differences(eager, compiled, tolerance)


def gradient_differences(eager: Dict[str, torch.Tensor], compiled: Dict[str, torch.Tensor],
                         tolerance: float) -> List[str]:
    """One line per parameter whose compiled gradient is missing, all zero, not finite, or too far off.

    A gradient is compared relative to the larger of its own norm and ``tolerance`` times the norm of all the
    eager gradients together: a gradient that is zero in exact arithmetic (the bias of a layer a BatchNorm
    follows, whose mean the normalization removes) is rounding noise, and eager and compiled code round
    differently (a relative difference of 1 between two noises of 1e-8 says nothing)."""
    norms = [float(gradient.float().norm()) for gradient in eager.values()]
    total = sum(norm ** 2 for norm in norms if norm == norm and norm != float("inf")) ** 0.5
    floor = tolerance * total
    problems = []
    for (name, expected), scale in zip(eager.items(), norms):
        actual = compiled.get(name)
        if actual is None:
            problems.append(f"{name} (no gradient when compiled)")
            continue
        expected, actual = expected.float(), actual.float()
        if torch.isfinite(expected).all() and not torch.isfinite(actual).all():
            problems.append(f"{name} (not finite when compiled)")
            continue
        if scale > floor and float(actual.abs().max()) == 0:
            problems.append(f"{name} (all zero when compiled)")
            continue
        reference = max(scale, floor)
        difference = float((actual - expected).norm()) / reference if reference > 0 else 0.0
        if difference > tolerance:
            problems.append(f"{name} (relative difference {difference:.3g})")
    return problems[:10] + ([f"... {len(problems) - 10} more"] if len(problems) > 10 else [])
