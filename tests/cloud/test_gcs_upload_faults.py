"""A GCS upload whose last answer is lost, or whose bytes are corrupted on the way, against the GCS emulator through
a FaultyProxy: each is reported with its true cause and the right ``transient`` flag (or, when the object was
stored whole, not reported at all)."""
import os

import pytest

from aitoolbox.cloud.storage import CloudNotFoundError, CloudPermissionError, CloudStorageError
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


# --- credentials that may not read the bucket's metadata ----------------------------------------------------------
# roles/storage.objectAdmin and objectCreator, common for training service accounts, lack storage.buckets.get:
# Bucket.exists() answers 403. The emulator has no IAM: the 403 is what google-cloud-storage raises for it.

FORBIDDEN_BUCKET_GET = ("GET https://storage.googleapis.com/storage/v1/b/x: sa@p.iam.gserviceaccount.com does not "
                        "have storage.buckets.get access to the Google Cloud Storage bucket.")


@pytest.fixture
def no_bucket_get(monkeypatch):
    from google.api_core import exceptions
    from google.cloud.storage import Bucket

    def exists(self, *args, **kwargs):
        raise exceptions.Forbidden(FORBIDDEN_BUCKET_GET)
    monkeypatch.setattr(Bucket, "exists", exists)


def test_a_lost_answer_is_settled_by_the_object_for_credentials_that_may_not_read_the_bucket(
        gcs_proxy, bucket_name, no_bucket_get, tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    storage.upload_file(local, "run/model.pth")
    assert gcs_proxy.answers_lost == 1
    assert storage.download_bytes("run/model.pth") == b"weights" * 100


def test_an_upload_to_a_missing_bucket_is_a_missing_bucket_for_credentials_that_may_not_read_it(
        gcs_env, no_bucket_get, tmp_path):
    local = write(tmp_path / "model.pth", b"weights")
    storage = make_storage("gcs", unique_bucket_name("gcs"))
    with pytest.raises(CloudNotFoundError) as raised:
        storage.upload_file(local, "run/model.pth")
    assert raised.value.reason == "NoSuchBucket" and not raised.value.transient
    assert "storage.buckets.get" not in str(raised.value)


def test_a_lost_session_the_credentials_cannot_explain_says_so_not_a_permission_error(
        gcs_proxy, bucket_name, no_bucket_get, tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    gcs_proxy.after_answer_lost = lambda: deleted(bucket_name)
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    with pytest.raises(CloudNotFoundError) as raised:
        storage.upload_file(local, "run/model.pth")
    error, message = raised.value, str(raised.value)
    assert not isinstance(error, CloudPermissionError) and error.reason == "NotFound", message
    assert "bucket" in message and "session" in message and "cannot tell which" in message, message
    assert "Forbidden" not in message and "upload_id=" not in message, message


def test_a_bucket_deleted_while_its_session_ended_is_a_missing_bucket_for_credentials_that_can_tell(
        gcs_proxy, bucket_name, tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)

    def bucket_deleted():
        deleted(bucket_name)
        gcs_client().bucket(bucket_name).delete()
    gcs_proxy.after_answer_lost = bucket_deleted
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    with pytest.raises(CloudNotFoundError) as raised:
        storage.upload_file(local, "run/model.pth")
    assert raised.value.reason == "NoSuchBucket" and not raised.value.transient, str(raised.value)


def test_a_session_url_quoted_in_an_error_has_its_upload_id_redacted(gcs_proxy, bucket_name, tmp_path):
    # The answer to the first of two chunks lost: the client sends it again, and the emulator refuses it (400,
    # "Invalid Content-Range"), an error that quotes the session's URL, whose upload_id lets anyone upload to it.
    local = write(tmp_path / "model.pth", os.urandom(300 * 1024))
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url, chunk_size=256 * 1024)
    gcs_proxy.lose_answer_once_matching = SESSION_REQUEST
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    message = str(raised.value)
    # Only the id goes: the URL's end (": " before the server's answer) stays.
    assert "upload_id=<redacted>: " in message and raised.value.__cause__ is None, message


# --- a corrupted upload whose deletion fails -----------------------------------------------------------------------
# google-cloud-storage deletes the object of an upload it rejected for a checksum mismatch; when that deletion fails,
# its error replaces the DataCorruption (which stays as its __context__).

def refuse_deletes(monkeypatch, error_class, text):
    from google.cloud.storage import Blob
    calls = []

    def delete(self, *args, **kwargs):
        calls.append(self.name)
        raise error_class(text)
    monkeypatch.setattr(Blob, "delete", delete)
    return calls


def test_a_corrupted_upload_whose_deletion_is_refused_says_so_and_names_the_key_left(gcs_proxy, bucket_name,
                                                                                     monkeypatch, tmp_path):
    from google.api_core import exceptions
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    # roles/storage.objectCreator has no storage.objects.delete.
    deletions = refuse_deletes(monkeypatch, exceptions.Forbidden, "DELETE .../o/run%2Fmodel.pth: sa@p does not have "
                                                                  "storage.objects.delete access")
    gcs_proxy.corrupt_once_matching = SESSION_REQUEST
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    error, message = raised.value, str(raised.value)
    assert gcs_proxy.corrupted == 1 and deletions == ["run/model.pth", "run/model.pth"]  # the client's, then ours
    assert error.reason == "DataCorruption" and not error.transient, message
    assert not isinstance(error, (CloudPermissionError, CloudNotFoundError)), message
    assert message.index("checksum") < message.index("could not be deleted"), message
    assert "may remain" in message and "'run/model.pth'" in message and "storage.objects.delete" in message, message
    assert gcs_client().bucket(bucket_name).blob("run/model.pth").exists()  # as the message says: it remains


def test_a_corrupted_upload_whose_deletion_fails_once_is_deleted_by_a_second_try(gcs_proxy, bucket_name,
                                                                                 monkeypatch, tmp_path):
    from google.api_core import exceptions
    from google.cloud.storage import Blob
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    original, calls = Blob.delete, []

    def delete_fails_once(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == 1:
            raise exceptions.ServiceUnavailable("DELETE .../o/run%2Fmodel.pth: backend unavailable")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Blob, "delete", delete_fails_once)
    gcs_proxy.corrupt_once_matching = SESSION_REQUEST
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    message = str(raised.value)
    assert raised.value.reason == "DataCorruption" and len(calls) == 2, message
    assert "deleted it" in message and "nothing of the upload remains" in message, message
    assert not gcs_client().bucket(bucket_name).blob("run/model.pth").exists()


def test_a_corrupted_upload_whose_object_is_already_gone_is_a_checksum_mismatch_not_a_lost_upload(
        gcs_proxy, bucket_name, monkeypatch, tmp_path):
    from google.api_core import exceptions
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    refuse_deletes(monkeypatch, exceptions.NotFound, "DELETE .../o/run%2Fmodel.pth: No such object")
    gcs_proxy.corrupt_once_matching = SESSION_REQUEST
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    error, message = raised.value, str(raised.value)
    assert error.reason == "DataCorruption" and not isinstance(error, CloudNotFoundError), message
    assert "checksum" in message and "no object" in message and "nothing of the upload remains" in message, message


def test_a_download_corrupted_in_transit_speaks_of_the_download_and_its_message_is_cut_cleanly(
        gcs_proxy, bucket_name, tmp_path):
    gcs_client().bucket(bucket_name).blob("run/model.pth").upload_from_string(b"weights" * 100)
    storage = make_storage("gcs", bucket_name, endpoint_url=gcs_proxy.url)
    target = write(tmp_path / "model.pth", b"previous local copy")
    gcs_proxy.replace_in_answer_once = (b"weightsweights", b"weightsWEIGHTS")
    with pytest.raises(CloudStorageError) as raised:
        storage.download_file("run/model.pth", target)
    error, message = raised.value, str(raised.value)
    assert error.reason == "DataCorruption" and not error.transient, message
    assert "download" in message.split("DataCorruption:", 1)[1] and "upload" not in message, message
    assert "...." not in message, message  # the client's long message, cut, then the hint: not glued together
    with open(target, "rb") as handle:
        assert handle.read() == b"previous local copy"
