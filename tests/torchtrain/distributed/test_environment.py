"""Where a process sits in a job: our own launch (processes per node, rendezvous), or one prepared by torchrun,
SLURM or OpenMPI, which fit_distributed joins instead of spawning."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aitoolbox.torchtrain.distributed.environment import ProcessPlacement, detect_external_launcher, job_master_port
from aitoolbox.torchtrain.train_loop.distributed_fit import processes_per_node, rendezvous
from tests.torchtrain.distributed.support import (
    assert_state_dicts_equal, free_port, make_model, run_scripts_together, script_env, torchrun_environments)


# --- detect_external_launcher on fake environments ---------------------------------------------------------------
def test_a_plain_process_is_not_part_of_an_external_job():
    assert detect_external_launcher({}) is None
    assert detect_external_launcher({"PATH": "/usr/bin", "MASTER_PORT": "1234"}) is None


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    assert detect_external_launcher(env) == ProcessPlacement(3, 1, 4, "node0", 29400, "torchrun")
    # torchrun prepared the rendezvous: its address wins over fit_distributed's arguments.
    assert detect_external_launcher(env, master_addr="elsewhere", master_port=8888) == \
        ProcessPlacement(3, 1, 4, "node0", 29400, "torchrun")
    # Inside a SLURM allocation, torchrun's variables describe this process.
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "gpu[1-2]"}
    assert detect_external_launcher({**slurm, **env}).launcher == "torchrun"


@pytest.mark.parametrize("nodelist, first_host", [
    ("node7", "node7"),
    ("gpu03,gpu04", "gpu03"),
    ("gpu[03-05,08],cpu1", "gpu03"),
    ("gpu[08,03-05]", "gpu08"),
    ("a-b[01-02],c", "a-b01"),
    ("rack[1-2]-node[01-04]", "rack1-node01"),
    ("n[7]", "n7"),
])
def test_slurm_environment_finds_the_first_host_of_the_node_list(nodelist, first_host):
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODELIST": nodelist,
           "SLURM_JOB_NAME": "train"}
    assert detect_external_launcher(env) == ProcessPlacement(5, 1, 8, first_host, 29500, "slurm")


def test_slurm_environment_address_and_port_overrides():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODELIST": "gpu[1-2]"}
    assert detect_external_launcher({**env, "MASTER_PORT": "4000"}).master_port == 4000
    assert detect_external_launcher({**env, "MASTER_ADDR": "10.0.0.1"}).master_addr == "10.0.0.1"
    placement = detect_external_launcher(env, master_addr="head", master_port=5000)
    assert (placement.master_addr, placement.master_port) == ("head", 5000)


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "gpu1", "SLURM_JOB_NAME": "bash"},  # salloc shell
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "gpu1"},  # sbatch running python directly
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
], ids=["interactive-slurm", "single-slurm-task", "single-mpi-rank"])
def test_a_single_task_or_interactive_shell_launches_its_own_processes(env):
    assert detect_external_launcher(env) is None


def test_openmpi_environment():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert detect_external_launcher(env) == ProcessPlacement(1, 1, 2, "127.0.0.1", 29500, "openmpi")
    across_nodes = {**env, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}
    with pytest.raises(ValueError, match="pass master_addr"):
        detect_external_launcher(across_nodes)
    assert detect_external_launcher({**across_nodes, "MASTER_ADDR": "head"}).master_addr == "head"
    assert detect_external_launcher(across_nodes, master_addr="head", master_port=7000) == \
        ProcessPlacement(3, 1, 4, "head", 7000, "openmpi")


# --- our own launch ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback applies without CUDA")
def test_processes_per_node_without_cuda():
    with pytest.warns(UserWarning, match="2 CPU processes over gloo"):
        assert processes_per_node(0, 2) == 2  # num_gpus=torch.cuda.device_count() on a CPU machine
    with pytest.warns(UserWarning, match="3 CPU processes"):
        assert processes_per_node(None, 3) == 3
    with pytest.warns(UserWarning, match="4 CPU processes"):
        assert processes_per_node(4, 2) == 4  # num_gpus > 0 counts CPU processes
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_gpus must be a non-negative int"):
            processes_per_node(bad, 2)


def _without_reservation(result):
    addr, port, reservation = result
    if reservation is not None:
        reservation.close()
    return addr, port


def test_rendezvous(monkeypatch):
    for name in ("AITOOLBOX_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert _without_reservation(rendezvous(1, 0, None, None))[0] == "127.0.0.1"
    port = free_port()
    assert _without_reservation(rendezvous(1, 0, "127.0.0.1", port)) == ("127.0.0.1", port)
    assert _without_reservation(rendezvous(2, 1, "10.0.0.1", None)) == ("10.0.0.1", 29500)
    assert _without_reservation(rendezvous(2, 1, "10.0.0.1", 1234)) == ("10.0.0.1", 1234)  # node 0's to check
    with pytest.raises(ValueError, match="pass master_addr"):
        rendezvous(2, 0, None, None)


def test_the_rendezvous_port_stays_reserved_until_the_store_binds_it():
    """Another job's socket that tries to take the chosen port before the store binds it is refused; the store
    (bound later, as rank 0 does in init_process_group) gets it. A busy requested port is replaced."""
    import socket
    from datetime import timedelta
    import torch.distributed as dist

    addr, port, reservation = rendezvous(1, 0, None, None)
    with reservation:
        thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with thief, pytest.raises(OSError) as refused:
            thief.bind((addr, port))
            thief.listen()
        assert refused.value.errno == errno.EADDRINUSE
        # Rank 0's store serves on the reserved socket itself.
        store = dist.TCPStore(addr, port, 1, True, timeout=timedelta(seconds=30),
                              master_listen_fd=os.dup(reservation.fileno()))
        store.set("key", "value")
        assert store.get("key") == b"value"
        del store
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        addr, port, reservation = rendezvous(1, 0, None, busy)
        reservation.close()
        assert port != busy


def test_a_reserved_port_keeps_other_jobs_off_also_when_they_use_so_reuseaddr():
    """Issue 33 item 9: both sockets used SO_REUSEADDR and neither listened, so a second job bound the same port
    and the two jobs' stores then fought over it. Reserved now, the port is listening: no bind succeeds, whatever
    the other socket's options, and a second reservation of it fails at once."""
    import socket
    from aitoolbox.torchtrain.distributed.environment import PortReservation

    with PortReservation() as reservation:
        for host in ("127.0.0.1", "0.0.0.0"):
            other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with other, pytest.raises(OSError) as refused:
                other.bind((host, reservation.port))
            assert refused.value.errno == errno.EADDRINUSE
        with pytest.raises(OSError):
            PortReservation(reservation.port)
    PortReservation(reservation.port).close()  # released with the reservation


def test_several_nodes_agree_on_a_port_of_the_job_and_node_0_refuses_a_busy_one(monkeypatch):
    import socket
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("AITOOLBOX_RUN_ID", raising=False)
    ports = {_without_reservation(rendezvous(2, rank, "127.0.0.1", None))[1] for rank in (1, 0)}
    assert len(ports) == 1 and 29510 <= ports.pop() < 39510
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert _without_reservation(rendezvous(2, 1, "127.0.0.1", None))[1] != job_master_port({"SLURM_JOB_ID": "4242"})
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(OSError, match="pass a free master_port"):
            rendezvous(2, 0, "127.0.0.1", taken.getsockname()[1])


# --- joining a job started by someone else -------------------------------------------------------------------------
JOIN_SCRIPT = textwrap.dedent("""
    import multiprocessing
    import os
    import sys

    import torch
    import torch.distributed as dist

    from tests.torchtrain.distributed.support import make_train_loop

    if __name__ == "__main__":
        tl = make_train_loop()
        # master_port is ignored: the launcher's MASTER_PORT is the rendezvous.
        model = tl.fit_distributed(num_epochs=2, num_gpus=2, master_port=1)
        assert multiprocessing.active_children() == [], multiprocessing.active_children()  # joined, spawned nothing
        rank = int(os.environ["RANK"])
        torch.save({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "state_dict": model.state_dict(),
                    "epoch": tl.epoch, "pid": os.getpid()}, os.path.join(sys.argv[1], f"rank{rank}.pt"))
""")


def check_joined_results(folder):
    results = [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [(r["rank"], r["world_size"], r["epoch"]) for r in results] == [(0, 2, 1), (1, 2, 1)]
    assert_state_dicts_equal(results[0]["state_dict"], results[1]["state_dict"])
    assert not torch.equal(results[0]["state_dict"]["out.weight"], make_model().state_dict()["out.weight"])
    return results


FSDP_JOIN_SCRIPT = textwrap.dedent("""
    import os
    import sys

    import torch

    from tests.torchtrain.distributed.support import make_train_loop

    if __name__ == "__main__":
        tl = make_train_loop(gpu_mode="fsdp")
        model = tl.fit_distributed(num_epochs=2, num_gpus=2)
        full = tl.strategy.model_state_dict(model)  # a collective: gathered to rank 0
        rank = int(os.environ["RANK"])
        torch.save({"full": full, "sharded": type(model.hidden.weight).__name__, "epoch": tl.epoch},
                   os.path.join(sys.argv[1], f"rank{rank}.pt"))
""")


@pytest.mark.slow
@pytest.mark.extended
def test_torchrun_style_environment_joins_an_fsdp_job(tmp_path):
    """Under torchrun each process keeps its sharded model; the full weights are gathered on request."""
    script = tmp_path / "join_fsdp.py"
    script.write_text(FSDP_JOIN_SCRIPT)
    run_scripts_together([[script, tmp_path]] * 2, torchrun_environments(2))
    rank0, rank1 = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert rank0["sharded"] == rank1["sharded"] == "DTensor" and rank0["epoch"] == 1
    assert rank1["full"] == {} and set(rank0["full"]) == set(make_model().state_dict())
    assert not torch.equal(rank0["full"]["out.weight"], make_model().state_dict()["out.weight"])


def test_torchrun_style_environment_joins_without_spawning(tmp_path):
    """Two processes started by the test with torchrun's variables form the job themselves."""
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    port = str(free_port())
    processes = []
    for rank in (0, 1):
        env = script_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        processes.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [process.communicate(timeout=300) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    results = check_joined_results(tmp_path)
    assert [r["pid"] for r in results] == [process.pid for process in processes]  # trained in the started processes
    assert "CUDA is not available" not in outputs[0][1]  # nothing was launched, so no CPU-process warning


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    """``python -m torch.distributed.run --nproc_per_node=2 script.py``: the script's fit_distributed joins."""
    script = tmp_path / "join.py"
    script.write_text(JOIN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               str(tmp_path)]
    result = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=180,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-5000:]
    check_joined_results(tmp_path)
