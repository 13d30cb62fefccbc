"""Auto-resume under torchrun: a rank killed mid-epoch, torchrun restarts the job (``--max-restarts``), and
the restarted processes find the run's newest complete checkpoint and end exactly as a run that never failed."""
import json
import subprocess
import sys

import pytest
import torch

from tests.torchtrain.distributed.support import script_env

SCRIPT = '''
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint


class Net(TTModel):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).cpu(), batch_data[1], {}


class KillRank1(AbstractCallback):
    """In the first attempt only, rank 1 dies abruptly at batch 2 of epoch 1."""

    def __init__(self):
        super().__init__("kill rank 1")

    def on_batch_begin(self):
        tl = self.train_loop_obj
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and os.environ["RANK"] == "1" and (tl.epoch, tl.iteration) == (1, 2):
            os._exit(3)


if __name__ == "__main__":
    root, gpu_mode, kill = sys.argv[1], sys.argv[2], sys.argv[3] == "kill"
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(dim=1, keepdim=True).tanh()
    train = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    validation = DataLoader(TensorDataset(x[:12], y[:12]), batch_size=4)
    model = Net()
    tl = TrainLoopCheckpoint(model, train, validation, None, torch.optim.AdamW(model.parameters(), lr=1e-2),
                             nn.MSELoss(), "proj", "exp", root, {}, iteration_save_freq=3, auto_resume=True,
                             gpu_mode=gpu_mode, show_progress=False)
    tl.fit_distributed(num_epochs=3, callbacks=[KillRank1()] if kill else [])
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in tl.model.state_dict().items()}
    if os.environ["RANK"] == "0":
        torch.save(state, os.path.join(root, "weights.pt"))
        with open(os.path.join(root, "result.json"), "w") as handle:
            json.dump({"history": tl.train_history.get_train_history_dict(), "resumed_from": tl.resumed_from,
                       "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")}, handle)
'''


def torchrun(script, root, gpu_mode, kill):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", str(script), str(root), gpu_mode, "kill" if kill else "run"]
    result = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=300,
                            cwd=str(script.parent))
    assert result.returncode == 0, result.stderr[-5000:]
    with open(root / "result.json") as handle:
        return torch.load(root / "weights.pt", weights_only=True), json.load(handle)


@pytest.mark.slow
@pytest.mark.parametrize("gpu_mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.extended)])
def test_a_rank_killed_mid_epoch_under_torchrun_max_restarts_resumes_bitwise(tmp_path, gpu_mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    straight_weights, straight = torchrun(script, tmp_path / "straight", gpu_mode, kill=False)
    weights, restarted = torchrun(script, tmp_path / "killed", gpu_mode, kill=True)
    assert straight["restarts"] == "0" and restarted["restarts"] == "1"
    assert straight["resumed_from"] is None
    # 4 batches per epoch and rank, a checkpoint every 3: the newest before batch 2 of epoch 1 is after batch 1.
    assert restarted["resumed_from"].rstrip("/").endswith("_E1_ITER5" + (".pth" if gpu_mode == "ddp" else ""))
    assert weights.keys() == straight_weights.keys()
    for name, value in straight_weights.items():
        assert torch.equal(weights[name], value), name
    assert restarted["history"] == straight["history"]
