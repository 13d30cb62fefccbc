"""SpikeRollback's blame of a non-finite state and the wording of its rollbacks (review 49s R6, R7; review 49x X4).

A NaN loss of a batch's own (bad data) and a NaN loss that follows a step with NaN gradients look alike at a check;
the blame leaves out exactly the batches the rule names, compared bitwise with a run whose loader never yields them.
"""
import copy
import logging
import os
import signal

import pytest
import torch

from aitoolbox.torchtrain.callbacks import SpikeRollback
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollbackError
from aitoolbox.torchtrain.callbacks.tracking_base import describe_rollback
from tests.helpers import MLP, assert_params_equal, model_pair, single_torch_thread
from tests.torchtrain.callbacks.test_spike_rollback import (
    SETTINGS, NanGradientMLP, Poisoned, TellModelEpoch, TellModelEpochAfter, batch_order, loader, make_loop,
    poisoned_at, reference_loader, resumed_from, stopped_by_sigterm, train)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

NAN = float("nan")


def nan_batches(epoch, positions):
    """Arguments of :class:`Poisoned`: the batches at ``positions`` of ``epoch`` made NaN (their loss is NaN by
    itself)."""
    order = batch_order(4)[epoch]
    return {epoch: [index for position in positions for index in order[position]]}


@pytest.mark.parametrize("positions, grad_accumulation", [((4, 5), 1), ((4, 5, 6), 1), ((4, 5), 2), ((3, 4), 2)],
                         ids=["two", "three", "two-accumulated", "two-in-one-window"])
def test_adjacent_batches_with_nan_losses_of_their_own_are_left_out_alone_one_rollback_each(positions,
                                                                                             grad_accumulation):
    """Review 49s R6: after (1,4) was left out, (1,5)'s NaN loss right after the (1,3) step matched the NaN-gradient
    pattern and the healthy (1,3) was left out too (3 rollbacks; three NaN batches needed 4, past the default
    max_rollbacks=3, and training stopped). The step before is blamed only where it left the state non-finite."""
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(nan_batches(1, positions), scale=NAN))),
               grad_accumulation=grad_accumulation, callbacks=[SpikeRollback(**SETTINGS)])  # max_rollbacks=3
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: set(positions)})),
                      grad_accumulation=grad_accumulation)
    assert tl.run_state.rollbacks.skipped == {1: list(positions)}
    assert len(tl.rollbacks) <= len(positions)
    assert all(record["non_finite_state"] for record in tl.rollbacks)
    assert_params_equal(tl.model, reference.model)
    assert tl.train_history["accumulated_loss"] == reference.train_history["accumulated_loss"]


def test_a_nan_gradient_step_followed_by_a_nan_batch_of_its_own_leaves_out_both_and_the_batch_after():
    """Bad data at (1,4), a finite loss with NaN gradients at (1,5): (1,4) is left out by itself; then (1,6)'s loss
    is NaN after the (1,5) step, which left the state non-finite: (1,6) first, then (1,5), as for a NaN gradient
    alone (the measured step is the bad one)."""
    torch.manual_seed(0)
    model = NanGradientMLP()
    twin = copy.deepcopy(model)
    order = batch_order(4)[1]
    model.bad = {1: torch.stack([Poisoned().base[index][0] for index in order[5]])}
    tl = train(make_loop(model, loader(Poisoned(nan_batches(1, [4]), scale=NAN))),
               callbacks=[SpikeRollback(**SETTINGS), TellModelEpoch()])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {4, 5, 6}})))
    assert [sorted(record["skipped_samples"]) for record in tl.rollbacks] == [sorted(order[p]) for p in (4, 6, 5)]
    assert_params_equal(tl.model, reference.model)


class EarlyEpochBegin(AbstractCallback):
    """An ``on_epoch_begin`` ordered before SpikeRollback: the fit's start is not kept, the first step's check keeps
    the first point."""

    def __init__(self):
        super().__init__("an epoch-begin hook before SpikeRollback", execution_order=-100)

    def on_epoch_begin(self):
        pass


@pytest.mark.parametrize("snapshot", ["checkpoint", "memory-start-not-kept"])
def test_adjacent_nan_batches_right_after_a_first_point_kept_at_the_first_step_are_each_left_out(tmp_path, snapshot):
    """Review 50s S2: NaN at (0,1) and (0,2) of a fresh run whose first point is kept by the first step's check (which
    leaves (0,0) pending). The replay starts after the (0,0) step, so it never measured it: (0,0)'s window was blamed,
    which lies before the point; nothing was left out, the run returned to the same point until max_rollbacks and
    training stopped. That check found the state finite after (0,0) and records so."""
    from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
    model, twin = model_pair(MLP)
    if snapshot == "checkpoint":
        callbacks = [SpikeRollback(**SETTINGS, snapshot="checkpoint"), ModelCheckpoint("proj", "exp", str(tmp_path))]
    else:
        callbacks = [EarlyEpochBegin(), SpikeRollback(**SETTINGS)]
    tl = train(make_loop(model, loader(Poisoned(nan_batches(0, (1, 2)), scale=NAN))), callbacks=callbacks)
    reference = train(make_loop(twin, reference_loader(Poisoned(), {0: {1, 2}})))
    assert tl.run_state.rollbacks.skipped == {0: [1, 2]}
    assert len(tl.rollbacks) == 2
    assert_params_equal(tl.model, reference.model)


class SigtermAfterRollbacks(AbstractCallback):
    """Sends SIGTERM at the start of the batch at ``total_iteration_idx == step`` once the run rolled back
    ``rollbacks`` times (in the replay)."""

    def __init__(self, step, rollbacks):
        super().__init__("SIGTERM at a replayed step")
        self.step, self.rollbacks = step, rollbacks

    def on_batch_begin(self):
        tl = self.train_loop_obj
        if tl.total_iteration_idx == self.step and len(tl.rollbacks) == self.rollbacks:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("positions, step, rollbacks", [
    ((4, 5), 15, 1), ((4, 5), 16, 1), ((4, 5), 15, 0), ((5, 6), 16, 0), ((4, 5, 6), 15, 0)],
    ids=["replay-before-pair", "replay-at-second", "before-pair", "before-later-pair", "before-three"])
def test_a_sigterm_between_the_rollbacks_of_adjacent_nan_batches_resumes_as_the_straight_run(tmp_path, positions,
                                                                                            step, rollbacks):
    """NaN at (1,4) and (1,5) (total 16, 17); the point kept at total 14. After (1,4) is left out, a SIGTERM in the
    replay at (1,3) (total 15: that step's finite state, measured because the next batch was left out, is saved with
    the losses the stop judged) or at (1,5)'s batch (total 16: blamed before the stop's checkpoint). The resumed run
    leaves out (1,5) alone, as the straight run.

    Review 50s S1: a SIGTERM at the step right before the adjacent NaN batches, before any rollback (total 15 for
    (1,4), (1,5)): the resumed fit's start lies after that step, so its replay never measured it, and the missing flag
    blamed the healthy (1,3) and raised (a window before the start). The stop found the state finite after that step
    and records so."""
    poison = nan_batches(1, positions)
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison, scale=NAN))), callbacks=[SpikeRollback(**SETTINGS)])
    assert straight.run_state.rollbacks.skipped == {1: list(positions)}
    stopped, saved = stopped_by_sigterm(tmp_path, model, Poisoned(poison, scale=NAN), -1,  # (its own never fires)
                                        callbacks=[SigtermAfterRollbacks(step, rollbacks)])
    assert len(stopped.rollbacks) == (0 if rollbacks == 0 else 1 if step == 15 else 2)
    resumed = resumed_from(saved, Poisoned(poison, scale=NAN))
    assert str(resumed.rollbacks) == str(straight.rollbacks)
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history


def test_a_stop_checkpoint_without_the_judged_flag_resumes_as_the_straight_run(tmp_path):
    """Review 50s S1, a checkpoint written before the judgements recorded the state finite (stop at (1,3), NaN at (1,4)
    and (1,5); its SpikeRollback state stripped of ``finite_after``, as aitoolbox before wrote it): the step before
    the bad batches lies before the resumed start, whose state is finite (a point is only kept so) and is that
    step's: it is not blamed (it was, and the resume raised)."""
    poison = nan_batches(1, (4, 5))
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison, scale=NAN))), callbacks=[SpikeRollback(**SETTINGS)])
    _, saved = stopped_by_sigterm(tmp_path, model, Poisoned(poison, scale=NAN), -1,
                                  callbacks=[SigtermAfterRollbacks(15, 0)])
    checkpoint = torch.load(saved, weights_only=False)
    (state,) = [state for state in checkpoint["callbacks"].values() if "finite_after" in state]
    assert state["finite_after"]  # (what the fix records)
    del state["finite_after"]
    torch.save(checkpoint, saved)
    resumed = resumed_from(saved, Poisoned(poison, scale=NAN))
    assert str(resumed.rollbacks) == str(straight.rollbacks)
    assert_params_equal(resumed.model, straight.model)


# --- the wording of each kind of rollback (review 49s R7, review 49x X4) -------------------------------------------
@pytest.fixture
def package_logs(caplog, monkeypatch):
    """caplog, with the package logger's records reaching it (the package logger stops at itself)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    return caplog


def rollback_warnings(caplog):
    return [record.getMessage() for record in caplog.records if record.getMessage().endswith("rolling back")]


def test_a_loss_spike_is_worded_as_one_with_its_median_and_limit(package_logs):
    caplog = package_logs
    model, _ = model_pair(MLP)
    with caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.callbacks.spike_rollback"):
        tl = train(make_loop(model, loader(Poisoned(poisoned_at(1, 5)))), callbacks=[SpikeRollback(**SETTINGS)])
    (record,) = tl.rollbacks
    (message,) = rollback_warnings(caplog)
    assert message.startswith("SpikeRollback: loss spike at epoch 2, iteration 5: loss ")
    assert ", median " in message and ", limit " in message and "not finite" not in message
    assert describe_rollback(record).startswith("rollback: loss spike at epoch 2, iteration 5 (loss ")


def test_a_non_finite_state_at_a_fresh_start_is_worded_as_such_and_back_to_the_fit_s_start(package_logs):
    """NaN gradients at the first batch, a finite loss: the state is not finite at the first check (iteration 4, the
    warmup not over: the rule's median and limit are NaN). The warnings read "loss spike ... median nan, limit nan;
    back to epoch 1, iteration -1"."""
    caplog = package_logs
    torch.manual_seed(0)
    model = NanGradientMLP()
    model.bad = {0: torch.stack([Poisoned().base[index][0] for index in batch_order(4)[0][0]])}
    with caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.callbacks.spike_rollback"):
        tl = train(make_loop(model, loader(Poisoned())), num_epochs=1,
                   callbacks=[SpikeRollback(**SETTINGS), TellModelEpochAfter()])
    assert [record["iteration"] for record in tl.rollbacks] == [1, 0]
    assert all(record["restored"] == {"epoch": 0, "iteration": -1} for record in tl.rollbacks)
    messages = rollback_warnings(caplog)
    assert len(messages) == 2
    # Review 50s W1: the first names the NaN loss of the batch after the bad step as what is known (a NaN loss, the
    # state not finite), not as "not finite after the step of" that healthy batch; the second names the blamed step.
    assert messages[0].startswith("SpikeRollback: non-finite loss at epoch 1, iteration 1, with the weights or "
                                  "optimizer states not finite: loss nan")
    assert messages[1].startswith("SpikeRollback: weights or optimizer states not finite after a step; blamed: the "
                                  "step with the gradients of epoch 1, iteration 0: loss ")
    for message, record in zip(messages, tl.rollbacks):
        assert "median" not in message and "limit" not in message and "spike" not in message
        assert message.endswith("back to the fit's start (before epoch 1's first batch); rolling back")
        text = describe_rollback(record)
        assert "spike" not in text and "iteration -1" not in text and "the fit's start" in text


def test_the_error_after_max_rollbacks_words_a_non_finite_state_as_such():
    torch.manual_seed(0)
    model = NanGradientMLP()
    model.bad = {1: torch.stack([Poisoned().base[index][0] for index in batch_order(4)[1][4]])}
    with pytest.raises(SpikeRollbackError) as raised:
        train(make_loop(model, loader(Poisoned())), callbacks=[SpikeRollback(**SETTINGS, max_rollbacks=1),
                                                               TellModelEpoch()])
    message = str(raised.value)
    assert message.startswith("weights or optimizer states not finite after a step; blamed: the step with the "
                              "gradients of epoch 2, iteration 4 (loss ")
    assert "median" not in message.split("\n")[0]
    assert "\n  non-finite loss at epoch 2, iteration 5, with the weights or optimizer states not finite: loss nan" \
        in message


@pytest.mark.parametrize("record, words, numbers", [
    (dict(epoch=1, iteration=5, loss=1454.75, median=1.1, limit=3.2), "loss spike at epoch 2, iteration 5",
     "loss 1454.75, median 1.1, limit 3.2"),
    # A NaN loss with the state finite (a step the loss scaler skipped): in the warmup the centre is NaN.
    (dict(epoch=0, iteration=2, loss=NAN, median=NAN, limit=NAN), "non-finite loss at epoch 1, iteration 2",
     "loss nan"),
    # Review 50s W1: a blamed step is named by the gradients it took (with accumulation, of its window's first
    # batch); a NaN loss left out with the state not finite, as such (the step before it may be the cause).
    (dict(epoch=0, iteration=0, loss=0.94, median=NAN, limit=NAN, non_finite_state=True),
     "weights or optimizer states not finite after a step; blamed: the step with the gradients of epoch 1, "
     "iteration 0", "loss 0.94"),
    (dict(epoch=1, iteration=6, loss=NAN, median=NAN, limit=NAN, non_finite_state=True),
     "non-finite loss at epoch 2, iteration 6, with the weights or optimizer states not finite", "loss nan"),
], ids=["spike", "non-finite-loss", "non-finite-state", "non-finite-loss-and-state"])
def test_each_kind_of_rollback_is_named_as_what_it_is(record, words, numbers):
    from aitoolbox.torchtrain.callbacks.rollback_request import describe_point, describe_spike, spike_numbers
    assert describe_spike(record) == words and spike_numbers(record) == numbers
    assert describe_point({"epoch": 0, "iteration": -1}) == "the fit's start (before epoch 1's first batch)"
    assert describe_point({"epoch": 2, "iteration": 7}) == "epoch 3, iteration 7"
