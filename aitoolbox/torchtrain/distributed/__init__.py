"""Distribution strategies (single device, DataParallel) that TrainLoop calls at fixed points."""
from aitoolbox.torchtrain.distributed.strategy import (
    GPU_MODES, DataParallelStrategy, SingleDeviceStrategy, create_strategy, resolve_device)

__all__ = ["GPU_MODES", "DataParallelStrategy", "SingleDeviceStrategy", "create_strategy", "resolve_device"]
