"""The errors of cloud storage operations, and the retry policy for transient ones.

A storage class (:class:`~aitoolbox.cloud.storage.CloudStorage`) classifies each client error as a
:class:`Failure`: transient ones are retried per :class:`RetryPolicy`, the others (and transient ones that outlast
the retries) raise :class:`CloudStorageError` or a subclass, naming the service, bucket, key and local file.
"""
import random
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
        transient: the error was of a kind that is retried (the retries ran out).
        attempts: how many attempts were made.
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


class MissingBucket(Exception):
    """Raised by a primitive when the bucket does not exist (a permanent error, reported by name)."""


class MissingObject(Exception):
    """Raised by a primitive when the object does not exist in an existing bucket."""


@dataclass(frozen=True)
class Failure:
    """How a subclass classifies a client error: retry it or not, its code, and advice for the user."""
    transient: bool
    reason: str
    hint: str = ""
    kind: type = CloudStorageError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for transient errors: attempt ``n`` (from 1) waits
    ``min(max_delay_s, initial_delay_s * multiplier ** (n - 1))`` seconds, scaled by a random factor in
    ``[1 - jitter, 1]`` so that many processes do not retry in step.

    Args:
        attempts: how many times an operation is tried in all (1: no retries).
        initial_delay_s: the wait after the first failure.
        max_delay_s: the longest wait.
        multiplier: the growth of the wait per failure.
        jitter: the random part of each wait, between 0 and 1.
    """
    attempts: int = 6
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy needs delays >= 0, multiplier >= 1 and 0 <= jitter <= 1, got {self}")

    def delay(self, failed_attempt: int) -> float:
        """Seconds to wait after attempt ``failed_attempt`` (counted from 1) failed."""
        base = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (failed_attempt - 1))
        return base * (1 - self.jitter * random.random())
