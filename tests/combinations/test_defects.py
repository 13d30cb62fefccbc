"""Named regression tests for the defects found where two features meet (one test per defect; the matrix of
combinations is test_matrix.py). Each compares TrainLoop with a hand-written loop or with a plain run."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    MLP, IterableTensorData, StepCounter, assert_params_equal, classification_data, model_pair, seeded_loader)


def plain_loop(model, loader, use_amp=False, **kwargs) -> TrainLoop:
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     end_auto_eval=False, show_progress=False, use_amp=use_amp, **kwargs)


# --- get_num_training_steps counts what the loop does ------------------------------------------------------
@pytest.mark.parametrize("num_samples, grad_accumulation, num_epochs, steps", [(10, 4, 2, 6), (3, 4, 1, 1)])
def test_get_num_training_steps_counts_the_epoch_end_steps(num_samples, grad_accumulation, num_epochs, steps):
    """One sample a batch: 10 batches with accumulation 4 step at batches 4, 8 and 10 of each epoch (1.x's
    floor said 4 for two epochs), and 3 batches with accumulation 4 step once, at the epoch's end (1.x: 0)."""
    model = MLP()
    tl = plain_loop(model, DataLoader(classification_data(num_samples), batch_size=1))
    counter = StepCounter()
    tl.fit(num_epochs=num_epochs, grad_accumulation=grad_accumulation, callbacks=[counter])
    assert tl.get_num_training_steps() == len(counter.step_iterations) == steps


# --- every optimizer step gets the same hooks -----------------------------------------------------------------
class DueAtStep(AbstractCallback):
    """Records, for each optimizer step, whether a gradient hook with optimizer_step_due came right before it."""

    def __init__(self):
        super().__init__("due at step")
        self.announced, self.steps = False, []

    def on_after_gradient_update(self, optimizer_idx):
        self.announced |= self.train_loop_obj.optimizer_step_due

    def on_after_optimizer_step(self):
        self.steps.append(self.announced)
        self.announced = False


def test_the_epoch_end_step_of_a_loader_without_len_is_clipped():
    """A loader without len: its last, partial window steps at the epoch's end; GradNormClip must clip that step
    too (weights bitwise those of a hand loop that clips before every step)."""
    data = classification_data(30)
    model, reference = model_pair(MLP, dropout=0.0)
    due = DueAtStep()
    tl = plain_loop(model, DataLoader(IterableTensorData(data), batch_size=4))
    tl.fit(num_epochs=2, grad_accumulation=3, callbacks=[GradNormClip(0.05), due])
    assert due.steps == [True] * 6  # 8 batches an epoch: steps at batches 3, 6 and the epoch end (2 batches)

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    for _ in range(2):
        batches = list(DataLoader(IterableTensorData(data), batch_size=4))
        for index, (x, y) in enumerate(batches):
            (criterion(reference(x), y) / 3).backward()
            if (index + 1) % 3 == 0 or index + 1 == len(batches):
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
                optimizer.step()
                optimizer.zero_grad()
    assert_params_equal(model, reference)


# --- an abandoned step leaves no precision state behind ---------------------------------------------------------
class FailOnceAfterClipping(AbstractCallback):
    """Raises in on_after_gradient_update of one step, after GradNormClip unscaled and clipped (runs after it)."""

    def __init__(self, at_iteration: int):
        super().__init__("fail once", execution_order=10)
        self.at_iteration, self.failed = at_iteration, False

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if not self.failed and tl.total_iteration_idx == self.at_iteration and tl.optimizer_step_due:
            self.failed = True
            raise RuntimeError("a failure between unscale_ and the step")


def test_an_exception_between_unscale_and_step_does_not_leak_into_the_next_fit():
    """With loss scaling (1024) and clipping: a fit stopped after the clipping callback unscaled, then continued,
    ends bitwise where a straight run does (before the fix the next step ran on still-scaled gradients)."""
    def run(fail_at):
        torch.manual_seed(0)
        model = MLP(dropout=0.0)  # the window before the failure is trained again: no randomness to replay
        tl = plain_loop(model, seeded_loader(classification_data(40)), use_amp={"init_scale": 1024.0})
        callbacks = [GradNormClip(1.0)] + ([FailOnceAfterClipping(fail_at)] if fail_at is not None else [])
        if fail_at is not None:
            with pytest.raises(RuntimeError, match="between unscale_ and the step"):
                tl.fit(num_epochs=3, grad_accumulation=2, callbacks=callbacks)
            callbacks = None  # registered by the first call
        tl.fit(num_epochs=3, grad_accumulation=2, callbacks=callbacks)
        return model, tl

    straight, straight_tl = run(None)
    continued, continued_tl = run(fail_at=8)
    assert_params_equal(continued, straight)
    assert continued_tl.precision.loss_scaler.loss_scale == straight_tl.precision.loss_scaler.loss_scale
