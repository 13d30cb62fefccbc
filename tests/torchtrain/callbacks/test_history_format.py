"""TrainHistoryFormatter and MetricHistoryRename inside real TrainLoops."""
import logging
import pickle

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.basic import FunctionOnTrainLoop
from aitoolbox.torchtrain.callbacks.history_format import MetricHistoryRename, TrainHistoryFormatter
from aitoolbox.torchtrain.callbacks.performance_eval import MetricHistoryRename as ReExported
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import distinct_records


def make_loop(make_model, make_loader):
    model = make_model()
    return TrainLoop(model, make_loader(num_samples=8), None, None, torch.optim.SGD(model.parameters(), lr=0.01),
                     nn.MSELoss(), end_auto_eval=False, show_progress=False)


def record(name, values_by_epoch, execution_order=0):
    def fn(tl):
        if tl.epoch in values_by_epoch:
            tl.insert_metric_result_into_history(name, values_by_epoch[tl.epoch])
    return FunctionOnTrainLoop(fn, epoch_end=True, execution_order=execution_order)


def test_rename_copies_the_newest_value_at_every_epoch_end(make_model, make_loader):
    tl = make_loop(make_model, make_loader)
    tl.fit(num_epochs=3, callbacks=[MetricHistoryRename("val_acc", "accuracy"),
                                    record("val_acc", {0: 0.5, 1: 0.6, 2: 0.7}, execution_order=-1)])
    assert tl.train_history["accuracy"] == [0.5, 0.6, 0.7]
    assert ReExported is MetricHistoryRename  # aitoolbox 1.x import path


def test_formatter_at_train_end_with_a_getter_and_a_setter(make_model, make_loader):
    tl = make_loop(make_model, make_loader)
    formatter = TrainHistoryFormatter(lambda history: history["train_end_score"],
                                      lambda values: ("score_percent", values[-1] * 100),
                                      epoch_end=False, train_end=True)

    def end_score(loop):
        loop.insert_metric_result_into_history("train_end_score", 0.25)
    tl.fit(num_epochs=2, callbacks=[FunctionOnTrainLoop(end_score, train_end=True, execution_order=-1), formatter])
    assert tl.train_history["score_percent"] == [25.0]


def test_a_metric_not_updated_this_epoch_is_an_error_or_a_warning(make_model, make_loader, caplog, monkeypatch):
    tl = make_loop(make_model, make_loader)
    with pytest.raises(ValueError, match="expected 2 value\\(s\\) in its history, found 1"):
        tl.fit(num_epochs=2, callbacks=[MetricHistoryRename("val_acc", "accuracy"),
                                        record("val_acc", {0: 0.5}, execution_order=-1)])
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    tl = make_loop(make_model, make_loader)
    with caplog.at_level(logging.WARNING):
        tl.fit(num_epochs=3, callbacks=[MetricHistoryRename("val_acc", "accuracy", strict_metric_extract=False),
                                        record("val_acc", {0: 0.5, 2: 0.7}, execution_order=-1)])
    assert tl.train_history["accuracy"] == [0.5]  # epochs 1 and 2 skipped: the history is one value behind
    assert sum("not up to date" in record.getMessage() for record in distinct_records(caplog)) == 2


def test_rename_with_a_getter_function_and_pickling():
    callback = MetricHistoryRename(lambda history: history["a"], "b")
    assert callback.input_metric_getter({"a": [1, 2]}) == [1, 2]
    by_name = pickle.loads(pickle.dumps(MetricHistoryRename("val_acc", "accuracy")))
    assert by_name.output_metric_setter(by_name.input_metric_getter({"val_acc": [1, 2]})) == ("accuracy", 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(epoch_end=True, train_end=True), ValueError, "exactly one of epoch_end and train_end"),
    (dict(epoch_end=False, train_end=False), ValueError, "exactly one of epoch_end and train_end"),
    (dict(new_metric_name=""), ValueError, "new_metric_name"),
    (dict(input_metric_path=3), TypeError, "input_metric_path"),
])
def test_bad_arguments(kwargs, error, match):
    arguments = {"input_metric_path": "val_acc", "new_metric_name": "accuracy", **kwargs}
    with pytest.raises(error, match=match):
        MetricHistoryRename(**arguments)
    with pytest.raises(TypeError, match="output_metric_setter must be a function"):
        TrainHistoryFormatter(lambda history: [], "not callable")
