"""E-mail notifications of training progress through AWS Simple Email Service (aitoolbox 1.x's callback)."""
import html
import logging
import numbers
import os
from typing import Any, List, Optional

from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, MissingExperimentDetailsError
from aitoolbox.torchtrain.callbacks.background import BackgroundSender
from aitoolbox.torchtrain.callbacks.experiment import scalar_value

logger = logging.getLogger(__name__)

__all__ = ["EmailNotification"]


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
    ``AWS_ENDPOINT_URL``) and retry settings, whose waits come from a generator of the client's own: sending
    leaves Python's global ``random``, which training draws from, alone. The sender's address must be verified in
    SES. Only the main process (global rank 0) sends.

    A notification never stops or holds up training. The hooks build each e-mail (reading its attachments then)
    and queue it; a background thread sends the queue in order. An e-mail SES cannot take for now (no connection,
    a timeout, throttling) is kept and tried again, and the outage is logged once; an e-mail SES refuses (an
    unverified sender) or an attachment that cannot be read is logged as an error. At most ``max_queued_emails``
    wait at once (the oldest is dropped beyond that). At the end of ``fit`` (or when it stops on an exception) the
    callback waits at most ``flush_timeout_s`` seconds for the queue, then logs which e-mails were not sent yet;
    they keep being tried while the process runs.

    Args:
        sender_name: the name shown as the sender.
        sender_email: the sender's address, verified in SES.
        recipient_email: where the e-mails go.
        project_name: the project named in the subjects; None takes the TrainLoop's (an experiment-tracking
            TrainLoop's ``project_name``).
        experiment_name: the experiment named in the subjects; None takes the TrainLoop's.
        aws_region: the SES region.
        flush_timeout_s: how long the end of ``fit`` waits for the queued e-mails to be sent.
        max_queued_emails: the most e-mails waiting to be sent at once.

    Raises:
        ValueError: an address, name or region that is not a non-empty string, a name with a line break, an
            address that is not one address.
        MissingExperimentDetailsError: at registration, ``project_name`` or ``experiment_name`` is None and the
            TrainLoop has none (an ``AttributeError``, as in aitoolbox 1.x, and a ``ValueError``).
        ImportError: at registration, when boto3 is not installed (the message names the ``aws`` extra).
    """

    #: Message-service keys under which aitoolbox 1.x's ModelTrainHistoryPlot and ModelTrainHistoryFileWriter
    #: announce the files they wrote (each message a list of local paths).
    ATTACHMENT_MESSAGE_KEYS = ("ModelTrainHistoryPlot_results_file_local_paths",
                               "ModelTrainHistoryFileWriter_results_file_local_paths")

    def __init__(self, sender_name: str, sender_email: str, recipient_email: str, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, aws_region: str = "eu-west-1",
                 flush_timeout_s: float = 10.0, max_queued_emails: int = 20):
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
        from aitoolbox.cloud.AWS.simple_email_service import check_display_name, check_email_address  # no boto3
        check_display_name(sender_name, "EmailNotification: sender_name")
        check_email_address(sender_email, "EmailNotification: sender_email")
        check_email_address(recipient_email, "EmailNotification: recipient_email", allow_name=True)
        if isinstance(flush_timeout_s, bool) or not isinstance(flush_timeout_s, (int, float)) or \
                not flush_timeout_s >= 0:
            raise ValueError(f"EmailNotification: flush_timeout_s must be a number of seconds >= 0, got "
                             f"{flush_timeout_s!r}")
        if isinstance(max_queued_emails, bool) or not isinstance(max_queued_emails, int) or max_queued_emails < 1:
            raise ValueError(f"EmailNotification: max_queued_emails must be a positive int, got {max_queued_emails!r}")
        self.sender_name = sender_name
        self.sender_email = sender_email
        self.recipient_email = recipient_email
        self.project_name = project_name
        self.experiment_name = experiment_name
        self.aws_region = aws_region
        self.flush_timeout_s = float(flush_timeout_s)
        self.max_queued_emails = max_queued_emails
        self.ses_sender: Any = None  # the SESSender, made at registration
        #: The BackgroundSender of the e-mails the hooks queued (made with the first one, per process).
        self.outbox: Optional[BackgroundSender] = None

    def __getstate__(self) -> dict:
        # Sent to the processes of distributed training: the boto3 client and the sending thread are not
        # picklable, and the sending process makes its own when it first needs them.
        state = self.__dict__.copy()
        state["ses_sender"] = None
        state["outbox"] = None
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
        epoch = self.train_loop_obj.epoch + 1  # counted from 1, as the epoch's summary line
        subject = f"End of epoch {epoch} report: {self.project_name}: {self.experiment_name}"
        self.queue_report(subject, lambda: f"<h2>End of epoch {epoch}</h2>\n{self.get_metric_list_html()}\n")

    def on_train_end(self) -> None:
        subject = f"End of training: {self.project_name}: {self.experiment_name}"
        self.queue_report(subject, lambda: (
            f"<h2>End of training at epoch {self.train_loop_obj.epoch + 1}</h2>\n{self.get_metric_list_html()}\n"
            f"<h3>Used hyper parameters:</h3>\n{self.get_hyperparams_html()}\n"))
        self.wait_for_queued_emails()

    def on_exception(self, exception: BaseException) -> None:
        self.wait_for_queued_emails()  # the epochs' reports queued before the exception

    def get_metric_list_html(self) -> str:
        """An HTML list of the newest value of every metric in the training history (metrics without values are
        left out)."""
        items = [f"<li><p>{html.escape(str(name))}: {_html_value(values[-1])}</p></li>"
                 for name, values in self.train_loop_obj.train_history.items() if len(values) > 0]
        return "<ul>\n" + "\n".join(items) + "\n</ul>"

    def get_hyperparams_html(self) -> str:
        """An HTML list of the TrainLoop's hyperparameters, or ``'Not given'`` when it has none."""
        hyperparams = redact_hyperparams(getattr(self.train_loop_obj, "hyperparams", None))  # no secret in an e-mail
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

    # --- sending ------------------------------------------------------------------------------------------------
    def queue_report(self, subject: str, body: Any) -> bool:
        """Queue an e-mail with the announced attachments, to be sent in the background; never raises.

        Args:
            subject: the subject (line breaks become spaces).
            body: the HTML body, or a function that makes it (called here; an error it raises is logged).

        Returns:
            True when the e-mail was queued; False when it could not be built (logged) or outside the main
            process, where nothing is sent.
        """
        if self.train_loop_obj is None or not self.train_loop_obj.is_main_process:
            return False
        try:
            if self.ses_sender is None:  # in a process of distributed training, the sender is made here
                self.ses_sender = self.make_sender()
            sender = self.ses_sender
            message = sender.build_message(subject, body() if callable(body) else body, self.get_attachment_paths())
        except OSError as error:  # an attachment removed or unreadable since it was checked
            logger.error("EmailNotification could not attach a file to the e-mail %r, which was not sent: %s",
                         subject, error)
            return False
        except Exception:  # noqa: BLE001 - a report must never stop training
            logger.exception("EmailNotification could not build the e-mail %r, which was not sent", subject)
            return False
        if self.outbox is None or self.outbox.pid != os.getpid():
            self.outbox = BackgroundSender("EmailNotification", f"AWS SES at {sender.endpoint}",
                                                sender.is_transient_error, max_queued=self.max_queued_emails)
        self.outbox.submit(f"the e-mail {message['Subject']!r} from {sender.sender_email} to "
                                f"{sender.recipient_email}", lambda: sender.send_message(message))
        return True

    def unsent(self) -> List[str]:
        """The e-mails queued and not sent yet, oldest first."""
        return self.outbox.unsent() if self.outbox is not None else []

    def wait_for_queued_emails(self, timeout_s: Optional[float] = None) -> bool:
        """Wait at most ``timeout_s`` seconds (``flush_timeout_s`` when None) for the queued e-mails; log those
        not sent by then. Returns True when none is left."""
        if self.outbox is None:
            return True
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        if self.outbox.wait(timeout_s):
            return True
        unsent = self.unsent()
        if unsent:
            logger.warning("EmailNotification: %s s after the end of training, not sent yet to %s: %s. Training is "
                           "not held up: they keep being tried in the background while this process runs",
                           f"{timeout_s:g}", self.outbox.service, "; ".join(unsent))
        return not unsent

    def discard_unsent(self) -> None:
        """Drop the e-mails not sent yet and stop trying: for a script that must not wait for SES."""
        if self.outbox is not None:
            self.outbox.stop()
            self.outbox = None

    def send_report(self, subject: str, body: str) -> Optional[str]:
        """Send an e-mail with the announced attachments now, on the calling thread (the hooks use
        :meth:`queue_report` instead); returns SES's message id, or None when it failed (the reason is logged).
        Outside the main process nothing is sent."""
        # device_idx_execution=0 already keeps this callback out of the other processes; checked again because
        # an e-mail sent from every process would be sent world-size times.
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
