"""Named regression tests for the defects the property-based test (test_properties.py) found: each small and
deterministic, comparing a run with a detour (an exception, a resume...) against the straight run.

A test marked ``xfail(strict=True)`` documents a defect whose fix belongs to another part of the loop (named in its
reason); it starts passing (and so failing as xfail) when the fix is merged: then remove the mark and the matching
entry of ``KNOWN_DEFECTS`` in test_properties.py.
"""
import copy

import pytest
import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.weight_averaging import WeightAveraging
from tests.combinations.properties_support import FAULT_POINTS, InjectedFault, Run, Setup, differences, observe


class RaiseOnce(AbstractCallback):
    """Raises once, in ``hook``, at the batch with ``total_iteration_idx == at``."""

    def __init__(self, hook: str, at: int, execution_order: int):
        super().__init__(f"raise once in {hook}", execution_order=execution_order)
        self.hook, self.at, self.raised = hook, at, False

    def _maybe_raise(self, hook: str) -> None:
        if hook == self.hook and not self.raised and self.train_loop_obj.total_iteration_idx == self.at:
            self.raised = True
            raise RuntimeError(f"raised in {hook}")

    def on_after_optimizer_step(self):
        self._maybe_raise("on_after_optimizer_step")

    def on_batch_end(self):
        self._maybe_raise("on_batch_end")


def _straight_and_continued(setup: Setup, fault: AbstractCallback, epochs: int = 2):
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=epochs)
    continued = Run(setup, under_test=False)
    continued.tl.callbacks_handler.register_callbacks([fault])
    with pytest.raises(RuntimeError, match="raised in"):
        continued.fit(num_epochs=epochs)
    continued.fit(num_epochs=epochs)
    return straight, continued


@pytest.mark.parametrize("hook, order", [("on_after_optimizer_step", 500), ("on_batch_end", -100)])
def test_an_exception_after_the_step_does_not_lose_the_callbacks_batch_end(hook, order):
    """Found by the property test. A callback raises after batch 3's optimizer step (in on_after_optimizer_step, or
    in on_batch_end before WeightAveraging's): the batch is committed, so the next fit goes on after it, but
    WeightAveraging's update of that step (at its on_batch_end) never happens: its average, and the model it is
    saved into, differ from the straight run's (measured: 12 averaged steps instead of 13, weights off by 5e-3). The
    next fit now finishes the committed batch: each hook that had not returned runs once (review of issue 32, D5)."""
    setup = Setup(averaging="ema", batchnorm=False, num_samples=20)
    straight, continued = _straight_and_continued(setup, RaiseOnce(hook, at=3, execution_order=order))
    averaging = [cb for cb in continued.callbacks if isinstance(cb, WeightAveraging)][0]
    assert averaging.num_averaged == 10
    assert not differences(observe(continued, {}), observe(straight, {}))


# --- a checkpoint of a loaded run that has not trained since ---------------------------------------------------
def _loaded_twice_then_trained(setup: Setup, mid_epoch: bool):
    """Train, keep a checkpoint (at the epoch end or at the newest step), load it into a new loop, take that loop's
    checkpoint before it trains, load that into a third loop and train on; with the straight run."""
    first = Run(setup, under_test=True)
    if mid_epoch:  # 5 batches an epoch, steps after batches 2, 4, 5 of each: the newest after batch 2 of epoch 2
        first.faults.arm("on_batch_begin", 7)
        with pytest.raises(InjectedFault):
            first.fit(num_epochs=2)
        checkpoint = first.keeper.newest
        assert checkpoint["iteration"] == 2
    else:
        first.fit(num_epochs=1)
        checkpoint = first.tl.checkpoint_state()
    torch.manual_seed(5)  # a new process: its own random state
    second = Run(setup, under_test=False)
    second.tl.load_checkpoint(checkpoint)
    again = second.tl.checkpoint_state(mid_epoch=mid_epoch)
    torch.manual_seed(6)
    third = Run(setup, under_test=False)
    third.tl.load_checkpoint(again)
    third.fit(num_epochs=3)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=3)
    return checkpoint, again, third, straight


@pytest.mark.parametrize("precision", ["fp32", "O2", "scaler"])
@pytest.mark.parametrize("mid_epoch", [False, True], ids=["epoch_end", "mid_epoch"])
def test_a_checkpoint_of_a_loaded_run_is_the_loaded_checkpoint(precision, mid_epoch):
    """Found by the property test (save, new TrainLoop, load, save again, new TrainLoop, load): the second checkpoint
    was taken before fit applied the loaded states, so it held the new process's random state, the schedulers'
    initial state, a fresh loss scale and O2's masters rounded from the bfloat16 weights; training from it went
    elsewhere (weights off by 1e-2). A job stopped right after resuming, before its first step, saves that."""
    setup = Setup(precision=precision, epoch_schedule=True, step_schedule=True, batchnorm=True, shuffle=True,
                  num_samples=18, accumulation=2)
    checkpoint, again, third, straight = _loaded_twice_then_trained(setup, mid_epoch)
    found = [line for line in differences(again, checkpoint) if not line.startswith(".hyperparams")]
    assert not found
    assert not differences(observe(third, {}), observe(straight, {}))


# --- O2's float32 masters while WeightAveraging holds the average in the model ---------------------------------
@pytest.mark.parametrize("averaging", ["ema", "ema_train"])
def test_o2_two_fits_with_weight_averaging_equal_one(averaging):
    """Found by the property test (O2, EMA evaluated with, a resume from an epoch-end checkpoint). Between two fits
    the model holds the average (save_average; eval_with_average from the epoch end to the next batch); the next
    fit's first zero_grad took that for a user's write of the weights and copied it into O2's float32 masters, and
    the training weights put back afterwards replaced them again, rounded to bfloat16: two fits ended 1e-2 away
    from one (and from a run resumed from a checkpoint, which keeps the masters)."""
    setup = Setup(precision="O2", averaging=averaging, batchnorm=True, num_samples=12)
    one = Run(setup, under_test=False)
    one.fit(num_epochs=3)
    two = Run(setup, under_test=False)
    two.fit(num_epochs=1)
    two.fit(num_epochs=3)
    assert not differences(observe(two, {}), observe(one, {}))


# --- two exceptions in a row ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", ["on_batch_end", "get_loss"])
@pytest.mark.parametrize("resumed_from", ["exception", "checkpoint"])
def test_a_second_exception_before_the_first_step_keeps_where_the_run_stopped(first, resumed_from):
    """Found by the property test. A fit stopped by an exception (or a new loop that loaded a mid-epoch checkpoint)
    is continued by a fit that raises again before its first step (in on_epoch_begin): the point to continue from
    was forgotten, so the next fit started the epoch over, training its first batch a second time (Adam one step
    ahead) or drawing its data order and dropout masks anew."""
    setup = Setup(num_samples=12, batchnorm=False, shuffle=True)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=2)
    run = Run(setup, under_test=True)
    run.faults.arm(first, 1)  # batch 1 (after batch 0's step; before or after batch 1's forward)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=2)
    if resumed_from == "checkpoint":
        checkpoint = run.keeper.newest  # after batch 0's step
        torch.manual_seed(77)
        run = Run(setup, under_test=True)
        run.tl.load_checkpoint(checkpoint)
    run.faults.arm("on_epoch_begin", 0)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=2)
    run.fit(num_epochs=2)
    assert not differences(observe(run, {}), observe(straight, {}))


# --- the loader's generator at the step point ------------------------------------------------------------------
@pytest.mark.parametrize("num_samples", [5, 6])
def test_an_exception_fetching_the_last_partial_batch_keeps_the_next_epochs_order(num_samples):
    """Found by the property test. A shuffling loader with its own generator, whose last batch is partial: fetching
    it makes the sampler draw from the generator once more (RandomSampler's tail), after the last step. An exception
    in that batch's get_loss saved the generator as it was then, the continuation drew the tail again on top of it,
    and every later epoch was shuffled differently from the straight run's."""
    setup = Setup(num_samples=num_samples, batchnorm=False, shuffle=True)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=3)
    run = Run(setup, under_test=True)
    run.faults.arm("get_loss", 1)  # batch 1, the partial one, of epoch 0
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=3)
    run.fit(num_epochs=3)
    assert not differences(observe(run, {}), observe(straight, {}))


# --- SpikeRollback and the batches an exception makes the next fit train again -------------------------------
@pytest.mark.xfail(strict=True, reason="monitors (SpikeRollback): the losses of the batches trained again are "
                                       "recorded twice; its per-batch state is not rolled back to the step point")
def test_spike_rollback_does_not_count_the_batches_trained_again_twice():
    """Found by the property test. Accumulation 2; an exception in batch 1's get_loss (batch 0 accumulated, not
    stepped): the next fit trains batch 0 again, and SpikeRollback, which had recorded its loss at its batch end,
    records it a second time: the losses it checks (and the median it keeps) are not the straight run's."""
    setup = Setup(spike_rollback=True, accumulation=2, num_samples=5, batchnorm=False)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=1)
    run = Run(setup, under_test=True)
    run.faults.arm("get_loss", 1)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=1)
    run.fit(num_epochs=1)
    assert not differences(observe(run, {}), observe(straight, {}))


def test_spike_rollback_keeps_its_clean_point_through_an_exception():
    """Found by the property test. The straight run keeps a clean point after its first steps and rolls back the
    spiking batch 2 (a poisoned sample); a run stopped by an exception in batch 2's get_loss continues with a fit
    whose first step is that spike, and SpikeRollback, which released its clean point at the exception, raised
    SpikeRollbackError ("before SpikeRollback kept any clean point: nothing to return to"). Passes since a fit that
    starts with nothing pending (the check of batch 1 judged everything) keeps its start as the point (review 47r
    D4). An exception between two checks (losses pending) still loses the point: "spike clean point" in
    test_properties.py's KNOWN_DEFECTS."""
    setup = Setup(spike_rollback=True, num_samples=12, poison=9, batchnorm=False)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=2)
    assert len(straight.tl.rollbacks) == 2
    run = Run(setup, under_test=True)
    run.faults.arm("get_loss", 2)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=2)
    run.fit(num_epochs=2)
    assert not differences(observe(run, {}), observe(straight, {}))


@pytest.mark.xfail(strict=True, reason="monitors (SpikeRollback): a mid-epoch checkpoint taken at a step whose check "
                                       "is due holds the state before the check (it runs after every callback's "
                                       "on_batch_end); the resumed run checks one batch later")
def test_spike_rollback_resumed_from_a_checkpoint_of_a_checked_step_equals_straight():
    """Found by the property test. Checks every 2 steps; a checkpoint callback saves after step 2 (batch 1), whose
    check runs after the callbacks' batch end: the checkpoint holds the two losses still to judge. The run resumed
    from it judges them together with batch 2's at its first step, the straight run judged them at step 2: the
    windows of losses the median is taken over differ from there on."""
    setup = Setup(spike_rollback=True, num_samples=14, batchnorm=False)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=2)
    crashed = Run(setup, under_test=True)
    crashed.faults.arm("on_batch_begin", 2)
    with pytest.raises(InjectedFault):
        crashed.fit(num_epochs=2)
    torch.manual_seed(3)
    resumed = Run(setup, under_test=False)
    resumed.tl.load_checkpoint(crashed.keeper.newest)
    resumed.fit(num_epochs=2)
    assert not differences(observe(resumed, {}), observe(straight, {}))


# --- restoring O2's masters while the model holds WeightAveraging's average --------------------------------------
def test_lr_find_leaves_the_average_in_the_model_under_o2():
    """Found by the property test (O2, EMA saved into the model, lr_find between fits, then a fit with nothing to
    train: the run had stopped early). lr_find restores the run from its snapshot, and restoring O2's float32 masters
    copied them into the model, over the averaged weights it held: the model lr_find returned held the training
    weights (1e-2 away), while WeightAveraging still took the average for being in the model."""
    setup = Setup(precision="O2", averaging="ema", batchnorm=True, num_samples=12)
    run = Run(setup, under_test=False)
    run.fit(num_epochs=2)
    before = {name: tensor.clone() for name, tensor in run.tl.model.state_dict().items()}
    masters = run.tl.precision.state_dict()["master_weights"]
    run.tl.lr_find(num_iterations=3)
    assert not differences(run.tl.model.state_dict(), before)
    assert not differences(run.tl.precision.state_dict()["master_weights"], masters)


# --- loading a checkpoint after an exception -------------------------------------------------------------------------
def test_a_checkpoint_loaded_after_an_exception_is_where_the_next_fit_continues():
    """Kills a mutant the mutation run found surviving (RunState.load keeping the exception's point): a fit stopped
    by an exception inside epoch 2, then the checkpoint of epoch 1's end loaded into the same loop: the next fit
    continues from the checkpoint, not from where the exception stopped."""
    setup = Setup(num_samples=12, batchnorm=False, shuffle=True)
    straight = Run(setup, under_test=False)
    straight.fit(num_epochs=2)
    run = Run(setup, under_test=True)
    run.fit(num_epochs=1)
    epoch_one = copy.deepcopy(run.keeper.newest)
    run.faults.arm("get_loss", 2)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=2)
    run.tl.load_checkpoint(epoch_one)
    run.fit(num_epochs=2)
    assert not differences(observe(run, {}), observe(straight, {}))


def test_spike_rollback_checks_a_continued_fit_on_the_straight_run_s_schedule():
    """Found by the property test (extended tier). After fit(num_iterations=1), fit(num_epochs=2) stops at an
    exception in the first batch's on_batch_end (the fault callback runs last: every other hook ran); the same fit
    again continues it, and SpikeRollback's first-step check of that fit judged a loss the uninterrupted run judges
    one check later: its window and pending losses differed from the straight run's (the weights did not). Fixed
    with the committed step's hooks finished by the next fit (review of issue 32, D4, D5)."""
    setup = Setup(precision="O1", spike_rollback=True, num_samples=5, batchnorm=False)
    straight = Run(setup, under_test=False)
    straight.fit(num_iterations=1)
    straight.fit(num_epochs=2)
    run = Run(setup, under_test=True)
    run.fit(num_iterations=1)
    run.faults.arm("on_batch_end", 0)
    with pytest.raises(InjectedFault):
        run.fit(num_epochs=2)
    run.fit(num_epochs=2)
    assert not differences(observe(run, {}), observe(straight, {}))


@pytest.mark.parametrize("loss", ["plain", "multi1", "multi2"])
def test_resumed_from_an_unsized_loader_s_checkpoint_after_its_last_batch_equals_straight(loss):
    """Found by the property test (extended tier, in CI). An unsized loader's mid-epoch checkpoint after its last
    batch (the loop cannot know it was the last); the epoch's end raises; a new TrainLoop resumes from that
    checkpoint and has no batch left to train: its batch index was 0 instead of the last batch's, and a MultiLoss's
    accumulated loss could not be recorded (the loss names were known only from a batch trained in this fit)."""
    from tests.combinations.test_properties import TrainingInvariant
    state = TrainingInvariant()  # driven by hand: the failing example's operations
    state.build(setup=Setup(precision="O1", loss=loss, num_samples=5, sized=False, batchnorm=False),
                faults_first=False)
    state.fit(detour=None, epochs=1, fault=(FAULT_POINTS.index("on_epoch_train_end"), 0), iterations=1,
              unit="epochs", variant=0)
    assert state.test.keeper.newest["iteration"] == 2  # mid-epoch, after both batches of 5 samples in 4s
    state.resume_from_newest_checkpoint()
    state.fit(detour=None, epochs=1, fault=None, iterations=1, unit="epochs", variant=0)  # compares with straight
    state.teardown()


def test_resumed_from_a_checkpoint_at_the_iteration_target_closes_the_epoch_as_straight():
    """Found by the property test (extended tier). fit(num_iterations=7) stops in epoch 3 after one batch; an
    exception in that epoch's end (on_epoch_train_end); a new TrainLoop loads the mid-epoch checkpoint taken after
    the 7th step and fit(num_iterations=7) again: it said "Nothing to train" and left the epoch unclosed (no
    accumulated loss, no epoch end), where the straight run closed it."""
    from tests.combinations.test_properties import TrainingInvariant
    state = TrainingInvariant()  # driven by hand: the failing example's operations
    state.build(setup=Setup(precision="O1", num_samples=9, sized=True, batchnorm=False), faults_first=False)
    state.fit(detour=None, epochs=1, fault=None, iterations=1, unit="epochs", variant=0)
    state.fit(detour=None, epochs=1, fault=(FAULT_POINTS.index("on_epoch_train_end"), 1), iterations=4,
              unit="iterations", variant=0)
    assert (state.test.keeper.newest["iteration_idx"], state.test.keeper.newest["iteration"]) == (6, 1)
    state.resume_from_newest_checkpoint()
    state.fit(detour=None, epochs=1, fault=None, iterations=1, unit="epochs", variant=0)  # compares with straight
    state.test.tl.fit(num_iterations=7)  # and now there is nothing to train
    state.teardown()


def test_lr_find_between_a_step_s_hook_exception_and_the_next_fit_keeps_the_average_s_pending_update():
    """Found by the property test (extended tier) once the step-hook faults were searched again. Two optimizers, an
    EMA, an exception in on_after_optimizer_step of the second optimizer's step; lr_find before the next fit
    restored the EMA's state from its snapshot with the step's update forgotten: the finished batch end did not
    update the average (one update fewer than the straight run, and weights off)."""
    from tests.combinations.test_properties import TrainingInvariant
    state = TrainingInvariant()  # driven by hand: the failing example's operations
    state.build(setup=Setup(precision="O1", loss="multi2", averaging="ema", num_samples=5, sized=False,
                            batchnorm=False), faults_first=False)
    state.fit(detour=None, epochs=1, fault=(FAULT_POINTS.index("on_after_optimizer_step"), 1), iterations=1,
              unit="epochs", variant=0)
    assert "on_after_optimizer_step" in state.steps[-1] and state.steps[-1].endswith("raised InjectedFault")
    state.fit(detour="lr_find", epochs=1, fault=None, iterations=1, unit="epochs", variant=0)  # compares
    state.teardown()


def test_spike_rollback_checks_a_fit_continued_after_a_hook_exception_on_the_straight_run_s_schedule():
    """Found by the derandomized extended tier: SpikeRollback's window and pending losses differ from the straight
    run's after an exception in get_loss, a fit, then one in on_after_optimizer_step and a fit (the weights do
    not). Fixed with SpikeRollback's per-step state kept for the step the next fit finishes (its on_train_begin had
    forgotten that the step was taken)."""
    from tests.combinations.test_properties import TrainingInvariant
    state = TrainingInvariant()  # driven by hand: the failing example's operations
    state.build(setup=Setup(precision="O1", spike_rollback=True, num_samples=5, sized=False, batchnorm=False),
                faults_first=False)
    state.fit(detour=None, epochs=1, fault=(FAULT_POINTS.index("get_loss"), 0), iterations=1, unit="epochs", variant=0)
    state.fit(detour=None, epochs=1, fault=None, iterations=1, unit="epochs", variant=0)
    state.fit(detour=None, epochs=1, fault=(FAULT_POINTS.index("on_after_optimizer_step"), 0), iterations=1,
              unit="epochs", variant=0)
    assert "on_after_optimizer_step" in state.steps[-1] and state.steps[-1].endswith("raised InjectedFault")
    state.fit(detour=None, epochs=1, fault=None, iterations=1, unit="epochs", variant=0)  # compares
