"""The clean points :class:`~aitoolbox.torchtrain.callbacks.spike_rollback.SpikeRollback` returns to, and what a
rollback does to the checkpoints on disk.

A point is kept in host memory (a :class:`~aitoolbox.torchtrain.train_loop.run_snapshot.RunSnapshot`, or, for the
start of a ``fit``, a host copy of the checkpoint the run stands at) or as a mid-epoch checkpoint. A checkpoint
point is written by the registered checkpoint callback under its usual name (so ``auto_resume`` finds it) and
*pinned*: hard-linked (copied where the file system has no hard links) into
``checkpoint_model/spike_rollback/``, where no callback prunes. The checkpoint callbacks may then delete or replace
the file under its usual name as they please (``keep_last``, a best-k ranking): the point SpikeRollback adopted stays
readable until a newer point replaces it or training ends.

When the run returns to a point, the checkpoints written after it (by any checkpoint callback of the run, in this
process's run) hold the run that is being undone: :func:`remove_checkpoints_after` deletes them, so that a job killed
right after the rollback never resumes from spiked weights.
"""
import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from aitoolbox.experiment.local_save.atomic import atomic_write_text

from aitoolbox.experiment.local_save.checkpoints import checkpoint_path_position, list_checkpoints, remove_checkpoint
from aitoolbox.torchtrain.host_copy import host_copy

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop
    from aitoolbox.torchtrain.train_loop.train_state import MidEpochResume

logger = logging.getLogger(__name__)

#: The sub-folder of ``checkpoint_model/`` that holds the pinned point.
PIN_FOLDER = "spike_rollback"
#: The file in the pin folder naming the pinned point and where it lies in the run.
POINT_FILE = "point.json"


class KeptPoint:
    """A clean point of the run: where it was (``epoch``, ``iteration`` of the last batch trained, ``batches_done``
    of its epoch, ``total_iteration``), when (``kept_at``, wall clock), and a snapshot in memory, a checkpoint dict
    in host memory (``checkpoint``: the start of a ``fit``) or the path of a pinned checkpoint."""

    def __init__(self, epoch: int, iteration: int, batches_done: int, total_iteration: int,
                 snapshot: Optional["RunSnapshot"] = None, pin: Optional[str] = None,
                 checkpoint_callback: Any = None, written: Optional[str] = None,
                 on_disk: Optional[Dict[str, int]] = None, checkpoint: Optional[dict] = None,
                 stands_for: Optional[Dict[str, int]] = None, start_iteration: Optional[int] = None):
        self.epoch, self.iteration, self.batches_done = epoch, iteration, batches_done
        self.total_iteration = total_iteration
        self.kept_at = time.time()
        # The checkpoints on disk when the point was kept (path: modification time in ns): any other, or one changed
        # since, was written after it. (A file's time comes from a coarser clock than time.time(): a checkpoint
        # written a few milliseconds after the point can carry an earlier time.)
        self.on_disk = dict(on_disk or {})
        self.snapshot, self.pin, self.checkpoint_callback = snapshot, pin, checkpoint_callback
        self.checkpoint = checkpoint  # every tensor on the host, shared with nothing (see torchtrain.host_copy)
        self.written = written  # the checkpoint under its usual name, when it was written for this point alone
        # The start of a fit whose pending losses were judged clean: the earlier point (epoch, iteration,
        # batches_done) it stands for, which the run that never stopped returns to (None: itself).
        self.stands_for = dict(stands_for) if stands_for is not None else None
        # A fit's start: the loop's ``iteration`` there (what its on_epoch_begin saw; a checkpoint does not hold it).
        self.start_iteration = start_iteration

    @property
    def position(self) -> tuple:
        """Comparable with :func:`~aitoolbox.experiment.local_save.checkpoints.checkpoint_position`."""
        return self.epoch, 0, self.total_iteration

    def discard(self, keep: Sequence[Optional[str]] = ()) -> None:
        """A newer point replaces this one (main process): its pin goes, and the checkpoint written for it alone,
        except the paths in ``keep`` (the newer point's own)."""
        if self.pin is not None and self.pin not in keep:
            _remove(self.pin)
        if self.written is not None and self.written not in keep:
            _remove(self.written)

    def restore(self, tl: "TrainLoop") -> Optional["MidEpochResume"]:
        """Put the point back into ``tl`` (a call in every process); where its epoch continues."""
        if self.snapshot is not None:
            return self.snapshot.restore(tl)
        if self.checkpoint is not None:
            # Loaded as a pin is, from a fresh copy each time: loading may keep the tensors it is given.
            tl.load_checkpoint(host_copy(self.checkpoint))
            resume = tl.apply_pending_restore()
            if self.start_iteration is not None:  # (the loop sets it where the point lies inside its epoch)
                tl.run_state.counters.iteration = self.start_iteration
            return resume
        if self.pin is None or not os.path.exists(self.pin):
            raise FileNotFoundError(f"SpikeRollback cannot roll back: its pinned checkpoint {self.pin} is gone (was "
                                    f"the run folder's checkpoint_model/{PIN_FOLDER}/ deleted during training?)")
        tl.load_checkpoint(self.pin)
        return tl.apply_pending_restore()  # inside fit: the states are applied now, as fit's start would


def pin_checkpoint(path: str, where: Optional[dict] = None, checkpoint_dir: Optional[str] = None) -> str:
    """Hard-link the checkpoint ``path`` (a file, or a sharded checkpoint's folder) into the pin folder beside it and
    return the pin's path; copies where hard links are not possible (another file system, no link support).
    ``where``: the point's position and the checkpoints on disk then (:class:`KeptPoint`'s arguments), written
    beside the pin (:data:`POINT_FILE`) for a resumed process (:func:`read_pinned_point`). ``checkpoint_dir``: the
    ``checkpoint_model/`` folder whose pin folder gets it (None: the one ``path`` is in; another: a run resumed into
    a new run folder takes over the pin of the run folder it resumed from)."""
    folder = os.path.join(checkpoint_dir or os.path.dirname(path), PIN_FOLDER)
    os.makedirs(folder, exist_ok=True)
    pin = os.path.join(folder, os.path.basename(path))
    _remove(pin)
    _remove(os.path.join(folder, POINT_FILE))  # names the point being replaced
    try:
        if os.path.isdir(path):
            shutil.copytree(path, pin, copy_function=os.link)
        else:
            os.link(path, pin)
    except OSError as error:
        logger.info("SpikeRollback: cannot hard-link %s (%s); copying it instead", path, error)
        _remove(pin)
        if os.path.isdir(path):
            shutil.copytree(path, pin)
        else:
            shutil.copy2(path, pin)
    if where is not None:  # after the pin: a point file never names a pin that is not complete
        atomic_write_text(os.path.join(folder, POINT_FILE),
                          json.dumps({"pin": os.path.basename(pin), "where": where}))
    return pin


def read_pinned_point(checkpoint_dir: str) -> Optional[Tuple[str, dict]]:
    """The pinned point an earlier process left in ``checkpoint_dir``: ``(pin path, where)``, or None where there is
    none (or it is incomplete or unreadable)."""
    folder = os.path.join(checkpoint_dir, PIN_FOLDER)
    try:
        with open(os.path.join(folder, POINT_FILE), encoding="utf-8") as handle:
            record = json.load(handle)
        pin = os.path.join(folder, os.path.basename(record["pin"]))
        where = {key: int(record["where"][key]) for key in ("epoch", "iteration", "batches_done", "total_iteration")}
        where["on_disk"] = {str(path): int(modified) for path, modified in record["where"].get("on_disk", {}).items()}
        stands_for = record["where"].get("stands_for")  # (a point kept at a fit's first step, see SpikeRollback)
        if stands_for is not None:
            where["stands_for"] = {key: int(stands_for[key]) for key in ("epoch", "iteration", "batches_done")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pin, where) if os.path.exists(pin) else None


def unpin(point: KeptPoint) -> None:
    """After returning to ``point`` (main process): where a checkpoint callback has pruned the point's checkpoint
    under its usual name, put it back from the pin, so that the newest resumable checkpoint on disk is the point's.
    It is the point's own from then on (deleted when a newer point replaces it)."""
    if point.pin is None:
        return
    path = os.path.join(os.path.dirname(os.path.dirname(point.pin)), os.path.basename(point.pin))
    if os.path.lexists(path):
        return
    try:
        if os.path.isdir(point.pin):
            shutil.copytree(point.pin, path, copy_function=os.link)
        else:
            os.link(point.pin, path)
    except OSError:
        _remove(path)
        if os.path.isdir(point.pin):
            shutil.copytree(point.pin, path)
        else:
            shutil.copy2(point.pin, path)
    point.written = path


def clear_pins(checkpoint_dir: str) -> None:
    """Remove what an earlier, interrupted process left in the pin folder (main process, at the start of a fit)."""
    folder = os.path.join(checkpoint_dir, PIN_FOLDER)
    if os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)


def checkpoints_on_disk(callbacks: List[Any]) -> Dict[str, int]:
    """``{path: modification time in ns}`` of the checkpoints in the folders of ``callbacks`` (checkpoint
    callbacks)."""
    on_disk = {}
    for folder in dict.fromkeys(callback.experiment_folder.checkpoint_dir for callback in callbacks):
        for path in list_checkpoints(folder):
            try:
                on_disk[path] = os.stat(path).st_mtime_ns
            except OSError:  # deleted meanwhile
                continue
    return on_disk


def remove_checkpoints_after(tl: "TrainLoop", point: KeptPoint, callbacks: List[Any]) -> List[str]:
    """Delete the checkpoints that ``callbacks`` (the run's checkpoint callbacks) wrote after ``point``: those of a
    later training position, not on disk as they were when the point was kept (new or rewritten since). Call it in every process: background saves
    are waited for first, then the main process deletes. Returns the deleted paths (main process)."""
    for callback in callbacks:
        callback.wait_for_pending_save()  # a save in flight would land after the clean-up
    if not tl.is_main_process:
        return []
    deleted = []
    for path, modified in checkpoints_on_disk(callbacks).items():
        position = checkpoint_path_position(path)
        written_after = point.on_disk.get(path) != modified
        if position is not None and position > point.position and written_after:
            remove_checkpoint(path)
            deleted.append(path)
    if deleted:
        logger.warning("SpikeRollback: deleted %d checkpoint(s) written after the point the run returns to (they hold "
                       "the run being undone): %s", len(deleted), ", ".join(os.path.basename(p) for p in deleted))
    return deleted


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    except OSError as error:
        logger.warning("SpikeRollback could not delete %s: %s", path, error)
