"""Uploads in the background: training hands a file to :class:`CloudUploader` and goes on.

Worker threads (one by default) upload the files in the order they were submitted, so the newest checkpoint in
the bucket is always the newest one submitted whose upload has finished. The queue is bounded and holds names,
not open files:

- a submitted file is pinned with a hidden hard link beside it (:mod:`aitoolbox.cloud.staging`) and opened only
  when its upload starts: it is uploaded as it was when submitted even if it is deleted (an older checkpoint
  pruned locally: the bucket keeps every checkpoint, as in aitoolbox 1.8) or replaced (the next atomic save of the
  same name) meanwhile. Only the uploads in progress hold files open; the queue's bound bounds the disk space that
  pinned, deleted files still take;
- a file submitted again for the same key (or a folder for the same prefix) before its earlier upload started
  replaces that upload, which is dropped (its future is cancelled): the bucket gets the newest version once;
- at most ``max_queued`` uploads wait; a submit beyond that waits for the oldest to start, and the wait is logged
  once, with its length, when it ends: training slows to the pace of the uploads instead of piling up work;
- a failed upload, or one dropped by an interrupted :meth:`CloudUploader.close`, puts its file back under its name
  if that was removed meanwhile: the local folder keeps every file that did not reach the bucket. Local files
  are never removed;
- where a hard link is not possible (some network file systems), nothing is pinned and a file removed before its
  upload starts is either skipped with a warning (``missing_ok``: the training callbacks, whose only removals
  are pruned checkpoints) or fails its upload with a :class:`FileNotFoundError` naming the file and the key;
- a symbolic link is uploaded as nothing, with a warning naming it: submitted itself (the future's result is
  None) or found in a submitted folder (see :mod:`aitoolbox.cloud.folders`). Its target, which could be any file
  of the machine (a credentials file), is never read.

Failures are logged when they happen and raised by :meth:`CloudUploader.wait` / :meth:`CloudUploader.close`,
which the training loop calls before ``fit`` returns; the local copy stays in the experiment folder either way.
"""
import collections
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from aitoolbox.cloud import gcs_available_options, s3_available_options
from aitoolbox.cloud.folders import open_for_upload
from aitoolbox.cloud.staging import Pinned, pin
from aitoolbox.cloud.storage import CloudStorage, open_folder

logger = logging.getLogger(__name__)

LOCAL_SAVE_MODES = (None, "local")
#: How many uploads may wait for their turn before a submit waits (see :class:`CloudUploader`).
DEFAULT_MAX_QUEUED = 16


def cloud_service(cloud_save_mode: Optional[str]) -> Optional[str]:
    """``'s3'``, ``'gcs'`` or None (local saving) for one of aitoolbox 1.x's ``cloud_save_mode`` values.

    Raises:
        ValueError: an unknown value; the message lists the valid ones.
    """
    if cloud_save_mode in LOCAL_SAVE_MODES:
        return None
    mode = cloud_save_mode.lower() if isinstance(cloud_save_mode, str) else cloud_save_mode
    if mode in s3_available_options:
        return "s3"
    if mode in gcs_available_options:
        return "gcs"
    raise ValueError(f"cloud_save_mode={cloud_save_mode!r} is not one of: None or 'local' (local files only), "
                     f"{s3_available_options} (AWS S3), {gcs_available_options} (Google Cloud Storage)")


def storage_for(cloud_save_mode: Optional[str], bucket_name: str, **options: Any) -> Optional[CloudStorage]:
    """The bucket ``cloud_save_mode`` names: :class:`~aitoolbox.cloud.s3.S3Storage`,
    :class:`~aitoolbox.cloud.gcs.GCSStorage`, or None for local saving.

    Args:
        cloud_save_mode: aitoolbox 1.x's selector (``'s3'``, ``'aws_s3'``, ``'aws'``, ``'gcs'``,
            ``'google_storage'``, ``'google storage'``; None or ``'local'``).
        bucket_name: the bucket.
        **options: passed to the storage class (``endpoint_url``, ``retry``, ...).

    Raises:
        ValueError: an unknown ``cloud_save_mode``.
        ImportError: the service's client is not installed (the message names the pip extra).
    """
    service = cloud_service(cloud_save_mode)
    if service == "s3":
        from aitoolbox.cloud.s3 import S3Storage
        return S3Storage(bucket_name, **options)
    if service == "gcs":
        from aitoolbox.cloud.gcs import GCSStorage
        return GCSStorage(bucket_name, **options)
    return None


def uploader_for(cloud_save_mode: Optional[str], bucket_name: str, **options: Any) -> Optional["CloudUploader"]:
    """A :class:`CloudUploader` for the bucket ``cloud_save_mode`` names, or None for local saving.

    Arguments as :func:`storage_for`.
    """
    storage = storage_for(cloud_save_mode, bucket_name, **options)
    return CloudUploader(storage) if storage is not None else None


class CloudUploader:
    """Uploads files and folders to one bucket in background threads, through a bounded queue.

    Args:
        storage: the bucket.
        max_workers: how many uploads run at once. With 1 (the default) they run in the order submitted.
        max_queued: how many uploads may wait for their turn; a submit beyond that waits until the oldest starts.

    Example::

        uploader = uploader_for("s3", "my-bucket")
        uploader.submit(checkpoint_path, keys.checkpoint(os.path.basename(checkpoint_path)))
        ...                      # training goes on while the file is uploaded
        uploader.close()         # waits for every upload; raises the first failure
    """

    def __init__(self, storage: CloudStorage, max_workers: int = 1, max_queued: int = DEFAULT_MAX_QUEUED):
        if not isinstance(storage, CloudStorage):
            raise TypeError(f"storage must be a CloudStorage (S3Storage, GCSStorage), got {type(storage).__name__}")
        for name, value in (("max_workers", max_workers), ("max_queued", max_queued)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.storage = storage
        self.max_workers = max_workers
        self.max_queued = max_queued
        self._changed = threading.Condition()  # guards everything below; notified when the queue changes
        self._queue: "collections.OrderedDict[str, _Job]" = collections.OrderedDict()  # destination -> job
        self._workers = 0
        self._running = 0
        self._submitted: List[Tuple[str, concurrent.futures.Future]] = []
        self._closed = False

    def submit(self, local_path: str, key: str, missing_ok: bool = False) -> "concurrent.futures.Future[str]":
        """Queue the upload of the file ``local_path`` as ``key``; returns once it is queued.

        The file is pinned now and opened when its upload starts (see the module's docstring). A queued upload of
        ``key`` that has not started is replaced by this one. With ``max_queued`` uploads waiting, this waits for
        the oldest to start (logged once, with the wait's length).

        Args:
            local_path: the file; it must exist now.
            key: the object's key.
            missing_ok: where the file cannot be pinned and is removed before its upload starts, skip it with a
                warning (the future's result is None) instead of failing the upload.

        Returns:
            A future whose result is the object's URI (None when the file is a symbolic link, which is not
            uploaded), or whose exception is the :class:`~aitoolbox.cloud.storage.CloudStorageError` naming the
            bucket and key; cancelled when a newer submit of the same key replaced it before it started.

        Raises:
            FileNotFoundError / IsADirectoryError: ``local_path`` is not a file now.
            RuntimeError: the uploader is closed.
        """
        local_path = os.path.expanduser(local_path)
        if os.path.isdir(local_path):
            raise IsADirectoryError(f"cannot upload {local_path} as a file: it is a folder (use submit_folder)")
        os.stat(local_path)  # a missing file is the caller's error: raise it now, in the caller's thread
        uri = self.storage.uri(key)
        if os.path.islink(local_path):
            return _not_followed(local_path, uri)

        def upload(pinned: Pinned) -> Optional[str]:
            try:
                handle = open_for_upload(pinned.path)
            except FileNotFoundError:
                return _removed(local_path, uri, missing_ok)
            if handle is None:  # replaced by a link (or something else) after it was submitted
                return _not_followed(local_path, uri).result()
            with handle:
                size = os.fstat(handle.fileno()).st_size  # a file still growing goes up as it is now
                return self.storage.upload_handle(handle, key, local_path=local_path, size=size)
        return self._enqueue(key, local_path, upload, f"{local_path} -> {uri}")

    def submit_folder(self, local_folder: str, key_prefix: str, complete_marker: bool = True,
                      missing_ok: bool = False) -> "concurrent.futures.Future[List[str]]":
        """Queue the upload of every file below ``local_folder`` to ``<key_prefix>/...``; returns once queued.

        The folder is pinned now (a copy of its tree made of hard links) and its files are opened when the upload
        starts. With ``complete_marker`` the folder's completion marker is written after every file (see
        :meth:`~aitoolbox.cloud.storage.CloudStorage.upload_folder`): a reader never takes a folder whose upload
        was interrupted for a complete one. A queued upload of the same prefix that has not started is replaced by
        this one; ``missing_ok`` as for :meth:`submit`.

        Returns:
            A future whose result is the list of keys written (None when skipped).

        Raises:
            NotADirectoryError: ``local_folder`` is not a folder now.
        """
        local_folder = os.path.expanduser(local_folder)
        if not os.path.isdir(local_folder):
            raise NotADirectoryError(f"cannot upload the folder {local_folder}: it is not a folder")
        key_prefix = key_prefix.rstrip("/")
        uri = f"{self.storage.uri(key_prefix)}/"
        if os.path.islink(local_folder):
            return _not_followed(local_folder, uri)

        def upload(pinned: Pinned) -> Optional[List[str]]:
            try:
                files = open_folder(pinned.path, shown_as=local_folder)
            except (FileNotFoundError, NotADirectoryError):
                if os.path.isdir(pinned.path):  # a file inside vanished while the folder stays: not pruning
                    raise
                return _removed(local_folder, uri, missing_ok)
            files.folder = local_folder  # errors name the folder as submitted, not its pin
            return self.storage.upload_open_folder(files, key_prefix, complete_marker)
        return self._enqueue(key_prefix + "/", local_folder, upload, f"{local_folder}/ -> {uri}")

    def _enqueue(self, destination: str, local_path: str, upload: Callable[[Pinned], Any],
                 description: str) -> concurrent.futures.Future:
        with self._changed:
            self._check_open(description)
        job = _Job(description, pin(local_path), upload, concurrent.futures.Future())
        waited_since = None
        try:
            with self._changed:
                self._check_open(description)
                while destination not in self._queue and len(self._queue) >= self.max_queued:
                    waited_since = waited_since or time.monotonic()
                    self._changed.wait()
                    self._check_open(description)
                superseded = self._queue.pop(destination, None)
                self._queue[destination] = job  # last: it goes up after everything submitted before it
                self._submitted.append((description, job.future))
                if self._workers < self.max_workers:
                    self._workers += 1
                    threading.Thread(target=self._work, name=f"aitoolbox-upload-{self._workers}").start()
                self._changed.notify_all()
        except BaseException:
            job.pinned.release()
            raise
        if waited_since is not None:
            logger.warning("Waited %.1f s to queue the upload %s: %d uploads to %s were waiting (max_queued=%d); "
                           "uploading is slower than training writes files", time.monotonic() - waited_since,
                           description, self.max_queued, self.storage.uri(), self.max_queued)
        if superseded is not None:
            _drop(superseded.future)
            superseded.pinned.release()
            logger.info("Dropped the queued upload %s: a newer version of it was submitted", superseded.description)
        job.future.add_done_callback(lambda done: _log_failure(done, description))
        return job.future

    def _check_open(self, description: str) -> None:
        if self._closed:
            raise RuntimeError(f"this CloudUploader of {self.storage.uri()} is closed: cannot upload {description}")

    def _work(self) -> None:
        """A worker thread: run the queued uploads, oldest first; end when the queue is empty (so an idle
        uploader holds no thread, and the interpreter never waits at exit for one that has nothing to do)."""
        while True:
            with self._changed:
                if not self._queue:
                    self._workers -= 1
                    return
                _, job = self._queue.popitem(last=False)
                self._running += 1
                self._changed.notify_all()  # a place in the queue is free
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        result = job.upload(job.pinned)
                    except BaseException as error:  # reported through the future, as an executor does
                        job.pinned.release(restore=True)
                        job.future.set_exception(error)
                    else:
                        job.pinned.release()
                        job.future.set_result(result)
                else:  # cancelled by its submitter while it waited: it did not happen
                    job.pinned.release(restore=True)
            finally:
                with self._changed:
                    self._running -= 1
                    self._changed.notify_all()

    @property
    def pending(self) -> int:
        """How many submitted uploads have not finished yet (waiting or in progress)."""
        with self._changed:
            return len(self._queue) + self._running

    @property
    def queued(self) -> int:
        """How many uploads wait for their turn (at most ``max_queued``)."""
        with self._changed:
            return len(self._queue)

    def wait(self, timeout: Optional[float] = None) -> List[Any]:
        """Wait for every upload submitted so far.

        Returns:
            Their results (object URIs, key lists; None for a file skipped by ``missing_ok``), in submission
            order, leaving out the uploads that a newer one of the same key replaced.

        Raises:
            CloudStorageError: the first upload that failed (the others are logged); each failure is raised once.
            TimeoutError: ``timeout`` seconds passed first; the uploads go on.
        """
        with self._changed:
            submitted = list(self._submitted)
        done, not_done = concurrent.futures.wait([future for _, future in submitted], timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} upload(s) to {self.storage.uri()} still running after {timeout} s")
        with self._changed:
            self._submitted = [item for item in self._submitted if item[1] not in done]
        finished = [future for _, future in submitted if not future.cancelled()]
        failures = [future.exception() for future in finished if future.exception() is not None]
        if failures:
            if len(failures) > 1:
                logger.error("%d uploads to %s failed; raising the first", len(failures), self.storage.uri())
            raise failures[0]
        return [future.result() for future in finished]

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for every upload (see :meth:`wait`); later submits raise.

        Interrupted (KeyboardInterrupt), it stops waiting at once: the uploads not started yet are dropped and the
        one in progress finishes in its thread.
        """
        with self._changed:
            self._closed = True
            self._changed.notify_all()  # a submit waiting for room raises now
        try:
            self.wait(timeout)
        except KeyboardInterrupt:
            with self._changed:
                dropped, self._queue = list(self._queue.values()), collections.OrderedDict()
            for job in dropped:
                _drop(job.future)
                job.pinned.release(restore=True)
            raise

    def __enter__(self) -> "CloudUploader":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error in the with-block wins: finish the uploads, but only log theirs
            self.close()
        except Exception as upload_error:
            logger.error("Upload failed while handling another error: %s", upload_error)

    def __repr__(self) -> str:
        return f"CloudUploader({self.storage!r}, pending={self.pending})"


@dataclass
class _Job:
    """One queued upload: what it is (for logs), its pinned file or folder, the upload itself, and its future."""
    description: str
    pinned: Pinned
    upload: Callable[[Pinned], Any]
    future: concurrent.futures.Future


def _drop(future: concurrent.futures.Future) -> None:
    """Cancel the future of an upload that will not run, and notify its waiters (``concurrent.futures.wait``
    counts a cancelled future as done only once notified)."""
    if future.cancel():
        future.set_running_or_notify_cancel()


def _removed(local_path: str, uri: str, missing_ok: bool) -> None:
    """The outcome of an upload whose file was removed before it started: skipped, or a clear failure."""
    if missing_ok:
        logger.warning("Not uploading %s to %s: it was removed (e.g. an older checkpoint pruned) before its upload "
                       "started", local_path, uri)
        return None
    raise FileNotFoundError(f"{local_path} was removed before its upload to {uri} started: nothing was uploaded "
                            "(keep the file until CloudUploader.wait() returns, or submit it with missing_ok=True)")


def _not_followed(local_path: str, uri: str) -> concurrent.futures.Future:
    """The outcome of a submitted symbolic link: nothing uploaded, one warning, a future whose result is None."""
    logger.warning("Not uploading %s to %s: it is a symbolic link, and an upload never follows one (its target "
                   "could be any file of this machine)", local_path, uri)
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(None)
    return future


def _log_failure(future: concurrent.futures.Future, description: str) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("Upload %s failed: %s (the local file is kept)", description, future.exception())
