"""MLflowTracking against a tracking server that is slow, closed or refusing: training neither stalls nor stops,
the values are kept until the server takes them, an outage is reported once.

The server is MLflow's own tracking server (the Flask app that mlflow-skinny ships, over a file store), started
on 127.0.0.1; a FaultyProxy in front of it holds the traffic for as long as a test needs ("a server that never
answers"), a free port stands for a closed one. No assertion is about time: a ``fit`` that should not wait runs
in a thread joined with a generous hang limit, far below what the client's own timeouts (120 s per request,
7 retries) would take.
"""
import logging
import sys
import threading
import traceback

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
from tests.hang_limits import HANG_LIMIT_S, fit_within_hang_limit, log_messages, wait_until
from tests.cloud.servers import FaultyProxy, ServerProcess, free_port, start_server
from tests.torchtrain.callbacks.tracking_support import BatchRecorder, make_train_loop

pytest.importorskip("mlflow")
pytest.importorskip("flask")
from mlflow.tracking import MlflowClient  # noqa: E402


SERVER_SCRIPT = """
import os, sys
os.environ["_MLFLOW_SERVER_FILE_STORE"] = sys.argv[2]
os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = sys.argv[3]
os.environ["_MLFLOW_SERVER_SERVE_ARTIFACTS"] = "false"
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # no database to migrate: starts in a second or two
from mlflow.server import app
app.run(host="127.0.0.1", port=int(sys.argv[1]), threaded=True)
"""


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """MLflow's tracking server on 127.0.0.1, storing runs in a file store."""
    folder = tmp_path_factory.mktemp("mlflow_server")

    def make(port: int) -> ServerProcess:
        command = [sys.executable, "-c", SERVER_SCRIPT, str(port), (folder / "mlruns").as_uri(),
                   str(folder / "artifacts")]
        return ServerProcess("mlflow_server", command, port, "/health")

    server = start_server(make, str(folder))
    MlflowClient(server.url).get_experiment_by_name("Default")  # the store is made at the first request
    yield server
    server.stop()


@pytest.fixture
def records(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO, logger="aitoolbox")
    return caplog


@pytest.fixture
def proxy(mlflow_server):
    faulty = FaultyProxy(mlflow_server.port)
    yield faulty
    faulty.close()


def history(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))


def only_run(client: MlflowClient, experiment_name: str):
    experiment = client.get_experiment_by_name(experiment_name)
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def test_a_server_that_never_answers_holds_up_neither_fit_nor_its_end_and_gets_every_value_later(
        mlflow_server, proxy, records):
    proxy.hold()  # connections are accepted, nothing is answered
    tl, recorder = make_train_loop(), BatchRecorder()
    callback = MLflowTracking(proxy.url, hyperparams={"lr": 0.1}, project_name="held", flush_timeout_s=0.5)
    fit_within_hang_limit(tl, waits_on="the tracking server", num_epochs=2, callbacks=[callback, recorder])
    assert len(tl.train_history["loss"]) == 2  # trained to the end

    (report,) = log_messages(records, "not sent yet")
    # 10 batches x (loss, mean loss, learning rate) + 2 epochs x (loss, accumulated_loss, val_loss)
    for unsent in ("36 metrics", "the start of the run", "the run's parameters", "the run's end (FINISHED)",
                   proxy.url):
        assert unsent in report, report

    proxy.release()
    assert callback.flush(timeout_s=HANG_LIMIT_S), callback.unsent()
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, "held")
    assert run.info.run_id == callback.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"}
    steps = range(10)
    assert history(client, run.info.run_id, "train_loss/last_batch_loss") == \
        [(step, recorder.batches[step]["loss"]) for step in steps]
    assert history(client, run.info.run_id, "train_loss/accumulated_batch_loss") == \
        [(step, recorder.running_mean(step)) for step in steps]
    for name in ("loss", "accumulated_loss", "val_loss"):
        assert history(client, run.info.run_id, name) == list(enumerate(tl.train_history[name])), name
    assert log_messages(records, "could not send") == []  # held, not failed: nothing to report but the delay


def test_a_closed_port_is_reported_once_and_training_completes(monkeypatch, records):
    # Each request fails at once here; with the client's default 7 retries the first report comes minutes later.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    url = f"http://127.0.0.1:{free_port()}"
    tl = make_train_loop()
    callback = MLflowTracking(url, project_name="closed", flush_timeout_s=0.2)
    fit_within_hang_limit(tl, waits_on="the tracking server", num_epochs=2, callbacks=[callback])
    assert len(tl.train_history["loss"]) == 2

    # After the fit nothing is tried until asked: each flush tries again (and keeps what it could not send).
    wait_until(lambda: callback.flush(timeout_s=0.1) or callback.sender().failures >= 3, "tried three times")
    (report,) = log_messages(records, "could not send")  # one report for the outage, not one per try
    assert url in report and "the start of the run" in report
    (unsent,) = log_messages(records, "not sent yet")
    assert "36 metrics" in unsent and "the run's end (FINISHED)" in unsent
    assert callback.unsent()[0] == "36 metrics"  # kept for a later fit or flush
    callback.discard_unsent()
    assert callback.unsent() == []


def test_the_queue_is_bounded_and_keeps_the_newest_values(mlflow_server, proxy, records):
    proxy.hold()
    tl, recorder = make_train_loop(), BatchRecorder()
    callback = MLflowTracking(proxy.url, project_name="bounded", max_queued_metrics=10, flush_timeout_s=0.2)
    fit_within_hang_limit(tl, waits_on="the tracking server", num_epochs=2, callbacks=[callback, recorder])
    assert callback.dropped_metrics == 26
    assert len(log_messages(records, "the oldest are dropped")) == 1

    proxy.release()
    assert callback.flush(timeout_s=HANG_LIMIT_S), callback.unsent()
    client = MlflowClient(mlflow_server.url)
    run = only_run(client, "bounded")
    # The newest 10: batch 7's learning rate, batches 8 and 9, then epoch 1's three metrics.
    assert history(client, run.info.run_id, "train_loss/last_batch_loss") == \
        [(step, recorder.batches[step]["loss"]) for step in (8, 9)]
    assert [step for step, _ in history(client, run.info.run_id, "learning_rate/optimizer_0_group_0")] == [7, 8, 9]
    assert history(client, run.info.run_id, "val_loss") == [(1, tl.train_history["val_loss"][1])]


def test_a_refused_run_is_an_error_once_and_training_completes(mlflow_server, records):
    tl = make_train_loop()
    callback = MLflowTracking(mlflow_server.url, run_id="f" * 32, flush_timeout_s=HANG_LIMIT_S)
    fit_within_hang_limit(tl, waits_on="the tracking server", num_epochs=2, callbacks=[callback])
    assert len(tl.train_history["loss"]) == 2
    errors = [record.getMessage() for record in records.records if record.levelname == "ERROR"]
    assert len(errors) == 1 and "refused the start of the run" in errors[0] and "f" * 32 in errors[0]
    assert callback.unsent() == [] and log_messages(records, "not sent yet") == []


class ManyMetrics(AbstractCallback):
    """Records ``count`` metrics in the training history at every epoch end."""

    def __init__(self, count: int):
        super().__init__("many metrics")
        self.count = count

    def on_epoch_end(self):
        for index in range(self.count):
            self.train_loop_obj.train_history.insert_single_result_into_history(f"metric_{index}", index / 7)


def test_more_than_one_request_of_metrics_reaches_a_file_store(tmp_path, monkeypatch):
    """The success path without a server: a file store, and 2 x 1,203 epoch values (several requests of at most
    1,000) besides the batch values."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    tl, recorder = make_train_loop(), BatchRecorder()
    callback = MLflowTracking(uri, project_name="many", flush_timeout_s=HANG_LIMIT_S)
    tl.fit(num_epochs=2, callbacks=[ManyMetrics(1200), callback, recorder])
    client = MlflowClient(uri)
    run = only_run(client, "many")
    assert run.info.status == "FINISHED" and callback.unsent() == []
    assert len(run.data.metrics) == 1200 + 3 + 3
    for index in (0, 999, 1000, 1199):
        assert history(client, run.info.run_id, f"metric_{index}") == [(0, index / 7), (1, index / 7)]
    assert history(client, run.info.run_id, "train_loss/last_batch_loss") == \
        [(step, recorder.batches[step]["loss"]) for step in range(10)]
    assert history(client, run.info.run_id, "val_loss") == list(enumerate(tl.train_history["val_loss"]))


# --- issue 31 items 8 and 10: the URI's password, and sender threads across fits ------------------------------
def sender_threads() -> list:
    return [thread for thread in threading.enumerate() if thread.name == "MLflowTracking sender"]


def test_four_fits_with_the_store_down_leave_no_sender_thread_and_keep_every_value(mlflow_server, proxy,
                                                                                   monkeypatch, records):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # each request fails at once
    proxy.drop_next(10**9)  # the store is down: every connection is reset
    callbacks, most_threads = [], 0
    for _ in range(4):  # a new logger for each fit, as a script that builds its loop and callbacks per fit does
        callbacks.append(MLflowTracking(proxy.url, project_name="down", flush_timeout_s=0.2))
        fit_within_hang_limit(make_train_loop(), waits_on="the tracking server", num_epochs=1,
                              callbacks=[callbacks[-1]])
        most_threads = max(most_threads, len(sender_threads()))
        wait_until(lambda: not sender_threads(), "stopped the sender threads after the fit")
    assert most_threads <= 1
    assert all("the run's end (FINISHED)" in callback.unsent() for callback in callbacks)  # kept, not dropped
    assert len(log_messages(records, "could not send")) == 4  # one report per logger's outage

    proxy.drop_next(0)  # the store answers again: what was kept is sent by flush (or a later fit)
    for callback in callbacks:
        assert callback.flush(timeout_s=HANG_LIMIT_S), callback.unsent()
    wait_until(lambda: not sender_threads(), "stopped the sender threads after flush")
    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name("down")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.info.run_id for run in runs) == sorted(callback.run_id for callback in callbacks)
    assert {run.info.status for run in runs} == {"FINISHED"}
    assert [len(history(client, callback.run_id, "val_loss")) for callback in callbacks] == [1, 1, 1, 1]


def test_the_tracking_uris_password_is_never_logged(monkeypatch, records):
    records.set_level(logging.DEBUG)  # every logger, every level
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    password = "pw-secret-7731"
    url = f"http://trainer:{password}@127.0.0.1:{free_port()}"
    callback = MLflowTracking(url, project_name="closed", flush_timeout_s=0.2)
    fit_within_hang_limit(make_train_loop(), waits_on="the tracking server", num_epochs=1, callbacks=[callback])
    callback.flush(timeout_s=0.2)
    texts = [record.getMessage() + str(record.exc_text or "") for record in records.records]
    assert any("could not send" in text and "127.0.0.1" in text for text in texts)
    assert [text for text in texts if password in text] == []
    callback.discard_unsent()

    unsupported = MLflowTracking(f"nosuchscheme://trainer:{password}@store.internal/x", project_name="p")
    with pytest.raises(Exception) as raised:
        make_train_loop().fit(num_epochs=1, callbacks=[unsupported])
    shown = "".join(traceback.format_exception(raised.type, raised.value, raised.tb))
    assert "nosuchscheme://" in shown and password not in shown
