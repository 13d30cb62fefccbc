"""aitoolbox 1.x's ``cloud.GoogleCloud.model_save``: Google Cloud Storage is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

PyTorchGoogleStorageModelSaver = not_supported(
    "PyTorchGoogleStorageModelSaver", "Google Cloud Storage",
    "aitoolbox.experiment.local_save.local_model_save.PyTorchLocalModelSaver", __name__)
KerasGoogleStorageModelSaver = not_supported(
    "KerasGoogleStorageModelSaver", "Google Cloud Storage",
    "aitoolbox.experiment.local_save.local_model_save.KerasLocalModelSaver", __name__)

__all__ = ["PyTorchGoogleStorageModelSaver", "KerasGoogleStorageModelSaver"]
