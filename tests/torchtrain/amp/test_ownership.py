"""Who keeps whom alive: a model and optimizer own their amp state, never the other way round.

A notebook that trains several models in a row must get each model's memory (float32 master weights
included) back once it drops the model: after ``del`` and ``gc.collect()`` nothing of an ``amp.initialize``
call may survive, while the state stays reachable for as long as the model or optimizer lives.
"""
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp


def prepared(opt_level, with_optimizer=True):
    """With dynamic loss scaling wherever the level allows it: the scalers' state is part of what must go."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    loss_scale = "dynamic" if opt_level in ("O1", "O2") else None
    if not with_optimizer:
        return amp.initialize(model, opt_level=opt_level, loss_scale=loss_scale, verbosity=0), None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=loss_scale, verbosity=0)


def train_steps(model, optimizer, steps=3):
    """Real steps: the hooks, the stash of unscaled gradients and the masters' updates all take part."""
    for step in range(steps):
        x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def stepped_tensors(optimizer):
    """What the optimizer updates: the float32 masters under O2, the model's parameters otherwise."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def assert_all_collected(refs):
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after del + gc.collect(): {alive}"


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_model_optimizer_state_and_masters_are_freed_after_training(opt_level):
    model, optimizer = prepared(opt_level)
    train_steps(model, optimizer)
    state = amp.state_of(optimizer)
    refs = {"model": weakref.ref(model), "optimizer": weakref.ref(optimizer), "state": weakref.ref(state)}
    refs.update({f"stepped{i}": weakref.ref(t) for i, t in enumerate(stepped_tensors(optimizer))})
    refs.update({f"scaler{i}": weakref.ref(s) for i, s in enumerate(state.loss_scalers)})
    if opt_level == "O2":
        assert state.master_weights is not None
        assert all(t.dtype == torch.float32 for t in stepped_tensors(optimizer))
        refs["master_weights"] = weakref.ref(state.master_weights)
    del model, optimizer, state
    assert_all_collected(refs)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_model_initialized_without_optimizer_is_freed(opt_level):
    model, _ = prepared(opt_level, with_optimizer=False)
    model(torch.randn(2, 4))
    refs = {"model": weakref.ref(model), "state": weakref.ref(amp.state_of(model))}
    del model
    assert_all_collected(refs)


def test_the_state_lives_as_long_as_its_model_and_optimizer():
    model, optimizer = prepared("O2")
    state_ref = weakref.ref(amp.state_of(optimizer))
    gc.collect()
    assert amp.state_of(optimizer) is state_ref() is amp.state_of(model)
    assert state_ref().models == [model] and state_ref().optimizers == [optimizer]
    train_steps(model, optimizer)  # still usable
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 3


def test_dropping_only_the_optimizer_frees_its_masters():
    """A new optimizer for a model kept: the old optimizer's float32 masters must not stay behind."""
    model, optimizer = prepared("O2")
    train_steps(model, optimizer, steps=1)
    model_params = {id(p) for p in model.parameters()}  # BatchNorm stays float32: stepped as it is
    master_refs = [weakref.ref(t) for t in stepped_tensors(optimizer) if id(t) not in model_params]
    assert len(master_refs) == 4  # the two Linear layers' weights and biases
    state = amp.state_of(model)
    del optimizer
    gc.collect()
    assert all(ref() is None for ref in master_refs)
    assert state.optimizers == [] and state.master_weights.optimizers == []
    assert state.master_weights.state_dict() == []


def test_successive_models_in_a_loop_do_not_accumulate():
    refs = []
    for _ in range(3):
        model, optimizer = prepared("O2")
        train_steps(model, optimizer, steps=1)
        refs.append(weakref.ref(model))
    del model, optimizer
    assert_all_collected({f"model{i}": ref for i, ref in enumerate(refs)})


def test_state_dict_after_the_models_were_freed_says_why():
    model, optimizer = prepared("O1")
    del model, optimizer
    gc.collect()
    with pytest.raises(RuntimeError, match="keep a reference to the model and optimizer"):
        amp.state_dict()
