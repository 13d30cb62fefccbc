"""MLflowTracking on real TrainLoop runs, read back with MlflowClient from local stores (SQLite, file store)."""
import logging
import math
import os
import sys
import threading

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking, flatten_params, mlflow_key
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpointEndSave
from tests.torchtrain.callbacks import tracking_support as support
from tests.torchtrain.callbacks.tracking_support import BatchRecorder, make_train_loop

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")  # the SQLite store (mlflow-skinny does not bring it)
from mlflow.tracking import MlflowClient  # noqa: E402

no_network = support.no_network


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory) -> str:
    """One SQLite store for the module (creating its tables takes a second or two); tests use their own
    MLflow experiment (project) in it."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact folder (./mlruns) lands here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def only_run(client: MlflowClient, experiment_name: str):
    experiment = client.get_experiment_by_name(experiment_name)
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def history(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))


def test_params_batch_losses_epoch_metrics_and_the_final_model(tmp_path, store_uri, no_network):
    tl = make_train_loop(TrainLoopCheckpointEndSave, test=True, project_name="proj", experiment_name="exp",
                         local_model_result_folder_path=str(tmp_path / "results"),
                         hyperparams={"lr": 0.1, "optimizer": {"name": "sgd", "nesterov": False}})
    recorder = BatchRecorder()
    callback = MLflowTracking(tracking_uri=store_uri, batch_log_frequency=2, log_model_artifact=True,
                              artifact_location=str(tmp_path / "artifacts"), tags={"team": "vision"})
    tl.fit(num_epochs=2, callbacks=[callback, recorder])

    client = MlflowClient(store_uri)
    run = only_run(client, "proj")
    folder = tl.experiment_folder
    assert run.info.run_id == callback.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == f"exp_{folder.timestamp}"
    assert run.data.params == {"lr": "0.1", "optimizer.name": "sgd", "optimizer.nesterov": "False"}
    model_path = os.path.join(folder.model_dir, f"model_exp_{folder.timestamp}.pth")
    assert os.path.isfile(model_path)
    assert run.data.tags["final_model_path"] == model_path
    assert run.data.tags["aitoolbox.experiment_folder"] == folder.path and run.data.tags["team"] == "vision"
    (artifact,) = client.list_artifacts(run.info.run_id, "model")
    assert artifact.path == f"model/{os.path.basename(model_path)}"
    assert artifact.file_size == os.path.getsize(model_path)

    steps = [0, 2, 4, 6, 8]
    assert history(client, run.info.run_id, "train_loss/last_batch_loss") == \
        [(step, recorder.batches[step]["loss"]) for step in steps]
    assert history(client, run.info.run_id, "train_loss/accumulated_batch_loss") == \
        [(step, recorder.running_mean(step)) for step in steps]
    assert history(client, run.info.run_id, "learning_rate/optimizer_0_group_0") == [(step, 0.1) for step in steps]
    for name in ("loss", "accumulated_loss", "val_loss"):
        assert history(client, run.info.run_id, name) == list(enumerate(tl.train_history[name])), name
    assert history(client, run.info.run_id, "train_end_test_loss") == [(1, tl.train_history["train_end_test_loss"][0])]


def test_the_tracking_uri_from_the_environment_a_file_store_and_a_row_per_optimizer_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    tl, recorder = make_train_loop(), BatchRecorder()
    callback = MLflowTracking(batch_log_frequency="step", project_name="plain", experiment_name="run")
    tl.fit(num_epochs=2, callbacks=[callback, recorder], grad_accumulation=2)

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run = only_run(client, "plain")
    assert run.info.run_name == f"run_{tl.experiment_timestamp}"
    assert "aitoolbox.experiment_folder" not in run.data.tags and "final_model_path" not in run.data.tags
    assert run.data.params == {}
    # 5 batches an epoch, accumulating 2: the optimizer steps after batches 1, 3 and the epoch's last.
    assert history(client, run.info.run_id, "train_loss/last_batch_loss") == \
        [(step, recorder.batches[step]["loss"]) for step in (1, 3, 4, 6, 8, 9)]
    assert history(client, run.info.run_id, "val_loss") == list(enumerate(tl.train_history["val_loss"]))


def test_selected_metrics_only_and_no_batch_metrics(store_uri):
    tl = make_train_loop()
    tl.fit(num_epochs=2, callbacks=[MLflowTracking(store_uri, metric_names=["val_loss"], batch_log_frequency=None,
                                                   project_name="selected")])
    client = MlflowClient(store_uri)
    run = only_run(client, "selected")
    assert set(run.data.metrics) == {"val_loss"}
    assert history(client, run.info.run_id, "val_loss") == list(enumerate(tl.train_history["val_loss"]))


class FailOnce(AbstractCallback):
    def __init__(self, at_step: int, error: BaseException):
        super().__init__("fail once")
        self.at_step, self.error = at_step, error

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.at_step:
            self.at_step = None
            raise self.error


@pytest.mark.parametrize("error, status", [(RuntimeError("simulated failure"), "FAILED"),
                                           (KeyboardInterrupt(), "KILLED")])
def test_an_exception_ends_the_run_and_the_next_fit_continues_it(store_uri, error, status):
    project = f"interrupted_{status.lower()}"
    tl = make_train_loop()
    callback = MLflowTracking(store_uri, hyperparams={"lr": 0.1}, project_name=project)
    with pytest.raises(type(error)):
        tl.fit(num_epochs=2, callbacks=[callback, FailOnce(6, error)])
    client = MlflowClient(store_uri)
    run = only_run(client, project)
    assert run.info.status == status
    # What was logged before the exception reached the store: batches 0-5 (ours runs after FailOnce) and epoch 0.
    assert [step for step, _ in history(client, run.info.run_id, "train_loss/last_batch_loss")] == list(range(6))
    assert [step for step, _ in history(client, run.info.run_id, "val_loss")] == [0]

    tl.fit(num_epochs=2)
    run = only_run(client, project)  # still one run
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert history(client, run.info.run_id, "val_loss") == list(enumerate(tl.train_history["val_loss"]))
    assert [step for step, _ in history(client, run.info.run_id, "train_loss/last_batch_loss")] == \
        list(range(10))  # batch 6 stepped before the failure: trained once; the next fit finishes its batch end


def test_run_id_continues_a_run_and_keeps_its_parameters(store_uri, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    first = make_train_loop()
    callback = MLflowTracking(store_uri, hyperparams={"lr": 0.1, "batch": 8}, project_name="continued")
    first.fit(num_epochs=1, callbacks=[callback])

    second = make_train_loop()
    second.epoch = 1  # as if loaded from the first run's checkpoint
    with caplog.at_level(logging.WARNING, logger="aitoolbox"):
        second.fit(num_epochs=2, callbacks=[MLflowTracking(store_uri, hyperparams={"lr": 0.2, "seed": 3},
                                                           run_id=callback.run_id)])
    assert any("cannot change" in record.getMessage() and "'lr'" in record.getMessage() for record in caplog.records)
    client = MlflowClient(store_uri)
    run = only_run(client, "continued")
    assert run.data.params == {"lr": "0.1", "batch": "8", "seed": "3"}
    assert history(client, run.info.run_id, "val_loss") == [(0, first.train_history["val_loss"][0]),
                                                            (1, second.train_history["val_loss"][0])]


def test_keys_and_params_mlflow_accepts():
    assert mlflow_key("val_loss") == "val_loss"
    assert mlflow_key("acc@1 (top)") == "acc_1 _top_"
    assert mlflow_key("/a/../b") == "a/_/b"
    assert flatten_params({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": "1", "a.c.d": "[1, 2]", "e": "{}"}


def test_arguments_are_checked_and_a_missing_package_is_named(monkeypatch):
    with pytest.raises(TypeError, match="tags"):
        MLflowTracking(tags=["a"])
    with pytest.raises(ValueError, match="run_id"):
        MLflowTracking(run_id="")
    with pytest.raises(TypeError, match="log_model_artifact"):
        MLflowTracking(log_model_artifact="yes")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"aitoolbox\[mlflow\]"):
        make_train_loop().fit(num_epochs=1, callbacks=[MLflowTracking()])


class RecordsAtTrainEnd(AbstractCallback):
    def __init__(self, value: float = 0.5):
        super().__init__("records at train end", execution_order=-1)  # before the tracker logs the end
        self.value = value

    def on_train_end(self):
        self.train_loop_obj.insert_metric_result_into_history("end_metric", self.value)


class CtrlCAfterOneTrainEndMetric(MLflowTracking):
    """A Ctrl-C after the first metric of the train-end write was queued (its other metrics not yet)."""
    interrupted_after = ("end_metric", "train_end_test_loss")

    def _add_metric(self, key, value, step):
        super()._add_metric(key, value, step)
        if key in self.interrupted_after and self.train_loop_obj.run_state.train_end_pending \
                and not getattr(self, "interrupted_once", False):
            self.interrupted_once = True
            raise KeyboardInterrupt


class CtrlCAfterTheFirstMetric(CtrlCAfterOneTrainEndMetric):
    """A Ctrl-C right after the train end's end_metric was queued."""
    interrupted_after = ("end_metric",)


@pytest.mark.parametrize("value", [0.5, float("nan")])
def test_a_ctrl_c_between_two_metrics_of_the_train_end_write_sends_each_once(store_uri, no_network, value):
    """Review 49l F3: the metric queued before the Ctrl-C was sent by on_exception's end of the run, and again by
    the next fit, which writes the train end again: a duplicated point in its history. Review 49y Y5: also a NaN
    (the write's memory of what it queued compared values, and a NaN is not equal to itself)."""
    tl = make_train_loop(test=True)
    project = f"ctrl_c_in_train_end_write_{value}"
    tracker = (CtrlCAfterOneTrainEndMetric if value == value else CtrlCAfterTheFirstMetric)(store_uri,
                                                                                           project_name=project)
    with pytest.raises(KeyboardInterrupt):
        tl.fit(num_epochs=2, callbacks=[RecordsAtTrainEnd(value), tracker])
    tl.fit(num_epochs=3)
    client = MlflowClient(store_uri)
    run = only_run(client, project)
    assert run.info.status == "FINISHED"
    points = history(client, run.info.run_id, "end_metric")
    assert [step for step, _ in points] == [1, 2]
    assert all(point == value or (math.isnan(point) and math.isnan(value)) for _, point in points)
    assert history(client, run.info.run_id, "train_end_test_loss") == \
        list(zip([1, 2], tl.train_history["train_end_test_loss"]))


class FinishedSentLate(MLflowTracking):
    """The first fit's FINISHED reaches the store only once ``release`` is set: a slow store, still sending the
    end of one fit when the next starts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _terminate(self, status):
        if status == "FINISHED" and not self.release.is_set():
            self.release.wait(30)
        super()._terminate(status)


class ReleasesThenFails(AbstractCallback):
    def __init__(self, tracker: FinishedSentLate):
        super().__init__("releases the late end, then fails")
        self.tracker = tracker

    def on_epoch_end(self):
        if self.train_loop_obj.epoch == 2:
            self.tracker.release.set()
            self.tracker.sender().wait(10)  # the late FINISHED is in the store, and the run reopened
            raise RuntimeError("training failed in epoch 3")


def test_a_fit_failing_after_the_last_fits_end_was_sent_late_ends_the_run_failed(store_uri, no_network):
    """Review 49y Y1: the flag saying FINISHED reached the store was cleared on the training thread when the next fit
    started, and set again by the sender's thread when the late FINISHED went through; the next fit's failure then
    sent no FAILED and the run stayed RUNNING."""
    tl = make_train_loop(test=True)
    callback = FinishedSentLate(store_uri, project_name="finished_sent_late", flush_timeout_s=0.2)
    tl.fit(num_epochs=2, callbacks=[callback])
    with pytest.raises(RuntimeError, match="training failed in epoch 3"):
        tl.fit(num_epochs=4, callbacks=[ReleasesThenFails(callback)])
    callback.flush()
    assert only_run(MlflowClient(store_uri), "finished_sent_late").info.status == "FAILED"


class FailsAfterTheEndWasSent(MLflowTracking):
    """end_run raises once after the run's end (FINISHED) reached the store (closing the connection fails)."""

    def _stop_sending_thread(self):
        super()._stop_sending_thread()
        if self.train_loop_obj.run_state.train_end_pending and not getattr(self, "failed_once", False):
            self.failed_once = True
            raise RuntimeError("closing failed")


def test_a_failure_after_the_run_was_sent_finished_leaves_it_finished(store_uri, no_network):
    """Review 49l F4: every value and FINISHED had reached the store when end_run failed; on_exception then ended the
    run again as FAILED, although its training had finished and was sent. The status says what happened to the
    training: it stays FINISHED (the fit still raises the failure)."""
    tl = make_train_loop(test=True)
    callback = FailsAfterTheEndWasSent(store_uri, project_name="fails_after_the_end")
    with pytest.raises(RuntimeError, match="closing failed"):
        tl.fit(num_epochs=2, callbacks=[callback])
    client = MlflowClient(store_uri)
    run = only_run(client, "fails_after_the_end")
    assert run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "train_end_test_loss") == [(1, tl.train_history["train_end_test_loss"][0])]
