"""ModelPerformanceEvaluation and ModelPerformancePrintReport on a real TrainLoop over a tiny classification task."""
import argparse
import logging

import pytest
import torch
from sklearn import metrics
from torch import nn

from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage, GeneralResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.callbacks.performance_eval import ModelPerformanceEvaluation, ModelPerformancePrintReport
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import (
    distinct_records,
    IN_FEATURES,
    MLP,
    NUM_CLASSES,
    assert_params_equal,
    classification_data,
    model_pair,
    seeded_loader,
)

REPORT_LOGGER = "aitoolbox.torchtrain.callbacks.performance_eval"
VAL_SAMPLES, BATCH_SIZE = 20, 8
VAL_BATCHES = 3  # ceil(20 / 8)


class LogitsClassifier(TTModel):
    """A linear classifier whose predictions are the (N, C) logits; the result package takes the argmax."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, NUM_CLASSES)

    def forward(self, x):
        return self.fc(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).cpu(), y.cpu(), None


def make_train_loop(model=None, validation=True, test=False, **kwargs) -> TrainLoop:
    if model is None:
        torch.manual_seed(0)
        model = LogitsClassifier()
    val_data, test_data = classification_data(VAL_SAMPLES, seed=20), classification_data(12, seed=30)
    return TrainLoop(model, seeded_loader(classification_data(40), batch_size=BATCH_SIZE),
                     seeded_loader(val_data, batch_size=BATCH_SIZE, shuffle=False) if validation else None,
                     seeded_loader(test_data, batch_size=BATCH_SIZE, shuffle=False) if test else None,
                     torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), show_progress=False,
                     **kwargs)


class HandWrittenValAccuracy(AbstractCallback):
    """Validation accuracy at each epoch end, computed with plain PyTorch and sklearn (after the evaluation)."""

    def __init__(self):
        super().__init__("hand-written accuracy", execution_order=1)
        self.accuracies = []

    def on_epoch_end(self):
        model = self.train_loop_obj.model
        x, y = classification_data(VAL_SAMPLES, seed=20).tensors
        model.eval()
        with torch.no_grad():
            predicted = model(x).argmax(dim=1)
        model.train()
        self.accuracies.append(metrics.accuracy_score(y.numpy(), predicted.numpy()))


class PackageProbe(AbstractCallback):
    """After the evaluation: keeps the callback's latest validation package and a package prepared afresh."""

    def __init__(self, evaluation: ModelPerformanceEvaluation):
        super().__init__("probe", execution_order=1)
        self.evaluation = evaluation
        self.packages, self.fresh_results, self.history_seen = [], [], []

    def on_epoch_end(self):
        y_pred, y_true, _ = self.train_loop_obj.predict_on_validation_set()
        self.fresh_results.append(ClassificationResultPackage().prepare_result_package(y_true, y_pred).get_results())
        self.packages.append(dict(self.evaluation.result_package.get_results()))
        self.history_seen.append(dict(self.train_loop_obj.train_history))


class CountingLoader:
    """A loader that counts the passes over it."""

    def __init__(self, loader):
        self.loader, self.passes = loader, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


# --- ModelPerformanceEvaluation ---------------------------------------------------------------------------
def test_val_metrics_in_history_equal_the_package_on_the_predictions():
    tl = make_train_loop()
    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage(), {"lr": 0.5})
    probe, hand_written = PackageProbe(evaluation), HandWrittenValAccuracy()
    tl.fit(num_epochs=3, callbacks=[probe, hand_written, evaluation])
    assert tl.train_history["val_Accuracy"] == [results["Accuracy"] for results in probe.fresh_results]
    assert tl.train_history["val_Accuracy"] == hand_written.accuracies
    assert len(set(hand_written.accuracies)) > 1  # the model learns: the check is not vacuous
    assert all(type(value) is float for value in tl.train_history["val_Accuracy"])
    assert "train_Accuracy" not in tl.train_history and "test_Accuracy" not in tl.train_history


def test_the_given_package_holds_the_validation_results_and_copies_the_others():
    tl = make_train_loop(test=True)
    package = ClassificationResultPackage()
    evaluation = ModelPerformanceEvaluation(package, {"lr": 0.5}, on_train_data=True, on_test_data=True)
    probe = PackageProbe(evaluation)
    tl.fit(num_epochs=2, callbacks=[evaluation, probe])
    assert evaluation.result_package is package  # prepared in place, as in aitoolbox 1.x
    assert [results["Accuracy"] for results in probe.packages] == tl.train_history["val_Accuracy"]
    assert package.get_hyperparameters() == {"lr": 0.5}
    assert evaluation.train_result_package is not package and evaluation.test_result_package is not package
    only_val = ModelPerformanceEvaluation(ClassificationResultPackage(), {})
    assert not hasattr(only_val, "train_result_package") and not hasattr(only_val, "test_result_package")


def test_train_val_and_test_metrics_with_prefixes():
    tl = make_train_loop(test=True)
    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage(), {}, on_train_data=True, on_val_data=True,
                                            on_test_data=True)
    tl.fit(num_epochs=2, callbacks=[evaluation])
    for prefix in ("train_", "val_", "test_"):
        assert len(tl.train_history[f"{prefix}Accuracy"]) == 2
    for package, predict in ((evaluation.train_result_package, tl.predict_on_train_set),
                             (evaluation.test_result_package, tl.predict_on_test_set)):
        y_pred, y_true, _ = predict()
        assert package.get_results()["Accuracy"] == metrics.accuracy_score(y_true.numpy(),
                                                                           y_pred.argmax(dim=1).numpy())
    assert tl.train_history["train_Accuracy"][-1] == evaluation.train_result_package.get_results()["Accuracy"]
    assert tl.train_history["test_Accuracy"][-1] == evaluation.test_result_package.get_results()["Accuracy"]


def top_class_share(y_true, y_pred):
    """The share of samples predicted as the most predicted class (any function of the predictions will do)."""
    labels = y_pred.argmax(axis=1)
    return (labels == torch.from_numpy(labels).mode().values.item()).mean()


def test_two_evaluation_callbacks_share_one_prediction_pass_per_epoch():
    tl = make_train_loop()
    tl.validation_loader = CountingLoader(tl.validation_loader)
    callbacks = [ModelPerformanceEvaluation(ClassificationResultPackage(), {}),
                 ModelPerformanceEvaluation(GeneralResultPackage([("Top_class_share", top_class_share)]), {})]
    tl.fit(num_epochs=2, callbacks=callbacks)
    # per epoch one pass for val_loss and one prediction pass for both callbacks (and the train-end evaluation)
    assert tl.validation_loader.passes == 2 * 2
    assert len(tl.train_history["val_Accuracy"]) == len(tl.train_history["val_Top_class_share"]) == 2


def test_two_callbacks_on_two_sets_share_one_pass_per_set():
    tl = make_train_loop()
    tl.train_loader = CountingLoader(tl.train_loader)
    tl.validation_loader = CountingLoader(tl.validation_loader)
    callbacks = [ModelPerformanceEvaluation(ClassificationResultPackage(), {}, on_train_data=True),
                 ModelPerformanceEvaluation(GeneralResultPackage([("Top_class_share", top_class_share)]), {},
                                            on_train_data=True)]
    tl.fit(num_epochs=1, callbacks=callbacks)
    # train set: training, the loss, one prediction pass; validation set: the loss, one prediction pass
    assert (tl.train_loader.passes, tl.validation_loader.passes) == (3, 2)


def test_eval_frequency():
    tl = make_train_loop()
    probe_epochs = []

    class EpochProbe(AbstractCallback):
        def on_epoch_end(self):
            probe_epochs.append(len(self.train_loop_obj.train_history.get("val_Accuracy", [])))

    tl.fit(num_epochs=5, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), {}, eval_frequency=2),
                                    EpochProbe("probe", execution_order=1)])
    assert probe_epochs == [0, 1, 1, 2, 2]  # evaluated at epochs 2 and 4 (counted from 1), as end_auto_eval=2


def test_eval_frequency_evaluates_in_the_epochs_of_end_auto_eval():
    """Review of issue 35, friction 10: eval_frequency=2 and end_auto_eval=2 record in the same epochs (2, 4, 6
    counted from 1; the metric used to come at 1, 3, 5), so a report shows each epoch's loss with its metrics."""
    tl = make_train_loop(end_auto_eval=2)
    recorded = []

    class EpochProbe(AbstractCallback):
        def on_epoch_end(self):
            history = self.train_loop_obj.train_history
            recorded.append((len(history.get("val_loss", [])), len(history.get("val_Accuracy", []))))

    tl.fit(num_epochs=4, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), {}, eval_frequency=2),
                                    EpochProbe("probe", execution_order=1)])
    assert recorded == [(0, 0), (1, 1), (1, 1), (2, 2)]


def test_ranking_and_stopping_by_a_metric_evaluated_every_few_epochs_wait_for_its_first_evaluation(tmp_path):
    """The first epoch no longer evaluates with eval_frequency=2: ModelCheckpoint and EarlyStopping on val_Accuracy
    wait for it instead of reporting the metric missing."""
    tl = make_train_loop(end_auto_eval=2)
    checkpoint = ModelCheckpoint("proj", "exp", str(tmp_path), rm_subopt_local_models="val_Accuracy",
                                 num_best_checkpoints_kept=1)
    stopping = EarlyStopping(monitor="val_Accuracy", patience=5)
    tl.fit(num_epochs=4, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), {}, eval_frequency=2),
                                    checkpoint, stopping])
    assert len(tl.train_history["val_Accuracy"]) == 2
    assert checkpoint.best_model_score == max(tl.train_history["val_Accuracy"])
    assert stopping.best_epoch in (1, 3)  # 0-based: an epoch that was evaluated


def test_evaluation_at_train_end_is_recorded_with_the_train_end_prefix():
    tl = make_train_loop()
    seen_during_epochs = []

    class EpochProbe(AbstractCallback):
        def on_epoch_end(self):
            seen_during_epochs.append(bool(self.train_loop_obj.train_history.get("val_Accuracy")))

    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage(), {}, on_each_epoch=False)
    tl.fit(num_epochs=3, callbacks=[evaluation, EpochProbe("probe")])
    assert seen_during_epochs == [False, False, False] and "val_Accuracy" not in tl.train_history
    y_pred, y_true, _ = tl.predict_on_validation_set()
    expected = metrics.accuracy_score(y_true.numpy(), y_pred.argmax(dim=1).numpy())
    assert tl.train_history["train_end_val_Accuracy"] == [expected]
    # evaluating at every epoch as well: the train-end value is the last epoch's (same model, cached predictions)
    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[ModelPerformanceEvaluation(ClassificationResultPackage(), {})])
    assert tl.train_history["train_end_val_Accuracy"] == tl.train_history["val_Accuracy"][-1:]


class LossNeedingPackage(ClassificationResultPackage):
    """Records the loss it is given with the predictions (aitoolbox 1.x's ``requires_loss``)."""

    def __init__(self):
        super().__init__()
        self.requires_loss = True

    def prepare_results_dict(self):
        return {"loss_seen": self.additional_results["additional_results"]["loss"]}


def test_a_package_requiring_the_loss_gets_it_without_changing_the_cached_metadata():
    class MetadataModel(LogitsClassifier):
        def get_predictions(self, batch_data, device):
            y_pred, y_true, _ = super().get_predictions(batch_data, device)
            return y_pred, y_true, {"ids": [0] * len(y_true)}

    torch.manual_seed(0)
    tl = make_train_loop(MetadataModel())
    tl.fit(num_epochs=1, callbacks=[ModelPerformanceEvaluation(LossNeedingPackage(), {}, on_train_data=True)])
    assert tl.train_history["val_loss_seen"] == [pytest.approx(tl.evaluate_loss_on_validation_set().item())]
    assert tl.train_history["train_loss_seen"] == [pytest.approx(tl.evaluate_loss_on_train_set().item())]
    assert set(tl.predict_on_validation_set()[2]) == {"ids"}


class StreamingMetric:
    """Stands in for a torchmetrics metric: counts resets and remembers its device."""

    def __init__(self):
        self.resets, self.device = 0, None

    def to(self, device):
        self.device = device
        return self

    def reset(self):
        self.resets += 1


class StreamingPackage(ClassificationResultPackage):
    def __init__(self):
        super().__init__()
        self.metric = StreamingMetric()

    def metric_reset(self):
        self.metric.reset()


def test_streaming_metric_packages_are_moved_to_the_device_and_reset_every_epoch():
    tl = make_train_loop()
    evaluation = ModelPerformanceEvaluation(StreamingPackage(), {}, on_train_data=True, eval_frequency=2)
    tl.fit(num_epochs=3, callbacks=[evaluation])
    for package in (evaluation.result_package, evaluation.train_result_package):
        assert package.metric.device == tl.device
        assert package.metric.resets == 3  # also in epochs without an evaluation


def test_on_exception_resets_streaming_metrics_for_the_next_fit():
    tl = make_train_loop()
    evaluation = ModelPerformanceEvaluation(StreamingPackage(), on_train_data=True)
    tl.callbacks_handler.register_callbacks([evaluation])
    tl.callbacks_handler.on_exception(KeyboardInterrupt())  # e.g. stopped inside an evaluation pass
    assert [package.metric.resets for package in (evaluation.result_package, evaluation.train_result_package)] == [1, 1]


def test_packages_learn_the_experiment_folder_of_a_tracking_loop(tmp_path):
    class FolderPackage(ClassificationResultPackage):
        def set_experiment_dir_path_for_additional_results(self, project_name, experiment_name, experiment_timestamp,
                                                           local_model_result_folder_path):
            self.folder = (project_name, experiment_name, experiment_timestamp, local_model_result_folder_path)

    tl = make_train_loop()
    tl.project_name, tl.experiment_name, tl.local_model_result_folder_path = "proj", "exp", str(tmp_path)
    told, not_told = FolderPackage(), FolderPackage()
    tl.callbacks_handler.register_callbacks([
        ModelPerformanceEvaluation(told, {}),
        ModelPerformanceEvaluation(not_told, {}, if_available_output_to_project_dir=False)])
    assert told.folder == ("proj", "exp", tl.experiment_timestamp, str(tmp_path))
    assert not hasattr(not_told, "folder")


def test_evaluation_does_not_change_training():
    """Prediction passes (the shuffled train loader included) leave the training run bitwise the same."""
    model_a, model_b = model_pair(MLP)
    with_eval, without_eval = make_train_loop(model_a, test=True), make_train_loop(model_b, test=True)
    torch.manual_seed(1)
    with_eval.fit(num_epochs=3, callbacks=[
        ModelPerformanceEvaluation(ClassificationResultPackage(), {}, on_train_data=True, on_test_data=True)])
    torch.manual_seed(1)
    without_eval.fit(num_epochs=3)
    assert_params_equal(model_a, model_b)
    assert with_eval.train_history["loss"] == without_eval.train_history["loss"]


def test_args_are_copied_and_namespace_accepted():
    args = {"lr": 0.5}
    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage(), args)
    args["lr"] = 1.0
    assert evaluation.args == {"lr": 0.5}
    namespace = ModelPerformanceEvaluation(ClassificationResultPackage(), argparse.Namespace(lr=0.1, epochs=3))
    assert namespace.args == {"lr": 0.1, "epochs": 3}
    assert ModelPerformanceEvaluation(ClassificationResultPackage(), None).args == {}


def test_args_are_optional_and_the_packages_get_an_empty_dict():
    hyperparameters_seen = []

    class Probe(ClassificationResultPackage):
        def prepare_result_package(self, y_true, y_predicted, hyperparameters=None, **kwargs):
            hyperparameters_seen.append(hyperparameters)
            return super().prepare_result_package(y_true, y_predicted, hyperparameters=hyperparameters, **kwargs)

    evaluation = ModelPerformanceEvaluation(Probe())
    assert evaluation.args == {}
    tl = make_train_loop()
    tl.fit(num_epochs=1, callbacks=[evaluation])
    assert hyperparameters_seen == [{}, {}]  # the epoch end and the end of training
    assert len(tl.train_history["val_Accuracy"]) == 1 and len(tl.train_history["train_end_val_Accuracy"]) == 1


@pytest.mark.parametrize("kwargs, error, match", [
    ({"result_package": {"Accuracy": None}}, TypeError, "AbstractResultPackage"),
    ({"result_package": ClassificationResultPackage}, TypeError, "AbstractResultPackage"),
    ({"args": [0.5]}, TypeError, "args"),
    ({"on_val_data": False}, ValueError, "at least one"),
    ({"eval_frequency": 0}, ValueError, "eval_frequency"),
    ({"eval_frequency": True}, ValueError, "eval_frequency"),
])
def test_evaluation_argument_errors(kwargs, error, match):
    arguments = {"result_package": ClassificationResultPackage(), "args": {}, **kwargs}
    with pytest.raises(error, match=match):
        ModelPerformanceEvaluation(**arguments)


@pytest.mark.parametrize("flags, missing", [({"on_val_data": True}, "validation_loader"),
                                            ({"on_test_data": True, "on_val_data": False}, "test_loader")])
def test_missing_loader_is_reported_before_training(flags, missing):
    tl = make_train_loop(validation=False)
    evaluation = ModelPerformanceEvaluation(ClassificationResultPackage(), {}, **flags)
    with pytest.raises(ValueError, match=f"no {missing}"):
        tl.fit(num_epochs=1, callbacks=[evaluation])
    assert tl.iterations_done == 0  # nothing trained


# --- ModelPerformancePrintReport ----------------------------------------------------------------------------
@pytest.fixture
def report_log(caplog, monkeypatch):
    """Capture the report logger's records even when the package logger does not propagate to the root."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO)

    def messages(level=logging.INFO):
        return [record.getMessage() for record in distinct_records(caplog)
                if record.name == REPORT_LOGGER and record.levelno == level]
    return messages


def test_print_report_logs_latest_values_after_evaluation(report_log):
    tl = make_train_loop()
    # Registered before the evaluation: execution_order (2 vs 0) still runs it after.
    report = ModelPerformancePrintReport(["val_loss", "val_Accuracy"])
    tl.fit(num_epochs=2, callbacks=[report, ModelPerformanceEvaluation(ClassificationResultPackage(), {})])
    messages = report_log()
    assert len(messages) == 3 and messages[2].startswith("End of training performance report")
    assert f"train_end_val_Accuracy: {tl.train_history['train_end_val_Accuracy'][0]}" in messages[2]
    assert f"val_loss: {tl.train_history['val_loss'][1]}" in messages[2]  # no train_end_ value: the latest
    for epoch, message in enumerate(messages[:2]):
        assert message.startswith(f"Epoch {epoch + 1} performance report")  # counted as the epoch line counts
        assert f"val_Accuracy: {tl.train_history['val_Accuracy'][epoch]}" in message
        assert f"val_loss: {tl.train_history['val_loss'][epoch]}" in message


def test_print_report_frequency_train_end_and_tracked_list(report_log):
    tl = make_train_loop()
    tl.fit(num_epochs=4, callbacks=[ModelPerformancePrintReport(["loss"], report_frequency=2)])
    assert [message.splitlines()[0] for message in report_log()] == [
        "Epoch 2 performance report", "Epoch 4 performance report", "End of training performance report"]
    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[ModelPerformancePrintReport(["loss"], on_each_epoch=False,
                                                                list_tracked_metrics=True)])
    last_two = report_log()[-2:]
    assert last_two[0] == f"End of training performance report\n  loss: {tl.train_history['loss'][-1]}"
    assert last_two[1] == "Tracked metrics: ['loss', 'accumulated_loss', 'val_loss']"


def test_print_report_strict_missing_metric_lists_tracked():
    tl = make_train_loop()
    with pytest.raises(ValueError, match=r"\['val_Accuracy'\].*Tracked metrics: \['loss', 'accumulated_loss', "
                                         r"'val_loss'\]"):
        tl.fit(num_epochs=1, callbacks=[ModelPerformancePrintReport(["val_loss", "val_Accuracy"])])


def test_print_report_lenient_skips_missing_metric(report_log):
    tl = make_train_loop()
    tl.fit(num_epochs=1, callbacks=[ModelPerformancePrintReport(["val_Accuracy", "val_loss"],
                                                                strict_metric_reporting=False)])
    assert "val_Accuracy" in report_log(logging.WARNING)[0]
    assert report_log()[0] == f"Epoch 1 performance report\n  val_loss: {tl.train_history['val_loss'][0]}"


@pytest.mark.parametrize("kwargs, error", [
    ({"metrics": "val_loss"}, TypeError),
    ({"metrics": []}, TypeError),
    ({"metrics": ["val_loss", 3]}, TypeError),
    ({"metrics": ["val_loss"], "report_frequency": -1}, ValueError),
])
def test_print_report_argument_errors(kwargs, error):
    with pytest.raises(error):
        ModelPerformancePrintReport(**kwargs)
