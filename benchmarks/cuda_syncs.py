"""Where TrainLoop makes the host wait for the GPU, against the hand-written loop (CUDA only).

Runs ``--iterations`` training iterations of benchmarks/amp_modes.py's TinyViT per mode with
``torch.cuda.set_sync_debug_mode("warn")`` and prints, per mode, how many synchronising CUDA calls were made and
from which source lines. A synchronisation per iteration stalls the host until the GPU has caught up, which
costs most where iterations are short.

With ``--monitor`` every TrainLoop mode trains with a ``ThroughputMonitor(window=5)`` (its tokens counted from a
tensor), which must add no synchronisation per iteration: only one per window of 5 (reading the window's token
count) and one per epoch end.

Run:  python benchmarks/cuda_syncs.py                 (needs a CUDA GPU; a few seconds)
      python benchmarks/cuda_syncs.py --monitor       (the same with ThroughputMonitor on)
"""
import argparse
import collections
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import amp_modes  # noqa: E402


def count_syncs(mode: str, iterations: int, args, loader, device, monitor: bool = False) -> collections.Counter:
    """``{'file:line': number of synchronising calls}`` over ``iterations`` iterations after a warm-up."""
    runner, _ = amp_modes.make_runner(mode, args, loader, device)
    if monitor and hasattr(runner, "callbacks"):  # a TrainLoop mode
        from aitoolbox.torchtrain.callbacks import ThroughputMonitor
        runner.callbacks.append(ThroughputMonitor(window=5, tokens_fn=lambda batch: batch[1].new_ones(()).sum()))
    runner.train(2)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.train(iterations)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="iterations counted per mode (one epoch)")
    parser.add_argument("--modes", nargs="+", default=["fp32", "hand-fp32", "O1", "hand-autocast"],
                        choices=list(amp_modes.TRAINLOOP_MODES) + list(amp_modes.HAND_MODES))
    parser.add_argument("--monitor", action="store_true", help="train the TrainLoop modes with a ThroughputMonitor")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_syncs.py needs a CUDA GPU")
    args = amp_modes.parse_args(["--model", "vit", "--iters", str(options.iterations)])
    loader = amp_modes.make_loader(args)
    device = torch.device("cuda", torch.cuda.current_device())
    for mode in options.modes:
        with amp_modes._common.output_to_devnull():
            where = count_syncs(mode, options.iterations, args, loader, device, options.monitor)
        places = ", ".join(f"{place} x{count}" for place, count in where.most_common()) or "-"
        print(f"{mode}: {sum(where.values())} synchronisations in {options.iterations} iterations: {places}")


if __name__ == "__main__":
    main()
