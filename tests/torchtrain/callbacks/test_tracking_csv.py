"""CSVLogger on real TrainLoop runs: the files are read back and compared with what the loop computed."""
import csv
import json
import os

import pytest
import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback, MissingExperimentDetailsError
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger, CSVTable
from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss
from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopEndSave
from tests.helpers import MLP
from tests.torchtrain.callbacks import tracking_support as support
from tests.torchtrain.callbacks.tracking_support import BATCHES_PER_EPOCH, BatchRecorder, make_train_loop

no_network = support.no_network


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def two_groups(model):
    return torch.optim.SGD([{"params": model.fc1.parameters(), "lr": 0.4},
                            {"params": model.fc2.parameters(), "lr": 0.2}])


def test_a_row_per_batch_and_per_epoch_with_the_loop_values(tmp_path, no_network):
    tl, recorder = make_train_loop(optimizer_fn=two_groups, test=True), BatchRecorder()
    scheduler = StepLRScheduler(step_size=3, gamma=0.5, step_per_optimizer_step=True)
    logger = CSVLogger(log_dir=str(tmp_path), is_project=False)
    tl.fit(num_epochs=2, callbacks=[scheduler, logger, recorder])

    rows = read_csv(tmp_path / "batch_log.csv")
    assert list(rows[0]) == ["epoch", "iteration", "total_iteration", "loss", "accumulated_loss",
                             "lr_optimizer_0_group_0", "lr_optimizer_0_group_1"]
    assert [int(row["total_iteration"]) for row in rows] == list(range(2 * BATCHES_PER_EPOCH))
    for row in rows:
        step = int(row["total_iteration"])
        expected = recorder.batches[step]
        assert (int(row["epoch"]), int(row["iteration"])) == (expected["epoch"], expected["iteration"])
        assert float(row["loss"]) == expected["loss"]  # written as repr: the same float
        assert float(row["accumulated_loss"]) == recorder.running_mean(step)
        # The learning rates the step used (the scheduler halves them every 3 steps, after the step).
        assert [float(row["lr_optimizer_0_group_0"]), float(row["lr_optimizer_0_group_1"])] == expected["lrs"]
        assert expected["lrs"] == [0.4 * 0.5 ** (step // 3), 0.2 * 0.5 ** (step // 3)]
    # The epoch's last running mean is the history's accumulated_loss.
    history = tl.train_history
    assert [float(rows[i]["accumulated_loss"]) for i in (4, 9)] == history["accumulated_loss"]

    epochs = read_csv(tmp_path / "epoch_log.csv")
    assert list(epochs[0]) == ["epoch", "total_iteration", "loss", "accumulated_loss", "val_loss",
                               "train_end_test_loss"]
    for epoch, row in enumerate(epochs):
        assert (int(row["epoch"]), int(row["total_iteration"])) == (epoch, 5 * epoch + 4)
        for name in ("loss", "accumulated_loss", "val_loss"):
            assert float(row[name]) == history[name][epoch]
    # The test loss of the end of training joins the last epoch's row.
    assert epochs[0]["train_end_test_loss"] == ""
    assert float(epochs[1]["train_end_test_loss"]) == history["train_end_test_loss"][0]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info == {"hyperparams": {}, "experiment_folder": None}  # no saving callback: no final model path


def test_a_row_per_optimizer_step_with_gradient_accumulation_or_every_n_batches(tmp_path):
    tl, recorder = make_train_loop(), BatchRecorder()
    per_step = CSVLogger(log_dir=str(tmp_path / "step"), is_project=False)
    every_3 = CSVLogger(log_dir=str(tmp_path / "every3"), is_project=False, batch_log_frequency=3,
                        log_learning_rates=False)
    tl.fit(num_epochs=2, callbacks=[per_step, every_3, recorder], grad_accumulation=2)
    # 5 batches an epoch, accumulating 2: steps after batches 1, 3 and the epoch's last, 4.
    steps = [int(row["total_iteration"]) for row in read_csv(tmp_path / "step" / "batch_log.csv")]
    assert steps == [1, 3, 4, 6, 8, 9]
    rows = read_csv(tmp_path / "every3" / "batch_log.csv")
    assert [int(row["total_iteration"]) for row in rows] == [0, 3, 6, 9]
    assert list(rows[0]) == ["epoch", "iteration", "total_iteration", "loss", "accumulated_loss"]
    assert [float(row["loss"]) for row in rows] == [recorder.batches[step]["loss"] for step in (0, 3, 6, 9)]


def test_one_file_for_batches_and_epochs(tmp_path):
    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False, epoch_file_name=None)])
    assert sorted(os.listdir(tmp_path)) == ["batch_log.csv", "run_info.json"]
    rows = read_csv(tmp_path / "batch_log.csv")
    assert [row["row"] for row in rows] == ["batch"] * 5 + ["epoch"] + ["batch"] * 5 + ["epoch"]
    epoch_rows = [row for row in rows if row["row"] == "epoch"]
    assert [float(row["val_loss"]) for row in epoch_rows] == tl.train_history["val_loss"]
    assert all(row["val_loss"] == "" for row in rows if row["row"] == "batch")


def test_metrics_recorded_every_few_epochs_widen_the_header(tmp_path):
    tl = make_train_loop(end_auto_eval=2)  # loss and val_loss only at epochs 1 and 3
    tl.fit(num_epochs=4, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False, batch_log_frequency=None)])
    assert not (tmp_path / "batch_log.csv").exists()
    rows = read_csv(tmp_path / "epoch_log.csv")
    assert [row["loss"] != "" for row in rows] == [False, True, False, True]
    assert [float(rows[i]["val_loss"]) for i in (1, 3)] == tl.train_history["val_loss"]


def test_a_value_put_into_the_history_before_training_is_logged_at_the_first_epoch_end(tmp_path):
    # Only a checkpoint's values count as logged already (a resumed run logged them); this loop trained nothing.
    tl = make_train_loop()
    tl.insert_metric_result_into_history("val_Accuracy", 0.5)
    tl.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False, batch_log_frequency=None)])
    assert [row["val_Accuracy"] for row in read_csv(tmp_path / "epoch_log.csv")] == ["0.5", ""]


def test_the_preset_folder_the_hyperparameters_and_the_final_model_path(tmp_path):
    tl = make_train_loop(TrainLoopEndSave, project_name="proj", experiment_name="exp",
                         local_model_result_folder_path=str(tmp_path), hyperparams={"lr": 0.1, "depth": 2})
    logger = CSVLogger()
    tl.fit(num_epochs=1, callbacks=[logger])
    folder = tl.experiment_folder
    assert logger.log_dir_path == os.path.join(folder.path, "csv_logs")
    info = json.loads((tmp_path / "proj" / os.path.basename(folder.path) / "csv_logs" / "run_info.json").read_text())
    model_path = os.path.join(folder.model_dir, f"model_exp_{folder.timestamp}.pth")
    assert info == {"hyperparams": {"lr": 0.1, "depth": 2}, "experiment_folder": folder.path,
                    "final_model_path": model_path}
    assert os.path.isfile(model_path)
    assert len(read_csv(os.path.join(logger.log_dir_path, "batch_log.csv"))) == BATCHES_PER_EPOCH


def test_a_run_resumed_from_a_mid_epoch_checkpoint_writes_the_same_files_without_duplicates(tmp_path):
    """Resumed bitwise from batch 5, the new process's rows replace the ones the first run wrote after it."""
    log_dir, checkpoints = tmp_path / "logs", tmp_path / "checkpoints"
    reference_dir = tmp_path / "reference"
    folder_args = dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(checkpoints))
    first = make_train_loop()
    first.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(log_dir), is_project=False),
                                       ModelIterationCheckpoint(3, **folder_args)])
    make_train_loop().fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(reference_dir), is_project=False)])
    (checkpoint,) = [path for path in (checkpoints / "proj").rglob("*_ITER5.pth")]

    resumed = make_train_loop()
    resumed.load_checkpoint(str(checkpoint))
    resumed.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(log_dir), is_project=False)])
    for name in ("batch_log.csv", "epoch_log.csv"):
        assert (log_dir / name).read_text() == (reference_dir / name).read_text(), name
    steps = [int(row["total_iteration"]) for row in read_csv(log_dir / "batch_log.csv")]
    assert steps == list(range(10))


class FailOnce(AbstractCallback):
    def __init__(self, at_step: int):
        super().__init__("fail once")
        self.at_step = at_step

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at_step:
            self.at_step = None
            raise RuntimeError("simulated failure")


def test_fit_continued_after_an_exception_appends_without_duplicates(tmp_path):
    """fit continues from the last optimizer step; the batches after it are trained again and logged once.

    Without dropout the batches trained again compute what they computed before the failure.
    """
    tl = make_train_loop(dropout=0.0)
    logger = CSVLogger(log_dir=str(tmp_path / "run"), is_project=False)
    with pytest.raises(RuntimeError, match="simulated failure"):
        tl.fit(num_epochs=2, callbacks=[logger, FailOnce(at_step=7)], grad_accumulation=2)
    assert logger.batch_table is None  # files closed at the exception
    # Rows of the steps before the failure: batch 7 ended its window, but the failure came before its row.
    assert [int(r["total_iteration"]) for r in read_csv(tmp_path / "run" / "batch_log.csv")] == [1, 3, 4, 6]
    tl.fit(num_epochs=2, grad_accumulation=2)
    reference = make_train_loop(dropout=0.0)
    reference.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path / "ref"), is_project=False)],
                  grad_accumulation=2)
    for name in ("batch_log.csv", "epoch_log.csv"):
        assert (tmp_path / "run" / name).read_text() == (tmp_path / "ref" / name).read_text(), name


class FailBeforeTrainEnd(AbstractCallback):
    def __init__(self):
        super().__init__("fail before the train end")
        self.failed = False

    def on_before_train_end(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("simulated failure in the train end")


def test_a_train_end_finished_by_the_next_fit_is_logged(tmp_path):
    """Review 48t G1: the next fit finishes a train end an exception interrupted before its own on_train_begin, where
    the tracker's run (closed by on_exception) was not started again: train_end_test_loss and the final model's path
    never reached the files. Logged as in the straight run."""
    def files(folder):
        return {name: (folder / name).read_text() for name in ("batch_log.csv", "epoch_log.csv")}

    tl = make_train_loop(test=True)
    with pytest.raises(RuntimeError, match="in the train end"):
        tl.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path / "run"), is_project=False),
                                        FailBeforeTrainEnd()])
    tl.fit(num_epochs=2)
    straight = make_train_loop(test=True)
    straight.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path / "ref"), is_project=False)])
    assert files(tmp_path / "run") == files(tmp_path / "ref")
    assert read_csv(tmp_path / "run" / "epoch_log.csv")[-1]["train_end_test_loss"] != ""


def test_a_new_train_loop_starts_the_files_afresh_and_a_partial_last_line_is_dropped(tmp_path):
    make_train_loop().fit(num_epochs=1, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False)])
    with open(tmp_path / "epoch_log.csv", "a") as handle:
        handle.write("7,39,0.5")  # a crash while writing a row
    table = CSVTable(str(tmp_path / "epoch_log.csv"))
    columns, rows = table.read()
    assert len(rows) == 1 and columns[:2] == ["epoch", "total_iteration"]

    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False)])
    assert [int(row["epoch"]) for row in read_csv(tmp_path / "epoch_log.csv")] == [0, 1]
    assert len(read_csv(tmp_path / "batch_log.csv")) == 2 * BATCHES_PER_EPOCH
    assert (tmp_path / "epoch_log.csv").read_text().endswith("\n")


class InterruptedCSVLogger(CSVLogger):
    """A CSVLogger whose train-end row (``interrupt='write'``) or final upload in end_run (``interrupt='upload'``) a
    Ctrl-C stops the first time; ``uploads`` counts the uploads end_run finished, per fit (``fits``)."""

    def __init__(self, interrupt, **kwargs):
        super().__init__(**kwargs)
        self.interrupt, self.uploads, self._ending = interrupt, [], False

    def write_epoch_metrics(self, epoch, step, metrics, train_end):
        if train_end and self.interrupt == "write":
            self.interrupt = None
            raise KeyboardInterrupt  # before the row is written
        super().write_epoch_metrics(epoch, step, metrics, train_end)

    def end_run(self, exception):
        self._ending = True
        try:
            super().end_run(exception)
        finally:
            self._ending = False

    def upload_files(self):
        if not self._ending:
            return
        if self.interrupt == "upload" and self.train_loop_obj.run_state.train_end_pending:
            self.interrupt = None
            raise KeyboardInterrupt  # during the slow upload
        self.uploads.append(self.train_loop_obj.run_state.train_end_pending)


def test_a_ctrl_c_in_the_trackers_train_end_row_is_logged_by_the_next_fit(tmp_path):
    """Review 48m M1: a Ctrl-C while the tracker wrote its train-end row; the next fit calls its on_train_end again,
    but the history values counted as logged had moved on before the write: train_end_test_loss of that end never
    reached the file. The row is written as in the straight run."""
    def files(folder):
        return {name: (folder / name).read_text() for name in ("batch_log.csv", "epoch_log.csv")}

    tl = make_train_loop(test=True)
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[InterruptedCSVLogger("write", log_dir=str(tmp_path / "run"),
                                                             is_project=False)])
    tl.fit(num_epochs=3)
    straight = make_train_loop(test=True)
    straight.fit(num_epochs=2, callbacks=[CSVLogger(log_dir=str(tmp_path / "ref"), is_project=False)])
    straight.fit(num_epochs=3)
    assert files(tmp_path / "run") == files(tmp_path / "ref")
    assert read_csv(tmp_path / "run" / "epoch_log.csv")[1]["train_end_test_loss"] != ""


def test_a_ctrl_c_in_the_trackers_final_upload_is_redone_by_the_next_fit(tmp_path):
    """Review 48m M2 (the docs' own example: Ctrl-C during a slow upload): on_train_end marked the run closed before
    end_run, so on_exception did nothing and the next fit's on_train_end returned at once: the final upload (and
    MLflow's set_terminated) was never done. The run is now closed as interrupted by on_exception, and the next fit
    ends it again, uploading the final files."""
    tl = make_train_loop(test=True)
    logger = InterruptedCSVLogger("upload", log_dir=str(tmp_path / "run"), is_project=False)
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[logger])
    uploads_before = len(logger.uploads)
    tl.fit(num_epochs=2)  # finishes the end only
    assert not tl.run_state.train_end_pending
    assert len(logger.uploads) > uploads_before and logger.uploads[-1] is True  # uploaded in the finished end
    assert not logger.run_active


class TwoLossMLP(MLP):
    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0].to(device), batch_data[1].to(device)
        logits = self(x)
        return MultiLoss({"ce": criterion(logits, y), "l2": 1e-3 * (logits ** 2).mean()})


def test_a_multi_loss_gets_a_column_per_loss(tmp_path):
    torch.manual_seed(0)
    model = TwoLossMLP()
    tl = make_train_loop()
    tl = TrainLoop(model, tl.train_loader, tl.validation_loader, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), tl.criterion, show_progress=False)
    recorder = BatchRecorder()
    tl.fit(num_epochs=1, callbacks=[CSVLogger(log_dir=str(tmp_path), is_project=False), recorder])
    names = list(getattr(tl, "last_batch_loss_names", None) or ["0", "1"])  # named once the loop names them
    rows = read_csv(tmp_path / "batch_log.csv")
    assert [column for column in rows[0] if "loss" in column] == \
        [f"loss_{names[0]}", f"loss_{names[1]}", f"accumulated_loss_{names[0]}", f"accumulated_loss_{names[1]}"]
    for row in rows:
        expected = recorder.batches[int(row["total_iteration"])]["loss"]
        assert [float(row[f"loss_{name}"]) for name in names] == expected
    epoch_row = read_csv(tmp_path / "epoch_log.csv")[0]
    assert float(epoch_row["accumulated_loss_ce"]) == tl.train_history["accumulated_loss_ce"][0]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="batch_log_frequency"):
        CSVLogger(batch_log_frequency=0)
    with pytest.raises(ValueError, match="batch_log_frequency"):
        CSVLogger(batch_log_frequency="epoch")
    with pytest.raises(ValueError, match="plain file name"):
        CSVLogger(batch_file_name="logs/batch.csv")
    with pytest.raises(TypeError, match="metric_names"):
        CSVLogger(metric_names="val_loss")
    with pytest.raises(TypeError, match="is_project"):
        CSVLogger(is_project="yes")
    # A folder inside the experiment folder, with a plain TrainLoop and some of the details only: refused at
    # registration (with none, the loop's default run folder is taken).
    with pytest.raises(MissingExperimentDetailsError, match="CSVLogger"):
        make_train_loop().fit(num_epochs=1, callbacks=[CSVLogger(experiment_name="e")])
