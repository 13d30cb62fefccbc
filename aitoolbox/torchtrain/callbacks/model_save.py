"""Checkpoint callbacks: every epoch (keeping the best k), every N iterations, and the final model at the end."""
import concurrent.futures
import logging
import os
import threading
from typing import Callable, Optional, Union

from aitoolbox.experiment.local_save.checkpoints import (
    checkpoint_file_name, checkpoint_position, list_checkpoints, prune_checkpoints, read_checkpoint_ranking,
    remove_checkpoint, save_checkpoint_file, snapshot_checkpoint, write_checkpoint_ranking)
from aitoolbox.experiment.local_save.sharded_checkpoints import checkpoint_process_group, sharded_checkpoint_name
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback, scalar_value

logger = logging.getLogger(__name__)

# Checkpoints run after every other epoch-end callback (LR schedulers, metrics), so what they save is
# exactly the state the next epoch starts from.
CHECKPOINT_EXECUTION_ORDER = 100


def _position(path: str):
    """:func:`checkpoint_position` of a checkpoint file or sharded checkpoint folder."""
    name = os.path.basename(path)
    return checkpoint_position(name if name.endswith(".pth") else f"{name}.pth")


def higher_is_better(metric_name: str) -> bool:
    name = metric_name.lower()
    return not ("loss" in name or "error" in name)


class _CheckpointCallback(AbstractExperimentCallback):
    """Shared parts: hyperparameters, the save itself (now or in the background), the upload of what was saved,
    and the error that keeps the in-memory state usable."""

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

    def __getstate__(self) -> dict:
        # Sent to spawned training processes before any save: a thread pool cannot travel (nor needs to).
        state = self.__dict__.copy()
        state["_writer"] = None
        state["_pending_save"] = None
        state["_last_snapshot"] = None
        state["_abandon"] = None
        state["_save_group"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._abandon = threading.Event()

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        if self.hyperparams and self.experiment_folder.hyperparams is None:
            # A folder of the callback's own: write the hyperparameters when the first checkpoint creates it.
            self.experiment_folder.hyperparams = self.hyperparams

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
        try:
            self.wait_for_pending_save()
        finally:
            self._stop_writer()

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

    def _save_checkpoint(self, mid_epoch: bool, folder: str, file_name: str,
                         after_save: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """Capture the loop's state and save it as ``folder/file_name`` (a call in every process): one file written
        by the main process, or under sharding a DCP folder every process writes into. Returns the path in the
        main process, None in the others."""
        tl = self.train_loop_obj
        if self.saves_shards:
            return self._save_shards(mid_epoch, folder, file_name, after_save)
        checkpoint = tl.checkpoint_state(mid_epoch=mid_epoch, hyperparams=self.hyperparams)
        if not self.is_main_process:
            return None
        return self._save(checkpoint, folder, file_name, after_save)

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
            except OSError as os_error:
                error = str(self._save_error(os_error, path))
        path, error = tl.broadcast_object((path, error))
        if error is not None:
            raise OSError(error)
        self.wait_for_pending_save()  # one save in flight at a time, in every process
        try:
            handle = tl.save_sharded_checkpoint(path, mid_epoch, self.hyperparams, async_save=self.background_save,
                                                process_group=self._save_group)
        except OSError as os_error:
            raise self._save_error(os_error, path) from os_error
        run_after = after_save if self.is_main_process else None

        def complete() -> None:
            handle.wait()
            logger.debug("saved sharded checkpoint %s", path)
            self.cloud_upload(path)  # the main process: the whole folder, complete now; its marker goes up last
            if run_after is not None:
                run_after(path)

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
        try:
            path = save_checkpoint_file(checkpoint, folder, file_name, abandon=self._abandon)
        except OSError as error:
            raise self._save_error(error, os.path.join(folder, file_name)) from error
        logger.debug("saved checkpoint %s", path)
        self.cloud_upload(path)  # queued: the file goes up as it is now, even if pruning removes it later
        if after_save is not None:
            after_save(path)  # e.g. delete older checkpoints: only once the new one is complete

    def _save_error(self, error: OSError, path: str) -> OSError:
        reason = str(error.strerror or error).rstrip(".")
        message = (f"{type(self).__name__} could not save {path}: {reason}. Training stopped; the TrainLoop still "
                   "holds the trained state in memory (save it elsewhere with torch.save(tl.checkpoint_state(), "
                   "path)).")
        if error.errno is None:  # e.g. FileExistsError(message): keep its type
            return type(error)(message)
        return OSError(error.errno, message)  # OSError picks the subclass of the errno


class ModelCheckpoint(_CheckpointCallback):
    """Save a checkpoint at the end of every epoch; optionally keep only the best ones.

    Files: ``checkpoint_model/model_<experiment>_<timestamp>_E<epoch>.pth`` holding aitoolbox 1.x's keys
    (``model_state_dict``, ``optimizer_state_dict``, ``schedulers_state_dict``, ``epoch``, ``iteration_idx``,
    ``hyperparams``, ``amp``) and everything else :meth:`TrainLoop.load_checkpoint` needs to continue bitwise.

    Args:
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (or None with a preset).
        hyperparams: stored in each checkpoint.
        cloud_save_mode: also upload each checkpoint to a bucket, once it is complete on the local disk, in the
            background: ``'s3'`` / ``'aws_s3'`` / ``'aws'`` or ``'gcs'`` / ``'google_storage'`` /
            ``'google storage'``; None / ``'local'``: local files only. With all three cloud arguments None the
            preset's are taken. See :doc:`cloud_storage`.
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        rm_subopt_local_models: False keeps every checkpoint; True keeps the ``num_best_checkpoints_kept`` best by
            ``val_loss`` (``loss`` without validation); a metric name ranks by that metric (higher is better unless
            the name contains 'loss' or 'error'). The newest checkpoint is always kept, for resuming; older ones
            are deleted only once the newest is complete on disk. Only local files are deleted: the bucket keeps
            every checkpoint uploaded (as in aitoolbox 1.8). The scores are recorded beside the checkpoints
            (``.aitoolbox-checkpoint-ranking.json``), so a run resumed in a new process into the same run folder
            (``auto_resume``) keeps the same best checkpoints as a run that never stopped.
        num_best_checkpoints_kept: how many best checkpoints to keep.
        background_save: copy the state to host memory and write the file in a background thread while
            training goes on (training waits only for the copy; see :doc:`checkpointing`). Holds a copy of the
            model and optimizer state in host memory from the first save to the end of training.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, hyperparams: Optional[dict] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, rm_subopt_local_models: Union[bool, str] = False,
                 num_best_checkpoints_kept: int = 2, background_save: bool = False):
        super().__init__("Model checkpoint at each epoch", project_name, experiment_name,
                         local_model_result_folder_path, hyperparams, cloud_save_mode, background_save,
                         bucket_name=bucket_name, cloud_dir_prefix=cloud_dir_prefix)
        if not isinstance(rm_subopt_local_models, (bool, str)):
            raise TypeError(f"rm_subopt_local_models must be a bool or a metric name, got {rm_subopt_local_models!r}")
        if isinstance(num_best_checkpoints_kept, bool) or not isinstance(num_best_checkpoints_kept, int) \
                or num_best_checkpoints_kept < 1:
            raise ValueError(f"num_best_checkpoints_kept must be an int >= 1, got {num_best_checkpoints_kept!r}")
        self.rm_subopt_local_models = rm_subopt_local_models
        self.num_best_checkpoints_kept = num_best_checkpoints_kept
        self.saved_checkpoints = []  # (score, path) of checkpoints this run wrote and still exist
        self._ranking_restored = False  # those an earlier process recorded in the run folder were read

    def _monitored_metric(self) -> str:
        if isinstance(self.rm_subopt_local_models, str):
            return self.rm_subopt_local_models
        return "val_loss" if self.train_loop_obj.train_history.get("val_loss") else "loss"

    def on_epoch_end(self) -> None:
        tl = self.train_loop_obj
        folder = self.experiment_folder
        file_name = checkpoint_file_name(folder.experiment_name, folder.timestamp, tl.epoch)
        if self.rm_subopt_local_models is False:
            self._save_checkpoint(False, folder.checkpoint_dir, file_name)
            return
        metric = self._monitored_metric()
        values = tl.train_history.get(metric)
        if not values:
            self._save_checkpoint(False, folder.checkpoint_dir, file_name)  # saved all the same: nothing is lost
            raise ValueError(f"ModelCheckpoint ranks checkpoints by {metric!r}, which is not in the training history "
                             f"(recorded: {sorted(k for k, v in tl.train_history.items() if v)}); pass "
                             "rm_subopt_local_models=<metric name>")
        score = scalar_value(values[-1])
        if self.is_main_process and not self._ranking_restored:
            # The checkpoints this run folder got from an earlier process (a resumed run) are ranked too.
            self._ranking_restored = True
            known = {path for _, path in self.saved_checkpoints}
            self.saved_checkpoints = [entry for entry in read_checkpoint_ranking(folder.checkpoint_dir, metric)
                                      if entry[1] not in known] + self.saved_checkpoints

        def keep_the_best(path: str) -> None:
            self.saved_checkpoints.append((score, path))
            deleted = prune_checkpoints(self.saved_checkpoints, self.num_best_checkpoints_kept, keep_always=[path],
                                        higher_is_better=higher_is_better(metric))
            self.saved_checkpoints = [(score_, p) for score_, p in self.saved_checkpoints if p not in deleted]
            # Uploaded too, so that the bucket keeps mirroring the run folder.
            self.cloud_upload(write_checkpoint_ranking(folder.checkpoint_dir, metric, self.saved_checkpoints))

        self._save_checkpoint(False, folder.checkpoint_dir, file_name, after_save=keep_the_best)


class ModelIterationCheckpoint(ModelCheckpoint):
    """Save a checkpoint every ``save_frequency`` training iterations, to resume inside an epoch, and one at the end of
    every epoch as :class:`ModelCheckpoint` does.

    As in aitoolbox 1.x, where this class extends ``ModelCheckpoint``, the epoch checkpoints come with it. When a
    :class:`ModelCheckpoint` of the same run folder is registered too (the Checkpoint presets with
    ``iteration_save_freq`` register both), that one saves them and this one saves the iteration checkpoints only,
    so no epoch checkpoint is written twice.

    With gradient accumulation, a save that falls inside an accumulation window waits for the window's
    optimizer step, so a checkpoint never holds half-accumulated gradients.

    Args:
        save_frequency: iterations (batches) between checkpoints.
        project_name, experiment_name, local_model_result_folder_path, hyperparams: as for
            :class:`ModelCheckpoint`.
        cloud_save_mode, bucket_name, cloud_dir_prefix: as for :class:`ModelCheckpoint`.
        rm_subopt_local_models, num_best_checkpoints_kept: which epoch checkpoints to keep, as for
            :class:`ModelCheckpoint`; the iteration checkpoints are kept by ``keep_last``.
        keep_last: keep only this many newest iteration checkpoints (None keeps all); older ones are deleted
            only once the newest is complete on disk. In a run resumed into the same run folder, the iteration
            checkpoints written there before the new one count too.
        background_save: write in a background thread, as for :class:`ModelCheckpoint`.
    """

    def __init__(self, save_frequency: int, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, hyperparams: Optional[dict] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, rm_subopt_local_models: Union[bool, str] = False,
                 num_best_checkpoints_kept: int = 2, keep_last: Optional[int] = None,
                 background_save: bool = False):
        super().__init__(project_name, experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode,
                         bucket_name, cloud_dir_prefix, rm_subopt_local_models, num_best_checkpoints_kept,
                         background_save)
        self.callback_name = "Model checkpoint every N iterations"
        if isinstance(save_frequency, bool) or not isinstance(save_frequency, int) or save_frequency < 1:
            raise ValueError(f"save_frequency must be an int >= 1 (iterations between checkpoints), got {save_frequency!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        self.save_frequency = save_frequency
        self.keep_last = keep_last
        self._save_due = False
        self._batch_steps = False
        self._written = []
        self._earlier_listed = False  # the run folder's iteration checkpoints from an earlier process were listed
        self.saves_epoch_checkpoints = True  # decided when training begins

    def on_train_begin(self) -> None:
        super().on_train_begin()
        self.saves_epoch_checkpoints = not any(
            isinstance(callback, ModelCheckpoint) and not isinstance(callback, ModelIterationCheckpoint)
            and callback.has_experiment_folder and self.has_experiment_folder
            and callback.experiment_folder.path == self.experiment_folder.path
            for callback in self.train_loop_obj.callbacks)

    def on_epoch_end(self) -> None:
        if self.saves_epoch_checkpoints:
            super().on_epoch_end()

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        # Whether this batch ends its accumulation window with an optimizer step (also the step forced at
        # the last batch of an epoch): only then are there no accumulated gradients a checkpoint would lose.
        self._batch_steps = self.train_loop_obj.optimizer_step_due

    def on_batch_end(self) -> None:
        tl = self.train_loop_obj
        if (tl.total_iteration_idx + 1) % self.save_frequency == 0:
            self._save_due = True
        if not (self._save_due and self._batch_steps):
            return
        self._save_due = False
        folder = self.experiment_folder
        self._save_checkpoint(
            True, folder.checkpoint_dir,
            checkpoint_file_name(folder.experiment_name, folder.timestamp, tl.epoch, tl.total_iteration_idx),
            after_save=self._keep_the_last)

    def _keep_the_last(self, path: str) -> None:
        if not self._earlier_listed:
            # The iteration checkpoints an earlier process wrote into this run folder before this one (a resumed
            # run) count too; any after it (a run continued from an older checkpoint) are left alone.
            self._earlier_listed = True
            position = _position(path)
            self._written = [earlier for earlier in list_checkpoints(os.path.dirname(path))
                             if earlier != path and earlier not in self._written and _position(earlier) is not None
                             and _position(earlier)[1] == 0 and _position(earlier) < position] + self._written
        self._written.append(path)
        if self.keep_last is not None:
            for old in self._written[:-self.keep_last]:
                remove_checkpoint(old)
            self._written = self._written[-self.keep_last:]


class ModelTrainEndSave(_CheckpointCallback):
    """At the end of training: save the final model, evaluate the result packages, write the results.

    Files: ``model/model_<experiment>_<timestamp>.pth`` (a full checkpoint), ``results/results.json`` with the
    validation and test metrics and the training history, and the hyperparameters.

    Args:
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (or None with a preset).
        hyperparams: written to ``hyperparams_list.txt`` / ``hyperparams.json`` and into the checkpoint.
        val_result_package: evaluated on the validation set, or None.
        test_result_package: evaluated on the test set, or None.
        cloud_save_mode, bucket_name, cloud_dir_prefix: also upload the final model, the results and the
            hyperparameters to a bucket, as for :class:`ModelCheckpoint`.
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, hyperparams: Optional[dict] = None,
                 val_result_package: Optional[AbstractResultPackage] = None,
                 test_result_package: Optional[AbstractResultPackage] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None):
        super().__init__("Model save at the end of training", project_name, experiment_name,
                         local_model_result_folder_path, hyperparams, cloud_save_mode, bucket_name=bucket_name,
                         cloud_dir_prefix=cloud_dir_prefix)
        for name, package in (("val_result_package", val_result_package), ("test_result_package", test_result_package)):
            if package is not None and not isinstance(package, AbstractResultPackage):
                raise TypeError(f"{name} must be a result package (e.g. ClassificationResultPackage()) or None, "
                                f"got {type(package).__name__}")
        self.val_result_package = val_result_package
        self.test_result_package = test_result_package
        self.results = {}

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        for name, package, loader in (("val_result_package", self.val_result_package,
                                       self.train_loop_obj.validation_loader),
                                      ("test_result_package", self.test_result_package, self.train_loop_obj.test_loader)):
            if package is not None and loader is None:
                raise ValueError(f"ModelTrainEndSave got a {name} but the TrainLoop has no loader for that set")

    def on_train_end(self) -> None:
        tl = self.train_loop_obj
        results = {}
        folder = self.experiment_folder
        for package in (self.val_result_package, self.test_result_package):
            if package is not None:  # as 1.x: extra output files (texts, heat maps) go into the run folder
                package.set_experiment_dir_path_for_additional_results(folder.project_name, folder.experiment_name,
                                                                       folder.timestamp, folder.root)
        for name, package, suffix, predict, evaluate_loss in (
                ("validation", self.val_result_package, "_VAL", tl.predict_on_validation_set,
                 tl.evaluate_loss_on_validation_set),
                ("test", self.test_result_package, "_TEST", tl.predict_on_test_set, tl.evaluate_loss_on_test_set)):
            if package is None:
                continue
            y_pred, y_true, metadata = predict()
            # As 1.x: the package sees the predictions' metadata, the set's loss when it asks for it, and is
            # named after the set it was evaluated on.
            metadata = dict(metadata) if isinstance(metadata, dict) else {}
            if getattr(package, "requires_loss", False):
                metadata["loss"] = evaluate_loss(float_dict_format=True)
            if package.pkg_name is not None and not package.pkg_name.endswith(suffix):
                package.pkg_name += suffix
            results[name] = package.prepare_result_package(y_true, y_pred, hyperparameters=self.hyperparams,
                                                           additional_results=metadata,
                                                           training_history=tl.train_history).get_results()
        self.results = results
        checkpoint = tl.checkpoint_state(mid_epoch=False, hyperparams=self.hyperparams)
        if not self.is_main_process:
            return
        folder = self.experiment_folder
        self._save(checkpoint, folder.model_dir, f"model_{folder.experiment_name}_{folder.timestamp}.pth")
        folder.save_hyperparams(self.hyperparams)
        self.cloud_upload_run_files()
        results_path = folder.save_json(os.path.join("results", "results.json"),
                                        {"results": results, "train_history": tl.train_history.get_train_history_dict(),
                                         "epochs_completed": tl.epochs_completed})
        self.cloud_upload(results_path)
