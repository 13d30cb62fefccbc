"""Gradient accumulation under DDP all-reduces once per optimizer step, not once per micro-batch."""
import copy
import os

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, IterableDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from tests.torchtrain.distributed.support import (
    assert_state_dicts_close, assert_state_dicts_equal, make_model, make_train_loop, regression_data)

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available", "ignore:an IterableDataset cannot be split")

BATCH = 4  # per process


class CountAllReduces(AbstractCallback):
    """Registers a DDP communication hook that records the batch (``total_iteration_idx``) of every bucket it
    all-reduces, and saves the record of each rank at the end of training."""

    def __init__(self, folder):
        super().__init__("count all-reduces")
        self.folder = str(folder)
        self.reduced_at = []

    def on_train_begin(self):
        tl = self.train_loop_obj

        def counting_allreduce(state, bucket):
            self.reduced_at.append(tl.total_iteration_idx)
            return default_hooks.allreduce_hook(None, bucket)  # the all-reduce DDP would do, on the default group

        tl.model_runner.wrapper.register_comm_hook(None, counting_allreduce)

    def on_train_end(self):
        tl = self.train_loop_obj
        torch.save({"reduced_at": self.reduced_at,
                    "state_dict": {k: v.detach().clone() for k, v in tl.model.state_dict().items()}},
                   os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


def rank_records(folder):
    return [torch.load(os.path.join(str(folder), f"rank{rank}.pt"), weights_only=True) for rank in (0, 1)]


def test_accumulation_windows_all_reduce_once_per_optimizer_step(tmp_path):
    """80 samples, 2 ranks x batches of 4: 10 batches per rank and epoch; with grad_accumulation=4 the optimizer
    steps after batches 3, 7 and 9 (the epoch's last), and only those batches all-reduce (one bucket: the model
    is small)."""
    initial = make_model()
    tl = make_train_loop(copy.deepcopy(initial), batch_size=BATCH, train_samples=80)
    tl.fit_distributed(num_epochs=2, grad_accumulation=4, callbacks=[CountAllReduces(tmp_path)],
                       train_data_shuffle=False, num_gpus=2, start_method="fork")
    rank0, rank1 = rank_records(tmp_path)
    assert rank0["reduced_at"] == rank1["reduced_at"] == [3, 7, 9, 13, 17, 19]

    # The same arithmetic as one process on the global batch (rank r holds samples r, r+2, ...), up to the
    # order in which the all-reduce sums: parameters agree to float32 rounding.
    reference = make_train_loop(copy.deepcopy(initial), batch_size=2 * BATCH, train_samples=80)
    reference.fit(num_epochs=2, grad_accumulation=4)
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    assert_state_dicts_close(rank0["state_dict"], reference.model.state_dict(), 1e-6)


class RegressionStream(IterableDataset):
    """The regression samples as a stream without a length."""

    def __init__(self, num_samples: int):
        self.data = regression_data(num_samples)

    def __iter__(self):
        return iter(self.data)


def test_an_unsized_epoch_ending_inside_a_window_reduces_the_skipped_gradients(tmp_path):
    """A loader without len: the epoch's end is known only after its last batch, which was trained under no_sync;
    the loop then all-reduces the window's gradients itself before stepping. Both ranks read the same stream, so
    the averaged gradient is each rank's own and the result equals one process's bitwise."""
    initial = make_model()
    tl = make_train_loop(copy.deepcopy(initial))
    tl.train_loader = DataLoader(RegressionStream(40), batch_size=BATCH)  # 10 batches: the last window holds 2
    tl.fit_distributed(num_epochs=2, grad_accumulation=4, callbacks=[CountAllReduces(tmp_path)], num_gpus=2,
                       start_method="fork")
    rank0, rank1 = rank_records(tmp_path)
    assert rank0["reduced_at"] == [3, 7, 13, 17]  # the ends of the epochs' last windows are reduced by the loop

    reference = make_train_loop(copy.deepcopy(initial))
    reference.train_loader = DataLoader(RegressionStream(40), batch_size=BATCH)
    reference.fit(num_epochs=2, grad_accumulation=4)
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    assert_state_dicts_equal(rank0["state_dict"], reference.model.state_dict())
