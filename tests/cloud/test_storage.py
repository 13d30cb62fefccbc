"""CloudStorage against real servers (moto's S3 server, a GCS emulator): round trips, folders with their
completion marker, and faults (missing bucket, no credentials, network down, connection resets, a part of a
large upload failing), retried by the clients' own policies."""
import os
import subprocess
import sys
import textwrap

import pytest

from aitoolbox.cloud.storage import (
    FOLDER_MARKER, CloudNotFoundError, CloudPermissionError, CloudStorageError, RetryPolicy, join_key)
from tests.cloud.buckets import FAST_RETRY, create_bucket, make_storage, unique_bucket_name
from tests.cloud.servers import FaultyProxy, free_port


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def test_file_round_trip_list_exists_delete(bucket, tmp_path):
    data = os.urandom(3000)
    local = write(tmp_path / "model.pth", data)
    uri = bucket.upload_file(local, "project/run/model.pth")
    assert uri == f"{bucket.scheme}://{bucket.bucket_name}/project/run/model.pth"
    assert bucket.exists("project/run/model.pth")
    assert not bucket.exists("project/run/other.pth")
    assert [(obj.key, obj.size) for obj in bucket.list("project/")] == [("project/run/model.pth", 3000)]

    downloaded = bucket.download_file("project/run/model.pth", str(tmp_path / "down" / "model.pth"))
    with open(downloaded, "rb") as handle:
        assert handle.read() == data
    assert not [name for name in os.listdir(tmp_path / "down") if name != "model.pth"]  # no temp files left
    assert bucket.download_bytes("project/run/model.pth") == data

    bucket.delete("project/run/model.pth")
    assert not bucket.exists("project/run/model.pth")
    bucket.delete("project/run/model.pth")  # deleting a missing object is no error
    assert os.path.exists(local)  # the local file is never removed


def test_a_large_file_goes_up_in_parts_and_comes_back_whole(bucket, tmp_path):
    # 9 MiB: above both clients' thresholds for multipart (S3) and resumable (GCS) uploads.
    data = os.urandom(9 * 1024 * 1024)
    local = write(tmp_path / "big.pth", data)
    bucket.upload_file(local, "big.pth")
    assert bucket.list("big")[0].size == len(data)
    assert bucket.download_bytes("big.pth") == data


def test_folder_upload_writes_its_marker_last_and_downloads_whole(bucket, tmp_path):
    folder = tmp_path / "model_exp_ts_E3"
    write(folder / ".metadata", b"index")
    write(folder / "__0_0.distcp", os.urandom(500))
    write(folder / "checkpoint.json", b"{}")
    write(folder / "sub" / "extra_rank0.pt", b"extra")
    write(folder / ".tmp-half-written", b"never uploaded")

    keys = bucket.upload_folder(str(folder), "run/checkpoint_model/model_exp_ts_E3")
    prefix = "run/checkpoint_model/model_exp_ts_E3/"
    assert keys[-1] == prefix + FOLDER_MARKER
    assert keys[-2] == prefix + "checkpoint.json"  # a sharded checkpoint's own marker after its other files
    assert sorted(keys[:-2]) == [prefix + ".metadata", prefix + "__0_0.distcp", prefix + "sub/extra_rank0.pt"]
    assert bucket.folder_manifest(prefix) == {".metadata": 5, "__0_0.distcp": 500, "checkpoint.json": 2,
                                              "sub/extra_rank0.pt": 5}
    assert bucket.is_complete_folder(prefix)

    local = bucket.download_folder(prefix, str(tmp_path / "down" / "model_exp_ts_E3"))
    for relative in (".metadata", "__0_0.distcp", "checkpoint.json", "sub/extra_rank0.pt"):
        with open(os.path.join(local, relative), "rb") as got, open(folder / relative, "rb") as want:
            assert got.read() == want.read()
    assert not os.path.exists(os.path.join(local, ".tmp-half-written"))
    assert sorted(os.listdir(tmp_path / "down")) == ["model_exp_ts_E3"]


def test_a_folder_without_its_marker_is_not_complete_and_is_not_downloaded(bucket, tmp_path):
    folder = tmp_path / "tb"
    write(folder / "events.out", b"event")
    bucket.upload_folder(str(folder), "run/tb", complete_marker=False)
    assert bucket.exists("run/tb/events.out")
    assert not bucket.is_complete_folder("run/tb")
    with pytest.raises(CloudNotFoundError, match="not a complete folder"):
        bucket.download_folder("run/tb", str(tmp_path / "down"))
    assert not os.path.exists(tmp_path / "down")

    bucket.upload_folder(str(folder), "run/tb")
    bucket.delete("run/tb/events.out")  # a file the marker lists has gone
    assert not bucket.is_complete_folder("run/tb")

    bucket.upload_folder(str(folder), "run/tb")
    assert bucket.delete_folder("run/tb") == 1
    assert bucket.list("run/tb/") == []


def test_uploading_to_a_missing_bucket_names_bucket_and_key(service, tmp_path):
    local = write(tmp_path / "model.pth", b"weights")
    missing = make_storage(service, "aitoolbox-no-such-bucket")
    with pytest.raises(CloudNotFoundError) as raised:
        missing.upload_file(local, "project/run/model.pth")
    error = raised.value
    assert (error.bucket, error.key, error.reason, error.attempts) == (
        "aitoolbox-no-such-bucket", "project/run/model.pth", "NoSuchBucket", 1)
    assert "'aitoolbox-no-such-bucket'" in str(error) and "'project/run/model.pth'" in str(error)
    assert local in str(error)
    assert "does not exist: create it" in str(error)
    assert isinstance(error, FileNotFoundError)
    assert os.path.exists(local)

    with pytest.raises(CloudNotFoundError, match="aitoolbox-no-such-bucket"):
        missing.exists("anything")
    with pytest.raises(CloudNotFoundError, match="aitoolbox-no-such-bucket"):
        missing.list("project/")


def test_downloading_a_missing_object_names_it(bucket, tmp_path):
    target = tmp_path / "model.pth"
    write(target, b"earlier download")
    with pytest.raises(CloudNotFoundError) as raised:
        bucket.download_file("project/run/missing.pth", str(target))
    assert raised.value.key == "project/run/missing.pth" and "missing.pth" in str(raised.value)
    assert raised.value.bucket == bucket.bucket_name
    with open(target, "rb") as handle:
        assert handle.read() == b"earlier download"  # a failed download leaves the earlier file alone
    assert os.listdir(tmp_path) == ["model.pth"]


MiB = 1024 * 1024


def test_a_network_that_stays_down_is_retried_by_the_client_then_raises_naming_bucket_and_key(service, proxy,
                                                                                                tmp_path):
    local = write(tmp_path / "model.pth", b"weights")
    proxy.drop_next(1000)  # every connection is reset
    retry = RetryPolicy(attempts=3, deadline_s=1.0, initial_delay_s=0.01, max_delay_s=0.02)
    storage = make_storage(service, "some-bucket", retry=retry)
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "project/run/model.pth")
    error = raised.value
    assert error.transient and error.reason == "ConnectionError"
    assert "'some-bucket'" in str(error) and "'project/run/model.pth'" in str(error)
    assert "retried per RetryPolicy" in str(error), str(error)  # the client does not say how many attempts
    if service == "s3":
        assert proxy.dropped == 3  # botocore's attempts, as the policy says
    else:
        assert proxy.dropped >= 2  # google-api-core's retries, for deadline_s
    with open(local, "rb") as handle:
        assert handle.read() == b"weights"  # the local copy is kept


def test_connection_resets_are_retried_until_the_upload_succeeds(service, proxy, tmp_path):
    name = unique_bucket_name(service)
    create_bucket(service, name)  # through the proxy, before it misbehaves
    storage = make_storage(service, name, retry=RetryPolicy(attempts=5, initial_delay_s=0.01, max_delay_s=0.02))
    local = write(tmp_path / "model.pth", b"weights" * 100)
    proxy.drop_next(2)
    storage.upload_file(local, "run/model.pth")
    assert proxy.dropped == 2
    assert storage.download_bytes("run/model.pth") == b"weights" * 100


def test_a_part_that_fails_once_is_sent_again_alone_not_the_whole_object_from_byte_0(service, proxy, tmp_path):
    name = unique_bucket_name(service)
    create_bucket(service, name)
    size = 12 * MiB  # above the 8 MiB at which GCS's client starts a resumable upload
    data = os.urandom(size)
    local = write(tmp_path / "model.pth", data)
    if service == "s3":
        from boto3.s3.transfer import TransferConfig
        part = 5 * MiB  # S3's smallest part; one at a time, so that the reset falls in the second
        storage = make_storage(service, name, transfer_config=TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=1, use_threads=False))
    else:
        part = 4 * MiB
        storage = make_storage(service, name, chunk_size=part)
    before = proxy.forwarded_bytes
    if service == "s3":
        proxy.reset_once_after_bytes = before + part + part // 2  # in the middle of the second part
    else:
        # The second chunk's request fails before reaching the emulator: the emulator rejects a chunk sent again
        # over bytes it kept of an interrupted one, which google-cloud-storage's retry does (it re-sends the
        # whole failed chunk); this test does not say what GCS itself does then.
        proxy.reset_once_matching = f"Content-Range: bytes {part}-".encode()
    storage.upload_file(local, "run/model.pth")
    sent = proxy.forwarded_bytes - before
    assert proxy.resets == 1
    # The object once, plus what the reset cut short (less than a part): starting again from byte 0 would have
    # sent at least a part more than the object.
    assert size < sent < size + part
    assert storage.download_bytes("run/model.pth") == data


def test_a_folder_upload_cut_off_midway_is_never_complete(service, proxy, tmp_path):
    name = unique_bucket_name(service)
    create_bucket(service, name)
    through_proxy = make_storage(service, name)
    folder = tmp_path / "model_exp_ts_E1"
    for index in range(4):
        write(folder / f"__{index}_0.distcp", os.urandom(200_000))
    proxy.cut_after_bytes = 450_000  # the network goes down during the third file
    with pytest.raises(CloudStorageError) as raised:
        through_proxy.upload_folder(str(folder), "run/model_exp_ts_E1")
    assert raised.value.transient and raised.value.bucket == name

    direct = make_storage(service, name, endpoint_url=proxy_upstream(service, proxy))
    uploaded = {obj.key for obj in direct.list("run/")}
    assert "run/model_exp_ts_E1/__0_0.distcp" in uploaded  # some files went up ...
    assert join_key("run/model_exp_ts_E1", FOLDER_MARKER) not in uploaded  # ... but never the marker
    assert not direct.is_complete_folder("run/model_exp_ts_E1")
    assert all(os.path.exists(folder / f"__{index}_0.distcp") for index in range(4))


def proxy_upstream(service, proxy) -> str:
    return f"http://127.0.0.1:{proxy.upstream_port}"


def test_s3_without_credentials_says_how_to_give_them(s3_env, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    local = write(tmp_path / "model.pth", b"weights")
    storage = make_storage("s3", "my-bucket")
    with pytest.raises(CloudPermissionError) as raised:
        storage.upload_file(local, "project/model.pth")
    assert raised.value.reason == "NoCredentials" and raised.value.attempts == 1
    assert "'my-bucket'" in str(raised.value) and "'project/model.pth'" in str(raised.value)
    assert "AWS_ACCESS_KEY_ID" in str(raised.value)
    assert os.path.exists(local)


def test_gcs_without_credentials_says_how_to_give_them(gcs_server, tmp_path):
    # A fresh process: google-auth reads NO_GCE_CHECK when imported; with it, no metadata server is asked.
    closed = f"127.0.0.1:{free_port()}"
    env = {key: value for key, value in os.environ.items()
           if key not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")}
    env.update(NO_GCE_CHECK="true", GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed, HOME=str(tmp_path),
               CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    local = write(tmp_path / "model.pth", b"weights")
    script = textwrap.dedent(f"""
        from aitoolbox.cloud.gcs import GCSStorage
        from aitoolbox.cloud.storage import CloudPermissionError
        try:
            GCSStorage("my-bucket").upload_file({local!r}, "project/model.pth")
        except CloudPermissionError as error:
            print(error.reason, error.attempts)
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr[-2000:]
    first_line, message = result.stdout.split("\n", 1)
    assert first_line == "NoCredentials 1"
    assert "'my-bucket'" in message and "'project/model.pth'" in message and "GOOGLE_APPLICATION_CREDENTIALS" in message
    assert os.path.exists(local)


def test_bad_arguments_are_refused_plainly():
    with pytest.raises(ValueError, match="attempts must be an int >= 1, got 0"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match=r"mode must be one of \('standard', 'adaptive'\), got 'legacy'"):
        RetryPolicy(mode="legacy")
    with pytest.raises(ValueError, match="deadline_s > 0"):
        RetryPolicy(deadline_s=0)
    pytest.importorskip("google.cloud.storage")
    from aitoolbox.cloud.gcs import GCSStorage
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 256 KiB"):
        GCSStorage("bucket-name", chunk_size=1000)
    pytest.importorskip("boto3")
    from aitoolbox.cloud.s3 import S3Storage
    with pytest.raises(ValueError, match="bucket_name must be a bucket's name"):
        S3Storage("bucket/with/slash")


def test_a_missing_client_names_the_pip_extra(monkeypatch):
    from aitoolbox.cloud.gcs import GCSStorage
    from aitoolbox.cloud.s3 import S3Storage
    from aitoolbox.cloud.uploader import uploader_for
    monkeypatch.setitem(sys.modules, "boto3", None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    with pytest.raises(ImportError, match=r"pip install aitoolbox\[aws\]"):
        S3Storage("bucket-name")
    with pytest.raises(ImportError, match=r"pip install aitoolbox\[gcs\]"):
        GCSStorage("bucket-name")
    with pytest.raises(ImportError, match=r"aitoolbox\[gcs\]"):
        uploader_for("gcs", "bucket-name")


def test_the_retry_policy_configures_the_clients_own_retries(s3_env, gcs_env):
    policy = RetryPolicy(attempts=7, mode="adaptive", deadline_s=30.0, initial_delay_s=0.5, max_delay_s=8.0,
                         multiplier=3.0)
    s3 = make_storage("s3", "bucket-a", retry=policy)
    assert s3.client.meta.config.retries == {"total_max_attempts": 7, "mode": "adaptive"}
    gcs_retry = make_storage("gcs", "bucket-b", retry=policy)._retry
    assert (gcs_retry._initial, gcs_retry._maximum, gcs_retry._multiplier, gcs_retry._timeout) == (0.5, 8.0, 3.0,
                                                                                                   30.0)
    default = make_storage("s3", "bucket-a", retry=RetryPolicy())
    assert default.client.meta.config.retries == {"total_max_attempts": 5, "mode": "standard"}


def test_keys_join_as_aitoolbox_1x_joined_them():
    assert join_key("", "project", "exp_ts") == "project/exp_ts"
    assert join_key("prefix/", "project", "exp_ts", "model") == "prefix/project/exp_ts/model"
    assert join_key("a/b", "", "c") == "a/b/c"
    assert FAST_RETRY.attempts == 3


def test_a_transient_error_tried_once_does_not_claim_retries(s3_env, tmp_path):
    # RetryPolicy(attempts=1): botocore does not retry; the error is transient (a 503), and its message must not
    # say that the client retried it.
    name = unique_bucket_name("s3")
    create_bucket("s3", name)
    proxy = FaultyProxy(s3_env.port)
    try:
        storage = make_storage("s3", name, retry=RetryPolicy(attempts=1), endpoint_url=proxy.url)
        proxy.replace_in_answer_once = (b" 200 OK", b" 503 Service Unavailable")
        with pytest.raises(CloudStorageError) as raised:
            storage.upload_bytes(b"weights", "run/model.pth")
    finally:
        proxy.close()
    assert raised.value.transient and raised.value.attempts == 1
    message = str(raised.value)
    assert "after the client's retries" not in message and "attempts" not in message, message


def test_a_connection_error_tried_once_does_not_claim_retries(s3_env):
    # RetryPolicy(attempts=1) and nothing listening: botocore tries once and does not say how many attempts it made.
    storage = make_storage("s3", "some-bucket", retry=RetryPolicy(attempts=1),
                           endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_bytes(b"weights", "run/model.pth")
    assert raised.value.transient and raised.value.reason == "ConnectionError"
    message = str(raised.value)
    assert "retries" not in message and "retried" not in message and "attempts" not in message, message


def test_a_gcs_request_that_outlasts_the_deadline_at_once_does_not_claim_retries(gcs_env):
    # One request that stalls past deadline_s: google-api-core gives up after that single attempt.
    name = unique_bucket_name("gcs")
    create_bucket("gcs", name)
    proxy = FaultyProxy(gcs_env.port)
    storage = make_storage("gcs", name, endpoint_url=proxy.url, timeout_s=2.0,
                           retry=RetryPolicy(deadline_s=1.0, initial_delay_s=0.01, max_delay_s=0.05))
    proxy.hold()
    try:
        with pytest.raises(CloudStorageError) as raised:
            storage.upload_bytes(b"weights", "run/model.pth")
    finally:
        proxy.release()
        proxy.close()
    message = str(raised.value)
    assert raised.value.transient and "after the client's retries" not in message, message
    assert "(retried per RetryPolicy, until a deadline of 1 s)" in message, message
