"""Reports of the training progress: metric curves, per-epoch result tables and gradient histograms.

Plots use matplotlib, imported only when something is drawn; figures are built on the Agg canvas without
pyplot, so a notebook's backend and pyplot's list of open figures are left alone. Every file is written
atomically (see :mod:`aitoolbox.experiment.local_save.atomic`).
"""
import csv
import io
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from aitoolbox.experiment.local_save.atomic import atomic_write, atomic_write_text
from aitoolbox.utils.dict_util import flatten_combine_dict

logger = logging.getLogger(__name__)


def _new_figure() -> Any:
    """A 10x8 inch matplotlib Figure on an Agg canvas (not registered with pyplot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("Plotting reports needs matplotlib: pip install matplotlib") from error
    figure = Figure(figsize=(10, 8))
    FigureCanvasAgg(figure)
    return figure


def _flat_history(training_history: Any) -> Dict[str, List[Any]]:
    """The history as ``{metric: [values]}`` with grouped (dict) metrics split per leaf key."""
    if hasattr(training_history, "get_train_history_dict"):
        return training_history.get_train_history_dict(flatten_dict=True)
    if isinstance(training_history, Mapping):
        return flatten_combine_dict(training_history)
    raise TypeError(f"training_history must be a TrainingHistory or a dict of metric name -> list of values, "
                    f"got {type(training_history).__name__}")


def _float_series(values: Sequence[Any]) -> Optional[List[float]]:
    """The values as floats, or None when one is not a number (a string, a list, a dict...)."""
    series = []
    for value in values:
        if isinstance(value, (str, bytes, bool, Mapping)):
            return None
        try:
            series.append(float(value))  # also takes NumPy scalars and one-element tensors
        except (TypeError, ValueError):
            return None
    return series


def _safe_file_stem(name: Any) -> str:
    """A metric name usable as a file name: path separators would otherwise create folders."""
    return re.sub(r"[\\/]", "_", str(name))


def _save_png(figure: Any, file_path: str) -> None:
    with atomic_write(file_path, "wb") as handle:
        figure.savefig(handle, format="png")


def _save_pdf(figures: Iterator[Any], file_path: str) -> None:
    from matplotlib.backends.backend_pdf import PdfPages

    with atomic_write(file_path, "wb") as handle, PdfPages(handle) as pdf:
        for figure in figures:
            pdf.savefig(figure)


def _save_named_pngs(named_figures: Iterator[Tuple[Any, Any]], folder_path: str, folder_name: str,
                     file_prefix: str = "") -> List[List[str]]:
    """Save each ``(name, figure)`` as ``<file_prefix><name>.png`` in ``folder_path``.

    Returns:
        ``[[path under folder_name, local path], ...]``.
    """
    saved = []
    for name, figure in named_figures:
        file_name = f"{file_prefix}{_safe_file_stem(name)}.png"
        file_path = os.path.join(folder_path, file_name)
        _save_png(figure, file_path)
        saved.append([os.path.join(folder_name, file_name), file_path])
    return saved


def _save_named_pdf(named_figures: Iterator[Tuple[Any, Any]], folder_path: str,
                    file_stem: str) -> List[List[str]]:
    """Save the figures of ``(name, figure)`` as the pages of ``<file_stem>.pdf`` in ``folder_path``."""
    file_name = f"{file_stem}.pdf"
    file_path = os.path.join(folder_path, file_name)
    _save_pdf((figure for _, figure in named_figures), file_path)
    return [[file_name, file_path]]


class _FigureReport:
    """The ``png`` / ``pdf`` choice shared by the plotters, which implement ``plot_png`` and ``plot_pdf``."""

    def _report_in_format(self, data: Any, results_path: str, folder_name: str,
                          file_format: str) -> List[List[str]]:
        if file_format == "png":
            folder_path = os.path.join(results_path, folder_name)
            os.makedirs(folder_path, exist_ok=True)
            return self.plot_png(data, folder_path, folder_name)
        if file_format == "pdf":
            return self.plot_pdf(data, results_path, folder_name)
        raise ValueError(f"file_format {file_format!r} is not supported: use 'png' or 'pdf'")


def _add_titles(axes: Any, title: str, *subtitles: str) -> None:
    """A bold title above the axes with small grey subtitle lines under it."""
    axes.text(0.5, 1.07, title, fontsize=16, weight="bold", ha="center", va="bottom", transform=axes.transAxes)
    for line_idx, line in enumerate(subtitles):
        axes.text(0.5, 1.035 - 0.025 * line_idx, line, fontsize=8, alpha=0.75, ha="center", va="bottom",
                  transform=axes.transAxes)


class TrainingHistoryPlotter(_FigureReport):
    """Plots how every metric in the training history progressed over the epochs.

    Args:
        experiment_results_local_path: the experiment's results folder, where the plots go.
    """

    def __init__(self, experiment_results_local_path: str):
        self.experiment_results_local_path = experiment_results_local_path

    def generate_report(self, training_history: Any, plots_folder_name: str = "plots",
                        file_format: str = "png") -> List[List[str]]:
        """Plot each metric with more than one numeric value.

        Args:
            training_history: the TrainLoop's TrainingHistory (or a ``{metric: [values]}`` dict).
            plots_folder_name: with ``'png'``, the sub-folder of the results folder receiving one image per
                metric; with ``'pdf'``, the name of the single PDF (``<plots_folder_name>.pdf``).
            file_format: ``'png'`` or ``'pdf'``.

        Returns:
            ``[[path relative to the results folder, local path], ...]`` of the saved files.

        Raises:
            ValueError: an unknown ``file_format``.
        """
        return self._report_in_format(training_history, self.experiment_results_local_path, plots_folder_name,
                                      file_format)

    def plot_png(self, training_history: Any, plots_local_folder_path: str,
                 plots_folder_name: str) -> List[List[str]]:
        """Save one ``<metric>.png`` per plotted metric into ``plots_local_folder_path``."""
        return _save_named_pngs(self.generate_plots(training_history), plots_local_folder_path, plots_folder_name)

    def plot_pdf(self, training_history: Any, plots_local_folder_path: str,
                 plots_file_name: str) -> List[List[str]]:
        """Save all plots as the pages of ``<plots_file_name>.pdf`` in ``plots_local_folder_path``."""
        return _save_named_pdf(self.generate_plots(training_history), plots_local_folder_path, plots_file_name)

    @staticmethod
    def generate_plots(training_history: Any) -> Iterator[Tuple[str, Any]]:
        """Yield ``(metric name, figure)`` for every metric with more than one numeric value."""
        for metric_name, values in _flat_history(training_history).items():
            series = _float_series(values) if len(values) > 1 else None
            if series is None:
                continue
            yield metric_name, TrainingHistoryPlotter.plot_performance_curve(metric_name, series)

    @staticmethod
    def plot_performance_curve(metric_name: Any, result_history: Sequence[float]) -> Any:
        """Draw one metric's values per epoch, titled with its best and worst value.

        The n-th value is drawn at epoch n (counted from 1, as the epoch's summary line counts) and the title names
        the same number: for a metric recorded every k epochs that is the n-th recording, epoch ``n * k``.

        Args:
            metric_name: the metric's name.
            result_history: the metric's value at each epoch.

        Returns:
            matplotlib.figure.Figure: the drawn figure.
        """
        values = np.asarray(result_history, dtype=float)
        figure = _new_figure()
        axes = figure.subplots()
        # The axis and the title count from 1, as the epoch's summary line counts (the values are 1.8's).
        axes.plot(range(1, len(values) + 1), values, marker="o")
        axes.set_xlabel("Epoch", size=10)
        axes.set_ylabel(str(metric_name), size=10)
        subtitles = []
        if np.isfinite(values).any():  # NaN epochs (e.g. a diverged loss) are ignored for the extremes
            finite = np.where(np.isfinite(values), values, np.nan)
            subtitles = [f"Max result: {np.nanmax(finite)} {metric_name} (at epoch {int(np.nanargmax(finite)) + 1})",
                         f"Min result: {np.nanmin(finite)} {metric_name} (at epoch {int(np.nanargmin(finite)) + 1})"]
        _add_titles(axes, str(metric_name), *subtitles)
        return figure


class TrainingHistoryWriter:
    """Appends the latest value of every metric in the training history to a text, TSV or CSV report.

    Args:
        experiment_results_local_path: the experiment's results folder; may be None at first and set later
            (as the results-writing callback does).
    """

    def __init__(self, experiment_results_local_path: Optional[str]):
        self.experiment_results_local_path = experiment_results_local_path
        # The columns of the current TSV/CSV table; a changed metric set starts a new header.
        self.metric_name_cols: Optional[List[str]] = None

    def generate_report(self, training_history: Any, epoch: int, file_name: str, results_folder_name: str = "",
                        file_format: str = "txt") -> Tuple[str, str]:
        """Append this epoch's results to ``<results folder>/<results_folder_name>/<file_name>``.

        Args:
            training_history: the TrainLoop's TrainingHistory (or a ``{metric: [values]}`` dict).
            epoch: the epoch the results belong to.
            file_name: the report file's name.
            results_folder_name: a sub-folder of the results folder ('' for the results folder itself).
            file_format: ``'txt'`` (a readable block per epoch), ``'tsv'`` or ``'csv'`` (a table, one row per
                epoch).

        Returns:
            The report's path relative to the results folder, and its local path.

        Raises:
            ValueError: an unknown ``file_format``, or no results folder set.
        """
        if file_format not in ("txt", "tsv", "csv"):
            raise ValueError(f"file_format {file_format!r} is not supported: use 'txt', 'tsv' or 'csv'")
        if self.experiment_results_local_path is None:
            raise ValueError("experiment_results_local_path is not set: give the results folder to the "
                             "TrainingHistoryWriter before writing a report")
        folder_path = os.path.join(self.experiment_results_local_path, results_folder_name or "")
        os.makedirs(folder_path, exist_ok=True)
        file_path = os.path.join(folder_path, file_name)

        if file_format == "txt":
            self.write_txt(training_history, epoch, file_path)
        else:
            self.write_csv_tsv(training_history, epoch, file_path, delimiter="\t" if file_format == "tsv" else ",")
        return os.path.join(results_folder_name or "", file_name), file_path

    @staticmethod
    def _append(file_path: str, text: str) -> None:
        """Append by rewriting the file atomically: a crash leaves the previous complete report."""
        previous = ""
        if os.path.exists(file_path):
            with open(file_path, "r", encoding="utf-8", newline="") as handle:
                previous = handle.read()
        atomic_write_text(file_path, previous + text)

    @staticmethod
    def write_txt(training_history: Any, epoch: int, file_path: str) -> None:
        """Append an ``Epoch: N`` block with one ``metric:<TAB>latest value`` line per metric."""
        rule = "=" * 28
        lines = [rule, f"Epoch: {epoch}", rule]
        lines += [f"{name}:\t{values[-1]}" for name, values in _flat_history(training_history).items()]
        TrainingHistoryWriter._append(file_path, "\n".join(lines) + "\n\n\n")

    def write_csv_tsv(self, training_history: Any, epoch: int, file_path: str, delimiter: str) -> None:
        """Append a row of the latest values; a header first, and again when the set of metrics changed."""
        history = _flat_history(training_history)
        names = list(history)
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter=delimiter)
        if self.metric_name_cols is None:
            self.metric_name_cols = names
            writer.writerow(["Epoch"] + names)
        elif sorted(names) != sorted(self.metric_name_cols):
            self.metric_name_cols = names
            writer.writerow(["NEW_METRICS_DETECTED"])
            writer.writerow(["Epoch"] + names)
        writer.writerow([epoch] + [history[name][-1] for name in self.metric_name_cols])
        self._append(file_path, buffer.getvalue())


class GradientPlotter(_FigureReport):
    """Plots the distribution of each layer's gradients.

    Args:
        experiment_grad_results_local_path: the folder where the gradient plots go.
    """

    def __init__(self, experiment_grad_results_local_path: str):
        self.experiment_grad_results_local_path = experiment_grad_results_local_path

    def generate_report(self, model_layer_gradients: Sequence[Any], grad_plots_folder_name: str = "grad_plots",
                        file_format: str = "png") -> List[List[str]]:
        """Plot a histogram of every layer's gradients (layers whose gradients are None are skipped).

        Args:
            model_layer_gradients: per layer, the flattened gradients (array or list), or None.
            grad_plots_folder_name: with ``'png'``, the sub-folder receiving ``layer_<i>.png`` per layer; with
                ``'pdf'``, the name of the single PDF.
            file_format: ``'png'`` or ``'pdf'``.

        Returns:
            ``[[path relative to the gradient folder, local path], ...]`` of the saved files.

        Raises:
            ValueError: an unknown ``file_format``.
        """
        return self._report_in_format(model_layer_gradients, self.experiment_grad_results_local_path,
                                      grad_plots_folder_name, file_format)

    def plot_png(self, model_layer_gradients: Sequence[Any], grad_plots_local_folder_path: str,
                 plots_folder_name: str) -> List[List[str]]:
        """Save one ``layer_<name>.png`` per layer into ``grad_plots_local_folder_path``."""
        return _save_named_pngs(self.generate_dist_plots(model_layer_gradients), grad_plots_local_folder_path,
                                plots_folder_name, file_prefix="layer_")

    def plot_pdf(self, model_layer_gradients: Sequence[Any], plots_local_folder_path: str,
                 plots_file_name: str) -> List[List[str]]:
        """Save all layers' plots as the pages of ``<plots_file_name>.pdf``."""
        return _save_named_pdf(self.generate_dist_plots(model_layer_gradients), plots_local_folder_path,
                               plots_file_name)

    @staticmethod
    def generate_dist_plots(model_layer_gradients: Sequence[Any],
                            layer_names: Optional[Sequence[Any]] = None) -> Iterator[Tuple[Any, Any]]:
        """Yield ``(layer name, figure)`` per layer with gradients; layers are named by index by default."""
        for layer_idx, gradients in enumerate(model_layer_gradients):
            layer_name = layer_idx if layer_names is None else layer_names[layer_idx]
            if gradients is None:
                logger.info("Layer %s has no gradients (None): not plotted", layer_name)
                continue
            yield layer_name, GradientPlotter.plot_gradient_distribution(gradients, layer_name)

    @staticmethod
    def plot_gradient_distribution(gradients: Any, layer_name: Any) -> Any:
        """Draw a histogram of one layer's gradients, titled with their mean and standard deviation.

        Args:
            gradients: the layer's flattened gradients.
            layer_name: the layer's name or index.

        Returns:
            matplotlib.figure.Figure: the drawn figure.
        """
        values = np.asarray(gradients, dtype=float).reshape(-1)
        figure = _new_figure()
        axes = figure.subplots()
        finite = values[np.isfinite(values)]
        axes.hist(finite, bins=min(50, max(1, int(math.sqrt(max(finite.size, 1))))), density=True)
        axes.set_xlabel("Gradient magnitude", size=10)
        _add_titles(axes, f"Gradient distribution for layer {layer_name}",
                    f"Mean: {np.mean(values)}", f"Std: {np.std(values)}")
        return figure
