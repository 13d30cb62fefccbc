import json
import logging
import os
import re
import sys

import numpy as np
import pytest
import torch

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.local_results_save import (
    BaseLocalResultsSaver, LocalResultsSaver, json_ready, plot_training_history)
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.experiment.training_history import TrainingHistory


@pytest.fixture
def log(caplog, monkeypatch):
    """The package's log records (the aitoolbox logger does not propagate to the root by default)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def warnings_of(log):
    return [record.getMessage() for record in log.records if record.levelno == logging.WARNING]


def evaluated_package():
    package = ClassificationResultPackage()
    package.prepare_result_package(np.array([0, 1, 1, 0]), np.array([0, 1, 0, 0]),
                                   hyperparameters={"lr": 0.01, "layers": (2, 3)})
    return package


class PackageWithExtraFiles(AbstractResultPackage):
    def __init__(self, extra):
        super().__init__("extra")
        self.extra = extra

    def prepare_results_dict(self):
        return {"score": np.float32(0.5)}

    def list_additional_results_dump_paths(self):
        return self.extra


def read_json(path):
    with open(path) as handle:
        return json.load(handle)


def test_json_ready_turns_arrays_tensors_and_odd_keys_into_plain_json():
    value = {"array": np.arange(3), "scalar": np.float64(0.25), "tensor": torch.tensor([[1.0, 2.0]]),
             "tensor_scalar": torch.tensor(3), (1, 2): "tuple key", 7: {"nested": (1, np.int64(2))},
             "set": {4}, "none": None, "flag": True, "object": object}
    ready = json_ready(value)
    assert ready["array"] == [0, 1, 2] and ready["scalar"] == 0.25 and ready["tensor"] == [[1.0, 2.0]]
    assert ready["tensor_scalar"] == 3 and ready["(1, 2)"] == "tuple key" and ready["7"] == {"nested": [1, 2]}
    assert ready["set"] == [4] and ready["none"] is None and ready["flag"] is True
    assert ready["object"] == str(object)
    json.dumps(ready, sort_keys=True)  # every key a string: sorting works too


def test_results_folder_is_created_inside_the_run_folder(tmp_path):
    saver = BaseLocalResultsSaver(str(tmp_path))
    path = saver.create_experiment_local_folder_structure("proj", "exp", "ts")
    assert path == str(tmp_path / "proj" / "exp_ts" / "results") and os.path.isdir(path)
    assert BaseLocalResultsSaver.get_experiment_local_results_folder_paths("proj", "exp", "ts", str(tmp_path)) == (
        str(tmp_path / "proj"), str(tmp_path / "proj" / "exp_ts"), path)


def test_default_format_is_json_and_pickle_is_read_as_json_with_a_warning(tmp_path, log):
    assert LocalResultsSaver(str(tmp_path)).file_format == "json"
    assert not warnings_of(log)
    saver = LocalResultsSaver(str(tmp_path), file_format="pickle")
    assert saver.file_format == "pickle"
    assert any("JSON" in message for message in warnings_of(log))
    name, path = saver.save_file({"acc": 1}, "dump", str(tmp_path / "dump"))
    assert (name, path) == ("dump.json", str(tmp_path / "dump.json"))
    assert read_json(path) == {"acc": 1}


def test_an_unknown_format_falls_back_as_in_aitoolbox_1_and_still_writes_json(tmp_path, log):
    saver = BaseLocalResultsSaver(str(tmp_path), file_format="my_fancy_format")
    assert saver.file_format == "pickle"
    assert any("my_fancy_format" in message for message in warnings_of(log))
    assert saver.save_file({"a": 1}, "dump", str(tmp_path / "dump"))[0] == "dump.json"
    saver.file_format = "yaml"
    with pytest.raises(ValueError, match="'yaml'"):
        saver.save_file({"a": 1}, "dump", str(tmp_path / "dump"))


@pytest.mark.parametrize("labels", [False, True])
def test_single_file_holds_results_hyperparameters_history_and_optionally_labels(tmp_path, labels):
    package = evaluated_package()
    history = TrainingHistory().wrap_pre_prepared_history({"loss": [0.5], "val_loss": [0.6]})
    saved = LocalResultsSaver(str(tmp_path)).save_experiment_results(
        package, history, "proj", "exp", "ts", save_true_pred_labels=labels)
    results_dir = str(tmp_path / "proj" / "exp_ts" / "results")
    name = "results_hyperParams_hist_exp_ts.json"
    assert saved == [[name, os.path.join(results_dir, name)]]
    content = read_json(saved[0][1])
    assert content["experiment_name"] == "exp" and content["experiment_results_local_path"] == results_dir
    assert content["results"] == package.get_results() and content["results"]["Accuracy"] == 0.75
    assert content["hyperparameters"] == {"lr": 0.01, "layers": [2, 3]}
    assert content["training_history"] == {"loss": [0.5], "val_loss": [0.6]}
    assert ("y_true" in content) is labels and ("y_predicted" in content) is labels
    if labels:
        assert content["y_true"] == [0, 1, 1, 0] and content["y_predicted"] == [0, 1, 0, 0]
    assert not [entry for entry in os.listdir(results_dir) if entry.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("labels", [False, True])
def test_separate_files_hold_one_part_each(tmp_path, labels):
    package = evaluated_package()
    saved = LocalResultsSaver(str(tmp_path)).save_experiment_results_separate_files(
        package, {"loss": [0.5]}, "proj", "exp", "ts", save_true_pred_labels=labels)
    prefixes = ["results", "hyperparams", "train_history"] + (["true_pred_labels"] if labels else [])
    assert [name for name, _ in saved] == [f"{prefix}_exp_ts.json" for prefix in prefixes]
    contents = [read_json(path) for _, path in saved]
    assert contents[0]["results"] == package.get_results() and "hyperparameters" not in contents[0]
    assert contents[1]["hyperparameters"]["lr"] == 0.01 and contents[1]["experiment_name"] == "exp"
    assert contents[2]["training_history"] == {"loss": [0.5]}
    if labels:
        assert contents[3] == {"y_true": [0, 1, 1, 0], "y_predicted": [0, 1, 0, 0]}


def test_without_a_timestamp_the_current_time_names_the_run(tmp_path):
    saved = LocalResultsSaver(str(tmp_path)).save_experiment_results(evaluated_package(), {}, "proj", "exp")
    assert re.fullmatch(r"results_hyperParams_hist_exp_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.json", saved[0][0])


@pytest.mark.parametrize("separate", [False, True])
def test_extra_files_then_plots_follow_the_results_files(tmp_path, separate):
    extra = [["notes.txt", str(tmp_path / "notes.txt")]]
    history = TrainingHistory().wrap_pre_prepared_history(
        {"loss": [0.9, 0.5, 0.4], "val_loss": [1.0], "val_f1": [{"a": 0.1, "b": 0.2}, {"a": 0.3, "b": 0.4}]})
    saver = LocalResultsSaver(str(tmp_path))
    save = saver.save_experiment_results_separate_files if separate else saver.save_experiment_results
    package = PackageWithExtraFiles(extra).prepare_result_package([1], [1], hyperparameters={})
    saved = save(package, history, "proj", "exp", "ts")
    results_files = 3 if separate else 1
    assert saved[results_files:results_files + 1] == extra
    plots = saved[results_files + 1:]
    plots_dir = str(tmp_path / "proj" / "exp_ts" / "results" / "plots")
    # val_loss has one value only: nothing to plot; dict-valued metrics are plotted per key.
    assert plots == [[os.path.join("plots", f"{name}.png"), os.path.join(plots_dir, f"{name}.png")]
                     for name in ("loss", "val_f1_a", "val_f1_b")]
    for _, path in plots:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    assert read_json(saved[0][1])["results"] == {"score": 0.5}


def test_plots_are_skipped_with_a_warning_without_matplotlib(tmp_path, log, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    assert plot_training_history({"loss": [1.0, 0.5]}, str(tmp_path)) == []
    assert any("pip install matplotlib" in message for message in warnings_of(log))


def test_plot_axis_counts_epochs_as_its_title(tmp_path, monkeypatch):
    """Review of issue 35, D11: the title's epoch is where the point sits on the Epoch axis (both from 1)."""
    from matplotlib.figure import Figure
    drawn, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: (drawn.append(figure),
                                                                             savefig(figure, *args, **kwargs)))
    plot_training_history({"val_loss": [0.9, 0.4, 0.6]}, str(tmp_path))
    (axes,) = drawn[0].axes
    assert list(axes.lines[0].get_xdata()) == [1, 2, 3]
    assert axes.get_title() == "val_loss\nmax 0.9 (epoch 1), min 0.4 (epoch 2)"


def test_metric_names_with_path_separators_become_safe_file_names(tmp_path):
    plots = plot_training_history({"val/loss": [1.0, float("nan"), 0.5]}, str(tmp_path))
    assert plots == [[os.path.join("plots", "val_loss.png"), str(tmp_path / "plots" / "val_loss.png")]]


def test_saving_twice_into_one_run_keeps_the_folder_and_replaces_the_file(tmp_path):
    saver = LocalResultsSaver(str(tmp_path))
    first = saver.save_experiment_results(evaluated_package(), {}, "proj", "exp", "ts")[0][1]
    other = os.path.join(os.path.dirname(first), "other.txt")
    open(other, "w").close()
    second = saver.save_experiment_results(evaluated_package(), {"loss": [1.0]}, "proj", "exp", "ts")[0][1]
    assert first == second and os.path.exists(other)
    assert read_json(second)["training_history"] == {"loss": [1.0]}


@pytest.mark.parametrize("separate", [False, True])
def test_secrets_in_the_hyperparameters_are_redacted_in_the_files(tmp_path, separate):
    package = ClassificationResultPackage()
    hyperparameters = {"lr": 0.01, "hf_token": "hf_s3cr3t_v4lue", "db": {"password": "pw-71x"}}
    package.prepare_result_package(np.array([0, 1]), np.array([0, 1]), hyperparameters=hyperparameters)
    saver = LocalResultsSaver(str(tmp_path))
    save = saver.save_experiment_results_separate_files if separate else saver.save_experiment_results
    saved = save(package, {"loss": [0.5]}, "proj", "exp", "ts")
    written = [open(path, encoding="utf-8").read() for _, path in saved]
    assert not [text for text in written if "hf_s3cr3t_v4lue" in text or "pw-71x" in text]
    [content] = [read_json(path) for _, path in saved if "hyperparameters" in read_json(path)]
    assert content["hyperparameters"] == {"lr": 0.01, "hf_token": "<redacted>", "db": {"password": "<redacted>"}}
    assert package.get_hyperparameters()["hf_token"] == "hf_s3cr3t_v4lue"  # the package keeps them
