"""AWS S3 (and S3-compatible stores: MinIO, Ceph, moto) through boto3, AWS's maintained SDK.

The client comes from boto3's standard configuration chain: credentials from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``), ``AWS_PROFILE``, ``~/.aws/credentials`` and
``~/.aws/config``, SSO, container and instance roles; the region from ``AWS_DEFAULT_REGION`` / ``AWS_REGION`` or
the config file; the endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (or ``endpoint_url`` in the
config file), which is how an S3-compatible store is reached. Files are transferred with boto3's managed
transfers (multipart uploads above 8 MiB, published only when complete).

Transient errors are retried by botocore itself, request by request (``retries={'mode': 'standard',
'total_max_attempts': ...}`` from :class:`~aitoolbox.cloud.errors.RetryPolicy`): one failed part of a multipart
upload is sent again, the parts already stored are not. Their waits are drawn from a generator of the client's own
(:mod:`aitoolbox.cloud.s3_retry`), not from Python's global ``random``, which training draws from.
"""
from typing import IO, Any, Iterator, Optional

from aitoolbox.cloud.bounded import ReadWindow
from aitoolbox.cloud.s3_retry import use_private_jitter
from aitoolbox.cloud.storage import (
    CloudNotFoundError, CloudObject, CloudPermissionError, CloudStorage, Failure, MissingBucket, MissingObject,
    RetryPolicy)

_INSTALL = "AWS S3 support needs boto3: pip install aitoolbox[aws]"

# Error codes that a retry can cure (besides every HTTP 5xx and 429).
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
                    "ProvisionedThroughputExceededException", "BandwidthLimitExceeded", "RequestTimeout",
                    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "PriorRequestNotComplete",
                    "EC2ThrottledException", "IDPCommunicationError"}
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                 "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem"}
_CREDENTIALS_HINT = ("Give credentials the standard AWS way: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                     "AWS_PROFILE, ~/.aws/credentials, or an instance / container role")


def import_boto3():
    """boto3 and botocore, or an ImportError that names the pip extra."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
        import botocore.session
    except ImportError as error:
        raise ImportError(_INSTALL) from error
    return boto3, botocore


class S3Storage(CloudStorage):
    """One S3 bucket.

    Args:
        bucket_name: the bucket.
        endpoint_url: the store's URL, e.g. ``http://127.0.0.1:9000`` for MinIO; None: boto3's configuration
            (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the config file, else AWS itself).
        region_name: None: boto3's configuration (``AWS_DEFAULT_REGION``, the config file).
        retry: how botocore retries transient errors: ``attempts`` tries of each request in ``mode``
            (``'standard'`` or ``'adaptive'``); :class:`~aitoolbox.cloud.errors.RetryPolicy` ``()`` when None.
        connect_timeout_s: how long to wait for a connection before the attempt counts as failed.
        read_timeout_s: how long to wait for data on an open connection.
        transfer_config: a ``boto3.s3.transfer.TransferConfig`` (part sizes, concurrency); boto3's default if None.
    """

    service = "AWS S3"
    scheme = "s3"

    def __init__(self, bucket_name: str, endpoint_url: Optional[str] = None, region_name: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0,
                 transfer_config: Any = None):
        super().__init__(bucket_name, retry)
        import_boto3()  # fail here, at construction, when the extra is missing
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.transfer_config = transfer_config

    def _make_client(self) -> Any:
        boto3, botocore = import_boto3()
        config = botocore.config.Config(retries={"total_max_attempts": self.retry.attempts, "mode": self.retry.mode},
                                        connect_timeout=self.connect_timeout_s, read_timeout=self.read_timeout_s)
        # A session of its own: boto3's default session is not thread-safe to create clients from.
        client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, region_name=self.region_name,
                                                config=config)
        use_private_jitter(client, self.retry.attempts)  # retries leave Python's global random alone
        return client

    def _put(self, handle: IO[bytes], key: str, size: int) -> None:
        self.client.upload_fileobj(ReadWindow(handle, size), self.bucket_name, key, Config=self.transfer_config)

    def _get(self, key: str, handle: IO[bytes]) -> None:
        _, botocore = import_boto3()
        try:
            self.client.download_fileobj(self.bucket_name, key, handle, Config=self.transfer_config)
        except botocore.exceptions.ClientError as error:
            if _code(error) not in _NOT_FOUND_CODES:
                raise
            self._check_bucket()  # a bare 404 (from HEAD) stands for a missing bucket or a missing object
            raise MissingObject() from error

    def _list(self, prefix: str) -> Iterator[CloudObject]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket_name, Prefix=prefix):
            for item in page.get("Contents", []):
                yield CloudObject(item["Key"], int(item["Size"]))

    def _size(self, key: str) -> Optional[int]:
        _, botocore = import_boto3()
        try:
            return int(self.client.head_object(Bucket=self.bucket_name, Key=key)["ContentLength"])
        except botocore.exceptions.ClientError as error:
            if _code(error) not in _NOT_FOUND_CODES:
                raise
        self._check_bucket()  # HEAD answers a bare 404 for a missing bucket too
        return None

    def _check_bucket(self) -> None:
        """Raise MissingBucket when the bucket does not exist."""
        _, botocore = import_boto3()
        try:
            self.client.head_bucket(Bucket=self.bucket_name)
        except botocore.exceptions.ClientError as error:
            if _code(error) in _NOT_FOUND_CODES:
                raise MissingBucket() from error
            raise

    def _delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket_name, Key=key)

    def _retry_note(self) -> str:
        # botocore does not say how many attempts a connection error took.
        return f" (retried per RetryPolicy, up to {self.retry.attempts} attempts)" \
            if self.retry.attempts > 1 else ""

    def _classify(self, error: BaseException) -> Optional[Failure]:
        _, botocore = import_boto3()
        exceptions = botocore.exceptions
        from boto3.exceptions import S3UploadFailedError
        if isinstance(error, S3UploadFailedError) and error.__context__ is not None:
            return self._classify(error.__context__)
        if isinstance(error, (exceptions.NoCredentialsError, exceptions.PartialCredentialsError)):
            return Failure(False, "NoCredentials", _CREDENTIALS_HINT, CloudPermissionError)
        if isinstance(error, exceptions.NoRegionError):
            return Failure(False, "NoRegion", "Set AWS_DEFAULT_REGION or the region in ~/.aws/config")
        if isinstance(error, (exceptions.ConnectionError, exceptions.HTTPClientError, exceptions.IncompleteReadError,
                              exceptions.CredentialRetrievalError, ConnectionError, TimeoutError)):
            return Failure(True, "ConnectionError")
        if isinstance(error, exceptions.ClientError):
            code, status = _code(error), _status(error)
            if code in _TRANSIENT_CODES or status == 429 or status >= 500:
                return Failure(True, code, attempts=_attempts(error))
            if code in _NOT_FOUND_CODES:
                bucket_missing = code == "NoSuchBucket"
                hint = (f"the bucket {self.bucket_name!r} does not exist: create it (or fix bucket_name)"
                        if bucket_missing
                        else "The object (or the bucket) does not exist")
                return Failure(False, code, hint, CloudNotFoundError)
            if code in _DENIED_CODES:
                return Failure(False, code, f"Check the credentials and their permissions on the bucket "
                                            f"{self.bucket_name!r}", CloudPermissionError)
            return Failure(False, code)
        try:
            from s3transfer.exceptions import RetriesExceededError
        except ImportError:  # pragma: no cover - s3transfer comes with boto3
            RetriesExceededError = ()
        if RetriesExceededError and isinstance(error, RetriesExceededError):
            return Failure(True, "ConnectionError")
        if isinstance(error, exceptions.BotoCoreError):
            return Failure(False, type(error).__name__)
        return None


def _code(error: Any) -> str:
    return str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))


def _attempts(error: Any) -> Optional[int]:
    """How many times botocore sent the request, when its response says."""
    retries = getattr(error, "response", {}).get("ResponseMetadata", {}).get("RetryAttempts")
    return int(retries) + 1 if retries is not None else None


def _status(error: Any) -> int:
    return int(getattr(error, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
