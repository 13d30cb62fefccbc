"""One outcome in every process for a step that some processes did alone (a checkpoint's completion, its upload).

In distributed training rank 0 alone writes a non-sharded checkpoint, completes (renames) a sharded one, prunes
old checkpoints and uploads them. If only rank 0 learned that such a step failed, rank 0 would stop while the
other ranks trained on, waiting in their next collective until it timed out with an unrelated error, or worse,
reported a checkpoint as saved that is not. So each such step ends with an exchange of outcomes: every process
hands in its error (or None), and every process raises the same error when any failed.

The error travels as text (its type's name, errno and message): exceptions do not all pickle, and a class known
in one process need not be importable in another.
"""
import builtins
import errno as errno_codes
from typing import Any, Callable, List, Optional, Tuple

# (rank, type name, errno or None, message) of a failed step; None for a step that succeeded.
Outcome = Optional[Tuple[int, str, Optional[int], str]]


def describe_failure(error: Optional[BaseException], rank: int) -> Outcome:
    """What ``error`` (raised in process ``rank``) becomes to travel to the other processes; None for no error."""
    if error is None:
        return None
    code = error.errno if isinstance(error, OSError) else None
    # OSError(errno, message) keeps the message in strerror; str() would add "[Errno n]" once more when rebuilt.
    message = error.strerror if code is not None and error.strerror else str(error)
    return rank, type(error).__name__, code, message


def rebuild_failure(outcome: Tuple[int, str, Optional[int], str]) -> BaseException:
    """The same error in every process: an OSError of the errno's subclass (``PermissionError``, ...), a built-in
    exception of the same type, or a RuntimeError that names the type."""
    rank, type_name, code, message = outcome
    message = f"{message} (on rank {rank})"
    if code is not None and code in errno_codes.errorcode:
        return OSError(code, message)  # OSError picks PermissionError, FileNotFoundError, ... by errno
    kind = getattr(builtins, type_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, OSError):
        try:
            return kind(message)
        except TypeError:  # a built-in exception with another constructor (UnicodeError's subclasses)
            pass
    return RuntimeError(f"{type_name}: {message}")


def raise_shared_outcome(error: Optional[BaseException], exchange: Callable[[Outcome], List[Outcome]],
                         rank: int, distributed: bool) -> None:
    """Hand this process's ``error`` (or None) to ``exchange`` and raise the first failure it reports.

    A collective when ``distributed``: every process calls it at the same point, whatever its own outcome.

    Args:
        error: what the step raised in this process, or None.
        exchange: sends this process's outcome and returns the outcomes that decide: every process's (an
            all-gather), or rank 0's alone (a broadcast, when only rank 0 did the step).
        rank: this process's rank.
        distributed: False in a single process: its own error is raised unchanged.

    Raises:
        The first failure, rebuilt alike in every process (see :func:`rebuild_failure`); in the process where it
        happened, chained to the original error, or the original itself when its type cannot be rebuilt.
    """
    if not distributed:
        if error is not None:
            raise error
        return
    failures = [outcome for outcome in exchange(describe_failure(error, rank)) if outcome is not None]
    if not failures:
        return
    shared = rebuild_failure(failures[0])
    if error is not None and failures[0][0] == rank:
        if type(shared) is not type(error):
            raise error  # its own type (e.g. CloudStorageError) where it happened: callers may catch that
        raise shared from error
    raise shared


def exchange_in_group(process_group: Any, world_size: int) -> Callable[[Outcome], List[Outcome]]:
    """An all-gather of outcomes in ``process_group`` (None: the default group), ordered by rank."""
    def exchange(outcome: Outcome) -> List[Outcome]:
        import torch.distributed as dist
        gathered: List[Outcome] = [None] * world_size
        dist.all_gather_object(gathered, outcome, group=process_group)
        return gathered
    return exchange
