"""A training job as a SLURM requeue runs it again and again: TrainLoopCheckpointEndSave with ``auto_resume=True``,
EarlyStopping on a scripted validation score, and a kill (``os._exit``, no clean-up) at the start of epoch
``DIE_AT_EPOCH`` when that variable is set. Prints, as JSON, the epochs this process trained and where it ended.

Usage: python requeue_script.py <results folder>
"""
import json
import os
import sys

import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.stopping import EarlyStopping
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpointEndSave
from tests.helpers import MLP, classification_data, seeded_loader

# Best at epoch 1, then two epochs without improvement: patience 1 stops at epoch 3. A resumed EarlyStopping that
# forgot its count would see epochs 2.. improve and train all NUM_EPOCHS.
SCORES = [1.0, 0.8, 0.9, 0.85, 0.7, 0.6, 0.5, 0.4]
NUM_EPOCHS = len(SCORES)


class Script(AbstractCallback):
    """Records the epochs trained by this process, the scripted score, and dies where told."""

    def __init__(self):
        super().__init__("script", execution_order=-10)
        self.trained_epochs = []

    def on_epoch_begin(self):
        if self.train_loop_obj.epoch == int(os.environ.get("DIE_AT_EPOCH", "-1")):
            os._exit(3)  # preempted: the process ends at once, as under SIGKILL
        self.trained_epochs.append(self.train_loop_obj.epoch)

    def on_epoch_end(self):
        self.train_loop_obj.insert_metric_result_into_history("val_score", SCORES[self.train_loop_obj.epoch])


def main(results_folder: str) -> dict:
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoopCheckpointEndSave(
        model, seeded_loader(classification_data(40)), seeded_loader(classification_data(16, seed=20), shuffle=False),
        None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), "proj", "exp", results_folder,
        hyperparams={"lr": 0.1}, auto_resume=True, show_progress=False)
    script = Script()
    tl.fit(num_epochs=NUM_EPOCHS, callbacks=[script, EarlyStopping("val_score", patience=1, mode="min")])
    return {"trained_epochs": script.trained_epochs, "epoch": tl.epoch, "early_stop": bool(tl.early_stop),
            "folder": tl.experiment_folder.path}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
