"""Checks of TrainLoop's inputs, run once in the constructor and in ``fit``, with messages that say the fix."""
from collections.abc import Iterable
from typing import Any, List, Union

import torch
from torch import nn

from aitoolbox.torchtrain.model import FeedDefinitionModel, ModelWrap, TTModel


def resolve_model(model: Any) -> TTModel:
    """The TTModel the loop drives: the model itself, or a TTModel adapter around a ModelWrap."""
    if isinstance(model, TTModel):
        return model
    if isinstance(model, ModelWrap):
        return FeedDefinitionModel(model)
    hint = (" It is a plain nn.Module: wrap it as ModelWrap(model, batch_model_feed_def) with an "
            "AbstractModelFeedDefinition, or subclass TTModel instead of nn.Module."
            if isinstance(model, nn.Module) else "")
    raise TypeError(f"model must be a TTModel or a ModelWrap, got {type(model).__name__}.{hint}")


def check_loader(loader: Any, name: str, required: bool) -> None:
    """A loader must be iterable; the training loader must exist and, when its length is known, be non-empty."""
    if loader is None:
        if required:
            raise ValueError(f"{name} is required; pass a torch.utils.data.DataLoader")
        return
    if not isinstance(loader, Iterable):
        hint = (" It looks like a Dataset: wrap it as DataLoader(dataset, batch_size=...)."
                if hasattr(loader, "__getitem__") else "")
        raise TypeError(f"{name} must be an iterable of batches such as a DataLoader, got "
                        f"{type(loader).__name__}.{hint}")
    if required:
        try:
            length = len(loader)
        except TypeError:
            return  # an IterableDataset without a length: checked when the first epoch ends
        if length == 0:
            raise ValueError(f"{name} is empty (len 0): it must yield at least one batch. Check the dataset "
                             "size, and batch_size with drop_last=True.")


def as_optimizer_list(optimizer: Any) -> List[torch.optim.Optimizer]:
    """The optimizers as a list; a single optimizer or a list/tuple of them is accepted."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(opt).__name__}")
    if not optimizers:
        raise ValueError("optimizer list is empty: pass at least one torch.optim.Optimizer")
    return optimizers


def check_end_auto_eval(end_auto_eval: Union[bool, int]) -> None:
    if isinstance(end_auto_eval, bool):
        return
    if not isinstance(end_auto_eval, int) or end_auto_eval < 1:
        raise ValueError(f"end_auto_eval must be True, False or a positive int N (evaluate every N epochs), "
                         f"got {end_auto_eval!r}")


def check_fit_arguments(num_epochs: int, num_iterations: int, grad_accumulation: int) -> None:
    """Exactly one of num_epochs and num_iterations is positive; grad_accumulation is an int >= 1."""
    for name, value in (("num_epochs", num_epochs), ("num_iterations", num_iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if (num_epochs > 0) == (num_iterations > 0):
        raise ValueError(f"set exactly one of num_epochs and num_iterations to a positive number "
                         f"(got num_epochs={num_epochs}, num_iterations={num_iterations})")
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ValueError(f"grad_accumulation must be an int >= 1 (1 means no accumulation), got {grad_accumulation!r}")


def check_loss(loss: Any, method_name: str) -> None:
    """A loss is a tensor with one element, so that ``backward`` and sample weighting work."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{method_name} must return the loss as a torch.Tensor, got {type(loss).__name__}. "
                        "Return the criterion's output itself, not loss.item().")
    if loss.numel() != 1:
        raise ValueError(f"{method_name} must return a scalar loss, got a tensor of shape {tuple(loss.shape)}. "
                         "Reduce it, e.g. with loss.mean() or a criterion with reduction='mean'.")

