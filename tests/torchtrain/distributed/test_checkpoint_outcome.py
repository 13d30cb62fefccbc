"""fit_distributed with checkpoint callbacks: what fails on rank 0 alone (creating the run folder, pruning an older
checkpoint, a sharded background save's completion) stops every rank with the same error, and none hangs.

Real faults, on rank 0 only (only rank 0 writes these): a results folder under a regular file (which stops root
too), and a checkpoint file made immutable (``chattr +i``: not even root may delete it) that pruning must delete.
Each rank records the exception that stopped its ``fit``."""
import glob
import os
import shutil
import subprocess

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from tests.torchtrain.distributed.test_fsdp import UNITS, Tower, make_loop

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")


class RecordOutcome(AbstractCallback):
    """Writes ``outcome_rank<r>.txt``: 'finished', or the type and message of the exception that stopped fit."""

    def __init__(self, folder: str):
        super().__init__("record the outcome")
        self.folder = folder

    def _write(self, text: str) -> None:
        with open(os.path.join(self.folder, f"outcome_rank{self.train_loop_obj.strategy.rank}.txt"), "w") as handle:
            handle.write(text)

    def on_train_end(self):
        self._write("finished")

    def on_exception(self, exception):
        self._write(f"{type(exception).__name__}: {exception}")


def outcomes(folder) -> list:
    found = []
    for rank in (0, 1):
        path = os.path.join(str(folder), f"outcome_rank{rank}.txt")
        found.append(open(path).read() if os.path.exists(path) else None)
    return found


class BlockTheRunFolder(AbstractCallback):
    """Rank 0, when training begins (after the folder was checked at registration and created): a regular file takes
    the place of the run folder the first checkpoint writes into."""

    def __init__(self):
        super().__init__("a file where the run folder goes")

    def on_train_begin(self):
        tl = self.train_loop_obj
        if tl.strategy.rank == 0:
            (checkpoint,) = [callback for callback in tl.callbacks if isinstance(callback, ModelCheckpoint)]
            os.makedirs(os.path.dirname(checkpoint.experiment_folder.path), exist_ok=True)
            if os.path.isdir(checkpoint.experiment_folder.path):  # created when training starts: still empty
                shutil.rmtree(checkpoint.experiment_folder.path)
            with open(checkpoint.experiment_folder.path, "w") as handle:
                handle.write("a regular file, not a folder")


@pytest.mark.parametrize("gpu_mode", ["ddp", "fsdp"])
def test_rank_0_failing_to_create_the_run_folder_stops_every_rank_with_its_error(tmp_path, gpu_mode):
    tl = make_loop(gpu_mode, Tower())
    checkpoint = ModelCheckpoint("proj", "exp", str(tmp_path / "results"))
    options = {"fsdp_model_args": UNITS} if gpu_mode == "fsdp" else {}
    with pytest.raises(Exception, match="could not save"):
        tl.fit_distributed(num_epochs=2, callbacks=[checkpoint, BlockTheRunFolder(), RecordOutcome(str(tmp_path))],
                           num_gpus=2, start_method="fork", timeout_s=120, **options)
    rank_0, rank_1 = outcomes(tmp_path)
    assert rank_0 is not None and "could not save" in rank_0, rank_0
    assert rank_1 == rank_0  # before: rank 1 went on into training's next collective


class ImmutableFirstCheckpoint(AbstractCallback):
    """Rank 0, once epoch 0's checkpoint is complete: makes a file of it immutable, so pruning it fails."""

    def __init__(self, root: str):
        super().__init__("make the first checkpoint undeletable")
        self.root = root
        self.made = []

    def on_epoch_begin(self):
        tl = self.train_loop_obj
        if tl.epoch != 1 or tl.strategy.rank != 0:
            return
        for callback in tl.callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback.wait_for_pending_save()  # epoch 0's background save
        (first,) = glob.glob(os.path.join(self.root, "proj", "exp_*", "checkpoint_model", "*E0*"))
        target = os.path.join(first, "checkpoint.json") if os.path.isdir(first) else first
        subprocess.run(["chattr", "+i", target], check=True)
        with open(os.path.join(self.root, "immutable.txt"), "w") as handle:
            handle.write(target)


def _chattr_works(folder) -> bool:
    probe = folder / "probe"
    probe.write_text("x")
    try:
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
            return False
        subprocess.run(["chattr", "-i", str(probe)], check=True)
        return True
    except FileNotFoundError:
        return False


class BetterEachEpoch(AbstractCallback):
    """Ranks checkpoints by a metric that improves every epoch, so epoch 0's is the one pruned."""

    def __init__(self):
        super().__init__("a metric that improves")

    def on_epoch_end(self):
        self.train_loop_obj.insert_metric_result_into_history("score", float(self.train_loop_obj.epoch))


@pytest.mark.parametrize("gpu_mode, background_save", [("ddp", False), ("fsdp", True)])
def test_a_prune_that_fails_on_rank_0_stops_every_rank_with_its_error(tmp_path, gpu_mode, background_save):
    if os.geteuid() != 0 or not _chattr_works(tmp_path):
        pytest.skip("needs chattr +i (root, on a file system with immutable files) for an undeletable file")
    root = str(tmp_path / "results")
    tl = make_loop(gpu_mode, Tower())
    checkpoint = ModelCheckpoint("proj", "exp", root, rm_subopt_local_models="score", num_best_checkpoints_kept=1,
                                 background_save=background_save)
    options = {"fsdp_model_args": UNITS} if gpu_mode == "fsdp" else {}
    try:
        with pytest.raises(Exception):
            tl.fit_distributed(num_epochs=3, callbacks=[BetterEachEpoch(), checkpoint, ImmutableFirstCheckpoint(root),
                                                        RecordOutcome(str(tmp_path))],
                               num_gpus=2, start_method="fork", timeout_s=120, **options)
    finally:
        if os.path.exists(os.path.join(root, "immutable.txt")):  # wherever pruning moved it: let pytest remove it
            subprocess.run(["chattr", "-R", "-i", root], check=True)
    rank_0, rank_1 = outcomes(tmp_path)
    assert rank_0 is not None and "Operation not permitted" in rank_0, rank_0
    assert rank_1 == rank_0  # before: rank 1 finished as if all had gone well, or waited for rank 0
