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
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from aitoolbox.cloud.layout import download_checkpoint, newest_cloud_run
from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, load_checkpoint_file
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, newest_resumable_run, run_checkpoints
from aitoolbox.experiment.local_save.run_identity import RunIdentity
from aitoolbox.experiment.local_save.sharded_checkpoints import is_sharded_checkpoint

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
    return timestamp, download_checkpoint(storage, key, local_folder, replace=False), key


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


def usable_checkpoint(run_folder: str, newest: str, world_size: int,
                      weights_only: bool) -> Optional[Tuple[str, dict]]:
    """The checkpoint of a run that ``world_size`` processes can continue, loaded: ``newest``, or when that one was
    saved mid-epoch by another number of processes, the run's newest epoch-end checkpoint (with a warning saying
    what is trained again). None when there is none."""
    checkpoint = load_checkpoint_file(newest, weights_only=weights_only)
    saved_world_size, batches_done = saved_shape(checkpoint)
    if saved_world_size == world_size or batches_done == 0:
        return newest, checkpoint
    position = checkpoint_path_position(newest)
    epoch_ends: List[str] = [path for path in run_checkpoints(run_folder)
                             if (checkpoint_path_position(path) or (0, 0, 0))[1] == 1
                             and checkpoint_path_position(path) < position]
    lost = (f"{newest} was saved by {saved_world_size} process(es) in the middle of epoch {checkpoint.get('epoch')} "
            f"({batches_done} batch(es) per process done) and this job has {world_size}: a mid-epoch checkpoint "
            "continues only with the number of processes that saved it")
    if not epoch_ends:
        logger.warning("auto_resume: %s, and the run has no epoch-end checkpoint: a new run starts", lost)
        return None
    fallback = epoch_ends[-1]
    logger.warning("auto_resume: %s. Continuing from the epoch-end checkpoint %s instead: the training done after it "
                   "(in epoch %s) is lost and is done again, with the data split among %d process(es)", lost,
                   os.path.basename(fallback), checkpoint.get("epoch"), world_size)
    return fallback, load_checkpoint_file(fallback, weights_only=weights_only)


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


def agree_on_run(tl: Any, decide: bool) -> Tuple[RunDecision, Any]:
    """In every process of a distributed job, once the process group exists: rank 0 decides (``decide``: the
    auto_resume search, otherwise its own folder's name) and broadcasts; each process then adopts the run folder
    and returns ``(decision, what to load)``: a checkpoint path on this process's disk, rank 0's checkpoint dict
    (non-sharded, when a rank lacks the file), or None for a new run.

    Raises:
        RuntimeError: in every process: rank 0 could not decide, or a sharded checkpoint is missing on some ranks.
    """
    strategy, folder = tl.strategy, tl.experiment_folder
    decision, loaded, error = None, None, None
    if strategy.is_main_process:
        try:
            if decide:
                decision, loaded = decide_run(folder, tl.cloud_destination, strategy.world_size, tl.weights_only,
                                              tl.lazy_experiment_save)
            else:
                if not tl.lazy_experiment_save:
                    folder.create()
                folder.reserve()
                decision = RunDecision(folder.timestamp, os.path.isdir(folder.path))
        except Exception as exception:  # every rank must learn it, or the others wait in the broadcast
            error = f"rank 0 could not choose the run to continue: {type(exception).__name__}: {exception}"
    decision, error = tl.broadcast_object((decision, error))
    if error is not None:
        raise RuntimeError(error)
    folder.adopt(decision.timestamp, created=False)  # rank 0's own stays created
    if decision.created:
        folder.adopt_if_created_elsewhere()  # the other ranks: rank 0's folder, on storage they share
    if decision.checkpoint is None:
        return decision, None
    local_path = os.path.join(folder.path, decision.checkpoint)
    if not strategy.is_main_process and not _readable(local_path) and decision.bucket_key is not None \
            and tl.cloud_destination is not None:
        try:
            download_checkpoint(tl.cloud_destination.storage(), decision.bucket_key, os.path.dirname(local_path),
                                replace=False)
        except Exception as exception:  # reported below with the ranks that lack it
            logger.warning("rank %d could not download %s: %s", strategy.rank, decision.bucket_key, exception)
    readable = strategy.all_gather_objects(_readable(local_path))
    if all(readable):
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
    return decision, tl.broadcast_object(loaded)
