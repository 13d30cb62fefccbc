"""Checkpoint save time: TrainLoop's epoch-end checkpoint against a bare ``torch.save`` of the same state dicts.

The model is a stack of ``nn.Linear(width, width)`` layers (default 6 x 4096 x 4096: 100.7 M parameters,
403 MB of float32 weights) trained for one step of SGD with momentum, so the optimizer holds a momentum
buffer per parameter (another 403 MB). Three ways of saving it are timed, each writing a new file into the
same folder (``--dir``, default a fresh folder under the system temp dir; the file system is reported):

* ``ours``: what ``ModelCheckpoint`` does at an epoch end: ``tl.checkpoint_state()`` (model, optimizer,
  precision and callback states, counters, history, RNG states) followed by ``save_checkpoint_file`` (atomic:
  temporary file, ``torch.save`` into it while a background thread flushes every 16 MB written to disk and
  drops it from the page cache, final fsync, rename over the target, fsync of the folder).
* ``bare``: ``torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict()}, path)``: the data
  reach the page cache, not the disk.
* ``save+fsync``: ``bare`` followed by an fsync of the file: the same durability as ``ours`` (less the
  rename and the folder fsync), so ``ours`` / ``save+fsync`` is the cost of the framework itself.

The three are interleaved (the order rotates every repetition, so drift of a shared machine spreads evenly)
and repeated; ``os.sync()`` runs before every timed save (outside the timing), so no save pays for the
write-back of an earlier one, and every file is deleted right after its save (disk space). Writing 800 MB
into the page cache takes anywhere from 0.7 s to 2 s on the development VM, whatever the variant (the
guest's freed memory goes back to the host and must be faulted in again), so the minima and the ratio of
minima are reported next to the medians and the median of the paired ratios.

Then the training stall: a TrainLoop on the same model with a one-sample training set (one batch of size 1
an epoch) and ``ModelCheckpoint``, between two timing callbacks with ``execution_order`` 99 and 101 (the
checkpoint runs at 100), measures how long ``ModelCheckpoint.on_epoch_end`` holds up training each epoch:
saving in place, and with ``background_save=True`` (the copy to host memory; the write is waited for after
the clock stops, as if the epoch lasted longer than a write).

With ``--resume-latency``, only the cost of a mid-epoch resume: the time from loading a mid-epoch checkpoint
(``tl.load_checkpoint`` of the checkpoint dict, then ``fit``) to the start of the first new batch, for checkpoints
taken at 10 %, 50 % and 90 % of an epoch, against a fresh start (``fit`` of a new run to its first batch). The
training set costs ``--sample-ms`` (2 ms) of sleep per sample (I/O latency without CPU load, fair on a busy
machine), ``--epoch-batches`` (100) batches of ``--resume-batch-size`` (8) samples an epoch, on a tiny model. Each
resume is timed twice: as the loop resumes a ``DataLoader`` (the trained batches' indices drawn, nothing fetched),
and with a ``DataLoader`` subclass with its own ``__iter__``, which the loop resumes as aitoolbox did before (the
trained batches loaded and discarded). The variants are interleaved, the order rotating every repetition.

Run:  python benchmarks/checkpoint.py                     (about 2 minutes on 2 cores)
      python benchmarks/checkpoint.py --quick             (smoke test: a 5 M parameter model, a few seconds)
      python benchmarks/checkpoint.py --resume-latency    (about 30 seconds)
"""
import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

import _common  # noqa: E402

from aitoolbox.experiment.local_save.checkpoints import save_checkpoint_file  # noqa: E402
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.callbacks.model_save import CHECKPOINT_EXECUTION_ORDER, ModelCheckpoint  # noqa: E402
from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

RATIO_TARGET = 1.1  # ours / bare torch.save, at most
VARIANTS = ("ours", "bare", "save+fsync")


class LinearStack(TTModel):
    """``layers`` square linear layers: many parameters, little else."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).cpu(), y, None


class StallStart(AbstractCallback):
    """Runs just before ModelCheckpoint at the epoch end: starts the clock."""

    def __init__(self, clock: Dict[str, float]):
        super().__init__("stall start", execution_order=CHECKPOINT_EXECUTION_ORDER - 1)
        self.clock = clock

    def on_epoch_end(self) -> None:
        self.clock["start"] = time.perf_counter()


class StallEnd(AbstractCallback):
    """Runs just after ModelCheckpoint: stops the clock, then (untimed) waits for a background save to finish,
    deletes the checkpoint and syncs."""

    def __init__(self, clock: Dict[str, float], folder: str, checkpoint: ModelCheckpoint):
        super().__init__("stall end", execution_order=CHECKPOINT_EXECUTION_ORDER + 1)
        self.clock = clock
        self.folder = folder
        self.checkpoint = checkpoint
        self.stalls: List[float] = []
        self.file_sizes: List[int] = []

    def on_epoch_begin(self) -> None:
        os.sync()  # the checkpoint of this epoch's end starts with nothing left to write back

    def on_epoch_end(self) -> None:
        self.stalls.append(time.perf_counter() - self.clock["start"])
        self.checkpoint.wait_for_pending_save()
        for root, _, files in os.walk(self.folder):
            for name in files:
                if name.endswith(".pth"):
                    path = os.path.join(root, name)
                    self.file_sizes.append(os.path.getsize(path))
                    os.remove(path)


def one_sample_loader(width: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(1, width, generator=generator),
                                    torch.randn(1, width, generator=generator)), batch_size=1)


def build_train_loop(args):
    """The model after one SGD step (momentum buffers exist), inside the TrainLoop that trained it."""
    torch.manual_seed(args.seed)
    model = LinearStack(args.width, args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    tl = TrainLoop(model, one_sample_loader(args.width, args.seed), None, None, optimizer, nn.MSELoss(),
                   end_auto_eval=False, show_progress=False)
    tl.fit(num_epochs=1)
    return tl, model, optimizer


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def savers(tl, model, optimizer, folder: str) -> Dict[str, Callable[[str], Dict[str, float]]]:
    """Each saver writes ``name`` into ``folder`` and returns its timings (seconds)."""

    def ours(name: str) -> Dict[str, float]:
        start = time.perf_counter()
        checkpoint = tl.checkpoint_state(mid_epoch=False)
        captured = time.perf_counter()
        save_checkpoint_file(checkpoint, folder, name)
        end = time.perf_counter()
        return {"total": end - start, "capture": captured - start}

    def bare(name: str) -> Dict[str, float]:
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(folder, name))
        return {"total": time.perf_counter() - start}

    def save_fsync(name: str) -> Dict[str, float]:
        path = os.path.join(folder, name)
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        saved = time.perf_counter()
        fsync_file(path)
        end = time.perf_counter()
        return {"total": end - start, "fsync": end - saved}

    return {"ours": ours, "bare": bare, "save+fsync": save_fsync}


def time_saves(args, tl, model, optimizer, folder: str) -> Dict[str, List[Dict[str, float]]]:
    timings: Dict[str, List[Dict[str, float]]] = {name: [] for name in VARIANTS}
    sizes: Dict[str, int] = {}
    functions = savers(tl, model, optimizer, folder)
    for repetition in range(args.warmup + args.repeats):
        shift = repetition % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            file_name = f"{name.replace('+', '_')}_{repetition}.pth"
            os.sync()
            result = functions[name](file_name)
            path = os.path.join(folder, file_name)
            sizes[name] = os.path.getsize(path)
            os.remove(path)
            if repetition >= args.warmup:
                timings[name].append(result)
    leftovers = os.listdir(folder)
    if leftovers:
        raise RuntimeError(f"files left in {folder} after the saves: {leftovers}")
    return {"timings": timings, "sizes": sizes}


def measure_stall(args, folder: str, background_save: bool) -> Dict[str, object]:
    """ModelCheckpoint.on_epoch_end's duration over ``warmup + repeats`` one-batch epochs.

    With ``background_save`` each write is waited for after the clock stopped, i.e. the stall of epochs that
    last longer than a write (a shorter epoch would also wait at its checkpoint for the previous write).
    """
    tl, _, _ = build_train_loop(args)
    clock: Dict[str, float] = {}
    checkpoint = ModelCheckpoint("checkpoint_bench", "stall", folder, background_save=background_save)
    end = StallEnd(clock, folder, checkpoint)
    tl.fit(num_epochs=1 + args.warmup + args.repeats, callbacks=[StallStart(clock), checkpoint, end])
    return {"stalls": end.stalls[args.warmup:], "size": max(end.file_sizes)}


def filesystem_of(path: str) -> str:
    """``<device> <fstype> mounted on <mount point>`` of the file system holding ``path`` (Linux)."""
    path = os.path.realpath(path)
    best = None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, fs_type = line.split()[:3]
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and \
                        (best is None or len(mount_point) > len(best[1])):
                    best = (device, mount_point, fs_type)
    except OSError:
        return "unknown"
    return f"{best[0]} ({best[2]}) mounted on {best[1]}" if best else "unknown"


HEADERS = ["variant", "saves timed", "seconds (median)", "seconds (min)", "seconds",
           "of which checkpoint_state / fsync (median)", "file MB", "ratio to bare (median paired)",
           "ratio to bare (of minima)", "ratio to save+fsync (median paired)", "ratio to save+fsync (of minima)"]


def result_rows(saves: Dict[str, object]) -> List[List[str]]:
    timings, sizes = saves["timings"], saves["sizes"]
    totals = {name: [run["total"] for run in runs] for name, runs in timings.items()}
    rows = []
    for name in VARIANTS:
        part = "-"
        if name == "ours":
            part = f"{_common.median([run['capture'] for run in timings[name]]):.3f} (checkpoint_state)"
        elif name == "save+fsync":
            part = f"{_common.median([run['fsync'] for run in timings[name]]):.3f} (fsync)"
        to_bare = _common.median([a / b for a, b in zip(totals[name], totals["bare"])])
        to_fsync = _common.median([a / b for a, b in zip(totals[name], totals["save+fsync"])])
        rows.append([name, str(len(totals[name])), f"{_common.median(totals[name]):.3f}",
                     f"{min(totals[name]):.3f}", _common.fmt_list(totals[name]), part, f"{sizes[name] / 1e6:.1f}",
                     _common.fmt_ratio(to_bare), _common.fmt_ratio(min(totals[name]) / min(totals["bare"])),
                     _common.fmt_ratio(to_fsync), _common.fmt_ratio(min(totals[name]) / min(totals["save+fsync"]))])
    return rows


def verdict_lines(saves: Dict[str, object], stall: Dict[str, object]) -> List[str]:
    totals = {name: [run["total"] for run in runs] for name, runs in saves["timings"].items()}
    to_bare = _common.median([a / b for a, b in zip(totals["ours"], totals["bare"])])
    to_fsync = _common.median([a / b for a, b in zip(totals["ours"], totals["save+fsync"])])
    fsync_share = _common.median([run["fsync"] / run["total"] for run in saves["timings"]["save+fsync"]])
    minima = {name: min(values) for name, values in totals.items()}
    of_minima = minima["ours"] / minima["bare"]
    verdict = {(True, True): "met", (False, False): "MISSED", (True, False): "met by the median paired ratio, "
               "MISSED by the ratio of minima", (False, True): "MISSED by the median paired ratio, met by the ratio "
               "of minima"}[(to_bare <= RATIO_TARGET, of_minima <= RATIO_TARGET)]
    lines = [f"- ours / bare torch.save: {to_bare:.3f} (median paired), {of_minima:.3f} (of minima); target <= "
             f"{RATIO_TARGET:.1f}: {verdict}",
             f"- ours / (torch.save + fsync): {to_fsync:.3f} (median paired), "
             f"{minima['ours'] / minima['save+fsync']:.3f} (of minima); fsync is {fsync_share:.0%} of "
             "save+fsync's time (median)"]
    for mode, measured in stall.items():
        stalls = measured["stalls"]
        how = "ModelCheckpoint.on_epoch_end" if mode == "in place" else \
            "ModelCheckpoint(background_save=True).on_epoch_end, the previous write finished"
        lines.append(f"- training stall per checkpoint, {mode} ({how}, {len(stalls)} epochs, "
                     f"{measured['size'] / 1e6:.1f} MB files): median {_common.median(stalls):.3f} s "
                     f"({_common.fmt_list(stalls)})")
    return lines


# --- resume latency ----------------------------------------------------------------------------------------------
RESUME_POSITIONS = (0.1, 0.5, 0.9)
LATENCY_TARGET = 1.05  # a resume at any position / a fresh start, at most


class SlowSamples(Dataset):
    """Random samples that each take ``cost_s`` to load (a sleep: I/O latency, no CPU)."""

    def __init__(self, size: int, width: int, cost_s: float):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, width, generator=generator), torch.randn(size, width, generator=generator)
        self.cost_s = cost_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        time.sleep(self.cost_s)
        return self.x[index], self.y[index]


class FetchingLoader(DataLoader):
    """A DataLoader with its own ``__iter__``: the loop cannot skip its batches by index and loads them."""

    def __iter__(self):
        return super().__iter__()


class FirstBatchReached(Exception):
    pass


class FirstBatch(AbstractCallback):
    """Notes when the first batch of ``fit`` begins (its data loaded) and stops training there."""

    def __init__(self):
        super().__init__("first batch clock")
        self.at = None

    def on_batch_begin(self) -> None:
        self.at = time.perf_counter()
        raise FirstBatchReached


class SaveAtBatches(AbstractCallback):
    """Mid-epoch checkpoints (dicts in memory) after the given numbers of batches."""

    def __init__(self, after: List[int]):
        super().__init__("save mid-epoch", execution_order=CHECKPOINT_EXECUTION_ORDER)
        self.after = set(after)
        self.saved: Dict[int, dict] = {}

    def on_batch_end(self) -> None:
        done = self.train_loop_obj.total_iteration_idx + 1
        if done in self.after:
            self.saved[done] = self.train_loop_obj.checkpoint_state(mid_epoch=True)


def resume_train_loop(args, loader_class=DataLoader) -> TrainLoop:
    torch.manual_seed(args.seed)
    model = LinearStack(32, 2)
    data = SlowSamples(args.epoch_batches * args.resume_batch_size, 32, args.sample_ms / 1000)
    loader = loader_class(data, batch_size=args.resume_batch_size, shuffle=True, num_workers=args.resume_workers,
                          generator=torch.Generator().manual_seed(args.seed))
    return TrainLoop(model, loader, None, None, torch.optim.SGD(model.parameters(), lr=1e-3), nn.MSELoss(),
                     end_auto_eval=False, show_progress=False)


def time_to_first_batch(args, checkpoint: Optional[dict], loader_class=DataLoader) -> float:
    """Seconds from loading ``checkpoint`` (None: a fresh start) to the first new batch's start."""
    tl = resume_train_loop(args, loader_class)
    checkpoint = copy.deepcopy(checkpoint)  # the loaded dict is the loop's afterwards
    clock = FirstBatch()
    start = time.perf_counter()
    if checkpoint is not None:
        tl.load_checkpoint(checkpoint)
    try:
        tl.fit(num_epochs=1, callbacks=[clock])
    except FirstBatchReached:
        pass
    return clock.at - start


def measure_resume_latency(args) -> Dict[str, List[float]]:
    positions = [round(fraction * args.epoch_batches) for fraction in RESUME_POSITIONS]
    saver = SaveAtBatches(positions)
    resume_train_loop(args).fit(num_epochs=1, callbacks=[saver])
    variants = {"fresh start": lambda: time_to_first_batch(args, None)}
    for fraction, position in zip(RESUME_POSITIONS, positions):
        checkpoint = saver.saved[position]
        variants[f"resume at {fraction:.0%}"] = lambda ckpt=checkpoint: time_to_first_batch(args, ckpt)
        variants[f"resume at {fraction:.0%}, loading the trained batches"] = \
            lambda ckpt=checkpoint: time_to_first_batch(args, ckpt, FetchingLoader)
    names = list(variants)
    timings: Dict[str, List[float]] = {name: [] for name in names}
    for repetition in range(args.warmup + args.repeats):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = variants[name]()
            if repetition >= args.warmup:
                timings[name].append(seconds)
    return timings


def resume_latency_text(args, timings: Dict[str, List[float]], info: Dict[str, str]) -> str:
    fresh = _common.median(timings["fresh start"])
    rows = [[name, f"{_common.median(values) * 1000:.1f}", f"{min(values) * 1000:.1f}",
             _common.fmt_list([value * 1000 for value in values], 1), f"{(_common.median(values) - fresh) * 1000:+.1f}",
             _common.fmt_ratio(_common.median(values) / fresh)] for name, values in timings.items()]
    resumes = [_common.median(timings[f"resume at {fraction:.0%}"]) for fraction in RESUME_POSITIONS]
    verdict = "met" if max(resumes) / fresh <= LATENCY_TARGET else "MISSED"
    first_batch_ms = args.resume_batch_size * args.sample_ms
    lines = [f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "",
             _common.markdown_table(["variant", "ms to the first new batch (median)", "ms (min)", "ms",
                                     "ms more than a fresh start (median)", "ratio to a fresh start (median)"], rows),
             "",
             f"- resume / fresh start at 10 %, 50 %, 90 % of the epoch: "
             f"{', '.join(_common.fmt_ratio(value / fresh) for value in resumes)}; target <= {LATENCY_TARGET:.2f} at "
             f"every position: {verdict}",
             f"- spread of the resume's median over the positions: {(max(resumes) - min(resumes)) * 1000:.1f} ms; "
             f"the first batch's data alone costs {first_batch_ms:.0f} ms", ""]
    return "\n".join(lines)


def resume_latency_main(args) -> str:
    info = _common.machine_info(torch.device("cpu"))
    with _common.stderr_to_devnull():  # the loop's epoch log lines
        load_before = _common.load_average()
        timings = measure_resume_latency(args)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    info["settings"] = (f"{args.epoch_batches} batches of {args.resume_batch_size} samples an epoch, "
                        f"{args.sample_ms} ms per sample, num_workers={args.resume_workers}, 2 x nn.Linear(32, 32); "
                        f"{args.repeats} timed repetitions after {args.warmup} warm-up, order rotating")
    text = resume_latency_text(args, timings, info)
    print(text)
    if args.write_results:
        print(f"updated {_common.update_results_section('checkpoint-resume-latency', text)}")
    return text


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096, help="in and out features of every layer")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="timed saves of each variant, and stall epochs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed saves of each variant (and epochs) first")
    parser.add_argument("--dir", default=None,
                        help="folder to write the checkpoints into (default: a new folder under the temp dir)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: 5 x 1024 x 1024 (5.2 M parameters), "
                                                             "1 timed repetition, no warm-up")
    parser.add_argument("--resume-latency", action="store_true",
                        help="measure only the time from a mid-epoch checkpoint to the first new batch")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="--resume-latency: load time per sample")
    parser.add_argument("--epoch-batches", type=int, default=100, help="--resume-latency: batches an epoch")
    parser.add_argument("--resume-batch-size", type=int, default=8, help="--resume-latency: samples a batch")
    parser.add_argument("--resume-workers", type=int, default=0, help="--resume-latency: DataLoader num_workers")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'checkpoint' section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.repeats, args.warmup = 1024, 5, 1, 0
    for name in ("width", "layers", "repeats", "epoch_batches", "resume_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "sample_ms", "resume_workers"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir} is not an existing folder")
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    _common.set_threads(args.threads)
    if args.resume_latency:
        return resume_latency_main(args)
    info = _common.machine_info(torch.device("cpu"))
    workdir = tempfile.mkdtemp(prefix="aitoolbox-bench-ckpt-", dir=args.dir)
    try:
        saves_dir = os.path.join(workdir, "saves")
        os.makedirs(saves_dir)
        with _common.stderr_to_devnull():  # the loop's epoch log lines
            tl, model, optimizer = build_train_loop(args)
            num_params = sum(p.numel() for p in model.parameters())
            load_before = _common.load_average()
            saves = time_saves(args, tl, model, optimizer, saves_dir)
            del tl, model, optimizer
            stall = {mode: measure_stall(args, os.path.join(workdir, "stall_" + mode.replace(" ", "_")),
                                         background_save=mode == "background")
                     for mode in ("in place", "background")}
        info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    info["disk"] = f"{workdir} on {filesystem_of(os.path.dirname(workdir))} (deleted afterwards)"
    info["settings"] = (f"{args.layers} x nn.Linear({args.width}, {args.width}) = {num_params / 1e6:.1f} M parameters, "
                        f"SGD momentum 0.9 after one step; {args.repeats} timed saves per variant after "
                        f"{args.warmup} warm-up, order rotating; os.sync() before each save")
    table = _common.markdown_table(HEADERS, result_rows(saves))
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, "",
                      *verdict_lines(saves, stall), ""])
    print(text)
    if args.write_results:
        path = _common.update_results_section("checkpoint", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
