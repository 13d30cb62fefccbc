"""aitoolbox 1.x's module path of the callbacks handler (it lives in :mod:`aitoolbox.torchtrain.callbacks.handler`)."""
from aitoolbox.torchtrain.callbacks.handler import CallbacksHandler

__all__ = ["CallbacksHandler"]
