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

Three tiers, so that the suite stays within its time budget and every cell still runs in CI:

* quick: a representative subset (each precision once, each strategy once, each other feature at least once);
* slow: with it, every pair of feature values together at least once (:func:`tests.combinations.support.all_pairs`)
  and every cell compared with one process for each precision and distributed strategy (about 30 cells);
* extended (``--extended``, CI's second step): the rest of the full product (195 cells in all).

Cells of one strategy share one pair of processes.
"""
import dataclasses
import itertools
from typing import List

import pytest

from tests.combinations.support import (
    LOSSES, PRECISIONS, STRATEGIES, Cell, all_pairs, compared_with_one_process, matrix_worker)
from tests.distributed_helpers import run_distributed

# torch_compile cells: one per precision and strategy (an aot_eager compile costs seconds; the other features
# do not change what is compiled).
COMPILED = [Cell(precision, strategy, 3, True, "multi1", True) for precision in PRECISIONS for strategy in STRATEGIES]
EAGER = [Cell(precision, strategy, accumulation, False, loss, clipping)
         for precision, strategy, accumulation, loss, clipping
         in itertools.product(PRECISIONS, STRATEGIES, (1, 3), LOSSES, (False, True))]
ALL_CELLS = EAGER + COMPILED

# (O1 compiled with two optimizers: a compiled backward is one graph, so every loss is back-propagated before the
# first step, with donated buffers off; found by the pairwise tier.)
QUICK = [Cell("fp32", "single", 3, False, "multi2", True), Cell("O1", "single", 1, True, "multi2", False),
         Cell("O3", "single", 3, False, "multi1", False),
         Cell("O2", "ddp", 3, False, "multi2", True), Cell("scaler", "ddp", 1, False, "plain", False),
         Cell("O1", "fsdp", 3, False, "plain", True), Cell("O2", "fsdp", 1, False, "multi1", False)]
# The composite cell of each precision and distributed strategy, compared with one process.
COMPARED = [Cell(precision, strategy, 3, False, "multi2", True) for precision in PRECISIONS
            for strategy in STRATEGIES if strategy != "single"]
FACTORS = {"precision": list(PRECISIONS), "strategy": list(STRATEGIES), "grad_accumulation": [1, 3],
           "compile": [False, True], "loss": list(LOSSES), "clipping": [False, True]}
PAIRWISE = [Cell(**values) for values in all_pairs(
    FACTORS, [dataclasses.asdict(cell) for cell in QUICK + [cell for cell in COMPARED if cell not in QUICK]])]
EXTENDED = [cell for cell in ALL_CELLS if cell not in PAIRWISE]


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
@pytest.mark.extended  # the suite runs test_representative_cells of every strategy (README: within 15 minutes)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_pair_of_features(strategy):
    check_cells(strategy, [cell for cell in PAIRWISE if cell not in QUICK])


@pytest.mark.extended
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_other_cell(strategy):
    check_cells(strategy, EXTENDED)


def test_the_tiers_cover_every_pair_and_together_the_whole_product():
    def pairs(cells):
        return {(a, getattr(cell, a), b, getattr(cell, b)) for cell in cells
                for a, b in itertools.combinations(FACTORS, 2)}
    full_product = [Cell(*values) for values in itertools.product(
        FACTORS["precision"], FACTORS["strategy"], FACTORS["grad_accumulation"], FACTORS["compile"],
        FACTORS["loss"], FACTORS["clipping"])]
    assert pairs(PAIRWISE) == pairs(full_product)
    assert set(ALL_CELLS) <= set(PAIRWISE) | set(EXTENDED) and set(QUICK) <= set(PAIRWISE)
    assert {(cell.precision, cell.strategy) for cell in PAIRWISE
            if compared_with_one_process(cell) and cell.strategy != "single"} == {
        (precision, strategy) for precision in PRECISIONS for strategy in STRATEGIES if strategy != "single"}
