"""Tensorboard callbacks on a real TrainLoop: the event files are read back and compared with the loop's numbers."""
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
from aitoolbox.torchtrain.callbacks.tensorboard import (
    TensorboardFullTracking,
    TensorboardReporterBaseCB,
    TensorboardTrainBatchLoss,
    TensorboardTrainHistoryMetric,
)
from aitoolbox.torchtrain.callbacks.tracking_base import TrackingCallback
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

BATCHES_PER_EPOCH = 5  # 40 samples, batch size 8


def make_train_loop(optimizer_fn=None, test=False, end_auto_eval=True) -> TrainLoop:
    torch.manual_seed(0)
    model = MLP()
    optimizer = optimizer_fn(model) if optimizer_fn else torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainLoop(model, seeded_loader(classification_data(40), batch_size=8),
                     seeded_loader(classification_data(16, seed=20), batch_size=8, shuffle=False),
                     seeded_loader(classification_data(12, seed=30), batch_size=8, shuffle=False) if test else None,
                     optimizer, nn.CrossEntropyLoss(), end_auto_eval=end_auto_eval, show_progress=False)


def read_events(log_dir: str) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str):
    return [(event.step, event.value) for event in events.Scalars(tag)]


class BatchLossRecorder(AbstractCallback):
    """Records the loss of every batch (by global batch index) and the gradients of each epoch's last step."""

    def __init__(self):
        super().__init__("batch loss recorder")
        self.losses = {}  # total_iteration_idx -> (epoch, loss)
        self.last_grads = {}  # epoch -> {name: grad copy}

    def on_batch_end(self):
        tl = self.train_loop_obj
        self.losses[tl.total_iteration_idx] = (tl.epoch, tl.last_batch_loss.item())

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        self.last_grads[tl.epoch] = {name: param.grad.clone() for name, param in tl.model.named_parameters()}


def test_batch_loss_is_logged_every_n_batches_with_the_epoch_running_mean(tmp_path):
    tl, recorder = make_train_loop(), BatchLossRecorder()
    log_dir = tmp_path / "tb"
    tl.fit(num_epochs=2, callbacks=[TensorboardTrainBatchLoss(batch_log_frequency=2, log_dir=str(log_dir),
                                                              is_project=False), recorder])
    events = read_events(log_dir)
    assert sorted(events.Tags()["scalars"]) == ["train_loss/accumulated_batch_loss", "train_loss/last_batch_loss"]
    logged_steps = list(range(0, 2 * BATCHES_PER_EPOCH, 2))
    # Tensorboard stores float32 and the loss is float32: the values are exact.
    assert scalars(events, "train_loss/last_batch_loss") == [(step, recorder.losses[step][1]) for step in logged_steps]
    expected_means = []
    for step in logged_steps:
        epoch = recorder.losses[step][0]
        so_far = [loss for idx, (ep, loss) in recorder.losses.items() if ep == epoch and idx <= step]
        expected_means.append(sum(so_far) / len(so_far))
    accumulated = scalars(events, "train_loss/accumulated_batch_loss")
    assert [step for step, _ in accumulated] == logged_steps
    assert [value for _, value in accumulated] == pytest.approx(expected_means, rel=1e-6)


def test_history_metrics_are_logged_per_epoch_into_the_experiment_folder(tmp_path):
    tl = make_train_loop(test=True)
    folder_args = dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path))
    history_cb = TensorboardTrainHistoryMetric(**folder_args)
    batch_cb = TensorboardTrainBatchLoss(**folder_args)
    tl.fit(num_epochs=3, callbacks=[history_cb, batch_cb])

    # Both callbacks share one run folder; the events land in its tensorboard/ sub-folder.
    assert history_cb.experiment_folder is batch_cb.experiment_folder
    log_dir = history_cb.experiment_folder.tensorboard_dir
    assert history_cb.log_dir_path == log_dir and os.path.isdir(log_dir)
    assert os.listdir(tmp_path / "proj") == [os.path.basename(history_cb.experiment_folder.path)]
    events = read_events(log_dir)
    history = tl.train_history
    assert set(history) == {"accumulated_loss", "loss", "val_loss", "train_end_test_loss"}
    for name in ("accumulated_loss", "loss", "val_loss"):
        assert scalars(events, f"loss/{name}") == [(epoch, pytest.approx(value, rel=1e-6))
                                                   for epoch, value in enumerate(history[name])]
    assert scalars(events, "loss/train_end_test_loss") == [(2, pytest.approx(history["train_end_test_loss"][0],
                                                                             rel=1e-6))]
    assert len(events.Scalars("train_loss/last_batch_loss")) == 3 * BATCHES_PER_EPOCH


def test_listed_metrics_only_and_only_when_recorded(tmp_path):
    tl = make_train_loop(end_auto_eval=2)  # loss / val_loss exist only at epochs 1 and 3
    tl.insert_metric_result_into_history("val_Accuracy", 0.5)  # a metric with a value before training
    tl.fit(num_epochs=4, callbacks=[TensorboardTrainHistoryMetric(metric_names=["loss", "val_Accuracy"],
                                                                  log_dir=str(tmp_path), is_project=False)])
    events = read_events(tmp_path)
    assert sorted(events.Tags()["scalars"]) == ["loss/loss", "metrics/val_Accuracy"]
    assert [step for step, _ in scalars(events, "loss/loss")] == [1, 3]  # not repeated in between
    assert scalars(events, "metrics/val_Accuracy") == [(0, 0.5)]


def test_full_tracking_logs_learning_rates_and_histograms(tmp_path):
    def two_groups(model):
        return torch.optim.SGD([{"params": model.fc1.parameters(), "lr": 0.25},
                                {"params": model.fc2.parameters(), "lr": 0.125}])

    tl, recorder = make_train_loop(two_groups), BatchLossRecorder()
    callback = TensorboardFullTracking(batch_log_frequency=3, log_dir=str(tmp_path), is_project=False,
                                       log_param_histograms=True, log_grad_histograms=True, histogram_frequency=2)
    tl.fit(num_epochs=2, callbacks=[callback, recorder])
    events = read_events(tmp_path)
    tags = events.Tags()
    steps = list(range(0, 2 * BATCHES_PER_EPOCH, 3))
    assert scalars(events, "learning_rate/optimizer_0_group_0") == [(step, 0.25) for step in steps]
    assert scalars(events, "learning_rate/optimizer_0_group_1") == [(step, 0.125) for step in steps]
    assert [step for step, _ in scalars(events, "train_loss/last_batch_loss")] == steps
    assert "loss/val_loss" in tags["scalars"]
    names = [name for name, _ in tl.model.named_parameters()]
    assert sorted(tags["histograms"]) == sorted([f"parameters/{n}" for n in names] + [f"gradients/{n}" for n in names])
    parameters = dict(tl.model.named_parameters())
    for name in names:
        # histogram_frequency=2: only epoch 1; the final weights and the gradients of its last step.
        (param_event,) = events.Histograms(f"parameters/{name}")
        (grad_event,) = events.Histograms(f"gradients/{name}")
        assert param_event.step == grad_event.step == 1
        param, grad = parameters[name].detach(), recorder.last_grads[1][name]
        assert param_event.histogram_value.num == param.numel()
        assert param_event.histogram_value.sum == pytest.approx(param.double().sum().item(), rel=1e-5, abs=1e-6)
        assert grad_event.histogram_value.sum == pytest.approx(grad.double().sum().item(), rel=1e-5, abs=1e-6)
        assert grad_event.histogram_value.max == pytest.approx(grad.max().item(), rel=1e-6)


class FailAfter(AbstractCallback):
    """Stops training with an error at the end of the batch of this global index, as a crash would."""

    def __init__(self, step: int):
        super().__init__("fail after")
        self.step = step

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.step:
            raise RuntimeError("simulated crash")


def all_scalars(log_dir) -> dict:
    events = read_events(log_dir)
    return {tag: scalars(events, tag) for tag in events.Tags()["scalars"]}


def test_the_callbacks_share_the_tracking_schedule():
    for callback_class in (TensorboardTrainBatchLoss, TensorboardTrainHistoryMetric, TensorboardFullTracking):
        assert issubclass(callback_class, TrackingCallback)
        for own in ("on_batch_end", "batch_record", "new_history_metrics", "current_learning_rates"):
            assert own not in vars(callback_class) and own not in vars(TensorboardReporterBaseCB), own


def test_a_run_resumed_from_a_mid_epoch_checkpoint_logs_what_the_straight_run_logs(tmp_path):
    """Stopped at batch 7, resumed in a new TrainLoop from the checkpoint after batch 5 (inside epoch 1): the
    running mean of epoch 1 counts its batch 5, trained before the resume, as the straight run's does."""
    def full_tracking(name, **summary_writer_kwargs):
        return TensorboardFullTracking(log_dir=str(tmp_path / name), is_project=False, **summary_writer_kwargs)

    make_train_loop().fit(num_epochs=2, callbacks=[full_tracking("straight")])
    straight = all_scalars(tmp_path / "straight")

    folder_args = dict(project_name="proj", experiment_name="exp",
                       local_model_result_folder_path=str(tmp_path / "checkpoints"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_train_loop().fit(num_epochs=2, callbacks=[full_tracking("stopped"), FailAfter(7),
                                                       ModelIterationCheckpoint(3, **folder_args)])
    stopped = all_scalars(tmp_path / "stopped")
    (checkpoint,) = (tmp_path / "checkpoints" / "proj").rglob("*_ITER5.pth")
    resumed_loop = make_train_loop()
    resumed_loop.load_checkpoint(str(checkpoint))
    resumed_loop.fit(num_epochs=2, callbacks=[full_tracking("resumed")])
    resumed = all_scalars(tmp_path / "resumed")

    assert sorted(resumed) == sorted(straight)
    for tag, values in straight.items():
        # Batch tags are at the batch step, the history's at the epoch: the resumed run logs from batch 6 and
        # epoch 1 on; the stopped run logged what came before, as the straight run did.
        first_resumed = 1 if tag.startswith(("loss/", "metrics/")) else 6
        assert resumed[tag] == [(step, value) for step, value in values if step >= first_resumed], tag
        assert [(step, value) for step, value in stopped.get(tag, []) if step < first_resumed] == \
            [(step, value) for step, value in values if step < first_resumed], tag
    # The epoch's mean at its last batch is the history's accumulated_loss: over all 5 batches of epoch 1.
    assert resumed["train_loss/accumulated_batch_loss"][-1][1] == \
        pytest.approx(resumed_loop.train_history["accumulated_loss"][1], rel=1e-6)

    # Resumed into the interrupted run's folder with purge_step (the recipe of docs/tracking.rst), TensorBoard
    # hides what the interrupted run logged from batch 6 on: the folder reads as the straight run.
    resumed_again = make_train_loop()
    resumed_again.load_checkpoint(str(checkpoint))
    resumed_again.fit(num_epochs=2, callbacks=[full_tracking("stopped", purge_step=6)])
    assert all_scalars(tmp_path / "stopped") == straight


class TwoLossMLP(MLP):
    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0].to(device), batch_data[1].to(device)
        logits = self(x)
        return MultiLoss({"ce": criterion(logits, y), "l2": 1e-3 * (logits ** 2).mean()})


def test_a_multi_loss_gets_a_tag_per_loss(tmp_path):
    torch.manual_seed(0)
    model = TwoLossMLP()
    template = make_train_loop()
    tl = TrainLoop(model, template.train_loader, template.validation_loader, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), template.criterion, show_progress=False)
    tl.fit(num_epochs=1, callbacks=[TensorboardTrainBatchLoss(log_dir=str(tmp_path), is_project=False)])
    names = tl.last_batch_loss_names
    logged = all_scalars(tmp_path)
    assert sorted(logged) == sorted(f"train_loss/{kind}_batch_loss_{name}"
                                    for kind in ("last", "accumulated") for name in names)
    for position, name in enumerate(names):
        mean_at_epoch_end = logged[f"train_loss/accumulated_batch_loss_{name}"][-1]
        assert mean_at_epoch_end == (BATCHES_PER_EPOCH - 1, pytest.approx(
            tl.train_history[f"accumulated_loss_{name}"][0], rel=1e-6)), name


def test_per_optimizer_step_logging_with_the_learning_rate_each_step_used(tmp_path):
    from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
    tl = make_train_loop()
    # Halves the learning rate after every second optimizer step, after the step.
    scheduler = StepLRScheduler(step_size=2, gamma=0.5, step_per_optimizer_step=True)
    callback = TensorboardFullTracking(batch_log_frequency="step", log_dir=str(tmp_path), is_project=False)
    tl.fit(num_epochs=2, callbacks=[scheduler, callback], grad_accumulation=2)
    # 5 batches an epoch, accumulating 2: steps after batches 1, 3 and the epoch's last, 4.
    steps = [1, 3, 4, 6, 8, 9]
    logged = all_scalars(tmp_path)
    assert [step for step, _ in logged["train_loss/last_batch_loss"]] == steps
    assert logged["learning_rate/optimizer_0_group_0"] == [(step, pytest.approx(0.1 * 0.5 ** (index // 2)))
                                                           for index, step in enumerate(steps)]


def test_uses_the_preset_experiment_folder(tmp_path):
    tl = make_train_loop()
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp")  # as TrainLoopCheckpoint sets it
    callback = TensorboardTrainBatchLoss()
    tl.fit(num_epochs=1, callbacks=[callback])
    assert callback.experiment_folder is tl.experiment_folder
    assert len(read_events(tl.experiment_folder.tensorboard_dir).Scalars("train_loss/last_batch_loss")) == 5


def test_relative_log_dir_is_inside_the_experiment_folder(tmp_path):
    tl = make_train_loop()
    tl.experiment_folder = ExperimentFolder(str(tmp_path), "proj", "exp")
    callback = TensorboardTrainHistoryMetric(log_dir="my_logs")
    tl.fit(num_epochs=1, callbacks=[callback])
    assert callback.log_dir_path == os.path.join(tl.experiment_folder.path, "my_logs")
    assert read_events(callback.log_dir_path).Scalars("loss/loss")


def test_writer_is_closed_at_train_end_and_a_second_fit_appends(tmp_path):
    tl = make_train_loop()
    callback = TensorboardTrainHistoryMetric(metric_names=["loss"], log_dir=str(tmp_path), is_project=False)
    tl.fit(num_epochs=1, callbacks=[callback])
    assert callback.tb_writer is None
    tl.fit(num_epochs=3)
    assert [step for step, _ in scalars(read_events(tmp_path), "loss/loss")] == [0, 1, 2]


def test_on_exception_flushes_and_closes_the_writers_and_the_next_fit_opens_new_ones(tmp_path):
    tl = make_train_loop()
    threads_before = set(threading.enumerate())
    callbacks = [TensorboardTrainHistoryMetric(metric_names=["loss"], log_dir=str(tmp_path / "history"),
                                               is_project=False, flush_secs=3600),
                 TensorboardFullTracking(log_dir=str(tmp_path / "full"), is_project=False, log_grad_histograms=True,
                                         flush_secs=3600)]
    tl.callbacks_handler.register_callbacks(callbacks)
    tl.callbacks_handler.on_train_begin()  # as fit starts: the writers (and their writer threads) open
    callbacks[0].tb_writer.add_scalar("loss/loss", 0.5, 0)
    callbacks[1].tb_writer.add_scalar("train_loss/last_batch_loss", 0.25, 0)
    callbacks[1]._last_step_grads = {"fc1.weight": torch.ones(2)}
    assert set(threading.enumerate()) - threads_before  # something to close

    tl.callbacks_handler.on_exception(KeyboardInterrupt())
    assert [callback.tb_writer for callback in callbacks] == [None, None]
    assert callbacks[1]._last_step_grads == {}
    assert not set(threading.enumerate()) - threads_before
    # Flushed, although flush_secs would have waited an hour.
    assert scalars(read_events(tmp_path / "history"), "loss/loss") == [(0, 0.5)]
    assert scalars(read_events(tmp_path / "full"), "train_loss/last_batch_loss") == [(0, 0.25)]

    tl.fit(num_epochs=2)
    assert sorted(step for step, _ in scalars(read_events(tmp_path / "history"), "loss/loss")) == [0, 0, 1]
    assert len(os.listdir(tmp_path / "history")) == 2  # the second fit wrote a new event file
    assert callbacks[1].tb_writer is None and not set(threading.enumerate()) - threads_before


def test_nothing_is_written_outside_the_main_process(tmp_path):
    tl = make_train_loop()
    tl.strategy.rank = 1  # as in a non-zero rank of a distributed run
    assert not tl.is_main_process
    callbacks = [TensorboardFullTracking(log_dir=str(tmp_path / "tb"), is_project=False, log_param_histograms=True,
                                         log_grad_histograms=True),
                 TensorboardTrainBatchLoss(project_name="p", experiment_name="e",
                                           local_model_result_folder_path=str(tmp_path / "exp"))]
    tl.fit(num_epochs=1, callbacks=callbacks)
    assert os.listdir(tmp_path) == []


def test_some_of_the_folder_information_fails_at_registration():
    """Given none, the callback writes into a plain loop's default run folder (test_default_run_folder.py)."""
    with pytest.raises(ValueError, match="project_name, experiment_name and local_model_result_folder_path"):
        make_train_loop().fit(num_epochs=1, callbacks=[TensorboardTrainBatchLoss(project_name="p")])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batch_log_frequency=0), ValueError, "batch_log_frequency"),
    (dict(batch_log_frequency=None), ValueError, "batch_log_frequency"),
    (dict(batch_log_frequency="epoch"), ValueError, "batch_log_frequency"),
    (dict(project_name="p/q"), ValueError, "project_name"),
    (dict(cloud_save_mode="ftp"), ValueError, "cloud_save_mode='ftp' is not one of"),
    (dict(log_dir=""), ValueError, "log_dir"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TensorboardTrainBatchLoss(**kwargs)


def test_is_project_false_without_log_dir_writes_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    callback = TensorboardTrainBatchLoss(is_project=False)  # aitoolbox 1.x default: ./tensorboard
    make_train_loop().fit(num_epochs=1, callbacks=[callback])
    assert callback.log_dir_path == str(tmp_path / "tensorboard")
    assert len(read_events(callback.log_dir_path).Scalars("train_loss/last_batch_loss")) == BATCHES_PER_EPOCH


class Custom1xReporter(TensorboardReporterBaseCB):
    """A tensorboard callback written against aitoolbox 1.x's base class methods."""

    def __init__(self, log_dir):
        super().__init__("custom reporter", log_dir=log_dir, is_project=False)

    def on_train_loop_registration(self):
        super().on_train_loop_registration()
        self.prepare_results_saver()

    def on_batch_end(self):
        self.log_mid_train_loss()
        self.global_step += 1

    def on_epoch_end(self):
        self.log_train_history_metrics(["loss", "val_loss", "not_recorded"])
        self.upload_to_cloud()
        super().on_epoch_end()


def test_a_callback_written_against_the_1x_base_class(tmp_path):
    tl = make_train_loop()
    recorder, callback = BatchLossRecorder(), Custom1xReporter(str(tmp_path))
    tl.fit(num_epochs=2, callbacks=[recorder, callback])
    events = read_events(tmp_path)
    assert scalars(events, "train_loss/last_batch_loss") == [
        (step, pytest.approx(loss)) for step, (_, loss) in sorted(recorder.losses.items())]
    assert scalars(events, "loss/val_loss") == [(epoch, pytest.approx(value))
                                                for epoch, value in enumerate(tl.train_history["val_loss"])]
    assert callback.global_step == 2 * BATCHES_PER_EPOCH
    assert callback.create_log_dir() == str(tmp_path)


def test_unknown_summary_writer_keyword_fails_at_registration(tmp_path):
    callback = TensorboardTrainBatchLoss(log_dir=str(tmp_path), is_project=False, flush_seconds=3)
    with pytest.raises(TypeError, match="flush_seconds"):
        make_train_loop().fit(num_epochs=1, callbacks=[callback])
    TensorboardTrainBatchLoss(log_dir=str(tmp_path), is_project=False, flush_secs=3)  # a real SummaryWriter keyword


def test_missing_tensorboard_is_an_import_error_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail as if absent
    callback = TensorboardTrainBatchLoss(log_dir=str(tmp_path), is_project=False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_train_loop().fit(num_epochs=1, callbacks=[callback])


def test_importing_the_callbacks_does_not_import_tensorboard_or_matplotlib():
    code = ("import sys\n"
            "import aitoolbox.torchtrain.callbacks.tensorboard, aitoolbox.torchtrain.callbacks.history_output\n"
            "import aitoolbox.torchtrain.callbacks.performance_eval, aitoolbox.torchtrain.train_loop\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'matplotlib')\n"
            "             or m == 'torch.utils.tensorboard'))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
