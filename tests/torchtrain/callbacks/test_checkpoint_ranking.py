"""The ranking ModelCheckpoint after the review of issue 35: ``mode`` (D2), several ranking callbacks in one run
folder (D1), and the ranking kept in the callback's state, so a run continued in a new run folder knows its best
checkpoint (D4)."""
import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.checkpoints import RANKING_FILE_NAME, list_checkpoints, ranking_file_name
from aitoolbox.torchtrain.callbacks import ModelCheckpoint, ModelIterationCheckpoint
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.checkpoint_ranking import epoch_file_tag
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data
from tests.torchtrain.callbacks.test_best_model import epoch_of, folder


def make_loop(validation=True):
    torch.manual_seed(0)
    model = MLP()
    train = DataLoader(classification_data(8), batch_size=8)
    val = DataLoader(classification_data(8, seed=3), batch_size=8) if validation else None
    return TrainLoop(model, train, val, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     show_progress=False)


class Record(AbstractCallback):
    """``values[name][epoch]`` recorded as ``name`` at every epoch end, before the checkpoints run."""

    def __init__(self, values):
        super().__init__("scripted metrics", execution_order=50)
        self.values = values

    def on_epoch_end(self):
        tl = self.train_loop_obj
        for name, values in self.values.items():
            tl.insert_metric_result_into_history(name, values[tl.epoch])


def best_index(values, mode):
    """The earliest best epoch, as the ranking keeps the earliest of equal scores."""
    best = min(values) if mode == "min" else max(values)
    return values.index(best)


# --- D2: mode ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric, mode, values, best", [
    ("val_Perplexity", "min", [9.0, 3.0, 5.0, 7.0], 1),  # a name without 'loss'/'error': auto would say max
    ("val_mae", "min", [0.5, 0.2, 0.4, 0.3], 1),
    ("val_loss_reward", "max", [0.5, 0.9, 0.4, 0.3], 1),  # 'loss' in the name: auto would say min
])
def test_mode_sets_the_direction_of_the_ranking(tmp_path, metric, mode, values, best):
    tl = make_loop()
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models=metric, num_best_checkpoints_kept=1,
                                 mode=mode)
    tl.fit(num_epochs=len(values), callbacks=[Record({metric: values}), checkpoint])
    assert epoch_of(checkpoint.best_model_path) == best and checkpoint.best_model_score == values[best]
    kept = [epoch_of(path) for path in list_checkpoints(tl.callbacks[-1].experiment_folder.checkpoint_dir)]
    assert kept == sorted({best, len(values) - 1})


def test_mode_auto_keeps_the_guess_from_the_name(tmp_path):
    tl = make_loop()
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_Perplexity",
                                 num_best_checkpoints_kept=1)
    tl.fit(num_epochs=3, callbacks=[Record({"val_Perplexity": [9.0, 3.0, 5.0]}), checkpoint])
    assert checkpoint.mode == "auto" and checkpoint.best_model_score == 9.0  # documented: higher is better


@pytest.mark.parametrize("kwargs, message", [
    ({"rm_subopt_local_models": "val_x", "mode": "lower"},
     r"mode must be one of \('auto', 'min', 'max'\), got 'lower'"),
    ({"rm_subopt_local_models": "val_x", "mode": None}, r"mode must be one of .*got None"),
    ({"mode": "min"}, r"rm_subopt_local_models=False ranks none"),
])
def test_a_bad_mode_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)
    with pytest.raises(ValueError, match=message):
        ModelIterationCheckpoint(5, **kwargs)


# --- D1: several ranking callbacks in one run folder -----------------------------------------------------------
def test_two_ranking_checkpoints_keep_their_own_files_and_rankings(tmp_path, monkeypatch):
    """The review's script: one ranks by val_loss, one by val_Acc, both in the default run folder."""
    monkeypatch.chdir(tmp_path)
    tl = make_loop()
    by_loss = ModelCheckpoint(rm_subopt_local_models="val_loss", num_best_checkpoints_kept=1)
    by_acc = ModelCheckpoint(rm_subopt_local_models="val_Acc", num_best_checkpoints_kept=1)
    tl.fit(num_epochs=4, callbacks=[Record({"val_Acc": [0.9, 0.1, 0.2, 0.3]}), by_loss, by_acc])
    val_loss = tl.train_history["val_loss"]
    assert epoch_of(by_acc.best_model_path) == 0 and by_acc.best_model_score == 0.9
    best_loss_epoch = val_loss.index(min(val_loss))
    assert by_loss.best_model_score == min(val_loss) and epoch_of(by_loss.best_model_path) == best_loss_epoch
    assert os.path.isfile(by_acc.best_model_path) and os.path.isfile(by_loss.best_model_path)
    checkpoint_dir = tl.run_folder.checkpoint_dir
    names = sorted(os.listdir(checkpoint_dir))
    stamp = tl.run_folder.timestamp
    # The first keeps aitoolbox 1.8's names, the second tags its own with its metric.
    assert by_loss.file_tag is None and by_acc.file_tag == "val_Acc"
    untagged = sorted(name for name in names if name.startswith(f"model_run_{stamp}_E"))
    tagged = sorted(name for name in names if name.startswith(f"model_run_{stamp}_val_Acc_E"))
    assert [epoch_of(name) for name in untagged] == sorted({val_loss.index(min(val_loss)), 3})
    assert [epoch_of(name) for name in tagged] == [0, 3]
    for tag, metric, files in ((None, "val_loss", untagged), ("val_Acc", "val_Acc", tagged)):
        with open(os.path.join(checkpoint_dir, ranking_file_name(tag))) as handle:
            record = json.load(handle)
        assert record["metric"] == metric and sorted(name for _, name in record["checkpoints"]) == files
    assert set(names) == set(untagged) | set(tagged) | {RANKING_FILE_NAME, ranking_file_name("val_Acc")}


def test_tags_name_a_metric_once():
    class Stub:
        def __init__(self, ranked, kept=1):
            self.rm_subopt_local_models = ranked
            self.num_best_checkpoints_kept = kept

        def monitored_metric(self):
            return "val_loss"

    savers = [Stub("val_loss"), Stub(True, 2), Stub("val/F1 score"), Stub(False), Stub("val_loss", 3)]
    assert [epoch_file_tag(saver, savers) for saver in savers] == [
        None, "val_loss", "val-F1-score", "every_epoch", "val_loss_2"]
    # Savers alike (one passed to every fit call, as 1.x scripts do) write the same files: they share a tag.
    alike = [Stub(False), Stub("val_loss"), Stub(False), Stub("val_loss"), Stub("val_loss", 2)]
    assert [epoch_file_tag(saver, alike) for saver in alike] == [None, "val_loss", None, "val_loss", "val_loss_2"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.tuples(st.floats(0, 1, allow_nan=False), st.floats(0, 1, allow_nan=False)),
                       min_size=1, max_size=4),
       modes=st.tuples(st.sampled_from(["min", "max"]), st.sampled_from(["min", "max"])),
       keep=st.tuples(st.integers(1, 2), st.integers(1, 2)))
def test_each_of_two_rankings_keeps_its_best_and_its_newest(tmp_path_factory, values, modes, keep):
    """Whatever the scores, directions and counts kept, each callback keeps exactly its own best k and its newest,
    and its best_model_path is the best of its own metric."""
    root = tmp_path_factory.mktemp("runs")
    tl = make_loop()
    series = {"val_a": [pair[0] for pair in values], "val_b": [pair[1] for pair in values]}
    callbacks = [ModelCheckpoint(**folder(root), rm_subopt_local_models=name, mode=mode, num_best_checkpoints_kept=k)
                 for name, mode, k in zip(series, modes, keep)]
    tl.fit(num_epochs=len(values), callbacks=[Record(series)] + callbacks)
    checkpoint_dir = callbacks[0].experiment_folder.checkpoint_dir
    on_disk = set(os.listdir(checkpoint_dir))
    for callback, (name, scores), mode, k in zip(callbacks, series.items(), modes, keep):
        best = best_index(scores, mode)
        assert epoch_of(callback.best_model_path) == best and callback.best_model_score == scores[best]
        ranked = sorted(range(len(scores)), key=lambda epoch: scores[epoch], reverse=mode == "max")
        expected = {callback_name(callback, epoch) for epoch in ranked[:k] + [len(scores) - 1]}
        own = {file for file in on_disk if file.endswith(".pth") and is_own(callback, file)}
        assert own == expected


def callback_name(callback, epoch):
    folder_ = callback.experiment_folder
    tag = "" if callback.file_tag is None else f"_{callback.file_tag}"
    return f"model_{folder_.experiment_name}_{folder_.timestamp}{tag}_E{epoch}.pth"


def is_own(callback, file_name):
    folder_ = callback.experiment_folder
    prefix = f"model_{folder_.experiment_name}_{folder_.timestamp}"
    rest = file_name[len(prefix):]
    return rest.startswith("_E") if callback.file_tag is None else rest.startswith(f"_{callback.file_tag}_E")


# --- D4: the ranking travels in the callback's state ------------------------------------------------------------
class InterruptAt(AbstractCallback):
    def __init__(self, epoch):
        super().__init__("Ctrl-C at an epoch's start")
        self.epoch = epoch

    def on_epoch_begin(self):
        if self.train_loop_obj.epoch == self.epoch:
            raise KeyboardInterrupt


SCORES = [0.1, 0.9, 0.2, 0.3, 0.4, 0.5]


def test_a_run_continued_in_a_new_run_folder_knows_the_best_checkpoint_of_the_first(tmp_path, monkeypatch):
    """The review's script: a plain TrainLoop interrupted, then continued by a new loop (as a new process would) with
    load_checkpoint(<the first run folder>): its checkpoints go to a new run folder, and its best is the first's E1."""
    monkeypatch.chdir(tmp_path)
    first = make_loop()
    with pytest.raises(KeyboardInterrupt):
        first.fit(num_epochs=6, callbacks=[Record({"val_score": SCORES}), InterruptAt(4),
                                           ModelCheckpoint(rm_subopt_local_models="val_score",
                                                           num_best_checkpoints_kept=1)])
    first_folder = first.run_folder.checkpoint_dir
    left_by_first = sorted(os.listdir(first_folder))
    resumed = make_loop()
    resumed.load_checkpoint(first.run_folder.path)
    checkpoint = ModelCheckpoint(rm_subopt_local_models="val_score", num_best_checkpoints_kept=1)
    resumed.fit(num_epochs=6, callbacks=[Record({"val_score": SCORES}), checkpoint])
    assert resumed.run_folder.path != first.run_folder.path
    assert os.path.dirname(checkpoint.best_model_path) == first_folder
    assert epoch_of(checkpoint.best_model_path) == 1 and checkpoint.best_model_score == 0.9
    assert sorted(os.listdir(first_folder)) == left_by_first  # the earlier folder's files are never deleted
    assert [epoch_of(path) for path in list_checkpoints(resumed.run_folder.checkpoint_dir)] == [5]


def test_the_state_holds_the_checkpoint_being_written(tmp_path):
    """A checkpoint's own epoch is in the ranking it carries: continuing from it knows its score."""
    tl = make_loop()
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_score", num_best_checkpoints_kept=1)
    tl.fit(num_epochs=2, callbacks=[Record({"val_score": [0.2, 0.9]}), checkpoint])
    newest = list_checkpoints(checkpoint.experiment_folder.checkpoint_dir)[-1]
    saved = torch.load(newest, weights_only=True)["callbacks"]["ModelCheckpoint:0"]
    assert saved["metric"] == "val_score" and saved["mode"] == "auto"
    assert [score for score, path in saved["checkpoints"] if path == newest] == [0.9]


def test_a_state_of_another_metric_is_not_taken_over(tmp_path):
    checkpoint = ModelCheckpoint(**folder(tmp_path), rm_subopt_local_models="val_other")
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([checkpoint])
    checkpoint.load_state_dict({"metric": "val_score", "mode": "auto", "checkpoints": [[0.9, __file__]]})
    assert checkpoint.saved_checkpoints == []
    checkpoint.load_state_dict({"metric": "val_other", "mode": "auto",
                                "checkpoints": [[0.9, __file__], [0.5, str(tmp_path / "gone_E0.pth")]]})
    assert checkpoint.saved_checkpoints == [(0.9, __file__)]  # a checkpoint that is gone is not ranked
    assert not math.isnan(checkpoint.saved_checkpoints[0][0])


def test_a_checkpoint_callback_that_ranks_nothing_has_an_empty_state(tmp_path):
    tl = make_loop()
    checkpoint = ModelCheckpoint(**folder(tmp_path))
    tl.fit(num_epochs=1, callbacks=[checkpoint])
    assert checkpoint.state_dict() == {}
