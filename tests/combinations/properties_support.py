"""The runs of the property-based test (test_properties.py): a drawn configuration, the faults it injects, what it
compares.

A :class:`Setup` is one point of the configuration space (precision, accumulation, MultiLoss with one or two
optimizers, clipping, BatchNorm, weight averaging, LR schedules per step and per epoch, EarlyStopping, SpikeRollback,
end-of-epoch evaluation, the training loader's length, sized or not, shuffled or not, a poisoned sample). A
:class:`Run` is one TrainLoop built from it, always the same way (the same initial weights, data and callbacks), with
a :class:`Faults` switch the test arms to raise at a chosen point of a ``fit``. :func:`observe` and
:func:`differences` are what the invariant compares: every tensor bitwise (NaN equal to NaN, at the same places).
"""
import contextlib
import dataclasses
import math
import random
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollback
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
from aitoolbox.torchtrain.callbacks.weight_averaging import WeightAveraging
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback, StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.evaluation import loader_generators
from aitoolbox.torchtrain.host_copy import host_copy
from aitoolbox.torchtrain.train_loop.train_state import capture_rng_state, restore_rng_state
from tests.combinations.support import IN_FEATURES, Cell, ComboNet, build_optimizers
from tests.helpers import IterableTensorData

BATCH_SIZE = 4
PRECISIONS = {"fp32": False, "O1": {"opt_level": "O1"}, "O2": {"opt_level": "O2", "loss_scale": "dynamic"},
              "scaler": {"init_scale": 2.0 ** 10, "growth_interval": 2}}

# Where an armed fault raises: in get_loss before or after the forward, in a hook of a callback, or in a checkpoint
# write (a mid-epoch checkpoint taken after an optimizer step, written to a full disk).
FAULT_POINTS = ("get_loss", "get_loss_after_forward", "on_train_begin", "on_epoch_begin", "on_batch_begin",
                "on_after_gradient_update", "on_after_optimizer_step", "on_batch_end", "checkpoint_write",
                "on_epoch_train_end", "on_epoch_end")


class InjectedFault(Exception):
    """What an armed fault raises."""


@dataclasses.dataclass(frozen=True)
class Setup:
    precision: str = "fp32"  # fp32, O1 (bfloat16 autocast), O2 (bfloat16 model, float32 masters, dynamic loss
    # scaling), scaler (bfloat16 autocast, GradScaler-style dynamic scaling that grows every 2 steps)
    accumulation: int = 1
    loss: str = "plain"  # plain, multi1 (a MultiLoss, one optimizer), multi2 (a MultiLoss, two optimizers)
    clipping: bool = False
    batchnorm: bool = True
    averaging: str = "none"  # none; ema (evaluated and saved with the average); ema_train (kept aside)
    step_schedule: bool = False  # StepLR after every optimizer step
    epoch_schedule: bool = False  # StepLR at every epoch end
    early_stopping: bool = False  # on accumulated_loss (or val_loss with auto_eval), patience 1
    spike_rollback: bool = False
    auto_eval: bool = False  # end_auto_eval with a validation set
    num_samples: int = 12  # of the training set; batches of 4
    sized: bool = True  # a DataLoader with len, or one over an IterableDataset (no len)
    shuffle: bool = False  # a seeded shuffling DataLoader (sized only)
    poison: Optional[int] = None  # this training sample's features are inf: its batch's loss is not finite

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.num_samples / BATCH_SIZE)


class Faults:
    """One armed fault: ``where`` raises at its ``after``-th eligible occurrence (0: the first), then disarms.

    ``uncommitted`` counts the training forwards since the last completed optimizer step: the batches a fault
    makes the next ``fit`` train again. ``retrain_allowed`` False (a known defect with the batches trained again,
    see ``KNOWN_DEFECTS`` in test_properties.py) makes only the occurrences with none of them eligible.
    """

    def __init__(self):
        self.where: Optional[str] = None
        self.after = 0
        self.uncommitted = 0
        self.retrain_allowed = True
        self.after_step_allowed = True  # False: not where the batch's optimizer step is taken and a callback's
        # post-step hooks (on_after_optimizer_step, on_batch_end) are still to run for it
        self.fired = False

    def arm(self, where: str, after: int) -> None:
        self.where, self.after, self.fired = where, after, False

    def disarm(self) -> None:
        self.where = None

    def due(self, where: str, cuts_step_hooks: bool = False) -> bool:
        """Whether the fault fires here and now (it is then disarmed); ``cuts_step_hooks``: here the batch's
        step is taken and some callback's post-step hooks would not run for it."""
        if self.where != where or (self.uncommitted and not self.retrain_allowed) \
                or (cuts_step_hooks and not self.after_step_allowed):
            return False
        if self.after > 0:
            self.after -= 1
            return False
        self.where, self.fired = None, True
        return True

    def check(self, where: str, cuts_step_hooks: bool = False) -> None:
        if self.due(where, cuts_step_hooks):
            raise InjectedFault(where)


class PropertyNet(ComboNet):
    """ComboNet whose training ``get_loss`` may raise, before or after its forward."""

    def __init__(self, setup: Setup, faults: Faults):
        super().__init__(setup.loss, batchnorm=setup.batchnorm)
        self.faults = faults

    def get_loss(self, batch_data, criterion, device):
        if self.training:
            self.faults.check("get_loss")
        loss = super().get_loss(batch_data, criterion, device)
        if self.training:
            self.faults.uncommitted += 1
            self.faults.check("get_loss_after_forward")
        return loss


class _FullDisk:
    """A file object whose writes fail after a few bytes, as on a full disk."""

    def __init__(self):
        self.written = 0

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > 64:
            raise OSError(28, "No space left on device")
        return len(data)

    def flush(self) -> None:
        pass


class FaultPoints(AbstractCallback):
    """Raises where :class:`Faults` is armed, in any hook; first or last among the callbacks (``execution_order``).
    Also counts the optimizer steps that complete a batch, for ``Faults.uncommitted``."""

    def __init__(self, faults: Faults, execution_order: int):
        super().__init__("fault points", execution_order=execution_order)
        self.faults = faults
        self.runs_last = execution_order > 100  # after every callback of a Setup (checkpoint callbacks: 100)
        self._steps_in_batch = 0
        self._stepped = False

    def on_train_begin(self):
        self.faults.check("on_train_begin")

    def on_epoch_begin(self):
        self.faults.check("on_epoch_begin")

    def on_batch_begin(self):
        self._stepped = False
        self.faults.check("on_batch_begin")

    def on_after_gradient_update(self, optimizer_idx):
        self.faults.check("on_after_gradient_update")

    def on_after_optimizer_step(self):
        self._steps_in_batch += 1
        if self._steps_in_batch == self.train_loop_obj.num_optimizers:  # every optimizer stepped: the batch is done
            self._steps_in_batch, self._stepped, self.faults.uncommitted = 0, True, 0
        self.faults.check("on_after_optimizer_step", cuts_step_hooks=True)  # on_batch_end is still to come

    def on_batch_end(self):
        cuts = self._stepped and not self.runs_last
        self.faults.check("on_batch_end", cuts_step_hooks=cuts)
        if self._stepped and self.faults.due("checkpoint_write", cuts_step_hooks=cuts):
            torch.save(self.train_loop_obj.checkpoint_state(mid_epoch=True), _FullDisk())  # raises OSError

    def on_epoch_train_end(self):
        self.faults.check("on_epoch_train_end")

    def on_epoch_end(self):
        self.faults.check("on_epoch_end")


class KeepCheckpoints(AbstractCallback):
    """Keeps the run's newest checkpoint in memory, as a checkpoint callback keeps its newest file: a mid-epoch one
    after each optimizer step that completes a batch, an epoch-end one at each epoch end (last of the callbacks)."""

    def __init__(self):
        super().__init__("keep checkpoints", execution_order=1000)
        self.newest: Optional[dict] = None
        self.rollbacks = 0  # the run's rollbacks when the newest was taken
        self._stepped = False

    def on_batch_begin(self):
        self._stepped = False

    def on_after_gradient_update(self, optimizer_idx):
        self._stepped = self.train_loop_obj.optimizer_step_due

    def on_batch_end(self):
        if self._stepped:
            self._keep(mid_epoch=True)

    def on_epoch_end(self):
        self._keep(mid_epoch=False)

    def _keep(self, mid_epoch: bool) -> None:
        tl = self.train_loop_obj
        self.newest = host_copy(tl.checkpoint_state(mid_epoch=mid_epoch))
        self.rollbacks = len(tl.rollbacks)


def _data(setup: Setup) -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(setup.num_samples, IN_FEATURES, generator=generator)
    y = ((x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())
    if setup.poison is not None:
        x[setup.poison] = float("inf")
    return TensorDataset(x, y)


def _validation_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(12, IN_FEATURES, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Run:
    """One TrainLoop of ``setup``, built the same way every time; ``keeper`` only for the run under test. The fault
    points are the run under test's, and also a reference's given a ``fault_order``: there they are never armed, but
    the two runs hold the same callbacks in the same order (SpikeRollback keeps a fit's start as a point only when no
    callback ordered before it has an ``on_epoch_begin``, so a fault callback ordered first changes its rollbacks)."""

    def __init__(self, setup: Setup, under_test: bool, fault_order: Optional[int] = None):
        self.setup = setup
        self.faults = Faults()
        torch.manual_seed(0)  # the same initial weights in every run (a loaded checkpoint replaces them anyway)
        self.model = PropertyNet(setup, self.faults)
        data = _data(setup)
        if setup.sized:
            generator = torch.Generator().manual_seed(3) if setup.shuffle else None
            loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=setup.shuffle, generator=generator)
        else:
            loader = DataLoader(IterableTensorData(data), batch_size=BATCH_SIZE)
        validation = DataLoader(_validation_data(), batch_size=8) if setup.auto_eval else None
        self.tl = TrainLoop(self.model, loader, validation, None, build_optimizers(self.model, Cell(loss=setup.loss)),
                            nn.CrossEntropyLoss(), end_auto_eval=setup.auto_eval, show_progress=False,
                            use_amp=PRECISIONS[setup.precision])
        self.callbacks = setup_callbacks(setup)
        self.keeper = KeepCheckpoints() if under_test else None
        extra = [FaultPoints(self.faults, fault_order or 0)] if under_test or fault_order is not None else []
        extra += [self.keeper] if under_test else []
        self.tl.callbacks_handler.register_callbacks(self.callbacks + extra)

    def fit(self, **targets) -> None:
        """``fit`` with the setup's accumulation."""
        self.tl.fit(grad_accumulation=self.setup.accumulation, **targets)


def setup_callbacks(setup: Setup) -> List[AbstractCallback]:
    callbacks: List[AbstractCallback] = []
    if setup.clipping:
        callbacks.append(GradNormClip(0.5))
    if setup.averaging != "none":
        callbacks.append(WeightAveraging(decay=0.6, eval_with_average=setup.averaging == "ema",
                                         save_average=setup.averaging == "ema"))
    if setup.step_schedule:
        callbacks.append(GeneralLRSchedulerCallback(torch.optim.lr_scheduler.StepLR, step_per_optimizer_step=True,
                                                    step_size=2, gamma=0.9))
    if setup.epoch_schedule:
        callbacks.append(StepLRScheduler(step_size=1, gamma=0.7))
    if setup.early_stopping:
        monitor = ("val_loss" if setup.auto_eval else "accumulated_loss") + ("_main" if setup.loss != "plain" else "")
        callbacks.append(EarlyStopping(monitor=monitor, patience=1))
    if setup.spike_rollback:
        callbacks.append(SpikeRollback(factor=3.0, window=6, warmup=3, snapshot_every=2, max_rollbacks=2))
    return callbacks


# --- the global random state of each run -----------------------------------------------------------------------
def initial_random_state() -> dict:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    return capture_rng_state()


class RandomStates:
    """The process's global random state kept apart for each run: the runs are trained in turns in one process,
    and each must draw from its own stream as if it were alone."""

    def __init__(self):
        start = initial_random_state()
        self.states = {"test": start, "reference": start}

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Run the body with run ``name``'s random state; keep what it leaves (also when it raises)."""
        restore_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = capture_rng_state()


# --- what the invariant compares ---------------------------------------------------------------------------------
def observe(run: Run, random_state: dict) -> Dict[str, Any]:
    """Everything a run's future depends on or reports: weights and buffers, optimizers, precision (loss scale,
    float32 masters), the setup's callbacks' states (schedulers, early stopping, averaging, rollbacks), history,
    counters, modes, random states."""
    tl = run.tl
    stateful = [cb for cb in run.callbacks if callable(getattr(cb, "state_dict", None))]
    return {
        "model": tl.model.state_dict(),
        "modes": [module.training for module in tl.model.modules()],
        "optimizers": [optimizer.state_dict() for optimizer in tl.optimizers],
        "precision": tl.precision.state_dict(),
        "callbacks": {f"{type(cb).__name__}:{index}": cb.state_dict() for index, cb in enumerate(stateful)},
        "history": {name: list(values) for name, values in tl.train_history.items()},
        "counters": tl.state.state_dict(),
        "rollbacks": list(tl.rollbacks),
        "random": random_state,
        "loader_generators": [generator.get_state() for generator in loader_generators(tl.train_loader)],
    }


def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Where ``a`` and ``b`` differ (tensors bitwise, NaN equal to NaN at the same places); empty when equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point():
            same = torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        else:
            same = torch.equal(a, b)
        if same:
            return []
        if a.is_floating_point() and a.numel():
            return [f"{path}: differs by up to {float((a - b).abs().nan_to_num(float('inf')).max()):.3g}"]
        return [f"{path}: differs"]
    if isinstance(a, MultiLoss) and isinstance(b, MultiLoss):
        a, b = dict(a.items()), dict(b.items())
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"]
        return [line for key in a for line in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [line for index, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, f"{path}[{index}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b, equal_nan=True) else [f"{path}: arrays differ"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
