"""The model, data and runs of the feature-combination tests.

A cell is one combination: precision x strategy x grad_accumulation x torch_compile x loss x clipping. Each run
trains the tiny :class:`ComboNet` (Linear, BatchNorm, ReLU, Dropout, Linear; with an auxiliary head for the
MultiLoss cells) on fixed data and returns what the invariants compare: the weights, the optimizer states, the
loss scale and the history, as plain CPU tensors and numbers.

Distributed cells run in the processes of :func:`tests.distributed_helpers.run_distributed` (gloo, two ranks):
the environment variables of a torchrun job make ``fit_distributed`` join the process group those processes
already share, so one pair of processes trains many cells one after another.
"""
import dataclasses
import itertools
import os
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.train_loop import TrainLoop

PRECISIONS = {"fp32": False, "O1": {"opt_level": "O1"}, "O2": {"opt_level": "O2"}, "O3": {"opt_level": "O3"},
              "scaler": {"init_scale": 2.0 ** 10, "growth_interval": 2}}
STRATEGIES = ("single", "ddp", "fsdp")
LOSSES = ("plain", "multi1", "multi2")
IN_FEATURES, HIDDEN, CLASSES = 6, 16, 3
NUM_SAMPLES, BATCH_SIZE = 40, 4  # per process: 5 batches an epoch under two ranks, 10 in one process


@dataclasses.dataclass(frozen=True)
class Cell:
    precision: str = "fp32"
    strategy: str = "single"
    grad_accumulation: int = 1
    compile: bool = False
    loss: str = "plain"
    clipping: bool = False

    @property
    def name(self) -> str:
        compiled = "compiled" if self.compile else "eager"
        return (f"{self.precision}-{self.strategy}-acc{self.grad_accumulation}-{compiled}"
                f"-{self.loss}-{'clip' if self.clipping else 'noclip'}")


def all_pairs(factors: Dict[str, Sequence[Any]], start: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Combinations of the factors' values in which every pair of values of two factors occurs at least once.

    ``start`` are combinations already chosen; the returned list begins with them and adds, greedily, the
    combination of the full product that covers the most pairs not covered yet (the first such in product order,
    so the choice is the same on every run). A bug that needs two features together to show is caught by a
    pairwise set; the full product is many times larger.
    """
    names = list(factors)

    def pairs_of(combination: Dict[str, Any]) -> Set[tuple]:
        return {(a, combination[a], b, combination[b]) for a, b in itertools.combinations(names, 2)}

    product = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    uncovered = set().union(*(pairs_of(combination) for combination in product))
    chosen = list(start)
    for combination in chosen:
        uncovered -= pairs_of(combination)
    while uncovered:
        best = max(product, key=lambda combination: len(pairs_of(combination) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


class ComboNet(TTModel):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear; ``aux`` (a regression head on the detached hidden
    features) only for the MultiLoss cells, whose second loss trains it."""

    def __init__(self, loss: str = "plain", dropout: float = 0.2, batchnorm: bool = True):
        super().__init__()
        self.loss_kind = loss
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)
        self.aux = nn.Linear(HIDDEN, 1) if loss != "plain" else None

    def forward(self, x):
        hidden = self.drop(torch.relu(self.bn(self.fc1(x))))
        aux = self.aux(hidden.detach()).squeeze(1) if self.aux is not None else None
        return self.fc2(hidden), aux

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0].to(device), batch_data[1].to(device)
        logits, aux = self(x)
        main = criterion(logits.float(), y)
        if aux is None:
            return main
        return MultiLoss({"main": main, "aux": ((aux.float() - y.float()) ** 2).mean()})

    def get_predictions(self, batch_data, device):
        x, y = batch_data[0].to(device), batch_data[1]
        return self(x)[0].float().argmax(dim=1).cpu(), y, None


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


def build_model(cell: Cell, per_sample: bool = False) -> ComboNet:
    """The cell's model; ``per_sample``: without BatchNorm and Dropout, so that a sample's gradient does not depend
    on which process's half batch it is in (what the comparison with one process needs)."""
    torch.manual_seed(0)
    if per_sample:
        return ComboNet(cell.loss, dropout=0.0, batchnorm=False)
    return ComboNet(cell.loss)


def build_optimizers(model: ComboNet, cell: Cell):
    if cell.loss == "multi2":
        main = [p for name, p in model.named_parameters() if not name.startswith("aux.")]
        return [torch.optim.Adam(main, lr=1e-2), torch.optim.SGD(model.aux.parameters(), lr=1e-2, momentum=0.9)]
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def build_loop(cell: Cell, model: Optional[ComboNet] = None) -> TrainLoop:
    if cell.compile:
        # As in a new process: torch.compile caches per code object (ComboNet.forward), and the many loops built
        # in one matrix process would otherwise reach its cache size limit and run later cells eagerly.
        torch._dynamo.reset()
    model = model if model is not None else build_model(cell)
    gpu_mode = "single" if cell.strategy == "single" else cell.strategy
    batch_size = BATCH_SIZE * (2 if cell.strategy == "single" else 1)  # the same global batches
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=False)
    return TrainLoop(model, loader, None, None, build_optimizers(model, cell), nn.CrossEntropyLoss(),
                     end_auto_eval=False, show_progress=False, gpu_mode=gpu_mode, use_amp=PRECISIONS[cell.precision],
                     torch_compile={"backend": "aot_eager"} if cell.compile else False)


def fit_callbacks(cell: Cell) -> List[AbstractCallback]:
    return [GradNormClip(1.0)] if cell.clipping else []


def fit(tl: TrainLoop, cell: Cell, num_epochs: int, callbacks=None) -> None:
    """``fit`` in one process, ``fit_distributed`` joining the current process group in a distributed cell."""
    grad_accumulation = cell.grad_accumulation
    if cell.strategy == "single":
        tl.fit(num_epochs=num_epochs, grad_accumulation=grad_accumulation, callbacks=callbacks)
    else:
        tl.fit_distributed(num_epochs=num_epochs, grad_accumulation=grad_accumulation, callbacks=callbacks,
                           train_data_shuffle=False)


def join_as_torchrun(rank: int, world_size: int) -> None:
    """Make this run_distributed process look like a torchrun worker, so fit_distributed joins its group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")


def run_state(tl: TrainLoop) -> Dict[str, Any]:
    """What the invariants compare, as CPU tensors: full weights (gathered under FSDP: a collective), optimizer
    states, loss scale and history."""
    strategy = tl.strategy
    model = strategy.model_state_dict(tl.model_for_user)
    optimizers = [strategy.optimizer_state_dict(tl.loop_model, opt) for opt in tl.optimizers]
    scaler = tl.precision.loss_scaler
    return {"model": {k: v.detach().float().cpu().clone() for k, v in model.items()},
            "optimizers": _tensors_of(optimizers),
            "loss_scale": None if scaler is None else float(scaler.loss_scale),
            "history": {k: [float(v) for v in values] for k, values in tl.train_history.items()}}


def _tensors_of(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().float().cpu().clone()]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in _tensors_of(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_of(item)]
    return []


def assert_same_state(a: Dict[str, Any], b: Dict[str, Any], what: str, atol: float = 0.0) -> None:
    assert a["model"].keys() == b["model"].keys(), what
    for name in a["model"]:
        if atol == 0.0:
            assert torch.equal(a["model"][name], b["model"][name]), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(a["model"][name], b["model"][name], atol=atol, rtol=0, msg=f"{what}: {name}")
    assert len(a["optimizers"]) == len(b["optimizers"]), what
    for index, (x, y) in enumerate(zip(a["optimizers"], b["optimizers"])):
        if atol == 0.0:
            assert torch.equal(x, y), f"{what}: optimizer tensor {index} differs"
    assert a["loss_scale"] == b["loss_scale"], f"{what}: loss scale {a['loss_scale']} != {b['loss_scale']}"


class RanksAgree(AbstractCallback):
    """After every epoch: all ranks hold identical weights (replicated strategies), optimizer state and loss scale.
    Records a failure message instead of raising, so that every rank reaches the same collectives."""

    def __init__(self):
        super().__init__("ranks agree")
        self.disagreements: List[str] = []
        self.parameter_names = set()

    def on_train_loop_registration(self):
        self.parameter_names = {name for name, _ in self.train_loop_obj.model_for_user.named_parameters()}

    def on_epoch_end(self):
        tl = self.train_loop_obj
        if tl.strategy.world_size == 1 or tl.shards_parameters:
            return  # a sharded run holds different shards on each rank by design; its gathered state is compared
        state = run_state(tl)
        # Parameters, not buffers: DDP gives every rank rank 0's buffers at the start of each forward, so
        # BatchNorm's running statistics differ by the last batch's update until the next forward.
        parameters = [tensor for name, tensor in state["model"].items() if name in self.parameter_names]
        mine = torch.cat([t.flatten() for t in parameters + state["optimizers"]]
                         + [torch.tensor([state["loss_scale"] or 0.0])])
        gathered = [torch.empty_like(mine) for _ in range(tl.strategy.world_size)]
        dist.all_gather(gathered, mine)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            diff = max(float((gathered[0] - other).abs().max()) for other in gathered[1:])
            self.disagreements.append(f"epoch {tl.epoch}: ranks differ by up to {diff:.3g}")


def train_cell(cell: Cell, epochs: int = 2, split_after: Optional[int] = None) -> Dict[str, Any]:
    """Train ``epochs`` epochs in one fit (or two fits, the first ending after ``split_after``); return the state
    and what RanksAgree recorded."""
    tl = build_loop(cell)
    agree = RanksAgree()
    callbacks = fit_callbacks(cell) + [agree]
    if split_after is None:
        fit(tl, cell, epochs, callbacks)
    else:
        fit(tl, cell, split_after, callbacks)
        fit(tl, cell, epochs)
    return {"state": run_state(tl), "disagreements": agree.disagreements}


def resume_cell(cell: Cell, epochs: int = 2, stop_after: int = 1) -> Dict[str, Any]:
    """Train ``stop_after`` epochs, take the run's checkpoint (a collective), then continue in a new TrainLoop built
    from scratch that loads it, as a new process would: nothing but the checkpoint carries over."""
    first = build_loop(cell)
    fit(first, cell, stop_after, fit_callbacks(cell))
    checkpoint = first.checkpoint_state()
    if cell.strategy != "single":
        # What every rank reads from the file rank 0 writes (under FSDP only rank 0 holds the gathered weights).
        checkpoint = first.broadcast_object(checkpoint)
    torch.manual_seed(12345)  # whatever the new process's random state: the checkpoint's is restored
    resumed = build_loop(cell)
    resumed.load_checkpoint(checkpoint)
    fit(resumed, cell, epochs, fit_callbacks(cell))
    return {"state": run_state(resumed)}


def single_process_differences(cell: Cell) -> Dict[str, float]:
    """Train the cell's per-sample model (no BatchNorm, no Dropout) in the cell's processes and, in each of them,
    in one process on the same global batches; the largest absolute difference of each weight (``{}`` on a rank
    that holds no gathered weights)."""
    distributed = build_loop(cell, build_model(cell, per_sample=True))
    fit(distributed, cell, 2, fit_callbacks(cell))
    got = run_state(distributed)  # a collective under FSDP (the weights are gathered)
    single_cell = dataclasses.replace(cell, strategy="single")
    reference = build_loop(single_cell, build_model(single_cell, per_sample=True))
    fit(reference, single_cell, 2, fit_callbacks(single_cell))
    expected = run_state(reference)
    if not got["model"]:  # under FSDP only rank 0 holds the gathered weights
        return {}
    return {name: float((got["model"][name] - expected["model"][name]).abs().max()) for name in expected["model"]}


def compared_with_one_process(cell: Cell) -> bool:
    """The cells whose equivalence with one process is checked: for each precision, distributed strategy and
    accumulation, the simplest cell (plain loss, no clipping, accumulation 1) and the most composite one (two
    optimizers, clipping, accumulation 3), eager. The other features change nothing in how the ranks' gradients
    are combined, and each check costs two more trainings."""
    if cell.compile:
        return False
    return (cell.grad_accumulation, cell.loss, cell.clipping) in ((1, "plain", False), (3, "multi2", True))


def single_process_tolerance(cell: Cell) -> float:
    """How far a distributed cell's weights may be from one process's after two epochs (measured: about half of it).

    The ranks average their half batches' gradients, one process the whole batch's: the same sums in another
    order. In float32 that is rounding (observed 6e-8: an ulp of the weights). Under autocast (O1, the GradScaler
    dict) the bfloat16 forward rounds activations differently per half batch (observed 7.5e-4). O2 and O3 keep
    bfloat16 weights, one unit in the last place of a weight below 1 is up to 3.9e-3 (observed 2e-3). FSDP's O2
    also reduces the gradients in bfloat16, and Adam divides each gradient by its running size, so an element
    whose gradient is near zero may step by up to the learning rate (1e-2) the other way (observed 1.5e-2).
    """
    if cell.precision == "fp32":
        return 1e-6
    if cell.precision in ("O1", "scaler"):
        return 2e-3
    if cell.precision == "O2" and cell.strategy == "fsdp":
        return 3e-2
    return 8e-3


def check_cell(cell: Cell) -> List[str]:
    """Every invariant of one cell, as a list of what failed (empty: all hold). In a distributed cell every rank
    runs it (the runs are collectives) and reports its own view."""
    problems = []
    straight = train_cell(cell)
    problems += [f"ranks disagree: {line}" for line in straight["disagreements"]]
    for name, other in (("two fits", train_cell(cell, split_after=1)), ("resume", resume_cell(cell))):
        try:
            assert_same_state(other["state"], straight["state"], f"{name} vs one straight fit")
            if other["state"]["history"] != straight["state"]["history"] and name == "two fits":
                problems.append(f"{name}: history differs")
        except AssertionError as error:
            problems.append(str(error).splitlines()[0])
    if cell.strategy != "single" and compared_with_one_process(cell):
        tolerance = single_process_tolerance(cell)
        differences = single_process_differences(cell)
        problems += [f"{name} differs from one process's by {difference:.3g} (tolerance {tolerance:g})"
                     for name, difference in differences.items() if difference > tolerance]
    return problems


def matrix_worker(rank: int, world_size: int, cells: List[Cell]) -> Dict[str, List[str]]:
    """run_distributed's function: every cell's invariants, in processes that stand in for torchrun's (for
    single-process cells, called in the test process itself, whose environment must stay as it is)."""
    if world_size > 1:
        join_as_torchrun(rank, world_size)
    results = {}
    for cell in cells:
        try:
            results[cell.name] = check_cell(cell)
        except Exception as error:  # one cell's failure must not hide the others'
            results[cell.name] = [f"raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"]
    return results
