"""aitoolbox 1.x's ``cloud.AWS.data_access``: AWS S3 is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

BaseDataSaver = not_supported(
    "BaseDataSaver", "AWS S3",
    "local files", __name__)
BaseDataLoader = not_supported(
    "BaseDataLoader", "AWS S3",
    "local files", __name__)

__all__ = ["BaseDataSaver", "BaseDataLoader"]
