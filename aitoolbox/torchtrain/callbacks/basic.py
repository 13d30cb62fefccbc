"""General-purpose callbacks: running a function at hooks, smoke runs on a data subset, listing the callbacks.

The stopping callbacks (:class:`EarlyStopping`, :class:`ThresholdEarlyStopping`, :class:`TerminateOnNaN`,
:class:`AllPredictionsSame`) live in :mod:`.stopping` and are importable from here, as in aitoolbox 1.x.
:class:`LogUpload` uploads a log file to the run's folder in S3 / Google Cloud Storage;
:class:`EmailNotification` e-mails a report after every epoch and at the end of training through AWS SES.
"""
import html
import logging
import numbers
import os
from typing import Any, Callable, Iterable, List, Optional

from aitoolbox.torchtrain.callbacks.abstract import (AbstractCallback, AbstractExperimentCallback,
                                                     MissingExperimentDetailsError)
from aitoolbox.torchtrain.callbacks.experiment import scalar_value
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


class EmailNotification(AbstractCallback):
    """E-mail a training report at the end of every epoch and at the end of training, through AWS SES.

    Each epoch's e-mail (subject ``"End of epoch <epoch> report: <project>: <experiment>"``) lists the newest
    value of every metric in the training history; the final one (``"End of training: <project>:
    <experiment>"``) adds the TrainLoop's hyperparameters ("Not given" when the loop has none). Names and values
    are HTML-escaped. Files that other callbacks announce through the loop's aitoolbox 1.x message service, under
    the keys in :attr:`ATTACHMENT_MESSAGE_KEYS`, are attached; an announced file that does not exist is left out
    with a warning.

    The e-mails go through :class:`~aitoolbox.cloud.AWS.simple_email_service.SESSender` (``pip install
    aitoolbox[aws]``), with boto3's standard credentials and endpoint configuration (``AWS_ENDPOINT_URL_SES`` /
    ``AWS_ENDPOINT_URL``); the sender's address must be verified in SES. A notification never stops training:
    an e-mail SES refuses or cannot take, or an attachment that cannot be read, is logged as an error and training
    goes on. Only the main process (global rank 0) sends.

    Args:
        sender_name: the name shown as the sender.
        sender_email: the sender's address, verified in SES.
        recipient_email: where the e-mails go.
        project_name: the project named in the subjects; None takes the TrainLoop's (an experiment-tracking
            TrainLoop's ``project_name``).
        experiment_name: the experiment named in the subjects; None takes the TrainLoop's.
        aws_region: the SES region.

    Raises:
        ValueError: an address, name or region that is not a non-empty string.
        MissingExperimentDetailsError: at registration, ``project_name`` or ``experiment_name`` is None and the
            TrainLoop has none (an ``AttributeError``, as in aitoolbox 1.x, and a ``ValueError``).
        ImportError: at registration, when boto3 is not installed (the message names the ``aws`` extra).
    """

    #: Message-service keys under which aitoolbox 1.x's ModelTrainHistoryPlot and ModelTrainHistoryFileWriter
    #: announce the files they wrote (each message a list of local paths).
    ATTACHMENT_MESSAGE_KEYS = ("ModelTrainHistoryPlot_results_file_local_paths",
                               "ModelTrainHistoryFileWriter_results_file_local_paths")

    def __init__(self, sender_name: str, sender_email: str, recipient_email: str, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, aws_region: str = "eu-west-1"):
        super().__init__("Send email to notify about the state of training", execution_order=98,
                         device_idx_execution=0)
        for name, value, optional in (("sender_name", sender_name, False), ("sender_email", sender_email, False),
                                      ("recipient_email", recipient_email, False),
                                      ("project_name", project_name, True),
                                      ("experiment_name", experiment_name, True),
                                      ("aws_region", aws_region, False)):
            if not (optional and value is None) and (not isinstance(value, str) or not value.strip()):
                allowed = "a non-empty string or None" if optional else "a non-empty string"
                raise ValueError(f"EmailNotification: {name} must be {allowed}, got {value!r}")
        self.sender_name = sender_name
        self.sender_email = sender_email
        self.recipient_email = recipient_email
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.aws_region = aws_region
        self.ses_sender: Any = None  # the SESSender, made at registration

    def __getstate__(self) -> dict:
        # Sent to the processes of distributed training: the boto3 client is not picklable, and the sending
        # process makes its own sender when it first needs one.
        state = self.__dict__.copy()
        state["ses_sender"] = None
        return state

    def on_train_loop_registration(self) -> None:
        for name in ("project_name", "experiment_name"):
            if getattr(self, name) is None:
                value = getattr(self.train_loop_obj, name, None)
                if value is None:
                    raise MissingExperimentDetailsError(
                        f"EmailNotification names the project and experiment in its subjects, but {name} is None "
                        "and the TrainLoop has none: pass project_name and experiment_name to EmailNotification, "
                        "or use it with an experiment-tracking TrainLoop (TrainLoopCheckpoint, TrainLoopEndSave or "
                        "TrainLoopCheckpointEndSave)")
                setattr(self, name, value)
        self.ses_sender = self.make_sender()  # a missing boto3 is reported now, not after the first epoch

    def make_sender(self) -> Any:
        """A new :class:`~aitoolbox.cloud.AWS.simple_email_service.SESSender` for this callback's addresses."""
        from aitoolbox.cloud.AWS.simple_email_service import SESSender  # boto3 is optional: imported when used
        return SESSender(self.sender_name, self.sender_email, self.recipient_email, self.aws_region)

    def on_epoch_end(self) -> None:
        epoch = self.train_loop_obj.epoch
        subject = f"End of epoch {epoch} report: {self.project_name}: {self.experiment_name}"
        body = f"<h2>End of epoch {epoch}</h2>\n{self.get_metric_list_html()}\n"
        self.send_report(subject, body)

    def on_train_end(self) -> None:
        subject = f"End of training: {self.project_name}: {self.experiment_name}"
        body = (f"<h2>End of training at epoch {self.train_loop_obj.epoch}</h2>\n{self.get_metric_list_html()}\n"
                f"<h3>Used hyper parameters:</h3>\n{self.get_hyperparams_html()}\n")
        self.send_report(subject, body)

    def get_metric_list_html(self) -> str:
        """An HTML list of the newest value of every metric in the training history (metrics without values are
        left out)."""
        items = [f"<li><p>{html.escape(str(name))}: {_html_value(values[-1])}</p></li>"
                 for name, values in self.train_loop_obj.train_history.items() if len(values) > 0]
        return "<ul>\n" + "\n".join(items) + "\n</ul>"

    def get_hyperparams_html(self) -> str:
        """An HTML list of the TrainLoop's hyperparameters, or ``'Not given'`` when it has none."""
        hyperparams = getattr(self.train_loop_obj, "hyperparams", None)
        if not hyperparams:
            return "Not given"
        items = [f"<li><p>{html.escape(str(name))}: {_html_value(value)}</p></li>"
                 for name, value in hyperparams.items()]
        return "<ul>\n" + "\n".join(items) + "\n</ul>"

    def get_attachment_paths(self) -> List[str]:
        """The existing files announced under :attr:`ATTACHMENT_MESSAGE_KEYS` (none without a message service).

        Announced files that do not exist are left out with a warning.
        """
        if self.message_service is None:
            return []
        paths: List[str] = []
        for key in self.ATTACHMENT_MESSAGE_KEYS:
            for message in self.message_service.read_messages(key) or []:
                # 1.x's messages are lists of paths; a single path is taken as well.
                for path in [message] if isinstance(message, (str, os.PathLike)) else message:
                    path = os.path.expanduser(os.fspath(path))
                    if path in paths:
                        continue
                    if os.path.isfile(path):
                        paths.append(path)
                    else:
                        logger.warning("EmailNotification: not attaching %s (announced under %s): there is no "
                                       "such file", path, key)
        return paths

    def send_report(self, subject: str, body: str) -> Optional[str]:
        """Send an e-mail with the announced attachments; returns SES's message id, or None when it failed
        (the reason is logged; training goes on). Outside the main process nothing is sent."""
        # device_idx_execution keeps the callbacks given to fit out of other ranks; one registered with the loop
        # before fit_distributed travels to every process.
        if not self.train_loop_obj.is_main_process:
            return None
        if self.ses_sender is None:  # in a process of distributed training, the sender is made here
            self.ses_sender = self.make_sender()
        try:
            return self.ses_sender.send_email(subject, body, self.get_attachment_paths())
        except OSError as error:  # an attachment removed or unreadable since it was checked
            logger.error("EmailNotification could not attach a file to the e-mail %r, which was not sent: %s",
                         subject, error)
            return None


def _html_value(value: Any) -> str:
    """``value`` as escaped HTML text; a one-element tensor or array shows as its number."""
    if not isinstance(value, numbers.Number):
        number = scalar_value(value)
        if number is not None:
            value = number
    return html.escape(str(value))


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
        num_val_batches: validation batches to keep; 0 keeps the whole validation loader.
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
