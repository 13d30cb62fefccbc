"""Checkpoint files of an experiment: names, the newest one, loading with clear errors, keeping the best k (and
the ranking that does so across processes)."""
import collections
import contextlib
import json
import logging
import math
import os
import re
import sys
import threading
from typing import Iterator, List, Optional, Tuple

import torch

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, atomic_write_text, torch_save_atomic
from aitoolbox.experiment.local_save.checkpoint_contents import check_checkpoint_contents
# The errors are imported for the callers of load_checkpoint_file, which raises them.
from aitoolbox.experiment.local_save.safe_load import (  # noqa: F401
    CheckpointLoadError, CheckpointMismatchError, CorruptCheckpointError, UntrustedCheckpointError, load_torch_file)
from aitoolbox.experiment.local_save.sharded_checkpoints import (
    is_sharded_checkpoint, read_sharded_checkpoint_state_and_identity, remove_sharded_checkpoint)

logger = logging.getLogger(__name__)

# Epoch checkpoints model_<experiment>_<timestamp>_E<epoch>.pth; iteration checkpoints add _ITER<iteration_idx>
# (aitoolbox 1.x's names); _I<batches done in the epoch> is this package's first iteration-checkpoint name.
# _ITER-1: nothing trained yet (a stop signal whose rollback returned to a fresh run's start saves there): before
# every other checkpoint, never a final model (review 49s R3).
_CHECKPOINT_NAME = re.compile(
    r"^model_.+_E(?P<epoch>\d+)(?:_ITER(?P<iteration_idx>-?\d+)|_I(?P<batches>\d+))?\.pth$")
# The final model ModelTrainEndSave writes into model/: model_<experiment>_<timestamp>.pth.
_FINAL_MODEL_NAME = re.compile(r"^model_.+\.pth$")
_AFTER_EVERY_EPOCH = (sys.maxsize, 0, 0)


def checkpoint_file_name(experiment_name: str, timestamp: str, epoch: int, iteration_idx: Optional[int] = None) -> str:
    """``model_<experiment>_<timestamp>_E<epoch>.pth``; an iteration checkpoint adds ``_ITER<iteration_idx>``
    (the index of the last batch trained, counted over the whole run), as aitoolbox 1.x named them."""
    suffix = f"_ITER{iteration_idx}" if iteration_idx is not None else ""
    return f"model_{experiment_name}_{timestamp}_E{epoch}{suffix}.pth"


def checkpoint_position(file_name: str) -> Optional[Tuple[int, int, int]]:
    """Training progress a checkpoint name stands for, comparable across epoch and iteration checkpoints.

    An epoch checkpoint comes after the iteration checkpoints of its epoch; ``_ITER-1`` (saved before the first
    batch: nothing trained) before them; a final model (``model_<experiment>_<timestamp>.pth``) comes after every
    checkpoint; other files give None.
    """
    if file_name.startswith(TEMP_PREFIX):
        return None
    match = _CHECKPOINT_NAME.match(file_name)
    if match is None:
        return _AFTER_EVERY_EPOCH if _FINAL_MODEL_NAME.match(file_name) else None
    epoch = int(match.group("epoch"))
    within_epoch = match.group("iteration_idx") or match.group("batches")
    return (epoch, 0, int(within_epoch)) if within_epoch is not None else (epoch, 1, 0)


def list_checkpoints(folder: str) -> List[str]:
    """Complete checkpoints in ``folder``, oldest training progress first: checkpoint files, and the folders of
    sharded checkpoints (``model_<experiment>_<timestamp>_E<epoch>[_ITER<i>]/``, see
    :mod:`~aitoolbox.experiment.local_save.sharded_checkpoints`) that hold their completion marker. Temporary files
    and folders of interrupted saves are ignored."""
    if not os.path.isdir(folder):
        return []
    named = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not is_sharded_checkpoint(path):
            continue
        position = checkpoint_path_position(path)
        if position is not None:
            named.append((position, name))
    return [os.path.join(folder, name) for position, name in sorted(named)]


def loaded_checkpoint_folder(source: str) -> str:
    """The ``checkpoint_model/`` folder a checkpoint load_checkpoint read from ``source`` lies in: ``source`` is the
    file (or a sharded checkpoint's folder), or the run folder or its ``checkpoint_model/`` folder whose newest
    checkpoint was read; ``~`` and symbolic links resolved as load_checkpoint resolves them. (A folder not named so
    where the source is elsewhere: the caller checks the name.)"""
    source = os.path.realpath(os.path.expanduser(source))
    if os.path.isdir(os.path.join(source, "checkpoint_model")):
        return os.path.join(source, "checkpoint_model")
    if os.path.isdir(source) and os.path.basename(source) == "checkpoint_model":
        return source
    return os.path.dirname(source)


def checkpoint_path_position(path: str) -> Optional[Tuple[int, int, int]]:
    """:func:`checkpoint_position` of a checkpoint file, or of a sharded checkpoint's folder (named as its file
    without ``.pth``)."""
    name = os.path.basename(path)
    return checkpoint_position(f"{name}.pth" if os.path.isdir(path) else name)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint file, or a sharded checkpoint's folder (never seen half-deleted)."""
    if os.path.isdir(path):
        remove_sharded_checkpoint(path)
    elif os.path.exists(path):
        os.remove(path)


def find_checkpoint(path: str) -> str:
    """The checkpoint ``path`` names: itself (a file or a sharded checkpoint's folder), or the newest one of an
    experiment or checkpoint folder."""
    path = os.path.expanduser(path)
    if os.path.isfile(path) or is_sharded_checkpoint(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        return path  # a file (a pipe or device too: the loader refuses it, naming it)
    if path.endswith(".pth") and not os.path.exists(path) and is_sharded_checkpoint(path[:-len(".pth")]):
        return path[:-len(".pth")]  # the file name of a checkpoint that a sharded run wrote as a folder
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint file or experiment folder at {path}")
    for folder in (path, os.path.join(path, "checkpoint_model")):
        found = list_checkpoints(folder)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no checkpoint (model_*_E<epoch>.pth) or final model (model_*.pth) in {path} or its "
                            "checkpoint_model/ folder")


# aitoolbox 1.8's checkpoint keys, written by every checkpoint and read by 1.8-style loading code
# (``torch.load(path)['model_state_dict']``); the state this package adds for a bitwise resume sits beside them.
MODEL_KEY = "model_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
SCHEDULERS_KEY = "schedulers_state_dict"
# A sharded checkpoint loaded by :func:`load_checkpoint_file`: its folder. The dict then holds the training state
# but not the weights, which the TrainLoop reads into its (sharded) model and optimizers once they are set up.
SHARDED_CHECKPOINT_KEY = "sharded_checkpoint"
# Beside it, the identity (device, inode) of the folder whose training state was read: the weights, read later,
# must come from that same folder, not from one swapped into its place (a link to another run's checkpoint).
SHARDED_IDENTITY_KEY = "sharded_checkpoint_identity"


def upgrade_checkpoint_format(checkpoint: dict) -> dict:
    """A checkpoint dict of this package's first format (``model``/``optimizers`` keys) with 1.8's key names.

    Files written before the 1.8 layout was adopted keep loading: ``model`` becomes ``model_state_dict`` and the
    ``optimizers`` list becomes ``optimizer_state_dict`` (the state dict itself for one optimizer, the list for
    several) and the count ``total_iteration_idx`` becomes the index ``iteration_idx``. Other dicts (and entries
    not of the first format's types) are returned unchanged.
    """
    if MODEL_KEY in checkpoint or "model" not in checkpoint:
        return checkpoint
    upgraded = {key: value for key, value in checkpoint.items() if key not in ("model", "optimizers")}
    upgraded[MODEL_KEY] = checkpoint["model"]
    optimizers = checkpoint.get("optimizers")
    if isinstance(optimizers, (list, tuple)) and optimizers:
        upgraded[OPTIMIZER_KEY] = optimizers[0] if len(optimizers) == 1 else list(optimizers)
    total = checkpoint.get("total_iteration_idx")
    if isinstance(total, int) and not isinstance(total, bool):  # it counted the batches done; 1.x's is the index
        upgraded["iteration_idx"] = total - 1
    return upgraded


def _run_folder(file_path: str, named: str) -> str:
    """The run folder of checkpoint ``file_path``, found from ``named`` (what the user passed): the folder itself
    when the user named a folder, else the folder holding the checkpoint (its run folder for one in
    ``checkpoint_model/``)."""
    named, file_path = os.path.abspath(named), os.path.abspath(file_path)
    if file_path != named and os.path.isdir(named) and os.path.commonpath([named, file_path]) == named:
        return named
    parent = os.path.dirname(file_path)
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoint_model" else parent


def _confined(file_path: str, named: str) -> str:
    """``file_path``, or for a symbolic link named as a checkpoint, its target when that is inside the link's folder.

    A checkpoint of an experiment folder (``model_*.pth``, or a sharded checkpoint's folder) found there or named
    by its parts must not lead outside that folder: a link planted in a shared folder would load another run's
    files. So no folder between the run folder and the checkpoint (``checkpoint_model/``) may be a link either;
    the run folder ``named`` leads to may itself be reached through links (the user's own: they named it).
    """
    if checkpoint_path_position(file_path) is None:
        return file_path
    current = _run_folder(file_path, named)
    for part in os.path.relpath(os.path.abspath(file_path), current).split(os.sep)[:-1]:
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise CorruptCheckpointError(file_path, f"the folder {current} on its path is a symbolic link (to "
                                                    f"{os.path.realpath(current)}): a checkpoint of a run folder "
                                                    "reads nothing through a link inside it, which could lead to "
                                                    "another run's files. If you made this link yourself, name the "
                                                    "checkpoint by the path it leads to")
    if not os.path.islink(file_path):
        return file_path
    folder = os.path.realpath(os.path.dirname(os.path.abspath(file_path)))
    target = os.path.realpath(file_path)
    if os.path.commonpath([folder, target]) != folder:
        raise CorruptCheckpointError(file_path, f"it is a symbolic link to {target}, outside its folder: a checkpoint "
                                                "of an experiment folder reads nothing outside it")
    return target


def load_checkpoint_file(path: str, map_location="cpu", *, weights_only: bool = True) -> dict:
    """Load the checkpoint ``path`` names (see :func:`find_checkpoint`) without running code from it.

    The file is read once by aitoolbox's restricted reader (:mod:`~aitoolbox.experiment.local_save.safe_load`),
    which also accepts the plain data types aitoolbox 1.x checkpoints hold in their hyperparameters (numpy values,
    ``argparse.Namespace``, paths, dates). A file that holds other Python objects is refused. The entries a
    TrainLoop and 1.x's loaders use are checked
    (:mod:`~aitoolbox.experiment.local_save.checkpoint_contents`).

    A sharded checkpoint's folder gives its training state without the weights: the model and optimizer states
    stay on disk and ``SHARDED_CHECKPOINT_KEY`` names the folder (:meth:`TrainLoop.load_checkpoint` reads them
    into the set-up model, each process its own shards). For the full model state dict in one process, use
    :func:`~aitoolbox.experiment.local_save.sharded_checkpoints.consolidate_sharded_checkpoint`.

    Args:
        path: a checkpoint file, a sharded checkpoint's folder, or a run or checkpoint folder (its newest).
        map_location: where to put the tensors (``torch.load``'s argument).
        weights_only: False unpickles the file fully, which runs whatever code it names: only for files you
            trust (e.g. your own aitoolbox 1.x checkpoints holding custom objects).

    Raises:
        UntrustedCheckpointError: the file holds objects only full unpickling can build; it names the file and
            the refused types (nothing from the file was run).
        CorruptCheckpointError: the file is truncated, damaged, not a torch file, beyond the reader's limits, or
            not an aitoolbox checkpoint (no ``model_state_dict``, or an entry not of its kind). A ``ValueError``.
        CheckpointLoadError: the file's tensors were saved on a device this machine lacks.
        FileNotFoundError: there is no checkpoint at ``path``.
    """
    file_path = _confined(find_checkpoint(path), os.path.expanduser(path))
    if os.path.isdir(file_path):
        state, identity = read_sharded_checkpoint_state_and_identity(file_path)
        state = check_checkpoint_contents(state, file_path, sharded=True)
        return dict(state, **{SHARDED_CHECKPOINT_KEY: file_path, SHARDED_IDENTITY_KEY: identity})
    checkpoint = load_torch_file(file_path, map_location=map_location, weights_only=weights_only,
                                 follow_symlinks=checkpoint_path_position(file_path) is None)
    if isinstance(checkpoint, dict):
        checkpoint = upgrade_checkpoint_format(checkpoint)
    return check_checkpoint_contents(checkpoint, file_path)


@contextlib.contextmanager
def failures_named(path: Optional[str]) -> Iterator[None]:
    """Name ``path`` in what putting a checkpoint read from it into a model, optimizers or loop raises.

    A ``RuntimeError`` or ``ValueError`` (torch's ``load_state_dict`` of another model, another number of
    optimizers) becomes :class:`CheckpointMismatchError`, still both; a ``TypeError``, ``KeyError``, ``IndexError``,
    ``AttributeError`` or ``ArithmeticError`` (content no checkpoint holds, e.g. an infinite count) becomes
    :class:`CorruptCheckpointError`. The original is chained. aitoolbox's own loading errors, and everything with
    ``path`` None (a checkpoint dict the caller made), pass unchanged.
    """
    if path is None:
        yield
        return
    try:
        yield
    except CheckpointLoadError:
        raise
    except (RuntimeError, ValueError) as error:
        raise CheckpointMismatchError(path, f"{type(error).__name__}: {error}") from error
    except (TypeError, KeyError, IndexError, AttributeError, ArithmeticError) as error:
        raise CorruptCheckpointError(path, f"its content is not what a checkpoint holds ({type(error).__name__}: "
                                           f"{error})") from error


def save_checkpoint_file(checkpoint: dict, folder: str, file_name: str,
                         abandon: Optional[threading.Event] = None) -> str:
    """Write a checkpoint atomically; returns its path. ``abandon``: see :func:`torch_save_atomic`."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name)
    torch_save_atomic(checkpoint, path, abandon=abandon)
    return path


def snapshot_checkpoint(checkpoint, reuse=None):
    """A copy of ``checkpoint`` whose tensors are copies in host memory, for writing while training goes on.

    Dicts, lists and tuples are rebuilt; tensors are copied into host memory; a tensor that appears twice (tied
    weights) stays one shared copy; every other value is kept as it is.

    Args:
        checkpoint: what ``TrainLoop.checkpoint_state()`` returned.
        reuse: an earlier snapshot that is no longer needed: its tensors receive the new values wherever the
            same place holds a tensor of the same shape and dtype. Writing into memory already in use is much
            faster than allocating (and page-faulting) gigabytes afresh at every checkpoint.
    """
    copies = {}  # id of a checkpoint tensor -> its copy
    reused = set()  # ids of buffers of ``reuse`` already filled

    def copy_tensor(tensor: torch.Tensor, previous) -> torch.Tensor:
        tensor = tensor.detach()
        if isinstance(previous, torch.Tensor) and id(previous) not in reused and previous.device.type == "cpu" \
                and previous.shape == tensor.shape and previous.dtype == tensor.dtype \
                and previous.layout == tensor.layout == torch.strided:
            reused.add(id(previous))
            return previous.copy_(tensor)
        return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")

    def copy(value, previous):
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = copy_tensor(value, previous)
            return copies[id(value)]
        if isinstance(value, dict):
            earlier = previous if isinstance(previous, dict) else {}
            items = [(key, copy(item, earlier.get(key))) for key, item in value.items()]
            copied = collections.OrderedDict(items) if isinstance(value, collections.OrderedDict) else dict(items)
            if hasattr(value, "_metadata"):  # a module state_dict's versions, read by load_state_dict
                copied._metadata = value._metadata
            return copied
        if type(value) in (list, tuple):
            earlier = previous if type(previous) is type(value) and len(previous) == len(value) else [None] * len(value)
            return type(value)(copy(item, earlier_item) for item, earlier_item in zip(value, earlier))
        return value

    return copy(checkpoint, reuse)


def prune_checkpoints(scored: List[Tuple[float, str]], keep_best: int, keep_always: List[str],
                      higher_is_better: bool) -> List[str]:
    """Delete all but the ``keep_best`` best-scored checkpoints (and ``keep_always``); return the deleted paths.

    A NaN score (an epoch without a value of the metric, or a diverged one) is never among the best."""
    ranked = sorted((item for item in scored if not math.isnan(item[0])), key=lambda item: item[0],
                    reverse=higher_is_better)
    keep = {path for _, path in ranked[:keep_best]} | set(keep_always)
    deleted = []
    for _, path in scored:
        if path not in keep and os.path.exists(path):
            remove_checkpoint(path)
            deleted.append(path)
    return deleted


# Beside the checkpoints of a run: the scores the best-k pruning ranked them by, so that a run continued in a new
# process (auto_resume, ModelLoadContinueTraining into the same folder) keeps pruning the checkpoints written before.
RANKING_FILE_NAME = ".aitoolbox-checkpoint-ranking.json"


def _is_checkpoint_name(name: str) -> bool:
    """A checkpoint file's or sharded checkpoint folder's name, without any path part."""
    if os.sep in name or (os.altsep and os.altsep in name) or "/" in name:
        return False
    return checkpoint_position(name) is not None or checkpoint_position(f"{name}.pth") is not None


def ranking_file_name(tag: Optional[str] = None) -> str:
    """The ranking record's name: :data:`RANKING_FILE_NAME`, or for a tagged ranking (a later one of several
    checkpoint callbacks in one folder) ``.aitoolbox-checkpoint-ranking-<tag>.json``."""
    return RANKING_FILE_NAME if tag is None else f".aitoolbox-checkpoint-ranking-{tag}.json"


def write_checkpoint_ranking(folder: str, metric: str, scored: List[Tuple[float, str]],
                             tag: Optional[str] = None) -> str:
    """Record, atomically, the ``(score, path)`` of the checkpoints in ``folder`` ranked by ``metric`` (in the
    record of ``tag``, see :func:`ranking_file_name`); returns the record's path."""
    entries = [[score, os.path.basename(path)] for score, path in scored if os.path.dirname(path) == folder]
    path = os.path.join(folder, ranking_file_name(tag))
    atomic_write_text(path, json.dumps({"metric": metric, "checkpoints": entries}))
    return path


def read_checkpoint_ranking(folder: str, metric: str, tag: Optional[str] = None) -> List[Tuple[float, str]]:
    """The ``(score, path)`` recorded by :func:`write_checkpoint_ranking` for ``metric`` (and ``tag``), of the
    checkpoints that still exist; nothing when there is no record, it ranks by another metric, or it cannot be
    read (the checkpoints it named are then kept, never deleted by mistake)."""
    path = os.path.join(folder, ranking_file_name(tag))
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        # Only checkpoint names directly inside the folder: pruning deletes what the record names.
        entries = [(float(score), os.path.join(folder, name)) for score, name in record["checkpoints"]
                   if isinstance(name, str) and _is_checkpoint_name(name)]
        recorded_metric = record["metric"]
    except (OSError, ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as error:
        # A planted or damaged record (a score beyond a float, JSON nested deeper than the parser goes) ranks nothing.
        logger.warning("Not pruning the checkpoints saved before in %s: %s cannot be read (%s)", folder,
                       ranking_file_name(tag), error)
        return []
    if recorded_metric != metric:
        logger.info("The checkpoints saved before in %s were ranked by %r, not %r: they are kept", folder,
                    recorded_metric, metric)
        return []
    return [(score, checkpoint) for score, checkpoint in entries if os.path.exists(checkpoint)]
