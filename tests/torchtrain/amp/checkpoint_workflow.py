"""apex's checkpoint workflow (seed 001), shared by test_checkpoint.py and the fresh process it starts.

Every step draws its batch from a generator seeded with the step number and the model has no dropout, so
a run resumed at any step sees exactly the data and randomness of an uninterrupted run: only the saved
model, optimizer and amp state carry it on.
"""
from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from aitoolbox.torchtrain import amp

NUM_STEPS = 6
CHECKPOINT_STEP = 3
OVERFLOW_STEP = 1  # before the checkpoint, so the saved loss scale is not the initial one
CASES: List[Tuple[str, int]] = [(level, losses) for level in ("O0", "O1", "O2", "O3") for losses in (1, 2)]


class CheckpointNet(nn.Module):
    """Linear + BatchNorm body (running statistics to restore) with a classification and a regression head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.classifier = nn.Linear(16, 3)
        self.regressor = nn.Linear(16, 1)

    def forward(self, x):
        hidden = self.body(x)
        return self.classifier(hidden), self.regressor(hidden)


def build(opt_level: str, num_losses: int):
    """O1 and O2 ask for apex's dynamic scaling (bfloat16's default is none), so a changed scale is restored."""
    torch.manual_seed(0)
    model = CheckpointNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_scale = "dynamic" if opt_level in ("O1", "O2") else None
    return amp.initialize(model, optimizer, opt_level=opt_level, num_losses=num_losses, loss_scale=loss_scale,
                          verbosity=0)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, num_losses: int, start: int, stop: int) -> None:
    """Steps ``start`` .. ``stop - 1``; one scale_loss per loss, an injected overflow at OVERFLOW_STEP."""
    dynamic = amp.state_of(optimizer).loss_scalers[-1].dynamic
    model.train()
    for step in range(start, stop):
        generator = torch.Generator().manual_seed(100 + step)
        x = torch.randn(8, 6, generator=generator)
        labels = torch.randint(0, 3, (8,), generator=generator)
        targets = torch.randn(8, 1, generator=generator)
        logits, values = model(x)
        losses = [F.cross_entropy(logits, labels), F.mse_loss(values, targets)]
        if num_losses == 1:
            losses = [losses[0] + losses[1]]
        for loss_id, loss in enumerate(losses):
            with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward(retain_graph=loss_id < len(losses) - 1)  # the losses share the body
                if step == OVERFLOW_STEP and dynamic and loss_id == num_losses - 1:
                    model.body[0].weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()


def checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, dict]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}


def outcome(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, object]:
    """What must agree bitwise: model parameters and buffers, stepped (master) parameters, amp state."""
    return {"params": [t.detach().clone() for t in model.state_dict(keep_vars=True).values()],
            "raw_params": [p.detach().clone() for p in model.parameters()],
            "masters": [p.detach().clone() for p in amp.master_params(optimizer)],
            "scalers": {k: v for k, v in amp.state_of(optimizer).state_dict().items() if k.startswith("loss_scaler")}}


def resume(path: str, opt_level: str, num_losses: int, load_amp: bool = True, amp_first: bool = False):
    """The restore half of the workflow: initialize, then load model, optimizer and amp state, then train on.

    ``amp_first`` loads the amp state before the model and optimizer instead of after them (apex's order).
    """
    model, optimizer = build(opt_level, num_losses)
    saved = torch.load(path, weights_only=True)
    if load_amp and amp_first:
        amp.load_state_dict(saved["amp"])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if load_amp and not amp_first:
        amp.load_state_dict(saved["amp"])
    train(model, optimizer, num_losses, CHECKPOINT_STEP, NUM_STEPS)
    return model, optimizer
