"""ModelTrainHistoryPlot and ModelTrainHistoryFileWriter on a real TrainLoop: files, contents, folders, ranks."""
import csv
import json
import os
import re

import pytest
import torch
from torch import nn

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.history_output import HistoryEpochs
from aitoolbox.torchtrain.callbacks.performance_eval import ModelTrainHistoryFileWriter, ModelTrainHistoryPlot
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

pytest.importorskip("matplotlib")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_train_loop(test=True, end_auto_eval=True) -> TrainLoop:
    torch.manual_seed(0)
    model = MLP()
    return TrainLoop(model, seeded_loader(classification_data(24), batch_size=8),
                     seeded_loader(classification_data(16, seed=20), batch_size=8, shuffle=False),
                     seeded_loader(classification_data(12, seed=30), batch_size=8, shuffle=False) if test else None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), end_auto_eval=end_auto_eval,
                     show_progress=False)


def folder_args(tmp_path) -> dict:
    return dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path))


def all_files(root) -> list:
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, names in os.walk(root) for name in names)


class ReadAtEpochEnd(AbstractCallback):
    """Runs after the writers (execution order 98) and keeps a copy of a file's text at each epoch end."""

    def __init__(self, path_fn):
        super().__init__("reader", execution_order=98)
        self.path_fn = path_fn
        self.texts = []

    def on_epoch_end(self):
        with open(self.path_fn(), encoding="utf-8") as handle:
            self.texts.append(handle.read())


# --- plots -----------------------------------------------------------------------------------------------
def test_one_valid_png_per_metric_in_the_plots_folder(tmp_path):
    tl = make_train_loop()
    callback = ModelTrainHistoryPlot(epoch_end=False, train_end=True, **folder_args(tmp_path))
    tl.fit(num_epochs=2, callbacks=[callback])
    plots_dir = callback.experiment_folder.plots_dir
    assert plots_dir == os.path.join(callback.experiment_folder.path, "results", "plots")
    assert sorted(os.listdir(plots_dir)) == sorted(f"{name}.png" for name in tl.train_history)
    assert "train_end_test_loss.png" in os.listdir(plots_dir)
    for name in os.listdir(plots_dir):
        with open(os.path.join(plots_dir, name), "rb") as handle:
            assert handle.read(8) == PNG_SIGNATURE
    image_module = pytest.importorskip("PIL.Image")
    with image_module.open(os.path.join(plots_dir, "loss.png")) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_plots_are_written_at_each_epoch_end(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)  # one metric: accumulated_loss
    callback = ModelTrainHistoryPlot(**folder_args(tmp_path))
    sizes = []

    class PlotSizes(AbstractCallback):
        def __init__(self):
            super().__init__("sizes", execution_order=98)

        def on_epoch_end(self):
            sizes.append(os.path.getsize(os.path.join(callback.experiment_folder.plots_dir, "accumulated_loss.png")))

    tl.fit(num_epochs=2, callbacks=[callback, PlotSizes()])
    assert len(sizes) == 2 and sizes[0] != sizes[1]  # redrawn with one more point
    assert not any(name.startswith(TEMP_PREFIX) for name in all_files(tmp_path))


@pytest.mark.parametrize("file_format, signature", [("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_other_plot_formats(tmp_path, file_format, signature):
    tl = make_train_loop(test=False, end_auto_eval=False)
    callback = ModelTrainHistoryPlot(file_format=file_format, **folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[callback])
    with open(os.path.join(callback.experiment_folder.plots_dir, f"accumulated_loss.{file_format}"), "rb") as handle:
        assert handle.read(len(signature)) == signature


def test_metric_names_become_safe_file_names_and_non_numbers_are_skipped(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)
    tl.insert_metric_result_into_history("val/F1 score", 0.25)
    tl.insert_metric_result_into_history("confusion", [[1, 2], [3, 4]])
    callback = ModelTrainHistoryPlot(**folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[callback])
    assert sorted(os.listdir(callback.experiment_folder.plots_dir)) == [
        "accumulated_loss.png", "val_F1_score.png"]


# --- history files ---------------------------------------------------------------------------------------
def test_txt_has_a_block_per_epoch_with_the_newest_values(tmp_path):
    tl = make_train_loop(end_auto_eval=2)  # loss and val_loss only at epochs 1 and 3
    callback = ModelTrainHistoryFileWriter(**folder_args(tmp_path))
    tl.fit(num_epochs=2, callbacks=[callback])
    assert callback.file_path == os.path.join(callback.experiment_folder.results_dir, "results.txt")
    with open(callback.file_path, encoding="utf-8") as handle:
        blocks = handle.read().split("\n\n\n")
    history = tl.train_history
    rule = "============================"
    assert blocks[0] == f"{rule}\nEpoch: 0\n{rule}\naccumulated_loss:\t{history['accumulated_loss'][0]}"
    assert blocks[1] == (f"{rule}\nEpoch: 1\n{rule}\nloss:\t{history['loss'][0]}\n"
                         f"accumulated_loss:\t{history['accumulated_loss'][1]}\nval_loss:\t{history['val_loss'][0]}")
    assert blocks[2] == ""


@pytest.mark.parametrize("file_format, delimiter", [("tsv", "\t"), ("csv", ",")])
def test_tables_have_a_row_per_write_and_a_new_header_when_metrics_change(tmp_path, file_format, delimiter):
    tl = make_train_loop(end_auto_eval=2)
    callback = ModelTrainHistoryFileWriter(train_end=True, file_format=file_format, **folder_args(tmp_path))
    reader = ReadAtEpochEnd(lambda: callback.file_path)
    tl.fit(num_epochs=3, callbacks=[callback, reader])
    with open(callback.file_path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle, delimiter=delimiter))
    history = tl.train_history
    assert rows == [["Epoch", "accumulated_loss"], ["0", repr(history["accumulated_loss"][0])],
                    ["NEW_METRICS_DETECTED"], ["Epoch", "loss", "accumulated_loss", "val_loss"],
                    ["1", repr(history["loss"][0]), repr(history["accumulated_loss"][1]), repr(history["val_loss"][0])],
                    ["2", repr(history["loss"][0]), repr(history["accumulated_loss"][2]), repr(history["val_loss"][0])]]
    assert [len(text.splitlines()) for text in reader.texts] == [2, 5, 6]  # appended at every epoch end
    # At the end of training: a file of its own, with the test loss recorded then.
    with open(callback.output_path("train_end_"), newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle, delimiter=delimiter))
    assert rows == [["Epoch", "loss", "accumulated_loss", "val_loss", "train_end_test_loss"],
                    ["2", repr(history["loss"][0]), repr(history["accumulated_loss"][2]), repr(history["val_loss"][0]),
                     repr(history["train_end_test_loss"][0])]]


def test_dict_metrics_and_tensors_are_flattened_into_plain_values(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)
    tl.insert_metric_result_into_history("val_f1", {"a": torch.tensor(0.5), "b": {"c": 2}})
    tl.insert_metric_result_into_history("empty_metric_is_left_out", 1.0)
    tl.train_history["empty_metric_is_left_out"].clear()
    callback = ModelTrainHistoryFileWriter(file_format="csv", **folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[callback])
    with open(callback.file_path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["Epoch", "accumulated_loss", "val_f1_a", "val_f1_b_c"]  # metrics without values left out
    assert rows[1][2:] == ["0.5", "2"]


def test_json_holds_the_history(tmp_path):
    tl = make_train_loop()
    tl.insert_metric_result_into_history("val_Accuracy", torch.tensor(0.75))
    callback = ModelTrainHistoryFileWriter(epoch_end=False, train_end=True, file_format="json", **folder_args(tmp_path))
    tl.fit(num_epochs=2, callbacks=[callback])
    assert not os.path.exists(callback.file_path)  # nothing written at epoch ends
    with open(callback.output_path("train_end_"), encoding="utf-8") as handle:
        content = json.load(handle)
    expected = tl.train_history.get_train_history_dict()
    expected["val_Accuracy"] = [0.75]
    assert content == expected
    assert os.path.basename(callback.output_path("train_end_")) == "train_end_train_history.json"


def test_1x_method_names_write_now(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)
    writer = ModelTrainHistoryFileWriter(file_format="tsv", **folder_args(tmp_path))
    plot = ModelTrainHistoryPlot(**folder_args(tmp_path))
    tl.callbacks_handler.register_callbacks([writer, plot])
    tl.insert_metric_result_into_history("val_acc", 0.5)
    writer.write_current_train_history(prefix="manual_")
    plot.plot_current_train_history()
    with open(writer.output_path("manual_"), encoding="utf-8") as handle:
        assert handle.read() == "Epoch\tval_acc\n0\t0.5\n"
    assert os.listdir(plot.experiment_folder.plots_dir) == ["val_acc.png"]


def test_history_epochs_of_values_already_there():
    history = {"loss": [1.0, 2.0, 3.0], "test": [4.0]}
    epochs = HistoryEpochs()
    epochs.observe(history, epoch=2)
    assert epochs.epochs == {"loss": [0, 1, 2], "test": [2]}
    history["loss"].append(5.0)
    epochs.observe(history, epoch=3)
    assert epochs.epochs["loss"] == [0, 1, 2, 3]


# --- folders and processes -------------------------------------------------------------------------------
def test_callbacks_naming_the_same_folder_share_one_run_folder(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)
    plot = ModelTrainHistoryPlot(**folder_args(tmp_path))
    writer = ModelTrainHistoryFileWriter(file_format="csv", **folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[plot, writer])
    assert plot.experiment_folder is writer.experiment_folder
    assert len(os.listdir(tmp_path / "proj")) == 1


def test_preset_folder_is_used_without_arguments(tmp_path):
    tl = make_train_loop(test=False, end_auto_eval=False)
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp")  # as TrainLoopCheckpoint sets it
    plot, writer = ModelTrainHistoryPlot(), ModelTrainHistoryFileWriter()
    tl.fit(num_epochs=1, callbacks=[plot, writer])
    assert plot.experiment_folder is writer.experiment_folder is tl.experiment_folder
    assert os.path.isfile(os.path.join(tl.experiment_folder.results_dir, "results.txt"))
    assert os.path.isfile(os.path.join(tl.experiment_folder.plots_dir, "accumulated_loss.png"))


def test_explicit_arguments_matching_the_preset_reuse_its_folder(tmp_path):
    tl = make_train_loop(test=False)
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp", timestamp="2020-01-01_00-00-00")
    writer = ModelTrainHistoryFileWriter(**folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[writer])
    assert writer.experiment_folder is tl.experiment_folder


@pytest.mark.parametrize("callback_class", [ModelTrainHistoryPlot, ModelTrainHistoryFileWriter])
def test_some_of_the_folder_details_only_is_a_clear_error_at_registration(callback_class):
    """Given none, the callback writes into a plain loop's default run folder (test_default_run_folder.py)."""
    with pytest.raises(ValueError, match="project_name, experiment_name and local_model_result_folder_path.*"
                                         "TrainLoopCheckpoint"):
        make_train_loop().fit(num_epochs=1, callbacks=[callback_class(local_model_result_folder_path="out")])


@pytest.mark.parametrize("callback_class", [ModelTrainHistoryPlot, ModelTrainHistoryFileWriter])
def test_some_folder_arguments_are_completed_from_the_preset(tmp_path, callback_class):
    tl = make_train_loop(test=False)
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp")  # as TrainLoopCheckpoint sets it
    tl.project_name, tl.experiment_name, tl.local_model_result_folder_path = "proj", "exp", str(tmp_path)
    callback = callback_class(experiment_name="other")
    tl.callbacks_handler.register_callbacks([callback])
    assert callback.experiment_folder.path == os.path.join(str(tmp_path), "proj", f"other_{tl.experiment_timestamp}")
    with pytest.raises(ValueError, match="local_model_result_folder_path=None"):  # a plain TrainLoop cannot
        make_train_loop().callbacks_handler.register_callbacks([callback_class(project_name="p", experiment_name="e")])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(project_name="p", experiment_name="a/b", local_model_result_folder_path="/tmp"), ValueError,
     "experiment_name"),
    (dict(epoch_end=False), ValueError, "never write"),
    (dict(epoch_end=1), TypeError, "epoch_end"),
    (dict(file_format="xlsx"), ValueError, "file_format"),
    (dict(cloud_save_mode="gcp"), ValueError, "cloud_save_mode='gcp' is not one of"),
])
@pytest.mark.parametrize("callback_class", [ModelTrainHistoryPlot, ModelTrainHistoryFileWriter])
def test_bad_arguments_are_refused(callback_class, kwargs, error, match):
    with pytest.raises(error, match=match):
        callback_class(**kwargs)


def test_nothing_is_written_outside_the_main_process(tmp_path):
    tl = make_train_loop()
    tl.strategy.rank = 1  # as in a non-zero rank of a distributed run
    assert not tl.is_main_process
    tl.fit(num_epochs=2, callbacks=[ModelTrainHistoryPlot(train_end=True, **folder_args(tmp_path)),
                                    ModelTrainHistoryFileWriter(train_end=True, **folder_args(tmp_path))])
    assert os.listdir(tmp_path) == []


def test_a_missing_matplotlib_is_an_import_error_with_the_install_command(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail as if absent
    with pytest.raises(ImportError, match="pip install matplotlib"):
        make_train_loop().fit(num_epochs=1, callbacks=[ModelTrainHistoryPlot(**folder_args(tmp_path))])
