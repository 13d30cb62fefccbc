"""ThroughputMonitor: counts against known sample and token counts, the data wait of a loader that sleeps, FLOPs
against a hand count, MFU from the recorded numbers, accumulation, two real processes, and training unchanged."""
import csv
import logging
import math
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import DataLoader, Dataset, TensorDataset

from aitoolbox.torchtrain.callbacks import CSVLogger, ThroughputMonitor
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.peak_flops import lookup_peak_flops, precision_key
from aitoolbox.torchtrain.callbacks.throughput import HISTORY_KEYS, first_dimension
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.combinations.support import join_as_torchrun
from tests.distributed_helpers import run_distributed
from tests.helpers import distinct_records, single_torch_thread

one_thread = pytest.fixture(single_torch_thread, autouse=True, scope="module", name="one_thread")


@pytest.fixture
def package_logs(caplog, monkeypatch):
    """caplog, with the package logger's records reaching it (the package logger stops at itself)."""
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    return caplog

IN, HIDDEN, OUT = 6, 16, 3


class TwoLayers(TTModel):
    """Linear(IN, HIDDEN), ReLU, Linear(HIDDEN, OUT) on batches ``(x, y)``; ``sleep_s`` per forward stands in for
    compute that takes known time."""

    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.sleep_s = sleep_s

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.fc2(torch.relu(self.fc1(x)))

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data[0], batch_data[1]
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        return self(batch_data[0].to(device)).argmax(dim=1), batch_data[1], None


def hand_counted_flops(samples: int) -> int:
    """FLOPs of forward and backward of TwoLayers on ``samples`` samples, counted by hand as FlopCounterMode counts
    them: a product of (m, k) and (k, n) matrices is 2*m*n*k; additions, activations and the loss count nothing.
    Forward: both layers' products. Backward: both weight gradients, and the input gradient of the second layer
    only (the data needs no gradient)."""
    forward = 2 * samples * (IN * HIDDEN + HIDDEN * OUT)
    weight_gradients = 2 * samples * (IN * HIDDEN + HIDDEN * OUT)
    input_gradients = 2 * samples * HIDDEN * OUT
    return forward + weight_gradients + input_gradients


def data(num_samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(num_samples, IN, generator=generator),
                         torch.randint(0, OUT, (num_samples,), generator=generator))


def make_loop(loader, sleep_s: float = 0.0, **loop_args) -> TrainLoop:
    torch.manual_seed(0)
    model = TwoLayers(sleep_s)
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                     end_auto_eval=False, show_progress=False, **loop_args)


def loader(num_samples: int = 50, batch_size: int = 8, **kwargs) -> DataLoader:
    return DataLoader(data(num_samples), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(1), **kwargs)


# --- counts ---------------------------------------------------------------------------------------------------
def test_every_sample_counts_once_with_a_smaller_last_batch():
    monitor = ThroughputMonitor(window=2)
    tl = make_loop(loader(50, 8))  # six batches of 8 and one of 2
    tl.fit(num_epochs=2, callbacks=[monitor])
    assert monitor.last_epoch["samples"] == 50
    history = tl.train_history
    assert len(history["samples_per_sec"]) == 2
    assert history["samples_per_sec"][-1] == pytest.approx(50 / monitor.last_epoch["seconds"], rel=1e-12)
    assert {"samples_per_sec", "data_wait_fraction", "peak_memory_mib"} <= set(history)
    assert "tokens_per_sec" not in history and "mfu" not in history  # no tokens_fn; no peak on the CPU
    assert 0 <= history["data_wait_fraction"][-1] <= 1 and history["peak_memory_mib"][-1] > 0
    assert monitor.last_window["samples_per_sec"] > 0


class SizedBatches(torch.utils.data.Sampler):
    """Batches of the given sizes, in order."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return len(self.sizes)


def test_batches_of_varying_size_and_a_custom_batch_size_fn_over_dict_batches():
    sizes = [3, 7, 1, 5, 2]

    def as_dict(samples):
        x, y = torch.utils.data.default_collate(samples)
        return {"meta": "text", "y": y, "x": x}

    class DictModel(TwoLayers):
        def get_loss(self, batch_data, criterion, device):
            return super().get_loss((batch_data["x"], batch_data["y"]), criterion, device)

    torch.manual_seed(0)
    model = DictModel()
    dict_loader = DataLoader(data(sum(sizes)), batch_sampler=SizedBatches(sizes), collate_fn=as_dict)
    tl = TrainLoop(model, dict_loader, None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    default, custom = ThroughputMonitor(), ThroughputMonitor(batch_size_fn=lambda batch: 2 * len(batch["y"]))
    tl.fit(num_epochs=1, callbacks=[default, custom])
    assert default.last_epoch["samples"] == sum(sizes)  # the first tensor found: the dict's "y"
    assert custom.last_epoch["samples"] == 2 * sum(sizes)
    assert default.flops_batch_size == 3 and default.flops_per_batch == hand_counted_flops(3)


def test_first_dimension_searches_nested_batches_depth_first():
    assert first_dimension(("text", [{"a": torch.zeros(4, 2)}], torch.zeros(9))) == 4
    with pytest.raises(ValueError, match="batch_size_fn"):
        first_dimension({"ids": [1, 2, 3]})


def test_tokens_given_as_tensors_are_summed_where_they_are():
    masks = torch.zeros(20, 5, dtype=torch.long)
    for row in range(20):
        masks[row, :1 + row % 5] = 1  # 1 to 5 tokens per sample
    dataset = TensorDataset(data(20).tensors[0], data(20).tensors[1], masks)
    monitor = ThroughputMonitor(window=3, tokens_fn=lambda batch: batch[2].sum())
    tl = make_loop(DataLoader(dataset, batch_size=6))  # 6, 6, 6, 2
    tl.fit(num_epochs=1, callbacks=[monitor])
    assert monitor.last_epoch["tokens"] == masks.sum().item()
    assert tl.train_history["tokens_per_sec"][0] == pytest.approx(masks.sum().item() / monitor.last_epoch["seconds"],
                                                                  rel=1e-12)
    assert "tokens_per_sec" in monitor.last_window

    per_sample = ThroughputMonitor(window=3, tokens_fn=lambda batch: batch[2].sum(dim=1))  # a count per sample
    make_loop(DataLoader(dataset, batch_size=6)).fit(num_epochs=1, callbacks=[per_sample])
    assert per_sample.last_epoch["tokens"] == masks.sum().item()


def test_counts_do_not_depend_on_gradient_accumulation():
    results = {}
    for accumulation in (1, 3):
        monitor = ThroughputMonitor()
        make_loop(loader(50, 8)).fit(num_epochs=1, callbacks=[monitor], grad_accumulation=accumulation)
        results[accumulation] = (monitor.last_epoch["samples"], monitor.flops_per_batch, monitor.flops_batch_size)
    assert results[1] == results[3] == (50, hand_counted_flops(8), 8)


# --- data wait ------------------------------------------------------------------------------------------------
class SlowData(Dataset):
    """Each sample takes ``sleep_s`` to load."""

    def __init__(self, num_samples: int, sleep_s: float):
        self.inner, self.sleep_s = data(num_samples), sleep_s

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        time.sleep(self.sleep_s)
        return self.inner[index]


def test_data_wait_is_high_when_loading_dominates_and_low_when_compute_does():
    slow_loading = ThroughputMonitor(window=2)
    make_loop(DataLoader(SlowData(12, 0.01), batch_size=2)).fit(num_epochs=1, callbacks=[slow_loading])
    slow_compute = ThroughputMonitor(window=2)
    make_loop(DataLoader(data(12), batch_size=2), sleep_s=0.02).fit(num_epochs=1, callbacks=[slow_compute])
    # 20 ms of loading per batch against microseconds of compute, and the other way round.
    assert slow_loading.last_epoch["wait_s"] >= 6 * 0.02 * 0.9
    assert slow_loading.last_epoch["wait_s"] / slow_loading.last_epoch["seconds"] > 0.5
    assert slow_compute.last_epoch["wait_s"] / slow_compute.last_epoch["seconds"] < 0.3


class Busy(AbstractCallback):
    """Work that is not data loading: ``sleep_s`` in both batch hooks, before or after the monitor's."""

    def __init__(self, sleep_s: float, execution_order: int):
        super().__init__("busy", execution_order=execution_order)
        self.sleep_s = sleep_s

    def on_batch_begin(self):
        time.sleep(self.sleep_s)

    def on_batch_end(self):
        time.sleep(self.sleep_s)


def test_data_wait_counts_only_the_time_spent_getting_batches_from_the_loader(tmp_path):
    """Issue 34.3: other callbacks' work (sleeping 20 ms in each batch hook, an iteration checkpoint every 2
    batches) is not waiting for data; an in-memory loader waits for next to nothing, a slow one for its loading."""
    from aitoolbox.torchtrain.callbacks.model_save import ModelIterationCheckpoint
    busy = [Busy(0.02, -10), Busy(0.02, 10)]
    fast = ThroughputMonitor(window=2)
    saver = ModelIterationCheckpoint(2, project_name="p", experiment_name="e", local_model_result_folder_path=str(tmp_path))
    tl = make_loop(DataLoader(data(24), batch_size=4))
    tl.fit(num_epochs=1, callbacks=[fast, saver] + busy)
    assert tl.train_history["data_wait_fraction"][0] < 0.05
    assert fast.last_window["data_wait_fraction"] < 0.05

    slow = ThroughputMonitor(window=2)
    make_loop(DataLoader(SlowData(12, 0.01), batch_size=2)).fit(num_epochs=1, callbacks=[slow, Busy(0.02, -10),
                                                                                        Busy(0.02, 10)])
    loading = 6 * 2 * 0.01  # six batches of two samples, 10 ms each
    assert loading * 0.9 <= slow.last_epoch["wait_s"] <= loading + 0.1  # not the 0.24 s of the busy callbacks


class SlowStartAndEnd(torch.utils.data.IterableDataset):
    """Twelve samples; starting an iteration takes ``start_s`` (as starting worker processes does: in
    ``iter(loader)``, before any ``next``), and finding the end takes ``end_s`` (the ``next`` that stops)."""

    def __init__(self, start_s: float, end_s: float):
        self.inner, self.start_s, self.end_s = data(12), start_s, end_s

    def __iter__(self):
        time.sleep(self.start_s)
        return self._samples()

    def _samples(self):
        yield from self.inner
        time.sleep(self.end_s)


def test_data_wait_counts_starting_the_loaders_iteration_and_the_next_that_finds_its_end():
    """The loader's time outside the batches' own ``next``: starting its iteration (workers, a resume's skipping)
    and the last ``next``, which ends the epoch."""
    start_s, end_s = 0.1, 0.15
    monitor = ThroughputMonitor(window=2)
    tl = make_loop(DataLoader(SlowStartAndEnd(start_s, end_s), batch_size=4))
    tl.fit(num_epochs=1, callbacks=[monitor])
    assert monitor.last_epoch["wait_s"] >= start_s + end_s  # a sleep is never shorter than asked
    assert tl.run_state.loader_wait_s >= start_s + end_s


# --- FLOPs and MFU --------------------------------------------------------------------------------------------
def test_flops_are_counted_once_on_the_first_batch_as_by_hand():
    monitor = ThroughputMonitor(peak_flops=1e9)
    tl = make_loop(loader(50, 8))
    tl.fit(num_epochs=2, callbacks=[monitor])
    assert monitor.flops_batch_size == 8 and monitor.flops_per_batch == hand_counted_flops(8)
    # The smaller last batch counts for its size: all samples of the epoch.
    assert monitor.last_epoch["flops"] == pytest.approx(hand_counted_flops(8) * 50 / 8, rel=1e-12)
    assert monitor.last_epoch["flops"] == pytest.approx(hand_counted_flops(50), rel=1e-12)
    assert _get_current_dispatch_mode() is None  # the counting mode is gone


class Checkpointed(TwoLayers):
    """TwoLayers whose second layer runs under activation checkpointing: its forward is computed again during the
    backward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        hidden = self.fc1(x)  # requires grad: the reentrant checkpoint needs an input that does
        return torch.utils.checkpoint.checkpoint(lambda h: self.fc2(torch.relu(h)), hidden,
                                                 use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_recomputation_counts_for_the_hardware_not_the_model(reentrant):
    """Issue 34.4: the model's forward and backward count once; the recomputed forward is hardware work only."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    monitor = ThroughputMonitor(peak_flops=1e9)
    tl = TrainLoop(model, loader(48, 8), None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1, callbacks=[monitor])
    assert monitor.flops_per_batch == hand_counted_flops(8)
    recomputed = 2 * 8 * HIDDEN * OUT  # the second layer's forward, run again in the backward
    if reentrant:
        assert monitor.hardware_flops_per_batch == hand_counted_flops(8) + recomputed
    else:  # recomputes only what the backward needs of the segment (here no product: only the ReLU)
        assert hand_counted_flops(8) <= monitor.hardware_flops_per_batch <= hand_counted_flops(8) + recomputed
    if monitor.hardware_flops_per_batch != monitor.flops_per_batch:
        assert tl.train_history["hfu"][0] == pytest.approx(
            tl.train_history["mfu"][0] * monitor.hardware_flops_per_batch / monitor.flops_per_batch, rel=1e-9)


class MatmulStepSGD(torch.optim.SGD):
    """SGD whose step first orthogonalises each matrix gradient a little with matrix products (as Muon does): work
    of the optimizer, not of the model."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None and parameter.grad.dim() == 2:
                    gram = parameter.grad @ parameter.grad.T
                    parameter.grad.copy_(1.5 * parameter.grad - 0.5 * (gram @ parameter.grad))
        return super().step(closure)


@pytest.mark.parametrize("grad_accumulation", [1, 2])
def test_an_optimizer_step_with_matrix_products_is_not_counted(grad_accumulation):
    torch.manual_seed(0)
    model = TwoLayers()
    monitor = ThroughputMonitor(peak_flops=1e9)
    tl = TrainLoop(model, loader(48, 8), None, None, MatmulStepSGD(model.parameters(), lr=0.01),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1, callbacks=[monitor], grad_accumulation=grad_accumulation)
    assert monitor.flops_per_batch == monitor.hardware_flops_per_batch == hand_counted_flops(8)
    assert "hfu" not in tl.train_history  # no recomputation: the hardware figure is the model's


def test_the_counted_flops_are_filed_by_the_precision_their_math_ran_in():
    from aitoolbox.torchtrain.callbacks.peak_flops import effective_peak, math_precision
    monitor = ThroughputMonitor(peak_flops=1e9)
    make_loop(loader(16, 8), use_amp={"opt_level": "O1", "dtype": torch.bfloat16}).fit(num_epochs=1,
                                                                                       callbacks=[monitor])
    counted = monitor.counted_flops
    # Under bfloat16 autocast the forward's products run in bfloat16 and so do the backward's gradients of them.
    assert set(counted.model_by_precision) == {"bf16"} and counted.model_by_precision["bf16"] == counted.model
    # float32 on a CUDA device: TF32 where torch allows it for the kind of operation (convolutions by default).
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
        assert math_precision("conv", torch.float32, "cuda") == "tf32"
        assert math_precision("matmul", torch.float32, "cuda") == "fp32"
        assert math_precision("conv", torch.float32, "cpu") == "fp32"
        assert math_precision("matmul", torch.bfloat16, "cuda") == "bf16"
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    # A100: TF32 156 TFLOP/s, float32 19.5: 80 % of the FLOPs in TF32 take 8/156 of the time per 10 FLOPs...
    peak, description = effective_peak("NVIDIA A100-SXM4-80GB", {"tf32": 8.0, "fp32": 2.0})
    assert peak == pytest.approx(10 / (8 / 156e12 + 2 / 19.5e12), rel=1e-12)
    assert description.startswith("A100") and "TF32 80%" in description
    assert effective_peak("NVIDIA A100-SXM4-80GB", {"fp64": 1.0}) is None


def test_mfu_is_the_achieved_flops_over_the_given_peak():
    monitor = ThroughputMonitor(peak_flops=2.5e9, window=3)
    tl = make_loop(loader(50, 8))
    tl.fit(num_epochs=1, callbacks=[monitor])
    epoch = monitor.last_epoch
    expected = monitor.flops_per_batch * epoch["samples"] / monitor.flops_batch_size / epoch["seconds"] / 2.5e9
    assert tl.train_history["mfu"][0] == pytest.approx(expected, rel=1e-12)
    assert tl.train_history["mfu"][0] == pytest.approx(tl.train_history["samples_per_sec"][0]
                                                       * hand_counted_flops(1) / 2.5e9, rel=1e-9)
    assert 0 < monitor.last_window["mfu"]


def test_a_given_flop_count_is_used_and_none_turns_mfu_off():
    given = ThroughputMonitor(flops_per_batch=1000.0, peak_flops=1e9)
    off = ThroughputMonitor(flops_per_batch=None, peak_flops=1e9)
    tl = make_loop(loader(50, 8))
    tl.fit(num_epochs=1, callbacks=[given, off])
    assert given.flops_per_batch == 1000.0 and given.flops_batch_size == 8
    assert given.last_epoch["flops"] == pytest.approx(1000.0 * 50 / 8, rel=1e-12)
    assert off.last_epoch["flops"] is None and off.flops_per_batch is None


def test_on_the_cpu_without_a_peak_there_is_no_mfu_and_the_log_says_so_once(package_logs):
    tl = make_loop(loader(16, 8))
    with package_logs.at_level(logging.INFO, logger="aitoolbox.torchtrain.callbacks.throughput"):
        monitor = ThroughputMonitor()
        tl.fit(num_epochs=1, callbacks=[monitor])
        tl.fit(num_epochs=2)
    notes = [record.getMessage() for record in distinct_records(package_logs) if "no mfu" in record.getMessage()]
    assert len(notes) == 1 and "peak_flops" in notes[0]
    assert "mfu" not in tl.train_history and monitor.flops_per_batch == hand_counted_flops(8)


@pytest.mark.parametrize("use_amp", [False, True], ids=["float32", "amp"])
def test_training_is_bitwise_the_same_with_the_monitor(use_amp):
    plain, monitored = make_loop(loader(50, 8), use_amp=use_amp), make_loop(loader(50, 8), use_amp=use_amp)
    torch.manual_seed(3)
    plain.fit(num_epochs=2, grad_accumulation=2)
    torch.manual_seed(3)
    monitored.fit(num_epochs=2, grad_accumulation=2, callbacks=[ThroughputMonitor(window=2, peak_flops=1e9)])
    for (name, a), b in zip(plain.model.state_dict().items(), monitored.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_under_torch_compile_nothing_is_counted_training_is_unchanged_and_a_given_count_is_used(package_logs):
    results = []
    counted, given = ThroughputMonitor(peak_flops=1e9), ThroughputMonitor(flops_per_batch=100.0, peak_flops=1e9)
    with package_logs.at_level(logging.INFO, logger="aitoolbox.torchtrain.callbacks.throughput"):
        for monitors in ([], [counted, given]):
            torch._dynamo.reset()
            tl = make_loop(loader(50, 8), torch_compile={"backend": "aot_eager"})
            torch.manual_seed(3)
            tl.fit(num_epochs=1, callbacks=monitors)
            results.append(tl.model.state_dict())
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
    assert counted.flops_per_batch == "auto" and counted.last_epoch["flops"] is None
    assert "mfu" in tl.train_history and given.last_epoch["flops"] == pytest.approx(100.0 * 50 / 8, rel=1e-12)
    assert any("not counted under torch_compile" in record.getMessage() for record in distinct_records(package_logs))


def test_the_counting_mode_is_left_when_the_counted_batch_fails():
    class Failing(TwoLayers):
        def get_loss(self, batch_data, criterion, device):
            raise RuntimeError("broken batch")

    torch.manual_seed(0)
    model = Failing()
    tl = TrainLoop(model, loader(16, 8), None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
    with pytest.raises(RuntimeError, match="broken batch"):
        tl.fit(num_epochs=1, callbacks=[ThroughputMonitor()])
    assert _get_current_dispatch_mode() is None


def test_the_flop_count_is_kept_in_checkpoints():
    monitor = ThroughputMonitor()
    make_loop(loader(16, 8)).fit(num_epochs=1, callbacks=[monitor])
    restored = ThroughputMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert (restored.flops_per_batch, restored.flops_batch_size) == (hand_counted_flops(8), 8)
    given = ThroughputMonitor(flops_per_batch=5.0)
    given.load_state_dict(monitor.state_dict())
    assert given.flops_per_batch == 5.0  # a number given to the constructor wins


# --- where the numbers show -----------------------------------------------------------------------------------
def test_the_numbers_reach_the_csv_logger_the_epoch_line_and_the_progress_bar(tmp_path, package_logs, capsys):
    tl = make_loop(loader(50, 8))
    tl.show_progress_bars = True
    with package_logs.at_level(logging.INFO, logger="aitoolbox.epochs"):
        tl.fit(num_epochs=2, callbacks=[ThroughputMonitor(window=2, peak_flops=1e9),
                                        CSVLogger(log_dir=str(tmp_path), is_project=False, batch_log_frequency=None)])
    with open(tmp_path / "epoch_log.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2
    for name in ("samples_per_sec", "data_wait_fraction", "mfu", "peak_memory_mib"):
        assert float(rows[1][name]) == pytest.approx(tl.train_history[name][1], rel=1e-6), name
    lines = [record.getMessage() for record in distinct_records(package_logs) if record.name == "aitoolbox.epochs"]
    assert len(lines) == 2 and all("samples_per_sec" in line and "data_wait_fraction" in line for line in lines)
    bar = capsys.readouterr().err
    assert "samples/s=" in bar and "data wait=" in bar and "mfu=" in bar


def test_callbacks_add_to_the_progress_bar(capsys):
    class Extra(AbstractCallback):
        def __init__(self):
            super().__init__("extra")

        def progress_bar_postfix(self):
            return {"extra": "42"}

    tl = make_loop(loader(16, 8))
    tl.show_progress_bars = True
    tl.fit(num_epochs=1, callbacks=[Extra()])
    assert "loss=" in capsys.readouterr().err.split("extra=42")[0].splitlines()[-1]  # after the loss


# --- arguments and the table ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arguments, error", [
    (dict(window=0), ValueError), (dict(window=2.0), ValueError), (dict(batch_size_fn=3), TypeError),
    (dict(tokens_fn="ids"), TypeError), (dict(flops_per_batch="count"), ValueError),
    (dict(flops_per_batch=-1), ValueError), (dict(peak_flops=0), ValueError), (dict(peak_flops=math.inf), ValueError),
])
def test_bad_arguments_are_refused_with_what_was_wrong(arguments, error):
    name = next(iter(arguments))
    with pytest.raises(error, match=name):
        ThroughputMonitor(**arguments)


def test_a_batch_size_fn_that_does_not_return_an_int_is_refused():
    tl = make_loop(loader(16, 8))
    with pytest.raises(TypeError, match="Python int"):
        tl.fit(num_epochs=1, callbacks=[ThroughputMonitor(batch_size_fn=lambda batch: torch.tensor(8))])


@pytest.mark.parametrize("device_name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 PCIe", "fp16", 756.5e12),
    ("NVIDIA H200", "bf16", 989.4e12), ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12), ("NVIDIA L4", "bf16", 121e12), ("NVIDIA L40S", "bf16", 362.05e12),
    ("NVIDIA A10G", "fp16", 125e12), ("Tesla V100-SXM2-16GB", "fp16", 125e12), ("Tesla T4", "fp16", 65e12),
    ("Tesla T4", "bf16", None), ("NVIDIA H100 NVL", "bf16", None), ("NVIDIA GeForce GTX 1080", "fp32", None),
])
def test_the_peak_table(device_name, precision, peak):
    found = lookup_peak_flops(device_name, precision)
    assert (found[0] if found else None) == peak


def test_the_precision_of_the_table():
    assert precision_key(torch.bfloat16) == "bf16" and precision_key(torch.float16) == "fp16"
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert precision_key(None) == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert precision_key(torch.float32) == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_history_keys_are_listed():
    assert set(HISTORY_KEYS) == {"samples_per_sec", "tokens_per_sec", "data_wait_fraction", "mfu", "hfu",
                                 "peak_memory_mib"}


# --- two processes --------------------------------------------------------------------------------------------
def distributed_worker(rank: int, world_size: int) -> dict:
    join_as_torchrun(rank, world_size)
    torch.manual_seed(0)
    model = TwoLayers()
    tl = TrainLoop(model, DataLoader(data(50), batch_size=4), None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                   nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False, gpu_mode="ddp")
    monitor = ThroughputMonitor(window=2, peak_flops=1e9, tokens_fn=lambda batch: torch.tensor(2 * len(batch[1])))
    tl.fit_distributed(num_epochs=2, callbacks=[monitor], train_data_shuffle=False)
    return {"last_epoch": monitor.last_epoch, "history": {name: list(values) for name, values in
                                                          tl.train_history.items()},
            "flops": (monitor.flops_per_batch, monitor.flops_batch_size)}


@pytest.mark.slow
def test_two_processes_count_every_sample_of_the_epoch_once():
    results = run_distributed(distributed_worker, world_size=2)
    for result in results:
        # 25 samples per process (6 batches of 4 and one of 1), summed over both.
        assert result["last_epoch"]["samples"] == 50 and result["last_epoch"]["tokens"] == 100
        assert result["flops"] == (hand_counted_flops(4), 4)
        assert result["last_epoch"]["flops"] == pytest.approx(hand_counted_flops(50), rel=1e-12)
        mfu = result["last_epoch"]["flops"] / result["last_epoch"]["seconds"] / (2 * 1e9)
        assert result["history"]["mfu"][-1] == pytest.approx(mfu, rel=1e-12)
    for name in ("samples_per_sec", "tokens_per_sec", "data_wait_fraction", "mfu"):
        assert results[0]["history"][name] == results[1]["history"][name], name  # the same in every process


def test_callbacks_see_the_batch_being_trained_and_none_outside_it():
    class Recorder(AbstractCallback):
        def __init__(self):
            super().__init__("recorder")
            self.seen = []

        def on_batch_begin(self):
            self.seen.append(("begin", self.train_loop_obj.current_batch[1].clone()))

        def on_batch_end(self):
            self.seen.append(("end", self.train_loop_obj.current_batch[1].clone()))

        def on_epoch_end(self):
            self.seen.append(("epoch end", self.train_loop_obj.current_batch))

    recorder = Recorder()
    tl = make_loop(DataLoader(data(10), batch_size=4))
    tl.fit(num_epochs=1, callbacks=[recorder])
    labels = data(10).tensors[1]
    expected = [labels[0:4], labels[0:4], labels[4:8], labels[4:8], labels[8:10], labels[8:10]]
    assert [kind for kind, _ in recorder.seen] == ["begin", "end"] * 3 + ["epoch end"]
    assert all(torch.equal(seen, want) for (_, seen), want in zip(recorder.seen, expected))
    assert recorder.seen[-1][1] is None and tl.current_batch is None


def test_the_precision_in_use_comes_from_autocast_or_the_model_weights():
    from aitoolbox.torchtrain.callbacks.throughput import _compute_dtype

    class Loop:
        def __init__(self, autocast_dtype, model):
            self.precision = type("P", (), {"autocast_dtype": autocast_dtype})()
            self.model = model

    mixed = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4).half())  # as amp's O2 leaves a model
    assert _compute_dtype(Loop(torch.bfloat16, nn.Linear(4, 4))) == torch.bfloat16
    assert _compute_dtype(Loop(None, mixed)) == torch.float16
    assert _compute_dtype(Loop(None, nn.Linear(4, 4))) is None
