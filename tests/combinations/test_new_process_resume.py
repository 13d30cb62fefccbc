"""Stopping after epoch 1 and resuming from the checkpoint file in new processes ends bitwise where the straight
run does, for the matrix's representative cells.

The first set of processes trains each cell straight for two epochs and, from scratch again, for one epoch whose
checkpoint rank 0 writes to a file; a second set of processes, started afresh (nothing in memory carries over:
not the random state, not torch's caches, not the amp registry), builds each cell's TrainLoop, loads the file
and trains on to two epochs. The test process compares what both sets returned.
"""
import os
from typing import Dict, List

import pytest
import torch

from tests.combinations.support import (
    Cell, assert_same_state, build_loop, fit, fit_callbacks, join_as_torchrun, run_state)
from tests.combinations.test_matrix import QUICK
from tests.distributed_helpers import run_distributed


def straight_and_checkpoint(rank: int, world_size: int, cells: List[Cell], folder: str) -> Dict[str, dict]:
    if world_size > 1:
        join_as_torchrun(rank, world_size)
    straight = {}
    for cell in cells:
        tl = build_loop(cell)
        fit(tl, cell, 2, fit_callbacks(cell))
        straight[cell.name] = run_state(tl)
        first = build_loop(cell)
        fit(first, cell, 1, fit_callbacks(cell))
        checkpoint = first.checkpoint_state()  # a collective; under FSDP rank 0 holds the gathered weights
        if rank == 0:
            torch.save(checkpoint, os.path.join(folder, f"{cell.name}.pth"))
    return straight


def resumed_from_file(rank: int, world_size: int, cells: List[Cell], folder: str) -> Dict[str, dict]:
    if world_size > 1:
        join_as_torchrun(rank, world_size)
    torch.manual_seed(12345)  # whatever the new process's random state: the checkpoint's is restored
    resumed = {}
    for cell in cells:
        tl = build_loop(cell)
        tl.load_checkpoint(os.path.join(folder, f"{cell.name}.pth"))
        fit(tl, cell, 2, fit_callbacks(cell))
        resumed[cell.name] = run_state(tl)
    return resumed


# DDP's cells (O2 with accumulation, two optimizers and clipping among them) in the quick tests; the others in
# the extended tier (CI's second step).
@pytest.mark.parametrize("strategy", [pytest.param("single", marks=[pytest.mark.slow, pytest.mark.extended]), "ddp",
                                      pytest.param("fsdp", marks=[pytest.mark.slow, pytest.mark.extended])])
def test_resuming_in_new_processes_equals_the_straight_run(strategy, tmp_path):
    cells = [cell for cell in QUICK if cell.strategy == strategy]
    # A single-process cell runs in one new process too (its process group of one is not used by the loop).
    world_size = 1 if strategy == "single" else 2
    straight = run_distributed(straight_and_checkpoint, world_size, (cells, str(tmp_path)), timeout=1200)
    resumed = run_distributed(resumed_from_file, world_size, (cells, str(tmp_path)), timeout=1200)
    for rank in range(world_size):
        for cell in cells:
            assert_same_state(resumed[rank][cell.name], straight[rank][cell.name],
                              f"rank {rank} {cell.name}: resumed in new processes vs straight")
            assert resumed[rank][cell.name]["history"] == straight[rank][cell.name]["history"], cell.name
