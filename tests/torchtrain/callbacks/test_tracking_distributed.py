"""The tracking callbacks under fit_distributed (2 CPU processes over gloo): only rank 0 logs.

The CSV and W&B callbacks are passed to ``fit_distributed`` (registered in rank 0 only, by
``device_idx_execution``); the MLflow callback is registered before it, so it travels to both ranks and must
keep quiet in rank 1 by itself. Each rank records its own batch losses, which differ, to tell whose were logged.
"""
import csv
import json
import os

import pytest

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.csv_logger import CSVLogger
from aitoolbox.torchtrain.callbacks.mlflow import MLflowTracking
from aitoolbox.torchtrain.callbacks.wandb import WandBTracking
from tests.torchtrain.callbacks import tracking_support as support
from tests.torchtrain.callbacks.tracking_support import WandbRun, offline_run_dirs
from tests.torchtrain.distributed.support import make_train_loop

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")
wandb_offline = support.wandb_offline

BATCHES_PER_EPOCH = 4  # 32 samples, 2 ranks, 4 per batch


class RecordRankLosses(AbstractCallback):
    """Writes ``<folder>/losses_rank<r>.json``: this rank's batch losses by global batch index."""

    def __init__(self, folder: str):
        super().__init__("record rank losses")
        self.folder = str(folder)
        self.losses = {}

    def on_batch_end(self):
        self.losses[self.train_loop_obj.total_iteration_idx] = self.train_loop_obj.last_batch_loss.item()

    def on_train_end(self):
        rank = self.train_loop_obj.strategy.rank
        with open(os.path.join(self.folder, f"losses_rank{rank}.json"), "w") as handle:
            json.dump(self.losses, handle)


def rank_losses(folder, rank: int) -> dict:
    with open(os.path.join(str(folder), f"losses_rank{rank}.json")) as handle:
        return {int(step): loss for step, loss in json.load(handle).items()}


def test_only_rank_0_logs(tmp_path, wandb_offline, monkeypatch):
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the processes inherit it
    tl = make_train_loop(shuffle=True)
    mlflow_callback = MLflowTracking(store, project_name="dist", experiment_name="ddp")
    tl.callbacks_handler.register_callbacks([mlflow_callback])  # before fit_distributed: in both ranks
    callbacks = [CSVLogger(log_dir=str(tmp_path / "csv"), is_project=False),
                 WandBTracking(batch_log_frequency=1, log_dir=str(tmp_path / "wandb"), is_project=False,
                               project_name="dist"),
                 RecordRankLosses(tmp_path)]
    tl.fit_distributed(num_epochs=2, callbacks=callbacks, num_cpu_processes=2, start_method="fork")

    rank0, rank1 = rank_losses(tmp_path, 0), rank_losses(tmp_path, 1)
    steps = list(range(2 * BATCHES_PER_EPOCH))
    assert sorted(rank0) == sorted(rank1) == steps and rank0 != rank1  # the ranks' losses tell them apart
    history = tl.train_history  # rank 0's, adopted by the launching process

    with open(tmp_path / "csv" / "batch_log.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["total_iteration"]) for row in rows] == steps
    assert [float(row["loss"]) for row in rows] == [rank0[step] for step in steps]
    with open(tmp_path / "csv" / "epoch_log.csv", newline="") as handle:
        epochs = list(csv.DictReader(handle))
    assert [float(row["accumulated_loss"]) for row in epochs] == history["accumulated_loss"]
    assert [float(row["val_loss"]) for row in epochs] == history["val_loss"]

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("dist").experiment_id])
    assert run.info.status == "FINISHED"
    logged = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id,
                                                                                 "train_loss/last_batch_loss")}
    assert logged == rank0
    assert [metric.value for metric in sorted(client.get_metric_history(run.info.run_id, "val_loss"),
                                              key=lambda metric: metric.step)] == history["val_loss"]

    (run_dir,) = offline_run_dirs(tmp_path / "wandb")
    assert WandbRun(run_dir).values("train_loss/last_batch_loss") == rank0
