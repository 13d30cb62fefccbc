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
def test_csv_has_one_row_per_epoch_and_empty_cells_where_a_metric_has_no_value(tmp_path):
    tl = make_train_loop(end_auto_eval=2)  # loss and val_loss only at epochs 1 and 3
    callback = ModelTrainHistoryFileWriter(train_end=True, file_format="csv", **folder_args(tmp_path))
    reader = ReadAtEpochEnd(lambda: callback.file_path)
    tl.fit(num_epochs=4, callbacks=[callback, reader])
    assert callback.file_path == os.path.join(callback.experiment_folder.results_dir, "train_history.csv")
    with open(callback.file_path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    history = tl.train_history
    assert rows[0] == ["epoch", "accumulated_loss", "loss", "val_loss", "train_end_test_loss"]
    assert [row[0] for row in rows[1:]] == ["0", "1", "2", "3"]
    assert [float(row[1]) for row in rows[1:]] == history["accumulated_loss"]  # exact: floats written in full
    assert [row[2] for row in rows[1:]] == ["", repr(history["loss"][0]), "", repr(history["loss"][1])]
    assert [row[3] for row in rows[1:]] == ["", repr(history["val_loss"][0]), "", repr(history["val_loss"][1])]
    assert [row[4] for row in rows[1:]] == ["", "", "", repr(history["train_end_test_loss"][0])]
    # Written at every epoch end: the file grows by one row per epoch.
    assert [len(text.splitlines()) for text in reader.texts] == [2, 3, 4, 5]


def test_txt_is_an_aligned_table(tmp_path):
    tl = make_train_loop()
    callback = ModelTrainHistoryFileWriter(train_end=True, file_format="txt", **folder_args(tmp_path))
    tl.fit(num_epochs=3, callbacks=[callback])
    with open(callback.file_path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    header = lines[0].split()
    assert header == ["epoch", "accumulated_loss", "loss", "val_loss", "train_end_test_loss"]
    columns = [match.start() for match in re.finditer(r"\S+", lines[0])]
    for epoch, line in enumerate(lines[1:]):
        cells = line.split()
        assert cells[0] == str(epoch)
        for name, cell in zip(header[1:], cells[1:]):
            assert float(cell) == tl.train_history[name][0 if name == "train_end_test_loss" else epoch]
        starts = [match.start() for match in re.finditer(r"\S+", line)]
        assert starts == columns[:len(cells)]  # every cell starts under its header
    assert len(lines) == 4 and len(lines[1].split()) == 4 and len(lines[3].split()) == 5


def test_json_holds_the_history(tmp_path):
    tl = make_train_loop()
    tl.insert_metric_result_into_history("val_Accuracy", torch.tensor(0.75))
    callback = ModelTrainHistoryFileWriter(epoch_end=False, train_end=True, file_format="json", **folder_args(tmp_path))
    tl.fit(num_epochs=2, callbacks=[callback])
    with open(callback.file_path, encoding="utf-8") as handle:
        content = json.load(handle)
    expected = tl.train_history.get_train_history_dict()
    expected["val_Accuracy"] = [0.75]
    assert content == expected


def test_history_epochs_of_values_already_there():
    history = {"loss": [1.0, 2.0, 3.0], "test": [4.0]}
    epochs = HistoryEpochs()
    epochs.observe(history, epoch=2)
    assert epochs.epochs == {"loss": [0, 1, 2], "test": [2]}
    history["loss"].append(5.0)
    epochs.observe(history, epoch=3)
    assert epochs.epochs["loss"] == [0, 1, 2, 3]
    assert epochs.rows(history) == [(0, {"loss": 1.0}), (1, {"loss": 2.0}), (2, {"loss": 3.0, "test": 4.0}),
                                    (3, {"loss": 5.0})]


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
    assert os.path.isfile(os.path.join(tl.experiment_folder.results_dir, "train_history.txt"))
    assert os.path.isfile(os.path.join(tl.experiment_folder.plots_dir, "accumulated_loss.png"))


def test_explicit_arguments_matching_the_preset_reuse_its_folder(tmp_path):
    tl = make_train_loop(test=False)
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp", timestamp="2020-01-01_00-00-00")
    writer = ModelTrainHistoryFileWriter(**folder_args(tmp_path))
    tl.fit(num_epochs=1, callbacks=[writer])
    assert writer.experiment_folder is tl.experiment_folder


@pytest.mark.parametrize("callback_class", [ModelTrainHistoryPlot, ModelTrainHistoryFileWriter])
def test_no_folder_is_a_clear_error_at_registration(callback_class):
    with pytest.raises(ValueError, match="project_name, experiment_name and local_model_result_folder_path.*"
                                         "TrainLoopCheckpoint"):
        make_train_loop().fit(num_epochs=1, callbacks=[callback_class()])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(project_name="p", experiment_name="e"), ValueError, "local_model_result_folder_path"),
    (dict(project_name="p", experiment_name="a/b", local_model_result_folder_path="/tmp"), ValueError,
     "experiment_name"),
    (dict(epoch_end=False), ValueError, "never write"),
    (dict(epoch_end=1), TypeError, "epoch_end"),
    (dict(file_format="xlsx"), ValueError, "file_format"),
    (dict(cloud_save_mode="gcs"), ValueError, "cloud_save_mode"),
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
