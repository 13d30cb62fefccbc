"""Weights & Biases tracking (aitoolbox 1.x's ``WandBTracking``): the names are here, the feature is not yet.

``AlertConfig`` can be built (it is plain data); constructing :class:`WandBTracking` raises
``NotImplementedError`` naming the local alternatives. The ``wandb`` package is never imported.
"""
from dataclasses import dataclass
from typing import Any, Optional

from aitoolbox.torchtrain.callbacks.abstract import AbstractExperimentCallback


@dataclass
class AlertConfig:
    """An alert on a training-history metric, for :class:`WandBTracking`.

    Args:
        metric_name: the metric whose newest value is checked.
        threshold_value: the value it is compared with.
        objective: ``'maximize'`` or ``'minimize'``.
        wandb_alert_level: a ``wandb.AlertLevel``, or None for wandb's default.
    """

    metric_name: str
    threshold_value: float
    objective: str = "maximize"
    wandb_alert_level: Any = None


class WandBTracking(AbstractExperimentCallback):
    """Logging to Weights & Biases: not supported yet.

    Raises:
        NotImplementedError: always; use the tensorboard callbacks (``TensorboardFullTracking``) or
            ``ModelTrainHistoryFileWriter`` / ``ModelTrainHistoryPlot`` for local experiment tracking.
    """

    def __init__(self, metric_names: Optional[list] = None, batch_log_frequency: Optional[int] = None,
                 hyperparams: Optional[dict] = None, tags: Optional[list] = None, alerts: Optional[list] = None,
                 wandb_pre_initialized: bool = False, source_dirs=(), log_dir: Optional[str] = None,
                 is_project: bool = True, project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, **kwargs):
        super().__init__("WeightsAndBiases Experiment Tracking", project_name, experiment_name,
                         local_model_result_folder_path, execution_order=97, device_idx_execution=0)
        raise NotImplementedError(
            "WandBTracking (Weights & Biases logging) is not supported yet. Track experiments locally with the "
            "tensorboard callbacks (aitoolbox.torchtrain.callbacks.tensorboard.TensorboardFullTracking) or with "
            "ModelTrainHistoryFileWriter / ModelTrainHistoryPlot")
