"""aitoolbox 1.x's module path of the message service between callbacks (it lives in
:mod:`aitoolbox.torchtrain.callbacks.messages`)."""
from aitoolbox.torchtrain.callbacks.messages import Message, MessageHandling, MessageService

__all__ = ["Message", "MessageHandling", "MessageService"]
