"""Helpers of the cloud tests: buckets made with the services' own clients, and storages under test."""
import uuid

from aitoolbox.cloud.storage import RetryPolicy

# Few retries, so that tests of faults that last end in seconds (botocore waits up to 1 s, then 2 s, between its
# attempts; google-api-core retries for deadline_s, quickly).
FAST_RETRY = RetryPolicy(attempts=3, deadline_s=3.0, initial_delay_s=0.01, max_delay_s=0.05)


def unique_bucket_name(service: str) -> str:
    """A bucket name no other test uses (the servers live for the whole session)."""
    return f"aitoolbox-test-{service}-{uuid.uuid4().hex[:16]}"


def create_bucket(service: str, name: str) -> None:
    """Create a bucket with the service's own client (not the code under test)."""
    if service == "s3":
        import boto3
        boto3.session.Session().client("s3").create_bucket(Bucket=name)
    else:
        gcs_client().create_bucket(name)


def gcs_client():
    """google-cloud-storage's own client, without its cache of bucket metadata: the cache's background thread
    would outlive the test (retrying for 120 s when the test's proxy then drops connections), drawing from the
    global random generator meanwhile (see tests/cloud/conftest.py)."""
    from google.cloud import storage
    client = storage.Client()
    if getattr(client, "_bucket_metadata_cache", None) is not None:
        client._bucket_metadata_cache = None
    return client


def make_storage(service: str, bucket_name: str, retry: RetryPolicy = FAST_RETRY, **options):
    """The storage under test for ``service``, with few, quick retries."""
    if service == "s3":
        from aitoolbox.cloud.s3 import S3Storage
        return S3Storage(bucket_name, retry=retry, **options)
    from aitoolbox.cloud.gcs import GCSStorage
    return GCSStorage(bucket_name, retry=retry, **options)
