"""Callbacks that save the training history: a plot per metric, and the history as a text, TSV, CSV or JSON file.

Both write into the experiment folder (see
:class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractExperimentCallback`), in the main process only.
Plots and the JSON file are replaced atomically, so a reader never sees a half-written one; the text, TSV and
CSV files grow by one block or row per write, as in aitoolbox 1.x. aitoolbox 1.x code imports these
callbacks from :mod:`aitoolbox.torchtrain.callbacks.performance_eval`, which re-exports them.
"""
import csv
import importlib
import io
import json
import logging
import numbers
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from aitoolbox.experiment.local_save.atomic import atomic_write, atomic_write_text
from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback, scalar_value

logger = logging.getLogger(__name__)

PLOT_FORMATS = ("png", "pdf", "svg")
FILE_FORMATS = ("txt", "tsv", "csv", "json")
TRAIN_END_PREFIX = "train_end_"
# aitoolbox 1.x's message keys: after each write, the list of files written (read by e.g. EmailNotification).
PLOT_PATHS_MESSAGE_KEY = "ModelTrainHistoryPlot_results_file_local_paths"
FILE_WRITER_PATHS_MESSAGE_KEY = "ModelTrainHistoryFileWriter_results_file_local_paths"


class HistoryEpochs:
    """Remembers in which epoch each value of each training-history metric appeared.

    Metrics recorded every epoch get epochs 0, 1, 2...; one recorded every few epochs (``end_auto_eval=N``,
    ``eval_frequency``) gets the epochs it was recorded in, and ``train_end_test_loss`` the last epoch.
    Values that were already in the history when first seen are taken to be one per epoch up to now.
    """

    def __init__(self):
        self.epochs: Dict[str, List[int]] = {}

    def observe(self, history: Mapping[str, List[Any]], epoch: int) -> None:
        """Assign ``epoch`` to the values added since the last call."""
        for name, values in history.items():
            known = self.epochs.get(name)
            if known is None or len(values) < len(known):  # first seen, or the history was replaced
                first = epoch - len(values) + 1
                self.epochs[name] = list(range(first, epoch + 1)) if first >= 0 else list(range(len(values)))
            else:
                known.extend([epoch] * (len(values) - len(known)))


def _check_flags(epoch_end: Any, train_end: Any, callback_name: str) -> None:
    for name, value in (("epoch_end", epoch_end), ("train_end", train_end)):
        if not isinstance(value, bool):
            raise TypeError(f"{callback_name}: {name} must be True or False, got {value!r}")
    if not (epoch_end or train_end):
        raise ValueError(f"{callback_name} with epoch_end=False and train_end=False would never write anything: "
                         "set at least one of them to True")


def _check_format(file_format: Any, valid: Tuple[str, ...]) -> str:
    if not isinstance(file_format, str) or file_format.lower().lstrip(".") not in valid:
        raise ValueError(f"file_format must be one of {list(valid)}, got {file_format!r}")
    return file_format.lower().lstrip(".")


def safe_file_name(metric_name: str) -> str:
    """A file name for a metric: characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", metric_name).strip(".") or "metric"


def _plain(value: Any) -> Any:
    """A JSON-ready version of a history value (numpy and torch numbers become Python numbers)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 or (scalar_value(value) is not None and hasattr(value, "item")):
        return value.item()  # a 0-d / one-element tensor or array: its Python number
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


class ModelTrainHistoryBaseCB(AbstractExperimentCallback):
    """Base of callbacks that write the training history at epoch ends and/or at the end of training.

    Writing happens in the main process only, through :meth:`write` (subclasses implement it); the epochs in
    which each metric got its values are tracked in ``history_epochs``.

    Args:
        callback_name: a name for messages.
        execution_order: position among the callbacks.
        epoch_end: write at the end of every epoch.
        train_end: write at the end of training.
        file_format: the output format (checked by the subclass).
        project_name: the project folder, or None to take the loop's.
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: also upload each file written to a bucket (``'s3'``, ``'gcs'``, ...; see
            :doc:`cloud_storage`); None or ``'local'``: local files only. With all three cloud arguments None
            the loop's are taken (an experiment-tracking preset's).
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.

    Raises:
        ValueError: both flags False, an unknown ``cloud_save_mode`` or a bad folder name.
        TypeError: a flag that is not a bool.
    """

    requires_experiment_folder = True

    def __init__(self, callback_name: str, execution_order: int = 0, epoch_end: bool = True, train_end: bool = False,
                 file_format: str = "", project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None):
        super().__init__(callback_name, project_name, experiment_name, local_model_result_folder_path,
                         cloud_save_mode, bucket_name, cloud_dir_prefix, execution_order=execution_order)
        _check_flags(epoch_end, train_end, type(self).__name__)
        self.epoch_end = epoch_end
        self.train_end = train_end
        self.file_format = file_format
        self.history_epochs = HistoryEpochs()
        self.cloud_results_saver = None  # aitoolbox 1.x attribute: uploads go through cloud_upload

    def prepare_results_saver(self) -> None:
        """aitoolbox 1.x's set-up of the cloud saver: nothing to do (the bucket is known after registration,
        see :attr:`cloud_destination`)."""
        self.cloud_results_saver = None

    def on_epoch_end(self) -> None:
        self.history_epochs.observe(self.train_loop_obj.train_history, self.train_loop_obj.epoch)
        if self.epoch_end and self.is_main_process:
            self.write()

    def on_train_end(self) -> None:
        self.history_epochs.observe(self.train_loop_obj.train_history, self.train_loop_obj.epoch)
        if self.train_end and self.is_main_process:
            self.write(prefix=TRAIN_END_PREFIX)

    def write(self, prefix: str = "") -> None:
        """Write the current training history (``prefix`` is ``'train_end_'`` at the end of training)."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """The epochs in which each metric got its values: a resumed run cannot tell them from the history alone
        when a metric is recorded only every few epochs (checkpoints store it under ``callbacks``)."""
        return {"history_epochs": {name: list(epochs) for name, epochs in self.history_epochs.epochs.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.history_epochs.epochs = {name: [int(epoch) for epoch in epochs]
                                      for name, epochs in state["history_epochs"].items()}

    def announce(self, key: str, paths: List[str]) -> None:
        """Tell the other callbacks which files were written, through the loop's message service (until the
        epoch's end, as in aitoolbox 1.x)."""
        if self.message_service is not None:
            self.message_service.write_message(key, paths)


class ModelTrainHistoryPlot(ModelTrainHistoryBaseCB):
    """Plot each training-history metric against the epoch, one file per metric in ``results/plots/``.

    The files (``<metric>.png``, ...) are replaced at each write, so they always show the whole history.
    Metrics whose values are not single numbers are skipped. matplotlib draws with its Agg renderer on a
    figure of its own, leaving the pyplot state (e.g. a notebook's backend) untouched.

    Args:
        epoch_end: write at the end of every epoch.
        train_end: write at the end of training.
        file_format: ``'png'``, ``'pdf'`` or ``'svg'``.
        project_name: the project folder, or None to take the loop's (e.g. TrainLoopCheckpoint's).
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: also upload each file written to a bucket (``'s3'``, ``'gcs'``, ...; see
            :doc:`cloud_storage`); None or ``'local'``: local files only. With all three cloud arguments None
            the loop's are taken (an experiment-tracking preset's).
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        execution_order: position among the callbacks; the default 97 runs after those that add metrics.

    Raises:
        ValueError: bad flags or format, or experiment details the loop cannot complete (at registration).
        TypeError: a flag that is not a bool.
        ImportError: at registration, when matplotlib is not installed.
    """

    def __init__(self, epoch_end: bool = True, train_end: bool = False, file_format: str = "png",
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97):
        super().__init__("Model training history plot", execution_order, epoch_end, train_end, file_format,
                         project_name, experiment_name, local_model_result_folder_path, cloud_save_mode,
                         bucket_name, cloud_dir_prefix)
        self.file_format = _check_format(file_format, PLOT_FORMATS)

    def on_train_loop_registration(self) -> None:
        # Checked here so that a missing package fails before training, not after the first epoch.
        try:
            importlib.import_module("matplotlib")
        except ImportError as error:
            raise ImportError("ModelTrainHistoryPlot needs matplotlib, which is not installed: pip install "
                              "matplotlib (or pip install 'aitoolbox[tracking]')") from error
        super().on_train_loop_registration()

    def write(self, prefix: str = "") -> None:
        """Plot every numeric metric of the training history now (the same files at every write)."""
        history = self.train_loop_obj.train_history
        plots_dir = self.ensure_folder(self.experiment_folder.plots_dir)
        written: List[str] = []
        for name, values in history.items():
            numbers_ = [scalar_value(value) for value in values]
            if not numbers_ or any(number is None for number in numbers_):
                logger.debug("Not plotting %r: its values are not all single numbers", name)
                continue
            epochs = self.history_epochs.epochs.get(name, list(range(len(values))))
            path = os.path.join(plots_dir, f"{safe_file_name(name)}.{self.file_format}")
            self.save_plot(path, name, epochs, numbers_)
            self.cloud_upload(path)
            written.append(path)
        self.announce(PLOT_PATHS_MESSAGE_KEY, written)

    def plot_current_train_history(self, prefix: str = "") -> None:
        """aitoolbox 1.x's name of :meth:`write`."""
        self.write(prefix)

    def save_plot(self, path: str, metric_name: str, epochs: List[int], values: List[float]) -> None:
        """Draw one metric and write the figure to ``path`` atomically."""
        # Imported here: matplotlib is optional and slow to import. Figure + the Agg canvas avoid pyplot's
        # global figure registry and backend switch.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        figure = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        axes.plot(epochs, values, marker="o" if len(values) <= 30 else None)
        axes.set_title(metric_name)
        axes.set_xlabel("Epoch")
        axes.set_ylabel(metric_name)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        figure.tight_layout()
        with atomic_write(path, "wb") as handle:
            figure.savefig(handle, format=self.file_format)


class ModelTrainHistoryFileWriter(ModelTrainHistoryBaseCB):
    """Write the training history into ``results/`` of the experiment folder, in aitoolbox 1.x's formats.

    At each write the newest value of every metric is added to ``results/results.<format>`` (at the end of
    training to ``results/train_end_results.<format>``); metrics without values are left out, and a metric whose
    values are dicts gives one entry per key (``<metric>_<key>``).

    - ``txt``: a block per write, ``Epoch: <epoch>`` then a ``<metric>:<TAB><value>`` line per metric.
    - ``tsv`` / ``csv``: a header ``Epoch, <metric>, ...``, then a row per write; when the set of metrics
      changes, a ``NEW_METRICS_DETECTED`` row and a new header come first.
    - ``json``: the whole history as ``{metric: [values]}`` in ``results/train_history.json`` (replaced at each
      write; ``train_end_train_history.json`` at the end of training).

    Args:
        epoch_end: write at the end of every epoch.
        train_end: write at the end of training.
        file_format: ``'txt'``, ``'tsv'``, ``'csv'`` or ``'json'``.
        project_name: the project folder, or None to take the loop's (e.g. TrainLoopCheckpoint's).
        experiment_name: prefix of the run folder, or None to take the loop's.
        local_model_result_folder_path: root folder of all projects, or None to take the loop's.
        cloud_save_mode: also upload each file written to a bucket (``'s3'``, ``'gcs'``, ...; see
            :doc:`cloud_storage`); None or ``'local'``: local files only. With all three cloud arguments None
            the loop's are taken (an experiment-tracking preset's).
        bucket_name: the bucket (None with a cloud mode: ``'model-result'``, aitoolbox 1.8's default).
        cloud_dir_prefix: the folder inside the bucket that holds the projects.
        execution_order: position among the callbacks; the default 97 runs after those that add metrics.

    Raises:
        ValueError: bad flags or format, or experiment details the loop cannot complete (at registration).
        TypeError: a flag that is not a bool.
    """

    def __init__(self, epoch_end: bool = True, train_end: bool = False, file_format: str = "txt",
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97):
        super().__init__("Model training history file writer", execution_order, epoch_end, train_end, file_format,
                         project_name, experiment_name, local_model_result_folder_path, cloud_save_mode,
                         bucket_name, cloud_dir_prefix)
        self.file_format = _check_format(file_format, FILE_FORMATS)
        self._columns: Dict[str, List[str]] = {}  # per TSV/CSV file: the metrics of its current header

    def output_path(self, prefix: str = "") -> str:
        """The file written at epoch ends (``prefix=''``) or at the end of training (``'train_end_'``)."""
        name = "train_history.json" if self.file_format == "json" else f"results.{self.file_format}"
        return os.path.join(self.experiment_folder.results_dir, f"{prefix}{name}")

    @property
    def file_path(self) -> str:
        """The file written at epoch ends (known after registration)."""
        return self.output_path()

    def write(self, prefix: str = "") -> None:
        """Add the newest values of the training history to the file now."""
        path = self.output_path(prefix)
        self.ensure_folder(os.path.dirname(path))
        history = self.train_loop_obj.train_history
        if self.file_format == "json":
            text = json.dumps({name: [_plain(value) for value in values] for name, values in history.items()},
                              indent=2, default=repr)
            atomic_write_text(path, text)
            self.cloud_upload(path)
            self.announce(FILE_WRITER_PATHS_MESSAGE_KEY, [path])
            return
        latest = newest_values(history)
        epoch = self.train_loop_obj.epoch
        if self.file_format == "txt":
            lines = ["============================", f"Epoch: {epoch}", "============================"]
            lines += [f"{name}:\t{value}" for name, value in latest.items()]
            text = "\n".join(lines) + "\n\n\n"
        else:
            text = self._table_rows(path, epoch, latest)
        with open(path, "a", encoding="utf-8", newline="") as handle:
            handle.write(text)  # one write per block, so a reader sees whole blocks or rows
        self.cloud_upload(path)
        self.announce(FILE_WRITER_PATHS_MESSAGE_KEY, [path])

    def write_current_train_history(self, prefix: str = "") -> None:
        """aitoolbox 1.x's name of :meth:`write`."""
        self.write(prefix)

    def _table_rows(self, path: str, epoch: int, latest: Dict[str, Any]) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="\t" if self.file_format == "tsv" else ",", lineterminator="\n")
        columns = self._columns.get(path)
        if columns is None or sorted(columns) != sorted(latest):
            if columns is not None:
                writer.writerow(["NEW_METRICS_DETECTED"])
            columns = self._columns[path] = list(latest)
            writer.writerow(["Epoch"] + columns)
        writer.writerow([epoch] + [latest[name] for name in columns])
        return buffer.getvalue()


def newest_values(history: Mapping[str, List[Any]]) -> Dict[str, Any]:
    """The newest value of each metric that has one; dict values become ``<metric>_<key>`` entries."""
    latest: Dict[str, Any] = {}
    for name, values in history.items():
        if values:
            _flatten_into(latest, name, _plain(values[-1]))
    return latest


def _flatten_into(target: Dict[str, Any], name: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten_into(target, f"{name}_{key}", _plain(inner))
    else:
        target[name] = value
