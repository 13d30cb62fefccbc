"""Loading saved models and checkpoints from the experiment folder (aitoolbox 1.x's loaders)."""
from aitoolbox.experiment.local_load.local_model_load import AbstractLocalModelLoader, PyTorchLocalModelLoader

__all__ = ["AbstractLocalModelLoader", "PyTorchLocalModelLoader"]
