"""Callbacks that compute a result package's metrics during training and report them.

:class:`ModelPerformanceEvaluation` puts metrics such as ``val_Accuracy`` into the training history, where
early stopping, schedulers and :class:`ModelPerformancePrintReport` find them. As in aitoolbox 1.x this
module also offers :class:`TrainHistoryFormatter` / :class:`MetricHistoryRename` (from :mod:`.history_format`)
and the history plot and file writer (from :mod:`.history_output`).
"""
import argparse
import copy
import logging
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.history_format import MetricHistoryRename, TrainHistoryFormatter
from aitoolbox.torchtrain.callbacks.history_output import (
    ModelTrainHistoryBaseCB, ModelTrainHistoryFileWriter, ModelTrainHistoryPlot)
from aitoolbox.torchtrain.data.validation_names import history_prefixes

logger = logging.getLogger(__name__)

__all__ = ["ModelPerformanceEvaluation", "ModelPerformancePrintReport", "TrainHistoryFormatter",
           "MetricHistoryRename", "ModelTrainHistoryBaseCB", "ModelTrainHistoryPlot", "ModelTrainHistoryFileWriter"]

# For each data set: (prefix in the history, TrainLoop prediction method, loss method, loader attribute, flag).
_DATASETS = {
    "train": ("train_", "predict_on_train_set", "evaluate_loss_on_train_set", "train_loader", "on_train_data"),
    "validation": ("val_", "predict_on_validation_set", "evaluate_loss_on_validation_set", "validation_loader",
                   "on_val_data"),
    "test": ("test_", "predict_on_test_set", "evaluate_loss_on_test_set", "test_loader", "on_test_data"),
}
TRAIN_END_PREFIX = "train_end_"


def _check_frequency(value: Optional[int], name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (every epoch) or a positive int (every N epochs), got {value!r}")


def _epoch_due(epoch: int, frequency: Optional[int]) -> bool:
    """Every epoch, or every ``frequency`` epochs: the N-th, 2N-th, ... counted from 1 (0-based index N-1, 2N-1, ...),
    the epochs ``end_auto_eval=N`` records the losses in, so metrics and losses are recorded together. aitoolbox 1.x
    counted from the first epoch (indices 0, N, 2N, ...)."""
    return frequency is None or (epoch + 1) % frequency == 0


def _is_streaming_package(package: AbstractResultPackage) -> bool:
    """True for packages over a stateful torchmetrics metric (``TorchMetricsPackage``): reset, moved to device."""
    return callable(getattr(package, "metric_reset", None))


class ModelPerformanceEvaluation(AbstractCallback):
    """Evaluate a result package on the model's predictions and record its metrics in the training history.

    At the end of each epoch (or every ``eval_frequency`` epochs: the N-th, 2N-th, ... counted from 1, as
    ``end_auto_eval=N``) the callback asks the TrainLoop
    for its predictions on the chosen data sets, prepares the result packages and appends every metric to
    ``train_history`` as ``train_<metric>``, ``val_<metric>`` or ``test_<metric>`` (e.g. ``val_Accuracy``).
    At the end of training it evaluates once more and records ``train_end_val_<metric>`` etc. The TrainLoop
    caches predictions within an iteration, so several callbacks share one prediction pass.

    With several validation sets (``validation_loader={'in_domain': dl1, 'shifted': dl2}``) every set is
    evaluated and recorded as ``val_<name>_<metric>`` (``train_end_val_<name>_<metric>``); the first set also as
    ``val_<metric>``. Its results are in ``result_package``; every set's package is in ``val_result_packages``
    (by name), the other sets' being copies of ``result_package`` made when training begins.

    As in aitoolbox 1.x, ``result_package`` itself is prepared with the validation results;
    ``train_result_package`` (with ``on_train_data``) and ``test_result_package`` (with ``on_test_data``) are
    copies of it made here. A package with ``requires_loss`` gets the data set's loss as
    ``additional_results['additional_results']['loss']``. Packages over a torchmetrics metric (with a
    ``metric_reset`` method) have their metric moved to the training device at registration and reset at
    every epoch end.

    Under distributed training the callback runs in every process (predicting is a collective operation).

    Args:
        result_package: the metrics to compute, e.g. ``ClassificationResultPackage()``.
        args: the experiment's hyperparameters (a dict, an ``argparse.Namespace``, or None for none), handed
            to the result packages (as a copy; None as ``{}``). Optional, unlike in aitoolbox 1.x.
        on_each_epoch: evaluate at epoch ends (True) or only at the end of training (False).
        on_train_data: evaluate on the training set.
        on_val_data: evaluate on the validation set.
        eval_frequency: with ``on_each_epoch``, evaluate every this many epochs (None: every epoch).
        if_available_output_to_project_dir: with an experiment-tracking TrainLoop, tell the packages the
            experiment folder (``set_experiment_dir_path_for_additional_results``) for their extra files.
        on_test_data: evaluate on the test set.
        execution_order: position among the callbacks; the default 0 runs before reporting and stopping.

    Raises:
        TypeError: ``result_package`` is not a result package, or ``args`` is not a dict.
        ValueError: no data set chosen, a bad ``eval_frequency``, or (at the start of training) a chosen data
            set without a loader.
    """

    def __init__(self, result_package: AbstractResultPackage, args: Any = None, on_each_epoch: bool = True,
                 on_train_data: bool = False, on_val_data: bool = True, eval_frequency: Optional[int] = None,
                 if_available_output_to_project_dir: bool = True, on_test_data: bool = False,
                 execution_order: int = 0):
        super().__init__("Model performance evaluation", execution_order=execution_order)
        if not isinstance(result_package, AbstractResultPackage):
            raise TypeError("result_package must be an AbstractResultPackage such as ClassificationResultPackage(), "
                            f"got {type(result_package).__name__}: {result_package!r}")
        if isinstance(args, argparse.Namespace):
            args = vars(args)
        if args is not None and not isinstance(args, Mapping):
            raise TypeError(f"args (the hyperparameters) must be a dict, an argparse.Namespace or None, got "
                            f"{type(args).__name__}: {args!r}")
        if not (on_train_data or on_val_data or on_test_data):
            raise ValueError("nothing to evaluate: on_train_data, on_val_data and on_test_data are all False; "
                             "set at least one to True")
        _check_frequency(eval_frequency, "eval_frequency")
        self.result_package = result_package
        self.args = dict(args) if args is not None else {}
        self.on_each_epoch = on_each_epoch
        self.on_train_data = on_train_data
        self.on_val_data = on_val_data
        self.on_test_data = on_test_data
        self.eval_frequency = eval_frequency
        self.if_available_output_to_project_dir = if_available_output_to_project_dir
        # With several validation sets: the package of each, by set name (see _add_validation_set_packages).
        self.val_result_packages: Dict[str, AbstractResultPackage] = {}
        # Attributes present only for the data sets evaluated, as in aitoolbox 1.x.
        if on_train_data:
            self.train_result_package = copy.deepcopy(result_package)
        if on_test_data:
            self.test_result_package = copy.deepcopy(result_package)

    @property
    def dataset_types(self) -> List[str]:
        """The data sets this callback evaluates, in the order it evaluates them."""
        return [dataset_type for dataset_type, spec in _DATASETS.items() if getattr(self, spec[4])]

    def package_for(self, dataset_type: str, name: Optional[str] = None) -> AbstractResultPackage:
        """The result package that holds the results of ``dataset_type`` ('train', 'validation' or 'test'); with
        several validation sets, ``name`` picks the set (None: the first, whose package is ``result_package``)."""
        if dataset_type == "validation" and name is not None:
            return self.val_result_packages[name]
        return {"train": getattr(self, "train_result_package", None), "validation": self.result_package,
                "test": getattr(self, "test_result_package", None)}[dataset_type]

    def _targets(self) -> List[Tuple[str, Optional[str], List[str]]]:
        """``(dataset type, validation set name, history prefixes)`` of every set evaluated, in order."""
        targets = []
        for dataset_type in self.dataset_types:
            if dataset_type == "validation":
                sets = history_prefixes(getattr(self.train_loop_obj, "validation_loader", None))
                targets.extend(("validation", name, prefixes) for name, prefixes in sets)
            else:
                targets.append((dataset_type, None, [_DATASETS[dataset_type][0]]))
        return targets

    def _packages(self) -> List[AbstractResultPackage]:
        packages = [self.package_for(dataset_type) for dataset_type in self.dataset_types]
        return packages + [package for package in self.val_result_packages.values()
                           if all(package is not known for known in packages)]

    def _add_validation_set_packages(self) -> None:
        """One package per named validation set: the first set's is ``result_package`` (1.x code reads its results),
        the others are copies of it, made when training begins (when the sets are known)."""
        names = self.train_loop_obj.validation_set_names if self.on_val_data else None
        for index, name in enumerate(names or []):
            if name not in self.val_result_packages:
                self.val_result_packages[name] = self.result_package if index == 0 else \
                    copy.deepcopy(self.result_package)

    def on_train_loop_registration(self) -> None:
        tl = self.train_loop_obj
        details = [getattr(tl, name, None) for name in ("project_name", "experiment_name",
                                                         "local_model_result_folder_path")]
        if self.if_available_output_to_project_dir and None not in details:
            project_name, experiment_name, root = details
            for package in self._packages():
                package.set_experiment_dir_path_for_additional_results(project_name, experiment_name,
                                                                       tl.experiment_timestamp, root)
        for package in self._packages():
            if _is_streaming_package(package) and callable(getattr(package.metric, "to", None)):
                package.metric.to(tl.device)

    def on_train_begin(self) -> None:
        for dataset_type in self.dataset_types:
            _, _, _, loader_name, flag = _DATASETS[dataset_type]
            if getattr(self.train_loop_obj, loader_name) is None:
                raise ValueError(f"ModelPerformanceEvaluation has {flag}=True but the TrainLoop has no "
                                 f"{loader_name}: pass a {loader_name} to TrainLoop or set {flag}=False")
        self._add_validation_set_packages()

    def skips_this_epoch(self) -> bool:
        """True in an epoch whose end ``eval_frequency`` skips: callbacks ranking or stopping by this callback's
        metrics then wait for its next evaluation rather than report the metric missing."""
        return self.on_each_epoch and not _epoch_due(self.train_loop_obj.epoch, self.eval_frequency)

    def on_epoch_end(self) -> None:
        if self.on_each_epoch and _epoch_due(self.train_loop_obj.epoch, self.eval_frequency):
            self.evaluate_model_performance()
        # torchmetrics metrics accumulate over updates: start every epoch afresh
        for package in self._packages():
            if _is_streaming_package(package):
                package.metric_reset()

    def on_train_end(self) -> None:
        self.evaluate_model_performance(prefix=TRAIN_END_PREFIX)

    def on_exception(self, exception: BaseException) -> None:
        # An evaluation cut short leaves partial updates in torchmetrics metrics: the next fit starts afresh.
        for package in self._packages():
            if _is_streaming_package(package):
                package.metric_reset()

    def evaluate_model_performance(self, prefix: str = "") -> None:
        """Evaluate on every chosen data set now and append the results to the training history.

        Args:
            prefix: put before the metric names in the history (``'train_end_'`` at the end of training).
        """
        tl = self.train_loop_obj
        self._add_validation_set_packages()  # a validation dict assigned since training began
        for dataset_type, name, _ in self._targets():
            _, predict_method, loss_method, _, _ = _DATASETS[dataset_type]
            # Only a named validation set passes name=: a 1.x TrainLoop subclass may not take the keyword.
            set_choice = {} if name is None else {"name": name}
            y_pred, y_true, metadata = getattr(tl, predict_method)(**set_choice)
            package = self.package_for(dataset_type, name)
            if getattr(package, "requires_loss", False):
                # A copy: the metadata belongs to the loop's prediction cache, shared with other callbacks.
                metadata = dict(metadata) if isinstance(metadata, Mapping) else {}
                metadata["loss"] = getattr(tl, loss_method)(float_dict_format=True, **set_choice)
            package.prepare_result_package(y_true, y_pred, hyperparameters=self.args, additional_results=metadata,
                                           training_history=tl.train_history)
        self.store_evaluated_metrics_to_history(prefix=prefix)

    def store_evaluated_metrics_to_history(self, prefix: str = "") -> None:
        """Append the results of the last evaluation to the training history, e.g. as ``val_Accuracy``.

        Args:
            prefix: put before the metric names (``'train_end_'`` at the end of training).
        """
        for dataset_type, name, set_prefixes in self._targets():
            results: Dict[str, Any] = self.package_for(dataset_type, name).get_results() or {}
            for set_prefix in set_prefixes:  # the first of several sets: val_<metric> and val_<name>_<metric>
                for metric_name, value in results.items():
                    self.train_loop_obj.insert_metric_result_into_history(f"{prefix}{set_prefix}{metric_name}", value)


class ModelPerformancePrintReport(AbstractCallback):
    """Log the latest value of chosen metrics from the training history (main process only, INFO level).

    At the end of training it reports the ``train_end_<metric>`` values that
    :class:`ModelPerformanceEvaluation` records then, and the latest plain value for metrics without one.

    Args:
        metrics: names of tracked metrics, e.g. ``['val_loss', 'val_Accuracy']``.
        on_each_epoch: report at epoch ends (and at the end of training), or only at the end of training.
        report_frequency: with ``on_each_epoch``, report every this many epochs (the N-th, 2N-th, ... counted from
            1, the epochs of ``eval_frequency=N`` and ``end_auto_eval=N``).
        strict_metric_reporting: raise an error when a metric is not in the history (otherwise log a
            warning and report the others).
        list_tracked_metrics: also log the names of all metrics in the history.
        execution_order: position among the callbacks; the default 2 runs after the evaluation callbacks.

    Raises:
        TypeError: a bad ``metrics`` list.
        ValueError: a bad ``report_frequency``.
    """

    def __init__(self, metrics: Sequence[str], on_each_epoch: bool = True, report_frequency: Optional[int] = None,
                 strict_metric_reporting: bool = True, list_tracked_metrics: bool = False, execution_order: int = 2):
        super().__init__("Model performance print report", execution_order=execution_order)
        if isinstance(metrics, str) or not isinstance(metrics, Sequence) or len(metrics) == 0:
            raise TypeError(f"metrics must be a non-empty list of metric names such as ['val_loss'], got {metrics!r}")
        not_names = [metric for metric in metrics if not isinstance(metric, str)]
        if not_names:
            raise TypeError(f"metrics must hold metric names (strings); these are not: {not_names!r}")
        _check_frequency(report_frequency, "report_frequency")
        self.metrics = list(metrics)
        self.on_each_epoch = on_each_epoch
        self.report_frequency = report_frequency
        self.strict_metric_reporting = strict_metric_reporting
        self.list_tracked_metrics = list_tracked_metrics

    def on_epoch_end(self) -> None:
        if self.on_each_epoch and _epoch_due(self.train_loop_obj.epoch, self.report_frequency):
            self.report(f"Epoch {self.train_loop_obj.epoch + 1}")  # counted from 1, as the epoch's summary line

    def on_train_end(self) -> None:
        self.print_performance_report(prefix=TRAIN_END_PREFIX)

    def print_performance_report(self, prefix: str = "") -> None:
        """Report the metrics now, preferring ``<prefix><metric>`` where the history has it (aitoolbox 1.x name)."""
        self.report("End of training" if prefix == TRAIN_END_PREFIX else f"Epoch {self.train_loop_obj.epoch + 1}",
                    prefix=prefix)

    def report(self, heading: str, prefix: str = "") -> None:
        """Log the latest value of each metric under ``heading``.

        Args:
            heading: the report's first line.
            prefix: report ``<prefix><metric>`` instead of ``<metric>`` where the history has it.

        Raises:
            ValueError: with ``strict_metric_reporting``, when a metric is not in the training history.
        """
        history = self.train_loop_obj.train_history
        tracked = list(history.keys())
        names = {metric: f"{prefix}{metric}" if prefix and history.get(f"{prefix}{metric}") else metric
                 for metric in self.metrics}
        missing = [metric for metric in self.metrics if not history.get(names[metric])]
        if missing and self.strict_metric_reporting:
            raise ValueError(f"cannot report {missing}: not in the training history. Tracked metrics: {tracked}. "
                             "Add an evaluation callback that computes them, or pass "
                             "strict_metric_reporting=False to skip missing metrics")
        if not self.train_loop_obj.is_main_process:
            return
        if missing:
            logger.warning("Metrics %s are not in the training history (tracked: %s); not reported", missing, tracked)
        lines = [f"{names[metric]}: {history[names[metric]][-1]}" for metric in self.metrics if metric not in missing]
        logger.info("%s performance report\n  %s", heading, "\n  ".join(lines) if lines else "(nothing to report)")
        if self.list_tracked_metrics:
            logger.info("Tracked metrics: %s", tracked)
