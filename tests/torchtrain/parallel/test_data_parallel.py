"""TTParallelBase, TTDataParallel (on CPU, and on a GPU when there is one) and TTDistributedDataParallel
(one in-process gloo rank, and two real processes)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.model import FeedDefinitionModel, ModelWrap, TTBasicModel, TTModel
from aitoolbox.torchtrain.parallel import TTDataParallel, TTDistributedDataParallel, TTParallelBase
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.distributed_helpers import run_distributed
from tests.helpers import ClassifierFeedDefinition, PlainMLP, classification_data

CPU = torch.device('cpu')


class CountingRegressor(TTModel):
    """Counts forward passes on the model and get_loss calls on whatever ``self`` is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 1)
        self.forward_calls = 0
        self.loss_calls = 0
        self.scale = 2.0
        self.secret = 'not transferred'
        self.transfer_model_attributes = ['scale', 'loss_calls', 'fc_ref']
        self.fc_ref = self.fc  # a module transferred as a plain reference

    def forward(self, x):
        self.forward_calls += 1
        return self.fc(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        self.loss_calls += 1
        return criterion(self.rescale(self(x.to(device))), y.to(device))

    def get_loss_eval(self, batch_data, criterion, device):
        return self.get_loss(batch_data, criterion, device) * 0 + 7.0

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self.rescale(self(x.to(device))).cpu(), y, {'who': [type(self).__name__]}

    def rescale(self, output):
        return output * self.scale

    def read_secret(self):
        return self.secret

    @staticmethod
    def static_helper(value):
        return value + 1

    @classmethod
    def class_helper(cls):
        return cls.__name__


def regression_batch(num=8):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num, 3, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def assert_loss_and_grads_match_plain_model(wrapper, model_params):
    reference = CountingRegressor()
    batch = regression_batch()
    loss = wrapper.get_loss(batch, nn.MSELoss(), CPU)
    loss.backward()
    expected = reference.get_loss(batch, nn.MSELoss(), CPU)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for got, want in zip(model_params, reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


# --- TTParallelBase ----------------------------------------------------------------------------------------
def test_base_rebinds_methods_and_copies_listed_attributes():
    model = CountingRegressor()
    base = TTParallelBase(model)
    assert base.scale == 2.0 and base.fc_ref is model.fc
    assert base.static_helper(1) == 2 and base.class_helper() == 'CountingRegressor'
    with pytest.raises(AttributeError, match='secret'):
        base.read_secret()  # runs with the base as self, which has no 'secret'
    assert not hasattr(base, 'forward_calls')
    assert not hasattr(base, 'fc')  # submodules stay behind the parallel forward


def test_base_rejects_a_model_whose_core_method_is_not_a_method():
    model = CountingRegressor()
    model.get_loss = lambda batch_data, criterion, device: None
    with pytest.raises(TypeError, match='get_loss must be a method'):
        TTParallelBase(model)


# --- TTDataParallel --------------------------------------------------------------------------------------
def test_data_parallel_is_a_data_parallel_with_the_model_methods():
    model = CountingRegressor()
    wrapper = TTDataParallel(model)
    assert isinstance(wrapper, nn.DataParallel) and isinstance(wrapper, TTParallelBase)
    assert wrapper.module is model
    # transferred attributes are references, not registrations: the state_dict is DataParallel's
    assert list(wrapper.state_dict()) == list(nn.DataParallel(model).state_dict())


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU-only DataParallel path')
def test_data_parallel_get_loss_runs_through_the_parallel_forward_on_cpu():
    model = CountingRegressor()
    wrapper = TTDataParallel(model)
    assert_loss_and_grads_match_plain_model(wrapper, model.parameters())
    assert model.forward_calls == 1
    assert wrapper.loss_calls == 1 and model.loss_calls == 0  # the counter lives on self, i.e. the wrapper
    assert wrapper.get_loss_eval(regression_batch(), nn.MSELoss(), CPU).item() == 7.0
    y_pred, _, metadata = wrapper.get_predictions(regression_batch(), CPU)
    torch.testing.assert_close(y_pred, model(regression_batch()[0]).detach() * 2)
    assert metadata == {'who': ['TTDataParallel']}
    with pytest.raises(AttributeError):
        wrapper.read_secret()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
def test_data_parallel_get_loss_on_gpu_matches_the_plain_model():
    model = CountingRegressor().cuda()
    wrapper = TTDataParallel(model)
    x, y = regression_batch()
    loss = wrapper.get_loss((x, y), nn.MSELoss(), torch.device('cuda'))
    loss.backward()
    reference = CountingRegressor()
    reference.get_loss((x, y), nn.MSELoss(), CPU).backward()
    torch.testing.assert_close(loss.cpu(), reference.get_loss((x, y), nn.MSELoss(), CPU).detach())
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad.cpu(), want.grad)


class TwoInputBasic(TTBasicModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(2, 1)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_data_parallel_runs_basic_models_helpers_on_the_wrapper():
    model = TwoInputBasic()
    wrapper = TTDataParallel(model.to('cuda' if torch.cuda.is_available() else 'cpu'))
    device = next(model.parameters()).device
    x1, x2, y = torch.randn(4, 2), torch.randn(4, 2), torch.randn(4, 1)
    expected = nn.MSELoss()(model(x1.to(device), x2.to(device)), y.to(device))
    torch.testing.assert_close(wrapper.get_loss((x1, x2, y), nn.MSELoss(), device), expected)


def test_data_parallel_around_a_model_wrap_adapter_uses_the_feed_definition():
    module = PlainMLP().eval()  # no dropout: both calls must compute the same function
    adapter = FeedDefinitionModel(ModelWrap(module, ClassifierFeedDefinition()))
    wrapper = TTDataParallel(adapter)
    x, y = classification_data(6).tensors
    torch.testing.assert_close(wrapper.get_loss((x, y), nn.CrossEntropyLoss(), CPU),
                               nn.CrossEntropyLoss()(module(x), y))


@pytest.mark.skipif(torch.cuda.is_available(), reason='TrainLoop moves the model to the GPU itself there')
def test_train_loop_trains_a_data_parallel_model_like_the_bare_model():
    data = DataLoader(classification_data(12), batch_size=4)

    def train(wrap):
        torch.manual_seed(0)
        module = PlainMLP()
        model = FeedDefinitionModel(ModelWrap(module, ClassifierFeedDefinition()))
        model = TTDataParallel(model) if wrap else model
        TrainLoop(model, data, None, None, torch.optim.SGD(module.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                  end_auto_eval=False, show_progress=False).fit(num_epochs=2)
        return module

    for got, want in zip(train(True).parameters(), train(False).parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- TTDistributedDataParallel ---------------------------------------------------------------------------
@pytest.fixture
def single_process_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group('gloo', init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_distributed_wrapper_in_one_process(single_process_group):
    model = CountingRegressor()
    wrapper = TTDistributedDataParallel(model)
    assert isinstance(wrapper, nn.parallel.DistributedDataParallel) and isinstance(wrapper, TTParallelBase)
    assert_loss_and_grads_match_plain_model(wrapper, model.parameters())
    assert model.forward_calls == 1 and wrapper.loss_calls == 1
    assert wrapper.get_predictions(regression_batch(), CPU)[2] == {'who': ['TTDistributedDataParallel']}
    assert wrapper.static_helper(2) == 3
    with pytest.raises(AttributeError):
        wrapper.read_secret()


def _two_rank_gradients(rank, world_size):
    model = CountingRegressor()
    wrapper = TTDistributedDataParallel(model)
    x, y = regression_batch(8)
    half = slice(rank * 4, rank * 4 + 4)
    wrapper.get_loss((x[half], y[half]), nn.MSELoss(), CPU).backward()  # DDP averages the ranks' gradients
    return [p.grad.clone() for p in model.parameters()]


def test_distributed_wrapper_averages_gradients_across_two_processes():
    grads = run_distributed(_two_rank_gradients, world_size=2)
    reference = CountingRegressor()
    reference.get_loss(regression_batch(8), nn.MSELoss(), CPU).backward()
    for rank_grads in grads:
        for got, want in zip(rank_grads, reference.parameters()):
            torch.testing.assert_close(got, want.grad)
