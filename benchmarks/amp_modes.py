"""Mixed-precision modes of TrainLoop against float32 and a hand-written ``torch.autocast`` loop.

The table follows ColossalAI's AMP comparison (memory, iterations/s, throughput) for one model:
a compact Vision Transformer (``--model vit``: 32x32 images, 4x4 patches, width 192, depth 4, 3 heads)
or the quickstart CNN (``--model cnn``: 8x8 digits-sized images), on random data of a fixed size (no
download). Modes:

* ``fp32``: ``TrainLoop(use_amp=False)``
* ``O1`` / ``O2`` / ``O3``: ``TrainLoop(use_amp={'opt_level': ...})`` (apex levels, see aitoolbox.torchtrain.amp)
* ``hand-autocast``: a plain loop under ``torch.autocast`` (bfloat16 on CPU; float16 with
  ``torch.amp.GradScaler`` on CUDA)
* ``hand-fp32``: the plain loop in float32 (the hand loop's own baseline)
* ``use_amp=True`` (opt-in with ``--modes``): TrainLoop's default mixed precision

Speed: for each repeat, every mode (in an order rotated per repeat) builds a fresh model and optimizer
with the same initial weights, trains ``--warmup`` untimed iterations, then ``--iters`` timed ones. The
table shows medians over repeats; "speed-up" is the median over repeats of (mode it/s) / (fp32 it/s) of
the same repeat.

Memory, measured in a separate untimed pass, one fresh model per mode:

* weights+grads: bytes of the model's parameters and gradients plus any float32 master copies the
  optimizer steps and their gradients (unique storages, read from the tensors after backward and after
  the optimizer step; the larger total is kept);
* optimizer state: bytes of the tensors in ``optimizer.state`` (Adam's moments);
* saved activations: bytes of the tensors autograd saves for backward in one iteration (unique
  storages, parameters excluded; autocast's low-precision weight copies count here), via
  ``torch.autograd.graph.saved_tensors_hooks``;
* peak: on CUDA ``torch.cuda.max_memory_allocated`` during model build + training, minus what was
  allocated before; on CPU the rise of the process's peak resident set size (VmHWM, reset through
  ``/proc/self/clear_refs`` after ``malloc_trim``) over the same span - allocator dependent, so noisier.

Run:  python benchmarks/amp_modes.py --model vit --plot        (about 1.5 minutes on 2 idle cores)
      python benchmarks/amp_modes.py --quick                   (smoke test)
"""
import argparse
import contextlib
import ctypes
import gc
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN  # noqa: E402

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

TRAINLOOP_MODES = {"fp32": False, "O1": {"opt_level": "O1"}, "O2": {"opt_level": "O2"},
                   "O3": {"opt_level": "O3"}, "use_amp=True": True}
HAND_MODES = ("hand-autocast", "hand-fp32")
DEFAULT_MODES = ["fp32", "O1", "O2", "O3", "hand-autocast", "hand-fp32"]
MiB = 2.0 ** 20


# --- models ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection and torch's scaled_dot_product_attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(TTModel):
    """A small Vision Transformer: conv patch embedding, class token, learned positions, pre-norm blocks."""

    def __init__(self, image_size: int = 32, patch_size: int = 4, channels: int = 3, dim: int = 192,
                 depth: int = 4, heads: int = 3, num_classes: int = 10):
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


MODELS: Dict[str, Callable[[argparse.Namespace], nn.Module]] = {
    "vit": lambda args: TinyViT(args.image_size, args.patch_size, 3, args.dim, args.depth, args.heads),
    "cnn": lambda args: DigitsCNN(),
}


def input_shape(args) -> tuple:
    return (3, args.image_size, args.image_size) if args.model == "vit" else (1, 8, 8)


def make_loader(args) -> DataLoader:
    """Fixed random images and labels: enough batches for the warm-up and for the timed iterations."""
    generator = torch.Generator().manual_seed(args.seed)
    num_samples = args.batch_size * max(args.iters, args.warmup, 1)
    images = torch.randn(num_samples, *input_shape(args), generator=generator)
    labels = torch.randint(0, 10, (num_samples,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=False)


# --- memory probes --------------------------------------------------------------------------------------
def unique_bytes(tensors, exclude: Optional[set] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share a storage and count once)."""
    seen, total = set(exclude or ()), 0
    for tensor in tensors:
        if tensor is None:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def storages_of(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


class TensorBytes:
    """Largest weights+gradients and optimizer-state byte counts seen at the probe points."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.weights_grads = 0
        self.model_weights_grads = 0
        self.optimizer_state = 0

    def probe(self) -> None:
        model_params = list(self.model.parameters())
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        masters = [p for p in stepped if p.untyped_storage().data_ptr() not in storages_of(model_params)]
        model_part = unique_bytes(model_params) + unique_bytes([p.grad for p in model_params])
        master_part = unique_bytes(masters) + unique_bytes([p.grad for p in masters])
        state = [value for per_param in self.optimizer.state.values() for value in per_param.values()
                 if isinstance(value, torch.Tensor)]
        self.model_weights_grads = max(self.model_weights_grads, model_part)
        self.weights_grads = max(self.weights_grads, model_part + master_part)
        self.optimizer_state = max(self.optimizer_state, unique_bytes(state))


class ProbeCallback(AbstractCallback):
    """Reads tensor sizes after backward and after the optimizer step of every TrainLoop iteration."""

    def __init__(self, sink: Callable[[], TensorBytes]):
        super().__init__("tensor bytes probe")
        self.sink = sink

    def on_after_gradient_update(self, optimizer_idx):
        self.sink().probe()

    def on_after_optimizer_step(self):
        self.sink().probe()


class SavedActivations:
    """Counts the bytes autograd saves for backward (distinct storages, parameters excluded)."""

    def __init__(self, exclude: set):
        self.exclude = set(exclude)
        self.seen: set = set()
        self.bytes = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class PeakMemory:
    """Peak memory over a span: CUDA allocator statistics, or the process's peak RSS on Linux."""

    def __init__(self, device: torch.device):
        self.device = device
        self.available = device.type == "cuda" or self._can_reset_rss_peak()
        self.base = 0

    @staticmethod
    def _can_reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so earlier modes do not hide growth
        if self.available:
            self._can_reset_rss_peak()  # writes "5": VmHWM := current RSS
            self.base = self._status_kib("VmRSS") * 1024

    def peak_rise(self) -> Optional[int]:
        if not self.available:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status_kib("VmHWM") * 1024 - self.base


# --- runners --------------------------------------------------------------------------------------------
def build_model_and_optimizer(args):
    torch.manual_seed(args.seed)
    model = MODELS[args.model](args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    return model, optimizer


class TrainLoopRunner:
    """TrainLoop with the mode's ``use_amp``; ``train(n)`` runs n more iterations (one ``fit`` call)."""

    def __init__(self, mode: str, args, loader: DataLoader, probe: Optional[ProbeCallback] = None):
        self.model, self.optimizer = build_model_and_optimizer(args)
        self.train_loop = TrainLoop(self.model, loader, None, None, self.optimizer, nn.CrossEntropyLoss(),
                                    end_auto_eval=False, show_progress=False, use_amp=TRAINLOOP_MODES[mode])
        self.callbacks = [probe] if probe is not None else []
        self.done = 0

    def train(self, num_iterations: int) -> None:
        self.train_loop.fit(num_iterations=self.done + num_iterations,
                            callbacks=self.callbacks if self.done == 0 else None)
        self.done += num_iterations

    @property
    def stepped_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer


class HandRunner:
    """The plain loop, in float32 or under ``torch.autocast`` (with a GradScaler for float16 on CUDA)."""

    def __init__(self, mode: str, args, loader: DataLoader, device: torch.device, probe=None):
        self.model, self.optimizer = build_model_and_optimizer(args)
        self.model.to(device)
        self.loader, self.device, self.probe = loader, device, probe
        self.criterion = nn.CrossEntropyLoss()
        self.autocast = mode == "hand-autocast"
        self.dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.autocast and self.dtype == torch.float16)

    def train(self, num_iterations: int) -> None:
        model, optimizer, criterion, scaler, device = self.model, self.optimizer, self.criterion, self.scaler, \
            self.device
        model.train()
        for _, (images, labels) in zip(range(num_iterations), self.loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=self.dtype, enabled=self.autocast):
                loss = criterion(model(images), labels)
            scaler.scale(loss).backward()
            if self.probe is not None:
                self.probe.probe()
            scaler.step(optimizer)
            scaler.update()
            if self.probe is not None:
                self.probe.probe()
            optimizer.zero_grad(set_to_none=True)

    @property
    def stepped_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer


def make_runner(mode: str, args, loader: DataLoader, device: torch.device, with_probe: bool = False):
    """A runner and, with ``with_probe``, the TensorBytes it reports to."""
    holder: Dict[str, TensorBytes] = {}
    if mode in HAND_MODES:
        runner = HandRunner(mode, args, loader, device)
        if with_probe:
            holder["bytes"] = runner.probe = TensorBytes(runner.model, runner.optimizer)
        return runner, holder.get("bytes")
    probe = ProbeCallback(lambda: holder["bytes"]) if with_probe else None
    runner = TrainLoopRunner(mode, args, loader, probe)
    if with_probe:
        holder["bytes"] = TensorBytes(runner.model, runner.optimizer)
    return runner, holder.get("bytes")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- measurement ----------------------------------------------------------------------------------------
def measure_memory(mode: str, args, loader: DataLoader, device: torch.device) -> Dict[str, Optional[float]]:
    peak = PeakMemory(device)
    peak.start()
    runner, tensor_bytes = make_runner(mode, args, loader, device, with_probe=True)
    runner.train(max(args.warmup, 1))  # Adam's state exists after the first step
    parameters = list(runner.model.parameters()) + [
        p for group in runner.stepped_optimizer.param_groups for p in group["params"]]
    saved = SavedActivations(storages_of(parameters))
    with saved.hooks():
        runner.train(1)
    peak_rise = peak.peak_rise()
    result = {"weights_grads": tensor_bytes.weights_grads, "model_weights_grads": tensor_bytes.model_weights_grads,
              "optimizer_state": tensor_bytes.optimizer_state, "saved_activations": saved.bytes,
              "peak": peak_rise}
    del runner
    gc.collect()
    return result


def measure_speed(modes: List[str], args, loader: DataLoader, device: torch.device):
    """Iterations/s of every mode in every repeat, modes round-robin (order rotated per repeat)."""
    its: Dict[str, List[float]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
        for mode in order:
            runner, _ = make_runner(mode, args, loader, device)
            with _common.output_to_devnull():
                if args.warmup:
                    runner.train(args.warmup)
                synchronize(device)
                start = time.perf_counter()
                runner.train(args.iters)
                synchronize(device)
                seconds = time.perf_counter() - start
            its[mode].append(args.iters / seconds)
            del runner
            gc.collect()
    return its


def paired_ratio(its: Dict[str, List[float]], mode: str, baseline: str) -> float:
    return _common.median([a / b for a, b in zip(its[mode], its[baseline])])


def fmt_mib(num_bytes: Optional[float]) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / MiB:.2f}"


def build_report(modes, memory, its, args, device) -> str:
    peak_label = "peak allocated MiB (CUDA)" if device.type == "cuda" else "peak RSS rise MiB"
    headers = ["mode", peak_label, "weights+grads MiB", "optimizer state MiB", "saved activations MiB",
               "iterations/s", "samples/s", "speed-up vs fp32"]
    rows = []
    for mode in modes:
        it_s = _common.median(its[mode])
        speed_up = paired_ratio(its, mode, "fp32") if "fp32" in its else float("nan")
        mem = memory[mode]
        rows.append([mode, fmt_mib(mem["peak"]), fmt_mib(mem["weights_grads"]), fmt_mib(mem["optimizer_state"]),
                     fmt_mib(mem["saved_activations"]), f"{it_s:.2f}", f"{it_s * args.batch_size:.1f}",
                     f"{speed_up:.3f}"])
    return _common.markdown_table(headers, rows)


def verdicts(modes, memory, its) -> List[str]:
    """The targets: O1 within 3% of the hand autocast loop's speed-up; O2/O3 cut weights+grads by >= 40%."""
    lines = []
    if {"O1", "hand-autocast", "fp32"} <= set(modes):
        ratio = paired_ratio(its, "O1", "hand-autocast")
        own = ""
        if "hand-fp32" in modes:
            own = f"; hand-autocast over hand-fp32: {paired_ratio(its, 'hand-autocast', 'hand-fp32'):.3f}"
        lines.append(f"- O1 speed-up {paired_ratio(its, 'O1', 'fp32'):.3f} vs hand autocast "
                     f"{paired_ratio(its, 'hand-autocast', 'fp32'):.3f} (both over TrainLoop fp32): O1/hand = "
                     f"{ratio:.3f}, target >= 0.97: {'met' if ratio >= 0.97 else 'MISSED'}{own}")
    if "fp32" in modes:
        fp32 = memory["fp32"]
        for level in ("O2", "O3"):
            if level not in modes:
                continue
            cut_all = 1 - memory[level]["weights_grads"] / fp32["weights_grads"]
            cut_model = 1 - memory[level]["model_weights_grads"] / fp32["model_weights_grads"]
            lines.append(f"- {level} weights+grads cut vs fp32: {cut_all:.1%} counting the float32 master copies "
                         f"the optimizer steps, {cut_model:.1%} for the model's own parameters and gradients; "
                         f"target >= 40%: {'met' if cut_all >= 0.40 else 'MISSED'} (all copies), "
                         f"{'met' if cut_model >= 0.40 else 'MISSED'} (model only)")
        if "hand-fp32" in modes:
            lines.append(f"- same-work check: hand-fp32 / TrainLoop fp32 it/s = "
                         f"{paired_ratio(its, 'hand-fp32', 'fp32'):.3f} (TrainLoop overhead at this model size)")
    return lines


def plot(modes, memory, its, args, device) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [_common.median(its[mode]) for mode in modes]
    panels = [("iterations/s (median)", speed),
              ("weights+grads MiB", [memory[m]["weights_grads"] / MiB for m in modes]),
              ("saved activations MiB", [memory[m]["saved_activations"] / MiB for m in modes])]
    if all(memory[m]["peak"] is not None for m in modes):
        label = "peak allocated MiB" if device.type == "cuda" else "peak RSS rise MiB"
        panels.append((label, [memory[m]["peak"] / MiB for m in modes]))
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for axis, (title, values) in zip(axes, panels):
        axis.bar(modes, values, color=["#4c72b0" if not m.startswith("hand") else "#dd8452" for m in modes])
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=45)
    figure.suptitle(f"TrainLoop AMP modes, {args.model} on {device.type} (batch {args.batch_size})")
    figure.tight_layout()
    path = _HERE / f"amp_modes_{device.type}.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="vit")
    parser.add_argument("--modes", nargs="+", choices=list(TRAINLOOP_MODES) + list(HAND_MODES),
                        default=DEFAULT_MODES)
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per repeat and mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before the timed ones")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 timed iterations, 1 repeat, depth 1")
    parser.add_argument("--plot", action="store_true", help="write benchmarks/amp_modes_<device>.png")
    parser.add_argument("--write-results", action="store_true",
                        help="replace this model/device's section of benchmarks/RESULTS.md with this run")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.warmup, args.repeats, args.depth = 2, 1, 1, 1
    for name in ("iters", "repeats", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if args.image_size % args.patch_size:
        parser.error(f"--image-size ({args.image_size}) must be divisible by --patch-size ({args.patch_size})")
    args.modes = list(dict.fromkeys(args.modes))  # drop repeats, keep order
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    threads = _common.set_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    loader = make_loader(args)
    model_desc = (f"TinyViT {args.image_size}x{args.image_size}, patch {args.patch_size}, dim {args.dim}, "
                  f"depth {args.depth}, heads {args.heads}" if args.model == "vit" else "DigitsCNN (1x8x8 input)")
    num_params = sum(p.numel() for p in MODELS[args.model](args).parameters())
    low = "float16 (+GradScaler)" if device.type == "cuda" else "bfloat16"
    info = _common.machine_info(device)
    info.update({"model": f"{model_desc}, {num_params / 1e6:.2f} M parameters, Adam",
                 "settings": f"batch {args.batch_size}, {args.iters} timed + {args.warmup} warm-up iterations, "
                             f"{args.repeats} repeats, threads={threads}",
                 "low-precision dtype": f"{low} (hand-autocast and TrainLoop O1-O3)"})
    with _common.output_to_devnull():
        # One-off costs of a process (oneDNN kernel creation per dtype and shape, lazy imports) must land
        # neither in the first mode's memory peak nor in its speed: pay them for every mode first.
        for mode in args.modes:
            make_runner(mode, args, loader, device)[0].train(2)
        memory = {mode: measure_memory(mode, args, loader, device) for mode in args.modes}
    load_before = _common.load_average()
    its = measure_speed(args.modes, args, loader, device)
    info["load average (1 min) before / after timing"] = f"{load_before} / {_common.load_average()}"
    table = build_report(args.modes, memory, its, args, device)
    per_repeat = "\n".join(f"  - {mode}: {_common.fmt_list(its[mode], 2)}" for mode in args.modes)
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "", table, "",
                      *verdicts(args.modes, memory, its), "- iterations/s per repeat:", per_repeat, ""])
    print(text)
    if args.plot:
        print(f"wrote {plot(args.modes, memory, its, args, device)}")
    if args.write_results:
        path = _common.update_results_section(f"amp_modes {args.model} {device.type}", text)
        print(f"updated {path}")
    return text


if __name__ == "__main__":
    main()
