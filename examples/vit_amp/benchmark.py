"""Memory and speed of the four precision modes: FP32, torch AMP, naive AMP and apex O1.

Each configuration trains for ``--warmup`` untimed and ``--iters`` timed iterations in a fresh Python
process (so one mode's allocations cannot hide another's peak), then the table is printed:

* RAM/GB: the peak memory of training. On CUDA ``torch.cuda.max_memory_allocated`` minus what was allocated
  before the model was built; on a CPU the rise of the process's peak resident set size (VmHWM, reset just
  before the model is built) - it includes activations and allocator caching, so it is noisier;
* param+grad+optim/GB: the exact bytes of the parameters, their gradients, any float32 master weights and
  the optimizer state, read from the tensors right after an optimizer step;
* Iteration/s and throughput (samples/s) over the timed iterations.

Run:  python benchmark.py                                  (all four configurations in config/)
      python benchmark.py --iters 20 --plot amp_modes.png  (also draws a bar chart)
      python benchmark.py --set DEPTH=2 --batch-size 32    (overrides apply to every configuration)
"""
import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.train_loop import TrainLoop
from train import load_config
from vit import build_model, synthetic_images

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIGS = [os.path.join(HERE, "config", name) for name in
                   ("config_fp32.py", "config_AMP_torch.py", "config_AMP_naive.py", "config_AMP_apex.py")]
RESULT_PREFIX = "BENCHMARK_RESULT "
GB = 1024.0 ** 3


# --- measuring, inside the child process ----------------------------------------------------------------
class IterationTimer(AbstractCallback):
    """Wall time of the iterations after the first ``warmup`` ones (waiting for the GPU at both ends)."""

    def __init__(self, warmup: int):
        super().__init__("iteration timer")
        self.warmup = warmup
        self.batches = 0
        self.start: Optional[float] = None
        self.end: Optional[float] = None

    def _now(self) -> float:
        if self.train_loop_obj.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self) -> None:
        if self.warmup == 0:
            self.start = self._now()

    def on_batch_end(self) -> None:
        self.batches += 1
        if self.batches == self.warmup:
            self.start = self._now()
        self.end = self._now() if self.start is not None else None


class TrainingTensorBytes(AbstractCallback):
    """Largest total, over optimizer steps, of parameter, gradient, master-weight and optimizer-state bytes."""

    def __init__(self):
        super().__init__("training tensor bytes")
        self.peak = 0

    def on_after_optimizer_step(self) -> None:
        tl = self.train_loop_obj
        storages: Dict[tuple, int] = {}

        def add(tensor) -> None:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                storages[(tensor.device.type, storage.data_ptr())] = storage.nbytes()

        for param in tl.model.parameters():
            add(param)
            add(param.grad)
        for optimizer in tl.optimizers:
            for param in tl.precision.stepped_parameters(optimizer):
                add(param)
                add(param.grad)
            for state in optimizer.state.values():
                for value in state.values():
                    add(value)
        self.peak = max(self.peak, sum(storages.values()))


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Make VmHWM start again from the current RSS (Linux >= 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def measure(config: dict, warmup: int, iters: int, seed: int = 0) -> dict:
    """Train one configuration for ``warmup + iters`` iterations and return its numbers."""
    torch.manual_seed(seed)
    use_cuda = torch.cuda.is_available()
    batch_size = config["BATCH_SIZE"]
    dataset = synthetic_images(batch_size * (warmup + iters), config["NUM_CLASSES"], config["IMAGE_SIZE"], seed, 0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)

    if use_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    rss_before = _status_kib("VmRSS")
    peak_resettable = _reset_peak_rss()

    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["LEARNING_RATE"], weight_decay=config["WEIGHT_DECAY"])
    tl = TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                   use_amp=config["AMP"], show_progress=False)
    timer, tensor_bytes = IterationTimer(warmup), TrainingTensorBytes()
    tl.fit(num_iterations=warmup + iters, callbacks=[timer, tensor_bytes])

    if use_cuda:
        peak_bytes = torch.cuda.max_memory_allocated() - allocated_before
        peak_source = "CUDA max allocated"
    else:
        peak_kib = _status_kib("VmHWM") if peak_resettable else None
        if peak_kib is None or rss_before is None:
            import resource
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # lifetime peak: an upper bound
        peak_bytes = max(peak_kib - (rss_before or 0), 0) * 1024
        peak_source = "peak RSS rise"
    seconds = timer.end - timer.start
    return {"name": config["NAME"], "amp": repr(config["AMP"]), "device": "cuda" if use_cuda else "cpu",
            "batch_size": batch_size, "iterations": iters, "peak_gb": peak_bytes / GB, "peak_source": peak_source,
            "tensor_gb": tensor_bytes.peak / GB, "iterations_per_s": iters / seconds,
            "samples_per_s": iters * batch_size / seconds, "precision": repr(tl.precision)}


# --- driving, in the parent process -----------------------------------------------------------------
def run_in_fresh_process(config_path: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--measure", config_path, "--warmup", str(args.warmup),
               "--iters", str(args.iters)] + [f"--set={item}" for item in args.overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"benchmarking {config_path} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")


def format_table(results: Sequence[dict]) -> str:
    """The results as a Markdown table in the layout of ColossalAI's AMP comparison."""
    source = results[0]["peak_source"]
    header = ["", f"RAM/GB ({source})", "param+grad+optim/GB", "Iteration/s", "throughput (samples/s)"]
    rows = [[r["name"], f"{r['peak_gb']:.3g}", f"{r['tensor_gb']:.3g}", f"{r['iterations_per_s']:.2f}",
             f"{r['samples_per_s']:.1f}"] for r in results]
    widths = [max(len(line[i]) for line in [header] + rows) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    return "\n".join([line(header), "| " + " | ".join("-" * width for width in widths) + " |"]
                     + [line(row) for row in rows])


def plot(results: Sequence[dict], path: str) -> None:
    """A bar chart with one panel per measure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    panels = [(f"RAM/GB ({results[0]['peak_source']})", "peak_gb"), ("Iteration/s", "iterations_per_s"),
              ("throughput (samples/s)", "samples_per_s")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for axis, (title, key) in zip(axes, panels):
        values = [r[key] for r in results]
        bars = axis.bar(range(len(names)), values, color=["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c"][:len(names)])
        axis.bar_label(bars, fmt="%.3g", fontsize=8)
        axis.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        axis.set_title(title, fontsize=10)
    figure.suptitle(f"ViT, batch {results[0]['batch_size']}, {results[0]['iterations']} timed iterations, "
                    f"{results[0]['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="configuration files to compare")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    parser.add_argument("--batch-size", type=int, default=None, help="override BATCH_SIZE")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting in every configuration (repeatable)")
    parser.add_argument("--plot", metavar="PATH", help="also write a bar chart (PNG) here")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results here")
    parser.add_argument("--measure", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: one child process
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1, got {args.warmup} and {args.iters}")
    if args.batch_size is not None:
        args.overrides.append(f"BATCH_SIZE={args.batch_size}")

    if args.measure:
        result = measure(load_config(args.measure, args.overrides), args.warmup, args.iters)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return [result]

    results = []
    for path in args.configs:
        print(f"benchmarking {os.path.relpath(path)} ...", flush=True)
        results.append(run_in_fresh_process(os.path.abspath(path), args))
    print()
    print(format_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"\nbar chart written to {args.plot}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
