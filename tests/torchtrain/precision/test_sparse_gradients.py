"""Sparse gradients (``nn.Embedding(sparse=True)``) under loss scaling: unscaled and checked as
``torch.amp.GradScaler`` does it (the fused kernel takes only dense tensors: a sparse gradient's values are
unscaled, a float16 one coalesced first)."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.precision.loss_scaler import LossScaler
from aitoolbox.torchtrain.precision.master_weights import unscale_into
from aitoolbox.torchtrain.train_loop import TrainLoop

VOCABULARY, WIDTH, CLASSES = 50, 8, 3


class BagOfWords(TTModel):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(dim=1))

    def get_loss(self, batch_data, criterion, device):
        tokens, labels = batch_data
        return criterion(self(tokens.to(device)).float(), labels.to(device))

    def get_predictions(self, batch_data, device):
        tokens, labels = batch_data
        return self(tokens.to(device)).argmax(dim=1).cpu(), labels, None


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCABULARY, (24, 5), generator=generator),
                         torch.randint(0, CLASSES, (24,), generator=generator))


def _model_and_optimizer():
    torch.manual_seed(0)
    model = BagOfWords()
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def test_sparse_gradients_under_the_grad_scaler_configuration_train_as_torch_grad_scaler():
    """aitoolbox 1.8's ``use_amp`` dict (GradScaler arguments): bitwise what autocast + ``torch.amp.GradScaler`` give
    (before: ``_amp_foreach_non_finite_check_and_unscale_`` refused the SparseCPU gradient)."""
    model, optimizer = _model_and_optimizer()
    tl = TrainLoop(model, DataLoader(_data(), batch_size=6), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp={"init_scale": 1024.0})
    tl.fit(num_epochs=2)

    reference, reference_optimizer = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    criterion = nn.CrossEntropyLoss()
    for _ in range(2):
        for tokens, labels in DataLoader(_data(), batch_size=6):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(reference(tokens).float(), labels)
            scaler.scale(loss).backward()
            scaler.step(reference_optimizer)
            scaler.update()
            reference_optimizer.zero_grad()
    assert not torch.equal(model.embedding.weight, _model_and_optimizer()[0].embedding.weight)  # it trained
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert tl.precision.loss_scaler.loss_scale == scaler.get_scale()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_overflow_in_a_sparse_gradient_is_found_and_the_values_unscaled(dtype):
    """The verdict reads the values of the sparse gradient, which are divided in place."""
    indices = torch.tensor([[0, 2, 2]])
    finite = torch.sparse_coo_tensor(indices, torch.tensor([4.0, 8.0, 8.0], dtype=dtype), (4,), check_invariants=True)
    infinite = torch.sparse_coo_tensor(indices, torch.tensor([4.0, float("inf"), 8.0], dtype=dtype), (4,))
    scaler = LossScaler(4.0)
    assert not scaler.unscale_grads([finite])
    assert torch.equal(finite.to_dense(), torch.tensor([1.0, 0.0, 4.0, 0.0], dtype=dtype))
    assert scaler.unscale_grads([infinite])
    assert LossScaler.has_overflow([infinite]) and not LossScaler.has_overflow([finite])


def test_a_float16_sparse_gradient_is_coalesced_before_the_check():
    """Two finite float16 values at one index whose sum overflows: the gradient the optimizer would apply is inf, so
    the check must see the coalesced values (as torch.amp.GradScaler does)."""
    param = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    param.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([60000.0, 60000.0],
                                                                             dtype=torch.float16), (4,))
    assert unscale_into([(param, param)], LossScaler(1.0))
    assert param.grad.is_coalesced()


def test_sparse_gradients_under_o2_with_dynamic_scaling_and_accumulation_train():
    """Master weights: the bfloat16 model's sparse gradients are moved, unscaled, into the float32 masters (summed
    there over the accumulation window) and the step takes them; it trains, and stays finite."""
    model, optimizer = _model_and_optimizer()
    initial = model.embedding.weight.detach().clone()
    tl = TrainLoop(model, DataLoader(_data(), batch_size=6), None, None, optimizer, nn.CrossEntropyLoss(),
                   end_auto_eval=False, show_progress=False, use_amp={"opt_level": "O2", "loss_scale": "dynamic"})
    tl.fit(num_epochs=2, grad_accumulation=2)
    weight = model.embedding.weight.detach().float()
    assert torch.isfinite(weight).all()
    assert not torch.equal(weight, initial.to(weight.dtype))
    assert tl.precision.loss_scaler.loss_scale == 2.0 ** 16  # no step skipped
