"""InMultiProcessDataLoad builds the loaders inside the training process; DistributedSamplerSetEpoch."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.ddp import DistributedSamplerSetEpoch, InMultiProcessDataLoad
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
    return DataLoader(TensorDataset(torch.randn(size, 3, generator=generator),
                                    torch.randn(size, 1, generator=generator)),
                      batch_size=4)


def test_factories_replace_only_the_loaders_they_build():
    model = Linear()
    placeholder = make_loader(4)
    tl = TrainLoop(model, placeholder, None, placeholder, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   show_progress=False)
    callback = InMultiProcessDataLoad(train_loader_fn=lambda: make_loader(12),
                                      validation_loader_fn=lambda: make_loader(8))
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
    assert tl.iterations_done == 2


def test_a_factory_must_be_callable():
    with pytest.raises(TypeError, match="train_loader_fn must be a function"):
        InMultiProcessDataLoad(train_loader_fn=make_loader(4))
    with pytest.raises(TypeError, match="val_loader_build_fn must be a function"):
        InMultiProcessDataLoad(val_loader_build_fn="data.csv")
    with pytest.raises(TypeError, match="pass train_loader_build_fn or train_loader_fn"):
        InMultiProcessDataLoad(lambda: make_loader(4), train_loader_fn=lambda: make_loader(4))


class SubclassDataLoad(InMultiProcessDataLoad):
    """aitoolbox 1.x style: True flags and overridden build methods."""

    def __init__(self):
        super().__init__(train_loader_build_fn=True, val_loader_build_fn=False, test_loader_build_fn=True)

    def build_train_dataloader(self):
        return make_loader(20)

    def build_val_dataloader(self):
        raise AssertionError("not asked for")

    def build_test_dataloader(self):
        return make_loader(8)


def test_1x_argument_names_and_overridden_build_methods():
    model = Linear()
    placeholder = make_loader(4)
    tl = TrainLoop(model, placeholder, placeholder, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   show_progress=False)
    InMultiProcessDataLoad(lambda: make_loader(12), None, lambda: make_loader(6)).load_into(tl)
    assert (len(tl.train_loader.dataset), tl.validation_loader, len(tl.test_loader.dataset)) == (12, placeholder, 6)
    SubclassDataLoad().load_into(tl)
    assert (len(tl.train_loader.dataset), tl.validation_loader, len(tl.test_loader.dataset)) == (20, placeholder, 8)


def test_distributed_sampler_set_epoch_at_every_epoch_begin():
    data = make_loader(16).dataset
    samplers = [DistributedSampler(data, num_replicas=2, rank=1, shuffle=shuffle) for shuffle in (True, False, False)]
    model = Linear()
    tl = TrainLoop(model, DataLoader(data, batch_size=4), None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.MSELoss(), show_progress=False, end_auto_eval=False)
    epochs_seen = []

    class Probe(AbstractCallback):  # execution order 0: after the sampler callback (-100)
        def on_epoch_begin(self):
            epochs_seen.append([sampler.epoch for sampler in samplers])

    tl.fit(num_epochs=3, callbacks=[Probe("probe"), DistributedSamplerSetEpoch(*samplers)])
    assert epochs_seen == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    DistributedSamplerSetEpoch(samplers[0], None, None)  # missing samplers are allowed
