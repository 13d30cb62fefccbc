"""Checkpoint callbacks: every epoch (keeping the best k), every N iterations, and the final model at the end."""
import copy
import logging
import os
import threading
from typing import Any, ContextManager, List, Optional, Tuple, Union

from torch import nn

from aitoolbox.experiment.local_save.checkpoints import (
    checkpoint_file_name, checkpoint_path_position, list_checkpoints, prune_checkpoints, read_checkpoint_ranking,
    remove_checkpoint, write_checkpoint_ranking)
from aitoolbox.torchtrain.callbacks import checkpoint_ranking as ranking
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.checkpoint_base import (  # noqa: F401  (CHECKPOINT_EXECUTION_ORDER: used from here)
    CHECKPOINT_EXECUTION_ORDER, CheckpointCallback)
from aitoolbox.torchtrain.callbacks.best_weights import best_of, checkpoint_weights, restore_weights, weights_swapped_in
from aitoolbox.torchtrain.callbacks.experiment import scalar_value
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping, not_evaluated_yet

logger = logging.getLogger(__name__)


def higher_is_better(metric_name: str) -> bool:
    """``mode='auto'``'s guess: True unless the metric's name contains 'loss' or 'error'."""
    return ranking.higher_is_better(metric_name)


class ModelCheckpoint(CheckpointCallback):
    """Save a checkpoint at the end of every epoch; optionally keep only the best ones.

    Files: ``checkpoint_model/model_<experiment>_<timestamp>_E<epoch>.pth`` holding aitoolbox 1.x's keys
    (``model_state_dict``, ``optimizer_state_dict``, ``schedulers_state_dict``, ``epoch``, ``iteration_idx``,
    ``hyperparams``, ``amp``) and everything else :meth:`TrainLoop.load_checkpoint` needs to continue bitwise.

    Args:
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (or None with a preset).
        hyperparams: stored in each checkpoint, with secrets redacted (see :mod:`aitoolbox.experiment.redaction`).
        cloud_save_mode: also upload each checkpoint to a bucket, once it is complete on the local disk, in the
            background: ``'s3'`` / ``'aws_s3'`` / ``'aws'`` or ``'gcs'`` / ``'google_storage'`` /
            ``'google storage'``; None / ``'local'``: local files only. With all three cloud arguments None the
            preset's are taken. See :doc:`cloud_storage`.
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        rm_subopt_local_models: False keeps every checkpoint; True keeps the ``num_best_checkpoints_kept`` best by
            ``val_loss`` (``loss`` without validation; aitoolbox 1.8 ranked by ``loss``); a metric name ranks by
            that metric, in the direction ``mode`` gives. The newest checkpoint is always kept, for resuming;
            older ones are deleted only once the newest is complete on disk. Only local files are deleted: the
            bucket keeps every checkpoint uploaded (as in aitoolbox 1.8). The scores are recorded beside the
            checkpoints (``.aitoolbox-checkpoint-ranking.json``) and in the callback's state in every checkpoint,
            so a run continued in a new process (``auto_resume`` into the same run folder, or ``load_checkpoint``
            and a new run folder) keeps the same best checkpoint as a run that never stopped.
        num_best_checkpoints_kept: how many best checkpoints to keep.
        background_save: copy the state to host memory and write the file in a background thread while
            training goes on (training waits only for the copy; see :doc:`checkpointing`). Holds a copy of the
            model and optimizer state in host memory from the first save to the end of training.
        mode: which checkpoints are the best by ``rm_subopt_local_models``'s metric: ``'min'`` (lower is better),
            ``'max'``, or ``'auto'``: ``'min'`` when the metric's name contains 'loss' or 'error', else ``'max'``
            (e.g. pass ``mode='min'`` for a perplexity or a mean absolute error named ``val_mae``).

    Several ModelCheckpoints may share a run folder (e.g. one ranking by ``val_loss``, one by ``val_Accuracy``):
    the first registered keeps aitoolbox 1.8's file names, each later one tags its checkpoints and its ranking record
    with its metric (``model_<experiment>_<timestamp>_val_Accuracy_E<epoch>.pth``), so none deletes or ranks
    another's checkpoints (see :mod:`~aitoolbox.torchtrain.callbacks.checkpoint_ranking`).

    Raises:
        TypeError / ValueError: a bad argument (the message names it).
    """

    def __init__(self, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, hyperparams: Optional[dict] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, rm_subopt_local_models: Union[bool, str] = False,
                 num_best_checkpoints_kept: int = 2, background_save: bool = False, mode: str = "auto"):
        super().__init__("Model checkpoint at each epoch", project_name, experiment_name,
                         local_model_result_folder_path, hyperparams, cloud_save_mode, background_save,
                         bucket_name=bucket_name, cloud_dir_prefix=cloud_dir_prefix)
        if not isinstance(rm_subopt_local_models, (bool, str)):
            raise TypeError(f"rm_subopt_local_models must be a bool or a metric name, got {rm_subopt_local_models!r}")
        if isinstance(num_best_checkpoints_kept, bool) or not isinstance(num_best_checkpoints_kept, int) \
                or num_best_checkpoints_kept < 1:
            raise ValueError(f"num_best_checkpoints_kept must be an int >= 1, got {num_best_checkpoints_kept!r}")
        ranking.check_ranking_mode(mode, rm_subopt_local_models)
        self.rm_subopt_local_models = rm_subopt_local_models
        self.num_best_checkpoints_kept = num_best_checkpoints_kept
        self.mode = mode
        self.saved_checkpoints = []  # (score, path) of the checkpoints it ranked (NaN: unranked), oldest first
        self._being_saved = []  # (score, path) of checkpoints being written: in the state they are saved with
        # The two lists change together in a background save's thread (keep_the_best) while the training thread
        # adds to the saves in flight or reads the state for another checkpoint.
        self._ranking_lock = threading.Lock()
        self._ranking_restored = False  # those an earlier process recorded in the run folder were read
        self._values_at_epoch_begin = 0  # of the ranked metric: a longer history at the epoch's end scores it
        self.file_tag: Optional[str] = None  # see checkpoint_ranking: decided when training begins

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_ranking_lock"] = None  # a lock cannot travel to spawned processes (nor needs to)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._ranking_lock = threading.Lock()

    def monitored_metric(self) -> str:
        """The metric the checkpoints are ranked by: ``rm_subopt_local_models``'s name, or for True ``val_loss``
        (``loss`` on a loop without validation data)."""
        if isinstance(self.rm_subopt_local_models, str):
            return self.rm_subopt_local_models
        # Decided by the loop, not by the history: with end_auto_eval=N val_loss is missing in most epochs.
        return "val_loss" if getattr(self.train_loop_obj, "validation_loader", None) is not None else "loss"

    _monitored_metric = monitored_metric

    def _higher_is_better(self) -> bool:
        return ranking.higher_is_better(self.monitored_metric(), self.mode)

    def on_train_begin(self) -> None:
        super().on_train_begin()
        savers = epoch_checkpoint_savers(self.train_loop_obj.callbacks, self.experiment_folder.path)
        if any(saver is self for saver in savers):
            self.file_tag = ranking.epoch_file_tag(self, savers)

    def on_epoch_begin(self) -> None:
        if self.rm_subopt_local_models is not False:
            self._values_at_epoch_begin = len(self.train_loop_obj.train_history.get(self._monitored_metric()) or [])

    def on_epoch_end(self) -> None:
        tl = self.train_loop_obj
        folder = self.experiment_folder
        file_name = ranking.epoch_file_name(folder, tl.epoch, self.file_tag)
        if self.rm_subopt_local_models is False:
            self._save_checkpoint(False, folder.checkpoint_dir, file_name)
            return
        metric = self._monitored_metric()
        values = tl.train_history.get(metric) or []
        if not values and not not_evaluated_yet(tl, metric):
            self._save_checkpoint(False, folder.checkpoint_dir, file_name)  # saved all the same: nothing is lost
            set_names = getattr(tl, "validation_set_names", None)
            sets_hint = (f" The validation sets {set_names} are recorded as val_<set>_loss and val_<set>_<metric>, the "
                         "first also as val_loss and val_<metric>." if set_names else "")
            raise ValueError(f"ModelCheckpoint ranks checkpoints by {metric!r}, which is not in the training history "
                             f"(recorded: {sorted(k for k, v in tl.train_history.items() if v)}); pass "
                             f"rm_subopt_local_models=<metric name>.{sets_hint}")
        # Only a value recorded in this epoch scores its checkpoint (end_auto_eval=N, a metric evaluated every few
        # epochs): the epoch's checkpoint is kept, unranked (NaN), until a newer one is complete.
        score = scalar_value(values[-1]) if len(values) > self._values_at_epoch_begin else None
        score = float("nan") if score is None else score
        if self.is_main_process and not self._ranking_restored:
            # The checkpoints this run folder got from an earlier process (a resumed run) are ranked too.
            self._ranking_restored = True
            self.saved_checkpoints = self._with_earlier_ranking(metric)
        entry = (score, os.path.join(folder.checkpoint_dir, file_name))
        if self.is_main_process:  # its own checkpoint's state ranks it (the main process's state is saved)
            with self._ranking_lock:  # (the previous epoch's background save may be completing meanwhile)
                self._being_saved = ranking.merged(self._being_saved, [entry])

        def keep_the_best(path: str) -> None:
            # In the writer thread under background_save, while other callbacks' checkpoints may read the state
            # (state_dict): the save leaves the saves in flight and joins the ranking at once, never one without
            # the other. A checkpoint written again (the replay after a rollback) is ranked by its new score only.
            ranked = ranking.merged(self.saved_checkpoints, [(score, path)])
            # Another run folder's checkpoints (a run continued from it) are ranked, never deleted.
            keep = [path] + ranking.elsewhere(ranked, folder.checkpoint_dir)
            deleted = prune_checkpoints(ranked, self.num_best_checkpoints_kept, keep_always=keep,
                                        higher_is_better=self._higher_is_better())
            with self._ranking_lock:
                self.saved_checkpoints = [(score_, p) for score_, p in ranked if p not in deleted]
                self._being_saved = [being for being in self._being_saved if being[1] != entry[1]]
            # Uploaded too, so that the bucket keeps mirroring the run folder.
            self.cloud_upload(write_checkpoint_ranking(folder.checkpoint_dir, metric, self.saved_checkpoints,
                                                       tag=self.file_tag))

        self._save_checkpoint(False, folder.checkpoint_dir, file_name, after_save=keep_the_best)

    def _with_earlier_ranking(self, metric: str) -> List[Tuple[float, str]]:
        """:attr:`saved_checkpoints` with those an earlier process ranked in this run folder (read from its record)."""
        earlier = read_checkpoint_ranking(self.experiment_folder.checkpoint_dir, metric, tag=self.file_tag)
        return ranking.merged(earlier, self.saved_checkpoints)

    def state_dict(self) -> dict:
        """The ranking: the metric, ``mode`` and the ``(score, path)`` of the checkpoints ranked so far (those being
        written included, and what their completion prunes left out), so that a run continued from a checkpoint knows its best checkpoint, also one in the
        earlier run folder. Empty without ranking (``rm_subopt_local_models=False``)."""
        if self.rm_subopt_local_models is False or self.train_loop_obj is None:
            return {}
        with self._ranking_lock:  # see keep_the_best in on_epoch_end
            saved, being_saved = self.saved_checkpoints, self._being_saved
        return ranking.ranking_state(self.monitored_metric(), self.mode, ranking.after_pending_saves(
            saved, being_saved, self.num_best_checkpoints_kept, self.experiment_folder.checkpoint_dir,
            self._higher_is_better()))

    def load_state_dict(self, state: dict) -> None:
        """Take over the ranking :meth:`state_dict` returned (the checkpoints that still exist count); a state of
        another metric, or of no ranking, is left aside (the run folder's ranking record still counts)."""
        if self.rm_subopt_local_models is False:
            return
        loaded = ranking.ranking_from_state(state, self.monitored_metric())
        if loaded is None:
            if state:
                logger.info("%s ranks by %s; the checkpoint's ranking was by %s: it is not taken over",
                            type(self).__name__, self.monitored_metric(), state.get("metric"))
            return
        # Its own list too: the launcher of fit_distributed adopts rank 0's state after each call, and its list of the
        # earlier call still names what the processes pruned since.
        self.saved_checkpoints = [entry for entry in ranking.merged(loaded, self.saved_checkpoints)
                                  if os.path.exists(entry[1])]

    # --- the best checkpoint ------------------------------------------------------------------------------------
    def _best(self) -> Optional[Tuple[float, str]]:
        if self.rm_subopt_local_models is False or self.train_loop_obj is None or not self.has_experiment_folder:
            return None
        metric = self._monitored_metric()
        ranked = self.saved_checkpoints if self._ranking_restored else self._with_earlier_ranking(metric)
        return best_of([(score, path) for score, path in ranked if os.path.exists(path)], self._higher_is_better())

    @property
    def best_model_path(self) -> Optional[str]:
        """The best checkpoint kept, by ``rm_subopt_local_models``'s metric (the earliest of equal scores), or None:
        no ranking (``rm_subopt_local_models=False``) or no epoch ranked yet. Also in a run resumed into the same run
        folder (``auto_resume``), and in the launching process after ``fit_distributed``. Lightning's name."""
        best = self._best()
        return best[1] if best is not None else None

    @property
    def best_model_score(self) -> Optional[float]:
        """The metric's value at :attr:`best_model_path`'s epoch, or None with no best checkpoint."""
        best = self._best()
        return best[0] if best is not None else None

    def _best_checkpoint_path(self) -> str:
        path = self.best_model_path
        if path is None:
            reason = ("it ranks no checkpoints: pass rm_subopt_local_models=True (val_loss) or a metric name"
                      if self.rm_subopt_local_models is False else "no epoch has been ranked yet")
            raise ValueError(f"{type(self).__name__} has no best checkpoint: {reason}")
        return path

    def load_best_model(self) -> nn.Module:
        """Put the weights of :attr:`best_model_path` into the TrainLoop's model and return the model, for
        predicting and evaluating (``tl.predict_on_test_set()`` then uses them). A later ``fit`` trains on from these
        weights with the optimizer state it has (an ``EarlyStopping(restore_best_weights=True)`` does not put the
        weights training ended with back); to continue the run as it was at that epoch instead, use
        ``tl.load_checkpoint(checkpoint.best_model_path)``.

        Raises:
            ValueError: there is no best checkpoint (see :attr:`best_model_path`), or under ``gpu_mode='fsdp'``
                in a training process (call it after ``fit_distributed`` returns).
        """
        path = self._best_checkpoint_path()
        restore_weights(self.train_loop_obj, checkpoint_weights(path))
        for callback in self.train_loop_obj.callbacks:
            if isinstance(callback, EarlyStopping):  # its restored weights would be undone by the next fit
                callback.keep_best_weights()
        logger.info("Loaded the weights of the best checkpoint %s (%s %.6g)", path, self._monitored_metric(),
                    self.best_model_score)
        return self.train_loop_obj.model

    def best_weights(self) -> ContextManager[nn.Module]:
        """A context in which the model holds the weights of :attr:`best_model_path`; afterwards (also after an
        exception) it has the trained weights again. One line predicts with the best checkpoint::

            with checkpoint.best_weights(): y_pred, y_true, _ = tl.predict_on_test_set()

        Raises:
            ValueError: as :meth:`load_best_model`.
        """
        return weights_swapped_in(self.train_loop_obj, checkpoint_weights(self._best_checkpoint_path()))


def epoch_checkpoint_savers(callbacks: List[Any], folder_path: str) -> List[ModelCheckpoint]:
    """The callbacks that write epoch checkpoints into the run folder ``folder_path``, in registration order: its
    ModelCheckpoints; a :class:`ModelIterationCheckpoint` only when there is none (else it saves the iteration
    checkpoints alone, so that no epoch checkpoint is written twice)."""
    same_folder = [callback for callback in callbacks if isinstance(callback, ModelCheckpoint)
                   and callback.has_experiment_folder and callback.experiment_folder.path == folder_path]
    return [callback for callback in same_folder if not isinstance(callback, ModelIterationCheckpoint)] or same_folder


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
        rm_subopt_local_models, num_best_checkpoints_kept, mode: which epoch checkpoints to keep, as for
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
                 background_save: bool = False, mode: str = "auto"):
        super().__init__(project_name, experiment_name, local_model_result_folder_path, hyperparams, cloud_save_mode,
                         bucket_name, cloud_dir_prefix, rm_subopt_local_models, num_best_checkpoints_kept,
                         background_save, mode)
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
        savers = epoch_checkpoint_savers(self.train_loop_obj.callbacks, self.experiment_folder.path)
        self.saves_epoch_checkpoints = any(saver is self for saver in savers)

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
            position = checkpoint_path_position(path)

            def iteration_checkpoint_before(earlier: str) -> bool:
                earlier_position = checkpoint_path_position(earlier)  # not None: list_checkpoints lists checkpoints
                return earlier_position[1] == 0 and earlier_position < position

            self._written = [earlier for earlier in list_checkpoints(os.path.dirname(path))
                             if earlier != path and earlier not in self._written
                             and iteration_checkpoint_before(earlier)] + self._written
        # A name written again (the replay after a SpikeRollback rollback) is the newest, and counts once.
        self._written = [written for written in self._written if written != path] + [path]
        if self.keep_last is not None:
            for old in self._written[:-self.keep_last]:
                remove_checkpoint(old)
            self._written = self._written[-self.keep_last:]


class ModelTrainEndSave(CheckpointCallback):
    """At the end of training: save the final model, evaluate the result packages, write the results.

    Files: ``model/model_<experiment>_<timestamp>.pth`` (a full checkpoint), ``results/results.json`` with the
    validation and test metrics and the training history, and the hyperparameters.

    Args:
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (or None with a preset).
        hyperparams: written to ``hyperparams_list.txt`` / ``hyperparams.json``, into the checkpoint and into the
            result packages, with secrets redacted (see :mod:`aitoolbox.experiment.redaction`).
        val_result_package: evaluated on the validation set, or None. With several named validation sets it is
            evaluated on the first (``results['validation']``) and a copy of it on each set
            (``results['validation_<name>']``).
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
        self.val_set_result_packages = {}  # with several validation sets: a copy of val_result_package for each
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
        for name, package, suffix, predict, evaluate_loss, set_choice in self._evaluations():
            y_pred, y_true, metadata = predict(**set_choice)
            # As 1.x: the package sees the predictions' metadata, the set's loss when it asks for it, and is
            # named after the set it was evaluated on.
            metadata = dict(metadata) if isinstance(metadata, dict) else {}
            if getattr(package, "requires_loss", False):
                metadata["loss"] = evaluate_loss(float_dict_format=True, **set_choice)
            if package.pkg_name is not None and not package.pkg_name.endswith(suffix):
                package.pkg_name += suffix
            results[name] = package.prepare_result_package(y_true, y_pred, hyperparameters=self.saved_hyperparams(),
                                                           additional_results=metadata,
                                                           training_history=tl.train_history).get_results()
        self.results = results
        checkpoint = tl.checkpoint_state(mid_epoch=False, hyperparams=self.saved_hyperparams())
        error = None
        if self.is_main_process:
            try:
                self._save_final(checkpoint, results)
            except Exception as raised:
                error = raised
        self._raise_shared_outcome(error)  # every process raises what the main process met

    def _evaluations(self) -> list:
        """``(results key, package, name suffix, predict, evaluate loss, set keyword)`` of each evaluation at the end.

        ``'validation'`` is ``val_result_package`` on the validation set (the first of several named sets, as
        ``val_loss``); with several sets, ``'validation_<name>'`` is a copy of it on each named set."""
        tl = self.train_loop_obj
        evaluations = []
        if self.val_result_package is not None:
            evaluations.append(("validation", self.val_result_package, "_VAL", tl.predict_on_validation_set,
                                tl.evaluate_loss_on_validation_set, {}))
            for set_name in getattr(tl, "validation_set_names", None) or []:
                if set_name not in self.val_set_result_packages:
                    package = copy.deepcopy(self.val_result_package)
                    if package.pkg_name is not None and package.pkg_name.endswith("_VAL"):  # named after its own set
                        package.pkg_name = package.pkg_name[:-len("_VAL")]
                    self.val_set_result_packages[set_name] = package
                package = self.val_set_result_packages[set_name]
                evaluations.append((f"validation_{set_name}", package, f"_VAL_{set_name}", tl.predict_on_validation_set,
                                    tl.evaluate_loss_on_validation_set, {"name": set_name}))
        if self.test_result_package is not None:
            evaluations.append(("test", self.test_result_package, "_TEST", tl.predict_on_test_set,
                                tl.evaluate_loss_on_test_set, {}))
        return evaluations

    def _save_final(self, checkpoint: dict, results: dict) -> None:
        tl = self.train_loop_obj
        folder = self.experiment_folder
        self._save(checkpoint, folder.model_dir, f"model_{folder.experiment_name}_{folder.timestamp}.pth")
        folder.save_hyperparams(self.hyperparams)
        self.cloud_upload_run_files()
        results_path = folder.save_json(os.path.join("results", "results.json"),
                                        {"results": results, "train_history": tl.train_history.get_train_history_dict(),
                                         "epochs_completed": tl.epochs_completed})
        self.cloud_upload(results_path)
        self._wait_for_uploads()
