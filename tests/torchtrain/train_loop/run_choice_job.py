"""One job (or one node's launcher of a job) of the run-choice tests: a TrainLoopCheckpoint trained with
``fit_distributed`` on CPU processes, started as ``python run_choice_job.py '<json options>'``.

Options: root, num_epochs, auto_resume, lazy, hyperparams, num_nodes, node_rank, port, processes, gpu_mode,
start_at (a time.time() second to wait for before building the preset: jobs started in the same second),
iteration_save_freq, out (where the result is saved), timeout_s.
"""
import json
import logging
import sys
import time

import torch

from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.torchtrain.distributed.support import make_model, regression_data
from torch import nn
from torch.utils.data import DataLoader


def main(options: dict) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if options.get("start_at"):
        time.sleep(max(0.0, options["start_at"] - time.time()))
    train = DataLoader(regression_data(32), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    model = make_model()
    tl = TrainLoopCheckpoint(
        model, train, None, None, torch.optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss(), "proj", "exp",
        options["root"], options.get("hyperparams", {}), auto_resume=options.get("auto_resume", False),
        lazy_experiment_save=options.get("lazy", False), gpu_mode=options.get("gpu_mode", "ddp"),
        iteration_save_freq=options.get("iteration_save_freq", 0), show_progress=False)
    tl.fit_distributed(num_epochs=options["num_epochs"], num_nodes=options.get("num_nodes", 1),
                       node_rank=options.get("node_rank", 0), master_addr="127.0.0.1",
                       master_port=options.get("port"), num_gpus=options.get("processes", 2), start_method="fork",
                       timeout_s=options.get("timeout_s", 120))
    torch.save({"state_dict": tl.model.state_dict(), "history": dict(tl.train_history), "epochs": tl.epochs_completed,
                "folder": tl.experiment_folder.path, "resumed_from": tl.resumed_from}, options["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
