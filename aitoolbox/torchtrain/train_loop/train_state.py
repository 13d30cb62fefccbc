"""Everything needed to continue a training run bitwise: capture it into a checkpoint dict and restore it.

A checkpoint holds the model (the user's module, no ``module.`` prefixes), the optimizers (with amp's float32
master weights in the precision state), the loss scaler, the state of every callback that has one (LR
schedulers, early stopping), the counters and whether training was stopped, the training history (under DDP
each rank's own, as its accumulated_loss is its own), and the RNG states of every rank (python, numpy, torch CPU and CUDA, and the training loader's own generators).
Everything in it loads with ``torch.load(weights_only=True)`` (numpy metrics are stored as numbers and tensors).

Mid-epoch checkpoints also hold the RNG state at the start of the epoch: on resume the epoch's data order is
drawn again from it, the batches already trained on are skipped (without loading them where the loader allows, see
:mod:`.data_position`; a loader with its own state, torchdata's ``StatefulDataLoader``, has that state saved too and
continues from it), and the RNG state of the checkpoint is put back.
"""
import dataclasses
import json
import logging
import os
import sys
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.experiment.local_save.checkpoints import (
    MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, SHARDED_CHECKPOINT_KEY, SHARDED_IDENTITY_KEY, failures_named,
    upgrade_checkpoint_format)
from aitoolbox.torchtrain.train_loop.data_position import (
    ITERATOR_KEY, continue_persistent_iterator, has_own_state, persistent_iterator_state)
from aitoolbox.torchtrain.train_loop.losses import EpochLossSum
from aitoolbox.torchtrain.train_loop.random_state import (  # noqa: F401 (weights_only_safe: importable from here)
    capture_draw_state, restore_draw_state, weights_only_safe)
from aitoolbox.torchtrain.data.loader_info import resets_own_iterator
from aitoolbox.torchtrain.train_loop.sampler_replay import check_loader_state_fits

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

# Where aitoolbox's own modules lie: a warning about the user's set-up names the first frame outside it.
_PACKAGE_FOLDER = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # aitoolbox/

# 2: aitoolbox 1.8's keys (model_state_dict, optimizer_state_dict, schedulers_state_dict, epoch, iteration_idx,
# hyperparams, amp) plus this package's state; 1: "model"/"optimizers" keys (upgraded when loaded).
FORMAT_VERSION = 2


def capture_rng_state(loader: Any = None, generators: Optional[List[torch.Generator]] = None) -> dict:
    """RNG states of this process and of ``loader``'s data order (its torch generators, the random states its
    samplers keep themselves, its persistent worker iterator), as weights-only-loadable values. ``generators``:
    ``loader``'s torch generators where the caller has them (see :func:`~.random_state.capture_draw_state`)."""
    state = capture_draw_state(loader, generators)
    iterator = persistent_iterator_state(loader) if loader is not None else None
    if iterator is not None:
        state[ITERATOR_KEY] = iterator
    return state


def restore_rng_state(state: dict, loader: Any = None) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    restore_draw_state(state, loader)
    if loader is not None:  # (states saved before this key existed hold none)
        continue_persistent_iterator(loader, state.get(ITERATOR_KEY))


@dataclasses.dataclass
class MidEpochResume:
    """Where training stopped inside an epoch: a mid-epoch checkpoint, or an exception in ``fit``.

    Attributes:
        batches_done: batches of the epoch trained (their optimizer steps taken).
        loss_sum: the sum of their losses (:meth:`~.losses.EpochLossSum.state`; from older checkpoints the sum
            itself, a list of sums for a MultiLoss).
        epoch_start_rng: the RNG state at the start of the epoch (its data order is drawn again from it).
        rng: the RNG state to continue with.
        batches_trained: the epoch's batches were all trained and its end (evaluation, ``on_epoch_end``) was
            interrupted: the steps of the end not finished yet are done (each step once).
        history_lengths: with ``batches_trained``, the length of each training-history list before the epoch's
            end (the epoch's summary line lists what the end recorded).
        finished_steps: with ``batches_trained``, the names of the steps of the epoch's end finished so far.
        finished_history_lengths: with ``batches_trained``, the length of each training-history list after those
            steps: what a step that did not finish recorded is dropped, so that it is not recorded twice.
        finish_step: the last of the ``batches_done`` batches has an optimizer step an exception interrupted after
            some optimizer had stepped: it is finished first (see :class:`~.step_runner.StepRunner`).
        loss_names: the names of the losses of the last batch done, for a MultiLoss (a checkpoint's; None: a
            plain loss, or the loop knows them): the epoch's accumulated loss is recorded under them also when no
            batch is left to train (an unsized loader's checkpoint after its last batch).
        loader_state: the training loader's own state after the batches done (a loader with ``state_dict``, such
            as torchdata's ``StatefulDataLoader``), which it continues from; None: the batches done are skipped.
    """

    batches_done: int
    loss_sum: Any
    epoch_start_rng: Optional[dict]
    rng: Optional[dict]
    batches_trained: bool = False
    history_lengths: Optional[Dict[str, int]] = None
    loader_state: Any = None
    finished_steps: List[str] = dataclasses.field(default_factory=list)
    finished_history_lengths: Optional[Dict[str, int]] = None
    finish_step: bool = False
    loss_names: Optional[List[str]] = None


def history_lengths(history: Any) -> Dict[str, int]:
    """The number of values of each metric of a training history."""
    return {name: len(values) for name, values in history.items()}


def truncate_history(history: Any, lengths: Dict[str, int]) -> None:
    """Drop what was recorded in ``history`` after :func:`history_lengths` returned ``lengths``."""
    for name in list(history):
        if name not in lengths:
            del history[name]
        else:
            del history[name][lengths[name]:]


def copied_history(history: Dict[str, list]) -> Dict[str, list]:
    """A checkpoint's training history with lists of its own: the loop appends to them, and the checkpoint dict
    (the caller's, or one a callback keeps) must stay as it was saved."""
    return {name: list(values) for name, values in history.items()}


def private_copy(value: Any) -> Any:
    """``value`` with every tensor cloned (on its device) and every container copied: what the loop loads it may keep
    and change in place (an optimizer keeps the state tensors it is given and steps them), and a checkpoint dict the
    caller holds must stay as it was saved, to be loaded again."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        copied = {key: private_copy(item) for key, item in value.items()}
        return OrderedDict(copied) if isinstance(value, OrderedDict) else copied
    if isinstance(value, list):
        return [private_copy(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(private_copy(item) for item in value)
    return value


def json_safe(value: Any) -> Any:
    """Hyperparameters as plain JSON types, so the checkpoint loads with ``weights_only=True``."""
    return json.loads(json.dumps(value, default=repr))


def stateful_callbacks(tl: "TrainLoop", include_schedulers: bool = True) -> Dict[str, Any]:
    """Registered callbacks with ``state_dict``/``load_state_dict`` (early stopping, LR schedulers...).

    Keyed ``<class name>:<n>``, n counting the callbacks of that class in execution order: the key of a
    callback stays the same when the resumed run adds other callbacks (ModelLoadContinueTraining, a logger).
    LR schedulers are saved apart, in 1.x's ``schedulers_state_dict`` list; ``include_schedulers`` finds them
    here too, for checkpoints of the first format.
    """
    schedulers = [] if include_schedulers else tl.get_schedulers()
    stateful: Dict[str, Any] = {}
    for callback in tl.callbacks:
        if any(callback is scheduler for scheduler in schedulers):
            continue
        if callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None)):
            name = type(callback).__name__
            count = sum(key.rsplit(":", 1)[0] == name for key in stateful)
            stateful[f"{name}:{count}"] = callback
    return stateful


def optimizer_state(tl: "TrainLoop") -> Any:
    """1.x's ``optimizer_state_dict``: the optimizer's state dict, or a list of them for several optimizers."""
    lacking = [type(opt).__name__ for opt in tl.optimizers if not callable(getattr(opt, "state_dict", None))]
    if lacking:
        raise TypeError(f"cannot checkpoint optimizer(s) {', '.join(lacking)}: a checkpoint needs the optimizer's "
                        "state_dict() and load_state_dict()")
    states = [tl.strategy.optimizer_state_dict(tl.loop_model, optimizer) for optimizer in tl.optimizers]
    return states[0] if isinstance(tl.optimizer, torch.optim.Optimizer) else states


def saved_optimizer_states(checkpoint: dict) -> List[dict]:
    """The optimizer states of a checkpoint as a list (1.x stores one optimizer's state dict by itself)."""
    states = checkpoint[OPTIMIZER_KEY]
    return [states] if isinstance(states, dict) else list(states)


def optimizer_hyperparameters(tl: "TrainLoop") -> Any:
    """The optimizers' ``param_groups`` without their parameters, as :func:`optimizer_state` nests them: what a
    sharded checkpoint keeps beside its DCP files (the learning rates LR schedulers set, restored at resume)."""
    states = [{"param_groups": [{key: value for key, value in group.items() if key != "params"}
                                for group in optimizer.param_groups]} for optimizer in tl.optimizers]
    return states[0] if isinstance(tl.optimizer, torch.optim.Optimizer) else states


def capture_train_state(tl: "TrainLoop", mid_epoch: bool, hyperparams: Optional[dict] = None,
                        include_weights: bool = True) -> dict:
    """The checkpoint of ``tl`` now. Call it in every process: the ranks' RNG states are gathered.

    Args:
        tl: the loop.
        mid_epoch: True inside an epoch (after an optimizer step), False at the end of an epoch. Where the run
            stands at an epoch boundary (see :attr:`~.run_state.RunState.inside_epoch_batches`: after a ``fit`` that
            ended with an epoch, before an epoch's first batch, in an epoch's end) the checkpoint is the epoch-end
            one either way: no batch of the next epoch is trained yet, and it continues with that epoch's first
            batch.
        hyperparams: stored with the checkpoint.
        include_weights: False leaves out the model state and the optimizers' states (only their parameter
            groups' hyperparameters are kept): the state a sharded checkpoint stores beside its DCP files.
    """
    # A mid-epoch checkpoint at an epoch boundary recorded the finished epoch's batch count (tl.iteration + 1) as a
    # position inside the next epoch, whose first batches a resume then skipped.
    mid_epoch = mid_epoch and tl.run_state.inside_epoch_batches
    # After an exception inside an epoch's batches the run is at its last step point, not at the batch that raised:
    # the position, the RNG state and the loss sum are that point's (the weights and buffers are already its); so
    # until the continuing fit trains past it.
    point = tl.run_state.continuation_point
    interrupted = point if mid_epoch else None
    if point is not None and point.batches_done == 0 and point.epoch_start_rng is not None:
        # Stopped in the epoch's first batch: the checkpoint starts that epoch again, from the random state it
        # started with (its data loader's iterator has drawn from the state since: a DataLoader draws its seed).
        rng = point.epoch_start_rng
    else:
        rng = interrupted.rng if interrupted is not None else capture_rng_state(tl.train_loader)
    rng_per_rank = tl.strategy.all_gather_objects(rng)
    # Not get_train_history_dict(): it warns (or raises, strict) on an empty history, which a run captured before
    # its first epoch ends rightly has. weights_only_safe copies every list.
    history = weights_only_safe(dict(tl.train_history.items()))
    checkpoint = {
        # aitoolbox 1.x's keys: 1.x loading code reads these.
        **({MODEL_KEY: tl.strategy.model_state_dict(tl.model_for_user)} if include_weights else {}),
        OPTIMIZER_KEY: optimizer_state(tl) if include_weights else weights_only_safe(optimizer_hyperparameters(tl)),
        SCHEDULERS_KEY: [weights_only_safe(scheduler.state_dict()) for scheduler in tl.get_schedulers()],
        "epoch": tl.epoch,
        "iteration_idx": tl.total_iteration_idx,
        "hyperparams": json_safe(redact_hyperparams(hyperparams or {})),  # never a secret in a file
        # What a bitwise continuation needs besides.
        "format_version": FORMAT_VERSION,
        "precision": tl.precision.state_dict(),
        "callbacks": {key: weights_only_safe(cb.state_dict())
                      for key, cb in stateful_callbacks(tl, include_schedulers=False).items()},
        "epochs_completed": tl.run_state.epochs_completed_at_checkpoint(mid_epoch),
        "iteration": (interrupted.batches_done if interrupted is not None else tl.iteration + 1) if mid_epoch else 0,
        # A stop request (early stopping) ends the run after this epoch: a fit resuming from here trains nothing
        # (a requeued job must not train on and overwrite the final model). Agreed by all ranks, as the loop
        # agrees after the epoch's end. A mid-epoch checkpoint does not record it: its epoch still has to end.
        "early_stop": False if mid_epoch else tl.strategy.any_process(bool(tl.state.early_stop)),
        "train_history": history,
        "rng": rng_per_rank,
        "world_size": tl.strategy.world_size,
    }
    rollbacks = tl.run_state.rollbacks
    if rollbacks.skipped or rollbacks.records:
        # The batches rollbacks left out and their records (SpikeRollback): a resumed run leaves out the same. Only
        # when there are any: a run without rollbacks writes the checkpoints it always wrote.
        checkpoint["rollbacks"] = rollbacks.state_dict()
    if tl.use_amp:
        checkpoint["amp"] = tl.amp_scaler.state_dict()
    if tl.strategy.world_size > 1:
        # Each rank's own history (its accumulated_loss is the mean over its own batches); the file rank 0
        # writes shows its history as "train_history", and each rank resumes with its own.
        checkpoint["train_history_per_rank"] = tl.strategy.all_gather_objects(history)
        checkpoint["train_history"] = checkpoint["train_history_per_rank"][0]
    if mid_epoch:
        epoch_loss = tl.run_state.epoch_loss if interrupted is None else EpochLossSum(interrupted.loss_sum)
        checkpoint["epoch_start_rng"] = tl.strategy.all_gather_objects(
            tl.epoch_start_rng_state if interrupted is None else interrupted.epoch_start_rng)
        # Per rank: under DDP each rank sums the losses of its own batches (its accumulated_loss). The sum, and what
        # continues it bit for bit (the sum of its complete blocks, the open block's values: losses.EpochLossSum).
        checkpoint["epoch_loss_sum"] = tl.strategy.all_gather_objects(epoch_loss.total().tolist())
        checkpoint["epoch_loss_state"] = tl.strategy.all_gather_objects(epoch_loss.state(include_pending=True))
        checkpoint["epoch_loss_names"] = interrupted.loss_names if interrupted is not None and \
            interrupted.loss_names is not None else tl.last_batch_loss_names
        if has_own_state(tl.train_loader):  # e.g. torchdata's StatefulDataLoader: it continues from its state
            # At a point an exception left, the loader has yielded the batch that raised (and what an accumulation
            # window had drawn past the point): its state is past the point. Without the state the point's own
            # (a loaded checkpoint's point not trained past yet holds one), the resume passes over the point's
            # batches from the epoch's start, as for any DataLoader, and trains the batch that raised.
            loader_state = interrupted.loader_state if interrupted is not None else tl.train_loader.state_dict()
            if interrupted is not None and loader_state is None and interrupted.batches_done > 0 \
                    and resets_own_iterator(tl.train_loader):
                # Passing over the point's batches from the epoch's start needs a new worker iterator, and the run
                # reset its persistent one instead: another order (the sampler iterated twice, new worker seeds).
                raise RuntimeError(
                    f"checkpoint_state(mid_epoch=True) after an exception inside an epoch cannot record where the "
                    f"run continues: the training loader {type(tl.train_loader).__name__} keeps its workers "
                    f"(persistent_workers=True) and has already yielded the batch that raised, so a resume would not "
                    f"train the batches of the uninterrupted run. Call fit() again to continue (it trains that batch "
                    f"again) and take the checkpoint after its next step, or build the loader with "
                    f"persistent_workers=False")
            if loader_state is not None:
                checkpoint["train_loader_state"] = tl.strategy.all_gather_objects(weights_only_safe(loader_state))
    return checkpoint


def warn_unresumable_epoch_start(tl: "TrainLoop", checkpoint: dict) -> None:
    """Warn, once per loop, that ``checkpoint`` (one the user keeps: ``checkpoint_state``, not an in-memory
    snapshot, review 48d F6) starts an epoch of a loader that resets its persistent worker iterator."""
    if checkpoint["iteration"] == 0 and not tl.run_state.persistent_workers_warned \
            and resets_own_iterator(tl.train_loader):
        tl.run_state.persistent_workers_warned = True  # the same for every epoch-end save of the run: said once
        warnings.warn(
            f"this checkpoint starts an epoch of the training loader {type(tl.train_loader).__name__} with "
            "persistent_workers=True, which the run continues by resetting its worker iterator: a run resumed from "
            "it makes a new one instead (the sampler iterated again, new worker seeds), so its data order and "
            "augmentation are not the uninterrupted run's. For a bitwise resume build the loader with "
            "persistent_workers=False, or resume from a mid-epoch checkpoint", UserWarning,
            stacklevel=_stacklevel_outside_package())


def _stacklevel_outside_package() -> int:
    """The ``stacklevel`` of a warning its caller gives that names the innermost frame outside aitoolbox: the
    user's call (``fit``, ``checkpoint_state``), however many of the package's frames (a checkpoint callback, the
    loop) lie between; 1 (the caller) when every frame is the package's (a thread it started)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_FOLDER):
        level, frame = level + 1, frame.f_back
    return level if frame is not None else 1


def restore_train_state(tl: "TrainLoop", checkpoint: dict) -> None:
    """Load a checkpoint into ``tl`` before ``fit``; the next ``fit`` continues exactly where it was saved.

    The model and optimizer states are loaded now, but those of a sharded checkpoint (``SHARDED_CHECKPOINT_KEY``)
    when the model is set up (:func:`load_pending_sharded_weights`): under FSDP each process then reads only its
    shards. The precision state (loss scale, master weights), callback
    states and RNG states are applied when ``fit`` has set up the model, registered the callbacks and is
    about to train, in every process of a distributed run.

    A file written by aitoolbox 1.x (no RNG state, no history) continues from the epoch after the saved one;
    that continuation is not bitwise (1.x did not save the random state).
    """
    checkpoint = upgrade_checkpoint_format(checkpoint)
    sharded = SHARDED_CHECKPOINT_KEY in checkpoint
    required = (OPTIMIZER_KEY, "epoch") if sharded else (MODEL_KEY, OPTIMIZER_KEY, "epoch")
    missing = [key for key in required if key not in checkpoint]
    if missing:
        raise ValueError(f"not an aitoolbox checkpoint: keys {missing} are missing (it has {sorted(checkpoint)})")
    loader_states = checkpoint.get("train_loader_state")
    if checkpoint.get("iteration", 0) > 0 and loader_states and tl.strategy.rank < len(loader_states) \
            and has_own_state(tl.train_loader):
        # Now, before any of the checkpoint is loaded: torchdata would fail on it only once the resumed epoch starts.
        check_loader_state_fits(tl.train_loader, loader_states[tl.strategy.rank])
    states = saved_optimizer_states(checkpoint)
    if len(states) != len(tl.optimizers):
        raise ValueError(f"the checkpoint holds {len(states)} optimizer state(s) but the TrainLoop "
                         f"has {len(tl.optimizers)} optimizer(s)")
    if not sharded:
        tl.strategy.load_model_state_dict(tl.model_for_user, checkpoint[MODEL_KEY])
        for optimizer, state in zip(tl.optimizers, states):  # a copy: the optimizer keeps the tensors it is given
            tl.strategy.load_optimizer_state_dict(tl.loop_model, optimizer, private_copy(state))
    if "rng" not in checkpoint:  # aitoolbox 1.x: saved at the end of epoch ``epoch``
        logger.warning("the checkpoint was written by aitoolbox 1.x: it holds no random state or training history, "
                       "so training continues from epoch %d but not bitwise as the original run would have",
                       checkpoint["epoch"] + 2)  # the next epoch's index + 1: counted as the epoch line counts
        checkpoint = dict(checkpoint, epochs_completed=checkpoint["epoch"] + 1, iteration=0,
                          train_history=dict(tl.train_history))
    tl.train_history.clear()
    tl.train_history.update(copied_history(checkpoint["train_history"]))
    tl.epoch = checkpoint["epoch"]
    tl.epochs_completed = checkpoint["epochs_completed"]
    tl.total_iteration_idx = checkpoint.get("iteration_idx", -1)
    tl.early_stop = bool(checkpoint.get("early_stop", False))  # checkpoints written before it was saved: False
    tl.run_state.rollbacks.load_state_dict(checkpoint.get("rollbacks"))  # before rollbacks existed: none
    tl.pending_restore = dict(checkpoint)  # its own dict: applying it pops keys, and the caller's stays whole


def load_pending_sharded_weights(tl: "TrainLoop") -> None:
    """Read the model and optimizer states of a loaded sharded checkpoint (see :func:`restore_train_state`) into
    ``tl``'s model and optimizers as they are now, once: sharded (each process reads its own shards, whatever the
    number of processes that saved them) or plain. A collective in a process group: every process calls it."""
    from aitoolbox.experiment.local_save.sharded_checkpoints import load_sharded_checkpoint
    checkpoint = tl.pending_restore
    if checkpoint is None or SHARDED_CHECKPOINT_KEY not in checkpoint:
        return
    path = checkpoint.pop(SHARDED_CHECKPOINT_KEY)
    identity = checkpoint.pop(SHARDED_IDENTITY_KEY, None)  # None: a dict the caller made names the folder itself
    logger.debug("loading the weights of the sharded checkpoint %s", path)
    with failures_named(path):
        load_sharded_checkpoint(path, tl.loop_model, tl.optimizers, expected_identity=identity)


def apply_pending_states(tl: "TrainLoop") -> Optional[MidEpochResume]:
    """At the start of ``fit``: restore precision, callback and RNG states of a loaded checkpoint.

    Returns:
        Where to resume inside the epoch, for a mid-epoch checkpoint; None otherwise.
    """
    checkpoint = tl.pending_restore
    if checkpoint is None:
        return None
    source = tl.run_state.pending_source
    tl.pending_restore = None
    # The entries applied now were checked only by kind when the file was read: what does not fit, or holds what
    # no checkpoint holds, names the file (as load_checkpoint's own errors do), not a bare TypeError at fit.
    with failures_named(source):
        return _apply_pending_states(tl, checkpoint)


def _apply_pending_states(tl: "TrainLoop", checkpoint: dict) -> Optional[MidEpochResume]:
    if "precision" in checkpoint:
        tl.precision.load_state_dict(checkpoint["precision"])
    elif checkpoint.get("amp"):
        tl.amp_scaler.load_state_dict(checkpoint["amp"])
    restore_callback_states(tl, checkpoint)
    # Schedulers built at registration reset the learning rate to its initial value; put the saved one back.
    for optimizer, state in zip(tl.optimizers, saved_optimizer_states(checkpoint)):
        for group, saved_group in zip(optimizer.param_groups, state["param_groups"]):  # (a tensor lr is changed in place)
            group.update({key: private_copy(value) for key, value in saved_group.items() if key != "params"})
    if "rng" not in checkpoint:
        return None
    rank = tl.strategy.rank
    rng_states: List[dict] = checkpoint["rng"]
    if len(rng_states) != tl.strategy.world_size:
        return continue_with_another_world_size(tl, checkpoint, len(rng_states))
    if "train_history_per_rank" in checkpoint:
        tl.train_history.clear()
        tl.train_history.update(copied_history(checkpoint["train_history_per_rank"][rank]))
    if checkpoint["iteration"] > 0:
        loader_states = checkpoint.get("train_loader_state")
        loss_sums = checkpoint.get("epoch_loss_state", checkpoint["epoch_loss_sum"])  # older checkpoints: the sum
        return MidEpochResume(batches_done=checkpoint["iteration"], loss_sum=loss_sums[rank],
                              epoch_start_rng=checkpoint["epoch_start_rng"][rank], rng=rng_states[rank],
                              loader_state=private_copy(loader_states[rank]) if loader_states else None,
                              loss_names=checkpoint.get("epoch_loss_names"))
    restore_rng_state(rng_states[rank], tl.train_loader)
    return None


def check_resumable_by(checkpoint: dict, world_size: int) -> None:
    """Refuse a mid-epoch checkpoint that ``world_size`` processes cannot continue: one saved by another number of
    processes. ``fit_distributed`` checks it before starting any process, and each process again at the start of
    fit (a checkpoint loaded there, or a torchrun job's).

    Raises:
        ValueError: the saved and the current number of processes, and what to do instead.
    """
    rng_states = checkpoint.get("rng")
    if rng_states is None or len(rng_states) == world_size or not checkpoint["iteration"] > 0:
        return
    saved_world_size = len(rng_states)
    raise ValueError(f"the checkpoint was saved by {saved_world_size} process(es) in the middle of an epoch and "
                     f"is resumed by {world_size}: a mid-epoch checkpoint continues only with the same number of "
                     f"processes (the epoch's batches were split among them). Resume with {saved_world_size} "
                     "process(es), or from an epoch-end checkpoint (auto_resume takes the run's newest epoch-end "
                     "checkpoint by itself in this case)")


def continue_with_another_world_size(tl: "TrainLoop", checkpoint: dict, saved_world_size: int) -> None:
    """An epoch-end checkpoint resumed by a different number of processes: the weights, optimizer and training
    state carry over, but each process now sees another share of the data, so the run goes on from the next
    epoch without being the bitwise continuation of the saved one (a warning says so).

    Raises:
        ValueError: a mid-epoch checkpoint: the batches done so far were another split of the data.
    """
    world_size = tl.strategy.world_size
    check_resumable_by(checkpoint, world_size)
    if tl.strategy.is_main_process:
        logger.warning("the checkpoint was saved by %d process(es) and is resumed by %d: training continues from "
                       "epoch %d with the saved weights and optimizer state, but not bitwise as the saved run would "
                       "have (the data is split differently)", saved_world_size, world_size,
                       checkpoint["epochs_completed"] + 1)
    restore_rng_state(checkpoint["rng"][tl.strategy.rank % saved_world_size], tl.train_loader)
    return None


def restore_callback_states(tl: "TrainLoop", checkpoint: dict) -> None:
    """Load the saved states into the registered callbacks: LR schedulers by position, the others by key."""
    saved_schedulers = checkpoint.get(SCHEDULERS_KEY)
    schedulers = tl.get_schedulers()
    if saved_schedulers and len(saved_schedulers) != len(schedulers):
        logger.warning("the checkpoint holds the states of %d LR scheduler(s) and this run registered %d, so the "
                       "schedulers start afresh: register the same callbacks (the LR schedulers, before fit or in "
                       "fit's callbacks) as in the saved run for an exact continuation",
                       len(saved_schedulers), len(schedulers))
    elif saved_schedulers:
        for scheduler, state in zip(schedulers, saved_schedulers):
            scheduler.load_state_dict(private_copy(state))  # copies: a callback may keep what it is given
    callbacks = stateful_callbacks(tl, include_schedulers=not saved_schedulers)
    for key, state in checkpoint.get("callbacks", {}).items():
        if key in callbacks:
            callbacks[key].load_state_dict(private_copy(state))
        elif state:  # an empty state (e.g. a ModelCheckpoint that ranks nothing) has nothing to continue
            logger.warning("the checkpoint holds the state of callback %s, which this run does not have: register the "
                           "same callbacks (e.g. the LR scheduler) as in the saved run for an exact continuation", key)
