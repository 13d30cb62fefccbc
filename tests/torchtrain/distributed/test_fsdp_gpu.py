"""gpu_mode='fsdp' on a CUDA GPU (NCCL): asynchronous sharded checkpoints, whose DCP collectives run in a gloo
group of their own, resume bitwise in new (spawned) processes, in float32 and under the bfloat16 policy."""
import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.experiment.local_save.checkpoints import list_checkpoints
from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Tower(TTModel):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.layers(x))

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).float().cpu(), batch_data[1], {}


def make_loop(model, use_amp):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())
    return TrainLoop(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8), None,
                     torch.optim.AdamW(model.parameters(), lr=1e-2), nn.MSELoss(), gpu_mode="fsdp", use_amp=use_amp,
                     show_progress=False)


def fit(tl, num_epochs, callbacks=()):
    tl.fit_distributed(num_epochs=num_epochs, callbacks=list(callbacks), train_data_shuffle=False, num_gpus=1,
                       start_method="spawn", fsdp_model_args={"shard_modules": [nn.Linear]})


@pytest.mark.parametrize("use_amp", [False, True], ids=["float32", "bfloat16"])
def test_asynchronous_sharded_checkpoints_on_cuda_resume_bitwise(tmp_path, use_amp):
    torch.manual_seed(0)
    initial = Tower()
    straight = make_loop(copy.deepcopy(initial), use_amp)
    fit(straight, 4)
    folder = dict(project_name="p", experiment_name="e", local_model_result_folder_path=str(tmp_path))
    fit(make_loop(copy.deepcopy(initial), use_amp), 3, [ModelCheckpoint(background_save=True, **folder),
                                                        ModelIterationCheckpoint(5, background_save=True, **folder)])
    (run,) = os.listdir(tmp_path / "p")
    saved = list_checkpoints(str(tmp_path / "p" / run / "checkpoint_model"))
    assert len(saved) == 7 and all(is_sharded_checkpoint(path) for path in saved)
    resumed = make_loop(copy.deepcopy(initial), use_amp)
    resumed.load_checkpoint(saved[-1])
    fit(resumed, 4)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert resumed.train_history == straight.train_history
