"""MLflow tracking: hyperparameters, batch losses, epoch metrics and the final model of a run, from rank 0.

The ``mlflow`` package (``mlflow-skinny`` is enough) is imported when the callback is registered with a
TrainLoop (``pip install aitoolbox[mlflow]``), so ``import aitoolbox`` works without it. The callback talks to
the tracking store through ``MlflowClient`` with the run's id, so it neither needs nor changes MLflow's
"active run" of the fluent API (``mlflow.start_run``). Every call to the tracking store is made on a background
thread (:class:`~aitoolbox.torchtrain.callbacks.background.BackgroundSender`): an unreachable or slow server never
stops or slows training. The thread runs only while a ``fit`` does (and during :meth:`MLflowTracking.flush`).

A tracking URI may carry a user name and password (``https://user:password@host``): no message shows them, the
MLflow client's own error texts included.
"""
import logging
import math
import os
import re
import threading
import time
import urllib.parse
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

from aitoolbox.experiment.redaction import redact_hyperparams, redact_message
from aitoolbox.torchtrain.callbacks.background import BackgroundSender
from aitoolbox.torchtrain.callbacks.tracking_base import BatchRecord, TrackingCallback

logger = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation): entities per log_batch call, parameter value length.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
DEFAULT_EXPERIMENT = "Default"
#: How long the end of ``fit`` waits for what is still queued, and how many metrics wait at most.
DEFAULT_FLUSH_TIMEOUT_S = 10.0
DEFAULT_MAX_QUEUED_METRICS = 100_000
# How long the end of fit (or flush) waits for the sender's thread to end once told to: a call in progress on a
# stalled connection ends when the client gives up on it, which the thread does not wait for.
_SENDER_JOIN_S = 1.0


def load_mlflow_client_class() -> type:
    """Import ``MlflowClient`` (and with it mlflow) now, with an install hint when it is missing."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as error:
        raise ImportError("MLflowTracking needs the mlflow package, which is not installed: "
                          "pip install 'aitoolbox[mlflow]' (or pip install mlflow-skinny)") from error
    return MlflowClient


def mlflow_key(name: str) -> str:
    """``name`` as a valid MLflow metric / parameter key: characters MLflow refuses become ``_``."""
    key = re.sub(r"[^A-Za-z0-9_\-./ :]", "_", str(name)).lstrip("/")
    return re.sub(r"(^|/)\.\.?(?=/|$)", r"\1_", key) or "_"  # no '.' or '..' path parts


def is_transient_mlflow_error(error: BaseException) -> bool:
    """True for a failure that may pass (no connection, a timeout, a server error, rate limiting); False for a
    refusal that would be repeated (an HTTP 4xx answer: a bad value, an unknown run, no permission)."""
    from mlflow.exceptions import MlflowException
    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return status == 429 or not 400 <= status < 500
    return isinstance(error, OSError)  # requests' and urllib3's connection errors are OSErrors


def describe_tracking_uri(uri: str) -> str:
    """``uri`` without the user name and password it may carry (nor the values of secret-looking query
    parameters), for messages."""
    try:
        parts = urllib.parse.urlsplit(uri)
        if "@" in parts.netloc:
            uri = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    except ValueError:  # not parsable as a URL: the text rules still hide what looks secret
        pass
    return redact_message(uri)


def flatten_params(params: dict, prefix: str = "") -> Dict[str, str]:
    """Nested dicts as ``{'outer.inner': str(value)}``; MLflow parameters are flat strings."""
    flat = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, f"{name}."))
        else:
            flat[mlflow_key(name)] = str(value)
    return flat


class MLflowTracking(TrackingCallback):
    """Log the training to an MLflow tracking store, from the main process only.

    The MLflow experiment is the project (``project_name``), the run is named ``<experiment_name>_<timestamp>``
    (the experiment folder's name). Logged:

    - the hyperparameters as the run's parameters (nested dicts flattened to ``outer.inner``);
    - every ``batch_log_frequency`` batches, at step = the batch index counted over the whole training:
      ``train_loss/last_batch_loss``, ``train_loss/accumulated_batch_loss`` (the epoch's mean so far) and
      ``learning_rate/optimizer_<i>_group_<j>``; with a MultiLoss one pair per loss;
    - at each epoch end, the history metrics that got a new value, by their history names (``loss``,
      ``val_loss``, ...) at step = the epoch; ``train_end_test_loss`` at the end of training;
    - the final model's path (when ``ModelTrainEndSave`` or an EndSave preset saved one) as the tag
      ``final_model_path``, and with ``log_model_artifact`` the file itself as an artifact under ``model/``.

    Nothing is sent from the training thread: the hooks queue the values and a background thread sends them
    (batch metrics up to 1,000 per call, MLflow's limit), in order. When the store cannot be reached, the values
    are kept (at most ``max_queued_metrics`` metrics; beyond that the oldest are dropped, with a warning) and
    sent when it answers again; the outage is logged once and training goes on. A refusal by the store (an
    unknown ``run_id``, a bad value) is logged as an error. At the end of each ``fit`` the callback waits at most
    ``flush_timeout_s`` seconds for the queue to empty, then logs what was not sent yet and stops its thread
    (after the call in progress): what was not sent is kept, and sent by the next ``fit`` of the callback or by
    :meth:`flush`. So no thread of the callback runs between fits, and a script that fits many times while the
    store is down (with a new callback each time, or the same) does not pile up threads.

    The run ends at the end of each ``fit`` (status FINISHED; FAILED or KILLED when an exception or Ctrl-C stopped
    it); a later ``fit`` of the same TrainLoop continues the same run. To continue a run from another process
    (after resuming from a checkpoint), pass its ``run_id``.

    Args:
        tracking_uri: where the runs are stored, e.g. ``'sqlite:///mlflow.db'``, ``'http://127.0.0.1:5000'``
            or ``'file:///path/mlruns'`` (MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``);
            None takes ``MLFLOW_TRACKING_URI``, else MLflow's default.
        metric_names: the training-history metrics to log; None logs all.
        batch_log_frequency: log the batch loss every this many batches, ``'step'`` at every optimizer step,
            None only at epoch ends.
        hyperparams: the run's parameters; None takes the experiment-tracking TrainLoop's (none with a plain
            TrainLoop).
        tags: ``{name: value}`` tags of the run (the experiment folder's path is added as
            ``aitoolbox.experiment_folder`` when there is one); secrets in them are redacted as in the
            hyperparameters.
        run_name: the run's name instead of ``<experiment_name>_<timestamp>``.
        run_id: continue this existing run instead of creating one.
        artifact_location: where a new MLflow experiment keeps its artifacts (used only when the callback
            creates the experiment); None: MLflow's default.
        log_model_artifact: also upload the final model file as an artifact.
        log_learning_rates: log the learning rates with the batch losses.
        project_name: the MLflow experiment; None takes the loop's, else ``'Default'``.
        experiment_name: the run name's prefix; None takes the loop's.
        local_model_result_folder_path: root folder of the experiment folders, or None to take the loop's.
        flush_timeout_s: how long the end of ``fit`` (and :meth:`flush`) waits for the queued values to be sent.
        max_queued_metrics: the most metric values kept while the store cannot be reached.

    Raises:
        TypeError / ValueError: a bad argument.
        ImportError: at registration, when mlflow is not installed.
    """

    def __init__(self, tracking_uri: Optional[str] = None, metric_names: Optional[Sequence[str]] = None,
                 batch_log_frequency: Union[int, str, None] = 1, hyperparams: Optional[dict] = None,
                 tags: Optional[Dict[str, Any]] = None, run_name: Optional[str] = None, run_id: Optional[str] = None,
                 artifact_location: Optional[str] = None, log_model_artifact: bool = False,
                 log_learning_rates: bool = True, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None,
                 flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
                 max_queued_metrics: int = DEFAULT_MAX_QUEUED_METRICS):
        super().__init__("MLflow experiment tracking", metric_names, batch_log_frequency, hyperparams, project_name,
                         experiment_name, local_model_result_folder_path, log_learning_rates)
        for name, value in (("tracking_uri", tracking_uri), ("run_name", run_name), ("run_id", run_id),
                            ("artifact_location", artifact_location)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be None or a non-empty string, got {value!r}")
        if tags is not None and not isinstance(tags, dict):
            raise TypeError(f"tags must be None or a dict of tag names and values, got {tags!r}")
        if not isinstance(log_model_artifact, bool):
            raise TypeError(f"log_model_artifact must be True or False, got {log_model_artifact!r}")
        if isinstance(flush_timeout_s, bool) or not isinstance(flush_timeout_s, (int, float)) or \
                not flush_timeout_s >= 0:
            raise ValueError(f"flush_timeout_s must be a number of seconds >= 0, got {flush_timeout_s!r}")
        if isinstance(max_queued_metrics, bool) or not isinstance(max_queued_metrics, int) or max_queued_metrics < 1:
            raise ValueError(f"max_queued_metrics must be a positive int, got {max_queued_metrics!r}")
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self.run_name = run_name
        self.run_id = run_id
        self.artifact_location = artifact_location
        self.log_model_artifact = log_model_artifact
        self.flush_timeout_s = float(flush_timeout_s)
        self.max_queued_metrics = max_queued_metrics
        self.client: Any = None  # the MlflowClient, in the main process once training started
        self._client_class: Optional[type] = None
        # The train end's metrics queued so far in this fit's end, by name: (value, sequence number). A Ctrl-C
        # between two of them leaves the end to the next fit, whose write skips those already queued (review 49l F3:
        # on_exception had sent them, and they were sent twice).
        self._train_end_queued: Dict[str, Tuple[float, int]] = {}
        self._reset_sending_state()

    def _reset_sending_state(self) -> None:
        self._sender: Optional[BackgroundSender] = None
        # (sequence number, key, value, timestamp ms, step) of the metrics not sent yet, oldest first.
        self._metrics: Deque[Tuple[int, str, float, int, int]] = deque()
        self._metrics_lock = threading.Lock()
        self._next_sequence = 0
        self._unflushed = 0  # metrics queued since the last request to send them
        self.dropped_metrics = 0
        self._run_open = False  # on the sender's thread: the run was created or continued
        self._finished = False  # on the sender's thread: FINISHED reached the store since the run was (re)opened

    def __getstate__(self) -> dict:
        # Sent to the processes of fit_distributed before training: each builds its own client if it needs one.
        state = self.__dict__.copy()
        for name in ("client", "_client_class", "_sender", "_metrics", "_metrics_lock"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.client = None
        self._client_class = None
        self._reset_sending_state()

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        self._client_class = load_mlflow_client_class()  # a missing package is reported now

    def on_train_begin(self) -> None:
        super().on_train_begin()
        self._train_end_queued = {}  # a new train end follows (a pending one runs before on_train_begin)

    # --- the background sender ----------------------------------------------------------------------------------
    def sender(self) -> BackgroundSender:
        """The :class:`BackgroundSender` that makes this callback's calls (made at the first need, per process)."""
        if self._sender is None or self._sender.pid != os.getpid():
            uri = self.client.tracking_uri if self.client is not None else self.tracking_uri or "the default URI"
            uri = describe_tracking_uri(uri)
            self._sender = BackgroundSender(type(self).__name__, f"the MLflow tracking store at {uri}",
                                            is_transient_mlflow_error)
        return self._sender

    def unsent(self) -> List[str]:
        """What is not sent to the tracking store yet, e.g. ``['1,234 metrics', "the run's end (FINISHED)"]``."""
        if self._sender is None:
            return []
        with self._metrics_lock:
            metrics = len(self._metrics)
        calls = [description for description in self._sender.unsent() if description != _METRICS_CALL]
        return ([f"{metrics:,} metrics"] if metrics else []) + calls

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Send what is queued (also what an earlier ``fit`` could not send), waiting at most ``timeout_s``
        seconds (``flush_timeout_s`` when None); then the sender's thread ends, keeping what is still unsent.

        Returns True when everything queued was sent (or refused by the store, which is logged).
        """
        if self._sender is None:
            return True
        self._request_metrics_sending()
        done = self._sender.wait(self.flush_timeout_s if timeout_s is None else timeout_s)
        self._stop_sending_thread()
        return done

    def _stop_sending_thread(self) -> None:
        """End the sender's thread after its call in progress; the queue is kept for the next fit or flush."""
        self._sender.pause()
        if not self._sender.join(_SENDER_JOIN_S):
            logger.debug("MLflowTracking: a call to %s is still in progress; the sender's thread ends when it "
                         "returns", self._sender.service)

    def discard_unsent(self) -> None:
        """Drop everything not sent yet and stop trying: for a script that must not wait for an absent server."""
        if self._sender is not None:
            self._sender.stop()
            self._sender = None
        with self._metrics_lock:
            self._metrics.clear()

    # --- the run --------------------------------------------------------------------------------------------
    def experiment_and_run_names(self) -> tuple:
        """The MLflow experiment's name and the new run's name."""
        if self.has_experiment_folder:
            folder = self.experiment_folder
            return folder.project_name, self.run_name or f"{folder.experiment_name}_{folder.timestamp}"
        tl = self.train_loop_obj
        project = self.project_name or getattr(tl, "project_name", None) or DEFAULT_EXPERIMENT
        experiment = self.experiment_name or getattr(tl, "experiment_name", None)
        return project, self.run_name or (f"{experiment}_{tl.experiment_timestamp}" if experiment else None)

    def start_run(self) -> None:
        if self._client_class is None:
            self._client_class = load_mlflow_client_class()
        if self.client is None:
            # Checks the URI and opens a local store; an HTTP client does not connect before its first call.
            self.client = self._make_client()
        experiment_name, run_name = self.experiment_and_run_names()
        tags = {mlflow_key(key): str(value) for key, value in redact_hyperparams(self.tags).items()}
        if self.has_experiment_folder:
            tags.setdefault("aitoolbox.experiment_folder", self.experiment_folder.path)
        self.sender().submit("the start of the run", lambda: self._open_run(experiment_name, run_name, tags))

    def _make_client(self) -> Any:
        try:
            return self._client_class(tracking_uri=self.tracking_uri)
        except Exception as error:
            # MLflow's message quotes the URI, password included: raise it without (and without the original).
            shown = describe_tracking_uri(self.tracking_uri) if self.tracking_uri else "the default tracking URI"
            message = f"MLflowTracking cannot use the tracking URI {shown}: {redact_message(str(error))}"
            try:
                replacement = type(error)(message)
            except Exception:  # an exception class that takes other arguments
                replacement = ValueError(message)
        raise replacement from None

    def _open_run(self, experiment_name: str, run_name: Optional[str], tags: Dict[str, str]) -> None:
        # On the sender's thread, before the calls that need the run (and after the previous fit's end, which a
        # slow store may still be sending when this fit starts: review 49y Y1).
        self._run_open = self._finished = False
        if self.run_id is not None:
            self.client.get_run(self.run_id)  # an unknown id is refused here, with MLflow's message
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self._experiment_id(experiment_name), run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
        self._run_open = True

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifact_location)
        except Exception:  # another process created it meanwhile: use theirs
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def end_run(self, exception: Optional[BaseException]) -> None:
        if exception is None:
            status = "FINISHED"
        else:
            status = "KILLED" if isinstance(exception, KeyboardInterrupt) else "FAILED"
        self._request_metrics_sending()
        self.sender().submit(f"the run's end ({status})", lambda: self._terminate(status))
        if not self._sender.wait(self.flush_timeout_s):
            dropped = f" ({self.dropped_metrics:,} older metric values were dropped)" if self.dropped_metrics else ""
            logger.warning("MLflowTracking: %s s after the end of training, not sent yet to %s: %s%s. Training is "
                           "not held up: these are kept and sent by the next fit with this callback, or by its "
                           "flush()", f"{self.flush_timeout_s:g}", self._sender.service, ", ".join(self.unsent()),
                           dropped)
        self._stop_sending_thread()

    def _terminate(self, status: str) -> None:
        # The status says what happened to the training: once it finished and that was sent, a failure after it
        # (closing the connection) is raised by fit but does not turn the run FAILED (review 49l F4). Decided here,
        # on the sender's thread, in order with the run's (re)opening and the last end sent.
        if self._run_open and not (self._finished and status != "FINISHED"):
            self.client.set_terminated(self.run_id, status=status)
            self._finished = status == "FINISHED"

    # --- what is logged ---------------------------------------------------------------------------------------
    def _add_metric(self, key: str, value: float, step: int) -> None:
        entry = (self._next_sequence, mlflow_key(key), float(value), int(time.time() * 1000), int(step))
        with self._metrics_lock:
            if len(self._metrics) >= self.max_queued_metrics:
                self._metrics.popleft()
                self.dropped_metrics += 1
                dropped = self.dropped_metrics
            else:
                dropped = 0
            self._metrics.append(entry)
            self._next_sequence += 1  # right after: a sequence number below it was queued (write_epoch_metrics)
        if dropped == 1:  # the end of fit says how many in all
            logger.warning("MLflowTracking: %d metric values are waiting to be sent, the most it keeps "
                           "(max_queued_metrics); the oldest are dropped from now on", self.max_queued_metrics)
        self._unflushed += 1
        if self._unflushed >= MAX_METRICS_PER_BATCH:
            self._request_metrics_sending()

    def _request_metrics_sending(self) -> None:
        self._unflushed = 0
        if self._sender is not None or self.client is not None:
            self.sender().submit(_METRICS_CALL, self._send_metrics, key=_METRICS_CALL)

    def _send_metrics(self) -> None:
        # On the sender's thread: the metrics queued when the call starts, 1,000 per request, each removed once
        # the store has them (a failed request keeps them for the next try).
        from mlflow.entities import Metric
        with self._metrics_lock:
            last = self._metrics[-1][0] if self._metrics else -1
        while True:
            with self._metrics_lock:
                chunk = [entry for _, entry in zip(range(MAX_METRICS_PER_BATCH), self._metrics) if entry[0] <= last]
            if not chunk:
                return
            if self._run_open:
                self.client.log_batch(self.run_id, metrics=[Metric(key, value, timestamp, step)
                                                            for _, key, value, timestamp, step in chunk],
                                      synchronous=True)
            # Without a run (its start was refused, which is logged) the values have nowhere to go.
            with self._metrics_lock:  # the oldest may have been dropped meanwhile: remove by sequence number
                while self._metrics and self._metrics[0][0] <= chunk[-1][0]:
                    self._metrics.popleft()

    def write_hyperparams(self, hyperparams: dict) -> None:
        params = flatten_params(redact_hyperparams(hyperparams or {}))  # secrets never leave the machine
        for key, value in params.items():
            if len(value) > MAX_PARAM_VALUE_LENGTH:
                logger.warning("MLflowTracking: hyperparameter %r is %d characters long; MLflow keeps %d, the rest is "
                               "cut", key, len(value), MAX_PARAM_VALUE_LENGTH)
                params[key] = value[:MAX_PARAM_VALUE_LENGTH]
        self.sender().submit("the run's parameters", lambda: self._send_params(params))

    def _send_params(self, params: Dict[str, str]) -> None:
        from mlflow.entities import Param
        if not self._run_open:
            return
        # MLflow parameters cannot change: a continued run logs only the new ones.
        existing = self.client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in params.items() if key in existing and existing[key] != value)
        if changed:
            logger.warning("MLflowTracking: run %s already has different values for parameters %s; MLflow parameters "
                           "cannot change, the run keeps its values", self.run_id, changed)
        new = [Param(key, value) for key, value in params.items() if key not in existing]
        for start in range(0, len(new), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + MAX_PARAMS_PER_BATCH], synchronous=True)

    def write_batch(self, record: BatchRecord) -> None:
        for name, value in record.losses.items():
            self._add_metric(f"train_loss/last_batch_{name}", value, record.step)
            self._add_metric(f"train_loss/accumulated_batch_{name}", record.mean_losses[name], record.step)
        for (optimizer_idx, group_idx), rate in record.learning_rates.items():
            self._add_metric(f"learning_rate/optimizer_{optimizer_idx}_group_{group_idx}", rate, record.step)

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        for name, value in metrics.items():
            if train_end:
                queued = self._train_end_queued.get(name)
                if queued is not None and _same_value(queued[0], value) and queued[1] < self._next_sequence:
                    continue  # queued before a Ctrl-C stopped this write: the next fit writes the end again
                self._train_end_queued[name] = (value, self._next_sequence)
            self._add_metric(name, value, epoch)
        self._request_metrics_sending()

    def write_final_model_path(self, path: str) -> None:
        self.sender().submit("the tag final_model_path", lambda: self._run_open and self.client.set_tag(
            self.run_id, "final_model_path", path, synchronous=True))
        if self.log_model_artifact:
            self.sender().submit(f"the model artifact {path}", lambda: self._run_open and self.client.log_artifact(
                self.run_id, path, artifact_path="model"))


#: The description of the call that sends the queued metrics (one waits at a time).
_METRICS_CALL = "the queued metrics"


def _same_value(first: float, second: float) -> bool:
    """Equal metric values, a NaN equal to a NaN (a train-end metric may be one: review 49y Y5)."""
    return first == second or (math.isnan(first) and math.isnan(second))
