"""Kept so that ``from aitoolbox.torchtrain.train_loop.history import TrainingHistory`` keeps working.

The class lives in :mod:`aitoolbox.experiment.training_history`, where aitoolbox 1.x has it.
"""
from aitoolbox.experiment.training_history import TrainingHistory

__all__ = ["TrainingHistory"]
