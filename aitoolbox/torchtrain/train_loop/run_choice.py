"""Which run a job continues (``auto_resume``) and which folder it writes to: decided once, by one process, and
carried to every other process of the job.

A single process decides when the preset is built. In a distributed job the decision waits until the process
group exists; then global rank 0 decides and broadcasts it (the run folder's timestamp and the checkpoint's place
in it), so that no rank continues another checkpoint or writes into a folder it named from its own clock. A rank
whose disk lacks the chosen checkpoint (node-local storage, an upload that lags) gets rank 0's state over the
process group; a sharded checkpoint cannot travel that way, so the job stops with an error naming the checkpoint
and the ranks.

auto_resume continues only a run of this job (see :mod:`~aitoolbox.experiment.local_save.run_identity`). A newest
checkpoint saved mid-epoch by another number of processes cannot continue (the epoch's batches were split among
those processes): the newest epoch-end checkpoint of the run is taken instead, with a warning saying what is lost.
"""
import dataclasses
import logging
import os
import posixpath
from typing import TYPE_CHECKING, Any, Optional, Tuple

from aitoolbox.cloud.layout import download_checkpoint, newest_cloud_run
from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, load_checkpoint_file
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, newest_resumable_run, run_checkpoints
from aitoolbox.experiment.local_save.run_identity import RunIdentity
from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError
from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint
from aitoolbox.experiment.local_save.train_end_marker import MAX_RECORD_BYTES, RECORD_FROM_CHECKPOINT

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.callbacks.cloud_upload import CloudDestination

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunDecision:
    """What every process of a job writes to and continues from (plain data: it is broadcast and saved).

    Attributes:
        timestamp: the run folder's timestamp (``<experiment>_<timestamp>``).
        created: the run folder exists (created, or a continued run's).
        checkpoint: the checkpoint to continue from, relative to the run folder; None: a new run.
        bucket_key: the checkpoint's key in the bucket when it came from there (a rank without it downloads it).
        sharded: the checkpoint is a sharded checkpoint's folder (every rank must read it from its own disk).
    """

    timestamp: str
    created: bool
    checkpoint: Optional[str] = None
    bucket_key: Optional[str] = None
    sharded: bool = False


def _shown_epoch(checkpoint: dict) -> object:
    """The checkpoint's epoch as messages show it: counted from 1, as the epoch's summary line counts."""
    epoch = checkpoint.get("epoch")
    return epoch + 1 if isinstance(epoch, int) else epoch


def resume_from_bucket(destination: "CloudDestination", root: str, project_name: str, experiment_name: str,
                       identity: Optional[RunIdentity] = None) -> Optional[Tuple[str, str, str]]:
    """``auto_resume`` when no local run has a checkpoint: the newest run of the experiment in the bucket that holds
    a complete checkpoint (and, with ``identity``, that this job may continue), whose newest checkpoint is
    downloaded into the local run folder of the same name.

    Returns:
        ``(timestamp, local checkpoint path, bucket key)``, or None.
    """
    storage = destination.storage()
    found = newest_cloud_run(storage, destination.cloud_dir_prefix, project_name, experiment_name, identity)
    if found is None:
        logger.info("auto_resume: no run of %s/%s with a checkpoint on the local disk nor in %s", project_name,
                    experiment_name, storage.uri(destination.cloud_dir_prefix))
        return None
    timestamp, key = found
    local_folder = _bucket_checkpoint_folder(destination, root, project_name, experiment_name, timestamp, key)
    logger.info("auto_resume: downloading %s to %s", storage.uri(key), local_folder)
    path = download_checkpoint(storage, key, local_folder, replace=False)
    _download_train_end_record(storage, key, local_folder)
    return timestamp, path, key


def _download_train_end_record(storage: Any, key: str, local_folder: str) -> None:
    """The record of the run's finished train ends, beside the checkpoint in the bucket (see
    :mod:`~aitoolbox.experiment.local_save.train_end_marker`): without it, a finished run continued from the bucket
    would run its train end again. None there (a run whose end did not finish): nothing to do."""
    record_key = posixpath.normpath(posixpath.join(posixpath.dirname(key.rstrip("/")), RECORD_FROM_CHECKPOINT))
    try:
        if storage.exists(record_key):
            # At most a record's size held or written (a bucket others write to: review 50e F5); larger is refused.
            data = storage.download_bytes(record_key, max_size=MAX_RECORD_BYTES)
            atomic_write_text(os.path.normpath(os.path.join(local_folder, RECORD_FROM_CHECKPOINT)),
                              data.decode("utf-8", errors="replace"))
    except Exception as error:  # the checkpoint is there: a run without the record repeats its end, no more
        logger.warning("auto_resume: could not download the train-end record %s (%s)", storage.uri(record_key), error)


def _bucket_checkpoint_folder(destination: "CloudDestination", root: str, project_name: str, experiment_name: str,
                              timestamp: str, key: str) -> str:
    run_key = destination.keys(ExperimentFolder(root, project_name, experiment_name, timestamp)).experiment
    return os.path.join(os.path.abspath(os.path.expanduser(root)), project_name, f"{experiment_name}_{timestamp}",
                        os.path.dirname(key[len(run_key) + 1:]))


def saved_shape(checkpoint: dict) -> Tuple[int, int]:
    """``(processes that saved it, batches of its epoch trained)`` of a loaded checkpoint (0 at an epoch's end)."""
    rng = checkpoint.get("rng")
    world_size = len(rng) if isinstance(rng, list) else int(checkpoint.get("world_size", 1))
    return world_size, int(checkpoint.get("iteration", 0) or 0)


def _read_checkpoint(path: str, weights_only: bool) -> Optional[dict]:
    """The checkpoint at ``path``, or None (with a warning naming it) when it cannot be read: truncated or corrupt
    (a save cut short on storage that is not atomic, a copy that broke), vanished or unreadable. The file is left as
    it is.

    Raises:
        UntrustedCheckpointError: the file holds objects that ``weights_only`` loading refuses: a planted or
            foreign file stops the job rather than being passed over quietly.
    """
    try:
        return load_checkpoint_file(path, weights_only=weights_only)
    except UntrustedCheckpointError:
        raise
    except Exception as error:  # every loader's documented errors (corrupt, truncated, not a checkpoint, I/O)
        logger.warning("auto_resume: cannot read the checkpoint %s (%s: %s); it is passed over and left as it is "
                       "(a later save of the same epoch and iteration replaces it: copy it elsewhere to keep it)",
                       path, type(error).__name__, error)
        return None


def usable_checkpoint(run_folder: str, newest: str, world_size: int,
                      weights_only: bool) -> Optional[Tuple[str, dict]]:
    """The checkpoint of a run that ``world_size`` processes can continue, loaded: ``newest``, or the newest
    earlier one of the run that can be read, when ``newest`` (and what came after the one returned) is truncated
    or corrupt, each passed over with a warning naming it; and when the newest readable one was saved mid-epoch by
    another number of processes, the run's newest readable epoch-end checkpoint before it (with a warning saying
    what is trained again). None when there is none: a new run starts.

    Raises:
        UntrustedCheckpointError: a checkpoint tried holds objects ``weights_only`` loading refuses.
    """
    newest_position = checkpoint_path_position(newest)
    candidates = [path for path in run_checkpoints(run_folder) if path != newest
                  and (newest_position is None or checkpoint_path_position(path) < newest_position)]
    refused = None  # (path, checkpoint): the newest readable one, saved mid-epoch by another number of processes
    for path in [newest] + candidates[::-1]:
        if refused is not None and (checkpoint_path_position(path) or (0, 0, 0))[1] != 1:
            continue  # after a refused mid-epoch checkpoint, only an epoch end can continue
        checkpoint = _read_checkpoint(path, weights_only)
        if checkpoint is None:
            continue
        saved_world_size, batches_done = saved_shape(checkpoint)
        if saved_world_size == world_size or batches_done == 0:
            if refused is not None:
                logger.warning("auto_resume: %s. Continuing from the epoch-end checkpoint %s instead: the training "
                               "done after it (in epoch %s) is lost and is done again, with the data split among %d "
                               "process(es)", _mid_epoch_refusal(*refused, world_size), os.path.basename(path),
                               _shown_epoch(refused[1]), world_size)
            elif path != newest:
                logger.warning("auto_resume: continuing from %s, the newest checkpoint of the run that can be read",
                               path)
            return path, checkpoint
        refused = path, checkpoint
    if refused is not None:
        logger.warning("auto_resume: %s, and the run has no readable epoch-end checkpoint before it: a new run starts",
                       _mid_epoch_refusal(*refused, world_size))
    else:
        logger.warning("auto_resume: no checkpoint of %s can be read: a new run starts (the run's folder and files "
                       "are left as they are)", run_folder)
    return None


def _mid_epoch_refusal(path: str, checkpoint: dict, world_size: int) -> str:
    saved_world_size, batches_done = saved_shape(checkpoint)
    return (f"{path} was saved by {saved_world_size} process(es) in the middle of epoch {_shown_epoch(checkpoint)} "
            f"({batches_done} batch(es) per process done) and this job has {world_size}: a mid-epoch checkpoint "
            "continues only with the number of processes that saved it")


def decide_run(folder: ExperimentFolder, destination: Optional["CloudDestination"], world_size: int,
               weights_only: bool, lazy: bool) -> Tuple[RunDecision, Optional[dict]]:
    """In the process that decides: the run to continue (with its checkpoint, loaded) or a new run in ``folder``
    (created now, or with ``lazy`` only its name reserved)."""
    root, project, experiment = folder.root, folder.project_name, folder.experiment_name
    found = newest_resumable_run(root, project, experiment, identity=folder.identity)
    bucket_key = None
    if found is None and destination is not None:
        from_bucket = resume_from_bucket(destination, root, project, experiment, folder.identity)
        if from_bucket is not None:
            found, bucket_key = from_bucket[:2], from_bucket[2]
    if found is not None:
        timestamp, newest = found
        run_folder = os.path.join(root, project, f"{experiment}_{timestamp}")
        usable = usable_checkpoint(run_folder, newest, world_size, weights_only)
        if usable is not None:
            path, checkpoint = usable
            bucket_key = bucket_key if path == newest else None
            return RunDecision(timestamp, True, os.path.relpath(path, run_folder), bucket_key,
                               sharded=os.path.isdir(path)), checkpoint
    if lazy:
        folder.reserve()
    else:
        folder.create()
        logger.info("Experiment folder: %s", folder.path)
    return RunDecision(folder.timestamp, not lazy), None


def _readable(path: str) -> bool:
    return os.path.isfile(path) or is_sharded_checkpoint(path)


def agree_on_run(tl: Any, decide: bool, provisional: Optional[RunDecision] = None) -> Tuple[RunDecision, Any]:
    """In every process of a distributed job, once the process group exists: rank 0 decides (``decide``: the
    auto_resume search, otherwise its own folder's name) and broadcasts; each process then adopts the run folder
    and returns ``(decision, what to load)``: a checkpoint path on this process's disk, rank 0's checkpoint dict
    (non-sharded, when a rank lacks the file), or None (a new run, or the checkpoint is loaded already).

    ``provisional`` is the choice this process's launcher made when the preset was built, before the group existed
    (and whose checkpoint is loaded): each node's launcher decided alone, maybe from a disk of its own and for one
    process. Rank 0 decides again and every process follows: one that continued another checkpoint loads rank 0's
    choice, one that continued a checkpoint where rank 0 starts a new run takes rank 0's initial state.

    Raises:
        RuntimeError: in every process: rank 0 could not decide, or a sharded checkpoint is missing on some ranks.
    """
    strategy, folder = tl.strategy, tl.experiment_folder
    decision, loaded, error = None, None, None
    if strategy.is_main_process:
        try:
            decision, loaded = _decide_in_rank_0(tl, decide, provisional)
        except Exception as exception:  # every rank must learn it, or the others wait in the broadcast
            error = f"rank 0 could not choose the run to continue: {type(exception).__name__}: {exception}"
    decision, error = tl.broadcast_object((decision, error))
    if error is not None:
        raise RuntimeError(error)
    folder.adopt(decision.timestamp, created=False)  # rank 0's own stays created
    if decision.created:
        folder.adopt_if_created_elsewhere()  # the other ranks: rank 0's folder, on storage they share
    _follow_rank_0(tl, decision, provisional)
    already_loaded = provisional is not None and decision.checkpoint is not None \
        and (provisional.timestamp, provisional.checkpoint) == (decision.timestamp, decision.checkpoint)
    if decision.checkpoint is None:
        return decision, None
    local_path = os.path.join(folder.path, decision.checkpoint)
    if not already_loaded and not strategy.is_main_process and not _readable(local_path) \
            and decision.bucket_key is not None and tl.cloud_destination is not None:
        try:
            download_checkpoint(tl.cloud_destination.storage(), decision.bucket_key, os.path.dirname(local_path),
                                replace=False)
        except Exception as exception:  # reported below with the ranks that lack it
            logger.warning("rank %d could not download %s: %s", strategy.rank, decision.bucket_key, exception)
    readable = strategy.all_gather_objects(already_loaded or _readable(local_path))
    if all(readable):
        if already_loaded:
            return decision, None
        return decision, loaded if strategy.is_main_process else local_path
    lacking = [rank for rank, has_it in enumerate(readable) if not has_it]
    if decision.sharded:
        raise RuntimeError(f"auto_resume: rank 0 continues {decision.checkpoint} of the run folder "
                           f"{folder.experiment_name}_{decision.timestamp}, which rank(s) {lacking} cannot read on "
                           "their disk (node-local storage?). A sharded checkpoint is read by every rank from its own "
                           "disk: put the run folder on storage all nodes share, or copy the checkpoint to the nodes "
                           "of those ranks, then start the job again")
    # A plain checkpoint travels: every rank takes rank 0's, so that all continue from the same state.
    if strategy.is_main_process:
        logger.warning("auto_resume: rank(s) %s cannot read %s on their disk: they get rank 0's checkpoint over the "
                       "process group", lacking, local_path)
    from_rank_0 = tl.broadcast_object(loaded)
    if already_loaded:
        return decision, None
    return decision, from_rank_0


def _decide_in_rank_0(tl: Any, decide: bool, provisional: Optional[RunDecision]) -> Tuple[RunDecision, Any]:
    folder = tl.experiment_folder
    if not decide:
        if not tl.lazy_experiment_save:
            folder.create()
        folder.reserve()
        return RunDecision(folder.timestamp, os.path.isdir(folder.path)), None
    decision, loaded = decide_run(folder, tl.cloud_destination, tl.strategy.world_size, tl.weights_only,
                                  tl.lazy_experiment_save)
    if decision.checkpoint is None and provisional is not None and provisional.checkpoint is not None:
        # This process holds that checkpoint's state and no initial state to go back to (its launcher loaded it).
        raise RuntimeError(f"this job's launcher continued {provisional.checkpoint} of the run folder "
                           f"{folder.experiment_name}_{provisional.timestamp} when the preset was built, and now no "
                           "checkpoint of it can be read (removed or damaged meanwhile?). Start the job again")
    return decision, loaded


def _follow_rank_0(tl: Any, decision: RunDecision, provisional: Optional[RunDecision]) -> None:
    """After rank 0's decision: the processes whose launcher had chosen otherwise are named, and those holding a
    checkpoint's state where rank 0 starts a new run take rank 0's initial state (a collective)."""
    strategy = tl.strategy
    chosen = (decision.timestamp, decision.checkpoint)
    choices = strategy.all_gather_objects(None if provisional is None
                                          else (provisional.timestamp, provisional.checkpoint))
    differing = {rank: choice for rank, choice in enumerate(choices) if choice is not None and choice != chosen}
    if differing and strategy.is_main_process:
        logger.warning("auto_resume: the launchers of rank(s) %s had chosen otherwise when the preset was built, "
                       "before the process group existed (%s); every process follows rank 0: %s", sorted(differing),
                       "; ".join(f"rank {rank}: {_describe(choice)}" for rank, choice in differing.items()),
                       _describe(chosen))
    needs_initial_state = [rank for rank, choice in enumerate(choices)
                           if choice is not None and choice[1] is not None and decision.checkpoint is None]
    if not needs_initial_state:
        return
    initial = tl.broadcast_object(_run_position(tl) if strategy.is_main_process else None)
    if strategy.rank in needs_initial_state:
        _take_run_position(tl, initial)


def _describe(choice: Tuple[str, Optional[str]]) -> str:
    timestamp, checkpoint = choice
    return f"continue {checkpoint} of run {timestamp}" if checkpoint else f"a new run ({timestamp})"


def _run_position(tl: Any) -> dict:
    """Rank 0's state before training, that a process which loaded a checkpoint takes to start a new run too."""
    return {"model": tl.model_for_user.state_dict(), "optimizers": [opt.state_dict() for opt in tl.optimizers],
            "loop": tl.state.state_dict(), "history": dict(tl.train_history),
            "rollbacks": tl.run_state.rollbacks.state_dict()}


def _take_run_position(tl: Any, position: dict) -> None:
    """Undo a checkpoint loaded by this process's launcher: every part a load sets (see
    :func:`~aitoolbox.torchtrain.train_loop.train_state.restore_train_state`) becomes rank 0's."""
    tl.strategy.load_model_state_dict(tl.model_for_user, position["model"])
    for optimizer, state in zip(tl.optimizers, position["optimizers"]):
        optimizer.load_state_dict(state)
    tl.state.load_state_dict(position["loop"])
    tl.train_history.clear()
    tl.train_history.update(position["history"])
    tl.run_state.rollbacks.load_state_dict(position["rollbacks"])
    tl.pending_restore = None
