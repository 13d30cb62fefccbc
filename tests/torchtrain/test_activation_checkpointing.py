"""TrainLoop(activation_checkpointing=[...]): the same training, fewer saved activations; single, DDP, FSDP."""
import copy
import os
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.activation_checkpointing import CheckpointedForward, apply_activation_checkpointing
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.torchtrain.distributed.support import regression_data

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")


class Block(nn.Module):
    """A residual block with dropout: the recomputation must draw the same dropout mask."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


class Net(TTModel):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.Sequential(Block(width), Block(width), Block(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).cpu(), batch_data[1], None


def make_loop(model, gpu_mode="single", activation_checkpointing=None):
    loader = DataLoader(regression_data(34), batch_size=4)
    return TrainLoop(model, loader, DataLoader(regression_data(10, seed=1), batch_size=4), None,
                     torch.optim.AdamW(model.parameters(), lr=1e-2), nn.MSELoss(), gpu_mode=gpu_mode,
                     show_progress=False, activation_checkpointing=activation_checkpointing)


def saved_elements(model: nn.Module, batch) -> int:
    """Elements of the tensors autograd saves for backward in one training forward."""
    count = [0]

    def pack(tensor):
        count[0] += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_loss(batch, nn.MSELoss(), torch.device("cpu"))
    return count[0]


def test_training_is_bitwise_the_same_and_saves_fewer_activations():
    torch.manual_seed(0)
    initial = Net()
    plain = make_loop(copy.deepcopy(initial))
    checkpointed = make_loop(copy.deepcopy(initial), activation_checkpointing=[Block])
    for tl in (plain, checkpointed):
        torch.manual_seed(1)  # the same dropout masks in both runs
        tl.fit(num_epochs=3)
    for key, value in plain.model.state_dict().items():
        assert torch.equal(checkpointed.model.state_dict()[key], value), key
    assert plain.train_history == checkpointed.train_history
    assert list(checkpointed.model.state_dict()) == list(initial.state_dict())
    assert all(isinstance(block.__dict__["forward"], CheckpointedForward) for block in checkpointed.model.blocks)

    batch = next(iter(plain.train_loader))
    plain.model.train()
    checkpointed.model.train()
    assert saved_elements(checkpointed.model, batch) < 0.5 * saved_elements(plain.model, batch)


def test_the_checkpointed_model_pickles_and_applying_twice_changes_nothing():
    model = Net()
    assert apply_activation_checkpointing(model, [Block]) == 3
    forwards = [block.__dict__["forward"] for block in model.blocks]
    assert apply_activation_checkpointing(model, [Block]) == 3
    assert [block.__dict__["forward"] for block in model.blocks] == forwards
    copied = pickle.loads(pickle.dumps(model))
    assert all(isinstance(block.__dict__["forward"], CheckpointedForward) and block.__dict__["forward"].module is block
               for block in copied.blocks)
    x = torch.randn(5, 4)
    model.eval()
    copied.eval()
    assert torch.equal(copied(x), model(x))


def test_nested_selections_checkpoint_the_outermost_only():
    model = Net()
    assert apply_activation_checkpointing(model, [Block, nn.Linear]) == 5  # embed, 3 blocks, head
    assert "forward" not in model.blocks[0].linear.__dict__


@pytest.mark.parametrize("argument, error, message", [
    ("Block", TypeError, "must be a list of nn.Module classes"),
    ([nn.Conv2d], ValueError, r"has no submodule of the classes \['Conv2d'\]"),
])
def test_bad_arguments_are_refused_by_the_constructor(argument, error, message):
    with pytest.raises(error, match=message):
        make_loop(Net(), activation_checkpointing=argument)


class SaveWeights(AbstractCallback):
    def __init__(self, folder):
        super().__init__("save weights")
        self.folder = str(folder)

    def on_train_end(self):
        tl = self.train_loop_obj
        state = tl.strategy.model_state_dict(tl.model)
        if tl.strategy.rank == 0:
            torch.save(state, os.path.join(self.folder, "weights.pt"))


@pytest.mark.parametrize("gpu_mode", ["ddp", "fsdp"])
def test_two_processes_train_the_same_with_and_without_it(tmp_path, gpu_mode):
    torch.manual_seed(0)
    initial = Net()
    weights = []
    for name, classes in (("plain", None), ("checkpointed", [Block])):
        folder = tmp_path / name
        folder.mkdir()
        tl = make_loop(copy.deepcopy(initial), gpu_mode, activation_checkpointing=classes)
        options = {"fsdp_model_args": {"shard_modules": [Block]}} if gpu_mode == "fsdp" else {}
        tl.fit_distributed(num_epochs=2, callbacks=[SaveWeights(folder)], train_data_shuffle=False, num_gpus=2,
                           start_method="fork", **options)
        weights.append(torch.load(folder / "weights.pt", weights_only=True))
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, rtol=0, atol=1e-6, msg=key)
