"""A plain TrainLoop continued from a checkpoint can write into the run folder that holds it (issue 35 review,
friction 5: a resumed run always went to a new default run folder, and the docs said nothing), never overwriting
what that run wrote after the checkpoint."""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks import ModelCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data


def make_loop():
    torch.manual_seed(0)
    model = MLP()
    return TrainLoop(model, DataLoader(classification_data(16), batch_size=8),
                     DataLoader(classification_data(8, seed=3), batch_size=8), None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)


def run_folders(root):
    return sorted(name for name in os.listdir(root / "aitoolbox_runs") if not name.startswith("."))


def checkpoint_epochs(folder):
    return sorted(name.rsplit("_E", 1)[1] for name in os.listdir(os.path.join(folder, "checkpoint_model"))
                  if name.endswith(".pth"))


def test_continued_in_the_same_folder_and_equal_to_the_straight_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = make_loop()
    first.fit(num_epochs=2, callbacks=[ModelCheckpoint()])
    (name,) = run_folders(tmp_path)
    folder = str(tmp_path / "aitoolbox_runs" / name)

    continued = make_loop()
    continued.load_checkpoint(folder, continue_run_folder=True)
    assert continued.run_folder.path == folder
    continued.fit(num_epochs=4, callbacks=[ModelCheckpoint()])
    assert run_folders(tmp_path) == [name]  # no second folder
    assert checkpoint_epochs(folder) == ["0.pth", "1.pth", "2.pth", "3.pth"]

    straight = make_loop()
    monkeypatch.chdir(tmp_path / "aitoolbox_runs")  # its own folder, elsewhere
    straight.fit(num_epochs=4)
    for ours, theirs in zip(continued.model.state_dict().values(), straight.model.state_dict().values()):
        assert torch.equal(ours, theirs)


def test_an_earlier_checkpoint_whose_later_ones_would_be_overwritten_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_loop().fit(num_epochs=2, callbacks=[ModelCheckpoint()])
    (name,) = run_folders(tmp_path)
    checkpoint_dir = tmp_path / "aitoolbox_runs" / name / "checkpoint_model"
    (first_epoch,) = [entry for entry in os.listdir(checkpoint_dir) if entry.endswith("_E0.pth")]
    before = sorted(os.listdir(checkpoint_dir))
    loop = make_loop()
    with pytest.raises(ValueError, match=r"holds checkpoints written after the one loaded \(model_run_.*_E1\.pth\)"):
        loop.load_checkpoint(str(checkpoint_dir / first_epoch), continue_run_folder=True)
    assert sorted(os.listdir(checkpoint_dir)) == before
    loop.load_checkpoint(str(checkpoint_dir / first_epoch))  # into a new run folder: allowed
    loop.fit(num_epochs=2, callbacks=[ModelCheckpoint()])
    assert len(run_folders(tmp_path)) == 2 and sorted(os.listdir(checkpoint_dir)) == before


def test_a_finished_runs_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_loop().fit(num_epochs=1, callbacks=[ModelCheckpoint(), ModelTrainEndSave()])
    (name,) = run_folders(tmp_path)
    with pytest.raises(ValueError, match="holds the final model of a finished run"):
        make_loop().load_checkpoint(str(tmp_path / "aitoolbox_runs" / name), continue_run_folder=True)


def test_a_checkpoint_outside_a_run_folder_a_used_loop_and_a_preset_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loop = make_loop()
    loop.fit(num_epochs=1, callbacks=[ModelCheckpoint()])
    (name,) = run_folders(tmp_path)
    folder = str(tmp_path / "aitoolbox_runs" / name)
    loose = str(tmp_path / "loose.pth")
    torch.save(loop.checkpoint_state(), loose)
    with pytest.raises(ValueError, match="lies in no run folder"):
        make_loop().load_checkpoint(loose, continue_run_folder=True)
    with pytest.raises(ValueError, match="this TrainLoop already writes into"):
        loop.load_checkpoint(folder, continue_run_folder=True)
    torch.manual_seed(0)
    model = MLP()
    preset = TrainLoopCheckpoint(model, DataLoader(classification_data(16), batch_size=8), None, None,
                                 torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                 project_name="p", experiment_name="e", local_model_result_folder_path=str(tmp_path),
                                 hyperparams={}, show_progress=False)
    with pytest.raises(ValueError, match="auto_resume=True"):
        preset.load_checkpoint(folder, continue_run_folder=True)
