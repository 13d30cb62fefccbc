"""Where a checkpoint records the run: ``checkpoint_state`` takes the position from the run state, whatever moment it
is called at, and a resume from it equals the straight run (weights, optimizer state, history).

At an epoch boundary (before the first fit, after a fit that ended with an epoch, in ``on_train_begin``,
``on_epoch_begin`` before the first batch, in the epoch's end) a mid-epoch checkpoint is the epoch-end one: it recorded
the finished epoch's batch count (``tl.iteration + 1``) as a position inside the next epoch, whose first batches a
resume then skipped. Between an epoch's batches the default is the mid-epoch checkpoint, an epoch-end one is refused,
and so is a mid-epoch one inside a batch before its optimizer step (review of mutation run 42, issue 32).
"""
import copy
import io
from typing import Optional

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.multi_loss_optim import MultiOptimizer
from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, IterableTensorData, classification_data, single_torch_thread
from tests.torchtrain.train_loop.test_step_transactions import assert_runs_equal

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

BATCH_SIZE = 4


def make_loop(sized: bool = True, num_batches: int = 5) -> TrainLoop:
    """An MLP with dropout and Adam over ``num_batches`` batches an epoch: shuffled by the loader's own generator, or
    streamed from an IterableDataset without ``len``."""
    torch.manual_seed(0)
    model = MLP()
    data = classification_data(num_batches * BATCH_SIZE)
    if sized:
        train = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(1))
    else:
        train = DataLoader(IterableTensorData(data), batch_size=BATCH_SIZE)
    validation = DataLoader(classification_data(8, seed=3), batch_size=4)
    return TrainLoop(model, train, validation, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                     nn.CrossEntropyLoss(), show_progress=False)


def decaying_lr() -> LambdaLRScheduler:
    """A stateful callback that steps every optimizer step: a resume that skips or repeats a step shows in the lr."""
    return LambdaLRScheduler(lambda step: 0.95 ** step, execute_epoch_end=False, execute_batch_end=True)


def as_from_a_file(checkpoint: dict) -> dict:
    """The checkpoint written and read back (it holds the live run's tensors)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def straight_run(num_epochs: int, grad_accumulation: int, sized: bool = True, num_batches: int = 5) -> TrainLoop:
    tl = make_loop(sized, num_batches)
    tl.fit(num_epochs=num_epochs, callbacks=[decaying_lr()], grad_accumulation=grad_accumulation)
    return tl


def resumed_run(checkpoint: dict, num_epochs: int, grad_accumulation: int, sized: bool = True,
                num_batches: int = 5) -> TrainLoop:
    """A new loop (in a new process: another random state) loads ``checkpoint`` and trains to ``num_epochs``."""
    torch.manual_seed(1234)
    tl = make_loop(sized, num_batches)
    tl.load_checkpoint(checkpoint)
    tl.fit(num_epochs=num_epochs, callbacks=[decaying_lr()], grad_accumulation=grad_accumulation)
    return tl


class CheckpointIn(AbstractCallback):
    """Takes ``checkpoint_state(mid_epoch)`` once, in ``hook`` (after the other callbacks, as a checkpoint callback
    does): of epoch ``epoch``; a batch hook at the run's ``at_batch``-th batch; ``on_train_begin`` of the first fit
    that has it."""

    def __init__(self, hook: str, mid_epoch: Optional[bool], epoch: int = 0, at_batch: int = 0):
        super().__init__("checkpoint in a hook", execution_order=1000)
        self.hook, self.mid_epoch, self.epoch, self.at_batch = hook, mid_epoch, epoch, at_batch
        self.checkpoint: Optional[dict] = None

    def _take(self, hook: str) -> None:
        tl = self.train_loop_obj
        if hook in ("on_batch_begin", "on_batch_end"):
            at = tl.total_iteration_idx + 1 == self.at_batch
        else:
            at = hook == "on_train_begin" or tl.epoch == self.epoch
        due = hook == self.hook and self.checkpoint is None and at
        if due:
            self.checkpoint = as_from_a_file(tl.checkpoint_state(mid_epoch=self.mid_epoch))

    def on_train_begin(self):
        self._take("on_train_begin")

    def on_epoch_begin(self):
        self._take("on_epoch_begin")

    def on_batch_begin(self):
        self._take("on_batch_begin")

    def on_batch_end(self):
        self._take("on_batch_end")

    def on_epoch_end(self):
        self._take("on_epoch_end")


def checkpoint_at(moment: str, mid_epoch: Optional[bool], grad_accumulation: int, sized: bool = True,
                  num_batches: int = 5, epochs_before: int = 1, num_epochs: int = 3) -> dict:
    """The checkpoint ``checkpoint_state(mid_epoch)`` takes at an epoch boundary ``moment`` of a run trained for
    ``epochs_before`` epochs (``fresh``: before any fit; ``after_fit``: after ``fit(epochs_before)``; a hook: in
    that hook of a ``fit(num_epochs)``, at epoch ``epochs_before``, of the second fit for ``on_train_begin``)."""
    tl = make_loop(sized, num_batches)
    if moment == "fresh":
        return as_from_a_file(tl.checkpoint_state(mid_epoch=mid_epoch))
    if moment == "after_fit":
        tl.fit(num_epochs=epochs_before, callbacks=[decaying_lr()], grad_accumulation=grad_accumulation)
        return as_from_a_file(tl.checkpoint_state(mid_epoch=mid_epoch))
    if moment == "on_train_begin":
        tl.fit(num_epochs=epochs_before, callbacks=[decaying_lr()], grad_accumulation=grad_accumulation)
        taker = CheckpointIn(moment, mid_epoch)
        tl.fit(num_epochs=num_epochs, callbacks=[taker], grad_accumulation=grad_accumulation)
        return taker.checkpoint
    # An epoch's end counts the epoch: its checkpoint continues after epoch ``epochs_before - 1``'s end.
    taker = CheckpointIn(moment, mid_epoch, epoch=epochs_before - (moment == "on_epoch_end"))
    tl.fit(num_epochs=num_epochs, callbacks=[decaying_lr(), taker], grad_accumulation=grad_accumulation)
    return taker.checkpoint


# --- at an epoch boundary ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
@pytest.mark.parametrize("grad_accumulation", [1, 2])
@pytest.mark.parametrize("mid_epoch", [True, None, False])
def test_a_checkpoint_after_fit_resumes_as_the_straight_run(mid_epoch, grad_accumulation, sized):
    """The repro of the review: fit(1), checkpoint_state(mid_epoch=True), a new loop loads it and fits to 2 epochs. It
    trained 5 of the second epoch's 10 batches (here: none of 5, the recorded position being the whole epoch)."""
    checkpoint = checkpoint_at("after_fit", mid_epoch, grad_accumulation, sized)
    assert (checkpoint["epochs_completed"], checkpoint["iteration"]) == (1, 0)
    assert "epoch_start_rng" not in checkpoint  # the epoch-end checkpoint's content
    resumed = resumed_run(checkpoint, 2, grad_accumulation, sized)
    assert_runs_equal(resumed, straight_run(2, grad_accumulation, sized))
    assert resumed.iterations_done == 10


@pytest.mark.parametrize("grad_accumulation", [1, 2])
@pytest.mark.parametrize("moment", ["fresh", "on_train_begin", "on_epoch_begin", "on_epoch_end"])
def test_a_mid_epoch_checkpoint_at_an_epoch_boundary_is_the_epoch_end_one(moment, grad_accumulation):
    """Before any fit it failed (no epoch start state); in a hook between epochs it skipped the next epoch's first
    batches, or (in the epoch's end) recorded the epoch's accumulated loss a second time."""
    mid_epoch, epoch_end = (checkpoint_at(moment, choice, grad_accumulation) for choice in (True, False))
    assert (mid_epoch["epochs_completed"], mid_epoch["iteration"]) == \
        (epoch_end["epochs_completed"], epoch_end["iteration"])
    assert mid_epoch.keys() == epoch_end.keys()
    assert_runs_equal(resumed_run(mid_epoch, 3, grad_accumulation), straight_run(3, grad_accumulation))


# --- between an epoch's batches ----------------------------------------------------------------------------------
def test_the_default_between_an_epochs_batches_is_the_mid_epoch_checkpoint():
    """In on_batch_end of a batch that stepped, checkpoint_state() ("the run where it stands") was an epoch-end
    checkpoint, whose resume trained the epoch's first batches again."""
    taker = CheckpointIn("on_batch_end", None, at_batch=7)
    make_loop().fit(num_epochs=3, callbacks=[decaying_lr(), taker])
    assert (taker.checkpoint["epochs_completed"], taker.checkpoint["iteration"]) == (1, 2)
    assert_runs_equal(resumed_run(taker.checkpoint, 3, 1), straight_run(3, 1))


def test_an_epoch_end_checkpoint_between_an_epochs_batches_is_refused():
    tl = make_loop()
    with pytest.raises(RuntimeError, match=r"mid_epoch=False\) was called while the run stands inside epoch 1, after 2 "
                                           "of its batches committed"):
        tl.fit(num_epochs=3, callbacks=[CheckpointIn("on_batch_end", False, at_batch=7)])


class EpochEndCheckpointIn(AbstractCallback):
    """Asks for ``checkpoint_state(mid_epoch=False)`` once, in ``hook`` of the run's ``at_batch``-th batch (or the
    first call of an epoch hook), and keeps the error that refused it."""

    def __init__(self, hook: str, at_batch: int = 0):
        super().__init__("epoch-end checkpoint in a hook", execution_order=1000)
        self.hook, self.at_batch, self.error = hook, at_batch, None

    def _take(self, hook: str) -> None:
        tl = self.train_loop_obj
        if hook != self.hook or self.error is not None:
            return
        if self.at_batch and tl.total_iteration_idx + 1 != self.at_batch:
            return
        with pytest.raises(RuntimeError) as refused:
            tl.checkpoint_state(mid_epoch=False)
        self.error = refused.value

    def on_train_begin(self):
        self._take("on_train_begin")

    def on_epoch_begin(self):
        self._take("on_epoch_begin")

    def on_after_gradient_update(self, optimizer_idx):
        self._take("on_after_gradient_update")

    def on_batch_end(self):
        self._take("on_batch_end")


@pytest.mark.parametrize("hook, grad_accumulation", [("on_after_gradient_update", 1), ("on_batch_end", 2)],
                         ids=["before-the-step", "accumulating"])
def test_a_refused_epoch_end_checkpoint_counts_the_batches_committed(hook, grad_accumulation):
    """The 8th batch is the 3rd of epoch 1; the two before it are committed (their optimizer steps taken), the batch
    in progress is not: the message counted it (review of issue 32's checkpoint-position work)."""
    taker = EpochEndCheckpointIn(hook, at_batch=8)
    make_loop().fit(num_epochs=2, callbacks=[taker], grad_accumulation=grad_accumulation)
    assert "inside epoch 1, after 2 of its batches committed" in str(taker.error)


def test_an_epoch_end_checkpoint_at_a_loaded_mid_epoch_checkpoints_position_is_refused_before_and_in_fit():
    """Before fit (and in its on_train_begin) the call returned the loaded mid-epoch checkpoint, in on_epoch_begin of
    the same fit it was refused: the run stands inside the epoch in all three, and all three refuse alike."""
    source = CheckpointIn("on_batch_end", None, at_batch=8)
    make_loop().fit(num_epochs=2, callbacks=[decaying_lr(), source])
    expected = "while the run stands inside epoch 1, at the position of the loaded mid-epoch checkpoint, after 3 of " \
               "its batches committed"
    tl = make_loop()
    tl.load_checkpoint(source.checkpoint)
    with pytest.raises(RuntimeError) as before_fit:
        tl.checkpoint_state(mid_epoch=False)
    assert expected in str(before_fit.value)
    by_default = tl.checkpoint_state()  # the run where it stands: the loaded position
    assert (by_default["epochs_completed"], by_default["iteration"]) == (1, 3)
    takers = [EpochEndCheckpointIn("on_train_begin"), EpochEndCheckpointIn("on_epoch_begin")]
    tl.fit(num_epochs=2, callbacks=[decaying_lr(), *takers])
    assert [str(taker.error) for taker in takers] == [str(before_fit.value)] * 2


class CheckpointAfterEachOptimizerStep(AbstractCallback):
    """Asks for ``checkpoint_state()`` in each ``on_after_optimizer_step`` of the run's ``at_batch``-th batch (one
    call per optimizer when they step one after another) and keeps the errors that refused it."""

    def __init__(self, at_batch: int):
        super().__init__("checkpoint after each optimizer step", execution_order=1000)
        self.at_batch, self.errors = at_batch, []

    def on_after_optimizer_step(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.at_batch:
            with pytest.raises(RuntimeError) as refused:
                self.train_loop_obj.checkpoint_state()
            self.errors.append(str(refused.value))


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_checkpoint_between_the_steps_of_several_optimizers_is_refused_as_such(grad_accumulation):
    """Two optimizers step one after another (a MultiLoss, a MultiOptimizer): between their steps the run is inside
    the batch's step. The message said "inside an accumulation window" with gradient accumulation (the window's
    earlier batch was counted), and "before its optimizer step" without."""
    from tests.torchtrain.train_loop.test_per_optimizer_accumulation import TwoHeads
    torch.manual_seed(0)
    model = TwoHeads()
    loader = DataLoader(classification_data(16), batch_size=BATCH_SIZE)
    optimizer = MultiOptimizer([torch.optim.Adam(model.head_a.parameters(), lr=0.05),
                                torch.optim.Adam(model.head_b.parameters(), lr=0.05)])
    taker = CheckpointAfterEachOptimizerStep(at_batch=2)  # the batch that steps, also with grad_accumulation=2
    TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
              show_progress=False).fit(num_epochs=1, callbacks=[taker], grad_accumulation=grad_accumulation)
    assert len(taker.errors) == 2
    for stepped, message in enumerate(taker.errors, start=1):
        assert f"between the optimizer steps of batch 1 of epoch 0: {stepped} of its 2 optimizers have stepped" \
            in message
        assert "accumulation window" not in message and "before its optimizer step" not in message
        assert "on_batch_end" in message  # where to take it instead


class CheckpointAfterGradients(AbstractCallback):
    def on_after_gradient_update(self, optimizer_idx):
        self.train_loop_obj.checkpoint_state(mid_epoch=True)


@pytest.mark.parametrize("where", ["on_batch_begin", "on_after_gradient_update"])
def test_a_mid_epoch_checkpoint_inside_a_batch_before_its_step_is_refused(where):
    """It recorded the batch as trained (``tl.iteration + 1``), and the resume skipped it."""
    callback = CheckpointIn("on_batch_begin", True, at_batch=7) if where == "on_batch_begin" else \
        CheckpointAfterGradients("checkpoint after gradients")
    with pytest.raises(RuntimeError, match="before its optimizer step: it would record the batch as trained"):
        make_loop().fit(num_epochs=3, callbacks=[callback])


class Crash(Exception):
    pass


class CrashBefore(AbstractCallback):
    """Raises in ``on_batch_begin`` of the run's ``at_batch``-th batch, once."""

    def __init__(self, at_batch: int):
        super().__init__("crash", execution_order=2000)
        self.at_batch = at_batch

    def on_batch_begin(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.at_batch:
            self.at_batch = -1
            raise Crash()


@pytest.mark.parametrize("grad_accumulation", [1, 2])
@pytest.mark.parametrize("mid_epoch", [True, None])
def test_a_checkpoint_before_a_continued_epochs_batches_records_where_it_continues(mid_epoch, grad_accumulation):
    """In on_epoch_begin of the fit that continues after an exception, the loop's counters are still those of the
    batch that raised: the checkpoint recorded that batch (or, by default, the epoch's start) as the position."""
    tl = make_loop()
    with pytest.raises(Crash):
        tl.fit(num_epochs=3, callbacks=[decaying_lr(), CrashBefore(9)], grad_accumulation=grad_accumulation)
    taker = CheckpointIn("on_epoch_begin", mid_epoch, epoch=1)
    tl.fit(num_epochs=3, callbacks=[taker], grad_accumulation=grad_accumulation)
    straight = straight_run(3, grad_accumulation)
    assert_runs_equal(tl, straight)
    # The 9th batch is the epoch's 4th: the batches before it whose window stepped are done.
    assert (taker.checkpoint["epochs_completed"], taker.checkpoint["iteration"]) == (1, 3 - 3 % grad_accumulation)
    assert_runs_equal(resumed_run(taker.checkpoint, 3, grad_accumulation), straight)


def test_an_epoch_end_checkpoint_before_a_continued_epochs_batches_is_refused():
    tl = make_loop()
    with pytest.raises(Crash):
        tl.fit(num_epochs=3, callbacks=[decaying_lr(), CrashBefore(9)])
    with pytest.raises(RuntimeError, match=r"mid_epoch=False\) was called while the run stands inside epoch 1, where "
                                           "the fit that stopped inside it continues, after 3 of its batches "
                                           "committed"):
        tl.fit(num_epochs=3, callbacks=[CheckpointIn("on_epoch_begin", False, epoch=1)])


# --- the invariant, drawn ----------------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(num_batches=st.integers(1, 6), grad_accumulation=st.integers(1, 3), sized=st.booleans(),
       epochs_before=st.integers(1, 2), mid_epoch=st.sampled_from([True, None, False]),
       moment=st.sampled_from(["after_fit", "on_train_begin", "on_epoch_begin", "on_epoch_end"]))
@example(num_batches=5, grad_accumulation=1, sized=True, epochs_before=1, mid_epoch=True, moment="after_fit")
@example(num_batches=5, grad_accumulation=2, sized=False, epochs_before=2, mid_epoch=True, moment="on_epoch_end")
def test_a_checkpoint_at_an_epoch_boundary_resumes_as_the_straight_run(num_batches, grad_accumulation, sized,
                                                                       epochs_before, mid_epoch, moment):
    """Any epoch length (windows ending on and off the epoch's end), accumulation, sized or not, any choice of
    mid_epoch, at any boundary after 1 or 2 epochs: the resume from it equals the straight run of 3 epochs."""
    checkpoint = checkpoint_at(moment, mid_epoch, grad_accumulation, sized, num_batches, epochs_before)
    assert checkpoint["iteration"] == 0
    resumed = resumed_run(checkpoint, 3, grad_accumulation, sized, num_batches)
    assert_runs_equal(resumed, straight_run(3, grad_accumulation, sized, num_batches))


def test_a_finished_runs_checkpoint_loaded_into_a_fit_with_nothing_to_train_is_the_run_as_it_ended():
    """A requeued job's auto_resume loads the checkpoint of a run that had finished and calls fit to the same total:
    nothing is trained, and the run stands as it ended (the scheduler registered by that fit had reset the learning
    rate, and the random state was not restored: a later fit went on from other values; review 45b)."""
    straight = make_loop()
    straight.fit(num_epochs=2, callbacks=[decaying_lr()])
    checkpoint = as_from_a_file(straight.checkpoint_state())
    rng_at_end = torch.get_rng_state()
    torch.manual_seed(1234)  # another random state in between
    resumed = make_loop()
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=2, callbacks=[decaying_lr()])
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    assert torch.equal(torch.get_rng_state(), rng_at_end)
    assert_runs_equal(resumed, straight)
    for tl in (straight, resumed):
        torch.set_rng_state(rng_at_end)
        tl.fit(num_epochs=3)
    assert_runs_equal(resumed, straight)


class FailsOnceInEpochTrainEnd(AbstractCallback):
    def __init__(self):
        super().__init__("fails once in on_epoch_train_end")
        self.failed = False

    def on_epoch_train_end(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("planned failure in the epoch's end")


def test_a_checkpoint_after_fit_stopped_in_the_epochs_end_is_refused_until_fit_finishes_it():
    """Stopped before the epoch's evaluation, the checkpoint recorded the epoch as finished, and a resume skipped the
    rest of its end (the evaluation, the callbacks' on_epoch_end; review 45b): refused, and taken once the next fit
    finished the end, it resumes as the straight run. (Stopped in on_epoch_end, by a checkpoint callback's failed
    save, it is the epoch's state its error message says to save elsewhere: test_model_save.py.)"""
    straight = straight_run(2, 1)
    tl = make_loop()
    with pytest.raises(RuntimeError, match="planned failure"):
        tl.fit(num_epochs=1, callbacks=[decaying_lr(), FailsOnceInEpochTrainEnd()])
    for mid_epoch in (None, True, False):
        with pytest.raises(RuntimeError, match="stopped in the end of epoch 0 before the epoch was evaluated"):
            tl.checkpoint_state(mid_epoch=mid_epoch)
    tl.fit(num_epochs=1)
    checkpoint = as_from_a_file(tl.checkpoint_state())
    resumed = make_loop()
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=2, callbacks=[decaying_lr()])
    assert_runs_equal(resumed, straight)


class CheckpointInEpochTrainEnd(AbstractCallback):
    """Takes ``checkpoint_state(mid_epoch)`` in ``on_epoch_train_end`` of epoch 1 (last of the callbacks, as a
    checkpoint callback runs), keeping it or the error it raised."""

    def __init__(self, mid_epoch: Optional[bool]):
        super().__init__("checkpoint in on_epoch_train_end", execution_order=1000)
        self.mid_epoch, self.checkpoint, self.error = mid_epoch, None, None

    def on_epoch_train_end(self):
        if self.train_loop_obj.epoch == 1:
            try:
                self.checkpoint = as_from_a_file(self.train_loop_obj.checkpoint_state(mid_epoch=self.mid_epoch))
            except RuntimeError as error:
                self.error = error
                raise


@pytest.mark.parametrize("loss", ["plain", "multi2"])
@pytest.mark.parametrize("mid_epoch", [None, False, True])
def test_a_checkpoint_in_on_epoch_train_end_is_refused_at_save_time(mid_epoch, loss):
    """Review 45b (two optimizers of a MultiLoss; any loop): a checkpoint taken in ``on_epoch_train_end`` recorded
    the epoch as done, and a run resumed from it never ran the rest of the epoch's end: the epoch's evaluated
    ``loss``/``val_loss`` were missing from the history and the epoch-stepping scheduler's step from the learning
    rate (weights off from the next epoch on). The checkpoint cannot hold which hooks of that end still run, so it
    is refused when it is taken, naming the hook to take it in; the run goes on from the same state once the callback
    takes it in ``on_epoch_end`` instead."""
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
    from tests.combinations.support import Cell, build_loop

    def loop() -> TrainLoop:
        if loss == "plain":
            return make_loop()
        tl = build_loop(Cell(loss=loss))  # two optimizers; its train-set loss evaluated at each epoch end
        tl.end_auto_eval = True
        return tl

    taker = CheckpointInEpochTrainEnd(mid_epoch)
    tl = loop()
    with pytest.raises(RuntimeError, match="on_epoch_train_end") as raised:
        tl.fit(num_epochs=3, callbacks=[StepLRScheduler(step_size=1, gamma=0.5), taker])
    assert raised.value is taker.error and taker.checkpoint is None
    message = str(raised.value)
    assert "end of epoch 1" in message and "before its evaluation" in message and "on_epoch_end" in message
    assert tl.epochs_completed == 1 and len(tl.train_history["accumulated_loss" if loss == "plain"
                                                             else "accumulated_loss_main"]) == 2
    # The refused save left the run as it was: the next fit finishes the epoch's end, as the straight run did it.
    taker.on_epoch_train_end = lambda: None
    tl.fit(num_epochs=3)
    straight = loop()
    straight.fit(num_epochs=3, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])
    assert_runs_equal(tl, straight)


# --- after an exception inside an epoch --------------------------------------------------------------------------
class RaiseBefore(AbstractCallback):
    """Raises once, in ``on_batch_begin`` of the run's ``at_batch``-th batch (fetched from the loader already)."""

    def __init__(self, at_batch: int):
        super().__init__("raise before a batch")
        self.at_batch, self.raised = at_batch, False

    def on_batch_begin(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.at_batch and not self.raised:
            self.raised = True
            raise RuntimeError("stopped before a batch")


def stateful_loop() -> TrainLoop:
    """make_loop's run over torchdata's StatefulDataLoader, which keeps its own position."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    tl = make_loop()
    tl.train_loader = stateful_dataloader.StatefulDataLoader(
        tl.train_loader.dataset, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(1))
    return tl


@pytest.mark.parametrize("loader", ["DataLoader", "StatefulDataLoader"])
@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_checkpoint_after_an_exception_inside_an_epoch_resumes_at_the_batch_that_raised(loader, grad_accumulation):
    """The exception came after the loader had yielded batch 8 (epoch 1's third): the run stands at its last step
    point, and a checkpoint taken now trains that batch again on resume. A loader keeping its own position had
    moved past the batch: its state was saved, and the resume skipped the batch (review of stop 47)."""
    make = stateful_loop if loader == "StatefulDataLoader" else make_loop

    def fit(tl, callbacks=None):
        tl.fit(num_epochs=2, callbacks=[decaying_lr(), *(callbacks or [])], grad_accumulation=grad_accumulation)

    straight = make()
    fit(straight)
    interrupted = make()
    with pytest.raises(RuntimeError, match="stopped before a batch"):
        fit(interrupted, [RaiseBefore(at_batch=8)])
    checkpoint = as_from_a_file(interrupted.checkpoint_state(mid_epoch=True))
    torch.manual_seed(1234)
    resumed = make()
    resumed.load_checkpoint(checkpoint)
    fit(resumed)
    assert_runs_equal(resumed, straight)


def test_a_checkpoint_after_an_exception_with_a_stateful_loaders_persistent_workers_is_refused():
    """Its resume would need a new worker iterator where the run reset its persistent one (another order): refused
    with what to do, never a silently other run."""
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    tl = make_loop()
    tl.train_loader = stateful_dataloader.StatefulDataLoader(
        tl.train_loader.dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=1, persistent_workers=True)
    with pytest.raises(RuntimeError, match="stopped before a batch"):
        tl.fit(num_epochs=2, callbacks=[RaiseBefore(at_batch=8)])
    with pytest.raises(RuntimeError, match="persistent_workers=True.*Call fit\\(\\) again"):
        tl.checkpoint_state(mid_epoch=True)
    tl.fit(num_epochs=2)  # the continuing fit is unaffected
