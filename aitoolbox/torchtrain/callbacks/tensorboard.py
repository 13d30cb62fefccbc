"""Tensorboard callbacks: the training batch loss, the training history metrics, learning rates and histograms.

Each callback writes with its own ``torch.utils.tensorboard.SummaryWriter``, created at the start of training
in the main process only and closed at its end, or when ``fit`` stops on an exception (the next ``fit`` opens
a new one). By default the event files go into the experiment folder's ``tensorboard/`` sub-folder (see
:class:`~aitoolbox.torchtrain.callbacks.experiment.AbstractExperimentCallback`); ``log_dir`` chooses another
place. The tensorboard package is imported only when a callback is registered,
so ``import aitoolbox`` works without it.

With a ``cloud_save_mode`` (the callback's, or an experiment-tracking preset's) the event files of a callback
writing into the experiment folder are also uploaded, in the background, after every epoch and at the end of
training, under aitoolbox 1.8's key ``<run key>/<log dir>/<project>_<experiment>/<event file>``.

What is logged and when follows the schedule the MLflow, W&B and CSV callbacks share
(:class:`~aitoolbox.torchtrain.callbacks.tracking_base.TrackingCallback`): the running mean is the loop's,
so a run resumed from a mid-epoch checkpoint logs the mean over the whole epoch, as the uninterrupted run
does, and history values a resumed checkpoint brought along are not logged again.

Tags (the same as aitoolbox 1.x, so existing dashboards keep working):

- ``train_loss/last_batch_loss`` and ``train_loss/accumulated_batch_loss`` (mean over the epoch so far),
  global step = the batch index counted over the whole training; a MultiLoss adds ``_<loss name>`` to both;
- ``loss/<metric>`` for history metrics whose name contains ``loss``, ``metrics/<metric>`` for the others,
  global step = the epoch;
- :class:`TensorboardFullTracking` adds ``learning_rate/optimizer_<i>_group_<j>`` (batch step) and the
  histograms ``parameters/<name>`` and ``gradients/<name>`` (epoch step);
- after a :class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` rollback, ``rollbacks/count`` and the text
  ``rollbacks`` at the first batch step replayed, where the batch steps logged before the rollback are purged
  (:meth:`TensorboardReporterBaseCB.write_rollback`): the logs show the final trajectory once.
"""
import inspect
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from aitoolbox.cloud.storage import join_key
from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.torchtrain.callbacks.experiment import scalar_value
from aitoolbox.torchtrain.callbacks.tracking_base import (
    BatchRecord, TrackingCallback, check_batch_log_frequency, check_log_dir, describe_rollback)
from aitoolbox.torchtrain.precision.precision import Precision

logger = logging.getLogger(__name__)


def load_summary_writer_class() -> type:
    """Import ``SummaryWriter`` (and with it tensorboard) now, with an install hint when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError("The tensorboard callbacks need the tensorboard package, which is not installed: "
                          "pip install tensorboard (or pip install 'aitoolbox[tracking]')") from error
    return SummaryWriter


def history_tag(metric_name: str) -> str:
    """The tensorboard tag of a training-history metric: losses and other metrics in separate sections."""
    return f"loss/{metric_name}" if "loss" in metric_name else f"metrics/{metric_name}"


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class TensorboardReporterBaseCB(TrackingCallback):
    """Owns the SummaryWriter; what is logged and when comes from the shared tracking schedule.

    The schedule is :class:`~aitoolbox.torchtrain.callbacks.tracking_base.TrackingCallback`'s, as for the MLflow,
    W&B and CSV callbacks: the batch loss with the epoch's running mean (the loop's, so a run resumed from a
    mid-epoch checkpoint logs the mean of the whole epoch), the learning rates in effect for the batch, and the
    history metrics that got a new value. This base class logs nothing by itself; the callbacks below switch
    on what they log, and a subclass written against aitoolbox 1.x calls :meth:`log_mid_train_loss` and
    :meth:`log_train_history_metrics` from its own hooks.

    Where the event files go:

    - ``is_project=True`` (default): into the experiment folder, in ``tensorboard/`` or, with a relative
      ``log_dir``, in that sub-folder of the run folder (aitoolbox 1.x behaviour). The experiment folder comes
      from the folder arguments or the experiment-tracking preset (TrainLoopCheckpoint, ...).
    - an absolute ``log_dir``: exactly there; no experiment folder is needed.
    - ``is_project=False``: ``log_dir`` is the full path (a relative one counts from the working directory);
      without a ``log_dir``, ``./tensorboard`` (aitoolbox 1.x default).

    Args:
        callback_name: a name for messages.
        log_dir: see above.
        is_project: write into the experiment folder structure.
        project_name: the project folder, or None to take the loop's (e.g. TrainLoopCheckpoint's).
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: with ``is_project=True``, also upload the event files to a bucket after every epoch and
            at the end (``'s3'``, ``'gcs'``, ...; see :doc:`cloud_storage`); None or ``'local'``: local files
            only. With all three cloud arguments None the loop's are taken (an experiment-tracking preset's).
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        execution_order: position among the callbacks; the default 97 runs after the callbacks that add
            metrics to the training history.
        batch_log_frequency: log the batch loss every this many batches (counted over the whole training),
            ``'step'`` at every optimizer step; None (default) does not.
        log_learning_rates: log the learning rates with the batch loss.
        log_history: log the training-history metrics that got a new value, at every epoch end and at the end
            of training.
        metric_names: with ``log_history``, the history metrics to log; None logs all.
        **summary_writer_kwargs: further ``SummaryWriter`` arguments (e.g. ``flush_secs``).

    Raises:
        ValueError: a bad ``log_dir``, an unknown ``cloud_save_mode``, or (at registration) an experiment folder
            that is needed but unknown.
    """

    def __init__(self, callback_name: str, log_dir: Optional[str] = None, is_project: bool = True,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97, *, batch_log_frequency: Union[int, str, None] = None,
                 log_learning_rates: bool = False, log_history: bool = False,
                 metric_names: Optional[Sequence[str]] = None, **summary_writer_kwargs):
        super().__init__(callback_name, metric_names, batch_log_frequency, None, project_name, experiment_name,
                         local_model_result_folder_path, log_learning_rates, cloud_save_mode=cloud_save_mode,
                         bucket_name=bucket_name, cloud_dir_prefix=cloud_dir_prefix, execution_order=execution_order)
        log_dir = check_log_dir(log_dir, is_project)
        if not is_project and log_dir is None:
            log_dir = "tensorboard"
        if not isinstance(log_history, bool):
            raise TypeError(f"log_history must be True or False, got {log_history!r}")
        if "log_dir" in summary_writer_kwargs or "logdir" in summary_writer_kwargs:
            raise TypeError("pass the tensorboard folder as the callback's log_dir argument")
        self.log_dir = log_dir
        self.is_project = is_project
        self.log_history = log_history
        self.summary_writer_kwargs = summary_writer_kwargs
        self.log_dir_path: Optional[str] = None  # the resolved absolute folder, known after registration
        self.tb_writer = None
        # The epoch steps logged per tag (an epoch end replayed after a rollback is logged once), and the rollback
        # texts by step (a later rollback to the same point purges them: they are written again).
        self._epoch_steps_logged: Dict[str, set] = {}
        self._rollback_texts: List[Tuple[int, str]] = []
        self.global_step = 0  # aitoolbox 1.x's batch counter, for subclasses that keep their own step
        self._writer_class: Optional[type] = None

    @property
    def uses_experiment_folder(self) -> bool:
        return self.is_project and (self.log_dir is None or not os.path.isabs(self.log_dir))

    @property
    def tb_writer_kwargs(self) -> dict:
        """aitoolbox 1.x's name of the further ``SummaryWriter`` arguments."""
        return self.summary_writer_kwargs

    @tb_writer_kwargs.setter
    def tb_writer_kwargs(self, kwargs: dict) -> None:
        self.summary_writer_kwargs = kwargs

    def on_train_loop_registration(self) -> None:
        self._writer_class = load_summary_writer_class()
        accepted = set(inspect.signature(self._writer_class).parameters)
        unknown = sorted(set(self.summary_writer_kwargs) - accepted)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown keyword argument(s) {unknown}; the extra keywords "
                            f"go to SummaryWriter, which accepts {sorted(accepted - {'log_dir', 'logdir'})}")
        if self.uses_experiment_folder:
            super().on_train_loop_registration()
            self.log_dir_path = self.resolve_log_dir(self.log_dir, True, "tensorboard")
            return
        self.log_dir_path = os.path.abspath(self.log_dir)
        self._cloud_destination = self._cloud_uploads = None
        if self.is_project:  # an absolute log_dir: uploaded under the run's key, as aitoolbox 1.8 did
            self.setup_cloud_destination()
            if self.cloud_destination is not None:
                self.experiment_folder  # noqa: B018 - the bucket's keys need the run: unknown details fail now
        elif self.cloud_save_mode is not None and self.resolve_cloud_destination() is not None:
            logger.warning("%s: is_project=False, so the event files in %s are not uploaded to cloud storage (as in "
                           "aitoolbox 1.x)", type(self).__name__, self.log_dir_path)

    # --- the run: a SummaryWriter per fit -----------------------------------------------------------------
    def start_run(self) -> None:
        """Open the SummaryWriter (a new event file in the log folder)."""
        if self.tb_writer is None:
            self.create_log_dir()
            self.tb_writer = self._writer_class(log_dir=self.log_dir_path, **self.summary_writer_kwargs)

    def end_run(self, exception: Optional[BaseException]) -> None:
        """Flush and close the writer (and upload the event files, with a cloud mode); a later ``fit`` opens a new
        one (a new event file)."""
        self.close_writer()
        self.upload_to_cloud()

    def close_writer(self) -> None:
        """Flush and close the SummaryWriter (and its writer thread), if one is open."""
        writer, self.tb_writer = self.tb_writer, None
        if writer is not None:
            writer.close()  # flushes first

    def on_epoch_end(self) -> None:
        super().on_epoch_end()
        if self.tb_writer is not None:
            self.tb_writer.flush()
            self.upload_to_cloud()

    # --- what is logged -------------------------------------------------------------------------------------
    def write_hyperparams(self, hyperparams: dict) -> None:
        """Not logged (as in aitoolbox 1.x)."""

    def write_final_model_path(self, path: str) -> None:
        """Not logged (as in aitoolbox 1.x)."""

    def write_batch(self, record: BatchRecord) -> None:
        """``train_loss/last_batch_loss`` and ``train_loss/accumulated_batch_loss`` (a MultiLoss: one tag per
        loss, ``..._<name>``) and the learning rates, at the batch's step."""
        if self.tb_writer is None:
            return
        single = list(record.losses) == ["loss"]
        for tag, values in (("train_loss/last_batch_loss", record.losses),
                            ("train_loss/accumulated_batch_loss", record.mean_losses)):
            for name, value in values.items():
                self.tb_writer.add_scalar(tag if single else f"{tag}_{name}", value, record.step)
        for (optimizer_idx, group_idx), rate in record.learning_rates.items():
            self.tb_writer.add_scalar(f"learning_rate/optimizer_{optimizer_idx}_group_{group_idx}", rate, record.step)

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        """With ``log_history``: each metric at global step = the epoch (see :func:`history_tag`)."""
        if self.tb_writer is None or not self.log_history:
            return
        for name, value in metrics.items():
            tag = history_tag(name)
            logged = self._epoch_steps_logged.setdefault(tag, set())
            if epoch in logged:  # an epoch end replayed after a rollback: its first values stay, one per step
                continue
            logged.add(epoch)
            self.tb_writer.add_scalar(tag, value, epoch)

    def write_rollback(self, record: dict) -> None:
        """SpikeRollback returned the run to an earlier point: a new event file purges the batch steps after it
        (TensorBoard's ``purge_step``, which hides from its readers every event of a step at or after it written
        before), and the rollback is logged there as ``rollbacks/count`` (the rollbacks so far) and a text
        ``rollbacks`` describing it. Epoch steps (history metrics) are numbered by epoch; an epoch end the replay
        logs again (a rollback across an epoch's end) is the same epoch end: it is logged once per tag, its first
        values staying (the history's are the same, bitwise; a timing of the replay is not logged). The texts of
        earlier rollbacks the purge hides (another rollback to the same point or a later one) are written again,
        with this one's, at this step."""
        if self.tb_writer is None:
            return
        tl = self.train_loop_obj
        step = tl.total_iteration_idx + 1  # the first batch the replay trains
        self.close_writer()
        self.tb_writer = self._writer_class(log_dir=self.log_dir_path,
                                            **dict(self.summary_writer_kwargs, purge_step=step))
        purged = [text for at, text in self._rollback_texts if at >= step]
        self._rollback_texts = [(at, text) for at, text in self._rollback_texts if at < step]
        text = "; ".join(purged + [describe_rollback(record)])
        self._rollback_texts.append((step, text))
        self.tb_writer.add_scalar("rollbacks/count", len(tl.rollbacks), step)
        self.tb_writer.add_text("rollbacks", text, step)


    # --- aitoolbox 1.x's methods, for subclasses written against it ----------------------------------------
    def log_mid_train_loss(self) -> None:
        """Log the current batch's loss and the epoch's running mean loss (at the loop's batch index)."""
        loss = getattr(self.train_loop_obj, "last_batch_loss", None)
        if self.tb_writer is None or loss is None:
            return
        self.write_batch(self.batch_record(loss.detach().float()))

    def log_train_history_metrics(self, metric_names: Sequence[str]) -> None:
        """Log the newest value of each of these training-history metrics at global step = the epoch."""
        if self.tb_writer is None:
            return
        history = self.train_loop_obj.train_history
        for name in metric_names:
            value = scalar_value(history[name][-1]) if history.get(name) else None
            if value is not None:
                self.tb_writer.add_scalar(history_tag(name), value, self.train_loop_obj.epoch)

    def create_log_dir(self) -> str:
        """Create (if needed) and return the folder of the event files (known after registration)."""
        return self.ensure_log_dir(self.log_dir_path)

    def prepare_results_saver(self) -> None:
        """aitoolbox 1.x's set-up of the cloud saver: nothing to do (the bucket is known after registration, see
        :attr:`cloud_destination`)."""

    def cloud_log_key(self) -> str:
        """The folder of the event files in the bucket: ``<run key>/<log dir>/<project>_<experiment>`` (aitoolbox
        1.8's key; ``<log dir>`` is the folder's path inside the run folder, or its name when it lies elsewhere)."""
        folder = self.experiment_folder
        if self.uses_experiment_folder:
            log_dir = os.path.relpath(self.log_dir_path, folder.path).replace(os.sep, "/")
        else:
            log_dir = os.path.basename(self.log_dir_path.rstrip(os.sep))
        return self.cloud_destination.keys(folder).experiment_file(
            f"{log_dir}/{folder.project_name}_{folder.experiment_name}")

    def upload_to_cloud(self) -> None:
        """Queue the upload of the event files changed since their last upload (nothing without a cloud mode,
        with ``is_project=False`` or outside the main process); returns at once."""
        if self._cloud_uploads is None or not self.is_main_process or not os.path.isdir(self.log_dir_path or ""):
            return
        prefix = self.cloud_log_key()
        for root, dirs, names in os.walk(self.log_dir_path):
            dirs[:] = sorted(name for name in dirs if not name.startswith(TEMP_PREFIX))
            for name in sorted(names):
                if name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(root, name)
                relative = os.path.relpath(path, self.log_dir_path).replace(os.sep, "/")
                self._cloud_uploads.upload_to_key(self.cloud_destination, path, join_key(prefix, relative),
                                                  only_if_changed=True)


# The name this base class had before aitoolbox 1.x's name was adopted.
TensorboardReporterBase = TensorboardReporterBaseCB


class TensorboardTrainBatchLoss(TensorboardReporterBaseCB):
    """Log the training loss of every ``batch_log_frequency``-th batch and the epoch's running mean.

    Args:
        batch_log_frequency: log every this many batches (counted over the whole training), or ``'step'`` at
            every optimizer step.
        log_dir, is_project, project_name, experiment_name: see :class:`TensorboardReporterBaseCB`.
        local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix: see
            :class:`TensorboardReporterBaseCB`.
        **kwargs: further ``SummaryWriter`` arguments.
    """

    def __init__(self, batch_log_frequency: Union[int, str] = 1, log_dir: Optional[str] = None,
                 is_project: bool = True, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, **kwargs):
        super().__init__("Tensorboard training batch loss", log_dir, is_project, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix,
                         batch_log_frequency=check_batch_log_frequency(batch_log_frequency, allow_none=False),
                         **kwargs)


class TensorboardTrainHistoryMetric(TensorboardReporterBaseCB):
    """At each epoch end log the new values of the training-history metrics (global step = the epoch).

    Metrics recorded at the end of training (``train_end_test_loss``) are logged then.

    Args:
        metric_names: the metrics to log; None logs every metric in the training history.
        log_dir, is_project, project_name, experiment_name: see :class:`TensorboardReporterBaseCB`.
        local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix: see
            :class:`TensorboardReporterBaseCB`.
        **kwargs: further ``SummaryWriter`` arguments.
    """

    def __init__(self, metric_names: Optional[Sequence[str]] = None, log_dir: Optional[str] = None,
                 is_project: bool = True, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, **kwargs):
        super().__init__("Tensorboard training history metrics", log_dir, is_project, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix,
                         log_history=True, metric_names=metric_names, **kwargs)


class TensorboardFullTracking(TensorboardReporterBaseCB):
    """Everything: batch loss, history metrics, learning rates and optionally weight / gradient histograms.

    The learning rates logged with a batch are those its optimizer step used (a scheduler stepping after the
    step changes them only for the next batch). Gradient histograms show the (unscaled) gradients of the last
    optimizer step of the epoch; to have them at epoch end the callback keeps a reference to that step's
    gradient tensors until then.

    Args:
        metric_names: the history metrics to log; None logs all.
        batch_log_frequency: log the batch loss and learning rates every this many batches, or ``'step'`` at every
            optimizer step.
        log_dir, is_project, project_name, experiment_name: see :class:`TensorboardReporterBaseCB`.
        local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix: see
            :class:`TensorboardReporterBaseCB`.
        log_learning_rates: log each optimizer's learning rate per parameter group.
        log_param_histograms: log a histogram of each parameter of the model.
        log_grad_histograms: log a histogram of each parameter's gradient.
        histogram_frequency: log the histograms every this many epochs.
        **kwargs: further ``SummaryWriter`` arguments.
    """

    def __init__(self, metric_names: Optional[Sequence[str]] = None, batch_log_frequency: Union[int, str] = 1,
                 log_dir: Optional[str] = None, is_project: bool = True, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, log_learning_rates: bool = True,
                 log_param_histograms: bool = False, log_grad_histograms: bool = False,
                 histogram_frequency: int = 1, **kwargs):
        super().__init__("Tensorboard full tracking", log_dir, is_project, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix,
                         batch_log_frequency=check_batch_log_frequency(batch_log_frequency, allow_none=False),
                         log_learning_rates=log_learning_rates, log_history=True, metric_names=metric_names,
                         **kwargs)
        self.histogram_frequency = _check_positive_int("histogram_frequency", histogram_frequency)
        self.log_param_histograms = log_param_histograms
        self.log_grad_histograms = log_grad_histograms
        self._last_step_grads: Dict[str, torch.Tensor] = {}

    def _user_model(self) -> torch.nn.Module:
        # The user's own module (not a ModelWrap adapter), so parameter names match the user's model.
        return getattr(self.train_loop_obj, "model_for_user", self.train_loop_obj.model)

    def _histograms_due(self) -> bool:
        return (self.train_loop_obj.epoch + 1) % self.histogram_frequency == 0

    def on_epoch_begin(self) -> None:
        super().on_epoch_begin()
        self._last_step_grads = {}

    def on_exception(self, exception: BaseException) -> None:
        self._last_step_grads = {}  # gradient tensors (GPU memory) a stopped fit no longer needs
        super().on_exception(exception)

    def on_after_optimizer_step(self) -> None:
        super().on_after_optimizer_step()
        tl = self.train_loop_obj
        if self.tb_writer is None or not self.log_grad_histograms or not self._histograms_due() \
                or tl.optimizer_step_skipped:
            return
        # References only: zero_grad sets the gradients to None, so these tensors keep this step's values.
        names = {id(param): name for name, param in self._user_model().named_parameters()}
        self._last_step_grads = {}
        for optimizer_idx, optimizer in enumerate(tl.optimizers):
            for param_idx, param in enumerate(Precision.stepped_parameters(optimizer)):
                if param.grad is not None:
                    name = names.get(id(param), f"optimizer_{optimizer_idx}/param_{param_idx}")
                    self._last_step_grads[name] = param.grad

    def on_epoch_end(self) -> None:
        if self.tb_writer is not None and self._histograms_due():
            epoch = self.train_loop_obj.epoch
            if self.log_param_histograms:
                for name, param in self._user_model().named_parameters():
                    self.tb_writer.add_histogram(f"parameters/{name}", param.detach().float().cpu(), epoch)
            for name, grad in self._last_step_grads.items():
                self.tb_writer.add_histogram(f"gradients/{name}", grad.detach().float().cpu(), epoch)
        self._last_step_grads = {}
        super().on_epoch_end()
