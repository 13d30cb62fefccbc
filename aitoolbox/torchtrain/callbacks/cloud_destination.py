"""Where a callback's files go in the cloud: aitoolbox 1.x's ``cloud_save_mode``, ``bucket_name`` and
``cloud_dir_prefix`` arguments resolved to one bucket of one service.

The uploading itself (a callback of its own, run after the others) is :mod:`aitoolbox.torchtrain.callbacks.
cloud_upload`; this module sits below every callback, so that the callbacks' base class can resolve its destination
without importing the callback that uploads.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from aitoolbox.cloud.layout import ExperimentKeys
from aitoolbox.cloud.storage import CloudStorage
from aitoolbox.cloud.uploader import cloud_service, storage_for
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder

#: aitoolbox 1.8's default bucket, used when a cloud ``cloud_save_mode`` comes without a ``bucket_name``.
DEFAULT_BUCKET = "model-result"


@dataclass(frozen=True)
class CloudDestination:
    """Where a callback's files go: a bucket of one service, and the folder in it that holds the projects.

    Attributes:
        cloud_save_mode: the selector as given (``'s3'``, ``'aws_s3'``, ``'gcs'``, ...).
        service: ``'s3'`` or ``'gcs'``.
        bucket_name: the bucket.
        cloud_dir_prefix: the folder inside the bucket that holds the projects (``''``: the bucket's top).
        storage_options: keyword arguments of the storage class (``endpoint_url``, ``retry``, ...).
    """
    cloud_save_mode: str
    service: str
    bucket_name: str
    cloud_dir_prefix: str = ""
    storage_options: Dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def uploader_key(self) -> Tuple[str, str, str]:
        """Destinations with equal keys share one uploader."""
        return self.service, self.bucket_name, repr(sorted(self.storage_options.items()))

    def storage(self) -> CloudStorage:
        """A new storage object for the bucket (it connects on first use)."""
        return storage_for(self.cloud_save_mode, self.bucket_name, **self.storage_options)

    def keys(self, folder: ExperimentFolder) -> ExperimentKeys:
        """The keys of the run ``folder`` in the bucket."""
        return ExperimentKeys(self.cloud_dir_prefix, folder.project_name, folder.experiment_name, folder.timestamp)


def check_cloud_save_mode(cloud_save_mode: Optional[str], owner: str) -> Optional[str]:
    """``'s3'``, ``'gcs'`` or None (local saving) for a ``cloud_save_mode`` argument of ``owner``.

    Raises:
        ValueError: an unknown value; the message names ``owner`` and lists the valid ones.
    """
    try:
        return cloud_service(cloud_save_mode)
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{owner}: {error}") from None


def cloud_destination(cloud_save_mode: Optional[str], bucket_name: Optional[str], cloud_dir_prefix: Optional[str],
                      storage_options: Optional[dict] = None, owner: str = "") -> Optional[CloudDestination]:
    """The destination these aitoolbox 1.x arguments name, or None for local saving.

    Args:
        cloud_save_mode: ``'s3'`` / ``'aws_s3'`` / ``'aws'``, ``'gcs'`` / ``'google_storage'`` /
            ``'google storage'``, or None / ``'local'``.
        bucket_name: the bucket; None takes aitoolbox 1.8's default, :data:`DEFAULT_BUCKET`.
        cloud_dir_prefix: the folder inside the bucket (None or ``''``: the bucket's top).
        storage_options: keyword arguments of the storage class.
        owner: named in errors.

    Raises:
        ValueError: an unknown ``cloud_save_mode``, or a bucket name or prefix that is not a string.
        TypeError: ``storage_options`` is not a dict, or holds an argument the storage class does not take.
        ImportError: the service's client is not installed (the message names the pip extra).
    """
    service = check_cloud_save_mode(cloud_save_mode, owner)
    if service is None:
        return None
    bucket_name = DEFAULT_BUCKET if bucket_name is None else bucket_name
    if not isinstance(bucket_name, str) or not bucket_name or "/" in bucket_name:
        raise ValueError(f"{owner}: bucket_name must be a bucket's name (no '/'), got {bucket_name!r}")
    if cloud_dir_prefix is not None and not isinstance(cloud_dir_prefix, str):
        raise ValueError(f"{owner}: cloud_dir_prefix must be a folder path inside the bucket or None, got "
                         f"{cloud_dir_prefix!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"{owner}: cloud_storage_options must be a dict of storage arguments (endpoint_url, retry, "
                        f"...) or None, got {type(storage_options).__name__}")
    destination = CloudDestination(cloud_save_mode, service, bucket_name, cloud_dir_prefix or "",
                                   dict(storage_options or {}))
    try:
        destination.storage()  # no request: fails now without the service's client, or with a bad option
    except TypeError as error:
        raise TypeError(f"{owner}: cloud_storage_options {sorted(destination.storage_options)} do not fit "
                        f"{service}'s storage class: {error}") from error
    return destination


def loop_cloud_destination(train_loop: Any) -> Optional[CloudDestination]:
    """The destination of an experiment-tracking preset (TrainLoopCheckpoint, ...), or None."""
    return cloud_destination(getattr(train_loop, "cloud_save_mode", None), getattr(train_loop, "bucket_name", None),
                             getattr(train_loop, "cloud_dir_prefix", None),
                             getattr(train_loop, "cloud_storage_options", None), type(train_loop).__name__)
