"""Google Cloud Storage through google-cloud-storage, Google's maintained client.

The client comes from Google's standard configuration: Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS`` naming a service-account key file, ``gcloud auth application-default login``,
or the metadata server on Google Cloud machines) and the project from ``GOOGLE_CLOUD_PROJECT`` or the
credentials. With ``STORAGE_EMULATOR_HOST`` set (e.g. ``http://127.0.0.1:9023``) the client talks to that
emulator with anonymous credentials. Every object goes up in a resumable upload of ``chunk_size`` chunks,
published only when complete.

Transient errors are retried by the client itself (the errors google-cloud-storage's ``DEFAULT_RETRY`` retries,
with the deadline and backoff of :class:`~aitoolbox.cloud.errors.RetryPolicy`), request by request: one failed
chunk of a resumable upload is sent again, the chunks already stored are not. Uploads are retried without a
generation precondition: each run writes its own keys from one process, so a repeated write stores the same
content again. When the answer to an upload's last request is lost (the connection closed after GCS stored the
object), the client's retry reaches a finished session, which GCS answers with 404 or 410: the bucket is then
asked whether it holds the object with the file's size and checksum (the upload succeeded), and otherwise the
failure is reported as ``UploadSessionLost`` (transient: a new upload opens a new session), never as a missing
bucket unless the bucket is missing, nor as a permission error when the credentials may read objects but not the
bucket's metadata. A checksum mismatch (``DataCorruption``) is reported as such, not transient: the client
verified the transfer and rejected it, without retrying; when its deletion of a rejected upload's object failed,
the mismatch is still what is reported, with what became of the object.

Python's global ``random``, which training draws from, is left alone (uploads run in background threads while
training goes on): every request passes a :class:`~aitoolbox.cloud.gcs_retry.PrivateJitterRetry`, whose waits come
from a generator of its own; every upload is resumable (google-cloud-storage draws the boundary of a multipart
upload, its way for objects up to 8 MiB, from ``random``); and the client's cache of bucket metadata, whose
background thread would keep fetching with the library's default retry (120 s, jitter from ``random``) after an
operation failed, is switched off for the clients made here.
"""
import base64
import hashlib
import importlib
import logging
import warnings
from typing import IO, Any, Iterator, Optional, Tuple

from aitoolbox.cloud.bounded import ReadWindow
from aitoolbox.cloud.storage import (
    CloudNotFoundError, CloudObject, CloudPermissionError, CloudStorage, CloudStorageError, Failure, MissingBucket,
    MissingObject, RetryPolicy, error_chain, redact_client_message)

_INSTALL = "Google Cloud Storage support needs google-cloud-storage: pip install aitoolbox[gcs]"
_CREDENTIALS_HINT = ("Give credentials the standard Google way: GOOGLE_APPLICATION_CREDENTIALS naming a "
                     "service-account key file, or `gcloud auth application-default login`; for an emulator set "
                     "STORAGE_EMULATOR_HOST")
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
#: The chunk of a resumable upload: a failed request re-sends at most this much.
DEFAULT_CHUNK_SIZE = 16 * 1024 * 1024
_CHUNK_MULTIPLE = 256 * 1024  # GCS takes chunks of multiples of 256 KiB
# google-cloud-storage sends an object of up to this size in one multipart request, whose boundary it draws from
# Python's global random; above it, in a resumable upload (which draws nothing).
_MULTIPART_LIMIT = 8 * 1024 * 1024
# What GCS answers a request to a resumable upload's session that is finished (its object stored) or has expired.
_SESSION_ENDED_STATUS = {404, 410}
_CORRUPTION_HINT = ("The checksum of the data GCS received does not match the checksum of the data sent: the bytes "
                    "were corrupted in transit, or the file changed while it was being uploaded. The upload was "
                    "verified and rejected by the client (which does not retry a checksum mismatch), and the object "
                    "it had stored was deleted; nothing of it was kept: upload the file again")
_DOWNLOAD_CORRUPTION_HINT = ("The checksum of the data received does not match the checksum GCS holds for the object: "
                             "the bytes were corrupted in transit (or the object was replaced during the download). "
                             "The download was verified and rejected by the client (which does not retry a checksum "
                             "mismatch); nothing of it was written: download the object again")

logger = logging.getLogger(__name__)


class UploadSessionLost(Exception):
    """The resumable session of an upload ended (GCS answered 404 or 410 to its URL) before the client heard that
    the object was stored, and the bucket does not hold the file: the upload did not complete."""


class UploadNotFound(Exception):
    """An upload's session answered 404 or 410, the object is not there (or may not be read), and the credentials
    cannot tell whether the bucket exists (they lack ``storage.buckets.get``): what is known is the upload's 404."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class RejectedUpload(Exception):
    """An upload the client rejected for a checksum mismatch (``DataCorruption``); ``hint`` says what became of
    the object it had stored."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


_UNREADABLE = object()  # an object the credentials may not read (403)


def import_storage():
    """``google.cloud.storage``, or an ImportError that names the pip extra."""
    try:
        return importlib.import_module("google.cloud.storage")
    except ImportError as error:
        raise ImportError(_INSTALL) from error


def _warn_if_media_retries_use_global_random(storage: Any) -> None:
    """Warn (once per calling line: the warnings module's default) when google-cloud-storage is older than 3:
    it retries uploads and downloads through google-resumable-media, whose waits come from Python's global random."""
    version = getattr(storage, "__version__", "")
    major = version.split(".")[0]
    if major.isdigit() and int(major) < 3:
        warnings.warn(f"google-cloud-storage {version} retries uploads and downloads with waits drawn from Python's "
                      "global random: a transfer retried while training runs moves the training's random stream. "
                      "Upgrade it to keep runs reproducible: pip install 'google-cloud-storage>=3'",
                      RuntimeWarning, stacklevel=3)


class GCSStorage(CloudStorage):
    """One Google Cloud Storage bucket.

    Args:
        bucket_name: the bucket.
        project: the project billed for requests; None: ``GOOGLE_CLOUD_PROJECT`` or the credentials' project.
        endpoint_url: another API endpoint (``client_options={'api_endpoint': ...}``); None: Google's, or
            ``STORAGE_EMULATOR_HOST`` when it is set.
        retry: how the client retries transient errors: each request until ``deadline_s`` has passed, with
            its backoff; :class:`~aitoolbox.cloud.errors.RetryPolicy` ``()`` when None.
        timeout_s: the connect and read timeout of each request.
        chunk_size: the chunk of a resumable upload (every upload), a multiple of 256 KiB.
    """

    service = "Google Cloud Storage"
    scheme = "gs"

    def __init__(self, bucket_name: str, project: Optional[str] = None, endpoint_url: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, timeout_s: float = 60.0,
                 chunk_size: int = DEFAULT_CHUNK_SIZE):
        super().__init__(bucket_name, retry)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 \
                or chunk_size % _CHUNK_MULTIPLE:
            raise ValueError(f"chunk_size must be a positive multiple of 256 KiB ({_CHUNK_MULTIPLE} bytes), got "
                             f"{chunk_size!r}")
        storage = import_storage()  # fail here, at construction, when the extra is missing
        self.project = project
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        _warn_if_media_retries_use_global_random(storage)
        from aitoolbox.cloud.gcs_retry import PrivateJitterRetry
        # DEFAULT_RETRY's predicate says which errors google-cloud-storage deems transient. The arguments go
        # positionally: google-api-core renamed the deadline's keyword (deadline -> timeout), not its place.
        self._retry = PrivateJitterRetry(storage.retry.DEFAULT_RETRY._predicate, self.retry.initial_delay_s,
                                         self.retry.max_delay_s, self.retry.multiplier, self.retry.deadline_s)

    def _make_client(self) -> Any:
        storage = import_storage()
        options = {"api_endpoint": self.endpoint_url} if self.endpoint_url else None
        client = storage.Client(project=self.project, client_options=options)
        # Recent google-cloud-storage (3.x) fetches bucket metadata (for OpenTelemetry span attributes) in a
        # background thread per bucket, retried with the library's default policy (120 s, jitter from the global
        # random), which outlives a failed operation. The library's own checks read this attribute (None: no cache); the
        # environment variable that also switches it off would change the user's other clients.
        if getattr(client, "_bucket_metadata_cache", None) is not None:
            client._bucket_metadata_cache = None
        return client

    @property
    def bucket(self) -> Any:
        """The client's ``Bucket`` object (no request is made)."""
        return self.client.bucket(self.bucket_name)

    def _put(self, handle: IO[bytes], key: str, size: int) -> None:
        # A size the client does not know makes it upload resumably (see _MULTIPART_LIMIT); the window ends the
        # file at the size given.
        source, known_size = (ReadWindow(handle, size), None) if size <= _MULTIPART_LIMIT else (handle, size)
        try:
            self.bucket.blob(key, chunk_size=self.chunk_size).upload_from_file(
                source, size=known_size, timeout=self.timeout_s, retry=self._retry)
        except Exception as error:
            # First: a failed deletion of a rejected upload replaces its DataCorruption, whatever it raised.
            corruption = _corruption_in(error)
            if corruption is not None:
                raise self._rejected_upload(error, corruption, key) from error
            if _status(error) not in _SESSION_ENDED_STATUS:
                raise
            self._settle_ended_upload(error, handle, key, size)

    def _rejected_upload(self, error: Exception, corruption: BaseException, key: str) -> RejectedUpload:
        """The error of an upload rejected for a checksum mismatch; when the client's deletion of the object it
        had stored failed (``error``, raised while handling ``corruption``), the object is deleted once more here,
        and the error says what became of it."""
        if error is corruption:
            return RejectedUpload(str(corruption), _CORRUPTION_HINT)
        from google.api_core import exceptions
        mismatch = ("The checksum of the data GCS received did not match the checksum of the data sent (the bytes "
                    "were corrupted in transit, or the file changed while it was being uploaded): the client rejected "
                    "the upload, then its deletion of the object it had stored failed "
                    f"({type(error).__name__}: {_brief(error)}); ")
        try:
            # One attempt (retry=None: nothing drawn from random), not to hold the caller past the failure.
            self.bucket.blob(key).delete(timeout=self.timeout_s, retry=None)
        except exceptions.NotFound:
            outcome = (f"the bucket holds no object {key!r} (a second deletion found none): nothing of the upload "
                       "remains; upload the file again")
        except Exception as second:  # what failed is said; the checksum mismatch stays the error reported
            permission = (" (deleting needs storage.objects.delete)"
                          if isinstance(second, (exceptions.Forbidden, exceptions.Unauthorized)) else "")
            outcome = (f"a second deletion failed too ({type(second).__name__}: {_brief(second)}): the corrupted "
                       f"object could not be deleted and may remain under the key {key!r} ({self.uri(key)}); "
                       f"delete it{permission}, or upload the file again to replace it")
        else:
            outcome = (f"a second deletion deleted it: nothing of the upload remains under {key!r}; upload the "
                       "file again")
        return RejectedUpload(str(corruption), mismatch + outcome)

    def _settle_ended_upload(self, error: Exception, handle: IO[bytes], key: str, size: int) -> None:
        """Return when an upload that failed with 404 or 410 stored its object after all, else raise what it was.

        A 404 is GCS's answer for a missing bucket, but also for a resumable session that is finished: when the
        answer to the last request of an upload is lost (the connection closed after the object was stored),
        the client's retry sends that request again to the finished session, which answers 404 (or 410). The
        object is looked up first (that needs only ``storage.objects.get``); the bucket's existence (which needs
        ``storage.buckets.get``, which roles such as ``roles/storage.objectAdmin`` lack) only when the object does
        not settle it, and a 403 there leaves it unknown rather than becoming the error.
        """
        from google.api_core import exceptions
        if not _on_session_url(error):
            # The request that starts an upload names the bucket only: its 404 says that the bucket is missing.
            if isinstance(error, exceptions.NotFound):
                raise MissingBucket() from error
            raise error
        blob = self._readable(lambda: self.bucket.get_blob(key, timeout=self.timeout_s, retry=self._retry))
        if blob is not None and blob is not _UNREADABLE:
            if self._holds(blob, handle, size):
                logger.info("The answer to the upload of %s was lost, but the bucket holds the object whole (its "
                            "size and checksum are the file's): uploaded", self.uri(key))
                return
            bucket_exists: Optional[bool] = True  # it holds an object
        else:
            bucket_exists = self._readable(lambda: self.bucket.exists(timeout=self.timeout_s, retry=self._retry))
            bucket_exists = None if bucket_exists is _UNREADABLE else bool(bucket_exists)
        if bucket_exists is False:
            raise MissingBucket() from error
        status, unread = _status(error), blob is _UNREADABLE
        if bucket_exists is None:
            raise UploadNotFound(
                f"the upload's resumable session answered HTTP {status}: the bucket {self.bucket_name!r} does not "
                "exist, or the upload's session was not found (a session ends once its object is stored, or "
                "expires), and these credentials cannot tell which: they may not read the bucket's metadata "
                f"(storage.buckets.get){' nor the object (storage.objects.get)' if unread else ''}, and the bucket "
                f"holds no object {key!r} that they can see. If the bucket exists, upload the file again (a new "
                "upload opens a new session); else create it (or fix bucket_name)",
                type(error).__name__) from error
        stored = (f"these credentials may not read the object {key!r} (storage.objects.get) to tell whether it "
                  "was stored" if unread else
                  f"the bucket holds no object {key!r} with this file's {size:,} bytes and checksum: the upload "
                  "did not complete, or the file changed since")
        raise UploadSessionLost(
            f"the upload's resumable session answered HTTP {status} (it had ended: finished, or expired) to a "
            f"request the client sent again after a connection was lost, and {stored}; upload the file again (a "
            "new upload opens a new session)") from error

    @staticmethod
    def _readable(lookup: Any) -> Any:
        """What ``lookup`` returns, or ``_UNREADABLE`` when the credentials may not make it (403 or 401)."""
        from google.api_core import exceptions
        try:
            return lookup()
        except (exceptions.Forbidden, exceptions.Unauthorized):
            return _UNREADABLE

    @staticmethod
    def _holds(blob: Any, handle: IO[bytes], size: int) -> bool:
        """Whether ``blob`` (an object's metadata) has the size and the checksums (CRC32C, MD5, those GCS gives)
        of the first ``size`` bytes of ``handle``."""
        if int(blob.size or 0) != size or not (blob.crc32c or blob.md5_hash):
            return False
        try:
            crc32c, md5 = _checksums(ReadWindow(handle, size))
        except ValueError:  # the file shrank since: what was stored is not the file now
            return False
        # Every checksum known on both sides must match, and at least one must be known on both.
        compared = [(remote, local) for remote, local in ((blob.crc32c, crc32c), (blob.md5_hash, md5))
                    if remote and local]
        return bool(compared) and all(remote == local for remote, local in compared)

    def _get(self, key: str, handle: IO[bytes]) -> None:
        try:
            self.bucket.blob(key).download_to_file(handle, timeout=self.timeout_s, retry=self._retry)
        except Exception as error:
            self._raise_missing(error, key, object_expected=True)
            raise

    def _list(self, prefix: str) -> Iterator[CloudObject]:
        try:
            blobs = list(self.client.list_blobs(self.bucket_name, prefix=prefix or None, timeout=self.timeout_s,
                                                retry=self._retry))
        except Exception as error:
            self._raise_missing(error, prefix, object_expected=False)
            raise
        return iter([CloudObject(blob.name, int(blob.size or 0)) for blob in blobs])

    def _size(self, key: str) -> Optional[int]:
        blob = self.bucket.get_blob(key, timeout=self.timeout_s, retry=self._retry)
        if blob is not None:
            return int(blob.size or 0)
        if not self.bucket.exists(timeout=self.timeout_s, retry=self._retry):
            raise MissingBucket()
        return None

    def _delete(self, key: str) -> None:
        from google.api_core import exceptions
        try:
            self.bucket.blob(key).delete(timeout=self.timeout_s, retry=self._retry)
        except exceptions.NotFound:
            if not self.bucket.exists(timeout=self.timeout_s, retry=self._retry):
                raise MissingBucket() from None

    def _raise_missing(self, error: Exception, key: str, object_expected: bool) -> None:
        """Turn GCS's 404, the same for a missing bucket and a missing object, into the one it is (asking whether
        the bucket exists)."""
        from google.api_core import exceptions
        if not isinstance(error, exceptions.NotFound):
            return
        if object_expected and self.bucket.exists(timeout=self.timeout_s, retry=self._retry):
            raise MissingObject() from error
        raise MissingBucket() from error

    def _retry_note(self) -> str:
        # google-api-core does not say how many attempts a request took before its deadline ran out.
        return f" (retried per RetryPolicy, until a deadline of {self.retry.deadline_s:g} s)"

    def _classify(self, error: BaseException) -> Optional[Failure]:
        import requests
        from google.api_core import exceptions
        from google.auth import exceptions as auth_exceptions
        if isinstance(error, exceptions.RetryError):  # the client's retries ran out: what failed last says why
            last = error.cause or error.__cause__
            failure = self._classify(last) if last is not None else None
            return Failure(True, failure.reason if failure else "RetryError", failure.hint if failure else "",
                           failure.kind if failure else CloudStorageError)
        if isinstance(error, auth_exceptions.DefaultCredentialsError):
            return Failure(False, "NoCredentials", _CREDENTIALS_HINT, CloudPermissionError)
        if isinstance(error, auth_exceptions.RefreshError):
            return Failure(False, "InvalidCredentials", _CREDENTIALS_HINT, CloudPermissionError)
        if isinstance(error, (auth_exceptions.TransportError, requests.exceptions.ConnectionError,
                              requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError,
                              ConnectionError, TimeoutError)):
            return Failure(True, "ConnectionError")
        if isinstance(error, exceptions.GoogleAPICallError):
            status = int(error.code or 0)
            reason = type(error).__name__
            if status in _TRANSIENT_STATUS or isinstance(error, (exceptions.ServerError,
                                                                 exceptions.TooManyRequests)):
                return Failure(True, reason)
            if isinstance(error, (exceptions.Forbidden, exceptions.Unauthorized)):
                return Failure(False, reason, "Check the credentials and their permissions on the bucket "
                                              f"{self.bucket_name!r}", CloudPermissionError)
            if isinstance(error, exceptions.NotFound):
                return Failure(False, reason, "", CloudNotFoundError)
            return Failure(False, reason)
        if isinstance(error, UploadSessionLost):  # a new upload opens a new session; the client cannot retry it
            return Failure(True, "UploadSessionLost", retried=False)
        if isinstance(error, UploadNotFound):
            return Failure(False, error.reason, "", CloudNotFoundError, retried=False)
        if isinstance(error, RejectedUpload):
            return Failure(False, "DataCorruption", error.hint)
        corruption, invalid_response = _media_errors()
        if isinstance(error, corruption):  # an upload's is a RejectedUpload: this is a download's
            # The client compared checksums and rejected the transfer; it does not retry a mismatch.
            return Failure(False, "DataCorruption", _DOWNLOAD_CORRUPTION_HINT)
        if isinstance(error, invalid_response):
            status = int(getattr(error.response, "status_code", 0) or 0)
            return Failure(status in _TRANSIENT_STATUS, f"HTTP{status}")
        return None


def _media_errors() -> Tuple[Tuple[type, ...], Tuple[type, ...]]:
    """The classes of the media layer's ``DataCorruption`` and ``InvalidResponse``: google-cloud-storage's own
    (3.x, subclasses of google-resumable-media's only when that is installed) and google-resumable-media's."""
    corruption, invalid = [], []
    for module in ("google.cloud.storage.exceptions", "google.resumable_media.common"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        corruption += [found.DataCorruption] if hasattr(found, "DataCorruption") else []
        invalid += [found.InvalidResponse] if hasattr(found, "InvalidResponse") else []
    return tuple(corruption), tuple(invalid)


def _corruption_in(error: BaseException) -> Optional[BaseException]:
    """The ``DataCorruption`` that ``error`` is, or was raised while handling (or from); None when there is none."""
    corruption, _ = _media_errors()
    return next((link for link in error_chain(error) if isinstance(link, corruption)), None)


def _brief(error: BaseException) -> str:
    """The redacted first line of ``error``'s message, at most 200 characters."""
    text = redact_client_message(str(error).strip()).split("\n")[0].rstrip(".") or type(error).__name__
    return text if len(text) <= 200 else text[:200].rsplit(" ", 1)[0] + " [message cut]"


def _status(error: BaseException) -> int:
    """The HTTP status of a google-api-core error (0 for other errors)."""
    from google.api_core import exceptions
    return int(error.code or 0) if isinstance(error, exceptions.GoogleAPICallError) else 0


def _on_session_url(error: BaseException) -> bool:
    """Whether ``error`` answered a request to a resumable upload's session (its URL holds ``upload_id``), not one
    to start an upload."""
    request = getattr(getattr(error, "response", None), "request", None)
    return "upload_id=" in str(getattr(request, "url", "") or "")


def _checksums(source: ReadWindow) -> Tuple[str, str]:
    """The CRC32C and MD5 of what ``source`` reads, base64-encoded as GCS gives them ('' for a CRC32C without
    google-crc32c)."""
    try:
        import google_crc32c
        crc32c: Any = google_crc32c.Checksum()
    except ImportError:  # pragma: no cover - comes with google-cloud-storage
        crc32c = None
    md5 = hashlib.md5(usedforsecurity=False)
    while True:
        chunk = source.read(_CHUNK_MULTIPLE * 4)
        if not chunk:
            break
        md5.update(chunk)
        if crc32c is not None:
            crc32c.update(chunk)
    encoded_crc32c = base64.b64encode(crc32c.digest()).decode() if crc32c is not None else ""
    return encoded_crc32c, base64.b64encode(md5.digest()).decode()
