"""Background checkpoints of CUDA tensors: the file holds the state at the moment of the save.

With ``background_save`` the state is copied to host memory and written by a thread while training goes on.
On a GPU the device runs behind the host, so the copy must wait for the kernels that produce the saved values
(and finish before the writer reads the host memory): a copy that does not (a ``non_blocking`` device-to-host
copy read at once) writes stale or half-copied values. Each test keeps the GPU busy (``torch.cuda._sleep``)
right before the save, queues a last change of the weights behind it, and changes the weights again right
after the save.
"""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.checkpoints import list_checkpoints, snapshot_checkpoint
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import CHECKPOINT_EXECUTION_ORDER, ModelCheckpoint
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Spin-loop cycles for torch.cuda._sleep: tens of milliseconds on any current GPU.
BUSY_CYCLES = 100_000_000
CHECKED_KEYS = ("model_state_dict", "optimizer_state_dict", "precision")


def host_copy(value):
    """A blocking copy of the tensors in ``value`` to host memory (the expected content of a file)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return value


def assert_same(expected, actual, where=""):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual.cpu(), expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (item_e, item_a) in enumerate(zip(expected, actual)):
            assert_same(item_e, item_a, f"{where}[{index}]")
    else:
        assert expected == actual, where


class LateChangeBeforeCheckpoint(AbstractCallback):
    """Just before the checkpoint callback: busy GPU, then one more change of every weight queued behind it."""

    def __init__(self):
        super().__init__("late change", execution_order=CHECKPOINT_EXECUTION_ORDER - 1)

    def on_epoch_end(self):
        torch.cuda._sleep(BUSY_CYCLES)
        with torch.no_grad():
            for param in self.train_loop_obj.model.parameters():
                param.mul_(1.5)


class RecordThenChange(AbstractCallback):
    """Right after the checkpoint callback: record the state it saved (blocking copies), then change the weights
    while the background write may still run."""

    def __init__(self):
        super().__init__("record then change", execution_order=CHECKPOINT_EXECUTION_ORDER + 1)
        self.expected = {}

    def on_epoch_end(self):
        tl = self.train_loop_obj
        checkpoint = tl.checkpoint_state(mid_epoch=False)
        self.expected[tl.epoch] = host_copy({key: checkpoint[key] for key in CHECKED_KEYS})
        with torch.no_grad():
            for param in tl.model.parameters():
                param.add_(1.0)


@pytest.mark.parametrize("use_amp", [False, {"opt_level": "O2"}], ids=["fp32", "O2"])
def test_a_background_checkpoint_of_cuda_tensors_holds_the_state_of_its_save(tmp_path, use_amp):
    torch.manual_seed(0)
    model = MLP()
    loader = DataLoader(classification_data(24), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    tl = TrainLoop(model, loader, None, None, torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp=use_amp)
    record = RecordThenChange()
    # Three epochs: the first snapshot is new host memory, the later ones are copied into the previous one's.
    tl.fit(num_epochs=3, callbacks=[LateChangeBeforeCheckpoint(), record, ModelCheckpoint(
        project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path),
        background_save=True)])
    assert tl.device.type == "cuda"
    (run_folder,) = os.listdir(tmp_path / "proj")
    files = list_checkpoints(os.path.join(tmp_path, "proj", run_folder, "checkpoint_model"))
    assert len(files) == 3
    for epoch, path in enumerate(files):
        saved = torch.load(path, weights_only=True)
        assert saved["epoch"] == epoch
        assert_same(record.expected[epoch], {key: saved[key] for key in CHECKED_KEYS}, f"epoch {epoch}")
    if use_amp:
        assert record.expected[0]["precision"]["master_weights"]  # the float32 masters were checked too


def test_snapshot_of_cuda_tensors_waits_for_pending_kernels_new_and_reused_memory():
    weight = torch.zeros(1 << 20, device="cuda")
    previous = None
    for round_ in range(1, 4):  # round 1: fresh host memory; rounds 2 and 3: into the previous snapshot
        torch.cuda._sleep(BUSY_CYCLES)
        weight.fill_(float(round_))  # queued behind the busy loop: the snapshot must wait for it
        snapshot = snapshot_checkpoint({"model": {"weight": weight}}, reuse=previous)
        weight.fill_(-1.0)  # training goes on right after the save
        assert snapshot["model"]["weight"].device.type == "cpu"
        assert torch.equal(snapshot["model"]["weight"], torch.full((1 << 20,), float(round_)))
        if previous is not None:
            assert snapshot["model"]["weight"] is previous["model"]["weight"]  # the reuse path was taken
        previous = snapshot
