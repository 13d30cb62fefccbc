"""What SpikeRollback costs when nothing spikes: the quickstart CNN on scikit-learn's digits, TrainLoop with
``SpikeRollback(snapshot_every=100)`` (a check of the interval's losses and a snapshot of the whole run
in host memory every 100 optimizer steps) against the same TrainLoop without it.

How it is measured: both runners start from the same initial weights and identically seeded loaders; each owns
its torch RNG state (dropout), so interleaving them (A B, B A, ...) changes nothing they compute, and both end with
bitwise identical weights (checked and reported: nothing spiked, so nothing was rolled back and the callback left
the training untouched). An epoch is the training digits repeated ``--epoch-repeat`` times (default 10: 400
batches of 32, four snapshots an epoch), timed as one ``fit`` call each; the epochs after ``--warmup`` are kept and
the median of the per-epoch ratios (with / without) is the result. Target: at most 1.02.

On a busy shared machine the epochs' times scatter by far more than 2 %, so the script also accounts for the cost
directly: the median time of one snapshot (``RunSnapshot.take`` of the trained loop) plus one check (the rolling
median over an interval of ``snapshot_every`` losses and its host copy), divided by the median time of
``snapshot_every`` training batches of the run without the callback: the expected slowdown, independent of
how the two runners' epochs happened to be scheduled.

Run:  python benchmarks/spike_rollback.py               (about 2 minutes on 2 idle cores)
      python benchmarks/spike_rollback.py --quick       (smoke test, a few seconds)
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import List, Tuple

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import ConcatDataset, DataLoader  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

from aitoolbox.torchtrain.callbacks import SpikeRollback  # noqa: E402
from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

SECTION = "spike-rollback"
TARGET = 1.02


class Runner:
    """A TrainLoop trained one more epoch per ``fit`` call, with its own RNG state for dropout."""

    def __init__(self, args, with_callback: bool):
        torch.manual_seed(args.seed)
        self.model = DigitsCNN()
        train_loader, _, _ = digits_loaders(args.batch_size, args.seed)
        repeated = ConcatDataset([train_loader.dataset] * args.epoch_repeat)
        loader = DataLoader(repeated, batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(args.seed))
        self.train_loop = TrainLoop(self.model, loader, None, None, torch.optim.Adam(self.model.parameters(), lr=1e-3),
                                    nn.CrossEntropyLoss(), end_auto_eval=False, show_progress=False)
        self.callbacks = [SpikeRollback(factor=args.factor, snapshot_every=args.snapshot_every)] \
            if with_callback else []
        self.rng = torch.Generator().manual_seed(args.seed).get_state()
        self.epochs_done = 0

    @contextlib.contextmanager
    def own_rng(self):
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            yield
        finally:
            self.rng = torch.get_rng_state()
            torch.set_rng_state(saved)

    def run_epoch(self) -> Tuple[float, float]:
        """Wall-clock and CPU seconds (this process) of one more epoch."""
        with self.own_rng():
            start, start_cpu = time.perf_counter(), time.process_time()
            callbacks = self.callbacks if not self.epochs_done else None  # registered once, they stay registered
            self.train_loop.fit(num_epochs=self.epochs_done + 1, callbacks=callbacks)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        self.epochs_done += 1
        return elapsed, cpu


def cost_per_interval(runner: Runner, snapshot_every: int, repeats: int = 15) -> float:
    """Median seconds of one snapshot plus one check of ``snapshot_every`` losses, on the trained loop."""
    tl = runner.train_loop
    callback = runner.callbacks[0]
    callback._pending = [torch.rand(()) + 1.0 for _ in range(snapshot_every)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        losses = torch.stack([value.float() for value in callback._pending])
        judgement = callback.rule.judge(callback._history, losses, callback.window, callback.warmup)
        judgement.flags.float().cpu().nonzero()
        RunSnapshot.take(tl, mid_epoch=True)
        times.append(time.perf_counter() - start)
    callback._pending = []
    return _common.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--epoch-repeat", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--snapshot-every", type=int, default=100)
    # The check costs the same whatever the rule decides: only a rollback would change the cost measured here. The
    # default rule raises no alarm on this run; --factor selects the earlier rule (factor=4 fires on it once the
    # repeated digits are learnt by heart, hence the 1e9 of the recorded run).
    parser.add_argument("--factor", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 3 short epochs")
    parser.add_argument("--record", action="store_true", help=f"write the result into RESULTS.md ({SECTION})")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.warmup, args.epoch_repeat = 3, 1, 2
    _common.set_threads(args.threads)
    load_before = _common.load_average()
    without, with_callback = Runner(args, False), Runner(args, True)
    times: dict = {"without": [], "with": []}
    cpu_times: dict = {"without": [], "with": []}
    with _common.stderr_to_devnull():
        for epoch in range(args.epochs):
            pair = [("without", without), ("with", with_callback)]
            for name, runner in (pair if epoch % 2 == 0 else pair[::-1]):
                elapsed, cpu = runner.run_epoch()
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
    kept = {name: values[args.warmup:] for name, values in times.items()}
    kept_cpu = {name: values[args.warmup:] for name, values in cpu_times.items()}
    ratios: List[float] = [b / a for a, b in zip(kept["without"], kept["with"])]
    cpu_ratios: List[float] = [b / a for a, b in zip(kept_cpu["without"], kept_cpu["with"])]
    same = all(torch.equal(a, b) for a, b in zip(without.model.state_dict().values(),
                                                 with_callback.model.state_dict().values()))
    ratio = _common.median(ratios)
    batches_per_epoch = len(without.train_loop.train_loader)
    batch_s = _common.median(kept["without"]) / batches_per_epoch
    interval_s = cost_per_interval(with_callback, args.snapshot_every)
    accounted = 1.0 + interval_s / (args.snapshot_every * batch_s)
    info = dict(_common.machine_info(torch.device("cpu")),
                **{"load average (1 min) before / after": f"{load_before} / {_common.load_average()}",
                   "settings": f"{batches_per_epoch} batches of {args.batch_size} an epoch, SpikeRollback("
                               f"{'' if args.factor is None else f'factor={args.factor:g}, '}"
                               f"snapshot_every={args.snapshot_every}), {args.epochs} "
                               f"epochs, {args.warmup} warm-up"})
    table = _common.markdown_table(
        ["runner", "s per epoch (median)", "s per epoch", "CPU s per epoch (median)", "CPU s per epoch"],
        [[name, f"{_common.median(values):.3f}", _common.fmt_list(values), f"{_common.median(kept_cpu[name]):.3f}",
          _common.fmt_list(kept_cpu[name])] for name, values in kept.items()])
    body = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, "",
                      f"- with / without, median of the per-epoch ratios: {_common.fmt_ratio(ratio)} "
                      f"(ratios: {_common.fmt_list(ratios)}); target <= {TARGET}: "
                      f"{'met' if ratio <= TARGET else 'NOT met'}",
                      f"- CPU time of this process, with / without, median of the per-epoch ratios: "
                      f"{_common.fmt_ratio(_common.median(cpu_ratios))} (ratios: {_common.fmt_list(cpu_ratios)})",
                      f"- accounted: one snapshot + one check {interval_s * 1000:.1f} ms (median of 15) per "
                      f"{args.snapshot_every} batches of {batch_s * 1000:.1f} ms (median) = "
                      f"{_common.fmt_ratio(accounted)}; target <= {TARGET}: "
                      f"{'met' if accounted <= TARGET else 'NOT met'}",
                      f"- same weights at the end (nothing spiked, so nothing was rolled back): "
                      f"{'yes' if same else 'NO'}"])
    print(body)
    if args.record:
        _common.update_results_section(SECTION, body)


if __name__ == "__main__":
    main()
