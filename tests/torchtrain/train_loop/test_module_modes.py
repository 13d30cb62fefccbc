"""Frozen submodules (a submodule in eval mode when ``fit`` starts) and unfreezing them (issue 32 item 11)."""
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.module_modes import FrozenModules
from tests.combinations.support import ComboNet, dataset


def _loop(model: ComboNet) -> TrainLoop:
    return TrainLoop(model, DataLoader(dataset(), batch_size=8), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), end_auto_eval=False,
                     show_progress=False)


def test_unfreezing_after_model_eval_trains_the_submodule():
    """The docs: after ``model.eval()`` for predictions, ``submodule.train()`` before ``fit`` unfreezes it. Before
    the fix the remembered frozen list won and the BatchNorm stayed in eval mode, its statistics unchanged."""
    torch.manual_seed(0)
    model = ComboNet(dropout=0.0)
    model.bn.eval()
    tl = _loop(model)
    tl.fit(num_epochs=1)
    frozen_mean = model.bn.running_mean.clone()
    model.eval()  # predicting in a notebook...
    model.bn.train()  # ...then unfreezing the BatchNorm
    tl.fit(num_epochs=2)
    assert model.training and model.bn.training
    assert tl.frozen_modules.modules == []
    assert not torch.equal(model.bn.running_mean, frozen_mean)


def test_after_model_eval_only_the_remembered_submodules_still_in_eval_mode_stay_frozen():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5))
    frozen = FrozenModules()
    model[1].eval()
    model[2].eval()
    frozen.enter_training(model, model)
    assert frozen.modules == [model[1], model[2]]
    model.eval()
    model[2].train()  # unfreeze the Dropout only
    frozen.enter_training(model, model)
    assert frozen.modules == [model[1]]
    assert [module.training for module in model.modules()] == [True, True, False, True]
    model.eval()  # nothing unfrozen: the BatchNorm stays frozen
    frozen.enter_training(model, model)
    assert [module.training for module in model.modules()] == [True, True, False, True]
