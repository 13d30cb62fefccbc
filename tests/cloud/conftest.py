"""Fixtures of the cloud tests: moto's S3 server and a GCS emulator, started once per session on 127.0.0.1.

The tests of a service are skipped when its client or server package is not installed
(``pip install 'moto[server]' boto3 google-cloud-storage gcp-storage-emulator``). Each test gets its own bucket,
and the standard environment variables (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, ...) set through
monkeypatch, pointing at the servers. Nothing reaches beyond 127.0.0.1: the clients' metadata-server
lookups (EC2 instance roles, GCE credentials) are switched off.

No test may leave a thread running (:func:`no_thread_left_running`): a client's thread that outlives its test
(google-cloud-storage's bucket-metadata fetch, retrying against a server gone) would go on sending requests and
drawing from Python's global ``random`` during the tests after it, which compare that generator's state.
"""
import logging
import threading
import time

import pytest

from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name
from tests.cloud.servers import FaultyProxy, gcs_emulator, moto_server, start_server

# How long the threads a test started have, after it, to end by themselves (an uploader's worker finishing).
THREAD_GRACE_S = 10.0
# Threads of the process rather than of a test: tqdm's one progress-bar monitor (started by the first progress bar,
# it sends nothing and draws nothing).
PROCESS_THREADS = {"tqdm_monitor"}


@pytest.fixture(autouse=True)
def no_thread_left_running():
    """Fail the test (at teardown, after its other fixtures) when a thread it started is still running
    ``THREAD_GRACE_S`` seconds later, naming the threads."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE_S
    while True:
        left = [thread for thread in threading.enumerate()
                if thread not in before and thread.is_alive() and thread.name not in PROCESS_THREADS]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if left:
        pytest.fail(f"the test left {len(left)} thread(s) running {THREAD_GRACE_S} s after it ended: "
                    f"{sorted(thread.name for thread in left)}; stop or join them in the test (or its fixtures)",
                    pytrace=False)

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server", reason="moto's server needs: pip install 'moto[server]'")
    pytest.importorskip("flask", reason="moto's server needs: pip install 'moto[server]'")
    server = start_server(moto_server, str(tmp_path_factory.mktemp("servers")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    pytest.importorskip("google.cloud.storage")
    pytest.importorskip("gcp_storage_emulator")
    server = start_server(gcs_emulator, str(tmp_path_factory.mktemp("servers")))
    yield server
    server.stop()


def no_aws_metadata(monkeypatch, tmp_path) -> None:
    """No AWS configuration from this machine, and no instance-metadata lookups (they would leave 127.0.0.1)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_SES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture
def s3_env(monkeypatch, tmp_path, s3_server):
    """The standard AWS variables pointing at moto's server, with test credentials."""
    no_aws_metadata(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_server


@pytest.fixture
def gcs_env(monkeypatch, gcs_server):
    """``STORAGE_EMULATOR_HOST`` pointing at the emulator (the client then uses anonymous credentials)."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "aitoolbox-test")
    return gcs_server


@pytest.fixture(params=["s3", "gcs"])
def service(request):
    """Each test that takes it runs against S3 (moto) and GCS (the emulator), with the environment set."""
    request.getfixturevalue(f"{request.param}_env")
    return request.param


@pytest.fixture
def bucket(service):
    """A new, empty bucket of ``service``: its CloudStorage."""
    name = unique_bucket_name(service)
    create_bucket(service, name)
    return make_storage(service, name)


@pytest.fixture
def proxy(service, request, monkeypatch):
    """A FaultyProxy in front of the service's server, with the environment pointing through it."""
    server = request.getfixturevalue(f"{service}_server")
    faulty = FaultyProxy(server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL" if service == "s3" else "STORAGE_EMULATOR_HOST", faulty.url)
    yield faulty
    faulty.close()


@pytest.fixture
def aitoolbox_records(monkeypatch, caplog):
    """caplog with the records of the ``aitoolbox`` logger (which does not propagate by default)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO, logger="aitoolbox")
    return caplog
