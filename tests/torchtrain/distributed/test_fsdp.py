"""gpu_mode='fsdp': FSDP2 training in two real processes over gloo, against DDP on the same global batch.

FSDP and DDP compute the same update: DDP all-reduces each gradient and averages; FSDP reduce-scatters (a sum
over the ranks of each shard, then the same division). Gloo sums two ranks' values in the same order either
way, so on two processes the weights usually agree bitwise; the tests allow 1e-5 for a reduction order that
may differ (FSDP flattens each shard unit's gradients into one buffer, padded to a multiple of the world size).
"""
import copy
import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.gradient import GradNormClip
from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint, ModelIterationCheckpoint, ModelTrainEndSave
from aitoolbox.torchtrain.distributed.fsdp import check_fsdp_model_args, shard_units
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from aitoolbox.experiment.local_load.local_model_load import PyTorchLocalModelLoader
from aitoolbox.experiment.local_save.checkpoints import list_checkpoints
from aitoolbox.experiment.local_save.sharded_checkpoints import (
    consolidate_sharded_checkpoint, is_sharded_checkpoint, sharded_checkpoint_info)
from tests.torchtrain.distributed.support import assert_state_dicts_close, regression_data

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")

UNITS = {"shard_modules": [nn.Linear]}


class Tower(TTModel):
    """Four linear layers with dropout-free nonlinearities; predictions carry the sample index."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                    nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.layers(x))

    def get_loss(self, batch_data, criterion, device):
        return criterion(self(batch_data[0].to(device)), batch_data[1].to(device))

    def get_predictions(self, batch_data, device):
        x, y, index = batch_data
        return self(x.to(device)).float().cpu(), y, {"index": index}


def make_loop(gpu_mode: str, model: nn.Module, use_amp=False, optimizer_class=torch.optim.AdamW,
              **options) -> TrainLoop:
    """34 training samples (batches of 4 per process: a smaller last batch), 35 evaluation samples (the ranks
    get 18 and 17: unequal evaluation batch counts)."""
    train = DataLoader(regression_data(34), batch_size=4)
    validation = DataLoader(regression_data(35, seed=1), batch_size=3)
    test = DataLoader(regression_data(35, seed=2), batch_size=3)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    return TrainLoop(model, train, validation, test, optimizer, nn.MSELoss(), gpu_mode=gpu_mode, use_amp=use_amp,
                     show_progress=False, **options)


class RecordShards(AbstractCallback):
    """At train end in every rank: the full weights (gathered), evaluation and predictions, and the bytes this
    rank holds in parameters, gradients and optimizer state."""

    def __init__(self, folder):
        super().__init__("record shards")
        self.folder = str(folder)

    def on_train_end(self):
        tl = self.train_loop_obj
        full = tl.strategy.model_state_dict(tl.model)
        y_pred, _, metadata = tl.predict_on_test_set()
        record = {"full_state_dict": full, "loss_validation": tl.evaluate_loss_on_validation_set(),
                  "test_pred": y_pred, "test_index": list(metadata["index"]),
                  "held_bytes": held_bytes(tl.model, tl.optimizers),
                  "param_dtypes": sorted({str(local(p).dtype) for p in tl.model.parameters()})}
        torch.save(record, os.path.join(self.folder, f"rank{tl.strategy.rank}.pt"))


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_bytes(model: nn.Module, optimizers) -> int:
    """Bytes of the parameters, gradients and optimizer state this process holds (its shards under FSDP)."""
    total = 0
    for param in model.parameters():
        total += local(param).numel() * local(param).element_size()
        if param.grad is not None:
            total += local(param.grad).numel() * local(param.grad).element_size()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += local(value).numel() * local(value).element_size()
    return total


class KeepGradients(AbstractCallback):
    """Zeroing sets gradients to None after each step; keep them for the byte count by not zeroing the last."""

    def __init__(self):
        super().__init__("keep gradients")

    def on_train_end(self):
        tl = self.train_loop_obj
        loss = tl.model.get_loss(next(iter(tl.train_loader)), tl.criterion, tl.device)
        loss.backward()


def records(folder):
    return [torch.load(os.path.join(str(folder), f"rank{rank}.pt"), weights_only=False) for rank in (0, 1)]


def run(gpu_mode, folder, model, use_amp=False, fsdp_model_args=None, callbacks=(), num_epochs=3, **kwargs):
    os.makedirs(folder, exist_ok=True)
    tl = make_loop(gpu_mode, model, use_amp)
    options = {"fsdp_model_args": fsdp_model_args} if gpu_mode == "fsdp" else {}
    tl.fit_distributed(num_epochs=num_epochs, callbacks=[KeepGradients(), RecordShards(folder)] + list(callbacks),
                       train_data_shuffle=False, num_gpus=2, start_method="fork", **options, **kwargs)
    return tl


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    initial = Tower()
    tl = run("ddp", folder, copy.deepcopy(initial), callbacks=[GradNormClip(0.5)])
    return initial, tl, records(folder)


@pytest.mark.parametrize("fsdp_model_args", [None, UNITS], ids=["root-only", "linear-units"])
def test_fsdp_trains_like_ddp_with_exact_evaluation(tmp_path, ddp_reference, fsdp_model_args):
    """Same weights (gradient clipping by the global norm across shards included), the same evaluation losses
    and predictions in data-set order, the parent's model unsharded with its own state_dict keys."""
    initial, ddp, (ddp0, _) = ddp_reference
    fsdp = run("fsdp", tmp_path, copy.deepcopy(initial), fsdp_model_args=fsdp_model_args,
               callbacks=[GradNormClip(0.5)])
    rank0, rank1 = records(tmp_path)
    assert_state_dicts_close(rank0["full_state_dict"], ddp0["full_state_dict"], atol=1e-5)
    assert rank1["full_state_dict"] == {}  # gathered to rank 0 only
    assert type(fsdp.model) is Tower and list(fsdp.model.state_dict()) == list(initial.state_dict())
    assert_state_dicts_close(fsdp.model.state_dict(), ddp.model.state_dict(), atol=1e-5)
    for rank in (rank0, rank1):
        assert float(rank["loss_validation"]) == pytest.approx(float(ddp0["loss_validation"]), abs=1e-6)
        assert rank["test_index"] == list(range(35))
        torch.testing.assert_close(rank["test_pred"], ddp0["test_pred"], rtol=1e-5, atol=1e-5)
    assert fsdp.train_history["val_loss"] == pytest.approx(ddp.train_history["val_loss"], abs=1e-6)
    # The parent's optimizer holds the trained AdamW state, as after a DDP run.
    assert len(fsdp.optimizer.state_dict()["state"]) == len(list(initial.parameters()))


def test_each_rank_holds_about_half_of_ddps_parameter_gradient_and_optimizer_bytes(tmp_path, ddp_reference):
    initial, _, (ddp0, ddp1) = ddp_reference
    run("fsdp", tmp_path, copy.deepcopy(initial), fsdp_model_args=UNITS)
    rank0, rank1 = records(tmp_path)
    for fsdp_rank, ddp_rank in ((rank0, ddp0), (rank1, ddp1)):
        assert fsdp_rank["held_bytes"] <= 0.55 * ddp_rank["held_bytes"]
    assert rank0["held_bytes"] + rank1["held_bytes"] >= ddp0["held_bytes"]  # every element is held somewhere


def test_bfloat16_policy_trains_with_float32_shards(tmp_path):
    torch.manual_seed(0)
    fsdp = run("fsdp", tmp_path, Tower(), use_amp=True, fsdp_model_args=UNITS, num_epochs=4)
    rank0, _ = records(tmp_path)
    assert rank0["param_dtypes"] == ["torch.float32"]  # O1: the shards stay float32, compute is bfloat16
    losses = fsdp.train_history["loss"]
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("use_amp", [{"opt_level": "O2"}, {"opt_level": "O3"}], ids=["O2", "O3"])
def test_o2_and_o3_train(tmp_path, use_amp):
    torch.manual_seed(0)
    fsdp = run("fsdp", tmp_path, Tower(), use_amp=use_amp, fsdp_model_args=UNITS, num_epochs=4)
    rank0, _ = records(tmp_path)
    # O2: float32 shards are the master weights; O3: the whole model in bfloat16.
    assert rank0["param_dtypes"] == (["torch.float32"] if use_amp["opt_level"] == "O2" else ["torch.bfloat16"])
    losses = fsdp.train_history["loss"]
    assert losses[-1] < 0.6 * losses[0]


class RecordResharding(AbstractCallback):
    """In every rank, before training starts and at train end (after an evaluation gathered everything): which
    parameters stay gathered after a training forward. FSDP swaps a unit's registered parameters between sharded
    DTensors and gathered plain tensors."""

    def __init__(self, folder):
        super().__init__("record resharding")
        self.folder = str(folder)
        self.seen = []

    def probe(self):
        from torch.distributed.tensor import DTensor
        tl = self.train_loop_obj
        tl.model.train()
        tl.model(next(iter(tl.train_loader))[0])
        self.seen.append({name: not isinstance(param, DTensor) for name, param in tl.model.named_parameters()})

    def on_epoch_begin(self):
        if not self.seen:
            self.probe()

    def on_train_end(self):
        self.probe()
        torch.save(self.seen, os.path.join(self.folder, f"rank{self.train_loop_obj.strategy.rank}.pt"))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_the_root_keeps_its_parameters_for_backward_and_units_follow_reshard_after_forward(
        tmp_path, reshard_after_forward):
    """The root unit is needed again at once for backward (torch's default never reshards it after forward: that
    would cost one more all-gather per batch); the other units free their gathered parameters after forward
    unless ``reshard_after_forward=False``. Both hold before and after an evaluation."""
    torch.manual_seed(0)
    tl = make_loop("fsdp", Tower())
    # 1000 parameters: the two 32x32 linear layers become units; the first layer and the head stay in the root.
    tl.fit_distributed(num_epochs=1, callbacks=[RecordResharding(tmp_path)], train_data_shuffle=False, num_gpus=2,
                       start_method="fork",
                       fsdp_model_args={"min_num_params": 1000, "reshard_after_forward": reshard_after_forward})
    for seen in records(tmp_path):
        assert len(seen) == 2
        for gathered in seen:
            assert gathered["layers.0.weight"] and gathered["head.weight"] and gathered["head.bias"]
            assert gathered["layers.2.weight"] is (not reshard_after_forward)
            assert gathered["layers.4.bias"] is (not reshard_after_forward)


class KillRank1(AbstractCallback):
    """Rank 1 dies abruptly (no exception, no cleanup) at the start of batch 2 of epoch 2."""

    def __init__(self):
        super().__init__("kill rank 1")

    def on_batch_begin(self):
        tl = self.train_loop_obj
        if tl.strategy.rank == 1 and tl.epoch == 2 and tl.iteration == 2:
            os._exit(3)


def only_run_folder(root, prefix):
    (run,) = [name for name in os.listdir(root) if name.startswith(prefix)]
    return root / run


@pytest.fixture(scope="module")
def straight_fsdp_run(tmp_path_factory):
    """Four epochs without a stop, with the final model saved (ModelTrainEndSave)."""
    root = tmp_path_factory.mktemp("straight")
    torch.manual_seed(0)
    initial = Tower()
    straight = make_loop("fsdp", copy.deepcopy(initial))
    fit_fsdp(straight, [ModelTrainEndSave(project_name="proj", experiment_name="straight",
                                          local_model_result_folder_path=str(root))], num_epochs=4)
    return initial, straight, only_run_folder(root / "proj", "straight")


@pytest.mark.parametrize("checkpoint_callback, stop", [
    (lambda **folder: ModelCheckpoint(**folder), "end"),
    (lambda **folder: ModelCheckpoint(background_save=True, **folder), "end"),
    (lambda **folder: ModelIterationCheckpoint(save_frequency=4, **folder), "end"),
    (lambda **folder: ModelCheckpoint(**folder), "killed"),
], ids=["epoch-end", "asynchronous", "mid-epoch", "rank-killed"])
def test_sharded_checkpoints_resume_bitwise_in_new_processes(tmp_path, straight_fsdp_run, checkpoint_callback,
                                                             stop):
    """Every rank writes its shards into a DCP folder; new processes continue from the newest complete one
    exactly as the run that never stopped (after an abrupt death of a rank too)."""
    initial, straight, _ = straight_fsdp_run
    folder = dict(project_name="proj", experiment_name="stopped", local_model_result_folder_path=str(tmp_path))
    stopped = make_loop("fsdp", copy.deepcopy(initial))
    if stop == "killed":
        with pytest.raises(Exception):
            fit_fsdp(stopped, [checkpoint_callback(**folder), KillRank1()], num_epochs=4)
    else:
        fit_fsdp(stopped, [checkpoint_callback(**folder)], num_epochs=3)
    checkpoint_dir = only_run_folder(tmp_path / "proj", "stopped") / "checkpoint_model"
    saved = list_checkpoints(str(checkpoint_dir))
    assert saved and all(is_sharded_checkpoint(path) for path in saved)
    assert sharded_checkpoint_info(saved[-1])["world_size"] == 2
    assert sorted(os.listdir(checkpoint_dir)) == sorted(os.path.basename(path) for path in saved)  # no leftovers
    newest = saved[-1]
    assert newest.endswith("_E1") if stop == "killed" else newest.endswith(("_E2", "_E2_ITER11"))

    resumed = make_loop("fsdp", copy.deepcopy(initial))
    resumed.load_checkpoint(str(checkpoint_dir.parent))  # the run folder: its newest checkpoint
    fit_fsdp(resumed, [], num_epochs=4)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert resumed.train_history == straight.train_history
    for mine, theirs in zip(resumed.optimizer.state_dict()["state"].values(),
                            straight.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_the_final_model_is_one_ordinary_file_of_the_gathered_weights(straight_fsdp_run):
    initial, straight, run_folder = straight_fsdp_run
    (final_file,) = [name for name in os.listdir(run_folder / "model") if name.endswith(".pth")]
    final = torch.load(run_folder / "model" / final_file, weights_only=True)
    plain = Tower()
    plain.load_state_dict(final["model_state_dict"])
    for key, value in straight.model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_a_sharded_checkpoint_consolidates_into_one_file_and_loads_with_the_1x_loader(tmp_path):
    torch.manual_seed(0)
    tl = make_loop("fsdp", Tower())
    path = epoch_checkpoint(tmp_path, tl, fit_fsdp)
    consolidated = consolidate_sharded_checkpoint(path, str(tmp_path / "model.pth"))
    plain = Tower()
    plain.load_state_dict(torch.load(consolidated, weights_only=True))
    for key, value in tl.model.state_dict().items():  # the parent adopted the trained weights
        assert torch.equal(plain.state_dict()[key], value), key
    # aitoolbox 1.x's loader: the checkpoint's file name leads to its folder; the weights are gathered on init.
    run_folder = os.path.dirname(os.path.dirname(path))
    experiment, timestamp = os.path.basename(run_folder).split("_", 1)
    loader = PyTorchLocalModelLoader(str(tmp_path))
    loader.load_model("proj", experiment, timestamp, epoch_num=1)
    loaded = loader.init_model(Tower())
    for key, value in tl.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="sharded .*TrainLoop.load_checkpoint"):
        loader.init_optimizer(torch.optim.AdamW(Tower().parameters()))


@pytest.mark.slow
def test_torch_compile_under_fsdp_trains_like_eager_fsdp():
    torch.manual_seed(0)
    initial = Tower()
    trained = []
    for torch_compile in (False, {"backend": "aot_eager"}):
        tl = make_loop("fsdp", copy.deepcopy(initial), torch_compile=torch_compile)
        tl.fit_distributed(num_epochs=2, train_data_shuffle=False, num_gpus=2, start_method="fork",
                           fsdp_model_args=UNITS)
        trained.append(tl.model.state_dict())
    assert_state_dicts_close(trained[1], trained[0], atol=1e-5)


def epoch_checkpoint(tmp_path, tl: TrainLoop, fit) -> str:
    """Train ``tl`` two epochs with ModelCheckpoint (``fit(tl, callbacks)``); the newest checkpoint's path."""
    fit(tl, [ModelCheckpoint(project_name="proj", experiment_name="run", local_model_result_folder_path=str(tmp_path))])
    (run_folder,) = os.listdir(tmp_path / "proj")
    return list_checkpoints(str(tmp_path / "proj" / run_folder / "checkpoint_model"))[-1]


def fit_fsdp(tl, callbacks, num_epochs=2):
    tl.fit_distributed(num_epochs=num_epochs, callbacks=callbacks, train_data_shuffle=False, num_gpus=2,
                       start_method="fork", fsdp_model_args=UNITS)


def test_a_two_process_checkpoint_continues_in_one_process(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    torch.manual_seed(0)
    sharded = make_loop("fsdp", Tower())
    path = epoch_checkpoint(tmp_path, sharded, fit_fsdp)
    assert is_sharded_checkpoint(path)
    single = make_loop("single", Tower())
    single.load_checkpoint(path)
    for key, value in sharded.model.state_dict().items():  # the weights the two processes ended with
        assert torch.equal(single.model.state_dict()[key], value)
    # The AdamW state written in shards (keyed by parameter name) is the optimizer's again, whole.
    for mine, theirs in zip(single.optimizer.state_dict()["state"].values(),
                            sharded.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    with caplog.at_level(logging.WARNING):
        single.fit(num_epochs=3)
    assert any("saved by 2 process(es) and is resumed by 1" in record.getMessage() for record in caplog.records)
    assert single.epochs_completed == 3 and single.train_history["loss"][-1] < single.train_history["loss"][0]


@pytest.mark.parametrize("saved_by", ["single", "fsdp"], ids=["plain-file", "sharded-folder"])
def test_a_one_process_checkpoint_continues_in_two_fsdp_processes(tmp_path, caplog, monkeypatch, saved_by):
    """A plain run's .pth file, or a one-process FSDP run's DCP folder, continues in two FSDP processes: the
    first step there starts from the saved weights and optimizer state."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    torch.manual_seed(0)
    one = make_loop(saved_by, Tower())
    path = epoch_checkpoint(tmp_path, one, lambda tl, callbacks: tl.fit_distributed(
        num_epochs=2, callbacks=callbacks, train_data_shuffle=False, num_gpus=1, start_method="fork")
        if saved_by == "fsdp" else tl.fit(num_epochs=2, callbacks=callbacks))
    assert is_sharded_checkpoint(path) is (saved_by == "fsdp")
    sharded = make_loop("fsdp", Tower())
    sharded.load_checkpoint(path)
    with caplog.at_level(logging.WARNING):
        fit_fsdp(sharded, [LoadedWeights(tmp_path)], num_epochs=3)
    for rank in (0, 1):
        loaded = torch.load(tmp_path / f"loaded{rank}.pt", weights_only=True)
        for key, value in one.model.state_dict().items():
            assert torch.equal(loaded[key], value), key
    assert sharded.epochs_completed == 3
    assert sharded.train_history["loss"][-1] < sharded.train_history["loss"][0]


class LoadedWeights(AbstractCallback):
    """At train begin (the checkpoint loaded, nothing trained yet): the full weights, gathered in every rank."""

    def __init__(self, folder):
        super().__init__("loaded weights")
        self.folder = str(folder)

    def on_train_begin(self):
        from torch.distributed.tensor import DTensor
        tl = self.train_loop_obj
        full = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
                for name, value in tl.model.state_dict().items()}
        torch.save(full, os.path.join(self.folder, f"loaded{tl.strategy.rank}.pt"))


class OverflowOnRank1(AbstractCallback):
    """Before the step of batch 2, rank 1 puts an inf into its own gradient shard; every rank records whether
    its step was skipped and the loss scale after it."""

    def __init__(self, folder):
        super().__init__("overflow on rank 1")
        self.folder = str(folder)
        self.skipped = []

    def on_after_gradient_update(self, optimizer_idx):
        tl = self.train_loop_obj
        if tl.strategy.rank == 1 and tl.total_iteration_idx == 2:
            local(tl.model.layers[2].weight.grad).view(-1)[0] = float("inf")

    def on_after_optimizer_step(self):
        tl = self.train_loop_obj
        self.skipped.append((tl.optimizer_step_skipped, tl.precision.loss_scaler.loss_scale))

    def on_train_end(self):
        tl = self.train_loop_obj
        torch.save(self.skipped, os.path.join(self.folder, f"skipped{tl.strategy.rank}.pt"))


@pytest.mark.parametrize("use_amp", [{"init_scale": 256.0, "growth_interval": 1000},
                                     {"opt_level": "O1", "dtype": torch.float16},
                                     {"opt_level": "O2", "dtype": torch.float16}],
                         ids=["GradScaler-dict", "O1-float16", "O2-float16"])
def test_loss_scaling_skips_a_step_on_every_rank_when_one_shard_overflows(tmp_path, use_amp):
    """Only rank 1's shard holds the inf: without agreeing, rank 0 would step and rank 1 skip."""
    torch.manual_seed(0)
    tl = make_loop("fsdp", Tower(), use_amp)
    tl.fit_distributed(num_epochs=2, callbacks=[OverflowOnRank1(tmp_path)], train_data_shuffle=False, num_gpus=2,
                       start_method="fork", fsdp_model_args=UNITS)
    skipped = [torch.load(tmp_path / f"skipped{rank}.pt") for rank in (0, 1)]
    assert skipped[0] == skipped[1]  # the same decisions and scales on both ranks
    assert skipped[0][2][0] is True
    if "init_scale" in use_amp:  # bfloat16 at a scale of 256 never overflows by itself: only batch 2 is skipped
        assert [flag for flag, _ in skipped[0]] == [False, False, True] + [False] * (len(skipped[0]) - 3)
        assert skipped[0][2][1] == 128.0
    assert tl.train_history["loss"][-1] < tl.train_history["loss"][0]


class FailOnRank1(AbstractCallback):
    def __init__(self):
        super().__init__("fail on rank 1")

    def on_batch_end(self):
        tl = self.train_loop_obj
        if tl.strategy.rank == 1 and tl.total_iteration_idx == 2:
            raise RuntimeError("rank 1 fails on purpose")


def test_a_failing_rank_surfaces_and_nothing_hangs(tmp_path):
    tl = make_loop("fsdp", Tower())
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        tl.fit_distributed(num_epochs=2, callbacks=[FailOnRank1()], num_gpus=2, start_method="fork", timeout_s=60,
                           fsdp_model_args=UNITS)


# --- in this process -----------------------------------------------------------------------------------------
def test_shard_units_by_class_and_by_size():
    model = Tower(width=32)
    by_class = shard_units(model, [nn.Linear])
    assert by_class == [model.head, model.layers[4], model.layers[2], model.layers[0]]
    # By size: the 32x32 layers (1,056 parameters) qualify, then the rest of `layers` does not reach 1,000.
    assert shard_units(model, min_num_params=1000) == [model.layers[2], model.layers[4]]
    assert shard_units(model, min_num_params=10 ** 6) == []


@pytest.mark.parametrize("args, error, message", [
    ([nn.Linear], TypeError, "fsdp_model_args must be a dict"),
    ({"shard": [nn.Linear]}, ValueError, r"unknown keys \['shard'\]"),
    ({"shard_modules": ["Linear"]}, TypeError, "must be nn.Module classes"),
    ({"min_num_params": 0}, ValueError, "must be an int >= 1"),
    ({"cpu_offload": "yes"}, TypeError, r"cpu_offload'\] must be True or False"),
])
def test_fsdp_model_args_are_checked(args, error, message):
    with pytest.raises(error, match=message):
        check_fsdp_model_args(args)


def test_arguments_that_do_not_fit_fsdp_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="sync_bn is not available with gpu_mode='fsdp'"):
        make_loop("fsdp", Tower()).fit_distributed(num_epochs=1, sync_bn=True, num_gpus=2)
    with pytest.raises(ValueError, match="ddp_model_args configure DistributedDataParallel"):
        make_loop("fsdp", Tower()).fit_distributed(num_epochs=1, ddp_model_args={"bucket_cap_mb": 1}, num_gpus=2)
    with pytest.raises(ValueError, match="fsdp_model_args needs TrainLoop\\(..., gpu_mode='fsdp'\\)"):
        make_loop("ddp", Tower()).fit_distributed(num_epochs=1, fsdp_model_args=UNITS, num_gpus=2)
