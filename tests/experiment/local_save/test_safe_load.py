"""Loading never runs code from a file: checkpoints are read with ``torch.load(weights_only=True)``.

A planted ``.pth`` whose ``__reduce__`` calls ``os.system`` is refused by every loading entry point (nothing is
run: the marker file it would create never appears), with an error naming the file, the refused global and the
opt-in ``weights_only=False``. aitoolbox 1.8's checkpoints, numpy values and all, keep loading by default.
"""
import io
import logging
import os
import pickle
import threading
import zipfile

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_load.local_model_load import PyTorchLocalModelLoader
from aitoolbox.experiment.local_save.checkpoints import load_checkpoint_file
from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError, load_torch_file
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data

PROJECT, EXPERIMENT, TIMESTAMP = "proj", "exp", "2023-05-06_07-08-09"


class PlantedPayload:
    """What an attacker pickles into a checkpoint: unpickling it runs a shell command creating ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class UserHyperparams:
    """A class of the user's own in the hyperparameters (an aitoolbox 1.x run could save that)."""

    def __init__(self, lr):
        self.lr = lr


def run_folder(root):
    return os.path.join(str(root), PROJECT, f"{EXPERIMENT}_{TIMESTAMP}", "checkpoint_model")


def saved_like_18(path, hyperparams, numpy_1x_names=True):
    """A checkpoint as aitoolbox 1.8 wrote it: ``torch.save`` of its dict, hyperparameters as the user gave them.

    With ``numpy_1x_names`` the pickle names numpy's module as numpy 1.x (1.8's time) did, ``numpy.core``.
    """
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(classification_data(4).tensors[0]).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    checkpoint = {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                  "schedulers_state_dict": [scheduler.state_dict()], "epoch": 1, "iteration_idx": 9,
                  "hyperparams": hyperparams, "amp": scaler.state_dict()}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    if numpy_1x_names:
        data = _renamed_in_pickle(data, b"numpy._core.multiarray", b"numpy.core.multiarray")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return checkpoint


def _renamed_in_pickle(data, old, new):
    """The torch zip file ``data`` with ``old`` replaced by ``new`` in its pickle (its globals' module names)."""
    source = zipfile.ZipFile(io.BytesIO(data))
    output = io.BytesIO()
    with zipfile.ZipFile(output, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            content = source.read(info.filename)
            if info.filename.endswith("data.pkl"):
                content = content.replace(old, new)
            target.writestr(info.filename, content)
    return output.getvalue()


def numpy_hyperparams():
    return {"lr": np.logspace(-3, -1, 3)[1], "batch_size": np.int64(8), "dropout": np.float32(0.1),
            "layer_sizes": np.array([10, 20, 3]), "use_bn": np.bool_(True), "experiment_file_path": "train.py"}


@pytest.fixture
def planted(tmp_path):
    """A checkpoint in the experiment folder layout whose hyperparameters carry :class:`PlantedPayload`."""
    marker = tmp_path / "code-was-run"
    path = os.path.join(run_folder(tmp_path / "results"), f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth")
    os.makedirs(os.path.dirname(path))
    torch.save({"model_state_dict": MLP().state_dict(), "optimizer_state_dict": {}, "epoch": 1,
                "hyperparams": {"lr": 0.1, "payload": PlantedPayload(str(marker))}}, path)
    return path, marker


def assert_refused(error_info, path, marker):
    message = str(error_info.value)
    assert path in message and "posix.system" in message and "weights_only=False" in message
    assert "only for files you trust" in message
    assert error_info.value.refused == ["posix.system"]
    assert not marker.exists()


def test_an_18_checkpoint_with_numpy_hyperparameters_loads_by_default_without_a_warning(tmp_path, caplog,
                                                                                       monkeypatch):
    path = os.path.join(run_folder(tmp_path), f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth")
    saved = saved_like_18(path, numpy_hyperparams())
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        loaded = load_checkpoint_file(path)
    assert not caplog.records  # no fallback to full unpickling
    assert loaded.keys() == saved.keys()
    hyperparams = loaded["hyperparams"]
    assert hyperparams["lr"] == pytest.approx(0.01) and isinstance(hyperparams["lr"], np.float64)
    assert hyperparams["batch_size"] == 8 and hyperparams["use_bn"]
    assert np.array_equal(hyperparams["layer_sizes"], [10, 20, 3])
    assert loaded["amp"] == saved["amp"] and loaded["schedulers_state_dict"] == saved["schedulers_state_dict"]
    for key, value in saved["model_state_dict"].items():
        assert torch.equal(loaded["model_state_dict"][key], value)

    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model(PROJECT, EXPERIMENT, TIMESTAMP, "checkpoint_model", 1)
    restored = loader.init_model(MLP(hidden=16)).state_dict()
    assert all(torch.equal(restored[key], value) for key, value in saved["model_state_dict"].items())


def test_the_allowed_types_are_allowed_only_while_a_checkpoint_loads(tmp_path):
    before = set(map(str, torch.serialization.get_safe_globals()))  # torch keeps no order that matters
    path = str(tmp_path / "numpy.pth")
    torch.save({"lr": np.float64(0.1)}, path)
    assert load_torch_file(path) == {"lr": 0.1}
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    with pytest.raises(pickle.UnpicklingError):  # the user's own torch.load is as strict as torch makes it
        torch.load(path, weights_only=True)


def test_loads_in_several_threads_share_the_allowed_types_and_leave_the_users_own(tmp_path):
    path = str(tmp_path / "numpy.pth")
    torch.save({"lr": np.float64(0.1), "sizes": np.arange(3)}, path)
    errors = []

    def load_many():
        try:
            for _ in range(20):
                assert load_torch_file(path)["lr"] == 0.1
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([np.dtype])  # the user's own, before any load
    try:
        threads = [threading.Thread(target=load_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        assert np.dtype in torch.serialization.get_safe_globals()  # not taken away by the loads
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_a_planted_file_is_refused_by_every_loading_entry_point(planted, tmp_path):
    path, marker = planted
    root = str(tmp_path / "results")
    with pytest.raises(UntrustedCheckpointError) as refused:
        load_checkpoint_file(path)
    assert_refused(refused, path, marker)
    with pytest.raises(UntrustedCheckpointError) as refused:
        load_checkpoint_file(os.path.dirname(path))  # the newest checkpoint of a folder
    assert_refused(refused, path, marker)
    with pytest.raises(UntrustedCheckpointError) as refused:
        PyTorchLocalModelLoader(root).load_model(PROJECT, EXPERIMENT, TIMESTAMP, "checkpoint_model", 1)
    assert_refused(refused, path, marker)
    with pytest.raises(UntrustedCheckpointError) as refused:
        PyTorchLocalModelLoader(root).load_model_from_path(path)
    assert_refused(refused, path, marker)
    model = MLP()
    loop = TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)
    with pytest.raises(UntrustedCheckpointError) as refused:
        loop.load_checkpoint(path)
    assert_refused(refused, path, marker)
    for callback in (ModelLoadContinueTraining(TIMESTAMP, epoch_num=1, project_name=PROJECT,
                                               experiment_name=EXPERIMENT, local_model_result_folder_path=root),
                     ModelLoadContinueTraining(saved_model_path=path)):
        with pytest.raises(UntrustedCheckpointError) as refused:
            loop.callbacks_handler.register_callbacks([callback])
        assert_refused(refused, path, marker)


def test_a_custom_object_is_refused_by_default_and_loads_with_weights_only_false(tmp_path):
    path = os.path.join(run_folder(tmp_path), f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth")
    saved_like_18(path, {"lr": 0.1, "custom": UserHyperparams(0.5)}, numpy_1x_names=False)
    with pytest.raises(UntrustedCheckpointError, match=f"{__name__}.UserHyperparams"):
        load_checkpoint_file(path)
    assert load_checkpoint_file(path, weights_only=False)["hyperparams"]["custom"].lr == 0.5
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loaded = loader.load_model(PROJECT, EXPERIMENT, TIMESTAMP, "checkpoint_model", 1, weights_only=False)
    assert loaded["hyperparams"]["custom"].lr == 0.5
    model = MLP()
    loop = TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None,
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), show_progress=False)
    callback = ModelLoadContinueTraining(saved_model_path=path, weights_only=False)
    loop.callbacks_handler.register_callbacks([callback])
    assert callback.checkpoint["hyperparams"]["custom"].lr == 0.5


def test_auto_resume_meeting_a_refused_file_stops_with_that_error(planted, tmp_path):
    path, marker = planted
    root = str(tmp_path / "results")
    model = MLP()
    with pytest.raises(UntrustedCheckpointError) as refused:
        TrainLoopCheckpoint(model, DataLoader(classification_data(8), batch_size=4), None, None,
                            torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), PROJECT, EXPERIMENT,
                            root, {}, auto_resume=True, show_progress=False)
    assert_refused(refused, path, marker)
    # No new run was started beside the one it was to continue.
    assert os.listdir(os.path.join(root, PROJECT)) == [f"{EXPERIMENT}_{TIMESTAMP}"]


def test_train_loop_load_checkpoint_refuses_by_default_and_takes_weights_only_false(tmp_path):
    path = os.path.join(run_folder(tmp_path), f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth")
    saved_like_18(path, {"lr": 0.1, "custom": UserHyperparams(0.5)}, numpy_1x_names=False)
    model = MLP()
    loop = TrainLoop(model, DataLoader(classification_data(8), batch_size=4), None, None,
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), show_progress=False)
    with pytest.raises(UntrustedCheckpointError, match="weights_only=False"):
        loop.load_checkpoint(path)
    assert loop.load_checkpoint(path, weights_only=False)["hyperparams"]["custom"].lr == 0.5
    assert loop.epochs_completed == 2  # a 1.8 file saved after epoch 1 continues from the next one


def test_auto_resume_takes_weights_only_false_for_a_trusted_file(tmp_path):
    root = str(tmp_path / "results")
    path = os.path.join(run_folder(tmp_path / "results"), f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth")
    saved_like_18(path, {"lr": 0.1, "custom": UserHyperparams(0.5)}, numpy_1x_names=False)
    model = MLP()
    arguments = (model, DataLoader(classification_data(8), batch_size=4), None, None,
                 torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), PROJECT, EXPERIMENT, root, {})
    with pytest.raises(UntrustedCheckpointError):
        TrainLoopCheckpoint(*arguments, auto_resume=True, show_progress=False)
    with pytest.raises(TypeError, match="weights_only must be True or False"):
        TrainLoopCheckpoint(*arguments, auto_resume=True, show_progress=False, weights_only="no")
    resumed = TrainLoopCheckpoint(*arguments, auto_resume=True, show_progress=False, weights_only=False)
    assert resumed.resumed_from == path and resumed.epochs_completed == 2


# --- sharded (DCP) checkpoints: torch's DCP would unpickle their index and non-tensor entries fully --------------
def sharded_checkpoint(tmp_path, lr=0.01):
    from aitoolbox.experiment.local_save.sharded_checkpoints import save_sharded_checkpoint

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = lr
    folder = str(tmp_path / "checkpoint_model" / f"model_{EXPERIMENT}_{TIMESTAMP}_E1")
    save_sharded_checkpoint(folder, model, optimizer, {"epoch": 1}).wait()
    optimizer.param_groups[0]["lr"] = 0.01
    return folder, model, optimizer


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_sharded_checkpoint_with_a_planted_index_is_refused(tmp_path):
    from aitoolbox.experiment.local_save.sharded_checkpoints import (
        load_sharded_checkpoint, read_full_model_state_dict)

    folder, model, optimizer = sharded_checkpoint(tmp_path)
    restored = nn.Linear(3, 2)
    load_sharded_checkpoint(folder, restored, torch.optim.Adam(restored.parameters(), lr=0.01))  # loads as it is
    assert torch.equal(restored.weight, model.weight)
    marker = tmp_path / "code-was-run"
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        pickle.dump(PlantedPayload(str(marker)), handle)
    with pytest.raises(UntrustedCheckpointError, match="posix.system") as refused:
        read_full_model_state_dict(folder)
    assert ".metadata" in str(refused.value)
    with pytest.raises(UntrustedCheckpointError, match="posix.system"):
        load_sharded_checkpoint(folder, restored, torch.optim.Adam(restored.parameters(), lr=0.01))
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_sharded_checkpoint_with_a_planted_entry_is_refused(tmp_path):
    from aitoolbox.experiment.local_save.sharded_checkpoints import load_sharded_checkpoint

    marker = tmp_path / "code-was-run"
    folder, _, _ = sharded_checkpoint(tmp_path, lr=PlantedPayload(str(marker)))  # pickled into a .distcp file
    restored = nn.Linear(3, 2)
    with pytest.raises(UntrustedCheckpointError, match="posix.system") as refused:
        load_sharded_checkpoint(folder, restored, torch.optim.Adam(restored.parameters(), lr=0.01))
    assert folder in str(refused.value) and "lr" in str(refused.value)
    assert not marker.exists()
