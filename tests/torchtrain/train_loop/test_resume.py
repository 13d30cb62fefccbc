"""Bitwise resume: a run stopped and continued from its checkpoint equals the run that was never stopped.

* In new processes (resume_workflow.py): for fp32, O1, O2 and fp16 with dynamic loss scaling (an overflow
  injected before the checkpoint), with dropout, a shuffling loader (its own seeded generator, or the global
  RNG) and an LR scheduler stepping every optimizer step, a run crashes; a new Python process builds a fresh
  TrainLoop, loads the crashed run's folder (``tl.load_checkpoint`` or ``ModelLoadContinueTraining``) and trains
  on: parameters (and O2 master weights, optimizer and loss scaler state) are bitwise equal, and so is the
  training history. Epoch-end and mid-epoch (ModelIterationCheckpoint) checkpoints, with grad_accumulation 2.
* Two-process DDP (fit_distributed, CPU processes over gloo): stopped and resumed with fit_distributed, equal
  to the uninterrupted two-process run.
* In this process: the edge cases and errors of loading.
"""
import copy
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.experiment.local_save.checkpoints import (
    MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, list_checkpoints, load_checkpoint_file)
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint
from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint, TrainLoopEndSave
from aitoolbox.torchtrain.distributed.launcher import ProcessLauncher
from tests.helpers import MLP, classification_data, single_torch_thread
from tests.torchtrain.data.support import SaveAt
from tests.torchtrain.train_loop import resume_workflow as workflow

REPO_ROOT = Path(__file__).resolve().parents[3]


one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


# --- in new processes --------------------------------------------------------------------------------------------
def run_phase(phase: str, work_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-m", "tests.torchtrain.train_loop.resume_workflow", phase, str(work_dir),
         *workflow.CASES_BY_NAME], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, f"{phase} phase failed:\n{completed.stderr[-5000:]}"
    return torch.load(work_dir / f"{phase}.pt", weights_only=True)


@pytest.fixture(scope="module")
def resumed_in_new_processes(tmp_path_factory):
    """``{case name: (uninterrupted outcome, resumed outcome)}``; one process per phase for all cases."""
    work_dir = tmp_path_factory.mktemp("resume")
    first = run_phase("first", work_dir)
    resumed = run_phase("resume", work_dir)
    return work_dir, {name: (first[name], resumed[name]) for name in workflow.CASES_BY_NAME}


def assert_tensor_lists_equal(expected, got, what):
    assert len(expected) == len(got), what
    for index, (a, b) in enumerate(zip(expected, got)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}[{index}] differs"


def assert_optimizer_states_equal(expected, got):
    assert expected["param_groups"] == got["param_groups"]
    assert expected["state"].keys() == got["state"].keys()
    for index in expected["state"]:
        for key, value in expected["state"][index].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][key])), (index, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(workflow.CASES_BY_NAME))
def test_resume_in_a_new_process_is_bitwise_exact(resumed_in_new_processes, name):
    work_dir, outcomes = resumed_in_new_processes
    expected, got = outcomes[name]
    case = workflow.CASES_BY_NAME[name]
    for key in expected["model"]:
        assert torch.equal(expected["model"][key], got["model"][key]), f"parameter {key} differs"
    assert_tensor_lists_equal(expected["raw_params"], got["raw_params"], "raw parameter")
    assert_tensor_lists_equal(sum(expected["masters"], []), sum(got["masters"], []), "master weight")
    assert_optimizer_states_equal(expected["optimizer"], got["optimizer"])
    assert expected["train_history"] == got["train_history"]
    assert expected["loss_scaler"] == got["loss_scaler"]
    assert expected["counters"] == got["counters"] == [workflow.NUM_EPOCHS - 1, workflow.NUM_EPOCHS, 9 * workflow.NUM_EPOCHS - 1]
    assert expected["lr"] == got["lr"]
    assert (expected["compiles"] > 0, got["compiles"] > 0) == (case.compiled, case.compiled)
    if case.precision == "O2":
        assert {p.dtype for p in got["raw_params"]} == {torch.bfloat16} and got["masters"][0]
    if case.precision != "fp32":  # the injected overflow was skipped and halved the scale before the crash
        assert got["loss_scaler"]["loss_scale"] == 2.0 ** 15
    # The crashed run's folder: hyperparameters, a copy of the running script, and mid-epoch checkpoints.
    run_folder = workflow.crashed_run_folder(case, str(work_dir))
    assert {"hyperparams_list.txt", "hyperparams.json", "resume_workflow.py"} <= set(os.listdir(run_folder))
    names = os.listdir(os.path.join(run_folder, "checkpoint_model"))
    assert any("_ITER" in n for n in names) == case.iteration_checkpoints


def test_the_cases_cover_the_required_matrix():
    cases = workflow.CASES
    for precision in workflow.PRECISIONS:
        assert any(c.precision == precision and not c.iteration_checkpoints and c.seeded_loader for c in cases)
        assert any(c.precision == precision and not c.iteration_checkpoints and not c.seeded_loader for c in cases)
        assert any(c.precision == precision and c.iteration_checkpoints for c in cases)
    assert {c.load for c in cases} == {"load_checkpoint", "callback_path", "callback_parts"}
    assert any(c.grad_accumulation == 2 and c.iteration_checkpoints for c in cases)


# --- two processes (DDP) ----------------------------------------------------------------------------------------
class SimulatedCrash(Exception):
    pass


class CrashAt(AbstractCallback):
    def __init__(self, crash_at: int):
        super().__init__("crash", execution_order=1000)
        self.crash_at = crash_at

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx + 1 == self.crash_at:
            raise SimulatedCrash(f"crashed after {self.crash_at} batches")


def ddp_loop(amp_init_args=None) -> TrainLoop:
    """32 samples, batches of 4 per process: 4 batches per process and epoch."""
    torch.manual_seed(0)
    model = MLP()
    train = DataLoader(classification_data(32), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    validation = DataLoader(classification_data(10, seed=5), batch_size=4)
    return TrainLoop(model, train, validation, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                     nn.CrossEntropyLoss(), show_progress=False)


def ddp_callbacks():
    return [LambdaLRScheduler(workflow.lr_decay, execute_epoch_end=False, execute_batch_end=True)]


class SaveRankHistory(AbstractCallback):
    """At train end, save this rank's own training history (the parent adopts only rank 0's)."""

    def __init__(self, folder: Path):
        super().__init__("save rank history")
        self.folder = folder

    def on_train_end(self):
        rank = torch.distributed.get_rank()
        torch.save(self.train_loop_obj.train_history.get_train_history_dict(), self.folder / f"rank{rank}.pt")


def rank_histories(folder: Path) -> list:
    return [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def fit_two_processes(tl: TrainLoop, amp_init_args, callbacks, num_epochs: int = 3) -> TrainLoop:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        tl.fit_distributed(num_epochs=num_epochs, callbacks=callbacks, amp_init_args=amp_init_args, num_gpus=2,
                           start_method="fork")
    return tl


@pytest.fixture(scope="module")
def ddp_straight(tmp_path_factory):
    """The uninterrupted two-process runs, by amp setting: ``(TrainLoop, [history of rank 0, of rank 1])``."""
    cache = {}

    def get(amp_init_args):
        key = repr(amp_init_args)
        if key not in cache:
            folder = tmp_path_factory.mktemp("ddp_straight")
            tl = fit_two_processes(ddp_loop(), amp_init_args, ddp_callbacks() + [SaveRankHistory(folder)])
            cache[key] = tl, rank_histories(folder)
        return cache[key]
    return get


def assert_same_run(expected: TrainLoop, got: TrainLoop):
    for key, value in expected.model.state_dict().items():
        assert torch.equal(value, got.model.state_dict()[key]), f"parameter {key} differs"
    assert expected.train_history == got.train_history
    assert (expected.epoch, expected.total_iteration_idx) == (got.epoch, got.total_iteration_idx)


def assert_same_two_process_run(straight, resumed: TrainLoop, resumed_histories: list):
    expected, expected_histories = straight
    assert_same_run(expected, resumed)
    assert resumed_histories == expected_histories  # each rank's own accumulated_loss too
    assert expected_histories[0]["accumulated_loss"] != expected_histories[1]["accumulated_loss"]


@pytest.mark.parametrize("amp_init_args, background_save", [(None, False), ({"opt_level": "O2"}, False),
                                                             (None, True)], ids=["fp32", "O2", "fp32-background"])
def test_two_process_resume_from_an_epoch_checkpoint_is_bitwise_exact(tmp_path, ddp_straight, amp_init_args,
                                                                       background_save):
    stopped = fit_two_processes(ddp_loop(), amp_init_args, ddp_callbacks() + [ModelCheckpoint(
        project_name="proj", experiment_name="ddp", local_model_result_folder_path=str(tmp_path),
        background_save=background_save)], num_epochs=2)
    (run,) = os.listdir(tmp_path / "proj")
    run_folder = tmp_path / "proj" / run
    paths = list_checkpoints(str(run_folder / "checkpoint_model"))
    assert len(paths) == 2  # written once per epoch, by rank 0 only
    checkpoint = torch.load(paths[-1], weights_only=True)
    assert list(checkpoint["model_state_dict"]) == list(stopped.model.state_dict())  # no 'module.' prefixes
    assert checkpoint["world_size"] == 2 and len(checkpoint["rng"]) == 2
    assert checkpoint["schedulers_state_dict"][0]["last_epoch"] == 8

    resumed = ddp_loop()
    resumed.load_checkpoint(str(run_folder))
    fit_two_processes(resumed, amp_init_args, ddp_callbacks() + [SaveRankHistory(tmp_path)])
    # The loaded checkpoint was applied in the processes; what is pending now is the run's end, for a next call
    # (its precision state, every rank's RNG and history), without a second copy of the weights.
    assert resumed.pending_restore["epochs_completed"] == resumed.epochs_completed == 3
    assert "model_state_dict" not in resumed.pending_restore
    assert_same_two_process_run(ddp_straight(amp_init_args), resumed, rank_histories(tmp_path))


def test_two_process_resume_from_a_mid_epoch_checkpoint_is_bitwise_exact(tmp_path, ddp_straight):
    folder = dict(project_name="proj", experiment_name="ddp", local_model_result_folder_path=str(tmp_path))
    crashed = ddp_loop()
    with pytest.raises(Exception, match="SimulatedCrash"):
        fit_two_processes(crashed, None, ddp_callbacks() + [ModelIterationCheckpoint(3, **folder), CrashAt(7)])
    (run,) = os.listdir(tmp_path / "proj")
    newest = list_checkpoints(str(tmp_path / "proj" / run / "checkpoint_model"))[-1]
    assert newest.endswith("_E1_ITER5.pth")  # after 6 batches: 2 into the second epoch

    resumed = ddp_loop()  # each process loads the checkpoint when the callback is registered there
    fit_two_processes(resumed, None, ddp_callbacks() + [ModelLoadContinueTraining(saved_model_path=newest),
                                                        SaveRankHistory(tmp_path)])
    assert_same_two_process_run(ddp_straight(None), resumed, rank_histories(tmp_path))

    single = ddp_loop()  # a checkpoint of two processes cannot continue exactly in one
    single.load_checkpoint(newest)
    with pytest.raises(ValueError, match="saved by 2 process\\(es\\) in the middle of an epoch and is resumed by 1"):
        single.fit(num_epochs=3)


# --- in this process: edge cases and errors ----------------------------------------------------------------------
def small_loop(seeded_loader: bool = True, **options) -> TrainLoop:
    """20 samples in batches of 4: 5 batches per epoch; dropout; Adam."""
    torch.manual_seed(0)
    model = MLP()
    generator = torch.Generator().manual_seed(1) if seeded_loader else None
    train = DataLoader(classification_data(20), batch_size=4, shuffle=True, generator=generator)
    validation = DataLoader(classification_data(12, seed=3), batch_size=5)
    return TrainLoop(model, train, validation, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                     nn.CrossEntropyLoss(), show_progress=False, **options)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_mid_epoch_checkpoint_of_another_world_size_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    """The same message, naming the file, as each process would give after the launch (review of issue 33, D13)."""
    saver = SaveAt(2)  # 2 batches into epoch 0 of a one-process run
    small_loop().fit(num_epochs=1, callbacks=[saver])
    path = tmp_path / "mid.pt"
    path.write_bytes(saver.saved)
    resumed = small_loop()
    resumed.load_checkpoint(str(path))

    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr(ProcessLauncher, "run", no_launch)
    with pytest.raises(ValueError, match="mid.pt.*saved by 1 process\\(es\\) in the middle of an epoch and is "
                                         "resumed by 2.*Resume with 1 process"):
        resumed.fit_distributed(num_epochs=2, num_cpu_processes=2, backend="gloo", start_method="fork")
    assert resumed.pending_restore is not None  # nothing of the loaded checkpoint was lost: fit can still use it


def straight_run(num_epochs: int = 3, grad_accumulation: int = 1, **options) -> TrainLoop:
    tl = small_loop(**options)
    tl.fit(num_epochs=num_epochs, callbacks=ddp_callbacks(), grad_accumulation=grad_accumulation)
    return tl


def test_continuing_a_finished_run_in_a_new_train_loop(tmp_path):
    first = TrainLoopCheckpoint(*loop_parts(), "proj", "exp", str(tmp_path), {}, show_progress=False)
    first.fit(num_epochs=2, callbacks=ddp_callbacks())
    torch.manual_seed(123)  # whatever happened in between: the checkpoint's RNG states win
    resumed = small_loop()
    checkpoint = resumed.load_checkpoint(first.experiment_folder.path)
    assert checkpoint["epochs_completed"] == 2 and resumed.epoch == 1
    resumed.fit(num_epochs=3, callbacks=ddp_callbacks())
    assert_same_run(straight_run(), resumed)


def loop_parts():
    tl = small_loop()
    return tl.model, tl.train_loader, tl.validation_loader, None, tl.optimizers[0], tl.criterion


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_a_mid_epoch_checkpoint_at_the_last_batch_of_an_epoch(tmp_path, grad_accumulation):
    """Saved after the step forced at the epoch's last batch, before the epoch-end evaluation and callbacks."""
    folder = dict(project_name="proj", experiment_name="exp", local_model_result_folder_path=str(tmp_path))
    crashed = small_loop()
    with pytest.raises(SimulatedCrash):
        crashed.fit(num_epochs=3, grad_accumulation=grad_accumulation,
                    callbacks=ddp_callbacks() + [ModelIterationCheckpoint(5, **folder), CrashAt(5)])
    (run,) = os.listdir(tmp_path / "proj")
    (path,) = list_checkpoints(str(tmp_path / "proj" / run / "checkpoint_model"))
    assert path.endswith("_E0_ITER4.pth")
    resumed = small_loop()
    resumed.load_checkpoint(path)
    resumed.fit(num_epochs=3, callbacks=ddp_callbacks(), grad_accumulation=grad_accumulation)
    assert_same_run(straight_run(grad_accumulation=grad_accumulation), resumed)


@pytest.mark.parametrize("seeded_loader", [True, False], ids=["loader-generator", "global-rng"])
def test_resume_from_a_checkpoint_dict_in_memory(seeded_loader):
    class SaveAt(AbstractCallback):
        def __init__(self):
            super().__init__("save", execution_order=100)
            self.saved = None

        def on_batch_end(self):
            if self.train_loop_obj.total_iteration_idx + 1 == 7:
                buffer = io.BytesIO()
                torch.save(self.train_loop_obj.checkpoint_state(mid_epoch=True), buffer)
                self.saved = buffer.getvalue()

    saver = SaveAt()
    small_loop(seeded_loader).fit(num_epochs=3, callbacks=ddp_callbacks() + [saver])
    resumed = small_loop(seeded_loader)
    resumed.load_checkpoint(torch.load(io.BytesIO(saver.saved), weights_only=True))
    resumed.fit(num_epochs=3, callbacks=ddp_callbacks())
    assert_same_run(straight_run(seeded_loader=seeded_loader), resumed)


def test_a_checkpoint_taken_between_loading_a_1x_checkpoint_and_fit_continues_as_that_checkpoint():
    """A checkpoint taken after ``load_checkpoint`` and before ``fit`` is the loaded run: what the loaded checkpoint
    lacks (an aitoolbox 1.x file: no random, precision or callback state) it lacks too, rather than holding the
    loop's own, which is not the run's. Written for the mutation run: with the loop's random state kept, a run
    resumed from that checkpoint drew another data order and dropout masks than one resumed from the 1.x file."""
    first = small_loop(seeded_loader=False)
    first.fit(num_epochs=1)
    saved = first.checkpoint_state()
    written_by_1x = {key: saved[key] for key in (MODEL_KEY, OPTIMIZER_KEY, SCHEDULERS_KEY, "epoch", "iteration_idx",
                                                 "hyperparams")}
    from_file = small_loop(seeded_loader=False)
    from_file.load_checkpoint(copy.deepcopy(written_by_1x))
    taken = small_loop(seeded_loader=False)
    taken.load_checkpoint(copy.deepcopy(written_by_1x))
    torch.manual_seed(7)  # the loop's random state when the checkpoint is taken: not the run's
    again = taken.checkpoint_state()
    assert not {"rng", "precision", "callbacks", "early_stop"} & set(again)
    from_again = small_loop(seeded_loader=False)
    from_again.load_checkpoint(again)
    for tl in (from_file, from_again):
        torch.manual_seed(3)  # a 1.x continuation draws from the process's random state
        tl.fit(num_epochs=3)
    assert_same_run(from_file, from_again)


def test_model_load_continue_training_with_aitoolbox_arguments_and_the_final_model(tmp_path):
    first = TrainLoopEndSave(*loop_parts(), "proj", "exp", str(tmp_path), {}, show_progress=False)
    first.fit(num_epochs=2, callbacks=ddp_callbacks())
    resumed = small_loop()
    resumed.fit(num_epochs=3, callbacks=ddp_callbacks() + [ModelLoadContinueTraining(
        first.experiment_timestamp, saved_model_dir="model", project_name="proj", experiment_name="exp",
        local_model_result_folder_path=str(tmp_path))])
    assert_same_run(straight_run(), resumed)


def test_model_load_continue_training_needs_a_path_or_all_parts():
    with pytest.raises(ValueError, match="needs saved_experiment_timestamp .* or saved_model_path"):
        ModelLoadContinueTraining(project_name="p", experiment_name="e")
    # The folder arguments left out are taken from an experiment-tracking TrainLoop; a plain one has none.
    with pytest.raises(ValueError, match="does not know local_model_result_folder_path"):
        small_loop().fit(num_epochs=1, callbacks=[
            ModelLoadContinueTraining("2026-01-01_00-00-00", project_name="p", experiment_name="e")])


def test_a_corrupt_newest_checkpoint_is_named(tmp_path):
    tl = TrainLoopCheckpoint(*loop_parts(), "proj", "exp", str(tmp_path), {}, show_progress=False)
    tl.fit(num_epochs=2)
    newest = list_checkpoints(tl.experiment_folder.checkpoint_dir)[-1]
    with open(newest, "r+b") as handle:
        handle.truncate(os.path.getsize(newest) // 3)
    with pytest.raises(RuntimeError, match=f"cannot read checkpoint {newest}"):
        small_loop().load_checkpoint(tl.experiment_folder.path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        small_loop().load_checkpoint(str(tmp_path / "proj"))


def test_checkpoints_that_do_not_fit_the_train_loop_are_refused(tmp_path):
    state = straight_run(num_epochs=1).checkpoint_state()
    with pytest.raises(ValueError, match="not an aitoolbox checkpoint: keys \\['optimizer_state_dict'\\] are missing"):
        small_loop().load_checkpoint({k: v for k, v in state.items() if k != "optimizer_state_dict"})
    two_optimizers = small_loop()
    two_optimizers.optimizers.append(torch.optim.SGD(two_optimizers.model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="holds 1 optimizer state\\(s\\) but the TrainLoop has 2"):
        two_optimizers.load_checkpoint(state)
    without_generator = small_loop(seeded_loader=False)
    without_generator.load_checkpoint(state)
    with pytest.raises(ValueError, match="build the DataLoader as in the original run"):
        without_generator.fit(num_epochs=2)


def test_a_saved_callback_state_without_its_callback_is_reported(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)  # the package logger may not propagate
    state = straight_run(num_epochs=1).checkpoint_state()
    resumed = small_loop()
    resumed.load_checkpoint(state)
    with caplog.at_level(logging.WARNING, logger="aitoolbox.torchtrain.train_loop.train_state"):
        resumed.fit(num_epochs=2)
    assert "1 LR scheduler(s) and this run registered 0" in caplog.text
    assert "register the same callbacks" in caplog.text


def test_the_saved_checkpoint_loads_weights_only_and_as_a_file(tmp_path):
    tl = straight_run(num_epochs=1)
    path = tmp_path / "state.pth"
    torch.save(tl.checkpoint_state(hyperparams={"lr": 1e-2, "fn": print}), path)
    checkpoint = load_checkpoint_file(str(path))
    assert checkpoint["hyperparams"]["lr"] == 1e-2 and "print" in checkpoint["hyperparams"]["fn"]
    resumed = small_loop()
    resumed.load_checkpoint(str(path))
    assert resumed.epoch == 0 and resumed.train_history == tl.train_history


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_checkpoint_loaded_before_fit_moves_its_optimizer_state_to_the_gpu_with_the_model(tmp_path):
    """A checkpoint file loads onto the CPU and load_checkpoint fills the optimizer state there (the model is
    placed on its device only when fit sets it up); the state must follow the parameters to the GPU, or the
    first step fails on mixed devices."""
    def make_loop():
        torch.manual_seed(0)
        model = MLP()
        return TrainLoop(model, DataLoader(classification_data(16), batch_size=4), None, None,
                         torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), show_progress=False)

    first = make_loop()
    first.fit(num_epochs=1)
    torch.save(first.checkpoint_state(), tmp_path / "checkpoint.pth")
    again = make_loop()
    again.load_checkpoint(str(tmp_path / "checkpoint.pth"))
    assert all(value.device.type == "cpu" for state in again.optimizer.state.values() for value in state.values())
    again.fit(num_epochs=2)
    for state in again.optimizer.state.values():
        assert all(value.device.type == "cuda" for value in state.values() if value.dim() > 0)
