"""CloudStorage against real servers (moto's S3 server, a GCS emulator): round trips, folders with their
completion marker, and faults (missing bucket, no credentials, network down, connection resets)."""
import os
import subprocess
import sys
import textwrap

import pytest

from aitoolbox.cloud.storage import (
    FOLDER_MARKER, CloudNotFoundError, CloudPermissionError, CloudStorageError, RetryPolicy, join_key)
from tests.cloud.buckets import FAST_RETRY, create_bucket, make_storage, unique_bucket_name
from tests.cloud.servers import free_port


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


def test_uploading_to_a_missing_bucket_names_bucket_and_key_and_is_not_retried(service, tmp_path,
                                                                                aitoolbox_records):
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
    assert not [record for record in aitoolbox_records.records if "attempt" in record.getMessage()]
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


def test_network_down_is_retried_with_backoff_then_raises_naming_bucket_and_key(service, tmp_path,
                                                                                 aitoolbox_records):
    local = write(tmp_path / "model.pth", b"weights")
    dead_endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    retry = RetryPolicy(attempts=4, initial_delay_s=0.01, max_delay_s=0.02)
    storage = make_storage(service, "some-bucket", retry=retry, endpoint_url=dead_endpoint)
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "project/run/model.pth")
    error = raised.value
    assert error.transient and error.attempts == 4 and error.reason == "ConnectionError"
    assert "'some-bucket'" in str(error) and "'project/run/model.pth'" in str(error) and "after 4 attempts" in str(error)
    retries = [record for record in aitoolbox_records.records if "attempt" in record.getMessage()]
    assert len(retries) == 3 and "attempt 2 of 4" in retries[0].getMessage()
    with open(local, "rb") as handle:
        assert handle.read() == b"weights"  # the local copy is kept


def test_connection_resets_are_retried_until_the_upload_succeeds(service, proxy, tmp_path, aitoolbox_records):
    name = unique_bucket_name(service)
    create_bucket(service, name)  # through the proxy, before it misbehaves
    storage = make_storage(service, name, retry=RetryPolicy(attempts=5, initial_delay_s=0.01, max_delay_s=0.02))
    local = write(tmp_path / "model.pth", b"weights" * 100)
    proxy.drop_next(2)
    storage.upload_file(local, "run/model.pth")
    assert proxy.dropped == 2
    retries = [record for record in aitoolbox_records.records if "attempt" in record.getMessage()]
    # google-cloud-storage 3 also fetches the bucket's metadata in a thread of its own (with its own retries),
    # which may take one of the dropped connections; S3 uploads meet both.
    assert len(retries) == 2 if service == "s3" else 1 <= len(retries) <= 2
    assert storage.download_bytes("run/model.pth") == b"weights" * 100


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
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        RetryPolicy(attempts=0)
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


def test_backoff_grows_exponentially_up_to_its_ceiling():
    policy = RetryPolicy(attempts=10, initial_delay_s=0.5, max_delay_s=4.0, multiplier=2.0, jitter=0.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    jittered = RetryPolicy(initial_delay_s=1.0, jitter=0.5)
    assert all(0.5 <= jittered.delay(1) <= 1.0 for _ in range(50))


def test_keys_join_as_aitoolbox_1x_joined_them():
    assert join_key("", "project", "exp_ts") == "project/exp_ts"
    assert join_key("prefix/", "project", "exp_ts", "model") == "prefix/project/exp_ts/model"
    assert join_key("a/b", "", "c") == "a/b/c"
    assert FAST_RETRY.attempts == 3
