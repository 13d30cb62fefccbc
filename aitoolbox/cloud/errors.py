"""The errors of cloud storage operations, and how the clients retry transient ones.

The service's own client retries transient errors per :class:`RetryPolicy` (botocore's retry modes for S3,
google-api-core's retry for GCS), request by request. What it raises in the end a storage class
(:class:`~aitoolbox.cloud.storage.CloudStorage`) classifies as a :class:`Failure` and raises as
:class:`CloudStorageError` or a subclass, naming the service, bucket, key and local file: the callbacks tell a
missing bucket, refused credentials and a network that stayed down apart by its class and ``transient``.
"""
from dataclasses import dataclass
from typing import Optional


class CloudStorageError(OSError):
    """An operation on a bucket failed: the message names the service, bucket, key and (for transfers) the local
    file, the reason, and the attempts made.

    Attributes:
        service: ``'AWS S3'`` or ``'Google Cloud Storage'``.
        bucket: the bucket's name.
        key: the object's key (or the prefix for listings).
        operation: ``'upload'``, ``'download'``, ``'list'``, ``'exists'``, ``'delete'``.
        reason: the service's error code or the exception's class (``'NoSuchBucket'``, ``'ConnectionError'``).
        transient: trying again later may succeed (mostly errors the client retried until its retries ran out).
        attempts: how many attempts the client made (1 when it does not say).
        local_path: the local file of an upload or download, else None.
    """

    def __init__(self, message: str, *, service: str = "", bucket: str = "", key: str = "", operation: str = "",
                 reason: str = "", transient: bool = False, attempts: int = 1, local_path: Optional[str] = None):
        super().__init__(message)
        self.service, self.bucket, self.key, self.operation = service, bucket, key, operation
        self.reason, self.transient, self.attempts, self.local_path = reason, transient, attempts, local_path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CloudNotFoundError(CloudStorageError, FileNotFoundError):
    """The bucket or the object does not exist."""


class CloudPermissionError(CloudStorageError, PermissionError):
    """No credentials were found, or they do not allow the operation."""


class CloudIntegrityError(CloudStorageError, ValueError):
    """What the bucket holds is not what its folder's marker says (an object of another size than listed, a
    marker or record too large to be one): the download is refused and nothing is written. A ``ValueError`` as
    well, like every refusal of content read from a bucket (a marker naming a file outside its folder)."""


class MissingBucket(Exception):
    """Raised by a primitive when the bucket does not exist (a permanent error, reported by name)."""


class MissingObject(Exception):
    """Raised by a primitive when the object does not exist in an existing bucket."""


@dataclass(frozen=True)
class Failure:
    """How a subclass classifies a client error: transient (worth trying again later) or not, its code, advice for
    the user, the error class to raise, how many attempts the client made when it says, and whether the client
    retried it before giving up (None: when it is transient, the kinds of errors the clients retry, unless
    ``attempts`` is 1). The message claims retries only when they happened."""
    transient: bool
    reason: str
    hint: str = ""
    kind: type = CloudStorageError
    attempts: Optional[int] = None
    retried: Optional[bool] = None


#: botocore's retry modes that :class:`RetryPolicy` accepts (``'legacy'`` retries fewer kinds of errors).
RETRY_MODES = ("standard", "adaptive")


@dataclass(frozen=True)
class RetryPolicy:
    """How the service's own client retries transient errors (connection resets, timeouts, HTTP 429 and 5xx).

    The clients retry each request on its own: one failed part of a multipart S3 upload, or one failed chunk of a
    resumable GCS upload, is sent again, not the whole file. The two clients bound their retries differently:

    - AWS S3 (botocore): ``attempts`` tries of each request in all, in botocore's ``mode`` (``'standard'``:
      exponential backoff with jitter, at most 20 s between tries; ``'adaptive'``: the same, slowed further by
      the client while the service throttles);
    - Google Cloud Storage (google-api-core): each request is retried until ``deadline_s`` seconds have passed,
      waiting a random time up to a bound that is ``initial_delay_s`` at first, then ``multiplier`` times longer
      after each failure, at most ``max_delay_s``.

    The random waits of both are drawn from a generator of the client's own, never from Python's global
    ``random``, which training draws from (see :mod:`aitoolbox.cloud.s3_retry`, :mod:`aitoolbox.cloud.gcs_retry`).

    Args:
        attempts: S3: how many times a request is tried in all (1: no retries).
        mode: S3: botocore's retry mode, ``'standard'`` or ``'adaptive'``.
        deadline_s: GCS: how long a request is retried.
        initial_delay_s: GCS: the bound of the wait after the first failure.
        max_delay_s: GCS: the largest bound of a wait.
        multiplier: GCS: the growth of the bound per failure.
    """
    attempts: int = 5
    mode: str = "standard"
    deadline_s: float = 120.0
    initial_delay_s: float = 1.0
    max_delay_s: float = 60.0
    multiplier: float = 2.0

    def __post_init__(self):
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.mode not in RETRY_MODES:
            raise ValueError(f"RetryPolicy.mode must be one of {RETRY_MODES}, got {self.mode!r}")
        if self.deadline_s <= 0 or self.initial_delay_s < 0 or self.max_delay_s < self.initial_delay_s \
                or self.multiplier < 1:
            raise ValueError(f"RetryPolicy needs deadline_s > 0, 0 <= initial_delay_s <= max_delay_s and "
                             f"multiplier >= 1, got {self}")
