"""Uploading the files callbacks write to S3 or Google Cloud Storage (aitoolbox 1.x's ``cloud_save_mode``).

A callback given ``cloud_save_mode='s3'`` / ``'gcs'`` (or taking it from an experiment-tracking preset) writes
each file into the local experiment folder as always, then hands it to the TrainLoop's :class:`CloudUploads`,
which uploads it in a background thread to the same place under the run's key in the bucket (aitoolbox 1.8's
layout, see :mod:`aitoolbox.cloud.layout`). Training goes on meanwhile.

:class:`CloudUploads` is a callback of its own, registered with the loop by the first callback that needs it
and run after all the others: at the end of ``fit`` it waits for every upload and raises the first failure
(a :class:`~aitoolbox.cloud.storage.CloudStorageError` naming the bucket and key); when ``fit`` stops on an
exception it waits too, but only logs failures.

Each bucket's uploader queues at most ``max_queued`` uploads (``CloudUploads.of(tl).max_queued``, see
:class:`~aitoolbox.cloud.uploader.CloudUploader`): when uploads are slower than the callbacks write files,
training waits for room and says so in the log; a file submitted again (the log, the checkpoint ranking,
TensorBoard's event files) replaces its queued older version. Files are opened only when their upload starts, so
a checkpoint pruned locally (``num_best_checkpoints_kept``, ``keep_last``) before its turn is not uploaded (a
warning names it; pruning never removes the newest checkpoint). What is guaranteed: when ``fit`` returns, every
file the callbacks handed over that is still in the run folder is in the bucket, as it was when handed over or
newer, or ``fit`` raises the upload's failure; nothing is removed locally.

The uploaders (and their threads and service clients) are made in the process that uploads, on its first upload:
rank 0 of distributed training; they never travel to spawned processes.
"""
import concurrent.futures
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from aitoolbox.cloud.storage import CloudStorageError
from aitoolbox.cloud.uploader import DEFAULT_MAX_QUEUED, CloudUploader
from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
# The destinations live below the callbacks' base class; their names stay importable from here (aitoolbox 1.x
# code and the package's own modules import them from cloud_upload).
from aitoolbox.torchtrain.callbacks.cloud_destination import (  # noqa: F401
    DEFAULT_BUCKET, CloudDestination, check_cloud_save_mode, cloud_destination, loop_cloud_destination)

logger = logging.getLogger(__name__)

#: After every other callback: the files of the last epoch and of the end of training are all submitted by then.
UPLOADS_EXECUTION_ORDER = 1_000_000


def upload_failed_at_train_end(error: CloudStorageError) -> CloudStorageError:
    """``error`` (an upload that failed) as the end of training reports it: with what the user has and can do."""
    return type(error)(f"{error}. Training finished and every file is in the local experiment folder; upload it "
                       "again once the bucket is reachable", service=error.service, bucket=error.bucket,
                       key=error.key, operation=error.operation, reason=error.reason, transient=error.transient,
                       attempts=error.attempts, local_path=error.local_path)


class CloudUploads(AbstractCallback):
    """The background uploads of one TrainLoop's callbacks; ``fit`` returns only once they are done.

    Registered by the first callback that uploads (:meth:`of`), it runs after every other callback. One
    :class:`~aitoolbox.cloud.uploader.CloudUploader` per bucket, made on the first upload in the process that
    uploads (the main process).

    - ``on_train_end``: wait for every upload and raise the first failure (the others are logged);
    - ``on_exception``: wait for every upload and log failures (``fit`` raises what stopped training); a
      KeyboardInterrupt while waiting stops waiting (the local files are complete either way).

    A failure never removes a local file: the experiment folder holds everything, to upload again later.

    Args:
        max_queued: how many uploads of a bucket may wait before a callback's upload waits for room. To change
            it for a loop, set ``CloudUploads.of(tl).max_queued`` before ``fit`` (it applies from the next
            uploader made, i.e. the next ``fit``'s first upload).
    """

    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED):
        super().__init__("Cloud storage uploads", execution_order=UPLOADS_EXECUTION_ORDER)
        self.max_queued = max_queued

    @property
    def max_queued(self) -> int:
        """How many uploads of a bucket may wait for their turn (see
        :class:`~aitoolbox.cloud.uploader.CloudUploader`)."""
        return self._max_queued

    @max_queued.setter
    def max_queued(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"CloudUploads: max_queued must be an int >= 1, got {value!r}")
        self._max_queued = value
        self._lock = threading.Lock()
        self._uploaders: Dict[Tuple[str, str, str], CloudUploader] = {}
        self._failures: List[BaseException] = []
        self._uploaded: Dict[Tuple[Tuple[str, str, str], str], Tuple[int, int]] = {}  # file -> (size, mtime)
        self._runs: Set[Tuple[Tuple[str, str, str], str]] = set()  # runs whose top files went up
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        # Sent to training processes: uploaders (threads, clients) are made anew in the process that uploads.
        state = self.__dict__.copy()
        state.update(_lock=None, _uploaders={}, _failures=[], _uploaded={}, _runs=set())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @classmethod
    def of(cls, train_loop: Any) -> "CloudUploads":
        """The loop's CloudUploads callback, registered with the loop now if it has none."""
        for callback in getattr(train_loop, "callbacks", []):
            if isinstance(callback, cls):
                return callback
        uploads = cls()
        train_loop.callbacks_handler.register_callbacks([uploads])
        return uploads

    # --- uploading ---------------------------------------------------------------------------------------
    def upload(self, destination: CloudDestination, folder: ExperimentFolder, local_path: str,
               only_if_changed: bool = False) -> Optional[concurrent.futures.Future]:
        """Queue the upload of a file (or a folder, with its completion marker) of the run ``folder`` to the same
        place under the run's key; returns at once. A run's first upload also uploads the files at the top of
        its folder (hyperparameters, the script copy).

        Args:
            destination: the bucket.
            folder: the local run folder ``local_path`` lies in.
            local_path: the file or folder.
            only_if_changed: skip a file whose size and modification time are those of its last upload.

        Returns:
            The upload's future, or None when skipped or when it could not be queued (the failure is raised at
            the end of ``fit``).
        """
        try:
            keys = destination.keys(folder)
            key = keys.for_local_path(local_path, folder.path)
        except ValueError as error:
            self._record_failure(error)
            return None
        with self._lock:
            first = (destination.uploader_key, keys.experiment) not in self._runs
            self._runs.add((destination.uploader_key, keys.experiment))
        if first:
            self.upload_run_files(destination, folder)
        return self.upload_to_key(destination, local_path, key, only_if_changed)

    def upload_run_files(self, destination: CloudDestination, folder: ExperimentFolder) -> None:
        """Queue the files at the top of the run folder (``hyperparams_list.txt``, the script copy, ...) that
        changed since their last upload."""
        if not os.path.isdir(folder.path):
            return
        keys = destination.keys(folder)
        for name in sorted(os.listdir(folder.path)):
            path = os.path.join(folder.path, name)
            if not name.startswith(TEMP_PREFIX) and os.path.isfile(path):
                self.upload_to_key(destination, path, keys.experiment_file(name), only_if_changed=True)

    def upload_to_key(self, destination: CloudDestination, local_path: str, key: str,
                      only_if_changed: bool = False) -> Optional[concurrent.futures.Future]:
        """Queue the upload of ``local_path`` (a file, or a folder with its completion marker) as ``key``.

        The file is opened when its upload starts; removed before then (pruned), it is skipped with a warning."""
        uploader = self._uploader(destination)
        record_key = (destination.uploader_key, os.path.abspath(local_path))
        try:
            if os.path.isdir(local_path):
                return uploader.submit_folder(local_path, key, missing_ok=True)
            stat = os.stat(local_path)
            signature = (stat.st_size, stat.st_mtime_ns)
            with self._lock:
                if only_if_changed and self._uploaded.get(record_key) == signature:
                    return None
                self._uploaded[record_key] = signature  # uploaded or on its way
            future = uploader.submit(local_path, key, missing_ok=True)
        except (OSError, RuntimeError) as error:  # a file gone, a closed uploader: reported at the end of fit
            self._record_failure(error)
            logger.error("Could not queue the upload of %s to %s: %s (the local file is kept)", local_path,
                         uploader.storage.uri(key), error)
            return None

        def forget_if_failed(done: concurrent.futures.Future) -> None:
            # After a failure the next upload of the file must not be skipped (a dropped one has a newer one queued).
            if not done.cancelled() and done.exception() is not None:
                with self._lock:
                    if self._uploaded.get(record_key) == signature:
                        del self._uploaded[record_key]
        future.add_done_callback(forget_if_failed)
        return future

    def _uploader(self, destination: CloudDestination) -> CloudUploader:
        with self._lock:
            if self._pid != os.getpid():  # a forked process: the parent's threads do not exist here
                self._uploaders, self._uploaded, self._runs, self._pid = {}, {}, set(), os.getpid()
            uploader = self._uploaders.get(destination.uploader_key)
            if uploader is None:
                uploader = CloudUploader(destination.storage(), max_queued=self.max_queued)
                self._uploaders[destination.uploader_key] = uploader
            return uploader

    def _record_failure(self, error: BaseException) -> None:
        with self._lock:
            self._failures.append(error)

    # --- waiting -----------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """How many queued uploads have not finished yet."""
        with self._lock:
            uploaders = list(self._uploaders.values())
        return sum(uploader.pending for uploader in uploaders)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for every queued upload, then stop the upload threads (a later upload starts new ones).

        Raises:
            CloudStorageError: the first upload that failed (after its retries); the others are logged.
            OSError / RuntimeError / ValueError: an upload that could not be queued.
        """
        with self._lock:
            uploaders, self._uploaders = self._uploaders, {}
            failures, self._failures = self._failures, []
        for uploader in uploaders.values():
            try:
                uploader.close(timeout)
            except (CloudStorageError, OSError, TimeoutError) as error:
                failures.append(error)
        if failures:
            for extra in failures[1:]:
                logger.error("Also failed: %s", extra)
            raise failures[0]

    def on_train_end(self) -> None:
        pending = self.pending
        if pending:
            logger.info("Waiting for %d upload(s) to cloud storage", pending)
        try:
            self.wait()
        except CloudStorageError as error:
            raise upload_failed_at_train_end(error) from error

    def on_exception(self, exception: BaseException) -> None:
        try:
            self.wait()
        except KeyboardInterrupt:
            logger.warning("Stopped waiting for the uploads to cloud storage; the local experiment folder holds "
                           "every file written")
        except Exception as error:  # fit raises what stopped training
            logger.error("An upload to cloud storage failed: %s (the local files are kept)", error)
