"""HyperParamSourceReporter: hyperparameter list, experiment script copy and source-code zip in the run folder."""
import logging
import os
import zipfile

import pytest

from aitoolbox.experiment.result_reporting.hyperparam_reporter import HyperParamSourceReporter


@pytest.fixture
def reporter(tmp_path):
    return HyperParamSourceReporter("proj", "exp", "2024_01_02", str(tmp_path))


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


def test_run_folder_is_created_and_reused(tmp_path, reporter):
    run_dir = os.path.join(tmp_path, "proj", "exp_2024_01_02")
    assert reporter.experiment_dir_path == run_dir and os.path.isdir(run_dir)
    assert reporter.local_hyperparams_file_path == os.path.join(run_dir, "hyperparams_list.txt")
    assert HyperParamSourceReporter("proj", "exp", "2024_01_02", str(tmp_path)).experiment_dir_path == run_dir


def test_hyperparams_text_file_in_dict_or_sorted_order(reporter):
    params = {"lr": 0.001, "batch_size": 32, "path": "a/b"}
    path = reporter.save_hyperparams_to_text_file(params)
    with open(path) as f:
        assert f.read() == "lr:\t0.001\nbatch_size:\t32\npath:\ta/b\n"
    reporter.save_hyperparams_to_text_file(params, sort_names=True)  # overwrites
    with open(path) as f:
        assert [line.split(":\t")[0] for line in f] == ["batch_size", "lr", "path"]
    assert params == {"lr": 0.001, "batch_size": 32, "path": "a/b"}


def test_hyperparams_text_file_holds_no_secret(reporter):
    params = {"lr": 0.001, "wandb_api_key": "k-93f0e1", "db": {"password": "pw-71x"}}
    with open(reporter.save_hyperparams_to_text_file(params)) as f:
        assert f.read() == "lr:\t0.001\nwandb_api_key:\t<redacted>\ndb:\t{'password': '<redacted>'}\n"
    assert params["wandb_api_key"] == "k-93f0e1" and params["db"]["password"] == "pw-71x"


def test_experiment_script_is_copied_or_skipped_with_a_warning(tmp_path, reporter, warnings_log):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    copied = reporter.save_experiment_python_file({"experiment_file_path": str(script)})
    assert copied == os.path.join(reporter.experiment_dir_path, "train.py")
    assert open(copied).read() == "print('train')\n"

    assert reporter.save_experiment_python_file({}) is None
    assert reporter.save_experiment_python_file({"experiment_file_path": str(tmp_path / "gone.py")}) is None
    assert "experiment_file_path" in warnings_log.text
    assert sorted(os.listdir(reporter.experiment_dir_path)) == ["train.py"]


def test_source_folders_are_zipped_under_their_names(tmp_path, reporter):
    for name in ("models", "data"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / f"{name}.py").write_text(name)
    zip_path = reporter.save_experiment_source_files(
        {"source_dirs_paths": [str(tmp_path / "src" / "models"), str(tmp_path / "src" / "data") + "/"]})
    assert zip_path == os.path.join(reporter.experiment_dir_path, "source_code.zip")
    with zipfile.ZipFile(zip_path) as archive:
        assert sorted(archive.namelist()) == ["data/data.py", "models/models.py"]
    assert os.listdir(reporter.experiment_dir_path) == ["source_code.zip"]  # no scratch left behind


def test_no_source_folders_means_no_zip(reporter):
    assert reporter.save_experiment_source_files({}) is None
    assert reporter.save_experiment_source_files({"source_dirs_paths": []}) is None


def test_copy_to_cloud_storage_needs_a_cloud_saver_and_the_file(reporter):
    # The uploads themselves are tested against the local S3 / GCS servers in tests/cloud/test_experiment_savers.py.
    with pytest.raises(TypeError, match="cloud model or results saver"):
        reporter.copy_to_cloud_storage(reporter.local_hyperparams_file_path, cloud_saver=object())

    class FolderOnly:
        def create_experiment_cloud_storage_folder_structure(self, project, experiment, timestamp):
            return f"{project}/{experiment}_{timestamp}/results"

        def save_file(self, local_file_path, cloud_file_path):
            raise AssertionError("nothing may be uploaded for a missing file")

    with pytest.raises(FileNotFoundError, match="save_hyperparams_to_text_file"):
        reporter.copy_to_cloud_storage(reporter.local_hyperparams_file_path, cloud_saver=FolderOnly())
