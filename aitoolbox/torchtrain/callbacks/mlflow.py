"""MLflow tracking: hyperparameters, batch losses, epoch metrics and the final model of a run, from rank 0.

The ``mlflow`` package (``mlflow-skinny`` is enough) is imported when the callback is registered with a
TrainLoop (``pip install aitoolbox[mlflow]``), so ``import aitoolbox`` works without it. The callback talks to
the tracking store through ``MlflowClient`` with the run's id, so it neither needs nor changes MLflow's
"active run" of the fluent API (``mlflow.start_run``).
"""
import logging
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.torchtrain.callbacks.tracking_base import BatchRecord, TrackingCallback

logger = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation): entities per log_batch call, parameter value length.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
DEFAULT_EXPERIMENT = "Default"


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

    Batch metrics are sent in batches of up to 1,000 (MLflow's limit per call), at each epoch end and when
    training stops. The run ends at the end of each ``fit`` (status FINISHED; FAILED or KILLED when an
    exception or Ctrl-C stopped it); a later ``fit`` of the same TrainLoop continues the same run. To continue a
    run from another process (after resuming from a checkpoint), pass its ``run_id``.

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
            ``aitoolbox.experiment_folder`` when there is one).
        run_name: the run's name instead of ``<experiment_name>_<timestamp>``.
        run_id: continue this existing run instead of creating one.
        artifact_location: where a new MLflow experiment keeps its artifacts (used only when the callback
            creates the experiment); None: MLflow's default.
        log_model_artifact: also upload the final model file as an artifact.
        log_learning_rates: log the learning rates with the batch losses.
        project_name: the MLflow experiment; None takes the loop's, else ``'Default'``.
        experiment_name: the run name's prefix; None takes the loop's.
        local_model_result_folder_path: root folder of the experiment folders, or None to take the loop's.

    Raises:
        TypeError / ValueError: a bad argument.
        ImportError: at registration, when mlflow is not installed.
    """

    def __init__(self, tracking_uri: Optional[str] = None, metric_names: Optional[Sequence[str]] = None,
                 batch_log_frequency: Union[int, str, None] = 1, hyperparams: Optional[dict] = None,
                 tags: Optional[Dict[str, Any]] = None, run_name: Optional[str] = None, run_id: Optional[str] = None,
                 artifact_location: Optional[str] = None, log_model_artifact: bool = False,
                 log_learning_rates: bool = True, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None):
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
        self.tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self.run_name = run_name
        self.run_id = run_id
        self.artifact_location = artifact_location
        self.log_model_artifact = log_model_artifact
        self.client: Any = None  # the MlflowClient, in the main process once training started
        self._client_class: Optional[type] = None
        self._pending_metrics: List[Any] = []

    def __getstate__(self) -> dict:
        # Sent to the processes of fit_distributed before training: each builds its own client if it needs one.
        state = self.__dict__.copy()
        state["client"] = None
        state["_client_class"] = None
        state["_pending_metrics"] = []
        return state

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        self._client_class = load_mlflow_client_class()  # a missing package is reported now

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
            self.client = self._client_class(tracking_uri=self.tracking_uri)
        if self.run_id is not None:
            self.client.get_run(self.run_id)  # an unknown id fails now, with MLflow's message
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment_name, run_name = self.experiment_and_run_names()
        tags = {mlflow_key(key): str(value) for key, value in self.tags.items()}
        if self.has_experiment_folder:
            tags.setdefault("aitoolbox.experiment_folder", self.experiment_folder.path)
        run = self.client.create_run(self._experiment_id(experiment_name), run_name=run_name, tags=tags)
        self.run_id = run.info.run_id

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
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status=status)

    def flush(self) -> None:
        """Send the buffered metrics to the tracking store."""
        pending, self._pending_metrics = self._pending_metrics, []
        for start in range(0, len(pending), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start:start + MAX_METRICS_PER_BATCH])

    # --- what is logged ---------------------------------------------------------------------------------------
    def _add_metric(self, key: str, value: float, step: int) -> None:
        from mlflow.entities import Metric
        self._pending_metrics.append(Metric(mlflow_key(key), float(value), int(time.time() * 1000), int(step)))
        if len(self._pending_metrics) >= MAX_METRICS_PER_BATCH:
            self.flush()

    def write_hyperparams(self, hyperparams: dict) -> None:
        from mlflow.entities import Param
        params = flatten_params(redact_hyperparams(hyperparams))  # secrets never leave the machine
        for key, value in params.items():
            if len(value) > MAX_PARAM_VALUE_LENGTH:
                logger.warning("MLflowTracking: hyperparameter %r is %d characters long; MLflow keeps %d, the rest is "
                               "cut", key, len(value), MAX_PARAM_VALUE_LENGTH)
                params[key] = value[:MAX_PARAM_VALUE_LENGTH]
        # MLflow parameters cannot change: a continued run logs only the new ones.
        existing = self.client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in params.items() if key in existing and existing[key] != value)
        if changed:
            logger.warning("MLflowTracking: run %s already has different values for parameters %s; MLflow parameters "
                           "cannot change, the run keeps its values", self.run_id, changed)
        new = [Param(key, value) for key, value in params.items() if key not in existing]
        for start in range(0, len(new), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + MAX_PARAMS_PER_BATCH])

    def write_batch(self, record: BatchRecord) -> None:
        for name, value in record.losses.items():
            self._add_metric(f"train_loss/last_batch_{name}", value, record.step)
            self._add_metric(f"train_loss/accumulated_batch_{name}", record.mean_losses[name], record.step)
        for (optimizer_idx, group_idx), rate in record.learning_rates.items():
            self._add_metric(f"learning_rate/optimizer_{optimizer_idx}_group_{group_idx}", rate, record.step)

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        for name, value in metrics.items():
            self._add_metric(name, value, epoch)
        self.flush()

    def write_final_model_path(self, path: str) -> None:
        self.client.set_tag(self.run_id, "final_model_path", path)
        if self.log_model_artifact:
            self.client.log_artifact(self.run_id, path, artifact_path="model")
