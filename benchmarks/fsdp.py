"""Per-rank memory and throughput of sharded training: TrainLoop DDP, TrainLoop FSDP and a hand-written FSDP2 script.

Two CPU processes over gloo train the same small transformer (``TokenRegressor``: an embedding, a few
``nn.TransformerEncoderLayer`` and a linear head; about 3.4 M parameters at the defaults, dropout 0) on a fixed
synthetic data set (random token sequences, a learnable regression target) with AdamW:

* ``ddp``: ``TrainLoop(gpu_mode='ddp', show_progress=False, end_auto_eval=False).fit_distributed(...)``.
* ``fsdp``: the same with ``gpu_mode='fsdp'`` and ``fsdp_model_args={'shard_modules': [nn.TransformerEncoderLayer]}``.
* ``hand_fsdp``: ``torch.multiprocessing.spawn`` of a plain FSDP2 worker: ``init_process_group('gloo')``,
  ``init_device_mesh('cpu', (2,))``, ``fully_shard`` on each encoder layer and then on the model, AdamW built
  on the sharded parameters, its share of the training loader's permutation (``_common.RankShare``: as
  fit_distributed shards the loader's sampler) and the plain loop (forward,
  MSE, backward, step, ``zero_grad(set_to_none=True)``; the epoch's loss summed on the tensor, read once).

All three start from the same initial weights and see the same data order (the permutations come from the
training loader's generator), so their training losses agree up to the reduction order of the gradients.

``OMP_NUM_THREADS=1`` is set before torch is imported: every process of every runner has one intra-op thread
(the machine has two cores for the two ranks); each process records ``torch.get_num_threads()`` to prove it.

Measured per run, in every rank:

* samples/s (steady state): the samples all ranks train in the epochs after ``--warmup-epochs`` (the
  shares are padded to equal sizes) over rank 0's time from the start of the first timed
  epoch to the end of the last (TrainLoop: its ``on_epoch_begin`` / ``on_epoch_end`` callbacks; the hand worker
  at the same points: at the epoch's start, after reading the epoch's loss). Epoch ends between timed epochs
  count: they are part of training.
* held bytes: after training, one more forward and backward on a training batch (so gradients exist, as
  between a backward and its optimizer step), then the bytes of the parameters, their gradients and the
  optimizer state this rank holds, counted from the tensors (``DTensor.to_local()`` under FSDP: the shard).
  DDP's gradient buckets (another copy of the gradients' size) are not in this count; they are in the RSS.
* RSS: ``VmRSS`` of ``/proc/self/status`` when training starts (the model wrapped or sharded, the optimizer
  built: TrainLoop's ``on_train_begin``, the hand worker just before its loop) and the peak, ``VmHWM``, at the
  end (the process's high-water resident set). Both include the interpreter, torch and what the runner
  imported (FSDP imports DTensor and more); the ranks are fresh spawned interpreters in all three runners.
  Peak minus start is what training itself added: gradients, optimizer state, activations, communication
  buffers and the allocator's slack.

Runs are interleaved (the order rotates every repeat, so slow drift of the shared machine spreads over all
three) over ``--repeats`` rounds after ``--warmup`` untimed rounds; medians are reported, and the throughput
ratio fsdp / hand_fsdp is the median of the per-round ratios. Each runner's final full weights (gathered to
rank 0) are compared with the hand script's.

Run:  python benchmarks/fsdp.py                 (about 4 minutes on 2 idle cores)
      python benchmarks/fsdp.py --quick         (smoke test, well under a minute)
"""
import argparse
import contextlib
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

# Before torch is imported: one intra-op thread per process, for this process and every child of every runner.
os.environ["OMP_NUM_THREADS"] = "1"

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler, TensorDataset  # noqa: E402

import _common  # noqa: E402

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

logger = logging.getLogger(__name__)

MEMORY_TARGET = 0.55  # FSDP's per-rank parameter+gradient+optimizer bytes / DDP's, at most
RATIO_TARGET = 0.97  # samples/s of TrainLoop FSDP / samples/s of the hand-written FSDP2 script, at least
RUNNERS = ("ddp", "fsdp", "hand_fsdp")
LOSS_RTOL = 1e-3  # relative agreement of the epoch losses expected of the three runners


class TokenRegressor(TTModel):
    """Token embedding plus learned positions, a stack of encoder layers, mean pooling, a linear head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, feedforward: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, feedforward, dropout=0.0, batch_first=True)
        # No nested tensors (padding masks are never used) and no dropout: all runners compute the same thing.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens) + self.position)
        return self.head(hidden.mean(dim=1)).squeeze(-1)

    def get_loss(self, batch_data, criterion, device):
        tokens, targets = batch_data
        return criterion(self(tokens.to(device)), targets.to(device))

    def get_predictions(self, batch_data, device):
        tokens, targets = batch_data
        return self(tokens.to(device)).cpu(), targets, {}


def model_settings(args) -> dict:
    return {"vocab": args.vocab, "seq_len": args.seq_len, "d_model": args.d_model, "layers": args.layers,
            "heads": args.heads, "feedforward": args.feedforward}


def fresh_model(args) -> TokenRegressor:
    torch.manual_seed(args.seed)
    return TokenRegressor(**model_settings(args))


def synthetic_data(args) -> TensorDataset:
    """Random token sequences; the target is the (standardised) share of tokens in the vocabulary's lower half."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=generator)
    share = (tokens < args.vocab // 2).float().mean(dim=1)
    return TensorDataset(tokens, (share - share.mean()) / share.std())


def training_loader(args) -> DataLoader:
    # fit_distributed shards this loader's permutation (drawn from the generator) across the ranks: the hand worker too.
    return DataLoader(synthetic_data(args), batch_size=args.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(args.seed))


def samples_per_epoch(args) -> int:
    """What all ranks train on in an epoch: each rank's share is padded to ceil(N / world_size)."""
    return math.ceil(args.samples / args.processes) * args.processes


def batches_per_epoch(args) -> int:
    """Batches of each rank in an epoch."""
    return math.ceil(samples_per_epoch(args) // args.processes / args.batch_size)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- measurements inside a rank ------------------------------------------------------------------------------------
def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def nbytes(tensor: torch.Tensor) -> int:
    tensor = local(tensor)
    return tensor.numel() * tensor.element_size()


def held_bytes(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state (its tensors other than scalars) this rank holds."""
    params = grads = states = 0
    for param in model.parameters():
        params += nbytes(param)
        if param.grad is not None:
            grads += nbytes(param.grad)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            states += sum(nbytes(value) for value in state.values()
                          if isinstance(value, torch.Tensor) and value.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": states}


def rss_bytes(field: str = "VmRSS") -> int:
    """The process's resident set (``VmRSS``) or its high-water mark (``VmHWM``), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status (the benchmark needs Linux)")


def write_rank_record(folder: str, runner: str, rank: int, record: dict) -> None:
    with open(os.path.join(folder, f"{runner}-rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


class RankRecorder(AbstractCallback):
    """Every rank writes its timing of the steady-state epochs, held bytes, peak RSS and epoch losses as JSON.

    Only epoch hooks: a callback with batch hooks would add a call per batch that the hand loop does not make.
    Defined at module level: fit_distributed pickles it into the spawned processes.
    """

    def __init__(self, folder: str, runner: str, warmup_epochs: int):
        super().__init__("rank recorder")
        self.folder, self.runner, self.warmup_epochs = folder, runner, warmup_epochs
        self.start = self.end = self.start_cpu = self.end_cpu = 0.0
        self.start_rss: Optional[int] = None

    def on_train_begin(self) -> None:
        self.start_rss = rss_bytes()  # the model set up: wrapped (DDP) or sharded (FSDP), nothing trained yet

    def on_epoch_begin(self) -> None:
        if self.train_loop_obj.epoch == self.warmup_epochs:
            self.start, self.start_cpu = time.perf_counter(), time.process_time()

    def on_epoch_end(self) -> None:
        self.end, self.end_cpu = time.perf_counter(), time.process_time()

    def on_train_end(self) -> None:
        tl = self.train_loop_obj
        # Gradients exist again (the loop set them to None after the last step), as between a backward and a step.
        tl.model.get_loss(next(iter(tl.train_loader)), tl.criterion, tl.device).backward()
        write_rank_record(self.folder, self.runner, tl.strategy.rank, {
            "seconds": self.end - self.start, "cpu_seconds": self.end_cpu - self.start_cpu,
            "held": held_bytes(tl.model, tl.optimizers),
            "start_rss": self.start_rss, "peak_rss": rss_bytes("VmHWM"),
            "losses": list(tl.train_history["accumulated_loss"]),
            "threads": torch.get_num_threads()})


# --- the hand-written FSDP2 script ---------------------------------------------------------------------------------
def hand_fsdp_worker(rank: int, world_size: int, port: int, initial_state: dict, tokens: torch.Tensor,
                     targets: torch.Tensor, settings: dict, folder: str) -> None:
    """A plain FSDP2 training process: join, shard each encoder layer and then the root, train, report."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    model = TokenRegressor(**settings["model"])
    model.load_state_dict(initial_state)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"])
    criterion = nn.MSELoss()
    start_rss = rss_bytes()
    dataset = TensorDataset(tokens, targets)
    # The training loader (shuffle=True with its own generator) sharded as fit_distributed shards it.
    generator = torch.Generator().manual_seed(settings["seed"])
    sampler = _common.RankShare(RandomSampler(dataset, generator=generator), rank, world_size)
    loader = DataLoader(dataset, batch_size=settings["batch_size"], sampler=sampler, generator=generator)
    losses, start, start_cpu = [], 0.0, 0.0
    model.train()
    for epoch in range(settings["epochs"]):
        if epoch == settings["warmup_epochs"]:
            start, start_cpu = time.perf_counter(), time.process_time()
        loss_sum, batches = torch.zeros(()), 0
        for batch_tokens, batch_targets in loader:
            loss = criterion(model(batch_tokens), batch_targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            batches += 1
        losses.append(loss_sum.item() / batches)
    end, end_cpu = time.perf_counter(), time.process_time()
    batch_tokens, batch_targets = next(iter(loader))
    criterion(model(batch_tokens), batch_targets).backward()
    write_rank_record(folder, "hand_fsdp", rank, {
        "seconds": end - start, "cpu_seconds": end_cpu - start_cpu, "held": held_bytes(model, [optimizer]),
        "start_rss": start_rss,
        "peak_rss": rss_bytes("VmHWM"),
        "losses": losses, "threads": torch.get_num_threads()})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, os.path.join(folder, "hand_fsdp-weights.pt"))
    dist.barrier()
    dist.destroy_process_group()


# --- the runners ---------------------------------------------------------------------------------------------------
def run_hand_fsdp(args, folder: str) -> Dict[str, object]:
    model = fresh_model(args)
    tokens, targets = synthetic_data(args).tensors
    settings = {"model": model_settings(args), "lr": args.lr, "seed": args.seed, "batch_size": args.batch_size,
                "epochs": args.epochs, "warmup_epochs": args.warmup_epochs}
    mp.spawn(hand_fsdp_worker, args=(args.processes, free_port(), model.state_dict(), tokens, targets, settings,
                                     folder), nprocs=args.processes, join=True)
    weights = torch.load(os.path.join(folder, "hand_fsdp-weights.pt"), weights_only=True)
    return collect(args, folder, "hand_fsdp", weights)


def run_trainloop(args, folder: str, gpu_mode: str) -> Dict[str, object]:
    model = fresh_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tl = TrainLoop(model, training_loader(args), None, None, optimizer, nn.MSELoss(), gpu_mode=gpu_mode,
                   end_auto_eval=False, show_progress=False)
    options = {"fsdp_model_args": {"shard_modules": [nn.TransformerEncoderLayer]}} if gpu_mode == "fsdp" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available: ... CPU processes over gloo"
        trained = tl.fit_distributed(num_epochs=args.epochs, callbacks=[RankRecorder(folder, gpu_mode,
                                                                                      args.warmup_epochs)],
                                     num_cpu_processes=args.processes, **options)
    return collect(args, folder, gpu_mode, trained.state_dict())


RUN = {"ddp": lambda args, folder: run_trainloop(args, folder, "ddp"),
       "fsdp": lambda args, folder: run_trainloop(args, folder, "fsdp"),
       "hand_fsdp": run_hand_fsdp}


def collect(args, folder: str, runner: str, weights: dict) -> Dict[str, object]:
    ranks = []
    for rank in range(args.processes):
        path = os.path.join(folder, f"{runner}-rank{rank}.json")
        with open(path) as handle:
            ranks.append(json.load(handle))
        os.remove(path)
    timed_epochs = args.epochs - args.warmup_epochs
    return {"samples_per_s": samples_per_epoch(args) * timed_epochs / ranks[0]["seconds"],
            "cpu_ms_per_batch": 1000 * ranks[0]["cpu_seconds"] / (batches_per_epoch(args) * timed_epochs),
            "held": [sum(rank["held"].values()) for rank in ranks], "held_parts": ranks[0]["held"],
            "peak_rss": [rank["peak_rss"] for rank in ranks], "start_rss": [rank["start_rss"] for rank in ranks],
            "losses": ranks[0]["losses"],
            "threads": sorted({rank["threads"] for rank in ranks}),
            "weights": {key: value.detach().cpu() for key, value in weights.items()}}


def max_difference(weights_a: dict, weights_b: dict) -> float:
    if weights_a.keys() != weights_b.keys():
        differing = sorted(weights_a.keys() ^ weights_b.keys())
        raise RuntimeError(f"the runners' state dicts have different keys: {differing}")
    return max((weights_a[key] - weights_b[key]).abs().max().item() for key in weights_a)


@contextlib.contextmanager
def stderr_to_file(path: str) -> Iterator[None]:
    """Send file descriptor 2 (TrainLoop's log lines, the ranks' warnings and tracebacks) to ``path`` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def run_logged(name: str, args, folder: str, failures: List[str]) -> Dict[str, object]:
    """One run of ``name``, its processes' stderr kept in a file; a failed run is tried once more (a rank of the
    shared machine's jobs can die for reasons of its own), and what its stderr ended with goes into ``failures``."""
    log_path = os.path.join(folder, f"{name}.stderr")
    for attempt in (1, 2):
        try:
            with stderr_to_file(log_path):
                return RUN[name](args, folder)
        except Exception as error:  # a rank's exit surfaces as several exception types
            with open(log_path) as log:
                lines = [line.strip() for line in log if line.strip() and "Warning" not in line]
            last = lines[-1] if lines else "(nothing on stderr)"
            failures.append(f"{name}: {type(error).__name__}: {error}; stderr's last line: {last}")
            if attempt == 2:
                raise RuntimeError(f"{name} failed twice; its stderr ended with:\n" + "\n".join(lines[-20:])) from error
            logger.warning("%s failed (%s), running it again; its stderr ended with:\n%s", name, error,
                           "\n".join(lines[-20:]))
    raise AssertionError("unreachable")


def run_benchmark(args) -> Dict[str, object]:
    results: Dict[str, List[Dict[str, object]]] = {name: [] for name in RUNNERS}
    ratios, cpu_ratios, failures = [], [], []
    with tempfile.TemporaryDirectory(prefix="aitoolbox-bench-fsdp-") as folder:
        for round_index in range(args.warmup + args.repeats):
            shift = round_index % len(RUNNERS)
            outcome = {}
            for name in RUNNERS[shift:] + RUNNERS[:shift]:
                outcome[name] = run_logged(name, args, folder, failures)
            if round_index < args.warmup:
                continue
            for name in RUNNERS:
                results[name].append(outcome[name])
            ratios.append(outcome["fsdp"]["samples_per_s"] / outcome["hand_fsdp"]["samples_per_s"])
            cpu_ratios.append(outcome["fsdp"]["cpu_ms_per_batch"] / outcome["hand_fsdp"]["cpu_ms_per_batch"])
    return {"results": results, "ratios": ratios, "cpu_ratios": cpu_ratios, "failures": failures}


# --- the report ----------------------------------------------------------------------------------------------------
HEADERS = ["runner", "runs", "samples/s (median)", "samples/s", "rank 0 CPU ms per batch (median)",
           "params / grads / optimizer MB (rank 0)",
           "held MB per rank (rank 0, rank 1)", "held / DDP's", "RSS MB at training start -> peak, per rank (median)",
           "threads per process", "epoch losses (rank 0, last run)", "max abs weight diff to hand_fsdp"]


def megabytes(value: float) -> str:
    return f"{value / 2 ** 20:.2f}"


def result_rows(outcome: Dict[str, object]) -> List[List[str]]:
    runs = outcome["results"]
    ddp_held = runs["ddp"][-1]["held"]
    reference = runs["hand_fsdp"][-1]["weights"]
    rows = []
    for name in RUNNERS:
        rates = [run["samples_per_s"] for run in runs[name]]
        last = runs[name][-1]
        parts = last["held_parts"]
        rss = [(_common.median([run["start_rss"][rank] for run in runs[name]]),
                _common.median([run["peak_rss"][rank] for run in runs[name]])) for rank in range(len(last["held"]))]
        rows.append([
            name, str(len(rates)), f"{_common.median(rates):.1f}", ", ".join(f"{rate:.1f}" for rate in rates),
            f"{_common.median([run['cpu_ms_per_batch'] for run in runs[name]]):.1f}",
            " / ".join(megabytes(parts[key]) for key in ("params", "grads", "optimizer")),
            ", ".join(megabytes(held) for held in last["held"]),
            ", ".join(f"{held / ddp:.3f}" for held, ddp in zip(last["held"], ddp_held)),
            ", ".join(f"{start / 2 ** 20:.0f} -> {peak / 2 ** 20:.0f}" for start, peak in rss),
            ", ".join(map(str, sorted({t for run in runs[name] for t in run["threads"]}))),
            ", ".join(f"{loss:.5f}" for loss in last["losses"]),
            "-" if name == "hand_fsdp" else f"{max_difference(last['weights'], reference):.2e}"])
    return rows


def losses_agree(outcome: Dict[str, object]) -> bool:
    runs = outcome["results"]
    reference = runs["hand_fsdp"][-1]["losses"]
    for name in RUNNERS:
        for run in runs[name]:
            if len(run["losses"]) != len(reference) or any(
                    abs(loss - ref) > LOSS_RTOL * max(abs(ref), 1e-8) for loss, ref in zip(run["losses"], reference)):
                return False
    return True


def verdict_lines(outcome: Dict[str, object]) -> List[str]:
    runs = outcome["results"]
    memory_ratio = max(fsdp / ddp for fsdp, ddp in zip(runs["fsdp"][-1]["held"], runs["ddp"][-1]["held"]))
    ratio = _common.median(outcome["ratios"])
    ratio_of_medians = (_common.median([run["samples_per_s"] for run in runs["fsdp"]])
                        / _common.median([run["samples_per_s"] for run in runs["hand_fsdp"]]))
    def median_of_larger_rank(name: str, key: str) -> float:
        return _common.median([max(run[key]) for run in runs[name]])

    def growth(name: str) -> float:
        return _common.median([max(peak - start for start, peak in zip(run["start_rss"], run["peak_rss"]))
                               for run in runs[name]])
    return [
        f"- held bytes fsdp / ddp (parameters + gradients + optimizer state, the larger of the ranks): "
        f"{memory_ratio:.3f}; target <= {MEMORY_TARGET:.2f}: {'met' if memory_ratio <= MEMORY_TARGET else 'MISSED'}",
        f"- samples/s fsdp / hand_fsdp: median paired {ratio:.3f} (rounds: {_common.fmt_list(outcome['ratios'])}), "
        f"ratio of medians {ratio_of_medians:.3f}; target >= {RATIO_TARGET:.2f}: "
        f"{'met' if ratio >= RATIO_TARGET else 'MISSED'}",
        f"- rank 0's CPU time per batch fsdp / hand_fsdp (less sensitive to other load than wall time): median "
        f"paired {_common.median(outcome['cpu_ratios']):.3f} (rounds: {_common.fmt_list(outcome['cpu_ratios'])})",
        "- RSS MB, median of the larger rank: peak " + ", ".join(
            f"{name} {megabytes(median_of_larger_rank(name, 'peak_rss'))}" for name in RUNNERS)
        + "; peak - training start " + ", ".join(f"{name} {megabytes(growth(name))}" for name in RUNNERS),
        f"- epoch losses of the three runners within {LOSS_RTOL:g} (relative) of hand_fsdp's in every run: "
        f"{'yes' if losses_agree(outcome) else 'NO'}",
        "- runs that failed and were run again: " + ("; ".join(outcome["failures"]) or "none"),
    ]


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="CPU processes of each job (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs a run, warm-up epochs included (default 3)")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs at a run's start (default 1)")
    parser.add_argument("--samples", type=int, default=512, help="sequences in the data set (default 512)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--feedforward", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16, help="per process (default 16)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of the three runners (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a tiny model and data set, 1 round, no warm-up round")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'fsdp' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.epochs, args.samples = 1, 0, 2, 32
        args.d_model, args.layers, args.feedforward, args.vocab, args.seq_len = 32, 2, 64, 50, 8
    for name in ("processes", "epochs", "samples", "seq_len", "vocab", "d_model", "layers", "heads", "feedforward",
                 "batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.warmup_epochs < args.epochs:
        parser.error(f"--warmup-epochs must be >= 0 and below --epochs ({args.epochs}), got {args.warmup_epochs}")
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    info = _common.machine_info(torch.device("cpu"))
    info["torch threads"] = "1 per process (OMP_NUM_THREADS=1)"
    num_params = sum(param.numel() for param in fresh_model(args).parameters())
    info["settings"] = (
        f"{args.processes} CPU processes (gloo, spawned), TokenRegressor ({num_params / 1e6:.2f} M parameters: "
        f"{args.layers} x nn.TransformerEncoderLayer d_model {args.d_model}, {args.heads} heads, feedforward "
        f"{args.feedforward}, dropout 0; vocabulary {args.vocab}, sequences of {args.seq_len}), {args.samples} "
        f"sequences, per-process batch size {args.batch_size}, AdamW lr {args.lr}, MSE; {args.epochs} epochs a run, "
        f"the first {args.warmup_epochs} untimed; {args.repeats} timed rounds after {args.warmup} warm-up round(s), "
        f"the runners' order rotating; fsdp: shard_modules=[nn.TransformerEncoderLayer], reshard_after_forward "
        f"True, no CPU offload")
    load_before = _common.load_average()
    outcome = run_benchmark(args)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    table = _common.markdown_table(HEADERS, result_rows(outcome))
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, "",
                      *verdict_lines(outcome), ""])
    print(text)
    if args.write_results:
        path = _common.update_results_section("fsdp", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
