"""What ProfilerCallback costs outside its active batches: TrainLoop with and without it, on a tiny model.

Four TrainLoops train the same single linear layer on the same synthetic data (200 batches of 32 an epoch, the
same shuffling seed, no dropout), with ``show_progress=False`` and no evaluation, so that the loop's own cost per
batch is what is compared:

* ``plain``: no callback (the loop skips the batch hooks altogether).
* ``plain again``: a second loop without a callback, timed against the first like the others: its difference is
  the noise floor of the measurement (zero on an idle machine).
* ``after the schedule``: ``ProfilerCallback(wait=0, warmup=1, active=1)``, registered in the untimed warm-up epoch,
  whose first two batches it profiles (one trace written). In the timed epochs the schedule is over: the callback
  has closed the profiler and unsubscribed from the batch hooks. Target: no measurable cost (within the noise of
  the paired differences, a few microseconds per batch on a shared machine).
* ``in wait steps``: ``ProfilerCallback(wait=10**9)``, whose schedule never leaves its wait phase: every batch
  calls the callback's batch hooks and ``profiler.step()`` without recording anything. This is the cost of the
  ``wait`` batches before a cycle (reported, no target).

How it is measured: each repeat builds the three loops afresh; they then train one epoch at a time (one
``fit(num_epochs=k)`` call), in an order that rotates every epoch so slow drift of a shared machine cancels, and
the epochs after ``--warmup`` are kept. The cost is the median over the timed epochs of the paired difference to
``plain``'s epoch, divided by the batches in an epoch, in wall-clock time and in the CPU time of this process
(``time.process_time``; with one torch thread it is the time the loop itself computed, which other processes of a
busy machine disturb far less than the wall clock: the target is judged on it). The loops must end with bitwise
equal weights ("same weights"): the callback changes nothing in training.

On a busy machine the timings scatter by more than the few microseconds in question, so the script also counts
the work itself: after the timed epochs each loop trains one more epoch under ``sys.setprofile``, which counts
the Python function calls and the calls of C functions from Python ("calls per batch", exact and independent of
the load). A loop that does the same work per batch as ``plain`` makes the same calls; the difference per epoch
of ``after the schedule`` is the callback's ``on_train_begin`` / ``on_train_end`` of each ``fit`` call.

Run:  python benchmarks/profiler_overhead.py                 (about 35 s of CPU time: 1.5 min on a busy 2-core VM)
      python benchmarks/profiler_overhead.py --quick         (smoke test, a few seconds)
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import _common  # noqa: E402
from overhead import TinyLinear  # noqa: E402  (the overhead benchmark's tiny model)

from aitoolbox.torchtrain.callbacks import ProfilerCallback  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

RUNNERS = ("plain", "plain again", "after the schedule", "in wait steps")


class Runner:
    """A TrainLoop trained one more epoch per ``fit`` call, with the callback of its kind."""

    def __init__(self, name: str, args, trace_dir: str):
        self.name = name
        torch.manual_seed(args.seed)
        self.model = TinyLinear()
        generator = torch.Generator().manual_seed(args.seed)
        x = torch.randn(args.batches * args.batch_size, 64, generator=generator)
        y = torch.randint(0, 10, (len(x),), generator=generator)
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(args.seed))
        self.train_loop = TrainLoop(self.model, loader, None, None, torch.optim.SGD(self.model.parameters(), lr=0.01),
                                    nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
        self.callback = None
        if name == "after the schedule":
            self.callback = ProfilerCallback(wait=0, warmup=1, active=1, output_dir=trace_dir)
        elif name == "in wait steps":
            self.callback = ProfilerCallback(wait=10 ** 9, warmup=1, active=1, output_dir=trace_dir)
        self.epochs_done = 0

    def run_epoch(self) -> None:
        callbacks = [self.callback] if self.callback is not None and self.epochs_done == 0 else None
        self.train_loop.fit(num_epochs=self.epochs_done + 1, callbacks=callbacks)
        self.epochs_done += 1


def count_calls(runner: Runner) -> int:
    """Python and C function calls made by one more epoch of ``runner`` (one ``fit`` call)."""
    count = 0

    def counter(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    with _common.stderr_to_devnull():
        sys.setprofile(counter)
        try:
            runner.run_epoch()
        finally:
            sys.setprofile(None)
    return count


def run(args) -> Dict[str, object]:
    times: Dict[str, List[float]] = {name: [] for name in RUNNERS}
    diffs: Dict[str, List[float]] = {name: [] for name in RUNNERS[1:]}
    cpu_diffs: Dict[str, List[float]] = {name: [] for name in RUNNERS[1:]}
    same_weights = True
    traces = 0
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as trace_dir:
            runners = [Runner(name, args, trace_dir) for name in RUNNERS]
            for epoch in range(args.warmup + args.epochs):
                shift = (epoch + repeat) % len(runners)
                order = runners[shift:] + runners[:shift]
                epoch_times, cpu_times = {}, {}
                for runner in order:
                    with _common.stderr_to_devnull():
                        start, cpu_start = time.perf_counter(), time.process_time()
                        runner.run_epoch()
                        cpu_times[runner.name] = time.process_time() - cpu_start
                        epoch_times[runner.name] = time.perf_counter() - start
                if epoch < args.warmup:
                    continue
                for name, seconds in epoch_times.items():
                    times[name].append(seconds)
                    if name != "plain":
                        diffs[name].append(seconds - epoch_times["plain"])
                        cpu_diffs[name].append(cpu_times[name] - cpu_times["plain"])
            if repeat == args.repeats - 1:
                calls = {runner.name: count_calls(runner) for runner in runners}
            after = runners[RUNNERS.index("after the schedule")]
            traces += len(after.callback.trace_files)
            hooks_after = after.train_loop.callbacks_handler.has_batch_hooks
            same_weights &= all(torch.equal(a, b) for runner in runners[1:]
                                for a, b in zip(runners[0].model.parameters(), runner.model.parameters()))
    return {"times": times, "diffs": diffs, "cpu_diffs": cpu_diffs, "calls": calls, "same_weights": same_weights,
            "traces": traces, "batch_hooks_after_schedule": hooks_after}


HEADERS = ["loop", "epochs timed", "ms/epoch (median)", "extra us/batch vs plain, wall clock (median paired)",
           "median paired ratio", "extra CPU us/batch vs plain (median paired)", "calls per batch (one epoch)",
           "extra calls per epoch vs plain", "target", "same weights"]


def result_rows(result: Dict[str, object], args) -> List[List[str]]:
    times, diffs = result["times"], result["diffs"]
    plain = _common.median(times["plain"])
    calls = result["calls"]
    rows = [["plain", str(len(times["plain"])), f"{plain * 1e3:.2f}", "", "", "",
             f"{calls['plain'] / args.batches:.2f}", "", "", ""]]
    for name in RUNNERS[1:]:
        extra_us = _common.median(diffs[name]) / args.batches * 1e6
        extra_cpu_us = _common.median(result["cpu_diffs"][name]) / args.batches * 1e6
        ratio = _common.median([(t + d) / t for t, d in zip(times["plain"], diffs[name])])
        extra_calls = calls[name] - calls["plain"]
        target = "(no target)"
        if name == "after the schedule":
            met = extra_calls < args.batches  # less than one extra call per batch: nothing per batch
            target = f"no extra work per batch: {'met' if met else 'MISSED'}"
        elif name == "plain again":
            target = "(noise floor of the timings)"
        rows.append([name, str(len(times[name])), f"{_common.median(times[name]) * 1e3:.2f}", f"{extra_us:+.2f}",
                     _common.fmt_ratio(ratio), f"{extra_cpu_us:+.2f}", f"{calls[name] / args.batches:.2f}",
                     f"{extra_calls:+d}", target, "yes" if result["same_weights"] else "NO"])
    return rows


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20, help="timed epochs per repeat and loop")
    parser.add_argument("--repeats", type=int, default=3, help="fresh starts, each with --warmup + --epochs epochs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs at the start of each repeat (>= 1: "
                                                              "the profiled batches are in it)")
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 100 batches, 2 timed epochs, 1 repeat")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'profiler_overhead' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.epochs, args.repeats = 100, 2, 1
    for name in ("epochs", "repeats", "warmup", "batches", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    threads = _common.set_threads(args.threads)
    info = _common.machine_info(torch.device("cpu"))
    load_before = _common.load_average()
    result = run(args)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    info["settings"] = (f"{args.batches} batches of {args.batch_size} an epoch, nn.Linear(64, 10), SGD, "
                        f"epochs={args.epochs} timed + {args.warmup} warm-up per repeat, repeats={args.repeats}, "
                        f"threads={threads}")
    info["after the schedule"] = (f"{result['traces']} trace(s) written in the warm-up epochs; batch hooks called "
                                  f"afterwards: {'yes' if result['batch_hooks_after_schedule'] else 'no'}")
    table = _common.markdown_table(HEADERS, result_rows(result, args))
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, ""])
    print(text)
    if args.write_results:
        path = _common.update_results_section("profiler_overhead", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
