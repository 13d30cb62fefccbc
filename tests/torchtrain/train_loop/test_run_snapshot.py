"""RunSnapshot: the whole run kept in host memory and put back, as a checkpoint file would be, in one process."""
import copy

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot, host_copy
from tests.helpers import MLP, assert_params_equal, classification_data, model_pair, seeded_loader

AMP_MODES = [False, {"opt_level": "O1", "dtype": torch.bfloat16}, {"opt_level": "O2", "dtype": torch.bfloat16}]


def make_loop(model, use_amp=False):
    loader = seeded_loader(classification_data(40), batch_size=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), use_amp=use_amp)


class SnapshotAt(AbstractCallback):
    """Takes a snapshot right after the optimizer step of batch ``at_batch`` (0-based, over the run) and keeps a
    checkpoint captured at the same moment, to compare what a restore puts back."""

    def __init__(self, at_batch: int):
        super().__init__("snapshot at a batch")
        self.at_batch = at_batch
        self.snapshot = None
        self.checkpoint = None

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        if tl.total_iteration_idx == self.at_batch:
            self.snapshot = RunSnapshot.take(tl, mid_epoch=True)
            self.checkpoint = host_copy(tl.checkpoint_state(mid_epoch=True))


@pytest.mark.parametrize("use_amp", AMP_MODES, ids=["fp32", "O1", "O2"])
def test_restore_before_fit_makes_the_next_fit_bitwise_equal_to_fit_alone(use_amp):
    model, twin = model_pair(MLP)
    straight = make_loop(twin, use_amp)
    torch.manual_seed(0)  # dropout draws from the global generator
    straight.fit(num_epochs=2, callbacks=[StepLRScheduler(step_size=1, gamma=0.5)])

    tl = make_loop(model, use_amp)
    scheduler = StepLRScheduler(step_size=1, gamma=0.5)
    tl.callbacks_handler.register_callbacks([scheduler])
    torch.manual_seed(0)
    snapshot = RunSnapshot.take(tl, mid_epoch=False)
    tl.fit(num_epochs=1)  # training the snapshot must undo: weights, optimizer, scheduler, RNG, history, counters
    assert tl.epochs_completed == 1
    assert snapshot.restore(tl) is None
    assert tl.epochs_completed == 0 and tl.total_iteration_idx == -1
    assert all(len(values) == 0 for values in tl.train_history.values())
    tl.fit(num_epochs=2)

    assert_params_equal(tl.model, straight.model)
    assert tl.train_history["loss"] == straight.train_history["loss"]
    assert tl.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


def test_restore_inside_an_epoch_puts_back_the_state_at_that_step_and_can_be_repeated():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    recorder = SnapshotAt(at_batch=3)
    tl.fit(num_epochs=2, callbacks=[recorder])
    saved = recorder.checkpoint

    for _ in range(2):  # the second restore sees the snapshot unchanged by what the first one loaded
        resume = recorder.snapshot.restore(tl)
        assert resume.batches_done == 4 and tl.epoch == 0 and tl.total_iteration_idx == 3
        for name, value in tl.model.state_dict().items():
            assert torch.equal(value, saved["model_state_dict"][name]), name
        live = tl.optimizer.state_dict()["state"]
        for index, state in saved["optimizer_state_dict"]["state"].items():
            for key, value in state.items():
                assert torch.equal(live[index][key], value), (index, key)
        # The loop draws the epoch's data order from its starting state, then continues with the step's state.
        assert torch.equal(resume.rng["torch"], saved["rng"][0]["torch"])
        assert torch.equal(resume.epoch_start_rng["torch"], saved["epoch_start_rng"][0]["torch"])
        with torch.no_grad():  # training on in place would also change a snapshot that shared memory with it
            for parameter in tl.model.parameters():
                parameter.add_(1.0)
            for state in tl.optimizer.state.values():
                state["exp_avg"].add_(1.0)


def test_a_snapshot_shares_no_memory_with_the_run():
    model, _ = model_pair(MLP)
    tl = make_loop(model)
    tl.fit(num_epochs=1)
    snapshot = RunSnapshot.take(tl, mid_epoch=False)
    kept = copy.deepcopy(snapshot._checkpoint["model_state_dict"])
    with torch.no_grad():
        for parameter in tl.model.parameters():
            parameter.mul_(2.0)
    for name, value in snapshot._checkpoint["model_state_dict"].items():
        assert torch.equal(value, kept[name]), name


def test_restore_keeps_a_loaded_checkpoint_waiting_for_fit():
    model, twin = model_pair(MLP)
    source = make_loop(twin)
    source.fit(num_epochs=1)
    checkpoint = source.checkpoint_state()

    tl = make_loop(model)
    tl.load_checkpoint(checkpoint)
    pending = tl.pending_restore
    snapshot = RunSnapshot.take(tl, mid_epoch=False)
    snapshot.restore(tl)
    assert tl.pending_restore is pending
