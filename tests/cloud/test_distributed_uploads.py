"""Uploads under fit_distributed (2 CPU processes over gloo, against moto's S3 server): only rank 0 uploads, and a
sharded (``gpu_mode='fsdp'``) checkpoint goes up as a folder with its completion marker and resumes from the
bucket. The bucket keeps every version of an object, so a second upload of any file would show."""
import collections
import copy
import os
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.cloud.folders import FOLDER_MARKER
from aitoolbox.cloud.layout import list_cloud_checkpoints
from aitoolbox.experiment.local_save.sharded_checkpoints import MARKER_FILE
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.cloud.buckets import create_bucket, make_storage, unique_bucket_name
from tests.torchtrain.distributed.support import make_model, regression_data

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")


def versioned_bucket() -> str:
    import boto3
    name = unique_bucket_name("s3")
    create_bucket("s3", name)
    boto3.session.Session().client("s3").put_bucket_versioning(
        Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


def upload_counts(bucket_name: str) -> collections.Counter:
    """How many times each key was written."""
    import boto3
    versions = boto3.session.Session().client("s3").list_object_versions(Bucket=bucket_name).get("Versions", [])
    return collections.Counter(version["Key"] for version in versions)


def loaders():
    return (DataLoader(regression_data(32), batch_size=4), DataLoader(regression_data(35, seed=1), batch_size=4),
            DataLoader(regression_data(35, seed=2), batch_size=4))


def test_fit_distributed_uploads_from_rank_0_only(s3_env, tmp_path):
    bucket_name = versioned_bucket()
    model = make_model()
    tl = TrainLoopCheckpoint(model, *loaders(), torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), "proj",
                             "ddp", str(tmp_path), {"lr": 0.1}, cloud_save_mode="s3", bucket_name=bucket_name,
                             gpu_mode="ddp", show_progress=False)
    tl.fit_distributed(num_epochs=2, num_cpu_processes=2, start_method="fork")

    run_key = f"proj/ddp_{tl.experiment_timestamp}"
    counts = upload_counts(bucket_name)
    assert {f"{run_key}/checkpoint_model/model_ddp_{tl.experiment_timestamp}_E{epoch}.pth" for epoch in (0, 1)} \
        | {f"{run_key}/hyperparams_list.txt"} <= set(counts)
    assert set(counts.values()) == {1}  # each file once: rank 1 uploaded nothing
    local = os.path.join(tl.experiment_folder.checkpoint_dir, f"model_ddp_{tl.experiment_timestamp}_E1.pth")
    with open(local, "rb") as handle:
        assert make_storage("s3", bucket_name).download_bytes(
            f"{run_key}/checkpoint_model/model_ddp_{tl.experiment_timestamp}_E1.pth") == handle.read()


def fsdp_loop(model) -> TrainLoop:
    return TrainLoop(model, *loaders(), torch.optim.AdamW(model.parameters(), lr=1e-2), nn.MSELoss(),
                     gpu_mode="fsdp", show_progress=False)


def fit_fsdp(tl, num_epochs, callbacks=()):
    tl.fit_distributed(num_epochs=num_epochs, callbacks=list(callbacks), train_data_shuffle=False, num_gpus=2,
                       start_method="fork", fsdp_model_args={"shard_modules": [nn.Linear]})


def test_a_sharded_checkpoint_uploads_as_a_complete_folder_and_resumes_from_the_bucket_bitwise(s3_env, tmp_path):
    bucket_name = versioned_bucket()
    storage = make_storage("s3", bucket_name)
    initial = make_model()
    straight = fsdp_loop(copy.deepcopy(initial))
    fit_fsdp(straight, 3)

    stopped = fsdp_loop(copy.deepcopy(initial))
    fit_fsdp(stopped, 2, [ModelCheckpoint(project_name="proj", experiment_name="fsdp",
                                          local_model_result_folder_path=str(tmp_path / "machine_1"),
                                          cloud_save_mode="s3", bucket_name=bucket_name, cloud_dir_prefix="team")])
    (run,) = os.listdir(tmp_path / "machine_1" / "proj")
    timestamp = run[len("fsdp_"):]
    checkpoint_dir = f"team/proj/{run}/checkpoint_model"
    saved = list_cloud_checkpoints(storage, checkpoint_dir)
    assert saved == [f"{checkpoint_dir}/model_fsdp_{timestamp}_E{epoch}" for epoch in (0, 1)]
    local_folder = tmp_path / "machine_1" / "proj" / run / "checkpoint_model" / f"model_fsdp_{timestamp}_E1"
    manifest = storage.folder_manifest(saved[-1])
    assert MARKER_FILE in manifest and manifest == {
        os.path.relpath(os.path.join(root, name), local_folder).replace(os.sep, "/"): os.path.getsize(
            os.path.join(root, name)) for root, _, names in os.walk(local_folder) for name in names}
    assert set(upload_counts(bucket_name).values()) == {1}  # every shard went up once, from rank 0
    assert f"{saved[-1]}/{FOLDER_MARKER}" in upload_counts(bucket_name)
    shutil.rmtree(tmp_path / "machine_1")

    resumed = fsdp_loop(make_model(seed=7))  # other weights: only the checkpoint's make it train like straight
    resumed.callbacks_handler.register_callbacks([ModelLoadContinueTraining(
        timestamp, project_name="proj", experiment_name="fsdp",
        local_model_result_folder_path=str(tmp_path / "machine_2"), cloud_save_mode="s3", bucket_name=bucket_name,
        cloud_dir_prefix="team")])
    fit_fsdp(resumed, 3)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert resumed.train_history == straight.train_history
