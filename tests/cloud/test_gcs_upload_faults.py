"""A GCS upload whose last answer is lost, or whose bytes are corrupted on the way, against the GCS emulator through
a FaultyProxy: each is reported with its true cause and the right ``transient`` flag (or, when the object was
stored whole, not reported at all)."""
import os

import pytest

from aitoolbox.cloud.storage import CloudNotFoundError, CloudStorageError
from tests.cloud.buckets import create_bucket, gcs_client, make_storage, unique_bucket_name
from tests.cloud.servers import FaultyProxy

MiB = 1024 * 1024
# The requests of a resumable upload's session (its data); the request that starts the session has no upload_id.
SESSION_REQUEST = b"upload_id="


@pytest.fixture
def gcs_proxy(gcs_env):
    faulty = FaultyProxy(gcs_env.port)
    yield faulty
    faulty.close()


@pytest.fixture
def bucket_name(gcs_env):
    name = unique_bucket_name("gcs")
    create_bucket("gcs", name)
    return name


def write(path, data: bytes) -> str:
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


# --- the last answer of an upload lost ----------------------------------------------------------------------------

@pytest.mark.parametrize("size", [700, 9 * MiB])  # one request of data (an unknown size), or three chunks
def test_an_upload_whose_last_answer_is_lost_after_the_object_was_stored_succeeds(gcs_proxy, bucket_name, size,
                                                                                   tmp_path):
    data = os.urandom(size)
    local = write(tmp_path / "model.pth", data)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url, chunk_size=4 * MiB)
    # The request that ends the session: its Content-Range ends with the object's size.
    gcs_proxy.lose_answer_once_matching = f"-{size - 1}/{size}".encode()
    assert storage.upload_file(local, "run/model.pth") == f"gs://{bucket_name}/run/model.pth"
    assert gcs_proxy.answers_lost == 1  # the client did not hear that the object was stored ...
    assert storage.download_bytes("run/model.pth") == data  # ... and it is, whole


def test_a_lost_answer_with_a_gone_session_is_reported_by_the_410_too(gcs_proxy, bucket_name, tmp_path):
    # GCS answers a finished session 404 or 410 (the emulator: 404, turned into 410 here).
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    gcs_proxy.replace_in_answer_once = (b" 404 Not Found", b" 410 Gone")
    storage.upload_file(local, "run/model.pth")
    assert gcs_proxy.answers_lost == 1 and gcs_proxy.replace_in_answer_once is None  # the 410 was answered
    assert storage.download_bytes("run/model.pth") == b"weights" * 100


def deleted(bucket_name: str) -> None:
    gcs_client().bucket(bucket_name).blob("run/model.pth").delete()


def overwritten_with_the_same_size(bucket_name: str) -> None:
    gcs_client().bucket(bucket_name).blob("run/model.pth").upload_from_string(b"WEIGHTS" * 100)


@pytest.mark.parametrize("gone", [b" 404 Not Found", b" 410 Gone"])
@pytest.mark.parametrize("meanwhile", [deleted, overwritten_with_the_same_size])
def test_a_lost_session_whose_object_is_not_there_is_a_transient_lost_session_not_a_missing_bucket(
        gcs_proxy, bucket_name, gone, meanwhile, tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    # Between the server's answer and the client's retry, another writer (or a lifecycle rule) changes the object:
    # the session is finished, and the bucket does not hold this file.
    gcs_proxy.after_answer_lost = lambda: meanwhile(bucket_name)
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    gcs_proxy.replace_in_answer_once = (b" 404 Not Found", gone)
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    error = raised.value
    assert gcs_proxy.answers_lost == 1
    assert not isinstance(error, CloudNotFoundError) and "NoSuchBucket" not in str(error)
    assert "create it" not in str(error)
    assert error.transient and error.reason == "UploadSessionLost" and error.local_path == local
    assert "session" in str(error) and "upload the file again" in str(error), str(error)
    assert storage.upload_file(local, "run/model.pth")  # it was: a new upload goes through


def test_an_upload_to_a_missing_bucket_is_still_a_missing_bucket(gcs_env, tmp_path):
    local = write(tmp_path / "model.pth", b"weights")
    storage = make_storage("gcs", unique_bucket_name("gcs"))
    with pytest.raises(CloudNotFoundError) as raised:
        storage.upload_file(local, "run/model.pth")
    assert raised.value.reason == "NoSuchBucket" and not raised.value.transient


# --- bytes corrupted on the way -----------------------------------------------------------------------------------

def test_an_upload_corrupted_in_transit_is_reported_as_verified_and_rejected_not_as_retried(gcs_proxy, bucket_name,
                                                                                             tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    gcs_proxy.corrupt_once_matching = SESSION_REQUEST  # one byte of the data flipped between client and server
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    error = raised.value
    assert gcs_proxy.corrupted == 1
    assert error.reason == "DataCorruption" and not error.transient and error.attempts == 1
    message = str(error)
    assert "retries" not in message and "attempts" not in message, message
    assert "checksum" in message and "verified and rejected" in message and "corrupted" in message, message
    assert not storage.exists("run/model.pth")  # the client deleted what the server stored
    assert storage.upload_file(local, "run/model.pth")  # sent again, it goes up whole
    assert storage.download_bytes("run/model.pth") == b"weights" * 100
