"""The training loop and its experiment-tracking presets."""
from aitoolbox.torchtrain.train_loop.tracking import TrainLoopCheckpoint, TrainLoopCheckpointEndSave, TrainLoopEndSave
from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop
from aitoolbox.torchtrain.train_loop.lr_suggestion import LRFinderResult

__all__ = ["TrainLoop", "TrainLoopCheckpoint", "TrainLoopEndSave", "TrainLoopCheckpointEndSave", "LRFinderResult"]
