"""SpikeRollback: a poisoned batch spikes the loss; the run rolls back, leaves the batch out and ends bitwise equal
to a run whose loader never yielded it (issue 25, "The guarantee, tested")."""
import copy
import io
import json
import math
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from aitoolbox.torchtrain.callbacks import SpikeRollback, ThroughputMonitor
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollbackError
from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, assert_params_equal, classification_data, model_pair, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

NUM_SAMPLES, BATCH_SIZE = 48, 4  # 12 batches an epoch
LOADER_SEED, TRAIN_SEED = 3, 4
SETTINGS = dict(window=8, warmup=10, snapshot_every=5)  # the default rule, over a short window


class Poisoned(Dataset):
    """The classification data with the samples ``by_epoch[epoch]`` scaled by ``scale`` (or made NaN) in that epoch
    (:class:`TellEpoch` tells the data the epoch): their batch's loss jumps and one optimizer step would ruin the
    weights."""

    def __init__(self, by_epoch=None, scale: float = 1e4):
        self.base = classification_data(NUM_SAMPLES)
        self.by_epoch, self.scale = dict(by_epoch or {}), scale
        self.epoch = 0

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        x, y = self.base[index]
        if index in self.by_epoch.get(self.epoch, ()):
            x = x * self.scale if not math.isnan(self.scale) else torch.full_like(x, float("nan"))
        return x, y


class TellEpoch(AbstractCallback):
    """Tells the training data the epoch at its start (a rollback into an earlier epoch starts it again). Ordered after
    SpikeRollback: a callback with an ``on_epoch_begin`` ordered before it keeps the fit's start from being a point."""

    def __init__(self):
        super().__init__("tell the data the epoch", execution_order=-10)

    def on_epoch_begin(self):
        self.train_loop_obj.train_loader.dataset.epoch = self.train_loop_obj.epoch


def loader(dataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True,
                      generator=torch.Generator().manual_seed(LOADER_SEED))


def batch_order(num_epochs: int):
    """The sample indices of every batch, per epoch, as ``loader`` draws them."""
    twin = DataLoader(range(NUM_SAMPLES), batch_size=BATCH_SIZE, shuffle=True,
                      generator=torch.Generator().manual_seed(LOADER_SEED))
    return [[batch.tolist() for batch in twin] for _ in range(num_epochs)]


class LeavingOut(BatchSampler):
    """The batches ``loader`` draws (same generator, same permutation), without those at ``drop[epoch]``."""

    def __init__(self, generator, drop):
        super().__init__(RandomSampler(range(NUM_SAMPLES), generator=generator), BATCH_SIZE, False)
        self.drop, self.epochs_started = drop, 0

    def __len__(self):  # the loop reads the length before each epoch's iteration
        return super().__len__() - len(self.drop.get(self.epochs_started, ()))

    def __iter__(self):
        epoch, self.epochs_started = self.epochs_started, self.epochs_started + 1
        for position, batch in enumerate(super().__iter__()):
            if position not in self.drop.get(epoch, ()):
                yield batch


def reference_loader(dataset, drop) -> DataLoader:
    generator = torch.Generator().manual_seed(LOADER_SEED)  # the base seed and the permutation, as in loader()
    return DataLoader(dataset, batch_sampler=LeavingOut(generator, drop), generator=generator)


def make_loop(model, train_loader, use_amp=False, loop_class=TrainLoop, **options) -> TrainLoop:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return loop_class(model, train_loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                      show_progress=False, use_amp=use_amp, **options)


def train(tl, num_epochs=4, callbacks=(), grad_accumulation=1):
    torch.manual_seed(TRAIN_SEED)  # dropout
    tl.fit(num_epochs=num_epochs, callbacks=[TellEpoch()] + list(callbacks), grad_accumulation=grad_accumulation)
    return tl


def poisoned_at(epoch, position, num_epochs=4):
    """Arguments of :class:`Poisoned` for the batch at ``position`` of ``epoch`` (its samples, that epoch)."""
    return {epoch: batch_order(num_epochs)[epoch][position]}


def test_a_poisoned_batch_is_rolled_back_and_left_out_bitwise_and_without_it_the_run_is_ruined():
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    ruined_model = copy.deepcopy(model)
    tl = train(make_loop(model, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})))
    assert_params_equal(tl.model, reference.model)
    assert tl.train_history["accumulated_loss"] == reference.train_history["accumulated_loss"]

    (record,) = tl.rollbacks
    assert (record["epoch"], record["iteration"]) == (1, 5)
    assert sorted(record["skipped_samples"]) == sorted(*poison.values())
    assert record["loss"] > 100 * record["median"]
    assert record["restored"]["epoch"] <= 1
    assert tl.train_history["rollbacks"] == [0, 1, 0, 0]
    assert tl.run_state.rollbacks.skipped == {1: [5]}

    ruined = train(make_loop(ruined_model, loader(Poisoned(poison))))
    distance = max((a - b).abs().max().item() for a, b in zip(ruined.model.parameters(), reference.model.parameters()))
    assert distance > 1.0, "the poisoned batch was meant to ruin the weights without SpikeRollback"
    assert max(p.abs().max().item() for p in ruined.model.parameters()) > 10 * max(
        p.abs().max().item() for p in reference.model.parameters())


def test_a_nan_loss_is_a_spike_from_the_first_check():
    poison = poisoned_at(0, 2)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison, scale=float("nan")))), num_epochs=2,
               callbacks=[SpikeRollback(**SETTINGS)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {0: {2}})), num_epochs=2)
    assert_params_equal(tl.model, reference.model)
    assert math.isnan(tl.rollbacks[0]["loss"]) and tl.rollbacks[0]["iteration"] == 2


def test_a_spike_inside_an_accumulation_window_redoes_the_window_from_the_remaining_batches():
    poison = poisoned_at(2, 4)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison))), grad_accumulation=3,
               callbacks=[SpikeRollback(**dict(SETTINGS, snapshot_every=2))])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {2: {4}})), grad_accumulation=3)
    assert_params_equal(tl.model, reference.model)
    assert len(tl.rollbacks) == 1


class NanGradientMLP(MLP):
    """An MLP whose loss stays finite on the batches holding the samples ``bad[epoch]`` while its gradients are NaN
    (0 x the derivative of sqrt at an exact 0, as a norm of an exact 0 does): their step makes the weights NaN."""

    def __init__(self):
        super().__init__()
        self.bad, self.epoch = {}, 0

    def forward(self, x):
        out = super().forward(x)
        rows = self.bad.get(self.epoch)
        if self.training and rows is not None and (x[:, None, :] == rows[None]).all(dim=-1).any():
            out = out + 0.0 * torch.sqrt(((out - out.detach()) ** 2).sum())
        return out


class TellModelEpoch(AbstractCallback):
    def __init__(self):
        super().__init__("tell the model the epoch", execution_order=-1000)

    def on_epoch_begin(self):
        self.train_loop_obj.model.epoch = self.train_loop_obj.epoch


class TellModelEpochAfter(TellModelEpoch):
    """Ordered after SpikeRollback: the resumed fit's start is a point (see _keep_start)."""

    def __init__(self):
        super().__init__()
        self.execution_order = -10


@pytest.mark.parametrize("position, blamed", [
    # The next batch's loss is NaN: as if by itself, so it is left out first; the replay ruins the weights again
    # right before it, so this batch is left out too (two rollbacks).
    (4, [{5}, {4}]),
    (7, [{7}]),  # the step ends at a check: every loss finite, the weights NaN
    (11, [{11}]),  # the epoch's last batch: judged at the epoch's end
])
def test_a_batch_with_a_finite_loss_and_nan_gradients_is_left_out_and_no_point_with_nan_weights_is_kept(
        position, blamed):
    torch.manual_seed(0)
    model = NanGradientMLP()
    twin = copy.deepcopy(model)
    samples = batch_order(4)[1][position]
    model.bad = {1: torch.stack([Poisoned().base[index][0] for index in samples])}
    tl = train(make_loop(model, loader(Poisoned())), callbacks=[SpikeRollback(**SETTINGS), TellModelEpoch()])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: set().union(*blamed)})))
    assert len(tl.rollbacks) == len(blamed)
    for record, left_out in zip(tl.rollbacks, blamed):
        assert record["epoch"] == 1 and record["non_finite_state"] is True
        assert sorted(record["skipped_samples"]) == sorted(i for p in left_out for i in batch_order(4)[1][p])
    assert all(torch.isfinite(parameter).all() for parameter in tl.model.parameters())
    assert_params_equal(tl.model, reference.model)


def test_skip_batches_leaves_out_the_batches_ending_at_the_spiking_one():
    poison = poisoned_at(1, 7)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS, skip_batches=3)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5, 6, 7}})))
    assert_params_equal(tl.model, reference.model)
    assert len(tl.rollbacks[0]["skipped_samples"]) == 3 * BATCH_SIZE


def test_snapshot_checkpoint_rolls_back_to_a_checkpoint_file(tmp_path):
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    saver = ModelCheckpoint(project_name="proj", experiment_name="spike", local_model_result_folder_path=str(tmp_path))
    tl = train(make_loop(model, loader(Poisoned(poison))),
               callbacks=[saver, SpikeRollback(**SETTINGS, snapshot="checkpoint")])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})))
    assert_params_equal(tl.model, reference.model)
    run_folder = tmp_path / "proj" / f"spike_{tl.experiment_timestamp}"
    (record,) = json.loads((run_folder / "rollbacks.json").read_text())
    assert (record["epoch"], record["iteration"]) == (1, 5)
    assert sorted(record["skipped_samples"]) == sorted(*poison.values())
    # The epoch checkpoints of ModelCheckpoint, and only the newest of SpikeRollback's (older ones are deleted).
    kept = sorted(path.name for path in (run_folder / "checkpoint_model").iterdir() if "_ITER" in path.name)
    assert kept == [f"model_spike_{tl.experiment_timestamp}_E3_ITER46.pth"]  # the last step (47 batches trained)


def test_snapshot_checkpoint_without_a_checkpoint_callback_is_refused_before_training():
    model, _ = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned()))
    with pytest.raises(ValueError, match="no checkpoint callback"):
        tl.fit(num_epochs=1, callbacks=[SpikeRollback(snapshot="checkpoint")])
    assert tl.total_iteration_idx == -1


def test_the_spike_after_max_rollbacks_stops_training_with_an_error_listing_them():
    order = batch_order(4)
    model, _ = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned({1: order[1][3], 2: order[2][6]})))
    with pytest.raises(SpikeRollbackError, match="max_rollbacks=1") as raised:
        train(tl, callbacks=[SpikeRollback(**SETTINGS, max_rollbacks=1)])
    message = str(raised.value)
    # Epochs counted from 1 in messages, as the epoch line counts (the records keep the index).
    assert "spike at epoch 2, iteration 3" in message and "epoch 3, iteration 6" in message
    assert len(raised.value.rollbacks) == 1 and raised.value.spike["epoch"] == 2


def test_a_learning_rate_that_keeps_failing_ends_at_max_rollbacks():
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoop(model, loader(Poisoned()), None, None, torch.optim.SGD(model.parameters(), lr=1e6),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    with pytest.raises(SpikeRollbackError):
        train(tl, callbacks=[SpikeRollback(**dict(SETTINGS, snapshot_every=1), max_rollbacks=2)])
    assert len(tl.rollbacks) == 2


class RecordLearningRates(AbstractCallback):
    """The learning rate each optimizer step uses (read before the step, after SpikeRollback lowered it), by batch
    index over the run (a replayed batch overwrites what the rolled-back run recorded)."""

    def __init__(self):
        super().__init__("lr at each step", execution_order=50)
        self.used = {}

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if tl.optimizer_step_due:
            self.used[tl.total_iteration_idx] = tl.optimizer.param_groups[0]["lr"]


def test_the_cooldown_lowers_the_learning_rate_for_its_steps_and_a_scheduler_goes_on_as_without_it():
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    seen, plain = RecordLearningRates(), RecordLearningRates()
    tl = train(make_loop(model, loader(Poisoned(poison))),
               callbacks=[SpikeRollback(**SETTINGS, lr_factor=0.1, cooldown_steps=3),
                          StepLRScheduler(step_size=7, gamma=0.5, step_per_optimizer_step=True), seen])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})),
                      callbacks=[StepLRScheduler(step_size=7, gamma=0.5, step_per_optimizer_step=True), plain])
    assert seen.used.keys() == plain.used.keys()
    lowered = sorted(index for index in plain.used if seen.used[index] != plain.used[index])
    restored = tl.rollbacks[0]["restored"]
    first_replayed = restored["epoch"] * 12 + restored["iteration"] + 1  # no batch left out before it
    assert lowered == [first_replayed, first_replayed + 1, first_replayed + 2]
    for index in lowered:
        assert seen.used[index] == 0.1 * plain.used[index]
    assert len(set(plain.used.values())) > 3  # the scheduler changed the rate during the run
    assert tl.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


class CheckpointAt(AbstractCallback):
    """Keeps a mid-epoch checkpoint (as bytes) taken at the end of batch ``at`` = (epoch, iteration) once the run
    rolled back ``after_rollbacks`` times."""

    def __init__(self, at, after_rollbacks=1):
        super().__init__("checkpoint at a batch", execution_order=200)
        self.at, self.after_rollbacks, self.saved = at, after_rollbacks, None

    def on_batch_end(self):
        tl = self.train_loop_obj
        if (tl.epoch, tl.iteration) == self.at and len(tl.rollbacks) == self.after_rollbacks \
                and tl.should_execute_optimizer_update():
            buffer = io.BytesIO()
            torch.save(tl.checkpoint_state(mid_epoch=True), buffer)
            self.saved = buffer.getvalue()


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_run_resumed_from_a_checkpoint_written_after_a_rollback_equals_the_straight_one(grad_accumulation):
    poison = poisoned_at(1, 3)
    model, twin = model_pair(MLP)
    keeper = CheckpointAt((1, 7))  # after the left-out batch, in its epoch: the resume fast-forwards past it
    straight = train(make_loop(model, loader(Poisoned(poison))), grad_accumulation=grad_accumulation,
                     callbacks=[SpikeRollback(**SETTINGS), keeper])
    assert keeper.saved is not None
    checkpoint = torch.load(io.BytesIO(keeper.saved), weights_only=True)
    assert checkpoint["rollbacks"]["skipped"] == [[1, 3]]

    resumed = make_loop(twin, loader(Poisoned(poison)))
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=4, grad_accumulation=grad_accumulation, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS)])
    assert_params_equal(resumed.model, straight.model)
    assert resumed.rollbacks == straight.rollbacks
    assert resumed.train_history["accumulated_loss"] == straight.train_history["accumulated_loss"]


class CheckpointAround(AbstractCallback):
    """Keeps the checkpoint (bytes) taken by ``checkpoint_state(mid_epoch)`` in ``hook`` at its ``k``-th call (0:
    the first) after the first rollback, or the error that refused it."""

    def __init__(self, hook, k=0, mid_epoch=None, execution_order=200):
        super().__init__("checkpoint around a rollback", execution_order=execution_order)
        self.hook, self.k, self.mid_epoch = hook, k, mid_epoch
        self.calls, self.saved, self.error = 0, None, None

    def _take(self, hook):
        tl = self.train_loop_obj
        if hook != self.hook or not tl.rollbacks or self.saved is not None or self.error is not None:
            return
        self.calls += 1
        if self.calls - 1 != self.k:
            return
        try:
            buffer = io.BytesIO()
            torch.save(tl.checkpoint_state(mid_epoch=self.mid_epoch), buffer)
            self.saved = buffer.getvalue()
        except RuntimeError as error:
            self.error = error

    def on_epoch_begin(self):
        self._take("on_epoch_begin")

    def on_batch_end(self):
        self._take("on_batch_end")

    def on_epoch_end(self):
        self._take("on_epoch_end")


AROUND_POISON = (1, 6)  # kept point: epoch 1 after 3 batches (grad_accumulation=1), epoch 0 after 10 (=2)


def straight_with_rollback(grad_accumulation, callbacks=()):
    model, _ = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poisoned_at(*AROUND_POISON)))), grad_accumulation=grad_accumulation,
               callbacks=[SpikeRollback(**SETTINGS), *callbacks])
    assert len(tl.rollbacks) == 1
    return tl


def assert_resumes_as_straight(saved, grad_accumulation):
    """A new loop loads the checkpoint ``saved`` and fits to the same total, with the same callbacks (no taker):
    bitwise the straight run with its rollback."""
    straight = straight_with_rollback(grad_accumulation)
    _, twin = model_pair(MLP)
    resumed = make_loop(twin, loader(Poisoned(poisoned_at(*AROUND_POISON))))
    torch.manual_seed(999)  # the checkpoint's RNG state decides, not the process's
    resumed.load_checkpoint(torch.load(io.BytesIO(saved), weights_only=True))
    resumed.fit(num_epochs=4, grad_accumulation=grad_accumulation, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS)])
    assert_params_equal(resumed.model, straight.model)
    assert resumed.rollbacks == straight.rollbacks
    assert resumed.train_history["accumulated_loss"] == straight.train_history["accumulated_loss"]
    assert resumed.train_history["rollbacks"] == straight.train_history["rollbacks"]


@pytest.mark.parametrize("grad_accumulation, mid_epoch, execution_order",
                         [(1, None, 200), (2, None, 200), (1, True, -30), (2, True, -30)])
def test_a_checkpoint_taken_in_the_replayed_on_epoch_begin_resumes_as_the_straight_run(grad_accumulation, mid_epoch,
                                                                                       execution_order):
    """The replay of a rollback starts with its epoch's on_epoch_begin (the kept point may lie in an earlier epoch):
    there the run stands at the kept point, which a checkpoint records (review of issue 32: it recorded the kept
    position with the abandoned run's RNG state, epoch start and loss sum, and the resumed run diverged)."""
    taker = CheckpointAround("on_epoch_begin", mid_epoch=mid_epoch, execution_order=execution_order)
    straight_with_rollback(grad_accumulation, [taker])
    assert taker.error is None and taker.saved is not None
    checkpoint = torch.load(io.BytesIO(taker.saved), weights_only=True)
    kept = (1, 3) if grad_accumulation == 1 else (0, 10)
    assert (checkpoint["epochs_completed"], checkpoint["iteration"]) == kept
    assert_resumes_as_straight(taker.saved, grad_accumulation)


def test_an_epoch_end_checkpoint_in_the_replayed_on_epoch_begin_is_refused_naming_the_kept_point():
    taker = CheckpointAround("on_epoch_begin", mid_epoch=False)
    straight_with_rollback(1, [taker])
    message = str(taker.error)
    assert "inside epoch 1, at the point SpikeRollback returned the run to, after 3 of its batches" in message
    assert "on_epoch_end" in message  # where an epoch-end checkpoint can be taken


class FailInReplayedEpochBegin(AbstractCallback):
    def __init__(self):
        super().__init__("fail in the replayed on_epoch_begin")
        self.failed = False

    def on_epoch_begin(self):
        if self.train_loop_obj.rollbacks and not self.failed:
            self.failed = True
            raise RuntimeError("stopped in the replay's on_epoch_begin")


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_fit_stopped_in_the_replayed_on_epoch_begin_continues_from_the_kept_point(grad_accumulation):
    """It continued from the abandoned run's last step point (counters, RNG and loss sum of the undone interval)."""
    model, _ = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned(poisoned_at(*AROUND_POISON))))
    with pytest.raises(RuntimeError, match="stopped in the replay"):
        train(tl, grad_accumulation=grad_accumulation,
              callbacks=[SpikeRollback(**SETTINGS), FailInReplayedEpochBegin()])
    tl.fit(num_epochs=4, grad_accumulation=grad_accumulation)
    straight = straight_with_rollback(grad_accumulation)
    assert_params_equal(tl.model, straight.model)
    assert tl.train_history["accumulated_loss"] == straight.train_history["accumulated_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("grad_accumulation", [1, 2])
@pytest.mark.parametrize("hook, k", [("on_batch_end", 1), ("on_batch_end", 3), ("on_epoch_end", 0)])
def test_a_checkpoint_taken_after_the_rollback_resumes_as_the_straight_run(grad_accumulation, hook, k):
    taker = CheckpointAround(hook, k)
    straight_with_rollback(grad_accumulation, [taker])
    assert taker.error is None and taker.saved is not None
    assert_resumes_as_straight(taker.saved, grad_accumulation)


def test_a_checkpoint_without_the_rollbacks_key_leaves_nothing_out():
    model, twin = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned()))
    tl.run_state.rollbacks.skip(0, 1)
    checkpoint = tl.checkpoint_state()
    del checkpoint["rollbacks"]
    other = make_loop(twin, loader(Poisoned()))
    other.run_state.rollbacks.skip(0, 2)
    other.load_checkpoint(checkpoint)
    assert other.run_state.rollbacks.skipped == {} and other.rollbacks == []


def test_bfloat16_autocast_run_completes_and_leaves_the_batch_out():
    poison = poisoned_at(1, 5)
    model, _ = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison)), use_amp={"opt_level": "O1", "dtype": torch.bfloat16}),
               num_epochs=3, callbacks=[SpikeRollback(**SETTINGS)])
    assert [(r["epoch"], r["iteration"]) for r in tl.rollbacks] == [(1, 5)]
    assert all(torch.isfinite(p).all() for p in tl.model.parameters())
    assert max(p.abs().max().item() for p in tl.model.parameters()) < 10


def test_a_preset_writes_rollbacks_json_into_its_run_folder(tmp_path):
    poison = poisoned_at(1, 5)
    model, _ = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned(poison)), loop_class=TrainLoopCheckpoint, project_name="proj",
                   experiment_name="exp", local_model_result_folder_path=str(tmp_path), hyperparams={})
    train(tl, num_epochs=2, callbacks=[SpikeRollback(**SETTINGS)])
    records = json.loads(open(os.path.join(tl.experiment_folder.path, "rollbacks.json")).read())
    assert [(r["epoch"], r["iteration"]) for r in records] == [(1, 5)]
    assert set(records[0]) == {"epoch", "iteration", "loss", "median", "limit", "skipped_samples", "restored"}


class CountChecks(AbstractCallback):
    """How often the loop ran an after-step action (SpikeRollback's check, and the judgement of the losses left at
    each epoch's end at its last step: the only host synchronisations it adds)."""

    def __init__(self):
        super().__init__("count checks", execution_order=300)
        self.checks = 0

    def on_batch_end(self):
        if self.train_loop_obj.run_state.after_step_action is not None:
            self.checks += 1


def test_the_losses_are_judged_once_per_interval_not_per_batch():
    model, _ = model_pair(MLP)
    counter = CountChecks()
    train(make_loop(model, loader(Poisoned())), num_epochs=4, callbacks=[SpikeRollback(**SETTINGS), counter])
    # Every 5 steps and the last step; not the first (the fit's start, with nothing pending, is the first point);
    # and the last step of epochs 1-3, where the losses left are judged for the epoch's end (not again there).
    assert counter.checks == 48 // 5 + 1 + 3


def test_a_spike_in_the_last_interval_of_a_fit_is_rolled_back_before_fit_returns():
    poison = poisoned_at(3, 10)  # the check at step 45 saw nothing; the fit ends at step 48
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {3: {10}})))
    assert_params_equal(tl.model, reference.model)
    assert [(r["epoch"], r["iteration"]) for r in tl.rollbacks] == [(3, 10)]


@pytest.mark.parametrize("bad", [dict(factor=0), dict(window=0), dict(snapshot_every=0), dict(skip_batches=0),
                                 dict(lr_factor=-1.0), dict(cooldown_steps=2), dict(snapshot="disk"),
                                 dict(max_rollbacks=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SpikeRollback(**bad)


def test_older_checkpoint_snapshots_are_deleted_but_never_another_callbacks_checkpoint(tmp_path):
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    model, _ = model_pair(MLP)
    saver = ModelIterationCheckpoint(5, project_name="proj", experiment_name="both",
                                     local_model_result_folder_path=str(tmp_path))
    tl = train(make_loop(model, loader(Poisoned())),
               callbacks=[saver, SpikeRollback(**SETTINGS, snapshot="checkpoint")])
    folder = tmp_path / "proj" / f"both_{tl.experiment_timestamp}" / "checkpoint_model"
    kept = sorted(int(path.name.split("_ITER")[1][:-4]) for path in folder.iterdir() if "_ITER" in path.name)
    # ModelIterationCheckpoint's every 5 batches (also where SpikeRollback saved the same step), SpikeRollback's
    # last (the end of the fit); its first (batch 0) was deleted when the next was kept.
    assert kept == list(range(4, 48, 5)) + [47]


# --- with the features that run at the same time -------------------------------------------------------------------
@pytest.mark.parametrize("use_amp, grad_accumulation, compiled, monitored", [
    ({"opt_level": "O2"}, 2, False, False),  # bfloat16 weights with float32 masters, a window of two batches
    ({"opt_level": "O1"}, 1, True, False),  # torch_compile: the replay runs the compiled graphs again
    (False, 1, False, True),  # beside ThroughputMonitor (batch hooks of its own, a FLOP count on the first batch)
], ids=["O2-accumulation", "O1-compiled", "with-ThroughputMonitor"])
def test_rollback_is_bitwise_with_other_features(use_amp, grad_accumulation, compiled, monitored):
    options = {"torch_compile": {"backend": "aot_eager"}} if compiled else {}
    extra = [ThroughputMonitor(peak_flops=1e12)] if monitored else []
    model, twin = model_pair(MLP)
    torch._dynamo.reset()
    tl = train(make_loop(model, loader(Poisoned(poisoned_at(1, 5))), use_amp=use_amp, **options),
               callbacks=[SpikeRollback(**SETTINGS)] + extra, grad_accumulation=grad_accumulation)
    torch._dynamo.reset()  # the reference compiles afresh, as a run of its own would
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5}}), use_amp=use_amp, **options),
                      grad_accumulation=grad_accumulation)
    assert len(tl.rollbacks) == 1
    assert_params_equal(tl.model, reference.model)


class FailOnce(AbstractCallback):
    """Raises once, at the end of the batch ``(epoch, iteration)``: a fit stopped half way."""

    def __init__(self, epoch: int, iteration: int):
        super().__init__("fail once")
        self.at, self.failed = (epoch, iteration), False

    def on_batch_end(self):
        tl = self.train_loop_obj
        if not self.failed and (tl.epoch, tl.iteration) == self.at:
            self.failed = True
            raise RuntimeError("stopped half way")


@pytest.mark.parametrize("at", [(1, 3), (1, 8), (2, 2)], ids=["before-the-spike", "after-the-rollback", "next-epoch"])
def test_a_fit_stopped_by_an_exception_and_called_again_ends_as_the_run_that_never_stopped(at):
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poisoned_at(1, 5)))), callbacks=[SpikeRollback(**SETTINGS)])
    tl = make_loop(model, loader(Poisoned(poisoned_at(1, 5))))
    with pytest.raises(RuntimeError, match="stopped half way"):
        train(tl, callbacks=[SpikeRollback(**SETTINGS), FailOnce(*at)])
    tl.fit(num_epochs=4)  # continues where the exception stopped it, the left-out batch still left out
    assert_params_equal(tl.model, straight.model)
    assert tl.train_history["rollbacks"] == straight.train_history["rollbacks"] == [0, 1, 0, 0]


# --- checkpoints on disk, stop requests (issue 34.2, issue 32.14) -------------------------------------------------
def iteration_saver(tmp_path, name, **options):
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    return ModelIterationCheckpoint(1, project_name="proj", experiment_name=name,
                                    local_model_result_folder_path=str(tmp_path), **options)


class KeptLast(AbstractCallback):
    """After every batch (and its checkpoint): the iteration checkpoints of the last ``keep_last`` steps that were on
    disk after the batch before and are gone now (none should be, also while the replay writes the names of the
    undone steps again), and whether the newest step's is there."""

    def __init__(self, saver):
        super().__init__("kept last", execution_order=500)
        self.saver, self.keep_last, self.missing, self.before = saver, saver.keep_last, [], set()

    def on_batch_end(self):
        tl = self.train_loop_obj
        folder = self.saver.experiment_folder.checkpoint_dir
        present = {int(name.split("_ITER")[1][:-4]) for name in os.listdir(folder) if "_ITER" in name}
        wanted = range(max(0, tl.total_iteration_idx - self.keep_last + 1), tl.total_iteration_idx + 1)
        self.missing += [(tl.total_iteration_idx, step) for step in wanted
                         if step not in present and (step in self.before or step == tl.total_iteration_idx)]
        self.before = present


@pytest.mark.parametrize("keep_last", [2, 10])
def test_the_point_kept_as_a_checkpoint_survives_the_pruning_of_an_iteration_checkpoint_keeping_the_last_two(
        tmp_path, keep_last):
    """The iteration checkpoint of the kept step is written by ModelIterationCheckpoint, which deletes it two steps
    later (keep_last=2): SpikeRollback's pinned copy is what the rollback loads. The replay writes the names of the
    steps it trains again: they count once among the last ones kept (keep_last=10)."""
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    saver = iteration_saver(tmp_path, "pruned", keep_last=keep_last)
    watcher = KeptLast(saver)
    tl = train(make_loop(model, loader(Poisoned(poison))),
               callbacks=[saver, SpikeRollback(**SETTINGS, snapshot="checkpoint"), watcher])
    assert watcher.missing == []
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {5}})))
    assert_params_equal(tl.model, reference.model)
    assert len(tl.rollbacks) == 1
    folder = tmp_path / "proj" / f"pruned_{tl.experiment_timestamp}" / "checkpoint_model"
    iterations = sorted(int(path.name.split("_ITER")[1][:-4]) for path in folder.iterdir() if "_ITER" in path.name)
    assert iterations == list(range(47 - keep_last, 47))  # the last of the 47 batches trained; the pin is gone
    assert not (folder / "spike_rollback").exists()


class StopAfterEpoch(AbstractCallback):
    """A stop request at the end of ``epoch`` (as EarlyStopping makes one)."""

    def __init__(self, epoch):
        super().__init__("stop after an epoch", execution_order=99)
        self.epoch = epoch

    def on_epoch_end(self):
        if self.train_loop_obj.epoch == self.epoch:
            self.train_loop_obj.stop_training("stop after an epoch")


def test_a_stop_request_lets_the_pending_check_run_first():
    """The spike at step 22 lies after the last check of epoch 1 (step 20); the stop at the epoch's end must not
    return its weights."""
    poison = poisoned_at(1, 10)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS), StopAfterEpoch(1)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {10}})), callbacks=[StopAfterEpoch(1)])
    assert [(r["epoch"], r["iteration"]) for r in tl.rollbacks] == [(1, 10)]
    assert tl.epochs_completed == reference.epochs_completed == 2
    assert_params_equal(tl.model, reference.model)


def test_terminate_on_nan_does_not_end_training_on_a_nan_batch_that_can_be_rolled_back():
    from aitoolbox.torchtrain.callbacks.stopping import TerminateOnNaN
    poison = poisoned_at(1, 10)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison, scale=float("nan")))),
               callbacks=[SpikeRollback(**SETTINGS), TerminateOnNaN(monitor="accumulated_loss")])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {10}})))
    assert tl.epochs_completed == 4 and len(tl.rollbacks) == 1
    assert_params_equal(tl.model, reference.model)


class KilledAfterRollback(AbstractCallback):
    """The job dies at the first batch after the first rollback."""

    def __init__(self):
        super().__init__("killed after a rollback")

    def on_batch_begin(self):
        if self.train_loop_obj.rollbacks:
            raise RuntimeError("killed")


@pytest.mark.parametrize("snapshot, keep_last", [("memory", None), ("checkpoint", None), ("checkpoint", 2)])
def test_a_job_killed_right_after_a_rollback_resumes_from_a_clean_checkpoint(tmp_path, snapshot, keep_last):
    """The checkpoints of the steps after the kept one (batch 14) hold the run being undone (the spike is at batch 17,
    found at batch 19): the rollback deletes them, and the newest on disk is the kept step's (put back from
    SpikeRollback's pin where keep_last had pruned it)."""
    from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, find_checkpoint
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(RuntimeError, match="killed"):
        train(tl, callbacks=[iteration_saver(tmp_path, "killed", keep_last=keep_last),
                             SpikeRollback(**SETTINGS, snapshot=snapshot),
                             KilledAfterRollback()])
    newest = find_checkpoint(str(tmp_path / "proj" / f"killed_{tl.experiment_timestamp}"))
    restored = tl.rollbacks[0]["restored"]
    assert (restored["epoch"], restored["iteration"]) == (1, 2)
    assert checkpoint_path_position(newest) == (1, 0, 12 + 2)

    resumed = make_loop(twin, loader(Poisoned(poison)))
    resumed.load_checkpoint(newest)
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS)])
    torch.manual_seed(0)
    reference_model, _ = model_pair(MLP)
    reference = train(make_loop(reference_model, reference_loader(Poisoned(), {1: {5}})))
    assert_params_equal(resumed.model, reference.model)


def test_a_checkpoint_written_after_the_kept_point_is_deleted_whatever_time_its_file_carries(tmp_path):
    """A file's modification time comes from a coarser clock than ``time.time()``: a checkpoint written milliseconds
    after the kept point can carry an earlier time. It holds the run being undone all the same (a killed job resumed
    from it continued the spiked run: the memory-snapshot variant above failed about every other run)."""
    from types import SimpleNamespace

    from aitoolbox.experiment.local_save.checkpoints import checkpoint_file_name
    from aitoolbox.torchtrain.callbacks.spike_points import KeptPoint, checkpoints_on_disk, remove_checkpoints_after

    folder = tmp_path / "checkpoint_model"
    folder.mkdir()
    saver = SimpleNamespace(experiment_folder=SimpleNamespace(checkpoint_dir=str(folder)),
                            wait_for_pending_save=lambda: None)

    def write(iteration):
        path = folder / checkpoint_file_name("exp", "ts", 1, iteration)
        torch.save({"iteration": iteration}, path)
        return path

    older_timeline = write(20)  # a later position already on disk when the point was kept: not this run's to undo
    kept_step = write(14)
    point = KeptPoint(epoch=1, iteration=2, batches_done=3, total_iteration=14,
                      on_disk=checkpoints_on_disk([saver]))
    undone = [write(15), write(16)]
    os.utime(undone[0], (point.kept_at - 5, point.kept_at - 5))  # an earlier time than the point's
    deleted = remove_checkpoints_after(SimpleNamespace(is_main_process=True), point, [saver])
    assert sorted(deleted) == sorted(str(path) for path in undone)
    assert kept_step.exists() and older_timeline.exists() and not any(path.exists() for path in undone)


class KilledAt(AbstractCallback):
    """The job dies at the start of batch ``step`` (a total iteration index)."""

    def __init__(self, step):
        super().__init__("killed at a step")
        self.step = step

    def on_batch_begin(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.step:
            raise RuntimeError("killed")


@pytest.mark.parametrize("keep_last", [None, 2])
def test_a_job_killed_after_a_spike_before_its_check_resumes_and_returns_to_the_pinned_point(tmp_path, monkeypatch,
                                                                                              keep_last):
    """The spike is at batch 17, its check due at batch 19; the job dies at batch 18. The newest checkpoint holds the
    spiked weights and the loss not yet judged; the point kept at batch 14 stays pinned across the processes, so the
    resumed run (in the same run folder) judges the loss, returns to that point and ends as the run that never met
    the batch (review of issue 34, D4)."""
    from aitoolbox.experiment.local_save.checkpoints import find_checkpoint
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    monkeypatch.chdir(tmp_path)  # the default run folder: ./aitoolbox_runs/run_<timestamp>/
    poison = poisoned_at(1, 5)
    model, twin = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(RuntimeError, match="killed"):
        train(tl, callbacks=[ModelIterationCheckpoint(1, keep_last=keep_last),
                             SpikeRollback(**SETTINGS, snapshot="checkpoint"), KilledAt(18)])
    assert tl.rollbacks == []
    run_folder = tl.run_folder.path
    assert os.path.isdir(os.path.join(run_folder, "checkpoint_model", "spike_rollback"))  # outlives the failed fit

    resumed = make_loop(twin, loader(Poisoned(poison)))
    resumed.load_checkpoint(find_checkpoint(run_folder), continue_run_folder=True)  # as the requeued job
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS, snapshot="checkpoint"),
                                         ModelIterationCheckpoint(1, keep_last=keep_last)])
    assert [(record["epoch"], record["iteration"]) for record in resumed.rollbacks] == [(1, 5)]
    torch.manual_seed(0)
    reference_model, _ = model_pair(MLP)
    reference = train(make_loop(reference_model, reference_loader(Poisoned(), {1: {5}})))
    assert_params_equal(resumed.model, reference.model)
    assert not os.path.exists(os.path.join(run_folder, "checkpoint_model", "spike_rollback"))  # gone at the end


# --- the start of a fit is a clean point where nothing is pending (review 47r D4) ---------------------------------
def rollback_records(tl):
    return [(record["epoch"], record["iteration"], record["restored"]) for record in tl.rollbacks]


def test_a_job_killed_right_after_a_check_resumes_at_its_pinned_point_and_rolls_back_a_spike_at_its_first_step(
        tmp_path, monkeypatch):
    """snapshot='checkpoint': the check of batch 14 keeps (and pins) its point; the job dies at the start of batch 15,
    the spike. The newest checkpoint is the point's, with nothing left to judge: the resumed run adopts the pin at its
    position (it dropped it before, and stopped with "before SpikeRollback kept any clean point") and rolls back as
    the run that never stopped."""
    from aitoolbox.experiment.local_save.checkpoints import find_checkpoint
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    monkeypatch.chdir(tmp_path)
    poison = poisoned_at(1, 3)  # batch 15
    model, twin = model_pair(MLP)
    tl = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(RuntimeError, match="killed"):
        train(tl, callbacks=[ModelIterationCheckpoint(1), SpikeRollback(**SETTINGS, snapshot="checkpoint"),
                             KilledAt(16)])
    newest = find_checkpoint(tl.run_folder.path)
    assert newest.endswith("_E1_ITER14.pth")
    resumed = make_loop(twin, loader(Poisoned(poison)))
    resumed.load_checkpoint(newest, continue_run_folder=True)
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS, snapshot="checkpoint"),
                                         ModelIterationCheckpoint(1)])
    assert rollback_records(resumed) == [(1, 3, {"epoch": 1, "iteration": 2})]
    torch.manual_seed(0)
    reference_model, _ = model_pair(MLP)
    reference = train(make_loop(reference_model, reference_loader(Poisoned(), {1: {3}})))
    assert_params_equal(resumed.model, reference.model)


@pytest.mark.parametrize("snapshot_every, poison_at, at_epoch_end", [(5, (1, 3), False), (4, (1, 0), True)],
                         ids=["mid-epoch", "epoch-end"])
def test_a_run_resumed_where_nothing_is_pending_keeps_its_start_and_ends_as_the_straight_run(
        snapshot_every, poison_at, at_epoch_end):
    """snapshot='memory': a checkpoint taken where the last check left nothing to judge (after a fit stopped right
    after the check of batch 14; after an epoch whose last step was checked), resumed in a new loop whose first step
    spikes. The start of the resumed fit is the clean point (the straight run's last one): the rollback, its record
    and the whole run are the straight run's, bitwise."""
    settings = dict(SETTINGS, snapshot_every=snapshot_every)
    poison = poisoned_at(*poison_at)
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison))), callbacks=[SpikeRollback(**settings)])
    tl = make_loop(model, loader(Poisoned(poison)))
    if at_epoch_end:
        train(tl, num_epochs=1, callbacks=[SpikeRollback(**settings)])
    else:
        with pytest.raises(RuntimeError, match="killed"):
            train(tl, callbacks=[SpikeRollback(**settings), KilledAt(16)])
    checkpoint = tl.checkpoint_state()
    torch.manual_seed(0)
    resumed = make_loop(model_pair(MLP)[0], loader(Poisoned(poison)))
    resumed.load_checkpoint(checkpoint)
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**settings)])
    assert rollback_records(resumed) == rollback_records(straight) and len(straight.rollbacks) == 1
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history


def test_a_nan_at_the_first_batch_of_a_fresh_run_returns_to_the_fit_s_start():
    """The docs' "a spike in the very first interval has nothing to return to" is gone: the fit's start is kept."""
    poison = poisoned_at(0, 0)
    model, twin = model_pair(MLP)
    tl = train(make_loop(model, loader(Poisoned(poison, scale=float("nan")))), num_epochs=2,
               callbacks=[SpikeRollback(**SETTINGS)])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {0: {0}})), num_epochs=2)
    assert rollback_records(tl) == [(0, 0, {"epoch": 0, "iteration": -1})]
    assert_params_equal(tl.model, reference.model)


def test_a_fit_after_one_whose_last_step_was_checked_keeps_its_start():
    """Review 48m M4: fit(1) then fit(2) with a NaN at the first batch of epoch 2 stopped with SpikeRollbackError
    (the last step's check of fit(1) judged its losses but left them pending, and a fit starting with losses pending
    kept no start point), where one fit(2) rolls back. Losses judged clean in this process do not stand in the way:
    the weights equal the one fit's."""
    poison = poisoned_at(1, 0)
    model, twin = model_pair(MLP)
    two_fits = make_loop(model, loader(Poisoned(poison, scale=float("nan"))))
    torch.manual_seed(TRAIN_SEED)
    two_fits.fit(num_epochs=1, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS)])
    two_fits.fit(num_epochs=2)
    one_fit = train(make_loop(twin, loader(Poisoned(poison, scale=float("nan")))), num_epochs=2,
                    callbacks=[SpikeRollback(**SETTINGS)])
    assert len(two_fits.rollbacks) == len(one_fit.rollbacks) == 1
    assert_params_equal(two_fits.model, one_fit.model)


class DrawsAtEpochBegin(AbstractCallback):
    """Draws from torch's generator in every ``on_epoch_begin`` (picks an augmentation for the epoch)."""

    def __init__(self, execution_order):
        super().__init__("draws at the epoch's begin", execution_order=execution_order)
        self.draws = []

    def on_epoch_begin(self):
        self.draws.append(torch.rand(1).item())


def test_no_fit_start_point_where_a_callback_ordered_before_has_an_epoch_begin():
    """Review 48s F5: the fit's start is kept in SpikeRollback's on_epoch_begin, after the earlier callbacks' ones;
    a rollback there replays on_epoch_begin, and a callback ordered before SpikeRollback drew its random numbers
    twice (silently another run). Such a run keeps no start point (the first step's check keeps it, as before);
    a callback ordered after SpikeRollback does not stand in the way."""
    poison = poisoned_at(0, 0)
    model, twin = model_pair(MLP)
    before = make_loop(model, loader(Poisoned(poison, scale=float("nan"))))
    with pytest.raises(SpikeRollbackError, match="before SpikeRollback kept any clean point.*DrawsAtEpochBegin "
                                                 r"\(ordered before SpikeRollback\) has an on_epoch_begin"):
        before.fit(num_epochs=2, callbacks=[SpikeRollback(**SETTINGS), DrawsAtEpochBegin(-100)])
    after_callback, reference_callback = DrawsAtEpochBegin(100), DrawsAtEpochBegin(100)
    model, twin = model_pair(MLP)
    after = train(make_loop(model, loader(Poisoned(poison, scale=float("nan")))), num_epochs=2,
                  callbacks=[SpikeRollback(**SETTINGS), after_callback])
    reference = train(make_loop(twin, reference_loader(Poisoned(), {0: {0}})), num_epochs=2,
                      callbacks=[reference_callback])
    assert_params_equal(after.model, reference.model)
    assert after_callback.draws[-2:] == reference_callback.draws


# --- the epoch's end is judged before every callback's on_epoch_train_end (review 47r D3) -------------------------
class SeesEpochTrainEnd(AbstractCallback):
    """Records, at the first ``on_epoch_train_end`` of ``epoch`` it sees, the rollbacks done by then and the weights;
    ordered before SpikeRollback."""

    def __init__(self, epoch):
        super().__init__("sees the epoch's train end", execution_order=-100)
        self.epoch, self.seen = epoch, None

    def on_epoch_train_end(self):
        tl = self.train_loop_obj
        if tl.epoch == self.epoch and self.seen is None:
            self.seen = (len(tl.rollbacks), [param.detach().clone() for param in tl.model.parameters()])


def test_a_callback_ordered_before_spike_rollback_sees_the_epochs_end_judged():
    """The spike (epoch 1, batch 10) lies after the epoch's last check (batch 7): the losses of batches 8-11 are
    judged at the epoch's end. A callback ordered before SpikeRollback saw them unjudged in its on_epoch_train_end
    (a checkpoint it took there held the spike, and the run resumed from it stopped with SpikeRollbackError; such a
    checkpoint is now refused, see test_checkpoint_position.py). They are judged at the epoch's last step: the
    callback's first on_epoch_train_end of the epoch comes after the rollback, with the replayed epoch's weights."""
    poison = poisoned_at(1, 10)
    model, twin = model_pair(MLP)
    seer = SeesEpochTrainEnd(1)
    tl = train(make_loop(model, loader(Poisoned(poison))), num_epochs=2, callbacks=[SpikeRollback(**SETTINGS), seer])
    assert rollback_records(tl) == [(1, 10, {"epoch": 1, "iteration": 7})]
    reference = train(make_loop(twin, reference_loader(Poisoned(), {1: {10}})), num_epochs=2)
    rollbacks_seen, weights_seen = seer.seen
    assert rollbacks_seen == 1
    for seen, param in zip(weights_seen, reference.model.parameters()):
        assert torch.equal(seen, param)


# --- a stop signal between a spike and its check (review 47r D2) ---------------------------------------------------
class SigtermAt(AbstractCallback):
    """Sends SIGTERM to this process at the start of batch ``step`` (a total iteration index): the loop's own handler
    stops training at that batch's optimizer step, after saving a resumable checkpoint."""

    def __init__(self, step):
        super().__init__("SIGTERM at a step")
        self.step = step

    def on_batch_begin(self):
        if self.train_loop_obj.total_iteration_idx == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def stopped_by_sigterm(tmp_path, model, dataset, step, callbacks=()):
    """The checkpoint a SIGTERM at batch ``step`` leaves (snapshot='memory'), and the loop."""
    import glob

    from aitoolbox.torchtrain.distributed.signals import SignalStop
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # else the loop leaves the signal alone
    tl = make_loop(model, loader(dataset))
    with pytest.raises(SignalStop):
        train(tl, callbacks=[ModelCheckpoint("proj", "exp", str(tmp_path)), SpikeRollback(**SETTINGS),
                             SigtermAt(step), *callbacks])
    (saved,) = glob.glob(str(tmp_path / "proj" / "exp_*" / "checkpoint_model" / "*ITER*.pth"))
    return tl, saved


@pytest.mark.parametrize("scale", [1e4, float("nan")], ids=["spike", "nan"])
def test_a_sigterm_between_a_spike_and_its_check_rolls_back_before_the_checkpoint(tmp_path, scale):
    """The spike is batch 15 (its check due at batch 19), SIGTERM at batch 16. The checkpoint held the spike among the
    losses not yet judged, and the point kept at batch 14 was in the stopped process's memory: the resumed run
    stopped with SpikeRollbackError. The losses are judged before the stop's checkpoint now (a loss flag: the same
    batch the check leaves out, whenever it runs); the run rolls back and stops at the point it returned to (batch
    14: the checkpoint holds nothing pending; it stopped at the replay's first step, which left the resumed run no
    point before a bad batch there, review 48s F2), and the resumed run ends as the one that never stopped, records
    included."""
    poison = poisoned_at(1, 3)
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison, scale=scale))), callbacks=[SpikeRollback(**SETTINGS)])
    stopped, saved = stopped_by_sigterm(tmp_path, model, Poisoned(poison, scale=scale), 16)
    assert saved.endswith("_E1_ITER14.pth") and len(stopped.rollbacks) == 1  # the point
    torch.manual_seed(0)
    resumed = make_loop(model_pair(MLP)[0], loader(Poisoned(poison, scale=scale)))
    resumed.load_checkpoint(saved)
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS)])
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(resumed.model, straight.model)


def test_a_sigterm_after_nan_gradients_with_finite_losses_stops_at_the_kept_point_and_resumes_as_the_straight_run(
        tmp_path):
    """Batch 15's loss is finite, its gradients NaN: at the SIGTERM of that batch the weights are NaN with every
    pending loss finite, which the check blames on a window that depends on the losses still to come. The checkpoint
    was saved with NaN weights and the run resumed from it stopped with an error naming a checkpoint an iteration
    checkpoint callback may have pruned (review 48s F11). The run returns to the point kept at batch 14 without
    leaving anything out and stops there: the newest checkpoint is finite, and the resumed run replays the batches and
    blames them as the run that never stopped, records included."""
    torch.manual_seed(0)
    model = NanGradientMLP()
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    model.bad = twin.bad = third.bad = {1: torch.stack([Poisoned().base[index][0] for index in batch_order(4)[1][3]])}
    straight = train(make_loop(third, loader(Poisoned())), callbacks=[SpikeRollback(**SETTINGS), TellModelEpochAfter()])
    stopped, saved = stopped_by_sigterm(tmp_path, model, Poisoned(), 15, callbacks=[TellModelEpochAfter()])
    assert saved.endswith("_E1_ITER14.pth") and stopped.rollbacks == []
    assert all(torch.isfinite(value).all() for value in torch.load(saved, weights_only=True)["model_state_dict"].values())
    resumed = resumed_from(saved, Poisoned(), callbacks=[TellModelEpochAfter()], model=twin)
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 2  # batch 16, then 15
    assert_params_equal(resumed.model, straight.model)


# --- the counters in the replayed on_epoch_begin (review 47r D5) ---------------------------------------------------
class CountersAtReplay(AbstractCallback):
    """``(epoch, iteration, batches done, total iteration)`` in each on_epoch_begin after a rollback."""

    def __init__(self):
        super().__init__("counters at the replay", execution_order=50)
        self.seen = []

    def on_epoch_begin(self):
        tl = self.train_loop_obj
        if tl.rollbacks:
            self.seen.append((tl.epoch, tl.iteration, tl.run_state.batches_done, tl.total_iteration_idx))


@pytest.mark.parametrize("snapshot", ["memory", "checkpoint"])
def test_the_replayed_on_epoch_begin_sees_the_kept_point_s_counters(tmp_path, snapshot):
    """The point kept at batch 14 (epoch 1, iteration 2, 3 batches done); the spike at batch 17. The replayed
    on_epoch_begin saw the abandoned run's iteration (checkpoint: 7) and batch count (both: 8)."""
    watcher = CountersAtReplay()
    model, _ = model_pair(MLP)
    saver = [iteration_saver(tmp_path, "counters")] if snapshot == "checkpoint" else []
    train(make_loop(model, loader(Poisoned(poisoned_at(1, 5)))), num_epochs=2,
          callbacks=saver + [SpikeRollback(**SETTINGS, snapshot=snapshot), watcher])
    assert watcher.seen[0] == (1, 2, 3, 14)


# --- what the callback decided is part of its state (review 48s F1, F3, F4) ---------------------------------------
def resumed_from(saved, dataset, settings=SETTINGS, callbacks=(), model=None):
    torch.manual_seed(0)  # the checkpoint's RNG state decides, not the process's
    resumed = make_loop(model if model is not None else model_pair(MLP)[0], loader(dataset))
    resumed.load_checkpoint(saved)
    resumed.fit(num_epochs=4, callbacks=[TellEpoch(), *callbacks, SpikeRollback(**settings)])
    return resumed


@pytest.mark.parametrize("scale", [1e4, float("nan")], ids=["spike", "nan"])
def test_a_sigterm_one_step_before_a_spike_resumes_as_the_straight_run(tmp_path, scale):
    """Review 48s F1: SIGTERM at batch 15 (no check due), the spike at batch 16. The stop judged batch 15's loss clean
    but the checkpoint held it as not judged: the resumed run kept no start and stopped with SpikeRollbackError at
    its first step. The judgement is saved: the resumed run returns to its start, as the straight run to batch 14's
    point, records included."""
    poison = poisoned_at(1, 4)
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison, scale=scale))), callbacks=[SpikeRollback(**SETTINGS)])
    stopped, saved = stopped_by_sigterm(tmp_path, model, Poisoned(poison, scale=scale), 15)
    assert saved.endswith("_E1_ITER15.pth") and stopped.rollbacks == []
    resumed = resumed_from(saved, Poisoned(poison, scale=scale))
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history


def test_a_resumed_start_after_judged_losses_never_leaves_out_other_batches_than_the_straight_run(tmp_path):
    """skip_batches=2: the straight run leaves out batches 15 and 16 (back to batch 14's point); the run resumed at
    batch 16 has trained batch 15 already and cannot: it stops with an error saying so (never another run)."""
    settings = dict(SETTINGS, skip_batches=2)
    poison = poisoned_at(1, 4)
    model, _ = model_pair(MLP)
    import glob

    from aitoolbox.torchtrain.distributed.signals import SignalStop
    stopped = make_loop(model, loader(Poisoned(poison)))
    with pytest.raises(SignalStop):
        train(stopped, callbacks=[ModelCheckpoint("proj", "exp", str(tmp_path)), SpikeRollback(**settings),
                                  SigtermAt(15)])
    (saved,) = glob.glob(str(tmp_path / "proj" / "exp_*" / "checkpoint_model" / "*ITER*.pth"))
    with pytest.raises(SpikeRollbackError, match=r"skip_batches=2 reaches before the start of this fit"):
        resumed_from(saved, Poisoned(poison), settings)


class SaveAtEpochEnd(AbstractCallback):
    """Keeps ``checkpoint_state()`` (bytes) at the end of epoch ``epoch``, as ModelCheckpoint saves it."""

    def __init__(self, epoch):
        super().__init__("checkpoint at an epoch's end", execution_order=100)
        self.epoch, self.saved = epoch, None

    def on_epoch_end(self):
        if self.train_loop_obj.epoch == self.epoch and self.saved is None:
            buffer = io.BytesIO()
            torch.save(self.train_loop_obj.checkpoint_state(), buffer)
            self.saved = buffer.getvalue()


def test_a_run_resumed_from_an_epoch_end_checkpoint_with_judged_losses_rolls_back_a_spike_at_its_first_step():
    """Review 48s F4: snapshot_every=5, 12 steps an epoch: the epoch's end judges batches 10 and 11 clean and the
    epoch-end checkpoint held them as not judged; the run resumed from it stopped with SpikeRollbackError at a spike in
    the next epoch's first batch. It rolls back as the straight run, records included."""
    poison = poisoned_at(1, 0)
    model, twin = model_pair(MLP)
    saver = SaveAtEpochEnd(0)
    straight = train(make_loop(twin, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS), saver])
    checkpoint = torch.load(io.BytesIO(saver.saved), weights_only=True)
    resumed = resumed_from(checkpoint, Poisoned(poison))
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history


def test_a_checkpoint_between_the_two_rollbacks_of_a_nan_gradient_blame_resumes_as_the_straight_run():
    """Review 48s F3: batch 16's gradients are NaN, batch 17's loss NaN: the straight run leaves out 17 first, then,
    the replay ruining the weights right before it, 16. A checkpoint taken in the replayed on_epoch_begin (between
    the two) forgot that 17 was left out for a non-finite state: the resumed run blamed each next batch in turn."""
    torch.manual_seed(0)
    model = NanGradientMLP()
    twin, third = copy.deepcopy(model), copy.deepcopy(model)
    bad = {1: torch.stack([Poisoned().base[index][0] for index in batch_order(4)[1][4]])}
    model.bad = twin.bad = third.bad = bad
    taker = CheckpointAround("on_epoch_begin", mid_epoch=True)
    settings = dict(SETTINGS, max_rollbacks=8)
    straight = train(make_loop(model, loader(Poisoned())),
                     callbacks=[SpikeRollback(**settings), TellModelEpochAfter(), taker])
    assert [record["iteration"] for record in straight.rollbacks] == [5, 4]
    checkpoint = torch.load(io.BytesIO(taker.saved), weights_only=True)
    assert len(checkpoint["rollbacks"]["records"]) == 1
    resumed = resumed_from(checkpoint, Poisoned(), settings, callbacks=[TellModelEpochAfter()], model=twin)
    assert str(resumed.rollbacks) == str(straight.rollbacks)
    assert_params_equal(resumed.model, straight.model)


@pytest.mark.parametrize("fail, nan", [((0, 1), (0, 2)), ((0, 11), (1, 0)), ((1, 3), (1, 5))],
                         ids=["before-the-first-check", "at-an-epoch-end", "between-checks"])
def test_a_fit_stopped_by_an_exception_keeps_its_point_for_the_fit_that_continues_it(fail, nan):
    """Review 48s F10: an exception in a hook, then fit() again in the same process (which continues the run
    bitwise). The point kept in memory was dropped with the exception: a NaN before the continued fit's first check
    had nothing to return to (SpikeRollbackError), or the point kept at its first step named another point in the
    record. The point is kept through the exception: the run, its records included, is the straight one."""
    model, twin = model_pair(MLP)
    data = lambda: loader(Poisoned(poisoned_at(*nan), scale=float("nan")))  # noqa: E731
    straight = train(make_loop(twin, data()), callbacks=[SpikeRollback(**SETTINGS)])
    tl = make_loop(model, data())
    with pytest.raises(RuntimeError, match="stopped half way"):
        train(tl, callbacks=[SpikeRollback(**SETTINGS), FailOnce(*fail)])
    tl.fit(num_epochs=4)
    assert str(tl.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(tl.model, straight.model)


class SeenAtEpochBegin(AbstractCallback):
    def __init__(self):
        super().__init__("counters at each epoch begin", execution_order=50)
        self.seen = []

    def on_epoch_begin(self):
        tl = self.train_loop_obj
        self.seen.append((len(tl.rollbacks), tl.epoch, tl.iteration, tl.run_state.batches_done, tl.total_iteration_idx))


def test_the_replayed_on_epoch_begin_at_the_fit_s_start_sees_the_start_s_counters():
    """Review 48s F8 (D5 at a fit-start point): a NaN at batch 2 of a fresh run rolls back to the fit's start; the
    replayed on_epoch_begin saw tl.iteration of the abandoned run (4)."""
    seen = SeenAtEpochBegin()
    model, _ = model_pair(MLP)
    train(make_loop(model, loader(Poisoned(poisoned_at(0, 2), scale=float("nan")))), num_epochs=1,
          callbacks=[SpikeRollback(**SETTINGS), seen])
    assert seen.seen == [(0, 0, 0, 0, -1), (1, 0, 0, 0, -1)]


# --- review 49s: the stop signal's checkpoint, the judgement through restores and exceptions -----------------------
def test_a_stop_checkpoint_at_a_fresh_run_s_start_sorts_before_every_later_checkpoint(tmp_path):
    """Review 49s R3: a NaN at batch 1 of a fresh run, SIGTERM there: the run returns to its start (nothing trained)
    and saves the stop checkpoint ``..._E0_ITER-1.pth``, which checkpoint_position read as a final model (after every
    checkpoint): find_checkpoint, load_checkpoint(<folder>) and auto_resume took it as the newest forever, even after
    the resumed run wrote later checkpoints into the same folder. It is the position before the first batch."""
    import shutil

    from aitoolbox.experiment.local_save.checkpoints import checkpoint_position, find_checkpoint
    poison = poisoned_at(0, 1)
    model, twin = model_pair(MLP)
    straight = train(make_loop(twin, loader(Poisoned(poison, scale=float("nan")))),
                     callbacks=[SpikeRollback(**SETTINGS)])
    stopped, saved = stopped_by_sigterm(tmp_path, model, Poisoned(poison, scale=float("nan")), 1)
    assert saved.endswith("_E0_ITER-1.pth") and len(stopped.rollbacks) == 1
    assert checkpoint_position(os.path.basename(saved)) == (0, 0, -1)
    assert checkpoint_position("model_exp_ts_E0_ITER-1.pth") < checkpoint_position("model_exp_ts_E0_ITER0.pth")
    # The resumed run's first epoch checkpoint, in the same folder: the newest.
    later = saved.replace("_E0_ITER-1.pth", "_E0.pth")
    shutil.copy(saved, later)
    assert find_checkpoint(os.path.dirname(saved)) == later
    resumed = resumed_from(saved, Poisoned(poison, scale=float("nan")))
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(resumed.model, straight.model)


def test_a_second_sigterm_rolling_back_to_a_resumed_start_saves_its_judgement_and_resumes_as_the_straight_run(
        tmp_path):
    """Review 49s R1: batches 16 and 17 spike. SIGTERM at batch 15 (judged clean, saved as judged); the run resumed
    from it keeps its start (standing for batch 14's point) and gets SIGTERM at batch 16: it rolls back to that start
    and saves the stop checkpoint there. _restore forgot the judgement the start's state held (judged_up_to None): the
    run resumed from that checkpoint kept no start and stopped with SpikeRollbackError at batch 17's spike. It rolls
    back as the straight run, records included."""
    import glob

    from aitoolbox.torchtrain.distributed.signals import SignalStop
    order = batch_order(4)
    poison = {1: order[1][4] + order[1][5]}
    model, twin = model_pair(MLP)
    third = copy.deepcopy(model)
    straight = train(make_loop(twin, loader(Poisoned(poison))), callbacks=[SpikeRollback(**SETTINGS)])
    _, first = stopped_by_sigterm(tmp_path / "first", model, Poisoned(poison), 15)
    assert first.endswith("_E1_ITER15.pth")
    second = make_loop(copy.deepcopy(third), loader(Poisoned(poison)))
    second.load_checkpoint(first)
    with pytest.raises(SignalStop):
        second.fit(num_epochs=4, callbacks=[TellEpoch(), SpikeRollback(**SETTINGS), SigtermAt(16),
                                            ModelCheckpoint("proj", "exp", str(tmp_path / "second"))])
    (saved,) = glob.glob(str(tmp_path / "second" / "proj" / "exp_*" / "checkpoint_model" / "*ITER*.pth"))
    assert saved.endswith("_E1_ITER15.pth") and len(second.rollbacks) == 1
    resumed = resumed_from(saved, Poisoned(poison), model=third)
    assert str(resumed.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 2
    assert_params_equal(resumed.model, straight.model)
    assert resumed.train_history == straight.train_history


class FailBeginOnce(AbstractCallback):
    """Raises once in on_train_begin, ordered before SpikeRollback (a logger whose service is down): that fit stops
    before SpikeRollback's on_train_begin runs."""

    def __init__(self):
        super().__init__("fail at the train's begin once", execution_order=-100)
        self.armed = self.failed = False

    def on_train_begin(self):
        if self.armed and not self.failed:
            self.failed = True
            raise RuntimeError("on_train_begin failed")


def test_a_second_exception_before_spike_rollback_s_train_begin_keeps_the_carried_point():
    """Review 49s R2: an exception at batch 1 (the point kept at the fit's start is carried), then a fit stopped in the
    on_train_begin of a callback ordered before SpikeRollback: on_exception replaced the carried point with None (no
    point kept in that fit), and the third fit stopped with SpikeRollbackError at the NaN of batch 2. It ends as the
    straight run, records included."""
    model, twin = model_pair(MLP)
    data = lambda: loader(Poisoned(poisoned_at(0, 2), scale=float("nan")))  # noqa: E731
    straight = train(make_loop(twin, data()), callbacks=[SpikeRollback(**SETTINGS)])
    tl = make_loop(model, data())
    failing = FailBeginOnce()
    with pytest.raises(RuntimeError, match="stopped half way"):
        train(tl, callbacks=[SpikeRollback(**SETTINGS), FailOnce(0, 1), failing])
    failing.armed = True
    with pytest.raises(RuntimeError, match="on_train_begin failed"):
        tl.fit(num_epochs=4)
    tl.fit(num_epochs=4)
    assert str(tl.rollbacks) == str(straight.rollbacks) and len(straight.rollbacks) == 1
    assert_params_equal(tl.model, straight.model)


class SaveAtEpochBegin(AbstractCallback):
    """Keeps ``checkpoint_state()`` (bytes) at the first begin of epoch ``epoch``."""

    def __init__(self, epoch):
        super().__init__("checkpoint at an epoch's begin", execution_order=100)
        self.epoch, self.saved = epoch, None

    def on_epoch_begin(self):
        if self.train_loop_obj.epoch == self.epoch and self.saved is None:
            buffer = io.BytesIO()
            torch.save(self.train_loop_obj.checkpoint_state(), buffer)
            self.saved = buffer.getvalue()


def test_a_checkpoint_loaded_into_a_loop_that_blamed_a_non_finite_state_resumes_as_in_a_new_loop():
    """Review 49s R4: NaN gradients at batch 16 (the next loss NaN): the run leaves out 17, then 16, and holds 17 as a
    state suspect. Loaded into the same loop, a checkpoint from epoch 1's begin (no suspects) kept that suspect
    (load_state_dict added the loaded suspects to those held), and the refit left out other batches than the same
    checkpoint resumed in a new loop. Loading replaces them; only a rollback's restore keeps those found since."""
    torch.manual_seed(0)
    model = NanGradientMLP()
    twin = copy.deepcopy(model)
    model.bad = twin.bad = {1: torch.stack([Poisoned().base[index][0] for index in batch_order(4)[1][4]])}
    saver = SaveAtEpochBegin(1)
    tl = train(make_loop(model, loader(Poisoned())),
               callbacks=[SpikeRollback(**SETTINGS), TellModelEpochAfter(), saver])
    assert [record["iteration"] for record in tl.rollbacks] == [5, 4]
    checkpoint = lambda: torch.load(io.BytesIO(saver.saved), weights_only=True)  # noqa: E731
    fresh = resumed_from(checkpoint(), Poisoned(), callbacks=[TellModelEpochAfter()], model=twin)
    tl.load_checkpoint(checkpoint())
    torch.manual_seed(0)
    tl.fit(num_epochs=4)
    assert str(tl.rollbacks) == str(fresh.rollbacks)
    assert_params_equal(tl.model, fresh.model)
