"""Training-loop components: TrainLoop, TTModel, callbacks, precision and distribution.

The names aitoolbox 1.x exported from here stay importable: ``from aitoolbox.torchtrain import TrainLoop, TTModel``.
"""
from aitoolbox.torchtrain.data.batch_model_feed_defs import AbstractModelFeedDefinition
from aitoolbox.torchtrain.data.dataset import BasicDataset
from aitoolbox.torchtrain.model import ModelWrap, MultiGPUModelWrap, TTModel
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss, MultiOptimizer
from aitoolbox.torchtrain.parallel import TTDataParallel
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint, TrainLoopCheckpointEndSave, TrainLoopEndSave

__all__ = ["TTModel", "MultiGPUModelWrap", "ModelWrap", "TTDataParallel", "TrainLoop", "TrainLoopCheckpoint",
           "TrainLoopEndSave", "TrainLoopCheckpointEndSave", "AbstractModelFeedDefinition", "MultiLoss",
           "MultiOptimizer", "BasicDataset"]
