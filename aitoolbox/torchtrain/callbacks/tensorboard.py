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

Tags (the same as aitoolbox 1.x, so existing dashboards keep working):

- ``train_loss/last_batch_loss`` and ``train_loss/accumulated_batch_loss`` (mean over the epoch so far),
  global step = the batch index counted over the whole training;
- ``loss/<metric>`` for history metrics whose name contains ``loss``, ``metrics/<metric>`` for the others,
  global step = the epoch;
- :class:`TensorboardFullTracking` adds ``learning_rate/optimizer_<i>_group_<j>`` (batch step) and the
  histograms ``parameters/<name>`` and ``gradients/<name>`` (epoch step).
"""
import inspect
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

import torch

from aitoolbox.cloud.storage import join_key
from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback, scalar_value
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


def _check_metric_names(metric_names: Optional[Sequence[str]]) -> Optional[List[str]]:
    if metric_names is None:
        return None
    if isinstance(metric_names, str) or not isinstance(metric_names, Sequence) or len(metric_names) == 0:
        raise TypeError(f"metric_names must be None (all metrics) or a non-empty list of names such as "
                        f"['loss', 'val_loss'], got {metric_names!r}")
    not_names = [name for name in metric_names if not isinstance(name, str)]
    if not_names:
        raise TypeError(f"metric_names must hold metric names (strings); these are not: {not_names!r}")
    return list(metric_names)


class TensorboardReporterBaseCB(AbstractExperimentCallback):
    """Owns the SummaryWriter and the logging routines the tensorboard callbacks combine.

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
        **summary_writer_kwargs: further ``SummaryWriter`` arguments (e.g. ``flush_secs``).

    Raises:
        ValueError: a bad ``log_dir``, an unknown ``cloud_save_mode``, or (at registration) an experiment folder
            that is needed but unknown.
    """

    def __init__(self, callback_name: str, log_dir: Optional[str] = None, is_project: bool = True,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97, **summary_writer_kwargs):
        super().__init__(callback_name, project_name, experiment_name, local_model_result_folder_path,
                         cloud_save_mode, bucket_name, cloud_dir_prefix, execution_order=execution_order)
        if log_dir is not None:
            if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
                raise ValueError(f"log_dir must be None or a folder path, got {log_dir!r}")
            log_dir = os.path.expanduser(os.fspath(log_dir))
        if not isinstance(is_project, bool):
            raise TypeError(f"is_project must be True or False, got {is_project!r}")
        if not is_project and log_dir is None:
            log_dir = "tensorboard"
        if "log_dir" in summary_writer_kwargs or "logdir" in summary_writer_kwargs:
            raise TypeError("pass the tensorboard folder as the callback's log_dir argument")
        self.log_dir = log_dir
        self.is_project = is_project
        self.summary_writer_kwargs = summary_writer_kwargs
        self.log_dir_path: Optional[str] = None  # the resolved absolute folder, known after registration
        self.tb_writer = None
        self.global_step = 0  # aitoolbox 1.x's batch counter, for subclasses that keep their own step
        self._writer_class: Optional[type] = None
        self._epoch_loss_sum: Optional[torch.Tensor] = None
        self._epoch_batches = 0
        self._logged_history_lengths: Dict[str, int] = {}
        self._unloggable_metrics: set = set()

    @property
    def uses_experiment_folder(self) -> bool:
        return self.is_project and (self.log_dir is None or not os.path.isabs(self.log_dir))

    def on_train_loop_registration(self) -> None:
        self._writer_class = load_summary_writer_class()
        accepted = set(inspect.signature(self._writer_class).parameters)
        unknown = sorted(set(self.summary_writer_kwargs) - accepted)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown keyword argument(s) {unknown}; the extra keywords "
                            f"go to SummaryWriter, which accepts {sorted(accepted - {'log_dir', 'logdir'})}")
        if self.uses_experiment_folder:
            super().on_train_loop_registration()
            self.log_dir_path = os.path.join(self.experiment_folder.path, self.log_dir or "tensorboard")
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

    def on_train_begin(self) -> None:
        if not self.is_main_process or self.tb_writer is not None:
            return
        self.create_log_dir()
        self.tb_writer = self._writer_class(log_dir=self.log_dir_path, **self.summary_writer_kwargs)

    def on_epoch_end(self) -> None:
        if self.tb_writer is not None:
            self.tb_writer.flush()
            self.upload_to_cloud()

    def on_train_end(self) -> None:
        self.close_writer()
        self.upload_to_cloud()

    def on_exception(self, exception: BaseException) -> None:
        """Write out what was logged and close the writer (and upload the event files, with a cloud mode); a later
        ``fit`` opens a new one (a new event file)."""
        self.close_writer()
        self.upload_to_cloud()

    def close_writer(self) -> None:
        """Flush and close the SummaryWriter (and its writer thread), if one is open."""
        writer, self.tb_writer = self.tb_writer, None
        if writer is not None:
            writer.close()  # flushes first

    # --- the logging routines --------------------------------------------------------------------------
    def reset_epoch_loss(self) -> None:
        self._epoch_loss_sum = None
        self._epoch_batches = 0

    def log_batch_loss(self, batch_log_frequency: int) -> bool:
        """Add the batch loss to the epoch's sum; every ``batch_log_frequency`` batches log it. True if logged."""
        if self.tb_writer is None:
            return False
        loss = getattr(self.train_loop_obj, "last_batch_loss", None)
        if loss is None:
            raise RuntimeError(f"{type(self).__name__} logs train_loop_obj.last_batch_loss, which this TrainLoop does "
                               "not provide: use a TrainLoop that records the detached loss of each batch")
        loss = loss.detach().float()
        # Summed on the loss's device: no GPU synchronisation except on the batches that are logged.
        self._epoch_loss_sum = loss if self._epoch_loss_sum is None else self._epoch_loss_sum + loss
        self._epoch_batches += 1
        step = self.train_loop_obj.total_iteration_idx
        if step % batch_log_frequency != 0:
            return False
        self.tb_writer.add_scalar("train_loss/last_batch_loss", loss.item(), step)
        self.tb_writer.add_scalar("train_loss/accumulated_batch_loss",
                                  (self._epoch_loss_sum / self._epoch_batches).item(), step)
        return True

    def write_learning_rates(self) -> None:
        """Log the learning rate of every parameter group of every optimizer at the current batch step."""
        step = self.train_loop_obj.total_iteration_idx
        for optimizer_idx, optimizer in enumerate(self.train_loop_obj.optimizers):
            for group_idx, group in enumerate(optimizer.param_groups):
                learning_rate = scalar_value(group.get("lr"))
                if learning_rate is not None:
                    self.tb_writer.add_scalar(f"learning_rate/optimizer_{optimizer_idx}_group_{group_idx}",
                                              learning_rate, step)

    def log_history_metrics(self, metric_names: Optional[List[str]]) -> None:
        """Log the metrics that got a new value since the last call, at global step = the epoch.

        A metric recorded only every few epochs (``end_auto_eval=N``, ``eval_frequency``) is logged at those
        epochs, not repeated in between. Values that are not single numbers are skipped with a warning.
        """
        if self.tb_writer is None:
            return
        history = self.train_loop_obj.train_history
        for name in (metric_names if metric_names is not None else list(history.keys())):
            values = history.get(name) or []
            if len(values) <= self._logged_history_lengths.get(name, 0):
                continue
            self._logged_history_lengths[name] = len(values)
            value = scalar_value(values[-1])
            if value is not None:
                self.tb_writer.add_scalar(history_tag(name), value, self.train_loop_obj.epoch)
            elif name not in self._unloggable_metrics:
                self._unloggable_metrics.add(name)
                logger.warning("Training history metric %r holds %s values, not single numbers; it is not logged "
                               "to tensorboard", name, type(values[-1]).__name__)


    # --- aitoolbox 1.x's methods, for subclasses written against it ----------------------------------------
    def log_mid_train_loss(self) -> None:
        """Log the current batch's loss and the epoch's running mean loss (at the loop's batch index)."""
        self.log_batch_loss(batch_log_frequency=1)

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
        if self.has_experiment_folder:
            return self.experiment_folder.ensure(self.log_dir_path)
        os.makedirs(self.log_dir_path, exist_ok=True)
        return self.log_dir_path

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
        batch_log_frequency: log every this many batches (counted over the whole training).
        log_dir, is_project, project_name, experiment_name: see :class:`TensorboardReporterBaseCB`.
        local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix: see
            :class:`TensorboardReporterBaseCB`.
        **kwargs: further ``SummaryWriter`` arguments.
    """

    def __init__(self, batch_log_frequency: int = 1, log_dir: Optional[str] = None, is_project: bool = True,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None, **kwargs):
        super().__init__("Tensorboard training batch loss", log_dir, is_project, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix, **kwargs)
        self.batch_log_frequency = _check_positive_int("batch_log_frequency", batch_log_frequency)

    def on_epoch_begin(self) -> None:
        self.reset_epoch_loss()

    def on_batch_end(self) -> None:
        self.log_batch_loss(self.batch_log_frequency)


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
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix, **kwargs)
        self.metric_names = _check_metric_names(metric_names)

    def on_epoch_end(self) -> None:
        self.log_history_metrics(self.metric_names)
        super().on_epoch_end()

    def on_train_end(self) -> None:
        self.log_history_metrics(self.metric_names)
        super().on_train_end()


class TensorboardFullTracking(TensorboardReporterBaseCB):
    """Everything: batch loss, history metrics, learning rates and optionally weight / gradient histograms.

    Gradient histograms show the (unscaled) gradients of the last optimizer step of the epoch; to have them
    at epoch end the callback keeps a reference to that step's gradient tensors until then.

    Args:
        metric_names: the history metrics to log; None logs all.
        batch_log_frequency: log the batch loss and learning rates every this many batches.
        log_dir, is_project, project_name, experiment_name: see :class:`TensorboardReporterBaseCB`.
        local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix: see
            :class:`TensorboardReporterBaseCB`.
        log_learning_rates: log each optimizer's learning rate per parameter group.
        log_param_histograms: log a histogram of each parameter of the model.
        log_grad_histograms: log a histogram of each parameter's gradient.
        histogram_frequency: log the histograms every this many epochs.
        **kwargs: further ``SummaryWriter`` arguments.
    """

    def __init__(self, metric_names: Optional[Sequence[str]] = None, batch_log_frequency: int = 1,
                 log_dir: Optional[str] = None, is_project: bool = True, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None,
                 cloud_save_mode: Optional[str] = None, bucket_name: Optional[str] = None,
                 cloud_dir_prefix: Optional[str] = None, log_learning_rates: bool = True,
                 log_param_histograms: bool = False, log_grad_histograms: bool = False,
                 histogram_frequency: int = 1, **kwargs):
        super().__init__("Tensorboard full tracking", log_dir, is_project, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix, **kwargs)
        self.metric_names = _check_metric_names(metric_names)
        self.batch_log_frequency = _check_positive_int("batch_log_frequency", batch_log_frequency)
        self.histogram_frequency = _check_positive_int("histogram_frequency", histogram_frequency)
        self.log_learning_rates = log_learning_rates
        self.log_param_histograms = log_param_histograms
        self.log_grad_histograms = log_grad_histograms
        self._last_step_grads: Dict[str, torch.Tensor] = {}

    def _user_model(self) -> torch.nn.Module:
        # The user's own module (not a ModelWrap adapter), so parameter names match the user's model.
        return getattr(self.train_loop_obj, "model_for_user", self.train_loop_obj.model)

    def _histograms_due(self) -> bool:
        return (self.train_loop_obj.epoch + 1) % self.histogram_frequency == 0

    def on_epoch_begin(self) -> None:
        self.reset_epoch_loss()
        self._last_step_grads = {}

    def on_exception(self, exception: BaseException) -> None:
        self._last_step_grads = {}  # gradient tensors (GPU memory) a stopped fit no longer needs
        super().on_exception(exception)

    def on_batch_end(self) -> None:
        if self.log_batch_loss(self.batch_log_frequency) and self.log_learning_rates:
            self.write_learning_rates()

    def on_after_optimizer_step(self) -> None:
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
        self.log_history_metrics(self.metric_names)
        if self.tb_writer is not None and self._histograms_due():
            epoch = self.train_loop_obj.epoch
            if self.log_param_histograms:
                for name, param in self._user_model().named_parameters():
                    self.tb_writer.add_histogram(f"parameters/{name}", param.detach().float().cpu(), epoch)
            for name, grad in self._last_step_grads.items():
                self.tb_writer.add_histogram(f"gradients/{name}", grad.detach().float().cpu(), epoch)
        self._last_step_grads = {}
        super().on_epoch_end()

    def on_train_end(self) -> None:
        self.log_history_metrics(self.metric_names)
        super().on_train_end()
