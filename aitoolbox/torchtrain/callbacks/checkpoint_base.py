"""What the checkpoint callbacks share: the save itself (now, or in a background thread while training goes on,
or as a sharded DCP folder under FSDP), the upload of what was saved, and errors that keep the in-memory state
usable. The callbacks are in :mod:`aitoolbox.torchtrain.callbacks.model_save`.

Under distributed training every process learns the outcome of every save: what the main process alone does
(create the folder, write the file, complete a sharded folder, prune older checkpoints, upload) ends with an
exchange of outcomes, and every process raises the same error when it failed (see
:mod:`aitoolbox.experiment.local_save.shared_outcome`). A save in the background is decided at the next save, or
at the end of training, in every process alike.
"""
import concurrent.futures
import logging
import os
import threading
from typing import Callable, List, Optional

from aitoolbox.cloud.storage import CloudStorageError
from aitoolbox.experiment.local_save.leftovers import remove_stale_temporaries, remove_stale_temporaries_under
from aitoolbox.experiment.local_save.checkpoints import checkpoint_file_name, save_checkpoint_file, snapshot_checkpoint
from aitoolbox.experiment.local_save.shared_outcome import exchange_in_group, raise_shared_outcome
from aitoolbox.experiment.local_save.sharded_checkpoints import checkpoint_process_group, sharded_checkpoint_name
from aitoolbox.experiment.local_save.train_end_marker import CHECKPOINT_KEY as TRAIN_END_CHECKPOINT_KEY
from aitoolbox.experiment.local_save.train_end_marker import record_path, record_train_end_done
from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.torchtrain.callbacks.cloud_upload import upload_failed_at_train_end
from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback

logger = logging.getLogger(__name__)

# Checkpoints run after every other epoch-end callback (LR schedulers, metrics), so what they save is
# exactly the state the next epoch starts from.
CHECKPOINT_EXECUTION_ORDER = 100


def _train_end_follows(tl) -> bool:
    """In an epoch's end: the fit's training ends with this epoch (its target reached, or a stop requested so far),
    so the train end follows an epoch-end checkpoint taken now."""
    state, run_state = getattr(tl, "state", None), getattr(tl, "run_state", None)
    if state is None or run_state is None:  # not a TrainLoop's run
        return False
    if state.early_stop:
        return True
    if state.num_iterations > 0:
        return state.iterations_done >= state.num_iterations
    return run_state.epochs_completed_at_checkpoint(False) >= state.num_epochs


class CheckpointCallback(AbstractExperimentCallback):
    """Shared parts: hyperparameters, the save itself (now or in the background), the upload of what was saved,
    and the error that keeps the in-memory state usable."""

    # Checkpoints always go somewhere: the folder is known from registration on (a plain TrainLoop's default run
    # folder included), for the save a SIGTERM asks for and for the folder logged when training starts.
    requires_experiment_folder = True

    def __init__(self, callback_name: str, project_name, experiment_name, local_model_result_folder_path,
                 hyperparams: Optional[dict], cloud_save_mode=None, background_save: bool = False,
                 execution_order: int = CHECKPOINT_EXECUTION_ORDER, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None):
        super().__init__(callback_name, project_name, experiment_name, local_model_result_folder_path,
                         cloud_save_mode, bucket_name, cloud_dir_prefix, execution_order=execution_order)
        if hyperparams is not None and not isinstance(hyperparams, dict):
            raise TypeError(f"hyperparams must be a dict or None, got {type(hyperparams).__name__}")
        if not isinstance(background_save, bool):
            raise TypeError(f"background_save must be True or False, got {background_save!r}")
        self.hyperparams = dict(hyperparams or {})  # a copy: the caller's dict is never changed
        self.background_save = background_save
        self._writer: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending_save: Optional[concurrent.futures.Future] = None
        self._last_snapshot: Optional[dict] = None  # host memory the next snapshot is copied into
        self._abandon = threading.Event()  # set: the background save in flight stops and leaves no file
        self._save_group = None  # sharded saves: the process group DCP's collectives run in
        self._uploads: List[concurrent.futures.Future] = []  # main process: this callback's uploads not waited for

    def __getstate__(self) -> dict:
        # Sent to spawned training processes before any save: a thread pool cannot travel (nor needs to).
        state = self.__dict__.copy()
        state["_writer"] = None
        state["_pending_save"] = None
        state["_last_snapshot"] = None
        state["_abandon"] = None
        state["_save_group"] = None
        state["_uploads"] = []
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._abandon = threading.Event()

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        if self.hyperparams and self.experiment_folder.hyperparams is None:
            # A folder of the callback's own: write the hyperparameters when the first checkpoint creates it.
            self.experiment_folder.hyperparams = self.hyperparams

    def saved_hyperparams(self) -> dict:
        """The hyperparameters as checkpoints store them: secrets redacted (see
        :mod:`aitoolbox.experiment.redaction`); :attr:`hyperparams` keeps the real values."""
        return redact_hyperparams(self.hyperparams)

    @property
    def saves_shards(self) -> bool:
        """Every process writes its shards of the model and optimizer states (``gpu_mode='fsdp'``): checkpoints
        are DCP folders (see :mod:`~aitoolbox.experiment.local_save.sharded_checkpoints`)."""
        return bool(self.train_loop_obj.shards_parameters)

    def on_train_begin(self) -> None:
        super().on_train_begin()
        if self.cloud_destination is not None and self.is_main_process:
            self.cloud_upload_run_files()  # the hyperparameters of a folder made when the preset was built
        if self.saves_shards and self._save_group is None:
            # Every process, at the same point: DCP's collectives (in a background thread for background_save)
            # get a gloo group of their own, apart from training's.
            self._save_group = checkpoint_process_group()

    def on_train_end(self) -> None:
        """Wait for the save in flight and this callback's uploads; every process raises what either met."""
        try:
            error = None
            try:
                self.wait_for_pending_save()
                self._wait_for_uploads()
            except Exception as raised:
                error = raised
            self._raise_shared_outcome(error)
        finally:
            self._stop_writer()

    def cloud_upload(self, local_path: str, only_if_changed: bool = False):
        future = super().cloud_upload(local_path, only_if_changed)
        if future is not None:
            self._uploads.append(future)  # list.append is atomic: the writer thread uploads too
        return future

    def _wait_for_uploads(self) -> None:
        """Raise the first failure of this callback's uploads (main process; the others have none)."""
        uploads, self._uploads = self._uploads, []
        for future in uploads:
            if not future.cancelled():  # cancelled: a newer upload of the same file replaced it
                try:
                    future.result()
                except CloudStorageError as error:
                    raise upload_failed_at_train_end(error) from error

    def _raise_shared_outcome(self, error: Optional[BaseException], process_group=None,
                              all_processes: bool = False) -> None:
        """Every process raises the same error when ``error`` (the main process's, or with ``all_processes`` any
        process's) is not None. A collective in distributed training: every process calls it at the same point.
        Without ``all_processes`` the main process's outcome is broadcast over the training group (main thread
        only); with it, outcomes are gathered in ``process_group`` (any thread)."""
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        if all_processes:
            exchange = exchange_in_group(process_group, dist.get_world_size(process_group) if distributed else 1)
        else:
            def exchange(outcome):
                return [self.train_loop_obj.broadcast_object(outcome)]
        raise_shared_outcome(error, exchange, rank, distributed)

    def on_exception(self, exception: BaseException) -> None:
        """Complete the background save in flight, then stop the writer thread.

        The newest checkpoint file is then complete, and the previous ones are kept until it is. Should that
        save fail, its error is logged (``fit`` raises the exception that stopped training). Another
        KeyboardInterrupt while waiting abandons the save instead: its temporary file is removed and the
        previous checkpoint stays the newest.
        """
        try:
            self.wait_for_pending_save()
        except KeyboardInterrupt:
            self._abandon.set()
            logger.warning("%s: interrupted while waiting for the checkpoint being written; abandoning it (the "
                           "previous checkpoint stays the newest)", type(self).__name__)
        except Exception as error:  # reported here: fit re-raises what stopped training
            logger.error("%s: the checkpoint being written when training stopped could not be saved: %s",
                         type(self).__name__, error)
        finally:
            self._stop_writer()

    def _stop_writer(self) -> None:
        """Let the writer thread finish (after an abandoned save: quickly) and drop the host-memory copy."""
        writer, self._writer, self._pending_save = self._writer, None, None
        if writer is not None:
            writer.shutdown(wait=True)
        self._abandon = threading.Event()  # a later fit saves again
        self._last_snapshot = None

    def wait_for_pending_save(self) -> None:
        """Return once the background save in flight, if any, is complete; raise the error it met.

        Called before the next save and at the end of training, so ``fit`` never returns before the last
        checkpoint is on disk, and a failed background save stops training one checkpoint later.
        """
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def _save(self, checkpoint: dict, folder: str, file_name: str,
              after_save: Optional[Callable[[str], None]] = None) -> str:
        """Write ``checkpoint`` to ``folder/file_name`` and then run ``after_save(path)``; returns the path.

        With ``background_save`` the state is first copied to host memory (the stall training sees), into the
        previous save's copy when there is one, and the write happens in a thread while training goes on; one
        save is in flight at a time.
        """
        path = os.path.join(folder, file_name)
        try:
            self.ensure_folder(folder)
        except OSError as error:
            raise self._save_error(error, path) from error
        if not self.background_save:
            self._write(checkpoint, folder, file_name, after_save)
            return path
        self.wait_for_pending_save()  # also frees the last snapshot for reuse
        snapshot = snapshot_checkpoint(checkpoint, reuse=self._last_snapshot)
        self._last_snapshot = snapshot
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix="aitoolbox-checkpoint")
        self._pending_save = self._writer.submit(self._write, snapshot, folder, file_name, after_save)
        return path

    def save_resume_checkpoint(self) -> Optional[str]:
        """Save a mid-epoch checkpoint of the run as it is now, named as an iteration checkpoint (so
        ``auto_resume`` and ``load_checkpoint(<folder>)`` find it); call it in every process, between batches,
        after an optimizer step. What a SIGTERM leaves before training stops (see
        :mod:`~aitoolbox.torchtrain.train_loop.interrupts`). Returns the path in the main process."""
        tl = self.train_loop_obj
        folder = self.experiment_folder
        file_name = checkpoint_file_name(folder.experiment_name, folder.timestamp, tl.epoch, tl.total_iteration_idx)
        return self._save_checkpoint(True, folder.checkpoint_dir, file_name)

    def _save_checkpoint(self, mid_epoch: bool, folder: str, file_name: str,
                         after_save: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """Capture the loop's state and save it as ``folder/file_name`` (a call in every process): one file written
        by the main process, or under sharding a DCP folder every process writes into. Returns the path in the
        main process, None in the others."""
        tl = self.train_loop_obj
        if self.saves_shards:
            return self._save_shards(mid_epoch, folder, file_name, after_save)
        checkpoint = tl.checkpoint_state(mid_epoch=mid_epoch, hyperparams=self.saved_hyperparams())
        if not mid_epoch and self.has_experiment_folder and _train_end_follows(tl) and \
                os.path.abspath(folder) == os.path.abspath(self.experiment_folder.checkpoint_dir):
            # The fit's last epoch: its train end follows this checkpoint, and the loop records in the run folder
            # when it finished (:meth:`record_train_end_done`). A load of this checkpoint at its fit's target,
            # without its end recorded, runs the end a kill lost; an earlier epoch's checkpoint carries no key.
            checkpoint[TRAIN_END_CHECKPOINT_KEY] = os.path.basename(os.path.abspath(self.experiment_folder.path))
        path, error = None, None
        if self.is_main_process:
            try:
                path = self._save(checkpoint, folder, file_name, after_save)
            except Exception as raised:  # this save's, or the failure of the background save before it
                error = raised
        self._raise_shared_outcome(error)
        return path

    def record_train_end_done(self) -> Optional[str]:
        """After the train end finished (every ``on_train_end`` returned), in the main process: record it in this
        callback's run folder, whose ``checkpoint_model/`` holds the run's epoch-end checkpoints (see
        :mod:`~aitoolbox.experiment.local_save.train_end_marker`), and upload the record. Returns the record's path,
        or None (no run folder on disk, or the record could not be written: logged, never raised)."""
        if not self.has_experiment_folder or not os.path.isdir(self.experiment_folder.checkpoint_dir):
            return None  # no checkpoint saved there: nothing for the record to describe
        tl = self.train_loop_obj
        path = record_train_end_done(record_path(self.experiment_folder.path), tl.epochs_completed,
                                     tl.total_iteration_idx)
        if path is not None and self.cloud_destination is not None:
            try:
                future = self.cloud_upload(path)
                if future is not None:
                    self._uploads.remove(future)  # waited for here: the end's waits are over
                    future.result()
            except Exception as error:  # the end is finished: a failed upload costs a repeated end, no more
                logger.warning("%s: could not upload the train-end record %s (%s)", type(self).__name__, path, error)
        return path

    def _save_shards(self, mid_epoch: bool, folder: str, file_name: str,
                     after_save: Optional[Callable[[str], None]]) -> Optional[str]:
        """Every process writes its shards into the folder named after ``file_name`` (without ``.pth``), with the
        training state beside them. With ``background_save`` DCP writes in the background; the main process
        completes the folder and then runs ``after_save(path)``."""
        tl = self.train_loop_obj
        path, error = None, None
        if self.is_main_process:  # the run folder (and its timestamp) is the main process's
            path = os.path.join(folder, sharded_checkpoint_name(file_name))
            try:
                self.ensure_folder(folder)
                self._remove_leftovers(folder)  # never this process's own temporaries: its saves may be in flight
            except OSError as os_error:
                error = str(self._save_error(os_error, path))
        path, error = tl.broadcast_object((path, error))
        if error is not None:
            raise OSError(error)
        self.wait_for_pending_save()  # one save in flight at a time, in every process
        try:
            handle = tl.save_sharded_checkpoint(path, mid_epoch, self.saved_hyperparams(),
                                                async_save=self.background_save, process_group=self._save_group)
        except OSError as os_error:
            raise self._save_error(os_error, path) from os_error
        run_after = after_save if self.is_main_process else None
        group = self._save_group

        def complete() -> None:
            handle.wait()  # the same outcome in every process
            logger.debug("saved sharded checkpoint %s", path)
            error = None
            try:
                self.cloud_upload(path)  # the main process: the whole folder, complete now; its marker goes up last
                if run_after is not None:
                    run_after(path)
            except Exception as raised:  # e.g. pruning failed: every process learns it, in this thread too
                error = raised
            self._raise_shared_outcome(error, group, all_processes=True)

        if not self.background_save:
            complete()
            return path if self.is_main_process else None
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                 thread_name_prefix="aitoolbox-checkpoint")
        self._pending_save = self._writer.submit(complete)
        return path if self.is_main_process else None

    def _write(self, checkpoint: dict, folder: str, file_name: str,
               after_save: Optional[Callable[[str], None]]) -> None:
        # This process's earlier saves are complete (one in flight at a time): what killed ones left can go.
        self._remove_leftovers(folder)
        try:
            path = save_checkpoint_file(checkpoint, folder, file_name, abandon=self._abandon)
        except OSError as error:
            raise self._save_error(error, os.path.join(folder, file_name)) from error
        logger.debug("saved checkpoint %s", path)
        self.cloud_upload(path)  # queued: the file goes up as it is now, even if pruning removes it later
        if after_save is not None:
            after_save(path)  # e.g. delete older checkpoints: only once the new one is complete

    def _remove_leftovers(self, folder: str) -> None:
        """Remove the temporaries killed saves left in the checkpoint ``folder`` and, when it lies in the run folder,
        in the whole run folder: a process killed while it wrote the hyperparameters, results or a plot leaves a
        full-size ``.tmp-*`` file there too, judged by the same rules (see
        :mod:`~aitoolbox.experiment.local_save.leftovers`). In the main process only (it writes those files)."""
        run_folder = os.path.abspath(self.experiment_folder.path) if self.has_experiment_folder else None
        if run_folder is not None and os.path.commonpath([run_folder, os.path.abspath(folder)]) == run_folder:
            remove_stale_temporaries_under(run_folder)
        else:
            remove_stale_temporaries(folder)

    def _save_error(self, error: OSError, path: str) -> OSError:
        reason = str(error.strerror or error).rstrip(".")
        message = (f"{type(self).__name__} could not save {path}: {reason}. Training stopped; the TrainLoop still "
                   "holds the trained state in memory (save it elsewhere with torch.save(tl.checkpoint_state(), "
                   "path)).")
        if error.errno is None:  # e.g. FileExistsError(message): keep its type
            return type(error)(message)
        return OSError(error.errno, message)  # OSError picks the subclass of the errno
