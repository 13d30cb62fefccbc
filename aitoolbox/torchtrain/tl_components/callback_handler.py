"""aitoolbox 1.2's module path of the callbacks handler."""
from aitoolbox.torchtrain.callbacks.handler import CallbacksHandler

__all__ = ["CallbacksHandler"]
