"""aitoolbox 1.x's ``cloud.GoogleCloud.results_save``: Google Cloud Storage is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

GoogleStorageResultsSaver = not_supported(
    "GoogleStorageResultsSaver", "Google Cloud Storage",
    "aitoolbox.experiment.local_save.local_results_save.LocalResultsSaver", __name__)

__all__ = ["GoogleStorageResultsSaver"]
