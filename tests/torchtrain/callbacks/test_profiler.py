"""ProfilerCallback: the trace files it writes (opened, their ProfilerStep events counted), where they go, the table it
logs, its schedule across fits and exceptions, and that it changes nothing in training and leaves nothing running.

Schedules are kept short (a handful of batches of a tiny MLP): the profiler's own cost is then a fraction of a
second per test.
"""
import json
import logging
import os
import re
from typing import List

import pytest
import torch
from torch import nn

from aitoolbox.torchtrain.callbacks import ProfilerCallback
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import (
    MLP, assert_params_equal, classification_data, distinct_records, seeded_loader, single_torch_thread)
from tests.torchtrain.distributed.support import make_train_loop

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


@pytest.fixture
def profiler_log(caplog, monkeypatch):
    """caplog with the profiler's INFO records (the package logger does not propagate to the root by itself)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO, logger=PROFILER_LOGGER)
    return caplog

PROFILER_LOGGER = "aitoolbox.torchtrain.callbacks.profiler"
TRACE_NAME = re.compile(r"^rank(\d+)\.\d+\.pt\.trace\.json$")  # torch's tensorboard_trace_handler layout


def make_loop(samples: int = 40, model: nn.Module = None, **kwargs) -> TrainLoop:
    """A TrainLoop over ``samples / 8`` batches per epoch."""
    torch.manual_seed(0)
    model = MLP() if model is None else model
    return TrainLoop(model, seeded_loader(classification_data(samples), batch_size=8), None, None,
                     torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False, **kwargs)


def trace_steps(path: str) -> List[int]:
    """The N of every ``ProfilerStep#N`` event of a Chrome trace file, sorted."""
    with open(path) as handle:
        trace = json.load(handle)
    names = [event.get("name", "") for event in trace["traceEvents"]]
    return sorted(int(name.split("#")[1]) for name in names if name.startswith("ProfilerStep#"))


def trace_files(folder) -> List[str]:
    folder = str(folder)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder)) if os.path.isdir(folder) else []


class Probe(AbstractCallback):
    """At every epoch end: whether a torch profiler is enabled, and whether the loop calls batch hooks."""

    def __init__(self):
        super().__init__("probe", execution_order=10 ** 6)
        self.profiler_enabled: List[bool] = []
        self.batch_hooks: List[bool] = []

    def on_epoch_end(self):
        self.profiler_enabled.append(torch.autograd._profiler_enabled())
        self.batch_hooks.append(self.train_loop_obj.callbacks_handler.has_batch_hooks)


class BatchCounter(AbstractCallback):
    """A callback with a batch hook of its own."""

    def __init__(self):
        super().__init__("batch counter")
        self.batches = 0

    def on_batch_end(self):
        self.batches += 1


# --- the trace files ----------------------------------------------------------------------------------------
def test_each_cycle_writes_a_trace_with_its_active_steps_and_the_table_is_logged(tmp_path, profiler_log):
    callback = ProfilerCallback(wait=1, warmup=1, active=2, repeat=2, output_dir=tmp_path / "traces", row_limit=7)
    make_loop(samples=80).fit(num_epochs=1, callbacks=[callback])  # 10 batches; the schedule takes 8

    files = trace_files(tmp_path / "traces")
    assert files == sorted(callback.trace_files) and len(files) == 2
    assert all(TRACE_NAME.match(os.path.basename(path)).group(1) == "0" for path in files)
    assert [trace_steps(path) for path in callback.trace_files] == [[1, 2], [1, 2]]  # active * repeat steps
    assert callback.cycles_done == 2
    tables = [record.getMessage() for record in distinct_records(profiler_log) if "Top 7 operators by self CPU time" in
              record.getMessage()]
    assert len(tables) == 2
    assert all("aten::addmm" in table and "Self CPU" in table for table in tables)
    assert callback.trace_files[0] in tables[0]


def test_traces_go_into_the_run_folder_of_a_preset(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    tl = TrainLoopCheckpoint(model, seeded_loader(classification_data(40)), None, None,
                             torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), "proj", "exp",
                             str(tmp_path / "results"), {}, show_progress=False)
    callback = ProfilerCallback()
    tl.fit(num_epochs=1, callbacks=[callback])

    folder = os.path.join(tl.experiment_folder.path, "profiler")
    assert callback.trace_dir == folder
    (path,) = trace_files(folder)
    assert TRACE_NAME.match(os.path.basename(path)) and trace_steps(path) == [1, 2, 3]


def test_without_output_dir_a_plain_loop_s_traces_go_into_its_default_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tl = make_loop()
    callback = ProfilerCallback()
    tl.fit(num_epochs=1, callbacks=[callback])
    folder = os.path.join(str(tmp_path), "aitoolbox_runs", f"run_{tl.experiment_timestamp}", "profiler")
    assert callback.trace_dir == folder and len(trace_files(folder)) == 1


@pytest.mark.parametrize("arguments, error", [
    (dict(active=0), ValueError), (dict(wait=-1), ValueError), (dict(repeat=0), ValueError),
    (dict(warmup=1.5), ValueError), (dict(active=True), ValueError), (dict(record_shapes="yes"), TypeError),
    (dict(output_dir=""), ValueError), (dict(row_limit=0), ValueError)])
def test_bad_arguments_are_refused(arguments, error):
    with pytest.raises(error, match=next(iter(arguments))):
        ProfilerCallback(**arguments)


def test_an_output_dir_that_cannot_be_a_folder_is_refused_at_registration(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match="output_dir"):
        make_loop().fit(num_epochs=1, callbacks=[ProfilerCallback(output_dir=blocker / "traces")])


class BlockFolder(AbstractCallback):
    """At train begin, puts a file where the traces' folder should be."""

    def __init__(self, path):
        super().__init__("block folder")
        self.path = path

    def on_train_begin(self):
        self.path.write_text("")


def test_a_trace_that_cannot_be_written_is_logged_and_training_goes_on(tmp_path, profiler_log):
    callback = ProfilerCallback(output_dir=tmp_path / "traces")
    tl = make_loop()
    tl.fit(num_epochs=2, callbacks=[callback, BlockFolder(tmp_path / "traces")])
    assert tl.epochs_completed == 2 and callback.cycles_done == 1 and callback.trace_files == []
    assert "could not write the trace" in profiler_log.text
    assert sorted(os.listdir(tmp_path)) == ["traces"]


# --- cost and effect on training ----------------------------------------------------------------------------
def test_training_is_bitwise_the_same_and_nothing_runs_after_the_schedule(tmp_path):
    plain = make_loop()
    torch.manual_seed(1)
    plain.fit(num_epochs=3)

    profiled = make_loop()
    probe = Probe()
    torch.manual_seed(1)
    profiled.fit(num_epochs=3, callbacks=[ProfilerCallback(record_shapes=True, profile_memory=True,
                                                           output_dir=tmp_path), probe])

    assert_params_equal(profiled.model, plain.model)
    assert profiled.train_history["loss"] == plain.train_history["loss"]
    # The schedule (5 batches) ends in the first epoch: no profiler left, and no batch hooks called after it.
    assert probe.profiler_enabled == [False, False, False]
    assert probe.batch_hooks == [False, False, False]
    assert len(trace_files(tmp_path)) == 1


def test_another_callback_keeps_its_batch_hooks_after_the_schedule(tmp_path):
    counter = BatchCounter()
    tl = make_loop()
    tl.fit(num_epochs=2, callbacks=[ProfilerCallback(output_dir=tmp_path), counter])
    assert counter.batches == 10 and tl.callbacks_handler.has_batch_hooks


def test_a_step_is_a_batch_also_under_grad_accumulation(tmp_path):
    callback = ProfilerCallback(output_dir=tmp_path)
    make_loop().fit(num_epochs=1, grad_accumulation=2, callbacks=[callback])  # optimizer steps after batches 1, 3
    (path,) = trace_files(tmp_path)
    assert trace_steps(path) == [1, 2, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_kernels_are_recorded_and_the_table_sorts_by_cuda_time(tmp_path, profiler_log):
    callback = ProfilerCallback(output_dir=tmp_path)
    tl = make_loop()
    assert tl.device.type == "cuda"
    tl.fit(num_epochs=1, callbacks=[callback])
    (path,) = trace_files(tmp_path)
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
    assert "by self CUDA time" in profiler_log.text


def test_torch_compile_is_profiled(tmp_path):
    torch._dynamo.reset()
    try:
        tl = make_loop(model=MLP(dropout=0.0), torch_compile={"backend": "aot_eager"})
        callback = ProfilerCallback(output_dir=tmp_path)
        tl.fit(num_epochs=1, callbacks=[callback])
    finally:
        torch._dynamo.reset()
    (path,) = trace_files(tmp_path)
    assert trace_steps(path) == [1, 2, 3]


# --- runs cut short, several fits, exceptions, resuming -----------------------------------------------------
def test_a_fit_shorter_than_the_schedule_writes_what_it_recorded(tmp_path):
    callback = ProfilerCallback(output_dir=tmp_path)  # wait 1, warmup 1, active 3
    make_loop().fit(num_iterations=3, callbacks=[callback])
    (path,) = trace_files(tmp_path)
    # Batch 2 recorded (step 1); step 2 began at its end and holds the end of training (no batch).
    assert trace_steps(path) == [1, 2]
    assert callback.cycles_done == 1


def test_a_fit_ending_before_the_active_batches_says_so_and_the_next_fit_profiles_the_cycle(tmp_path, profiler_log):
    callback = ProfilerCallback(wait=1, warmup=1, active=2, repeat=2, output_dir=tmp_path)
    tl = make_loop()  # 5 batches an epoch: cycle 1 takes 4, the 5th is the wait of cycle 2
    tl.fit(num_epochs=1, callbacks=[callback])
    assert len(callback.trace_files) == 1 and callback.cycles_done == 1
    assert any("nothing was recorded" in record.getMessage() and "cycle 2 of 2" in record.getMessage()
               for record in distinct_records(profiler_log))

    probe = Probe()
    tl.fit(num_epochs=3, callbacks=[probe])  # cycle 2 from its wait again, then nothing
    assert callback.cycles_done == 2
    assert [trace_steps(path) for path in callback.trace_files] == [[1, 2], [1, 2]]
    assert probe.batch_hooks == [False, False]

    tl.fit(num_epochs=4)  # the schedule is over: a later fit does not profile
    assert len(trace_files(tmp_path)) == 2


class FailAtBatch(AbstractCallback):
    def __init__(self, batch: int):
        super().__init__("fail")
        self.batch = batch

    def on_batch_end(self):
        if self.train_loop_obj.total_iteration_idx == self.batch:
            raise RuntimeError("failing batch")


def test_an_exception_stops_the_profiler_and_writes_what_was_recorded(tmp_path):
    callback = ProfilerCallback(output_dir=tmp_path)
    failing = FailAtBatch(3)
    tl = make_loop()
    with pytest.raises(RuntimeError, match="failing batch"):
        tl.fit(num_epochs=1, callbacks=[callback, failing])  # fails in batch 3, the second active one

    assert not torch.autograd._profiler_enabled()
    with torch.profiler.profile() as another:  # torch refuses a second profiler while one is enabled
        torch.ones(2).sum()
    assert any(event.name == "aten::sum" for event in another.events())
    (path,) = trace_files(tmp_path)
    assert trace_steps(path) == [1, 2]  # batch 2, and the failing batch 3
    assert callback.cycles_done == 1

    failing.batch = -1
    tl.fit(num_epochs=1)  # continues where it stopped; the only cycle is done
    assert len(trace_files(tmp_path)) == 1


def test_state_dict_counts_the_cycles_and_a_loaded_state_profiles_only_those_left(tmp_path):
    first = ProfilerCallback(wait=0, warmup=1, active=1, repeat=2, output_dir=tmp_path / "first")
    make_loop().fit(num_epochs=1, callbacks=[first])
    assert first.state_dict() == {"cycles_done": 2}

    done = ProfilerCallback(wait=0, warmup=1, active=1, repeat=2, output_dir=tmp_path / "done")
    probe = Probe()
    tl = make_loop()
    tl.callbacks_handler.register_callbacks([done, probe])
    done.load_state_dict(first.state_dict())
    tl.fit(num_epochs=1)
    assert trace_files(tmp_path / "done") == [] and probe.batch_hooks == [False]

    half = ProfilerCallback(wait=0, warmup=1, active=1, repeat=2, output_dir=tmp_path / "half")
    half.load_state_dict({"cycles_done": 1})
    make_loop().fit(num_epochs=1, callbacks=[half])
    assert len(trace_files(tmp_path / "half")) == 1 and half.cycles_done == 2


def test_a_running_profiler_of_the_user_is_left_alone(tmp_path, profiler_log):
    callback = ProfilerCallback(output_dir=tmp_path)
    with torch.profiler.profile():
        make_loop().fit(num_epochs=1, callbacks=[callback])
    assert trace_files(tmp_path) == [] and callback.cycles_done == 0
    assert "another torch profiler is running" in profiler_log.text


# --- distributed ----------------------------------------------------------------------------------------------
class RecordProfilerLog(AbstractCallback):
    """In every process: the profiler's log messages of this rank, written to ``<folder>/log_rank<r>.json``."""

    def __init__(self, folder: str):
        super().__init__("record profiler log", execution_order=10 ** 6)
        self.folder = str(folder)

    def on_train_begin(self):
        self.messages = []
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logger = logging.getLogger(PROFILER_LOGGER)
        logger.setLevel(logging.INFO)
        logger.addHandler(self.handler)

    def on_train_end(self):
        logging.getLogger(PROFILER_LOGGER).removeHandler(self.handler)
        rank = self.train_loop_obj.strategy.rank
        with open(os.path.join(self.folder, f"log_rank{rank}.json"), "w") as handle:
            json.dump(self.messages, handle)


def test_under_ddp_each_rank_writes_its_trace_named_by_rank_and_only_rank_0_logs_the_table(tmp_path):
    pytest.importorskip("torch.distributed")
    tl = make_train_loop()  # 32 samples, 2 ranks, batches of 4: 4 batches per rank
    callback = ProfilerCallback(wait=1, warmup=1, active=2, output_dir=tmp_path / "traces")
    tl.fit_distributed(num_epochs=1, callbacks=[callback, RecordProfilerLog(tmp_path)], num_cpu_processes=2,
                       start_method="fork", on_gpu=False)

    files = trace_files(tmp_path / "traces")
    ranks = sorted(int(TRACE_NAME.match(os.path.basename(path)).group(1)) for path in files)
    assert ranks == [0, 1]
    assert [trace_steps(path) for path in files] == [[1, 2], [1, 2]]
    logs = {}
    for rank in (0, 1):
        with open(tmp_path / f"log_rank{rank}.json") as handle:
            logs[rank] = json.load(handle)
    assert sum("Top 15 operators" in message for message in logs[0]) == 1
    assert not any("Top" in message for message in logs[1])
    assert callback.cycles_done == 1  # rank 0's state, taken over by the launching process
