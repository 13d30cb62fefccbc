"""Where the files go (issue 35, item 2): a plain TrainLoop's file-writing callbacks without experiment details write
into one default run folder, ``./aitoolbox_runs/run_<timestamp>/``, whose path is logged once when training starts
(as a preset's is); run folders hold only the sub-folders something was written into."""
import contextlib
import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.experiment_folder import DEFAULT_EXPERIMENT_NAME, DEFAULT_RUNS_FOLDER
from aitoolbox.torchtrain.callbacks import (
    CSVLogger, ModelCheckpoint, ModelTrainHistoryPlot, TensorboardFullTracking)
from aitoolbox.torchtrain.callbacks.abstract import (
    AbstractCallback, AbstractExperimentCallback, MissingExperimentDetailsError)
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run folder lies under the working directory


def loop_arguments():
    torch.manual_seed(0)
    model = MLP()
    return (model, DataLoader(classification_data(8), batch_size=4), DataLoader(classification_data(4, seed=3)),
            None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())


def make_loop(**kwargs):
    return TrainLoop(*loop_arguments(), show_progress=False, **kwargs)


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


def runs(tmp_path):
    root = tmp_path / DEFAULT_RUNS_FOLDER
    return sorted(name for name in os.listdir(root) if not name.startswith(".")) if root.exists() else []


def test_checkpoints_and_tensorboard_share_the_default_run_folder(tmp_path):
    tl = make_loop()
    checkpoint, tensorboard = ModelCheckpoint(), TensorboardFullTracking()
    with logged() as lines:
        tl.fit(num_epochs=2, callbacks=[checkpoint, tensorboard])
    (run,) = runs(tmp_path)
    assert run == f"{DEFAULT_EXPERIMENT_NAME}_{tl.experiment_timestamp}"
    run_path = tmp_path / DEFAULT_RUNS_FOLDER / run
    assert checkpoint.experiment_folder is tensorboard.experiment_folder
    assert checkpoint.experiment_folder.path == str(run_path)
    assert sorted(os.listdir(run_path / "checkpoint_model")) == [f"model_run_{tl.experiment_timestamp}_E0.pth",
                                                                 f"model_run_{tl.experiment_timestamp}_E1.pth"]
    assert os.listdir(run_path / "tensorboard")
    # Only what something was written into: no empty model/ or results/.
    assert sorted(name for name in os.listdir(run_path) if os.path.isdir(run_path / name)) == [
        "checkpoint_model", "tensorboard"]
    announced = [line for line in lines if line.startswith("Run folder: ")]
    assert announced == [f"Run folder: {run_path}"]
    with logged() as lines:
        tl.fit(num_epochs=3)
    assert not [line for line in lines if line.startswith("Run folder")]  # once: the first fit said it


@pytest.mark.slow
def test_lr_find_then_fit_writes_into_the_default_folder(tmp_path):
    """The issue's case: TensorboardFullTracking() failed with MissingExperimentDetailsError when fit started."""
    tl = make_loop()
    tl.lr_find(num_iterations=3)
    tl.fit(num_epochs=1, callbacks=[TensorboardFullTracking(), ModelTrainHistoryPlot(epoch_end=False, train_end=True)])
    (run,) = runs(tmp_path)
    assert sorted(os.listdir(tmp_path / DEFAULT_RUNS_FOLDER / run)) == ["results", "tensorboard"]


class InterruptFirstBatch(AbstractCallback):
    def __init__(self):
        super().__init__("interrupt the first batch")

    def on_batch_end(self):
        raise KeyboardInterrupt


def test_a_fit_interrupted_before_any_file_leaves_the_logged_folder_and_no_claim(tmp_path):
    """Review of issue 35, D9: the folder logged at train start exists, and no hidden claim marker is left alone."""
    tl = make_loop()
    with logged() as lines, pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[ModelCheckpoint(), InterruptFirstBatch()])
    (announced,) = [line for line in lines if line.startswith("Run folder: ")]
    run_path = announced[len("Run folder: "):]
    assert os.path.isdir(run_path)
    assert os.listdir(tmp_path / DEFAULT_RUNS_FOLDER) == [os.path.basename(run_path)]


def test_a_plain_loop_writing_nothing_creates_and_announces_nothing(tmp_path):
    with logged() as lines:
        make_loop().fit(num_epochs=1)
    assert not (tmp_path / DEFAULT_RUNS_FOLDER).exists()
    assert not [line for line in lines if line.startswith("Run folder")]


def test_two_loops_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    from aitoolbox.torchtrain.train_loop import train_loop as train_loop_module
    monkeypatch.setattr(train_loop_module, "timestamp_now", lambda: "2026-01-02_03-04-05")  # the same second
    first, second = make_loop(), make_loop()
    csv_first, csv_second = CSVLogger(), CSVLogger()
    first.fit(num_epochs=1, callbacks=[csv_first])
    second.fit(num_epochs=1, callbacks=[csv_second])
    assert runs(tmp_path) == ["run_2026-01-02_03-04-05", "run_2026-01-02_03-04-05_1"]
    assert second.experiment_timestamp == "2026-01-02_03-04-05_1"
    # Each logger wrote into its own run's folder (its path was derived when it was registered).
    assert csv_second.log_dir_path == str(tmp_path / DEFAULT_RUNS_FOLDER / "run_2026-01-02_03-04-05_1" / "csv_logs")
    assert os.listdir(csv_first.log_dir_path) and os.listdir(csv_second.log_dir_path)


def test_reading_the_run_folder_creates_nothing(tmp_path):
    tl = make_loop()
    assert tl.run_folder.path == str(tmp_path / DEFAULT_RUNS_FOLDER / f"run_{tl.experiment_timestamp}")
    assert not (tmp_path / DEFAULT_RUNS_FOLDER).exists()


def test_given_details_are_still_honoured_and_a_partial_set_is_an_error(tmp_path):
    checkpoint = ModelCheckpoint(project_name="p", experiment_name="e", local_model_result_folder_path="out")
    make_loop().fit(num_epochs=1, callbacks=[checkpoint])
    assert checkpoint.experiment_folder.path.startswith(str(tmp_path / "out" / "p" / "e_"))
    assert not (tmp_path / DEFAULT_RUNS_FOLDER).exists()
    with pytest.raises(MissingExperimentDetailsError, match=r"pass all three.*or none of them, for the default "
                                                            rf"run folder \./{DEFAULT_RUNS_FOLDER}/run_<timestamp>"):
        make_loop().fit(num_epochs=1, callbacks=[ModelCheckpoint(project_name="p")])


def test_a_1x_callback_inferring_the_details_gets_the_default_run_folder(tmp_path):
    tl = make_loop()
    callback = AbstractExperimentCallback("1.x style")
    tl.callbacks_handler.register_callbacks([callback])
    callback.try_infer_experiment_details(infer_cloud_details=False)
    assert (callback.project_name, callback.experiment_name) == (DEFAULT_RUNS_FOLDER, DEFAULT_EXPERIMENT_NAME)
    assert callback.local_model_result_folder_path == str(tmp_path)
    assert callback.experiment_folder.path == str(tmp_path / DEFAULT_RUNS_FOLDER / f"run_{tl.experiment_timestamp}")


def test_a_preset_announces_its_folder_when_training_starts_and_creates_no_empty_sub_folders(tmp_path):
    with logged() as lines:
        tl = TrainLoopCheckpoint(*loop_arguments(), project_name="p", experiment_name="e",
                                 local_model_result_folder_path=str(tmp_path / "runs"), show_progress=False)
        assert not [line for line in lines if "folder" in line.lower()]  # not at construction
        tl.fit(num_epochs=1)
    assert [line for line in lines if line.startswith("Run folder: ")] == [f"Run folder: {tl.experiment_folder.path}"]
    assert sorted(name for name in os.listdir(tl.experiment_folder.path)
                  if os.path.isdir(os.path.join(tl.experiment_folder.path, name))) == ["checkpoint_model"]


def test_a_working_directory_that_cannot_hold_the_runs_folder_is_named_with_the_arguments(tmp_path):
    """Review of issue 35, friction 9: the error names the working directory and the three arguments that choose
    another folder, not local_model_result_folder_path, which the user never passed."""
    (tmp_path / DEFAULT_RUNS_FOLDER).write_text("a file where the runs folder goes")
    tl = make_loop()
    with pytest.raises(NotADirectoryError) as raised:
        tl.fit(num_epochs=1, callbacks=[ModelCheckpoint()])
    message = str(raised.value)
    assert f"the working directory {str(tmp_path)!r} cannot hold {DEFAULT_RUNS_FOLDER}/" in message
    assert "project_name, experiment_name and local_model_result_folder_path" in message
    assert "local_model_result_folder_path=" not in message
    assert tl.iterations_done == 0
