"""Loss spikes undone automatically: detect a spike, roll the run back to the last clean point, replay the interval
without the bad batches, go on.

Detection costs no host-device synchronisation per batch: each batch's loss (``tl.last_batch_loss``, the sum of a
MultiLoss's parts) stays on the device in a list, and once per check (every ``snapshot_every`` optimizer steps, and
at each epoch's end) the whole interval is judged in a few tensor operations (:mod:`.spike_rules`) and copied to the
host once (under DDP/FSDP after one all-reduce of the per-batch flags, so that every process agrees). On a spike the
loop itself rolls back (see :mod:`aitoolbox.torchtrain.train_loop.rollback`); the batches left out are part of the
run's state and of its checkpoints. The points kept, and what a rollback does to checkpoints on disk, are
:mod:`.spike_points`'. See the "Undoing loss spikes" docs page.
"""
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.checkpoints import loaded_checkpoint_folder
from aitoolbox.torchtrain.data.loader_info import resets_own_iterator
from aitoolbox.torchtrain.host_copy import host_copy
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.handler import overrides_hook
from aitoolbox.torchtrain.callbacks.spike_points import (
    PIN_FOLDER, KeptPoint, checkpoints_on_disk, clear_pins, pin_checkpoint, read_pinned_point, remove_checkpoints_after,
    unpin)
from aitoolbox.torchtrain.callbacks.spike_rules import Judgement, LossHistory, make_rule, positive_number, remember
from aitoolbox.torchtrain.callbacks.rollback_request import RollBack, describe_point, describe_spike, spike_numbers

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop
    from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume

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


class SpikeRollback(AbstractCallback):
    """Detect a loss spike, return the run to the last clean point, replay it without the bad batches, go on.

    **The rule** (:class:`~aitoolbox.torchtrain.callbacks.spike_rules.RobustRule`): a batch loss is a spike when it is
    not finite, or, once ``warmup`` losses were seen, its rise above the median of the ``window`` clean losses before
    it exceeds all of ``threshold`` robust standard deviations of those losses (1.4826 x their median absolute
    deviation), ``tail_factor`` times the second largest such rise among the last ``memory`` clean losses, and
    ``min_rise`` (default: 5 % of the run's scale, the median absolute loss of the window at the last check). Rises are differences, so negative
    losses are judged like positive ones, and the run's own healthy outliers set the bar: on a small-batch run whose
    healthy batches reach hundreds of times the median, only a loss well beyond them counts. Passing ``factor`` selects the
    rule of aitoolbox before issue 34 instead (:class:`~aitoolbox.torchtrain.callbacks.spike_rules.FactorRule`: a
    loss above ``factor`` times the median), which fires on the noise of small-batch runs and cannot judge negative
    losses.

    **The check**: every ``snapshot_every`` optimizer steps, the losses since the last check are judged; if they are
    clean, the run is kept (``snapshot='memory'``: a
    :class:`~aitoolbox.torchtrain.train_loop.run_snapshot.RunSnapshot` in host memory; ``'checkpoint'``: a mid-epoch
    checkpoint by the registered checkpoint callback, pinned so that no pruning removes it, for models too large to
    copy and for FSDP). A ``fit`` that starts with nothing pending judgement is clean at its start: with
    ``'memory'`` that start is the first point (a resumed one adopts, with ``'checkpoint'``, the pin at its
    position); else its first step is checked and kept. The last step of each ``fit`` is checked too, and the
    losses not yet judged at each epoch's end (before evaluation and ``on_epoch_end``): a stop request
    (EarlyStopping, TerminateOnNaN, a callback's ``stop_training``) never ends training on an unseen spike.

    **The rollback**: the run returns to the kept point (weights, optimizers, loss scaler, schedulers, callbacks'
    states, RNG, data position, history); checkpoints the run's checkpoint callbacks wrote after that point are
    deleted (they hold the run being undone); the ``skip_batches`` batches ending at the first spiking one (in its
    epoch, never before the kept point) are left out: the run goes on as if the loader had never yielded them,
    bitwise. With ``lr_factor``, every parameter group's learning rate is multiplied by it for the ``cooldown_steps``
    optimizer steps after the rollback, during the step only. After ``max_rollbacks`` rollbacks, the next spike stops
    training with :class:`SpikeRollbackError`.

    Each rollback is recorded: ``tl.rollbacks`` (dicts with ``epoch`` and ``iteration`` of the spiking batch, the
    loop's 0-based counters, ``loss``, ``median`` (the centre it was judged against), ``limit`` (the loss above which
    it was a spike), ``skipped_samples``: the dataset indices of the batches left out when the sampler knows them,
    else None; under DDP every process's, by rank; and ``restored``: the epoch and iteration of the last batch trained
    before the kept point), ``train_history['rollbacks']`` (the rollbacks of each epoch, 0 included) and, with an
    experiment folder (the presets, or the checkpoint callback's with ``snapshot='checkpoint'``),
    ``rollbacks.json``.

    Args:
        factor: None (default) for the rule above; a number selects aitoolbox's earlier rule (a loss above
            ``factor`` x the median of the window is a spike) and cannot be combined with the rule's settings.
        window: how many earlier clean losses the centre and spread are taken over.
        warmup: batch losses seen before the rule applies (non-finite losses are spikes from the start).
        snapshot_every: optimizer steps between checks (and snapshots).
        skip_batches: batches left out per spike: the spiking one and those just before it.
        lr_factor: multiply the learning rates by this for ``cooldown_steps`` steps after a rollback (None: no).
        cooldown_steps: optimizer steps the ``lr_factor`` applies to.
        max_rollbacks: rollbacks allowed over the run; the spike after them stops training.
        snapshot: ``'memory'`` (a copy of the whole run in host memory: about the size of the model and optimizer
            states) or ``'checkpoint'`` (a registered checkpoint callback's ``save_resume_checkpoint``).
        execution_order: position among the callbacks; keep it below the LR schedulers' (default 0), so that the
            learning rate is put back before they step.
        threshold: robust standard deviations a rise must exceed (default 10).
        tail_factor: how many times the second largest recent clean rise a rise must exceed (default 5).
        memory: how many recent clean losses' rises ``tail_factor`` looks back over (default 1000).
        min_rise: the smallest rise that can be a spike, in the loss's units (default None: 5 % of the run's scale,
            the median absolute loss of the window refreshed at each check; where the loss sits at exactly 0,
            ``tail_factor`` times the last scale that was not 0).
    """

    def __init__(self, factor: Optional[float] = None, window: int = 100, warmup: int = 50,
                 snapshot_every: int = 100, skip_batches: int = 1, lr_factor: Optional[float] = None,
                 cooldown_steps: int = 0, max_rollbacks: int = 3, snapshot: str = "memory",
                 execution_order: int = -20, *, threshold: Optional[float] = None,
                 tail_factor: Optional[float] = None, memory: Optional[int] = None, min_rise: Optional[float] = None):
        super().__init__("Spike rollback", execution_order=execution_order)
        self.rule = make_rule(factor, threshold, tail_factor, memory, min_rise)
        for name, value, minimum in (("window", window, 1), ("warmup", warmup, 0),
                                     ("snapshot_every", snapshot_every, 1), ("skip_batches", skip_batches, 1),
                                     ("cooldown_steps", cooldown_steps, 0), ("max_rollbacks", max_rollbacks, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if lr_factor is not None and not positive_number(lr_factor):
            raise ValueError(f"lr_factor must be None or a number > 0, got {lr_factor!r}")
        if cooldown_steps > 0 and lr_factor is None:
            raise ValueError(f"cooldown_steps={cooldown_steps} needs lr_factor (the factor the learning rate is "
                             "multiplied by during the cooldown)")
        if snapshot not in SNAPSHOT_KINDS:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_KINDS}, got {snapshot!r}")
        self.factor = None if factor is None else float(factor)
        self.window, self.warmup = window, warmup
        self.snapshot_every, self.skip_batches = snapshot_every, skip_batches
        self.lr_factor, self.cooldown_steps, self.max_rollbacks = lr_factor, cooldown_steps, max_rollbacks
        self.snapshot = snapshot
        # The detection state (saved in checkpoints; a rollback puts back the kept point's).
        self._history = LossHistory(torch.zeros(0), torch.zeros(0))
        self._pending: List[torch.Tensor] = []  # losses since the last check, on the device
        self._pending_at: List[Tuple[int, int]] = []  # their (epoch, iteration)
        self._pending_stepped: List[bool] = []  # whether an optimizer step ended each (gradient accumulation)
        self._steps_since_check = 0
        self._checked_at: Optional[Dict[str, int]] = None  # where the last check left nothing pending
        # The (epoch, iteration) of the last pending loss judged clean (None: none since the last rollback). Saved:
        # a run resumed (or a fit begun) with its pending losses judged clean keeps its start (review 48s F1, F4).
        self._judged_up_to: Optional[Tuple[int, int]] = None
        # Where the point kept last lies (epoch, iteration, batches_done): the point the run that never stopped
        # returns to, which a start kept after judged losses stands for (see _keep_start). Saved.
        self._point_at: Optional[Dict[str, int]] = None
        self._cooldown_left = 0
        # Per process, rebuilt: the kept point, a step's lowered learning rates, the epochs' starting RNG states.
        self._snapshot: Optional[KeptPoint] = None
        self._saved_lrs: Dict[int, List[float]] = {}
        self._stepped = False
        self._epoch_rngs: Dict[int, dict] = {}
        self._checkpoint_callback: Any = None
        self._pins_unsettled = False  # snapshot='checkpoint': an earlier process's pin not yet adopted or cleared
        # snapshot='checkpoint': the file the fit resumed from (its run folder may hold the pin, see _adopt_pin).
        self._resumed_from: Optional[str] = None
        self._start_due = False  # snapshot='memory': the fit's start not yet kept or passed over (see _keep_start)
        self._started_with: Optional[int] = None
        self._start_not_kept = False
        # (epoch, loader position) of the batches left out for a non-finite state because their own loss was not
        # finite: kept through rollbacks (unlike the detection state), to tell a cause one step earlier. Saved (a run
        # resumed between the two rollbacks of such a blame blames as the run that never stopped, review 48s F3).
        self._state_suspects: set = set()
        # Whether the state was finite right after a pending step whose next batch was left out as such a suspect
        # (a 0-d bool on the device, by the step's (epoch, iteration)): a NaN loss that follows it is its batch's own
        # where it was, the step's where not (see _blame_state; review 49s R6). Measured in the replay, or recorded
        # by a judgement that found the state finite after the last pending step (review 50s S1, S2). Part of the
        # detection state, saved.
        self._finite_after: Dict[Tuple[int, int], torch.Tensor] = {}
        # snapshot='memory': the point kept when an exception stopped the last fit, for the fit that continues it
        # in this process (review 48s F10; see on_exception).
        self._carried: Optional[KeptPoint] = None

    # --- hooks -------------------------------------------------------------------------------------------------
    def on_train_begin(self) -> None:
        tl = self.train_loop_obj
        if self.snapshot == "memory" and tl.shards_parameters:
            raise ValueError("SpikeRollback(snapshot='memory') cannot keep a sharded (FSDP) run in memory: each "
                             "process holds only its shards. Use snapshot='checkpoint' with a checkpoint callback "
                             "(e.g. ModelCheckpoint, or a TrainLoopCheckpoint preset)")
        # A new fit: its start, or a point kept at its first step (see _keep_start); a fit continuing one an exception
        # stopped (no checkpoint loaded since) goes on with that fit's point, as the run that never stopped.
        carried, self._carried = self._carried, None
        self._snapshot = carried if tl.pending_restore is None else None
        # Decided once a resumed checkpoint's states are in place: the fit's start in on_epoch_begin, an earlier
        # process's pin at the first batch (see _settle_pins).
        # (Not a fit that begins by finishing an epoch's end an exception interrupted: the next epoch is not its
        # start, the end is.)
        self._start_due = self.snapshot == "memory" and not tl.run_state.continuation_pending \
            and self._snapshot is None
        self._started_with: Optional[int] = None  # the losses pending at the fit's first batch (for an error)
        self._start_not_kept = False  # a callback ordered before this one has an on_epoch_begin (see _keep_start)
        if self.snapshot == "checkpoint":
            self._checkpoint_callback = _checkpoint_callback(tl)
            self._pins_unsettled = True
            self._resumed_from = tl.run_state.pending_source if tl.pending_restore is not None else None
        if not tl.finishes_interrupted_step:  # else that step's hooks still run, with the state they left
            self._put_back_lrs()  # lowered for a step an exception abandoned: the window is trained again
            self._stepped = False

    def on_epoch_begin(self) -> None:
        if self._start_due:
            self._start_due = False
            self._keep_start(self.train_loop_obj)

    def _keep_start(self, tl: "TrainLoop") -> None:
        """``snapshot='memory'``, the first ``on_epoch_begin`` of a ``fit`` (the run's states in place, a loaded
        checkpoint's included): where nothing is pending judgement (a fresh run, a run resumed or continued right
        after a check), the run as it stands is clean, the point the run that never stopped kept last: a spike at
        the fit's first steps returns here. Kept as the checkpoint the run stands at (the replay's on_epoch_begin
        runs again, as for a checkpoint taken here). So also where the losses pending were judged clean in this
        process (the last step of the fit before, review 48m M4). Where losses are pending unjudged, the first step's
        check keeps the point, as before (nothing earlier is known to be clean); so it does where a callback ordered
        before this one has an ``on_epoch_begin``: what it did (drawn random numbers, its state) is in the point
        already, and the replay's ``on_epoch_begin`` would do it again.

        Where the pending losses were judged clean (here, or in the process that saved the checkpoint: at a stop
        signal, at an epoch's end, review 48s F1, F4), the start stands for the point kept before them, the one the
        run that never stopped returns to: a rollback leaves out what that run's does and records its point, or
        stops with an error where that run's would leave out a batch trained before this start (skip_batches
        reaching back over the judged losses; see :meth:`_rollback_request`)."""
        unjudged = bool(self._pending) and (self._judged_up_to != self._pending_at[-1] or self._point_at is None)
        if unjudged or tl.finishes_interrupted_step or resets_own_iterator(tl.train_loader):
            # (A loader with persistent workers continues an epoch by resetting its own iterator, which a restored
            # checkpoint does not: a run resumed from the epoch start of one is not bitwise; see checkpoint_state.)
            return
        if self._epoch_begins_before_this(tl):
            self._start_not_kept = True  # named in the error of a spike with nothing to return to
            return
        try:
            checkpoint = host_copy(tl.checkpoint_state())
        except RuntimeError as error:  # a position no checkpoint can hold: the first step keeps the point
            logger.info("SpikeRollback: the start of this fit cannot be kept (%s); the first step's is", error)
            return
        batches, total = int(checkpoint["iteration"]), int(checkpoint["iteration_idx"])
        where = dict(epoch=tl.epoch, iteration=batches - 1, batches_done=batches, total_iteration=total)
        if self._checked_at is not None and self._checked_at["total_iteration"] == total:
            # Where the last check left nothing pending, as the run that never stopped keeps it (at an epoch's start:
            # the end of the epoch before): a rollback's record names the same point.
            where = dict(self._checked_at)
        stands_for = None
        if self._pending:
            # Losses judged clean are pending: the run that never stopped returns to the point kept before them.
            stands_for = self._point_at
        else:  # (its checkpoint names the point before; _restore puts this one back)
            self._point_at = {key: where[key] for key in ("epoch", "iteration", "batches_done")}
        on_disk = checkpoints_on_disk(_checkpoint_callbacks(tl)) if tl.is_main_process else {}
        self._snapshot = KeptPoint(checkpoint=checkpoint, on_disk=on_disk, stands_for=stands_for,
                                   start_iteration=tl.iteration, **where)  # (review 48s F8)

    def _epoch_begins_before_this(self, tl: "TrainLoop") -> bool:
        """Whether a callback ordered before this one overrides ``on_epoch_begin`` (review 48s F5)."""
        earlier = tl.callbacks[:tl.callbacks.index(self)]  # (in execution order)
        return any(overrides_hook(callback, "on_epoch_begin") for callback in earlier)

    def on_batch_begin(self) -> None:
        self._start_due = False
        if self._started_with is None:
            self._started_with = len(self._pending)
        if self._pins_unsettled:
            self._pins_unsettled = False
            self._settle_pins(self.train_loop_obj)

    def _settle_pins(self, tl: "TrainLoop") -> None:
        """A run resumed with losses not yet judged (killed or preempted after a spike, before the check) returns to
        the point the interrupted process kept, if one is pinned; so does a run resumed with nothing to judge (right
        after a check) where that check's point is pinned at the resumed position: it is clean, and the run that
        never stopped would return there. Else an earlier process's pin goes."""
        self._snapshot = self._adopt_pin(tl, at_resumed_position=not self._pending)
        if self._snapshot is None and tl.is_main_process:
            clear_pins(self._checkpoint_callback.experiment_folder.checkpoint_dir)

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        tl = self.train_loop_obj
        if self._cooldown_left > 0 and tl.optimizer_step_due and optimizer_idx not in self._saved_lrs:
            groups = tl.optimizers[optimizer_idx].param_groups
            self._saved_lrs[optimizer_idx] = [group["lr"] for group in groups]
            for group in groups:
                group["lr"] = group["lr"] * self.lr_factor

    def on_after_optimizer_step(self) -> None:
        self._stepped = True
        self._put_back_lrs()  # exactly the values the step found, before any scheduler steps

    def _put_back_lrs(self) -> None:
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
        self._pending_stepped.append(self._stepped)
        if tl.epoch not in self._epoch_rngs:
            self._epoch_rngs[tl.epoch] = tl.epoch_start_rng_state
        if not self._stepped:
            return
        if self._state_suspects and self._left_out_after(tl, len(self._pending) - 1):
            # Only in a replay past a batch left out for a non-finite state: no host synchronisation, no cost else.
            self._finite_after[self._pending_at[-1]] = _state_finite(tl, self._pending[-1].device)
        self._stepped = False
        self._steps_since_check += 1
        if self._cooldown_left > 0:
            self._cooldown_left -= 1
        if self._snapshot is None or self._steps_since_check >= self.snapshot_every or self._last_step_of_fit(tl):
            tl.run_state.call_after_step(self._check)  # once every callback finished the batch
        elif tl.iteration + 1 == tl.run_state.num_batches:  # (None: a loader without len)
            # The epoch's last step: its losses are judged before any callback's on_epoch_train_end, whatever the
            # callbacks' order (one saving a checkpoint there before SpikeRollback's hook saved them unjudged, a
            # spike among them, review 47r D3). The same losses and state on_epoch_train_end would judge.
            tl.run_state.call_after_step(self._judge_epoch_end)

    @staticmethod
    def _last_step_of_fit(tl: "TrainLoop") -> bool:
        """The batch ends the ``fit``: its tail is checked too (a spike there would otherwise end the run unseen,
        or be found by the next ``fit``, which keeps no point before it)."""
        if tl.num_iterations > 0:
            return tl.total_iteration_idx + 1 >= tl.num_iterations
        return tl.epoch + 1 >= tl.num_epochs and tl.iteration + 1 == tl.run_state.num_batches

    def on_epoch_train_end(self) -> None:
        tl = self.train_loop_obj
        self._start_due = False
        # Before evaluation and on_epoch_end, where stop requests come from: a stopped run never ends on a spike it
        # did not judge (a loader without len, a stop mid-epoch or mid-window). A rollback from here is raised out
        # of the epoch's end, which the loop redoes after returning to the kept point. Mostly judged already, at
        # the epoch's last step (see on_batch_end).
        if self._pending and self._snapshot is not None and self._judged_up_to != self._pending_at[-1]:
            self._judge_epoch_end(tl)
        tl.insert_metric_result_into_history("rollbacks", sum(record["epoch"] == tl.epoch for record in tl.rollbacks))

    def on_train_end(self) -> None:
        self._release()

    def on_exception(self, exception: BaseException) -> None:
        # A pinned point outlives the process (a preempted or failed job resumes with the losses after it not yet
        # judged, see _adopt_pin); the next fit clears it where it is not needed. A point in memory is kept for a
        # fit that continues this one in the process (the loop continues it bitwise: the point is the one the run
        # that never stopped returns to); the next fit frees it where a checkpoint was loaded in between.
        if self.snapshot == "memory":
            # (None where this fit kept no point: its on_train_begin took over the carried one, or did not run (an
            # exception before it), which leaves the carried one in place, review 49s R2.)
            if self._snapshot is not None:
                self._carried, self._snapshot = self._snapshot, None
            return
        self._release(keep_pin=True)

    def _adopt_pin(self, tl: "TrainLoop", at_resumed_position: bool = False) -> Optional[KeptPoint]:
        """The pinned point an interrupted earlier process kept, when it lies at or before where this run resumes
        (``at_resumed_position``: exactly there; at the first batch, ``total_iteration_idx`` is the batch's own)
        (every process gets it from the main process); None where there is none.

        A run resumed into a new run folder (``load_checkpoint`` without ``continue_run_folder``) finds no pin in its
        own folder: the pin of the run folder its checkpoint was read from is taken over (copied into this folder's
        pin folder; the old run folder is left as it is), so that the run returns where the run that never stopped
        does (review 49x X2)."""
        found = None
        if tl.is_main_process:
            checkpoint_dir = self._checkpoint_callback.experiment_folder.checkpoint_dir
            found = self._usable_pin(tl, checkpoint_dir, at_resumed_position)
            source_dir = _checkpoint_dir_of(self._resumed_from)
            if found is None and source_dir is not None and \
                    os.path.realpath(source_dir) != os.path.realpath(checkpoint_dir):
                found = self._usable_pin(tl, source_dir, at_resumed_position)
                if found is not None:
                    pin, where = found
                    clear_pins(checkpoint_dir)  # an earlier process's pin of this folder, not the one to return to
                    # The checkpoints of this folder now are not the run being undone.
                    where = dict(where, on_disk=checkpoints_on_disk(_checkpoint_callbacks(tl)))
                    try:
                        found = pin_checkpoint(pin, where, checkpoint_dir=checkpoint_dir), where
                        logger.info("SpikeRollback: the pinned point of the run folder resumed from (%s) is taken "
                                    "over into this run's checkpoint folder", pin)
                    except OSError as error:  # (review 50k K14: a full disk; before the broadcast the others wait in)
                        clear_pins(checkpoint_dir)  # what a failed copy left
                        found = None
                        logger.warning("SpikeRollback: the pinned point of the run folder resumed from (%s) could not "
                                       "be taken over into this run's checkpoint folder (%s): the run goes on without "
                                       "it, and a spike whose skip reaches before this fit's first point stops with "
                                       "SpikeRollbackError", pin, error)
        found = tl.broadcast_object(found)
        if found is None:
            return None
        pin, where = found
        logger.info("SpikeRollback: the run resumes with %d loss(es) not yet judged; the clean point kept %s (%s) is "
                    "the one to return to", len(self._pending), "there" if at_resumed_position else "before it",
                    os.path.basename(pin))
        return KeptPoint(pin=pin, checkpoint_callback=self._checkpoint_callback, **where)

    @staticmethod
    def _usable_pin(tl: "TrainLoop", checkpoint_dir: str, at_resumed_position: bool) -> Optional[Tuple[str, dict]]:
        """The pin in ``checkpoint_dir`` where it lies as :meth:`_adopt_pin` needs (else None)."""
        found = read_pinned_point(checkpoint_dir)
        last_trained = tl.total_iteration_idx - 1
        if found is not None and (found[1]["total_iteration"] != last_trained if at_resumed_position
                                  else found[1]["total_iteration"] > tl.total_iteration_idx):
            return None
        return found

    def _release(self, keep_pin: bool = False) -> None:
        """The end of a fit: the host memory of the kept point is freed, its pin (not the checkpoint the callback
        wrote, which stays resumable) deleted unless ``keep_pin``."""
        point, self._snapshot = self._snapshot, None
        if point is not None and point.pin is not None and self.train_loop_obj.is_main_process and not keep_pin:
            clear_pins(os.path.dirname(os.path.dirname(point.pin)))  # <checkpoint_dir>/spike_rollback/<name>

    # --- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The detection state (the window of clean losses, the memory of their rises, the losses since the last
        check, the counters)."""
        history = self._history
        pending = torch.stack([value.float() for value in self._pending]).cpu() if self._pending else torch.zeros(0)
        return {"window": history.window.cpu(), "seen": history.seen, "rises": history.rises.cpu(),
                "rise_scales": history.scales_of_rises().cpu(),
                "reference": None if history.reference is None else float(history.reference), "pending": pending, "pending_at": [list(at) for at in self._pending_at],
                "pending_stepped": list(self._pending_stepped),
                "steps_since_check": self._steps_since_check, "cooldown_left": self._cooldown_left,
                "checked_at": None if self._checked_at is None else dict(self._checked_at),
                "judged_up_to": None if self._judged_up_to is None else list(self._judged_up_to),
                "point_at": None if self._point_at is None else dict(self._point_at),
                "state_suspects": sorted([epoch, position] for epoch, position in self._state_suspects),
                "finite_after": [[epoch, iteration, bool(flag)] for (epoch, iteration), flag in
                                 self._finite_after.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Put back what :meth:`state_dict` returned (a checkpoint from before the rises were kept: none yet)."""
        device = self.train_loop_obj.device if self.train_loop_obj is not None else torch.device("cpu")
        rises = state.get("rises")
        rise_scales = state.get("rise_scales")  # None in a checkpoint from before: those rises count unscaled only
        reference = state.get("reference")
        self._history = LossHistory(state["window"].float().to(device),
                                    rises.float().to(device) if rises is not None else torch.zeros(0, device=device),
                                    int(state["seen"]),
                                    None if reference is None else torch.tensor(float(reference), device=device),
                                    None if rise_scales is None else rise_scales.float().to(device))
        self._pending = list(state["pending"].to(device).unbind()) if state["pending"].numel() else []
        self._pending_at = [(int(epoch), int(iteration)) for epoch, iteration in state["pending_at"]]
        # A checkpoint from before the steps were recorded: each batch counts as its own step.
        self._pending_stepped = [bool(stepped) for stepped in
                                 state.get("pending_stepped", [True] * len(self._pending_at))]
        self._steps_since_check = int(state["steps_since_check"])
        self._cooldown_left = int(state["cooldown_left"])
        # None in a checkpoint from before these were kept: its pending losses are judged again where needed (the
        # same losses, the same judgement), and a resumed fit keeps its first point at its first step.
        judged_up_to, point_at = state.get("judged_up_to"), state.get("point_at")
        self._judged_up_to = None if judged_up_to is None else (int(judged_up_to[0]), int(judged_up_to[1]))
        self._point_at = None if point_at is None else {key: int(value) for key, value in point_at.items()}
        checked_at = state.get("checked_at")  # None in a checkpoint from before it was kept
        self._checked_at = None if checked_at is None else {key: int(value) for key, value in checked_at.items()}
        # Replaced, as a new loop loading the checkpoint has them (review 49s R4); a rollback's restore keeps the
        # suspects found since the point as well (see _restore).
        self._state_suspects = {(int(epoch), int(position)) for epoch, position in state.get("state_suspects", [])}
        self._finite_after = {(int(epoch), int(iteration)): torch.tensor(bool(flag), device=device)
                              for epoch, iteration, flag in state.get("finite_after", [])}

    # --- the check at the end of a step ------------------------------------------------------------------------
    def _flags(self, tl: "TrainLoop") -> Tuple[Judgement, torch.Tensor]:
        """The judgement of the pending losses and, agreed by all processes, on the host: a flag per loss (a spike),
        a flag per loss (not finite) and whether the weights or optimizer states are not finite (the last)."""
        losses = torch.stack([value.float() for value in self._pending])
        history = self._history
        if history.window.device != losses.device:  # e.g. a state loaded before the loop knew its device
            self._history = history = LossHistory(history.window.to(losses.device), history.rises.to(losses.device),
                                                  history.seen, history.reference,
                                                  history.scales_of_rises().to(losses.device))
        judgement = self.rule.judge(history, losses, self.window, self.warmup)
        # A batch can have a finite loss and non-finite gradients (a sqrt or norm of an exact 0, a custom backward):
        # its step ruins the weights while its loss looks clean. Checked here, with the flags, at no extra sync.
        state_bad = (~_state_finite(tl, losses.device)).float()[None]
        flags = torch.cat([judgement.flags.float(), (~torch.isfinite(losses)).float(), state_bad])
        agreed = tl.all_reduce_sum(flags).cpu()  # the interval's only host synchronisation
        if agreed[-1] == 0:
            self._note_finite_after_last_step(losses.device)
        return judgement, agreed

    def _note_finite_after_last_step(self, device: torch.device) -> None:
        """Record that the state is finite after the last pending step (it is the state now: nothing stepped since).

        Every judgement that finds the state finite measured it there. A point kept with losses pending (a fit's
        first step, a start kept after a stop signal's or an epoch end's judgement) lies after that step, so a
        replay from it never measures it; without the record, a NaN batch right after the point blamed that
        healthy step (its window before the point: an error on resume, or rollbacks that left out nothing, review
        50s S1, S2). A host bool already known; the flag is made on the device, no synchronisation."""
        stepped = [index for index, done in enumerate(self._pending_stepped) if done]
        if stepped:
            self._finite_after[self._pending_at[stepped[-1]]] = torch.ones((), dtype=torch.bool, device=device)

    def _judge(self, tl: "TrainLoop") -> Tuple[Judgement, Optional[int], Optional[int]]:
        """Judge the losses since the last check, and whether the weights and optimizer states are still finite.

        Returns the judgement, the first index to blame all processes agree on (None: clean) and, when the run's
        state is not finite, the last index to leave out with it (else None). One host copy, after one all-reduce
        in a distributed run.
        """
        judgement, agreed = self._flags(tl)
        count = len(self._pending)
        spiking = agreed[:count].nonzero()
        first = int(spiking[0]) if spiking.numel() else None
        if agreed[-1] == 0:
            return judgement, first, None
        non_finite = agreed[count:2 * count].nonzero()
        cause, last = self._blame_state(tl, int(non_finite[0]) if non_finite.numel() else count)
        if first is not None and first < cause:  # an earlier spike: the rollback undoes the later steps anyway
            return judgement, first, None
        return judgement, cause, last

    def _blame_state(self, tl: "TrainLoop", non_finite: int) -> Tuple[int, int]:
        """The pending batches ``(first, last)`` to leave out when the weights or optimizer states are not finite
        at a check. ``non_finite``: the first pending batch whose loss was not finite (the count when none was).

        With every loss finite, the interval's last step ruined the state: its accumulation window is left out.
        Else the cause is that batch (its loss was not finite by itself, the common case) or the step before it (a
        finite loss with non-finite gradients, after which every loss is NaN): the two look alike at a check. The
        batch is left out first; the replay measures the state right after the step before the batch left out (see
        on_batch_end). Where that step left it non-finite, the step is the cause and its window is left out (one
        more rollback); where it left it finite, the next NaN loss is its own batch's (adjacent bad batches, each
        left out alone, review 49s R6): no healthy batch is lost to a guess.
        """
        count = len(self._pending)
        stepped = [index for index in range(count) if self._pending_stepped[index]]
        if non_finite < count:
            before = [index for index in stepped if index < non_finite]
            if not before or not self._left_out_after(tl, before[-1]) or self._finite_after_step(tl, before[-1]):
                self._state_suspects.add(self._position(tl, non_finite))
                return non_finite, non_finite
        else:
            before = stepped
        if not before:  # cannot be: a check follows a step
            return count - 1, count - 1
        earlier = [index for index in stepped if index < before[-1]]
        return (earlier[-1] + 1 if earlier else 0), before[-1]

    def _finite_after_step(self, tl: "TrainLoop", index: int) -> bool:
        """Whether the state was finite right after pending step ``index``, measured in the replay (see on_batch_end)
        or by a judgement right after it (see :meth:`_note_finite_after_last_step`) (agreed by every process: a
        sharded parameter is judged on each process's shards). Where it was not (a checkpoint from before the flags
        were saved, or before judgements recorded them), a step at or before the kept point is the last before it
        (the batch after the step lies after the point): the point's state is that step's, and finite (a point is only
        kept so; review 50s S1). Else False: the step is blamed, as before."""
        flag = self._finite_after.get(self._pending_at[index])
        if flag is None:
            kept = self._snapshot
            return kept is not None and self._pending_at[index] <= (kept.epoch, kept.iteration)
        # (The same branch in every process: the suspects and the pending steps agree. A rare blame's one sync.)
        return bool(tl.all_reduce_sum((~flag).float()[None]).cpu()[0] == 0)

    def _position(self, tl: "TrainLoop", index: int) -> Tuple[int, int]:
        """The (epoch, loader position) of pending batch ``index``."""
        epoch, iteration = self._pending_at[index]
        return epoch, tl.run_state.rollbacks.loader_position(epoch, iteration)

    def _left_out_after(self, tl: "TrainLoop", index: int) -> bool:
        """Whether the batch the loader yielded right after pending batch ``index`` was left out of this run for a
        non-finite state (see :meth:`_blame_state`)."""
        epoch, position = self._position(tl, index)
        # Within the epoch: a step at an epoch's end is judged there, before the next epoch's losses.
        return (epoch, position + 1) in self._state_suspects

    def on_stop_signal(self) -> None:
        """The loop, in every process at the step where a stop signal (SIGTERM) ends training, before the checkpoint
        it saves (see :mod:`~aitoolbox.torchtrain.train_loop.interrupts`). ``snapshot='memory'`` keeps its point in
        this process only: a spike among the pending losses would be saved in the checkpoint with nothing for the
        resumed run to return to (review 47r D2). So they are judged now, and a spike rolled back where the check
        would certainly leave out the same batches: a loss flagged while the weights and optimizer states are
        finite (each loss is judged against the same window at any moment), or a non-finite state with a non-finite
        loss among them (blamed from the first such loss, whatever comes after). Nothing is kept, the window does
        not move; the run stops at the point it returned to (the checkpoint is the point's, nothing pending: the
        resumed run keeps its start). A non-finite state with every loss finite is blamed on the last step's window,
        which depends on the losses still to come (see :meth:`_blame_state`): the run returns to the point without
        leaving anything out and stops there; the resumed run replays the same batches, and its check blames them as
        the run that never stopped (review 48s F2, F11)."""
        tl = self.train_loop_obj
        if self.snapshot != "memory" or not self._pending or self._snapshot is None \
                or self._judged_up_to == self._pending_at[-1]:
            return
        _, agreed = self._flags(tl)  # (not _judge yet: blaming a non-finite state records suspects)
        count = len(self._pending)
        state_bad, spiking = bool(agreed[-1] != 0), bool(agreed[:count].any())
        if state_bad and not agreed[count:2 * count].any():
            # Returned to the point, nothing left out: the resumed run replays the same batches and its check blames
            # them as the run that never stopped (review 48s F11: a checkpoint with NaN weights was saved, and
            # the one the resumed run's error named could be pruned already).
            logger.warning("SpikeRollback: stopping with the weights or optimizer states not finite since the last "
                           "check, every loss finite: the run returns to the point kept at %s, leaving nothing "
                           "out, and the stop's checkpoint is saved there",
                           describe_point(dict(epoch=self._snapshot.epoch, iteration=self._snapshot.iteration)))
            raise RollBack(lambda loop: self._restore(loop, rolled_back=False), [], None)
        if spiking or state_bad:
            judgement, first, last = self._judge(tl)  # as the check would
            raise self._rollback_request(tl, first, judgement, last)  # the run stops at the point (see interrupts)
        self._judged_up_to = self._pending_at[-1]

    def _judge_epoch_end(self, tl: "TrainLoop") -> None:
        """Judge the losses since the last check at the end of an epoch's training: roll back if one is a spike
        (nothing is kept and the window does not move: the next check judges them again, alike)."""
        judgement, first, last = self._judge(tl)
        if first is not None:
            raise self._rollback_request(tl, first, judgement, last)
        self._judged_up_to = self._pending_at[-1]

    def _check(self, tl: "TrainLoop") -> None:
        """Judge the losses since the last check; keep the run if they are clean, else roll back."""
        judgement, first, last = self._judge(tl)
        if first is not None:
            raise self._rollback_request(tl, first, judgement, last)
        self._judged_up_to = self._pending_at[-1]  # (the epoch's end need not judge them again)
        scheduled = self._steps_since_check >= self.snapshot_every
        if scheduled:  # a scheduled check moves the window on
            self._history = remember(self._history, torch.stack([value.float() for value in self._pending]),
                                     judgement, self.window, self.warmup, getattr(self.rule, "memory", 0))
            self._pending, self._pending_at, self._pending_stepped, self._steps_since_check = [], [], [], 0
            self._finite_after = {}
            self._checked_at = dict(epoch=tl.epoch, iteration=tl.iteration, batches_done=tl.run_state.batches_done,
                                    total_iteration=tl.total_iteration_idx)
            first_epoch = tl.epoch
            self._epoch_rngs = {epoch: rng for epoch, rng in self._epoch_rngs.items() if epoch >= first_epoch}
        self._keep(tl, scheduled)

    def _keep(self, tl: "TrainLoop", scheduled: bool = True) -> None:
        """Keep the run as it is now (right after an optimizer step, every callback done with the batch).

        ``scheduled``: at a scheduled check, where the run that never stopped keeps its point too. The first point of
        a fit kept at an unscheduled check (its first step: no start kept, no pin adopted) while the run's state
        names an earlier point (``_point_at``, from the checkpoint it resumed from, or the fit before) stands for
        that point, the one the run that never stopped returns to: a rollback records it, and one whose skip would
        reach before this point stops with an error instead of leaving out fewer batches (review 49x X2)."""
        previous, self._snapshot = self._snapshot, None  # a memory snapshot's copy is freed before the next is taken
        where = dict(epoch=tl.epoch, iteration=tl.iteration, batches_done=tl.run_state.batches_done,
                     total_iteration=tl.total_iteration_idx)
        stands_for = self._point_at if previous is None and not scheduled and self._point_at is not None else None
        if stands_for is not None:
            where["stands_for"] = dict(stands_for)  # (and the state saved with the point names it)
        else:
            self._point_at = {key: where[key] for key in ("epoch", "iteration", "batches_done")}  # before it is saved
        if self.snapshot == "memory":
            del previous
            on_disk = checkpoints_on_disk(_checkpoint_callbacks(tl)) if tl.is_main_process else {}
            self._snapshot = KeptPoint(snapshot=tl.take_snapshot(mid_epoch=True), on_disk=on_disk, **where)
            return
        callback = self._checkpoint_callback
        alone = tl.is_main_process and not _checkpoint_exists(tl, callback)  # else another callback saved it here
        path = callback.save_resume_checkpoint()
        callback.wait_for_pending_save()  # the pin links the complete file
        where["on_disk"] = checkpoints_on_disk(_checkpoint_callbacks(tl)) if tl.is_main_process else {}
        pin = pin_checkpoint(path, where) if tl.is_main_process else None
        path, pin = tl.broadcast_object((path, pin))  # the main process knows them
        self._snapshot = KeptPoint(pin=pin, checkpoint_callback=callback, written=path if alone else None, **where)
        if previous is not None and tl.is_main_process:
            previous.discard(keep=[path, pin])

    def _rollback_request(self, tl: "TrainLoop", first: int, judgement: Judgement,
                          last: Optional[int] = None) -> RollBack:
        """The RollBack for the first spiking batch ``first`` of the interval (or the error that ends training).
        ``last``: when the weights or optimizer states were not finite, the last pending batch left out with it
        (the batches from ``first`` to ``last``, see :meth:`_blame_state`)."""
        epoch, iteration = self._pending_at[first]
        kept = self._snapshot
        history = tl.run_state.rollbacks
        # The point the run that never stopped returns to (a start kept after judged losses stands for it).
        anchor = None if kept is None else (kept.stands_for or dict(epoch=kept.epoch, iteration=kept.iteration,
                                                                   batches_done=kept.batches_done))
        low = anchor["batches_done"] if anchor is not None and anchor["epoch"] == epoch else 0
        wanted = iteration - self.skip_batches + 1
        iterations = range(max(wanted, low), iteration + 1)
        skipped = [(epoch, history.loader_position(epoch, at)) for at in iterations]
        skipped += [(at_epoch, history.loader_position(at_epoch, at)) for at_epoch, at in
                    self._pending_at[first + 1:(first if last is None else last) + 1]]
        loss = self._pending[first]
        own = (last is not None or bool(judgement.flags[first]), float(loss), float(judgement.centres[first]),
               float(judgement.limits[first]), self._batch_indices(tl, skipped))
        per_rank = tl.all_gather_objects(own)  # a rollback is rare: the spiking rank's numbers for all
        spiked = next(values for values in per_rank if values[0])
        samples = None if any(values[4] is None for values in per_rank) else \
            [index for values in per_rank for index in values[4]]
        spike = {"epoch": epoch, "iteration": iteration, "loss": spiked[1], "median": spiked[2], "limit": spiked[3],
                 "skipped_samples": samples}
        if last is not None:
            spike["non_finite_state"] = True  # the weights or optimizer states, after this batch's step
        if kept is None:
            raise SpikeRollbackError(f"{describe_spike(spike)} ({spike_numbers(spike)}) before SpikeRollback kept any "
                                     f"clean point: nothing to return to{self._resume_hint()}", list(tl.rollbacks),
                                     spike)
        if len(tl.rollbacks) >= self.max_rollbacks:
            listed = "\n".join(f"  {_describe(record)}" for record in tl.rollbacks) or "  (none)"
            raise SpikeRollbackError(f"{describe_spike(spike)} ({spike_numbers(spike)}) after max_rollbacks="
                                     f"{self.max_rollbacks} rollback(s); training stops. The rollbacks:\n{listed}",
                                     list(tl.rollbacks), spike)
        if kept.stands_for is not None and kept.epoch == epoch and iterations.start < kept.batches_done:
            # The batches to leave out begin among those judged clean before this fit's start, which this run
            # trained already: returning to the start would leave out fewer than the run that never stopped.
            raise SpikeRollbackError(
                f"{describe_spike(spike)} ({spike_numbers(spike)}): skip_batches={self.skip_batches} reaches before "
                + self._first_point_text(kept, anchor), list(tl.rollbacks), spike)
        if wanted < low:
            logger.warning("SpikeRollback: skip_batches=%d reaches before the kept point (%s): leaving out %d "
                           "batch(es) only", self.skip_batches, describe_point(anchor), len(iterations))
        record = dict(spike, restored={"epoch": anchor["epoch"], "iteration": anchor["iteration"]})
        if tl.is_main_process:
            logger.warning("SpikeRollback: %s; rolling back", _describe(record))
        self._write_records(tl, list(tl.rollbacks) + [record])
        return RollBack(self._restore, skipped, record)

    def _first_point_text(self, kept: KeptPoint, anchor: Dict[str, int]) -> str:
        """Why a fit's first point ``kept``, which stands for ``anchor``, cannot leave out what the run that never
        stopped does, and what to do (the tail of the error)."""
        if kept.start_iteration is not None:  # the fit's start, kept after losses judged clean
            why = (f"the start of this fit ({_where(kept)}), over loss(es) judged clean but not yet checked when the "
                   "run was saved")
        else:  # kept at the fit's first step (review 49x X2)
            why = (f"the first point this fit kept ({_where(kept)}, at its first step), and the point the run that "
                   f"never stopped returns to ({describe_point(anchor)}) is not available here "
                   f"(snapshot='{self.snapshot}': " +
                   ("a copy in memory, released at the end of each fit or process" if self.snapshot == "memory" else
                    "no pin of it in this run's checkpoint folder, nor in the folder of the checkpoint it resumed "
                    "from") + ")")
        if self.snapshot == "checkpoint" and kept.start_iteration is None:
            # (Review 50k K5: the checkpoint of the last check may be the one resumed from; only its pin helps.)
            return (why + "; the run that never stopped would leave those batches out too, which this run cannot. "
                    "Resume in the run folder that holds the point's pin (checkpoint_model/spike_rollback/ of the run "
                    "that kept it: load_checkpoint(..., continue_run_folder=True) there, or a checkpoint of that "
                    "folder loaded into a new one), or with snapshot='memory' from a checkpoint written at a check "
                    f"({describe_point(anchor)}), whose fit keeps its start")
        return (why + "; the run that never stopped would leave those batches out too, which this run cannot. Resume "
                f"from a checkpoint written at or before the last check ({describe_point(anchor)}), if one is kept")

    def _resume_hint(self) -> str:
        """For the error of a spike with no point kept: what to do where the run resumed with losses its checkpoint
        held unjudged (the point kept before them is what is missing)."""
        if self._start_not_kept:
            earlier = [type(callback).__name__ for callback in self.train_loop_obj.callbacks[
                :self.train_loop_obj.callbacks.index(self)] if overrides_hook(callback, "on_epoch_begin")]
            return (f". The fit's start was not kept as a point: {', '.join(earlier)} (ordered before SpikeRollback) "
                    "has an on_epoch_begin, which a rollback's replay would run twice; give it an execution_order "
                    "above SpikeRollback's to keep the start")
        if not self._started_with:  # a fresh run's first step, snapshot='checkpoint'
            return ""
        where = self._checked_at
        last_check = "" if where is None else (f" (epoch {where['epoch'] + 1}, iteration {where['iteration']}, "
                                               f"total iteration {where['total_iteration']})")
        # (Review 48s F9: the pending losses may have been judged clean, and come from the fit before this one in
        # the same process as well as from a loaded checkpoint: the message claims neither.)
        return (f". This fit started with {self._started_with} loss(es) of the run before it not checked yet (from "
                "the previous fit, or held by the checkpoint it resumed from), so it keeps its first point at its "
                "first step, and the point kept before those losses is gone (snapshot="
                f"'{self.snapshot}': " + ("a copy in memory, released at the end of each fit or process"
                                          if self.snapshot == "memory" else "no pin in its checkpoint folder") +
                f"). Resume from a checkpoint written at or before the last check{last_check}, if one is kept" +
                (", or train with snapshot='checkpoint', whose point outlives the process"
                 if self.snapshot == "memory" else ""))

    def _batch_indices(self, tl: "TrainLoop", skipped: List[Tuple[int, int]]) -> Optional[List[int]]:
        """The dataset indices of the ``(epoch, position)`` batches left out (None where the sampler cannot say)."""
        indices: List[int] = []
        for epoch in dict.fromkeys(at_epoch for at_epoch, _ in skipped):
            found = tl.batch_indices(epoch, self._epoch_rngs.get(epoch),
                                     [position for at_epoch, position in skipped if at_epoch == epoch])
            if found is None:
                return None
            indices += found
        return indices

    def _restore(self, tl: "TrainLoop", rolled_back: bool = True) -> Optional["MidEpochResume"]:
        """Return the run to the kept point; ``rolled_back``: for a spike's rollback (the cooldown starts), else a
        return that leaves nothing out (before a stop signal's checkpoint, see :meth:`on_stop_signal`)."""
        point = self._snapshot
        suspects = set(self._state_suspects)  # found since the point (and the blame of this rollback): they stay
        resume = point.restore(tl)  # this callback's detection state goes back with the run
        self._state_suspects |= suspects
        remove_checkpoints_after(tl, point, _checkpoint_callbacks(tl))
        if tl.is_main_process:
            unpin(point)
        if rolled_back:
            self._cooldown_left = self.cooldown_steps if self.lr_factor is not None else 0
        self._saved_lrs, self._stepped = {}, False
        # (_judged_up_to is the point's, put back with its state: the losses pending there that were judged clean
        # stay judged, saved so in a stop signal's checkpoint taken there (review 49s R1). The abandoned run's,
        # which a replayed batch's (epoch, iteration) could match, is gone with it.)
        self._point_at = point.stands_for or dict(epoch=point.epoch, iteration=point.iteration,
                                                  batches_done=point.batches_done)
        return resume

    def _write_records(self, tl: "TrainLoop", records: List[dict]) -> None:
        folder = tl.experiment_folder
        if folder is None and self._checkpoint_callback is not None:
            folder = self._checkpoint_callback.experiment_folder
        if folder is None or not tl.is_main_process:
            return
        path = os.path.join(folder.ensure(folder.path), ROLLBACKS_FILE)
        atomic_write_text(path, json.dumps([_json_record(record) for record in records], indent=2))


def _state_finite(tl: "TrainLoop", device: torch.device) -> torch.Tensor:
    """Whether every parameter and floating optimizer state of the run is finite (a 0-d bool on ``device``; no
    host synchronisation). A sharded parameter is judged on this process's shards (the flags are all-reduced)."""
    tensors = list(tl.model.parameters())
    for optimizer in tl.optimizers:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if torch.is_tensor(value) and value.is_floating_point()]
    flags = [(tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().isfinite().all().to(device)
             for tensor in tensors]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)


def _checkpoint_callbacks(tl: "TrainLoop") -> List[Any]:
    from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback
    return [callback for callback in tl.callbacks
            if isinstance(callback, CheckpointCallback) and callback.has_experiment_folder]


def _checkpoint_callback(tl: "TrainLoop") -> Any:
    callbacks = _checkpoint_callbacks(tl)
    if callbacks:
        return callbacks[0]
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


def _checkpoint_dir_of(source: Optional[str]) -> Optional[str]:
    """The ``checkpoint_model/`` folder a loaded checkpoint came from (:func:`loaded_checkpoint_folder`; review 50k K4,
    50t T1/T2, 50f G6), or a folder given that holds a pin itself."""
    if source is None:
        return None
    resolved = os.path.realpath(os.path.expanduser(source))
    folder = loaded_checkpoint_folder(resolved)
    if folder == os.path.dirname(resolved) and os.path.isdir(os.path.join(resolved, PIN_FOLDER)):
        return resolved
    return folder


def _where(kept: KeptPoint) -> str:
    """A kept point as the messages name it (:func:`~.rollback_request.describe_point`)."""
    return describe_point({"epoch": kept.epoch, "iteration": kept.iteration})


def _describe(record: dict) -> str:
    text = f"{describe_spike(record)}: {spike_numbers(record)}"
    if "restored" in record:
        text += f"; back to {describe_point(record['restored'])}"
    return text


def _json_record(record: dict) -> dict:
    """JSON has no NaN or infinity: a non-finite loss or median is written as a string ("nan", "inf")."""
    return {key: (str(value) if isinstance(value, float) and not math.isfinite(value) else value)
            for key, value in record.items()}
