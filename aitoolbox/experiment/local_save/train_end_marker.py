"""The record, beside a run's checkpoints, of the train ends that finished (issue 32).

A checkpoint callback saves the epoch-end checkpoint of a run's last epoch before the train end (the test-set
evaluation, ``on_train_end``: final saves, tracker rows, uploads) runs, in every run. A job killed after that
checkpoint and before its end finished (SIGKILL, a preemption) leaves the same checkpoint as a job whose end
finished; only a record that outlives the process tells the two apart. After every ``on_train_end`` has returned,
the loop writes into the run folder of each checkpoint callback ``.train_end_done.json`` (hidden, at the folder's
top: code that lists ``checkpoint_model/`` finds checkpoints only): the points (epochs completed, total iteration
index) at which a train end finished. The epoch-end checkpoint of a fit's last epoch (its target reached, or a stop
requested) that such a callback saved into its ``checkpoint_model/`` carries :data:`CHECKPOINT_KEY`, the name of
its run folder: the train end follows it. ``fit`` of such a checkpoint at its target, read from that run folder's
``checkpoint_model/`` (a copy elsewhere, or in another run's folder, says nothing: review 50e F1), without its point
in the record, runs the end that was lost instead of reporting nothing to train; with its point recorded the end
finished, and ``fit`` trains nothing, as before. A record that is not a small regular file of points (a planted
FIFO, a huge or deeply nested file) is taken as "finished" and never rewritten.

A checkpoint without the key (an earlier epoch's, aitoolbox 1.x's, ``tl.checkpoint_state()`` saved by hand, a
mid-epoch or sharded checkpoint) says nothing about an end: ``fit`` treats it as before.
"""
import json
import logging
import os
import stat
from typing import List, Optional

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.local_save.checkpoints import loaded_checkpoint_folder

logger = logging.getLogger(__name__)

#: The record's file name, at the top of the run folder.
MARKER_NAME = ".train_end_done.json"
#: In the epoch-end checkpoint of a fit's last epoch, saved into a run folder's ``checkpoint_model/``: the run
#: folder's name (the record is :data:`RECORD_FROM_CHECKPOINT`, relative to the checkpoint's folder).
CHECKPOINT_KEY = "train_end_record"
RECORD_FROM_CHECKPOINT = "../" + MARKER_NAME
#: A record is a list of points, at most this large: anything larger is not one (a bucket's or a planted file); the
#: writer drops the oldest points to stay below it (about 90,000 points fit).
MAX_RECORD_BYTES = 1024 * 1024
_CHECKPOINT_FOLDER = "checkpoint_model"


def record_path(run_folder: str) -> str:
    """The record of the run folder ``run_folder``."""
    return os.path.join(run_folder, MARKER_NAME)


def record_beside(checkpoint: dict, source: Optional[str]) -> Optional[str]:
    """The record of the run a checkpoint read from ``source`` was saved in: only where the file lies in the
    ``checkpoint_model/`` folder of the run folder its :data:`CHECKPOINT_KEY` names (None otherwise: it names none,
    or the file was copied elsewhere or into another run's folder, whose record is not its own; a path taken from a
    file is never followed). ``source`` is the file, or the run folder or its ``checkpoint_model/`` folder that
    load_checkpoint took the newest checkpoint of; ``~`` and symbolic links are resolved as load_checkpoint does
    (review 50f G1, G4)."""
    run_name = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(run_name, str) or not isinstance(source, str):
        return None
    checkpoint_dir = loaded_checkpoint_folder(source)
    run_folder = os.path.dirname(checkpoint_dir)
    if os.path.basename(checkpoint_dir) != _CHECKPOINT_FOLDER or os.path.basename(run_folder) != run_name:
        return None
    return record_path(run_folder)


def _point(epochs_completed: int, iteration_idx: int) -> list:
    return [int(epochs_completed), int(iteration_idx)]


def _read(path: str) -> Optional[List[list]]:
    """The points recorded in ``path`` (entries that are not two integers are passed over); [] when there is no
    record; None when it cannot be read, or is not a small regular file of points."""
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_RECORD_BYTES:
            raise ValueError(f"not a regular file of at most {MAX_RECORD_BYTES} bytes")  # (a FIFO would block)
        with open(path, encoding="utf-8") as handle:
            points = json.loads(handle.read(MAX_RECORD_BYTES + 1))["train_ends_done"]
        if not isinstance(points, list):
            raise TypeError("train_ends_done is not a list")
        return [list(point) for point in points
                if isinstance(point, list) and len(point) == 2 and all(type(value) is int for value in point)]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        logger.warning("cannot read the train-end record %s (%s); its run's train ends are taken as finished", path,
                       error)
        return None


def record_train_end_done(path: str, epochs_completed: int, iteration_idx: int) -> Optional[str]:
    """Add the point of a finished train end to the record ``path`` (written atomically: a kill leaves the old record
    or the new one). Returns ``path``, or None when its folder does not exist (no run there to describe) or the record
    could not be written (logged: the end is finished, and a restart runs it again)."""
    if not os.path.isdir(os.path.dirname(path)):
        return None
    points = _read(path)
    if points is None:  # unreadable: every end of the run counts as finished already (rewritten, some would not)
        return None
    point = _point(epochs_completed, iteration_idx)
    if point not in points:
        points.append(point)
    text = json.dumps({"train_ends_done": points}) + "\n"
    if len(text) > MAX_RECORD_BYTES:  # (review 50f G2: a larger record would no longer be read)
        kept = points[len(points) // 2:]
        logger.warning("the train-end record %s is full: its %d oldest points are dropped (a final checkpoint of "
                       "theirs, loaded at its target, runs its train end again)", path, len(points) - len(kept))
        text = json.dumps({"train_ends_done": kept}) + "\n"
    try:
        atomic_write_text(path, text)
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
