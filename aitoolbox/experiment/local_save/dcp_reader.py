"""Reading a sharded checkpoint's folder for torch's DCP, without DCP opening or unpickling any file itself.

DCP's own reader unpickles the index ``.metadata`` with plain ``pickle``, falls back to a rank-local
``__<rank>.metadata`` when that fails, reads each storage entry at whatever path and length the index says, and
unpickles non-tensor entries fully. Here instead:

- :class:`~aitoolbox.experiment.local_save.checkpoint_folder.CheckpointFolder` opens the folder once; each file in it is opened once, by its name inside that open
  folder (a name with ``/``, ``..`` or an absolute path is refused), never through a symbolic link, and must be a
  regular file.
- :func:`~aitoolbox.experiment.local_save.dcp_index.read_dcp_metadata` reads ``.metadata`` once, with aitoolbox's restricted pickle reader, and rebuilds DCP's
  index from plain data: every storage entry names a file of the folder, within that file's size, without a
  transform (compression, encryption) of the file's choosing, and no tensor is larger than its stored pieces allow.
- :class:`FolderStorageReader` hands DCP that index (its ``read_metadata`` takes no rank: DCP never asks it for a
  rank-local one) and reads each entry's bytes itself, through aitoolbox's reader of torch files; a tensor is
  copied into DCP's target, any other value handed to :class:`RestrictedLoadPlanner`.
- :func:`dcp_errors` turns DCP's ``CheckpointException`` (a ``BaseException``) into aitoolbox's loading errors.
"""
import contextlib
import io
from typing import Any, Iterator, List

import torch

from aitoolbox.experiment.local_save.checkpoint_folder import CheckpointFolder
from aitoolbox.experiment.local_save.dcp_index import METADATA_FILE
from aitoolbox.experiment.local_save.restricted_pickle import short
from aitoolbox.experiment.local_save.safe_load import CheckpointLoadError, CorruptCheckpointError, read_torch_source


def _storage_reader_base() -> type:
    from torch.distributed.checkpoint.storage import StorageReader
    return StorageReader


def _planner_base() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    return DefaultLoadPlanner


class RestrictedLoadPlanner(_planner_base()):  # type: ignore[misc]
    """DCP's default load planner, except that a non-tensor entry arrives already read (DCP's own unpickles it
    fully): it is only put in place."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value


class FolderStorageReader(_storage_reader_base()):  # type: ignore[misc]
    """A DCP storage reader over an open
    :class:`~aitoolbox.experiment.local_save.checkpoint_folder.CheckpointFolder` and its index read by
    :func:`~aitoolbox.experiment.local_save.dcp_index.read_dcp_metadata`.

    Use it with :class:`RestrictedLoadPlanner`: ``dcp.load(state, storage_reader=..., planner=...)``.
    """

    def __init__(self, folder: CheckpointFolder, metadata: Any):
        super().__init__()
        self._folder = folder
        self._metadata = metadata

    @property
    def checkpoint_id(self) -> str:
        return self._folder.path

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self) -> Any:  # no rank: DCP's fallback to a rank-local index never happens
        return self._metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool) -> None:
        if metadata is not self._metadata:
            raise CorruptCheckpointError(self._folder.path, "DCP was handed an index this reader did not read")

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: List[Any]) -> List[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        for request in plan.items:
            info = self._metadata.storage_data.get(request.storage_index)
            if info is None:
                raise CorruptCheckpointError(self._folder.where(METADATA_FILE),
                                             f"it has no storage entry for {short(request.storage_index.fqn)}")
            where = f"{self._folder.where(info.relative_path)} (its entry {short(request.storage_index.fqn)})"
            data = self._folder.read(info.relative_path, info.offset, info.length)
            value = read_torch_source(io.BytesIO(data), where)
            del data
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, value)
                continue
            if type(value) is not torch.Tensor:
                raise CorruptCheckpointError(where, f"a tensor's entry holds a {type(value).__name__}")
            try:
                piece = narrow_tensor_by_index(value, request.storage_offsets, request.lengths)
            except (RuntimeError, IndexError) as error:
                raise CorruptCheckpointError(where, f"its piece does not hold the part the index says ({error})")
            target = planner.resolve_tensor(request).detach()
            if target.size() != piece.size() or target.dtype != piece.dtype:
                raise CorruptCheckpointError(where, f"it holds {tuple(piece.size())} {piece.dtype}, the index says "
                                                    f"{tuple(target.size())} {target.dtype}")
            target.copy_(piece)
            planner.commit_tensor(request, target)
        done: Any = Future()
        done.set_result(None)
        return done


@contextlib.contextmanager
def dcp_errors(path: str) -> Iterator[None]:
    """Raise what DCP met, wrapped in its ``CheckpointException`` (a ``BaseException``), as aitoolbox's errors: ours
    as they are, any other as a :class:`CheckpointLoadError` naming ``path``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        causes = {rank: failure[0] if isinstance(failure, tuple) else failure
                  for rank, failure in error.failures.items()}
        for cause in causes.values():
            if isinstance(cause, CheckpointLoadError):
                raise cause from error
        rank, first = next(iter(causes.items())) if causes else (None, error)
        raise CheckpointLoadError(path, f"it does not fit the model and optimizers given, or its files are damaged "
                                        f"(rank {rank}: {type(first).__name__}: {first})") from error
