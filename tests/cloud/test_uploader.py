"""CloudUploader: background uploads that never block training, report failures with bucket and key, keep the
local files, and upload a file as it was when submitted."""
import os
import threading

import pytest

from aitoolbox.cloud.storage import FOLDER_MARKER, CloudNotFoundError
from aitoolbox.cloud.uploader import (
    CloudUploader, cloud_service, experiment_uploader_for, storage_for, uploader_for)
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def test_submit_returns_before_a_slow_upload_finishes(service, proxy, tmp_path):
    name = unique_bucket_name(service)
    create_bucket(service, name)
    uploader = CloudUploader(make_storage(service, name))
    data = os.urandom(300_000)
    local = write(tmp_path / "model_exp_ts_E1.pth", data)
    proxy.hold()  # the network stalls: the upload cannot finish until the test releases it

    future = uploader.submit(local, "run/checkpoint_model/model_exp_ts_E1.pth")
    # submit returned although nothing can reach the bucket yet: it did not wait for the upload.
    assert not future.done() and uploader.pending == 1
    proxy.release()
    uris = uploader.wait(timeout=60)
    assert uris == [f"{uploader.storage.uri('run/checkpoint_model/model_exp_ts_E1.pth')}"]
    assert future.result() == uris[0] and uploader.pending == 0
    assert uploader.storage.download_bytes("run/checkpoint_model/model_exp_ts_E1.pth") == data
    uploader.close()


def test_an_upload_carries_the_file_as_it_was_when_submitted(bucket, tmp_path):
    local = write(tmp_path / "model.pth", b"version 1")
    pruned = write(tmp_path / "old.pth", b"pruned later")
    with CloudUploader(bucket) as uploader:
        block = threading.Event()
        uploader._enqueue(block.wait, "a job that holds the queue")  # the uploads below wait behind it
        uploader.submit(local, "model.pth")
        uploader.submit(pruned, "old.pth")
        write(tmp_path / "model.pth.new", b"version 2")
        os.replace(tmp_path / "model.pth.new", local)  # the next atomic save of the same name
        os.remove(pruned)  # pruning of old checkpoints
        block.set()
    assert bucket.download_bytes("model.pth") == b"version 1"
    assert bucket.download_bytes("old.pth") == b"pruned later"


def test_a_growing_file_goes_up_as_it_was_when_submitted_and_its_folder_is_complete(bucket, tmp_path):
    events = write(tmp_path / "tensorboard" / "events.out.tfevents.1", b"record 1;")
    single = write(tmp_path / "log.txt", b"line 1\n")
    with CloudUploader(bucket) as uploader:
        block = threading.Event()
        uploader._enqueue(block.wait, "a job that holds the queue")
        uploader.submit_folder(str(tmp_path / "tensorboard"), "run/tensorboard")
        uploader.submit(single, "run/log.txt")
        for path, more in ((events, b"record 2;"), (single, b"line 2\n")):  # the writers go on appending
            with open(path, "ab") as handle:
                handle.write(more)
        block.set()
    assert bucket.download_bytes("run/tensorboard/events.out.tfevents.1") == b"record 1;"
    assert bucket.is_complete_folder("run/tensorboard")
    assert bucket.download_bytes("run/log.txt") == b"line 1\n"


def test_uploads_run_in_the_order_submitted(bucket, tmp_path):
    uploader = CloudUploader(bucket)
    finished = []
    for epoch in range(1, 5):
        path = write(tmp_path / f"model_E{epoch}.pth", os.urandom(1000 * (5 - epoch)))
        uploader.submit(path, f"model_E{epoch}.pth").add_done_callback(lambda _, e=epoch: finished.append(e))
    uploader.close()
    assert finished == [1, 2, 3, 4]


def test_wait_raises_the_first_failure_with_bucket_and_key_once_and_keeps_the_local_file(service, tmp_path):
    uploader = CloudUploader(make_storage(service, "aitoolbox-no-such-bucket"))
    first = write(tmp_path / "first.pth", b"1")
    second = write(tmp_path / "second.pth", b"2")
    uploader.submit(first, "run/first.pth")
    uploader.submit(second, "run/second.pth")
    with pytest.raises(CloudNotFoundError) as raised:
        uploader.wait(timeout=60)
    assert raised.value.key == "run/first.pth" and raised.value.bucket == "aitoolbox-no-such-bucket"
    assert "'aitoolbox-no-such-bucket'" in str(raised.value) and "'run/first.pth'" in str(raised.value)
    assert uploader.wait() == []  # each failure is raised once
    assert os.path.exists(first) and os.path.exists(second)
    uploader.close()


def test_failures_are_logged_when_they_happen(service, tmp_path, aitoolbox_records):
    uploader = CloudUploader(make_storage(service, "aitoolbox-no-such-bucket"))
    future = uploader.submit(write(tmp_path / "m.pth", b"1"), "run/m.pth")
    with pytest.raises(CloudNotFoundError):
        future.result(timeout=60)
    with pytest.raises(CloudNotFoundError):
        uploader.close()
    errors = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "ERROR"]
    assert any("run/m.pth" in message and "the local file is kept" in message for message in errors)


def test_folder_uploads_end_with_their_marker(bucket, tmp_path):
    folder = tmp_path / "tensorboard" / "project_exp"
    write(folder / "events.out.tfevents.1", b"event 1")
    with CloudUploader(bucket) as uploader:
        future = uploader.submit_folder(str(folder), "run/tensorboard/project_exp")
    assert future.result()[-1] == f"run/tensorboard/project_exp/{FOLDER_MARKER}"
    assert bucket.is_complete_folder("run/tensorboard/project_exp")


def test_a_missing_local_file_is_refused_at_submit_and_a_closed_uploader_takes_nothing(bucket, tmp_path):
    uploader = CloudUploader(bucket)
    with pytest.raises(FileNotFoundError):
        uploader.submit(str(tmp_path / "missing.pth"), "missing.pth")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        uploader.submit_folder(str(tmp_path / "missing"), "missing")
    uploader.close()
    with pytest.raises(RuntimeError, match="closed"):
        uploader.submit(write(tmp_path / "late.pth", b"x"), "late.pth")


def test_wait_with_a_timeout_leaves_the_uploads_running(bucket, tmp_path):
    uploader = CloudUploader(bucket)
    release = threading.Event()
    uploader._enqueue(release.wait, "a job that holds the queue")
    uploader.submit(write(tmp_path / "m.pth", b"1"), "m.pth")
    with pytest.raises(TimeoutError, match="still running"):
        uploader.wait(timeout=0.05)
    release.set()
    uploader.close()
    assert bucket.exists("m.pth")


@pytest.mark.parametrize("mode, service", [("s3", "s3"), ("aws_s3", "s3"), ("aws", "s3"), ("AWS_S3", "s3"),
                                           ("gcs", "gcs"), ("google_storage", "gcs"), ("google storage", "gcs"),
                                           (None, None), ("local", None)])
def test_cloud_save_modes_of_aitoolbox_1x(mode, service):
    assert cloud_service(mode) == service


def test_uploader_for_builds_the_services_storage(s3_env, gcs_env):
    from aitoolbox.cloud.gcs import GCSStorage
    from aitoolbox.cloud.s3 import S3Storage
    assert isinstance(uploader_for("aws_s3", "bucket-a").storage, S3Storage)
    assert isinstance(uploader_for("google_storage", "bucket-b").storage, GCSStorage)
    assert uploader_for(None, "bucket-a") is None and storage_for("local", "bucket-a") is None
    assert storage_for("s3", "bucket-a", endpoint_url="http://127.0.0.1:1").endpoint_url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="cloud_save_mode='ftp' is not one of"):
        uploader_for("ftp", "bucket-a")
    with pytest.raises(TypeError, match="must be a CloudStorage"):
        CloudUploader("bucket-a")


def test_an_experiment_uploader_puts_each_file_of_the_run_folder_under_the_runs_key(service, bucket, tmp_path):
    uploader = CloudUploader(bucket)
    sync = experiment_uploader_for(service, bucket.bucket_name, "team", "proj", "exp", "ts", str(tmp_path),
                                   uploader=uploader)
    run = tmp_path / "proj" / "exp_ts"
    checkpoint = write(run / "checkpoint_model" / "model_exp_ts_E1.pth", b"weights")
    write(run / "tensorboard" / "proj_exp" / "events.out.tfevents.1", b"event")
    sync.upload(checkpoint)
    sync.upload(str(run / "tensorboard" / "proj_exp"))
    sync.close()
    assert bucket.download_bytes("team/proj/exp_ts/checkpoint_model/model_exp_ts_E1.pth") == b"weights"
    assert bucket.is_complete_folder("team/proj/exp_ts/tensorboard/proj_exp")
    with pytest.raises(ValueError, match="not inside the experiment folder"):
        sync.upload(write(tmp_path / "elsewhere.txt", b"x"))
    assert experiment_uploader_for("local", bucket.bucket_name, "", "proj", "exp", "ts", str(tmp_path)) is None
    with pytest.raises(ValueError, match="writes to the bucket"):
        experiment_uploader_for(service, "other-bucket", "", "proj", "exp", "ts", str(tmp_path), uploader=uploader)


def test_an_interrupted_close_stops_waiting_and_drops_the_uploads_not_started(bucket, tmp_path):
    uploader = CloudUploader(bucket)
    release = threading.Event()
    uploader._enqueue(release.wait, "a job that holds the queue")  # the upload in progress
    later = uploader.submit(write(tmp_path / "m.pth", b"1"), "m.pth")
    original_wait = uploader.wait

    def interrupted_wait(timeout=None):
        raise KeyboardInterrupt  # Ctrl-C while waiting

    uploader.wait = interrupted_wait
    safety = threading.Timer(120, release.set)  # were close to wait after all, the test fails instead of hanging
    safety.start()
    with pytest.raises(KeyboardInterrupt):
        uploader.close()
    assert not release.is_set()  # close returned while the job in progress was still blocked: it did not wait
    safety.cancel()
    assert later.cancelled()
    release.set()
    uploader.wait = original_wait
    assert not bucket.exists("m.pth")
