"""Signals to a fit_distributed launcher beyond the fault matrix (``test_signal_matrix.py``), with real processes
and real signals: SIGHUP with sharded (FSDP) checkpoints, SIGKILL of the launcher (its workers die with it), a
batch that outlasts the grace period (the processes are killed), and the launcher's death watch.
"""
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from aitoolbox.torchtrain.distributed import worker
from tests.torchtrain.distributed.support import (
    assert_state_dicts_equal, make_train_loop, process_alive, recorded_pids, script_env, wait_until_gone)

SCRIPT = textwrap.dedent("""
    import os
    import sys
    import time
    from pathlib import Path

    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
    from aitoolbox.torchtrain.callbacks.model_save import ModelCheckpoint
    from tests.torchtrain.distributed.support import RecordPid, make_train_loop


    class SlowBatches(AbstractCallback):
        '''Batches take a while (time for the test to signal); rank 0 marks the start of epoch 1.'''

        def __init__(self, folder):
            super().__init__("slow batches")
            self.folder = folder
            self.hang = sys.argv[4] == "hang"

        def on_epoch_begin(self):
            tl = self.train_loop_obj
            if tl.epoch == 1 and tl.strategy.rank == 0:
                Path(self.folder, "epoch1").write_text("")

        def on_batch_end(self):
            # "hang": from epoch 1 on, a batch outlasts any grace period
            time.sleep(300 if self.hang and self.train_loop_obj.epoch >= 1 else 0.4)


    if __name__ == "__main__":
        import signal
        for name in ("SIGTERM", "SIGHUP"):  # the handling the tests rely on, whatever was inherited (nohup)
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        folder, num_epochs = sys.argv[1], int(sys.argv[2])
        tl = make_train_loop(gpu_mode=sys.argv[5], shuffle=True)
        callbacks = [ModelCheckpoint(project_name="proj", experiment_name="exp", local_model_result_folder_path=folder),
                     RecordPid(folder), SlowBatches(folder)]
        if "RANK" in os.environ:  # under torchrun
            Path(folder, f"pid-rank{os.environ['RANK']}").write_text(str(os.getpid()))
            tl.fit_distributed(num_epochs=num_epochs, callbacks=callbacks)
        else:
            tl.fit_distributed(num_epochs=num_epochs, callbacks=callbacks, num_cpu_processes=2, start_method="fork",
                               signal_grace_s=float(sys.argv[3]))
""")
NUM_EPOCHS = 4


def start(tmp_path, num_epochs: int, grace_s: float = 60.0, torchrun: bool = False,
          hang: bool = False, gpu_mode: str = "ddp") -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    return subprocess.Popen(launcher + [str(script), str(tmp_path), str(num_epochs), str(grace_s),
                                        "hang" if hang else "run", gpu_mode],
                            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-5000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def kill_launcher_and_workers(process, folder) -> None:
    """Whatever the test saw: no launcher or worker of it outlives the test."""
    process.kill()
    for pid in worker_pids(folder):
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def worker_pids(folder) -> list:
    return [pid for name, pid in recorded_pids(folder).items() if name.startswith("pid-rank")]


def signal_in_epoch_1(tmp_path, signum, num_epochs: int = NUM_EPOCHS, **start_options):
    process = start(tmp_path, num_epochs, **start_options)
    try:
        wait_for(tmp_path / "epoch1", process)
        pids = worker_pids(tmp_path)
        assert len(pids) == 2
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=180)
        left = wait_until_gone(pids, timeout_s=30)
    finally:
        kill_launcher_and_workers(process, tmp_path)
    assert not left, f"training processes {left} outlived the launcher"
    saved = glob.glob(str(tmp_path / "proj" / "exp_*" / "checkpoint_model" / "*_E1_ITER*"))
    return process.returncode, stderr, saved


def assert_resume_equals_straight(checkpoint_path: str, gpu_mode: str = "ddp") -> None:
    straight = make_train_loop(gpu_mode=gpu_mode, shuffle=True)
    straight.fit_distributed(num_epochs=NUM_EPOCHS, num_cpu_processes=2, start_method="fork")
    resumed = make_train_loop(gpu_mode=gpu_mode, shuffle=True)
    resumed.load_checkpoint(checkpoint_path)
    resumed.fit_distributed(num_epochs=NUM_EPOCHS, num_cpu_processes=2, start_method="fork")
    assert_state_dicts_equal(resumed.model.state_dict(), straight.model.state_dict())
    assert resumed.train_history == straight.train_history


@pytest.mark.slow
@pytest.mark.extended
def test_sighup_to_the_launcher_stops_the_same_way_also_with_sharded_checkpoints(tmp_path):
    returncode, stderr, saved = signal_in_epoch_1(tmp_path, signal.SIGHUP, gpu_mode="fsdp")
    assert returncode == 128 + signal.SIGHUP, stderr[-5000:]
    assert len(saved) == 1 and os.path.isdir(saved[0]), stderr[-5000:]  # a DCP folder
    assert_resume_equals_straight(saved[0], gpu_mode="fsdp")


@pytest.mark.slow
def test_sigkill_of_the_launcher_takes_its_workers_with_it(tmp_path):
    process = start(tmp_path, num_epochs=1000)
    try:
        wait_for(tmp_path / "epoch1", process)
        pids = worker_pids(tmp_path)
        process.kill()
        process.wait(timeout=60)  # not communicate: orphaned workers would hold its output pipes open
        left = wait_until_gone(pids, timeout_s=30)
    finally:
        kill_launcher_and_workers(process, tmp_path)
    assert not left, f"training processes {left} outlived the launcher killed by SIGKILL"


@pytest.mark.slow
@pytest.mark.extended
def test_workers_that_do_not_stop_within_the_grace_period_are_killed(tmp_path):
    """A batch that outlasts signal_grace_s: no checkpoint can be written; the processes are killed."""
    returncode, stderr, saved = signal_in_epoch_1(tmp_path, signal.SIGTERM, grace_s=2.0, hang=True)
    assert returncode == 128 + signal.SIGTERM, stderr[-5000:]
    assert "grace period" in stderr
    assert saved == []


def test_signal_grace_s_must_be_a_positive_number():
    tl = make_train_loop(gpu_mode="ddp")
    for bad in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match="signal_grace_s must be a number of seconds > 0"):
            tl.fit_distributed(num_epochs=1, signal_grace_s=bad)


def _child_dying_with_the_launcher(pid_queue, fallback: bool) -> None:
    if fallback:  # the check used where prctl is unavailable (macOS)
        threading.Thread(target=worker._exit_when_launcher_gone,
                         args=(multiprocessing.parent_process(), os.getppid()), daemon=True).start()
    else:
        worker.die_with_parent()
    pid_queue.put(os.getpid())
    time.sleep(120)


def _launcher(start_method: str, pid_queue, fallback: bool) -> None:
    multiprocessing.get_context(start_method).Process(target=_child_dying_with_the_launcher,
                                                      args=(pid_queue, fallback)).start()
    time.sleep(120)


@pytest.mark.slow
@pytest.mark.parametrize("start_method, fallback", [("fork", True), ("forkserver", False),
                                                      pytest.param("spawn", False, marks=pytest.mark.extended)])
def test_a_process_dies_with_a_launcher_killed_by_sigkill(start_method, fallback):
    """Under forkserver the parent is the fork server, not the launcher: the launcher's end counts."""
    pid_queue = multiprocessing.get_context("spawn").Queue()
    # A fresh interpreter as the launcher: forked from pytest it would inherit the fork server other tests of the
    # session started, and its forkserver children would be that server's, not its own.
    launcher = multiprocessing.get_context("spawn").Process(target=_launcher, args=(start_method, pid_queue, fallback))
    launcher.start()
    try:
        pid = pid_queue.get(timeout=240)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.join()
        left = wait_until_gone([pid], timeout_s=30)
    finally:
        launcher.kill()
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left
