"""aitoolbox 1.x's ``cloud.AWS.results_save``: AWS S3 is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

S3ResultsSaver = not_supported(
    "S3ResultsSaver", "AWS S3",
    "aitoolbox.experiment.local_save.local_results_save.LocalResultsSaver", __name__)

__all__ = ["S3ResultsSaver"]
