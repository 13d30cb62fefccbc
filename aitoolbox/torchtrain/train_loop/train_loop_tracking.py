"""aitoolbox 1.x's module path of the experiment-tracking presets (they live in :mod:`.tracking`)."""
from aitoolbox.torchtrain.train_loop.tracking import TrainLoopCheckpoint, TrainLoopCheckpointEndSave, TrainLoopEndSave

__all__ = ["TrainLoopCheckpoint", "TrainLoopEndSave", "TrainLoopCheckpointEndSave"]
