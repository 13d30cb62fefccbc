"""SpikeRollback's default rule (issue 34.1): no alarm on healthy noisy runs (the quickstart's digits CNN at batch
sizes 32 and 8, a Gaussian negative log-likelihood whose loss is negative), a x10 loss and a NaN still caught; the
rule's invariants on drawn loss sequences; the earlier ``factor`` rule still available."""
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks import SpikeRollback
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollbackError
from aitoolbox.torchtrain.callbacks.spike_rules import FactorRule, LossHistory, RobustRule, remember
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import single_torch_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


# --- runs ------------------------------------------------------------------------------------------------------
class Poison(AbstractCallback):
    """Turns the loss of the batches at ``at`` (total batch indices, counted once: a replay does not poison them
    again) into ``m + 9 |m|`` (x10 for a positive loss; ``m``: the median of the last 50 losses) or NaN."""

    def __init__(self, at, kind="x10"):
        super().__init__("poison", execution_order=-1000)
        self.at, self.kind, self.target, self.losses, self.done = set(at), kind, None, [], set()

    def on_batch_begin(self):
        index = self.train_loop_obj.total_iteration_idx
        self.target = None
        if index in self.at and index not in self.done:
            self.done.add(index)
            level = float(torch.tensor(self.losses[-50:]).median())
            self.target = math.nan if self.kind == "nan" else level + 9 * abs(level)

    def on_batch_end(self):
        self.losses.append(float(self.train_loop_obj.last_batch_loss))
        self.target = None


class PoisonedLoss(nn.Module):
    def __init__(self, criterion, poison):
        super().__init__()
        self.criterion, self.poison = criterion, poison

    def forward(self, *args):
        loss = self.criterion(*args)
        target = self.poison.target
        if target is None:
            return loss
        return loss * math.nan if math.isnan(target) else loss + (target - loss.detach())


class GaussianMLP(TTModel):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, x):
        out = self.net(x)
        return out[:, 0], nn.functional.softplus(out[:, 1]) + 1e-4

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        mean, variance = self(x.to(device))
        return criterion(mean, y.to(device), variance)

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device))[0], batch_data[1], None


def heteroscedastic_loader(batch_size=16, num_samples=1600):
    generator = torch.Generator().manual_seed(5)
    x = torch.rand(num_samples, 4, generator=generator) * 2 - 1
    noise = (0.02 + 0.14 * (x[:, 3] + 1)) * torch.randn(num_samples, generator=generator)
    y = torch.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] / 2 + noise
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(6))


def nll_run(epochs, spike, poison=None):
    torch.manual_seed(7)
    model = GaussianMLP()
    poison = poison or Poison(())
    tl = TrainLoop(model, heteroscedastic_loader(), None, None, torch.optim.Adam(model.parameters(), lr=3e-3),
                   PoisonedLoss(nn.GaussianNLLLoss(), poison), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=epochs, callbacks=[poison, spike])
    return tl, poison


def quickstart_run(batch_size, epochs, spike, poison=None):
    """examples/quickstart.py's training (digits CNN, Adam 2e-3, use_amp=True), without evaluation."""
    torch.manual_seed(0)
    train_loader, _, _ = digits_loaders(batch_size, 0)
    model = DigitsCNN()
    poison = poison or Poison(())
    tl = TrainLoop(model, train_loader, None, None, torch.optim.Adam(model.parameters(), lr=2e-3),
                   PoisonedLoss(nn.CrossEntropyLoss(), poison), use_amp=True, end_auto_eval=False,
                   show_progress=False)
    tl.fit(num_epochs=epochs, callbacks=[poison, spike])
    return tl, poison


class FlatMLP(TTModel):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, images):
        return self.net(images)

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).argmax(dim=1), batch_data[1], None


def test_a_noisy_small_batch_run_raises_no_alarm():
    """Batch size 8 on the digits: from the second epoch on, most batches lie near 0 and single ones far above the
    median (one misclassified sample); the earlier rule rolled back from batch ~260 on."""
    torch.manual_seed(0)
    train_loader, _, _ = digits_loaders(8, 0)
    model = FlatMLP()
    poison = Poison(())
    tl = TrainLoop(model, train_loader, None, None, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                   PoisonedLoss(nn.CrossEntropyLoss(), poison), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=3, callbacks=[poison, SpikeRollback()])
    assert tl.rollbacks == [] and tl.train_history["rollbacks"] == [0, 0, 0]
    late = torch.tensor(poison.losses[200:])
    assert late.max() > 10 * late.median()


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [32, pytest.param(8, marks=pytest.mark.extended)])
def test_the_quickstart_trains_its_15_epochs_without_an_alarm(batch_size):
    tl, poison = quickstart_run(batch_size, 15, SpikeRollback())
    assert tl.rollbacks == []
    late = torch.tensor(poison.losses[len(poison.losses) // 2:])
    assert late.max() > 4 * late.median(), "meant to have batches far above the median (the earlier rule's alarms)"


def test_a_negative_loss_raises_no_alarm_and_a_x10_spike_and_a_nan_are_caught():
    tl, poison = nll_run(3, SpikeRollback(snapshot_every=20))
    assert tl.rollbacks == []
    assert sorted(poison.losses)[len(poison.losses) // 2] < -0.5  # a negative loss for most of the run

    spiked, poison = nll_run(3, SpikeRollback(snapshot_every=20, max_rollbacks=5), Poison([150, 240]))
    # The second is at batch 240 of the run, which numbers its batches without the one left out: iteration 41.
    assert [(r["epoch"], r["iteration"]) for r in spiked.rollbacks] == [(1, 50), (2, 41)]
    assert all(r["loss"] > r["limit"] > r["median"] for r in spiked.rollbacks)

    nan, _ = nll_run(2, SpikeRollback(snapshot_every=20), Poison([130], kind="nan"))
    assert [(r["epoch"], r["iteration"]) for r in nan.rollbacks] == [(1, 30)] and math.isnan(nan.rollbacks[0]["loss"])


def test_the_earlier_factor_rule_is_kept_and_fires_on_the_negative_loss():
    spike = SpikeRollback(4.0, 8, 4, 5)  # factor, window, warmup, snapshot_every: the positional order of before
    assert isinstance(spike.rule, FactorRule) and spike.factor == 4.0
    with pytest.raises(SpikeRollbackError):
        nll_run(1, spike)  # loss > 4 x a negative median: nearly every batch


@pytest.mark.parametrize("arguments", [dict(factor=4.0, threshold=5.0), dict(factor=2.0, memory=10),
                                       dict(threshold=0), dict(tail_factor=-1.0), dict(memory=0),
                                       dict(memory=2.5), dict(min_rise=-1.0), dict(min_rise=math.nan),
                                       dict(factor=math.inf)])
def test_bad_rule_settings_are_refused_naming_them(arguments):
    with pytest.raises(ValueError, match="|".join(arguments)):
        SpikeRollback(**arguments)


# --- the rule on drawn sequences -------------------------------------------------------------------------------
def judge(rule, values, earlier=(), rises=(), window=20, warmup=0, seen=None, reference=None):
    history = LossHistory(torch.tensor(list(earlier), dtype=torch.float64),
                          torch.tensor(list(rises), dtype=torch.float64),
                          len(earlier) if seen is None else seen,
                          None if reference is None else torch.tensor(float(reference), dtype=torch.float64),
                          # with a reference: the rises were judged in that same scale
                          None if reference is None else torch.full((len(rises),), float(reference),
                                                                    dtype=torch.float64))
    return rule.judge(history, torch.tensor(list(values), dtype=torch.float64), window, warmup)


finite_losses = st.lists(st.integers(-1000, 1000), min_size=30, max_size=80)


@settings(max_examples=60, deadline=None)
@given(finite_losses, st.integers(-12, 12))
def test_flags_do_not_change_when_the_losses_are_scaled(values, exponent):
    """A rise is a difference and the spread, the memory and the run's scale scale with it: the judgement depends on
    the loss's shape, not its units (a negative loss is judged like a positive one). Not on its offset in general:
    the remembered rises count in units of the loss's size (the median absolute loss), which a shift changes."""
    rule = RobustRule(memory=50, min_rise=0.0)
    base = judge(rule, values[10:], earlier=values[:10], window=10)
    moved = judge(rule, [v * 2.0 ** exponent for v in values[10:]],
                  earlier=[v * 2.0 ** exponent for v in values[:10]], window=10)
    margin = (torch.tensor(values[10:], dtype=torch.float64) - base.limits).abs()
    clear = margin > 1e-6 * (1 + torch.tensor(values).abs().max())  # not within rounding of the limit
    assert torch.equal(base.flags[clear], moved.flags[clear])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=5, max_size=40), st.data())
def test_a_non_finite_loss_is_a_spike_from_the_first_batch_and_nothing_finite_before_the_warm_up(values, data):
    position = data.draw(st.integers(0, len(values) - 1))
    values[position] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    judgement = judge(RobustRule(), values, warmup=len(values))
    assert judgement.flags.tolist() == [index == position for index in range(len(values))]
    legacy = judge(FactorRule(4.0), values, warmup=len(values))
    assert legacy.flags.tolist() == judgement.flags.tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=40, max_size=60), st.floats(0.5, 20), st.floats(1.0, 8.0))
def test_a_rise_no_larger_than_two_remembered_ones_is_never_a_spike(values, largest, tail_factor):
    rule = RobustRule(threshold=0.1, tail_factor=tail_factor, min_rise=0.0)
    rises = [0.1, largest, 0.3, largest]
    judgement = judge(rule, values, earlier=values[:20], rises=rises, reference=1.0)  # remembered in units of 1
    assert not bool((judgement.flags & (judgement.rises <= largest)).any())


def test_rare_large_healthy_batches_set_the_bar_and_a_loss_far_beyond_them_is_a_spike():
    """Mostly near 0, one batch in 25 at 0.4 to 1.6 (one misclassified sample of a small batch): the 200 losses after
    800 like them raise no alarm though they lie hundreds of times above the median; 8 is a spike."""
    generator = torch.Generator().manual_seed(0)
    small = torch.rand(1000, generator=generator, dtype=torch.float64) * 0.01
    large = 0.4 + 1.2 * torch.rand(1000, generator=generator, dtype=torch.float64)
    values = torch.where(torch.rand(1000, generator=generator, dtype=torch.float64) < 0.04, large, small)
    rule = RobustRule()
    history = judge(rule, values[:800].tolist(), warmup=0, window=100)  # their rises, to remember
    judgement = judge(rule, values[800:].tolist(), earlier=values[700:800].tolist(),
                      rises=history.rises[50:].tolist(), window=100, warmup=0, seen=800)
    assert not judgement.flags.any()
    assert float(values[800:].max()) > 100 * float(values[800:].median())
    spike = judge(rule, [8.0], earlier=values[900:].tolist(), rises=history.rises[50:].tolist(), window=100,
                  seen=1000)
    assert spike.flags.tolist() == [True] and spike.limits[0] < 8.0


def test_a_loss_that_sat_still_needs_the_floor_to_count():
    """A hinge-like loss at exactly 0 for the whole window: no spread, no remembered rise; a loss counts only beyond
    tail_factor times the size the loss had when it last moved."""
    rule = RobustRule()
    zeros = [0.0] * 100
    assert judge(rule, [4.9], earlier=zeros, window=100, reference=1.0).flags.tolist() == [False]
    assert judge(rule, [5.1], earlier=zeros, window=100, reference=1.0).flags.tolist() == [True]
    assert judge(RobustRule(min_rise=0.1), [0.2], earlier=zeros, window=100, reference=1.0).flags.tolist() == [True]


def test_the_scale_follows_a_falling_loss_and_never_falls_to_0():
    """The floor's scale is refreshed at each check (a bar fixed when the loss was 20 let a x100 batch through at
    1e-6) and keeps its last value where the loss sits at exactly 0 (a healthy hinge loss was stopped)."""
    history = LossHistory(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))
    rule = RobustRule()
    for level in (20.0, 1e-3, 1e-6):
        losses = torch.full((100,), level, dtype=torch.float64)
        history = remember(history, losses, rule.judge(history, losses, 100, 50), 100, 50, rule.memory)
        assert float(history.reference) == pytest.approx(level)
    assert judge(rule, [1e-4], earlier=history.window.tolist(), rises=history.rises.tolist(), window=100,
                 reference=float(history.reference)).flags.tolist() == [True]  # x100 at 1e-6
    zeros = torch.zeros(100, dtype=torch.float64)
    history = remember(history, zeros, rule.judge(history, zeros, 100, 50), 100, 50, rule.memory)
    assert float(history.reference) == pytest.approx(1e-6)


def test_the_detection_state_is_saved_and_an_older_state_without_the_rises_loads():
    spike = SpikeRollback(snapshot_every=20)
    tl, _ = nll_run(1, spike)
    state = spike.state_dict()
    assert state["rises"].numel() > 0 and state["reference"] is not None
    restored = SpikeRollback()
    restored.load_state_dict(state)
    assert torch.equal(restored._history.rises, state["rises"])
    assert restored._history.reference == state["reference"]
    older = {key: value for key, value in state.items() if key not in ("rises", "reference")}
    restored.load_state_dict(older)
    assert restored._history.rises.numel() == 0 and restored._history.reference is None
