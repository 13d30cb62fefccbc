"""AbstractCallback and AbstractExperimentCallback: registration, experiment details and the experiment folder."""
import inspect
import os

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks import experiment
from aitoolbox.torchtrain.callbacks.abstract import (AbstractCallback, AbstractExperimentCallback,
                                                     MissingExperimentDetailsError)
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint

HOOKS = ("on_train_loop_registration", "on_multiprocess_start", "on_train_begin", "on_train_end", "on_epoch_begin",
         "on_epoch_end", "on_batch_begin", "on_batch_end", "on_after_gradient_update", "on_after_optimizer_step",
         "on_after_batch_prediction")


def make_loop(make_model, make_loader):
    model = make_model()
    return TrainLoop(model, make_loader(num_samples=8), None, None, torch.optim.SGD(model.parameters(), lr=0.01),
                     nn.MSELoss(), show_progress=False)


def test_registration_returns_the_callback_and_runs_the_registration_hook(make_model, make_loader):
    calls = []

    class Probe(AbstractCallback):
        def on_train_loop_registration(self):
            calls.append(self.train_loop_obj)

    tl = make_loop(make_model, make_loader)
    callback = Probe("probe")
    assert callback.register_train_loop_object(tl) is callback
    assert calls == [tl] and callback.message_service is tl.message_service
    tl.message_service = "messages"  # a loop that offers aitoolbox 1.x's message service hands it over
    assert callback.register_train_loop_object(tl).message_service == "messages"
    base = AbstractCallback("base")
    assert all(callable(getattr(base, hook)) for hook in HOOKS)
    assert (base.execution_order, base.device_idx_execution) == (0, None)


def test_experiment_callback_has_the_1x_signature():
    parameters = list(inspect.signature(AbstractExperimentCallback).parameters)
    assert parameters == ["callback_name", "project_name", "experiment_name", "local_model_result_folder_path",
                          "cloud_save_mode", "bucket_name", "cloud_dir_prefix", "execution_order",
                          "device_idx_execution"]
    callback = AbstractExperimentCallback("cb", "p", "e", "~/results", "gcs", "bucket", "prefix", 3, 0)
    assert (callback.project_name, callback.experiment_name) == ("p", "e")
    assert callback.local_model_result_folder_path == os.path.expanduser("~/results")
    assert (callback.cloud_save_mode, callback.bucket_name, callback.cloud_dir_prefix) == ("gcs", "bucket", "prefix")
    assert (callback.execution_order, callback.device_idx_execution) == (3, 0)
    assert experiment.AbstractExperimentCallback is AbstractExperimentCallback  # the older import path


def test_try_infer_experiment_details_from_a_tracking_loop(make_model, make_loader, tmp_path):
    model = make_model()
    tl = TrainLoopCheckpoint(model, make_loader(num_samples=8), None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                             nn.MSELoss(), "proj", "exp", str(tmp_path), {}, lazy_experiment_save=True)
    callback = AbstractExperimentCallback("cb", experiment_name="mine")
    tl.callbacks_handler.register_callbacks([callback])
    callback.try_infer_experiment_details(infer_cloud_details=True)
    assert (callback.project_name, callback.experiment_name) == ("proj", "mine")  # given values are kept
    assert callback.local_model_result_folder_path == str(tmp_path)
    assert callback.cloud_save_mode == getattr(tl, "cloud_save_mode", None)
    assert callback.experiment_folder.path == os.path.join(str(tmp_path), "proj", f"mine_{tl.experiment_timestamp}")
    # without own details the callback shares the loop's folder object
    shared = AbstractExperimentCallback("cb2")
    tl.callbacks_handler.register_callbacks([shared])
    assert shared.experiment_folder is tl.experiment_folder


def test_missing_details_are_an_attribute_and_value_error(make_model, make_loader):
    """Some details given, the others unknown to a plain loop (given none, a callback takes the loop's default run
    folder: tests/torchtrain/callbacks/test_default_run_folder.py)."""
    tl = make_loop(make_model, make_loader)
    callback = AbstractExperimentCallback("cb", project_name="p")
    tl.callbacks_handler.register_callbacks([callback])  # registration itself does not need the details
    assert not callback.has_experiment_folder
    for call in (lambda: callback.try_infer_experiment_details(infer_cloud_details=False),
                 lambda: callback.experiment_folder):
        with pytest.raises(AttributeError, match="pass all three of project_name, experiment_name and "
                                                 "local_model_result_folder_path"):
            call()
        with pytest.raises(ValueError):
            call()
    assert issubclass(MissingExperimentDetailsError, (AttributeError, ValueError))

    class Writer(AbstractExperimentCallback):
        requires_experiment_folder = True

    with pytest.raises(MissingExperimentDetailsError, match="Writer does not know where to write"):
        tl.callbacks_handler.register_callbacks([Writer("writer", experiment_name="e")])


def test_cloud_details_are_inferred_only_when_none_is_given(make_model, make_loader):
    tl = make_loop(make_model, make_loader)
    tl.project_name, tl.experiment_name, tl.local_model_result_folder_path = "p", "e", "/results"
    tl.cloud_save_mode, tl.bucket_name, tl.cloud_dir_prefix = "s3", "tl_bucket", "tl_prefix"
    inferred, own = AbstractExperimentCallback("a"), AbstractExperimentCallback("b", bucket_name="mine")
    for callback in (inferred, own):
        tl.callbacks_handler.register_callbacks([callback])
        callback.try_infer_experiment_details(infer_cloud_details=True)
    assert (inferred.cloud_save_mode, inferred.bucket_name, inferred.cloud_dir_prefix) == ("s3", "tl_bucket",
                                                                                           "tl_prefix")
    assert (own.cloud_save_mode, own.bucket_name, own.cloud_dir_prefix) == (None, "mine", None)
    local_only = AbstractExperimentCallback("c")
    tl.callbacks_handler.register_callbacks([local_only])
    local_only.try_infer_experiment_details(infer_cloud_details=False)
    assert local_only.cloud_save_mode is None and local_only.project_name == "p"


def test_callbacks_naming_the_same_experiment_share_one_folder_object(make_model, make_loader, tmp_path):
    tl = make_loop(make_model, make_loader)
    first, second = (AbstractExperimentCallback(name, "p", "e", str(tmp_path)) for name in ("a", "b"))
    tl.callbacks_handler.register_callbacks([first, second])
    assert first.experiment_folder is second.experiment_folder
    assert first.experiment_folder.timestamp == tl.experiment_timestamp
    first.ensure_folder(first.experiment_folder.results_dir)
    second.ensure_folder(second.experiment_folder.plots_dir)  # the same run folder: no "already exists" error
    assert os.listdir(tmp_path / "p") == [f"e_{tl.experiment_timestamp}"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(project_name=""), "project_name must be a non-empty string"),
    (dict(experiment_name="a/b"), "experiment_name must be a plain folder name"),
    (dict(local_model_result_folder_path=3), "local_model_result_folder_path must be a non-empty string"),
])
def test_bad_details_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AbstractExperimentCallback("cb", **kwargs)
