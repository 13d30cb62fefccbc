"""A small object-storage interface (upload, download, list, exists, delete) with retries and clear errors.

:class:`CloudStorage` holds what AWS S3 (:class:`~aitoolbox.cloud.s3.S3Storage`) and Google Cloud Storage
(:class:`~aitoolbox.cloud.gcs.GCSStorage`) share: the errors, folders with a completion marker,
atomic downloads. A subclass implements five primitives on one service's client and says which of its errors
are transient.

Faults:

- transient errors (connection refused or reset, timeouts, HTTP 5xx, throttling) are retried by the service's
  own client, request by request, per :class:`RetryPolicy` (a failed part of a large upload is sent again, not the
  whole file);
- permanent errors (missing bucket or object, access denied, no credentials) and transient ones that outlast the
  retries raise :class:`CloudStorageError` (or a subclass) naming the service, bucket, key and local file;
- a single object is never seen half-written (S3 and GCS publish an object only once its upload completes);
  a folder is complete only once its marker object (:data:`FOLDER_MARKER`, a manifest of the files and their
  sizes) is written, after every file;
- downloads write into a temporary file that replaces the target only once complete; a file of a folder is
  written only up to the size its marker lists, and an object of another size is refused
  (:class:`CloudIntegrityError`): whoever can write to the bucket cannot fill the disk through a folder's
  download. An upload never follows a symbolic link (see :mod:`aitoolbox.cloud.folders`).
"""
import abc
import contextlib
import io
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, TypeVar

from aitoolbox.cloud.bounded import BoundedWriter, went_past_the_bound
from aitoolbox.cloud.errors import (
    CloudIntegrityError, CloudNotFoundError, CloudPermissionError, CloudStorageError, Failure, MissingBucket,
    MissingObject, RetryPolicy)
from aitoolbox.cloud.folders import (
    FOLDER_MARKER, MAX_MARKER_BYTES, OpenFolder, folder_marker, local_path_inside, open_folder, open_for_upload,
    parse_folder_marker)
from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.redaction import REDACTED, redact_message

# The errors and folder helpers are importable from here too: this is the module users meet first.
__all__ = ["CloudStorage", "CloudObject", "join_key", "CloudStorageError", "CloudNotFoundError",
           "CloudPermissionError", "CloudIntegrityError", "RetryPolicy", "Failure", "MissingBucket", "MissingObject",
           "FOLDER_MARKER", "OpenFolder", "open_folder"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass(frozen=True)
class CloudObject:
    """One object of a listing: its key and size in bytes."""
    key: str
    size: int


def join_key(*parts: str) -> str:
    """Join key parts as aitoolbox 1.x did (``os.path.join`` on POSIX): empty parts vanish, no doubled slashes."""
    return posixpath.join(*[part for part in parts if part]) if any(parts) else ""


class CloudStorage(abc.ABC):
    """One bucket of an object store. Thread-safe: the client is made once, on first use.

    Args:
        bucket_name: the bucket.
        retry: how the client retries transient errors; :class:`RetryPolicy` ``()`` when None.
    """

    service = "cloud storage"
    scheme = ""

    def __init__(self, bucket_name: str, retry: Optional[RetryPolicy] = None):
        if not isinstance(bucket_name, str) or not bucket_name or "/" in bucket_name:
            raise ValueError(f"bucket_name must be a bucket's name (no '/'), got {bucket_name!r}")
        self.bucket_name = bucket_name
        self.retry = retry if retry is not None else RetryPolicy()
        self._client: Any = None
        self._client_lock = threading.Lock()

    # The primitives of one service ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _make_client(self) -> Any:
        """Build the service's client from its standard environment and configuration."""

    @abc.abstractmethod
    def _put(self, handle: IO[bytes], key: str, size: int) -> None:
        """Upload the first ``size`` bytes of ``handle`` (at position 0) as ``key``: no more, even if the file
        has grown since it was opened."""

    @abc.abstractmethod
    def _get(self, key: str, handle: IO[bytes]) -> None:
        """Write the object ``key`` into ``handle``; raise :class:`MissingBucket` / :class:`MissingObject`."""

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterator[CloudObject]:
        """Every object whose key starts with ``prefix``; raise :class:`MissingBucket` without the bucket."""

    @abc.abstractmethod
    def _size(self, key: str) -> Optional[int]:
        """The size of ``key``; None when there is no such object; :class:`MissingBucket` without the bucket."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Delete ``key``; a missing object is not an error, a missing bucket raises :class:`MissingBucket`."""

    @abc.abstractmethod
    def _classify(self, error: BaseException) -> Optional[Failure]:
        """How to treat ``error`` raised by the client; None for errors that are not the service's (bugs)."""

    # Public operations ---------------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The service's client, made on first use."""
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def uri(self, key: str = "") -> str:
        """``s3://bucket/key`` or ``gs://bucket/key``."""
        return f"{self.scheme}://{self.bucket_name}/{key}"

    def upload_file(self, local_path: str, key: str) -> str:
        """Upload the file ``local_path`` as ``key``; returns the object's URI. The local file is kept.

        Raises:
            FileNotFoundError: there is no such local file.
            ValueError: ``local_path`` is a symbolic link (an upload never follows one) or not a regular file.
            CloudStorageError: the upload failed (after the retries, for transient errors).
        """
        local_path = os.path.expanduser(local_path)
        handle = open_for_upload(local_path)
        if handle is None:
            kind = "a symbolic link" if os.path.islink(local_path) else "not a regular file"
            raise ValueError(f"refusing to upload {local_path} to {self.uri(key)}: it is {kind}, and an upload "
                             "never follows a link (its target could be any file of this machine) nor reads what is "
                             "not a regular file; upload the file a link points to by its own path")
        with handle:
            return self.upload_handle(handle, key, local_path=local_path)

    def upload_handle(self, handle: IO[bytes], key: str, local_path: Optional[str] = None,
                      size: Optional[int] = None) -> str:
        """Upload the first ``size`` bytes (all, when None) of the seekable binary ``handle`` as ``key``.

        Returns:
            The object's URI.
        """
        if size is None:
            size = os.fstat(handle.fileno()).st_size if _has_fileno(handle) else len(handle.getbuffer())

        def put() -> None:
            handle.seek(0)
            self._put(handle, key, size)
        self._call("upload", key, put, local_path=local_path)
        return self.uri(key)

    def upload_bytes(self, data: bytes, key: str) -> str:
        """Upload ``data`` as ``key``; returns the object's URI."""
        return self.upload_handle(io.BytesIO(data), key)

    def upload_folder(self, local_folder: str, key_prefix: str, complete_marker: bool = True) -> List[str]:
        """Upload every file below ``local_folder`` to ``<key_prefix>/<path inside the folder>``.

        Temporary files of interrupted local writes (``.tmp-*``) are skipped, and so are symbolic links and what is
        not a regular file (one warning names them). With ``complete_marker``, an earlier marker of the prefix is
        removed first and a new one (:data:`FOLDER_MARKER`, listing each file and its size) is written after every
        file: :meth:`is_complete_folder` is true only for a fully uploaded folder.

        Returns:
            The keys written, the marker last.

        Raises:
            ValueError: ``local_folder`` itself is a symbolic link.
        """
        return self.upload_open_folder(open_folder(local_folder), key_prefix, complete_marker)

    def upload_open_folder(self, files: "OpenFolder", key_prefix: str, complete_marker: bool = True) -> List[str]:
        """:meth:`upload_folder` of files opened beforehand (:func:`open_folder`); closes them."""
        key_prefix = key_prefix.rstrip("/")
        marker_key = join_key(key_prefix, FOLDER_MARKER)
        written = []
        with files:
            if complete_marker:
                self._call("delete", marker_key, lambda: self._delete(marker_key))
            for relative_path, handle in files.handles:
                key = join_key(key_prefix, relative_path)
                self.upload_handle(handle, key, local_path=os.path.join(files.folder, relative_path),
                                   size=files.sizes[relative_path])
                written.append(key)
            if complete_marker:
                self.upload_bytes(folder_marker(files), marker_key)
                written.append(marker_key)
        return written

    def download_file(self, key: str, local_path: str, expected_size: Optional[int] = None,
                      listed_in: str = "") -> str:
        """Download ``key`` to ``local_path`` (folders are created); returns ``local_path``.

        The file appears only once complete: a failed download leaves an earlier file of that name as it was.

        Args:
            key: the object.
            local_path: where to put it.
            expected_size: the size the object must have (a folder's marker lists it): no more than this is ever
                written, and an object of another size is refused. None: any size.
            listed_in: where ``expected_size`` comes from (a marker's URI), for the error.

        Raises:
            CloudNotFoundError: there is no such bucket or object.
            CloudIntegrityError: the object's size is not ``expected_size``; nothing was written.
            CloudStorageError: the download failed.
        """
        local_path = os.path.expanduser(local_path)
        directory = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(directory, exist_ok=True)
        fd, temp_path = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.path.basename(local_path)}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                def get() -> None:
                    handle.seek(0)
                    handle.truncate()
                    self._get(key, handle if expected_size is None else BoundedWriter(handle, expected_size))
                self._call_bounded("download", key, get, expected_size, listed_in, local_path=local_path)
                handle.flush()
                size = os.fstat(handle.fileno()).st_size
                if expected_size is not None and size != expected_size:
                    raise self._size_error(key, expected_size, f"{size:,} bytes", listed_in, local_path)
                os.fsync(handle.fileno())
            os.replace(temp_path, local_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_path)
            raise
        return local_path

    def download_bytes(self, key: str, max_size: Optional[int] = None) -> bytes:
        """The content of ``key``.

        Args:
            key: the object.
            max_size: refuse an object larger than this many bytes (:class:`CloudIntegrityError`) before more is
                held in memory; None: any size.
        """
        buffer = io.BytesIO()

        def get() -> None:
            buffer.seek(0)
            buffer.truncate()
            self._get(key, buffer if max_size is None else BoundedWriter(buffer, max_size))
        self._call_bounded("download", key, get, max_size, "", at_most=True)
        return buffer.getvalue()

    def folder_manifest(self, key_prefix: str) -> Optional[Dict[str, int]]:
        """The files (path inside the folder -> size) of a complete folder; None when its marker is missing.

        Raises:
            ValueError: the marker is not one aitoolbox wrote (see
                :func:`~aitoolbox.cloud.folders.parse_folder_marker`); :class:`CloudIntegrityError` (a
                ``ValueError`` too) when it is larger than :data:`~aitoolbox.cloud.folders.MAX_MARKER_BYTES`.
        """
        marker_key = join_key(key_prefix.rstrip("/"), FOLDER_MARKER)
        if not self.exists(marker_key):
            return None
        return parse_folder_marker(self.download_bytes(marker_key, max_size=MAX_MARKER_BYTES), self.uri(marker_key))

    def is_complete_folder(self, key_prefix: str) -> bool:
        """True when the folder's marker exists and every file it lists is there with its size."""
        manifest = self.folder_manifest(key_prefix)
        if manifest is None:
            return False
        present = {obj.key: obj.size for obj in self.list(key_prefix.rstrip("/") + "/")}
        return all(present.get(join_key(key_prefix.rstrip("/"), path)) == size for path, size in manifest.items())

    def download_folder(self, key_prefix: str, local_folder: str, replace: bool = True) -> str:
        """Download a complete folder (see :meth:`upload_folder`) into ``local_folder``; returns its path.

        The files are gathered in a temporary folder beside ``local_folder`` that takes its name only once
        every file is there. An existing ``local_folder`` is replaced; with ``replace=False`` it is kept instead
        (e.g. the same folder placed meanwhile by another process downloading it too) and the download dropped.

        The marker comes from the bucket: a name it lists that is absolute or leads outside ``local_folder``
        (``..``) is refused before anything is downloaded, and each file is written only up to the size the marker
        lists.

        Raises:
            CloudNotFoundError: the folder has no completion marker (it is missing, or its upload was
                interrupted) or a file it lists is missing.
            CloudIntegrityError: a file's object is larger or smaller than the marker lists (the folder was changed
                after its upload, or planted); nothing was written.
            ValueError: the marker lists a name outside the folder; nothing was written.
        """
        key_prefix = key_prefix.rstrip("/")
        manifest = self.folder_manifest(key_prefix)
        if manifest is None:
            raise self._error(CloudNotFoundError, "download", join_key(key_prefix, FOLDER_MARKER),
                              "IncompleteFolder", f"{self.uri(key_prefix)}/ is not a complete folder: its "
                              f"completion marker {FOLDER_MARKER} is missing (the folder does not exist, or its "
                              "upload was interrupted)", local_path=local_folder)
        local_folder = os.path.abspath(os.path.expanduser(local_folder))
        parent = os.path.dirname(local_folder)
        os.makedirs(parent, exist_ok=True)
        temp_folder = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.path.basename(local_folder)}.", dir=parent)
        try:
            marker_uri = self.uri(join_key(key_prefix, FOLDER_MARKER))
            for relative_path, size in manifest.items():
                # The marker's names were checked when it was read; the fresh temporary folder holds no links.
                self.download_file(join_key(key_prefix, relative_path),
                                   local_path_inside(temp_folder, relative_path, marker_uri), expected_size=size,
                                   listed_in=marker_uri)
            if os.path.isdir(local_folder):
                if not replace:
                    shutil.rmtree(temp_folder, ignore_errors=True)
                    return local_folder
                shutil.rmtree(local_folder)
            try:
                os.replace(temp_folder, local_folder)
            except OSError:
                if replace or not os.path.isdir(local_folder):
                    raise
                shutil.rmtree(temp_folder, ignore_errors=True)  # another process placed it first: keep that one
        except BaseException:
            shutil.rmtree(temp_folder, ignore_errors=True)
            raise
        return local_folder

    def list(self, prefix: str = "") -> List[CloudObject]:
        """Every object whose key starts with ``prefix`` (a plain string prefix: end it with ``/`` for a folder)."""
        return self._call("list", prefix, lambda: list(self._list(prefix)))

    def exists(self, key: str) -> bool:
        """True when the object ``key`` exists.

        Raises:
            CloudNotFoundError: the bucket does not exist.
        """
        return self._call("exists", key, lambda: self._size(key)) is not None

    def delete(self, key: str) -> None:
        """Delete the object ``key`` (nothing happens when it does not exist)."""
        self._call("delete", key, lambda: self._delete(key))

    def delete_folder(self, key_prefix: str) -> int:
        """Delete the folder's marker first (so it is never seen complete while half-deleted), then its files.

        Returns:
            How many objects were deleted.
        """
        key_prefix = key_prefix.rstrip("/")
        marker_key = join_key(key_prefix, FOLDER_MARKER)
        self.delete(marker_key)
        objects = [obj for obj in self.list(key_prefix + "/") if obj.key != marker_key]
        for obj in objects:
            self.delete(obj.key)
        return len(objects)

    # The errors ----------------------------------------------------------------------------------------------

    def _call_bounded(self, operation: str, key: str, function: Callable[[], T], bound: Optional[int],
                      listed_in: str, local_path: Optional[str] = None, at_most: bool = False) -> T:
        """:meth:`_call` of a download written through a :class:`~aitoolbox.cloud.bounded.BoundedWriter`: going
        past the bound is a :class:`CloudIntegrityError`, however the client wraps it."""
        try:
            return self._call(operation, key, function, local_path=local_path)
        except Exception as error:
            if not went_past_the_bound(error):
                raise
            if at_most:
                raise self._error(CloudIntegrityError, operation, key, "ObjectTooLarge",
                                  f"the object is larger than {bound:,} bytes, the most accepted there; refused "
                                  "before reading more", local_path=local_path) from None
            raise self._size_error(key, bound, f"more than {bound:,} bytes", listed_in, local_path) from None

    def _size_error(self, key: str, expected: int, found: str, listed_in: str,
                    local_path: Optional[str]) -> CloudIntegrityError:
        where = f"its folder's marker {listed_in}" if listed_in else "the size it must have"
        return self._error(CloudIntegrityError, "download", key, "SizeMismatch",
                           f"the object holds {found}, but {where} lists {expected:,} byte"
                           f"{'' if expected == 1 else 's'}: refused, nothing was written (the folder was changed "
                           "after its upload completed, or planted; upload it again)", local_path=local_path)

    def _call(self, operation: str, key: str, function: Callable[[], T], local_path: Optional[str] = None) -> T:
        """Run ``function`` (an operation on ``key``) once: the client retries transient errors itself, request
        by request (:attr:`retry`); what it raises in the end becomes a :class:`CloudStorageError`."""
        try:
            return function()
        except MissingBucket as error:
            raise self._error(CloudNotFoundError, operation, key, "NoSuchBucket",
                              f"the bucket {self.bucket_name!r} does not exist: create it (or fix bucket_name)",
                              local_path=local_path) from error
        except MissingObject as error:
            raise self._error(CloudNotFoundError, operation, key, "NoSuchKey",
                              f"the bucket {self.bucket_name!r} has no object {key!r}", local_path=local_path) \
                from error
        except Exception as error:
            failure = self._classify(error)
            if failure is None:
                raise
            # The client's own errors stay attached for debugging, unless their text had something to hide.
            cause = error if all(redact_client_message(str(link)) == str(link) for link in error_chain(error)) \
                else None
            raise self._error(failure.kind, operation, key, failure.reason,
                              _describe(error) + (f". {failure.hint}" if failure.hint else ""),
                              local_path=local_path, transient=failure.transient, attempts=failure.attempts or 1,
                              retried=_retried(failure)) from cause

    def _retry_note(self) -> str:
        """What the message says of the retries of a transient error when the client does not say whether it
        retried (how the client retries, per :attr:`retry`); '' when it does not retry."""
        return ""

    def _error(self, kind: type, operation: str, key: str, reason: str, detail: str,
               local_path: Optional[str] = None, transient: bool = False, attempts: int = 1,
               retried: Optional[bool] = False) -> CloudStorageError:
        transfer = {"upload": f" from {local_path}", "download": f" to {local_path}"}.get(operation, "") \
            if local_path else ""
        # Retries are claimed only when the client made them (a checksum mismatch, for one, is not retried); when
        # that is not known, the message says how the client retries, not that it did.
        if attempts > 1:
            tries = f" after {attempts} attempts"
        elif retried:
            tries = " after the client's retries"
        else:
            tries = self._retry_note() if retried is None and transient else ""
        message = (f"{self.service} {operation} of {self.uri(key)}{transfer} failed{tries} "
                   f"(bucket {self.bucket_name!r}, key {key!r}): {reason}: {detail}")
        return kind(message, service=self.service, bucket=self.bucket_name, key=key, operation=operation,
                    reason=reason, transient=transient, attempts=attempts, local_path=local_path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bucket_name!r})"


def _has_fileno(handle: IO[bytes]) -> bool:
    try:
        handle.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    return True


def _retried(failure: Failure) -> Optional[bool]:
    """Whether the client retried the error it gave up on: as the failure says; not when it is permanent or the
    client says it made one attempt only; None (not known) otherwise."""
    if failure.retried is not None:
        return failure.retried
    if not failure.transient or failure.attempts == 1:
        return False
    return None


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or while handling (``__cause__``, ``__context__``), each once."""
    seen, pending = set(), [error]
    while pending:
        link = pending.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        pending += [link.__cause__, link.__context__]


# The id of a GCS resumable upload's session: whoever has the session's URL can upload to it, without credentials.
# GCS gives it URL-encoded: it ends where the URL does (``&``, a space, a quote, or ``:`` before the server's answer).
_UPLOAD_ID = re.compile(r"(?P<name>\bupload_id=)(?!<redacted>)[^&\s\"'#),:]+")
_MAX_DETAIL = 500  # characters of a client's message quoted in an error


def redact_client_message(text: str) -> str:
    """A client's error message with what it may quote of credentials (see
    :func:`~aitoolbox.experiment.redaction.redact_message`) and the id of an upload session redacted."""
    return _UPLOAD_ID.sub(rf"\g<name>{REDACTED}", redact_message(text))


def _describe(error: BaseException) -> str:
    # A client's message may quote an endpoint or a signed URL with credentials in it, or an upload session's URL.
    # Its final full stop goes: a hint follows after one. A long message is cut at a space, and says so.
    text = redact_client_message(str(error).strip()).rstrip(".") or type(error).__name__
    if len(text) <= _MAX_DETAIL:
        return text
    cut = text[:_MAX_DETAIL]
    cut = cut[:cut.rfind(" ")] if " " in cut else cut
    return cut.rstrip(" .,;:") + " [message cut]"
