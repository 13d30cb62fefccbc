"""The learning-rate scheduler callbacks under their old aitoolbox import path.

They live in :mod:`aitoolbox.torchtrain.schedulers.basic` and :mod:`aitoolbox.torchtrain.schedulers.warmup`;
``from aitoolbox.torchtrain.callbacks.train_schedule import StepLRScheduler`` keeps working.
"""
from aitoolbox.torchtrain.schedulers.basic import (  # noqa: F401
    AbstractScheduler, GeneralLRSchedulerCallback, LambdaLRScheduler, MultiStepLRScheduler,
    ReduceLROnPlateauMetricScheduler, ReduceLROnPlateauScheduler, StepLRScheduler)
from aitoolbox.torchtrain.schedulers.warmup import (  # noqa: F401
    ConstantWithWarmupScheduler, CosineWithWarmupScheduler, HardRestartsCosineWithWarmupScheduler,
    LinearWithWarmupScheduler)

__all__ = ["AbstractScheduler", "GeneralLRSchedulerCallback", "ReduceLROnPlateauScheduler",
           "ReduceLROnPlateauMetricScheduler", "LambdaLRScheduler", "StepLRScheduler", "MultiStepLRScheduler",
           "ConstantWithWarmupScheduler", "CosineWithWarmupScheduler", "HardRestartsCosineWithWarmupScheduler",
           "LinearWithWarmupScheduler"]
