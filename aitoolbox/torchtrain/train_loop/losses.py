"""One loss or several: the loop's bookkeeping of batch losses, plain tensors and ``MultiLoss`` alike.

A model's ``get_loss`` returns a scalar tensor or a :class:`~aitoolbox.torchtrain.multi_loss_optim.MultiLoss`
of named scalar tensors. The loop sums losses over an epoch as one tensor: 0-dimensional for a single loss,
one element per loss name (in sorted order, as aitoolbox 1.x) for a MultiLoss. History keys follow 1.x:
``loss``/``val_loss``/``accumulated_loss`` for a single loss, ``loss_<name>``, ``val_loss_<name>``... for several.
"""
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.train_loop.validation import check_loss

LossResult = Union[torch.Tensor, MultiLoss]


def loss_names(loss: LossResult) -> Optional[List[str]]:
    """The sorted names of a MultiLoss; None for a single loss."""
    return sorted(loss) if isinstance(loss, MultiLoss) else None


def detached_values(loss: LossResult) -> torch.Tensor:
    """The loss values without their graph: a 0-dim tensor, or one element per name for a MultiLoss."""
    if isinstance(loss, MultiLoss):
        return torch.stack([loss[name].detach().reshape(()).float() for name in sorted(loss)])
    loss = loss.detach()
    return loss if loss.dim() == 0 else loss.reshape(())  # a reshape costs microseconds per batch: only when needed


def checked_batch_loss(loss: LossResult) -> Tuple[torch.Tensor, Optional[List[str]]]:
    """A training batch's loss checked (see :func:`~aitoolbox.torchtrain.train_loop.validation.check_loss` and
    :func:`check_trainable_loss`), as ``(detached values, loss names)``: :func:`detached_values` and
    :func:`loss_names` in one call, since it runs for every batch."""
    if type(loss) is torch.Tensor and loss.requires_grad and loss.ndim == 0:  # the usual case first (ndim: no call)
        return loss.detach(), None
    check_loss(loss, "get_loss")
    check_trainable_loss(loss)
    return detached_values(loss), loss_names(loss)


def check_trainable_loss(loss: LossResult) -> None:
    """A training loss is a floating-point tensor with an autograd graph back to the parameters (for a MultiLoss:
    every entry floating-point, at least one with a graph). Torch's own errors for the two mistakes below name
    neither ``get_loss`` nor the cause.

    Raises:
        TypeError: an integer (or boolean) loss, which has no gradient.
        ValueError: a loss that does not require grad: backward would train nothing.
    """
    entries = [(f"MultiLoss entry {name!r}", loss[name]) for name in sorted(loss)] if isinstance(loss, MultiLoss) \
        else [("loss", loss)]
    for what, value in entries:
        if not (value.is_floating_point() or value.is_complex()):
            raise TypeError(f"get_loss returned a {what} of dtype {value.dtype}: a loss must be a floating-point "
                            "tensor (an integer one has no gradient). Compute it with the criterion on the model's "
                            "outputs, e.g. criterion(model(x), y), not from argmax() or a cast to an integer dtype.")
    if not any(value.requires_grad for _, value in entries):
        raise ValueError("get_loss returned a loss that does not require grad, so backward would train nothing: it "
                         "has no autograd graph back to the model's parameters. It was detached (.detach(), "
                         ".item(), torch.tensor(...)), computed under torch.no_grad() or torch.inference_mode(), or "
                         "computed from parameters that all have requires_grad=False. Return the criterion's output "
                         "on the model's outputs itself.")


def as_loss_result(values: torch.Tensor, names: Optional[List[str]]) -> LossResult:
    """Values back in the user's form: the tensor itself, or a MultiLoss of 0-dim tensors by name."""
    if names is None:
        return values
    return MultiLoss(dict(zip(names, values.unbind())))


def as_float_dict(result: LossResult) -> Union[float, Dict[str, float]]:
    """A loss result as a float, or a ``{name: float}`` dict for a MultiLoss (1.x's ``float_dict_format``)."""
    if isinstance(result, MultiLoss):
        return {name: float(value) for name, value in result.items()}
    return float(result)


def history_entries(metric_name: str, values: torch.Tensor, names: Optional[List[str]]) -> Dict[str, float]:
    """``{metric_name: value}``, or ``{metric_name_<loss name>: value}`` per loss of a MultiLoss."""
    if names is None:
        return {metric_name: values.item()}
    return {f"{metric_name}_{name}": value for name, value in zip(names, values.tolist())}


def loss_postfix(values: torch.Tensor, names: Optional[List[str]]) -> Dict[str, str]:
    """A progress bar's postfix for loss values: ``{'loss': '0.4123'}``, or ``{'loss_<name>': ...}`` per loss."""
    return {name: f"{value:.4f}" for name, value in history_entries("loss", values, names).items()}


class EpochLossSum:
    """The sum of an epoch's batch losses, on the device (``accumulated_loss`` is its mean).

    Each batch's detached loss joins :attr:`values` (:meth:`add`); those of the batches since the last optimizer
    step are pending until the step commits them (:meth:`commit`): the sum up to the last step is where a ``fit``
    stopped by an exception continues. Committed values are summed in blocks of :attr:`BLOCK` batches, in order: one
    ``torch.stack(...).sum()`` a block, added to the blocks before, instead of a tensor addition for every batch
    (microseconds a batch on a small model). A block holds the batches of the same positions in the epoch however
    the epoch was run, so the sum of an epoch continued from any step (a checkpoint saves :meth:`state`) is the
    straight run's, bit for bit.

    Args:
        state: where to start (a resumed epoch's): :meth:`state`'s dict, or a plain sum (a number or a list of
            numbers, as older checkpoints hold it); None starts empty.
        device: where the sum lives.
    """

    BLOCK = 64

    def __init__(self, state: Any = None, device: Optional[torch.device] = None):
        self.device = device
        self.folded: Optional[torch.Tensor] = None  # the sum of the complete blocks
        # The open block's values, the committed ones first; the pending ones after them (one list: a batch's add
        # and its step's commit are an append and a count, as they run for every batch).
        self.values: List[torch.Tensor] = []
        self.committed = 0  # how many of values are committed
        if isinstance(state, dict):
            if state.get("folded") is not None:
                self.folded = torch.as_tensor(state["folded"]).to(device, copy=True)
            if state.get("values") is not None:
                self.values = list(torch.as_tensor(state["values"]).to(device, copy=True).unbind())
                self.committed = len(self.values)
        elif state is not None:
            self.folded = torch.tensor(state, device=device)

    @property
    def pending(self) -> Tuple[torch.Tensor, ...]:
        """The values added since the last commit (read-only: :meth:`add` adds one)."""
        return tuple(self.values[self.committed:])

    def add(self, value: torch.Tensor) -> None:
        """A batch's detached loss, pending until the next :meth:`commit`."""
        self.values.append(value)

    def commit(self) -> None:
        """Commit the pending values (at an optimizer step)."""
        committed = self.committed = len(self.values)
        if committed >= self.BLOCK:
            values = self.values
            block, self.values = values[:self.BLOCK], values[self.BLOCK:]
            self.committed = committed - self.BLOCK
            self.folded = self._added(self.folded, block)

    @staticmethod
    def _added(total: Optional[torch.Tensor], values: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """``total`` plus the sum of ``values`` (summed in float32 at least, as a sum starting from zero would be)."""
        if not values:
            return total
        stacked = torch.stack(values)
        block = stacked.sum(dim=0, dtype=torch.promote_types(stacked.dtype, torch.float32))
        return block if total is None else total + block

    def total(self, include_pending: bool = True) -> torch.Tensor:
        """The sum of the committed values and, with ``include_pending``, the pending ones (a new tensor)."""
        total = self._added(self.folded, self.values if include_pending else self.values[:self.committed])
        return total if total is not None else torch.zeros((), device=self.device)

    def state(self, include_pending: bool = False) -> Dict[str, Optional[torch.Tensor]]:
        """What continues the sum bit for bit (:class:`EpochLossSum` takes it back): the complete blocks' sum and the
        open block's values (with ``include_pending``, the pending ones too, as committed), on the CPU."""
        values = self.values if include_pending else self.values[:self.committed]
        return {"folded": None if self.folded is None else self.folded.detach().cpu().clone(),
                "values": torch.stack(values).cpu() if values else None}
