"""Messages between callbacks: one callback writes a value under a key, others read it later in the training.

Every TrainLoop has a :class:`MessageService` (``train_loop_obj.message_service``, also ``self.message_service`` in
a registered callback), as in aitoolbox 1.x. Example: ``ModelTrainHistoryPlot`` announces the plot files it wrote
under ``'ModelTrainHistoryPlot_results_file_local_paths'`` and ``EmailNotification`` attaches them.

The service lives in one process: under distributed training each process has its own.
"""
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Union

__all__ = ["MessageHandling", "Message", "MessageService"]


class MessageHandling(Enum):
    """How long a message stays readable."""

    #: until the TrainLoop ends
    KEEP_FOREVER = "keep_forever"
    #: until the end of the epoch it was written in (after every callback's ``on_epoch_end``); the default
    UNTIL_END_OF_EPOCH = "until_end_of_epoch"
    #: until it is read once
    UNTIL_READ = "until_read"
    #: replaces the key's earlier messages; combines with one of the others
    OVERWRITE = "overwrite"


class Message:
    """A value written under a key, with its handling settings.

    Args:
        key: the key.
        value: the value.
        msg_handling_settings: one :class:`MessageHandling` or a list of them.
    """

    def __init__(self, key: str, value: Any, msg_handling_settings: Union[MessageHandling, Sequence[MessageHandling]]):
        self.key = key
        self.value = value
        self.msg_handling_settings: List[MessageHandling] = (list(msg_handling_settings)
                                                             if isinstance(msg_handling_settings, (list, tuple))
                                                             else [msg_handling_settings])

    def __repr__(self) -> str:
        return f"Message({self.key!r}, {self.value!r}, {self.msg_handling_settings})"


class MessageService:
    """The messages of one TrainLoop, by key, in the order written."""

    def __init__(self):
        self.message_store: Dict[str, List[Message]] = {}

    def read_messages(self, key: str) -> Optional[List[Any]]:
        """The values written under ``key``, oldest first; None when nothing was written under it.

        Messages written with ``UNTIL_READ`` are removed by this read. As in aitoolbox 1.x, a key whose messages
        were all read stays known (its reads return ``[]``) until the end of the epoch.
        """
        if key not in self.message_store:
            return None
        messages = self.message_store[key]
        self.message_store[key] = [message for message in messages
                                   if MessageHandling.UNTIL_READ not in message.msg_handling_settings]
        return [message.value for message in messages]

    def write_message(self, key: str, value: Any,
                      msg_handling_settings: Union[MessageHandling, Sequence[MessageHandling]] =
                      MessageHandling.UNTIL_END_OF_EPOCH) -> None:
        """Write ``value`` under ``key``.

        Args:
            key: the key.
            value: any value (it is not copied).
            msg_handling_settings: how long the message stays: one :class:`MessageHandling`, or ``OVERWRITE``
                together with one other setting in a list.

        Raises:
            TypeError: a setting is not a :class:`MessageHandling`.
            ValueError: a list of settings that combines two lifetimes.
        """
        settings = self.validate_msg_handling_settings(msg_handling_settings)
        message = Message(key, value, settings)
        if MessageHandling.OVERWRITE in settings:
            self.message_store[key] = [message]
        else:
            self.message_store.setdefault(key, []).append(message)

    def end_of_epoch_trigger(self) -> None:
        """Remove the ``UNTIL_END_OF_EPOCH`` messages; the TrainLoop calls it after the callbacks' ``on_epoch_end``."""
        for key in list(self.message_store):
            kept = [message for message in self.message_store[key]
                    if MessageHandling.UNTIL_END_OF_EPOCH not in message.msg_handling_settings]
            if kept:
                self.message_store[key] = kept
            else:
                del self.message_store[key]

    @staticmethod
    def validate_msg_handling_settings(msg_handling_settings: Union[MessageHandling, Sequence[MessageHandling]]
                                       ) -> List[MessageHandling]:
        """The settings as a list, checked.

        Raises:
            TypeError: a setting is not a :class:`MessageHandling`.
            ValueError: more than one setting without ``OVERWRITE``, or ``OVERWRITE`` with two others.
        """
        settings = list(msg_handling_settings) if isinstance(msg_handling_settings, (list, tuple)) \
            else [msg_handling_settings]
        for setting in settings:
            if not isinstance(setting, MessageHandling):
                raise TypeError(f"message handling settings must be MessageHandling members (e.g. "
                                f"MessageHandling.UNTIL_END_OF_EPOCH), got {setting!r}")
        if not settings:
            raise ValueError("give at least one MessageHandling setting")
        lifetimes = [setting for setting in settings if setting is not MessageHandling.OVERWRITE]
        if len(lifetimes) > 1:
            raise ValueError(f"the settings {settings} combine {len(lifetimes)} lifetimes: give one of KEEP_FOREVER, "
                             "UNTIL_END_OF_EPOCH, UNTIL_READ, optionally with OVERWRITE")
        return settings
