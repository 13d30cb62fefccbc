"""torch_compile's check of the compiled gradients against eager ones, on the quickstart CNN with inductor (the
case that trained silently wrong: torch 2.13's inductor on the CPU computed exactly zero convolution gradients)."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.compiling.verify import CompiledGradientsDiffer, gradient_differences
from aitoolbox.torchtrain.train_loop import TrainLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from quickstart import DigitsCNN, digits_loaders  # noqa: E402


def test_gradient_differences_name_missing_zero_non_finite_and_distant_gradients():
    eager = {"a": torch.ones(3), "b": torch.ones(3), "c": torch.ones(3), "d": torch.ones(3), "e": torch.ones(3)}
    compiled = {"b": torch.zeros(3), "c": torch.tensor([1.0, float("nan"), 1.0]), "d": torch.full((3,), 1.1),
                "e": torch.full((3,), 1.0001)}
    assert gradient_differences(eager, compiled, tolerance=1e-3) == [
        "a (no gradient when compiled)", "b (all zero when compiled)", "c (not finite when compiled)",
        "d (relative difference 0.1)"]


@pytest.mark.slow
@pytest.mark.extended
def test_inductor_on_the_quickstart_cnn_is_caught_when_it_computes_wrong_gradients():
    """Whether this torch's inductor miscompiles the CNN is measured here with plain torch.compile (dropout off,
    as the check compares); TrainLoop must stop exactly when it does, naming the convolutions."""
    torch.manual_seed(0)
    model = DigitsCNN()
    train, _, _ = digits_loaders(64, seed=0)
    images, labels = next(iter(train))
    criterion = nn.CrossEntropyLoss()
    model.classifier[3].eval()

    def gradients(forward):
        model.zero_grad()
        criterion(forward(images), labels).backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    eager = gradients(model)
    miscompiled = bool(gradient_differences(eager, gradients(torch.compile(model)), tolerance=1e-3))
    torch._dynamo.reset()
    model.classifier[3].train()
    model.zero_grad()

    tl = TrainLoop(model, train, None, None, torch.optim.Adam(model.parameters(), lr=1e-3), criterion,
                   end_auto_eval=False, show_progress=False, torch_compile=True)
    if miscompiled:
        with pytest.raises(CompiledGradientsDiffer, match=r"features\.0\.weight"):
            tl.fit(num_iterations=1)
    else:
        tl.fit(num_iterations=1)
        assert tl._compiler._verified
