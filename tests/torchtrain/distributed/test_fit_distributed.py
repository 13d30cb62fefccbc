"""fit_distributed with 2 real CPU processes over gloo, compared with plain single-process fit().

The in-process tests call fit_distributed with start_method='fork' (fast: the processes inherit the imported
torch and the test's objects). The launch paths that need a real script (spawn, two nodes) run scripts in
subprocesses.
"""
import copy
import os
import textwrap

import pytest
import torch

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from tests.torchtrain.distributed.support import (
    BatchNormRegressor, BuildLoadersInProcess, IndexRecordingRegressor, RecordRankResult, assert_state_dicts_close,
    assert_state_dicts_equal, check_seed_result, free_port, load_rank_results, make_model, make_train_loop,
    run_script, run_scripts_together, seed_result, seed_script)

pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available")

BATCH = 4  # per process; the single-process reference trains with batches of 2 * BATCH
# All-reduce sums the two ranks' gradients in a different order than one backward pass over the global batch
# sums its samples, so parameters agree to float32 rounding, not bitwise.
PARAM_TOL = 1e-6


def test_two_processes_train_like_one_process_on_the_global_batch(tmp_path):
    """2 processes x batch B == 1 process x batch 2B: weights, evaluation, predictions, the parent's state.

    DistributedSampler interleaves (rank r gets samples r, r+2, ...), so global batch k of the 2-process run
    holds exactly the samples of batch k of the 1-process run. With a mean-reduced loss and DDP's gradient
    averaging the update is the same up to rounding. 32 training samples: no padding, no partial batch.
    The training loader shuffles, but train_data_shuffle=False turns that off in the processes.
    """
    initial = make_model()
    tl = make_train_loop(copy.deepcopy(initial), batch_size=BATCH, shuffle=True)
    reference = make_train_loop(copy.deepcopy(initial), batch_size=2 * BATCH, shuffle=False)

    with pytest.warns(UserWarning, match="CUDA is not available.*2 CPU processes"):
        returned = tl.fit_distributed(num_epochs=3, callbacks=[RecordRankResult(tmp_path)], train_data_shuffle=False,
                                      num_gpus=2, start_method="fork")
    reference.fit(num_epochs=3)
    rank0, rank1 = load_rank_results(tmp_path)

    # DDP keeps the replicas identical: both ranks apply the same averaged gradient.
    assert (rank0["world_size"], rank1["world_size"]) == (2, 2)
    assert rank0["is_main_process"] and not rank1["is_main_process"]
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    assert_state_dicts_close(rank0["state_dict"], reference.model.state_dict(), PARAM_TOL)

    # The parent: the returned model is its own model, holding rank 0's weights; history and epoch are rank 0's.
    assert returned is tl.model
    assert_state_dicts_equal(returned.state_dict(), rank0["state_dict"])
    assert tl.train_history == rank0["train_history"]
    assert tl.epoch == rank0["epoch"] == reference.epoch == 2
    assert tl.total_iteration_idx + 1 == 3 * 32 // (2 * BATCH)  # batches of this rank: 4 per epoch

    # Evaluation over all ranks is exact: sample-weighted means over every sample once.
    for name in ("loss", "val_loss", "train_end_test_loss"):
        assert tl.train_history[name] == pytest.approx(reference.train_history[name], abs=PARAM_TOL), name
    for rank in (rank0, rank1):
        assert rank["loss_train"] == pytest.approx(reference.evaluate_loss_on_train_set(float_dict_format=True), abs=PARAM_TOL)
        assert rank["loss_validation"] == pytest.approx(reference.evaluate_loss_on_validation_set(float_dict_format=True), abs=PARAM_TOL)
        assert rank["loss_test"] == pytest.approx(reference.evaluate_loss_on_test_set(float_dict_format=True), abs=PARAM_TOL)

    # 35 test samples: 35 predictions (no DistributedSampler padding), in data-set order, on every rank.
    y_pred, y_true, metadata = reference.predict_on_test_set()
    for rank in (rank0, rank1):
        assert rank["test_pred"].shape == (35, 1)
        assert rank["test_index"] == list(range(35)) == metadata["index"]
        assert torch.equal(rank["test_true"], y_true)
        torch.testing.assert_close(rank["test_pred"], y_pred, rtol=0, atol=PARAM_TOL)

    # The parent continues where the processes stopped: one more epoch in this process.
    tl.fit(num_epochs=4)
    assert tl.epoch == 3 and len(tl.train_history["loss"]) == 4


def test_shuffled_data_is_split_across_ranks_and_reshuffled_every_epoch(tmp_path):
    """train_data_shuffle=True with a shuffling loader: each epoch the ranks train on disjoint halves of a new
    permutation (DistributedSampler with set_epoch, seeded from the loader's generator). Also: fit() with
    gpu_mode='ddp' is fit_distributed."""
    tl = make_train_loop(make_model(IndexRecordingRegressor), shuffle=True, gpu_mode="ddp")
    returned = tl.fit(num_epochs=3, callbacks=[RecordRankResult(tmp_path)], num_gpus=2, start_method="fork")
    assert returned is tl.model
    rank0, rank1 = load_rank_results(tmp_path)
    batches_per_epoch = 32 // (2 * BATCH)
    epoch_orders = []
    for epoch in range(3):
        per_rank = [sum(rank["trained_indices"][epoch * batches_per_epoch:(epoch + 1) * batches_per_epoch], [])
                    for rank in (rank0, rank1)]
        assert sorted(per_rank[0] + per_rank[1]) == list(range(32))  # every sample once per epoch
        epoch_orders.append(per_rank[0] + per_rank[1])
    assert len({tuple(order) for order in epoch_orders}) == 3  # a new permutation each epoch
    assert epoch_orders[0] != sorted(epoch_orders[0])
    assert tl.model.trained_indices == []  # the parent's model trained nothing itself: it adopted the weights
    assert_state_dicts_equal(tl.model.state_dict(), rank0["state_dict"])


def test_in_process_data_load_builds_the_loaders_in_each_process_before_sharding(tmp_path):
    tl = make_train_loop(make_model(IndexRecordingRegressor))  # 32 training samples in the parent
    tl.fit_distributed(num_epochs=1, callbacks=[RecordRankResult(tmp_path)],
                       in_process_data_load=BuildLoadersInProcess(num_samples=16), num_gpus=2, start_method="fork")
    rank0, rank1 = load_rank_results(tmp_path)
    trained = sorted(sum(rank0["trained_indices"] + rank1["trained_indices"], []))
    assert trained == list(range(16))  # the processes' own 16 samples, split between them
    assert rank0["test_index"] == list(range(16))


@pytest.mark.parametrize("use_amp, amp_init_args", [(False, {"opt_level": "O1"}), (False, {"opt_level": "O2"}),
                                                     (True, None)], ids=["O1", "O2", "use_amp=True"])
def test_mixed_precision_under_ddp(tmp_path, use_amp, amp_init_args):
    """amp.initialize runs in every process before the DDP wrap; the ranks stay identical and the parent
    gets rank 0's weights (O2 trains a low-precision model copy: the parent's float32 model takes its values)."""
    tl = make_train_loop(use_amp=use_amp)
    before = copy.deepcopy(tl.model.state_dict())
    tl.fit_distributed(num_epochs=2, callbacks=[RecordRankResult(tmp_path)], amp_init_args=amp_init_args,
                       num_gpus=2, start_method="fork")
    rank0, rank1 = load_rank_results(tmp_path)
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    if amp_init_args == {"opt_level": "O2"}:
        # O2 trains a bfloat16 copy of the model on the CPU; like apex, its state_dict is upcast to float32.
        weight = rank0["state_dict"]["hidden.weight"]
        assert torch.equal(weight, weight.bfloat16().float())
    for name, value in tl.model.state_dict().items():
        assert value.dtype == before[name].dtype == torch.float32
        assert torch.equal(value, rank0["state_dict"][name]), name
        assert not torch.equal(value, before[name]), f"{name} did not train"
    assert len(tl.train_history["loss"]) == 2 and all(torch.isfinite(torch.tensor(tl.train_history["loss"])))


def test_sync_bn_trains_batchnorm_across_processes(tmp_path):
    """sync_bn=True: BatchNorm statistics over the global batch, so 2 processes x B match 1 process x 2B."""
    pytest.importorskip("aitoolbox.torchtrain.parallel", reason="the parallel package (SyncBatchNorm) is missing")
    initial = make_model(BatchNormRegressor)
    tl = make_train_loop(copy.deepcopy(initial), batch_size=BATCH)
    reference = make_train_loop(copy.deepcopy(initial), batch_size=2 * BATCH)
    tl.fit_distributed(num_epochs=2, callbacks=[RecordRankResult(tmp_path)], sync_bn=True, num_gpus=2,
                       start_method="fork")
    reference.fit(num_epochs=2)
    rank0, rank1 = load_rank_results(tmp_path)
    assert "SyncBatchNorm" in rank0["module_types"] and "BatchNorm1d" not in rank0["module_types"]
    # Running statistics are the global batch's in every rank: the replicas stay identical, buffers included.
    assert_state_dicts_equal(rank0["state_dict"], rank1["state_dict"])
    assert_state_dicts_close(rank0["state_dict"], reference.model.state_dict(), 1e-5)
    assert_state_dicts_equal(tl.model.state_dict(), rank0["state_dict"])
    assert type(tl.model.norm).__name__ == "BatchNorm1d"  # the parent's model keeps its own layers


TWO_NODE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from tests.torchtrain.distributed.support import make_train_loop

    if __name__ == "__main__":
        node_rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        tl = make_train_loop()
        # fork keeps the test fast (no second torch import per node); the launch logic is the same.
        model = tl.fit_distributed(num_epochs=2, num_nodes=2, node_rank=node_rank, master_addr="127.0.0.1",
                                   master_port=port, num_gpus=1, start_method="fork")
        torch.save({"state_dict": model.state_dict(), "history": dict(tl.train_history), "epoch": tl.epoch}, out)
""")


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    """Two launchers (node_rank 0 and 1) of one CPU process each join one job and end with identical weights."""
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODE_SCRIPT)
    port = str(free_port())
    outputs = run_scripts_together([[script, node, port, tmp_path / f"node{node}.pt"] for node in (0, 1)],
                                   [None, None])
    node0, node1 = (torch.load(tmp_path / f"node{node}.pt", weights_only=False) for node in (0, 1))
    assert_state_dicts_equal(node0["state_dict"], node1["state_dict"])
    assert not torch.equal(node0["state_dict"]["out.weight"], make_model().state_dict()["out.weight"])
    # Each launcher returns the trained model and holds rank 0's history.
    assert node0["epoch"] == node1["epoch"] == 1
    assert node0["history"] == node1["history"]
    assert "Epoch 1/2 - " in outputs[0][1] and "Epoch 1/2 - " not in outputs[1][1]  # only global rank 0 reports


@pytest.mark.slow
def test_seed_snippet_as_a_script_spawns_cpu_processes_and_only_rank_0_reports(tmp_path):
    """Seed 000's snippet, unchanged under a __main__ guard, on a CPU-only machine: num_gpus=device_count()=0
    gives 2 CPU processes (with a warning), started by spawn since the program is a script file; the model
    class is defined in the script itself. Only global rank 0 logs the epoch summaries."""
    script = tmp_path / "seed_000.py"
    script.write_text(seed_script())
    result = run_script(script, timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    check_seed_result(seed_result(result.stdout))
    if not torch.cuda.is_available():
        assert "CUDA is not available: fit_distributed trains with 2 CPU processes over gloo" in result.stderr
    for epoch in range(1, 11):
        assert result.stderr.count(f"Epoch {epoch}/10 - ") == 1, result.stderr[-3000:]
    assert result.stderr.count("Test loss at the end of training") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback of a machine without CUDA")
def test_1x_ddp_keywords_train_cpu_processes(tmp_path):
    """aitoolbox 1.x's fit keywords for gpu_mode='ddp': its default backend='nccl' and on_gpu=False."""
    initial = make_model()
    tl = make_train_loop(copy.deepcopy(initial), batch_size=BATCH, shuffle=False)
    tl.gpu_mode = "ddp"
    with pytest.warns(UserWarning, match="backend='nccl' needs CUDA.*using gloo"):
        tl.fit(num_epochs=1, callbacks=[RecordRankResult(tmp_path)], backend="nccl", num_gpus=2, start_method="fork")
    rank0, rank1 = load_rank_results(tmp_path)
    assert (rank0["world_size"], rank1["world_size"]) == (2, 2)
    assert_state_dicts_equal(tl.model.state_dict(), rank0["state_dict"])
    other = make_train_loop(copy.deepcopy(initial), batch_size=BATCH, shuffle=False)
    other.fit_distributed(num_epochs=1, on_gpu=False, num_gpus=2, start_method="fork")
    assert_state_dicts_equal(other.model.state_dict(), tl.model.state_dict())


def test_a_forked_cpu_process_computes_with_one_thread_instead_of_hanging(tmp_path, caplog, monkeypatch):
    """GNU OpenMP cannot start threads in a forked child of a process that ran a parallel region: one process on
    two cores would hang at its first multi-threaded operation. Forked CPU processes get one thread each."""
    import logging
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.tanh(torch.randn(1_000_000)).sum()  # a parallel region in this (the parent) process
        tl = make_train_loop(make_model(), batch_size=BATCH, shuffle=False)
        with caplog.at_level(logging.WARNING):
            tl.fit_distributed(num_epochs=1, callbacks=[RecordRankResult(tmp_path)], num_gpus=1, start_method="fork")
    finally:
        torch.set_num_threads(threads)
    assert any("forked CPU processes compute with one thread each" in record.getMessage()
               for record in caplog.records if record.name.startswith("aitoolbox"))
    assert tl.epoch == 0 and len(tl.train_history["loss"]) == 1


class TouchFileOnTrainBegin(AbstractCallback):
    """Writes ``<folder>/<name>_rank<r>`` in every process it runs in."""

    def __init__(self, folder, name: str, device_idx_execution=None):
        super().__init__(f"touch {name}", device_idx_execution=device_idx_execution)
        self.folder, self.name = str(folder), name

    def on_train_begin(self):
        rank = self.train_loop_obj.strategy.rank
        with open(os.path.join(self.folder, f"{self.name}_rank{rank}"), "w") as handle:
            # What the loop lists as its callbacks in this process.
            handle.write(",".join(sorted(cb.name for cb in self.train_loop_obj.callbacks
                                         if isinstance(cb, TouchFileOnTrainBegin))))


def test_callbacks_registered_before_fit_distributed_run_only_in_their_rank(tmp_path):
    tl = make_train_loop(make_model())
    # Registered in the launching process (rank 0 there): they travel to both processes with the loop.
    tl.callbacks_handler.register_callbacks([TouchFileOnTrainBegin(tmp_path, "rank0_only", device_idx_execution=0),
                                             TouchFileOnTrainBegin(tmp_path, "everywhere")])
    tl.fit_distributed(num_epochs=1, callbacks=[TouchFileOnTrainBegin(tmp_path, "given_to_fit_rank1_only",
                                                                      device_idx_execution=1)],
                       num_gpus=2, start_method="fork")
    assert sorted(os.listdir(tmp_path)) == ["everywhere_rank0", "everywhere_rank1", "given_to_fit_rank1_only_rank1",
                                            "rank0_only_rank0"]
    listed = {rank: (tmp_path / f"everywhere_rank{rank}").read_text() for rank in (0, 1)}
    assert listed == {0: "everywhere,rank0_only", 1: "everywhere,given_to_fit_rank1_only"}


STOP_ON_SOME_RANKS_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch

    from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
    from tests.torchtrain.distributed.support import make_train_loop


    class StopOnRanks(AbstractCallback):
        '''Asks to stop at batch 2 of the first epoch (or in on_train_begin), in the given ranks, with the given
        reason.'''

        def __init__(self, ranks, reason, at_train_begin):
            super().__init__("stop on some ranks")
            self.ranks, self.reason, self.at_train_begin = ranks, reason, at_train_begin

        def on_train_begin(self):
            if self.at_train_begin and torch.distributed.get_rank() in self.ranks:
                self.train_loop_obj.stop_training(self.reason)

        def on_batch_end(self):
            tl = self.train_loop_obj
            rank = torch.distributed.get_rank()
            if rank in self.ranks and (tl.epoch, tl.iteration) >= (0, 2):
                tl.stop_training(self.reason)


    if __name__ == "__main__":
        ranks, reason, at_train_begin = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "train_begin"
        tl = make_train_loop()
        tl.fit_distributed(num_epochs=3, callbacks=[StopOnRanks(ranks, reason, at_train_begin)],
                           num_cpu_processes=2, start_method="fork")
        print("epochs completed", tl.epochs_completed, flush=True)
""")


@pytest.mark.parametrize("ranks, reason, logged", [
    ([1], "NaN loss", "Stopping training: NaN loss (requested on rank 1)"),
    ([1], "", "Stopping training: requested on rank 1, without a reason"),
    ([0, 1], "EarlyStopping: no improvement", "Stopping training: EarlyStopping: no improvement"),
])
def test_a_stop_requested_on_another_rank_is_logged_once_by_rank_0_naming_the_rank(tmp_path, ranks, reason, logged):
    """All ranks stop at the epoch's end as agreed; only rank 0 logs, so a reason given on rank 1 alone was never
    shown. A reason that rank 0 gave too (EarlyStopping on every rank) is logged once, as in one process."""
    import json
    script = tmp_path / "stop_on_some_ranks.py"
    script.write_text(STOP_ON_SOME_RANKS_SCRIPT)
    result = run_script(script, [json.dumps(ranks), reason, "batch"], timeout=120)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "epochs completed 1" in result.stdout, result.stderr[-3000:]
    stops = [line for line in result.stderr.splitlines() if "Stopping training" in line]
    assert stops == [logged], result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines.index(logged) == lines.index(next(line for line in lines if line.startswith("Epoch 1/3"))) + 1


@pytest.mark.parametrize("ranks", [[1], [0, 1]])
def test_a_stop_requested_in_on_train_begin_on_another_rank_stops_every_rank_before_training(tmp_path, ranks):
    """Rank 1 alone asked to stop in on_train_begin: it trained nothing while rank 0 trained, and gloo aborted on
    the mismatched collectives (the launcher said "rank 1 was killed by signal SIGABRT"). The processes agree on a
    stop right after on_train_begin; the reason is logged by rank 0, once also where rank 0 gave it too (it was
    logged twice: reviews of issue 33, stop 40)."""
    import json
    script = tmp_path / "stop_on_some_ranks.py"
    script.write_text(STOP_ON_SOME_RANKS_SCRIPT)
    result = run_script(script, [json.dumps(ranks), "at begin", "train_begin"], timeout=120)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "epochs completed 0" in result.stdout, result.stderr[-3000:]
    logged = "Stopping training: at begin" + (" (requested on rank 1)" if ranks == [1] else "")
    assert [line for line in result.stderr.splitlines() if "Stopping training" in line] == [logged], \
        result.stderr[-3000:]
