"""The matrix of feature combinations: precision x strategy x grad_accumulation x torch_compile x loss x clipping.

Every cell trains the tiny ComboNet (BatchNorm and Dropout; an auxiliary head for the MultiLoss cells) for two
epochs and checks, in every process (see :func:`tests.combinations.support.check_cell`):

* all ranks hold identical parameters, optimizer state and loss scale after each epoch (DDP; under FSDP each rank
  holds its own shards by design, and the gathered states are what the other invariants compare);
* two ``fit`` calls (1 epoch, then to 2) end bitwise where one call of 2 epochs does, history included;
* stopping after epoch 1 and continuing in a new TrainLoop that loads the checkpoint (nothing else carries over,
  the global random state scrambled) ends bitwise where the straight run does.

* a distributed cell's weights (for each precision, strategy and accumulation, the simplest and the most composite
  cell: :func:`tests.combinations.support.compared_with_one_process`) equal those of one process trained on the
  same global batches, within the
  tolerance :func:`tests.combinations.support.single_process_tolerance` states and justifies per precision (for
  this invariant the model has no BatchNorm or Dropout: each rank normalises its own half batch and draws its
  own masks, so with them the runs are different computations).

The matrix runs in the processes of ``run_distributed``; ``test_new_process_resume.py`` continues the
representative cells from a checkpoint file in new processes.

A representative subset (each precision once, each strategy once, each other feature at least once) runs in the
quick tests; the whole matrix is marked slow. Cells of one strategy share one pair of processes.
"""
import itertools
from typing import List

import pytest

from tests.combinations.support import LOSSES, PRECISIONS, STRATEGIES, Cell, matrix_worker
from tests.distributed_helpers import run_distributed

# torch_compile cells: one per precision and strategy (an aot_eager compile costs seconds; the other features
# do not change what is compiled).
COMPILED = [Cell(precision, strategy, 3, True, "multi1", True) for precision in PRECISIONS for strategy in STRATEGIES]
EAGER = [Cell(precision, strategy, accumulation, False, loss, clipping)
         for precision, strategy, accumulation, loss, clipping
         in itertools.product(PRECISIONS, STRATEGIES, (1, 3), LOSSES, (False, True))]
ALL_CELLS = EAGER + COMPILED

QUICK = [Cell("fp32", "single", 3, False, "multi2", True), Cell("O1", "single", 1, True, "plain", False),
         Cell("O3", "single", 3, False, "multi1", False),
         Cell("O2", "ddp", 3, False, "multi2", True), Cell("scaler", "ddp", 1, False, "plain", False),
         Cell("O1", "fsdp", 3, False, "plain", True), Cell("O2", "fsdp", 1, False, "multi1", False)]


def check_cells(strategy: str, cells: List[Cell]) -> None:
    cells = [cell for cell in cells if cell.strategy == strategy]
    if not cells:
        return
    world_size = 1 if strategy == "single" else 2
    if strategy == "single":
        by_rank = [matrix_worker(0, 1, cells)]
    else:
        by_rank = run_distributed(matrix_worker, world_size, (cells,), timeout=3000)
    failures = {f"rank {rank} {name}": problems for rank, results in enumerate(by_rank)
                for name, problems in results.items() if problems}
    assert not failures, "\n".join(f"{name}: {problems}" for name, problems in failures.items())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_representative_cells(strategy):
    check_cells(strategy, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_cell(strategy):
    check_cells(strategy, [cell for cell in ALL_CELLS if cell not in QUICK])
