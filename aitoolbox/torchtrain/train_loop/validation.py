"""Checks of TrainLoop's inputs, run once in the constructor and in ``fit``, with messages that say the fix."""
from collections.abc import Iterable, Mapping
from typing import Any, List, Optional, Union

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from aitoolbox.torchtrain.model import FeedDefinitionModel, ModelWrap, TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss


def resolve_model(model: Any) -> nn.Module:
    """The TTModel the loop drives: the model itself, or a TTModel adapter around a ModelWrap.

    A module that is not a TTModel but has TTModel's methods (e.g. ``TTDataParallel``) is driven as it is.
    """
    if isinstance(model, TTModel):
        return model
    if isinstance(model, ModelWrap):
        return FeedDefinitionModel(model)
    if isinstance(model, nn.Module) and all(callable(getattr(model, name, None))
                                            for name in ("get_loss", "get_loss_eval", "get_predictions")):
        return model
    hint = (" It is a plain nn.Module: wrap it as ModelWrap(model, batch_model_feed_def) with an "
            "AbstractModelFeedDefinition, or subclass TTModel instead of nn.Module."
            if isinstance(model, nn.Module) else "")
    raise TypeError(f"model must be a TTModel or a ModelWrap, got {type(model).__name__}.{hint}")


def _is_list_of_loaders(loader: Any) -> bool:
    # A list of batches is a loader too (any iterable of batches is); a list of DataLoaders never is.
    return isinstance(loader, (list, tuple)) and len(loader) > 0 and all(isinstance(item, DataLoader)
                                                                        for item in loader)


def is_batch_iterable(loader: Any) -> bool:
    """Whether ``for batch in loader`` works: an iterable, or a loader with Python's sequence protocol
    (``__len__`` and ``__getitem__`` raising ``IndexError`` at the end, as a Keras ``Sequence``) that is not a torch
    ``Dataset``. A ``Dataset`` iterates too, but over samples, not batches: that is the mistake to catch."""
    if isinstance(loader, Iterable):
        return True
    return hasattr(loader, "__getitem__") and hasattr(loader, "__len__") and not isinstance(loader, Dataset)


def check_loader(loader: Any, name: str) -> None:
    """A loader is None or an iterable of batches (not a dict or a list of loaders) that, when its length is known,
    is not empty. None is accepted for every loader: a TrainLoop without a training loader predicts only. A
    sequence of batches (``__len__`` + ``__getitem__``, no ``__iter__``) is an iterable of batches too, unless it is a
    torch ``Dataset`` (see :func:`is_batch_iterable`).

    Raises:
        TypeError: not iterable (e.g. a Dataset), a dict of loaders, or a list of DataLoaders; the message says
            what to pass.
        ValueError: ``len(loader) == 0``.
    """
    if loader is None:
        return
    if isinstance(loader, Mapping):
        raise TypeError(f"{name} is a dict of {len(loader)} entries ({sorted(map(str, loader))[:5]}): only "
                        f"validation_loader takes named sets; pass one DataLoader as {name}")
    if _is_list_of_loaders(loader):
        plural = "s" if len(loader) > 1 else ""
        if name == "validation_loader":
            names = ", ".join(f"'set_{index}': ..." for index in range(len(loader)))
            fix = (f"to evaluate several validation sets, name each set: validation_loader={{{names}}} (each is "
                   "recorded as val_<name>_loss, the first also as val_loss); for one set pass its DataLoader itself")
        else:
            fix = f"pass one DataLoader as {name}"
        raise TypeError(f"{name} is a {type(loader).__name__} of {len(loader)} DataLoader{plural}: {fix}")
    if not is_batch_iterable(loader):
        hint = (" It looks like a Dataset: wrap it as DataLoader(dataset, batch_size=...)."
                if hasattr(loader, "__getitem__") else "")
        raise TypeError(f"{name} must be an iterable of batches such as a DataLoader, got "
                        f"{type(loader).__name__}.{hint}")
    try:
        length = len(loader)
    except TypeError:
        return  # an IterableDataset without a length: the training loader's is checked when the first epoch ends
    if length == 0:
        raise ValueError(f"{name} is empty (len 0): it must yield at least one batch. Check the dataset "
                         "size, and batch_size with drop_last=True.")


def _class_name(cls: type) -> str:
    """How a user writes the class: ``nn.CrossEntropyLoss``, ``torch.optim.AdamW``, else its full name."""
    module = cls.__module__
    if module.startswith("torch.nn"):
        return f"nn.{cls.__name__}"
    if module.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{module}.{cls.__qualname__}"


def check_criterion(criterion: Any) -> None:
    """The criterion is handed to ``get_loss`` as it is (a loss function, a dict or list of them, anything the model
    reads); a loss class where an instance belongs (``nn.CrossEntropyLoss`` without ``()``) is refused now rather
    than failing inside the first batch with torch's message. Other classes pass: a class can be what the model
    reads (a namespace of loss functions ``get_loss`` picks from); only an ``nn.Module`` class (every torch loss is
    one) is surely a missing ``()``.

    Raises:
        TypeError: the criterion, or an entry of a dict / list / tuple of criteria, is an ``nn.Module`` class.
    """
    if isinstance(criterion, Mapping):
        entries = [(f"criterion[{key!r}]", value) for key, value in criterion.items()]
    elif isinstance(criterion, (list, tuple)):
        entries = [(f"criterion[{index}]", value) for index, value in enumerate(criterion)]
    else:
        entries = [("criterion", criterion)]
    for where, value in entries:
        if isinstance(value, type) and issubclass(value, nn.Module):
            raise TypeError(f"{where} is the class {_class_name(value)}, not a loss function: pass an instance, "
                            f"e.g. {_class_name(value)}()")


def is_optimizer(obj: Any) -> bool:
    """A torch optimizer, or an object that steps and zeroes gradients like one (an optimizer wrapper)."""
    return isinstance(obj, torch.optim.Optimizer) or (callable(getattr(obj, "step", None))
                                                     and callable(getattr(obj, "zero_grad", None)))


def as_optimizer_list(optimizer: Any) -> List[torch.optim.Optimizer]:
    """The optimizers as a list: one optimizer, a list/tuple of them, or a MultiOptimizer; None gives ``[]``
    (a TrainLoop that only predicts)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "optimizer_list") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer_list  # aitoolbox's MultiOptimizer
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if isinstance(opt, type):  # the class has step() and zero_grad() too: torch would fail in the first step
            raise TypeError(f"optimizer is the class {_class_name(opt)}, not an optimizer: build one, e.g. "
                            f"{opt.__name__}(model.parameters(), lr=1e-3)")
        if not is_optimizer(opt):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or an object with its step() and zero_grad() "
                            f"methods), a list of them or a MultiOptimizer, got {type(opt).__name__}")
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


def check_fit_keywords(kwargs: dict, gpu_mode: str) -> dict:
    """The keywords ``fit`` takes besides its own: ``dp_model_args`` with ``gpu_mode='dp'`` (aitoolbox 1.x)."""
    allowed = ("dp_model_args",) if gpu_mode == "dp" else ()
    unexpected = sorted(set(kwargs) - set(allowed))
    if unexpected:
        raise TypeError(f"fit() got unexpected keyword argument(s) {unexpected}; the distributed keywords "
                        "(num_gpus, amp_init_args, ...) need gpu_mode='ddp' or fit_distributed(), dp_model_args "
                        "needs gpu_mode='dp'")
    dp_model_args = kwargs.get("dp_model_args")
    if dp_model_args is not None and not isinstance(dp_model_args, dict):
        raise TypeError(f"dp_model_args must be a dict of torch.nn.DataParallel arguments, got {dp_model_args!r}")
    return kwargs


def check_ready_to_train(train_loader: Any, optimizers: list) -> None:
    """``fit`` needs a training loader and an optimizer; a TrainLoop built without them predicts only."""
    missing = [name for name, absent in (("train_loader", train_loader is None), ("optimizer", not optimizers))
               if absent]
    if missing:
        raise ValueError(f"this TrainLoop has no {' and no '.join(missing)}, so it can only predict and evaluate "
                         "(predict_on_*_set, evaluate_loss_on_*_set). To train, construct it with "
                         f"{' and '.join(missing)}.")


def check_loss(loss: Any, method_name: str) -> None:
    """A loss is a tensor with one element (or a MultiLoss of such tensors), so that ``backward`` and sample
    weighting work."""
    if type(loss) is torch.Tensor and loss.dim() == 0:  # the usual case, checked first: this runs every batch
        return
    if isinstance(loss, MultiLoss):
        if len(loss) == 0:
            raise ValueError(f"{method_name} returned an empty MultiLoss: it needs at least one named loss")
        for name in loss:
            check_loss(loss[name], f"{method_name} (MultiLoss entry {name!r})")
        return
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{method_name} must return the loss as a torch.Tensor, got {type(loss).__name__}. "
                        "Return the criterion's output itself, not loss.item().")
    if loss.numel() != 1:
        raise ValueError(f"{method_name} must return a scalar loss, got a tensor of shape {tuple(loss.shape)}. "
                         "Reduce it, e.g. with loss.mean() or a criterion with reduction='mean'.")



def check_user_precision(precision: Any, shards_parameters: bool, device: Optional[torch.device],
                         use_amp: Any) -> None:
    """A ``tl.precision`` the user assigned is used in every process of a distributed run; refuse what cannot be.

    Raises:
        ValueError: under FSDP (its mixed precision is a sharding policy built from ``use_amp``), with
            ``amp_init_args`` as well (which precision would win?), or for another device type than the
            strategy's.
    """
    if shards_parameters:
        raise ValueError("tl.precision was assigned by hand, and gpu_mode='fsdp' cannot use it: FSDP's mixed precision "
                         "is a sharding policy built from use_amp. Pass use_amp (e.g. True or {'opt_level': 'O1'}) "
                         "instead of assigning tl.precision.")
    if use_amp is not None:
        raise ValueError(f"tl.precision was assigned by hand and fit_distributed got amp_init_args={use_amp!r} as "
                         "well: pass one of them")
    if device is not None and precision.device_type != device.type:
        raise ValueError(f"tl.precision is for device type {precision.device_type!r} but this process trains on "
                         f"{device}: build it with Precision(device_type={device.type!r}, ...)")
