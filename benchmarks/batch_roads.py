"""The per-batch cost of TrainLoop's two roads for a batch, against a hand-written loop, in one process.

TrainLoop trains the common batch (no callback with a batch hook, no autocast or DDP context, no loss scaling, every
batch stepping) on a short road (``TrainLoop._train_direct_batches``) and every other batch on the general one
(``TrainLoop._run_batch``). This script times three runners on ``overhead.py``'s tiny model, one epoch each per
round, interleaved (A B C, C B A, ...): the hand loop, TrainLoop on the general road (the short one switched off on
that loop object), and TrainLoop as it runs. It prints the median paired excess over the hand loop, in microseconds
a batch. One process and one thread: a busy machine slows all three alike, which ``overhead.py``'s separate runs do
not guarantee.

    python benchmarks/batch_roads.py --rounds 30

It does not compare weights (the three runners draw their own data orders from one loader); ``overhead.py`` checks
that TrainLoop's weights are bitwise the hand loop's, and ``tests/torchtrain/train_loop/test_direct_batches.py``
that the two roads train the same, bit for bit.
"""
import argparse
import logging
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import TinyLinear  # noqa: E402

from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="epochs timed per runner")
    parser.add_argument("--batches", type=int, default=393, help="batches of 32 samples an epoch")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 batches: a smoke test")
    options = parser.parse_args()
    if options.quick:
        options.rounds, options.batches = 2, 20
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    samples = 32 * options.batches
    data = TensorDataset(torch.randn(samples, 8, 8), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    criterion = nn.CrossEntropyLoss()

    hand_model = TinyLinear()
    hand_optimizer = torch.optim.Adam(hand_model.parameters(), 1e-3)

    def hand_epoch() -> None:
        for images, labels in loader:
            loss = criterion(hand_model(images), labels)
            loss.backward()
            hand_optimizer.step()
            hand_optimizer.zero_grad(set_to_none=True)

    def train_loop_epoch(short_road: bool):
        model = TinyLinear()
        tl = TrainLoop(model, loader, None, None, torch.optim.Adam(model.parameters(), 1e-3), criterion,
                       end_auto_eval=False, show_progress=True)
        if not short_road:
            tl._direct_batches = lambda: False  # this loop object takes the general road for every batch
        epochs = [0]

        def epoch() -> None:
            epochs[0] += 1
            tl.fit(num_epochs=epochs[0])
        return epoch

    runners = {"hand": hand_epoch, "general road": train_loop_epoch(False), "as it runs": train_loop_epoch(True)}
    times = {name: [] for name in runners}
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # the bars
    try:
        for runner in runners.values():  # warm-up
            runner()
        order = list(runners)
        for round_index in range(options.rounds):
            for name in (order if round_index % 2 == 0 else order[::-1]):
                started = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - started)
    finally:
        sys.stderr.close()
        sys.stderr = stderr
    batches = len(loader)
    print(f"{options.rounds} epochs of {batches} batches per runner, load average {os.getloadavg()[0]:.1f}")
    print(f"hand loop: median {statistics.median(times['hand']) * 1e3:.1f} ms/epoch")
    for name in ("general road", "as it runs"):
        excess = [(mine - hand) / batches * 1e6 for mine, hand in zip(times[name], times["hand"])]
        print(f"TrainLoop, {name}: median {statistics.median(times[name]) * 1e3:.1f} ms/epoch, "
              f"{statistics.median(excess):+.1f} us a batch over the hand loop (median paired)")


if __name__ == "__main__":
    main()
