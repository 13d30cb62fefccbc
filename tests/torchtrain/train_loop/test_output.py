"""What a training prints (issue 35, item 6): one progress bar per epoch for training and at most one for the epoch's
evaluation, an epoch line without the first validation set twice, and ``use_amp`` saying once what it chose."""
import contextlib
import io
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks import ModelPerformanceEvaluation
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop import progress
from tests.helpers import MLP, classification_data


class CountingBar(tqdm):
    """A tqdm bar writing into a buffer, recording each bar's description when it is made."""

    made = []

    def __init__(self, *args, **kwargs):
        kwargs["file"] = io.StringIO()
        super().__init__(*args, **kwargs)
        CountingBar.made.append(self.desc)


@pytest.fixture
def bars(monkeypatch):
    CountingBar.made = []
    monkeypatch.setattr(progress, "tqdm", CountingBar)
    monkeypatch.setattr(progress, "writes_to_terminal", lambda: True)  # the bars of a terminal
    return CountingBar.made


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged():
    handler, package_logger = Messages(), logging.getLogger("aitoolbox")
    level = package_logger.level
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(level)


def make_loop(**kwargs):
    torch.manual_seed(0)
    model = MLP()
    sets = {"in_domain": DataLoader(classification_data(8, seed=3), batch_size=4),
            "shifted": DataLoader(classification_data(8, seed=5), batch_size=4)}
    return TrainLoop(model, DataLoader(classification_data(16), batch_size=4), sets, None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), **kwargs)


def test_one_bar_per_epoch_for_training_and_one_for_its_evaluation(bars):
    tl = make_loop(show_progress=True)
    # The epoch's evaluation: the loss on the training set and on both sets, then predictions on both sets.
    tl.fit(num_epochs=2, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), on_val_data=True)])
    epochs = [index for index, description in enumerate(bars) if description.startswith("Epoch ")]
    assert [bars[index] for index in epochs] == ["Epoch 1/2", "Epoch 2/2"]
    per_epoch = [bars[start + 1:end] for start, end in zip(epochs, epochs[1:] + [len(bars)])]
    assert [len(others) for others in per_epoch] == [1, 1], bars


def test_a_pass_outside_the_epoch_end_still_shows_its_own_transient_bar(bars):
    tl = make_loop(show_progress=True)
    tl.predict_on_validation_set()
    assert len(bars) == 1 and "validation" in bars[0]


def test_the_epoch_line_shows_each_value_once():
    tl = make_loop(show_progress=False)
    with logged() as lines:
        tl.fit(num_epochs=1, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), on_val_data=True)])
    (line,) = [line for line in lines if line.startswith("Epoch 1/1 - ")]
    names = [part.rsplit(" ", 1)[0] for part in line.split(" - ")[2:]]
    assert "val_in_domain_loss" in names and "val_shifted_loss" in names and "val_in_domain_Accuracy" in names
    # The first set's values under the plain names (val_loss = val_in_domain_loss) stay in the history only.
    assert "val_loss" not in names and "val_Accuracy" not in names
    assert tl.train_history["val_loss"] == tl.train_history["val_in_domain_loss"]
    assert len(names) == len(set(names))


def test_a_single_validation_loader_keeps_its_plain_names():
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoop(model, DataLoader(classification_data(16), batch_size=4), DataLoader(classification_data(8)),
                   None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)
    with logged() as lines:
        tl.fit(num_epochs=1)
    (line,) = [line for line in lines if line.startswith("Epoch 1/1 - ")]
    assert " - val_loss " in line


@pytest.mark.parametrize("use_amp, expected", [
    (True, "Mixed precision (use_amp=True): bfloat16 autocast on cpu, no loss scaling"),
    ({"opt_level": "O2"}, "Mixed precision (use_amp={'opt_level': 'O2'}): bfloat16 model weights with float32 "
                          "master weights on cpu, no loss scaling"),
])
def test_use_amp_says_once_which_precision_it_chose(use_amp, expected):
    tl = make_loop(show_progress=False, use_amp=use_amp)
    with logged() as lines:
        tl.fit(num_epochs=1)
        tl.fit(num_epochs=2)
    assert [line for line in lines if line.startswith("Mixed precision")] == [expected]
    # One message: amp.initialize's own summary ('amp: O2 on cpu, ...') is not said too (review 35, friction 8).
    assert not [line for line in lines if line.startswith("amp: ")]


def test_without_use_amp_nothing_is_said():
    with logged() as lines:
        make_loop(show_progress=False).fit(num_epochs=1)
    assert not [line for line in lines if "precision" in line.lower()]
