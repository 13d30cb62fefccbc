"""Route TTModel methods through a parallel wrapper's forward, so the wrapper sees every computation."""
from typing import Any

import torch
from torch import nn

from aitoolbox.torchtrain.multi_loss_optim import MultiLoss


class MethodDispatcher(nn.Module):
    """A module whose forward calls a named method of the wrapped TTModel.

    ``DistributedDataParallel(MethodDispatcher(model))("get_loss", batch, criterion, device)`` runs
    ``model.get_loss`` inside the wrapper's forward, so the wrapper prepares its gradient all-reduce (or,
    for DataParallel, scatters the batch) exactly as it would for a plain forward call.

    Args:
        model: the user's TTModel.
        use_replica_device: replace the trailing ``device`` argument with the device of this replica's
            parameters. DataParallel runs one replica per GPU, and each must move its slice of the batch
            to its own GPU rather than to the device the loop passed.
    """

    def __init__(self, model: nn.Module, use_replica_device: bool = False):
        super().__init__()
        self.model = model
        self.use_replica_device = use_replica_device

    def forward(self, method_name: str, *args: Any) -> Any:
        if self.use_replica_device:
            replica_device = next(self.model.parameters()).device
            args = args[:-1] + (replica_device,)
        return getattr(self.model, method_name)(*args)


def _mean_over_replicas(loss: torch.Tensor) -> torch.Tensor:
    return loss.mean() if loss.dim() > 0 else loss


class ParallelModelRunner:
    """Gives a parallel wrapper the calling interface the training loop uses on a TTModel.

    Args:
        wrapper: the parallel module that wraps a :class:`MethodDispatcher` around ``model``.
        model: the user's TTModel, as held by this process.
        evaluate_through_wrapper: run ``get_loss_eval`` through the wrapper (DataParallel: to use every GPU).
            DistributedDataParallel evaluates on the module itself: evaluation needs no gradient
            synchronisation, and ranks may then see different numbers of batches.
    """

    def __init__(self, wrapper: nn.Module, model: nn.Module, evaluate_through_wrapper: bool = True):
        self.wrapper = wrapper
        self.model = model
        self.evaluate_through_wrapper = evaluate_through_wrapper

    def _loss(self, method_name: str, batch_data, criterion, device) -> Any:
        loss = self.wrapper(method_name, batch_data, criterion, device)
        # DataParallel gathers one loss per replica into a vector; DDP returns the scalar itself. A MultiLoss
        # (several named losses) gets the same treatment for each of its losses.
        if isinstance(loss, MultiLoss):
            return loss._map(_mean_over_replicas)
        return _mean_over_replicas(loss)

    def get_loss(self, batch_data, criterion, device) -> torch.Tensor:
        return self._loss("get_loss", batch_data, criterion, device)

    def get_loss_eval(self, batch_data, criterion, device) -> torch.Tensor:
        if not self.evaluate_through_wrapper:
            return self.model.get_loss_eval(batch_data, criterion, device)
        return self._loss("get_loss_eval", batch_data, criterion, device)

    def get_predictions(self, batch_data, device):
        # Predictions end on the host; a scatter/gather wrapper cannot gather CPU tensors, and no gradient
        # synchronisation is needed here, so this process's replica computes them.
        return self.model.get_predictions(batch_data, device)

    def train(self, mode: bool = True) -> "ParallelModelRunner":
        self.wrapper.train(mode)
        return self

    def eval(self) -> "ParallelModelRunner":
        return self.train(False)
