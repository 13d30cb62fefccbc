"""Sharded checkpoints: a folder written by every process of a sharded (FSDP) run, with torch's DCP.

Under ``gpu_mode='fsdp'`` each process holds only its shard of the parameters and optimizer state, so a
checkpoint is written by all of them at once with ``torch.distributed.checkpoint`` (DCP) instead of one
``.pth`` file written by rank 0. Nothing is gathered: each process writes its own shards.

Layout on disk: the checkpoint of ``model_<experiment>_<timestamp>_E<epoch>[_ITER<i>].pth`` is the folder of
the same name without ``.pth`` (:func:`sharded_checkpoint_name`)::

    checkpoint_model/model_<experiment>_<timestamp>_E<epoch>[_ITER<i>]/
        .metadata               DCP's index of every tensor and where its pieces are (written by rank 0)
        __<rank>_0.distcp       each process's shards of the model and optimizer states
        extra_rank<rank>.pt     each process's own other state (counters, history, RNG states): torch.save
        checkpoint.json         the completion marker: written last; names the number of processes

The DCP state is ``{"model": <model state dict>, "optimizers": {"0": <state dict>, ...}}``, both keyed by
parameter names (``get_model_state_dict`` / ``get_optimizer_state_dict``): the same keys whether the model is
sharded or not, which is what lets a checkpoint load into another number of processes. The extra state is one
file per process because RNG states differ per process; it must load with ``torch.load(weights_only=True)``
(tensors, numbers, strings and containers of them), which is checked when it is saved.

Atomicity: every process writes into ``.tmp-<name>/`` beside the final folder. When DCP has finished (all
processes' files and ``.metadata`` are on disk), rank 0 writes the marker, fsyncs, renames the folder to its
final name and fsyncs the parent. A folder counts as a checkpoint only with its marker
(:func:`is_sharded_checkpoint`): a save killed at any moment leaves at most a ``.tmp-`` folder, which listing
ignores, and the previous checkpoint stays the newest. Rank 0 records in each temporary folder who writes it
(host, process id, job id): at the start of every save it removes the temporaries of saves whose writer is gone
(killed: they are full size), never one a live process may still write (see
:func:`~aitoolbox.experiment.local_save.leftovers.remove_stale_temporaries`). Replacing an existing folder of the
same name renames it aside first: killed in between, that name is missing (never half-written) and the
checkpoint before it is the newest.

One outcome in every process: what one process meets (rank 0 cannot create or complete the folder, a full disk,
a failed write in any process) is raised by every process, the same error, and no process's ``wait()`` returns
the path of a checkpoint that is not complete. The processes exchange their outcomes over the save's process
group, so a failure on one rank never leaves the others waiting for it beyond the group's timeout.

Asynchronous saving (``async_save=True``): the state is copied to host memory (the only stall), DCP writes it in
a background thread while training goes on, rank 0 renames the folder when the write completes, and the
processes then exchange the outcome (in that background thread). DCP needs a
process group with a CPU backend for this: gloo on the CPU, ``init_process_group("cpu:gloo,cuda:nccl")`` on
GPUs. Its background collectives must not interleave with training's, so pass a group of its own made once by
every process with :func:`checkpoint_process_group`. Wait for a save's :meth:`ShardedCheckpointSave.wait`
before the next save, and before the program ends.

Resharding: loading works with any number of processes. DCP reads into each process's shards the pieces it
needs, whatever the sharding was at save time; a single process without a process group loads into a plain
model (2 -> 1), and a single process can write a checkpoint the same way that a sharded run loads (1 -> 2).
Process ``r`` gets the extra state of saved process ``r % saved_world_size``: counters and history are the
same in every process, RNG states then come from that process.

:func:`consolidate_sharded_checkpoint` turns a checkpoint into one ordinary ``.pth`` file of the full model state
dict, offline in one process; :func:`aitoolbox.torchtrain.distributed.fsdp.gather_full_model_state_dict` gathers it from a live sharded
model (the strategy's job).
"""
import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX, _fsync_directory, atomic_write_bytes, atomic_write_text
from aitoolbox.experiment.local_save.leftovers import OWNER_FILE, create_temporary_folder, remove_stale_temporaries
from aitoolbox.experiment.local_save.restricted_pickle import short
from aitoolbox.experiment.local_save.safe_load import CorruptCheckpointError, read_torch_source
from aitoolbox.experiment.local_save.shared_outcome import exchange_in_group, raise_shared_outcome

# torch.distributed.checkpoint (and dcp_reader, built on it) is imported where it is used: this module is imported
# wherever checkpoints are listed, and most runs never touch DCP.

MARKER_FILE = "checkpoint.json"
FORMAT = "aitoolbox-sharded-checkpoint"
FORMAT_VERSION = 1
_MODEL = "model"
_OPTIMIZERS = "optimizers"


def sharded_checkpoint_name(file_name: str) -> str:
    """The folder name of a sharded checkpoint: its ``.pth`` file name without the suffix."""
    if not file_name.endswith(".pth") or os.sep in file_name:
        raise ValueError(f"expected a checkpoint file name such as 'model_exp_ts_E3.pth', got {file_name!r}")
    return file_name[:-len(".pth")]


def _extra_state_file(rank: int) -> str:
    return f"extra_rank{rank}.pt"


def is_sharded_checkpoint(path: str) -> bool:
    """True for a complete sharded checkpoint folder (one with its completion marker, not a temporary one)."""
    return (not os.path.basename(os.path.normpath(path)).startswith(TEMP_PREFIX)
            and os.path.isfile(os.path.join(path, MARKER_FILE)))


def sharded_checkpoint_info(path: str) -> Dict[str, Any]:
    """The completion marker of a checkpoint: ``world_size`` (processes that saved it), ``num_optimizers``,
    ``stateless_optimizers`` (indices of optimizers that had no state yet), ``torch_version``.

    Raises:
        FileNotFoundError: ``path`` is not a complete sharded checkpoint (no such folder, a temporary folder
            of an interrupted save, or a folder without its marker).
        CorruptCheckpointError: the marker is not one this package writes (a ``ValueError``).
    """
    from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder

    _check_complete(path)
    with CheckpointFolder(path) as folder:
        return _read_marker(folder)


def _check_complete(path: str) -> None:
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint: a checkpoint folder holds "
                                f"{MARKER_FILE}, written once every process has saved its part (a folder without it, "
                                f"or named {TEMP_PREFIX}*, is an interrupted save)")


_MAX_MARKER_BYTES = 1 << 20


def _read_marker(folder: Any) -> Dict[str, Any]:
    """The marker of the open checkpoint ``folder``, each field checked (it comes from storage)."""
    where = folder.where(MARKER_FILE)
    if folder.size(MARKER_FILE) > _MAX_MARKER_BYTES:
        raise CorruptCheckpointError(where, f"it is larger than the {_MAX_MARKER_BYTES} bytes a marker takes")
    try:
        info = json.loads(folder.read(MARKER_FILE).decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise CorruptCheckpointError(where, f"it is not JSON ({type(error).__name__}: {error})") from None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(where, f"it is not a JSON object but a {type(info).__name__}")
    if info.get("format") != FORMAT:
        raise CorruptCheckpointError(where, f"it is not a {FORMAT} marker (format {short(info.get('format'))})")
    version, world_size, count = info.get("version"), info.get("world_size"), info.get("num_optimizers")
    stateless = info.get("stateless_optimizers", [])

    def whole(value: Any, low: int, high: int) -> bool:
        return type(value) is int and low <= value <= high

    if not whole(version, 1, FORMAT_VERSION):
        raise CorruptCheckpointError(where, f"its version {short(version)} is not one this package reads (1 to "
                                            f"{FORMAT_VERSION}): written by a newer aitoolbox?")
    if not whole(world_size, 1, 1 << 20) or not whole(count, 0, 1 << 16) or type(stateless) is not list \
            or not all(whole(index, 0, count - 1) for index in stateless):
        raise CorruptCheckpointError(where, f"its world_size {short(world_size)}, num_optimizers {short(count)} or "
                                            f"stateless_optimizers {short(stateless)} are not counts and indices")
    return dict(info, stateless_optimizers=stateless)


def checkpoint_process_group(timeout_s: Optional[float] = None) -> Any:
    """A gloo process group of all processes for checkpoint saves, apart from training's collectives.

    A collective: every process calls it, once, at the same point. Returns None when no process group is
    initialised (a single process). An asynchronous save runs DCP's collectives in a background thread; on the
    training group they could interleave with training's own collectives differently in different processes.

    Args:
        timeout_s: how long a save's collective waits for a missing process before failing. None: the default
            process group's timeout (``fit_distributed(timeout_s=...)`` sets it), else torch's default.
    """
    import datetime
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else _default_group_timeout()
    return dist.new_group(backend="gloo", timeout=timeout)


def _default_group_timeout() -> Any:
    """The timeout the default process group was made with, or None (torch's default) where torch hides it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_group
        return _get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # another torch, or a group without a CPU backend
        return None


class ShardedCheckpointSave:
    """A save started by :func:`save_sharded_checkpoint`: done at once for a synchronous save.

    Attributes:
        path: the checkpoint folder, present once rank 0's save has completed.
    """

    def __init__(self, path: str, future: "concurrent.futures.Future[str]"):
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> str:
        """Block until this process's part is written (on rank 0: and the folder renamed); return the path.

        Raises:
            Exception: what the save met in this process (DCP reports a failure of any process to every one).
            TimeoutError: ``timeout`` seconds passed first.
        """
        return self._future.result(timeout)


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_intended(no_dist: bool) -> Iterator[None]:
    """DCP warns at every single-process save and load that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _group_rank_and_size(process_group: Any) -> tuple:
    import torch.distributed as dist
    if _distributed():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    if process_group is not None:
        raise ValueError("a process_group was given but torch.distributed is not initialised")
    return 0, 1


def _all_gather(obj: Any, process_group: Any, world_size: int) -> List[Any]:
    if not _distributed():
        return [obj]
    import torch.distributed as dist
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj, group=process_group)
    return gathered


def _as_list(optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]) -> list:
    if optimizers is None:
        return []
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _serialised_extra_state(extra_state: dict) -> bytes:
    """``extra_state`` as torch.save bytes, refused now rather than at resume if weights-only loading fails."""
    if not isinstance(extra_state, dict):
        raise TypeError(f"extra_state must be a dict, got {type(extra_state).__name__}")
    buffer = io.BytesIO()
    torch.save(extra_state, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:
        raise TypeError("extra_state must load with torch.load(weights_only=True): keep to tensors, numbers, "
                        f"strings and lists/tuples/dicts of them (convert numpy values first); {error}") from error
    return data


def _optimizer_state_dicts(model: nn.Module, optimizers: list) -> tuple:
    """The optimizers' state dicts keyed by parameter name (sharded under FSDP), and the indices of those that
    had no state yet. DCP's ``get_optimizer_state_dict`` fills an empty optimizer's state with a step at lr 0;
    that state is dropped again here so that saving changes nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    states, stateless = {}, []
    for index, optimizer in enumerate(optimizers):
        if not optimizer.state:
            stateless.append(index)
        states[str(index)] = get_optimizer_state_dict(model, optimizer)
        if index in stateless:
            optimizer.state.clear()
    return states, stateless


def _replace_folder(temp_path: str, path: str) -> None:
    """Rename the finished ``temp_path`` to ``path`` (a folder of that name is moved aside and removed)."""
    parent = os.path.dirname(path)
    aside = os.path.join(parent, f"{TEMP_PREFIX}{os.path.basename(path)}.old")
    if os.path.lexists(path):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    os.rename(temp_path, path)
    _fsync_directory(parent)
    shutil.rmtree(aside, ignore_errors=True)


def _finish(temp_path: str, path: str, world_size: int, num_optimizers: int, stateless: List[int]) -> None:
    """Rank 0 completes the folder: marker, rename. Raises OSError naming ``path``; the temporary folder is then
    removed (a full disk gets its space back)."""
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "world_size": world_size,
              "num_optimizers": num_optimizers, "stateless_optimizers": stateless, "torch_version": torch.__version__}
    try:
        atomic_write_text(os.path.join(temp_path, MARKER_FILE), json.dumps(marker, indent=1))  # fsyncs the folder
        _replace_folder(temp_path, path)
        # Complete: nobody writes it any more. Removed only now: a temporary folder without its owner record, left by
        # a process killed before the rename, would wait STALE_AFTER_S for its removal.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, OWNER_FILE))
    except OSError as error:
        shutil.rmtree(temp_path, ignore_errors=True)
        raise OSError(error.errno, f"cannot complete the checkpoint {path}: {error.strerror or error}") from error


def _complete_everywhere(temp_path: str, path: str, rank: int, world_size: int, num_optimizers: int,
                         stateless: List[int], process_group: Any, write_error: Optional[BaseException]) -> str:
    """After DCP's write: agree that every process wrote its part, have rank 0 complete the folder, agree on that.
    A collective; raises the same error in every process when any step failed anywhere."""
    exchange = exchange_in_group(process_group, world_size)
    distributed = _distributed()
    try:
        raise_shared_outcome(write_error, exchange, rank, distributed)
    except BaseException as shared:
        if rank == 0:
            shutil.rmtree(temp_path, ignore_errors=True)
        if write_error is not None:
            raise write_error  # DCP's own report (a CheckpointException naming each process's failure)
        raise shared
    finish_error = None
    if rank == 0:
        try:
            _finish(temp_path, path, world_size, num_optimizers, stateless)
        except OSError as error:
            finish_error = error
    raise_shared_outcome(finish_error, exchange, rank, distributed)
    return path


def _start(path: str, temp_path: str, extra_state: dict, rank: int, world_size: int, process_group: Any) -> None:
    """Check the arguments in every process, have rank 0 create the temporary folder (removing what an
    interrupted save of this name left), then write this process's extra state into it. What is wrong in one
    process is raised in all of them, before any of them enters DCP's collectives (where the others would wait)."""
    error = None
    try:
        extra_bytes = _serialised_extra_state(extra_state)
    except TypeError as type_error:
        error = ("TypeError", f"process {rank}: {type_error}")
    if rank == 0 and error is None:
        try:
            # Every earlier save of this process was waited for: what killed saves left can go (full size).
            remove_stale_temporaries(os.path.dirname(path))
            for leftover in (temp_path, f"{temp_path}.old"):
                shutil.rmtree(leftover, ignore_errors=True)
            create_temporary_folder(temp_path)
        except OSError as os_error:
            error = ("OSError", f"cannot create the checkpoint folder {temp_path}: {os_error}")
    gathered = _all_gather((path, error), process_group, world_size)
    errors = [error for _, error in gathered if error is not None]
    paths = [saved_path for saved_path, _ in gathered]
    if (errors or len(set(paths)) > 1) and rank == 0:
        shutil.rmtree(temp_path, ignore_errors=True)
    if errors:
        kind, message = errors[0]
        raise (TypeError if kind == "TypeError" else OSError)(message)
    if len(set(paths)) > 1:
        raise ValueError(f"save_sharded_checkpoint was given different folders in different processes: {paths}; "
                         "every process must save into the same folder (name it on rank 0 and broadcast it)")
    write_error = None
    try:
        atomic_write_bytes(os.path.join(temp_path, _extra_state_file(rank)), extra_bytes)
    except OSError as os_error:  # e.g. a full disk on one node: every process stops, none waits in DCP
        write_error = os_error
    try:
        raise_shared_outcome(write_error, exchange_in_group(process_group, world_size), rank, _distributed())
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp_path, ignore_errors=True)
        raise


def save_sharded_checkpoint(folder_path: str, model: nn.Module,
                            optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None],
                            extra_state: dict, async_save: bool = False,
                            process_group: Any = None) -> ShardedCheckpointSave:
    """Write a sharded checkpoint of ``model`` and ``optimizers`` to the folder ``folder_path``.

    A collective: every process of the group calls it with the same ``folder_path``. Without an initialised
    process group one process writes the same format (its model plain or sharded on one process).

    Args:
        folder_path: the final checkpoint folder (see :func:`sharded_checkpoint_name`); replaced if it exists.
        model: the model, sharded with ``fully_shard`` or plain.
        optimizers: an optimizer or a list of them (over ``model``'s parameters), or None.
        extra_state: this process's other state (counters, history, RNG states...); loadable with
            ``torch.load(weights_only=True)``.
        async_save: return once the state is copied to host memory and write it in the background.
        process_group: the group that saves (None: the default group). For ``async_save`` use
            :func:`checkpoint_process_group`.

    Returns:
        The save: :meth:`ShardedCheckpointSave.wait` returns the path once it is complete.

    Raises:
        ValueError: the processes were given different folders.
        TypeError: ``extra_state`` of some process does not load with ``weights_only=True``.
        OSError: rank 0 could not create or complete the folder.
        AssertionError: ``async_save`` in a process group without a CPU backend (DCP's check).
        torch.distributed.checkpoint.api.CheckpointException: DCP's save failed, in any process (an
            asynchronous save raises it from ``wait``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    rank, world_size = _group_rank_and_size(process_group)
    path = os.path.abspath(os.path.expanduser(folder_path))
    temp_path = os.path.join(os.path.dirname(path), TEMP_PREFIX + os.path.basename(path))
    _start(path, temp_path, extra_state, rank, world_size, process_group)
    optimizers = _as_list(optimizers)
    optimizer_states, stateless = _optimizer_state_dicts(model, optimizers)
    state = {_MODEL: get_model_state_dict(model), _OPTIMIZERS: optimizer_states}
    result: "concurrent.futures.Future[str]" = concurrent.futures.Future()
    no_dist = not _distributed()
    if not async_save:
        with _single_process_intended(no_dist):
            dcp.save(state, checkpoint_id=temp_path, process_group=process_group, no_dist=no_dist)
        # DCP returns in every process once all files and .metadata are written (or raises in every process).
        _complete_everywhere(temp_path, path, rank, world_size, len(optimizers), stateless, process_group, None)
        result.set_result(path)
        return ShardedCheckpointSave(path, result)

    written = dcp.async_save(state, checkpoint_id=temp_path, process_group=process_group, no_dist=no_dist)

    def on_written(future: concurrent.futures.Future) -> None:
        # Runs in DCP's writer thread (every process: the exchanges below are collectives of the save's group,
        # which nothing else uses until wait() returned). DCP's future completes in rank 0 only after every
        # process's write results were gathered and .metadata was written, so rank 0 may complete the folder then.
        try:
            error = future.exception()
            result.set_result(_complete_everywhere(temp_path, path, rank, world_size, len(optimizers), stateless,
                                                   process_group, error))
        except BaseException as error:  # hand every failure to wait()
            result.set_exception(error)

    written.add_done_callback(on_written)
    return ShardedCheckpointSave(path, result)


def load_sharded_checkpoint(folder_path: str, model: nn.Module,
                            optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None],
                            process_group: Any = None, *, expected_identity: Optional[tuple] = None) -> dict:
    """Load a sharded checkpoint into ``model`` and ``optimizers``; return this process's extra state.

    A collective in a process group (every process calls it); a single process needs none. The model and
    optimizers are as they will train: sharded with ``fully_shard`` (any number of processes) or plain; each
    process reads the pieces of its shards, so the number of processes may differ from the saved one.

    Args:
        folder_path: a checkpoint folder (see :func:`is_sharded_checkpoint`).
        model: the model, sharded or plain, with the saved parameter names.
        optimizers: the optimizers, as many as were saved, over ``model``'s parameters.
        process_group: the group that loads (None: the default group, or none at all).
        expected_identity: the folder's identity when its training state was read
            (:func:`read_sharded_checkpoint_state_and_identity`): the folder read now must be the same one.

    Returns:
        The extra state of saved process ``rank % saved_world_size``.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        UntrustedCheckpointError: DCP's index ``.metadata`` or an entry holds objects only full unpickling can
            build (a planted file); nothing from it was run.
        CorruptCheckpointError: a file of the folder is damaged or not what it should be, DCP's index names a
            file outside the folder or bytes beyond a file, or a file is a symbolic link or not a regular file, or
            the folder is not the one of ``expected_identity``.
        ValueError: the number of optimizers differs from the saved one.
        CheckpointLoadError: DCP's load failed otherwise, e.g. a parameter is missing or has another shape in the
            checkpoint (a ``RuntimeError``); in a process group, another process could not read the checkpoint.
        All of them in every process of the group.
    """
    from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder

    path = os.path.abspath(os.path.expanduser(folder_path))
    _check_complete(path)
    with CheckpointFolder(path, expected_identity) as folder:
        return _load_sharded(folder, model, _as_list(optimizers), process_group)


def _read_for_load(folder: Any, optimizers: list, process_group: Any) -> tuple:
    """The marker, DCP's index and this process's extra state of ``folder``, read by every process; what one process
    cannot read stops all of them before DCP's collectives (where the others would wait for it)."""
    from aitoolbox.experiment.local_save.dcp_index import read_dcp_metadata
    from aitoolbox.experiment.local_save.safe_load import CheckpointLoadError

    rank, world_size = _group_rank_and_size(process_group)
    info, metadata, extra, error = None, None, None, None
    try:
        info = _read_marker(folder)
        if len(optimizers) != info["num_optimizers"]:
            raise ValueError(f"the checkpoint {folder.path} holds {info['num_optimizers']} optimizer state(s), "
                             f"{len(optimizers)} optimizer(s) were given: pass the optimizers of the saved run")
        metadata = read_dcp_metadata(folder)  # the one read of DCP's index; DCP opens no file itself
        extra = _extra_state(folder, info, rank)
    except Exception as failure:  # noqa: BLE001 - every process must learn it
        error = failure
    if _distributed():
        failures = [outcome for outcome in exchange_in_group(process_group, world_size)(
            None if error is None else (rank, type(error).__name__, str(error))) if outcome is not None]
        if failures and error is None:
            other, kind, message = failures[0]
            raise CheckpointLoadError(folder.path, f"process {other} could not read it ({kind}: {message})")
    if error is not None:
        raise error
    return info, metadata, extra


def _load_sharded(folder: Any, model: nn.Module, optimizers: list, process_group: Any) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    from aitoolbox.experiment.local_save.dcp_reader import FolderStorageReader, RestrictedLoadPlanner, dcp_errors

    path = folder.path
    info, metadata, extra = _read_for_load(folder, optimizers, process_group)
    stateless = set(info["stateless_optimizers"])
    with_state = [index for index in range(len(optimizers)) if index not in stateless]
    # DCP loads into existing tensors: an optimizer without state gets it (zeros) from a step at lr 0, which
    # DCP skips while gradients exist; set them aside meanwhile (loading replaces the training state anyway).
    grads = {}
    for index in with_state:
        for group in optimizers[index].param_groups:
            for param in group["params"]:
                grads[param] = param.grad
                param.grad = None
    try:
        optimizer_states = {str(index): get_optimizer_state_dict(model, optimizers[index]) for index in with_state}
    finally:
        for param, grad in grads.items():
            param.grad = grad
    state = {_MODEL: get_model_state_dict(model), _OPTIMIZERS: optimizer_states}
    with _single_process_intended(not _distributed()), dcp_errors(path):
        dcp.load(state, storage_reader=FolderStorageReader(folder, metadata), planner=RestrictedLoadPlanner(),
                 process_group=process_group, no_dist=not _distributed())
    set_model_state_dict(model, state[_MODEL])
    for index, optimizer in enumerate(optimizers):
        if index in stateless:
            optimizer.state.clear()
        else:
            set_optimizer_state_dict(model, optimizer, state[_OPTIMIZERS][str(index)])
    return extra


def read_sharded_checkpoint_state(folder_path: str, rank: int = 0, check_index: bool = True) -> dict:
    """The extra state saved process ``rank % saved_world_size`` wrote, without loading any weights.

    Args:
        folder_path: the checkpoint folder.
        rank: this process's rank.
        check_index: also read DCP's index and check that its entries lie inside the folder's files (cheap: the
            weights are not read), so that a damaged or planted index is found now, not when the weights load.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        UntrustedCheckpointError / CorruptCheckpointError: as for a checkpoint file (see
            :mod:`~aitoolbox.experiment.local_save.safe_load`).
    """
    return read_sharded_checkpoint_state_and_identity(folder_path, rank, check_index)[0]


def read_sharded_checkpoint_state_and_identity(folder_path: str, rank: int = 0,
                                               check_index: bool = True) -> Tuple[dict, Optional[tuple]]:
    """:func:`read_sharded_checkpoint_state` and the identity of the folder it was read from, which
    :func:`load_sharded_checkpoint` (``expected_identity``) checks when it reads the weights later: a folder
    swapped in between (for a link to another run's checkpoint) is refused rather than read."""
    from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder
    from aitoolbox.experiment.local_save.dcp_index import read_dcp_metadata

    _check_complete(folder_path)
    with CheckpointFolder(folder_path) as folder:
        info = _read_marker(folder)
        if check_index:
            read_dcp_metadata(folder)
        return _extra_state(folder, info, rank), folder.identity


def _extra_state(folder: Any, info: Dict[str, Any], rank: int) -> dict:
    name = _extra_state_file(rank % info["world_size"])
    state = read_torch_source(folder.open(name), folder.where(name))
    if not isinstance(state, dict):
        raise CorruptCheckpointError(folder.where(name), f"it holds a {type(state).__name__}, not the dict of a "
                                                         "process's training state")
    return state


def consolidate_sharded_checkpoint(folder_path: str, output_pth: str, key: Optional[str] = None) -> str:
    """Write the full model state dict of a sharded checkpoint to one ordinary ``.pth`` file; returns its path.

    Offline, in one process without a process group (it holds the whole model in memory). The file loads with
    ``model.load_state_dict(torch.load(output_pth))`` into the plain, unsharded model.

    Args:
        folder_path: the checkpoint folder.
        output_pth: the file to write (atomically).
        key: None: the file is the state dict; a key such as ``'model_state_dict'``: ``{key: state dict}``, as
            aitoolbox 1.x's checkpoints hold it.
    """
    from aitoolbox.experiment.local_save.atomic import torch_save_atomic

    model_state = read_full_model_state_dict(folder_path)
    torch_save_atomic(model_state if key is None else {key: model_state}, output_pth)
    return output_pth


def read_full_model_state_dict(folder_path: str, *, expected_identity: Optional[tuple] = None
                               ) -> Dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, read into this process's memory (no process group
    needed): what :func:`consolidate_sharded_checkpoint` writes, for ``model.load_state_dict`` on the plain model.

    Args:
        folder_path: the checkpoint folder.
        expected_identity: as for :func:`load_sharded_checkpoint`.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        UntrustedCheckpointError / CorruptCheckpointError / CheckpointLoadError: see :func:`load_sharded_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder
    from aitoolbox.experiment.local_save.dcp_index import read_dcp_metadata
    from aitoolbox.experiment.local_save.dcp_reader import FolderStorageReader, RestrictedLoadPlanner, dcp_errors

    path = os.path.abspath(os.path.expanduser(folder_path))
    _check_complete(path)
    with CheckpointFolder(path, expected_identity) as folder:
        _read_marker(folder)
        metadata = read_dcp_metadata(folder)  # sizes bounded by what is stored: the allocations below are too
        prefix = f"{_MODEL}."
        # The model state dict is flat (parameter name -> tensor), so its DCP keys are "model." + the name.
        model_state = {}
        for name, item in metadata.state_dict_metadata.items():
            if name.startswith(prefix):
                model_state[name[len(prefix):]] = (torch.empty(item.size, dtype=item.properties.dtype)
                                                   if isinstance(item, TensorStorageMetadata) else io.BytesIO())
        with _single_process_intended(True), dcp_errors(path):
            dcp.load({_MODEL: model_state}, storage_reader=FolderStorageReader(folder, metadata),
                     planner=RestrictedLoadPlanner(), no_dist=True)
    return model_state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def remove_sharded_checkpoint(path: str) -> None:
    """Delete a checkpoint folder: renamed to a temporary name first, so it is never seen half-deleted."""
    path = os.path.abspath(path)
    aside = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.path.basename(path)}.old")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(path, aside)
    # A concurrent cleaner may remove parts of it too (remove_stale_temporaries): what is gone is no error.
    shutil.rmtree(aside, onerror=_ignore_missing)


def _ignore_missing(function, path: str, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
