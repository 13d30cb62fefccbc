"""Every shipped callback that keeps state across epochs or batches saves it in checkpoints, and a run resumed from
a checkpoint behaves exactly as the uninterrupted run (issue 22, item 8).

The walk covers every AbstractCallback subclass defined in :mod:`aitoolbox.torchtrain.callbacks` and
:mod:`aitoolbox.torchtrain.schedulers` (their modules, not only their ``__all__``): a new callback fails
:func:`test_every_shipped_callback_is_walked` until it gets a factory here. For each, a straight run of
``NUM_EPOCHS`` epochs snapshots the callback's attributes after ``on_train_begin`` and at every epoch end; those that
change (references to the loop, model, optimizer or to foreign objects such as writers and clients do not count)
are its state. A callback with state must have ``state_dict``/``load_state_dict``, its checkpoint must load with
``weights_only=True``, and a run resumed in a new TrainLoop from the epoch-end checkpoint after ``CHECKPOINT_EPOCH``
must end as the straight run: the same epochs trained (early stopping stops at the same epoch), learning rates
(plateau schedulers reduce at the same epoch), history, weights and callback state.
"""
import importlib
import inspect
import io
import math
import os
import pkgutil
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import aitoolbox.torchtrain.callbacks as callbacks_package
import aitoolbox.torchtrain.schedulers as schedulers_package
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks import (
    basic, cloud_upload, csv_logger, ddp, gradient, history_format, history_output, mlflow, model_load, model_save,
    performance_eval, profiler, spike_rollback, stopping, tensorboard, throughput, wandb, weight_averaging)
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, AbstractExperimentCallback
from aitoolbox.torchtrain.callbacks.checkpoint_base import CheckpointCallback
from aitoolbox.torchtrain.callbacks.messages import MessageService
from aitoolbox.torchtrain.callbacks.tracking_base import TrackingCallback
from aitoolbox.torchtrain.schedulers import basic as schedulers, warmup
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.cloud.conftest import s3_env, s3_server  # noqa: F401  (fixtures: moto's S3 and SES on 127.0.0.1)
from tests.cloud.buckets import create_bucket, unique_bucket_name
from tests.helpers import MLP, classification_data, seeded_loader, single_torch_thread
from tests.torchtrain.callbacks.tracking_support import wandb_offline  # noqa: F401  (fixture)

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")

NUM_EPOCHS = 6
CHECKPOINT_EPOCH = 1  # the resumed run continues from the epoch-end checkpoint of this epoch
# A scripted validation metric: best at epoch 1, then two epochs without improvement, then improving again. Early
# stopping with patience 1 stops at epoch 3; a run resumed from epoch 1 with a fresh callback would not stop at all.
SCORES = [1.0, 0.8, 0.9, 0.85, 0.7, 0.6]

# Classes meant to be subclassed, not registered themselves.
BASES = {AbstractCallback, AbstractExperimentCallback, CheckpointCallback, TrackingCallback,
         gradient.GradientCallbackBase, gradient.GradientClipBase, history_output.ModelTrainHistoryBaseCB,
         tensorboard.TensorboardReporterBaseCB, warmup._PerStepWarmupScheduler}

# Attributes that change during a fit but are not saved in checkpoints, because a resumed run rebuilds them: from
# the training history the checkpoint holds, or afresh at every batch, optimizer step or evaluation. The resumed
# run must end with the same values as the straight one.
REBUILT = {"_logged_history_lengths", "_epoch_base_lengths", "_last_logged_epoch",  # tracking: from the history
           "_stepped", "_batch_steps",  # set at an optimizer step, cleared when the batch is logged or saved
           "_grads",  # the gradients of the last optimizer step
           "result_package",  # the metrics of the last evaluation, computed again at every one
           "_epoch_rngs",  # SpikeRollback: the epochs' starting RNG states, taken from the loop at their first batch
           # SpikeRollback: a fit's pin not yet settled (its first batch), batches left out for a non-finite state,
           # a fit's start not yet kept (its first on_epoch_begin)
           "_pins_unsettled", "_state_suspects", "_start_due"}
# Attributes naming files of the run folder (checkpoints written, open CSV files), which a resumed run finds on
# disk: they hold paths, which differ between the two runs' folders, so they are not compared.
RUN_FOLDER_FILES = {"saved_checkpoints", "_ranking_restored", "_written", "_earlier_listed",
                    "batch_table", "epoch_table", "trace_files",
                    "_epoch_steps_logged", "_rollback_texts"}  # TensorBoard: what this process's event files hold
# The connection to a service (MLflow, SES): its background sender and queue, and the service's own id of the run,
# which belongs to the service (each run of the test is another MLflow run; a resumed job continues one by
# passing run_id). Not training state, so neither saved nor compared.
SERVICE_CONNECTION = {"outbox", "_sender", "_next_sequence", "_run_open", "run_id"}
# Wall-clock measurements (ThroughputMonitor's rates of the last window and epoch, and when the last batch ended):
# every run measures its own, so they are neither saved nor compared, nor are the history entries holding them.
MEASURED = {"last_window", "last_epoch", "_postfix", "_last_batch_end"}
MEASURED_HISTORY = set(throughput.HISTORY_KEYS)
# A copy of the whole run a process holds in memory to return to (SpikeRollback's last clean point): each process
# keeps its own from its first optimizer step on, so neither saved nor compared. So SpikeRollback's notes of this
# process's fit: the losses pending at its first batch (for an error's advice) and the last pending loss judged clean
# (a resumed run judges them again, alike), and whether its start was not kept for a callback ordered before it.
PROCESS_MEMORY = {"_snapshot", "_started_with", "_judged_up_to", "_start_not_kept"}


class ScriptedScore(AbstractCallback):
    """Records ``SCORES[epoch]`` as ``val_score`` at each epoch end, before the callbacks that read it."""

    def __init__(self):
        super().__init__("scripted val_score", execution_order=-10)

    def on_epoch_end(self):
        self.train_loop_obj.insert_metric_result_into_history("val_score", SCORES[self.train_loop_obj.epoch])


class Observer(AbstractCallback):
    """Runs after every other callback: snapshots the watched callback after ``on_train_begin`` and at each epoch
    end, keeps the epoch-end checkpoint of CHECKPOINT_EPOCH (when ``checkpoint``) and records the learning rates."""

    def __init__(self, watched: AbstractCallback, checkpoint: bool):
        super().__init__("observer", execution_order=10 ** 6)
        self.watched, self.take_checkpoint = watched, checkpoint
        self.snapshots: List[Any] = []
        self.checkpoint: Optional[bytes] = None
        self.learning_rates: List[float] = []

    def on_train_begin(self):
        self.snapshots.append(fingerprint(vars(self.watched)))

    def on_epoch_end(self):
        self.snapshots.append(fingerprint(vars(self.watched)))
        self.learning_rates.append(self.train_loop_obj.optimizer.param_groups[0]["lr"])
        if self.take_checkpoint and self.train_loop_obj.epoch == CHECKPOINT_EPOCH:
            buffer = io.BytesIO()
            torch.save(self.train_loop_obj.checkpoint_state(mid_epoch=False), buffer)
            self.checkpoint = buffer.getvalue()


# --- what counts as state --------------------------------------------------------------------------------------
# The loop, the model, the optimizer, data, functions, and the run's configuration (its folder, the loop's message
# service): what a callback refers to, not state of its own.
REFERENCE_TYPES = (TrainLoop, nn.Module, torch.optim.Optimizer, DataLoader, torch.device, types.ModuleType,
                   types.FunctionType, types.MethodType, types.BuiltinFunctionType, type, ExperimentFolder,
                   MessageService)


def fingerprint(value: Any, depth: int = 0) -> Any:
    """A comparable picture of ``value``: plain data as it is, tensors cloned, objects with a ``state_dict`` (torch
    LR schedulers) by it, aitoolbox's own helper objects by their attributes, and references (the loop, the model,
    functions, foreign objects such as writers and clients) by identity only."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().clone())
    if isinstance(value, np.ndarray):
        return ("tensor", torch.from_numpy(value.copy())) if value.dtype != object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, REFERENCE_TYPES) or isinstance(value, AbstractCallback) or depth > 8:
        return ("reference", id(value))
    if isinstance(value, (list, tuple)):
        return [fingerprint(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {key: fingerprint(item, depth + 1) for key, item in value.items()}
    if type(value).__module__.startswith("torch.optim") and callable(getattr(value, "state_dict", None)):
        return ("state", fingerprint(value.state_dict(), depth + 1))
    if type(value).__module__.startswith("aitoolbox") and hasattr(value, "__dict__"):
        return ("object", type(value).__name__, fingerprint(vars(value), depth + 1))
    return ("reference", id(value))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and b[0] == "tensor" and a[1].shape == b[1].shape and torch.equal(a[1], b[1])
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def changed_attributes(snapshots: List[dict]) -> set:
    """The attributes whose picture differs between two consecutive snapshots."""
    changed = set()
    for before, after in zip(snapshots, snapshots[1:]):
        changed |= {name for name in set(before) | set(after)
                    if name not in before or name not in after or not same(before[name], after[name])}
    return changed


# --- the callbacks, one factory each ----------------------------------------------------------------------------
def first_layer(model: nn.Module) -> List[nn.Module]:
    return [model.fc1]


def experiment(tmp_path) -> dict:
    return dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path / "results"))


def saved_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "start.pth")
    if not os.path.exists(path):
        torch.manual_seed(0)
        tl = make_loop()
        torch.save(tl.checkpoint_state(), path)
    return path


def cloud(tmp_path, request) -> dict:
    """Experiment details for a callback writing to a new bucket of moto's S3 (the s3_env fixture)."""
    request.getfixturevalue("s3_env")
    name = unique_bucket_name("s3")
    create_bucket("s3", name)
    return dict(experiment(tmp_path), cloud_save_mode="s3", bucket_name=name, cloud_dir_prefix="team")


def email_callback(tmp_path, request):
    request.getfixturevalue("s3_env")
    import boto3
    boto3.session.Session().client("ses", region_name="eu-west-1").verify_email_identity(EmailAddress="bot@x.com")
    return basic.EmailNotification("bot", "bot@x.com", "me@x.com", project_name="proj", experiment_name="exp")


def log_upload(tmp_path, request):
    log_file = tmp_path / "training.log"
    log_file.write_text("a log line\n")
    return basic.LogUpload(str(log_file), **cloud(tmp_path, request))


def wandb_callback(tmp_path, request):
    request.getfixturevalue("wandb_offline")
    return wandb.WandBTracking(log_dir=str(tmp_path / "wandb"), is_project=False)


def mlflow_callback(tmp_path, request):
    request.getfixturevalue("monkeypatch").setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # no SQLite tables to create
    return mlflow.MLflowTracking(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment_name="exp")


PLATEAU = dict(mode="min", patience=1, factor=0.5)
Factory = Callable[[Any, Any], AbstractCallback]
FACTORIES: Dict[type, Factory] = {
    stopping.EarlyStopping: lambda tmp, req: stopping.EarlyStopping("val_score", patience=1, mode="min"),
    stopping.ThresholdEarlyStopping: lambda tmp, req: stopping.ThresholdEarlyStopping("val_score", 0.75, patience=2,
                                                                                         mode="min"),
    stopping.TerminateOnNaN: lambda tmp, req: stopping.TerminateOnNaN("accumulated_loss"),
    stopping.AllPredictionsSame: lambda tmp, req: stopping.AllPredictionsSame(value=0.5),
    basic.ListRegisteredCallbacks: lambda tmp, req: basic.ListRegisteredCallbacks(),
    basic.FunctionOnTrainLoop: lambda tmp, req: basic.FunctionOnTrainLoop(lambda tl: None, epoch_end=True),
    basic.DataSubsetTestRun: lambda tmp, req: basic.DataSubsetTestRun(num_train_batches=2),
    basic.EmailNotification: email_callback,
    basic.LogUpload: log_upload,
    cloud_upload.CloudUploads: lambda tmp, req: cloud_upload.CloudUploads(),
    csv_logger.CSVLogger: lambda tmp, req: csv_logger.CSVLogger(log_dir=str(tmp / "csv"), is_project=False),
    ddp.DistributedSamplerSetEpoch: lambda tmp, req: ddp.DistributedSamplerSetEpoch(None, None, None),
    ddp.InMultiProcessDataLoad: lambda tmp, req: ddp.InMultiProcessDataLoad(),
    gradient.GradValueClip: lambda tmp, req: gradient.GradValueClip(0.5),
    gradient.GradNormClip: lambda tmp, req: gradient.GradNormClip(0.5),
    gradient.GradientStatsPrint: lambda tmp, req: gradient.GradientStatsPrint(first_layer),
    gradient.GradDistributionPlot: lambda tmp, req: gradient.GradDistributionPlot(first_layer, **experiment(tmp)),
    history_format.TrainHistoryFormatter: lambda tmp, req: history_format.TrainHistoryFormatter(
        lambda history: history["val_score"], lambda values: ("best_score", min(values))),
    history_format.MetricHistoryRename: lambda tmp, req: history_format.MetricHistoryRename("val_score", "score"),
    history_output.ModelTrainHistoryPlot: lambda tmp, req: history_output.ModelTrainHistoryPlot(**experiment(tmp)),
    history_output.ModelTrainHistoryFileWriter: lambda tmp, req: history_output.ModelTrainHistoryFileWriter(
        **experiment(tmp)),
    mlflow.MLflowTracking: mlflow_callback,
    model_load.ModelLoadContinueTraining: lambda tmp, req: model_load.ModelLoadContinueTraining(
        saved_model_path=saved_checkpoint(tmp), **experiment(tmp)),
    model_save.ModelCheckpoint: lambda tmp, req: model_save.ModelCheckpoint(**experiment(tmp)),
    model_save.ModelIterationCheckpoint: lambda tmp, req: model_save.ModelIterationCheckpoint(3, **experiment(tmp)),
    model_save.ModelTrainEndSave: lambda tmp, req: model_save.ModelTrainEndSave(**experiment(tmp)),
    performance_eval.ModelPerformanceEvaluation: lambda tmp, req: performance_eval.ModelPerformanceEvaluation(
        ClassificationResultPackage(), if_available_output_to_project_dir=False),
    performance_eval.ModelPerformancePrintReport: lambda tmp, req: performance_eval.ModelPerformancePrintReport(
        ["val_score"]),
    profiler.ProfilerCallback: lambda tmp, req: profiler.ProfilerCallback(output_dir=str(tmp / "profiler")),
    tensorboard.TensorboardTrainBatchLoss: lambda tmp, req: tensorboard.TensorboardTrainBatchLoss(
        log_dir=str(tmp / "tb"), is_project=False),
    tensorboard.TensorboardTrainHistoryMetric: lambda tmp, req: tensorboard.TensorboardTrainHistoryMetric(
        log_dir=str(tmp / "tb"), is_project=False),
    tensorboard.TensorboardFullTracking: lambda tmp, req: tensorboard.TensorboardFullTracking(
        log_dir=str(tmp / "tb"), is_project=False),
    throughput.ThroughputMonitor: lambda tmp, req: throughput.ThroughputMonitor(window=2, peak_flops=1e9),
    wandb.WandBTracking: wandb_callback,
    weight_averaging.WeightAveraging: lambda tmp, req: weight_averaging.WeightAveraging(mode="ema", decay=0.9),
    spike_rollback.SpikeRollback: lambda tmp, req: spike_rollback.SpikeRollback(window=4, warmup=2, snapshot_every=4),
    schedulers.GeneralLRSchedulerCallback: lambda tmp, req: schedulers.GeneralLRSchedulerCallback(
        torch.optim.lr_scheduler.ExponentialLR, gamma=0.9),
    schedulers.LambdaLRScheduler: lambda tmp, req: schedulers.LambdaLRScheduler(lambda step: 1 / (step + 1)),
    schedulers.StepLRScheduler: lambda tmp, req: schedulers.StepLRScheduler(2, gamma=0.5),
    schedulers.MultiStepLRScheduler: lambda tmp, req: schedulers.MultiStepLRScheduler([1, 3], gamma=0.5),
    schedulers.ReduceLROnPlateauScheduler: lambda tmp, req: schedulers.ReduceLROnPlateauScheduler(
        mode="min", patience=0, factor=0.5, threshold=0.5),
    schedulers.ReduceLROnPlateauMetricScheduler: lambda tmp, req: schedulers.ReduceLROnPlateauMetricScheduler(
        "val_score", **PLATEAU),
    warmup.ConstantWithWarmupScheduler: lambda tmp, req: warmup.ConstantWithWarmupScheduler(7),
    warmup.LinearWithWarmupScheduler: lambda tmp, req: warmup.LinearWithWarmupScheduler(7, 30),
    warmup.CosineWithWarmupScheduler: lambda tmp, req: warmup.CosineWithWarmupScheduler(7, 30),
    warmup.HardRestartsCosineWithWarmupScheduler: lambda tmp, req: warmup.HardRestartsCosineWithWarmupScheduler(
        7, 30, num_cycles=2),
}


def shipped_callback_classes() -> set:
    """Every AbstractCallback subclass defined in the callbacks and schedulers packages."""
    found = set()
    for package in (callbacks_package, schedulers_package):
        for module_info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{module_info.name}")
            found |= {obj for obj in vars(module).values() if inspect.isclass(obj)
                      and issubclass(obj, AbstractCallback) and obj.__module__.startswith(package.__name__)}
    return found


def make_loop() -> TrainLoop:
    torch.manual_seed(0)
    model = MLP()
    return TrainLoop(model, seeded_loader(classification_data(40), batch_size=8),
                     seeded_loader(classification_data(16, seed=20), batch_size=8, shuffle=False), None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)


def run(callback: AbstractCallback, checkpoint: Optional[bytes] = None) -> Tuple[TrainLoop, Observer]:
    """Train NUM_EPOCHS epochs with ``callback`` (from ``checkpoint`` when given) and an Observer."""
    tl = make_loop()
    if checkpoint is not None:
        tl.load_checkpoint(torch.load(io.BytesIO(checkpoint), weights_only=True))
    observer = Observer(callback, checkpoint=checkpoint is None)
    torch.manual_seed(1)
    tl.fit(num_epochs=NUM_EPOCHS, callbacks=[ScriptedScore(), callback, observer])
    return tl, observer


def unmeasured(history) -> dict:
    return {name: values for name, values in history.items() if name not in MEASURED_HISTORY}


def test_every_shipped_callback_is_walked():
    shipped = shipped_callback_classes()
    assert shipped - BASES - set(FACTORIES) == set(), "a shipped callback has no factory in this test"
    assert set(FACTORIES) <= shipped


@pytest.mark.parametrize("callback_class", sorted(FACTORIES, key=lambda cls: f"{cls.__module__}.{cls.__name__}"),
                         ids=lambda cls: cls.__name__)
def test_a_stateful_callback_saves_its_state_and_a_resumed_run_equals_the_straight_one(callback_class, tmp_path,
                                                                                       request, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a callback writes by default stays in the test's folder
    for folder in ("straight", "resumed"):
        (tmp_path / folder).mkdir()
    straight_callback = FACTORIES[callback_class](tmp_path / "straight", request)
    straight, straight_observer = run(straight_callback)
    changed = changed_attributes(straight_observer.snapshots)
    saved = changed - REBUILT - RUN_FOLDER_FILES - SERVICE_CONNECTION - MEASURED - PROCESS_MEMORY
    if saved:
        assert callable(getattr(straight_callback, "state_dict", None)) \
            and callable(getattr(straight_callback, "load_state_dict", None)), \
            f"{callback_class.__name__} keeps {sorted(saved)} across epochs but has no state_dict/load_state_dict"
    if not changed:
        return  # nothing carried from one epoch or batch to the next
    assert straight_observer.checkpoint is not None  # it loads with weights_only=True in run()

    resumed_callback = FACTORIES[callback_class](tmp_path / "resumed", request)
    resumed, resumed_observer = run(resumed_callback, straight_observer.checkpoint)

    assert resumed.epoch == straight.epoch and resumed.epochs_completed == straight.epochs_completed
    assert resumed_observer.learning_rates == straight_observer.learning_rates[CHECKPOINT_EPOCH + 1:]
    assert same(fingerprint(unmeasured(resumed.train_history)), fingerprint(unmeasured(straight.train_history)))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    final_straight, final_resumed = straight_observer.snapshots[-1], resumed_observer.snapshots[-1]
    for name in sorted(changed - RUN_FOLDER_FILES - SERVICE_CONNECTION - MEASURED - PROCESS_MEMORY):
        assert same(final_resumed.get(name), final_straight.get(name)), \
            f"{callback_class.__name__}.{name} differs after the resumed run"
