"""One loss or several: the loop's bookkeeping of batch losses, plain tensors and ``MultiLoss`` alike.

A model's ``get_loss`` returns a scalar tensor or a :class:`~aitoolbox.torchtrain.multi_loss_optim.MultiLoss`
of named scalar tensors. The loop sums losses over an epoch as one tensor: 0-dimensional for a single loss,
one element per loss name (in sorted order, as aitoolbox 1.x) for a MultiLoss. History keys follow 1.x:
``loss``/``val_loss``/``accumulated_loss`` for a single loss, ``loss_<name>``, ``val_loss_<name>``... for several.
"""
from typing import Dict, List, Optional, Tuple, Union

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
    if type(loss) is torch.Tensor and loss.requires_grad and loss.dim() == 0:  # the usual case first
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
    """The sum of an epoch's batch losses, on the device, in batch order (``accumulated_loss`` is its mean).

    The losses of the batches since the last optimizer step wait in :attr:`pending` (the loop appends each
    batch's detached value) and are added, in place, when the step is taken (:meth:`commit`): :attr:`committed` is then the sum up to the last step, which is where a
    ``fit`` stopped by an exception continues. Adding in place spares an allocation per batch.

    Args:
        initial: a sum to start from (a resumed epoch's), as a number or a list of numbers; None starts empty.
        device: where the sum lives.
    """

    def __init__(self, initial: Union[float, List[float], None] = None, device: Optional[torch.device] = None):
        self.device = device
        self.committed: Optional[torch.Tensor] = None if initial is None else torch.tensor(initial, device=device)
        self.pending: List[torch.Tensor] = []

    def commit(self) -> None:
        """Add the pending values to the committed sum (at an optimizer step)."""
        for value in self.pending:
            if self.committed is None:  # float32 at least, as a sum starting from a float32 zero would be
                self.committed = torch.zeros(value.shape, dtype=torch.promote_types(value.dtype, torch.float32),
                                             device=value.device)
            self.committed.add_(value)
        self.pending.clear()

    def total(self) -> torch.Tensor:
        """Committed and pending values together (a new tensor; the same arithmetic as :meth:`commit`)."""
        total = self.committed if self.committed is not None else torch.zeros((), device=self.device)
        for value in self.pending:
            total = total + value
        return total
