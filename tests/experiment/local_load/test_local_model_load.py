import argparse
import logging
import os

import pytest
import torch

from aitoolbox.experiment.local_load import PyTorchLocalModelLoader
from aitoolbox.experiment.local_save.local_model_save import PyTorchLocalModelSaver
from aitoolbox.experiment.local_save.safe_load import UntrustedCheckpointError
from aitoolbox.torchtrain.multi_loss_optim import MultiOptimizer
from aitoolbox.torchtrain.schedulers.basic import AbstractScheduler


@pytest.fixture
def log(caplog, monkeypatch):
    """The package's log records (the aitoolbox logger does not propagate to the root by default)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


class StepScheduler(AbstractScheduler):
    """A scheduler callback as the TrainLoop holds it: a torch scheduler behind AbstractScheduler."""

    def __init__(self, optimizer):
        super().__init__()
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(tmp_path, content, epoch=3, iteration_idx=None, checkpoint_model=True):
    saver = PyTorchLocalModelSaver(str(tmp_path), checkpoint_model=checkpoint_model)
    return saver.save_model(content, "proj", "exp", "ts", epoch=epoch, iteration_idx=iteration_idx)[1]


def checkpoint_of(model, optimizer, **extra):
    return {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(), "epoch": 3,
            "hyperparams": {"lr": 0.1}, **extra}


def test_nothing_is_loaded_at_first(tmp_path):
    loader = PyTorchLocalModelLoader(str(tmp_path))
    assert loader.model_representation is None
    with pytest.raises(ValueError, match="load_model"):
        loader.init_model(torch.nn.Linear(3, 2))


def test_model_and_optimizer_are_restored_from_an_epoch_checkpoint(tmp_path):
    model, optimizer = trained()
    save(tmp_path, checkpoint_of(model, optimizer, iteration_idx=11, format_version=2, rng=[{"seed": 5}]))
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loaded = loader.load_model("proj", "exp", "ts", "checkpoint_model", 3)
    assert loaded is loader.model_representation
    # Extra entries are carried along; a missing scheduler list is added empty (as aitoolbox 1.x did).
    assert loaded["format_version"] == 2 and loaded["rng"] == [{"seed": 5}] and loaded["iteration_idx"] == 11
    assert loaded["schedulers_state_dict"] == []

    fresh_model, fresh_optimizer = trained(seed=1)
    assert loader.init_model(fresh_model) is fresh_model
    for key, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[key], value)
    loader.init_optimizer(fresh_optimizer)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_final_models_and_iteration_checkpoints_are_found_by_their_names(tmp_path):
    model, optimizer = trained()
    save(tmp_path, checkpoint_of(model, optimizer, tag="final"), epoch=None, checkpoint_model=False)
    save(tmp_path, checkpoint_of(model, optimizer, tag="iteration"), epoch=2, iteration_idx=19)
    loader = PyTorchLocalModelLoader(str(tmp_path))
    assert loader.load_model("proj", "exp", "ts", "model")["tag"] == "final"
    assert loader.load_model("proj", "exp", "ts", epoch_num=2, iteration_idx=19)["tag"] == "iteration"


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_exp_ts_E9.pth"):
        PyTorchLocalModelLoader(str(tmp_path)).load_model("proj", "exp", "ts", "checkpoint_model", 9)


def test_map_location_places_the_tensors(tmp_path):
    model, optimizer = trained()
    path = save(tmp_path, checkpoint_of(model, optimizer))
    loaded = PyTorchLocalModelLoader(str(tmp_path)).load_model_from_path(path, map_location="meta")
    assert loaded["model_state_dict"]["weight"].device.type == "meta"


def test_files_of_the_first_format_get_aitoolbox_1_entry_names(tmp_path):
    model, optimizer = trained()
    path = str(tmp_path / "old.pth")
    torch.save({"model": model.state_dict(), "optimizers": [optimizer.state_dict()], "epoch": 1,
                "hyperparams": {}, "callbacks": {"x": 1}}, path)
    loaded = PyTorchLocalModelLoader(str(tmp_path)).load_model_from_path(path)
    assert "model" not in loaded and "optimizers" not in loaded
    assert loaded["optimizer_state_dict"]["param_groups"][0]["lr"] == 0.1
    assert loaded["callbacks"] == {"x": 1}


class CustomHyperparams:
    """A user class in the hyperparameters: unpickling it means running code the file names."""

    def __init__(self, lr):
        self.lr = lr


def test_an_argparse_namespace_in_the_hyperparameters_loads_by_default(tmp_path, log):
    model, optimizer = trained()
    # aitoolbox 1.x saved hyperparameters as given, e.g. an argparse Namespace: plain data, allowed.
    path = save(tmp_path, checkpoint_of(model, optimizer, hyperparams=argparse.Namespace(lr=0.1)))
    loaded = PyTorchLocalModelLoader(str(tmp_path)).load_model_from_path(path)
    assert loaded["hyperparams"].lr == 0.1
    assert not [record for record in log.records if record.levelno >= logging.WARNING]


def test_a_file_with_other_pickled_objects_is_refused_unless_trusted(tmp_path):
    model, optimizer = trained()
    path = save(tmp_path, checkpoint_of(model, optimizer, hyperparams=CustomHyperparams(0.1)))
    loader = PyTorchLocalModelLoader(str(tmp_path))
    with pytest.raises(UntrustedCheckpointError, match="weights_only=False") as refused:
        loader.load_model("proj", "exp", "ts", "checkpoint_model", 3)
    assert path in str(refused.value) and f"{__name__}.CustomHyperparams" in str(refused.value)
    assert loader.model_representation is None
    loaded = loader.load_model("proj", "exp", "ts", "checkpoint_model", 3, weights_only=False)
    assert loaded["hyperparams"].lr == 0.1
    assert loader.load_model_from_path(path, weights_only=False)["hyperparams"].lr == 0.1


def test_a_file_that_loads_with_weights_only_gives_no_warning(tmp_path, log):
    model, optimizer = trained()
    PyTorchLocalModelLoader(str(tmp_path)).load_model_from_path(save(tmp_path, checkpoint_of(model, optimizer)))
    assert not [record for record in log.records if record.levelno >= logging.WARNING]


def test_data_parallel_prefixes_are_removed_on_request(tmp_path):
    model, optimizer = trained()
    wrapped = {f"module.{key}": value for key, value in model.state_dict().items()}
    save(tmp_path, {**checkpoint_of(model, optimizer), "model_state_dict": wrapped})
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", "checkpoint_model", 3)
    with pytest.raises(RuntimeError):
        loader.init_model(torch.nn.Linear(3, 2))
    restored = loader.init_model(torch.nn.Linear(3, 2), used_data_parallel=True)
    assert torch.equal(restored.weight, model.weight)


def test_several_saved_optimizers_go_to_a_multi_optimizer_or_a_list(tmp_path):
    model, first = trained()
    second = torch.optim.SGD(model.parameters(), lr=0.3)
    save(tmp_path, {**checkpoint_of(model, first), "optimizer_state_dict": [first.state_dict(), second.state_dict()]})
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)

    def fresh():
        return [torch.optim.Adam(model.parameters(), lr=1.0), torch.optim.SGD(model.parameters(), lr=1.0)]

    as_list = loader.init_optimizer(fresh())
    assert [optimizer.param_groups[0]["lr"] for optimizer in as_list] == [0.1, 0.3]
    multi = loader.init_optimizer(MultiOptimizer(fresh()))
    assert [optimizer.param_groups[0]["lr"] for optimizer in multi] == [0.1, 0.3]
    with pytest.raises(ValueError, match="2 optimizer states"):
        loader.init_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="2 optimizer state"):
        loader.init_optimizer(fresh()[:1])


def test_a_one_element_optimizer_list_goes_to_a_single_optimizer(tmp_path):
    model, optimizer = trained()
    save(tmp_path, {**checkpoint_of(model, optimizer), "optimizer_state_dict": [optimizer.state_dict()]})
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)
    fresh = loader.init_optimizer(torch.optim.Adam(model.parameters(), lr=1.0))
    assert fresh.param_groups[0]["lr"] == 0.1


def test_a_checkpoint_without_optimizer_state_cannot_restore_an_optimizer(tmp_path):
    model, optimizer = trained()
    save(tmp_path, {**checkpoint_of(model, optimizer), "optimizer_state_dict": None})
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)
    with pytest.raises(KeyError, match="optimizer_state_dict"):
        loader.init_optimizer(optimizer)


def loader_with_schedulers(tmp_path, scheduler_states):
    model, optimizer = trained()
    save(tmp_path, checkpoint_of(model, optimizer, schedulers_state_dict=scheduler_states))
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)
    return loader, optimizer


def test_scheduler_states_are_restored_in_order(tmp_path):
    _, optimizer = trained()
    saved = [StepScheduler(optimizer), StepScheduler(optimizer)]
    for _ in range(3):
        optimizer.step()
        saved[0].scheduler.step()
    loader, optimizer = loader_with_schedulers(tmp_path, [scheduler.state_dict() for scheduler in saved])
    restored = loader.init_scheduler([StepScheduler(optimizer), StepScheduler(optimizer)])
    assert [scheduler.scheduler.last_epoch for scheduler in restored] == [3, 0]


def test_scheduler_mismatches_are_errors_unless_ignored(tmp_path):
    _, optimizer = trained()
    loader, optimizer = loader_with_schedulers(tmp_path, [StepScheduler(optimizer).state_dict()])
    with pytest.raises(ValueError, match="ignore_saved"):
        loader.init_scheduler([])
    assert loader.init_scheduler([], ignore_saved=True) == []
    with pytest.raises(ValueError, match="one to one"):
        loader.init_scheduler([StepScheduler(optimizer), StepScheduler(optimizer)])
    with pytest.raises(TypeError, match="not a scheduler callback: it has no load_state_dict"):
        loader.init_scheduler([object()])


@pytest.mark.parametrize("saved_states", [[], None])
def test_schedulers_without_saved_states_are_an_error_unless_ignored(tmp_path, saved_states):
    loader, optimizer = loader_with_schedulers(tmp_path, saved_states)
    schedulers = [StepScheduler(optimizer)]
    with pytest.raises(KeyError, match="ignore_missing_saved"):
        loader.init_scheduler(schedulers)
    assert loader.init_scheduler(schedulers, ignore_missing_saved=True) is schedulers
    assert loader.init_scheduler([]) == []


def test_amp_scaler_state_is_restored(tmp_path):
    model, optimizer = trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    save(tmp_path, checkpoint_of(model, optimizer, amp=scaler.state_dict()))
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)
    restored = loader.init_amp(torch.amp.GradScaler("cpu"))
    assert restored.state_dict() == scaler.state_dict()


def test_amp_scaler_needs_a_checkpoint_saved_with_amp(tmp_path):
    model, optimizer = trained()
    save(tmp_path, checkpoint_of(model, optimizer))
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", "exp", "ts", epoch_num=3)
    with pytest.raises(KeyError, match="amp"):
        loader.init_amp(torch.amp.GradScaler("cpu"))


def test_the_folder_argument_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert PyTorchLocalModelLoader("~/results").local_model_result_folder_path == os.path.join(str(tmp_path),
                                                                                              "results")
