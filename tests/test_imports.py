"""aitoolbox 1.8's import surface: its star-exports and the module paths user code imports all work here.

Checked in fresh interpreters, so that what one import pulls in is not hidden by an earlier test's imports.
"""
import subprocess
import sys
import textwrap

import pytest

# What ``from aitoolbox import *`` gave a 1.8 user (the names its three star-exported packages defined).
TOP_LEVEL_NAMES = [
    "TrainLoop", "TrainLoopCheckpoint", "TrainLoopEndSave", "TrainLoopCheckpointEndSave", "TTModel", "ModelWrap",
    "MultiGPUModelWrap", "TTDataParallel", "AbstractModelFeedDefinition", "MultiLoss", "MultiOptimizer",
    "BasicDataset", "AbstractCallback", "AbstractExperimentCallback", "EarlyStopping", "ThresholdEarlyStopping",
    "EmailNotification", "TerminateOnNaN", "AllPredictionsSame", "LogUpload", "ModelPerformanceEvaluation",
    "ModelPerformancePrintReport", "ModelTrainHistoryFileWriter", "ModelTrainHistoryPlot", "GradNormClip",
    "GradValueClip", "TensorboardFullTracking", "TensorboardTrainHistoryMetric", "WandBTracking",
    "LinearWithWarmupScheduler", "ReduceLROnPlateauScheduler", "ReduceLROnPlateauMetricScheduler",
    "BinaryClassificationResultPackage", "ClassificationResultPackage", "RegressionResultPackage",
]

# Module paths of 1.8 that user scripts import, with a name each must provide.
MODULE_PATHS = {
    "aitoolbox.torchtrain.train_loop": "TrainLoopCheckpointEndSave",
    "aitoolbox.torchtrain.train_loop.train_loop": "TrainLoop",
    "aitoolbox.torchtrain.train_loop.train_loop_tracking": "TrainLoopCheckpoint",
    "aitoolbox.torchtrain.train_loop.components.pred_collate_fns": "append_concat_predictions",
    "aitoolbox.torchtrain.train_loop.components.callback_handler": "CallbacksHandler",
    "aitoolbox.torchtrain.train_loop.components.message_passing": "MessageService",
    "aitoolbox.torchtrain.model": "TTBasicModel",
    "aitoolbox.torchtrain.multi_loss_optim": "MultiOptimizer",
    "aitoolbox.torchtrain.model_predict": "PyTorchModelPredictor",
    "aitoolbox.torchtrain.parallel": "TTDistributedDataParallel",
    "aitoolbox.torchtrain.data.dataset": "ListDataset",
    "aitoolbox.torchtrain.data.batch_model_feed_defs": "AbstractModelFeedDefinition",
    "aitoolbox.torchtrain.callbacks.abstract": "AbstractExperimentCallback",
    "aitoolbox.torchtrain.callbacks.basic": "ListRegisteredCallbacks",
    "aitoolbox.torchtrain.callbacks.gradient": "GradientStatsPrint",
    "aitoolbox.torchtrain.callbacks.performance_eval": "MetricHistoryRename",
    "aitoolbox.torchtrain.callbacks.model_save": "ModelIterationCheckpoint",
    "aitoolbox.torchtrain.callbacks.model_load": "ModelLoadContinueTraining",
    "aitoolbox.torchtrain.callbacks.tensorboard": "TensorboardTrainBatchLoss",
    "aitoolbox.torchtrain.callbacks.ddp": "InMultiProcessDataLoad",
    "aitoolbox.torchtrain.callbacks.train_schedule": "LinearWithWarmupScheduler",
    "aitoolbox.torchtrain.schedulers.basic": "AbstractScheduler",
    "aitoolbox.torchtrain.schedulers.warmup": "HardRestartsCosineWithWarmupScheduler",
    "aitoolbox.experiment.training_history": "TrainingHistory",
    "aitoolbox.experiment.local_load.local_model_load": "PyTorchLocalModelLoader",
    "aitoolbox.experiment.local_save.local_model_save": "PyTorchLocalModelSaver",
    "aitoolbox.experiment.local_save.local_results_save": "LocalResultsSaver",
    "aitoolbox.experiment.local_save.folder_create": "ExperimentFolder",
    "aitoolbox.experiment.local_experiment_saver": "FullPyTorchExperimentLocalSaver",
    "aitoolbox.experiment.core_metrics.abstract_metric": "AbstractBaseMetric",
    "aitoolbox.experiment.core_metrics.classification": "AccuracyMetric",
    "aitoolbox.experiment.core_metrics.regression": "MeanSquaredErrorMetric",
    "aitoolbox.experiment.result_package.abstract_result_packages": "PreCalculatedResultPackage",
    "aitoolbox.experiment.result_package.basic_packages": "GeneralResultPackage",
    "aitoolbox.experiment.result_reporting.hyperparam_reporter": "HyperParamSourceReporter",
    "aitoolbox.experiment.result_reporting.report_generator": "TrainingHistoryPlotter",
    "aitoolbox.utils.dict_util": "flatten_dict",
    "aitoolbox.utils.file_system": "zip_folder",
    "aitoolbox.utils.util": "function_exists",
    "aitoolbox.torchtrain.tl_components.pred_collate_fns": "torch_cat_transf",
    "aitoolbox.torchtrain.tl_components.callback_handler": "CallbacksHandler",
    "aitoolbox.cloud": "s3_available_options",
    "aitoolbox.nlp.core.core": "find_sub_list",
    "aitoolbox.nlp.core.vocabulary": "Vocabulary",
    "aitoolbox.nlp.torch_collate_fns": "qa_concat_ctx_span_collate_fn",
    "aitoolbox.nlp.experiment_evaluation.NLP_metrics": "ROUGEMetric",
    "aitoolbox.nlp.experiment_evaluation.NLP_result_package": "QuestionAnswerResultPackage",
    "aitoolbox.nlp.experiment_evaluation.attention_heatmap": "AttentionHeatMap",
    "aitoolbox.cloud.AWS.model_save": "PyTorchS3ModelSaver",
    "aitoolbox.cloud.AWS.model_load": "PyTorchS3ModelLoader",
    "aitoolbox.cloud.AWS.results_save": "S3ResultsSaver",
    "aitoolbox.cloud.GoogleCloud.model_save": "PyTorchGoogleStorageModelSaver",
    "aitoolbox.cloud.GoogleCloud.model_load": "PyTorchGoogleStorageModelLoader",
}

# Packages that must not be imported just by importing aitoolbox (slow, optional, or cloud SDKs).
HEAVY_MODULES = ["tensorboard", "torch.utils.tensorboard", "matplotlib", "seaborn", "boto3", "botocore",
                 "google.cloud", "wandb", "torchmetrics", "evaluate", "nltk"]


def run_python(code: str) -> str:
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_star_exports_give_the_1x_names_without_heavy_imports():
    output = run_python(f"""
        import sys
        from aitoolbox import *
        from aitoolbox.torchtrain import *
        from aitoolbox.torchtrain.callbacks import *
        from aitoolbox.experiment import *
        missing = [name for name in {TOP_LEVEL_NAMES!r} if name not in globals()]
        heavy = [name for name in {HEAVY_MODULES!r} if name in sys.modules]
        print(missing, heavy)
    """)
    assert output.strip() == "[] []"


@pytest.mark.parametrize("module, name", sorted(MODULE_PATHS.items()))
def test_1x_module_paths_import(module, name):
    imported = __import__(module, fromlist=[name])
    assert hasattr(imported, name), f"{module} has no {name}"
