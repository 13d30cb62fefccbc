"""The cloud clients leave Python's global ``random`` generator alone.

Training code draws from ``random`` (augmentations, samplers) and a run is reproducible, and resumes bitwise, only
if nothing else draws from it in between. The clients upload from background threads while training goes on, so a
draw of theirs (the jitter of a retry's backoff, a multipart boundary) would move the training's stream at a
moment that depends on the network. Each test seeds ``random``, runs operations through a storage (healthy,
retried, failing), and checks that the state is the one the seed gave, then again after the client had time to do
anything it left running, and that no thread of the client outlives the operation.
"""
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aitoolbox.cloud.storage import CloudStorageError, RetryPolicy
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name
from tests.cloud.servers import FaultyProxy

MiB = 1024 * 1024
QUICK = RetryPolicy(attempts=3, deadline_s=1.0, initial_delay_s=0.01, max_delay_s=0.02)
# What a client left running has this long to draw: the first retry of google-cloud-storage's default policy
# waits up to 1 s.
SETTLE_S = 1.5


def content(size: int) -> bytes:
    """``size`` bytes of text: moto's introspection endpoint, which the SES tests read later in the session, fails
    on objects that are not UTF-8."""
    return (b"weights " * (size // 8 + 1))[:size]


def write(path, data: bytes) -> str:
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def new_threads(before):
    """The threads alive now that were not before, after giving those ending anyway a moment to end."""
    deadline = time.monotonic() + 2.0
    while True:
        left = [thread for thread in threading.enumerate() if thread not in before and thread.is_alive()]
        if not left or time.monotonic() > deadline:
            return [thread.name for thread in left]
        time.sleep(0.05)


@pytest.fixture
def seeded():
    """``random`` seeded; yields the state the seed gives; the test's own state is restored afterwards."""
    saved = random.getstate()
    random.seed(20240917)
    yield random.getstate()
    random.setstate(saved)


def test_a_failed_upload_leaves_random_alone_and_no_client_thread_running(service, proxy, seeded, tmp_path):
    local = write(tmp_path / "model.pth", b"weights" * 100)
    storage = make_storage(service, unique_bucket_name(service), retry=QUICK)
    storage.client  # made before the threads are counted: making it starts none either
    before = set(threading.enumerate())
    proxy.drop_next(10 ** 6)  # the network is down: every request fails, and is retried
    with pytest.raises(CloudStorageError) as raised:
        storage.upload_file(local, "run/model.pth")
    assert raised.value.transient
    assert proxy.dropped >= 2  # the client did retry
    assert random.getstate() == seeded, "the client's retries drew from the global random generator"
    assert new_threads(before) == []
    time.sleep(SETTLE_S)
    assert random.getstate() == seeded, "something the client left running drew from the global random generator"


@pytest.mark.parametrize("mode", ["standard", "adaptive"])
def test_retries_that_succeed_leave_random_alone(service, mode, proxy, seeded, tmp_path):
    if service == "gcs" and mode == "adaptive":
        pytest.skip("the retry mode is botocore's")
    name = unique_bucket_name(service)
    create_bucket(service, name)
    storage = make_storage(service, name, retry=RetryPolicy(attempts=5, mode=mode, initial_delay_s=0.01,
                                                            max_delay_s=0.02))
    local = write(tmp_path / "model.pth", b"weights" * 100)
    random.seed(20240917)  # creating the bucket (the services' own clients, not the code under test) may draw
    proxy.drop_next(1)
    storage.upload_file(local, "run/model.pth")
    proxy.drop_next(1)
    assert storage.download_bytes("run/model.pth") == b"weights" * 100
    assert proxy.dropped == 2
    time.sleep(SETTLE_S)
    assert random.getstate() == seeded


def test_every_operation_on_a_healthy_network_leaves_random_alone(bucket, seeded, tmp_path):
    # google-cloud-storage draws the boundary of a multipart upload (objects up to 8 MiB) from random: small
    # uploads must not go that way.
    sizes = [0, 1, 3000, 256 * 1024]
    before = set(threading.enumerate())
    for size in sizes:
        bucket.upload_bytes(content(size), f"run/{size}.bin")
    for size in sizes:
        assert bucket.download_bytes(f"run/{size}.bin") == content(size)
    assert [obj.size for obj in bucket.list("run/")] == sorted(sizes, key=lambda size: f"run/{size}.bin")
    assert bucket.exists("run/1.bin") and not bucket.exists("run/2.bin")
    bucket.delete("run/1.bin")
    assert new_threads(before) == []
    time.sleep(SETTLE_S)
    assert random.getstate() == seeded


def test_a_chunk_of_a_resumable_upload_retried_leaves_random_alone(gcs_env, seeded, tmp_path):
    # google-cloud-storage retries a chunk through its media layer, not through the JSON API's retry. (An S3 part is
    # retried by the same botocore handler as every request, which the tests above cover; moto's introspection
    # endpoint, which the SES tests read later in the session, fails once it has seen a multipart upload.)
    name = unique_bucket_name("gcs")
    create_bucket("gcs", name)
    proxy = FaultyProxy(gcs_env.port)
    try:
        data = content(9 * MiB)  # above 8 MiB: a resumable upload of known size
        local = write(tmp_path / "model.pth", data)
        storage = make_storage("gcs", name, endpoint_url=proxy.url, chunk_size=4 * MiB)
        random.seed(20240917)
        proxy.reset_once_matching = f"Content-Range: bytes {4 * MiB}-".encode()  # the second chunk, once
        storage.upload_file(local, "run/model.pth")
        assert proxy.resets == 1
        assert storage.download_bytes("run/model.pth") == data
    finally:
        proxy.close()
    time.sleep(SETTLE_S)
    assert random.getstate() == seeded


OPERATIONS = st.lists(st.tuples(st.sampled_from(["upload", "download", "exists", "list", "delete"]),
                                st.integers(min_value=0, max_value=2),  # connections reset before it
                                st.integers(min_value=0, max_value=20_000)),  # the object's size
                      min_size=1, max_size=4)


@pytest.mark.slow
def test_any_operations_with_any_recoverable_resets_leave_random_alone(service, proxy, tmp_path):
    name = unique_bucket_name(service)
    create_bucket(service, name)
    storage = make_storage(service, name, retry=RetryPolicy(attempts=4, initial_delay_s=0.01, max_delay_s=0.02))
    storage.upload_bytes(b"first", "run/model.pth")

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(OPERATIONS, st.integers(min_value=0, max_value=2 ** 32 - 1))
    def check(operations, seed):
        random.seed(seed)
        expected = random.getstate()
        for operation, resets, size in operations:
            proxy.drop_next(resets)
            if operation == "upload":
                storage.upload_bytes(content(size), "run/model.pth")
            elif operation == "download":
                if storage.exists("run/model.pth"):  # not after a delete
                    storage.download_bytes("run/model.pth")
            elif operation == "exists":
                storage.exists("run/model.pth")
            elif operation == "list":
                storage.list("run/")
            else:
                storage.delete("run/model.pth")
            proxy.drop_next(0)
        assert random.getstate() == expected, operations

    saved = random.getstate()
    try:
        check()
    finally:
        random.setstate(saved)


# --- SES: the e-mails of EmailNotification, sent from a background thread while training runs ------------------

@pytest.fixture
def ses_proxy(s3_env, s3_server, monkeypatch):
    """A FaultyProxy in front of moto's SES, the sender verified; the environment points through the proxy."""
    from tests.cloud.test_email_notification import verify_sender
    verify_sender()
    faulty = FaultyProxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", faulty.url)
    yield faulty
    faulty.close()


def test_an_email_whose_sending_is_retried_leaves_random_alone(ses_proxy, s3_env, seeded):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    from tests.cloud.test_email_notification import RECIPIENT, REGION, SENDER, unique_project
    from tests.cloud.test_ses import sent_messages
    sender = SESSender("Bot", SENDER, RECIPIENT, aws_region=REGION)
    subject = f"retried {unique_project()}"
    ses_proxy.drop_next(2)  # the first two attempts fail: botocore retries
    assert sender.send_email(subject, "<p>sent on the third attempt</p>")
    assert ses_proxy.dropped == 2
    assert random.getstate() == seeded, "the SES client's retries drew from the global random generator"
    assert len(sent_messages(s3_env.url, subject)) == 1


def test_the_emails_of_a_training_run_retried_in_the_background_leave_its_random_stream_alone(ses_proxy, seeded):
    from aitoolbox.torchtrain.callbacks.basic import EmailNotification
    from aitoolbox.torchtrain.train_loop import TrainLoop
    from tests.cloud.test_email_notification import RECIPIENT, SENDER, loop_arguments, unique_project
    from tests.hang_limits import HANG_LIMIT_S

    def run(connections_dropped: int):
        """The random state after a 2-epoch run whose e-mails go out while its first connections are dropped."""
        random.seed(20240917)
        callback = EmailNotification("Bot", SENDER, RECIPIENT, unique_project(), "exp")
        ses_proxy.drop_next(connections_dropped)
        TrainLoop(*loop_arguments()).fit(num_epochs=2, callbacks=[callback])
        assert callback.wait_for_queued_emails(HANG_LIMIT_S), callback.unsent()
        return random.getstate()

    healthy = run(0)
    retried = run(2)
    assert ses_proxy.dropped == 2  # the second run's e-mails were retried by botocore (and went out)
    assert retried == healthy, "the e-mails' retries moved the training's random stream"


@pytest.mark.parametrize("config, expected", [
    ("", {"mode": "standard", "total_max_attempts": RetryPolicy().attempts}),  # botocore's default: legacy
    ("retry_mode = adaptive\nmax_attempts = 4\n", {"mode": "adaptive", "total_max_attempts": 4}),
    ("retry_mode = standard\n", {"mode": "standard", "total_max_attempts": RetryPolicy().attempts}),
    ("retry_mode = legacy\nmax_attempts = 2\n", {"mode": "standard", "total_max_attempts": 2}),
])
def test_the_ses_client_keeps_the_retry_settings_of_the_aws_configuration(s3_env, tmp_path, monkeypatch, config,
                                                                           expected):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    config_file = tmp_path / "aws-config"
    config_file.write_text("[default]\n" + config)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config_file))
    retries = SESSender("Bot", "bot@example.com", "me@example.com").client.meta.config.retries
    assert {name: retries.get(name) for name in expected} == expected


def test_an_ses_client_limited_to_two_attempts_by_the_environment_gives_up_after_two(ses_proxy, monkeypatch,
                                                                                       seeded):
    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    from tests.cloud.test_email_notification import RECIPIENT, REGION, SENDER
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    sender = SESSender("Bot", SENDER, RECIPIENT, aws_region=REGION)
    assert sender.client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 2}
    ses_proxy.drop_next(2)
    assert sender.send_email("never sent", "<p>two attempts, both dropped</p>") is None  # logged, not raised
    assert ses_proxy.dropped == 2
    assert random.getstate() == seeded


# --- the pieces: google-api-core's retry and botocore's handler with generators of their own ---------------------

def test_gcs_retry_copies_keep_their_own_generator_and_retry_within_the_policy(seeded):
    pytest.importorskip("google.cloud.storage")
    from google.api_core import exceptions
    from google.api_core.retry import if_exception_type
    from aitoolbox.cloud.gcs_retry import PrivateJitterRetry
    retry = PrivateJitterRetry(if_exception_type(ConnectionError), 0.01, 0.02, 2.0, 5.0)
    copies = [retry.with_delay(initial=0.005, maximum=0.01), retry.with_timeout(0.3),
              retry.with_predicate(if_exception_type(TimeoutError))]
    assert all(type(copy) is PrivateJitterRetry for copy in copies)
    assert len({id(copy._jitter) for copy in copies + [retry]}) == 4

    failures = iter([ConnectionError("reset"), ConnectionError("reset")])

    def flaky():
        error = next(failures, None)
        if error is not None:
            raise error
        return "stored"
    assert retry(flaky)() == "stored"

    def down():
        raise ConnectionError("reset")
    started = time.monotonic()
    with pytest.raises(exceptions.RetryError):
        copies[1](down)()  # until the copy's 0.3 s, not the original's 5 s
    assert time.monotonic() - started < 3.0
    with pytest.raises(ConnectionError):
        copies[2](down)()  # not retried: the copy's predicate
    assert random.getstate() == seeded
    waits = retry._waits()
    assert all(0.0 <= next(waits) <= 0.02 for _ in range(50))


def test_the_gcs_storage_retries_with_the_policys_values(gcs_env):
    from aitoolbox.cloud.gcs import GCSStorage
    from aitoolbox.cloud.gcs_retry import PrivateJitterRetry
    policy = RetryPolicy(deadline_s=7.0, initial_delay_s=0.5, max_delay_s=3.0, multiplier=1.5)
    retry = GCSStorage("some-bucket", retry=policy)._retry
    assert type(retry) is PrivateJitterRetry
    assert (retry._initial, retry._maximum, retry._multiplier, retry._retry_timeout()) == (0.5, 3.0, 1.5, 7.0)


def test_an_s3_client_whose_botocore_is_laid_out_otherwise_keeps_botocores_retries_and_warns(
        s3_env, monkeypatch):
    from botocore.retries import standard
    register = standard.register_retry_handler

    def registers_and_returns_something_else(*args, **kwargs):  # a botocore of another shape
        register(*args, **kwargs)
        return object()
    monkeypatch.setattr(standard, "register_retry_handler", registers_and_returns_something_else)
    name = unique_bucket_name("s3")
    create_bucket("s3", name)
    proxy = FaultyProxy(s3_env.port)
    try:
        storage = make_storage("s3", name, endpoint_url=proxy.url)
        with pytest.warns(RuntimeWarning, match="global random"):
            storage.client
        proxy.drop_next(1)
        storage.upload_bytes(b"weights", "run/model.pth")  # retried by botocore's own handler
        assert proxy.dropped == 1
        assert storage.download_bytes("run/model.pth") == b"weights"
    finally:
        proxy.close()


def test_a_google_cloud_storage_older_than_3_is_warned_about(gcs_env, monkeypatch):
    import google.cloud.storage
    from aitoolbox.cloud.gcs import GCSStorage
    monkeypatch.setattr(google.cloud.storage, "__version__", "2.18.2")  # its media retries use the global random
    with pytest.warns(RuntimeWarning, match=r"google-cloud-storage 2\.18\.2 .*global random.*>=3"):
        GCSStorage("some-bucket")


@pytest.mark.parametrize("mode", ["garbage", "STANDARD", "Adaptive"])
def test_an_invalid_retry_mode_in_the_environment_raises_as_boto3_does_not_silently_changed(s3_env, monkeypatch,
                                                                                           mode):
    # botocore matches the mode exactly ('Adaptive' is not 'adaptive'): boto3's own client refuses it, and so must
    # the SES client, rather than run in another mode than the user's.
    import boto3
    from botocore.exceptions import InvalidRetryModeError

    from aitoolbox.cloud.AWS.simple_email_service import SESSender
    monkeypatch.setenv("AWS_RETRY_MODE", mode)
    with pytest.raises(InvalidRetryModeError):
        boto3.session.Session().client("ses", region_name="us-east-1")
    with pytest.raises(InvalidRetryModeError) as raised:
        SESSender("Bot", "bot@example.com", "me@example.com")
    assert mode in str(raised.value)
