"""``TrainLoop.fit_distributed`` on CPU processes against a hand-written ``torch.multiprocessing.spawn`` + DDP script.

Both train the quickstart CNN (``DigitsCNN``) on scikit-learn's digits (the 1,257 training images, repeated
``--repeat-data`` times so that an epoch lasts a few seconds) with ``--processes`` CPU processes over gloo:

* ``fit_distributed``: ``TrainLoop(show_progress=False, end_auto_eval=False).fit_distributed(num_epochs,
  num_cpu_processes=N)``, started from this script (so its launcher spawns fresh interpreters).
* ``hand``: ``torch.multiprocessing.spawn`` of a worker that joins the group (``tcp://127.0.0.1:<free port>``),
  wraps the model in ``DistributedDataParallel`` and trains on its share of the shuffling loader's permutation
  (every rank draws it alike, rank r takes positions r, r + W, ...: how fit_distributed shards a sampler), the
  same per-process batch size, the same Adam settings, the same initial weights and the same
  initial RNG state (the dropout masks) as ``fit_distributed`` hands its processes.

``OMP_NUM_THREADS=1`` is set before torch is imported, so every process of both runners has one intra-op
thread (fit_distributed leaves the thread count alone when OMP_NUM_THREADS is set; the hand worker also calls
``torch.set_num_threads(1)``); each process records ``torch.get_num_threads()`` to prove it.

Measured per run, in rank 0:

* first-batch latency: ``time.time()`` at the start of the first batch (a callback's ``on_batch_begin``; the
  hand worker right after its loader yields the first batch) minus ``time.time()`` just before the call
  (``fit_distributed`` / ``mp.spawn``) in this process: process start, imports, unpickling, process group,
  DDP wrap, loader set-up.
* samples/s: samples trained by all ranks (the shares are padded to equal sizes) divided by the time
  from the start of rank 0's first batch to the end of its last batch.

Runs are interleaved (hand, ours; ours, hand; ... so slow drift of a shared machine cancels) over
``--repeats`` pairs after ``--warmup`` untimed pairs (file-system caches of the imports); medians and the
median of the per-pair ratios are reported. Both runners end with rank 0's weights, compared bitwise
("same weights": both did the same arithmetic).

With ``--model tiny`` both train a linear classifier of the 64 pixels instead (a step of well under a
millisecond of arithmetic), where a fixed per-step cost of the loop shows most: issue 33 found the stop agreement,
then exchanged at every step, costing 0.5-1.3 ms a step (1.23-1.46x the step time) on such a model.

With ``--grad-accumulation N`` both step every N batches (and at each epoch's end); the hand worker runs the
micro-batches before a window's last under DDP's ``no_sync()``, as fit_distributed does, so both all-reduce the
gradients once per optimizer step.

Run:  python benchmarks/distributed.py                    (about 2 minutes on 2 cores)
      python benchmarks/distributed.py --grad-accumulation 4
      python benchmarks/distributed.py --model tiny
      python benchmarks/distributed.py --quick            (smoke test, about 30 s)
"""
import argparse
import contextlib
import json
import math
import os
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

# In a training process (which imports this script as __mp_main__): when the interpreter began running the
# script, i.e. after process start-up, before the imports. Reported to split the first-batch latency.
SCRIPT_START_TIME = time.time()
# Before torch is imported: one intra-op thread per process, for this process and every child of both runners.
os.environ["OMP_NUM_THREADS"] = "1"

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler, TensorDataset  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

RATIO_TARGET = 0.97  # samples/s of fit_distributed / samples/s of the hand script, at least
LATENCY_TARGET_S = 1.0  # first-batch latency of fit_distributed minus the hand script's, at most


class BatchTimer(AbstractCallback):
    """Rank 0 writes when its first batch started, when its last batch ended, and the batch count, as JSON.

    Defined at module level: fit_distributed pickles it into the spawned processes.
    """

    def __init__(self, path: str):
        super().__init__("batch timer")
        self.path = path
        self.group_up_time: Optional[float] = None
        self.first_batch_time: Optional[float] = None
        self.first_batch_perf: Optional[float] = None
        self.last_batch_end_perf: Optional[float] = None
        self.batches = 0

    def on_multiprocess_start(self) -> None:
        self.group_up_time = time.time()  # the process group is up

    def on_batch_begin(self) -> None:
        if self.first_batch_time is None:
            self.first_batch_time = time.time()
            self.first_batch_perf = time.perf_counter()

    def on_batch_end(self) -> None:
        self.last_batch_end_perf = time.perf_counter()
        self.batches += 1

    def on_train_end(self) -> None:
        if self.train_loop_obj.is_main_process:
            write_marker(self.path, self.group_up_time, self.first_batch_time, self.first_batch_perf,
                         self.last_batch_end_perf, self.batches)


def write_marker(path: str, group_up_time: float, first_time: float, first_perf: float, last_perf: float,
                 batches: int) -> None:
    with open(path, "w") as handle:
        json.dump({"script_start_time": SCRIPT_START_TIME, "group_up_time": group_up_time,
                   "first_batch_time": first_time, "train_seconds": last_perf - first_perf, "batches": batches,
                   "threads": torch.get_num_threads()}, handle)


def repeated_digits(args):
    """The digits training set repeated ``args.repeat_data`` times, in a loader like the quickstart's."""
    base_loader, _, _ = digits_loaders(args.batch_size, args.seed)
    images, labels = base_loader.dataset.tensors
    dataset = TensorDataset(images.repeat(args.repeat_data, 1, 1, 1), labels.repeat(args.repeat_data))
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(args.seed))


class TinyDigits(DigitsCNN):
    """A linear classifier of the 64 pixels: almost no arithmetic a step, so the loop's own per-step cost shows.
    (DigitsCNN's ``get_loss`` and ``get_predictions`` apply as they are.)"""

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        del self.features  # only the classifier trains: the layers the CNN built are dropped
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, images):
        return self.classifier(images)


#: ``--model`` choices.
MODELS = {"cnn": DigitsCNN, "tiny": TinyDigits}


def fresh_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    return MODELS[args.model]()


def samples_per_run(args, dataset_size: int) -> int:
    """What all ranks train on: every rank's share is padded to ceil(N / world_size) samples an epoch."""
    per_rank = math.ceil(dataset_size / args.processes)
    return per_rank * args.processes * args.epochs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hand_worker(rank: int, world_size: int, port: int, initial_state: dict, images: torch.Tensor,
                labels: torch.Tensor, settings: dict, rng_state: torch.Tensor, marker_path: str,
                weights_path: str) -> None:
    """The hand-written DDP process: join, wrap, shard, train; rank 0 reports its timings and weights."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group_up_time = time.time()
    model = MODELS[settings["model"]]()
    model.load_state_dict(initial_state)  # a private copy (the spawn arguments live in shared memory)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=settings["lr"])
    criterion = nn.CrossEntropyLoss()
    dataset = TensorDataset(images, labels)
    # The quickstart's loader (shuffle=True with its own generator, which draws the base seed and the permutation)
    # sharded as fit_distributed shards it: this rank's share of the permutation every rank draws alike.
    generator = torch.Generator().manual_seed(settings["seed"])
    sampler = _common.RankShare(RandomSampler(dataset, generator=generator), rank, world_size)
    loader = DataLoader(dataset, batch_size=settings["batch_size"], sampler=sampler, generator=generator)
    torch.set_rng_state(rng_state)  # as fit_distributed: every rank trains from the parent's RNG state
    accumulation = settings["grad_accumulation"]
    first_time = first_perf = last_perf = None
    batches = 0
    ddp_model.train()
    for epoch in range(settings["epochs"]):
        for index, (batch_images, batch_labels) in enumerate(loader):
            if first_time is None:
                first_time, first_perf = time.time(), time.perf_counter()
            # The usual accumulation under DDP: the gradients are all-reduced only by a window's last backward
            # (the epoch's last batch closes a window too).
            steps = (index + 1) % accumulation == 0 or index + 1 == len(loader)
            with contextlib.nullcontext() if steps else ddp_model.no_sync():
                loss = criterion(ddp_model(batch_images), batch_labels)
                (loss / accumulation if accumulation > 1 else loss).backward()
            if steps:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            last_perf = time.perf_counter()
            batches += 1
    if rank == 0:
        write_marker(marker_path, group_up_time, first_time, first_perf, last_perf, batches)
        torch.save(model.state_dict(), weights_path)
    dist.barrier()
    dist.destroy_process_group()


def run_hand(args, workdir: str) -> Dict[str, object]:
    model = fresh_model(args)
    loader = repeated_digits(args)
    images, labels = loader.dataset.tensors
    settings = {"model": args.model, "lr": args.lr, "seed": args.seed, "batch_size": args.batch_size, "epochs": args.epochs,
                "grad_accumulation": args.grad_accumulation}
    marker_path, weights_path = os.path.join(workdir, "hand.json"), os.path.join(workdir, "hand_weights.pt")
    torch.manual_seed(args.seed + 1)  # the dropout RNG state both runners hand to their processes
    start = time.time()
    mp.spawn(hand_worker, args=(args.processes, free_port(), model.state_dict(), images, labels, settings,
                                torch.get_rng_state(), marker_path, weights_path),
             nprocs=args.processes, join=True)
    call_seconds = time.time() - start
    weights = torch.load(weights_path, weights_only=True)
    return collect(args, marker_path, start, call_seconds, len(loader.dataset), weights)


def run_ours(args, workdir: str) -> Dict[str, object]:
    model = fresh_model(args)
    loader = repeated_digits(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    tl = TrainLoop(model, loader, None, None, optimizer, nn.CrossEntropyLoss(), end_auto_eval=False,
                   show_progress=False)
    marker_path = os.path.join(workdir, "ours.json")
    torch.manual_seed(args.seed + 1)
    start = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available: ... CPU processes over gloo"
        trained = tl.fit_distributed(num_epochs=args.epochs, callbacks=[BatchTimer(marker_path)],
                                     grad_accumulation=args.grad_accumulation, num_cpu_processes=args.processes)
    call_seconds = time.time() - start
    return collect(args, marker_path, start, call_seconds, len(loader.dataset), trained.state_dict())


def collect(args, marker_path: str, start: float, call_seconds: float, dataset_size: int,
            weights: dict) -> Dict[str, object]:
    with open(marker_path) as handle:
        marker = json.load(handle)
    os.remove(marker_path)
    per_rank = math.ceil(dataset_size / args.processes)
    expected_batches = args.epochs * math.ceil(per_rank / args.batch_size)
    if marker["batches"] != expected_batches:
        raise RuntimeError(f"rank 0 trained {marker['batches']} batches, expected {expected_batches}")
    samples = samples_per_run(args, dataset_size)
    return {"latency": marker["first_batch_time"] - start, "script_start": marker["script_start_time"] - start,
            "group_up": marker["group_up_time"] - start, "samples_per_s": samples / marker["train_seconds"],
            "call_seconds": call_seconds, "threads": marker["threads"], "weights": weights, "samples": samples}


RUNNERS = {"hand": run_hand, "fit_distributed": run_ours}


def same_weights(weights_a: dict, weights_b: dict) -> bool:
    return weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def run_benchmark(args) -> Dict[str, object]:
    results: Dict[str, List[Dict[str, object]]] = {name: [] for name in RUNNERS}
    ratios, latency_diffs, equal = [], [], []
    with tempfile.TemporaryDirectory(prefix="aitoolbox-bench-ddp-") as workdir:
        for pair in range(args.warmup + args.repeats):
            order = list(RUNNERS) if pair % 2 == 0 else list(reversed(RUNNERS))
            outcome = {}
            for name in order:
                with _common.stderr_to_devnull():
                    outcome[name] = RUNNERS[name](args, workdir)
            if pair < args.warmup:
                continue
            for name in RUNNERS:
                results[name].append(outcome[name])
            ratios.append(outcome["fit_distributed"]["samples_per_s"] / outcome["hand"]["samples_per_s"])
            latency_diffs.append(outcome["fit_distributed"]["latency"] - outcome["hand"]["latency"])
            equal.append(same_weights(outcome["fit_distributed"]["weights"], outcome["hand"]["weights"]))
    return {"results": results, "ratios": ratios, "latency_diffs": latency_diffs, "same_weights": all(equal)}


HEADERS = ["runner", "runs", "first-batch latency s (median)", "latencies s", "samples/s (median)", "samples/s",
           "call wall s (median)", "threads per process", "rank 0 script started / group up s (median)",
           "same weights as hand"]


def result_rows(outcome: Dict[str, object]) -> List[List[str]]:
    rows = []
    for name, runs in outcome["results"].items():
        latencies = [run["latency"] for run in runs]
        rates = [run["samples_per_s"] for run in runs]
        threads = sorted({run["threads"] for run in runs})
        same = "-" if name == "hand" else ("yes" if outcome["same_weights"] else "NO")
        rows.append([name, str(len(runs)), f"{_common.median(latencies):.2f}", _common.fmt_list(latencies, 2),
                     f"{_common.median(rates):.0f}", ", ".join(f"{rate:.0f}" for rate in rates),
                     f"{_common.median([run['call_seconds'] for run in runs]):.2f}",
                     ", ".join(map(str, threads)),
                     f"{_common.median([run['script_start'] for run in runs]):.2f} / "
                     f"{_common.median([run['group_up'] for run in runs]):.2f}", same])
    return rows


def verdict_lines(outcome: Dict[str, object]) -> List[str]:
    runs = outcome["results"]
    ratio = _common.median(outcome["ratios"])
    ratio_of_medians = (_common.median([r["samples_per_s"] for r in runs["fit_distributed"]])
                        / _common.median([r["samples_per_s"] for r in runs["hand"]]))
    diff = _common.median(outcome["latency_diffs"])
    return [
        f"- samples/s ratio fit_distributed / hand: median paired {ratio:.3f} (pairs: "
        f"{_common.fmt_list(outcome['ratios'])}), ratio of medians {ratio_of_medians:.3f}; target >= "
        f"{RATIO_TARGET:.2f}: {'met' if ratio >= RATIO_TARGET else 'MISSED'}",
        f"- first-batch latency fit_distributed - hand: median paired {diff:+.2f} s (pairs: "
        f"{', '.join(f'{d:+.2f}' for d in outcome['latency_diffs'])}); target <= {LATENCY_TARGET_S:.0f} s: "
        f"{'met' if diff <= LATENCY_TARGET_S else 'MISSED'}",
    ]


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="CPU processes of each job (default 2)")
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn",
                        help="cnn: the quickstart's DigitsCNN (default); tiny: a linear classifier (the loop's "
                             "per-step cost shows most)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat-data", type=int, default=8,
                        help="the 1,257 training digits repeated this many times make one epoch (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed (hand, fit_distributed) pairs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs first (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad-accumulation", type=int, default=1,
                        help="optimizer step (and gradient all-reduce) every this many batches (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 pair, no warm-up, 2 epochs of the 1,257 digits")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'distributed' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.epochs, args.repeat_data = 1, 0, 2, 1
    for name in ("processes", "epochs", "repeat_data", "repeats", "batch_size", "grad_accumulation"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    info = _common.machine_info(torch.device("cpu"))
    info["torch threads"] = "1 per process (OMP_NUM_THREADS=1)"
    dataset_size = len(repeated_digits(args).dataset)
    info["settings"] = (f"{args.processes} CPU processes (gloo), {MODELS[args.model].__name__}, {dataset_size} samples an epoch "
                        f"(digits x{args.repeat_data}), per-process batch size {args.batch_size}, "
                        f"grad_accumulation {args.grad_accumulation}, Adam lr {args.lr}, "
                        f"{args.epochs} epochs a run ({samples_per_run(args, dataset_size)} samples over all "
                        f"ranks), {args.repeats} timed pairs after {args.warmup} warm-up pair(s), order alternating")
    load_before = _common.load_average()
    outcome = run_benchmark(args)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    table = _common.markdown_table(HEADERS, result_rows(outcome))
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, "",
                      *verdict_lines(outcome), ""])
    print(text)
    if args.write_results:  # the accumulation and tiny-model runs have sections of their own
        section = "distributed" if args.grad_accumulation == 1 else f"distributed-ga{args.grad_accumulation}"
        section += "-tiny" if args.model == "tiny" else ""
        path = _common.update_results_section(section, text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
