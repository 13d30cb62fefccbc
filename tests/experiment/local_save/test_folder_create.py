import os

from aitoolbox.experiment.local_save import experiment_folder
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder


def test_paths_follow_the_project_and_run_folder_layout(tmp_path):
    project, run = ExperimentFolder.get_base_folder_paths("proj", "exp", "2020-01-02_03-04-05", str(tmp_path))
    assert project == os.path.join(str(tmp_path), "proj")
    assert run == os.path.join(str(tmp_path), "proj", "exp_2020-01-02_03-04-05")
    assert not os.path.exists(project)  # only named, not created


def test_paths_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    project, _ = ExperimentFolder.get_base_folder_paths("proj", "exp", "ts", "~/results")
    assert project == os.path.join(str(tmp_path), "results", "proj")


def test_create_base_folder_creates_missing_folders_and_returns_the_run_folder(tmp_path):
    root = tmp_path / "not" / "there"
    path = ExperimentFolder.create_base_folder("proj", "exp", "ts", str(root))
    assert path == str(root / "proj" / "exp_ts")
    assert os.path.isdir(path)


def test_create_base_folder_reuses_an_existing_run_folder_and_keeps_its_files(tmp_path):
    first = ExperimentFolder.create_base_folder("proj", "exp", "ts", str(tmp_path))
    with open(os.path.join(first, "keep.txt"), "w") as handle:
        handle.write("kept")
    second = ExperimentFolder.create_base_folder("proj", "exp", "ts", str(tmp_path))
    assert second == first
    with open(os.path.join(second, "keep.txt")) as handle:
        assert handle.read() == "kept"


def test_is_the_experiment_folder_class_of_this_package():
    assert issubclass(ExperimentFolder, experiment_folder.ExperimentFolder)
