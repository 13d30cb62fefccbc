"""The epoch's summary line shows what the user chooses (issue 35 review, friction 7: a ~520-character line with
two validation sets, a result package and ThroughputMonitor could not be trimmed)."""
import logging
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def fit_and_log(epochs=2, **kwargs):
    torch.manual_seed(0)
    model = MLP()
    validation = {"in_domain": DataLoader(classification_data(8, seed=3), batch_size=8),
                  "shifted": DataLoader(classification_data(8, seed=4), batch_size=8)}
    tl = TrainLoop(model, DataLoader(classification_data(16), batch_size=8), validation, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False, **kwargs)
    handler, epochs_logger = Lines(), logging.getLogger("aitoolbox.epochs")
    level = epochs_logger.level
    epochs_logger.addHandler(handler)
    epochs_logger.setLevel(logging.INFO)
    try:
        tl.fit(num_epochs=epochs)
    finally:
        epochs_logger.removeHandler(handler)
        epochs_logger.setLevel(level)
    return tl, handler.lines


def names(line):
    epoch, seconds, *entries = line.split(" - ")
    assert re.fullmatch(r"Epoch \d+/\d+", epoch) and re.fullmatch(r"[\d.]+s", seconds)
    return [entry.rsplit(" ", 1)[0] for entry in entries]


def test_by_default_every_entry_once():
    _, lines = fit_and_log()
    assert names(lines[0]) == ["accumulated_loss", "loss", "val_in_domain_loss", "val_shifted_loss"]


@pytest.mark.parametrize("patterns, shown", [
    (["accumulated_loss"], ["accumulated_loss"]),
    (["val_*loss"], ["val_in_domain_loss", "val_shifted_loss"]),  # a pattern leaves the plain alias out
    (["val_loss", "accumulated_loss"], ["accumulated_loss", "val_loss"]),  # an exact name shows the alias
    ([], []),
])
def test_the_line_shows_the_chosen_entries_and_the_history_keeps_all(patterns, shown):
    tl, lines = fit_and_log(epoch_line_metrics=patterns)
    assert len(lines) == 2 and all(names(line) == shown for line in lines)
    assert {"loss", "val_loss", "val_in_domain_loss", "val_shifted_loss", "accumulated_loss"} <= set(tl.train_history)


def test_settable_between_fits_and_back_to_all():
    tl, lines = fit_and_log(epochs=1, epoch_line_metrics=["loss"])
    assert names(lines[0]) == ["loss"]
    tl.epoch_line_metrics = None
    assert tl.epoch_line_metrics is None


def test_a_pattern_matching_nothing_is_named_at_the_end_of_fit():
    with pytest.warns(UserWarning, match=r"\['val_acuracy'\] matched no entry of the training history"):
        _, lines = fit_and_log(epoch_line_metrics=["loss", "val_acuracy"])
    assert names(lines[0]) == ["loss"]


@pytest.mark.parametrize("bad", ["loss", [1], [""], 3])
def test_a_bad_choice_is_refused_when_set(bad):
    torch.manual_seed(0)
    model = MLP()
    with pytest.raises(TypeError, match="epoch_line_metrics must be None .* or a list of history names"):
        TrainLoop(model, DataLoader(classification_data(16), batch_size=8), None, None,
                  torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), epoch_line_metrics=bad)


def test_no_warning_when_every_pattern_matched():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_and_log(epochs=1, epoch_line_metrics=["val_*"])
