"""aitoolbox 1.8's key layout, and listing / finding / downloading checkpoints in a bucket (incomplete folders
skipped)."""
import os

import pytest

from aitoolbox.cloud.layout import (
    ExperimentKeys, download_checkpoint, find_newest_cloud_checkpoint, list_cloud_checkpoints)
from aitoolbox.cloud.storage import FOLDER_MARKER, CloudNotFoundError

RUN = "proj/exp_2026-01-02_03-04-05"
NAME = "model_exp_2026-01-02_03-04-05"


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def test_the_keys_of_aitoolbox_1_8():
    keys = ExperimentKeys("", "proj", "exp", "2026-01-02_03-04-05")
    assert keys.experiment == RUN
    assert keys.checkpoint(f"{NAME}_E3.pth") == f"{RUN}/checkpoint_model/{NAME}_E3.pth"
    assert keys.final_model(f"{NAME}.pth") == f"{RUN}/model/{NAME}.pth"
    assert keys.model(f"{NAME}.pth", checkpoint_model=False) == f"{RUN}/model/{NAME}.pth"
    assert keys.results("plots/loss.png") == f"{RUN}/results/plots/loss.png"
    assert keys.experiment_file("hyperparams_list.txt") == f"{RUN}/hyperparams_list.txt"
    prefixed = ExperimentKeys("team/experiments", "proj", "exp", "2026-01-02_03-04-05")
    assert prefixed.checkpoint("m.pth") == f"team/experiments/{RUN}/checkpoint_model/m.pth"
    assert ExperimentKeys("team/", "proj", "exp", "ts").experiment == "team/proj/exp_ts"


def test_a_local_path_maps_to_the_same_place_in_the_bucket(tmp_path):
    keys = ExperimentKeys("prefix", "proj", "exp", "ts")
    run = tmp_path / "proj" / "exp_ts"
    assert keys.for_local_path(str(run / "tensorboard" / "proj_exp" / "events.1"), str(run)) == \
        "prefix/proj/exp_ts/tensorboard/proj_exp/events.1"
    assert keys.for_local_path(str(run / "results" / "plots"), str(run)) == "prefix/proj/exp_ts/results/plots"
    with pytest.raises(ValueError, match="is not inside the experiment folder"):
        keys.for_local_path(str(tmp_path / "elsewhere.txt"), str(run))
    with pytest.raises(ValueError, match="experiment_timestamp must be a non-empty string"):
        ExperimentKeys("", "proj", "exp", "")


def upload_checkpoints(bucket, tmp_path):
    """E1, E2_ITER7, E2 files, a complete sharded E3 folder, an interrupted E4 folder, stray files."""
    folder = f"{RUN}/checkpoint_model"
    for name in (f"{NAME}_E1.pth", f"{NAME}_E2_ITER7.pth", f"{NAME}_E2.pth", "notes.txt", f".tmp-{NAME}_E9.pth"):
        bucket.upload_bytes(name.encode(), f"{folder}/{name}")
    sharded = tmp_path / f"{NAME}_E3"
    write(sharded / ".metadata", b"meta")
    write(sharded / "__0_0.distcp", b"shards")
    write(sharded / "checkpoint.json", b"{}")
    bucket.upload_folder(str(sharded), f"{folder}/{NAME}_E3")
    bucket.upload_folder(str(sharded), f"{folder}/{NAME}_E4", complete_marker=False)  # cut off before its marker
    return folder


def test_listing_skips_folders_without_their_marker_and_orders_by_training_progress(bucket, tmp_path):
    folder = upload_checkpoints(bucket, tmp_path)
    assert list_cloud_checkpoints(bucket, folder) == [
        f"{folder}/{NAME}_E1.pth", f"{folder}/{NAME}_E2_ITER7.pth", f"{folder}/{NAME}_E2.pth", f"{folder}/{NAME}_E3"]
    assert find_newest_cloud_checkpoint(bucket, folder) == f"{folder}/{NAME}_E3"
    assert find_newest_cloud_checkpoint(bucket, RUN) == f"{folder}/{NAME}_E3"  # from the run's key too

    bucket.delete(f"{folder}/{NAME}_E3/__0_0.distcp")  # a file its marker lists is gone: not complete
    assert find_newest_cloud_checkpoint(bucket, RUN + "/") == f"{folder}/{NAME}_E2.pth"

    bucket.upload_bytes(b"final", f"{folder}/{NAME}.pth")  # a final model comes after every checkpoint
    assert list_cloud_checkpoints(bucket, folder)[-1] == f"{folder}/{NAME}.pth"


def test_no_complete_checkpoint_names_bucket_and_prefix(bucket, tmp_path):
    sharded = tmp_path / f"{NAME}_E1"
    write(sharded / "__0_0.distcp", b"shards")
    bucket.upload_folder(str(sharded), f"{RUN}/checkpoint_model/{NAME}_E1", complete_marker=False)
    with pytest.raises(CloudNotFoundError) as raised:
        find_newest_cloud_checkpoint(bucket, RUN)
    assert raised.value.bucket == bucket.bucket_name and raised.value.key == RUN
    assert bucket.bucket_name in str(raised.value) and RUN in str(raised.value)


def test_download_checkpoint_fetches_a_file_or_a_complete_folder(bucket, tmp_path):
    folder = upload_checkpoints(bucket, tmp_path / "upload")
    local_folder = tmp_path / "download" / "checkpoint_model"
    path = download_checkpoint(bucket, f"{folder}/{NAME}_E2.pth", str(local_folder))
    assert path == str(local_folder / f"{NAME}_E2.pth")
    with open(path, "rb") as handle:
        assert handle.read() == f"{NAME}_E2.pth".encode()

    path = download_checkpoint(bucket, f"{folder}/{NAME}_E3", str(local_folder))
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "checkpoint.json"]
    assert FOLDER_MARKER not in os.listdir(path)
    with pytest.raises(CloudNotFoundError, match="not a complete folder"):
        download_checkpoint(bucket, f"{folder}/{NAME}_E4", str(local_folder))
    assert sorted(os.listdir(local_folder)) == [f"{NAME}_E2.pth", f"{NAME}_E3"]
