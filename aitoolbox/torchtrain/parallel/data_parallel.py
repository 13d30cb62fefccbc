"""DataParallel and DistributedDataParallel wrappers that keep a TTModel's ``get_loss`` / ``get_predictions``.

Wrapping a TTModel in ``nn.DataParallel`` hides its methods behind the wrapper, and calling
``wrapper.module.get_loss(...)`` would run ``self(...)`` on the bare module, outside the parallel forward.
These wrappers (aitoolbox 1.8's ``TTDataParallel`` and ``TTDistributedDataParallel``) instead run the model's
methods *with the wrapper as* ``self``:

* ``self(x)`` inside ``get_loss`` goes through the wrapper's forward, so DataParallel splits the batch over the
  GPUs and DistributedDataParallel synchronises gradients;
* the model's other methods are re-bound to the wrapper, so ``self.helper()`` works;
* attributes named in the model's ``transfer_model_attributes`` are copied onto the wrapper, so
  ``self.<name>`` works; any other model attribute (including submodules) is not reachable through ``self``
  and raises ``AttributeError``, exactly as in aitoolbox 1.8.

Both wrappers work on a CPU-only machine: DataParallel without GPUs calls the module directly, and
DistributedDataParallel runs over a gloo process group.
"""
import functools
import logging
from typing import Any, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

CORE_MODEL_METHODS = ('get_loss', 'get_loss_eval', 'get_predictions')


def _method_function(method: Any, owner: Any) -> Any:
    """The plain function behind ``method`` if it is bound to ``owner``; None for any other callable."""
    if getattr(method, '__self__', None) is owner and hasattr(method, '__func__'):
        return method.__func__
    return None


class TTParallelBase:
    """Gives a parallel wrapper its model's TTModel methods, run with the wrapper as ``self``.

    Args:
        module: the wrapped TTModel.
        default_model_methods: the model's core methods, exposed as the wrapper's own ``get_loss``,
            ``get_loss_eval`` and ``get_predictions``; every other method of the model (beyond those of
            ``nn.Module``) is re-bound to the wrapper under its own name.
    """

    def __init__(self, module: nn.Module, default_model_methods: Sequence[str] = CORE_MODEL_METHODS):
        self.get_loss_fn = self._function_of(module, 'get_loss')
        self.get_loss_eval_fn = self._function_of(module, 'get_loss_eval')
        self.get_predictions_fn = self._function_of(module, 'get_predictions')

        # Never shadow nn.Module's or the wrapper's own API (forward, DDP's no_sync, ...), the model's
        # submodules (reached through the parallel forward instead) or the core methods above.
        skipped = (set(dir(nn.Module)) | set(dir(type(self))) | set(getattr(module, '_modules', {}))
                   | set(default_model_methods))
        for name in dir(module):
            if name in skipped:
                continue
            value = getattr(module, name, None)
            if not callable(value):
                continue
            function = _method_function(value, module)
            # object.__setattr__: a transferred callable must not be registered as a submodule of the wrapper.
            if function is not None:
                object.__setattr__(self, name, functools.partial(function, self))
            else:  # a static method, class method or callable attribute needs no re-binding
                object.__setattr__(self, name, value)

        transferred = getattr(module, 'transfer_model_attributes', None)
        if isinstance(transferred, (list, tuple)):
            for name in transferred:
                # A reference, not a registration: a transferred tensor or module must not appear twice in the
                # wrapper's state_dict.
                object.__setattr__(self, name, getattr(module, name))

    @staticmethod
    def _function_of(module: nn.Module, name: str) -> Any:
        method = getattr(module, name)
        function = _method_function(method, module)
        if function is None:
            raise TypeError(f'{type(module).__name__}.{name} must be a method of the model (a TTModel '
                            f'implementing get_loss, get_loss_eval and get_predictions), got {method!r}.')
        return function

    def get_loss(self, batch_data, criterion, device):
        """The model's ``get_loss`` with the wrapper as ``self``."""
        return self.get_loss_fn(self, batch_data, criterion, device)

    def get_loss_eval(self, batch_data, criterion, device):
        """The model's ``get_loss_eval`` with the wrapper as ``self``."""
        return self.get_loss_eval_fn(self, batch_data, criterion, device)

    def get_predictions(self, batch_data, device):
        """The model's ``get_predictions`` with the wrapper as ``self``."""
        return self.get_predictions_fn(self, batch_data, device)


class TTDataParallel(nn.DataParallel, TTParallelBase):
    """``nn.DataParallel`` over a TTModel that keeps the model's TTModel methods (see the module docstring).

    Args:
        module: the TTModel.
        default_model_methods: see :class:`TTParallelBase`.
        **kwargs: ``nn.DataParallel``'s arguments (``device_ids``, ``output_device``, ``dim``).

    Example::

        model = TTDataParallel(MyTTModel().cuda())
        TrainLoop(model, train_loader, val_loader, None, optimizer, criterion).fit(num_epochs=10)
    """

    def __init__(self, module: nn.Module, default_model_methods: Sequence[str] = CORE_MODEL_METHODS, **kwargs):
        nn.DataParallel.__init__(self, module, **kwargs)
        TTParallelBase.__init__(self, module, default_model_methods)


class TTDistributedDataParallel(TTParallelBase, DistributedDataParallel):
    """torch's ``DistributedDataParallel`` over a TTModel that keeps the model's TTModel methods.

    The default process group must be initialised first (``torch.distributed.init_process_group``).

    Args:
        module: the TTModel.
        default_model_methods: see :class:`TTParallelBase`.
        **kwargs: ``DistributedDataParallel``'s arguments (``device_ids``, ``find_unused_parameters``, ...).
    """

    def __init__(self, module: nn.Module, default_model_methods: Sequence[str] = CORE_MODEL_METHODS, **kwargs):
        DistributedDataParallel.__init__(self, module, **kwargs)
        TTParallelBase.__init__(self, module, default_model_methods)
