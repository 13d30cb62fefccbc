"""Activation checkpointing: ``TrainLoop(..., activation_checkpointing=[nn.TransformerEncoderLayer])``.

Each submodule of the given classes runs its forward under non-reentrant ``torch.utils.checkpoint``: the
backward pass keeps only the submodule's inputs and recomputes its activations when it needs them, trading
about one extra forward of those submodules for their activation memory. Gradients are the same as without it
(the recomputation restores the random state, so dropout draws the same masks).

The submodule stays where it was: its ``forward`` is wrapped by a picklable :class:`CheckpointedForward`
(an instance attribute shadowing the class's method), so parameter names and ``state_dict`` keys do not change,
the model pickles to the processes of ``fit_distributed``, and the module's hooks (FSDP's, amp's) still run
around the checkpointed forward.
"""
import logging
from typing import Any, Sequence, Tuple, Type

import torch.utils.checkpoint
from torch import nn

logger = logging.getLogger(__name__)


class CheckpointedForward:
    """A module's own forward, run under non-reentrant activation checkpointing when gradients are needed.

    Args:
        module: the submodule whose activations are recomputed in backward.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward anyway
            return forward(self.module, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, self.module, *args, use_reentrant=False, **kwargs)


def check_module_classes(module_classes: Any) -> Tuple[Type[nn.Module], ...]:
    """TrainLoop's ``activation_checkpointing`` argument as a tuple of classes (empty: off).

    Raises:
        TypeError: not a list of ``nn.Module`` classes.
    """
    if module_classes is None or module_classes is False:
        return ()
    classes = tuple(module_classes) if isinstance(module_classes, (list, tuple, set)) else (module_classes,)
    if not classes or not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise TypeError(f"activation_checkpointing must be a list of nn.Module classes whose instances recompute "
                        f"their activations in backward (e.g. [nn.TransformerEncoderLayer]), got {module_classes!r}")
    return classes


def checkpointed_modules(model: nn.Module, module_classes: Sequence[Type[nn.Module]]) -> list:
    """The submodules of ``model`` that ``module_classes`` select: instances of them other than the model itself,
    outermost only (one nested in another selected submodule is recomputed with it).

    Raises:
        ValueError: no submodule is of those classes (a misspelt or unused class would silently do nothing).
    """
    classes = tuple(module_classes)
    chosen = [module for name, module in model.named_modules() if name and isinstance(module, classes)]
    if not chosen:
        raise ValueError(f"activation_checkpointing: the model {type(model).__name__} has no submodule of the classes "
                         f"{[cls.__name__ for cls in classes]}")
    nested = {id(inner) for outer in chosen for inner in outer.modules() if inner is not outer}
    return [module for module in chosen if id(module) not in nested]


def apply_activation_checkpointing(model: nn.Module, module_classes: Sequence[Type[nn.Module]]) -> int:
    """Checkpoint the submodules :func:`checkpointed_modules` selects. Idempotent.

    Returns:
        How many submodules are checkpointed.
    """
    modules = checkpointed_modules(model, module_classes)
    for module in modules:
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module)
    logger.debug("activation checkpointing on %d submodule(s) of %s", len(modules), type(model).__name__)
    return len(modules)
