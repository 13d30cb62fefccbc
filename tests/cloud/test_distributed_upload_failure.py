"""An upload that fails on rank 0 (the only rank that uploads) stops every rank of fit_distributed with the same
error at the end of training: the bucket is a closed port on 127.0.0.1, nothing listens there."""
import os
import socket

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint
from tests.cloud.buckets import FAST_RETRY
from tests.cloud.conftest import no_aws_metadata
from tests.torchtrain.distributed.support import make_model
from tests.torchtrain.distributed.test_checkpoint_outcome import RecordOutcome, outcomes
from tests.cloud.test_distributed_uploads import loaders

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections to it are refused


def test_an_upload_failing_on_rank_0_stops_every_rank_with_its_error(monkeypatch, tmp_path):
    no_aws_metadata(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    model = make_model()
    tl = TrainLoopCheckpoint(model, *loaders(), torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), "proj",
                             "ddp", str(tmp_path / "results"), {"lr": 0.1}, cloud_save_mode="s3", bucket_name="bucket",
                             cloud_storage_options={"endpoint_url": f"http://127.0.0.1:{closed_port()}",
                                                    "retry": FAST_RETRY},
                             gpu_mode="ddp", show_progress=False)
    with pytest.raises(Exception):
        tl.fit_distributed(num_epochs=1, callbacks=[RecordOutcome(str(tmp_path))], num_cpu_processes=2,
                           start_method="fork", timeout_s=120)
    rank_0, rank_1 = outcomes(tmp_path)
    # Before: rank 1 finished as if the checkpoint were in the bucket. Rank 0 raises the CloudStorageError itself.
    assert rank_1 == f"RuntimeError: {rank_0} (on rank 0)", (rank_0, rank_1)
    assert rank_0.startswith("CloudStorageError: ") and "'bucket'" in rank_0, rank_0
    # Every checkpoint is complete in the local folder, to upload again later.
    assert any(name.endswith("_E0.pth") for name in os.listdir(tl.experiment_folder.checkpoint_dir))
