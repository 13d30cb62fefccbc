"""Precision: autocast, loss scaling and the optimizer step behind one fixed interface."""
from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.precision import Precision

__all__ = ["LossScaler", "Precision"]
