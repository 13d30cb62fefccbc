"""Callbacks that compute a result package's metrics during training and report them.

:class:`ModelPerformanceEvaluation` puts metrics such as ``val_Accuracy`` into the training history, where
early stopping, schedulers and :class:`ModelPerformancePrintReport` find them.
"""
import argparse
import copy
import logging
from collections.abc import Mapping
from typing import Any, List, Optional, Sequence

from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback

logger = logging.getLogger(__name__)

# (prefix in the history, TrainLoop prediction method, loader attribute) for each data set.
_DATASETS = {
    "train": ("train_", "predict_on_train_set", "train_loader"),
    "validation": ("val_", "predict_on_validation_set", "validation_loader"),
    "test": ("test_", "predict_on_test_set", "test_loader"),
}


def _check_frequency(value: Optional[int], name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (every epoch) or a positive int (every N epochs), got {value!r}")


def _epoch_due(epoch: int, frequency: Optional[int]) -> bool:
    """Every epoch, or every ``frequency`` epochs counting from the first (epochs 0-based: N-1, 2N-1, ...)."""
    return frequency is None or (epoch + 1) % frequency == 0


class ModelPerformanceEvaluation(AbstractCallback):
    """Evaluate a result package on the model's predictions and record its metrics in the training history.

    At the end of each epoch (or every ``eval_frequency`` epochs, or once at the end of training with
    ``on_each_epoch=False``) the callback asks the TrainLoop for its predictions on the chosen data sets,
    prepares a fresh copy of ``result_package`` for each set, and appends every metric to
    ``train_history`` under ``train_<metric>``, ``val_<metric>`` or ``test_<metric>`` (e.g.
    ``val_Accuracy``). The TrainLoop caches predictions within an iteration, so several of these
    callbacks on the same data set share one prediction pass.

    The packages of the latest evaluation stay available as ``train_result_package``,
    ``val_result_package`` and ``test_result_package`` (None for sets not evaluated yet), e.g. for saving.

    Under distributed training the callback runs in every process (predicting is a collective operation).

    Args:
        result_package: the metrics to compute, e.g. ``ClassificationResultPackage()``; never prepared
            itself (copies are).
        args: the experiment's hyperparameters (a dict, an ``argparse.Namespace`` or None), handed to the
            result packages.
        on_each_epoch: evaluate at epoch ends (True) or once at the end of training (False).
        on_train_data: evaluate on the training set.
        on_val_data: evaluate on the validation set.
        on_test_data: evaluate on the test set.
        eval_frequency: with ``on_each_epoch``, evaluate every this many epochs (None: every epoch).
        execution_order: position among the callbacks; the default 0 runs before reporting (order 2).

    Raises:
        TypeError: ``result_package`` is not a result package, or ``args`` is not a dict.
        ValueError: no data set chosen, a bad ``eval_frequency``, or (when registered with a TrainLoop) a
            chosen data set without a loader.
    """

    def __init__(self, result_package: AbstractResultPackage, args: Any, on_each_epoch: bool = True,
                 on_train_data: bool = False, on_val_data: bool = True, on_test_data: bool = False,
                 eval_frequency: Optional[int] = None, execution_order: int = 0):
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
        if eval_frequency is not None and not on_each_epoch:
            raise ValueError(f"eval_frequency={eval_frequency} applies to per-epoch evaluation; with "
                             "on_each_epoch=False the evaluation runs once at the end, so leave eval_frequency None")
        self.result_package = result_package
        self.args = dict(args) if args is not None else {}
        self.on_each_epoch = on_each_epoch
        self.on_train_data = on_train_data
        self.on_val_data = on_val_data
        self.on_test_data = on_test_data
        self.eval_frequency = eval_frequency
        self.train_result_package: Optional[AbstractResultPackage] = None
        self.val_result_package: Optional[AbstractResultPackage] = None
        self.test_result_package: Optional[AbstractResultPackage] = None

    @property
    def dataset_types(self) -> List[str]:
        """The data sets this callback evaluates, in the order it evaluates them."""
        chosen = {"train": self.on_train_data, "validation": self.on_val_data, "test": self.on_test_data}
        return [dataset_type for dataset_type, wanted in chosen.items() if wanted]

    def on_train_loop_registration(self) -> None:
        for dataset_type in self.dataset_types:
            loader_name = _DATASETS[dataset_type][2]
            if getattr(self.train_loop_obj, loader_name) is None:
                flag = {"train": "on_train_data", "validation": "on_val_data", "test": "on_test_data"}[dataset_type]
                raise ValueError(f"ModelPerformanceEvaluation has {flag}=True but the TrainLoop has no "
                                 f"{loader_name}: pass a {loader_name} to TrainLoop or set {flag}=False")

    def on_epoch_end(self) -> None:
        if self.on_each_epoch and _epoch_due(self.train_loop_obj.epoch, self.eval_frequency):
            self.evaluate_model_performance()

    def on_train_end(self) -> None:
        if not self.on_each_epoch:
            self.evaluate_model_performance()

    def evaluate_model_performance(self) -> None:
        """Evaluate on every chosen data set now and append the results to the training history."""
        tl = self.train_loop_obj
        for dataset_type in self.dataset_types:
            prefix, predict_method, _ = _DATASETS[dataset_type]
            y_pred, y_true, metadata = getattr(tl, predict_method)()
            # A fresh copy per evaluation, so packages handed out earlier keep their own results.
            package = copy.deepcopy(self.result_package)
            package.prepare_result_package(y_true, y_pred, hyperparameters=self.args,
                                           training_history=tl.train_history, metadata=metadata)
            for metric_name, value in package.get_results().items():
                tl.insert_metric_result_into_history(f"{prefix}{metric_name}", value)
            setattr(self, f"{prefix}result_package", package)


class ModelPerformancePrintReport(AbstractCallback):
    """Log the latest value of chosen metrics from the training history (main process only, INFO level).

    Args:
        metrics: names of tracked metrics, e.g. ``['val_loss', 'val_Accuracy']``.
        on_each_epoch: report at epoch ends (True) or once at the end of training (False).
        report_frequency: with ``on_each_epoch``, report every this many epochs (None: every epoch).
        strict_metric_reporting: raise an error when a metric is not in the history (otherwise log a
            warning and report the others).
        list_tracked_metrics: also log the names of all metrics in the history.
        execution_order: position among the callbacks; the default 2 runs after the evaluation callbacks.

    Raises:
        TypeError / ValueError: for a bad ``metrics`` list or ``report_frequency``.
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
        if report_frequency is not None and not on_each_epoch:
            raise ValueError(f"report_frequency={report_frequency} applies to per-epoch reports; with "
                             "on_each_epoch=False the report is logged once at the end, so leave it None")
        self.metrics = list(metrics)
        self.on_each_epoch = on_each_epoch
        self.report_frequency = report_frequency
        self.strict_metric_reporting = strict_metric_reporting
        self.list_tracked_metrics = list_tracked_metrics

    def on_epoch_end(self) -> None:
        if self.on_each_epoch and _epoch_due(self.train_loop_obj.epoch, self.report_frequency):
            self.report(f"Epoch {self.train_loop_obj.epoch}")

    def on_train_end(self) -> None:
        if not self.on_each_epoch:
            self.report("End of training")

    def report(self, heading: str) -> None:
        """Log the latest value of each metric under ``heading``.

        Raises:
            ValueError: with ``strict_metric_reporting``, when a metric is not in the training history.
        """
        history = self.train_loop_obj.train_history
        tracked = sorted(history.keys())
        missing = [metric for metric in self.metrics if not history.get(metric)]
        if missing and self.strict_metric_reporting:
            raise ValueError(f"cannot report {missing}: not in the training history. Tracked metrics: {tracked}. "
                             "Add an evaluation callback that computes them, or pass "
                             "strict_metric_reporting=False to skip missing metrics")
        if not self.train_loop_obj.is_main_process:
            return
        if missing:
            logger.warning("Metrics %s are not in the training history (tracked: %s); not reported", missing, tracked)
        lines = [f"{metric}: {history[metric][-1]}" for metric in self.metrics if metric not in missing]
        logger.info("%s performance report\n  %s", heading, "\n  ".join(lines) if lines else "(nothing to report)")
        if self.list_tracked_metrics:
            logger.info("Tracked metrics: %s", tracked)


# aitoolbox 1.x users import the history plot and file writer from this module; they live in history_output.
from aitoolbox.torchtrain.callbacks.history_output import ModelTrainHistoryFileWriter, ModelTrainHistoryPlot  # noqa: E402,F401,E501
