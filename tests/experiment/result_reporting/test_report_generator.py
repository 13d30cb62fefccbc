"""Report generators: history plots (PNG / PDF), per-epoch result tables, gradient histograms."""
import csv
import os
import sys

import numpy as np
import pytest

from aitoolbox.experiment.result_reporting.report_generator import (GradientPlotter, TrainingHistoryPlotter,
                                                                    TrainingHistoryWriter)
from aitoolbox.experiment.training_history import TrainingHistory

matplotlib = pytest.importorskip("matplotlib")


def _history():
    return TrainingHistory().wrap_pre_prepared_history({
        "loss": [1.0, 0.6, float("nan"), 0.4], "accumulated_loss": [], "val_loss": [0.9],
        "val_f1": [{"cat": 0.1, "dog": 0.2}, {"cat": 0.3, "dog": 0.4}], "notes": ["a", "b"]})


# --- TrainingHistoryPlotter -------------------------------------------------------------------------------
def test_png_report_plots_numeric_metrics_with_several_values(tmp_path):
    pyplot_loaded = "matplotlib.pyplot" in sys.modules
    saved = TrainingHistoryPlotter(str(tmp_path)).generate_report(_history())
    assert saved == [[os.path.join("plots", f"{name}.png"), os.path.join(tmp_path, "plots", f"{name}.png")]
                     for name in ("loss", "val_f1_cat", "val_f1_dog")]
    for _, path in saved:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded  # figures are not made through pyplot


def test_pdf_report_is_one_file_named_after_the_folder_name(tmp_path):
    saved = TrainingHistoryPlotter(str(tmp_path)).generate_report({"loss": [3, 2, 1]}, "curves", file_format="pdf")
    assert saved == [["curves.pdf", os.path.join(tmp_path, "curves.pdf")]]
    with open(saved[0][1], "rb") as f:
        assert f.read(5) == b"%PDF-"
    with pytest.raises(ValueError, match="'png' or 'pdf'"):
        TrainingHistoryPlotter(str(tmp_path)).generate_report({"loss": [3, 2]}, file_format="svg")


def test_performance_curve_subtitles_name_the_extremes_ignoring_nan():
    figure = TrainingHistoryPlotter.plot_performance_curve("loss", [1.0, float("nan"), 0.25, 0.5])
    texts = [text.get_text() for text in figure.axes[0].texts]
    assert texts == ["loss", "Max result: 1.0 loss (at epoch 1)", "Min result: 0.25 loss (at epoch 3)"]


def test_performance_curve_axis_counts_epochs_as_its_title():
    """Review of issue 35, D11: the title's epoch is where the point sits on the Epoch axis (both from 1)."""
    figure = TrainingHistoryPlotter.plot_performance_curve("val_Accuracy", [0.5, 0.9, 0.7])
    (line,) = figure.axes[0].lines
    assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata()) == [0.5, 0.9, 0.7]
    assert "Max result: 0.9 val_Accuracy (at epoch 2)" in [text.get_text() for text in figure.axes[0].texts]


# --- TrainingHistoryWriter --------------------------------------------------------------------------------
def _read(path):
    with open(path) as f:
        return f.read()


def test_txt_report_appends_a_block_per_epoch(tmp_path):
    history = TrainingHistory(has_validation=False)
    history.insert_single_result_into_history("loss", 0.5)
    writer = TrainingHistoryWriter(str(tmp_path))
    rel_path, path = writer.generate_report(history, epoch=0, file_name="results.txt", results_folder_name="res")
    assert (rel_path, path) == (os.path.join("res", "results.txt"), os.path.join(tmp_path, "res", "results.txt"))
    history.insert_single_result_into_history("loss", 0.25)
    history.insert_single_result_into_history("val_f1", {"cat": 0.7})
    writer.generate_report(history, epoch=1, file_name="results.txt", results_folder_name="res")
    rule = "=" * 28
    assert _read(path) == (f"{rule}\nEpoch: 0\n{rule}\nloss:\t0.5\n\n\n"
                           f"{rule}\nEpoch: 1\n{rule}\nloss:\t0.25\nval_f1_cat:\t0.7\n\n\n")


@pytest.mark.parametrize("file_format, delimiter", [("tsv", "\t"), ("csv", ",")])
def test_table_report_restates_the_header_when_metrics_change(tmp_path, file_format, delimiter):
    history = TrainingHistory(has_validation=False)
    writer = TrainingHistoryWriter(None)
    writer.experiment_results_local_path = str(tmp_path)  # set late, as the writing callback does
    for epoch, (loss, extra) in enumerate([(0.5, None), (0.4, None), (0.3, 9)]):
        history.insert_single_result_into_history("loss", loss)
        if extra is not None:
            history.insert_single_result_into_history("acc", extra)
        rel_path, path = writer.generate_report(history, epoch, f"results.{file_format}", file_format=file_format)
    assert rel_path == f"results.{file_format}" and path == os.path.join(tmp_path, f"results.{file_format}")
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter=delimiter))
    assert rows == [["Epoch", "loss"], ["0", "0.5"], ["1", "0.4"],
                    ["NEW_METRICS_DETECTED"], ["Epoch", "loss", "acc"], ["2", "0.3", "9"]]


def test_writer_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="'txt', 'tsv' or 'csv'"):
        TrainingHistoryWriter(str(tmp_path)).generate_report({"loss": [1]}, 0, "r.json", file_format="json")
    with pytest.raises(ValueError, match="experiment_results_local_path"):
        TrainingHistoryWriter(None).generate_report({"loss": [1]}, 0, "r.txt")


# --- GradientPlotter --------------------------------------------------------------------------------------
def test_gradient_plots_skip_layers_without_gradients(tmp_path):
    gradients = [np.random.default_rng(0).normal(size=500), None, [0.1, -0.2, 0.3]]
    saved = GradientPlotter(str(tmp_path)).generate_report(gradients, "epoch_3")
    assert [rel for rel, _ in saved] == [os.path.join("epoch_3", "layer_0.png"), os.path.join("epoch_3", "layer_2.png")]
    assert all(os.path.getsize(path) > 0 for _, path in saved)
    pdf = GradientPlotter(str(tmp_path)).generate_report(gradients, "epoch_3", file_format="pdf")
    assert pdf == [["epoch_3.pdf", os.path.join(tmp_path, "epoch_3.pdf")]]


def test_gradient_distribution_titles():
    figure = GradientPlotter.plot_gradient_distribution(np.array([1.0, 3.0]), "fc1")
    texts = [text.get_text() for text in figure.axes[0].texts]
    assert texts == ["Gradient distribution for layer fc1", "Mean: 2.0", "Std: 1.0"]
    names = [name for name, _ in GradientPlotter.generate_dist_plots([[1.0], [2.0]], layer_names=["a", "b"])]
    assert names == ["a", "b"]
