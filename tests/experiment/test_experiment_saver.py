import pytest

from aitoolbox.experiment.experiment_saver import (
    AbstractExperimentSaver, BaseFullExperimentGoogleStorageSaver, BaseFullExperimentS3Saver,
    BaseFullExperimentSaver, FullKerasExperimentGoogleStorageSaver, FullKerasExperimentS3Saver,
    FullPyTorchExperimentGoogleStorageSaver, FullPyTorchExperimentS3Saver)


@pytest.mark.parametrize("saver_class, storage, local_alternative", [
    (FullPyTorchExperimentS3Saver, "AWS S3", "FullPyTorchExperimentLocalSaver"),
    (FullKerasExperimentS3Saver, "AWS S3", "FullKerasExperimentLocalSaver"),
    (FullPyTorchExperimentGoogleStorageSaver, "Google Cloud Storage", "FullPyTorchExperimentLocalSaver"),
    (FullKerasExperimentGoogleStorageSaver, "Google Cloud Storage", "FullKerasExperimentLocalSaver"),
])
def test_cloud_savers_are_not_supported_yet_and_name_the_local_saver(saver_class, storage, local_alternative):
    with pytest.raises(NotImplementedError, match=f"{storage}.*{local_alternative}"):
        saver_class(project_name="proj", experiment_name="exp", bucket_name="model-result",
                    local_model_result_folder_path="/tmp/unused")
    assert issubclass(saver_class, BaseFullExperimentSaver)


@pytest.mark.parametrize("base_class", [BaseFullExperimentS3Saver, BaseFullExperimentGoogleStorageSaver])
def test_cloud_base_savers_are_not_supported_yet(base_class):
    with pytest.raises(NotImplementedError, match="not supported yet"):
        base_class(None, "proj", "exp")


def test_the_abstract_saver_needs_save_experiment():
    with pytest.raises(TypeError):
        AbstractExperimentSaver()


class RecordingModelSaver:
    def __init__(self):
        self.calls = []

    def save_model(self, **kwargs):
        self.calls.append(kwargs)
        return "models/m.pth", "m.pth", "/local/m.pth"


class RecordingResultsSaver(RecordingModelSaver):
    def save_experiment_results(self, **kwargs):
        self.calls.append(kwargs)
        return "results/r.json", "/local/r.json"


def test_base_saver_saves_model_then_results_under_one_timestamp():
    model_saver, results_saver = RecordingModelSaver(), RecordingResultsSaver()
    saver = BaseFullExperimentSaver(model_saver, results_saver, "proj", "exp")
    assert saver.save_experiment("model", "package", "history", separate_files=True) == ("models/m.pth",
                                                                                          "results/r.json")
    model_call, results_call = model_saver.calls[0], results_saver.calls[0]
    assert model_call["experiment_timestamp"] == results_call["experiment_timestamp"] is not None
    assert results_call["separate_files"] is True and results_call["project_name"] == "proj"
    assert model_call["model"] == "model" and results_call["result_package"] == "package"
