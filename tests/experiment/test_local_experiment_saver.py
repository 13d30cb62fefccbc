import json
import os
import re

import numpy as np
import pytest
import torch

from aitoolbox.experiment.experiment_saver import AbstractExperimentSaver
from aitoolbox.experiment.local_experiment_saver import (
    BaseFullExperimentLocalSaver, FullKerasExperimentLocalSaver, FullPyTorchExperimentLocalSaver)
from aitoolbox.experiment.local_save.local_model_save import KerasLocalModelSaver, PyTorchLocalModelSaver
from aitoolbox.experiment.local_save.local_results_save import LocalResultsSaver
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.experiment.training_history import TrainingHistory


def package():
    return ClassificationResultPackage().prepare_result_package(np.array([1, 0]), np.array([1, 1]),
                                                                hyperparameters={"lr": 0.1})


def checkpoint():
    model = torch.nn.Linear(2, 1)
    return {"model_state_dict": model.state_dict(), "optimizer_state_dict": None, "epoch": 5, "hyperparams": {}}


class FakeKerasModel:
    """Stands in for a keras.Model (Keras is not a dependency): the saver only calls save(path)."""

    def save(self, path):
        with open(path, "wb") as handle:
            handle.write(b"h5")


def test_savers_are_built_from_a_local_model_saver_and_a_results_saver(tmp_path):
    pytorch = FullPyTorchExperimentLocalSaver("proj", "exp", str(tmp_path))
    keras = FullKerasExperimentLocalSaver("proj", "exp", str(tmp_path))
    for saver, model_saver in ((pytorch, PyTorchLocalModelSaver), (keras, KerasLocalModelSaver)):
        assert isinstance(saver, AbstractExperimentSaver) and isinstance(saver, BaseFullExperimentLocalSaver)
        assert type(saver.model_saver) is model_saver and type(saver.results_saver) is LocalResultsSaver
        assert saver.results_saver.file_format == "json"


def test_a_model_saver_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="AbstractLocalModelSaver"):
        BaseFullExperimentLocalSaver(object(), "proj", "exp")


@pytest.mark.parametrize("separate, labels, prefixes", [
    (False, False, ["results_hyperParams_hist"]),
    (False, True, ["results_hyperParams_hist"]),
    (True, False, ["results", "hyperparams", "train_history"]),
    (True, True, ["results", "hyperparams", "train_history", "true_pred_labels"]),
])
def test_pytorch_experiment_is_saved_as_final_model_and_json_results(tmp_path, separate, labels, prefixes):
    saver = FullPyTorchExperimentLocalSaver("proj", "exp", str(tmp_path))
    history = TrainingHistory().wrap_pre_prepared_history({"loss": [0.4]})
    paths = saver.save_experiment(checkpoint(), package(), history, "ts", save_true_pred_labels=labels,
                                  separate_files=separate)
    run = tmp_path / "proj" / "exp_ts"
    assert paths == [str(run / "model" / "model_exp_ts.pth")] + \
        [str(run / "results" / f"{prefix}_exp_ts.json") for prefix in prefixes]
    assert torch.load(paths[0], weights_only=True)["epoch"] == 5
    with open(paths[1]) as handle:
        assert json.load(handle)["results"] == package().get_results()


def test_without_a_timestamp_model_and_results_share_the_current_one(tmp_path):
    paths = FullPyTorchExperimentLocalSaver("proj", "exp", str(tmp_path)).save_experiment(
        checkpoint(), package(), {"loss": [1.0]})
    stamp = re.search(r"model_exp_(.+)\.pth$", paths[0]).group(1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", stamp)
    assert os.path.basename(paths[1]) == f"results_hyperParams_hist_exp_{stamp}.json"


def test_plots_are_listed_after_the_results(tmp_path):
    paths = FullPyTorchExperimentLocalSaver("proj", "exp", str(tmp_path)).save_experiment(
        checkpoint(), package(), {"loss": [1.0, 0.5]}, "ts")
    assert paths[2:] == [str(tmp_path / "proj" / "exp_ts" / "results" / "plots" / "loss.png")]


def test_keras_experiment_is_saved_as_h5_model_and_json_results(tmp_path):
    paths = FullKerasExperimentLocalSaver("proj", "exp", str(tmp_path)).save_experiment(
        FakeKerasModel(), package(), {}, "ts")
    assert [os.path.basename(path) for path in paths] == ["model_exp_ts.h5", "results_hyperParams_hist_exp_ts.json"]


def test_star_import_gives_what_aitoolbox_1_modules_gave():
    namespace = {}
    exec("from aitoolbox.experiment.local_experiment_saver import *", namespace)
    for name in ("datetime", "time", "FullPyTorchExperimentLocalSaver", "PyTorchLocalModelSaver", "LocalResultsSaver"):
        assert name in namespace
