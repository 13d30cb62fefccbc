"""aitoolbox 1.x's ``cloud.GoogleCloud.model_load``: Google Cloud Storage is not supported yet."""
from aitoolbox.cloud.unsupported import not_supported

PyTorchGoogleStorageModelLoader = not_supported(
    "PyTorchGoogleStorageModelLoader", "Google Cloud Storage",
    "aitoolbox.experiment.local_load.local_model_load.PyTorchLocalModelLoader", __name__)

__all__ = ["PyTorchGoogleStorageModelLoader"]
