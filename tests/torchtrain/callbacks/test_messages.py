"""The message service between callbacks (aitoolbox 1.x's ``MessageService``): lifetimes, checks, the TrainLoop's
end-of-epoch purge, and the history callbacks announcing their files."""
import os

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.history_output import (
    FILE_WRITER_PATHS_MESSAGE_KEY, PLOT_PATHS_MESSAGE_KEY, ModelTrainHistoryFileWriter, ModelTrainHistoryPlot)
from aitoolbox.torchtrain.callbacks.messages import MessageHandling, MessageService
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.torchtrain.callbacks.test_handler import make_loop


def test_messages_are_read_in_the_order_written_and_until_read_ones_once():
    service = MessageService()
    assert service.read_messages("k") is None
    service.write_message("k", 1)
    service.write_message("k", 2, MessageHandling.UNTIL_READ)
    assert service.read_messages("k") == [1, 2]
    assert service.read_messages("k") == [1]
    service.write_message("once", "x", MessageHandling.UNTIL_READ)
    assert service.read_messages("once") == ["x"] and service.read_messages("once") == []  # as in 1.x
    service.end_of_epoch_trigger()
    assert service.read_messages("once") is None


def test_the_end_of_an_epoch_removes_its_messages_only():
    service = MessageService()
    service.write_message("epoch", "a")  # the default: until the end of the epoch
    service.write_message("forever", "b", MessageHandling.KEEP_FOREVER)
    service.write_message("unread", "c", MessageHandling.UNTIL_READ)
    service.end_of_epoch_trigger()
    assert service.read_messages("epoch") is None
    assert service.read_messages("forever") == ["b"] and service.read_messages("unread") == ["c"]


def test_overwrite_replaces_the_keys_messages():
    service = MessageService()
    service.write_message("k", 1, MessageHandling.KEEP_FOREVER)
    service.write_message("k", 2, [MessageHandling.OVERWRITE, MessageHandling.UNTIL_END_OF_EPOCH])
    assert service.read_messages("k") == [2]
    service.end_of_epoch_trigger()
    assert service.read_messages("k") is None


def test_bad_settings_are_refused_before_anything_is_written():
    service = MessageService()
    with pytest.raises(TypeError, match="MessageHandling members"):
        service.write_message("k", 1, "until_read")
    with pytest.raises(ValueError, match="combine 2 lifetimes"):
        service.write_message("k", 1, [MessageHandling.UNTIL_READ, MessageHandling.KEEP_FOREVER])
    with pytest.raises(ValueError, match="at least one"):
        service.write_message("k", 1, [])
    assert service.message_store == {}


class Writer(AbstractCallback):
    def __init__(self):
        super().__init__("writer")

    def on_epoch_end(self):
        self.message_service.write_message("epoch", self.train_loop_obj.epoch)
        self.message_service.write_message("all", self.train_loop_obj.epoch, MessageHandling.KEEP_FOREVER)


class Reader(AbstractCallback):
    def __init__(self):
        super().__init__("reader", execution_order=10)
        self.at_epoch_begin, self.at_epoch_end = [], []

    def on_epoch_begin(self):
        self.at_epoch_begin.append((self.message_service.read_messages("epoch"),
                                    self.message_service.read_messages("all")))

    def on_epoch_end(self):
        self.at_epoch_end.append(self.message_service.read_messages("epoch"))


def test_the_train_loop_keeps_an_epochs_messages_until_its_end():
    tl = make_loop()
    reader = Reader()
    tl.fit(num_epochs=3, callbacks=[Writer(), reader])
    assert reader.message_service is tl.message_service
    assert reader.at_epoch_end == [[0], [1], [2]]
    assert reader.at_epoch_begin == [(None, None), (None, [0]), (None, [0, 1])]


def test_the_history_callbacks_announce_the_files_they_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    seen = {}

    class Collect(AbstractCallback):
        def __init__(self):
            super().__init__("collect", execution_order=10000)  # after the history callbacks

        def on_epoch_end(self):
            seen[self.train_loop_obj.epoch] = (self.message_service.read_messages(PLOT_PATHS_MESSAGE_KEY),
                                               self.message_service.read_messages(FILE_WRITER_PATHS_MESSAGE_KEY))

    tl = make_loop()
    tl = TrainLoopCheckpoint(tl.model, tl.train_loader, None, None, tl.optimizer, tl.criterion, "proj", "exp",
                             str(tmp_path), end_auto_eval=False, show_progress=False)
    writer = ModelTrainHistoryFileWriter()
    tl.fit(num_epochs=2, callbacks=[ModelTrainHistoryPlot(), writer, Collect()])
    plots_dir = tl.experiment_folder.plots_dir
    for epoch in range(2):
        plots, history_files = seen[epoch]
        [paths] = plots  # one announcement per epoch: the previous epoch's are gone
        assert sorted(paths) == [os.path.join(plots_dir, "accumulated_loss.png")]  # the one metric there is
        assert history_files == [[writer.output_path()]]


def test_1x_import_path():
    from aitoolbox.torchtrain.train_loop.components.message_passing import MessageHandling as Handling
    from aitoolbox.torchtrain.train_loop.components.message_passing import MessageService as Service
    assert Service is MessageService and Handling.UNTIL_END_OF_EPOCH is MessageHandling.UNTIL_END_OF_EPOCH
