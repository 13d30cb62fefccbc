"""Loss spikes undone automatically: detect a spike, roll the run back to the last clean point, replay the interval
without the bad batches, go on.

Detection costs no host-device synchronisation per batch: each batch's loss (``tl.last_batch_loss``, the sum of a
MultiLoss's parts) stays on the device in a list, and once per check (every ``snapshot_every`` optimizer steps) the
whole interval is judged in a few tensor operations and copied to the host once (under DDP/FSDP after one
all-reduce of the per-batch flags, so that every process agrees). On a spike the loop itself rolls back (see
:mod:`aitoolbox.torchtrain.train_loop.rollback`); the batches left out are part of the run's state and of its
checkpoints. See the "Undoing loss spikes" docs page.
"""
import json
import logging
import math
import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop.data_position import batch_indices
from aitoolbox.torchtrain.train_loop.rollback import RollBack
from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot
from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume, apply_pending_states

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

SNAPSHOT_KINDS = ("memory", "checkpoint")
ROLLBACKS_FILE = "rollbacks.json"


class SpikeRollbackError(RuntimeError):
    """Training stopped: a loss spike came after ``max_rollbacks`` rollbacks, or before any clean point to return
    to. ``rollbacks`` lists the rollbacks done (``tl.rollbacks``), ``spike`` describes the last spike."""

    def __init__(self, message: str, rollbacks: List[dict], spike: dict):
        super().__init__(message)
        self.rollbacks = rollbacks
        self.spike = spike


class _KeptPoint:
    """The last clean point: a snapshot in host memory, or a mid-epoch checkpoint file (or sharded folder)."""

    def __init__(self, epoch: int, iteration: int, batches_done: int, snapshot: Optional[RunSnapshot] = None,
                 path: Optional[str] = None, checkpoint_callback: Any = None, owned: bool = False):
        self.epoch, self.iteration, self.batches_done = epoch, iteration, batches_done
        self.snapshot, self.path, self.checkpoint_callback = snapshot, path, checkpoint_callback
        self.owned = owned  # the checkpoint was written for this point alone (no other callback saved it)

    def discard(self) -> None:
        """A newer point replaces this one: delete its checkpoint if it was written for it alone (main process; a
        background save may still be writing it, so it is then kept)."""
        if not self.owned or self.checkpoint_callback.background_save or self.path is None:
            return
        try:
            if os.path.isdir(self.path):
                shutil.rmtree(self.path)
            elif os.path.exists(self.path):
                os.remove(self.path)
        except OSError as error:
            logger.warning("SpikeRollback could not delete its older checkpoint %s: %s", self.path, error)

    def restore(self, tl: "TrainLoop") -> Optional[MidEpochResume]:
        if self.snapshot is not None:
            return self.snapshot.restore(tl)
        self.checkpoint_callback.wait_for_pending_save()  # a background save of it may still be writing
        if self.path is None or not os.path.exists(self.path):
            raise FileNotFoundError(f"SpikeRollback cannot roll back: its checkpoint {self.path} is gone (deleted by "
                                    "another callback's pruning, e.g. keep_last?)")
        tl.load_checkpoint(self.path)
        return apply_pending_states(tl)  # inside fit: the states are applied now, as fit's start would


class SpikeRollback(AbstractCallback):
    """Detect a loss spike, return the run to the last clean point, replay it without the bad batches, go on.

    A batch loss is a spike when it is not finite, or larger than ``factor`` times the median (the lower middle
    value) of the ``window`` batch losses before it, once ``warmup`` batch losses were seen. Every
    ``snapshot_every`` optimizer steps the losses since the last check are judged; if they are clean, the run is
    kept (``snapshot='memory'``: a :class:`~aitoolbox.torchtrain.train_loop.run_snapshot.RunSnapshot` in host
    memory; ``'checkpoint'``: a mid-epoch checkpoint by the registered checkpoint callback, for models too large to
    copy and for FSDP). On a spike the run returns there (weights, optimizers, loss scaler, schedulers,
    callbacks' states, RNG, data position, history), and the ``skip_batches`` batches ending at the first spiking
    one (in its epoch, never before the kept point) are left out: the run goes on as if the loader had never
    yielded them, bitwise (iteration indices and gradient-accumulation windows are formed from the remaining
    batches). With ``lr_factor``, every parameter group's learning rate is multiplied by it for the
    ``cooldown_steps`` optimizer steps after the rollback, during the step only: LR schedulers that step in
    ``on_after_optimizer_step`` (after this callback, which runs early) see and set the learning rate as without
    the cooldown. After ``max_rollbacks`` rollbacks, the next spike stops training with :class:`SpikeRollbackError`.

    Each rollback is recorded: ``tl.rollbacks`` (dicts with ``epoch`` and ``iteration`` of the spiking batch,
    the loop's 0-based counters, ``loss``, ``median``, ``skipped_samples``: the dataset indices of the batches
    left out when the sampler knows them, else None; under DDP every process's, by rank; and ``restored``: the
    epoch and iteration of the last batch trained before the kept point), ``train_history['rollbacks']`` (the
    rollbacks of each epoch, 0 included) and, with an experiment folder (the presets, or the checkpoint
    callback's with ``snapshot='checkpoint'``), ``rollbacks.json``.

    No host-device synchronisation per batch: the losses stay on the device until the check (one copy of the
    interval's flags per check; see the module docstring). The first and the last step of each ``fit`` are checked
    too (without changing the schedule): a clean point exists from the start, also after a resume, and a spike in
    the last interval does not end the run unseen.

    Args:
        factor: a loss above ``factor`` x the median of the window is a spike.
        window: how many earlier batch losses the median is taken over.
        warmup: batch losses seen before the median rule applies (non-finite losses are spikes from the start).
        snapshot_every: optimizer steps between checks (and snapshots).
        skip_batches: batches left out per spike: the spiking one and those just before it.
        lr_factor: multiply the learning rates by this for ``cooldown_steps`` steps after a rollback (None: no).
        cooldown_steps: optimizer steps the ``lr_factor`` applies to.
        max_rollbacks: rollbacks allowed over the run; the spike after them stops training.
        snapshot: ``'memory'`` (a copy of the whole run in host memory: about the size of the model and optimizer
            states) or ``'checkpoint'`` (a registered checkpoint callback's ``save_resume_checkpoint``).
        execution_order: position among the callbacks; keep it below the LR schedulers' (default 0), so that the
            learning rate is put back before they step.
    """

    def __init__(self, factor: float = 4.0, window: int = 100, warmup: int = 50, snapshot_every: int = 100,
                 skip_batches: int = 1, lr_factor: Optional[float] = None, cooldown_steps: int = 0,
                 max_rollbacks: int = 3, snapshot: str = "memory", execution_order: int = -20):
        super().__init__("Spike rollback", execution_order=execution_order)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"factor must be a number > 0 (a loss above factor x the median is a spike), "
                             f"got {factor!r}")
        for name, value, minimum in (("window", window, 1), ("warmup", warmup, 0),
                                     ("snapshot_every", snapshot_every, 1), ("skip_batches", skip_batches, 1),
                                     ("cooldown_steps", cooldown_steps, 0), ("max_rollbacks", max_rollbacks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if lr_factor is not None and (isinstance(lr_factor, bool) or not isinstance(lr_factor, (int, float))
                                      or not lr_factor > 0):
            raise ValueError(f"lr_factor must be None or a number > 0, got {lr_factor!r}")
        if cooldown_steps > 0 and lr_factor is None:
            raise ValueError(f"cooldown_steps={cooldown_steps} needs lr_factor (the factor the learning rate is "
                             "multiplied by during the cooldown)")
        if snapshot not in SNAPSHOT_KINDS:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_KINDS}, got {snapshot!r}")
        self.factor, self.window, self.warmup = float(factor), window, warmup
        self.snapshot_every, self.skip_batches = snapshot_every, skip_batches
        self.lr_factor, self.cooldown_steps, self.max_rollbacks = lr_factor, cooldown_steps, max_rollbacks
        self.snapshot = snapshot
        # The detection state (saved in checkpoints; a rollback puts back the kept point's).
        self._window: Optional[torch.Tensor] = None  # the last clean losses, on the device
        self._seen = 0  # losses that entered the window
        self._pending: List[torch.Tensor] = []  # losses since the last check, on the device
        self._pending_at: List[Tuple[int, int]] = []  # their (epoch, iteration)
        self._steps_since_check = 0
        self._cooldown_left = 0
        # Per process, rebuilt: the kept point, a step's lowered learning rates, the epochs' starting RNG states.
        self._snapshot: Optional[_KeptPoint] = None
        self._saved_lrs: Dict[int, List[float]] = {}
        self._stepped = False
        self._epoch_rngs: Dict[int, dict] = {}
        self._checkpoint_callback: Any = None

    # --- hooks -------------------------------------------------------------------------------------------------
    def on_train_begin(self) -> None:
        tl = self.train_loop_obj
        if self.snapshot == "memory" and tl.shards_parameters:
            raise ValueError("SpikeRollback(snapshot='memory') cannot keep a sharded (FSDP) run in memory: each "
                             "process holds only its shards. Use snapshot='checkpoint' with a checkpoint callback "
                             "(e.g. ModelCheckpoint, or a TrainLoopCheckpoint preset)")
        if self.snapshot == "checkpoint":
            self._checkpoint_callback = _checkpoint_callback(tl)
        self._snapshot = None  # a new fit: a point is kept at its first step
        self._saved_lrs, self._stepped = {}, False

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        tl = self.train_loop_obj
        if self._cooldown_left > 0 and tl.optimizer_step_due and optimizer_idx not in self._saved_lrs:
            groups = tl.optimizers[optimizer_idx].param_groups
            self._saved_lrs[optimizer_idx] = [group["lr"] for group in groups]
            for group in groups:
                group["lr"] = group["lr"] * self.lr_factor

    def on_after_optimizer_step(self) -> None:
        self._stepped = True
        if self._saved_lrs:  # exactly the values the step found, before any scheduler steps
            optimizers = self.train_loop_obj.optimizers
            for optimizer_idx, lrs in self._saved_lrs.items():
                for group, lr in zip(optimizers[optimizer_idx].param_groups, lrs):
                    group["lr"] = lr
            self._saved_lrs = {}

    def on_batch_end(self) -> None:
        tl = self.train_loop_obj
        loss = tl.last_batch_loss
        self._pending.append(loss if loss.dim() == 0 else loss.sum())  # a MultiLoss: the sum of its parts
        self._pending_at.append((tl.epoch, tl.iteration))
        if tl.epoch not in self._epoch_rngs:
            self._epoch_rngs[tl.epoch] = tl.epoch_start_rng_state
        if not self._stepped:
            return
        self._stepped = False
        self._steps_since_check += 1
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
        if self._snapshot is None or self._steps_since_check >= self.snapshot_every or self._last_step_of_fit(tl):
            tl.run_state.call_after_step(self._check)  # once every callback finished the batch

    @staticmethod
    def _last_step_of_fit(tl: "TrainLoop") -> bool:
        """The batch ends the ``fit``: its tail is checked too (a spike there would otherwise end the run unseen,
        or be found by the next ``fit``, which keeps no point before it)."""
        if tl.num_iterations > 0:
            return tl.total_iteration_idx + 1 >= tl.num_iterations
        return tl.epoch + 1 >= tl.num_epochs and tl.iteration + 1 == tl.run_state.num_batches

    def on_epoch_train_end(self) -> None:
        tl = self.train_loop_obj
        tl.insert_metric_result_into_history("rollbacks", sum(record["epoch"] == tl.epoch for record in tl.rollbacks))

    def on_train_end(self) -> None:
        self._snapshot = None  # the host memory of the kept point is released

    def on_exception(self, exception: BaseException) -> None:
        self._snapshot = None

    # --- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The detection state (the window of clean losses, the losses since the last check, the counters)."""
        pending = torch.stack([value.float() for value in self._pending]).cpu() if self._pending else torch.zeros(0)
        return {"window": self._window.cpu() if self._window is not None else torch.zeros(0), "seen": self._seen,
                "pending": pending, "pending_at": [list(at) for at in self._pending_at],
                "steps_since_check": self._steps_since_check, "cooldown_left": self._cooldown_left}

    def load_state_dict(self, state: dict) -> None:
        device = self.train_loop_obj.device if self.train_loop_obj is not None else torch.device("cpu")
        window = state["window"].to(device)
        self._window = window if window.numel() > 0 else None
        self._seen = int(state["seen"])
        self._pending = list(state["pending"].to(device).unbind()) if state["pending"].numel() else []
        self._pending_at = [(int(epoch), int(iteration)) for epoch, iteration in state["pending_at"]]
        self._steps_since_check = int(state["steps_since_check"])
        self._cooldown_left = int(state["cooldown_left"])

    # --- the check at the end of a step ------------------------------------------------------------------------
    def _check(self, tl: "TrainLoop") -> None:
        """Judge the losses since the last check (one host copy, after one all-reduce in a distributed run); keep
        the run if they are clean, else roll back."""
        losses = torch.stack([value.float() for value in self._pending])
        own_flags, medians = self._spikes(losses)
        agreed = tl.all_reduce_sum(own_flags.float()).cpu()  # the interval's only host synchronisation
        spiking = agreed.nonzero()
        if spiking.numel() == 0:
            if self._steps_since_check >= self.snapshot_every:  # a scheduled check moves the window on
                self._window = torch.cat([self._window, losses]) if self._window is not None else losses
                self._window = self._window[-self.window:].clone()
                self._seen += len(losses)
                self._pending, self._pending_at, self._steps_since_check = [], [], 0
                first_epoch = tl.epoch
                self._epoch_rngs = {epoch: rng for epoch, rng in self._epoch_rngs.items() if epoch >= first_epoch}
            self._keep(tl)
            return
        raise self._rollback_request(tl, int(spiking[0]), own_flags, losses, medians)

    def _spikes(self, losses: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per batch of ``losses``: whether it spikes, and the median of the ``window`` losses before it (all on the
        device, no synchronisation)."""
        device, count = losses.device, len(losses)
        earlier = self._window if self._window is not None else losses.new_zeros(0)
        padding = losses.new_full((self.window - len(earlier),), float("nan"))
        rows = torch.cat([padding, earlier, losses]).unfold(0, self.window, 1)[:count]  # row i: the window before i
        medians = rows.nanmedian(dim=1).values
        checked = self._seen + torch.arange(count, device=device) >= max(self.warmup, 1)
        flags = ~torch.isfinite(losses) | (checked & (losses > self.factor * medians))
        return flags, medians

    def _keep(self, tl: "TrainLoop") -> None:
        """Keep the run as it is now (right after an optimizer step, every callback done with the batch)."""
        previous, self._snapshot = self._snapshot, None  # a memory snapshot's copy is freed before the next is taken
        where = dict(epoch=tl.epoch, iteration=tl.iteration, batches_done=tl.run_state.batches_done)
        if self.snapshot == "memory":
            del previous
            self._snapshot = _KeptPoint(snapshot=RunSnapshot.take(tl, mid_epoch=True), **where)
            return
        callback = self._checkpoint_callback
        owned = tl.is_main_process and not _checkpoint_exists(tl, callback)  # else another callback saved it here
        path = callback.save_resume_checkpoint()
        path = tl.broadcast_object(path)  # the main process knows it
        self._snapshot = _KeptPoint(path=path, checkpoint_callback=callback, owned=owned, **where)
        if previous is not None and previous.path != path:
            previous.discard()

    def _rollback_request(self, tl: "TrainLoop", first: int, own_flags: torch.Tensor, losses: torch.Tensor,
                          medians: torch.Tensor) -> RollBack:
        """The RollBack for the first spiking batch ``first`` of the interval (or the error that ends training)."""
        epoch, iteration = self._pending_at[first]
        kept = self._snapshot
        history = tl.run_state.rollbacks
        low = kept.batches_done if kept is not None and kept.epoch == epoch else 0
        wanted = iteration - self.skip_batches + 1
        iterations = range(max(wanted, low), iteration + 1)
        positions = [history.loader_position(epoch, skipped) for skipped in iterations]
        own = (bool(own_flags[first]), float(losses[first]), float(medians[first]),
               batch_indices(tl.train_loader, epoch, self._epoch_rngs.get(epoch), positions))
        per_rank = tl.all_gather_objects(own)  # a rollback is rare: the spiking rank's numbers for all
        spiked = next(values for values in per_rank if values[0])
        samples = None if any(values[3] is None for values in per_rank) else \
            [index for values in per_rank for index in values[3]]
        spike = {"epoch": epoch, "iteration": iteration, "loss": spiked[1], "median": spiked[2],
                 "skipped_samples": samples}
        if kept is None:
            raise SpikeRollbackError(f"loss spike at epoch {epoch + 1}, iteration {iteration} (loss {spiked[1]}, median "
                                     f"{spiked[2]}) before SpikeRollback kept any clean point: nothing to return to",
                                     list(tl.rollbacks), spike)
        if len(tl.rollbacks) >= self.max_rollbacks:
            listed = "\n".join(f"  {_describe(record)}" for record in tl.rollbacks) or "  (none)"
            raise SpikeRollbackError(f"loss spike at epoch {epoch + 1}, iteration {iteration} (loss {spiked[1]}, median "
                                     f"{spiked[2]}) after max_rollbacks={self.max_rollbacks} rollback(s); training "
                                     f"stops. The rollbacks:\n{listed}", list(tl.rollbacks), spike)
        if wanted < low:
            logger.warning("SpikeRollback: skip_batches=%d reaches before the kept point (epoch %d, iteration %d): "
                           "leaving out %d batch(es) only", self.skip_batches, kept.epoch + 1, kept.iteration,
                           len(positions))
        record = dict(spike, restored={"epoch": kept.epoch, "iteration": kept.iteration})
        if tl.is_main_process:
            logger.warning("SpikeRollback: %s; rolling back", _describe(record))
        self._write_records(tl, list(tl.rollbacks) + [record])
        return RollBack(self._restore, [(epoch, position) for position in positions], record)

    def _restore(self, tl: "TrainLoop") -> Optional[MidEpochResume]:
        resume = self._snapshot.restore(tl)  # this callback's detection state goes back with the run
        self._cooldown_left = self.cooldown_steps if self.lr_factor is not None else 0
        self._saved_lrs, self._stepped = {}, False
        return resume

    def _write_records(self, tl: "TrainLoop", records: List[dict]) -> None:
        folder = tl.experiment_folder
        if folder is None and self._checkpoint_callback is not None:
            folder = self._checkpoint_callback.experiment_folder
        if folder is None or not tl.is_main_process:
            return
        path = os.path.join(folder.ensure(folder.path), ROLLBACKS_FILE)
        atomic_write_text(path, json.dumps([_json_record(record) for record in records], indent=2))


def _checkpoint_callback(tl: "TrainLoop") -> Any:
    from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback
    for callback in tl.callbacks:
        if isinstance(callback, CheckpointCallback) and callback.has_experiment_folder:
            return callback
    raise ValueError("SpikeRollback(snapshot='checkpoint') keeps its clean points as checkpoints, but no checkpoint "
                     "callback with an experiment folder is registered: register ModelCheckpoint or "
                     "ModelIterationCheckpoint (or train with a TrainLoopCheckpoint preset), or use "
                     "snapshot='memory'")


def _checkpoint_exists(tl: "TrainLoop", callback: Any) -> bool:
    """Whether the mid-epoch checkpoint ``save_resume_checkpoint`` is about to write exists already (an iteration
    checkpoint callback saved this step)."""
    from aitoolbox.experiment.local_save.checkpoints import checkpoint_file_name
    from aitoolbox.experiment.local_save.sharded_checkpoints import sharded_checkpoint_name
    folder = callback.experiment_folder
    name = checkpoint_file_name(folder.experiment_name, folder.timestamp, tl.epoch, tl.total_iteration_idx)
    if callback.saves_shards:
        name = sharded_checkpoint_name(name)
    return os.path.exists(os.path.join(folder.checkpoint_dir, name))


def _describe(record: dict) -> str:
    # Epochs counted from 1, as the epoch's summary line (the record keeps the 0-based index).
    text = (f"spike at epoch {record['epoch'] + 1}, iteration {record['iteration']}: loss {record['loss']:.6g}, "
            f"median {record['median']:.6g}")
    if "restored" in record:
        text += f"; back to epoch {record['restored']['epoch'] + 1}, iteration {record['restored']['iteration']}"
    return text


def _json_record(record: dict) -> dict:
    """JSON has no NaN or infinity: a non-finite loss or median is written as a string ("nan", "inf")."""
    return {key: (str(value) if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in record.items()}
