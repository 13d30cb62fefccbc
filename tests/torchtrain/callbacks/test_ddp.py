"""InMultiProcessDataLoad builds the loaders inside the training process."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.ddp import InMultiProcessDataLoad
from aitoolbox.torchtrain.model import TTBasicModel
from aitoolbox.torchtrain.train_loop import TrainLoop


class Linear(TTBasicModel):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x):
        return self.linear(x)


def make_loader(size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(size)
    return DataLoader(TensorDataset(torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator)),
                      batch_size=4)


def test_factories_replace_only_the_loaders_they_build():
    model = Linear()
    placeholder = make_loader(4)
    tl = TrainLoop(model, placeholder, None, placeholder, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   show_progress=False)
    callback = InMultiProcessDataLoad(train_loader_fn=lambda: make_loader(12), validation_loader_fn=lambda: make_loader(8))
    tl.callbacks_handler.register_callbacks([callback])
    tl.callbacks_handler.on_multiprocess_start()
    assert len(tl.train_loader.dataset) == 12
    assert len(tl.validation_loader.dataset) == 8
    assert tl.test_loader is placeholder  # no factory: kept


def test_loaders_built_in_each_process_are_used_by_fit_distributed():
    model = Linear()
    placeholder = make_loader(4)
    tl = TrainLoop(model, placeholder, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   show_progress=False, end_auto_eval=False)
    with pytest.warns(UserWarning, match="CPU processes"):
        tl.fit_distributed(num_epochs=1, num_gpus=2, start_method="fork",
                           in_process_data_load=InMultiProcessDataLoad(train_loader_fn=lambda: make_loader(16)))
    # 16 samples over 2 ranks in batches of 4: 2 iterations per rank (the placeholder would give 1).
    assert tl.total_iteration_idx == 2


def test_a_factory_must_be_callable():
    with pytest.raises(TypeError, match="train_loader_fn must be a function"):
        InMultiProcessDataLoad(train_loader_fn=make_loader(4))
