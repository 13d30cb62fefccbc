"""A GCS upload whose bytes are corrupted on the way, against the GCS emulator through a FaultyProxy: reported with
its true cause and the right ``transient`` flag."""
import os

import pytest

from aitoolbox.cloud.storage import CloudStorageError
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name
from tests.cloud.servers import FaultyProxy

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
