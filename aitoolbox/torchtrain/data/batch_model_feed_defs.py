"""The feed definition: how a plain ``nn.Module`` computes its loss and predictions from a batch."""
from abc import ABC, abstractmethod
from typing import Any, Optional, Tuple

import torch
from torch import nn


class AbstractModelFeedDefinition(ABC):
    """Tells TrainLoop how to compute a loss and predictions for a plain ``nn.Module``.

    Pair it with the model in :class:`aitoolbox.torchtrain.model.ModelWrap`. The methods mirror those of
    :class:`aitoolbox.torchtrain.model.TTModel`, with the model passed in as the first argument.
    """

    @abstractmethod
    def get_loss(self, model: nn.Module, batch_data: Any, criterion: Optional[nn.Module],
                 device: torch.device) -> torch.Tensor:
        """Return the scalar training loss of one batch."""

    def get_loss_eval(self, model: nn.Module, batch_data: Any, criterion: Optional[nn.Module],
                      device: torch.device) -> torch.Tensor:
        """Return the scalar evaluation loss of one batch; the training loss unless overridden."""
        return self.get_loss(model, batch_data, criterion, device)

    @abstractmethod
    def get_predictions(self, model: nn.Module, batch_data: Any,
                        device: torch.device) -> Tuple[Any, Any, Optional[dict]]:
        """Return ``(y_pred, y_true, metadata)`` for one batch; metadata may be None."""
