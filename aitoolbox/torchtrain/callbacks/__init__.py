"""Callbacks: code that runs at fixed points of the training loop (see :mod:`.abstract` for the hooks).

Every public callback class of the package's modules, and every LR scheduler callback of
:mod:`aitoolbox.torchtrain.schedulers`, is importable from here (``from
aitoolbox.torchtrain.callbacks import ModelCheckpoint``), besides the module paths aitoolbox 1.x used (``...callbacks.
model_save``); none of them imports TensorBoard, matplotlib or a cloud SDK before it is used.
"""
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, AbstractExperimentCallback
from aitoolbox.torchtrain.callbacks.basic import (
    AllPredictionsSame, DataSubsetTestRun, EarlyStopping, EmailNotification, FunctionOnTrainLoop,
    ListRegisteredCallbacks, LogUpload, TerminateOnNaN, ThresholdEarlyStopping)
from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback
from aitoolbox.torchtrain.callbacks.cloud_upload import CloudUploads
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.callbacks.ddp import DistributedSamplerSetEpoch, InMultiProcessDataLoad
from aitoolbox.torchtrain.callbacks.gradient import (
    GradDistributionPlot, GradientCallbackBase, GradientClipBase, GradientStatsPrint, GradNormClip, GradValueClip)
from aitoolbox.torchtrain.callbacks.history_format import MetricHistoryRename, TrainHistoryFormatter
from aitoolbox.torchtrain.callbacks.history_output import (
    ModelTrainHistoryBaseCB, ModelTrainHistoryFileWriter, ModelTrainHistoryPlot)
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.callbacks.spike_rollback import SpikeRollback
from aitoolbox.torchtrain.callbacks.performance_eval import ModelPerformanceEvaluation, ModelPerformancePrintReport
from aitoolbox.torchtrain.callbacks.profiler import ProfilerCallback
from aitoolbox.torchtrain.callbacks.tensorboard import (
    TensorboardFullTracking, TensorboardReporterBase, TensorboardReporterBaseCB, TensorboardTrainBatchLoss,
    TensorboardTrainHistoryMetric)
from aitoolbox.torchtrain.callbacks.throughput import ThroughputMonitor
from aitoolbox.torchtrain.callbacks.tracking_base import TrackingCallback
from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
from aitoolbox.torchtrain.callbacks.weight_averaging import WeightAveraging
from aitoolbox.torchtrain.schedulers.basic import (
    GeneralLRSchedulerCallback, LambdaLRScheduler, MultiStepLRScheduler, ReduceLROnPlateauMetricScheduler,
    ReduceLROnPlateauScheduler, StepLRScheduler)
from aitoolbox.torchtrain.schedulers.warmup import (
    ConstantWithWarmupScheduler, CosineWithWarmupScheduler, HardRestartsCosineWithWarmupScheduler,
    LinearWithWarmupScheduler)

__all__ = ["AbstractCallback", "AbstractExperimentCallback", "EarlyStopping", "ThresholdEarlyStopping",
           "EmailNotification", "TerminateOnNaN", "AllPredictionsSame", "LogUpload", "ModelPerformanceEvaluation",
           "ModelPerformancePrintReport", "ModelTrainHistoryFileWriter", "ModelTrainHistoryPlot", "GradNormClip",
           "GradValueClip", "TensorboardFullTracking", "TensorboardTrainHistoryMetric", "WandBTracking",
           "MLflowTracking", "CSVLogger", "WeightAveraging", "LinearWithWarmupScheduler", "ReduceLROnPlateauScheduler",
           "ReduceLROnPlateauMetricScheduler",
           "ProfilerCallback", "ThroughputMonitor", "SpikeRollback",
           # Exported since aitoolbox 1.8 had them only under their modules' paths (which keep working).
           "ModelCheckpoint", "ModelIterationCheckpoint", "ModelTrainEndSave", "ModelLoadContinueTraining",
           "CheckpointCallback", "ListRegisteredCallbacks", "FunctionOnTrainLoop", "DataSubsetTestRun",
           "DistributedSamplerSetEpoch", "InMultiProcessDataLoad", "GradientCallbackBase", "GradientClipBase",
           "GradientStatsPrint", "GradDistributionPlot", "MetricHistoryRename", "TrainHistoryFormatter",
           "ModelTrainHistoryBaseCB", "TensorboardReporterBaseCB", "TensorboardReporterBase",
           "TensorboardTrainBatchLoss", "TrackingCallback", "CloudUploads",
           # The LR scheduler callbacks, also importable from aitoolbox.torchtrain.schedulers as in 1.8.
           "GeneralLRSchedulerCallback", "LambdaLRScheduler", "StepLRScheduler", "MultiStepLRScheduler",
           "ConstantWithWarmupScheduler", "CosineWithWarmupScheduler", "HardRestartsCosineWithWarmupScheduler"]
