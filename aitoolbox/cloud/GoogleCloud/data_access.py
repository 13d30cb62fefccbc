"""aitoolbox 1.x's ``cloud.GoogleCloud.data_access``: Google Cloud Storage is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

BaseGoogleStorageDataSaver = not_supported(
    "BaseGoogleStorageDataSaver", "Google Cloud Storage",
    "local files", __name__)
BaseGoogleStorageDataLoader = not_supported(
    "BaseGoogleStorageDataLoader", "Google Cloud Storage",
    "local files", __name__)

__all__ = ["BaseGoogleStorageDataSaver", "BaseGoogleStorageDataLoader"]
