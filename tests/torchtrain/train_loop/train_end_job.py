"""A job for test_lost_train_end.py: a TrainLoopCheckpointEndSave run of a tiny model with a test set, in a process of
its own (``python -m tests.torchtrain.train_loop.train_end_job <root> <num_epochs> <mode> [checkpoint]``).

Modes: ``run`` (``auto_resume=True``: a new run, or the newest run's newest checkpoint continued), ``kill`` (as run,
and the process SIGKILLs itself in ``on_before_train_end``: after the last epoch's checkpoint, before its train end),
``load`` (a new run folder; ``load_checkpoint(<checkpoint>)`` first). Each ``on_train_end`` adds a line to
``<root>/ends.txt``; the history goes to ``<root>/history.json``.
"""
import json
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpointEndSave
from tests.helpers import MLP, classification_data


class CountsEnds(AbstractCallback):
    def __init__(self, root):
        super().__init__("counts train ends")
        self.root = root

    def on_train_end(self):
        with open(os.path.join(self.root, "ends.txt"), "a") as handle:
            handle.write(f"{self.train_loop_obj.epochs_completed}\n")


class KillsBeforeTheEnd(AbstractCallback):
    def __init__(self):
        super().__init__("SIGKILL before the train end")

    def on_before_train_end(self):
        os.kill(os.getpid(), signal.SIGKILL)


def main(root, num_epochs, mode, checkpoint=None):
    torch.manual_seed(0)
    model, data = MLP(hidden=8), classification_data(24)
    train = DataLoader(Subset(data, range(16)), batch_size=4)
    test = DataLoader(Subset(data, range(16, 24)), batch_size=4)
    tl = TrainLoopCheckpointEndSave(model, train, None, test, torch.optim.SGD(model.parameters(), lr=0.1),
                                    nn.CrossEntropyLoss(), "proj", "exp", root, {}, auto_resume=mode != "load",
                                    show_progress=False)
    if checkpoint is not None:
        tl.load_checkpoint(checkpoint)
    callbacks = [CountsEnds(root)] + ([KillsBeforeTheEnd()] if mode == "kill" else [])
    tl.fit(num_epochs=num_epochs, callbacks=callbacks)
    with open(os.path.join(root, "history.json"), "w") as handle:
        json.dump({"history": tl.train_history.get_train_history_dict(), "epochs": tl.epochs_completed}, handle)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
