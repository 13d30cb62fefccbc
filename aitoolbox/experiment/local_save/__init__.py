"""Experiment folders and crash-safe files: where checkpoints, models and results are written."""
from aitoolbox.experiment.local_save.atomic import (
    atomic_write, atomic_write_bytes, atomic_write_text, torch_load_checked, torch_save_atomic)
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder

__all__ = ["ExperimentFolder", "atomic_write", "atomic_write_bytes", "atomic_write_text", "torch_load_checked",
           "torch_save_atomic"]
