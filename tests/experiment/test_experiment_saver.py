import pytest

from aitoolbox.experiment.experiment_saver import (
    AbstractExperimentSaver, BaseFullExperimentGoogleStorageSaver, BaseFullExperimentS3Saver,
    BaseFullExperimentSaver, FullKerasExperimentGoogleStorageSaver, FullKerasExperimentS3Saver,
    FullPyTorchExperimentGoogleStorageSaver, FullPyTorchExperimentS3Saver)


def test_the_cloud_savers_are_full_experiment_savers():
    # Their uploads are tested against the local S3 / GCS servers in tests/cloud/test_experiment_savers.py.
    for saver_class in (FullPyTorchExperimentS3Saver, FullKerasExperimentS3Saver, BaseFullExperimentS3Saver,
                        FullPyTorchExperimentGoogleStorageSaver, FullKerasExperimentGoogleStorageSaver,
                        BaseFullExperimentGoogleStorageSaver):
        assert issubclass(saver_class, BaseFullExperimentSaver)


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
