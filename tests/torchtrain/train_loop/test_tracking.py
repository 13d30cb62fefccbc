"""The experiment-tracking presets: TrainLoopCheckpoint, TrainLoopEndSave, TrainLoopCheckpointEndSave.

Each fills ``<root>/<project>/<experiment>_<timestamp>/``: hyperparameter files and the running script,
a checkpoint per epoch (loadable with ``torch.load(weights_only=True)`` and holding the whole training state),
the final model, JSON results with the result packages' metrics, plots and the history CSV.
"""
import copy
import datetime
import json
import logging
import os
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder
from aitoolbox.experiment.result_package.abstract_result_packages import AbstractResultPackage
from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.schedulers.basic import StepLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoopCheckpoint, TrainLoopCheckpointEndSave, TrainLoopEndSave
from tests.experiment.local_save.unwritable import unwritable_root  # noqa: F401 - a fixture
from tests.helpers import MLP, classification_data, indexed_classification_data, single_torch_thread

# aitoolbox 1.8's keys, then this package's.
CHECKPOINT_KEYS = {"model_state_dict", "optimizer_state_dict", "schedulers_state_dict", "epoch", "iteration_idx",
                   "hyperparams", "format_version", "precision", "callbacks", "epochs_completed", "iteration",
                   "train_history", "rng", "world_size", "early_stop"}
RNG_KEYS = {"python", "numpy", "torch", "cuda", "loader_generators"}


one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


def preset_arguments(train_samples: int = 20):
    torch.manual_seed(0)
    model = MLP()
    train = DataLoader(classification_data(train_samples), batch_size=4, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    validation = DataLoader(classification_data(12, seed=3), batch_size=5)
    test = DataLoader(classification_data(10, seed=4), batch_size=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, train, validation, test, optimizer, nn.CrossEntropyLoss()


def make_hyperparams(tmp_path):
    script = tmp_path / "my_experiment.py"
    script.write_text("# the experiment script\n")
    return {"lr": 1e-2, "layers": [16, {"dropout": 0.3}], "experiment_file_path": str(script)}


def run_folder_files(tl) -> set:
    root = tl.experiment_folder.path
    return {os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root) for name in names}


def test_checkpoint_preset_writes_a_complete_checkpoint_every_epoch(tmp_path):
    hyperparams = make_hyperparams(tmp_path)
    untouched = copy.deepcopy(hyperparams)
    tl = TrainLoopCheckpoint(*preset_arguments(), project_name="proj", experiment_name="exp",
                             local_model_result_folder_path=str(tmp_path / "results"), hyperparams=hyperparams,
                             show_progress=False)
    folder = tl.experiment_folder
    assert folder.path == str(tmp_path / "results" / "proj" / f"exp_{tl.experiment_timestamp}")
    assert os.path.isfile(os.path.join(folder.path, "hyperparams_list.txt"))  # written at construction
    history_at_epoch_end = []

    class RecordHistory(AbstractCallback):
        def __init__(self):
            super().__init__("record history", execution_order=200)  # after the checkpoint callback

        def on_epoch_end(self):
            history_at_epoch_end.append(copy.deepcopy(self.train_loop_obj.train_history.get_train_history_dict()))

    tl.fit(num_epochs=3, callbacks=[StepLRScheduler(step_size=1, gamma=0.5), RecordHistory()])

    assert hyperparams == untouched
    names = [f"model_exp_{tl.experiment_timestamp}_E{epoch}.pth" for epoch in range(3)]
    assert sorted(os.listdir(folder.checkpoint_dir)) == names
    assert {"hyperparams_list.txt", "hyperparams.json", "my_experiment.py"} <= run_folder_files(tl)
    assert json.loads(open(os.path.join(folder.path, "hyperparams.json")).read())["layers"] == [16, {"dropout": 0.3}]
    for epoch, name in enumerate(names):
        checkpoint = torch.load(os.path.join(folder.checkpoint_dir, name), weights_only=True)
        # The fit's last epoch's checkpoint also says that a train end follows it (issue 32, see train_end_marker).
        assert set(checkpoint) == CHECKPOINT_KEYS | ({"train_end_record"} if epoch == len(names) - 1 else set())
        assert (checkpoint["epoch"], checkpoint["epochs_completed"], checkpoint["iteration"]) == (epoch, epoch + 1, 0)
        assert checkpoint["iteration_idx"] == 5 * (epoch + 1) - 1
        assert checkpoint["train_history"] == history_at_epoch_end[epoch]
        assert checkpoint["hyperparams"] == hyperparams
        assert list(checkpoint["model_state_dict"]) == list(tl.model.state_dict())
        assert checkpoint["schedulers_state_dict"][0]["last_epoch"] == epoch + 1
        assert checkpoint["optimizer_state_dict"]["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.5 ** (epoch + 1))
        assert len(checkpoint["rng"]) == checkpoint["world_size"] == 1
        assert set(checkpoint["rng"][0]) == RNG_KEYS and len(checkpoint["rng"][0]["loader_generators"]) == 1
        assert checkpoint["precision"] == {"loss_scaler": None, "master_weights": None}
    last = torch.load(os.path.join(folder.checkpoint_dir, names[-1]), weights_only=True)
    for key, value in tl.model.state_dict().items():
        assert torch.equal(last["model_state_dict"][key], value)
    assert set(last["optimizer_state_dict"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("preset", [TrainLoopEndSave, TrainLoopCheckpointEndSave])
def test_end_save_presets_write_model_json_results_plots_and_history(tmp_path, preset):
    hyperparams = make_hyperparams(tmp_path)
    untouched = copy.deepcopy(hyperparams)
    tl = preset(*preset_arguments(), project_name="proj", experiment_name="exp",
                local_model_result_folder_path=str(tmp_path), hyperparams=hyperparams,
                val_result_package=ClassificationResultPackage(), test_result_package=ClassificationResultPackage(),
                show_progress=False)
    tl.fit(num_epochs=2)
    assert hyperparams == untouched
    ts = tl.experiment_timestamp
    files = run_folder_files(tl)
    checkpoints = {f"checkpoint_model/model_exp_{ts}_E{epoch}.pth" for epoch in range(2)}
    if preset is TrainLoopCheckpointEndSave:
        assert checkpoints <= files
    else:
        assert not checkpoints & files
    assert {f"model/model_exp_{ts}.pth", "results/results.json", "results/train_end_train_history.json",
            "results/plots/loss.png", "results/plots/val_loss.png", "hyperparams_list.txt", "hyperparams.json",
            "my_experiment.py"} <= files
    assert not [name for name in files if name.endswith((".p", ".pkl", ".pickle")) or ".tmp-" in name]

    with open(os.path.join(tl.experiment_folder.results_dir, "results.json")) as handle:
        results = json.load(handle)  # JSON, not pickle
    for name, predict in (("validation", tl.predict_on_validation_set), ("test", tl.predict_on_test_set)):
        y_pred, y_true, _ = predict()
        expected = ClassificationResultPackage().prepare_result_package(y_true, y_pred).get_results()
        assert results["results"][name] == pytest.approx(expected)
    assert results["train_history"] == tl.train_history.get_train_history_dict()
    assert results["epochs_completed"] == 2

    final = torch.load(os.path.join(tl.experiment_folder.model_dir, f"model_exp_{ts}.pth"), weights_only=True)
    assert set(final) == CHECKPOINT_KEYS and final["epochs_completed"] == 2
    assert final["train_history"]["train_end_test_loss"] == tl.train_history["train_end_test_loss"]
    for key, value in tl.model.state_dict().items():
        assert torch.equal(final["model_state_dict"][key], value)
    with open(os.path.join(tl.experiment_folder.results_dir, "train_end_train_history.json")) as handle:
        assert json.load(handle) == tl.train_history.get_train_history_dict()


def test_iteration_save_freq_adds_mid_epoch_checkpoints(tmp_path):
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, iteration_save_freq=2,
                             show_progress=False)
    tl.fit(num_epochs=2)  # 5 batches per epoch: saves after 2, 4, 6 (epoch 1, 1 batch), 8 and 10 batches
    ts = tl.experiment_timestamp
    assert sorted(os.listdir(tl.experiment_folder.checkpoint_dir)) == sorted(
        f"model_exp_{ts}_{suffix}.pth" for suffix in ("E0_ITER1", "E0_ITER3", "E0", "E1_ITER5", "E1_ITER7", "E1_ITER9", "E1"))
    checkpoint = torch.load(os.path.join(tl.experiment_folder.checkpoint_dir, f"model_exp_{ts}_E1_ITER7.pth"),
                            weights_only=True)
    assert (checkpoint["epoch"], checkpoint["iteration"], checkpoint["iteration_idx"]) == (1, 3, 7)
    assert set(checkpoint) == CHECKPOINT_KEYS | {"epoch_start_rng", "epoch_loss_sum", "epoch_loss_state",
                                                   "epoch_loss_names"}


@pytest.mark.parametrize("use_amp, scaled, masters", [
    ({"opt_level": "O1"}, False, False), ({"opt_level": "O2"}, False, True),
    ({"opt_level": "O2", "loss_scale": "dynamic"}, True, True),
    ({"opt_level": "O1", "dtype": torch.float16}, True, False), (True, False, False)],
    ids=["O1", "O2", "O2-dynamic", "fp16", "use_amp=True"])  # bfloat16 (the CPU default) is scaled only on request
def test_checkpoints_hold_the_mixed_precision_state(tmp_path, use_amp, scaled, masters):
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, use_amp=use_amp,
                             show_progress=False)
    tl.fit(num_epochs=1)
    checkpoint = torch.load(os.path.join(tl.experiment_folder.checkpoint_dir, f"model_exp_{tl.experiment_timestamp}_E0.pth"),
                            weights_only=True)
    precision = checkpoint["precision"]
    assert (precision["loss_scaler"] is not None) == scaled
    if scaled:
        assert precision["loss_scaler"] == tl.precision.loss_scaler.state_dict()
    if masters:  # O2: the optimizer steps float32 masters of the bfloat16 model; they are what resumes exactly
        saved = precision["master_weights"][0]
        assert [m.dtype for m in saved] == [torch.float32] * 4
        for value, master in zip(saved, tl.precision.master_weights.state_dict()[0]):
            assert torch.equal(value, master)
        assert {v.dtype for v in checkpoint["model_state_dict"].values()} <= {torch.float32, torch.bfloat16}
    else:
        assert precision["master_weights"] is None


def test_numpy_metrics_in_the_history_still_load_with_weights_only(tmp_path):
    class NumpyMetric(AbstractCallback):
        def __init__(self):
            super().__init__("numpy metric")

        def on_epoch_end(self):  # e.g. a scikit-learn score
            self.train_loop_obj.insert_metric_result_into_history("val_f1", np.float64(0.25))
            self.train_loop_obj.insert_metric_result_into_history("confusion", np.eye(2, dtype=np.int64))

    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {"seed": np.int64(3)},
                             show_progress=False)
    tl.fit(num_epochs=1, callbacks=[NumpyMetric()])
    checkpoint = torch.load(os.path.join(tl.experiment_folder.checkpoint_dir, f"model_exp_{tl.experiment_timestamp}_E0.pth"),
                            weights_only=True)
    assert checkpoint["train_history"]["val_f1"] == [0.25]
    assert torch.equal(checkpoint["train_history"]["confusion"][0], torch.eye(2, dtype=torch.int64))
    assert tl.train_history["val_f1"] == [np.float64(0.25)]  # the live history is left as it was


@pytest.mark.parametrize("preset", [TrainLoopCheckpoint, TrainLoopEndSave, TrainLoopCheckpointEndSave])
def test_cloud_save_mode_is_local_by_default_and_an_unknown_mode_is_refused(tmp_path, preset):
    # The cloud modes ('s3', 'gcs', ...) are tested against local servers in tests/cloud/test_training_uploads.py.
    for mode in (None, "local"):
        tl = preset(*preset_arguments(), "proj", f"exp_{mode}", str(tmp_path), {}, cloud_save_mode=mode,
                    show_progress=False)
        assert os.path.isdir(tl.experiment_folder.path)
    with pytest.raises(ValueError, match=f"{preset.__name__}: cloud_save_mode='dropbox' is not one of"):
        preset(*preset_arguments(), "proj", "cloud", str(tmp_path), {}, cloud_save_mode="dropbox")
    assert not [name for name in os.listdir(tmp_path / "proj") if name.startswith("cloud")]


@pytest.mark.parametrize("preset", [TrainLoopCheckpoint, TrainLoopEndSave])
def test_lazy_experiment_save_creates_nothing_until_the_first_write(tmp_path, preset):
    root = tmp_path / "results"
    tl = preset(*preset_arguments(), "proj", "exp", str(root), {"lr": 0.1}, lazy_experiment_save=True,
                show_progress=False)
    assert not root.exists()
    tl.fit(num_epochs=1)
    files = run_folder_files(tl)
    assert {"hyperparams_list.txt", "hyperparams.json"} <= files  # written with the first file
    assert json.loads((root / "proj" / f"exp_{tl.experiment_timestamp}" / "hyperparams.json").read_text()) == {"lr": 0.1}


def test_an_existing_experiment_folder_is_never_overwritten(tmp_path):
    now = datetime.datetime.now()
    taken = []
    for seconds in range(-1, 4):  # whatever second the constructor reads, its folder exists already
        stamp = (now + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%d_%H-%M-%S")
        folder = ExperimentFolder(str(tmp_path), "proj", "exp", timestamp=stamp)
        open(os.path.join(folder.ensure(folder.checkpoint_dir), "model_exp_E0.pth"), "wb").close()
        taken.append(folder.path)
    tl = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {})
    assert tl.experiment_folder.path not in taken and os.path.isdir(tl.experiment_folder.path)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_1", tl.experiment_timestamp)  # a suffixed run folder
    for path in taken:
        assert os.listdir(os.path.join(path, "checkpoint_model")) == ["model_exp_E0.pth"]


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path):
    first = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {})
    second = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {})
    assert first.experiment_folder.path != second.experiment_folder.path
    assert sorted(os.listdir(tmp_path / "proj")) == sorted({f"exp_{first.experiment_timestamp}",
                                                            f"exp_{second.experiment_timestamp}"})


def test_a_folder_that_cannot_be_created_fails_at_construction_with_its_path(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    with pytest.raises(NotADirectoryError, match="blocker"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(blocker / "results"), {})


@pytest.mark.parametrize("preset", [TrainLoopCheckpoint, TrainLoopEndSave, TrainLoopCheckpointEndSave])
def test_hyperparams_are_optional(tmp_path, preset):
    """Without hyperparams (unlike aitoolbox 1.x) a preset trains and saves as with an empty dict."""
    tl = preset(*preset_arguments(), "proj", "exp", str(tmp_path), show_progress=False)
    assert tl.hyperparams == {}
    tl.fit(num_epochs=1)
    folder = tl.experiment_folder.path
    assert json.loads(open(os.path.join(folder, "hyperparams.json")).read()) == {}
    assert os.path.isfile(os.path.join(folder, "hyperparams_list.txt"))
    saved = [os.path.join(folder, path) for path in run_folder_files(tl) if path.endswith(".pth")]
    assert saved and all(torch.load(path, weights_only=True)["hyperparams"] == {} for path in saved)
    if preset is not TrainLoopCheckpoint:
        assert os.path.isfile(os.path.join(folder, "results", "results.json"))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy_experiment_save"])
@pytest.mark.parametrize("preset", [TrainLoopCheckpoint, TrainLoopEndSave])
def test_an_unwritable_root_fails_at_construction_naming_the_argument(unwritable_root, preset, lazy):
    with pytest.raises((PermissionError, NotADirectoryError),
                       match=re.escape(f"local_model_result_folder_path={unwritable_root!r} cannot hold")):
        preset(*preset_arguments(), "proj", "exp", unwritable_root, lazy_experiment_save=lazy)
    assert not os.path.exists(unwritable_root)


def test_bad_hyperparams_are_refused():
    with pytest.raises(TypeError, match="hyperparams must be a dict or None, got list"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", "/tmp/unused", [("lr", 0.1)])


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_lazy_preset_trained_with_ddp_saves_plain_checkpoints_into_one_folder(tmp_path):
    """gpu_mode='ddp' (2 CPU processes): rank 0 creates the lazy folder and writes each checkpoint once, without
    DDP's 'module.' prefixes; a second fit of the same TrainLoop continues in that folder."""
    tl = TrainLoopCheckpoint(*preset_arguments(train_samples=16), "proj", "exp", str(tmp_path), {"lr": 1e-2},
                             lazy_experiment_save=True, gpu_mode="ddp", show_progress=False)
    assert not (tmp_path / "proj").exists()
    tl.fit(num_epochs=1, num_gpus=2, start_method="fork")
    tl.fit(num_epochs=2, num_gpus=2, start_method="fork")
    folder = tl.experiment_folder
    assert sorted(os.listdir(folder.checkpoint_dir)) == [f"model_exp_{tl.experiment_timestamp}_E{e}.pth" for e in (0, 1)]
    assert os.listdir(tmp_path / "proj") == [f"exp_{tl.experiment_timestamp}"]
    assert json.loads(open(os.path.join(folder.path, "hyperparams.json")).read()) == {"lr": 1e-2}
    checkpoint = torch.load(os.path.join(folder.checkpoint_dir, f"model_exp_{tl.experiment_timestamp}_E1.pth"),
                            weights_only=True)
    assert list(checkpoint["model_state_dict"]) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert checkpoint["world_size"] == 2 and len(checkpoint["rng"]) == 2 and checkpoint["epochs_completed"] == 2
    for key, value in tl.model.state_dict().items():  # the parent adopted rank 0's weights
        assert torch.equal(checkpoint["model_state_dict"][key], value)


class MetadataPackage(AbstractResultPackage):
    """Reads the predictions' metadata and the loss, as 1.x packages of the BERT QA kind do."""

    def __init__(self):
        super().__init__("MetadataPackage", False, np_array=False)
        self.requires_loss = True

    def prepare_results_dict(self):
        extra = self.additional_results["additional_results"]
        return {"n_indices": len(extra["index"]), "loss": extra["loss"]}


def test_end_save_hands_the_prediction_metadata_and_the_loss_to_the_packages(tmp_path):
    model, train, _, _, optimizer, criterion = preset_arguments()
    indexed = DataLoader(indexed_classification_data(12, seed=3), batch_size=5)
    package = MetadataPackage()
    tl = TrainLoopEndSave(model, train, indexed, None, optimizer, criterion, "proj", "exp", str(tmp_path), {},
                          val_result_package=package, show_progress=False)
    tl.fit(num_epochs=1)
    results = package.get_results()
    assert results["n_indices"] == 12
    assert results["loss"] == pytest.approx(tl.evaluate_loss_on_validation_set(float_dict_format=True))
    assert package.pkg_name == "MetadataPackage_VAL"  # named after the set, as in 1.x


class CrashAt(AbstractCallback):
    """Raises at the start of a batch, as a crashed or preempted job stops."""

    def __init__(self, epoch: int, iteration: int):
        super().__init__("crash")
        self.epoch, self.iteration = epoch, iteration

    def on_batch_begin(self):
        tl = self.train_loop_obj
        if (tl.epoch, tl.iteration) == (self.epoch, self.iteration):
            raise RuntimeError("the machine went away")


@pytest.mark.parametrize("preset", [TrainLoopCheckpoint, TrainLoopCheckpointEndSave])
def test_auto_resume_continues_the_newest_run_bitwise_after_a_crash(tmp_path, preset):
    """Started again with the same arguments, the run finds its own folder and newest checkpoint (a mid-epoch
    one here) and ends exactly as the run that never crashed; no second run folder is made."""
    straight = preset(*preset_arguments(), "proj", "exp", str(tmp_path / "straight"), {}, iteration_save_freq=2,
                      show_progress=False)
    straight.fit(num_epochs=3)

    root = str(tmp_path / "crashing")
    first = preset(*preset_arguments(), "proj", "exp", root, {}, iteration_save_freq=2, auto_resume=True,
                   show_progress=False)
    assert first.resumed_from is None  # nothing to resume: a new run
    with pytest.raises(RuntimeError, match="went away"):
        first.fit(num_epochs=3, callbacks=[CrashAt(epoch=1, iteration=4)])
    again = preset(*preset_arguments(), "proj", "exp", root, {}, iteration_save_freq=2, auto_resume=True,
                   show_progress=False)
    assert again.experiment_folder.path == first.experiment_folder.path
    assert os.path.basename(again.resumed_from) == f"model_exp_{first.experiment_timestamp}_E1_ITER7.pth"
    again.fit(num_epochs=3)
    assert os.listdir(os.path.join(root, "proj")) == [os.path.basename(first.experiment_folder.path)]
    for key, value in straight.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key
    assert again.train_history == straight.train_history

    # Finished: started once more, it finds the last checkpoint and has nothing left to train.
    done = preset(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True, show_progress=False)
    assert done.epochs_completed == 3
    done.fit(num_epochs=3)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(done.model.state_dict()[key], value), key
    for name in ("loss", "accumulated_loss", "val_loss"):
        assert done.train_history[name] == straight.train_history[name]


def test_auto_resume_picks_the_newest_run_with_a_checkpoint_and_only_runs_of_that_experiment(tmp_path):
    from aitoolbox.experiment.local_save.experiment_folder import newest_resumable_run
    project = tmp_path / "proj"
    for run, checkpoint in (("exp_2026-01-01_10-00-00", "model_exp_2026-01-01_10-00-00_E4.pth"),
                            ("exp_2026-01-02_10-00-00", "model_exp_2026-01-02_10-00-00_E1.pth"),
                            ("exp_2026-01-02_10-00-00_1", "model_exp_2026-01-02_10-00-00_1_E0.pth"),
                            ("exp_other_2026-01-05_10-00-00", "model_exp_other_2026-01-05_10-00-00_E9.pth")):
        os.makedirs(project / run / "checkpoint_model")
        torch.save({}, project / run / "checkpoint_model" / checkpoint)
    os.makedirs(project / "exp_2026-01-03_10-00-00" / "checkpoint_model")  # crashed before its first checkpoint
    assert newest_resumable_run(str(tmp_path), "proj", "exp") == (
        "2026-01-02_10-00-00_1", str(project / "exp_2026-01-02_10-00-00_1" / "checkpoint_model" /
                                     "model_exp_2026-01-02_10-00-00_1_E0.pth"))
    assert newest_resumable_run(str(tmp_path), "proj", "nothing") is None
    assert newest_resumable_run(str(tmp_path / "absent"), "proj", "exp") is None
    with pytest.raises(TypeError, match="auto_resume must be True or False"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), auto_resume="yes")


def test_a_resumed_run_keeps_the_checkpoints_a_straight_run_keeps(tmp_path):
    """Best-k pruning and keep_last count the checkpoints an earlier process wrote into the run folder: the crashed
    and auto-resumed run ends with the same checkpoint files as the run that never stopped."""
    from aitoolbox.experiment.local_save.checkpoints import RANKING_FILE_NAME
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint

    def run(root, crash_at=None):
        def make():
            return TrainLoopCheckpoint(*preset_arguments(train_samples=24), "proj", "exp", root, {},
                                       rm_subopt_local_models="accumulated_loss", num_best_checkpoints_kept=2,
                                       auto_resume=True, show_progress=False)
        tl = make()
        if crash_at is not None:
            with pytest.raises(RuntimeError, match="went away"):
                tl.fit(num_epochs=6, callbacks=[ModelIterationCheckpoint(4, keep_last=2), crash_at])
            tl = make()  # a new process: new callbacks, nothing remembered but the files
            assert tl.resumed_from is not None
        tl.fit(num_epochs=6, callbacks=[ModelIterationCheckpoint(4, keep_last=2)])
        folder = tl.experiment_folder.checkpoint_dir
        names = sorted(name.replace(tl.experiment_timestamp, "<ts>") for name in os.listdir(folder))
        assert names[0] == RANKING_FILE_NAME
        return names[1:], [tl.train_history["accumulated_loss"]]

    straight_files, straight_history = run(str(tmp_path / "straight"))
    resumed_files, resumed_history = run(str(tmp_path / "crashing"), CrashAt(epoch=3, iteration=2))
    assert resumed_history == straight_history
    assert resumed_files == straight_files
    epoch_checkpoints = [name for name in straight_files if "ITER" not in name]
    assert len(epoch_checkpoints) in (2, 3)  # the best 2, and the newest when it is not one of them
    assert len(straight_files) - len(epoch_checkpoints) == 2  # keep_last


def _truncated(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _one_bit_flipped_in_a_storage(data: bytes) -> bytes:
    """``data`` (a torch zip) with one bit of a tensor's bytes flipped, its zip container intact."""
    import io
    import zipfile
    (record,) = [info for info in zipfile.ZipFile(io.BytesIO(data)).infolist() if info.filename.endswith("/data/0")]
    name_length, extra_length = int.from_bytes(data[record.header_offset + 26:record.header_offset + 28], "little"), \
        int.from_bytes(data[record.header_offset + 28:record.header_offset + 30], "little")
    damaged = bytearray(data)
    damaged[record.header_offset + 30 + name_length + extra_length + 4] ^= 0x40
    return bytes(damaged)


@pytest.mark.parametrize("damage", [_truncated, _one_bit_flipped_in_a_storage])
def test_auto_resume_passes_over_a_truncated_newest_checkpoint_naming_it_and_keeping_it(tmp_path, caplog,
                                                                                       monkeypatch, damage):
    """A save cut short on storage without atomic renames (or a copy that broke) left the newest checkpoint
    truncated, or a bit of it flipped on disk (torch's loader would load that silently): the job continues from the
    newest readable one, every requeue alike, and ends bitwise as the run that never stopped; the bad file is left
    as it was."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    straight = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path / "straight"), {},
                                   show_progress=False)
    straight.fit(num_epochs=4)

    root = str(tmp_path / "crashing")
    first = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True, show_progress=False)
    first.fit(num_epochs=3)
    checkpoints = sorted(os.listdir(first.experiment_folder.checkpoint_dir))
    newest = os.path.join(first.experiment_folder.checkpoint_dir,
                          f"model_exp_{first.experiment_timestamp}_E2.pth")
    with open(newest, "rb") as handle:
        data = handle.read()
    damaged = damage(data)
    with open(newest, "wb") as handle:
        handle.write(damaged)
    for _ in range(2):  # every requeue alike: the bad file never blocks the job
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True,
                                        show_progress=False)
        assert again.experiment_folder.path == first.experiment_folder.path
        assert os.path.basename(again.resumed_from) == f"model_exp_{first.experiment_timestamp}_E1.pth"
        assert f"cannot read the checkpoint {newest}" in caplog.text
        assert sorted(os.listdir(first.experiment_folder.checkpoint_dir)) == checkpoints
        with open(newest, "rb") as handle:
            assert handle.read() == damaged
    again.fit(num_epochs=4)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key
    assert again.train_history == straight.train_history


class PlantedObject:
    """Stands for what a planted file holds: loading it would run code."""


def test_auto_resume_with_no_readable_checkpoint_starts_a_new_run_and_a_planted_one_stops_it(tmp_path, caplog,
                                                                                            monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    root = str(tmp_path)
    first = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True, show_progress=False)
    first.fit(num_epochs=1)
    (only,) = os.listdir(first.experiment_folder.checkpoint_dir)
    path = os.path.join(first.experiment_folder.checkpoint_dir, only)
    with open(path, "wb") as handle:
        handle.write(b"PK\x03\x04 not a whole zip file")
    with caplog.at_level(logging.WARNING):
        fresh = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True,
                                    show_progress=False)
    assert fresh.resumed_from is None and fresh.epochs_completed == 0
    assert fresh.experiment_folder.path != first.experiment_folder.path
    assert f"no checkpoint of {first.experiment_folder.path} can be read: a new run starts" in caplog.text
    assert os.path.isfile(path)
    torch.save({"model_state_dict": {}, "payload": PlantedObject()}, path)
    with pytest.raises(RuntimeError, match="refusing to load"):
        TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", root, {}, auto_resume=True, show_progress=False)


def test_the_next_save_removes_what_a_killed_save_of_this_job_left_in_the_run_folder(tmp_path, monkeypatch):
    """A requeued job (same AITOOLBOX_RUN_ID, another host) removes at its first checkpoint save the temporaries
    its killed processes left beside the checkpoint folder (hyperparameters, results), as it removes those in the
    checkpoint folder; another job's recent one stays (docs/checkpointing.rst, atomic writes)."""
    from aitoolbox.experiment.local_save.leftovers import _job_tag
    monkeypatch.setenv("AITOOLBOX_RUN_ID", "tmpjob")
    first = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, auto_resume=True,
                                show_progress=False)
    first.fit(num_epochs=1)
    run = first.experiment_folder.path
    same_job, other_job = _job_tag("tmpjob"), _job_tag("otherjob")
    left = [os.path.join(run, f".tmp-hyperparams.json.4242-deadbeef-j{same_job}@nodeB.abc127"),
            os.path.join(first.experiment_folder.checkpoint_dir,
                         f".tmp-model_exp_{first.experiment_timestamp}_E0.pth.4242-deadbeef-j{same_job}@nodeB.abc1")]
    other = os.path.join(run, f".tmp-hyperparams.json.4242-deadbeef-j{other_job}@nodeB.abc128")
    for path in left + [other]:
        with open(path, "wb") as handle:
            handle.write(b"\0" * 100_000)
    again = TrainLoopCheckpoint(*preset_arguments(), "proj", "exp", str(tmp_path), {}, auto_resume=True,
                                show_progress=False)
    assert again.experiment_folder.path == run
    again.fit(num_epochs=2)
    assert not [path for path in left if os.path.exists(path)]
    assert os.path.exists(other)
