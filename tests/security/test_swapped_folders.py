"""A checkpoint folder swapped, or reached through a symbolic link planted inside a run folder (issue 31's review):
what was checked is what is read, and nothing below the run folder the user names leads outside it."""
import os
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import aitoolbox.experiment.local_save.checkpoints as checkpoints
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError
from aitoolbox.experiment.local_save.sharded_checkpoints import read_full_model_state_dict
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import classification_data
from tests.security import hostile

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")

RUN = "exp_2024-01-01_00-00-00"


def _loop() -> TrainLoop:
    model = hostile.small_model()
    return TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                     show_progress=False)


@pytest.fixture
def run_and_other(tmp_path):
    """A run folder with a sharded checkpoint, and another run's sharded checkpoint outside it."""
    other = hostile.sharded_checkpoint(str(tmp_path / "private" / "model_other_2020-01-01_00-00-00_E1"), seed=123)
    checkpoint_folder = tmp_path / "shared" / RUN / "checkpoint_model"
    checkpoint_folder.mkdir(parents=True)
    own = hostile.sharded_checkpoint(str(checkpoint_folder / f"model_{RUN}_E1"), seed=0)
    return str(tmp_path / "shared" / RUN), own, other


def _swap_for_link(own: str, other: str) -> None:
    shutil.rmtree(own)
    os.symlink(other, own)


def test_a_sharded_folder_swapped_after_its_state_was_read_is_refused_when_its_weights_load(run_and_other,
                                                                                          monkeypatch):
    run, own, other = run_and_other
    read = checkpoints.load_checkpoint_file

    def read_then_swap(*args, **kwargs):  # the attacker's window: after the checks, before the weights are read
        checkpoint = read(*args, **kwargs)
        _swap_for_link(own, other)
        return checkpoint

    monkeypatch.setattr(checkpoints, "load_checkpoint_file", read_then_swap)
    tl = _loop()
    before = {key: value.clone() for key, value in tl.model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError) as refused:
        tl.load_checkpoint(run)
    assert own in str(refused.value) and "no longer the folder" in str(refused.value)
    assert all(torch.equal(before[key], value) for key, value in tl.model.state_dict().items())


def test_the_full_weights_of_a_swapped_sharded_folder_are_refused(run_and_other):
    run, own, other = run_and_other
    checkpoint = checkpoints.load_checkpoint_file(run)
    _swap_for_link(own, other)
    with pytest.raises(CorruptCheckpointError, match="no longer the folder"):
        read_full_model_state_dict(checkpoint[checkpoints.SHARDED_CHECKPOINT_KEY],
                                   expected_identity=checkpoint[checkpoints.SHARDED_IDENTITY_KEY])


def test_an_unswapped_sharded_folder_loads(run_and_other):
    run, own, _ = run_and_other
    tl = _loop()
    tl.load_checkpoint(run)
    assert all(torch.equal(tl.model.state_dict()[key], value) for key, value in read_full_model_state_dict(own).items())


@pytest.fixture
def linked_checkpoint_model(tmp_path):
    """A run folder whose checkpoint_model/ is a link to another run's checkpoints (a .pth and a sharded one)."""
    other = tmp_path / "private" / "checkpoint_model"
    other.mkdir(parents=True)
    hostile.sharded_checkpoint(str(other / "model_secret_2020-01-01_00-00-00_E1"))
    torch.save(hostile.small_checkpoint(), str(other / "model_secret_2020-01-01_00-00-00_E2.pth"))
    run = tmp_path / "shared" / RUN
    run.mkdir(parents=True)
    os.symlink(other, run / "checkpoint_model")
    return run, other


@pytest.mark.parametrize("named", ["run folder", "file through the link", "sharded folder through the link"])
def test_a_link_inside_the_run_folder_is_refused(linked_checkpoint_model, named):
    run, _ = linked_checkpoint_model
    linked = run / "checkpoint_model"
    path = {"run folder": run, "file through the link": linked / "model_secret_2020-01-01_00-00-00_E2.pth",
            "sharded folder through the link": linked / "model_secret_2020-01-01_00-00-00_E1"}[named]
    with pytest.raises(CorruptCheckpointError) as refused:
        checkpoints.load_checkpoint_file(str(path))
    message = str(refused.value)
    assert "checkpoint_model on its path is a symbolic link" in message and "name the checkpoint" in message


def test_the_run_folder_itself_may_be_reached_through_the_users_links(linked_checkpoint_model, tmp_path):
    _, other = linked_checkpoint_model
    os.symlink(other.parent, tmp_path / "my_link_to_the_run")  # the user's own link, to the run folder they name
    assert checkpoints.load_checkpoint_file(str(tmp_path / "my_link_to_the_run"))["epoch"] is not None
    named = tmp_path / "my_link_to_the_run" / "checkpoint_model" / "model_secret_2020-01-01_00-00-00_E2.pth"
    assert checkpoints.load_checkpoint_file(str(named))["epoch"] is not None
