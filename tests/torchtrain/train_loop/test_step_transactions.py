"""A step is a transaction (DESIGN.md principle 17): what a step changes is committed at the step point or not at all,
and an epoch's end is a sequence of named steps, each done once. Continuing after an exception, resuming from a
checkpoint taken at any moment and loading a checkpoint dict then equal the straight run (issue 32)."""
import copy
import logging
import os
import shutil
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.experiment_folder import DEFAULT_RUNS_FOLDER
from aitoolbox.torchtrain.callbacks import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.combinations.support import Cell, ComboNet, build_loop, build_model, dataset
from tests.helpers import MLP, assert_params_equal, classification_data, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


def _tensors(value, prefix=""):
    """Every tensor in a nested checkpoint dict, by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {path: tensor for key, item in value.items() for path, tensor in _tensors(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {path: tensor for index, item in enumerate(value)
                for path, tensor in _tensors(item, f"{prefix}/{index}").items()}
    return {}


def assert_runs_equal(a: TrainLoop, b: TrainLoop) -> None:
    """Weights and buffers, optimizer states and history bitwise equal."""
    assert_params_equal(a.model, b.model)
    for optimizer_a, optimizer_b in zip(a.optimizers, b.optimizers):
        state_a, state_b = _tensors(optimizer_a.state_dict()), _tensors(optimizer_b.state_dict())
        assert state_a.keys() == state_b.keys()
        for path in state_a:
            assert torch.equal(state_a[path], state_b[path]), f"optimizer state {path} differs"
    assert dict(a.train_history) == dict(b.train_history)


class IterationCounter(AbstractCallback):
    def __init__(self):
        super().__init__("iterations")
        self.batches = 0

    def on_batch_end(self):
        self.batches += 1


# --- item 2: a checkpoint records the run state's own counters ------------------------------------------------
def test_a_checkpoint_taken_before_training_resumes_at_the_first_epoch():
    """``checkpoint_state()`` on a fresh loop recorded ``epochs_completed=1`` (it wrote ``epoch + 1``): loading it
    and fitting 2 epochs trained one."""
    fresh = build_loop(Cell())
    checkpoint = fresh.checkpoint_state()
    assert checkpoint["epochs_completed"] == 0 and checkpoint["iteration"] == 0

    resumed = build_loop(Cell())
    resumed.load_checkpoint(checkpoint)
    counter = IterationCounter()
    resumed.fit(num_epochs=2, callbacks=[counter])
    assert counter.batches == 2 * len(resumed.train_loader)
    straight = build_loop(Cell())
    straight.fit(num_epochs=2)
    assert_runs_equal(resumed, straight)


def test_checkpoints_after_fit_and_at_an_epoch_end_record_the_epochs_done():
    """After ``fit(num_epochs=1)``: 1 epoch done. In ``on_epoch_end`` of the second epoch: 2 (the epoch is ending,
    and the checkpoint is the run after its end)."""
    saved = {}

    class SaveAtEpochEnd(AbstractCallback):
        def on_epoch_end(self):
            saved[self.train_loop_obj.epoch] = self.train_loop_obj.checkpoint_state()

    tl = build_loop(Cell())
    tl.fit(num_epochs=1)
    assert tl.checkpoint_state()["epochs_completed"] == 1
    tl.fit(num_epochs=2, callbacks=[SaveAtEpochEnd("save")])
    assert saved[1]["epochs_completed"] == 2 and saved[1]["iteration"] == 0


# --- item 3: an epoch's end is a sequence of named steps, each done once -----------------------------------------
class FailOnceInEpochEnd(AbstractCallback):
    """In ``on_epoch_end`` of epoch ``epoch``: records a value into the history, then (the first time only) raises, as
    a checkpoint save on a full disk would. Runs after the LR scheduler and EarlyStopping (order 100)."""

    hook = "on_epoch_end"

    def __init__(self, epoch):
        super().__init__("fail once", execution_order=100)
        self.epoch, self.failed, self.calls = epoch, False, []

    def _maybe_fail(self):
        tl = self.train_loop_obj
        self.calls.append(tl.epoch)
        tl.insert_metric_result_into_history(f"{self.hook}_marker", float(tl.epoch))
        if tl.epoch == self.epoch and not self.failed:
            self.failed = True
            raise OSError(28, "No space left on device")

    def on_epoch_end(self):
        self._maybe_fail()


class FailOnceInEpochTrainEnd(FailOnceInEpochEnd):
    hook = "on_epoch_train_end"
    on_epoch_end = AbstractCallback.on_epoch_end

    def on_epoch_train_end(self):
        self._maybe_fail()


class CountsEpochEnds(AbstractCallback):
    def __init__(self):
        super().__init__("counts", execution_order=50)
        self.train_ends, self.ends = [], []

    def on_epoch_train_end(self):
        self.train_ends.append(self.train_loop_obj.epoch)

    def on_epoch_end(self):
        self.ends.append(self.train_loop_obj.epoch)


@pytest.mark.parametrize("failing_class", [FailOnceInEpochEnd, FailOnceInEpochTrainEnd])
def test_an_exception_in_the_epoch_end_does_not_repeat_the_steps_it_finished(failing_class):
    """A callback's ``on_epoch_end`` raised; the next ``fit`` called every ``on_epoch_end`` again: the per-epoch LR
    scheduler stepped twice and EarlyStopping counted the epoch twice (it stopped an epoch early). Now the continued
    fit runs only the steps of the end that did not finish: equal to the straight run in weights, learning rate,
    EarlyStopping's state, history and the hooks each callback got."""
    from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler

    def run(fail_at):
        tl = build_loop(Cell())
        failing, counts = failing_class(fail_at), CountsEpochEnds()
        stopping = EarlyStopping(monitor="accumulated_loss", min_delta=100.0, patience=1)
        callbacks = [StepLRScheduler(step_size=1, gamma=0.5), stopping, failing, counts]
        if fail_at is not None:
            with pytest.raises(OSError, match="No space left"):
                tl.fit(num_epochs=5, callbacks=callbacks)
            callbacks = None
        tl.fit(num_epochs=5, callbacks=callbacks)
        return tl, stopping, failing, counts

    straight, straight_stopping, straight_failing, straight_counts = run(None)
    continued, stopping, failing, counts = run(1)
    assert straight.epochs_completed == continued.epochs_completed == 3  # EarlyStopping stopped after epoch 2
    assert continued.optimizers[0].param_groups[0]["lr"] == straight.optimizers[0].param_groups[0]["lr"]
    assert_runs_equal(continued, straight)
    assert stopping.state_dict() == straight_stopping.state_dict()
    assert (counts.train_ends, counts.ends) == (straight_counts.train_ends, straight_counts.ends) == ([0, 1, 2],) * 2
    assert failing.calls == [0, 1, 1, 2]  # the failed call is made again, once


@pytest.mark.parametrize("length", [{"num_epochs": 5}, {"num_iterations": 10}])
def test_an_interrupted_epoch_end_is_finished_by_the_next_fit_even_when_training_is_over(length):
    """In the last epoch's end (EarlyStopping asked to stop in it; or num_iterations is reached) a later callback
    raised: the next fit must still finish that end (the failed callback, the epoch count, on_train_end), not report
    "nothing to train"."""
    from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping

    class TrainEnds(AbstractCallback):
        def __init__(self):
            super().__init__("train ends")
            self.count = 0

        def on_train_end(self):
            self.count += 1

    def run(fail_at):
        tl = build_loop(Cell())
        failing, ends = FailOnceInEpochEnd(fail_at), TrainEnds()
        callbacks = [EarlyStopping(monitor="accumulated_loss", min_delta=100.0, patience=0), failing, ends]
        if fail_at is not None:
            with pytest.raises(OSError):
                tl.fit(callbacks=callbacks, **length)
            callbacks = None
        tl.fit(callbacks=callbacks, **length)
        return tl, failing, ends

    straight, straight_failing, straight_ends = run(None)
    continued, failing, ends = run(1)
    assert continued.epochs_completed == straight.epochs_completed == 2
    assert continued.early_stop == straight.early_stop
    assert failing.calls == [0, 1, 1] and ends.count == straight_ends.count == 1
    assert_runs_equal(continued, straight)


class FailOnceAtBatchEnd(AbstractCallback):
    """Raises in ``on_batch_end`` of the batch ``at`` (counted over the run, after its optimizer step), once."""

    def __init__(self, at):
        super().__init__("fail at batch end")
        self.at, self.failed = at, False

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("a failure after the last batch's step")


@pytest.mark.parametrize("where,loss,grad_accumulation,num_iterations", [
    ("batch_end", "plain", 1, 8), ("batch_end", "multi2", 2, 8), ("second_optimizer_step", "multi2", 1, 8),
    ("batch_end", "plain", 1, 1)])
def test_an_exception_in_the_last_batch_of_fit_num_iterations_is_finished_by_the_same_fit_again(
        where, loss, grad_accumulation, num_iterations):
    """fit(num_iterations=N) raised in its last batch after the batch's step (in on_batch_end; or in the second
    optimizer's step, the first had stepped): fit(num_iterations=N) again said "Nothing to train" and never finished
    the step or closed the shortened epoch (accumulated_loss, epochs_completed, the epoch-stepping scheduler). With 5
    batches an epoch, N = 8 is the third batch of the second epoch; N = 1 the first batch of the run (the mutation
    run: a target of 1 counted as none)."""
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
    epochs_at_target = 1 + num_iterations // 5

    def run(fail):
        tl = build_loop(Cell(loss=loss))
        callbacks = [StepLRScheduler(step_size=1, gamma=0.5)]
        if fail and where == "batch_end":
            callbacks.append(FailOnceAtBatchEnd(num_iterations - 1))
        elif fail:
            calls = []

            def fail_at_last(optimizer, args, kwargs):
                calls.append(None)
                if len(calls) == num_iterations:
                    raise RuntimeError("the second optimizer's step failed")
            tl.optimizers[1].register_step_pre_hook(fail_at_last)
        if fail:
            with pytest.raises(RuntimeError):
                tl.fit(num_iterations=num_iterations, callbacks=callbacks, grad_accumulation=grad_accumulation)
            callbacks = None
        tl.fit(num_iterations=num_iterations, callbacks=callbacks, grad_accumulation=grad_accumulation)
        at_target = (tl.epochs_completed, tl.iterations_done, [o.param_groups[0]["lr"] for o in tl.optimizers])
        return tl, at_target

    straight, straight_at_target = run(False)
    continued, at_target = run(True)
    assert at_target == straight_at_target and at_target[:2] == (epochs_at_target, num_iterations)
    assert_runs_equal(continued, straight)
    for tl in (straight, continued):
        torch.manual_seed(1)  # the same RNG state for both (the other loop's fit drew from the global one)
        tl.fit(num_iterations=num_iterations + 5, grad_accumulation=grad_accumulation)
    assert continued.epochs_completed == straight.epochs_completed == epochs_at_target + 1
    assert_runs_equal(continued, straight)


class TrainBegins(AbstractCallback):
    def __init__(self):
        super().__init__("train begins")
        self.count = 0

    def on_train_begin(self):
        self.count += 1


def _progress(tl: TrainLoop):
    return tl.epochs_completed, tl.iterations_done, dict(tl.train_history), copy.deepcopy(tl.model.state_dict())


def _assert_same_progress(a, b):
    assert a[:3] == b[:3]
    for name, tensor in a[3].items():
        assert torch.equal(tensor, b[3][name]), name


@pytest.mark.parametrize("where", ["mid_epoch", "first_batch_of_an_epoch", "epoch_end_checkpoint"])
def test_fit_num_iterations_already_done_trains_nothing_and_keeps_the_continuation(where):
    """fit(num_iterations=N) with N batches already trained says "Nothing to train" and changes nothing where the
    run does not stand inside the epoch batch N is in: N below the batches done (after an exception a step later),
    an exception in the first batch of the next epoch (before its first step), a loaded epoch-end checkpoint. Only
    a run stopped inside batch N's epoch after batch N (an exception in batch N after its step or in batch N + 1
    before its step, or a mid-epoch checkpoint there) leaves that fit the epoch's end to do (see the test above).
    Found by the mutation run (mut47: a target passed counted as reached exactly; a stop before an epoch's first
    step, or an epoch-end checkpoint, counted as a position inside the epoch). 5 batches an epoch."""
    total = 10
    straight = build_loop(Cell())
    straight.fit(num_iterations=total)

    if where == "epoch_end_checkpoint":
        first = build_loop(Cell())
        first.fit(num_iterations=5)
        checkpoint = copy.deepcopy(first.checkpoint_state())  # (before build_loop seeds the process's RNG)
        tl, done = build_loop(Cell()), 5
        tl.load_checkpoint(checkpoint)
    else:
        # get_loss raises at batch 7 (after batch 6's step: 1 batch of epoch 2 done) or at batch 6 (epoch 2's first)
        at = 6 if where == "mid_epoch" else 5
        tl = build_loop(Cell(), model=FailOnceInGetLoss(at=at))
        with pytest.raises(RuntimeError, match="get_loss failed"):
            tl.fit(num_iterations=total)
        done = at
        assert tl.iterations_done == done
    before, begins = _progress(tl), TrainBegins()
    # (fit(num_iterations=6) after the exception at batch 7 is at its target: it closes the shortened epoch.)
    for number, num_iterations in enumerate([4] if where == "mid_epoch" else [done, 4]):
        tl.fit(num_iterations=num_iterations, callbacks=[begins] if number == 0 else None)
    assert begins.count == 0  # nothing started
    _assert_same_progress(_progress(tl), before)

    tl.fit(num_iterations=total)
    assert_runs_equal(tl, straight)


class FailOnceInGetLoss(ComboNet):
    """ComboNet whose ``get_loss`` raises once, at the ``at``-th call (before the batch's forward)."""

    def __init__(self, at):
        torch.manual_seed(0)
        super().__init__("plain")
        self.at, self.calls = at, 0

    def get_loss(self, batch_data, criterion, device):
        self.calls += 1
        if self.calls == self.at + 1:
            raise RuntimeError("get_loss failed")
        return super().get_loss(batch_data, criterion, device)


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_mid_epoch_checkpoint_taken_after_an_exception_records_the_last_step_point(grad_accumulation):
    """checkpoint_state(mid_epoch=True) after fit raised in batch 3 recorded the batch that raised (iteration 4,
    its RNG): a resume from it skipped the batches since the last step."""
    straight = build_loop(Cell())
    straight.fit(num_epochs=2, grad_accumulation=grad_accumulation)

    interrupted = build_loop(Cell(), model=FailOnceInGetLoss(at=3))
    with pytest.raises(RuntimeError, match="get_loss failed"):
        interrupted.fit(num_epochs=2, grad_accumulation=grad_accumulation)
    checkpoint = copy.deepcopy(interrupted.checkpoint_state(mid_epoch=True))
    assert checkpoint["iteration"] == 3 - (3 % grad_accumulation)  # the batches up to the last step

    resumed = build_loop(Cell())
    torch.manual_seed(999)  # the checkpoint's RNG state, not the process's, continues the run
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=2, grad_accumulation=grad_accumulation)
    assert_runs_equal(resumed, straight)


@pytest.mark.parametrize("grad_accumulation, at", [(1, 8), (2, 8), (1, 5)])
def test_checkpoint_state_after_an_exception_inside_an_epoch_continues_after_its_last_step(grad_accumulation, at):
    """checkpoint_state() with its default (what docs/checkpointing.rst advises after a failed save) after fit raised
    inside an epoch's batches wrote an epoch-end checkpoint: a resume started that epoch again on weights already
    trained on its first batches, training them twice (review of issue 32). By default it is now the mid-epoch
    checkpoint of the last step point, and an explicit epoch-end one is refused.

    Raised in the epoch's first batch (at=5: 5 batches an epoch) nothing of the epoch is trained, and either kind of
    checkpoint starts the epoch again; they held the random state after the epoch's DataLoader iterator had drawn its
    seed, so the resumed epoch drew other dropout masks. They hold the epoch's starting state now."""
    straight = build_loop(Cell())
    straight.fit(num_epochs=3, grad_accumulation=grad_accumulation)

    interrupted = build_loop(Cell(), model=FailOnceInGetLoss(at=at))
    with pytest.raises(RuntimeError, match="get_loss failed"):
        interrupted.fit(num_epochs=3, grad_accumulation=grad_accumulation)
    batches_done = at % 5 - (at % 5) % grad_accumulation
    if batches_done:
        with pytest.raises(RuntimeError, match=f"inside epoch 1, where the fit that stopped inside it continues, "
                                                 f"after {batches_done} of its batches committed"):
            interrupted.checkpoint_state(mid_epoch=False)
        checkpoints = [interrupted.checkpoint_state()]
    else:
        checkpoints = [interrupted.checkpoint_state(mid_epoch=mid_epoch) for mid_epoch in (None, False, True)]
    for checkpoint in map(copy.deepcopy, checkpoints):
        assert (checkpoint["epochs_completed"], checkpoint["iteration"]) == (1, batches_done)
        resumed = build_loop(Cell())
        resumed.load_checkpoint(checkpoint)
        resumed.fit(num_epochs=3, grad_accumulation=grad_accumulation)
        assert_runs_equal(resumed, straight)


class CheckpointEveryBatch(AbstractCallback):
    """Takes a mid-epoch checkpoint at every batch end: its iteration into ``taken``, a refusal's message into
    ``refused``."""

    def __init__(self, taken, refused):
        super().__init__("checkpoint every batch")
        self.taken, self.refused = taken, refused

    def on_batch_end(self):
        try:
            self.taken.append(self.train_loop_obj.checkpoint_state(mid_epoch=True)["iteration"])
        except RuntimeError as error:
            self.refused.append(str(error))


def test_a_mid_epoch_checkpoint_inside_an_accumulation_window_is_refused():
    """Inside a window the gradients of the batches since the last step are not in a checkpoint: a resume from it
    skipped them. Refused, naming where; at the window's step it is taken."""
    taken, refused = [], []
    tl = build_loop(Cell())
    tl.fit(num_iterations=4, grad_accumulation=3, callbacks=[CheckpointEveryBatch(taken, refused)])
    assert taken == [3, 4]  # the window's step (batch 2) and num_iterations' step (batch 3)
    assert len(refused) == 2
    assert "inside an accumulation window (batch 0 of epoch 0, 1 batch(es) since the last optimizer step with " \
           "grad_accumulation=3)" in refused[0]
    assert "optimizer_step_due" in refused[0]


def test_a_mid_epoch_checkpoint_at_every_step_of_two_optimizers_stepped_in_turn_is_taken():
    """A MultiLoss with two optimizers and accumulation 2 (5 batches: windows ending at batches 2, 4 and 5): at each
    window's step the run is at a step point, nothing accumulated."""
    taken, refused = [], []
    tl = build_loop(Cell(loss="multi2"))
    tl.fit(num_epochs=1, grad_accumulation=2, callbacks=[CheckpointEveryBatch(taken, refused)])
    assert taken == [2, 4, 5]
    assert len(refused) == 2 and all("1 batch(es) since the last optimizer step" in message for message in refused)


def test_mid_epoch_checkpoints_before_any_fit_are_not_refused():
    """Before the first fit nothing is accumulated: no mid-epoch checkpoint is inside a window, also not the second
    one (the first set the loop up, with its step runner)."""
    tl = build_loop(Cell())
    for _ in range(2):
        tl.checkpoint_state(mid_epoch=True)


# --- item 4: the step point holds the buffers -------------------------------------------------------------------
class FailOnceAtBatch(AbstractCallback):
    """Raises in ``on_batch_end`` of the batch ``at`` (counted over the run), once."""

    def __init__(self, at):
        super().__init__("fail at batch")
        self.at, self.failed = at, False

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("a failure in the middle of an accumulation window")


def _evaluated_loop(model):
    loader = DataLoader(dataset(), batch_size=8)
    return TrainLoop(model, loader, DataLoader(dataset(), batch_size=8), None,
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), end_auto_eval=True,
                     show_progress=False)


@pytest.mark.parametrize("fail_at", [1, 6])
def test_continuing_after_an_exception_mid_window_counts_batchnorm_statistics_once(fail_at):
    """With accumulation 3, an exception after the window's first or second batch: the continued fit trains those
    batches again. Their BatchNorm updates were counted twice (num_batches_tracked 12 or 11 instead of 10; the
    running statistics, and so ``loss`` and ``val_loss``, differed). The step point holds the buffers now."""
    def run(fail):
        torch.manual_seed(0)
        tl = _evaluated_loop(ComboNet())
        callbacks = [FailOnceAtBatch(fail)] if fail is not None else []
        if fail is not None:
            with pytest.raises(RuntimeError, match="middle of an accumulation window"):
                tl.fit(num_epochs=2, grad_accumulation=3, callbacks=callbacks)
        tl.fit(num_epochs=2, grad_accumulation=3, callbacks=None if fail is not None else callbacks)
        return tl

    straight, continued = run(None), run(fail_at)
    assert int(continued.model.bn.num_batches_tracked) == int(straight.model.bn.num_batches_tracked) == 10
    assert_runs_equal(continued, straight)


# --- item 13: what cannot train is said plainly ---------------------------------------------------------------
def _plain_loop(model, optimizer, criterion=None):
    return TrainLoop(model, DataLoader(dataset(), batch_size=8), None, None, optimizer,
                     criterion if criterion is not None else nn.CrossEntropyLoss(), end_auto_eval=False,
                     show_progress=False)


def test_an_optimizer_over_another_models_parameters_is_refused_at_fit_start():
    """A model built again after its optimizer: the optimizer steps the old model's parameters and the model never
    changed (silently). Now fit refuses before training, saying why."""
    stale = ComboNet()
    model = ComboNet()
    before = copy.deepcopy(model.state_dict())
    tl = _plain_loop(model, torch.optim.Adam(stale.parameters(), lr=1e-2))
    with pytest.raises(ValueError, match=r"none of the optimizers' 6 parameter\(s\) is a parameter of the model"):
        tl.fit(num_epochs=1)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize("use_amp", [False, {"opt_level": "O2"}])
def test_an_optimizer_with_some_foreign_parameters_is_warned_about(use_amp):
    """Part of the parameters outside the model (and the criterion): a warning naming how many and their shapes. The
    check sees through amp's float32 master weights (O2: the optimizer steps copies of the model's parameters), and
    a criterion's own parameters are the run's."""
    model = ComboNet()
    extra = nn.Parameter(torch.zeros(5, 2))
    weighting = nn.Linear(1, 1)  # a criterion with parameters: trained by the optimizer too, legitimately

    class WeightedLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.weighting = weighting

        def forward(self, logits, target):
            return nn.functional.cross_entropy(logits, target) * self.weighting.weight.squeeze() ** 2

    tl = _plain_loop(model, torch.optim.Adam([*model.parameters(), *weighting.parameters(), extra], lr=1e-2),
                     WeightedLoss())
    tl.use_amp = use_amp
    with pytest.warns(UserWarning, match=r"optimizer 0 \(Adam\) holds 1 of its 9 parameter\(s\).*\(5, 2\)"):
        tl.fit(num_epochs=1)


class LossOf(ComboNet):
    def __init__(self, make_loss):
        super().__init__()
        self.make_loss = make_loss

    def get_loss(self, batch_data, criterion, device):
        return self.make_loss(super().get_loss(batch_data, criterion, device), self(batch_data[0])[0])


@pytest.mark.parametrize("make_loss, error, message", [
    (lambda loss, logits: loss.detach(), ValueError, "does not require grad"),
    (lambda loss, logits: torch.tensor(loss.item()), ValueError, r"\.item\(\), torch\.tensor"),
    (lambda loss, logits: (logits.argmax(dim=1) == 0).sum(), TypeError, "dtype torch.int64: a loss must be a floating"),
])
def test_a_detached_or_integer_loss_gets_a_message_naming_get_loss(make_loss, error, message):
    """Torch's raw "element 0 of tensors does not require grad and does not have a grad_fn" named neither get_loss
    nor the cause."""
    model = LossOf(make_loss)
    tl = _plain_loop(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(error, match=f"get_loss returned.*{message}"):
        tl.fit(num_epochs=1)


# --- item 10: a checkpoint dict handed to load_checkpoint stays the caller's --------------------------------------
@pytest.mark.parametrize("mid_epoch", [False, True])
def test_load_checkpoint_of_a_dict_leaves_the_dict_as_it_was(mid_epoch):
    """``load_checkpoint(dict)`` then ``fit`` changed the caller's dict (the optimizer's state tensors were shared
    with it): loading it again continued from another state. Every tensor of the dict is as saved after the fit, and
    a second loop loading it trains as the first."""
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
    from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
    saved = {}

    class Save(AbstractCallback):
        def on_batch_end(self):
            if self.train_loop_obj.total_iteration_idx == 6 and mid_epoch:
                saved["checkpoint"] = self.train_loop_obj.checkpoint_state(mid_epoch=True)

    def callbacks():
        return [StepLRScheduler(step_size=1, gamma=0.5),
                EarlyStopping(monitor="accumulated_loss_main", patience=5)]

    cell = Cell(precision="O2", loss="multi2")
    first = build_loop(cell)
    first.fit(num_epochs=2, callbacks=callbacks() + [Save("save")])
    checkpoint = saved["checkpoint"] if mid_epoch else first.checkpoint_state()
    pristine = copy.deepcopy(checkpoint)

    runs = []
    for _ in range(2):
        resumed = build_loop(cell)
        resumed.load_checkpoint(checkpoint)
        resumed.fit(num_epochs=4, callbacks=callbacks())
        runs.append(resumed)
        got, expected = _tensors(checkpoint), _tensors(pristine)
        assert got.keys() == expected.keys()
        for path in expected:
            assert torch.equal(got[path], expected[path]), f"the caller's checkpoint changed at {path}"
        assert checkpoint.keys() == pristine.keys()
    assert_runs_equal(*runs)


# --- an exception in a callback's hook after a committed step (review of issue 32, D4, D5) ---------------------
class FailOnceInHook(AbstractCallback):
    """Raises once, at the ``at``-th call (counted over the run) of ``hook``, after the callbacks ordered before it."""

    def __init__(self, hook, at):
        super().__init__("fail once in a hook", execution_order=500)
        self.hook, self.at, self.calls = hook, at, 0

    def _count(self, hook):
        if hook == self.hook:
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError(f"a failure in {hook}")

    def on_after_optimizer_step(self):
        self._count("on_after_optimizer_step")

    def on_batch_end(self):
        self._count("on_batch_end")


class RecordsHooks(AbstractCallback):
    """Records each call of the hooks that follow a step, with the batch and the optimizers that stepped."""

    def __init__(self, execution_order):
        super().__init__(f"records hooks {execution_order}", execution_order=execution_order)
        self.calls = []

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        self.calls.append(("on_after_optimizer_step", tl.total_iteration_idx, tl.state.stepped_optimizers))

    def on_batch_end(self):
        self.calls.append(("on_batch_end", self.train_loop_obj.total_iteration_idx))


@pytest.mark.parametrize("loss,hook,at", [
    ("plain", "on_after_optimizer_step", 3), ("plain", "on_batch_end", 3),
    ("multi2", "on_after_optimizer_step", 5),  # after optimizer 0's step of batch 2 (D4)
    ("multi2", "on_after_optimizer_step", 6),  # after optimizer 1's
    ("multi2", "on_batch_end", 3)])
def test_an_exception_in_a_hook_after_the_step_runs_each_hook_of_that_step_once(loss, hook, at):
    """A callback's hook raises after the batch's step (after one optimizer's step, with two). The step is kept;
    the next fit finishes it: the hooks that had returned (a per-optimizer-step LR scheduler, a recorder before the
    failing callback) are not called again, the failing one and those after it are; then the batch's end. It
    re-ran the whole hook for the optimizer (the scheduler stepped twice, D4) or, with one optimizer, dropped the
    rest of the step's hooks and the batch's end (D5)."""
    from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback

    def run(fail):
        tl = build_loop(Cell(loss=loss))
        scheduler = GeneralLRSchedulerCallback(torch.optim.lr_scheduler.StepLR, step_per_optimizer_step=True,
                                               step_size=1, gamma=0.9)
        recorders = [RecordsHooks(-10), RecordsHooks(600)]
        callbacks = [scheduler, *recorders] + ([FailOnceInHook(hook, at)] if fail else [])
        if fail:
            with pytest.raises(RuntimeError, match="a failure in"):
                tl.fit(num_epochs=2, callbacks=callbacks)
            callbacks = None
        tl.fit(num_epochs=2, callbacks=callbacks)
        return tl, scheduler, recorders

    straight, straight_scheduler, straight_recorders = run(False)
    continued, scheduler, recorders = run(True)
    assert [r.calls for r in recorders] == [r.calls for r in straight_recorders]
    assert scheduler.state_dict() == straight_scheduler.state_dict()
    assert [o.param_groups[0]["lr"] for o in continued.optimizers] == \
        [o.param_groups[0]["lr"] for o in straight.optimizers]
    assert_runs_equal(continued, straight)


def test_a_mid_epoch_checkpoint_before_the_interrupted_hooks_are_finished_is_refused():
    """After an exception in a hook of a committed step, a mid-epoch checkpoint would resume after the batch without
    the hooks left: refused, naming the batch, until fit finishes them."""
    tl = build_loop(Cell())
    with pytest.raises(RuntimeError, match="a failure in"):
        tl.fit(num_epochs=1, callbacks=[FailOnceInHook("on_batch_end", 2)])
    with pytest.raises(RuntimeError, match="batch 1 of epoch 0 is half done"):
        tl.checkpoint_state(mid_epoch=True)
    tl.fit(num_epochs=1)
    assert tl.checkpoint_state(mid_epoch=True)["epochs_completed"] == 1


@pytest.mark.parametrize("loss", ["plain", "multi2"])
def test_an_exception_in_a_hook_of_the_step_at_the_loaders_end_does_not_repeat_the_batch_end(loss):
    """A loader without len, accumulation 2 over 5 batches: the last window is stepped once the loader is exhausted,
    after its batch's on_batch_end. A hook of that step raises: the next fit finishes the step's hooks and does not
    call on_batch_end for the batch again (its end had come before the step)."""
    from tests.combinations.support import build_optimizers
    from tests.helpers import IterableTensorData

    def run(fail):
        model = build_model(Cell(loss=loss))
        tl = TrainLoop(model, DataLoader(IterableTensorData(dataset()), batch_size=8), None, None,
                       build_optimizers(model, Cell(loss=loss)), nn.CrossEntropyLoss(), end_auto_eval=False,
                       show_progress=False)
        recorders = [RecordsHooks(-10), RecordsHooks(600)]
        steps_an_epoch = 3 * (2 if loss == "multi2" else 1)  # calls of on_after_optimizer_step
        callbacks = recorders + ([FailOnceInHook("on_after_optimizer_step", steps_an_epoch)] if fail else [])
        if fail:
            with pytest.raises(RuntimeError, match="a failure in"):
                tl.fit(num_epochs=2, grad_accumulation=2, callbacks=callbacks)
            callbacks = None
        tl.fit(num_epochs=2, grad_accumulation=2, callbacks=callbacks)
        return tl, recorders

    straight, straight_recorders = run(False)
    continued, recorders = run(True)
    assert [r.calls for r in recorders] == [r.calls for r in straight_recorders]
    assert_runs_equal(continued, straight)


class StopsAtBatch(AbstractCallback):
    """Asks the loop to stop at the batch with ``total_iteration_idx == at``, in ``hook`` (ordered first)."""

    def __init__(self, at, hook):
        super().__init__("stops at a batch", execution_order=-500)
        self.at, self.hook = at, hook

    def _stop(self, hook):
        if hook == self.hook and self.train_loop_obj.total_iteration_idx == self.at:
            self.train_loop_obj.stop_training("enough")

    def on_after_optimizer_step(self):
        self._stop("on_after_optimizer_step")

    def on_batch_end(self):
        self._stop("on_batch_end")


@pytest.mark.parametrize("hook", ["on_after_optimizer_step", "on_batch_end"])
def test_a_stop_requested_in_the_batch_whose_hook_raised_is_carried_out_by_the_next_fit(hook):
    """Review of the step-hook fix, D1: a stop requested in a batch, then an exception in a later hook of that batch's
    committed step; the next fit said "Nothing to train" and left the step, the epoch's end and on_train_end
    undone. It finishes the step, then stops as the run that never raised."""
    def run(fail):
        tl = build_loop(Cell())
        recorder = RecordsHooks(600)
        callbacks = [StopsAtBatch(2, hook), recorder] + ([FailOnceInHook(hook, 3)] if fail else [])
        if fail:
            with pytest.raises(RuntimeError, match="a failure in"):
                tl.fit(num_epochs=3, callbacks=callbacks)
        tl.fit(num_epochs=3, callbacks=None if fail else callbacks)
        return tl, recorder

    straight, straight_recorder = run(False)
    continued, recorder = run(True)
    assert continued.epochs_completed == straight.epochs_completed == 1
    assert recorder.calls == straight_recorder.calls
    assert_runs_equal(continued, straight)


def test_per_step_state_of_callbacks_is_kept_for_the_step_the_next_fit_finishes(tmp_path):
    """Review of the step-hook fix, D2 and D3: an exception in on_after_optimizer_step after SpikeRollback's and a
    step-logging tracker's hooks returned; their on_train_begin (and the tracker's on_epoch_begin) forgot that the
    step had happened, so SpikeRollback's check schedule shifted and the tracker never logged the step."""
    from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollback
    from aitoolbox.torchtrain.callbacks.tracking_base import TrackingCallback

    class ListTracking(TrackingCallback):
        def __init__(self):
            super().__init__("list tracking", batch_log_frequency="step", project_name="p", experiment_name="e",
                             local_model_result_folder_path=str(tmp_path))
            self.logged = []

        def start_run(self):
            pass

        def write_hyperparams(self, hyperparams):
            pass

        def write_batch(self, record):
            self.logged.append(self.train_loop_obj.total_iteration_idx)

        def write_epoch_metrics(self, *args, **kwargs):
            pass

        def write_final_model_path(self, path):
            pass

        def end_run(self, exception):
            pass

    def run(fail):
        tl = build_loop(Cell())
        spike, tracking = SpikeRollback(), ListTracking()
        callbacks = [spike, tracking] + ([FailOnceInHook("on_after_optimizer_step", 4)] if fail else [])
        if fail:
            with pytest.raises(RuntimeError, match="a failure in"):
                tl.fit(num_epochs=2, callbacks=callbacks)
        tl.fit(num_epochs=2, callbacks=None if fail else callbacks)
        return tl, spike, tracking

    straight, straight_spike, straight_tracking = run(False)
    continued, spike, tracking = run(True)
    assert tracking.logged == straight_tracking.logged
    state, straight_state = spike.state_dict(), straight_spike.state_dict()
    for key in ("seen", "steps_since_check", "pending_at", "pending_stepped"):
        assert state[key] == straight_state[key], key
    assert_runs_equal(continued, straight)


# --- an exception before the loop's steps start (between set_up and the step runner's start) -----------------------
class TrainModeFailsOnce(MLP):
    """A user's model whose ``train()`` raises the first time: the loop puts the model in training mode after setting
    up its step runner and before starting it (``_train``)."""

    def __init__(self):
        super().__init__()
        self.fail = True

    def train(self, mode=True):
        if self.fail and mode:
            self.fail = False
            raise LookupError("the user's train() failed")
        return super().train(mode)


def _mlp_loop(model):
    torch.manual_seed(0)
    loader = DataLoader(classification_data(16), batch_size=4, shuffle=False)
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     end_auto_eval=False, show_progress=False)


def test_an_exception_before_the_first_step_reaches_the_caller_and_the_next_fit_trains_as_a_straight_run():
    """The exception leaves fit through the step runner's ``abandon()``, which reads the step in progress: a runner
    that never started has none (not an AttributeError masking the user's exception)."""
    torch.manual_seed(0)
    failing = TrainModeFailsOnce()
    straight_model = copy.deepcopy(failing)
    straight_model.fail = False
    tl = _mlp_loop(failing)
    with pytest.raises(LookupError, match="the user's train"):
        tl.fit(num_epochs=2)
    torch.manual_seed(1)  # the dropout's masks
    tl.fit(num_epochs=2)
    straight = _mlp_loop(straight_model)
    torch.manual_seed(1)
    straight.fit(num_epochs=2)
    assert_runs_equal(tl, straight)


def test_a_run_folder_that_cannot_be_created_at_train_start_is_the_error_fit_raises(tmp_path, monkeypatch):
    """A requeued job: a loaded epoch-end checkpoint whose epochs are done and a checkpoint callback registered by
    the fit that had nothing to train (it set the loop up, its folder's name reserved); the default run folder's
    place then taken by a file. Creating the folder when the next fit starts training fails before the loop's
    steps start, and that error (naming the folder) reaches the caller, not an error of the loop's own clean-up.
    The next fit, once the folder can be created, trains as the straight run."""
    monkeypatch.chdir(tmp_path)  # the default run folder lies under the working directory
    torch.manual_seed(0)
    model = MLP()
    straight, tl = _mlp_loop(copy.deepcopy(model)), _mlp_loop(model)
    straight.fit(num_epochs=1)
    checkpoint = copy.deepcopy(straight.checkpoint_state())  # its tensors are the live weights
    straight.fit(num_epochs=2)  # before the resumed run changes the global random state it goes on from
    tl.load_checkpoint(checkpoint)
    tl.fit(num_epochs=1, callbacks=[ModelCheckpoint()])  # nothing to train
    shutil.rmtree(tmp_path / DEFAULT_RUNS_FOLDER)
    (tmp_path / DEFAULT_RUNS_FOLDER).write_text("not a folder")
    with pytest.raises(OSError, match=DEFAULT_RUNS_FOLDER):
        tl.fit(num_epochs=2)
    (tmp_path / DEFAULT_RUNS_FOLDER).unlink()
    tl.fit(num_epochs=2)
    assert_runs_equal(tl, straight)
    (run,) = os.listdir(tmp_path / DEFAULT_RUNS_FOLDER)
    assert os.listdir(tmp_path / DEFAULT_RUNS_FOLDER / run / "checkpoint_model")  # the second epoch's


# --- the train end an exception interrupted (issue 32, defect A of loopcore48) ----------------------------------
class TrainEndHooks(AbstractCallback):
    """Records its train-end hooks; ``fails``: its ``on_before_train_end`` raises the first time (as a save of the
    best weights on a full disk would)."""

    def __init__(self, name, execution_order, fails=False):
        super().__init__(name, execution_order=execution_order)
        self.fails, self.calls = fails, []

    def on_before_train_end(self):
        self.calls.append("on_before_train_end")
        if self.fails:
            self.fails = False
            raise OSError(28, "No space left on device")

    def on_train_end(self):
        self.calls.append("on_train_end")


def _loop_with_a_test_set() -> TrainLoop:
    """ComboNet over 7 batches an epoch, with a test loader: the train end records ``train_end_test_loss``."""
    model = build_model(Cell())
    data = torch.utils.data.Subset(dataset(), range(28))
    test = torch.utils.data.Subset(dataset(), range(28, 40))
    return TrainLoop(model, DataLoader(data, batch_size=4), None, DataLoader(test, batch_size=4),
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), show_progress=False)


class RecordsThenFails(AbstractCallback):
    """Puts a metric into the history in ``on_before_train_end``, then raises (the first time)."""

    def __init__(self, fails):
        super().__init__("records, then fails")
        self.fails = fails

    def on_before_train_end(self):
        self.train_loop_obj.insert_metric_result_into_history("final_metric", 1.0)
        if self.fails:
            self.fails = False
            raise OSError(28, "No space left on device")


def test_what_a_train_end_step_wrote_before_it_raised_is_not_recorded_twice():
    """Review 48t G3: the step the next fit runs again had put its value into the history before it raised; the
    history held it twice ([1.0, 1.0] against the straight run's [1.0]). The history goes back to its lengths after
    the last finished step first, as in an epoch's end."""
    def run(fail):
        torch.manual_seed(0)
        tl = _loop_with_a_test_set()
        if fail:
            with pytest.raises(OSError, match="No space left"):
                tl.fit(num_epochs=2, callbacks=[RecordsThenFails(True)])
            tl.fit(num_epochs=2)
        else:
            tl.fit(num_epochs=2, callbacks=[RecordsThenFails(False)])
        return tl

    straight, continued = run(False), run(True)
    assert continued.train_history["final_metric"] == straight.train_history["final_metric"] == [1.0]
    assert_runs_equal(continued, straight)


def test_loading_a_checkpoint_over_an_unfinished_train_end_says_it_drops_it(caplog, monkeypatch):
    """Review 48t G4: load_checkpoint after an exception in the train end dropped that end without a word."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger may not propagate
    torch.manual_seed(0)
    tl = _loop_with_a_test_set()
    tl.fit(num_epochs=1)
    checkpoint = copy.deepcopy(tl.checkpoint_state())
    with pytest.raises(OSError, match="No space left"):
        tl.fit(num_epochs=2, callbacks=[RecordsThenFails(True)])
    with caplog.at_level("WARNING", logger="aitoolbox.torchtrain.train_loop.run_state"):
        tl.load_checkpoint(checkpoint)
    assert "loading a checkpoint drops what was left of that end" in caplog.text


@pytest.mark.parametrize("length", [{"num_iterations": 9, "grad_accumulation": 2},
                                    {"num_iterations": 8, "grad_accumulation": 3}, {"num_epochs": 2}])
def test_an_exception_in_the_train_end_is_finished_by_the_next_fit(length):
    """fit(num_iterations=N) (N inside an accumulation window: the partial window stepped at N) raised in a
    callback's on_before_train_end; the same fit again said "Nothing to train": the test set was never evaluated
    (train_end_test_loss missing from the history) and no callback's on_train_end ran (a final save, an upload). The
    next fit now finishes the train end: the steps that did not finish, each once (the failed hook again), as the
    straight run did them; a later, longer fit then equals the straight one's."""
    def run(fail):
        torch.manual_seed(0)
        tl = _loop_with_a_test_set()
        first, failing = TrainEndHooks("first", 10), TrainEndHooks("failing", 20, fails=fail)
        last = TrainEndHooks("last", 30)
        if fail:
            with pytest.raises(OSError, match="No space left"):
                tl.fit(callbacks=[first, failing, last], **length)
            assert "train_end_test_loss" not in tl.train_history
            tl.fit(**length)
        else:
            tl.fit(callbacks=[first, failing, last], **length)
        return tl, [first.calls, failing.calls, last.calls]

    straight, straight_calls = run(False)
    continued, calls = run(True)
    assert len(continued.train_history["train_end_test_loss"]) == 1
    assert_runs_equal(continued, straight)
    assert straight_calls == [["on_before_train_end", "on_train_end"]] * 3
    assert calls == [["on_before_train_end", "on_train_end"], ["on_before_train_end"] * 2 + ["on_train_end"],
                     ["on_before_train_end", "on_train_end"]]
    longer = {key: value + 3 if key.startswith("num_") else value for key, value in length.items()}
    for tl in (straight, continued):
        torch.manual_seed(1)
        tl.fit(**longer)
    assert_runs_equal(continued, straight)


def fail_once_in(hook: str, after_iterations: int) -> AbstractCallback:
    """A callback whose ``hook`` raises once, the first time it runs with ``after_iterations`` batches done (order
    500: after the other callbacks, before the checkpoint taker)."""
    def fail(self, *args):
        if not self.failed and self.train_loop_obj.iterations_done >= after_iterations:
            self.failed = True
            raise RuntimeError("a failure after fit's last step")

    def init(self):
        AbstractCallback.__init__(self, f"fails once in {hook}", execution_order=500)
        self.failed = False
    return type(f"FailOnceIn_{hook}", (AbstractCallback,), {"__init__": init, hook: fail})()


class CheckpointAtSteps(AbstractCallback):
    """Keeps a mid-epoch checkpoint (as from a file) at every batch whose optimizer stepped, as
    ModelIterationCheckpoint(save_frequency=1) does."""

    def __init__(self):
        super().__init__("checkpoint at steps", execution_order=1000)
        self.newest, self._steps = None, False

    def on_after_gradient_update(self, optimizer_idx):
        self._steps = self.train_loop_obj.optimizer_step_due

    def on_batch_end(self):
        if self._steps:
            self.newest = copy.deepcopy(self.train_loop_obj.checkpoint_state())


@pytest.mark.parametrize("continued_in", ["the same loop", "a new loop"])
@pytest.mark.parametrize("hook", ["on_epoch_train_end", "on_epoch_end", "on_before_train_end"])
@pytest.mark.parametrize("loss, grad_accumulation, num_iterations", [("plain", 2, 9), ("plain", 3, 8),
                                                                     ("multi2", 3, 7), ("multi2", 2, 3)])
def test_fit_num_iterations_ending_mid_window_and_failing_after_its_step_is_continued_as_straight(
        loss, grad_accumulation, num_iterations, hook, continued_in):
    """Issue 32 A (loopcore48): fit(num_iterations=N) with N inside an accumulation window (the partial window is
    stepped at N; 5 batches an epoch), an exception after that step in the epoch's end or the train end, then the
    same fit again: in the same TrainLoop, or in a new one from the mid-epoch checkpoint taken at N's step. Equal to
    the straight call (weights, optimizer states, history, the epoch-stepping scheduler's learning rate): the window
    is stepped once and the epoch closed once; then a longer fit equals the straight one's too."""
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler

    def run(fail):
        tl = build_loop(Cell(loss=loss))
        kept = CheckpointAtSteps()
        callbacks = [StepLRScheduler(step_size=1, gamma=0.5), kept]
        callbacks += [fail_once_in(hook, num_iterations)] if fail else []
        if not fail:
            tl.fit(num_iterations=num_iterations, grad_accumulation=grad_accumulation, callbacks=callbacks)
            return tl
        with pytest.raises(RuntimeError, match="after fit's last step"):
            tl.fit(num_iterations=num_iterations, grad_accumulation=grad_accumulation, callbacks=callbacks)
        if continued_in == "a new loop":
            assert kept.newest["iteration_idx"] == num_iterations - 1  # the checkpoint of N's step
            torch.manual_seed(1234)  # a new process's random state
            tl = build_loop(Cell(loss=loss))
            tl.load_checkpoint(kept.newest)
            callbacks = [StepLRScheduler(step_size=1, gamma=0.5)]
        else:
            callbacks = None
        tl.fit(num_iterations=num_iterations, grad_accumulation=grad_accumulation, callbacks=callbacks)
        return tl

    straight, continued = run(False), run(True)
    assert (continued.epochs_completed, continued.iterations_done) == (straight.epochs_completed, num_iterations)
    assert [o.param_groups[0]["lr"] for o in continued.optimizers] == \
        [o.param_groups[0]["lr"] for o in straight.optimizers]
    assert_runs_equal(continued, straight)
    for tl in (straight, continued):
        torch.manual_seed(1)
        tl.fit(num_iterations=num_iterations + 4, grad_accumulation=grad_accumulation)
    assert_runs_equal(continued, straight)


# --- the train end an exception interrupted: review 48l's findings ----------------------------------------------
class TrainHooks(TrainEndHooks):
    """TrainEndHooks that also records ``on_train_begin``; ``interrupts``: its ``on_train_end`` raises
    KeyboardInterrupt the first time (Ctrl-C during a slow upload)."""

    def __init__(self, name, execution_order, fails=False, interrupts=False):
        super().__init__(name, execution_order, fails=fails)
        self.interrupts = interrupts

    def on_train_begin(self):
        self.calls.append("on_train_begin")

    def on_train_end(self):
        self.calls.append("on_train_end")
        if self.interrupts:
            self.interrupts = False
            raise KeyboardInterrupt


def test_a_callback_registered_by_the_fit_that_finishes_a_train_end_takes_no_part_in_that_end():
    """Review 48l F1: fit(callbacks=[added]) after an exception in the train end ran the added callback's
    on_before_train_end and on_train_end for the earlier fit's end, before its own on_train_begin (a
    ModelPerformanceEvaluation added there recorded the old end's train_end_* metrics too). The pending end is now
    finished with the callbacks registered when it started; the added one is registered after it."""
    def run(fail):
        torch.manual_seed(0)
        tl = _loop_with_a_test_set()
        failing, added, late = TrainHooks("failing", 20, fails=fail), TrainHooks("added", 10), TrainHooks("late", 5)
        if fail:
            with pytest.raises(OSError, match="No space left"):
                tl.fit(num_epochs=1, callbacks=[failing])
            tl.fit(num_epochs=1, callbacks=[late])  # nothing left to train: the end only; late stays registered
            assert late.calls == [] and any(callback is late for callback in tl.callbacks)
        else:
            tl.fit(num_epochs=1, callbacks=[failing, late])
            late.calls.clear()
        tl.fit(num_epochs=2, callbacks=[added])
        return tl, added.calls, late.calls

    straight, straight_added, straight_late = run(False)
    continued, added, late = run(True)
    assert straight_added == ["on_train_begin", "on_before_train_end", "on_train_end"]
    assert added == straight_added and late == straight_late == straight_added
    assert_runs_equal(continued, straight)


@pytest.mark.parametrize("target", [{"num_epochs": 1}, {"num_epochs": 2}, {"num_iterations": 20}, "stopped"])
def test_fit_distributed_with_a_train_end_pending_is_refused_before_starting_anything(target):
    """Review 48l F4: fit_distributed after an exception in the train end returned 'Nothing to train' with the end
    never run (same target, or a run a stop request ended), or trained on in its processes while the launcher kept
    the end pending (a later fit ran it again on the new weights). It is refused now, before any process starts,
    and fit finishes the end."""
    tl = _loop_with_a_test_set()
    tl.fit(num_epochs=1)
    failing = TrainHooks("failing", 20, fails=True)
    with pytest.raises(OSError, match="No space left"):
        tl.fit(num_epochs=2, callbacks=[failing])
    if target == "stopped":
        tl.early_stop, target = True, {"num_epochs": 2}
    with pytest.raises(RuntimeError, match=r"the last fit stopped in its train end; call fit\(\) to finish it first"):
        tl.fit_distributed(**target, num_cpu_processes=2)
    assert tl.run_state.train_end_pending and "train_end_test_loss" in tl.train_history
    assert len(tl.train_history["train_end_test_loss"]) == 1
    tl.fit(num_epochs=2)
    assert not tl.run_state.train_end_pending and len(tl.train_history["train_end_test_loss"]) == 2
    assert failing.calls == ["on_train_begin"] + ["on_before_train_end"] * 2 + ["on_train_end"]


class ChecksCheckpointAtTrainEnd(AbstractCallback):
    """Takes a checkpoint in ``on_train_end``, as TrainLoopCheckpointEndSave does (not refused)."""

    def __init__(self):
        super().__init__("checkpoint at the train end", execution_order=100)
        self.taken = 0

    def on_train_end(self):
        self.train_loop_obj.checkpoint_state()
        self.taken += 1


@pytest.mark.parametrize("hook", ["on_before_train_end", "on_train_end"])
def test_checkpoint_state_with_a_train_end_pending_is_refused(hook):
    """Review 48l F2 (same process): checkpoint_state after an exception in the train end was given without
    complaint and held nothing of the pending end, so a loop resuming from it said 'Nothing to train' and never ran
    the end (no final save, no train_end_test_loss). It is refused now, as after an exception in an epoch's end;
    once fit finished the end it is taken (also in on_train_end, where the checkpoint callbacks take it)."""
    tl = _loop_with_a_test_set()
    failing = TrainHooks("failing", 20, fails=hook == "on_before_train_end", interrupts=hook == "on_train_end")
    checkpointer = ChecksCheckpointAtTrainEnd()
    with pytest.raises((OSError, KeyboardInterrupt)):
        tl.fit(num_epochs=1, callbacks=[failing, checkpointer])
    with pytest.raises(RuntimeError, match="stopped in its train end.*Call fit to finish the train end first"):
        tl.checkpoint_state()
    tl.fit(num_epochs=1)
    assert checkpointer.taken == 1
    assert tl.checkpoint_state()["epoch"] == 0


def test_a_keyboard_interrupt_in_on_train_end_leaves_the_later_callbacks_on_train_end_to_the_next_fit():
    """Review 48l F3: Ctrl-C in one callback's on_train_end (a slow upload) skipped the on_train_end of the
    callbacks after it (the final save) for good: the train end counted as done before on_train_end ran, and the
    next fit said 'Nothing to train'. The next fit now runs the on_train_end of the callbacks that had not
    returned (the interrupted one again, from its start), not of those that had."""
    tl = _loop_with_a_test_set()
    first, uploader, final_save = TrainHooks("first", 10), TrainHooks("uploader", 20, interrupts=True), \
        TrainHooks("final save", 30)
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=1, callbacks=[first, uploader, final_save])
    assert tl.run_state.train_end_pending
    tl.fit(num_epochs=1)
    assert not tl.run_state.train_end_pending
    assert first.calls == ["on_train_begin", "on_before_train_end", "on_train_end"]
    assert uploader.calls == ["on_train_begin", "on_before_train_end", "on_train_end", "on_train_end"]
    assert final_save.calls == ["on_train_begin", "on_before_train_end", "on_train_end"]
    assert len(tl.train_history["train_end_test_loss"]) == 1


class CheckpointBeforeTrainEnd(AbstractCallback):
    """Takes a checkpoint in ``on_before_train_end``, before the test-set evaluation and every ``on_train_end``."""

    def __init__(self):
        super().__init__("checkpoint before the train end", execution_order=100)

    def on_before_train_end(self):
        self.train_loop_obj.checkpoint_state()


def test_checkpoint_state_in_the_train_end_before_on_train_end_is_refused():
    """(Found with review 48l's F2.) A checkpoint taken in on_before_train_end held nothing of the end still to run: a
    loop resuming from it said 'Nothing to train', without train_end_test_loss or any on_train_end. It is refused,
    as in an epoch's end before its evaluation; the run's fit raises it, and the next fit finishes the end."""
    tl = _loop_with_a_test_set()
    with pytest.raises(RuntimeError, match="in its train end before the callbacks' on_train_end"):
        tl.fit(num_epochs=1, callbacks=[CheckpointBeforeTrainEnd()])
    assert "train_end_test_loss" not in tl.train_history


# --- fit(num_iterations=N) with N at an epoch's end, then a longer fit ----------------------------------------------
def _shuffled_mlp_loop() -> TrainLoop:
    torch.manual_seed(0)
    model = MLP()  # with dropout
    loader = DataLoader(classification_data(24), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(3))
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                     nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_fit_num_iterations_ending_at_an_epochs_last_batch_then_a_longer_fit_equals_one_fit(grad_accumulation):
    """The loop stopped after the epoch's last batch without asking the loader for the next one, which the run of one
    fit does: torch's RandomSampler draws a permutation for its tail there (an empty one too), so the next fit's
    epochs drew another order (epoch 1's first batch differed). 6 batches an epoch."""
    def run(targets):
        tl = _shuffled_mlp_loop()
        torch.manual_seed(1)  # the dropout's masks
        for target in targets:
            tl.fit(num_iterations=target, grad_accumulation=grad_accumulation)
        return tl

    assert_runs_equal(run([6, 18]), run([18]))
    assert_runs_equal(run([12, 18]), run([18]))


# --- the train end an exception interrupted: reviews 48m, 48t and 48l's later findings ---------------------------
class RecordsInTrainEnd(TrainHooks):
    """TrainHooks whose ``on_train_end`` first puts a metric into the history (then may be interrupted)."""

    def on_train_end(self):
        self.train_loop_obj.insert_metric_result_into_history("end_metric", 1.0)
        super().on_train_end()


def test_what_an_interrupted_on_train_end_recorded_is_not_recorded_twice():
    """Review 48m M3: a callback put a value into the history in on_train_end, then a Ctrl-C stopped it; the next
    fit called it again from its start and the history held the value twice. Each on_train_end is a step of the end:
    what an interrupted one recorded goes first."""
    def run(interrupt):
        torch.manual_seed(0)
        tl = _loop_with_a_test_set()
        if interrupt:
            with pytest.raises(KeyboardInterrupt):
                tl.fit(num_epochs=2, callbacks=[RecordsInTrainEnd("records", 10, interrupts=True)])
            tl.fit(num_epochs=2)
        else:
            tl.fit(num_epochs=2, callbacks=[RecordsInTrainEnd("records", 10)])
        tl.fit(num_epochs=3)
        return tl

    straight, continued = run(False), run(True)
    assert continued.train_history["end_metric"] == straight.train_history["end_metric"] == [1.0, 1.0]
    assert_runs_equal(continued, straight)


class FailsInTrainEnd(TrainHooks):
    """TrainHooks whose ``on_train_end`` raises the first time (a final save on a full disk)."""

    def on_train_end(self):
        super().on_train_end()
        if self.calls.count("on_train_end") == 1:
            raise RuntimeError("the final save failed")


def test_an_on_train_end_failure_before_a_ctrl_c_in_a_later_callback_is_raised_by_the_next_fit(caplog, monkeypatch):
    """Review 48t G2: a callback's on_train_end raised (kept to raise after the others), then a Ctrl-C stopped a later
    callback's: the failure was never raised nor logged, and the next fit returned normally. It is logged when the
    Ctrl-C comes, and the fit that finishes the end raises it after the last callback, as the straight run does."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    tl = _loop_with_a_test_set()
    failing, interrupted, last = FailsInTrainEnd("failing", 10), TrainHooks("ctrl-c", 20, interrupts=True), \
        TrainHooks("last", 30)
    with caplog.at_level("ERROR", logger="aitoolbox.torchtrain.callbacks.handler"):
        with pytest.raises(KeyboardInterrupt):
            tl.fit(num_epochs=1, callbacks=[failing, interrupted, last])
    assert "the final save failed" in caplog.text
    with pytest.raises(RuntimeError, match="the final save failed"):
        tl.fit(num_epochs=1)
    assert not tl.run_state.train_end_pending
    assert (failing.calls, interrupted.calls, last.calls) == \
        (["on_train_begin", "on_before_train_end", "on_train_end"],
         ["on_train_begin", "on_before_train_end", "on_train_end", "on_train_end"],
         ["on_train_begin", "on_before_train_end", "on_train_end"])
    tl.fit(num_epochs=2)  # nothing left of the end: the run goes on
    assert last.calls[-1] == "on_train_end" and len(tl.train_history["train_end_test_loss"]) == 2


class RecordsFitArguments(TrainEndHooks):
    def __init__(self, name, execution_order, fails=False):
        super().__init__(name, execution_order, fails=fails)
        self.seen = []

    def on_train_end(self):
        tl = self.train_loop_obj
        self.seen.append((tl.num_epochs, tl.num_iterations, tl.grad_accumulation))


def test_the_end_the_next_fit_finishes_sees_its_own_fits_arguments():
    """Review 48t G5: the next fit set its own num_epochs / num_iterations / grad_accumulation before finishing the
    earlier fit's end, whose hooks saw them. They see their fit's; the next fit's training then sees its own."""
    tl = _loop_with_a_test_set()
    recorder = RecordsFitArguments("recorder", 10, fails=True)
    with pytest.raises(OSError, match="No space left"):
        tl.fit(num_epochs=2, callbacks=[recorder])
    tl.fit(num_epochs=4, grad_accumulation=2)
    assert recorder.seen == [(2, 0, 1), (4, 0, 2)]
    assert (tl.num_epochs, tl.grad_accumulation) == (4, 2)


def test_a_callback_the_next_fit_registers_gets_no_on_exception_from_the_earlier_end():
    """Review 48t G6: a callback registered by the fit that finishes an earlier fit's end takes no part in that end;
    when the end failed again there, it got on_exception before its own on_train_begin."""
    class Hooks(TrainHooks):
        def on_exception(self, exception):
            self.calls.append("on_exception")

    tl = _loop_with_a_test_set()
    failing = TrainHooks("failing", 20, fails=True)
    with pytest.raises(OSError, match="No space left"):
        tl.fit(num_epochs=1, callbacks=[failing])
    failing.fails = True  # fails again in the fit that finishes it
    added = Hooks("added", 10)
    with pytest.raises(OSError, match="No space left"):
        tl.fit(num_epochs=2, callbacks=[added])
    assert added.calls == []
    tl.fit(num_epochs=2)
    assert added.calls == ["on_train_begin", "on_before_train_end", "on_train_end"]


def test_early_stopping_interrupted_after_restoring_the_best_weights_trains_on_from_the_trained_ones(monkeypatch):
    """Review 48l F5: a Ctrl-C in EarlyStopping(restore_best_weights).on_before_train_end after it had put the best
    weights in; the next fit ran the hook again, which took the best weights as those training ended with, so a
    longer fit trained on from the best epoch's weights instead of the last. The weights taken stay those of the
    first run of the hook."""
    from aitoolbox.torchtrain.callbacks import stopping

    restore = stopping.restore_weights

    def run(interrupt):
        torch.manual_seed(0)
        tl = _loop_with_a_test_set()
        pending = [interrupt]

        def restore_then_interrupt(loop, weights):
            restore(loop, weights)
            if pending[0]:
                pending[0] = False
                raise KeyboardInterrupt  # after the best weights are in

        monkeypatch.setattr(stopping, "restore_weights", restore_then_interrupt)
        early = stopping.EarlyStopping(monitor="accumulated_loss", mode="max", patience=10, restore_best_weights=True)
        if interrupt:
            with pytest.raises(KeyboardInterrupt):
                tl.fit(num_epochs=2, callbacks=[early])
        tl.fit(num_epochs=2, callbacks=None if interrupt else [early])
        assert early.best_epoch == 0  # the best weights are not the last epoch's
        tl.fit(num_epochs=3)
        return tl

    straight, continued = run(False), run(True)
    assert_runs_equal(continued, straight)


def test_what_the_user_records_between_an_interrupted_end_and_the_next_fit_is_kept():
    """Review 49l F2: after a Ctrl-C in on_train_end the user put values into the history (a manual evaluation, by
    the public insert_metric_result_into_history), and the fit that finished the end deleted them: it cut the history
    back to its lengths before the interrupted hook. Only what the interrupted hook itself recorded goes."""
    tl = _loop_with_a_test_set()
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[RecordsInTrainEnd("records", 10, interrupts=True)])
    interrupted_hooks_value = tl.train_history.get("end_metric")
    tl.insert_metric_result_into_history("my_manual_eval", 0.42)
    tl.insert_metric_result_into_history("val_loss", 9.99)
    tl.fit(num_epochs=2)
    assert tl.train_history["my_manual_eval"] == [0.42]
    assert tl.train_history["val_loss"][-1] == 9.99
    assert tl.train_history["end_metric"] == [1.0]
    assert interrupted_hooks_value is None  # what the interrupted hook recorded went when the Ctrl-C stopped it


class _InterruptAtLine:
    """A Ctrl-C (KeyboardInterrupt) raised just before the ``at``-th statement of the train end's own bookkeeping
    (``_end_training``, its steps, the handler's ``on_train_end`` loop), or as one of their frames returns: a SIGINT
    lands between any two statements."""

    frames = {("train_loop.py", "_end_training"), ("train_loop.py", "_train_end_step"), ("handler.py", "on_train_end")}

    def __init__(self, at):
        self.at, self.seen = at, 0

    def _local(self, frame, event, arg):
        # From the end's start on (begin_train_end): before it, the fit has not reached its end yet.
        started = frame.f_code.co_name != "_end_training" or "done" in frame.f_locals
        if event in ("line", "return") and started and self.seen <= self.at:
            self.seen += 1
            if self.seen == self.at + 1:
                raise KeyboardInterrupt(f"SIGINT at {frame.f_code.co_name}:{frame.f_lineno} ({event})")
        return self._local

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if self.seen > self.at or (os.path.basename(code.co_filename), code.co_name) not in self.frames:
            return None
        return self._local


def test_a_ctrl_c_at_any_statement_of_the_train_end_neither_loses_nor_repeats_a_value():
    """Review 49l F1: a SIGINT after a step of the end was marked done but before its history lengths were saved made
    the next fit delete train_end_test_loss; one after a callback's on_train_end returned but before it was marked
    done recorded its value twice. A Ctrl-C at each statement of the train end in turn, then fit again: the history
    equals the straight run's."""
    class Records(AbstractCallback):
        def on_train_end(self):
            self.train_loop_obj.insert_metric_result_into_history(f"end_{self.callback_name}", 1.0)

    def loop():
        torch.manual_seed(0)
        return _loop_with_a_test_set()

    straight = loop()
    straight.fit(num_epochs=1, callbacks=[Records("a"), Records("b")])
    # The trace function in place (a coverage measurement's: the mutation run's, tests/mutation/) is put back after
    # each interrupted fit, not cleared: clearing it left every later test of the process unmeasured.
    previous_trace = sys.gettrace()
    at = 0
    while True:
        tl = loop()
        sys.settrace(_InterruptAtLine(at))
        try:
            tl.fit(num_epochs=1, callbacks=[Records("a"), Records("b")])
            break  # past the end's last statement
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(previous_trace)
        tl.fit(num_epochs=1)
        assert dict(tl.train_history) == dict(straight.train_history), f"Ctrl-C before statement {at}"
        at += 1
    assert at > 10  # each of the train end's statements was interrupted in turn


def test_on_exception_of_the_end_the_next_fit_finishes_sees_the_same_arguments_as_its_hooks():
    """Review 49l F8: the end of fit(2) cut short by a Ctrl-C failed again in fit(4, grad_accumulation=2), which
    finished it: its on_train_end saw fit(2)'s arguments, on_exception for that failure fit(4)'s. Both see the end's
    fit's; after the failed fit the state holds fit(4)'s, as after any fit that fails early."""
    class Recorder(AbstractCallback):
        def __init__(self):
            super().__init__("recorder")
            self.seen, self.faults = [], [KeyboardInterrupt, RuntimeError]

        def _record(self, hook):
            tl = self.train_loop_obj
            self.seen.append((hook, tl.num_epochs, tl.num_iterations, tl.grad_accumulation))

        def on_train_end(self):
            self._record("on_train_end")
            raise self.faults.pop(0)("fault")

        def on_exception(self, exception):
            self._record("on_exception")

    tl = _loop_with_a_test_set()
    recorder = Recorder()
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[recorder])
    with pytest.raises(RuntimeError):
        tl.fit(num_epochs=4, grad_accumulation=2)
    assert recorder.seen == [("on_train_end", 2, 0, 1), ("on_exception", 2, 0, 1),
                             ("on_train_end", 2, 0, 1), ("on_exception", 2, 0, 1)]
    assert (tl.num_epochs, tl.num_iterations, tl.grad_accumulation) == (4, 0, 2)


def test_loading_a_checkpoint_over_an_end_with_a_kept_failure_says_that_failure_is_not_raised(caplog, monkeypatch):
    """Review 49l F7: an on_train_end failure before a Ctrl-C in a later callback's is logged as one the next fit
    raises; load_checkpoint then dropped it with a warning that did not mention it, and it was never raised."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    tl = _loop_with_a_test_set()
    tl.fit(num_epochs=1)
    checkpoint = copy.deepcopy(tl.checkpoint_state())
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[FailsInTrainEnd("failing", 10), TrainHooks("ctrl-c", 20, interrupts=True)])
    caplog.clear()
    with caplog.at_level("WARNING", logger="aitoolbox.torchtrain.train_loop.run_state"):
        tl.load_checkpoint(checkpoint)
    warning = " ".join(record.getMessage() for record in caplog.records if record.name.endswith("run_state"))
    assert "RuntimeError: the final save failed" in warning and "not raised" in warning
    tl.fit(num_epochs=2)  # trains on from the checkpoint, without that failure


class _InterruptAfterLastEpochEnd:
    """A Ctrl-C raised just before the ``at``-th statement (or frame return) of the loop's own code (train_loop.py,
    run_state.py) after the last epoch's ``on_epoch_end`` returned and before the train end's first step: the rest of
    the epoch's end, the epoch's completion, the loop's condition and the end's start (issue 32: a Ctrl-C there left
    no end pending, and the next fit with the same target said "Nothing to train")."""

    files = {"train_loop.py", "run_state.py"}

    def __init__(self, at):
        self.at, self.seen, self.armed = at, 0, False

    def _local(self, frame, event, arg):
        if frame.f_code.co_name == "_end_training" and "done" in frame.f_locals:
            self.armed = False  # the end has begun: its own statements are the test above's
        if event in ("line", "return") and self.armed and self.seen <= self.at:
            self.seen += 1
            if self.seen == self.at + 1:
                raise KeyboardInterrupt(f"SIGINT at {frame.f_code.co_name}:{frame.f_lineno} ({event})")
        return self._local

    def __call__(self, frame, event, arg):
        if self.seen > self.at or os.path.basename(frame.f_code.co_filename) not in self.files:
            return None
        return self._local


def test_a_ctrl_c_between_the_last_epoch_end_and_the_train_end_leaves_the_end_to_the_next_fit():
    """Issue 32: a Ctrl-C at each statement between the last epoch's on_epoch_end and the train end's first step in
    turn, then fit with the same target: the end runs once (the test-set loss, each on_train_end once) and the run
    equals the straight run."""
    class Records(AbstractCallback):
        def __init__(self, tracer=None):
            super().__init__("records")
            self.tracer, self.ends = tracer, 0

        def on_epoch_end(self):
            if self.tracer is not None and self.train_loop_obj.epoch == 1:
                self.tracer.armed = True  # the last epoch's on_epoch_end is done once this returns

        def on_train_end(self):
            self.ends += 1
            self.train_loop_obj.insert_metric_result_into_history("end_metric", 1.0)

    def loop():
        torch.manual_seed(0)
        return _loop_with_a_test_set()

    straight = loop()
    straight.fit(num_epochs=2, callbacks=[Records()])
    assert "train_end_test_loss" in straight.train_history
    at = 0
    while True:
        tl, tracer = loop(), _InterruptAfterLastEpochEnd(at)
        records = Records(tracer)
        sys.settrace(tracer)
        try:
            tl.fit(num_epochs=2, callbacks=[records])
            break  # past the gap's last statement
        except KeyboardInterrupt as interrupt:
            where = str(interrupt)
        finally:
            sys.settrace(None)
        tl.fit(num_epochs=2)
        assert records.ends == 1, f"{where}: on_train_end ran {records.ends} times"
        assert tl.epochs_completed == 2, where
        assert_runs_equal(tl, straight)
        at += 1
    assert records.ends == 1
    assert at > 10  # each statement of the gap was interrupted in turn
