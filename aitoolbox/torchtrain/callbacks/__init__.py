"""Callbacks: code that runs at fixed points of the training loop (see :mod:`.abstract` for the hooks).

The callbacks aitoolbox 1.x exported from here stay importable (``from aitoolbox.torchtrain.callbacks import
EarlyStopping``); none of them imports TensorBoard, matplotlib or a cloud SDK before it is used.
"""
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, AbstractExperimentCallback
from aitoolbox.torchtrain.callbacks.basic import (
    AllPredictionsSame, EarlyStopping, EmailNotification, LogUpload, TerminateOnNaN, ThresholdEarlyStopping)
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip, GradValueClip
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollback
from aitoolbox.torchtrain.callbacks.performance_eval import (
    ModelPerformanceEvaluation, ModelPerformancePrintReport, ModelTrainHistoryFileWriter, ModelTrainHistoryPlot)
from aitoolbox.torchtrain.callbacks.profiler import ProfilerCallback
from aitoolbox.torchtrain.callbacks.tensorboard import TensorboardFullTracking, TensorboardTrainHistoryMetric
from aitoolbox.torchtrain.callbacks.throughput import ThroughputMonitor
from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
from aitoolbox.torchtrain.callbacks.weight_averaging import WeightAveraging
from aitoolbox.torchtrain.schedulers.basic import ReduceLROnPlateauMetricScheduler, ReduceLROnPlateauScheduler
from aitoolbox.torchtrain.schedulers.warmup import LinearWithWarmupScheduler

__all__ = ["AbstractCallback", "AbstractExperimentCallback", "EarlyStopping", "ThresholdEarlyStopping",
           "EmailNotification", "TerminateOnNaN", "AllPredictionsSame", "LogUpload", "ModelPerformanceEvaluation",
           "ModelPerformancePrintReport", "ModelTrainHistoryFileWriter", "ModelTrainHistoryPlot", "GradNormClip",
           "GradValueClip", "TensorboardFullTracking", "TensorboardTrainHistoryMetric", "WandBTracking",
           "MLflowTracking", "CSVLogger", "WeightAveraging", "LinearWithWarmupScheduler", "ReduceLROnPlateauScheduler",
           "ReduceLROnPlateauMetricScheduler",
           "ProfilerCallback", "ThroughputMonitor", "SpikeRollback"]
