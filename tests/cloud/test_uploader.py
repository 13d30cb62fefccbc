"""CloudUploader: background uploads through a bounded queue that never blocks training until it is full,
report failures with bucket and key, keep the local files, upload a file as it was when submitted, hold files open
only while they are being uploaded, and upload a file submitted again only once."""
import os
import threading

import pytest

from aitoolbox.cloud.staging import STAGING_PREFIX
from aitoolbox.cloud.storage import FOLDER_MARKER, CloudNotFoundError
from aitoolbox.cloud.uploader import CloudUploader, cloud_service, storage_for, uploader_for
from tests.hang_limits import log_messages
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name

HANG_TIMEOUT_S = 60  # only for a broken uploader: the tests wait on conditions


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def open_files_below(folder) -> list:
    """The files below ``folder`` this process holds open (from /proc/self/fd)."""
    folder = os.path.realpath(folder)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(folder + os.sep):
            held.append(target)
    return held


def pins_below(folder) -> list:
    return [os.path.join(root, name) for root, dirs, names in os.walk(folder)
            for name in names + dirs if name.startswith(STAGING_PREFIX)]


def wait_until(condition, what: str) -> None:
    done = threading.Event()
    for _ in range(HANG_TIMEOUT_S * 100):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"waited {HANG_TIMEOUT_S} s for {what}")


def held_uploader(service, proxy, **options) -> CloudUploader:
    """An uploader of a new bucket behind ``proxy``."""
    name = unique_bucket_name(service)
    create_bucket(service, name)
    return CloudUploader(make_storage(service, name), **options)


def start_a_stalled_upload(uploader, proxy, tmp_path):
    """Stall the network and start an upload that cannot finish until the proxy is released ("still uploading"
    holds however fast or slow the machine is)."""
    proxy.hold()
    blocker = uploader.submit(write(tmp_path / "stalled" / "first.bin", b"in progress"), "first.bin")
    wait_until(lambda: uploader.queued == 0 and open_files_below(tmp_path / "stalled"),
               "the first upload to start")
    return blocker


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


def test_the_queue_is_bounded_the_submitter_waits_for_room_and_the_wait_is_logged_once(
        service, proxy, tmp_path, aitoolbox_records):
    uploader = held_uploader(service, proxy, max_queued=2)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    checkpoints = [write(tmp_path / "run" / f"model_E{epoch}.pth", os.urandom(20_000)) for epoch in range(4)]
    uploader.submit(checkpoints[0], "model_E0.pth")
    uploader.submit(checkpoints[1], "model_E1.pth")
    assert uploader.queued == 2  # full: the next submit must wait

    submitted = threading.Event()

    def training():  # the training thread, handing over the next checkpoints
        uploader.submit(checkpoints[2], "model_E2.pth")
        uploader.submit(checkpoints[3], "model_E3.pth")
        submitted.set()
    thread = threading.Thread(target=training)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and not submitted.is_set()  # still waiting for room: the network is stalled
    assert uploader.queued == 2 and uploader.pending == 3
    # Only the upload in progress holds a file open (its pin); the queued ones are pinned, not open.
    assert open_files_below(tmp_path) == open_files_below(tmp_path / "stalled")
    assert len(open_files_below(tmp_path)) == 1 and len(pins_below(tmp_path / "run")) == 3
    waits = [record for record in aitoolbox_records.records if record.getMessage().startswith("Waited")]
    assert waits == []  # logged when the wait ends, with its length

    proxy.release()
    assert submitted.wait(HANG_TIMEOUT_S)
    thread.join(HANG_TIMEOUT_S)
    uploader.close()
    waits = [record.getMessage() for record in aitoolbox_records.records if record.getMessage().startswith("Waited")]
    assert len(waits) >= 1 and all("max_queued=2" in message for message in waits)
    assert any("model_E2.pth" in message for message in waits)
    for epoch in range(4):
        assert uploader.storage.download_bytes(f"model_E{epoch}.pth") == open(checkpoints[epoch], "rb").read()
    assert pins_below(tmp_path) == [] and open_files_below(tmp_path) == []


def test_a_newer_version_of_a_queued_file_or_folder_replaces_it(service, proxy, tmp_path, aitoolbox_records):
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    ranking = tmp_path / "run" / "checkpoint_ranking.json"
    versions = []
    for epoch in range(3):
        write(ranking, f"ranking after epoch {epoch}".encode())
        versions.append(uploader.submit(str(ranking), "run/checkpoint_ranking.json"))
    events = tmp_path / "run" / "tensorboard"
    write(events / "events.out.tfevents.1", b"epoch 0;")
    first_folder = uploader.submit_folder(str(events), "run/tensorboard/proj_exp")
    write(events / "events.out.tfevents.1", b"epoch 0;epoch 1;")
    last_folder = uploader.submit_folder(str(events), "run/tensorboard/proj_exp")
    assert uploader.queued == 2  # one upload of each key waits

    proxy.release()
    results = uploader.wait(timeout=HANG_TIMEOUT_S)
    assert [future.cancelled() for future in versions] == [True, True, False]
    assert first_folder.cancelled() and not last_folder.cancelled()
    assert len(results) == 3  # the stalled one, the newest ranking, the newest folder
    assert uploader.storage.download_bytes("run/checkpoint_ranking.json") == b"ranking after epoch 2"
    assert uploader.storage.download_bytes("run/tensorboard/proj_exp/events.out.tfevents.1") == b"epoch 0;epoch 1;"
    assert uploader.storage.is_complete_folder("run/tensorboard/proj_exp")
    dropped = [record for record in aitoolbox_records.records if record.getMessage().startswith("Dropped")]
    assert len(dropped) == 3
    assert pins_below(tmp_path) == []
    uploader.close()


def test_an_upload_carries_the_file_as_it_was_when_submitted(service, proxy, tmp_path):
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    local = write(tmp_path / "model.pth", b"version 1")
    pruned = write(tmp_path / "old.pth", b"pruned later")
    uploader.submit(local, "model.pth")
    uploader.submit(pruned, "old.pth")
    write(tmp_path / "model.pth.new", b"version 2")
    os.replace(tmp_path / "model.pth.new", local)  # the next atomic save of the same name
    os.remove(pruned)  # pruning of old checkpoints
    proxy.release()
    uploader.close()
    assert uploader.storage.download_bytes("model.pth") == b"version 1"
    assert uploader.storage.download_bytes("old.pth") == b"pruned later"  # the bucket keeps every checkpoint
    assert not os.path.exists(pruned) and pins_below(tmp_path) == []  # the pruning stands; no pin is left


def test_a_growing_file_goes_up_as_it_was_when_its_upload_started_and_its_folder_is_complete(
        service, proxy, tmp_path):
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    events = write(tmp_path / "tensorboard" / "events.out.tfevents.1", b"record 1;")
    single = write(tmp_path / "log.txt", b"line 1\n")
    uploader.submit_folder(str(tmp_path / "tensorboard"), "run/tensorboard")
    uploader.submit(single, "run/log.txt")
    for path, more in ((events, b"record 2;"), (single, b"line 2\n")):  # the writers go on appending
        with open(path, "ab") as handle:
            handle.write(more)
    proxy.release()
    uploader.close()
    # Appended in place before the uploads started: they carry it, and the folder's marker its size.
    assert uploader.storage.download_bytes("run/tensorboard/events.out.tfevents.1") == b"record 1;record 2;"
    assert uploader.storage.is_complete_folder("run/tensorboard")
    assert uploader.storage.download_bytes("run/log.txt") == b"line 1\nline 2\n"


def test_a_failed_upload_puts_a_file_removed_meanwhile_back_into_its_folder(service, proxy, tmp_path):
    uploader = CloudUploader(make_storage(service, "aitoolbox-no-such-bucket"))
    proxy.hold()
    checkpoint = write(tmp_path / "run" / "model_E0.pth", b"weights of epoch 0")
    uploader.submit(checkpoint, "run/model_E0.pth")
    assert len(pins_below(tmp_path)) == 1
    os.remove(checkpoint)  # pruned locally before its upload failed
    proxy.release()
    with pytest.raises(CloudNotFoundError):
        uploader.close()
    with open(checkpoint, "rb") as handle:
        assert handle.read() == b"weights of epoch 0"  # it did not reach the bucket: the local folder has it
    assert pins_below(tmp_path) == []


def test_where_a_file_cannot_be_pinned_one_removed_before_its_upload_is_skipped_or_fails_clearly(
        service, proxy, tmp_path, monkeypatch, aitoolbox_records):
    def no_hard_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")  # as on file systems without hard links
    monkeypatch.setattr(os, "link", no_hard_links)
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    pruned = write(tmp_path / "run" / "model_E0.pth", b"0")
    deleted = write(tmp_path / "run" / "notes.txt", b"n")
    skipped = uploader.submit(pruned, "run/model_E0.pth", missing_ok=True)
    failed = uploader.submit(deleted, "run/notes.txt")
    assert open_files_below(tmp_path / "run") == []  # opened only when their uploads start
    os.remove(pruned)
    os.remove(deleted)
    proxy.release()
    with pytest.raises(FileNotFoundError, match="was removed before its upload to .*notes.txt started"):
        uploader.close()
    assert skipped.result() is None and isinstance(failed.exception(), FileNotFoundError)
    warnings = [record.getMessage() for record in aitoolbox_records.records if record.levelname == "WARNING"]
    assert any("Not uploading" in message and "model_E0.pth" in message for message in warnings)
    assert not uploader.storage.exists("run/model_E0.pth")


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
    # Logged by the upload thread, which may still be at it when the future already holds the error.
    wait_until(lambda: any("run/m.pth" in message and "the local file is kept" in message
                           for message in log_messages(aitoolbox_records, "", level="ERROR")),
               "logged the failed upload")


def test_folder_uploads_end_with_their_marker(bucket, tmp_path):
    folder = tmp_path / "tensorboard" / "project_exp"
    write(folder / "events.out.tfevents.1", b"event 1")
    with CloudUploader(bucket) as uploader:
        future = uploader.submit_folder(str(folder), "run/tensorboard/project_exp")
    assert future.result()[-1] == f"run/tensorboard/project_exp/{FOLDER_MARKER}"
    assert bucket.is_complete_folder("run/tensorboard/project_exp")
    assert pins_below(tmp_path) == []


def test_a_missing_local_file_is_refused_at_submit_and_a_closed_uploader_takes_nothing(bucket, tmp_path):
    uploader = CloudUploader(bucket)
    with pytest.raises(FileNotFoundError):
        uploader.submit(str(tmp_path / "missing.pth"), "missing.pth")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        uploader.submit_folder(str(tmp_path / "missing"), "missing")
    with pytest.raises(IsADirectoryError, match="use submit_folder"):
        uploader.submit(str(tmp_path), "folder")
    uploader.close()
    with pytest.raises(RuntimeError, match="closed"):
        uploader.submit(write(tmp_path / "late.pth", b"x"), "late.pth")
    assert pins_below(tmp_path) == []


def test_wait_with_a_timeout_leaves_the_uploads_running(service, proxy, tmp_path):
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    uploader.submit(write(tmp_path / "m.pth", b"1"), "m.pth")
    with pytest.raises(TimeoutError, match="still running"):
        uploader.wait(timeout=0.05)
    proxy.release()
    uploader.close()
    assert uploader.storage.exists("m.pth")


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
    storage = storage_for("s3", "bucket-a")
    with pytest.raises(ValueError, match="max_queued must be an int >= 1, got 0"):
        CloudUploader(storage, max_queued=0)
    with pytest.raises(ValueError, match="max_workers must be an int >= 1, got 0"):
        CloudUploader(storage, max_workers=0)


def test_an_interrupted_close_stops_waiting_and_drops_the_uploads_not_started(service, proxy, tmp_path):
    uploader = held_uploader(service, proxy)
    start_a_stalled_upload(uploader, proxy, tmp_path)
    pruned = write(tmp_path / "m.pth", b"1")
    later = uploader.submit(pruned, "m.pth")
    os.remove(pruned)  # pruned locally while its upload waited
    original_wait = uploader.wait

    def interrupted_wait(timeout=None):
        raise KeyboardInterrupt  # Ctrl-C while waiting

    uploader.wait = interrupted_wait
    with pytest.raises(KeyboardInterrupt):
        uploader.close()  # returns although the upload in progress cannot finish: it did not wait
    assert later.cancelled()
    assert open(pruned, "rb").read() == b"1"  # not uploaded: put back into the local folder
    proxy.release()
    uploader.wait = original_wait
    uploader.wait(timeout=HANG_TIMEOUT_S)
    assert not uploader.storage.exists("m.pth")
