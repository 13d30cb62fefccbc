"""aitoolbox 1.x's ``cloud.AWS.model_save``: AWS S3 is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

PyTorchS3ModelSaver = not_supported(
    "PyTorchS3ModelSaver", "AWS S3",
    "aitoolbox.experiment.local_save.local_model_save.PyTorchLocalModelSaver", __name__)
KerasS3ModelSaver = not_supported(
    "KerasS3ModelSaver", "AWS S3",
    "aitoolbox.experiment.local_save.local_model_save.KerasLocalModelSaver", __name__)

__all__ = ["PyTorchS3ModelSaver", "KerasS3ModelSaver"]
