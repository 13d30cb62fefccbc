"""aitoolbox 1.8's cloud classes at their 1.8 import paths: the savers write locally and upload under 1.8's
keys; the loaders download a checkpoint uploaded under those keys and load it into a model."""
import importlib.util
import os

import pytest
import torch
from torch import nn

from aitoolbox.cloud.storage import CloudNotFoundError
from aitoolbox.cloud.uploader import CloudUploader
from tests.cloud.buckets import create_bucket, gcs_client, make_storage, unique_bucket_name

TIMESTAMP = "2026-01-02_03-04-05"
RUN = f"team/proj/exp_{TIMESTAMP}"


def checkpoint(seed: int = 0, epoch: int = 3) -> tuple:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                              "schedulers_state_dict": [], "epoch": epoch, "iteration_idx": 29,
                              "hyperparams": {"lr": 0.1}}


def saver_classes(service):
    if service == "s3":
        from aitoolbox.cloud.AWS.model_save import PyTorchS3ModelSaver
        from aitoolbox.cloud.AWS.results_save import S3ResultsSaver
        return PyTorchS3ModelSaver, S3ResultsSaver
    from aitoolbox.cloud.GoogleCloud.model_save import PyTorchGoogleStorageModelSaver
    from aitoolbox.cloud.GoogleCloud.results_save import GoogleStorageResultsSaver
    return PyTorchGoogleStorageModelSaver, GoogleStorageResultsSaver


def loader_class(service):
    if service == "s3":
        from aitoolbox.cloud.AWS.model_load import PyTorchS3ModelLoader
        return PyTorchS3ModelLoader
    from aitoolbox.cloud.GoogleCloud.model_load import PyTorchGoogleStorageModelLoader
    return PyTorchGoogleStorageModelLoader


def upload_with_the_services_client(service, bucket_name, local_path, key):
    """Upload as aitoolbox 1.8 did, with the service's own client (not the code under test)."""
    if service == "s3":
        import boto3
        boto3.session.Session().client("s3").upload_file(local_path, bucket_name, key)
    else:
        gcs_client().bucket(bucket_name).blob(key).upload_from_filename(local_path)


def test_the_1_8_loader_loads_a_checkpoint_uploaded_under_1_8s_layout(service, bucket, tmp_path):
    model, optimizer, state = checkpoint()
    name = f"model_exp_{TIMESTAMP}_E3.pth"
    torch.save(state, tmp_path / name)
    upload_with_the_services_client(service, bucket.bucket_name, str(tmp_path / name),
                                    f"{RUN}/checkpoint_model/{name}")

    loader = loader_class(service)(str(tmp_path / "elsewhere"), bucket.bucket_name, "team")
    loaded = loader.load_model("proj", "exp", TIMESTAMP, "checkpoint_model", epoch_num=3)
    assert loaded["epoch"] == 3 and loaded["hyperparams"] == {"lr": 0.1}
    assert os.path.isfile(tmp_path / "elsewhere" / "proj" / f"exp_{TIMESTAMP}" / "checkpoint_model" / name)

    fresh = nn.Linear(4, 2)
    loader.init_model(fresh)
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in model.state_dict().items())
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    loader.init_optimizer(fresh_optimizer, device="cpu")
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    assert loader.init_scheduler([], ignore_saved=True) == []


def test_the_1_8_savers_upload_under_1_8s_keys_and_keep_the_local_files(service, bucket, tmp_path):
    model_saver_class, results_saver_class = saver_classes(service)
    local_root = str(tmp_path / "model_result")
    saver = model_saver_class(bucket.bucket_name, "team", local_root, checkpoint_model=True)
    assert type(saver.storage) is type(bucket)
    _, _, state = checkpoint()
    cloud_path, timestamp, local_path = saver.save_model(state, "proj", "exp", TIMESTAMP, epoch=3)
    key = f"{RUN}/checkpoint_model/model_exp_{TIMESTAMP}_E3.pth"
    assert (cloud_path, timestamp) == (f"{bucket.bucket_name}/{key}", TIMESTAMP)
    assert local_path == os.path.join(local_root, "proj", f"exp_{TIMESTAMP}", "checkpoint_model",
                                      f"model_exp_{TIMESTAMP}_E3.pth")
    assert os.path.isfile(local_path) and bucket.exists(key)

    final_saver = model_saver_class(bucket.bucket_name, "team", local_root)
    cloud_path, _, _ = final_saver.save_model(state, "proj", "exp", TIMESTAMP)
    assert cloud_path == f"{bucket.bucket_name}/{RUN}/model/model_exp_{TIMESTAMP}.pth"
    with pytest.raises(ValueError, match="lacks"):
        final_saver.save_model({"model_state_dict": {}}, "proj", "exp", TIMESTAMP)

    results_saver = results_saver_class(bucket.bucket_name, "team", local_root)
    main_path, timestamp = results_saver.save_experiment_results(
        ResultPackage(), {"loss": [3.0, 2.0, 1.0]}, "proj", "exp", TIMESTAMP, separate_files=True)
    results = f"{RUN}/results"
    assert main_path == f"{bucket.bucket_name}/{results}/results_exp_{TIMESTAMP}.json"
    uploaded = {obj.key for obj in bucket.list(results + "/")}
    assert {f"{results}/results_exp_{TIMESTAMP}.json", f"{results}/hyperparams_exp_{TIMESTAMP}.json",
            f"{results}/train_history_exp_{TIMESTAMP}.json"} <= uploaded
    if _has_matplotlib():
        assert f"{results}/plots/loss.png" in uploaded


class ResultPackage:
    """The parts of a result package the results savers read."""
    y_true, y_predicted = [1, 0], [1, 1]

    def get_results(self):
        return {"accuracy": 0.5}

    def get_hyperparameters(self):
        return {"lr": 0.1}

    def get_additional_results_dump_paths(self):
        return []


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_the_savers_upload_in_the_background_through_an_uploader(service, bucket, tmp_path):
    model_saver_class, _ = saver_classes(service)
    uploader = CloudUploader(bucket)
    saver = model_saver_class(bucket.bucket_name, "", str(tmp_path), checkpoint_model=True, uploader=uploader)
    _, _, state = checkpoint()
    saver.save_model(state, "proj", "exp", TIMESTAMP, epoch=1)
    uploader.close()
    assert bucket.exists(f"proj/exp_{TIMESTAMP}/checkpoint_model/model_exp_{TIMESTAMP}_E1.pth")
    with pytest.raises(ValueError, match="writes to the bucket"):
        model_saver_class("another-bucket", uploader=CloudUploader(bucket))


def test_a_model_saved_by_the_1_8_saver_comes_back_through_the_1_8_loader(service, bucket, tmp_path):
    model_saver_class, _ = saver_classes(service)
    model, _, state = checkpoint(seed=5, epoch=2)
    model_saver_class(bucket.bucket_name, "", str(tmp_path / "a")).save_model(state, "proj", "exp", TIMESTAMP)
    loader = loader_class(service)(str(tmp_path / "b"), bucket.bucket_name, "")
    loaded = loader.load_model("proj", "exp", TIMESTAMP, model_save_dir="model", epoch_num=None)
    assert loaded["epoch"] == 2
    fresh = loader.init_model(nn.Linear(4, 2))
    assert torch.equal(fresh.weight, model.weight)


def test_load_newest_checkpoint_resumes_from_the_bucket(service, bucket, tmp_path):
    model_saver_class, _ = saver_classes(service)
    saver = model_saver_class(bucket.bucket_name, "team", str(tmp_path / "a"), checkpoint_model=True)
    for epoch in (1, 2, 3):
        newest, _, state = checkpoint(seed=epoch, epoch=epoch)
        saver.save_model(state, "proj", "exp", TIMESTAMP, epoch=epoch)
    loader = loader_class(service)(str(tmp_path / "b"), bucket.bucket_name, "team")
    assert loader.load_newest_checkpoint("proj", "exp", TIMESTAMP)["epoch"] == 3
    assert torch.equal(loader.init_model(nn.Linear(4, 2)).weight, newest.weight)
    assert os.path.isfile(tmp_path / "b" / "proj" / f"exp_{TIMESTAMP}" / "checkpoint_model" /
                          f"model_exp_{TIMESTAMP}_E3.pth")


def test_the_loader_loads_a_sharded_checkpoint_folder_once_complete(service, bucket, tmp_path):
    from aitoolbox.experiment.local_save.sharded_checkpoints import (
        consolidate_sharded_checkpoint, save_sharded_checkpoint)
    model, optimizer, _ = checkpoint(seed=7)
    name = f"model_exp_{TIMESTAMP}_E4"
    save_sharded_checkpoint(str(tmp_path / name), model, optimizer, {"epoch": 4}).wait()
    bucket.upload_folder(str(tmp_path / name), f"{RUN}/checkpoint_model/{name}")

    loader = loader_class(service)(str(tmp_path / "b"), bucket.bucket_name, "team")
    loaded = loader.load_model("proj", "exp", TIMESTAMP, "checkpoint_model", epoch_num=4)
    assert loaded["epoch"] == 4
    folder = tmp_path / "b" / "proj" / f"exp_{TIMESTAMP}" / "checkpoint_model" / name
    consolidated = torch.load(consolidate_sharded_checkpoint(str(folder), str(tmp_path / "full.pth")))
    weights = consolidated.get("model_state_dict", consolidated)
    assert torch.equal(weights["weight"], model.weight)


def test_the_loader_names_a_missing_bucket_and_a_missing_model(service, tmp_path):
    loader = loader_class(service)(str(tmp_path), "aitoolbox-no-such-bucket", "")
    with pytest.raises(CloudNotFoundError, match="aitoolbox-no-such-bucket"):
        loader.load_model("proj", "exp", TIMESTAMP, epoch_num=1)
    name = unique_bucket_name(service)
    create_bucket(service, name)
    loader = loader_class(service)(str(tmp_path), name, "")
    with pytest.raises(CloudNotFoundError) as raised:
        loader.load_model("proj", "exp", TIMESTAMP, epoch_num=1)
    assert raised.value.key == f"proj/exp_{TIMESTAMP}/checkpoint_model/model_exp_{TIMESTAMP}_E1.pth"


def test_data_saver_and_loader_of_1_8(service, bucket, tmp_path):
    if service == "s3":
        from aitoolbox.cloud.AWS.data_access import BaseDataLoader as Loader
        from aitoolbox.cloud.AWS.data_access import BaseDataSaver as Saver
    else:
        from aitoolbox.cloud.GoogleCloud.data_access import BaseGoogleStorageDataLoader as Loader
        from aitoolbox.cloud.GoogleCloud.data_access import BaseGoogleStorageDataSaver as Saver
    data = tmp_path / "data" / "squad"
    (data / "sub").mkdir(parents=True)
    (data / "train.json").write_bytes(b"train")
    (data / "sub" / "dev.json").write_bytes(b"dev")
    saver = Saver(bucket.bucket_name)
    saver.save_file(str(data / "train.json"), "datasets/train.json")
    saver.save_folder(str(data), "datasets/squad")
    assert bucket.is_complete_folder("datasets/squad") and bucket.exists("datasets/squad/sub/dev.json")

    loader = Loader(bucket.bucket_name, str(tmp_path / "local"))
    target = tmp_path / "local" / "train.json"
    assert loader.load_file("datasets/train.json", str(target)) == str(target)
    assert target.read_bytes() == b"train"
    bucket.upload_bytes(b"changed", "datasets/train.json")
    loader.load_file("datasets/train.json", str(target))
    assert target.read_bytes() == b"train"  # already on the local disk: not downloaded again
    folder = loader.load_folder("datasets/squad", str(tmp_path / "local" / "squad"))
    assert (tmp_path / "local" / "squad" / "sub" / "dev.json").read_bytes() == b"dev" and folder.endswith("squad")


def test_the_s3_data_loader_keeps_1_8s_data_folder_helpers(s3_env, tmp_path):
    from aitoolbox.cloud.AWS.data_access import BaseDataLoader
    loader = BaseDataLoader("any-bucket", str(tmp_path))
    assert loader.exists_local_data_folder("squad") is False and os.path.isdir(tmp_path / "squad")
    (tmp_path / "squad" / "file").write_text("kept")
    assert loader.exists_local_data_folder("squad") is True and (tmp_path / "squad" / "file").exists()
    assert loader.exists_local_data_folder("squad", protect_local_folder=False) is False
    assert os.listdir(tmp_path / "squad") == []
    loader.available_prepocessed_datasets.append("squad_v1")
    assert loader.preproc_dataset_available("squad_v1") and not loader.preproc_dataset_available("other")


def test_a_local_loader_that_is_not_one_is_refused(s3_env, tmp_path):
    from aitoolbox.cloud.AWS.model_load import BaseModelLoader
    with pytest.raises(TypeError, match="must be an AbstractLocalModelLoader"):
        BaseModelLoader(object(), str(tmp_path), "bucket-name")


def test_storage_is_built_from_the_environment(service, bucket):
    # the bucket fixture's storage was built with no endpoint argument: the environment pointed it at the server
    assert make_storage(service, bucket.bucket_name).list() == []
