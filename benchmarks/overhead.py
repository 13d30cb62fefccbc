"""TrainLoop's overhead over a hand-written PyTorch loop: the quickstart CNN on scikit-learn's digits.

Three scenarios, each timed per epoch:

* ``bare``: ``TrainLoop(end_auto_eval=False, show_progress=False)`` against the plainest loop
  (the batch moved to the device as the models' ``get_loss`` moves it, forward, loss, backward,
  ``optimizer.step()``, ``zero_grad(set_to_none=True)``; the same hand loop in every scenario).
* ``tiny-model``: a single linear layer, so that the loop's fixed cost per batch (the "extra us/batch"
  column) is not hidden by the compute; TrainLoop runs as users run it, with its progress bar on
  (``show_progress=True``, written to /dev/null). Its epoch is the training digits repeated
  ``--tiny-epoch-repeat`` times (default 10: 400 batches), so that what TrainLoop does once per ``fit`` and
  per epoch (set-up, the bar's creation, the RNG snapshot for resuming, the epoch's summary line: about
  1 ms) weighs per batch as in an epoch of realistic length rather than of 40 batches;
  ``--tiny-epoch-repeat 1`` shows that per-epoch cost. Target: at most +20 us per batch (the step point's copy of
  the model's buffers included). A third runner, ``TrainLoop+ThroughputMonitor``, is the same TrainLoop with a
  ``ThroughputMonitor(peak_flops=1e12)`` (FLOPs counted on the first batch, MFU, the window's rates in the bar),
  interleaved with the other two; its row also gives its extra time over the plain TrainLoop (the monitor's cost).
  Target: at most +5 us per batch.
  Under the table, the cost of the monitor's per-batch hooks alone (the loop's four batch-hook calls and the
  monitor's work in them, 200,000 times, best of 5): on a shared machine a difference of a few microseconds
  between two epochs' medians is within their noise, this direct reading is not. ``--no-monitor`` leaves both
  out.
* ``bars+metrics``: TrainLoop with progress bars and the callbacks
  ``ModelPerformanceEvaluation(ClassificationResultPackage())`` + ``ModelPerformancePrintReport(['val_Accuracy'])``,
  against a hand loop that also predicts the validation set each epoch, computes the package's four metrics
  (accuracy, macro F1, precision and recall, with scikit-learn) and prints the accuracy; as each TrainLoop epoch is
  a whole ``fit``, whose train end computes the metrics of the same (cached) predictions again and reports them,
  the hand loop computes and prints them twice an epoch too, so both do the same work (before 2026-11-30 the hand
  loop computed the accuracy once: see RESULTS.md). ``end_auto_eval=False`` in both scenarios
  (the hand loop computes no whole-set losses either). Everything written to stdout and stderr during
  the timed runs (bars, log lines, the accuracy lines) goes to /dev/null; the table is printed afterwards.

How it is measured: for each repeat, fresh models with the same initial weights and fresh loaders with
the same shuffling seed are built for every runner; the runners then train one epoch at a time,
interleaved (A B, B A, A B, ... so slow drift of a shared machine cancels), and only the epochs after
``--warmup`` are kept. Each runner owns its torch RNG state (dropout), so the interleaving does not change
what it computes: TrainLoop and the hand loop end with bitwise identical weights, which the script
checks and reports ("same weights") as proof that both did the same work.

The TrainLoop time of an epoch is one ``tl.fit(num_epochs=k)`` call, i.e. it includes fit's own setup.
If ``lightning`` (or ``pytorch_lightning``) is importable its Trainer is a third column (timing only: its
weights are not expected to match the hand loop's bitwise, "same weights" then says "differs").

Run:  python benchmarks/overhead.py                      (about 1 minute on 2 idle cores)
      python benchmarks/overhead.py --quick              (smoke test, a few seconds)
      python benchmarks/overhead.py --profile 20         (cProfile of 20 TrainLoop epochs vs the hand loop)
      python benchmarks/overhead.py --bytecode           (Python bytecode a batch, TrainLoop vs the hand loop)

``--bytecode`` counts the Python bytecode instructions each loop executes in one tiny-model epoch (traced, after
two untraced epochs), by function, and prints TrainLoop's excess per batch: unlike a time, the count does not
depend on how busy the machine is, so a change to the loop's per-batch Python work shows in it exactly. The bar hands
its steps to tqdm on a clock, which tracing slows twentyfold: the traced epoch draws only once, at its start, and
tqdm's own functions are one line apart and left out of the total.
"""
import argparse
import collections
import contextlib
import cProfile
import inspect
import io
import math
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
from sklearn.metrics import accuracy_score, precision_recall_fscore_support  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import ConcatDataset, DataLoader, Subset  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage  # noqa: E402
from aitoolbox.torchtrain.callbacks.performance_eval import (  # noqa: E402
    ModelPerformanceEvaluation, ModelPerformancePrintReport)
from aitoolbox.torchtrain.callbacks.throughput import ThroughputMonitor  # noqa: E402
from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop, progress  # noqa: E402

SCENARIOS = ("bare", "bars+metrics", "tiny-model")
TARGETS = {"bare": 1.02, "bars+metrics": 1.05}  # median paired ratios
EXTRA_US_TARGETS = {"tiny-model": 20.0}  # the loop's fixed cost per batch, in microseconds
MONITOR_RUNNER = "TrainLoop+ThroughputMonitor"
MONITOR_EXTRA_US_TARGET = 5.0  # the monitor's cost per batch over the plain TrainLoop, in microseconds
DEVICE = torch.device("cpu")  # where the hand loop moves its batches (this benchmark runs on the CPU)


class RngSlot:
    """A private torch RNG state: a runner draws its dropout masks from it, whatever ran in between."""

    def __init__(self, seed: int):
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.state = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def active(self):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(saved)


class TinyLinear(TTModel):
    """One linear layer on the flattened digits: so little compute that the loop's own cost shows."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, images):
        return self.linear(images.flatten(1))

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


def build_model_and_data(args, scenario: str):
    """The same initial weights and the same loaders (own shuffling generator) for every runner."""
    torch.manual_seed(args.seed)
    model = TinyLinear() if scenario == "tiny-model" else DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader, val_loader, _ = digits_loaders(args.batch_size, args.seed)
    if args.train_samples:  # a shorter epoch (smoke tests): the first samples, shuffled the same way
        subset = Subset(train_loader.dataset, range(min(args.train_samples, len(train_loader.dataset))))
        train_loader = DataLoader(subset, batch_size=args.batch_size, shuffle=True,
                                  generator=torch.Generator().manual_seed(args.seed))
    if scenario == "tiny-model" and args.tiny_epoch_repeat > 1:
        repeated = ConcatDataset([train_loader.dataset] * args.tiny_epoch_repeat)
        train_loader = DataLoader(repeated, batch_size=args.batch_size, shuffle=True,
                                  generator=torch.Generator().manual_seed(args.seed))
    return model, optimizer, train_loader, val_loader


class HandLoop:
    """The plain PyTorch loop; with ``with_metrics`` it also reports validation accuracy every epoch."""

    name = "hand"

    def __init__(self, args, scenario: str):
        self.model, self.optimizer, self.train_loader, self.val_loader = build_model_and_data(args, scenario)
        self.criterion = nn.CrossEntropyLoss()
        self.with_metrics = scenario == "bars+metrics"
        self.epoch = 0

    def run_epoch(self) -> None:
        model, optimizer, criterion, device = self.model, self.optimizer, self.criterion, DEVICE
        model.train()
        for images, labels in self.train_loader:
            # The batch moved to the device as the models' get_loss does (a no-op move on the CPU, not free).
            loss = criterion(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.with_metrics:
            model.eval()
            predictions, targets = [], []
            with torch.no_grad():
                for images, labels in self.val_loader:
                    predictions.append(model(images.to(device)).argmax(dim=1).cpu())  # as get_predictions
                    targets.append(labels)
            model.train()
            y_true, y_predicted = torch.cat(targets).numpy(), torch.cat(predictions).numpy()
            accuracy = classification_metrics(y_true, y_predicted)["Accuracy"]
            print(f"Epoch {self.epoch} performance report\n  val_Accuracy: {accuracy}", file=sys.stderr)
            # TrainLoopRunner's epoch is a whole fit, whose train end computes the metrics of the same (cached)
            # predictions again (the train_end_ ones) and reports them: the same work here.
            accuracy = classification_metrics(y_true, y_predicted)["Accuracy"]
            print(f"End of training performance report\n  val_Accuracy: {accuracy}", file=sys.stderr)
        self.epoch += 1


def classification_metrics(y_true, y_predicted) -> Dict[str, float]:
    """What ClassificationResultPackage computes for a multi-class set: accuracy, macro precision, recall, F1."""
    precision, recall, f1, _ = precision_recall_fscore_support(y_true, y_predicted, average="macro", zero_division=0)
    return {"Accuracy": float(accuracy_score(y_true, y_predicted)), "F1_score": float(f1),
            "Precision": float(precision), "Recall": float(recall)}


class TrainLoopRunner:
    """TrainLoop trained one more epoch per ``fit`` call (fit counts epochs in totals)."""

    name = "TrainLoop"

    def __init__(self, args, scenario: str):
        with_metrics = scenario == "bars+metrics"
        self.model, optimizer, self.train_loader, val_loader = build_model_and_data(args, scenario)
        self.train_loop = TrainLoop(self.model, self.train_loader, val_loader, None, optimizer, nn.CrossEntropyLoss(),
                                    end_auto_eval=False, show_progress=scenario != "bare")
        self.callbacks = [ModelPerformanceEvaluation(ClassificationResultPackage(), args=None, on_val_data=True),
                          ModelPerformancePrintReport(["val_Accuracy"])] if with_metrics else []
        self.epochs_done = 0

    def run_epoch(self) -> None:
        callbacks = self.callbacks if self.epochs_done == 0 else None  # registered once, they stay registered
        self.train_loop.fit(num_epochs=self.epochs_done + 1, callbacks=callbacks)
        self.epochs_done += 1


class MonitoredTrainLoopRunner(TrainLoopRunner):
    """TrainLoop with a ThroughputMonitor (FLOPs counted, MFU against a given peak), otherwise as TrainLoopRunner."""

    name = MONITOR_RUNNER

    def __init__(self, args, scenario: str):
        super().__init__(args, scenario)
        self.callbacks = self.callbacks + [ThroughputMonitor(peak_flops=1e12)]


def import_lightning():
    """The ``lightning`` package, else ``pytorch_lightning``, else None."""
    for module_name in ("lightning", "pytorch_lightning"):
        try:
            return __import__(module_name)
        except ImportError:
            continue
    return None


class LightningRunner:
    """Lightning's Trainer, continued one epoch per ``fit`` call by raising ``fit_loop.max_epochs``.

    ``bare``: ``Trainer(barebones=True)`` where the installed version has it (no logger, checkpointing,
    progress bar or model summary either way). ``bars+metrics``: progress bar on and a validation step that
    collects predictions, with the same metrics and accuracy print as the hand loop's epoch end (once an epoch).
    """

    name = "Lightning"

    def __init__(self, args, scenario: str, lightning):
        with_metrics = scenario == "bars+metrics"
        model, optimizer, self.train_loader, self.val_loader = build_model_and_data(args, scenario)
        self.model = model
        self.module = _lightning_module_class(lightning)(model, optimizer, with_metrics)
        self.with_metrics = with_metrics
        options = dict(accelerator="cpu", devices=1, max_epochs=0, logger=False, enable_checkpointing=False,
                       enable_model_summary=False, num_sanity_val_steps=0)
        if with_metrics:
            options.update(enable_progress_bar=True)
        else:
            options.update(enable_progress_bar=False, limit_val_batches=0)
            if "barebones" in inspect.signature(lightning.Trainer.__init__).parameters:
                options.update(barebones=True)
                del options["enable_checkpointing"], options["enable_model_summary"], options["logger"]
                del options["enable_progress_bar"], options["num_sanity_val_steps"]
        self.trainer = lightning.Trainer(**options)
        self.epochs_done = 0

    def run_epoch(self) -> None:
        self.trainer.fit_loop.max_epochs = self.epochs_done + 1
        if self.with_metrics:
            self.trainer.fit(self.module, self.train_loader, self.val_loader)
        else:
            self.trainer.fit(self.module, self.train_loader)
        self.epochs_done += 1


def _lightning_module_class(lightning):
    """A LightningModule around DigitsCNN (defined lazily: lightning is optional)."""

    class DigitsModule(lightning.LightningModule):
        def __init__(self, net, optimizer, with_metrics):
            super().__init__()
            self.net = net
            self.optimizer = optimizer
            self.with_metrics = with_metrics
            self.criterion = nn.CrossEntropyLoss()
            self._predictions: List[torch.Tensor] = []
            self._targets: List[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return self.criterion(self.net(images), labels)

        def validation_step(self, batch, batch_idx):
            images, labels = batch
            self._predictions.append(self.net(images).argmax(dim=1))
            self._targets.append(labels)

        def on_validation_epoch_end(self):
            accuracy = classification_metrics(torch.cat(self._targets).numpy(),
                                              torch.cat(self._predictions).numpy())["Accuracy"]
            print(f"Epoch {self.current_epoch} performance report\n  val_Accuracy: {accuracy}", file=sys.stderr)
            self._predictions, self._targets = [], []

        def configure_optimizers(self):
            return self.optimizer

    return DigitsModule


def monitor_hook_cost_us(args, calls: int = 200_000, rounds: int = 5) -> float:
    """Microseconds per batch that a ThroughputMonitor adds through its batch hooks: the handler's four calls a
    batch with a callback overriding batch hooks (none are made without one) and the monitor's work in them, on a
    tiny-model batch, the fastest of ``rounds`` rounds of ``calls`` batches (window closes included)."""
    model, optimizer, train_loader, _ = build_model_and_data(args, "tiny-model")
    train_loop = TrainLoop(model, train_loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                           show_progress=False)
    monitor = ThroughputMonitor(peak_flops=1e12)
    train_loop.callbacks_handler.register_callbacks([monitor])
    train_loop.set_up()
    monitor.on_train_begin()
    monitor.on_epoch_begin()
    handler = train_loop.callbacks_handler
    train_loop._current_batch = next(iter(train_loader))  # what the loop sets before on_batch_begin
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            if handler.has_batch_hooks:  # as TrainLoop._run_batch and StepRunner do
                handler.on_batch_begin()
                handler.on_after_gradient_update(0)
                handler.on_after_optimizer_step()
                handler.on_batch_end()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def same_weights(model_a: nn.Module, model_b: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))


def run_scenario(scenario: str, args, lightning) -> Dict[str, object]:
    """Time every runner's epochs, interleaved, over ``args.repeats`` fresh starts."""
    factories = [lambda: HandLoop(args, scenario), lambda: TrainLoopRunner(args, scenario)]
    if scenario == "tiny-model" and not args.no_monitor:
        factories.append(lambda: MonitoredTrainLoopRunner(args, scenario))
    if lightning is not None:
        factories.append(lambda: LightningRunner(args, scenario, lightning))
    times: Dict[str, List[float]] = {}
    paired_ratios: Dict[str, List[float]] = {}
    paired_diffs: Dict[str, List[float]] = {}
    weights_equal: Dict[str, List[bool]] = {}
    for repeat in range(args.repeats):
        with _common.output_to_devnull():
            runners = [factory() for factory in factories]
        rng_slots = [RngSlot(args.seed + 1) for _ in runners]
        for epoch in range(args.warmup + args.epochs):
            order = list(range(len(runners)))
            if (epoch + repeat) % 2:
                order.reverse()
            epoch_times = {}
            for index in order:
                runner = runners[index]
                with _common.output_to_devnull(), rng_slots[index].active():
                    start = time.perf_counter()
                    runner.run_epoch()
                    epoch_times[runner.name] = time.perf_counter() - start
            if epoch < args.warmup:
                continue
            for name, seconds in epoch_times.items():
                times.setdefault(name, []).append(seconds)
                if name != "hand":
                    paired_ratios.setdefault(name, []).append(seconds / epoch_times["hand"])
                    paired_diffs.setdefault(name, []).append(seconds - epoch_times["hand"])
                if name == MONITOR_RUNNER:
                    paired_diffs.setdefault("monitor over TrainLoop", []).append(seconds - epoch_times["TrainLoop"])
        for runner in runners[1:]:
            weights_equal.setdefault(runner.name, []).append(same_weights(runners[0].model, runner.model))
    return {"times": times, "paired_ratios": paired_ratios, "paired_diffs": paired_diffs,
            "weights_equal": {name: all(equal) for name, equal in weights_equal.items()},
            "batches_per_epoch": len(runners[0].train_loader)}


def result_rows(scenario: str, result: Dict[str, object], lightning_present: bool) -> List[List[str]]:
    times, ratios = result["times"], result["paired_ratios"]
    hand = _common.median(times["hand"])
    rows = []
    names = ["TrainLoop"] + ([MONITOR_RUNNER] if MONITOR_RUNNER in times else [])
    for name in names + (["Lightning"] if lightning_present else []):
        runner_median = _common.median(times[name])
        ratio_of_medians = runner_median / hand
        median_ratio = _common.median(ratios[name])
        per_batch_us = _common.median(result["paired_diffs"][name]) / result["batches_per_epoch"] * 1e6
        target_cell = "(no target)"
        same = "yes" if result["weights_equal"][name] else ("differs" if name == "Lightning" else "NO")
        if name == "TrainLoop" and scenario in TARGETS:
            verdict = "met" if median_ratio <= TARGETS[scenario] else "MISSED"
            target_cell = f"<= {TARGETS[scenario]:.2f}: {verdict}"
        elif name == "TrainLoop" and scenario in EXTRA_US_TARGETS:
            verdict = "met" if per_batch_us <= EXTRA_US_TARGETS[scenario] else "MISSED"
            target_cell = f"<= +{EXTRA_US_TARGETS[scenario]:.0f} us/batch: {verdict}"
        elif name == MONITOR_RUNNER:
            monitor_us = _common.median(result["paired_diffs"]["monitor over TrainLoop"]) \
                / result["batches_per_epoch"] * 1e6
            verdict = "met" if monitor_us <= MONITOR_EXTRA_US_TARGET else "MISSED"
            target_cell = (f"monitor over TrainLoop {monitor_us:+.1f} us/batch "
                           f"(<= +{MONITOR_EXTRA_US_TARGET:.0f}: {verdict})")
        ratio_of_minima = min(times[name]) / min(times["hand"])
        rows.append([scenario, name, str(len(times[name])), f"{hand * 1e3:.1f}", f"{runner_median * 1e3:.1f}",
                     _common.fmt_ratio(ratio_of_medians), _common.fmt_ratio(median_ratio),
                     _common.fmt_ratio(ratio_of_minima), f"{per_batch_us:+.0f}", target_cell, same])
    return rows


HEADERS = ["scenario", "loop", "epochs timed", "hand ms/epoch (median)", "loop ms/epoch (median)",
           "ratio of medians", "median paired ratio", "ratio of minima", "extra us/batch (median paired)",
           "target", "same weights"]


def profile(args, num_epochs: int) -> str:
    """cProfile of ``num_epochs`` bare TrainLoop epochs and hand-loop epochs: where the extra time goes."""
    report = io.StringIO()
    for runner_class in (HandLoop, TrainLoopRunner):
        with _common.output_to_devnull():
            runner = runner_class(args, "bare")
            runner.run_epoch()  # warm-up, not profiled
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(num_epochs):
                runner.run_epoch()
            profiler.disable()
        stats = pstats.Stats(profiler, stream=report)
        report.write(f"\n===== {runner_class.name}: {num_epochs} epochs, "
                     f"{stats.total_calls} function calls, {stats.total_tt:.3f} s =====\n")
        stats.sort_stats("tottime").print_stats(args.profile_top)
    return report.getvalue()


TQDM_KEY = "tqdm (the bar's creation, one draw and close a fit; left out)"


def bytecode_per_batch(runner, epochs_untraced: int = 2) -> Dict[str, float]:
    """Python bytecode instructions per batch of one traced epoch of ``runner``, by ``file:function``."""
    for _ in range(epochs_untraced):
        runner.run_epoch()
    counts: Dict[str, int] = collections.Counter()

    def trace_calls(frame, event, arg):
        frame.f_trace_opcodes = True
        code = frame.f_code
        key = TQDM_KEY if f"{os.sep}tqdm{os.sep}" in code.co_filename else f"{Path(code.co_filename).name}:{code.co_name}"

        def trace_opcodes(frame, event, arg):
            if event == "opcode":
                counts[key] += 1
            return trace_opcodes
        return trace_opcodes

    # The bar hands its steps to tqdm on a clock (every DRAW_INTERVAL_S), and tracing slows an epoch twentyfold, so
    # a traced epoch drew twenty times as often as a real one, more on a busy machine: the traced epoch draws once,
    # at its start, and the count is the bar's per-step cost (an untraced tiny-model epoch draws every ~120 batches).
    draw_interval, progress.DRAW_INTERVAL_S = progress.DRAW_INTERVAL_S, 3600.0
    sys.settrace(trace_calls)
    try:
        runner.run_epoch()
    finally:
        sys.settrace(None)
        progress.DRAW_INTERVAL_S = draw_interval
    batches = len(runner.train_loader)
    return {key: count / batches for key, count in counts.items()}


def bytecode_report(args) -> str:
    """TrainLoop's excess Python bytecode a tiny-model batch over the hand loop's, by function."""
    with _common.output_to_devnull():
        hand = bytecode_per_batch(HandLoop(args, "tiny-model"))
        loop = bytecode_per_batch(TrainLoopRunner(args, "tiny-model"))
    excess = {key: loop.get(key, 0.0) - hand.get(key, 0.0) for key in set(hand) | set(loop)}
    counted = {key: count for key, count in excess.items() if key != TQDM_KEY}
    lines = [f"Python bytecode instructions per tiny-model batch: hand loop {sum(hand.values()):.0f}, TrainLoop "
             f"{sum(loop.values()):.0f}; TrainLoop's excess {sum(counted.values()):+.0f} without tqdm's redraws "
             f"(per-fit work spread over the epoch's {len(TrainLoopRunner(args, 'tiny-model').train_loader)} batches "
             "included)"]
    lines += [f"  {count:+8.1f}  {key}" for key, count in sorted(excess.items(), key=lambda item: -abs(item[1]))
              if abs(count) >= 0.5]
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="timed epochs per repeat and runner")
    parser.add_argument("--repeats", type=int, default=3, help="fresh starts, each with --warmup + --epochs epochs")
    parser.add_argument("--warmup", type=int, default=2, help="untimed epochs at the start of each repeat")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-samples", type=int, default=0,
                        help="train on only the first N of the 1,257 training digits (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--tiny-epoch-repeat", type=int, default=10,
                        help="tiny-model's epoch: the training digits this many times (1: 40 batches)")
    parser.add_argument("--no-lightning", action="store_true", help="skip Lightning even if it is installed")
    parser.add_argument("--no-monitor", action="store_true",
                        help="leave TrainLoop+ThroughputMonitor out of the tiny-model scenario")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 timed epochs of 320 samples, 1 repeat, 1 warm-up")
    parser.add_argument("--profile", type=int, default=0, metavar="EPOCHS",
                        help="also print a cProfile of this many bare epochs of each loop")
    parser.add_argument("--profile-top", type=int, default=25, help="functions listed per profile")
    parser.add_argument("--bytecode", action="store_true",
                        help="only count the Python bytecode a tiny-model batch executes in each loop (deterministic)")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'overhead' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.repeats, args.warmup = 2, 1, 1
        args.train_samples = args.train_samples or 320
    if args.quick:
        args.tiny_epoch_repeat = 1
    for name in ("epochs", "repeats", "tiny_epoch_repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    threads = _common.set_threads(args.threads)
    if args.bytecode:
        text = bytecode_report(args)
        print(text)
        return text
    lightning = None if args.no_lightning else import_lightning()
    info = _common.machine_info(torch.device("cpu"))
    if lightning is not None:
        info["lightning"] = f"{lightning.__name__} {lightning.__version__}"
    else:
        info["lightning"] = "skipped (--no-lightning)" if args.no_lightning else \
            "skipped (neither lightning nor pytorch_lightning is importable)"
    samples = f"first {args.train_samples} training samples" if args.train_samples else "all 1,257 training samples"
    settings = (f"epochs={args.epochs} timed + {args.warmup} warm-up per repeat, repeats={args.repeats}, "
                f"batch size {args.batch_size}, {samples}, threads={threads}, "
                f"tiny-model epoch = the training set x {args.tiny_epoch_repeat}")
    # The first epochs of a process pay one-off costs (oneDNN kernel creation, lazy imports): pay them here.
    with _common.output_to_devnull():
        for runner_class in (HandLoop, TrainLoopRunner):
            runner_class(args, "bare").run_epoch()
    load_before = _common.load_average()
    rows = []
    for scenario in args.scenarios:
        result = run_scenario(scenario, args, lightning)
        rows += result_rows(scenario, result, lightning is not None)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    info["settings"] = settings
    table = _common.markdown_table(HEADERS, rows)
    lines = [f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, ""]
    if "tiny-model" in args.scenarios and not args.no_monitor:
        with _common.output_to_devnull():
            hooks_us = monitor_hook_cost_us(args)
        verdict = "met" if hooks_us <= MONITOR_EXTRA_US_TARGET else "MISSED"
        lines += [f"ThroughputMonitor's batch hooks alone: {hooks_us:.2f} us per batch (best of 5 x 200,000; "
                  f"target <= +{MONITOR_EXTRA_US_TARGET:.0f} us: {verdict})", ""]
    text = "\n".join(lines)
    print(text)
    if lightning is None:
        print(f"Lightning column: {info['lightning']}")
    if args.profile:
        print(profile(args, args.profile))
    if args.write_results:
        path = _common.update_results_section("overhead", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
