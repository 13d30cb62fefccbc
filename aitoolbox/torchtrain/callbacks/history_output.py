"""Callbacks that save the training history: a plot per metric, and the history as a TXT, CSV or JSON file.

Both write into the experiment folder (see
:class:`~aitoolbox.torchtrain.callbacks.experiment.AbstractExperimentCallback`), in the main process only,
and replace their files atomically, so a reader never sees a half-written plot or table. aitoolbox 1.x code
imports them from :mod:`aitoolbox.torchtrain.callbacks.performance_eval`, which re-exports them.
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
from aitoolbox.torchtrain.callbacks.experiment import AbstractExperimentCallback, check_local_save_mode, scalar_value

logger = logging.getLogger(__name__)

PLOT_FORMATS = ("png", "pdf", "svg")
FILE_FORMATS = ("txt", "csv", "json")


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

    def rows(self, history: Mapping[str, List[Any]]) -> List[Tuple[int, Dict[str, Any]]]:
        """The history as table rows ``(epoch, {metric: value})``, one per epoch (more if an epoch has repeats)."""
        by_epoch: Dict[int, Dict[str, List[Any]]] = {}
        for name, values in history.items():
            for epoch, value in zip(self.epochs.get(name, range(len(values))), values):
                by_epoch.setdefault(epoch, {}).setdefault(name, []).append(value)
        rows = []
        for epoch in sorted(by_epoch):
            cells = by_epoch[epoch]
            for repeat in range(max(len(values) for values in cells.values())):
                rows.append((epoch, {name: values[repeat] for name, values in cells.items() if repeat < len(values)}))
        return rows


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


def _cell(value: Any) -> str:
    value = _plain(value)
    return repr(value) if isinstance(value, float) else str(value)


class _HistoryOutputBase(AbstractExperimentCallback):
    """Writes at epoch ends and/or at the end of training, in the main process only."""

    def __init__(self, callback_name: str, epoch_end: bool, train_end: bool, project_name: Optional[str],
                 experiment_name: Optional[str], local_model_result_folder_path: Optional[str],
                 cloud_save_mode: Optional[str], execution_order: int):
        super().__init__(callback_name, project_name, experiment_name, local_model_result_folder_path,
                         execution_order=execution_order)
        _check_flags(epoch_end, train_end, type(self).__name__)
        check_local_save_mode(cloud_save_mode, type(self).__name__)
        self.epoch_end = epoch_end
        self.train_end = train_end
        self.history_epochs = HistoryEpochs()

    def on_epoch_end(self) -> None:
        self.history_epochs.observe(self.train_loop_obj.train_history, self.train_loop_obj.epoch)
        if self.epoch_end and self.is_main_process:
            self.write()

    def on_train_end(self) -> None:
        self.history_epochs.observe(self.train_loop_obj.train_history, self.train_loop_obj.epoch)
        if self.train_end and self.is_main_process:
            self.write()

    def write(self) -> None:
        raise NotImplementedError


class ModelTrainHistoryPlot(_HistoryOutputBase):
    """Plot each training-history metric against the epoch, one file per metric in ``results/plots/``.

    The files (``<metric>.png``, ...) are replaced at each write, so they always show the whole history.
    Metrics whose values are not single numbers are skipped. matplotlib draws with its Agg renderer on a
    figure of its own, leaving the pyplot state (e.g. a notebook's backend) untouched.

    Args:
        epoch_end: write at the end of every epoch.
        train_end: write at the end of training.
        file_format: ``'png'``, ``'pdf'`` or ``'svg'``.
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (all three or
            none, then the folder of TrainLoopCheckpoint / TrainLoopEndSave / TrainLoopCheckpointEndSave).
        cloud_save_mode, bucket_name, cloud_dir_prefix: accepted for aitoolbox 1.x compatibility; only local
            saving is supported.
        execution_order: position among the callbacks; the default 97 runs after those that add metrics.

    Raises:
        ValueError / TypeError: bad flags or format, or incomplete folder arguments.
        ImportError: at registration, when matplotlib is not installed.
    """

    def __init__(self, epoch_end: bool = True, train_end: bool = False, file_format: str = "png",
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97):
        super().__init__("Model training history plot", epoch_end, train_end, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, execution_order)
        self.file_format = _check_format(file_format, PLOT_FORMATS)

    def on_train_loop_registration(self) -> None:
        # Checked here so that a missing package fails before training, not after the first epoch.
        try:
            importlib.import_module("matplotlib")
        except ImportError as error:
            raise ImportError("ModelTrainHistoryPlot needs matplotlib, which is not installed: pip install "
                              "matplotlib (or pip install 'aitoolbox[tracking]')") from error
        super().on_train_loop_registration()

    def write(self) -> None:
        """Plot every numeric metric of the training history now."""
        history = self.train_loop_obj.train_history
        plots_dir = self.ensure_folder(self.experiment_folder.plots_dir)
        for name, values in history.items():
            numbers_ = [scalar_value(value) for value in values]
            if not numbers_ or any(number is None for number in numbers_):
                logger.debug("Not plotting %r: its values are not all single numbers", name)
                continue
            epochs = self.history_epochs.epochs.get(name, list(range(len(values))))
            self.save_plot(os.path.join(plots_dir, f"{safe_file_name(name)}.{self.file_format}"), name, epochs,
                           numbers_)

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


class ModelTrainHistoryFileWriter(_HistoryOutputBase):
    """Write the training history to ``results/train_history.<txt|csv|json>``.

    - ``csv``: a header ``epoch,<metric>,...`` and one row per epoch; a metric without a value in an epoch
      (recorded every few epochs, or only at the end like ``train_end_test_loss``) has an empty cell.
    - ``txt``: the same table with aligned columns, for reading.
    - ``json``: the history as ``{metric: [values]}``.

    Args:
        epoch_end: write at the end of every epoch.
        train_end: write at the end of training.
        file_format: ``'txt'``, ``'csv'`` or ``'json'``.
        project_name, experiment_name, local_model_result_folder_path: the experiment folder (all three or
            none, then the folder of TrainLoopCheckpoint / TrainLoopEndSave / TrainLoopCheckpointEndSave).
        cloud_save_mode, bucket_name, cloud_dir_prefix: accepted for aitoolbox 1.x compatibility; only local
            saving is supported.
        execution_order: position among the callbacks; the default 97 runs after those that add metrics.

    Raises:
        ValueError / TypeError: bad flags or format, or incomplete folder arguments.
    """

    def __init__(self, epoch_end: bool = True, train_end: bool = False, file_format: str = "txt",
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, cloud_save_mode: Optional[str] = None,
                 bucket_name: Optional[str] = None, cloud_dir_prefix: Optional[str] = None,
                 execution_order: int = 97):
        super().__init__("Model training history file writer", epoch_end, train_end, project_name, experiment_name,
                         local_model_result_folder_path, cloud_save_mode, execution_order)
        self.file_format = _check_format(file_format, FILE_FORMATS)

    @property
    def file_path(self) -> str:
        """Where the history is written (known after registration)."""
        return os.path.join(self.experiment_folder.results_dir, f"train_history.{self.file_format}")

    def write(self) -> None:
        """Write the whole training history now."""
        self.ensure_folder(self.experiment_folder.results_dir)
        history = self.train_loop_obj.train_history
        if self.file_format == "json":
            text = json.dumps({name: [_plain(value) for value in values] for name, values in history.items()},
                              indent=2, default=repr)
        else:
            header = ["epoch"] + list(history.keys())
            table = [header] + [[str(epoch)] + [_cell(cells[name]) if name in cells else "" for name in header[1:]]
                                for epoch, cells in self.history_epochs.rows(history)]
            text = self._csv(table) if self.file_format == "csv" else self._aligned(table)
        atomic_write_text(self.file_path, text)

    @staticmethod
    def _csv(table: List[List[str]]) -> str:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(table)
        return buffer.getvalue()

    @staticmethod
    def _aligned(table: List[List[str]]) -> str:
        widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
        return "".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n"
                       for row in table)
