"""aitoolbox 1.8's full experiment savers (``aitoolbox.experiment.experiment_saver``) and the hyperparameter
reporter's ``copy_to_cloud_storage`` against the local S3 and GCS servers: the files land locally and in the
bucket under 1.8's keys."""
import json
import os

import pytest
import torch
from torch import nn

from aitoolbox.cloud.storage import CloudStorageError
from aitoolbox.cloud.uploader import CloudUploader
from aitoolbox.experiment.experiment_saver import (
    BaseFullExperimentGoogleStorageSaver, BaseFullExperimentS3Saver, FullKerasExperimentGoogleStorageSaver,
    FullKerasExperimentS3Saver, FullPyTorchExperimentGoogleStorageSaver, FullPyTorchExperimentS3Saver)
from aitoolbox.experiment.result_reporting.hyperparam_reporter import HyperParamSourceReporter
from tests.cloud.test_1x_classes import ResultPackage

TIMESTAMP = "2026-01-02_03-04-05"
RUN = f"team/proj/exp_{TIMESTAMP}"


def saver_classes(service):
    """(PyTorch saver, Keras saver, base saver) of ``service``."""
    if service == "s3":
        return FullPyTorchExperimentS3Saver, FullKerasExperimentS3Saver, BaseFullExperimentS3Saver
    return (FullPyTorchExperimentGoogleStorageSaver, FullKerasExperimentGoogleStorageSaver,
            BaseFullExperimentGoogleStorageSaver)


def checkpoint_dict():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
                   "schedulers_state_dict": [], "epoch": 2, "hyperparams": {"lr": 0.1}}


def test_the_pytorch_saver_writes_locally_and_uploads_model_and_results(service, bucket, tmp_path):
    pytorch_saver_class, _, _ = saver_classes(service)
    local_root = tmp_path / "model_result"
    saver = pytorch_saver_class("proj", "exp", bucket.bucket_name, "team", str(local_root))
    model, state = checkpoint_dict()

    model_path, results_path = saver.save_experiment(state, ResultPackage(), {"loss": [2.0, 1.0]},
                                                     experiment_timestamp=TIMESTAMP, separate_files=True)
    model_key = f"{RUN}/model/model_exp_{TIMESTAMP}.pth"
    results_key = f"{RUN}/results/results_exp_{TIMESTAMP}.json"
    assert (model_path, results_path) == (f"{bucket.bucket_name}/{model_key}", f"{bucket.bucket_name}/{results_key}")
    uploaded = {item.key for item in bucket.list(RUN + "/")}
    assert {model_key, results_key, f"{RUN}/results/hyperparams_exp_{TIMESTAMP}.json",
            f"{RUN}/results/train_history_exp_{TIMESTAMP}.json"} <= uploaded

    run_dir = local_root / "proj" / f"exp_{TIMESTAMP}"
    assert (run_dir / "model" / f"model_exp_{TIMESTAMP}.pth").is_file()  # the local copy is kept
    downloaded = tmp_path / "downloaded.pth"
    bucket.download_file(model_key, str(downloaded))
    assert torch.equal(torch.load(downloaded)["model_state_dict"]["weight"], model.weight)
    bucket.download_file(results_key, str(tmp_path / "results.json"))
    assert json.loads((tmp_path / "results.json").read_text())["results"] == {"accuracy": 0.5}


def test_the_keras_saver_uploads_what_the_models_own_save_writes(service, bucket, tmp_path):
    _, keras_saver_class, _ = saver_classes(service)

    class KerasLikeModel:
        def save(self, path):
            with open(path, "wb") as handle:
                handle.write(b"HDF5 weights")

    saver = keras_saver_class("proj", "exp", bucket.bucket_name, "team", str(tmp_path))
    model_path, _ = saver.save_experiment(KerasLikeModel(), ResultPackage(), {"loss": [1.0]},
                                          experiment_timestamp=TIMESTAMP)
    key = f"{RUN}/model/model_exp_{TIMESTAMP}.h5"
    assert model_path == f"{bucket.bucket_name}/{key}"
    bucket.download_file(key, str(tmp_path / "model.h5"))
    assert (tmp_path / "model.h5").read_bytes() == b"HDF5 weights"


def test_the_savers_upload_in_the_background_through_an_uploader(service, bucket, tmp_path):
    pytorch_saver_class, _, base_saver_class = saver_classes(service)
    uploader = CloudUploader(bucket)
    saver = pytorch_saver_class("proj", "exp", bucket.bucket_name, "", str(tmp_path), uploader=uploader)
    saver.save_experiment(checkpoint_dict()[1], ResultPackage(), {"loss": [1.0]}, experiment_timestamp=TIMESTAMP)
    uploader.close()
    assert bucket.exists(f"proj/exp_{TIMESTAMP}/model/model_exp_{TIMESTAMP}.pth")
    assert bucket.exists(f"proj/exp_{TIMESTAMP}/results/results_hyperParams_hist_exp_{TIMESTAMP}.json")

    with pytest.raises(ValueError, match="writes to the bucket"):
        pytorch_saver_class("proj", "exp", "another-bucket", uploader=CloudUploader(bucket))
    # 1.8's base saver takes the model saver it is given.
    model_saver = saver.model_saver
    assert base_saver_class(model_saver, "proj", "exp", bucket.bucket_name).model_saver is model_saver


def test_a_missing_bucket_is_named_and_the_local_files_are_kept(service, tmp_path):
    pytorch_saver_class, _, _ = saver_classes(service)
    saver = pytorch_saver_class("proj", "exp", "aitoolbox-no-such-bucket", "", str(tmp_path))
    with pytest.raises(CloudStorageError, match="aitoolbox-no-such-bucket"):
        saver.save_experiment(checkpoint_dict()[1], ResultPackage(), {"loss": [1.0]}, experiment_timestamp=TIMESTAMP)
    assert os.path.isfile(tmp_path / "proj" / f"exp_{TIMESTAMP}" / "model" / f"model_exp_{TIMESTAMP}.pth")


def test_the_reporter_copies_its_file_to_the_top_of_the_run_folder_in_the_bucket(service, bucket, tmp_path):
    if service == "s3":
        from aitoolbox.cloud.AWS.results_save import BaseResultsSaver as ResultsSaver
    else:
        from aitoolbox.cloud.GoogleCloud.results_save import BaseResultsGoogleStorageSaver as ResultsSaver
    reporter = HyperParamSourceReporter("proj", "exp", TIMESTAMP, str(tmp_path))
    local_path = reporter.save_hyperparams_to_text_file({"lr": 0.1, "batch_size": 32})
    cloud_saver = ResultsSaver(bucket_name=bucket.bucket_name, cloud_dir_prefix="team")

    key = reporter.copy_to_cloud_storage(local_path, cloud_saver)
    assert key == f"{RUN}/hyperparams_list.txt"
    assert reporter.copy_to_cloud_storage(local_path, cloud_saver, file_name="params.txt") == f"{RUN}/params.txt"
    bucket.download_file(key, str(tmp_path / "copy.txt"))
    assert (tmp_path / "copy.txt").read_text() == "lr:\t0.1\nbatch_size:\t32\n"
    assert os.path.isfile(local_path)
