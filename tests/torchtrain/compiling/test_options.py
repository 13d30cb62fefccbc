"""TrainLoop's torch_compile argument: what it accepts and the errors for what it does not."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.compiling import CompileOptions
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data


@pytest.mark.parametrize("argument", [False, None])
def test_off(argument):
    assert CompileOptions.from_argument(argument) is None


def test_true_is_torch_defaults_with_errors_and_the_optimizer_step():
    options = CompileOptions.from_argument(True)
    assert options.torch_kwargs == {} and options.fallback == "error" and options.optimizer_step


def test_a_dict_splits_torch_compile_arguments_from_trainloop_ones():
    options = CompileOptions.from_argument({"backend": "aot_eager", "fullgraph": True, "dynamic": False,
                                            "fallback": "eager", "optimizer_step": False})
    assert options.torch_kwargs == {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    assert options.fallback == "eager" and not options.optimizer_step
    # fullgraph and dynamic concern the forward only: every torch optimizer's step has deliberate graph breaks.
    assert options.optimizer_kwargs == {"backend": "aot_eager"}


@pytest.mark.parametrize("argument, error, message", [
    ("inductor", TypeError, "torch_compile must be False, True or a dict"),
    (1, TypeError, "torch_compile must be False, True or a dict"),
    ({"backnd": "aot_eager"}, ValueError, r"unknown keys \['backnd'\].*'backend'"),
    ({"fallback": "cpu"}, ValueError, r"fallback'\] must be one of \['error', 'eager'\]"),
    ({"optimizer_step": "yes"}, TypeError, r"optimizer_step'\] must be True or False"),
    ({"fullgraph": 1}, TypeError, r"fullgraph'\] must be True or False"),
    ({"mode": "max-autotune", "options": {"trace.enabled": True}}, ValueError, "'mode' or 'options', not both"),
])
def test_bad_arguments_are_refused_by_the_constructor(argument, error, message):
    model = MLP()
    with pytest.raises(error, match=message):
        TrainLoop(model, DataLoader(classification_data(), batch_size=8), None, None,
                  torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), torch_compile=argument)


def test_compile_stats_is_none_without_torch_compile():
    model = MLP()
    tl = TrainLoop(model, DataLoader(classification_data(), batch_size=8), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    assert tl.compile_stats is None


def test_dataparallel_mode_is_refused():
    model = MLP()
    with pytest.raises(ValueError, match="torch_compile does not work with gpu_mode='dp'.*gpu_mode='ddp'"):
        TrainLoop(model, DataLoader(classification_data(), batch_size=8), None, None,
                  torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), gpu_mode="dp",
                  torch_compile=True)
