"""What the experiment-tracking callbacks log and when; each subclass says where it goes.

:class:`TrackingCallback` is the base of :class:`~aitoolbox.torchtrain.callbacks.wandb.WandBTracking`,
:class:`~aitoolbox.torchtrain.callbacks.mlflow.MLflowTracking`,
:class:`~aitoolbox.torchtrain.callbacks.csv_logger.CSVLogger` and the TensorBoard callbacks
(:mod:`aitoolbox.torchtrain.callbacks.tensorboard`). All of them log, in the main process only
(global rank 0 under distributed training):

- the hyperparameters, when the run starts;
- every ``batch_log_frequency`` batches (or at every optimizer step), a :class:`BatchRecord`: the batch's
  loss, the running mean loss of the epoch so far and the learning rate of every parameter group;
- at every epoch end, the training-history metrics that got a new value in that epoch, and at the end of
  training those recorded then (``train_end_test_loss``);
- at the end of training, the path of the final model when
  :class:`~aitoolbox.torchtrain.callbacks.model_save.ModelTrainEndSave` (the EndSave presets) saved one.

The callbacks run after the checkpoint callbacks (order 101, checkpoints are 100), so the final model file
exists when its path is logged.

The base keeps no running state of its own that a resumed run would need: the epoch's running mean is the
loop's (``epoch_loss_sum``, which a checkpoint holds, also in the middle of an epoch), and the history values
counted as logged are those a loop that has trained (a resumed one) held when the callback's first ``fit``
started. A run resumed from a checkpoint in a new TrainLoop therefore logs the same values as the run that was
not interrupted.
"""
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback, scalar_value
from aitoolbox.torchtrain.callbacks.model_save import ModelTrainEndSave
from aitoolbox.torchtrain.callbacks.rollback_request import describe_point, describe_spike

logger = logging.getLogger(__name__)

#: After the checkpoint callbacks (100): the final model is on disk when the trackers' ``on_train_end`` runs.
TRACKING_EXECUTION_ORDER = 101

#: ``batch_log_frequency`` value that logs once per optimizer step (the last batch of each accumulation window).
PER_OPTIMIZER_STEP = "step"


@dataclass
class BatchRecord:
    """One logged training batch.

    Attributes:
        epoch: the epoch index.
        iteration: the batch index within the epoch.
        step: the batch index counted over the whole training (``total_iteration_idx``), the x axis of the logs.
        losses: the batch's loss: ``{'loss': value}``, or one entry per loss of a MultiLoss.
        mean_losses: the same, averaged over the epoch's batches so far (those trained before a resume from a
            mid-epoch checkpoint included).
        learning_rates: ``{(optimizer index, group index): learning rate}``.
    """

    epoch: int
    iteration: int
    step: int
    losses: Dict[str, float]
    mean_losses: Dict[str, float]
    learning_rates: Dict[tuple, float] = field(default_factory=dict)


def history_lengths(history: Any) -> Dict[str, int]:
    return {name: len(values) for name, values in history.items()}


def check_batch_log_frequency(value: Any, allow_none: bool) -> Union[int, str, None]:
    """``value`` if it is a positive int, ``'step'`` (or None where allowed); else a ValueError."""
    if value is None and allow_none:
        return None
    if value == PER_OPTIMIZER_STEP or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    allowed = "a positive int (log every N batches), 'step' (once per optimizer step)" + \
        (" or None (no batch-level logging)" if allow_none else "")
    raise ValueError(f"batch_log_frequency must be {allowed}, got {value!r}")


def check_metric_names(metric_names: Optional[Sequence[str]]) -> Optional[List[str]]:
    """None (every metric of the training history) or a non-empty list of metric names."""
    if metric_names is None:
        return None
    if isinstance(metric_names, str) or not isinstance(metric_names, Sequence) or len(metric_names) == 0 \
            or not all(isinstance(name, str) for name in metric_names):
        raise TypeError(f"metric_names must be None (all metrics) or a non-empty list of metric names such as "
                        f"['loss', 'val_loss'], got {metric_names!r}")
    return list(metric_names)


def final_model_path(callbacks: Sequence[Any]) -> Optional[str]:
    """The final model file :class:`ModelTrainEndSave` wrote in this process, or None.

    ModelTrainEndSave documents its file as ``model/model_<experiment>_<timestamp>.pth`` in its experiment
    folder; the path is returned only once that file exists (the trackers run after the saving callbacks).
    """
    for callback in callbacks:
        if isinstance(callback, ModelTrainEndSave) and callback.has_experiment_folder:
            folder = callback.experiment_folder
            path = os.path.join(folder.model_dir, f"model_{folder.experiment_name}_{folder.timestamp}.pth")
            if os.path.isfile(path):
                return path
    return None


class TrackingCallback(AbstractExperimentCallback):
    """The logging schedule shared by the tracking callbacks; subclasses implement the ``write_*`` methods.

    A run starts at the first ``on_train_begin`` in the main process (:meth:`start_run`) and is closed at the end
    of each ``fit`` (:meth:`end_run`); a later ``fit`` of the same TrainLoop starts it again, and a subclass
    that can continues the same run then.

    Args:
        callback_name: a name for messages.
        metric_names: the training-history metrics to log; None logs all.
        batch_log_frequency: log a :class:`BatchRecord` every this many batches (counted over the whole
            training), ``'step'`` at every optimizer step, None never.
        hyperparams: the hyperparameters to log; None takes the experiment-tracking TrainLoop's (an empty dict
            with a plain TrainLoop).
        project_name, experiment_name, local_model_result_folder_path: the experiment folder, or None to take
            the loop's (see :class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractExperimentCallback`).
        log_learning_rates: include the learning rates in the batch records.
        cloud_save_mode, bucket_name, cloud_dir_prefix: the bucket of a subclass that uploads its files (see
            :class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractExperimentCallback`); None: the loop's.
        execution_order: position among the callbacks (default :data:`TRACKING_EXECUTION_ORDER`).
    """

    def __init__(self, callback_name: str, metric_names: Optional[Sequence[str]] = None,
                 batch_log_frequency: Union[int, str, None] = 1, hyperparams: Optional[dict] = None,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, log_learning_rates: bool = True, *,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, execution_order: int = TRACKING_EXECUTION_ORDER):
        super().__init__(callback_name, project_name, experiment_name, local_model_result_folder_path,
                         cloud_save_mode, bucket_name, cloud_dir_prefix, execution_order=execution_order,
                         device_idx_execution=0)
        self.metric_names = check_metric_names(metric_names)
        self.batch_log_frequency = check_batch_log_frequency(batch_log_frequency, allow_none=True)
        if hyperparams is not None and not isinstance(hyperparams, dict):
            raise TypeError(f"hyperparams must be a dict or None, got {type(hyperparams).__name__}")
        self.hyperparams = hyperparams
        if not isinstance(log_learning_rates, bool):
            raise TypeError(f"log_learning_rates must be True or False, got {log_learning_rates!r}")
        self.log_learning_rates = log_learning_rates
        self.run_active = False  # between start_run and end_run, in the main process
        self._interrupted = False  # the run was ended by on_exception (the next fit starts it again)
        # History lengths after the last logged epoch end, and before it (the base when that end is done again).
        self._logged_history_lengths: Optional[Dict[str, int]] = None
        self._epoch_base_lengths: Dict[str, int] = {}
        self._last_logged_epoch: Optional[int] = None
        self._unloggable_metrics: set = set()
        self._stepped = False  # an optimizer step since the last batch record ('step' mode)
        self._batch_learning_rates: Optional[Dict[tuple, float]] = None  # in effect for the batch to be logged
        self._rollbacks_seen: Optional[int] = None  # SpikeRollback's rollbacks already handled (tl.rollbacks)

    # --- what a subclass implements ---------------------------------------------------------------------------
    def start_run(self) -> None:
        """Open the run (or continue it); called in the main process at the start of each ``fit``."""
        raise NotImplementedError

    def write_hyperparams(self, hyperparams: dict) -> None:
        """Record the hyperparameters (called right after :meth:`start_run`)."""
        raise NotImplementedError

    def write_batch(self, record: BatchRecord) -> None:
        """Record one training batch."""
        raise NotImplementedError

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        """Record the history metrics new at this epoch end (``train_end``: those recorded at the end of training).

        Args:
            epoch: the epoch index.
            step: the index of its last batch (``total_iteration_idx``).
            metrics: ``{history metric name: value}``.
            train_end: True for the metrics recorded after the last epoch (e.g. ``train_end_test_loss``).
        """
        raise NotImplementedError

    def write_final_model_path(self, path: str) -> None:
        """Record where the final model was saved."""
        raise NotImplementedError

    def write_rollback(self, record: dict) -> None:
        """The run went back to an earlier point (:class:`~aitoolbox.torchtrain.callbacks.SpikeRollback`; ``record``
        is its entry of ``tl.rollbacks``, the loop is at the point now): the batches and epochs logged after the
        point are replayed and logged again. A subclass that can drop what it logged after the point
        (``tl.total_iteration_idx``, ``tl.epochs_completed``) does so and marks the rollback; by default nothing is
        dropped and the replay is logged after the first attempt."""

    def end_run(self, exception: Optional[BaseException]) -> None:
        """Write out what is buffered and close the run; ``exception`` is what stopped training, if anything."""
        raise NotImplementedError

    # --- the hooks --------------------------------------------------------------------------------------------
    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        if self.hyperparams is None:
            self.hyperparams = dict(getattr(self.train_loop_obj, "hyperparams", None) or {})

    def on_train_begin(self) -> None:
        # Callbacks registered before fit_distributed travel to every rank: only the main process logs.
        if not self.is_main_process or self.run_active:
            return
        if self._logged_history_lengths is None:
            tl = self.train_loop_obj
            # A resumed checkpoint's values were logged by the run that recorded them; in a loop that has trained
            # nothing yet, a value put into the history before training is logged at the first epoch end.
            trained = tl.total_iteration_idx >= 0 or tl.epochs_completed > 0
            self._logged_history_lengths = history_lengths(tl.train_history) if trained else {}
        if not self.train_loop_obj.finishes_interrupted_step:  # else that step's batch end still logs it
            self.reset_epoch_loss()
        if self._rollbacks_seen is None:  # those a resumed checkpoint brought were handled by the run that made them
            self._rollbacks_seen = len(getattr(self.train_loop_obj, "rollbacks", None) or [])
        self.start_run()
        self.run_active, self._interrupted = True, False
        self.write_hyperparams(self.hyperparams)

    def on_epoch_begin(self) -> None:
        if not self.train_loop_obj.finishes_interrupted_step:  # else that step's batch end still logs it
            self.reset_epoch_loss()
        self._handle_rollbacks()

    def _handle_rollbacks(self) -> None:
        """After a rollback (the loop starts the epoch of the point it returned to): what was logged after the point
        is logged again, so the history values count as not logged from the point on."""
        records = getattr(self.train_loop_obj, "rollbacks", None) or []
        if not self.run_active or self._rollbacks_seen is None or len(records) <= self._rollbacks_seen:
            return
        new, self._rollbacks_seen = records[self._rollbacks_seen:], len(records)
        self._logged_history_lengths = history_lengths(self.train_loop_obj.train_history)
        self._epoch_base_lengths, self._last_logged_epoch = {}, None
        for record in new:
            self.write_rollback(record)

    def on_batch_begin(self) -> None:
        # The learning rates this batch's optimizer step uses: a scheduler stepping after the optimizer step
        # changes them before on_batch_end.
        tl = self.train_loop_obj
        if not self.run_active or not self.log_learning_rates or self.batch_log_frequency is None:
            return
        if self.batch_log_frequency == PER_OPTIMIZER_STEP:
            due = tl.optimizer_step_due
        else:
            due = tl.total_iteration_idx % self.batch_log_frequency == 0
        self._batch_learning_rates = self.current_learning_rates() if due else None

    def on_after_optimizer_step(self) -> None:
        self._stepped = True

    def on_batch_end(self) -> None:
        if not self.run_active or self.batch_log_frequency is None:
            return
        tl = self.train_loop_obj
        if self.batch_log_frequency == PER_OPTIMIZER_STEP:
            due, self._stepped = self._stepped, False
        else:
            due = tl.total_iteration_idx % self.batch_log_frequency == 0
        if due:
            self.write_batch(self.batch_record(tl.last_batch_loss.detach().float()))

    def on_epoch_end(self) -> None:
        if not self.run_active:
            return
        tl = self.train_loop_obj
        if self._stepped and self.batch_log_frequency == PER_OPTIMIZER_STEP and tl.last_batch_loss is not None:
            # The step a loader without len takes after its last batch (on_batch_end has run already).
            self._stepped = False
            self.write_batch(self.batch_record(tl.last_batch_loss.detach().float()))
        metrics = self.new_history_metrics(epoch=tl.epoch)
        self.write_epoch_metrics(tl.epoch, tl.total_iteration_idx, metrics, train_end=False)

    def on_train_end(self) -> None:
        if not self.run_active:
            if not (self.is_main_process and self._interrupted):
                return
            # A fit finishing the train end an exception interrupted runs it before its own on_train_begin: the run
            # is started again for what that end logs (review 48t G1: train_end_test_loss, the final model's path).
            self.start_run()
            self.run_active = True
        tl = self.train_loop_obj
        logged = self._logged_history_lengths
        metrics = self.new_history_metrics()
        if metrics:
            try:
                self.write_epoch_metrics(tl.epoch, tl.total_iteration_idx, metrics, train_end=True)
            except BaseException as error:
                if not isinstance(error, Exception):  # a Ctrl-C: the next fit calls this again (review 48m M1)
                    self._logged_history_lengths = logged
                raise
        path = final_model_path(tl.callbacks)
        if path is not None:
            self.write_final_model_path(path)
        # Closed while still active: a Ctrl-C in end_run (a slow upload) leaves the run to on_exception, which ends
        # it as interrupted, and the next fit's on_train_end opens and ends it again (review 48m M2).
        self.end_run(None)
        self.run_active = False

    def on_exception(self, exception: BaseException) -> None:
        """Write out what was logged and close the run as failed (interrupted); the next ``fit`` starts it again."""
        if not self.run_active:
            return
        self.run_active, self._interrupted = False, True
        self.end_run(exception)

    # --- the values -------------------------------------------------------------------------------------------
    def reset_epoch_loss(self) -> None:
        """Forget the epoch's pending batch state (a step not yet logged, the learning rates kept for a batch)."""
        self._stepped = False
        self._batch_learning_rates = None

    def loss_names(self, loss: torch.Tensor) -> List[str]:
        """``['loss']``, or the names of a MultiLoss's losses (their index when the loop does not name them)."""
        if loss.numel() == 1:
            return ["loss"]
        names = self.train_loop_obj.last_batch_loss_names
        return list(names) if names is not None else [str(index) for index in range(loss.numel())]

    def batch_record(self, loss: torch.Tensor) -> BatchRecord:
        """The :class:`BatchRecord` of the current batch, whose detached loss is ``loss``."""
        tl = self.train_loop_obj
        names = self.loss_names(loss)
        values = loss.reshape(-1).tolist()
        # The loop's sum, not one of the callback's: it includes the batches trained before a resume (from a
        # mid-epoch checkpoint, or the fit before an exception), and a checkpoint holds it.
        means = (tl.epoch_loss_sum.float() / (tl.iteration + 1)).reshape(-1).tolist()
        rates, self._batch_learning_rates = self._batch_learning_rates, None
        if rates is None and self.log_learning_rates:
            rates = self.current_learning_rates()
        return BatchRecord(tl.epoch, tl.iteration, tl.total_iteration_idx, dict(zip(names, values)),
                           dict(zip(names, means)), rates or {})

    def current_learning_rates(self) -> Dict[tuple, float]:
        """``{(optimizer index, group index): learning rate}`` of every parameter group now."""
        rates = {}
        for optimizer_idx, optimizer in enumerate(self.train_loop_obj.optimizers):
            for group_idx, group in enumerate(optimizer.param_groups):
                rate = scalar_value(group.get("lr"))
                if rate is not None:
                    rates[(optimizer_idx, group_idx)] = rate
        return rates

    def new_history_metrics(self, epoch: Optional[int] = None) -> Dict[str, float]:
        """The selected history metrics recorded since the last epoch end logged, with their newest value.

        A metric recorded only every few epochs is returned at those epochs; values that are not single numbers
        are skipped (with one warning per metric). When the end of ``epoch`` is done again (the next ``fit``
        after an exception there), its metrics count as new again.

        Args:
            epoch: the epoch whose end this is; None at the end of training.
        """
        history = self.train_loop_obj.train_history
        if self._logged_history_lengths is None:
            self._logged_history_lengths = {}
        if epoch is not None and epoch == self._last_logged_epoch:
            base = self._epoch_base_lengths
        else:
            base = self._logged_history_lengths
            if epoch is not None:
                self._epoch_base_lengths, self._last_logged_epoch = dict(base), epoch
        metrics = {}
        for name in (self.metric_names if self.metric_names is not None else list(history.keys())):
            values = history.get(name) or []
            if len(values) <= base.get(name, 0):
                continue
            value = scalar_value(values[-1])
            if value is not None:
                metrics[name] = value
            elif name not in self._unloggable_metrics:
                self._unloggable_metrics.add(name)
                logger.warning("%s: training history metric %r holds %s values, not single numbers; it is not logged",
                               type(self).__name__, name, type(values[-1]).__name__)
        self._logged_history_lengths = history_lengths(history)
        return metrics

    # --- where files go (for the callbacks that write locally) ------------------------------------------------
    def resolve_log_dir(self, log_dir: Optional[str], is_project: bool,
                        default_sub_folder: Optional[str]) -> Optional[str]:
        """The absolute folder for local files, after registration.

        ``is_project=True``: a relative (or no) ``log_dir`` lies in the experiment folder (``default_sub_folder``
        without one; the run folder itself when that is None too); an absolute one is used as it is.
        ``is_project=False``: ``log_dir`` from the working directory, or ``default_sub_folder`` there; None when
        both are None.

        Raises:
            MissingExperimentDetailsError: the experiment folder is needed but unknown.
        """
        if log_dir is not None and os.path.isabs(log_dir):
            return log_dir
        if is_project:
            parts = [part for part in (log_dir if log_dir is not None else default_sub_folder,) if part]
            return os.path.join(self.experiment_folder.path, *parts)
        relative = log_dir if log_dir is not None else default_sub_folder
        return os.path.abspath(relative) if relative is not None else None

    def ensure_log_dir(self, path: str) -> str:
        """Create ``path`` (and the experiment folder when it lies inside it) in the main process."""
        if self.has_experiment_folder and os.path.commonpath([path, self.experiment_folder.path]) \
                == self.experiment_folder.path:
            return self.experiment_folder.ensure(path)
        os.makedirs(path, exist_ok=True)
        return path


def describe_rollback(record: dict) -> str:
    """A line for a log: the spike and the point the run returned to (a record of ``tl.rollbacks``)."""
    # Epochs counted from 1, as the epoch's summary line (the record keeps the 0-based index).
    restored = record.get("restored", {})
    back_to = "" if restored.get("epoch") is None else f"; back to {describe_point(restored)}"
    return f"rollback: {describe_spike(record)} (loss {record['loss']:.6g}){back_to}"


def check_log_dir(log_dir: Any, is_project: Any) -> Optional[str]:
    """Validate the ``log_dir`` / ``is_project`` arguments; returns ``log_dir`` with ``~`` expanded."""
    if not isinstance(is_project, bool):
        raise TypeError(f"is_project must be True or False, got {is_project!r}")
    if log_dir is None:
        return None
    if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
        raise ValueError(f"log_dir must be None or a folder path, got {log_dir!r}")
    return os.path.expanduser(os.fspath(log_dir))

