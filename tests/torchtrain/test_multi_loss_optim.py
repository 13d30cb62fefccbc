"""MultiLoss and MultiOptimizer on real tensors, optimizers and a (disabled or enabled) GradScaler."""
import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer


def disabled_scaler():
    return torch.amp.GradScaler('cpu', enabled=False)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 4)
        self.head_a = nn.Linear(4, 1)
        self.head_b = nn.Linear(4, 1)

    def losses(self, x):
        hidden = torch.relu(self.trunk(x))
        return self.head_a(hidden).pow(2).mean(), self.head_b(hidden).abs().mean()


def test_default_map_follows_dict_order():
    multi_loss = MultiLoss({'b': torch.tensor(1.), 'a': torch.tensor(2.)})
    assert multi_loss.optimizer_loss_map == {0: 'b', 1: 'a'}


def test_explicit_map_is_inverted():
    multi_loss = MultiLoss({'x': torch.tensor(1.), 'y': torch.tensor(2.)}, {'x': 1, 'y': 0})
    assert multi_loss.optimizer_loss_map == {1: 'x', 0: 'y'}


def test_map_of_wrong_length_is_rejected():
    with pytest.raises(ValueError, match='loss_optimizer_map'):
        MultiLoss({'x': torch.tensor(1.), 'y': torch.tensor(2.)}, {'x': 0})


def test_behaves_as_a_mutable_mapping():
    multi_loss = MultiLoss({'x': torch.tensor(1.)})
    multi_loss['y'] = torch.tensor(3.)
    assert list(multi_loss) == ['x', 'y'] and len(multi_loss) == 2
    assert multi_loss.item() == {'x': 1.0, 'y': 3.0}
    del multi_loss['x']
    assert multi_loss.get_loss_dict().keys() == {'y'}


def test_tensor_methods_apply_to_every_loss_and_keep_settings():
    multi_loss = MultiLoss({'x': torch.tensor(4., requires_grad=True), 'y': torch.tensor(8.)},
                           {'x': 1, 'y': 0}, retain_graph_until_last=False)
    multi_loss.loss_backward_remaining = 1
    halved = (multi_loss / 2).detach().cpu().to(torch.float64)
    assert isinstance(halved, MultiLoss)
    assert halved.item() == {'x': 2.0, 'y': 4.0}
    assert halved['x'].dtype == torch.float64 and not halved['x'].requires_grad
    assert halved.loss_optimizer_map == {'x': 1, 'y': 0} and halved.retain_graph_until_last is False
    assert halved.loss_backward_remaining == 1
    assert halved.device == {'x': torch.device('cpu'), 'y': torch.device('cpu')}
    assert multi_loss['x'].item() == 4.0  # the original is untouched


class WeightedMultiLoss(MultiLoss):
    """A subclass with its own constructor, attributes and backward (1.x lets a subclass decide how each loss is
    back-propagated)."""

    def __init__(self, loss_dict, weights):
        super().__init__(loss_dict)
        self.weights = weights
        self.backward_calls = []

    def backward(self, optimizer_idx, iteration, amp_grad_scaler):
        self.backward_calls.append(optimizer_idx)
        weighted = self.weights[optimizer_idx] * self.loss_dict[self.optimizer_loss_map[optimizer_idx]]
        amp_grad_scaler.scale(weighted).backward(retain_graph=self.loss_backward_remaining > 1)
        self.loss_backward_remaining -= 1


@pytest.mark.parametrize('method', ['truediv', 'detach', 'item', 'cpu', 'to'])
def test_a_subclass_stays_itself_through_the_tensor_methods(method):
    """aitoolbox 1.7's division returned the MultiLoss itself (its losses divided); 1.8's, and this package's until
    now, a plain MultiLoss: the subclass's backward was never called on the loss the loop divides by
    grad_accumulation."""
    weighted = WeightedMultiLoss({'x': torch.tensor(4., requires_grad=True), 'y': torch.tensor(8.)}, [0.5, 3.0])
    weighted.loss_backward_remaining = 1
    result = {'truediv': lambda: weighted / 2, 'detach': weighted.detach, 'item': weighted.item,
              'cpu': weighted.cpu, 'to': lambda: weighted.to(torch.float64)}[method]()
    assert type(result) is WeightedMultiLoss
    assert result.weights == [0.5, 3.0] and result.backward_calls is weighted.backward_calls
    assert result.loss_backward_remaining == 1 and result.optimizer_loss_map == {0: 'x', 1: 'y'}
    assert result is not weighted and weighted.item() == {'x': 4.0, 'y': 8.0}  # the original is untouched


class NamedLosses(MultiLoss):
    """Reaches its losses as attributes (``loss.main``), by a ``__getattr__`` that reads ``self.loss_dict``."""

    __slots__ = ("tag",)

    def __getattr__(self, name):
        try:
            return self.loss_dict[name]
        except KeyError:
            raise AttributeError(name) from None


def test_a_subclass_whose_getattr_reads_its_losses_is_divided_and_keeps_its_slots():
    """The copy is built field by field: copy.copy probed the half-built object for ``__setstate__``, whose
    ``__getattr__`` then read the missing ``loss_dict`` and recursed (grad_accumulation > 1 crashed)."""
    named = NamedLosses({'main': torch.tensor(2., requires_grad=True), 'aux': torch.tensor(4.)})
    named.tag = "run 7"
    halved = named / 2
    assert type(halved) is NamedLosses and halved.tag == "run 7"
    assert halved.main.item() == 1.0 and halved.aux.item() == 2.0 and named.main.item() == 2.0


class PrivateSlot(MultiLoss):
    __slots__ = ("__weight",)

    def set_weight(self, weight):
        self.__weight = weight

    def weight(self):
        return self.__weight


class OwnCopy(MultiLoss):
    copies = 0

    def __copy__(self):
        OwnCopy.copies += 1
        new = OwnCopy(dict(self.loss_dict))
        new.__dict__.update({key: value for key, value in vars(self).items() if key != "loss_dict"})
        return new


def test_a_private_slot_is_copied_and_a_subclass_copy_is_used():
    """A private slot is stored under its mangled name (review 46: the divided copy lost it); a subclass's own
    ``__copy__`` says how it is copied."""
    private = PrivateSlot({'x': torch.tensor(2.)})
    private.set_weight(0.25)
    assert (private / 2).weight() == 0.25
    OwnCopy.copies = 0
    copied = OwnCopy({'x': torch.tensor(2.)}) / 2
    assert type(copied) is OwnCopy and OwnCopy.copies == 1 and copied['x'].item() == 1.0


def test_a_divided_subclass_back_propagates_with_its_own_backward():
    model = TwoHeads()
    loss_a, loss_b = model.losses(torch.randn(5, 3, generator=torch.Generator().manual_seed(1)))
    expected = torch.autograd.grad(0.5 * (loss_a / 4) + 3.0 * (loss_b / 4), list(model.parameters()),
                                   retain_graph=True)
    weighted = WeightedMultiLoss({'a': loss_a, 'b': loss_b}, [0.5, 3.0])
    divided = weighted / 4
    for optimizer_idx in (0, 1):
        divided.backward(optimizer_idx, 0, disabled_scaler())
    assert weighted.backward_calls == [0, 1]
    for parameter, gradient in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, gradient, rtol=1e-6, atol=0)


def test_shared_graph_backward_retains_until_last_and_matches_autograd():
    model = TwoHeads()
    x = torch.randn(5, 3)
    loss_a, loss_b = model.losses(x)
    multi_loss = MultiLoss({'a': loss_a, 'b': loss_b})

    multi_loss.backward(0, 0, disabled_scaler())
    assert multi_loss.loss_backward_remaining == 1
    multi_loss.backward(1, 0, disabled_scaler())  # would fail had the first call freed the shared graph
    assert multi_loss.loss_backward_remaining == 0

    reference = TwoHeads()
    ref_a, ref_b = reference.losses(x)
    (ref_a + ref_b).backward()
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)


def test_without_retain_graph_second_backward_of_shared_graph_fails():
    loss_a, loss_b = TwoHeads().losses(torch.randn(5, 3))
    multi_loss = MultiLoss({'a': loss_a, 'b': loss_b}, retain_graph_until_last=False)
    multi_loss.backward(0, 0, disabled_scaler())
    with pytest.raises(RuntimeError):
        multi_loss.backward(1, 0, disabled_scaler())


def test_enabled_scaler_scales_the_loss():
    weight = torch.tensor(1.0, requires_grad=True)
    scaler = torch.amp.GradScaler('cpu', init_scale=8.0)
    MultiLoss({'only': weight * 3}).backward(0, 0, scaler)
    assert weight.grad.item() == pytest.approx(24.0)


def test_multi_optimizer_steps_and_zeroes_only_the_indexed_optimizer():
    model = TwoHeads()
    opt_a = torch.optim.SGD(model.head_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.head_b.parameters(), lr=0.1)
    multi_opt = MultiOptimizer([opt_a, opt_b])
    assert len(multi_opt) == 2 and multi_opt[1] is opt_b and multi_opt.optimizer_list == [opt_a, opt_b]

    loss_a, loss_b = model.losses(torch.randn(5, 3))
    multi_loss = MultiLoss({'a': loss_a, 'b': loss_b})
    before_b = model.head_b.weight.detach().clone()
    before_a = model.head_a.weight.detach().clone()
    multi_loss.backward(0, 0, disabled_scaler())
    multi_opt.step(0, 0, disabled_scaler())
    assert not torch.equal(model.head_a.weight, before_a)
    assert torch.equal(model.head_b.weight, before_b)

    multi_loss.backward(1, 0, disabled_scaler())
    multi_opt.zero_grad(0, 0)
    assert model.head_a.weight.grad is None
    assert model.head_b.weight.grad is not None


def test_multi_optimizer_state_dict_round_trip():
    def make():
        model = TwoHeads()
        return model, MultiOptimizer([torch.optim.Adam(model.head_a.parameters(), lr=0.01),
                                      torch.optim.Adam(model.head_b.parameters(), lr=0.02)])

    model, multi_opt = make()
    loss_a, loss_b = model.losses(torch.randn(5, 3))
    MultiLoss({'a': loss_a, 'b': loss_b}).backward(0, 0, disabled_scaler())
    multi_opt.step(0, 0, disabled_scaler())
    state = multi_opt.state_dict()
    assert isinstance(state, list) and len(state) == 2

    _, restored = make()
    restored.load_state_dict(state)
    assert restored.state_dict()[0]['state'][0]['step'] == state[0]['state'][0]['step']
    assert restored[1].param_groups[0]['lr'] == 0.02


def test_multi_optimizer_load_state_dict_validates():
    multi_opt = MultiOptimizer([torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)])
    with pytest.raises(TypeError, match='list'):
        multi_opt.load_state_dict({'state': {}})
    with pytest.raises(ValueError, match='1 optimizers'):
        multi_opt.load_state_dict([{}, {}])
