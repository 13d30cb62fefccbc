import logging
import os
import re

import pytest
import torch

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.local_model_save import (
    AbstractLocalModelSaver, BaseLocalModelSaver, KerasLocalModelSaver, LocalSubOptimalModelRemover,
    PyTorchLocalModelSaver, model_file_name)


@pytest.fixture
def log(caplog, monkeypatch):
    """The package's log records (the aitoolbox logger does not propagate to the root by default)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def checkpoint(**extra):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
            "schedulers_state_dict": [], "epoch": 4, "iteration_idx": 40, "hyperparams": {"lr": 0.1}, **extra}


def no_temporary_files(folder):
    return not [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("epoch, iteration_idx, expected", [
    (None, None, "model_exp_ts.pth"),
    (None, 7, "model_exp_ts.pth"),
    (3, None, "model_exp_ts_E3.pth"),
    (3, 77, "model_exp_ts_E3_ITER77.pth"),
    (0, 0, "model_exp_ts_E0_ITER0.pth"),
])
def test_model_file_names_are_those_of_aitoolbox_1(epoch, iteration_idx, expected):
    assert model_file_name("exp", "ts", epoch, iteration_idx) == expected
    assert model_file_name("exp", "ts", epoch, iteration_idx, ".h5") == expected.replace(".pth", ".h5")


@pytest.mark.parametrize("checkpoint_model, folder", [(True, "checkpoint_model"), (False, "model")])
def test_models_folder_is_created_inside_the_run_folder(tmp_path, checkpoint_model, folder):
    saver = BaseLocalModelSaver(str(tmp_path), checkpoint_model=checkpoint_model)
    path = saver.create_experiment_local_models_folder("proj", "exp", "ts")
    assert path == str(tmp_path / "proj" / "exp_ts" / folder)
    assert os.path.isdir(path)


def test_pytorch_saver_writes_the_whole_dict_loadable_with_weights_only(tmp_path):
    saver = PyTorchLocalModelSaver(str(tmp_path), checkpoint_model=True)
    saved = checkpoint(format_version=2, rng={"torch": torch.get_rng_state()})
    name, path = saver.save_model(saved, "proj", "exp", "ts", epoch=4)
    assert name == "model_exp_ts_E4.pth"
    assert path == str(tmp_path / "proj" / "exp_ts" / "checkpoint_model" / name)
    loaded = torch.load(path, weights_only=True)
    assert sorted(loaded) == sorted(saved)
    assert torch.equal(loaded["model_state_dict"]["weight"], saved["model_state_dict"]["weight"])
    assert loaded["format_version"] == 2 and loaded["iteration_idx"] == 40
    assert no_temporary_files(os.path.dirname(path))


def test_pytorch_saver_names_iteration_checkpoints_and_final_models(tmp_path):
    checkpoints = PyTorchLocalModelSaver(str(tmp_path), checkpoint_model=True)
    final = PyTorchLocalModelSaver(str(tmp_path))
    assert checkpoints.save_model(checkpoint(), "proj", "exp", "ts", epoch=2, iteration_idx=25)[0] == \
        "model_exp_ts_E2_ITER25.pth"
    name, path = final.save_model(checkpoint(), "proj", "exp", "ts")
    assert name == "model_exp_ts.pth"
    assert os.path.dirname(path).endswith(os.path.join("exp_ts", "model"))


def test_pytorch_saver_uses_the_current_time_without_a_timestamp(tmp_path):
    name, path = PyTorchLocalModelSaver(str(tmp_path)).save_model(checkpoint(), "proj", "exp", epoch=1)
    assert re.fullmatch(r"model_exp_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_E1\.pth", name)
    assert os.path.isfile(path)


def test_pytorch_saver_keeps_an_existing_folder_and_its_files(tmp_path):
    saver = PyTorchLocalModelSaver(str(tmp_path), checkpoint_model=True)
    _, first = saver.save_model(checkpoint(), "proj", "exp", "ts", epoch=1)
    for protect in (True, False):
        saver.save_model(checkpoint(), "proj", "exp", "ts", epoch=2, protect_existing_folder=protect)
    assert os.path.isfile(first)
    assert sorted(os.listdir(os.path.dirname(first))) == ["model_exp_ts_E1.pth", "model_exp_ts_E2.pth"]


@pytest.mark.parametrize("missing", ["model_state_dict", "optimizer_state_dict", "epoch", "hyperparams"])
def test_pytorch_saver_refuses_a_dict_without_a_required_entry(tmp_path, missing):
    incomplete = {key: value for key, value in checkpoint().items() if key != missing}
    saver = PyTorchLocalModelSaver(str(tmp_path))
    with pytest.raises(ValueError, match=missing):
        saver.save_model(incomplete, "proj", "exp", "ts", epoch=1)
    assert not (tmp_path / "proj").exists()  # checked before anything is created


def test_pytorch_saver_refuses_a_model_instead_of_a_dict(tmp_path):
    with pytest.raises(ValueError, match="checkpoint dict"):
        PyTorchLocalModelSaver(str(tmp_path)).save_model(torch.nn.Linear(2, 2), "proj", "exp", "ts")


def test_a_failed_save_keeps_the_previous_file_and_leaves_no_partial_one(tmp_path):
    saver = PyTorchLocalModelSaver(str(tmp_path))
    _, path = saver.save_model(checkpoint(), "proj", "exp", "ts")
    before = open(path, "rb").read()
    with pytest.raises(Exception):
        saver.save_model(checkpoint(unpicklable=lambda: None), "proj", "exp", "ts")
    assert open(path, "rb").read() == before
    assert no_temporary_files(os.path.dirname(path))


class FakeKerasModel:
    """Stands in for a keras.Model: Keras is not a dependency; its save(path) is all the saver uses."""

    def __init__(self, fail=False):
        self.fail = fail

    def save(self, path):
        assert path.endswith(".h5")  # Keras chooses the format by the extension
        with open(path, "wb") as handle:
            handle.write(b"HDF5 model")
            if self.fail:
                raise OSError("disk full")


def test_keras_saver_writes_an_h5_file_through_model_save(tmp_path):
    saver = KerasLocalModelSaver(str(tmp_path), checkpoint_model=True)
    assert isinstance(saver, AbstractLocalModelSaver) and isinstance(saver, BaseLocalModelSaver)
    name, path = saver.save_model(FakeKerasModel(), "proj", "exp", "ts", epoch=3)
    assert name == "model_exp_ts_E3.h5"
    assert path == str(tmp_path / "proj" / "exp_ts" / "checkpoint_model" / name)
    assert open(path, "rb").read() == b"HDF5 model"
    assert no_temporary_files(os.path.dirname(path))


def test_keras_saver_leaves_nothing_when_model_save_fails(tmp_path):
    saver = KerasLocalModelSaver(str(tmp_path))
    with pytest.raises(OSError, match="disk full"):
        saver.save_model(FakeKerasModel(fail=True), "proj", "exp", "ts")
    assert os.listdir(tmp_path / "proj" / "exp_ts" / "model") == []


def test_keras_saver_refuses_objects_without_save(tmp_path):
    with pytest.raises(TypeError, match="PyTorchLocalModelSaver"):
        KerasLocalModelSaver(str(tmp_path)).save_model(checkpoint(), "proj", "exp", "ts")


def saved_files(tmp_path, count):
    paths = []
    for index in range(count):
        path = tmp_path / f"model_{index}.pth"
        path.write_bytes(b"x")
        paths.append(str(path))
    return paths


def test_remover_keeps_the_lowest_loss_models_and_deletes_the_others(tmp_path):
    remover = LocalSubOptimalModelRemover("val_loss", num_best_kept=2)
    assert remover.decrease_metric and remover.is_default_metric
    paths = saved_files(tmp_path, 4)
    history = {"val_loss": []}
    for path, value in zip(paths, [0.5, 0.3, 0.4, 0.1]):
        history["val_loss"].append(value)
        remover.decide_if_remove_suboptimal_model(history, [path])
    assert [os.path.exists(path) for path in paths] == [False, True, False, True]
    assert remover.model_save_history == [([paths[3]], 0.1), ([paths[1]], 0.3)]


def test_remover_ranks_other_metrics_by_the_value_computed_after_the_save(tmp_path):
    # A callback metric is computed after the model of the epoch is saved: the paths wait one call.
    remover = LocalSubOptimalModelRemover("val_accuracy", num_best_kept=1)
    assert not remover.decrease_metric and not remover.is_default_metric
    paths = saved_files(tmp_path, 3)
    history = {"val_accuracy": []}
    remover.decide_if_remove_suboptimal_model(history, [paths[0]])
    history["val_accuracy"].append(0.9)
    remover.decide_if_remove_suboptimal_model(history, [paths[1]])
    history["val_accuracy"].append(0.6)
    remover.decide_if_remove_suboptimal_model(history, [paths[2]])
    assert remover.model_save_history == [([paths[0]], 0.9)]
    assert remover.non_default_metric_buffer == [paths[2]]
    assert [os.path.exists(path) for path in paths] == [True, False, True]


def test_remover_warns_when_the_metric_is_not_tracked(log):
    remover = LocalSubOptimalModelRemover("val_f1")
    remover.decide_if_remove_suboptimal_model({"loss": [1.0]}, ["a.pth"])
    remover.decide_if_remove_suboptimal_model({"loss": [1.0, 0.5]}, ["b.pth"])
    assert any("val_f1" in record.getMessage() for record in log.records if record.levelno == logging.WARNING)
    assert remover.model_save_history == []


def test_star_import_gives_what_aitoolbox_1_modules_gave():
    namespace = {}
    exec("from aitoolbox.experiment.local_save.local_model_save import *", namespace)
    for name in ("os", "time", "datetime", "ExperimentFolder", "PyTorchLocalModelSaver"):
        assert name in namespace
