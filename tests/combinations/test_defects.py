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
from aitoolbox.torchtrain.precision import Precision
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


def test_an_unscale_by_hand_between_two_fits_does_not_leak_into_the_next_fit():
    """``tl.amp_scaler.unscale_(optimizer)`` by hand between two fits (a notebook inspecting gradient norms, none
    there): the next fit's first step unscales its own gradients, bitwise as two fits without it."""
    def run(unscale_between):
        torch.manual_seed(0)
        model = MLP(dropout=0.0)
        tl = plain_loop(model, seeded_loader(classification_data(40)), use_amp={"init_scale": 1024.0})
        tl.fit(num_epochs=1)
        if unscale_between:
            tl.amp_scaler.unscale_(tl.optimizer)
        tl.fit(num_epochs=2)
        return model

    assert_params_equal(run(unscale_between=True), run(unscale_between=False))


# --- replicas stay identical: O2 + DDP + accumulation, MultiLoss under DDP ---------------------------------------
def _ranks_agree_worker(rank, world_size, cells):
    from tests.combinations.support import join_as_torchrun, train_cell
    join_as_torchrun(rank, world_size)
    return {cell.name: train_cell(cell)["disagreements"] for cell in cells}


def test_ddp_replicas_stay_identical_with_master_weights_accumulation_and_multiloss():
    """O2's accumulating micro-batches go into the float32 masters, where DDP's all-reduce does not see them (the
    replicas drifted by ~0.1 after one epoch); a MultiLoss with two optimizers stepped optimizer 0 before DDP had
    synchronised its gradients (after the last backward), and a MultiLoss crashed under DDP (``loss.dim()``)."""
    from tests.combinations.support import Cell
    from tests.distributed_helpers import run_distributed
    cells = [Cell("O2", "ddp", 3), Cell("scaler", "ddp", 3), Cell("O2", "ddp", 3, loss="multi1"),
             Cell("fp32", "ddp", 1, loss="multi2"), Cell("O2", "ddp", 3, loss="multi2", clipping=True)]
    results = run_distributed(_ranks_agree_worker, 2, (cells,))
    for rank_result in results:
        assert rank_result == {cell.name: [] for cell in cells}


def _unsized_epoch_end_worker(rank, world_size):
    from tests.combinations.support import RanksAgree, build_loop, Cell, join_as_torchrun
    from tests.helpers import IterableTensorData
    join_as_torchrun(rank, world_size)
    # Unsized loader, O2, accumulation: the epoch ends inside a window (sync_skipped_gradients' path).
    tl = build_loop(Cell("O2", "ddp", 3))
    data = tl.train_loader.dataset
    own = torch.utils.data.Subset(data, range(rank, len(data), world_size))
    tl.train_loader = DataLoader(IterableTensorData(own), batch_size=4)  # 5 batches: the last window holds 2
    agree = RanksAgree()
    tl.fit_distributed(num_epochs=2, grad_accumulation=3, callbacks=[agree])
    return agree.disagreements


def test_ddp_replicas_stay_identical_when_an_unsized_epoch_ends_inside_an_accumulation_window():
    from tests.distributed_helpers import run_distributed
    assert run_distributed(_unsized_epoch_end_worker, 2) == [[], []]


# --- several optimizers: a step some optimizer took is finished, not taken again ---------------------------------
class FailBetweenOptimizerSteps(AbstractCallback):
    """Raises once, at batch ``at_iteration``: in ``on_after_gradient_update`` of optimizer 1 (optimizer 0 stepped
    already, optimizer 1 not yet), or in the ``on_after_optimizer_step`` after optimizer ``after_step``'s step."""

    def __init__(self, at_iteration: int, hook: str = "gradient", after_step: int = 0):
        super().__init__("fail between optimizers")
        self.at_iteration, self.hook, self.after_step, self.failed = at_iteration, hook, after_step, False
        self.steps_seen = 0

    def _fail(self):
        self.failed = True
        raise RuntimeError("a failure between two optimizers' steps")

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if self.hook == "gradient" and optimizer_idx == 1 and tl.total_iteration_idx == self.at_iteration \
                and not self.failed:
            self._fail()

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        if tl.total_iteration_idx != self.at_iteration:
            self.steps_seen = 0
            return
        self.steps_seen += 1
        if self.hook == "step" and self.steps_seen == self.after_step + 1 and not self.failed:
            self._fail()


def straight_and_continued_between_optimizer_steps(cell, hook="gradient", after_step=0, extra_callbacks=(),
                                                   prepare=lambda tl: None, between=lambda tl: None):
    """Two loops of ``cell`` fitted for two epochs: straight, and stopped by an exception between the two
    optimizers' steps of batch 6 then continued by a second fit (``between`` runs on the loop in between)."""
    from tests.combinations.support import build_loop

    def run(fail_at):
        tl = build_loop(cell)
        prepare(tl)
        callbacks = [*(make() for make in extra_callbacks), FailBetweenOptimizerSteps(fail_at, hook, after_step)]
        if fail_at >= 0:
            with pytest.raises(RuntimeError, match="between two optimizers"):
                tl.fit(num_epochs=2, callbacks=callbacks)
            callbacks = None  # registered by the first call
            between(tl)
        tl.fit(num_epochs=2, callbacks=callbacks)
        return tl

    return run(-1), run(6)


def _adam_steps(optimizer) -> int:
    return int(next(iter(optimizer.state.values()))["step"])


@pytest.mark.parametrize("hook, after_step, between, compiled", [
    ("gradient", 0, None, False), ("step", 0, None, False), ("step", 1, None, False), ("gradient", 0, "lr_find", False),
    pytest.param("gradient", 0, None, True, marks=pytest.mark.slow)])  # compiled: every backward before any step
def test_an_exception_between_two_optimizers_steps_is_finished_by_the_next_fit(hook, after_step, between, compiled):
    """Before: optimizer 0 stepped on the failed batch, and the continued fit trained the batch again, so optimizer 0
    stepped twice on it (11 steps instead of 10). A step that some optimizer took cannot be abandoned: the next fit
    finishes it (the other optimizers step on the gradients they had, the loss scale is updated, the batch ends),
    then goes on with the next batch: bitwise the straight run, also with an lr_find in between (it clears the
    gradients)."""
    from tests.combinations.support import Cell

    def adam_for_optimizer_1(tl):
        tl.optimizers[1] = torch.optim.Adam(tl.optimizers[1].param_groups[0]["params"], lr=1e-2)
        tl.optimizer[1] = tl.optimizers[1]

    def lr_find(tl):
        if between == "lr_find":
            tl.lr_find(num_iterations=3, start_lr=1e-4, end_lr=1e-2)

    straight, continued = straight_and_continued_between_optimizer_steps(
        Cell(loss="multi2", precision="scaler", compile=compiled), hook, after_step, prepare=adam_for_optimizer_1,
        between=lr_find)
    assert _adam_steps(continued.optimizers[1]) == _adam_steps(straight.optimizers[1]) == 10
    assert _adam_steps(continued.optimizers[0]) == _adam_steps(straight.optimizers[0]) == 10
    assert_params_equal(continued.model, straight.model)
    assert continued.precision.loss_scaler.state_dict() == straight.precision.loss_scaler.state_dict()
    assert dict(continued.train_history) == dict(straight.train_history)


def test_an_exception_after_clipping_between_two_optimizers_does_not_unscale_twice():
    """Optimizer 1's gradients were unscaled and clipped (loss scale 1024) when the exception came between the two
    optimizers' steps: the next fit finishes the step with the precision state it had, so they are not divided by
    the scale again. Bitwise the straight run."""
    from tests.combinations.support import Cell
    straight, continued = straight_and_continued_between_optimizer_steps(
        Cell(loss="multi2", precision="scaler"), extra_callbacks=[lambda: GradNormClip(1.0)])
    assert_params_equal(continued.model, straight.model)
    assert continued.precision.loss_scaler.state_dict() == straight.precision.loss_scaler.state_dict()


class FailOnceBeforeBatch(AbstractCallback):
    def __init__(self, at_iteration: int):
        super().__init__("fail once before a batch")
        self.at_iteration, self.failed = at_iteration, False

    def on_batch_begin(self):
        if self.train_loop_obj.total_iteration_idx == self.at_iteration and not self.failed:
            self.failed = True
            raise RuntimeError(f"a failure before batch {self.at_iteration}")


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_an_exception_between_batches_of_two_optimizers_stepped_in_turn_continues_after_the_last_step(
        grad_accumulation):
    """Each per-optimizer step moves the run's resume point (the batches, their losses and the random state at the
    step): an exception before batch 3 continues there, bitwise the straight run (not from the epoch's start)."""
    from tests.combinations.support import Cell, build_loop
    cell = Cell(loss="multi2", precision="scaler")

    def run(fail):
        tl = build_loop(cell)
        callbacks = [FailOnceBeforeBatch(3 if fail else -1)]
        if fail:
            with pytest.raises(RuntimeError, match="before batch 3"):
                tl.fit(num_epochs=2, grad_accumulation=grad_accumulation, callbacks=callbacks)
            callbacks = None
        tl.fit(num_epochs=2, grad_accumulation=grad_accumulation, callbacks=callbacks)
        return tl

    straight, continued = run(False), run(True)
    assert_params_equal(continued.model, straight.model)
    assert dict(continued.train_history) == dict(straight.train_history)


class FailOnceAfterStep(AbstractCallback):
    def __init__(self, at_iteration: int):
        super().__init__("fail once after a step")
        self.at_iteration, self.failed = at_iteration, False

    def on_after_optimizer_step(self):
        if self.train_loop_obj.total_iteration_idx == self.at_iteration and not self.failed:
            self.failed = True
            raise RuntimeError("a failure after the step")


class StepsSeen(AbstractCallback):
    def __init__(self):
        super().__init__("steps seen")
        self.seen = []

    def on_after_optimizer_step(self):
        self.seen.append((self.train_loop_obj.total_iteration_idx, self.train_loop_obj.stepped_optimizers))


def test_an_exception_after_a_step_of_two_optimizers_stepped_together_is_finished_for_both():
    """Two optimizers of one plain loss step together; a callback's on_after_optimizer_step raises after the step of
    batch 3. The next fit finishes that step for both optimizers (the later callbacks' hook sees both stepped, both
    gradients are cleared): bitwise the straight run."""
    from tests.combinations.support import Cell, build_loop

    def run(fail):
        tl = build_loop(Cell(precision="scaler"))
        head = [param for name, param in tl.model.named_parameters() if name.startswith("fc1")]
        rest = [param for name, param in tl.model.named_parameters() if not name.startswith("fc1")]
        tl.optimizer = tl.optimizers = [torch.optim.SGD(head, lr=0.1), torch.optim.Adam(rest, lr=0.01)]
        seen = StepsSeen()
        callbacks = [FailOnceAfterStep(3 if fail else -1), seen]
        if fail:
            with pytest.raises(RuntimeError, match="after the step"):
                tl.fit(num_epochs=2, callbacks=callbacks)
            callbacks = None
        tl.fit(num_epochs=2, callbacks=callbacks)
        return tl, seen.seen

    (straight, straight_seen), (continued, continued_seen) = run(False), run(True)
    assert continued_seen == straight_seen == [(index, (0, 1)) for index in range(10)]
    assert_params_equal(continued.model, straight.model)


def test_a_checkpoint_loaded_after_an_interrupted_two_optimizer_step_is_where_the_run_goes_on():
    """An exception between two optimizers' steps keeps the step for the next fit, unless a checkpoint is loaded in
    between: the run goes on from the checkpoint, bitwise as a loop that loads it fresh (the kept step of another
    point of the run is dropped, not finished on the loaded weights)."""
    from tests.combinations.support import Cell, build_loop
    cell = Cell(loss="multi2", precision="scaler")
    source = build_loop(cell)
    source.fit(num_epochs=1)
    checkpoint = source.checkpoint_state()

    interrupted = build_loop(cell)
    with pytest.raises(RuntimeError, match="between two optimizers"):
        interrupted.fit(num_epochs=2, callbacks=[FailBetweenOptimizerSteps(6)])
    interrupted.load_checkpoint(copy.deepcopy(checkpoint))
    # Another exception in the loaded run (before a batch) continues that run's own step point.
    with pytest.raises(RuntimeError, match="before batch 7"):
        interrupted.fit(num_epochs=2, callbacks=[FailOnceBeforeBatch(7)])
    interrupted.fit(num_epochs=2)
    fresh = build_loop(cell)
    fresh.load_checkpoint(copy.deepcopy(checkpoint))
    fresh.fit(num_epochs=2)
    assert_params_equal(interrupted.model, fresh.model)
    assert dict(interrupted.train_history) == dict(fresh.train_history)


def test_an_interrupted_step_of_two_optimizers_keeps_the_model_gradients_under_master_weights():
    """O2 (bfloat16 model, float32 masters): optimizer 1's gradients are still in the model's bfloat16 ``.grad``
    when the exception comes (its step unscales them into its masters), and the next fit starts by clearing every
    gradient. The interrupted step keeps the model parameters' gradients too, so optimizer 1 steps on them when the
    next fit finishes the step: bitwise the straight run (before the masters' gradients were the only ones kept,
    optimizer 1 would have stepped on none)."""
    from tests.combinations.support import Cell
    straight, continued = straight_and_continued_between_optimizer_steps(Cell(loss="multi2", precision="O2"))
    assert_params_equal(continued.model, straight.model)
    for continued_optimizer, straight_optimizer in zip(continued.optimizers, straight.optimizers):
        for continued_param, straight_param in zip(Precision.stepped_parameters(continued_optimizer),
                                                   Precision.stepped_parameters(straight_optimizer)):
            assert torch.equal(continued_param, straight_param)  # the float32 masters
    assert dict(continued.train_history) == dict(straight.train_history)


# --- frozen modules stay frozen ------------------------------------------------------------------------------------
def _frozen_bn_loop(model, evaluate: bool = True) -> TrainLoop:
    from tests.combinations.support import dataset
    loader = DataLoader(dataset(), batch_size=8)
    return TrainLoop(model, loader, loader if evaluate else None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                     nn.CrossEntropyLoss(), end_auto_eval=evaluate, show_progress=False)


def test_evaluation_and_fit_keep_a_batchnorm_frozen_before_fit_frozen():
    """The notebook way: ``model.bn.eval()`` before fit. The BatchNorm's running statistics never change, through
    the end-of-epoch evaluations and a second fit; before, evaluation restored train mode on the whole model."""
    from tests.combinations.support import ComboNet
    torch.manual_seed(0)
    model = ComboNet(dropout=0.0)
    model.bn.eval()
    frozen_stats = (model.bn.running_mean.clone(), model.bn.running_var.clone())
    tl = _frozen_bn_loop(model)
    tl.fit(num_epochs=2)
    assert not model.bn.training and model.training and model.fc1.training
    assert torch.equal(model.bn.running_mean, frozen_stats[0]) and torch.equal(model.bn.running_var, frozen_stats[1])
    assert tl.frozen_modules.modules == [model.bn]
    model.eval()  # predicting in the notebook puts the whole model in eval mode...
    tl.fit(num_epochs=3)  # ...and the next fit trains it, the BatchNorm still frozen
    assert model.training and not model.bn.training
    assert torch.equal(model.bn.running_mean, frozen_stats[0])
    model.bn.train()  # unfreezing
    tl.fit(num_epochs=4)
    assert model.bn.training and not torch.equal(model.bn.running_mean, frozen_stats[0])


def test_training_with_a_frozen_batchnorm_equals_a_hand_loop():
    from tests.combinations.support import ComboNet, dataset
    torch.manual_seed(0)
    model = ComboNet(dropout=0.0)
    reference = copy.deepcopy(model)
    model.bn.eval()
    _frozen_bn_loop(model).fit(num_epochs=2)
    reference.train()
    reference.bn.eval()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in DataLoader(dataset(), batch_size=8):
            nn.CrossEntropyLoss()(reference(x)[0], y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_params_equal(model, reference)


# --- torch_compile: only the batch dimension is marked dynamic ---------------------------------------------------
class SequenceFirst(nn.Module):
    """A GRU over (sequence, batch, features) inputs, as torch's recurrent layers take them by default."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.rnn(x)[0][-1])


def test_compile_marks_only_the_dimension_that_holds_the_batch():
    """A sequence-first input's dimension 0 is its length: it stays static (before, dimension 0 of every input
    was marked dynamic, here the sequence); the batch-first labels' dimension 0 is marked."""
    from aitoolbox.torchtrain.compiling.model import mark_batch_dimension_dynamic
    sequence_first, batch_first = torch.randn(7, 4, 3), torch.randn(4, 7)
    mark_batch_dimension_dynamic((sequence_first, batch_first), {}, batch_size=4)
    assert getattr(sequence_first, "_dynamo_weak_dynamic_indices", set()) == set()
    assert batch_first._dynamo_weak_dynamic_indices == {0}

    from aitoolbox.torchtrain.model import ModelWrap
    from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition

    class FeedSequences(AbstractModelFeedDefinition):
        def get_loss(self, model, batch_data, criterion, device):
            x, y = batch_data
            return criterion(model(x.transpose(0, 1).contiguous().to(device)), y.to(device))

        def get_loss_eval(self, model, batch_data, criterion, device):
            return self.get_loss(model, batch_data, criterion, device)

        def get_predictions(self, model, batch_data, device):
            x, y = batch_data
            return model(x.transpose(0, 1).contiguous().to(device)).argmax(1), y, None

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 7, 3, generator=generator), torch.randint(0, 2, (10,)))
    model = SequenceFirst()
    tl = TrainLoop(ModelWrap(model, FeedSequences()), DataLoader(data, batch_size=4), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False, torch_compile={"backend": "aot_eager"})
    tl.fit(num_epochs=2)
    # The loop told the compiled call which dimension size is the batch; sequence-first training works compiled.
    # 6 batches, and the compiled pass of the first batch's gradient check.
    assert tl._compiler.model_call.batch_size == 4 and tl._compiler.model_call.calls == 7


# --- a tl.precision the user assigned -------------------------------------------------------------------------------
def _assigned_precision_worker(rank, world_size):
    from aitoolbox.torchtrain.precision import LossScaler, Precision
    from tests.combinations.support import Cell, build_loop, join_as_torchrun
    join_as_torchrun(rank, world_size)
    tl = build_loop(Cell(strategy="ddp"))
    tl.precision = Precision("cpu", autocast_dtype=torch.bfloat16, loss_scaler=LossScaler(8.0))
    tl.fit_distributed(num_epochs=1, train_data_shuffle=False)
    return repr(tl.precision)


def test_an_assigned_precision_is_used_under_ddp_and_refused_under_fsdp():
    """Before, use_strategy dropped it and the processes trained in use_amp's precision (float32) silently."""
    from aitoolbox.torchtrain.precision import Precision
    from tests.combinations.support import Cell, build_loop
    from tests.distributed_helpers import run_distributed
    for described in run_distributed(_assigned_precision_worker, 2):
        assert "autocast_dtype=torch.bfloat16" in described and "LossScaler" in described
    tl = build_loop(Cell(strategy="fsdp"))
    tl.precision = Precision("cpu", autocast_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gpu_mode='fsdp' cannot use it.*Pass use_amp"):
        tl.fit(num_epochs=1)
    tl = build_loop(Cell(strategy="ddp"))
    tl.precision = Precision("cpu", autocast_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amp_init_args.*pass one of them"):
        tl.fit_distributed(num_epochs=1, amp_init_args={"opt_level": "O1"})


# --- fit_distributed twice is one longer call ---------------------------------------------------------------------
O2_DYNAMIC = {"opt_level": "O2", "loss_scale": "dynamic"}


def _scheduler():
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
    return StepLRScheduler(step_size=1, gamma=0.7)


def _two_calls_equal_one(run_calls):
    """``run_calls(tl, [2, 4])`` against ``run_calls(tl, [4])``: weights, masters, loss scale, learning rate and
    history equal, and the first call's callbacks registered for the second."""
    from tests.combinations.support import Cell, build_loop
    results = []
    for calls in ([2, 4], [4]):
        tl = build_loop(Cell(strategy="ddp", loss="plain"))
        scheduler = _scheduler()
        run_calls(tl, calls, scheduler)
        results.append(tl)
    split, whole = results
    assert_params_equal(split.model, whole.model)
    assert split.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    assert dict(split.train_history) == dict(whole.train_history)
    return split, whole


def test_fit_distributed_twice_equals_one_longer_call_spawned():
    def run_calls(tl, calls, scheduler):
        for number, epochs in enumerate(calls):
            tl.fit_distributed(num_epochs=epochs, callbacks=[scheduler] if number == 0 else None,
                               amp_init_args=O2_DYNAMIC, num_gpus=2, start_method="fork", train_data_shuffle=False)
        assert scheduler in tl.callbacks  # registered by the first call, here too

    split, whole = _two_calls_equal_one(run_calls)
    masters_split = split.pending_restore["precision"]["master_weights"]
    masters_whole = whole.pending_restore["precision"]["master_weights"]
    assert all(torch.equal(a, b) for a, b in zip(masters_split[0], masters_whole[0]))  # float32, not rounded
    assert split.pending_restore["precision"]["loss_scaler"] == whole.pending_restore["precision"]["loss_scaler"]


def _torchrun_calls_worker(rank, world_size, calls):
    from tests.combinations.support import Cell, build_loop, join_as_torchrun, run_state
    join_as_torchrun(rank, world_size)
    tl = build_loop(Cell(strategy="ddp", loss="plain"))
    scheduler = _scheduler()
    for number, epochs in enumerate(calls):
        tl.fit_distributed(num_epochs=epochs, callbacks=[scheduler] if number == 0 else None,
                           amp_init_args=O2_DYNAMIC, train_data_shuffle=False)
    state = run_state(tl)
    return state, tl.precision.state_dict(), tl.optimizers[0].param_groups[0]["lr"], scheduler in tl.callbacks


@pytest.mark.slow
@pytest.mark.extended  # the spawned and FSDP variants run in the suite (README: within 15 minutes)
def test_fit_distributed_twice_equals_one_longer_call_under_torchrun():
    from tests.combinations.support import assert_same_state
    from tests.distributed_helpers import run_distributed
    split = run_distributed(_torchrun_calls_worker, 2, ([2, 4],))
    whole = run_distributed(_torchrun_calls_worker, 2, ([4],))
    for rank in range(2):
        assert_same_state(split[rank][0], whole[rank][0], f"rank {rank}")
        assert split[rank][0]["history"] == whole[rank][0]["history"]
        masters = [torch.equal(a, b) for a, b in zip(split[rank][1]["master_weights"][0],
                                                     whole[rank][1]["master_weights"][0])]
        assert all(masters) and split[rank][1]["loss_scaler"] == whole[rank][1]["loss_scaler"]
        assert split[rank][2] == whole[rank][2] and split[rank][3]


# --- a miscompiled model stops training before it trains wrong ---------------------------------------------------
def _backend_zeroing_first_gradient(graph_module, example_inputs):
    """A real dynamo backend whose backward is wrong: it returns zeros for the first gradient (as inductor did for
    the quickstart CNN's convolutions), everything else computed by the traced graph."""
    from torch._dynamo.backends.common import aot_autograd

    def wrong_backward(backward_graph, _inputs):
        def run(*args):
            outputs = list(backward_graph(*args))
            index = next(i for i, out in enumerate(outputs) if isinstance(out, torch.Tensor))
            outputs[index] = torch.zeros_like(outputs[index])
            return tuple(outputs)
        run._boxed_call = False
        return run

    return aot_autograd(fw_compiler=lambda gm, _inputs: gm, bw_compiler=wrong_backward)(graph_module, example_inputs)


def _compiled_loop(torch_compile, seed=0):
    from tests.combinations.support import ComboNet, dataset
    torch.manual_seed(seed)
    model = ComboNet()
    return TrainLoop(model, DataLoader(dataset(), batch_size=8), None, None,
                     torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), end_auto_eval=False,
                     show_progress=False, torch_compile=torch_compile)


def test_a_miscompiled_model_stops_at_the_first_batch_naming_the_parameters():
    from aitoolbox.torchtrain.compiling.verify import CompiledGradientsDiffer
    tl = _compiled_loop({"backend": _backend_zeroing_first_gradient})
    before = copy.deepcopy(tl.model.state_dict())
    expected = r"all zero when compiled.*'backend': 'aot_eager'.*'verify': False"
    with pytest.raises(CompiledGradientsDiffer, match=expected):
        tl.fit(num_epochs=1)
    assert all(torch.equal(before[k], v) for k, v in tl.model.state_dict().items())  # nothing trained, BN untouched
    unchecked = _compiled_loop({"backend": _backend_zeroing_first_gradient, "verify": False})
    unchecked.fit(num_epochs=1)  # without the check it trains, silently wrong


def test_the_check_leaves_training_bitwise_as_without_it():
    """Dropout and BatchNorm: the check's passes restore the random state, the running statistics and the
    gradients, so a checked run equals an unchecked one."""
    checked = _compiled_loop({"backend": "aot_eager"})  # seeds the global RNG: built right before training
    checked.fit(num_epochs=2)
    unchecked = _compiled_loop({"backend": "aot_eager", "verify": False})
    unchecked.fit(num_epochs=2)
    assert checked._compiler._verified and not unchecked._compiler._verified
    assert_params_equal(checked.model, unchecked.model)


# --- O3 resume: the optimizer state follows the cast parameters ---------------------------------------------------
def test_o3_resumes_from_a_checkpoint_loaded_before_the_model_is_cast():
    """load_checkpoint before fit put Adam's state on the float32 parameters; O3 then cast the model to bfloat16
    and the first step failed (a float32 state for a bfloat16 gradient). Resumed now equals straight."""
    from tests.combinations.support import Cell, assert_same_state, resume_cell, train_cell
    cell = Cell("O3")
    assert_same_state(resume_cell(cell)["state"], train_cell(cell)["state"], "O3 resumed vs straight")


def test_fit_distributed_twice_equals_one_longer_call_under_fsdp():
    """The same with sharded processes (the launching process adopts the gathered weights and name-keyed optimizer
    state) and FSDP's mixed-precision policy."""
    from tests.combinations.support import Cell, build_loop
    results = []
    for calls in ([1, 2], [2]):
        tl = build_loop(Cell("O1", "fsdp"))
        scheduler = _scheduler()
        for number, epochs in enumerate(calls):
            tl.fit_distributed(num_epochs=epochs, callbacks=[scheduler] if number == 0 else None, num_gpus=2,
                               start_method="fork", train_data_shuffle=False)
        results.append(tl)
    split, whole = results
    assert_params_equal(split.model, whole.model)
    assert dict(split.train_history) == dict(whole.train_history)
    assert split.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]


# --- O2 + dynamic scaling + MultiLoss with two optimizers + accumulation: one overflow verdict per optimizer ----
class PoisonedAux:
    """Makes a ComboNet's auxiliary loss infinite at the get_loss calls numbered in ``calls`` (0-based)."""

    def __init__(self, model, calls):
        self.calls, self.count = set(calls), 0
        self.original = model.get_loss
        model.get_loss = self

    def __call__(self, batch_data, criterion, device):
        loss = self.original(batch_data, criterion, device)
        if self.count in self.calls:
            loss["aux"] = loss["aux"] * float("inf")
        self.count += 1
        return loss


def _o2_two_optimizer_run(poisoned_call: int):
    from tests.combinations.support import Cell, build_loop, build_model
    cell = Cell(loss="multi2", grad_accumulation=2)
    model = build_model(cell)
    PoisonedAux(model, [poisoned_call])
    tl = build_loop(cell, model)
    tl.use_amp = {"opt_level": "O2", "loss_scale": "dynamic"}
    skipped = []

    class Skips(AbstractCallback):
        def on_after_optimizer_step(self):
            skipped.append(self.train_loop_obj.optimizer_step_skipped)

    tl.fit(num_epochs=1, grad_accumulation=2, callbacks=[Skips("skips")])
    return tl, skipped


@pytest.mark.parametrize("first_micro_batch", [0, 2])  # 5 batches: windows (0, 1), (2, 3), (4)
def test_o2_dynamic_scaling_two_optimizers_accumulation_skips_only_the_overflowing_optimizer(first_micro_batch):
    """An inf in the second loss in the first micro-batch of a window skipped optimizer 0 and let optimizer 1 step on
    NaN gradients (one overflow verdict for both, cleared after optimizer 0's step). Each optimizer has its own
    verdict now: optimizer 1 skips, optimizer 0 steps, exactly as when the inf comes in the window's last micro-batch
    (the main loss never sees the auxiliary head: its gradients are the same either way)."""
    early, early_skips = _o2_two_optimizer_run(first_micro_batch)
    late, late_skips = _o2_two_optimizer_run(first_micro_batch + 1)
    for name, tensor in early.model.state_dict().items():
        assert torch.isfinite(tensor.float()).all(), f"{name} is not finite"
    assert_params_equal(early.model, late.model)
    window = first_micro_batch // 2
    assert early_skips == late_skips  # per optimizer step: [opt0, opt1] of each window
    assert early_skips[2 * window: 2 * window + 2] == [False, True]
    assert early.precision.loss_scaler.loss_scale == late.precision.loss_scaler.loss_scale == 2.0 ** 15
