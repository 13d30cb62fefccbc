"""Uploads in the background: training hands a file to :class:`CloudUploader` and goes on at once.

One worker thread (by default) uploads the files in the order they were submitted, so the newest checkpoint in
the bucket is always the newest one submitted whose upload has finished. Files are opened when they are
submitted: an upload carries the file as it was then, even if the file is replaced (the next atomic save of the
same name) or deleted (pruning of old checkpoints) before its turn comes. Local files are never removed.

Failures are logged when they happen and raised by :meth:`CloudUploader.wait` / :meth:`CloudUploader.close`,
which the training loop calls before ``fit`` returns; the local copy stays in the experiment folder either way.
"""
import concurrent.futures
import logging
import os
import threading
from typing import Any, List, Optional, Tuple

from aitoolbox.cloud import gcs_available_options, s3_available_options
from aitoolbox.cloud.layout import ExperimentKeys
from aitoolbox.cloud.storage import CloudStorage, open_folder
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder

logger = logging.getLogger(__name__)

LOCAL_SAVE_MODES = (None, "local")


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
    """Uploads files and folders to one bucket in background threads.

    Args:
        storage: the bucket.
        max_workers: how many uploads run at once. With 1 (the default) they run in the order submitted.

    Example::

        uploader = uploader_for("s3", "my-bucket")
        uploader.submit(checkpoint_path, keys.checkpoint(os.path.basename(checkpoint_path)))
        ...                      # training goes on while the file is uploaded
        uploader.close()         # waits for every upload; raises the first failure
    """

    def __init__(self, storage: CloudStorage, max_workers: int = 1):
        if not isinstance(storage, CloudStorage):
            raise TypeError(f"storage must be a CloudStorage (S3Storage, GCSStorage), got {type(storage).__name__}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.storage = storage
        self.max_workers = max_workers
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._submitted: List[Tuple[str, concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, local_path: str, key: str) -> "concurrent.futures.Future[str]":
        """Queue the upload of the file ``local_path`` as ``key``; returns at once.

        The file is opened now (a missing file raises here); its content as of now is uploaded.

        Returns:
            A future whose result is the object's URI, or whose exception is the
            :class:`~aitoolbox.cloud.storage.CloudStorageError` naming the bucket and key.
        """
        local_path = os.path.expanduser(local_path)
        handle = open(local_path, "rb")
        size = os.fstat(handle.fileno()).st_size  # a file still growing (TensorBoard's) goes up as it is now

        def upload() -> str:
            with handle:
                return self.storage.upload_handle(handle, key, local_path=local_path, size=size)
        try:
            return self._enqueue(upload, f"{local_path} -> {self.storage.uri(key)}")
        except BaseException:
            handle.close()
            raise

    def submit_folder(self, local_folder: str, key_prefix: str,
                      complete_marker: bool = True) -> "concurrent.futures.Future[List[str]]":
        """Queue the upload of every file below ``local_folder`` to ``<key_prefix>/...``; returns at once.

        The files are opened now. With ``complete_marker`` the folder's completion marker is written after every
        file (see :meth:`~aitoolbox.cloud.storage.CloudStorage.upload_folder`): a reader never takes a folder
        whose upload was interrupted for a complete one.

        Returns:
            A future whose result is the list of keys written.
        """
        files = open_folder(local_folder)
        try:
            return self._enqueue(lambda: self.storage.upload_open_folder(files, key_prefix, complete_marker),
                                 f"{local_folder}/ -> {self.storage.uri(key_prefix.rstrip('/'))}/")
        except BaseException:
            files.close()
            raise

    def _enqueue(self, job, description: str) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"this CloudUploader of {self.storage.uri()} is closed: cannot upload "
                                   f"{description}")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers,
                                                                       thread_name_prefix="aitoolbox-upload")
            future = self._executor.submit(job)
            self._submitted.append((description, future))
        future.add_done_callback(lambda done: _log_failure(done, description))
        return future

    @property
    def pending(self) -> int:
        """How many submitted uploads have not finished yet."""
        with self._lock:
            return sum(1 for _, future in self._submitted if not future.done())

    def wait(self, timeout: Optional[float] = None) -> List[Any]:
        """Wait for every upload submitted so far.

        Returns:
            Their results (object URIs, key lists), in submission order.

        Raises:
            CloudStorageError: the first upload that failed (the others are logged); each failure is raised once.
            TimeoutError: ``timeout`` seconds passed first; the uploads go on.
        """
        with self._lock:
            submitted = list(self._submitted)
        done, not_done = concurrent.futures.wait([future for _, future in submitted], timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} upload(s) to {self.storage.uri()} still running after {timeout} s")
        with self._lock:
            self._submitted = [item for item in self._submitted if item[1] not in done]
        failures = [future.exception() for _, future in submitted if future.exception() is not None]
        if failures:
            if len(failures) > 1:
                logger.error("%d uploads to %s failed; raising the first", len(failures), self.storage.uri())
            raise failures[0]
        return [future.result() for _, future in submitted]

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for every upload (see :meth:`wait`), then stop the worker threads. Later submits raise.

        Interrupted (KeyboardInterrupt), it stops waiting at once: the uploads not started yet are dropped and the
        one in progress finishes in its thread.
        """
        with self._lock:
            self._closed = True
        interrupted = False
        try:
            self.wait(timeout)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=timeout is None and not interrupted, cancel_futures=interrupted)

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


class ExperimentUploader:
    """Uploads files of one run's local experiment folder to the same place under the run's key in the bucket
    (aitoolbox 1.8's layout, see :mod:`aitoolbox.cloud.layout`).

    Args:
        uploader: the uploader (several ExperimentUploaders may share one, so that one ``wait`` covers all).
        keys: the run's keys.
        local_experiment_folder: the run's local folder (``<root>/<project>/<experiment>_<timestamp>``).
    """

    def __init__(self, uploader: CloudUploader, keys: ExperimentKeys, local_experiment_folder: str):
        self.uploader = uploader
        self.keys = keys
        self.local_experiment_folder = os.path.abspath(os.path.expanduser(local_experiment_folder))

    @property
    def storage(self) -> CloudStorage:
        return self.uploader.storage

    def upload(self, local_path: str) -> concurrent.futures.Future:
        """Queue the upload of a file, or of a folder (with its completion marker), of the run folder.

        Returns:
            The upload's future (see :meth:`CloudUploader.submit`).

        Raises:
            ValueError: ``local_path`` is not inside the run folder.
            FileNotFoundError: there is no such file or folder.
        """
        key = self.keys.for_local_path(local_path, self.local_experiment_folder)
        if os.path.isdir(local_path):
            return self.uploader.submit_folder(local_path, key)
        return self.uploader.submit(local_path, key)

    def wait(self, timeout: Optional[float] = None) -> List[Any]:
        """:meth:`CloudUploader.wait` of the shared uploader."""
        return self.uploader.wait(timeout)

    def close(self, timeout: Optional[float] = None) -> None:
        """:meth:`CloudUploader.close` of the shared uploader."""
        self.uploader.close(timeout)


def experiment_uploader_for(cloud_save_mode: Optional[str], bucket_name: str, cloud_dir_prefix: Optional[str],
                            project_name: str, experiment_name: str, experiment_timestamp: str,
                            local_model_result_folder_path: str,
                            uploader: Optional[CloudUploader] = None, **options: Any) -> Optional[ExperimentUploader]:
    """An :class:`ExperimentUploader` for one run, or None for local saving.

    Args:
        cloud_save_mode, bucket_name: as :func:`uploader_for`.
        cloud_dir_prefix: the folder inside the bucket that holds the projects (None or ``''``: the top).
        project_name, experiment_name, experiment_timestamp: the run.
        local_model_result_folder_path: the local folder that holds the projects.
        uploader: share this uploader (of the same bucket) instead of making a new one.
        **options: for the storage class, when a new uploader is made.
    """
    if cloud_service(cloud_save_mode) is None:
        return None
    if uploader is None:
        uploader = uploader_for(cloud_save_mode, bucket_name, **options)
    elif uploader.storage.bucket_name != bucket_name:
        raise ValueError(f"the uploader writes to the bucket {uploader.storage.bucket_name!r}, not to "
                         f"bucket_name={bucket_name!r}")
    _, folder = ExperimentFolder.get_base_folder_paths(project_name, experiment_name, experiment_timestamp,
                                                       local_model_result_folder_path)
    keys = ExperimentKeys(cloud_dir_prefix, project_name, experiment_name, experiment_timestamp)
    return ExperimentUploader(uploader, keys, folder)


def _log_failure(future: concurrent.futures.Future, description: str) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("Upload %s failed: %s (the local file is kept)", description, future.exception())
