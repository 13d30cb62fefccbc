"""General-purpose callbacks: running a function at hooks, smoke runs on a data subset, listing the callbacks.

The stopping callbacks (:class:`EarlyStopping`, :class:`ThresholdEarlyStopping`, :class:`TerminateOnNaN`,
:class:`AllPredictionsSame`) live in :mod:`.stopping` and are importable from here, as in aitoolbox 1.x.
:class:`LogUpload` uploads a log file to the run's folder in S3 / Google Cloud Storage;
:class:`EmailNotification` (in :mod:`.email_notification`, importable from here as in aitoolbox 1.x) e-mails a
report after every epoch and at the end of training through AWS SES.
"""
import logging
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterable, List, Optional

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, AbstractExperimentCallback
from aitoolbox.torchtrain.callbacks.email_notification import EmailNotification  # noqa: F401  (1.x import path)
from aitoolbox.torchtrain.callbacks.stopping import (  # noqa: F401  (aitoolbox 1.x import path)
    AllPredictionsSame, EarlyStopping, TerminateOnNaN, ThresholdEarlyStopping)

logger = logging.getLogger(__name__)

__all__ = ["ListRegisteredCallbacks", "EarlyStopping", "ThresholdEarlyStopping", "TerminateOnNaN",
           "AllPredictionsSame", "EmailNotification", "LogUpload", "DataSubsetTestRun", "FunctionOnTrainLoop"]

# The hooks a callback can override, in the order the listing shows them.
_LISTED_HOOKS = ("on_train_loop_registration", "on_multiprocess_start", "on_train_begin", "on_epoch_begin",
                 "on_batch_begin", "on_after_gradient_update", "on_after_optimizer_step", "on_batch_end",
                 "on_epoch_end", "on_train_end", "on_after_batch_prediction")


def registered_callbacks_report(callbacks: Iterable[AbstractCallback]) -> str:
    """A text listing, for each hook, the callbacks that override it, in execution order."""
    callbacks = list(callbacks)
    lines = ["Registered callbacks:"]
    for hook in _LISTED_HOOKS:
        users = [cb for cb in callbacks if getattr(type(cb), hook, None) is not getattr(AbstractCallback, hook)]
        lines.append(f"  {hook}:")
        lines.extend(f"    {cb.callback_name}: {type(cb).__name__}, execution_order: {cb.execution_order}"
                     for cb in users)
    return "\n".join(lines)


class ListRegisteredCallbacks(AbstractCallback):
    """Print, at the start of training, which callbacks run at each hook (in the main process)."""

    def __init__(self):
        super().__init__("Print the list of registered callbacks")

    def on_train_begin(self) -> None:
        if self.train_loop_obj.is_main_process:
            print(registered_callbacks_report(self.train_loop_obj.callbacks))  # the report the user asked for


class LogUpload(AbstractExperimentCallback):
    """Upload a log file (e.g. the ``tee``'d output of the training script) to the run's folder in the bucket,
    after every epoch, at the end of training and when ``fit`` stops on an exception, as
    ``<run key>/<log file name>``.

    The log file is read where it is; it is not copied into the experiment folder. Uploads run in the
    background (see :doc:`cloud_storage`); only the main process uploads.

    Args:
        log_file_path: the log file.
        fail_if_cloud_missing: without a cloud ``cloud_save_mode`` (the callback's or the preset's), raise a
            ``ValueError`` at registration; False only logs a warning and the callback does nothing.
        project_name, experiment_name, local_model_result_folder_path: the run (None: the preset's).
        cloud_save_mode, bucket_name, cloud_dir_prefix: the bucket (all None: the preset's).

    Raises:
        ValueError: at registration, no cloud storage is configured and ``fail_if_cloud_missing`` is True.
    """

    def __init__(self, log_file_path: str = "~/project/training.log", fail_if_cloud_missing: bool = True,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None):
        super().__init__("Upload the logging file to cloud storage", project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, bucket_name, cloud_dir_prefix,
                         execution_order=1500, device_idx_execution=0)
        self.log_file_path = os.path.expanduser(log_file_path)
        self.log_filename = os.path.basename(self.log_file_path)
        self.fail_if_cloud_missing = fail_if_cloud_missing

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        if self.cloud_destination is not None:
            self.experiment_folder  # noqa: B018 - the key needs the run: unknown details fail now
            return
        message = (f"LogUpload has no cloud storage to upload {self.log_file_path} to: pass cloud_save_mode ('s3' or "
                   "'gcs') and bucket_name, or use an experiment-tracking TrainLoop with them. The log could be "
                   "lost with the machine")
        if self.fail_if_cloud_missing:
            raise ValueError(message)
        logger.warning(message)

    def on_epoch_end(self) -> None:
        self.upload_log_file()

    def on_train_end(self) -> None:
        self.upload_log_file()

    def on_exception(self, exception: BaseException) -> None:
        self.upload_log_file()  # the log of a run that stopped is the one most worth keeping

    def upload_log_file(self) -> None:
        """Queue the upload of the log file (when it exists and changed since its last upload)."""
        if self._cloud_uploads is None or not self.is_main_process:
            return
        if not os.path.isfile(self.log_file_path):
            logger.warning("LogUpload: there is no log file %s (yet) to upload", self.log_file_path)
            return
        key = self.cloud_destination.keys(self.experiment_folder).experiment_file(self.log_filename)
        self._cloud_uploads.upload_to_key(self.cloud_destination, self.log_file_path, key, only_if_changed=True)


class FunctionOnTrainLoop(AbstractCallback):
    """Call ``fn_to_execute(train_loop)`` at the hooks whose flag is True (or directly, :meth:`execute_callback`).

    ``after_gradient_update`` runs once per optimizer after every backward pass.

    Args:
        fn_to_execute: a function taking the TrainLoop as its only argument.
        tl_registration: when the callback is registered with the loop.
        epoch_begin: at the start of each epoch.
        epoch_end: at the end of each epoch.
        train_begin: at the start of training.
        train_end: at the end of training.
        batch_begin: before each batch.
        batch_end: after each batch.
        after_gradient_update: after each backward pass.
        after_optimizer_step: after each optimizer step.
        execution_order: position among the callbacks (increasing).
        device_idx_execution: under distributed training, run only in the process of this global rank.

    Raises:
        TypeError: ``fn_to_execute`` is not callable.
    """

    def __init__(self, fn_to_execute: Callable[[Any], Any], tl_registration: bool = False,
                 epoch_begin: bool = False, epoch_end: bool = False, train_begin: bool = False,
                 train_end: bool = False, batch_begin: bool = False, batch_end: bool = False,
                 after_gradient_update: bool = False, after_optimizer_step: bool = False, execution_order: int = 0,
                 device_idx_execution: Optional[int] = None):
        super().__init__("Execute the provided function at the selected hooks", execution_order=execution_order,
                         device_idx_execution=device_idx_execution)
        if not callable(fn_to_execute):
            raise TypeError(f"fn_to_execute must be a function taking the TrainLoop, got {fn_to_execute!r}")
        self.fn_to_execute = fn_to_execute
        self.tl_registration = tl_registration
        self.epoch_begin = epoch_begin
        self.epoch_end = epoch_end
        self.train_begin = train_begin
        self.train_end = train_end
        self.batch_begin = batch_begin
        self.batch_end = batch_end
        self.after_gradient_update = after_gradient_update
        self.after_optimizer_step = after_optimizer_step

    def execute_callback(self) -> None:
        """Call the function with the registered TrainLoop now."""
        self.fn_to_execute(self.train_loop_obj)

    # The handler calls only the hooks a class overrides, so every hook is overridden and checks its flag.
    def on_train_loop_registration(self) -> None:
        if self.after_gradient_update or self.after_optimizer_step:
            # aitoolbox 1.x's flag for "a callback uses the gradient hooks"; our loop always calls them.
            self.train_loop_obj.grad_cb_used = True
        if self.tl_registration:
            self.execute_callback()

    def on_epoch_begin(self) -> None:
        if self.epoch_begin:
            self.execute_callback()

    def on_epoch_end(self) -> None:
        if self.epoch_end:
            self.execute_callback()

    def on_train_begin(self) -> None:
        if self.train_begin:
            self.execute_callback()

    def on_train_end(self) -> None:
        if self.train_end:
            self.execute_callback()

    def on_batch_begin(self) -> None:
        if self.batch_begin:
            self.execute_callback()

    def on_batch_end(self) -> None:
        if self.batch_end:
            self.execute_callback()

    def on_after_gradient_update(self, optimizer_idx: int) -> None:
        if self.after_gradient_update:
            self.execute_callback()

    def on_after_optimizer_step(self) -> None:
        if self.after_optimizer_step:
            self.execute_callback()


class DataSubsetTestRun(AbstractCallback):
    """Train (and evaluate) on only the first few batches: a quick smoke run of a new model or pipeline.

    At the start of training the loop's loaders are replaced by lists of their first N batches, so every
    epoch sees the same few batches (aitoolbox 1.x behaviour): a model that cannot fit them has a bug.

    Args:
        num_train_batches: training batches to keep (>= 1).
        num_val_batches: validation batches to keep (of each set, with several named validation sets); 0 keeps the
            whole validation loader.
        num_test_batches: test batches to keep; 0 keeps the whole test loader.

    Raises:
        ValueError: on a bad count, or at registration when a loader to subset was not given to the TrainLoop.
    """

    def __init__(self, num_train_batches: int = 1, num_val_batches: int = 0, num_test_batches: int = 0):
        super().__init__("Run on a small subset of the data")
        for name, value, minimum in (("num_train_batches", num_train_batches, 1),
                                     ("num_val_batches", num_val_batches, 0),
                                     ("num_test_batches", num_test_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.num_train_batches = num_train_batches
        self.num_val_batches = num_val_batches
        self.num_test_batches = num_test_batches

    def on_train_loop_registration(self) -> None:
        for count, name in ((self.num_val_batches, "validation_loader"), (self.num_test_batches, "test_loader")):
            if count > 0 and getattr(self.train_loop_obj, name) is None:
                raise ValueError(f"DataSubsetTestRun was asked to keep {count} batch(es) of the {name}, but the "
                                 f"TrainLoop has no {name}: pass one to TrainLoop or set the count to 0")

    def on_train_begin(self) -> None:
        tl = self.train_loop_obj
        tl.train_loader = self.subset_data_loader(tl.train_loader, self.num_train_batches)
        if self.num_val_batches > 0:
            if isinstance(tl.validation_loader, Mapping):  # several named validation sets: each one cut
                tl.validation_loader = {name: self.subset_data_loader(loader, self.num_val_batches)
                                        for name, loader in tl.validation_loader.items()}
            else:
                tl.validation_loader = self.subset_data_loader(tl.validation_loader, self.num_val_batches)
        if self.num_test_batches > 0:
            tl.test_loader = self.subset_data_loader(tl.test_loader, self.num_test_batches)
        if tl.is_main_process:
            logger.info("DataSubsetTestRun: training on the first %d batch(es)", len(tl.train_loader))

    @staticmethod
    def subset_data_loader(data_loader: Iterable, num_batches: int) -> List[Any]:
        """The first ``num_batches`` batches of ``data_loader``, as a list."""
        subset = []
        for batch in data_loader:
            subset.append(batch)
            if len(subset) == num_batches:  # stop before the loader loads one batch more
                break
        return subset
