"""Train/eval modes per submodule: evaluation puts each one back as it was, and ``fit`` keeps frozen ones frozen.

A fine-tuning user freezes part of a model by putting it in eval mode (a BatchNorm whose running statistics must
not change, a Dropout to switch off): ``model.backbone.bn.eval()``. ``model.train()`` and ``model.eval()`` set the
whole tree, so a loop that calls them must remember and restore each submodule's own mode.
"""
import contextlib
from typing import Iterator, List, Tuple

from torch import nn


def submodule_modes(module: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """``(submodule, training)`` for ``module`` and every module below it."""
    return [(submodule, submodule.training) for submodule in module.modules()]


def restore_modes(modes: List[Tuple[nn.Module, bool]]) -> None:
    for submodule, training in modes:
        submodule.training = training  # this module only: its children are in the list themselves


@contextlib.contextmanager
def modes_restored(*modules: nn.Module) -> Iterator[None]:
    """Restore the mode of every submodule of ``modules`` on exit (what the body set with ``eval()`` undone)."""
    saved = [mode for module in modules for mode in submodule_modes(module)]
    try:
        yield
    finally:
        restore_modes(saved)


class FrozenModules:
    """The submodules the user keeps in eval mode during training, and ``fit``'s switch to training mode.

    When ``fit`` starts with the model in training mode, the submodules found in eval mode are the frozen ones:
    they stay in eval mode, and are remembered. When it starts with the whole model in eval mode (``model.eval()``
    before predicting, say), the model is put in training mode except the frozen submodules remembered from an
    earlier ``fit`` that are still in eval mode. Unfreezing is ``submodule.train()`` before the next ``fit``, also
    after ``model.eval()``: a remembered submodule found in training mode is no longer frozen.
    """

    def __init__(self):
        self._frozen: List[nn.Module] = []

    @property
    def modules(self) -> List[nn.Module]:
        return list(self._frozen)

    def enter_training(self, model: nn.Module, runner) -> None:
        """Put ``runner`` (the model or its parallel wrapper) in training mode, keeping ``model``'s frozen parts."""
        if model.training:
            self._frozen = [submodule for submodule in model.modules() if not submodule.training]
        else:  # the whole tree was put in eval mode: only the user's train() calls since then tell what changed
            self._frozen = [submodule for submodule in self._frozen if not submodule.training]
        runner.train()
        for submodule in self._frozen:
            submodule.eval()
