"""Continue training from a saved checkpoint."""
import os
from typing import Optional

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback


class ModelLoadContinueTraining(AbstractCallback):
    """Load a checkpoint into the TrainLoop when registered, so ``fit`` continues from it bitwise.

    Name the checkpoint by its file or folder (``saved_model_path``), or aitoolbox 1.x style by the experiment
    folder parts: the newest checkpoint of that run is taken.

    Args:
        saved_experiment_timestamp: timestamp of the run to continue (with the three folder arguments).
        saved_model_dir: ``'checkpoint_model'`` (default) or ``'model'`` (the final model of a finished run).
        project_name, experiment_name, local_model_result_folder_path: the saved run's experiment folder.
        saved_model_path: a checkpoint file, a run folder, or its checkpoint folder (instead of the above).
    """

    def __init__(self, saved_experiment_timestamp: Optional[str] = None, saved_model_dir: str = "checkpoint_model",
                 project_name: Optional[str] = None, experiment_name: Optional[str] = None,
                 local_model_result_folder_path: Optional[str] = None, saved_model_path: Optional[str] = None):
        super().__init__("Continue training from a checkpoint", execution_order=-100)
        parts = (saved_experiment_timestamp, project_name, experiment_name, local_model_result_folder_path)
        if saved_model_path is None:
            if any(part is None for part in parts):
                raise ValueError("ModelLoadContinueTraining needs saved_model_path, or all of saved_experiment_timestamp, "
                                 "project_name, experiment_name and local_model_result_folder_path")
            saved_model_path = os.path.join(os.path.expanduser(local_model_result_folder_path), project_name,
                                            f"{experiment_name}_{saved_experiment_timestamp}", saved_model_dir)
        self.saved_model_path = saved_model_path
        self.checkpoint = None

    def on_train_loop_registration(self) -> None:
        self.checkpoint = self.train_loop_obj.load_checkpoint(self.saved_model_path)
