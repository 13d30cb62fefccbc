"""Weights & Biases tracking: aitoolbox 1.x's ``WandBTracking`` callback and its ``AlertConfig``.

The ``wandb`` package is imported when the callback is registered with a TrainLoop (``pip install
aitoolbox[wandb]``), so ``import aitoolbox`` works without it. Offline runs (``WANDB_MODE=offline``) are
written to the local folder and can be uploaded later with ``wandb sync``.
"""
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from aitoolbox.experiment.redaction import redact_hyperparams, redact_value
from aitoolbox.experiment.secret_names import is_credentials_file
from aitoolbox.torchtrain.callbacks.tracking_base import BatchRecord, TrackingCallback, check_log_dir

logger = logging.getLogger(__name__)

ALERT_OBJECTIVES = ("maximize", "minimize")


def load_wandb() -> Any:
    """Import ``wandb`` now, with an install hint when it is missing."""
    try:
        import wandb
    except ImportError as error:
        raise ImportError("WandBTracking needs the wandb package, which is not installed: "
                          "pip install 'aitoolbox[wandb]' (or pip install wandb)") from error
    return wandb


@dataclass
class AlertConfig:
    """An alert on a training-history metric, for :class:`WandBTracking`.

    After each epoch the metric's newest value is compared with ``threshold_value``: with ``'maximize'`` a value
    below the threshold sends the alert, with ``'minimize'`` a value above it.

    Args:
        metric_name: the metric, as named in the training history (``'val_loss'``) or as logged
            (``'loss_at_epoch_end/val_loss'``).
        threshold_value: the value it is compared with.
        objective: ``'maximize'`` or ``'minimize'``.
        wandb_alert_level: a ``wandb.AlertLevel`` (or its name, e.g. ``'WARN'``), or None for wandb's default.
    """

    metric_name: str
    threshold_value: float
    objective: str = "maximize"
    wandb_alert_level: Any = None


def epoch_metric_key(metric_name: str) -> str:
    """The W&B key of a history metric (aitoolbox 1.x's): losses and other metrics in separate sections."""
    return f"loss_at_epoch_end/{metric_name}" if "loss" in metric_name else f"metrics/{metric_name}"


def is_python_source(path: str) -> bool:
    """The default ``include_fn`` of :class:`WandBTracking`'s code upload: Python source files (``*.py``)."""
    return path.endswith(".py")


def _symbolic_links_below(folder: str) -> List[str]:
    """The symbolic links (to files or folders) below ``folder``, as paths inside it; links are not followed."""
    links = []
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                links.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(links)


def _artifact_name(path: str) -> str:
    # W&B artifact names may hold letters, digits, '-', '_' and '.'.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.normpath(path))) or "source"


class WandBTracking(TrackingCallback):
    """Log the training to Weights & Biases (https://wandb.ai), from the main process only.

    Logged, at step = the batch index counted over the whole training (``total_iteration_idx``):

    - every ``batch_log_frequency`` batches: ``train_loss/last_batch_loss`` and
      ``train_loss/accumulated_batch_loss`` (the epoch's mean so far), ``learning_rate/optimizer_<i>_group_<j>``;
      with a MultiLoss one pair per loss (``train_loss/last_batch_<name>``);
    - at each epoch end: ``epoch`` and the history metrics that got a new value, as
      ``loss_at_epoch_end/<name>`` (names containing "loss") or ``metrics/<name>``; then the ``alerts`` are
      checked;
    - the hyperparameters as the run's config, with secrets redacted (see :mod:`aitoolbox.experiment.redaction`);
      the final model's path (when ``ModelTrainEndSave`` or an EndSave preset saved one) as the summary value
      ``final_model_path``;
    - the source code in ``source_dirs`` as code artifacts: the files ``include_fn`` accepts (``*.py`` by
      default), never files that hold credentials by their name or folder (``.env``, ``credentials.json``,
      ``service-account.json``, ``*.pem``, ``.ssh/``..., see
      :func:`~aitoolbox.experiment.secret_names.is_credentials_file`) and never symbolic links (whose target may
      be any file of the machine; one warning names them), whatever ``include_fn`` says.

    The run is started when training starts (aitoolbox 1.x started it at registration), in the main process
    only, so neither ``fit_distributed``'s other ranks nor its launching process open one. It is finished
    at the end of each ``fit``, and at an exception with exit code 1, so its files are complete; a later
    ``fit`` of the same TrainLoop continues the same run (same id, ``resume='allow'``). A run you started
    yourself (``wandb_pre_initialized=True``) is used and left open.

    Note:
        Online logging needs a W&B account and ``wandb login`` on the machine. Without one, set
        ``WANDB_MODE=offline`` (or pass ``mode='offline'``): the run is written locally and can be uploaded
        later with ``wandb sync``.

    Args:
        metric_names: the training-history metrics to log; None logs all.
        batch_log_frequency: log the batch loss every this many batches, ``'step'`` at every optimizer step;
            None (the default, as in 1.x) logs only at epoch ends.
        hyperparams: the run's config; None takes the experiment-tracking TrainLoop's (``TrainLoopCheckpoint``
            ...), an empty config with a plain TrainLoop.
        tags: tags of the run.
        alerts: :class:`AlertConfig` objects checked after every epoch.
        wandb_pre_initialized: log into the run you started with ``wandb.init()`` before training.
        source_dirs: source folders (or files) stored with the run as code artifacts. Left empty with
            ``is_project=True``, the experiment-tracking TrainLoop's ``source_dirs`` and the script in its
            hyperparameters' ``experiment_file_path`` are stored, where there are any. A file named here is
            stored only when ``include_fn`` accepts it and it is not a symbolic link.
        include_fn: which files of ``source_dirs`` are stored: called with each file's absolute path, True
            stores it; None stores Python files (``*.py``). Files that hold credentials by their name or folder
            (``.env``, ``credentials.json``, ``*.pem``, ``.aws/``...) and symbolic links are never stored. For example ``lambda path:
            path.endswith((".py", ".yaml"))`` adds configuration files; with ``fit_distributed`` starting fresh
            processes (spawn) it must be a module-level function, which can be sent to them.
        log_dir: the folder wandb writes its local files in (it adds a ``wandb/`` sub-folder). With
            ``is_project=True``, None is the experiment's run folder and a relative path lies inside it; an
            absolute path is used as it is. With ``is_project=False``, None leaves wandb's default (``WANDB_DIR``
            or the working directory).
        is_project: keep the wandb files in the experiment folder (see ``log_dir``); it needs the experiment
            details (the callback's folder arguments or an experiment-tracking TrainLoop).
        project_name: the W&B project; None takes the loop's (wandb's default project without one).
        experiment_name: the W&B run name; None takes the loop's.
        local_model_result_folder_path: root folder of the experiment folders, or None to take the loop's.
        **kwargs: further ``wandb.init()`` arguments (``entity``, ``mode``, ``group``, ``settings``...); they
            override the callback's own choices. A ``config`` given here is redacted like the hyperparameters.

    Raises:
        TypeError / ValueError: a bad argument, e.g. an alert that is not an :class:`AlertConfig` or whose
            objective is neither ``'maximize'`` nor ``'minimize'``, or a ``source_dirs`` path that does not exist.
        ImportError: at registration, when wandb is not installed.
        MissingExperimentDetailsError: at registration, ``is_project=True`` without experiment details.
    """

    def __init__(self, metric_names: Optional[Sequence[str]] = None, batch_log_frequency: Union[int, str, None] = None,
                 hyperparams: Optional[dict] = None, tags: Optional[Sequence[str]] = None,
                 alerts: Optional[List[AlertConfig]] = None, wandb_pre_initialized: bool = False,
                 source_dirs: Sequence[str] = (), log_dir: Optional[str] = None, is_project: bool = True,
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None,
                 include_fn: Optional[Callable[[str], bool]] = None, **kwargs):
        super().__init__("WeightsAndBiases Experiment Tracking", metric_names, batch_log_frequency, hyperparams,
                         project_name, experiment_name, local_model_result_folder_path)
        if tags is not None and (isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags)):
            raise TypeError(f"tags must be None or a list of strings, got {tags!r}")
        self.tags = list(tags) if tags is not None else None
        self.alerts = list(alerts) if alerts is not None else None
        self.check_alerts()
        if not isinstance(wandb_pre_initialized, bool):
            raise TypeError(f"wandb_pre_initialized must be True or False, got {wandb_pre_initialized!r}")
        self.wandb_pre_initialized = wandb_pre_initialized
        if isinstance(source_dirs, (str, os.PathLike)) or not isinstance(source_dirs, (list, tuple)):
            raise TypeError(f"source_dirs must be a list or tuple of paths, got {source_dirs!r}")
        missing = [path for path in source_dirs if not os.path.exists(os.path.expanduser(os.fspath(path)))]
        if missing:
            raise ValueError(f"source_dirs holds paths that do not exist: {missing}")
        self.source_dirs = [os.path.abspath(os.path.expanduser(os.fspath(path))) for path in source_dirs]
        if include_fn is not None and not callable(include_fn):
            raise TypeError(f"include_fn must be a function of a file path returning True for the files to store "
                            f"(or None for *.py files), got {include_fn!r}")
        self.include_fn = include_fn
        self.log_dir = check_log_dir(log_dir, is_project)
        self.is_project = is_project
        self.wandb_params_kwargs = kwargs  # aitoolbox 1.x's name
        self.run: Any = None  # the wandb Run while training
        self.run_id: Optional[str] = None  # the run a later fit continues
        self.wandb_dir: Optional[str] = None  # resolved at registration
        self._code_logged = False

    def __getstate__(self) -> dict:
        # Sent to the processes of fit_distributed before training: a wandb Run cannot travel (nor needs to).
        state = self.__dict__.copy()
        state["run"] = None
        return state

    def check_alerts(self) -> None:
        """Check that every alert is an :class:`AlertConfig` with a valid objective."""
        for alert in self.alerts or []:
            if not isinstance(alert, AlertConfig):
                raise TypeError(f"alerts must be AlertConfig objects, got {type(alert).__name__}: {alert!r}")
            if alert.objective not in ALERT_OBJECTIVES:
                raise ValueError(f"an alert's objective must be 'maximize' or 'minimize'; {alert} has "
                                 f"{alert.objective!r}")

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        load_wandb()  # a missing package is reported now, not after the first epoch
        self.try_infer_additional_logging_details()
        if not self.wandb_pre_initialized:
            self.wandb_dir = self.resolve_log_dir(self.log_dir, self.is_project, None)

    def try_infer_additional_logging_details(self) -> None:
        """Take the source folders from the experiment-tracking TrainLoop when none were given (is_project)."""
        if self.source_dirs or not self.is_project:
            return
        script = (self.hyperparams or {}).get("experiment_file_path")
        candidates = ([script] if script else []) + list(getattr(self.train_loop_obj, "source_dirs", None) or [])
        self.source_dirs = [os.path.abspath(os.path.expanduser(path)) for path in candidates
                            if os.path.exists(os.path.expanduser(path))]

    # --- the run --------------------------------------------------------------------------------------------
    def _run_names(self) -> Dict[str, Optional[str]]:
        if self.has_experiment_folder:
            return {"project": self.experiment_folder.project_name, "name": self.experiment_folder.experiment_name}
        return {"project": self.project_name or getattr(self.train_loop_obj, "project_name", None),
                "name": self.experiment_name or getattr(self.train_loop_obj, "experiment_name", None)}

    def start_run(self) -> None:
        wandb = load_wandb()
        if self.wandb_pre_initialized:
            if wandb.run is None:
                raise RuntimeError("WandBTracking(wandb_pre_initialized=True) found no active wandb run: call "
                                   "wandb.init() before training, or leave wandb_pre_initialized False")
            self.run = wandb.run
            if self.tags:
                self.run.tags = tuple(self.run.tags or ()) + tuple(tag for tag in self.tags
                                                                   if tag not in (self.run.tags or ()))
        else:
            init_args = dict(self._run_names(), tags=self.tags, save_code=True,
                             dir=self.ensure_log_dir(self.wandb_dir) if self.wandb_dir else None)
            if self.run_id is not None:  # a later fit of the same loop: the same run
                init_args.update(id=self.run_id, resume="allow")
            init_args.update(self.wandb_params_kwargs)
            if init_args.get("config") is not None:  # a config given through the callback is redacted too
                init_args["config"] = redact_value(init_args["config"])
            self.run = wandb.init(**init_args)
            self.run_id = self.run.id
        if not self._code_logged:
            self._code_logged = True
            for path in self.source_dirs:
                self._log_code(path)

    def uploads_as_code(self, path: str, root: Optional[str] = None) -> bool:
        """True when the file ``path`` goes into the code artifacts: ``include_fn`` (``*.py`` by default)
        accepts it, it is not a symbolic link, and neither its name nor its folders below ``root`` (the folder
        uploaded; wandb passes it) say it holds credentials."""
        path = os.path.abspath(path)
        if os.path.islink(path) or is_credentials_file(path, root):
            return False
        return bool((self.include_fn or is_python_source)(path))

    def _log_code(self, path: str) -> None:
        if os.path.islink(path):
            logger.warning("WandBTracking: not storing %s as code: it is a symbolic link (a link's target may be "
                           "any file of this machine); name the file it points to instead", path)
        elif os.path.isdir(path):
            links = _symbolic_links_below(path)
            if links:
                logger.warning("WandBTracking: not storing %d symbolic link(s) in %s as code (a link's target may be "
                               "any file of this machine): %s", len(links), path, ", ".join(links))
            self.run.log_code(path, name=_artifact_name(path), include_fn=self.uploads_as_code)
        elif self.uploads_as_code(path):  # a single file: its folder, filtered to the file
            self.run.log_code(os.path.dirname(path), name=_artifact_name(path),
                              include_fn=lambda candidate: os.path.abspath(candidate) == path)
        else:
            logger.warning("WandBTracking: not storing %s as code: %s", path,
                           "its name says it holds credentials" if is_credentials_file(path)
                           else "include_fn refuses it")

    def end_run(self, exception: Optional[BaseException]) -> None:
        # Let go of the run once it is finished: a Ctrl-C in finish() (the final sync) leaves it to on_exception,
        # which finishes it as interrupted before the next fit starts it again (review 49l F5).
        if self.run is not None and not self.wandb_pre_initialized:
            self.run.finish(exit_code=1 if exception is not None else 0)
        self.run = None

    # --- what is logged ---------------------------------------------------------------------------------------
    def write_hyperparams(self, hyperparams: dict) -> None:
        if hyperparams:
            self.run.config.update(redact_hyperparams(hyperparams), allow_val_change=True)

    def write_batch(self, record: BatchRecord) -> None:
        values = {}
        for name, value in record.losses.items():
            values[f"train_loss/last_batch_{name}"] = value
            values[f"train_loss/accumulated_batch_{name}"] = record.mean_losses[name]
        for (optimizer_idx, group_idx), rate in record.learning_rates.items():
            values[f"learning_rate/optimizer_{optimizer_idx}_group_{group_idx}"] = rate
        self.run.log(values, step=record.step)

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        metrics_log = {"epoch": epoch}
        metrics_log.update({epoch_metric_key(name): value for name, value in metrics.items()})
        # Not committed here: the metrics recorded at the end of training join the last epoch's row (same step).
        self.run.log(metrics_log, step=step)
        if self.alerts and not train_end:
            self.send_configured_alerts(self.alerts, self._alert_values(metrics_log), run=self.run)

    def write_final_model_path(self, path: str) -> None:
        self.run.summary["final_model_path"] = path

    def _alert_values(self, metrics_log: Dict[str, float]) -> Dict[str, float]:
        # The newest value of every alerted metric, by the name the alert uses (history name or logged key).
        values = dict(metrics_log)
        history = self.train_loop_obj.train_history
        for alert in self.alerts:
            name = alert.metric_name
            for history_name in (name, name.split("/", 1)[-1]):
                if name not in values and history.get(history_name):
                    values[name] = history[history_name][-1]
        return values

    # --- aitoolbox 1.x's methods ----------------------------------------------------------------------------
    def log_mid_train_loss(self) -> None:
        """Log the current batch's loss and the epoch's running mean at the current batch step."""
        if self.run is not None and self.train_loop_obj.last_batch_loss is not None:
            self.write_batch(self.batch_record(self.train_loop_obj.last_batch_loss.detach().float()))

    def log_train_history_metrics(self, metric_names: Sequence[str]) -> Dict[str, float]:
        """Log the newest value of each of these history metrics at the current step; returns what was logged."""
        history = self.train_loop_obj.train_history
        metrics_log = {"epoch": self.train_loop_obj.epoch}
        for name in metric_names:
            if history.get(name):
                metrics_log[epoch_metric_key(name)] = history[name][-1]
        if self.run is not None:
            self.run.log(metrics_log, step=self.train_loop_obj.total_iteration_idx, commit=True)
        return metrics_log

    @staticmethod
    def send_configured_alerts(alerts: List[AlertConfig], metrics_log: Dict[str, Any], run: Any = None) -> None:
        """Send the alerts whose metric crossed its threshold.

        Args:
            alerts: the alert configurations.
            metrics_log: ``{metric name: current value}``; alerts whose metric is missing are skipped.
            run: the wandb run to alert through; None uses the active one (``wandb.run``).
        """
        run = run if run is not None else load_wandb().run
        for alert in alerts:
            value = metrics_log.get(alert.metric_name)
            if value is None or run is None:
                continue
            if alert.objective == "maximize" and value < alert.threshold_value:
                title, relation = f"{alert.metric_name} is too low", "below"
            elif alert.objective == "minimize" and value > alert.threshold_value:
                title, relation = f"{alert.metric_name} is too high", "above"
            else:
                continue
            text = (f"Metric {alert.metric_name} is currently at {value}, {relation} the threshold of "
                    f"{alert.threshold_value}.")
            if alert.wandb_alert_level is None:
                run.alert(title=title, text=text)
            else:
                run.alert(title=title, text=text, level=alert.wandb_alert_level)
