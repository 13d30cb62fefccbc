"""Sharded (DCP) checkpoints: two real processes over gloo with an FSDP2-sharded MLP and AdamW, and one process
without a process group for the 2 -> 1 and 1 -> 2 loads and the consolidation.

Each group of ranks costs seconds to start, so the cases share spawns: one run trains and saves (sync and
async), a second run in new processes loads what the first saved and what one process saved.
"""
import multiprocessing
import os
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from aitoolbox.experiment.local_save.atomic import TEMP_PREFIX
from aitoolbox.experiment.local_save.sharded_checkpoints import (
    MARKER_FILE, checkpoint_process_group, consolidate_sharded_checkpoint, is_sharded_checkpoint, load_sharded_checkpoint, remove_sharded_checkpoint, save_sharded_checkpoint,
    sharded_checkpoint_info, sharded_checkpoint_name)
from aitoolbox.torchtrain.distributed.fsdp import gather_full_model_state_dict
from tests.distributed_helpers import run_distributed

E1, E2_SYNC, E2_ASYNC, E9_ONE_PROCESS = "model_x_ts_E1", "model_x_ts_E2", "model_x_ts_E2_ITER5", "model_x_ts_E9"


# --- models, training and state snapshots (importable by name from the spawned ranks) ---------------------
def mlp(seed: int) -> nn.Sequential:
    """The last layer has one output row: under two ranks one of them holds an empty shard of it."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def sharded_mlp(seed: int, world_size: int, device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = mlp(seed).to(device_type)
    mesh = init_device_mesh(device_type, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int, device_type: str = "cpu") -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
        ((model(x.to(device_type)) - y.to(device_type)) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of the parameters and of the optimizer state, as plain tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def local(value):
        value = value.to_local() if hasattr(value, "to_local") else value
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    optimizer_state = get_optimizer_state_dict(model, optimizer)
    return {"params": {name: local(param) for name, param in model.named_parameters()},
            "optimizer": {name: {key: local(value) for key, value in state.items()}
                          for name, state in optimizer_state["state"].items()}}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full model and optimizer state keyed by parameter names (gathered to rank 0 under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if dist.is_initialized() else None
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options).get("state", {})  # rank 0's
    # Copies: the state dict holds the optimizer's own step tensors, which later steps change.
    return {"model": gather_full_model_state_dict(model),
            "optimizer": {name: {key: value.clone() for key, value in state.items()}
                          for name, state in optimizer_state.items()}}


def extra_of(rank: int) -> dict:
    return {"epoch": 1, "rank": rank, "rng": torch.Generator().manual_seed(rank).get_state(),
            "history": {"loss": [1.0, 0.5]}}


def assert_bitwise(got, want, where="state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_bitwise(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (got_item, want_item) in enumerate(zip(got, want)):
            assert_bitwise(got_item, want_item, f"{where}[{index}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# --- the ranks' work -------------------------------------------------------------------------------------
def _train_and_save(rank: int, world_size: int, folder: str) -> dict:
    model, optimizer = sharded_mlp(seed=0, world_size=world_size)
    # What is wrong in one process is raised in every process, before any of them waits in DCP.
    refused = []
    for name, extra in ((f"model_x_ts_E{rank}", {}), ("model_x_ts_E0", {"obj": _Unloadable()} if rank else {})):
        try:
            save_sharded_checkpoint(os.path.join(folder, name), model, optimizer, extra)
        except (ValueError, TypeError) as error:
            refused.append(f"{type(error).__name__}: {error}")
    train(model, optimizer, steps=3, seed=rank)
    save_sharded_checkpoint(os.path.join(folder, E1), model, optimizer, extra_of(rank)).wait()
    record = {"e1_local": local_state(model, optimizer), "e1_full": full_state(model, optimizer)}
    train(model, optimizer, steps=1, seed=100 + rank)
    record["e2_local"] = local_state(model, optimizer)
    save_sharded_checkpoint(os.path.join(folder, E2_SYNC), model, optimizer, extra_of(rank)).wait()
    group = checkpoint_process_group()  # DCP's background collectives apart from training's
    pending = save_sharded_checkpoint(os.path.join(folder, E2_ASYNC), model, optimizer, extra_of(rank),
                                      async_save=True, process_group=group)
    train(model, optimizer, steps=2, seed=200 + rank)  # training goes on while the checkpoint is written
    assert pending.wait(timeout=30) == os.path.join(folder, E2_ASYNC)
    record["after_async_local"] = local_state(model, optimizer)
    record["refused"] = refused
    return record


def _load_in_new_processes(rank: int, world_size: int, folder: str) -> dict:
    record = {}
    model, optimizer = sharded_mlp(seed=1, world_size=world_size)  # other initial weights, no optimizer state
    record["e1_extra"] = load_sharded_checkpoint(os.path.join(folder, E1), model, optimizer)
    record["e1_local"] = local_state(model, optimizer)
    train(model, optimizer, steps=1, seed=100 + rank)  # the step the saved run took after E1
    record["e1_resumed_local"] = local_state(model, optimizer)
    model, optimizer = sharded_mlp(seed=2, world_size=world_size)
    load_sharded_checkpoint(os.path.join(folder, E2_ASYNC), model, optimizer)
    record["e2_async_local"] = local_state(model, optimizer)
    model, optimizer = sharded_mlp(seed=3, world_size=world_size)
    record["e9_extra"] = load_sharded_checkpoint(os.path.join(folder, E9_ONE_PROCESS), model, optimizer)
    record["e9_full"] = full_state(model, optimizer)
    record["gathered_buffer_kept"] = _gathered_buffers_are_copies(world_size)
    return record


def _gathered_buffers_are_copies(world_size: int) -> bool:
    """FSDP leaves buffers unsharded; the gathered state must not be the model's own buffers, which training
    changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    gathered = gather_full_model_state_dict(model)
    model(torch.randn(5, 4))  # a training-mode forward updates the running statistics
    return dist.get_rank() != 0 or torch.equal(gathered["1.running_mean"], torch.zeros(6))


def _die_during_second_save(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = sharded_mlp(seed=0, world_size=world_size)
    train(model, optimizer, steps=2, seed=rank)
    save_sharded_checkpoint(os.path.join(folder, E1), model, optimizer, extra_of(rank)).wait()
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save(full, os.path.join(folder, "expected_e1.pt"))
    train(model, optimizer, steps=1, seed=rank)
    if rank == 1:  # DCP pickles the non-tensor values of the state when it writes this process's file
        optimizer.param_groups[0]["exits_when_written"] = _ExitWhenPickled()
    save_sharded_checkpoint(os.path.join(folder, E2_SYNC), model, optimizer, {"epoch": 2})


class _ExitWhenPickled:
    def __reduce__(self):
        os._exit(3)


# --- tests -----------------------------------------------------------------------------------------------
def plain_model_and_optimizer(seed: int):
    model = mlp(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_sharded_save_then_load_in_new_processes_and_with_another_number_of_processes(tmp_path):
    folder = str(tmp_path)
    saved = run_distributed(_train_and_save, 2, (folder,))
    for rank in range(2):
        assert len(saved[rank]["refused"]) == 2, saved[rank]["refused"]
        assert saved[rank]["refused"][0].startswith("ValueError: save_sharded_checkpoint was given different folders")
        assert saved[rank]["refused"][1].startswith("TypeError: process 1: extra_state must load with")
    assert sorted(os.listdir(folder)) == sorted([E1, E2_SYNC, E2_ASYNC])  # nor a temporary folder
    assert sorted(os.listdir(os.path.join(folder, E1))) == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt", MARKER_FILE])
    assert sharded_checkpoint_info(os.path.join(folder, E1))["world_size"] == 2
    trained_on = saved[0]["after_async_local"]["params"]["0.weight"]
    assert not torch.equal(trained_on, saved[0]["e2_local"]["params"]["0.weight"])  # while the async save ran

    # 2 -> 1: one process without a process group, plain model; the sync and async saves are the same state.
    e1_full = saved[0]["e1_full"]
    model, optimizer = plain_model_and_optimizer(seed=5)
    assert_bitwise(load_sharded_checkpoint(os.path.join(folder, E1), model, optimizer), extra_of(0))
    assert_bitwise(full_state(model, optimizer), e1_full)
    loaded_e2 = []
    for name in (E2_SYNC, E2_ASYNC):
        model, optimizer = plain_model_and_optimizer(seed=6)
        load_sharded_checkpoint(os.path.join(folder, name), model, optimizer)
        loaded_e2.append(full_state(model, optimizer))
    assert_bitwise(loaded_e2[1], loaded_e2[0])
    assert int(loaded_e2[0]["optimizer"]["0.weight"]["step"]) == 4

    # Consolidation: one ordinary file, loadable into the plain model with torch.load.
    output = consolidate_sharded_checkpoint(os.path.join(folder, E1), str(tmp_path / "final.pth"))
    consolidated = torch.load(output, weights_only=True)
    assert_bitwise(consolidated, e1_full["model"])
    plain = mlp(seed=7)
    plain.load_state_dict(consolidated)
    wrapped = torch.load(consolidate_sharded_checkpoint(os.path.join(folder, E1), str(tmp_path / "final_1x.pth"),
                                                        key="model_state_dict"), weights_only=True)
    assert_bitwise(wrapped, {"model_state_dict": e1_full["model"]})

    # 1 -> 2: one process without a process group writes the checkpoint that two sharded processes load.
    model, optimizer = plain_model_and_optimizer(seed=8)
    train(model, optimizer, steps=2, seed=9)
    save_sharded_checkpoint(os.path.join(folder, E9_ONE_PROCESS), model, optimizer, extra_of(0)).wait()
    one_process_full = full_state(model, optimizer)
    assert sharded_checkpoint_info(os.path.join(folder, E9_ONE_PROCESS))["world_size"] == 1

    loaded = run_distributed(_load_in_new_processes, 2, (folder,))
    for rank in range(2):
        assert_bitwise(loaded[rank]["e1_extra"], extra_of(rank), f"rank {rank} extra")
        assert_bitwise(loaded[rank]["e1_local"], saved[rank]["e1_local"], f"rank {rank} E1 shards")
        assert_bitwise(loaded[rank]["e1_resumed_local"], saved[rank]["e2_local"], f"rank {rank} resumed step")
        assert_bitwise(loaded[rank]["e2_async_local"], saved[rank]["e2_local"], f"rank {rank} async E2 shards")
        assert_bitwise(loaded[rank]["e9_extra"], extra_of(0))  # rank r gets saved rank r % 1
    assert_bitwise(loaded[0]["e9_full"], one_process_full)
    assert loaded[0]["gathered_buffer_kept"]


def test_a_save_killed_midway_leaves_no_checkpoint_and_the_previous_one_loads(tmp_path):
    folder = str(tmp_path)
    # Rank 1 exits in the second save; rank 0 fails in DCP's next collective (gloo sees the peer gone) or is
    # killed by the launcher.
    with pytest.raises(RuntimeError, match="_die_during_second_save"):
        run_distributed(_die_during_second_save, 2, (folder,))
    temp_folder = TEMP_PREFIX + E2_SYNC
    assert sorted(os.listdir(folder)) == sorted([E1, temp_folder, "expected_e1.pt"])
    # Rank 1 died writing its DCP file: after both processes wrote their extra state, before DCP's .metadata.
    left = set(os.listdir(os.path.join(folder, temp_folder)))
    assert {"extra_rank0.pt", "extra_rank1.pt"} <= left and not {".metadata", MARKER_FILE} & left, left
    assert not is_sharded_checkpoint(os.path.join(folder, temp_folder))
    model, optimizer = plain_model_and_optimizer(seed=5)
    assert load_sharded_checkpoint(os.path.join(folder, E1), model, optimizer)["epoch"] == 1
    assert_bitwise(full_state(model, optimizer), torch.load(os.path.join(folder, "expected_e1.pt")))
    # The next save of that name clears what the killed one left.
    save_sharded_checkpoint(os.path.join(folder, E2_SYNC), model, optimizer, {"epoch": 2}).wait()
    assert sorted(os.listdir(folder)) == sorted([E1, E2_SYNC, "expected_e1.pt"])


# DCP's asynchronous save warns from its writer thread that it assumes one process.
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_single_process_roundtrip_replacing_and_removing(tmp_path):
    path = str(tmp_path / "checkpoint_model" / sharded_checkpoint_name("model_x_ts_E3_ITER7.pth"))
    assert path.endswith("model_x_ts_E3_ITER7")
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=2, seed=0)
    save_sharded_checkpoint(path, model, optimizer, {"value": 1}).wait()
    train(model, optimizer, steps=1, seed=1)
    expected = full_state(model, optimizer)
    pending = save_sharded_checkpoint(path, model, optimizer, {"value": 2}, async_save=True)  # replaces it
    assert pending.wait(timeout=30) == path
    assert sorted(os.listdir(os.path.dirname(path))) == ["model_x_ts_E3_ITER7"]
    restored, restored_optimizer = plain_model_and_optimizer(seed=1)
    assert load_sharded_checkpoint(path, restored, restored_optimizer) == {"value": 2}
    assert_bitwise(full_state(restored, restored_optimizer), expected)
    remove_sharded_checkpoint(path)
    assert os.listdir(os.path.dirname(path)) == []


class _FailsWhenPickled:
    """Copied fine when the state is staged, refused when the writer thread serialises it."""

    def __deepcopy__(self, memo):
        return _FailsWhenPickled()

    def __reduce__(self):
        raise RuntimeError("this value cannot be written")


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_an_async_save_that_fails_raises_from_wait_and_leaves_no_checkpoint(tmp_path):
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=1, seed=0)
    optimizer.param_groups[0]["unwritable"] = _FailsWhenPickled()  # DCP pickles it in the writer thread
    pending = save_sharded_checkpoint(str(tmp_path / "model_x_ts_E1"), model, optimizer, {}, async_save=True)
    with pytest.raises(CheckpointException) as raised:  # DCP's report of the failures of every process
        pending.wait(timeout=30)
    assert "this value cannot be written" in repr(raised.value.failures[0])
    assert pending.done()
    assert os.listdir(tmp_path) == []  # not even the temporary folder: a failed save gives its space back


def test_an_optimizer_without_state_is_saved_and_loaded_without_state(tmp_path):
    model, optimizer = plain_model_and_optimizer(seed=0)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    save_sharded_checkpoint(str(tmp_path / "model_x_ts_E0"), model, [optimizer], {}).wait()
    assert not optimizer.state  # saving did not start AdamW's state (its step count)
    assert_bitwise(dict(model.named_parameters()), before)
    assert sharded_checkpoint_info(str(tmp_path / "model_x_ts_E0"))["stateless_optimizers"] == [0]
    other, other_optimizer = plain_model_and_optimizer(seed=1)
    train(other, other_optimizer, steps=1, seed=0)
    load_sharded_checkpoint(str(tmp_path / "model_x_ts_E0"), other, [other_optimizer])
    assert not other_optimizer.state
    assert_bitwise({name: param.detach() for name, param in other.named_parameters()}, before)


def test_loading_with_gradients_present_still_restores_the_optimizer_state(tmp_path):
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=2, seed=0)
    save_sharded_checkpoint(str(tmp_path / "model_x_ts_E1"), model, optimizer, {}).wait()
    fresh, fresh_optimizer = plain_model_and_optimizer(seed=1)
    ((fresh(torch.ones(2, 4))) ** 2).sum().backward()  # gradients, and no optimizer state yet
    load_sharded_checkpoint(str(tmp_path / "model_x_ts_E1"), fresh, fresh_optimizer)
    assert_bitwise(full_state(fresh, fresh_optimizer), full_state(model, optimizer))
    assert all(param.grad is not None for param in fresh.parameters())  # left as they were


def test_incomplete_folders_are_not_checkpoints_and_errors_say_what_is_wrong(tmp_path):
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=1, seed=0)
    path = str(tmp_path / "model_x_ts_E1")
    save_sharded_checkpoint(path, model, optimizer, {}).wait()
    assert is_sharded_checkpoint(path)
    with pytest.raises(ValueError, match="holds 1 optimizer state"):
        load_sharded_checkpoint(path, model, [optimizer, torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(TypeError, match="weights_only"):
        save_sharded_checkpoint(str(tmp_path / "model_x_ts_E2"), model, optimizer, {"obj": _Unloadable()})
    with pytest.raises(ValueError, match="checkpoint file name"):
        sharded_checkpoint_name("model_x_ts_E1")
    os.remove(os.path.join(path, MARKER_FILE))  # e.g. a folder copied by hand without its marker
    assert not is_sharded_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        load_sharded_checkpoint(path, model, optimizer)
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        consolidate_sharded_checkpoint(str(tmp_path / "missing"), str(tmp_path / "out.pth"))


class _Unloadable:
    """Pickles fine, but weights-only loading refuses it."""


# --- kills at random moments -----------------------------------------------------------------------------
def _fill(model: nn.Module, optimizer: torch.optim.Optimizer, value: float) -> None:
    """Every parameter and optimizer-state element of this rank becomes ``value``: a checkpoint mixing two
    saves would show two values."""
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(value)
        for state in optimizer.state.values():
            for tensor in state.values():
                (tensor.to_local() if hasattr(tensor, "to_local") else tensor).fill_(value)


def _save_until_killed(rank: int, world_size: int, folder: str, first_value: int, started_marker: str) -> None:
    model, optimizer = sharded_mlp(seed=0, world_size=world_size)
    train(model, optimizer, steps=1, seed=rank)
    value = first_value
    while True:
        _fill(model, optimizer, value)
        # Three names in turn: later saves replace earlier folders.
        save_sharded_checkpoint(os.path.join(folder, f"model_x_ts_E{value % 3}"), model, optimizer,
                                {"value": value, "rank": rank}).wait()
        if value == first_value and rank == 0:
            # Tells the test that this run's first save is complete on disk: the kill moment is chosen after it,
            # so a slow start on a busy machine cannot leave a run with nothing to check.
            open(started_marker, "w").close()
        value += 1


def _rank_main(fn, rank: int, world_size: int, init_method: str, args, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _wait_for_file(path: str, processes, timeout_s: float) -> None:
    """Wait until ``path`` exists; fail (killing ``processes``) if a process dies first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        dead = [process.exitcode for process in processes if not process.is_alive()]
        if dead or time.monotonic() > deadline:
            for process in processes:
                process.kill()
            pytest.fail(f"no complete first save within {timeout_s} s (exit codes of dead ranks: {dead})")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.extended
def test_killing_both_ranks_at_random_moments_leaves_only_complete_checkpoints(tmp_path):
    """Both ranks are SIGKILLed at a random moment of a stream of saves, four times; the folder holds only complete
    checkpoints (each one save's values throughout) and temporary folders. The random moment is counted from
    the run's first complete save, so the test does not depend on how fast the ranks start."""
    folder = str(tmp_path / "checkpoint_model")
    os.makedirs(folder)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    rng = random.Random(0)
    interrupted, checked = 0, 0
    for run in range(4):
        store = tmp_path / f"store_{run}"
        started = str(tmp_path / f"first_save_done_{run}")
        processes = [context.Process(target=_rank_main, daemon=True,
                                     args=(_save_until_killed, rank, 2, f"file://{store}",
                                           (folder, 1000 * (run + 1), started)))
                     for rank in range(2)]
        for process in processes:
            process.start()
        _wait_for_file(started, processes, timeout_s=180)
        time.sleep(rng.uniform(0.0, 1.0))
        assert all(process.is_alive() for process in processes), [process.exitcode for process in processes]
        for process in processes:
            process.kill()  # SIGKILL, as a machine failure
        for process in processes:
            process.join()
        names = os.listdir(folder)
        interrupted += any(name.startswith(TEMP_PREFIX) for name in names)
        for name in names:
            path = os.path.join(folder, name)
            if not is_sharded_checkpoint(path):
                assert name.startswith(TEMP_PREFIX), f"{name}: a checkpoint name without a complete checkpoint"
                continue
            model, optimizer = plain_model_and_optimizer(seed=1)
            value = load_sharded_checkpoint(path, model, optimizer)["value"]
            assert name == f"model_x_ts_E{value % 3}"
            state = full_state(model, optimizer)
            for tensor in list(state["model"].values()) + [t for s in state["optimizer"].values() for t in s.values()]:
                assert torch.all(tensor == value), f"{name} mixes saves: expected every value {value}"
            checked += 1
    assert checked > 0 and interrupted > 0, (checked, interrupted)
    # Their writers are gone: the next save removes what they left (full size), and only that.
    complete = sorted(name for name in os.listdir(folder) if not name.startswith(TEMP_PREFIX))
    model, optimizer = plain_model_and_optimizer(seed=1)
    save_sharded_checkpoint(os.path.join(folder, "model_x_ts_E99"), model, optimizer, {"value": 99}).wait()
    assert sorted(os.listdir(folder)) == sorted(set(complete) | {"model_x_ts_E99"})


# --- CUDA ------------------------------------------------------------------------------------------------
def _cuda_async_save_and_load(rank: int, world_size: int, folder: str) -> None:
    """One process on the GPU, in a "cpu:gloo,cuda:nccl" group: the asynchronous save of CUDA shards while
    training goes on, loaded back into a new sharded CUDA model."""
    torch.cuda.set_device(rank)
    model, optimizer = sharded_mlp(seed=0, world_size=world_size, device_type="cuda")
    train(model, optimizer, steps=2, seed=rank, device_type="cuda")
    expected = local_state(model, optimizer)
    pending = save_sharded_checkpoint(os.path.join(folder, E1), model, optimizer, extra_of(rank), async_save=True,
                                      process_group=checkpoint_process_group())
    train(model, optimizer, steps=1, seed=10, device_type="cuda")
    pending.wait(timeout=60)
    model, optimizer = sharded_mlp(seed=1, world_size=world_size, device_type="cuda")
    assert_bitwise(load_sharded_checkpoint(os.path.join(folder, E1), model, optimizer), extra_of(rank))
    loaded = local_state(model, optimizer)
    assert all(tensor.is_cuda for tensor in loaded["params"].values())
    assert_bitwise(loaded, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_save_of_cuda_shards_in_a_cpu_and_cuda_process_group(tmp_path):
    folder = str(tmp_path / "checkpoint_model")
    os.makedirs(folder)
    context = multiprocessing.get_context("spawn")  # a fresh CUDA context in the child
    process = context.Process(target=_rank_main, args=(_cuda_async_save_and_load, 0, 1, f"file://{tmp_path / 'store'}",
                                                       (folder,), "cpu:gloo,cuda:nccl"))
    process.start()
    process.join(180)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the CUDA process did not finish within 180 s")
    assert process.exitcode == 0, f"the CUDA process failed (exit code {process.exitcode}); its traceback is above"
    assert is_sharded_checkpoint(os.path.join(folder, E1))
    model = mlp(seed=2)
    model.load_state_dict(torch.load(consolidate_sharded_checkpoint(os.path.join(folder, E1),
                                                                    str(tmp_path / "final.pth")), weights_only=True))


def test_checkpoint_listing_finding_loading_and_pruning_know_sharded_folders(tmp_path):
    """The checkpoint helpers every callback and loader uses treat a complete folder as a checkpoint, ordered by
    the training progress its name stands for among .pth files; interrupted saves are never found."""
    from aitoolbox.experiment.local_save.checkpoints import (
        SHARDED_CHECKPOINT_KEY, find_checkpoint, list_checkpoints, load_checkpoint_file, prune_checkpoints)
    from aitoolbox.experiment.local_save.sharded_checkpoints import read_full_model_state_dict

    folder = tmp_path / "checkpoint_model"
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=1, seed=0)
    extra = {"epoch": 1, "optimizer_state_dict": {"param_groups": [{"lr": 0.5}]}}
    for name in ("model_x_ts_E1_ITER4", "model_x_ts_E1"):
        save_sharded_checkpoint(str(folder / name), model, optimizer, extra).wait()
    torch.save({"model_state_dict": model.state_dict()}, folder / "model_x_ts_E0.pth")
    os.makedirs(folder / f"{TEMP_PREFIX}model_x_ts_E2")  # an interrupted save
    os.makedirs(folder / "model_x_ts_E3")  # a folder without its marker
    assert [os.path.basename(path) for path in list_checkpoints(str(folder))] == [
        "model_x_ts_E0.pth", "model_x_ts_E1_ITER4", "model_x_ts_E1"]
    assert find_checkpoint(str(tmp_path)) == str(folder / "model_x_ts_E1")
    assert find_checkpoint(str(folder / "model_x_ts_E1_ITER4.pth")) == str(folder / "model_x_ts_E1_ITER4")

    loaded = load_checkpoint_file(str(folder / "model_x_ts_E1"))
    assert loaded["epoch"] == 1 and loaded[SHARDED_CHECKPOINT_KEY] == str(folder / "model_x_ts_E1")
    assert "model_state_dict" not in loaded  # the weights stay on disk until a model is there to take them
    full = read_full_model_state_dict(loaded[SHARDED_CHECKPOINT_KEY])
    assert full.keys() == model.state_dict().keys()
    assert all(torch.equal(full[key], value) for key, value in model.state_dict().items())

    deleted = prune_checkpoints([(1.0, str(folder / "model_x_ts_E1_ITER4")), (0.5, str(folder / "model_x_ts_E1"))],
                                keep_best=1, keep_always=[], higher_is_better=False)
    assert deleted == [str(folder / "model_x_ts_E1_ITER4")]
    assert [os.path.basename(path) for path in list_checkpoints(str(folder))] == [
        "model_x_ts_E0.pth", "model_x_ts_E1"]
