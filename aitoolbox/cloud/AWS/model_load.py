"""aitoolbox 1.x's ``cloud.AWS.model_load``: AWS S3 is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

PyTorchS3ModelLoader = not_supported(
    "PyTorchS3ModelLoader", "AWS S3",
    "aitoolbox.experiment.local_load.local_model_load.PyTorchLocalModelLoader", __name__)

__all__ = ["PyTorchS3ModelLoader"]
