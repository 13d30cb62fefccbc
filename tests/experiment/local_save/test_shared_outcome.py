"""A sharded save that fails on rank 0 alone fails on every rank, with the same error, and none hangs or returns
the path of an incomplete checkpoint. Real faults in two real processes: a file size limit (RLIMIT_FSIZE: EFBIG)
in rank 0 only, and rank 0 without the permission to complete the folder (an effective user that may not rename
a checkpoint another user owns in a sticky folder, as in /tmp); kills with SIGKILL leave temporary folders that
the next save removes; a directory fsync the file system refuses is no failure."""
import errno
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import tempfile
import time

import pytest
import torch

from aitoolbox.experiment.local_save import atomic, leftovers
from aitoolbox.experiment.local_save.leftovers import OWNER_FILE, TEMP_PREFIX, remove_stale_temporaries
from aitoolbox.experiment.local_save.sharded_checkpoints import (
    checkpoint_process_group, is_sharded_checkpoint, save_sharded_checkpoint)
from aitoolbox.experiment.local_save.shared_outcome import describe_failure, rebuild_failure
from tests.distributed_helpers import run_distributed
from tests.experiment.local_save.test_sharded_checkpoints import (
    extra_of, plain_model_and_optimizer, sharded_mlp, train)
from tests.killed_writes import BlockWhenPickled

NOBODY = 65534


def _outcome(call) -> tuple:
    """What a call raised, as every rank can compare it: (type, errno, message); or ('returned', value)."""
    try:
        return "returned", call()
    except Exception as error:  # noqa: BLE001 - the outcome is what the test compares
        return type(error).__name__, getattr(error, "errno", None), str(error)


# --- a file size limit in rank 0 only ---------------------------------------------------------------------------
def _save_with_a_file_size_limit_on_rank_0(rank: int, world_size: int, folder: str) -> tuple:
    model, optimizer = sharded_mlp(seed=0, world_size=world_size)
    train(model, optimizer, steps=1, seed=rank)
    if rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    outcome = _outcome(lambda: save_sharded_checkpoint(os.path.join(folder, "model_x_ts_E1"), model, optimizer,
                                                       extra_of(rank)).wait())
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    # Both ranks go on together: a later save succeeds.
    later = save_sharded_checkpoint(os.path.join(folder, "model_x_ts_E2"), model, optimizer, extra_of(rank)).wait()
    return outcome, later


def test_a_file_size_limit_on_rank_0_fails_the_save_on_every_rank_alike(tmp_path):
    outcomes = run_distributed(_save_with_a_file_size_limit_on_rank_0, 2, (str(tmp_path),), timeout=240)
    (kind, code, message), later = outcomes[0]
    assert (kind, code) == ("OSError", errno.EFBIG) and "File too large" in message and "(on rank 0)" in message
    assert outcomes[1][0] == outcomes[0][0]  # the same error on rank 1, which had no limit
    assert later == str(tmp_path / "model_x_ts_E2")
    assert sorted(os.listdir(tmp_path)) == ["model_x_ts_E2"]  # nothing left of the failed save


# --- rank 0 may not complete the folder ------------------------------------------------------------------------
def _async_save_that_rank_0_cannot_complete(rank: int, world_size: int, folder: str) -> tuple:
    model, optimizer = sharded_mlp(seed=0, world_size=world_size)
    train(model, optimizer, steps=1, seed=rank)
    path = os.path.join(folder, "model_x_ts_E1")
    save_sharded_checkpoint(path, model, optimizer, extra_of(rank)).wait()  # by root: root owns it
    group = checkpoint_process_group(timeout_s=120)
    if rank == 0:
        os.seteuid(NOBODY)  # a sticky folder lets nobody rename what root owns: the replacing rename fails
    try:
        pending = save_sharded_checkpoint(path, model, optimizer, extra_of(rank), async_save=True,
                                          process_group=group)
        train(model, optimizer, steps=1, seed=rank)  # training goes on meanwhile
        outcome = _outcome(lambda: pending.wait(timeout=120))
    finally:
        if rank == 0:
            os.seteuid(0)
    return outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user in rank 0 only")
def test_an_async_save_rank_0_cannot_complete_fails_on_every_rank_and_no_rank_returns_its_path():
    folder = tempfile.mkdtemp(prefix="aitoolbox_sticky_")  # not under pytest's folder, which nobody cannot enter
    try:
        os.chmod(folder, 0o1777)
        outcomes = run_distributed(_async_save_that_rank_0_cannot_complete, 2, (folder,), timeout=240)
        assert outcomes[1] == outcomes[0]  # before: rank 1's wait() returned the path of an incomplete folder
        kind, code, message = outcomes[0]
        assert (kind, code) == ("PermissionError", errno.EPERM), outcomes
        assert message.startswith(f"[Errno {errno.EPERM}] cannot complete the checkpoint {folder}/model_x_ts_E1")
        assert sorted(os.listdir(folder)) == ["model_x_ts_E1"]  # the first save, intact; no temporary folder
        assert is_sharded_checkpoint(os.path.join(folder, "model_x_ts_E1"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait_while_rank_0_does_not_answer(rank: int, init_method: str, job_timeout_s: float, folder: str) -> None:
    from datetime import timedelta
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                                         timeout=timedelta(seconds=job_timeout_s))  # as fit_distributed(timeout_s=)
    group = checkpoint_process_group()  # takes the job's timeout
    raised = os.path.join(folder, "rank1_raised")
    if rank == 0:  # does not answer until rank 1 gave up (or the test's hang detector fires)
        while not os.path.exists(raised):
            time.sleep(0.05)
        return
    try:
        torch.distributed.barrier(group=group)
        outcome = "returned"
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {error}"
    with open(raised + ".tmp", "w") as handle:
        handle.write(outcome)
    os.rename(raised + ".tmp", raised)


@pytest.mark.slow
@pytest.mark.extended
def test_the_checkpoint_group_takes_the_timeout_of_the_job(tmp_path):
    """Made with torch's default, a save's collective waited 30 minutes for a process that does not answer."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    processes = [context.Process(target=_wait_while_rank_0_does_not_answer, daemon=True,
                                 args=(rank, f"file://{tmp_path / 'store'}", 15.0, str(tmp_path)))
                 for rank in range(2)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 240  # a hang detector: the job's timeout is 15 s, torch's default 30 minutes
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in processes:
        process.kill()
        process.join()
    assert os.path.exists(tmp_path / "rank1_raised"), "rank 1 still waited for rank 0 after 240 s"
    outcome = (tmp_path / "rank1_raised").read_text()
    assert outcome != "returned" and "timed out" in outcome.lower(), outcome


# --- errors travel alike -----------------------------------------------------------------------------------------
def test_failures_are_rebuilt_with_their_type_errno_and_message():
    rebuilt = rebuild_failure(describe_failure(OSError(errno.ENOSPC, "cannot write x"), 0))
    assert type(rebuilt) is OSError and rebuilt.errno == errno.ENOSPC
    assert str(rebuilt) == "[Errno 28] cannot write x (on rank 0)"
    assert type(rebuild_failure(describe_failure(PermissionError(errno.EACCES, "no"), 1))) is PermissionError
    assert str(rebuild_failure(describe_failure(ValueError("bad"), 1))) == "bad (on rank 1)"

    class Custom(Exception):
        pass
    assert str(rebuild_failure(describe_failure(Custom("odd"), 2))) == "Custom: odd (on rank 2)"


# --- leftovers of killed saves -----------------------------------------------------------------------------------
def _save_until_blocked(folder: str, started: str) -> None:
    # A forked child of a process that already computed with several threads hangs when OpenMP starts threads.
    torch.set_num_threads(1)
    model, optimizer = plain_model_and_optimizer(seed=0)
    train(model, optimizer, steps=1, seed=0)
    optimizer.param_groups[0]["blocks"] = BlockWhenPickled(started)
    save_sharded_checkpoint(os.path.join(folder, "model_x_ts_E1"), model, optimizer, {"epoch": 1})


def _dead_pid() -> int:
    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    process.start()
    process.join()
    return process.pid


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_the_next_save_removes_what_killed_saves_left_and_keeps_what_live_ones_write(tmp_path):
    folder = str(tmp_path)
    started = str(tmp_path.parent / f"{tmp_path.name}_started")
    writer = multiprocessing.get_context("fork").Process(target=_save_until_blocked, args=(folder, started))
    writer.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(started):
        assert writer.is_alive() and time.monotonic() < deadline, "the save did not start writing"
        time.sleep(0.02)
    writer.kill()  # SIGKILL mid-save, as the OOM killer or a node failure would
    writer.join()
    killed = os.path.join(folder, TEMP_PREFIX + "model_x_ts_E1")
    assert os.path.isdir(killed) and os.path.isfile(os.path.join(killed, OWNER_FILE))

    host = socket.gethostname()
    dead_file = os.path.join(folder, f"{TEMP_PREFIX}model_x_ts_E0.pth.{_dead_pid()}-1a2b@{host}.abc_12")
    open(dead_file, "wb").close()  # what a killed torch_save_atomic leaves
    aside = os.path.join(folder, f"{TEMP_PREFIX}model_x_ts_E0.old")  # a removal killed midway
    os.makedirs(aside)
    # Kept: a save a live process writes (this one, another one here), and one of another host, still changing.
    sleeper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    sleeper.start()
    try:
        kept = []
        this_process = {"host": host, "pid": os.getpid(), "token": leftovers._ProcessIdentity.token(), "job": ""}
        for name, owner in (("live_here", {"host": host, "pid": sleeper.pid, "token": "77", "job": ""}),
                            ("this_process", this_process),
                            ("other_host", {"host": host + "-elsewhere", "pid": 1, "token": "77", "job": ""})):
            path = os.path.join(folder, f"{TEMP_PREFIX}model_x_ts_{name}")
            os.makedirs(path)
            with open(os.path.join(path, OWNER_FILE), "w") as handle:
                json.dump(owner, handle)
            kept.append(os.path.basename(path))
        live_file = f"{TEMP_PREFIX}model_x_ts_E5.pth.{sleeper.pid}-77@{host}.xyz"
        open(os.path.join(folder, live_file), "wb").close()
        kept.append(live_file)
        # An earlier process of this host that had this pid (a restarted container): its token differs.
        earlier = os.path.join(folder, f"{TEMP_PREFIX}model_x_ts_E6")
        os.makedirs(earlier)
        with open(os.path.join(earlier, OWNER_FILE), "w") as handle:
            json.dump(dict(this_process, token="0000"), handle)

        model, optimizer = plain_model_and_optimizer(seed=1)
        save_sharded_checkpoint(os.path.join(folder, "model_x_ts_E2"), model, optimizer, {"epoch": 2}).wait()
        assert sorted(os.listdir(folder)) == sorted(kept + ["model_x_ts_E2"])
    finally:
        sleeper.kill()
        sleeper.join()
    # Its owner gone, the live one's leftovers go at the next cleanup; another host's only once quiet for long.
    assert sorted(os.listdir(folder)) == sorted(kept + ["model_x_ts_E2"])
    removed = {os.path.basename(path) for path in remove_stale_temporaries(folder)}
    assert removed == {f"{TEMP_PREFIX}model_x_ts_live_here", live_file}


def test_a_directory_fsync_the_file_system_refuses_is_not_a_failure(caplog):
    fd = os.open("/proc", os.O_RDONLY)  # procfs refuses fsync with EINVAL, as some FUSE and CIFS mounts do
    try:
        with pytest.raises(OSError) as refused:
            os.fsync(fd)
        assert refused.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    atomic._fsync_directory("/proc")  # before: OSError EINVAL turned a good save into a failure
    with pytest.raises(FileNotFoundError):
        atomic._fsync_directory("/no/such/folder")  # other errors still count


def test_a_requeued_job_on_another_host_removes_the_temporary_file_its_killed_save_left(tmp_path, monkeypatch):
    """Issue 33 item 10: temporary files recorded no job, so a requeued job on another host kept its killed save's
    full-size temporary file for an hour (its temporary folder went at once). The file's name now carries the job
    (a short hash of its id): the same job removes it at its next save, another job's stays until quiet."""
    folder = str(tmp_path)
    monkeypatch.delenv("AITOOLBOX_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    with atomic.atomic_write(os.path.join(folder, "model_x_ts_E3.pth")) as handle:
        handle.write(b"half a checkpoint")
        (written,) = [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)]
        # What the same save on the killed job's host left (another host name, a pid long gone), and one of
        # another job there.
        other_host = written.replace(f"@{socket.gethostname()}.", "@gpu-node-17.")
        assert other_host != written
        os.link(os.path.join(folder, written), os.path.join(folder, other_host))
        monkeypatch.setenv("SLURM_JOB_ID", "4")
        with atomic.atomic_write(os.path.join(folder, "model_y_ts_E3.pth")) as other_job:
            other_job.write(b"x")
            other_job_file = [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)
                              and "model_y" in name][0].replace(f"@{socket.gethostname()}.", "@gpu-node-18.")
            os.link(os.path.join(folder, [name for name in os.listdir(folder) if "model_y" in name][0]),
                    os.path.join(folder, other_job_file))
        monkeypatch.setenv("SLURM_JOB_ID", "31337")  # the requeued job
        removed = {os.path.basename(path) for path in remove_stale_temporaries(folder)}
        assert removed == {other_host}  # not this process's save in flight, not the other job's
    assert sorted(os.listdir(folder)) == sorted([other_job_file, "model_x_ts_E3.pth", "model_y_ts_E3.pth"])
