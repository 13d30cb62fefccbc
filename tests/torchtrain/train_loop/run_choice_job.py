"""One job (or one node's launcher of a job) of the run-choice tests: a TrainLoopCheckpoint trained with
``fit_distributed`` on CPU processes, started as ``python run_choice_job.py '<json options>'``.

Options: root, num_epochs, auto_resume, lazy, hyperparams, num_nodes, node_rank, port, processes, gpu_mode,
go_file (with jobs started in the same second: the job creates ``<go_file>.<out name>.ready`` once it is
imported, then waits for ``go_file``, which holds the time.time() second at which to build the preset),
iteration_save_freq, out (where the result is saved), timeout_s.
"""
import json
import logging
import os
import sys
import time

import torch

from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.torchtrain.distributed.support import make_model, regression_data
from torch import nn
from torch.utils.data import DataLoader


def main(options: dict) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    train = DataLoader(regression_data(32), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    model = make_model()
    go_file = options.get("go_file")
    if go_file:
        open(f"{go_file}.{os.path.basename(options['out'])}.ready", "w").close()
        while not os.path.exists(go_file):
            time.sleep(0.01)
        with open(go_file) as handle:
            start_at = float(handle.read())
        time.sleep(max(0.0, start_at - time.time()))
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
