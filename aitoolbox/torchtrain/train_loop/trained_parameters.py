"""Whether the optimizers step the model: an optimizer over parameters the model does not hold trains nothing.

The usual cause is a model built again after its optimizer (a notebook cell re-run: ``model = Net()`` while the
optimizer still holds the old model's parameters); the loop would then train for hours and return the model as it
was. :func:`check_optimizers_step_the_model` runs at the start of every ``fit``, after the model was set up (placed,
cast, wrapped, sharded), on the parameters the optimizers really step.
"""
import warnings
from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch import nn


def _criterion_parameters(criterion: Any) -> Iterator[torch.Tensor]:
    """The parameters of a criterion module (a learnable loss weighting), also inside a dict, list or tuple."""
    if isinstance(criterion, nn.Module):
        yield from criterion.parameters()
    elif isinstance(criterion, dict):
        for value in criterion.values():
            yield from _criterion_parameters(value)
    elif isinstance(criterion, (list, tuple)):
        for value in criterion:
            yield from _criterion_parameters(value)


def stepped_model_tensors(optimizer: torch.optim.Optimizer, master_weights: Any = None) -> List[torch.Tensor]:
    """The tensors ``optimizer`` trains: its parameters, or, for the float32 masters of a model cast to low
    precision (amp's O2), the model parameters they are copied into."""
    if master_weights is not None and master_weights.manages(optimizer):
        return master_weights.model_parameters(optimizer)  # (grad_pairs would take the model's weights as a write)
    return [param for group in getattr(optimizer, "param_groups", []) for param in group["params"]]


def check_optimizers_step_the_model(model: nn.Module, criterion: Any, optimizers: Sequence[torch.optim.Optimizer],
                                    master_weights: Optional[Any] = None) -> None:
    """Refuse optimizers none of whose parameters belongs to the model (or the criterion); warn about an optimizer
    holding parameters that do not (they train only if ``get_loss`` uses them some other way).

    Raises:
        ValueError: no optimizer holds a parameter of the model or the criterion: training would not change them.
    """
    known = {id(param) for param in model.parameters()}
    known.update(id(param) for param in _criterion_parameters(criterion))
    stepped = [stepped_model_tensors(optimizer, master_weights) for optimizer in optimizers]
    foreign = [[tensor for tensor in tensors if id(tensor) not in known] for tensors in stepped]
    total, total_foreign = sum(map(len, stepped)), sum(map(len, foreign))
    if total and total_foreign == total:
        raise ValueError(f"none of the optimizers' {total} parameter(s) is a parameter of the model (or of the "
                         "criterion): training would not change the model. Build the optimizer from this model, e.g. "
                         "torch.optim.Adam(model.parameters()); a model created again after its optimizer (a notebook "
                         "cell run twice) leaves the optimizer with the old model's parameters.")
    for index, (optimizer, tensors, outside) in enumerate(zip(optimizers, stepped, foreign)):
        if outside:
            shapes = ", ".join(str(tuple(tensor.shape)) for tensor in outside[:5]) + (", ..." if len(outside) > 5 else "")
            warnings.warn(f"optimizer {index} ({type(optimizer).__name__}) holds {len(outside)} of its {len(tensors)} "
                          f"parameter(s) that are not the model's or the criterion's (shapes {shapes}): they train "
                          "only if get_loss uses them some other way. Was the model built again after the optimizer?",
                          UserWarning, stacklevel=3)
