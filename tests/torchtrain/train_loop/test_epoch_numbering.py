"""One way to count epochs (issue 35, item 3): every message counts as the ``Epoch N/M`` line does (from 1);
file names keep aitoolbox 1.8's ``E<index>`` (from 0)."""
import contextlib
import logging
import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks import (
    AllPredictionsSame, EarlyStopping, ModelCheckpoint, ModelPerformancePrintReport, TerminateOnNaN,
    ThresholdEarlyStopping)
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data

EPOCH_LINE = re.compile(r"^Epoch (\d+)/\d+ - ")


class Messages(logging.Handler):
    """The package's log messages, in order (its logger need not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def epoch_lines(self):
        return [int(EPOCH_LINE.match(line).group(1)) for line in self.lines if EPOCH_LINE.match(line)]

    def epoch_line_after(self, pattern):
        """``(the number a message matching pattern shows, the number of the next epoch line)``, for each match."""
        pairs = []
        for position, line in enumerate(self.lines):
            match = re.search(pattern, line)
            if match:
                following = [EPOCH_LINE.match(later) for later in self.lines[position + 1:]]
                number = next(int(found.group(1)) for found in following if found)
                pairs.append((int(match.group(1)), number))
        return pairs

    def epoch_line_before(self, pattern):
        """``(the number a message matching pattern shows, the number of the epoch line before it)``, each match."""
        pairs = []
        for position, line in enumerate(self.lines):
            match = re.search(pattern, line)
            if match:
                preceding = [EPOCH_LINE.match(earlier) for earlier in reversed(self.lines[:position])]
                pairs.append((int(match.group(1)), next(int(found.group(1)) for found in preceding if found)))
        return pairs


@contextlib.contextmanager
def logged():
    handler = Messages()
    package_logger = logging.getLogger("aitoolbox")
    level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)


def make_loop(model=None, **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else MLP()
    return TrainLoop(model, DataLoader(classification_data(16), batch_size=8),
                     DataLoader(classification_data(8, seed=3), batch_size=8), None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False, **kwargs)


def test_reports_stop_messages_and_file_names(tmp_path):
    tl = make_loop()
    folder = dict(project_name="p", experiment_name="e", local_model_result_folder_path=str(tmp_path))
    with logged() as messages:
        # min_delta never met: the first epoch stays the best, and the third stops the run.
        tl.fit(num_epochs=10, callbacks=[ModelPerformancePrintReport(["val_loss"]),
                                         EarlyStopping(min_delta=1e9, patience=1), ModelCheckpoint(**folder)])
    assert messages.epoch_lines() == [1, 2, 3]
    reports = messages.epoch_line_after(r"^Epoch (\d+) performance report")
    assert reports == [(1, 1), (2, 2), (3, 3)]
    (stop,) = [line for line in messages.lines if line.startswith("Stopping training: EarlyStopping")]
    assert "stopped at epoch 3, best epoch 1 " in stop
    # The reason follows its epoch's line, as Keras prints it (friction 3 of issue 35's review).
    assert messages.lines.index(stop) == messages.lines.index(next(
        line for line in messages.lines if line.startswith("Epoch 3/10 - "))) + 1
    # File names keep 1.8's index: the end of "Epoch 3/10" is _E2.pth.
    checkpoints = sorted(os.listdir(os.path.join(tl.callbacks[-1].experiment_folder.checkpoint_dir)))
    assert [re.search(r"_E(\d+)\.pth$", name).group(1) for name in checkpoints] == ["0", "1", "2"]
    with logged() as messages:
        tl.fit(num_epochs=10)
    (nothing,) = [line for line in messages.lines if line.startswith("Nothing to train")]
    assert "stopped at epoch 3 " in nothing


class InsertNaN(AbstractCallback):
    def __init__(self, at_epoch):
        super().__init__("insert NaN", execution_order=-1)
        self.at_epoch = at_epoch

    def on_epoch_end(self):
        value = float("nan") if self.train_loop_obj.epoch == self.at_epoch else 1.0
        self.train_loop_obj.insert_metric_result_into_history("probe", value)


@pytest.mark.parametrize("stopper, pattern, stopped_at", [
    (TerminateOnNaN(monitor="probe"), r"TerminateOnNaN: probe = nan at epoch (\d+)", 2),
    (ThresholdEarlyStopping(monitor="val_loss", threshold=-1.0, patience=1), r"stopped at epoch (\d+)", 2),
])
def test_other_stops_count_as_the_epoch_line(stopper, pattern, stopped_at):
    tl = make_loop()
    with logged() as messages:
        tl.fit(num_epochs=5, callbacks=[InsertNaN(at_epoch=1), stopper])
    assert messages.epoch_lines() == list(range(1, stopped_at + 1))
    assert messages.epoch_line_before(pattern) == [(stopped_at, stopped_at)]  # a stop's reason follows its line


class ConstantPredictions(MLP):
    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return torch.zeros(len(x)), y, None


def test_all_predictions_same_counts_as_the_epoch_line():
    tl = make_loop(ConstantPredictions())
    with logged() as messages:
        tl.fit(num_epochs=2, callbacks=[AllPredictionsSame(value=0.0)])
    assert messages.epoch_line_after(r"validation predictions at epoch (\d+) are") == [(1, 1), (2, 2)]


class StopInEpoch(AbstractCallback):
    def __init__(self):
        super().__init__("interrupt once")
        self.done = False

    def on_batch_end(self):
        if self.train_loop_obj.epoch == 1 and not self.done:
            self.done = True
            raise KeyboardInterrupt


def test_continuing_after_an_interruption_names_the_epoch_as_its_line_does():
    tl = make_loop()
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=3, callbacks=[StopInEpoch()])
    with logged() as messages:
        tl.fit(num_epochs=3)
    assert messages.epoch_line_after(r"Continuing epoch (\d+) where the last fit stopped") == [(2, 2)]
    # Review of issue 35, friction 4: the batch is a count of batches done, not a 0-based index: say so.
    (line,) = [line for line in messages.lines if line.startswith("Continuing epoch")]
    assert line == "Continuing epoch 2 where the last fit stopped, after 1 batch of it", line
