"""A bucket other people can write to: nothing read from it runs code or lands outside the download folder.

Against moto's S3 server and the GCS emulator: a checkpoint planted in the bucket whose ``__reduce__`` calls
``os.system`` is refused by the cloud loaders, ModelLoadContinueTraining and ``auto_resume`` (the marker file
the command would create never appears); a folder marker listing ``..`` or absolute names is refused before
anything is downloaded; a symbolic link in the local folder does not lead a download outside it.
"""
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.cloud.folders import FOLDER_MARKER, FOLDER_MARKER_FORMAT, local_path_inside
from aitoolbox.cloud.layout import download_checkpoint
from aitoolbox.cloud.storage import join_key
from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.cloud.test_1x_classes import loader_class
from tests.helpers import MLP, classification_data

PREFIX, PROJECT, EXPERIMENT, TIMESTAMP = "team", "proj", "exp", "2024-01-02_03-04-05"
RUN_KEY = f"{PREFIX}/{PROJECT}/{EXPERIMENT}_{TIMESTAMP}"
CHECKPOINT_NAME = f"model_{EXPERIMENT}_{TIMESTAMP}_E1.pth"


class PlantedPayload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def planted(bucket, tmp_path):
    """A checkpoint carrying :class:`PlantedPayload` in the bucket, where a run's checkpoint of epoch 1 goes."""
    marker = tmp_path / "code-was-run"
    local = tmp_path / "planted.pth"
    torch.save({"model_state_dict": MLP().state_dict(), "optimizer_state_dict": {}, "epoch": 1,
                "hyperparams": {"payload": PlantedPayload(str(marker))}}, str(local))
    bucket.upload_file(str(local), f"{RUN_KEY}/checkpoint_model/{CHECKPOINT_NAME}")
    return marker


def assert_refused(error_info, marker):
    message = str(error_info.value)
    assert CHECKPOINT_NAME in message and "posix.system" in message and "weights_only=False" in message
    assert not marker.exists()


def small_loop(cls=TrainLoop, *args, **kwargs):
    model = MLP()
    return cls(model, DataLoader(classification_data(8), batch_size=4), None, None,
               torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), *args, show_progress=False,
               **kwargs)


def test_the_cloud_loaders_refuse_a_planted_checkpoint(service, bucket, planted, tmp_path):
    root = str(tmp_path / "results")
    loader = loader_class(service)(root, bucket.bucket_name, PREFIX)
    with pytest.raises(UntrustedCheckpointError) as refused:
        loader.load_model(PROJECT, EXPERIMENT, TIMESTAMP, "checkpoint_model", 1)
    assert_refused(refused, planted)
    with pytest.raises(UntrustedCheckpointError) as refused:
        loader.load_newest_checkpoint(PROJECT, EXPERIMENT, TIMESTAMP)
    assert_refused(refused, planted)


def test_model_load_continue_training_from_a_bucket_refuses_a_planted_checkpoint(service, bucket, planted, tmp_path):
    callback = ModelLoadContinueTraining(TIMESTAMP, project_name=PROJECT, experiment_name=EXPERIMENT,
                                         local_model_result_folder_path=str(tmp_path / "results"),
                                         cloud_save_mode=service, bucket_name=bucket.bucket_name,
                                         cloud_dir_prefix=PREFIX)
    loop = small_loop()
    with pytest.raises(UntrustedCheckpointError) as refused:
        loop.callbacks_handler.register_callbacks([callback])
    assert_refused(refused, planted)


def test_auto_resume_from_a_bucket_stops_at_a_planted_checkpoint(service, bucket, planted, tmp_path):
    root = tmp_path / "results"
    with pytest.raises(UntrustedCheckpointError) as refused:
        small_loop(TrainLoopCheckpoint, PROJECT, EXPERIMENT, str(root), {}, auto_resume=True,
                   cloud_save_mode=service, bucket_name=bucket.bucket_name, cloud_dir_prefix=PREFIX)
    assert_refused(refused, planted)
    # It stopped: no new run was started beside the one it was to continue (only that run's download is there).
    assert os.listdir(root / PROJECT) == [f"{EXPERIMENT}_{TIMESTAMP}"]


def upload_marker(bucket, folder_key, files):
    manifest = {"format": FOLDER_MARKER_FORMAT, "version": 1, "files": files}
    bucket.upload_bytes(json.dumps(manifest).encode("utf-8"), join_key(folder_key, FOLDER_MARKER))


def every_file_below(folder):
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


@pytest.mark.parametrize("name", ["../../../escaped.txt", "inside/../../../escaped.txt", "ABSOLUTE"])
def test_a_folder_marker_naming_files_outside_the_folder_is_refused(service, bucket, tmp_path, name):
    escaped = tmp_path / "escaped.txt"
    if name == "ABSOLUTE":
        name = str(escaped)
    folder_key = f"{RUN_KEY}/checkpoint_model/model_{EXPERIMENT}_{TIMESTAMP}_E1"
    upload_marker(bucket, folder_key, {"ok.txt": 2, name: 4})
    bucket.upload_bytes(b"ok", join_key(folder_key, "ok.txt"))
    if service == "s3":  # moto stores keys holding '..' as they are (the GCS emulator cannot): the attack works
        bucket.upload_bytes(b"evil", join_key(folder_key, name))
    local_folder = tmp_path / "a" / "b" / "c" / "download"
    with pytest.raises(ValueError, match="refused") as refused:
        bucket.download_folder(folder_key, str(local_folder))
    assert repr(name) in str(refused.value) and FOLDER_MARKER in str(refused.value)
    assert not escaped.exists()
    assert every_file_below(tmp_path) == []  # nothing written anywhere, no temporary folder left


def test_a_sharded_checkpoint_whose_marker_climbs_out_is_not_downloaded_by_the_loaders(service, bucket, tmp_path):
    folder_key = f"{RUN_KEY}/checkpoint_model/model_{EXPERIMENT}_{TIMESTAMP}_E1"
    upload_marker(bucket, folder_key, {"../../../../escaped.txt": 4})
    if service == "s3":
        bucket.upload_bytes(b"evil", join_key(folder_key, "../../../../escaped.txt"))
    loader = loader_class(service)(str(tmp_path / "results"), bucket.bucket_name, PREFIX)
    with pytest.raises(ValueError, match="refused"):
        loader.load_model(PROJECT, EXPERIMENT, TIMESTAMP, "checkpoint_model", 1)
    assert not any("escaped" in path for path in every_file_below(tmp_path))


def test_a_symlink_in_the_local_folder_does_not_lead_a_download_outside(service, bucket, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / CHECKPOINT_NAME).write_bytes(b"the user's own file")
    local_folder = tmp_path / "checkpoint_model"
    local_folder.mkdir()
    (local_folder / CHECKPOINT_NAME).symlink_to(outside / CHECKPOINT_NAME)
    (local_folder / "shards").symlink_to(outside, target_is_directory=True)
    key = f"{RUN_KEY}/checkpoint_model/{CHECKPOINT_NAME}"
    bucket.upload_bytes(b"downloaded", key)
    with pytest.raises(ValueError, match="symbolic link"):
        download_checkpoint(bucket, key, str(local_folder))
    with pytest.raises(ValueError, match="symbolic link"):
        local_path_inside(str(local_folder), "shards/escaped.txt", "a marker")
    assert (outside / CHECKPOINT_NAME).read_bytes() == b"the user's own file"
    assert os.listdir(outside) == [CHECKPOINT_NAME]


def test_a_listed_key_ending_in_dots_is_not_joined_onto_the_local_folder(bucket, tmp_path):
    with pytest.raises(ValueError, match="'..'"):
        download_checkpoint(bucket, f"{RUN_KEY}/checkpoint_model/..", str(tmp_path / "checkpoint_model"))
    assert every_file_below(tmp_path) == []
