"""The two ways to hand a model to TrainLoop: subclass :class:`TTModel`, or wrap a module in :class:`ModelWrap`."""
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Tuple

import torch
from torch import nn

from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition


class TTModel(nn.Module):
    """An ``nn.Module`` that knows how to compute its loss and predictions from a batch.

    Subclass it, define ``forward`` as usual and implement :meth:`get_loss` and :meth:`get_predictions`.
    Inside these methods call ``self(...)`` rather than ``self.forward(...)``: under distributed training
    TrainLoop routes the call through the DistributedDataParallel wrapper so gradients are synchronised.

    Example::

        class Net(TTModel):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(10, 2)

            def forward(self, x):
                return self.fc(x)

            def get_loss(self, batch_data, criterion, device):
                x, y = batch_data
                return criterion(self(x.to(device)), y.to(device))

            def get_predictions(self, batch_data, device):
                x, y = batch_data
                return self(x.to(device)).argmax(dim=1).cpu(), y, None

    ``transfer_model_attributes``: names of attributes that a :class:`~aitoolbox.torchtrain.parallel.TTDataParallel`
    or :class:`~aitoolbox.torchtrain.parallel.TTDistributedDataParallel` wrapper copies from the model, so that
    ``get_loss`` and ``get_predictions`` running on the wrapper can still read them as ``self.<name>``. Set it
    in ``__init__`` after ``super().__init__()``; it starts as an empty list (or a copy of a class-level list).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A fresh list per instance, so appending to it never leaks into other models.
        self.transfer_model_attributes = list(getattr(self, "transfer_model_attributes", ()))

    def get_loss(self, batch_data: Any, criterion: Optional[nn.Module], device: torch.device) -> torch.Tensor:
        """Return the scalar training loss of one batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_loss(batch_data, criterion, device)")

    def get_loss_eval(self, batch_data: Any, criterion: Optional[nn.Module], device: torch.device) -> torch.Tensor:
        """Return the scalar evaluation loss of one batch; the training loss unless overridden."""
        return self.get_loss(batch_data, criterion, device)

    def get_predictions(self, batch_data: Any, device: torch.device) -> Tuple[Any, Any, Optional[dict]]:
        """Return ``(y_pred, y_true, metadata)`` for one batch; metadata may be None."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_predictions(batch_data, device)")


class TTBasicModel(TTModel):
    """A TTModel for the common case: the last batch element is the target, the others are the inputs.

    ``forward`` receives the inputs as positional arguments; the loss is ``criterion(output, target)`` and
    the predictions are the raw outputs.
    """

    def _split_batch(self, batch_data: Any, device: torch.device):
        if isinstance(batch_data, Mapping) or not isinstance(batch_data, Sequence) or isinstance(batch_data, str):
            what = (f"a dict with keys {list(batch_data)}" if isinstance(batch_data, Mapping)
                    else f"a {type(batch_data).__name__}")
            raise TypeError(f"{type(self).__name__} (a TTBasicModel) takes each batch as a sequence (input_1, ..., "
                            f"input_n, target), got {what}. For other batches subclass TTModel and write get_loss "
                            "and get_predictions, which receive the batch as the loader yields it.")
        if len(batch_data) < 2:
            raise ValueError(f"{type(self).__name__} (a TTBasicModel) needs batches of at least two elements (the "
                             f"inputs, then the target), got {len(batch_data)}")
        for index, element in enumerate(batch_data):
            if not isinstance(element, torch.Tensor):
                raise TypeError(f"{type(self).__name__} (a TTBasicModel) moves every batch element to the device: "
                                f"element {index} of the batch is a {type(element).__name__}, not a tensor")
        *inputs, target = batch_data
        return [x.to(device) for x in inputs], target.to(device)

    def get_loss(self, batch_data, criterion, device):
        inputs, target = self._split_batch(batch_data, device)
        return criterion(self(*inputs), target)

    def get_predictions(self, batch_data, device):
        inputs, target = self._split_batch(batch_data, device)
        return self(*inputs).cpu(), target.cpu(), {}  # empty metadata, as aitoolbox 1.x


class TTBasicMultiGPUModel(TTBasicModel):
    """A :class:`TTBasicModel` whose ``forward`` also computes the loss, so under ``DataParallel`` the loss of
    each GPU's slice is computed on that GPU and only the losses are gathered, not the full outputs.

    :meth:`get_loss` calls ``self(*inputs, targets=targets, criterion=criterion)``; :meth:`get_predictions`
    calls ``self(*inputs)``. ``forward`` must therefore accept both forms::

        def forward(self, *inputs, targets=None, criterion=None):
            predictions = ...
            if criterion is not None:
                return criterion(predictions, targets)
            return predictions
    """

    def get_loss(self, batch_data, criterion, device):
        inputs, target = self._split_batch(batch_data, device)
        return self(*inputs, targets=target, criterion=criterion)


class MultiGPUModelWrap(TTBasicMultiGPUModel):
    """Turns a plain ``nn.Module`` (whose ``forward`` returns predictions) into a :class:`TTBasicMultiGPUModel`.

    The module becomes the submodule ``model``, so the wrapper's ``state_dict`` keys carry a ``model.`` prefix.

    Args:
        model: the network; the batch's last element is its target, the others its inputs.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"MultiGPUModelWrap needs an nn.Module as model, got {type(model).__name__}")
        self.model = model

    def forward(self, *input_data, targets=None, criterion=None):
        """The wrapped module's predictions, or ``criterion(predictions, targets)`` when a criterion is given."""
        predictions = self.model(*input_data)
        if criterion is not None:
            return criterion(predictions, targets)
        return predictions


class ModelWrap:
    """Pairs a plain ``nn.Module`` with the feed definition that computes its loss and predictions.

    Args:
        model: the neural network.
        batch_model_feed_def: an :class:`AbstractModelFeedDefinition` describing how a batch is fed.
    """

    def __init__(self, model: nn.Module, batch_model_feed_def: AbstractModelFeedDefinition):
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelWrap needs an nn.Module as model, got {type(model).__name__}")
        if not isinstance(batch_model_feed_def, AbstractModelFeedDefinition):
            raise TypeError("ModelWrap needs an AbstractModelFeedDefinition instance as batch_model_feed_def, "
                            f"got {type(batch_model_feed_def).__name__}")
        self.model = model
        self.batch_model_feed_def = batch_model_feed_def


class FeedDefinitionModel(TTModel):
    """Adapts a :class:`ModelWrap` to the TTModel interface so the loop sees one kind of model.

    The wrapped module is registered as a submodule, so ``state_dict`` keys carry a ``model.`` prefix only
    inside this adapter; TrainLoop hands back and checkpoints the user's own module.
    """

    def __init__(self, model_wrap: ModelWrap):
        super().__init__()
        self.model = model_wrap.model
        self.feed_def = model_wrap.batch_model_feed_def
        # get_loss reads self.feed_def: a TTDataParallel around this adapter must carry it over.
        self.transfer_model_attributes = ["feed_def"]

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def get_loss(self, batch_data, criterion, device):
        return self.feed_def.get_loss(self, batch_data, criterion, device)

    def get_loss_eval(self, batch_data, criterion, device):
        return self.feed_def.get_loss_eval(self, batch_data, criterion, device)

    def get_predictions(self, batch_data, device):
        return self.feed_def.get_predictions(self, batch_data, device)
