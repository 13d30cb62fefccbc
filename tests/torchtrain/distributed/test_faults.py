"""fit_distributed when things go wrong: a failing or killed rank, unpicklable parts, a script without a
``__main__`` guard, a busy port. Failures must surface fast, with the cause, and leave no process behind."""
import socket
import textwrap
import time

import pytest
from torch.utils.data import DataLoader

from tests.torchtrain.distributed.support import (
    FailOnRank, PidFileWorkerInit, RecordPid, RecordRankResult, Regressor, child_pids, load_rank_results,
    make_train_loop, recorded_pids, regression_data, run_script, wait_until_gone)

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")

# Not a speed requirement, a hang detector: a failure must not wait for the 600 s collective timeout. Generous,
# so that a loaded machine never fails it.
HANG_DEADLINE_S = 120.0


def train_loop_with_loader_workers(pid_folder):
    """A TrainLoop whose training loader runs one worker process per rank, each recording its pid."""
    tl = make_train_loop()
    tl.train_loader = DataLoader(regression_data(32), batch_size=4, num_workers=1,
                                 worker_init_fn=PidFileWorkerInit(pid_folder))
    return tl


def assert_no_process_left(pid_folder):
    pids = recorded_pids(pid_folder)
    assert {"pid-rank0", "pid-rank1"} <= set(pids)
    assert any(name.startswith("pid-worker") for name in pids)  # the loader workers did run
    assert wait_until_gone(pids.values()) == [], f"left running: {pids}"


def test_a_raising_rank_fails_the_run_with_its_traceback(tmp_path):
    tl = train_loop_with_loader_workers(tmp_path)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        tl.fit_distributed(num_epochs=3, callbacks=[RecordPid(tmp_path), FailOnRank(rank=1, epoch=1)],
                           num_gpus=2, start_method="fork")
    assert time.monotonic() - start < HANG_DEADLINE_S
    message = str(error.value)
    assert "rank 1 failed with ValueError: deliberate failure on rank 1 at epoch 1" in message
    assert "Traceback of rank 1" in message and "in on_epoch_begin" in message  # the rank's own traceback
    assert_no_process_left(tmp_path)
    # The parent's TrainLoop is untouched: nothing of the failed run was adopted.
    assert not any(tl.train_history.values()) and tl.epoch == 0


@pytest.mark.parametrize("how, expected", [("kill", "rank 1 was killed by signal SIGKILL"),
                                           ("exit", "rank 1 exited with code 3 without reporting an error")])
def test_a_rank_dying_without_a_report_is_named_and_the_others_do_not_hang(tmp_path, how, expected):
    """Rank 1 dies by SIGKILL (as under the OOM killer) or exits abruptly; rank 0, blocked in a collective,
    then fails too ("connection closed by peer"), but the error names the rank that died first."""
    tl = train_loop_with_loader_workers(tmp_path)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=expected) as error:
        tl.fit_distributed(num_epochs=3, callbacks=[RecordPid(tmp_path), FailOnRank(rank=1, epoch=1, how=how)],
                           num_gpus=2, start_method="fork")
    assert "rank 0" not in str(error.value)
    assert time.monotonic() - start < HANG_DEADLINE_S
    assert_no_process_left(tmp_path)


class CallbackHoldingLambda(RecordPid):
    def __init__(self, folder):
        super().__init__(folder)
        self.transform = lambda value: value


class RegressorHoldingLambda(Regressor):
    def __init__(self):
        super().__init__()
        self.transform = lambda value: value


@pytest.mark.parametrize("part", ["model", "train_loader", "callback"])
def test_unpicklable_parts_are_named_before_any_process_starts(tmp_path, part):
    """spawn sends the TrainLoop to fresh interpreters: a lambda anywhere in it must fail early and clearly."""
    tl = make_train_loop(RegressorHoldingLambda() if part == "model" else None)
    if part == "train_loader":
        tl.train_loader = DataLoader(regression_data(32), batch_size=4, collate_fn=lambda batch: batch)
    callbacks = [CallbackHoldingLambda(tmp_path)] if part == "callback" else None
    children_before = set(child_pids())
    with pytest.raises(TypeError) as error:
        tl.fit_distributed(num_epochs=1, callbacks=callbacks, num_gpus=2, start_method="spawn")
    expected = {"model": "the model cannot be pickled", "train_loader": "the train_loader cannot be pickled",
                "callback": "the callback CallbackHoldingLambda cannot be pickled"}[part]
    assert expected in str(error.value)
    assert "lambda" in str(error.value)
    assert set(child_pids()) <= children_before
    assert recorded_pids(tmp_path) == {}


NO_GUARD_SCRIPT = textwrap.dedent("""
    import sys
    with open(sys.argv[1], "a") as marker:
        marker.write("top level ran\\n")
    from tests.torchtrain.distributed.support import make_train_loop
    tl = make_train_loop()
    tl.fit_distributed(num_epochs=1, num_gpus=2)
""")


def test_a_script_without_main_guard_gets_a_clear_error_before_any_process_starts(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD_SCRIPT)
    marker = tmp_path / "marker.txt"
    result = run_script(script, [str(marker)], timeout=300)
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr and "no 'if __name__ == \"__main__\":' guard" in result.stderr
    assert "bootstrapping phase" not in result.stderr  # multiprocessing's own, later error
    assert marker.read_text() == "top level ran\n"  # no spawned process imported the script


FAILING_IMPORT_SCRIPT = textwrap.dedent("""
    import time
    if __name__ == "__mp_main__":  # only in the spawned processes, which import the script before training
        raise ImportError("deliberate failure while a spawned process imports the script")
    from tests.torchtrain.distributed.support import make_train_loop
    if __name__ == "__main__":
        start = time.monotonic()
        try:
            make_train_loop().fit_distributed(num_epochs=1, num_gpus=2)
        except RuntimeError as error:
            print(f"raised after {time.monotonic() - start:.1f} s: {error}")
""")


def test_a_process_failing_before_it_receives_the_job_fails_the_run(tmp_path):
    """Spawned processes get the pickled job through a pipe once all have started; one that dies while importing
    the script never reads it. The parent must not wait on that pipe: the run fails fast, naming the rank."""
    script = tmp_path / "failing_import.py"
    script.write_text(FAILING_IMPORT_SCRIPT)
    result = run_script(script, [], timeout=HANG_DEADLINE_S)  # waiting on the pipe would hang: the timeout fails it
    assert result.returncode == 0, result.stderr
    assert "raised after" in result.stdout, result.stdout
    assert "exited with code 1 without reporting an error" in result.stdout
    assert "deliberate failure while a spawned process imports the script" in result.stderr  # the child's own


def test_a_busy_master_port_is_replaced(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        tl = make_train_loop()
        tl.fit_distributed(num_epochs=1, callbacks=[RecordRankResult(tmp_path)], master_port=port, num_gpus=2,
                           start_method="fork")
    rank0, rank1 = load_rank_results(tmp_path)
    assert rank0["master_port"] == rank1["master_port"] != port
    assert len(tl.train_history["loss"]) == 1


TWO_NODE_JOB = textwrap.dedent("""
    import json
    import sys
    import torch
    from tests.torchtrain.distributed.support import make_train_loop

    if __name__ == "__main__":
        node_rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        tl = make_train_loop()
        tl.fit_distributed(num_epochs=1, num_nodes=2, node_rank=node_rank, master_addr="127.0.0.1",
                           master_port=port, num_gpus=1, start_method="fork", timeout_s=90)
        torch.save(tl.model.state_dict(), out)
""")


@pytest.mark.slow
def test_a_rank_of_another_job_given_the_same_master_port_never_joins_this_job(tmp_path):
    """Issue 33 item 9: job B's node 1 reaches job A's rendezvous (the same master_port, B's node 0 never came).
    It stops at once, naming master_port, instead of taking a rank in A's group; job A trains as if B never
    existed."""
    import subprocess
    import sys
    from tests.torchtrain.distributed.support import free_port, script_env
    script = tmp_path / "node.py"
    script.write_text(TWO_NODE_JOB)
    port = free_port()

    def start(job, node_rank):
        return subprocess.Popen([sys.executable, str(script), str(node_rank), str(port),
                                 str(tmp_path / f"{job}{node_rank}.pt")], env=script_env({"AITOOLBOX_RUN_ID": job}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    a0 = start("a", 0)
    b1 = start("b", 1)  # before A's node 1: it meets A's store first
    processes = [a0, b1]
    try:
        _, b_err = b1.communicate(timeout=HANG_DEADLINE_S)
        processes.append(start("a", 1))
        outputs = [process.communicate(timeout=HANG_DEADLINE_S) for process in (processes[0], processes[2])]
    finally:
        for process in processes:
            process.kill()
    assert b1.returncode != 0
    assert "belongs to another job" in b_err and f"master_port={port}" in b_err, b_err[-3000:]
    for process, (_, stderr) in zip((processes[0], processes[2]), outputs):
        assert process.returncode == 0, stderr[-3000:]
    import torch
    a0_weights, a1_weights = (torch.load(tmp_path / f"a{node}.pt") for node in (0, 1))
    for name in a0_weights:
        assert torch.equal(a0_weights[name], a1_weights[name])
    assert not (tmp_path / "b1.pt").exists()


def test_the_multi_node_job_token_tells_jobs_over_other_data_apart():
    """Review of issue 33's restart half, D1: two jobs of one script, model and optimizer over data of another
    size computed the same token, so one's node joined the other's rendezvous and trained on mixed data."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from aitoolbox.torchtrain.distributed.rendezvous import job_shape, job_token
    from aitoolbox.torchtrain.train_loop import TrainLoop
    from aitoolbox.torchtrain.train_loop.distributed_fit import DistributedFitOptions, _fit_shape
    from tests.conftest import TinyRegressor

    def token(num_samples, batch_size=4):
        torch.manual_seed(0)
        model = TinyRegressor()
        loader = DataLoader(TensorDataset(torch.randn(num_samples, 4), torch.randn(num_samples, 1)),
                            batch_size=batch_size)
        tl = TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
        shape = job_shape("train.py", 2, 2, _fit_shape(DistributedFitOptions(num_epochs=2), tl), model,
                          tl.optimizers)
        return job_token({}, shape)

    assert token(32) == token(32)  # every node computes it alike
    assert token(32) != token(40) and token(32) != token(32, batch_size=8)
