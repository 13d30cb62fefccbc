"""Several losses and several optimizers in one training step (aitoolbox 1.8's ``multi_loss_optim``).

A model's ``get_loss`` returns a :class:`MultiLoss` (named losses) and the user passes a
:class:`MultiOptimizer` (a list of optimizers) to the TrainLoop. The loop then runs, for each optimizer index
``i``, ``loss.backward(i, ...)``, ``optimizer.step(i, ...)`` and ``optimizer.zero_grad(i, ...)``; the loss named
for optimizer ``i`` in ``loss_optimizer_map`` is the one back-propagated before optimizer ``i`` steps.

Both methods take the loop's gradient scaler: any object with ``scale(loss)`` and ``step(optimizer)`` in the
manner of ``torch.amp.GradScaler``. A disabled scaler returns the loss unchanged and simply calls
``optimizer.step()``, so the same code path serves training with and without mixed precision.
"""
import copy
from collections.abc import Iterator, MutableMapping
from typing import Any, Dict, List, Optional


def _slot_names(cls: type) -> List[str]:
    """The attribute names of the ``__slots__`` a class and its bases declare (a subclass of MultiLoss may add
    some), private ones as Python stores them (``__secret`` of class ``Loss``: ``_Loss__secret``)."""
    names: List[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__") and klass.__name__.lstrip("_"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    return names


class MultiLoss(MutableMapping):
    """A dict of named losses that the TrainLoop back-propagates one optimizer at a time.

    It behaves as a ``dict`` (indexing, iteration, ``len``, equality with a plain dict) and also mirrors the
    tensor methods the loop applies to a single loss (``item``, ``detach``, ``cpu``, ``to``, division by the
    gradient-accumulation count), each returning a new :class:`MultiLoss` with the method applied to every loss: a
    copy of the same class, with the attributes the instance carries, so that a subclass's own ``backward`` is
    called on the loss the loop divided.

    Args:
        loss_dict: the losses, keyed by name.
        loss_optimizer_map: loss name -> index of the optimizer in the :class:`MultiOptimizer` that this loss
            trains. ``None`` pairs the losses, in the dict's order, with optimizers ``0, 1, 2, ...``.
        retain_graph_until_last: keep the autograd graph alive after each ``backward`` except the last one of
            the step, so losses sharing part of the graph can all be back-propagated.

    Raises:
        ValueError: if ``loss_optimizer_map`` does not name as many losses as ``loss_dict`` holds.
    """

    def __init__(self, loss_dict: Dict[str, Any], loss_optimizer_map: Optional[Dict[str, int]] = None,
                 retain_graph_until_last: bool = True):
        self.loss_dict = loss_dict
        self.loss_optimizer_map = loss_optimizer_map
        self.retain_graph_until_last = retain_graph_until_last
        # Counts down with every backward(); the last one may free the graph.
        self.loss_backward_remaining = len(loss_dict)

        if loss_optimizer_map is None:
            self.optimizer_loss_map = dict(enumerate(loss_dict.keys()))
        else:
            if len(loss_optimizer_map) != len(loss_dict):
                raise ValueError(
                    f'loss_optimizer_map has {len(loss_optimizer_map)} entries but loss_dict holds '
                    f'{len(loss_dict)} losses ({list(loss_dict)}): map every loss name to one optimizer index.')
            self.optimizer_loss_map = {int(opt_idx): str(name) for name, opt_idx in loss_optimizer_map.items()}

    def backward(self, optimizer_idx: int, iteration: int, amp_grad_scaler: Any) -> None:
        """Back-propagate the loss that belongs to optimizer ``optimizer_idx``.

        Args:
            optimizer_idx: index of the optimizer about to step.
            iteration: the loop's current iteration; unused here, available to subclasses with custom schedules.
            amp_grad_scaler: GradScaler-like object; the loss always goes through its ``scale`` (a disabled
                scaler returns it unchanged).
        """
        loss = amp_grad_scaler.scale(self.loss_dict[self.optimizer_loss_map[optimizer_idx]])
        if self.retain_graph_until_last and self.loss_backward_remaining > 1:
            loss.backward(retain_graph=True)
        else:
            loss.backward()
        self.loss_backward_remaining -= 1

    def _map(self, fn) -> 'MultiLoss':
        """A copy of this MultiLoss holding ``fn(loss)`` for every loss: of its class, with every attribute it carries
        (its settings, backward count, and a subclass's own; a shallow copy, so what they refer to is shared).

        The loop divides the loss by ``grad_accumulation`` before the backward passes: a subclass's own ``backward``
        must be what it then calls (1.8's division built a plain MultiLoss, and the override was silently lost).
        """
        # Built field by field, not with copy.copy (which probes the half-built object for __setstate__: a subclass
        # whose __getattr__ reads self.loss_dict would recurse), and without __init__ (a subclass's may take other
        # arguments).
        cls = type(self)
        if getattr(cls, "__copy__", None) is not None:  # the subclass says how it is copied
            new_loss = copy.copy(self)
            new_loss.loss_dict = {name: fn(loss) for name, loss in self.loss_dict.items()}
            return new_loss
        new_loss = cls.__new__(cls)
        fields = dict(vars(self))
        fields["loss_dict"] = {name: fn(loss) for name, loss in self.loss_dict.items()}
        object.__getattribute__(new_loss, "__dict__").update(fields)
        for slot in _slot_names(cls):
            try:
                object.__setattr__(new_loss, slot, object.__getattribute__(self, slot))
            except AttributeError:  # a slot this instance never set
                pass
        return new_loss

    def item(self) -> 'MultiLoss':
        """Python numbers of all losses (compares equal to the plain dict of them)."""
        return self._map(lambda loss: loss.item())

    def numpy(self) -> 'MultiLoss':
        return self._map(lambda loss: loss.numpy())

    def detach(self) -> 'MultiLoss':
        return self._map(lambda loss: loss.detach())

    def cpu(self, *args, **kwargs) -> 'MultiLoss':
        return self._map(lambda loss: loss.cpu(*args, **kwargs))

    def cuda(self, *args, **kwargs) -> 'MultiLoss':
        return self._map(lambda loss: loss.cuda(*args, **kwargs))

    def to(self, *args, **kwargs) -> 'MultiLoss':
        return self._map(lambda loss: loss.to(*args, **kwargs))

    def __truediv__(self, divisor) -> 'MultiLoss':
        # The loop divides the loss by grad_accumulation before backward.
        return self._map(lambda loss: loss / divisor)

    @property
    def device(self) -> Dict[str, Any]:
        """Device of each loss, by name."""
        return {name: loss.device for name, loss in self.loss_dict.items()}

    def get_loss_dict(self) -> Dict[str, Any]:
        return self.loss_dict

    def __getitem__(self, key: str) -> Any:
        return self.loss_dict[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.loss_dict[key] = value

    def __delitem__(self, key: str) -> None:
        del self.loss_dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.loss_dict)

    def __len__(self) -> int:
        return len(self.loss_dict)

    def __repr__(self) -> str:
        return f'MultiLoss({self.loss_dict!r})'


class MultiOptimizer:
    """A list of optimizers that the TrainLoop steps one index at a time.

    Args:
        optimizer_list: the optimizers; their position is the index used by :class:`MultiLoss`'s
            ``loss_optimizer_map``.
    """

    def __init__(self, optimizer_list: List[Any]):
        self.optimizer_list = optimizer_list

    def step(self, optimizer_idx: int, iteration: int, amp_grad_scaler: Any) -> None:
        """Step optimizer ``optimizer_idx`` through the scaler.

        Args:
            optimizer_idx: which optimizer to step.
            iteration: the loop's current iteration; unused here, available to subclasses.
            amp_grad_scaler: GradScaler-like object; a disabled one just calls ``optimizer.step()``.
        """
        amp_grad_scaler.step(self.optimizer_list[optimizer_idx])

    def zero_grad(self, optimizer_idx: int, iteration: int) -> None:
        """Zero the gradients of optimizer ``optimizer_idx``.

        Args:
            optimizer_idx: which optimizer.
            iteration: the loop's current iteration; unused here, available to subclasses.
        """
        self.optimizer_list[optimizer_idx].zero_grad()

    def state_dict(self) -> List[Dict[str, Any]]:
        """The optimizers' state dicts, in list order."""
        return [optimizer.state_dict() for optimizer in self.optimizer_list]

    def load_state_dict(self, state_dict_list: List[Dict[str, Any]]) -> None:
        """Load one state dict into each optimizer, in list order.

        Raises:
            TypeError: if ``state_dict_list`` is not a list.
            ValueError: if it holds a different number of state dicts than there are optimizers.
        """
        if not isinstance(state_dict_list, list):
            raise TypeError(f'state_dict_list must be a list of optimizer state dicts (as returned by '
                            f'MultiOptimizer.state_dict()), got {type(state_dict_list).__name__}.')
        if len(state_dict_list) != len(self.optimizer_list):
            raise ValueError(f'state_dict_list holds {len(state_dict_list)} state dicts but this MultiOptimizer '
                             f'has {len(self.optimizer_list)} optimizers.')
        for state_dict, optimizer in zip(state_dict_list, self.optimizer_list):
            optimizer.load_state_dict(state_dict)

    def __len__(self) -> int:
        return len(self.optimizer_list)

    def __getitem__(self, idx: int) -> Any:
        return self.optimizer_list[idx]

    def __iter__(self):
        return iter(self.optimizer_list)

    def __repr__(self) -> str:
        return f'MultiOptimizer({self.optimizer_list!r})'
