"""The record, beside a run's checkpoints, of the train ends that finished (issue 32).

A checkpoint callback saves the epoch-end checkpoint of a run's last epoch before the train end (the test-set
evaluation, ``on_train_end``: final saves, tracker rows, uploads) runs, in every run. A job killed after that
checkpoint and before its end finished (SIGKILL, a preemption) leaves the same checkpoint as a job whose end
finished; only a record that outlives the process tells the two apart. After every ``on_train_end`` has returned,
the loop writes into the run folder of each checkpoint callback ``.train_end_done.json`` (hidden, at the folder's
top: code that lists ``checkpoint_model/`` finds checkpoints only): the points (epochs completed, total iteration
index) at which a train end finished. The epoch-end checkpoint of a fit's last epoch (its target reached, or a stop
requested) that such a callback saved into its ``checkpoint_model/`` carries :data:`CHECKPOINT_KEY`, the record's
path relative to the checkpoint's folder: the train end follows it. ``fit`` of such a checkpoint at its target,
without its point in the record, runs the end that was lost instead of reporting nothing to train; with its point
recorded the end finished, and ``fit`` trains nothing, as before.

A checkpoint without the key (an earlier epoch's, aitoolbox 1.x's, ``tl.checkpoint_state()`` saved by hand, a
mid-epoch or sharded checkpoint) says nothing about an end: ``fit`` treats it as before.
"""
import json
import logging
import os
from typing import Optional

from aitoolbox.experiment.local_save.atomic import atomic_write_text

logger = logging.getLogger(__name__)

#: The record's file name, at the top of the run folder.
MARKER_NAME = ".train_end_done.json"
#: In the epoch-end checkpoint of a fit's last epoch, saved into a run folder's ``checkpoint_model/``: the record's
#: path relative to the checkpoint's folder (:data:`RECORD_FROM_CHECKPOINT`).
CHECKPOINT_KEY = "train_end_record"
RECORD_FROM_CHECKPOINT = "../" + MARKER_NAME


def record_path(run_folder: str) -> str:
    """The record of the run folder ``run_folder``."""
    return os.path.join(run_folder, MARKER_NAME)


def record_beside(checkpoint: dict, source: Optional[str]) -> Optional[str]:
    """The record a checkpoint read from the file ``source`` names (None: it names none, or none that aitoolbox
    writes: a path taken from a file is never followed elsewhere)."""
    if checkpoint.get(CHECKPOINT_KEY) != RECORD_FROM_CHECKPOINT or not isinstance(source, str):
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(source)), RECORD_FROM_CHECKPOINT))


def _point(epochs_completed: int, iteration_idx: int) -> list:
    return [int(epochs_completed), int(iteration_idx)]


def _read(path: str) -> Optional[list]:
    """The points recorded in ``path``; [] when there is no record; None when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            points = json.load(handle)["train_ends_done"]
        return [list(point) for point in points]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("cannot read the train-end record %s (%s); its run's train end is taken as finished", path,
                       error)
        return None


def record_train_end_done(path: str, epochs_completed: int, iteration_idx: int) -> Optional[str]:
    """Add the point of a finished train end to the record ``path`` (written atomically: a kill leaves the old record
    or the new one). Returns ``path``, or None when its folder does not exist (no run there to describe) or the record
    could not be written (logged: the end is finished, and a restart runs it again)."""
    if not os.path.isdir(os.path.dirname(path)):
        return None
    points = _read(path) or []
    point = _point(epochs_completed, iteration_idx)
    if point not in points:
        points.append(point)
    try:
        atomic_write_text(path, json.dumps({"train_ends_done": points}) + "\n")
    except OSError as error:
        logger.warning("could not record the finished train end in %s (%s): a job restarted from the final "
                       "checkpoint of the run runs its train end again", path, error)
        return None
    return path


def train_end_lost(checkpoint: dict, source: Optional[str]) -> bool:
    """Whether ``checkpoint`` (read from the file ``source``) is the epoch-end checkpoint of a fit's last epoch whose
    record holds no finished train end at its point: its job stopped before its end finished."""
    path = record_beside(checkpoint, source)
    if path is None or int(checkpoint.get("iteration", 0) or 0) > 0:
        return False
    points = _read(path)
    if points is None:
        return False
    return _point(checkpoint.get("epochs_completed", 0), checkpoint.get("iteration_idx", -1)) not in points
