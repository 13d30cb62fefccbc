"""TrainLoop.lr_find: the run is put back bitwise, the learning rates follow the schedule, the suggestion lands where
the problem's curvature says it must, and every rank of a distributed job gets the same one."""
import copy
import json
import math
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler, StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.lr_finder import lr_schedule
from aitoolbox.torchtrain.train_loop.lr_suggestion import (
    LRFinderResult, longest_valley, smoothed_losses, suggestion_index)
from tests.helpers import MLP, HookRecorder, assert_params_equal, classification_data, model_pair, seeded_loader

AMP_MODES = [False, {"opt_level": "O1", "dtype": torch.bfloat16}, {"opt_level": "O2", "dtype": torch.bfloat16},
             {"opt_level": "O3", "dtype": torch.bfloat16},
             # float16 with dynamic loss scaling (the scaler's state must come back too): CUDA only
             pytest.param(True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def make_loop(model, use_amp=False, torch_compile=False, samples=40):
    loader = seeded_loader(classification_data(samples), batch_size=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), use_amp=use_amp,
                     torch_compile=torch_compile, show_progress=False)


def assert_same_run(tl, straight):
    assert_params_equal(tl.model, straight.model)
    assert tl.train_history["loss"] == straight.train_history["loss"]
    assert tl.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    for index, state in straight.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(tl.optimizer.state_dict()["state"][index][key], value), (index, key)


def search(tl, **kwargs):
    options = dict(num_iterations=15, start_lr=1e-4, end_lr=1.0)
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the curves of these tiny problems are not the point
        return tl.lr_find(**options)


# --- the run afterwards is the run without the search -----------------------------------------------------------
@pytest.mark.parametrize("use_amp", AMP_MODES, ids=["fp32", "O1-bf16", "O2-bf16", "O3-bf16", "fp16-cuda"])
def test_fit_after_lr_find_is_bitwise_fit_alone_with_dropout_amp_and_a_scheduler(use_amp):
    model, twin = model_pair(MLP)  # MLP has dropout: the RNG must be put back too
    straight = make_loop(twin, use_amp)
    torch.manual_seed(0)
    straight.fit(num_epochs=2, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])

    tl = make_loop(model, use_amp)
    scheduler = StepLRScheduler(step_size=1, gamma=0.5)
    torch.manual_seed(0)
    result = search(tl, callbacks=[scheduler], grad_accumulation=2)  # the scheduler is registered, not run
    assert len(result.lrs) > 2
    assert tl.total_iteration_idx == -1 and tl.epochs_completed == 0 and len(tl.train_history["loss"]) == 0
    tl.fit(num_epochs=2, callbacks=[scheduler])
    assert_same_run(tl, straight)


def test_a_strict_history_does_not_refuse_a_search_before_any_epoch():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    tl.train_history.strict_content_check = True  # an empty history raises where a result is expected from it
    assert search(tl).suggestion is not None


def test_lr_find_between_two_fits_leaves_the_second_fit_unchanged():
    model, twin = model_pair(MLP)
    straight = make_loop(twin)
    torch.manual_seed(0)
    straight.fit(num_epochs=1, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])
    straight.fit(num_epochs=3)

    tl = make_loop(model)
    torch.manual_seed(0)
    tl.fit(num_epochs=1, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])
    search(tl, num_iterations=20)
    tl.fit(num_epochs=3)
    assert_same_run(tl, straight)


class Interrupt(AbstractCallback):
    """Raises once, at a batch of the first epoch."""

    def __init__(self, at_batch):
        super().__init__("interrupt once")
        self.at_batch, self.fired = at_batch, False

    def on_batch_end(self):
        if not self.fired and self.train_loop_obj.iteration == self.at_batch:
            self.fired = True
            raise RuntimeError("stopped on purpose")


def test_lr_find_while_an_interrupted_fit_waits_to_continue():
    def interrupted():
        model_copy = MLP()
        model_copy.load_state_dict(start_weights)
        tl = make_loop(model_copy)
        torch.manual_seed(0)
        with pytest.raises(RuntimeError, match="on purpose"):
            tl.fit(num_epochs=2, callbacks=[Interrupt(at_batch=3)])
        return tl

    start_weights = model_pair(MLP)[0].state_dict()
    straight = interrupted()
    straight.fit(num_epochs=2)
    tl = interrupted()
    search(tl)
    tl.fit(num_epochs=2)
    assert_same_run(tl, straight)
    assert len(tl.train_history["loss"]) == 2


def test_lr_find_while_a_loaded_checkpoint_waits_for_fit():
    model, twin = model_pair(MLP)
    source = make_loop(twin)
    torch.manual_seed(0)
    source.fit(num_epochs=1)
    checkpoint = copy.deepcopy(source.checkpoint_state())  # (its tensors are the live ones)
    source.fit(num_epochs=2)  # the straight run

    tl = make_loop(model)
    tl.load_checkpoint(checkpoint)
    pending = tl.pending_restore
    torch.manual_seed(5)  # the checkpoint's RNG state, not this one, must drive the continuation
    search(tl)
    assert tl.pending_restore is pending
    tl.fit(num_epochs=2)
    assert_same_run(tl, source)


class FailingMLP(MLP):
    """Raises ``error`` at the ``fail_at``-th call of get_loss (counted from 1)."""

    def __init__(self, error=None, fail_at=0):
        super().__init__()
        self.error, self.fail_at, self.calls = error, fail_at, 0

    def get_loss(self, batch_data, criterion, device):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return super().get_loss(batch_data, criterion, device)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")], ids=["Ctrl-C", "exception"])
def test_an_exception_during_the_search_restores_the_run_and_is_raised(error):
    torch.manual_seed(0)
    model = FailingMLP(error, fail_at=6)
    twin = FailingMLP()
    twin.load_state_dict(model.state_dict())
    straight = make_loop(twin)
    torch.manual_seed(1)
    straight.fit(num_epochs=1)

    tl = make_loop(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    torch.manual_seed(1)
    with pytest.raises(type(error)):
        search(tl)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert tl.optimizer.param_groups[0]["lr"] == 0.01 and not tl.optimizer.state
    tl.fit(num_epochs=1)
    assert_same_run(tl, straight)


@pytest.mark.slow
def test_fit_after_lr_find_is_bitwise_fit_alone_compiled():
    compile_options = {"backend": "aot_eager"}
    model, twin = model_pair(MLP)
    straight = make_loop(twin, torch_compile=compile_options, samples=24)
    torch.manual_seed(0)
    straight.fit(num_epochs=2)

    tl = make_loop(model, torch_compile=compile_options, samples=24)
    torch.manual_seed(0)
    result = search(tl, num_iterations=8)
    assert len(result.lrs) == 8 and all(math.isfinite(loss) for loss in result.raw_losses)
    tl.fit(num_epochs=2)
    assert_same_run(tl, straight)
    assert tl.compile_stats.compiles >= straight.compile_stats.compiles  # the search's compilations are recorded


def test_callbacks_do_not_run_during_the_search_but_gradient_clipping_does():
    log = []
    model, twin = model_pair(MLP)
    tl = make_loop(model)
    clipped = search(tl, callbacks=[HookRecorder(log), GradNormClip(1e-3)], end_lr=10.0)
    assert [hook for _, hook, _ in log] == ["on_train_loop_registration"]  # nothing from the search itself

    free = search(make_loop(twin), end_lr=10.0)
    assert free.raw_losses[0] == clipped.raw_losses[0]  # the same first batch, before any step
    assert free.raw_losses[1:] != clipped.raw_losses[1:]  # the steps were clipped


# --- what the search trains with ----------------------------------------------------------------------------------
class Regression(TTModel):
    """``w . x`` without bias; records the first group's learning rate (and the second's) seen by each batch and
    each batch's loss."""

    def __init__(self, weights, two_groups=False):
        super().__init__()
        self.first = nn.Linear(len(weights), 1, bias=False)
        with torch.no_grad():
            self.first.weight.copy_(torch.tensor([weights], dtype=torch.float64))
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64)) if two_groups else None
        self.optimizer = None
        self.seen_lrs, self.batch_losses = [], []

    def forward(self, x):
        out = self.first(x).squeeze(1)
        return out * self.scale if self.scale is not None else out

    def get_loss(self, batch_data, criterion, device):
        if self.optimizer is not None:
            self.seen_lrs.append([group["lr"] for group in self.optimizer.param_groups])
        loss = criterion(self(batch_data[0].to(device)), batch_data[1].to(device))
        self.batch_losses.append(loss.detach().clone())
        return loss

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)), batch_data[1], None


def regression_loop(x, y, weights, batch_size, lr=0.1, two_groups=False, momentum=0.0):
    model = Regression(weights, two_groups).double()
    if two_groups:
        groups = [{"params": model.first.parameters()}, {"params": [model.scale], "lr": lr / 10}]
    else:
        groups = model.parameters()
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum)
    model.optimizer = optimizer
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    return TrainLoop(model, loader, None, None, optimizer, nn.MSELoss(), show_progress=False)


def quadratic_problem():
    """Four points whose mean squared error has the Hessian diag(s1^2, s2^2) = diag(4, 1): L = 4, so full-batch
    gradient descent diverges exactly for lr > 2 / L = 0.5 and contracts every component for lr < 0.5."""
    s1, s2 = 2.0, 1.0
    x = torch.tensor([[s1, 0.0], [-s1, 0.0], [0.0, s2], [0.0, -s2]], dtype=torch.float64)
    # H = 2/n X^T X = 2/4 * diag(2 s1^2, 2 s2^2) = diag(s1^2, s2^2)
    target_weights = torch.tensor([1.0, -3.0], dtype=torch.float64)
    return x, x @ target_weights, 2.0 / max(s1, s2) ** 2


@pytest.mark.parametrize("rule", ["valley", "steepest", "minimum"])
def test_the_suggestion_of_a_quadratic_lies_below_its_divergence_threshold(rule):
    x, y, critical_lr = quadratic_problem()
    tl = regression_loop(x, y, [0.0, 0.0], batch_size=4)
    result = tl.lr_find(start_lr=1e-4, end_lr=100.0, num_iterations=100, suggestion=rule)
    assert result.diverged and len(result.lrs) < 100
    raw = result.raw_losses
    # A step of gradient descent on a quadratic with lr <= 2/L lowers every component of the error: the loss
    # (measured before the step at index t, after the step with lrs[t - 1]) can rise only after a larger lr.
    first_rise = next(step for step in range(1, len(raw)) if raw[step] > raw[step - 1])
    assert result.lrs[first_rise - 1] > critical_lr
    # The optimum of a quadratic is lr = 1/L = critical_lr / 2; the rules stay below the edge and within 100x.
    assert critical_lr / 100 < result.suggestion < critical_lr, result.suggestion


@pytest.mark.filterwarnings("ignore:the loss never fell")  # one sample per batch: the curve is noise here
@pytest.mark.parametrize("mode", ["exponential", "linear"])
def test_the_learning_rate_follows_the_schedule_and_all_groups_keep_their_ratio(mode):
    x, y, _ = quadratic_problem()
    tl = regression_loop(x, y, [0.1, -0.2], batch_size=1, lr=0.1, two_groups=True)
    result = tl.lr_find(start_lr=1e-5, end_lr=1e-3, num_iterations=6, mode=mode, grad_accumulation=2)
    if mode == "exponential":
        expected = [1e-5 * 10 ** (step * 2 / 5) for step in range(6)]
    else:
        expected = [1e-5 + (1e-3 - 1e-5) * step / 5 for step in range(6)]
    assert result.lrs == pytest.approx(expected, rel=1e-12)
    assert not result.diverged
    seen = tl.model.seen_lrs
    assert len(seen) == 12  # two batches per step
    for batch, (first, second) in enumerate(seen):
        assert first == pytest.approx(expected[batch // 2], rel=1e-12)
        assert second == pytest.approx(expected[batch // 2] / 10, rel=1e-12)
    assert [group["lr"] for group in tl.optimizer.param_groups] == [0.1, 0.01]  # put back


def test_grad_accumulation_counts_optimizer_steps_and_averages_each_window():
    x, y, _ = quadratic_problem()
    x, y = torch.cat([x, x * 0.5]), torch.cat([y, y * 0.5])[:7]
    x = x[:7]  # seven batches of one: windows [0 1 2] [3 4 5] [6] (the pass's end), then the next pass
    tl = regression_loop(x, y, [0.0, 0.0], batch_size=1)
    result = tl.lr_find(start_lr=1e-4, end_lr=1e-3, num_iterations=5, grad_accumulation=3)
    losses = tl.model.batch_losses
    assert len(result.lrs) == 5 and len(losses) == 3 + 3 + 1 + 3 + 3
    windows = [(0, 3), (3, 6), (6, 7), (7, 10), (10, 13)]
    for step, (first, last) in enumerate(windows):
        assert result.raw_losses[step] == torch.stack(losses[first:last]).float().mean().item()
    assert [seen[0] for seen in tl.model.seen_lrs] == [result.lrs[step] for step, (a, b) in enumerate(windows)
                                                      for _ in range(a, b)]


def test_a_window_an_unsized_loaders_end_cuts_short_is_a_step_of_the_search():
    """The same seven batches from a loader without len: the window [6] is found only when the pass ends, and its
    step counts and is recorded as the sized loader's is."""
    from tests.helpers import IterableTensorData
    x, y, _ = quadratic_problem()
    x, y = torch.cat([x, x * 0.5])[:7], torch.cat([y, y * 0.5])[:7]
    tl = regression_loop(x, y, [0.0, 0.0], batch_size=1)
    tl.train_loader = DataLoader(IterableTensorData(TensorDataset(x, y)), batch_size=1)
    result = tl.lr_find(start_lr=1e-4, end_lr=1e-3, num_iterations=5, grad_accumulation=3)
    losses = tl.model.batch_losses
    assert len(result.lrs) == 5 and len(losses) == 3 + 3 + 1 + 3 + 3
    assert result.raw_losses[2] == losses[6].float().item()


def test_an_unsized_loaders_end_on_a_window_boundary_adds_no_step_to_the_search():
    """Six batches from a loader without len, windows of three: each pass ends where a window did, with nothing
    pending, and the search's steps are the sized loader's (a step of an empty window at each pass's end raised,
    mutation run of issue 32: step_pending_gradients answered True with nothing pending)."""
    from tests.helpers import IterableTensorData
    x, y, _ = quadratic_problem()
    x, y = torch.cat([x, x * 0.5])[:6], torch.cat([y, y * 0.5])[:6]
    results = []
    for sized in (True, False):
        tl = regression_loop(x, y, [0.0, 0.0], batch_size=1)
        if not sized:
            tl.train_loader = DataLoader(IterableTensorData(TensorDataset(x, y)), batch_size=1)
        results.append((tl.lr_find(start_lr=1e-4, end_lr=1e-3, num_iterations=5, grad_accumulation=3),
                        tl.model.batch_losses))
    (sized_result, sized_losses), (result, losses) = results
    assert len(result.lrs) == 5 and len(losses) == 5 * 3  # two and a half passes
    assert result.lrs == sized_result.lrs and result.raw_losses == sized_result.raw_losses
    assert [loss.item() for loss in losses] == [loss.item() for loss in sized_losses]


class InfiniteAt(Regression):
    def __init__(self, weights, at_batch):
        super().__init__(weights)
        self.at_batch = at_batch

    def get_loss(self, batch_data, criterion, device):
        loss = super().get_loss(batch_data, criterion, device)
        return loss * math.inf if len(self.batch_losses) == self.at_batch else loss


def test_a_loss_that_is_not_finite_stops_the_search_without_being_recorded():
    x, y, _ = quadratic_problem()
    model = InfiniteAt([0.0, 0.0], at_batch=5).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tl = TrainLoop(model, DataLoader(TensorDataset(x, y), batch_size=4), None, None, optimizer, nn.MSELoss(),
                   show_progress=False)
    result = tl.lr_find(start_lr=1e-4, end_lr=1e-2, num_iterations=10)
    assert result.diverged and len(result.lrs) == len(result.raw_losses) == 4
    assert all(math.isfinite(loss) for loss in result.raw_losses)


def test_apply_sets_the_suggestion_and_keeps_the_ratio_of_the_other_group():
    x, y, _ = quadratic_problem()
    tl = regression_loop(x, y, [0.0, 0.0], batch_size=4, lr=0.3, two_groups=True)
    result = tl.lr_find(start_lr=1e-4, end_lr=100.0, num_iterations=60, apply=True)
    assert result.suggestion is not None
    first, second = (group["lr"] for group in tl.optimizer.param_groups)
    assert first == result.suggestion and second == pytest.approx(result.suggestion / 10, rel=1e-12)


def test_apply_with_a_registered_scheduler_makes_the_suggestion_its_base_rate():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    warmup = LambdaLRScheduler(lr_lambda=lambda step: 0.1 if step == 0 else 1.0)  # 10 % in the first epoch
    result = search(tl, callbacks=[warmup], apply=True, end_lr=10.0, num_iterations=30)
    assert warmup.scheduler.base_lrs == [result.suggestion]
    assert tl.optimizer.param_groups[0]["lr"] == pytest.approx(result.suggestion * 0.1, rel=1e-12)
    tl.fit(num_epochs=2, callbacks=[warmup])
    assert tl.optimizer.param_groups[0]["lr"] == pytest.approx(result.suggestion, rel=1e-12)


# --- the rules and the result ---------------------------------------------------------------------------------------
def test_the_rules_on_a_hand_made_curve():
    lrs = [10.0 ** exponent for exponent in range(-6, 3)]  # 9 steps
    losses = [2.0, 2.1, 1.9, 1.5, 1.0, 0.6, 0.5, 0.55, 3.0]
    assert longest_valley(losses) == (0, 6, 6)  # 2.0 > 1.9 > 1.5 > 1.0 > 0.6 > 0.5 (2.1 is skipped)
    assert suggestion_index(lrs, losses, "valley") == 3  # the valley spans its 6 points: steps 1 to 6
    # A plateau the subsequence threads through (every other step a little lower: 9 of its 18 steps) does not
    # stretch the valley back to the plateau's start: its 14 points (9 + the 5 of the descent, steps 18 to 22) span
    # steps 9 to 22, half way is step 15 (step 11 if the valley began at the subsequence's first point, step 0).
    plateau = [2.0 - 0.001 * (step // 2) + (0.0005 if step % 2 else 0.0) for step in range(18)]
    curve = plateau + [1.8, 1.4, 1.0, 0.7, 0.5, 3.0]
    assert longest_valley(curve) == (0, 22, 14)
    assert suggestion_index(list(range(len(curve))), curve, "valley") == 15
    assert suggestion_index(lrs, losses, "minimum") == 6
    # Slopes against log10(lr) up to the minimum (step 6): central differences, e.g. step 4: (0.6 - 1.5) / 2 = -0.45
    # is the steepest fall; step 7, (3.0 - 0.5) / 2, and a fall after a blow-up would not count.
    assert suggestion_index(lrs, losses, "steepest") == 4
    assert suggestion_index(lrs + [1e3], losses + [0.1], "steepest") == 9  # the fall into a new lowest value
    assert suggestion_index(lrs + [1e3], losses + [1.0], "steepest") == 4  # falling after the blow-up: not counted
    assert smoothed_losses([4.0, 2.0], 0.5) == [4.0, (0.5 * 0.5 * 4.0 + 0.5 * 2.0) / (1 - 0.25)]
    assert smoothed_losses([4.0, 2.0, 7.0], 1.0) == [4.0, 2.0, 7.0]
    assert lr_schedule(1.0, 8.0, 4, "exponential") == pytest.approx([1.0, 2.0, 4.0, 8.0], rel=1e-12)
    assert lr_schedule(1.0, 4.0, 4, "linear") == [1.0, 2.0, 3.0, 4.0]


def test_the_warnings_of_an_untrustworthy_curve():
    x, y, critical_lr = quadratic_problem()
    with pytest.warns(RuntimeWarning, match="never fell"):  # diverging from the first step
        regression_loop(x, y, [0.0, 0.0], batch_size=4).lr_find(start_lr=2 * critical_lr, end_lr=100.0,
                                                                num_iterations=20)
    with pytest.warns(RuntimeWarning, match="edge"):  # still falling at the end of the range
        regression_loop(x, y, [0.0, 0.0], batch_size=4).lr_find(start_lr=1e-4, end_lr=1e-3, num_iterations=20,
                                                                suggestion="minimum")


def test_plot_draws_a_log_axis_with_the_suggestion_and_saves(tmp_path):
    pytest.importorskip("matplotlib")
    result = LRFinderResult(lrs=[1e-4, 1e-3, 1e-2, 1e-1], losses=[2.0, 1.5, 1.0, 3.0],
                            raw_losses=[2.0, 1.4, 0.9, 4.0], suggestion=1e-3, suggestion_rule="valley",
                            suggestion_index=1, diverged=True, num_iterations=10)
    figure, axes = result.plot(tmp_path / "curve.png")
    assert axes.get_xscale() == "log"
    assert any(list(line.get_xdata()) == [1e-3, 1e-3] for line in axes.get_lines())  # the suggestion's line
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what Python does for a package not installed
    result = LRFinderResult([1.0, 2.0], [1.0, 0.5], [1.0, 0.5], 1.0, "valley", 0, False, 2)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        result.plot()


@pytest.mark.parametrize("kwargs, message", [
    ({"start_lr": 1.0, "end_lr": 0.1}, "smaller than end_lr"),
    ({"start_lr": 0.0}, "start_lr must be"),
    ({"end_lr": float("inf")}, "end_lr must be"),
    ({"num_iterations": 1}, "num_iterations"),
    ({"mode": "cosine"}, "mode must be one of"),
    ({"suggestion": "best"}, "suggestion must be one of"),
    ({"smoothing": 0.0}, "smoothing"),
    ({"divergence_threshold": 1.0}, "divergence_threshold"),
    ({"grad_accumulation": 0}, "grad_accumulation"),
])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, message):
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    with pytest.raises(ValueError, match=message):
        tl.lr_find(**kwargs)
    assert tl._model_runner is None  # refused before the set-up


def test_fsdp_and_ddp_outside_a_job_are_refused_with_what_to_do():
    model, _ = model_pair(MLP)
    loader = seeded_loader(classification_data(12))
    fsdp = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     gpu_mode="fsdp")
    with pytest.raises(ValueError, match="gpu_mode='ddp'"):
        fsdp.lr_find()
    ddp = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    gpu_mode="ddp")
    with pytest.raises(ValueError, match="torchrun"):
        ddp.lr_find()
    with pytest.raises(TypeError, match="unexpected keyword"):
        make_loop(model).lr_find(ddp_model_args={})


# --- a torchrun-style job: every rank searches together and gets the same suggestion -------------------------------
DDP_SCRIPT = '''
import json
import os
import sys

import torch

from tests.torchtrain.distributed.support import make_train_loop

if __name__ == "__main__":
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tl = make_train_loop(gpu_mode="ddp", batch_size=2, train_samples=16, shuffle=True)
    initial = {name: value.clone() for name, value in tl.model.state_dict().items()}
    result = tl.lr_find(start_lr=1e-4, end_lr=10.0, num_iterations=12, apply=True, grad_accumulation=2)
    unchanged = all(torch.equal(value, initial[name]) for name, value in tl.model.state_dict().items())
    # This rank's own loss of the search's first window (its first two batches, the weights as before the search).
    batches = iter(tl.train_loader)
    with torch.no_grad():
        own = [tl.model.get_loss(next(batches), tl.criterion, tl.device) for _ in range(2)]
    tl.fit(num_epochs=1)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump({"suggestion": result.suggestion, "raw": result.raw_losses, "lrs": result.lrs,
                   "lr": tl.optimizer.param_groups[0]["lr"], "unchanged": unchanged,
                   "own_first": torch.stack(own).mean().item(), "epochs": tl.epochs_completed,
                   "weights": [value.tolist() for value in tl.model.state_dict().values()]}, handle)
'''


@pytest.mark.slow
def test_every_rank_of_a_torchrun_style_job_gets_the_same_suggestion(tmp_path):
    from tests.torchtrain.distributed.support import run_scripts_together, torchrun_environments
    script = tmp_path / "lr_find_job.py"
    script.write_text(DDP_SCRIPT)
    run_scripts_together([[script, tmp_path]] * 2, torchrun_environments(2), timeout=240)
    rank0, rank1 = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert rank0["suggestion"] is not None
    for key in ("suggestion", "raw", "lrs", "weights"):
        assert rank0[key] == rank1[key], key
    assert rank0["lr"] == rank1["lr"] == rank0["suggestion"]  # applied, then fit kept it (no scheduler)
    assert rank0["unchanged"] and rank1["unchanged"] and rank0["epochs"] == rank1["epochs"] == 1
    # The step's loss is the mean over the ranks, each having seen its own share of the data.
    assert rank0["own_first"] != rank1["own_first"]
    assert rank0["raw"][0] == pytest.approx((rank0["own_first"] + rank1["own_first"]) / 2, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("cell_args", [("O1", "single", 3, True, "multi2", True), ("O2", "single", 1, False, "multi2", True)],
                         ids=["O1-compiled-two-optimizers-accumulation", "O2-two-optimizers-clipping"])
def test_fit_after_lr_find_is_bitwise_fit_alone_in_matrix_cells(cell_args):
    # Cells of the feature matrix (tests/combinations): a MultiLoss with two optimizers, compiled (its backward
    # graph serves both losses, so donated buffers must stay off during the search too) or under O2.
    from tests.combinations.support import Cell, build_loop, fit
    cell = Cell(*cell_args)
    torch._dynamo.reset()
    straight = build_loop(cell)
    torch.manual_seed(5)
    fit(straight, cell, 2)
    torch._dynamo.reset()
    tl = build_loop(cell)
    torch.manual_seed(5)
    assert tl.lr_find(num_iterations=6, grad_accumulation=cell.grad_accumulation).suggestion is not None
    fit(tl, cell, 2)
    assert_params_equal(tl.model, straight.model)


# --- issue 34: cyclic schedules, negative losses ---------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["one-cycle", "cyclic"])
def test_apply_makes_the_suggestion_the_peak_of_a_one_cycle_or_cyclic_schedule_for_every_group(schedule):
    """Issue 34.5: OneCycleLR and CyclicLR peak at max_lr, not at their base rate: the suggestion (the largest rate
    that still trains well) becomes the peak, per group with the groups' ratio, and the schedule keeps its shape."""
    from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback
    torch.manual_seed(0)
    model = MLP()
    groups = [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), "lr": 0.01}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    tl = TrainLoop(model, seeded_loader(classification_data(40), batch_size=6), None, None, optimizer,
                   nn.CrossEntropyLoss(), show_progress=False)
    if schedule == "one-cycle":
        scheduler = GeneralLRSchedulerCallback(torch.optim.lr_scheduler.OneCycleLR, max_lr=[0.1, 0.01],
                                               total_steps=20, pct_start=0.25, step_per_optimizer_step=True)
    else:
        scheduler = GeneralLRSchedulerCallback(torch.optim.lr_scheduler.CyclicLR, base_lr=[0.01, 0.001],
                                               max_lr=[0.1, 0.01], step_size_up=3, step_per_optimizer_step=True)
    result = search(tl, callbacks=[scheduler], apply=True, end_lr=10.0, num_iterations=30)
    suggestion = result.suggestion
    assert suggestion is not None

    class Peaks(AbstractCallback):
        def __init__(self):
            super().__init__("peaks")
            self.seen = [0.0, 0.0]

        def on_after_gradient_update(self, optimizer_idx):
            rates = [group["lr"] for group in self.train_loop_obj.optimizer.param_groups]
            self.seen = [max(seen, rate) for seen, rate in zip(self.seen, rates)]

    peaks = Peaks()
    tl.fit(num_epochs=2, callbacks=[peaks])  # 14 optimizer steps: one-cycle peaks at the 5th, cyclic at the 4th
    # Exactly the suggestion (and the second group's rate as a fit given max_lr=[s, s * ratio] computes it), not
    # within an ulp: the peak is set, not scaled (review of issue 34, C3).
    second = suggestion * (0.01 / 0.1)
    assert peaks.seen == [suggestion, second]
    torch_scheduler = scheduler.scheduler
    if schedule == "one-cycle":
        assert [group["max_lr"] for group in optimizer.param_groups] == [suggestion, second]
        assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(suggestion / 25)  # div_factor kept
    else:
        assert torch_scheduler.max_lrs == [suggestion, second]
        assert torch_scheduler.base_lrs == pytest.approx([suggestion / 10, suggestion / 100])  # the ratio kept


def _one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.05, 0.005], total_steps=20)


def _cyclic(optimizer):
    return torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=[0.005, 0.0005], max_lr=[0.05, 0.005],
                                             step_size_up=3)


def _lambda(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))


@pytest.mark.parametrize("make", [None, _one_cycle, _cyclic, _lambda], ids=["none", "OneCycleLR", "CyclicLR",
                                                                            "LambdaLR"])
def test_the_applied_rate_is_exactly_the_suggestion(make):
    """Review of issue 34, C3: the peak (or base) rate was the old one times ``suggestion / old``, an ulp off the
    suggestion (0.05736152510448681 for ...682). Both groups' rates are those a schedule built with the suggestion
    computes: ``s`` and ``s * (0.005 / 0.05)``."""
    from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback
    from aitoolbox.torchtrain.train_loop.lr_finder import apply_learning_rate
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), "lr": 0.005}],
                                lr=0.05)
    tl = TrainLoop(model, seeded_loader(classification_data(12), batch_size=6), None, None, optimizer,
                   nn.CrossEntropyLoss(), show_progress=False)
    scheduler = None
    if make is not None:
        scheduler = GeneralLRSchedulerCallback(make, step_per_optimizer_step=True)
        tl.callbacks_handler.register_callbacks([scheduler])
    suggestion = 0.05736152510448682
    assert 0.05 * (suggestion / 0.05) != suggestion  # scaling would miss it by an ulp
    apply_learning_rate(tl, suggestion)
    expected = [suggestion, suggestion * (0.005 / 0.05)]
    if make is None:
        assert [group["lr"] for group in optimizer.param_groups] == expected
    elif make is _one_cycle:
        assert [group["max_lr"] for group in optimizer.param_groups] == expected
    elif make is _cyclic:
        assert scheduler.scheduler.max_lrs == expected
    else:
        assert scheduler.scheduler.base_lrs == expected
        assert [group["initial_lr"] for group in optimizer.param_groups] == expected


def _warmup_then_cosine(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5),
                    torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=30)], milestones=[5])


def _chained_warmup(optimizer):
    return torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5),
         torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.99)])


@pytest.mark.parametrize("make", [_warmup_then_cosine, _chained_warmup], ids=["SequentialLR", "ChainedScheduler"])
def test_apply_with_a_composite_schedule_makes_the_suggestion_its_base_rate(make):
    """Review of issue 34, D3: SequentialLR and ChainedScheduler have no base rates of their own; the suggestion
    replaced the warm-up's current rate (a tenth of the base) and the schedule multiplied up from there, peaking at
    ten times the suggestion. The fit must follow the LR sequence of the same fit built with the suggestion as its
    rate (a warm-up from a tenth of it to the suggestion itself), for both groups."""
    from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback

    class Rates(AbstractCallback):
        def __init__(self):
            super().__init__("rates")
            self.seen = []

        def on_after_gradient_update(self, optimizer_idx):
            self.seen.append([group["lr"] for group in self.train_loop_obj.optimizer.param_groups])

    def build(lr):
        torch.manual_seed(0)
        model = MLP()
        groups = [{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), "lr": lr / 10}]
        tl = TrainLoop(model, seeded_loader(classification_data(40), batch_size=6), None, None,
                       torch.optim.SGD(groups, lr=lr, momentum=0.9), nn.CrossEntropyLoss(), show_progress=False)
        return tl, GeneralLRSchedulerCallback(make, step_per_optimizer_step=True)

    tl, scheduler = build(0.1)
    suggestion = search(tl, callbacks=[scheduler], apply=True, end_lr=10.0, num_iterations=30).suggestion
    assert suggestion is not None and suggestion != 0.1
    rates = Rates()
    tl.fit(num_epochs=2, callbacks=[rates])
    alone, alone_scheduler = build(suggestion)
    alone_rates = Rates()
    alone.fit(num_epochs=2, callbacks=[alone_scheduler, alone_rates])
    assert len(rates.seen) == 14
    assert rates.seen[0] == pytest.approx(alone_rates.seen[0], rel=1e-12)  # the warm-up starts at a tenth
    for ours, theirs in zip(rates.seen, alone_rates.seen):
        assert ours == pytest.approx(theirs, rel=1e-12)
    peak = max(rate for rate, _ in rates.seen)
    if make is _warmup_then_cosine:
        assert peak == pytest.approx(suggestion, rel=1e-12)  # the warm-up ends at the suggestion
    else:
        assert peak <= suggestion * (1 + 1e-12)  # the chained decay runs during the warm-up: never above it


class GaussianRegression(TTModel):
    """A linear mean and a learnt variance under ``nn.GaussianNLLLoss``: near the data's noise the loss is
    negative."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(2, 1).double()
        self.log_variance = nn.Parameter(torch.tensor(-3.0, dtype=torch.float64))
        with torch.no_grad():
            self.mean.weight.copy_(torch.tensor([[1.0, -3.0]]))
            self.mean.bias.zero_()

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self.mean(x).squeeze(1), y, self.log_variance.exp().expand(len(y)))

    def get_predictions(self, batch_data, device):
        return self.mean(batch_data[0]).squeeze(1), batch_data[1], None


def test_a_negative_loss_is_searched_over_the_whole_range_and_suggests_a_rate():
    """Issue 34.7: 'smoothed > 4 x best' holds at once for a negative best; the search stopped after two steps and
    its warning blamed the range."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -3.0], dtype=torch.float64) + 0.05 * torch.randn(64, generator=generator,
                                                                                dtype=torch.float64)
    model = GaussianRegression()
    tl = TrainLoop(model, DataLoader(TensorDataset(x, y), batch_size=8), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.01), nn.GaussianNLLLoss(), show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = tl.lr_find(start_lr=1e-5, end_lr=10.0, num_iterations=60)
    assert max(result.raw_losses[:3]) < 0  # negative from the start
    assert len(result.lrs) > 30 and result.suggestion is not None
    assert min(result.losses) < result.losses[0]
