"""torch.compile in TrainLoop against hand-written loops, eager and compiled, on the CPU in bfloat16 autocast.

Three models (``--models``): ``mlp`` (512-1024-1024-10, batch 64), ``cnn`` (the quickstart's DigitsCNN on
8x8 images, batch 32) and ``vit`` (benchmarks/amp_modes.py's TinyViT on 32x32 images, batch 32), each trained
with the same plain ``torch.optim.AdamW`` (neither fused nor foreach forced) under bfloat16 autocast by:

* ``a``: a hand-written eager loop (autocast forward and loss, ``loss.backward()``, ``optimizer.step()``,
  ``optimizer.zero_grad()``);
* ``b``: the same loop with torch's compiled-optimizer recipe: ``torch.compile(model)`` (the wrapper: in
  torch 2.13 ``nn.Module.compile()`` compiles nothing for modules whose forward is torch's own) and
  ``optimizer.step()`` inside a ``torch.compile``-d function, with a tensor learning rate
  (``AdamW(params, lr=torch.tensor(1e-3))``);
* ``c``: ``TrainLoop(..., use_amp=True, torch_compile=True, show_progress=False, end_auto_eval=False)``, one
  ``fit`` call per epoch (``use_amp=True`` is bfloat16 autocast without loss scaling on the CPU).

The data are random, of a fixed size, and the epoch's last batch has half the samples, so the recompilation
a smaller last batch causes happens once, in the warm-up epoch. Every runner of a model starts from the same
weights and sees the same batches.

What is measured, per model:

* **steady-state samples/s**: after one warm-up epoch per runner, ``--repeats`` rounds in which every runner
  trains ``--epochs`` epochs, the runners' order rotating from round to round (so a busy neighbour slows all
  alike); the table shows the median over rounds, and the ratios are medians of the per-round ratios.
* **recompiles after warm-up**: graphs dynamo compiled during the timed epochs
  (``torch._dynamo.utils.counters['stats']['unique_graphs']``) and, for ``c``, ``tl.compile_stats`` events
  after the warm-up epoch. Both should be 0.
* **first compile**: the warm-up epoch's wall time minus the median steady epoch, and for ``c`` also
  ``tl.compile_stats.compile_time_s``. ``b`` and ``c`` compile the same graphs, so in one process whichever
  compiles second would find them in inductor's caches: each is therefore measured in a fresh process with
  an empty ``TORCHINDUCTOR_CACHE_DIR`` of its own ("cold"; it includes importing the compiler, as a user's
  first compile does). The main process then reuses those cache directories, so its warm-up epochs show
  what a rerun with a warm cache costs ("warm"). ``--no-cold`` skips the fresh processes (the main process
  then compiles with one empty cache directory, and its first-compile figures are not comparable).
* **losses**: each runner's mean training loss in the warm-up epoch and in the last timed epoch, to show
  that the three did the same training (bfloat16 rounding and, for the CNN, dropout drawn differently when
  compiled make them close, not equal).

Run:  python benchmarks/compile.py                          (about 12 minutes on 2 idle cores)
      python benchmarks/compile.py --models mlp --repeats 3  (about 2 minutes)
      python benchmarks/compile.py --models mlp --batches 4 --repeats 2 --backend aot_eager --no-cold  (smoke)
"""
import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import _common  # noqa: E402
from amp_modes import TinyViT  # noqa: E402
from quickstart import DigitsCNN  # noqa: E402

from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

PATHS = ("a", "b", "c")
# --variants: loop b with some of TrainLoop's choices, to tell which of them costs time, and loop a with a fused
# AdamW (no compiling at all). name: (description, dtype of the tensor learning rate, dtype of tensor betas or None
# for floats, batch dimension dynamic)
VARIANTS = {
    "a-fused": ("a, AdamW(fused=True), uncompiled", None, None, False),
    "b-lr64": ("b, lr a float64 tensor", torch.float64, None, False),
    "b-betas64": ("b, lr and betas float64 tensors", torch.float64, torch.float64, False),
    "b-betas32": ("b, lr and betas float32 tensors", torch.float32, torch.float32, False),
    "b-dynamic": ("b, batch dimension dynamic", torch.float32, None, True),
    "b-like-c": ("b, lr and betas float64 tensors, batch dimension dynamic", torch.float64, torch.float64, True),
}
PATH_NAMES = {"a": "a: hand eager", "b": "b: hand compiled", "c": "c: TrainLoop torch_compile",
              **{name: variant[0] for name, variant in VARIANTS.items()}}
TARGETS_C_OVER_A = {"mlp": 1.5, "vit": 1.3}  # the CNN is reported without a target
TARGET_C_OVER_B = 0.97
LR = 1e-3


class MLP(TTModel):
    """512-1024-1024-10 with ReLUs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                    nn.Linear(1024, 10))

    def forward(self, x):
        return self.layers(x)

    def get_loss(self, batch_data, criterion, device):
        inputs, labels = batch_data
        return criterion(self(inputs.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        inputs, labels = batch_data
        return self(inputs.to(device)).argmax(dim=1).cpu(), labels, None


# name: (model factory, input shape of one sample, batch size, full batches per epoch by default)
MODELS: Dict[str, tuple] = {
    "mlp": (MLP, (512,), 64, 80),
    "cnn": (DigitsCNN, (1, 8, 8), 32, 150),
    "vit": (TinyViT, (3, 32, 32), 32, 12),
}


def make_loader(model_name: str, args) -> DataLoader:
    """Random inputs labelled by a fixed random linear map (a task every model can learn, so that the losses of
    the loops stay comparable as training goes on): ``batches`` full batches and a last one of half the size,
    always in the same order."""
    _, shape, batch_size, default_batches = MODELS[model_name]
    num_samples = batch_size * (args.batches or default_batches) + batch_size // 2
    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(num_samples, *shape, generator=generator)
    teacher = torch.randn(inputs[0].numel(), 10, generator=generator)
    labels = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return DataLoader(TensorDataset(inputs, labels), batch_size=batch_size, shuffle=False)


def new_model(model_name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights for every runner
    return MODELS[model_name][0]()


def compile_kwargs(args) -> dict:
    return {} if args.backend == "inductor" else {"backend": args.backend}


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


class DynamicBatches:
    """The loader's batches with dimension 0 of the inputs marked dynamic (as TrainLoop's compiled forward does)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for inputs, labels in self.loader:
            torch._dynamo.maybe_mark_dynamic(inputs, 0)
            yield inputs, labels


class HandLoop:
    """Runners ``a`` (eager), ``b`` (model and optimizer step compiled) and b's variants: one epoch per
    ``run_epoch``."""

    def __init__(self, path: str, model_name: str, loader: DataLoader, args):
        self.path = path
        _, lr_dtype, betas_dtype, dynamic = VARIANTS.get(path, (None, torch.float32, None, False))
        self.loader = DynamicBatches(loader) if dynamic else loader
        self.model = new_model(model_name, args.seed)
        self.criterion = nn.CrossEntropyLoss()
        if path in ("a", "a-fused"):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=path == "a-fused")
            self.forward, self.step = self.model, self.optimizer.step
        else:
            # torch's compiled-optimizer recipe: a tensor learning rate, step() inside a compiled function.
            betas = (0.9, 0.999) if betas_dtype is None else \
                (torch.tensor(0.9, dtype=betas_dtype), torch.tensor(0.999, dtype=betas_dtype))
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(LR, dtype=lr_dtype),
                                               betas=betas)
            self.forward = torch.compile(self.model, **compile_kwargs(args))
            optimizer = self.optimizer

            @torch.compile(**compile_kwargs(args))
            def step():
                optimizer.step()

            self.step = step

    def run_epoch(self) -> float:
        model, forward, criterion, optimizer, step = self.model, self.forward, self.criterion, self.optimizer, \
            self.step
        model.train()
        loss_sum = torch.zeros(())
        for inputs, labels in self.loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = criterion(forward(inputs), labels)
            loss.backward()
            step()
            optimizer.zero_grad()
            loss_sum += loss.detach()
        return loss_sum.item() / len(self.loader)

    def compiled_frames(self) -> List[str]:
        """Which of this runner's functions dynamo holds compiled code for (proof that ``b`` compiles)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        if self.path in ("a", "a-fused"):
            return []
        functions = {"forward": type(self.model).forward, "step": self.step._torchdynamo_orig_callable}
        return [name for name, function in functions.items() if _debug_get_cache_entry_list(function.__code__)]


class TrainLoopRunner:
    """Runner ``c``: TrainLoop with ``torch_compile``, trained one more epoch per ``fit`` call."""

    path = "c"

    def __init__(self, model_name: str, loader: DataLoader, args):
        self.model = new_model(model_name, args.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        torch_compile = compile_kwargs(args) or True
        self.train_loop = TrainLoop(self.model, loader, None, None, self.optimizer, nn.CrossEntropyLoss(),
                                    use_amp=True, torch_compile=torch_compile, show_progress=False,
                                    end_auto_eval=False)
        self.epochs_done = 0

    def run_epoch(self) -> float:
        self.train_loop.fit(num_epochs=self.epochs_done + 1)
        self.epochs_done += 1
        return self.train_loop.train_history["accumulated_loss"][-1]


def make_runner(path: str, model_name: str, loader: DataLoader, args):
    return TrainLoopRunner(model_name, loader, args) if path == "c" else HandLoop(path, model_name, loader, args)


def timed_epoch(runner) -> tuple:
    """(seconds, mean loss, graphs dynamo compiled) of one epoch."""
    graphs_before = unique_graphs()
    start = time.perf_counter()
    loss = runner.run_epoch()
    return time.perf_counter() - start, loss, unique_graphs() - graphs_before


def stats_of(runner) -> Optional[dict]:
    stats = runner.train_loop.compile_stats if runner.path == "c" else None
    if stats is None:
        return None
    return {"compiles": stats.compiles, "recompiles": stats.recompiles, "compile_time_s": stats.compile_time_s,
            "after_warmup": len(stats.compiles_since(1))}


# --- first compile in a fresh process -------------------------------------------------------------------
def first_compile_child(model_name: str, path: str, args) -> dict:
    """In a fresh process with an empty cache: the warm-up epoch, then two steady epochs."""
    runner = make_runner(path, model_name, make_loader(model_name, args), args)
    warmup_s, _, warmup_graphs = timed_epoch(runner)
    steady = [timed_epoch(runner)[0] for _ in range(2)]
    return {"warmup_s": warmup_s, "steady_s": _common.median(steady), "graphs": warmup_graphs,
            "stats": stats_of(runner)}


def run_cold_child(model_name: str, path: str, args, cache_dir: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", model_name, path,
               "--threads", str(args.threads), "--seed", str(args.seed), "--backend", args.backend,
               "--batches", str(args.batches)] + (["--deterministic"] if args.deterministic else [])
    environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    if completed.returncode != 0:
        raise RuntimeError(f"the first-compile process for {model_name} {path} failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def pay_process_one_offs(args, cache_dir: str) -> None:
    """Compile a small training step and an optimizer step once, in a throwaway cache, and forget them.

    A process's first compilation also imports the compiler and starts inductor's worker processes; without
    this, the main process's first compiled loop would pay that alone and look slower to warm up than the next.
    """
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    model = nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LR))
    forward = torch.compile(model, **compile_kwargs(args))
    step = torch.compile(optimizer.step, **compile_kwargs(args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = forward(torch.randn(4, 8)).float().sum()
    loss.backward()
    step()
    torch._dynamo.reset()


# --- the benchmark of one model -------------------------------------------------------------------------
def benchmark_model(model_name: str, args, cache_dirs: Dict[str, str]) -> dict:
    """Warm-up epoch per runner, then ``repeats`` rounds of ``epochs`` epochs each, in rotating order."""
    loader = make_loader(model_name, args)
    paths = PATHS + tuple(args.variants)
    result = {"samples": len(loader.dataset), "batches": len(loader), "cold": {}}
    if not args.no_cold:
        for path in ("b", "c"):
            result["cold"][path] = run_cold_child(model_name, path, args, cache_dirs[path])
    runners = {path: make_runner(path, model_name, loader, args) for path in paths}
    warmup, losses = {}, {path: [] for path in paths}
    for path, runner in runners.items():
        # Read by inductor at every compile. The variants share b's (and compile the graphs they change).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs.get(path, cache_dirs["b"])
        seconds, loss, graphs = timed_epoch(runner)
        warmup[path] = {"seconds": seconds, "graphs": graphs}
        losses[path].append(loss)
    result["compiled_frames_b"] = runners["b"].compiled_frames()
    epoch_s = {path: [] for path in paths}
    round_rate = {path: [] for path in paths}
    late_graphs = dict.fromkeys(paths, 0)
    for round_index in range(args.repeats):
        shift = round_index % len(paths)
        order = paths[shift:] + paths[:shift]
        for path in order:
            seconds = []
            for _ in range(args.epochs):
                epoch_seconds, loss, graphs = timed_epoch(runners[path])
                seconds.append(epoch_seconds)
                late_graphs[path] += graphs
            losses[path].append(loss)
            epoch_s[path] += seconds
            round_rate[path].append(result["samples"] * args.epochs / sum(seconds))
    result.update(paths=paths, warmup=warmup, epoch_s=epoch_s, round_rate=round_rate, late_graphs=late_graphs,
                  losses={path: (values[0], values[-1]) for path, values in losses.items()},
                  stats=stats_of(runners["c"]), gradients=gradient_check(runners, loader))
    torch._dynamo.reset()  # this model's compiled code is not needed any more: keep dynamo's caches small
    return result


def gradient_check(runners: dict, loader: DataLoader) -> Dict[str, str]:
    """After the timed epochs: every loop computes the gradients of one full batch from loop a's weights.

    Returns, per loop, the parameters whose gradient is zero where the eager loop's is not (a compiled graph
    that computes wrong gradients), else how far the gradient norms are from the eager loop's (bfloat16 rounding;
    for the CNN also dropout masks, which compiled code draws differently).
    """
    inputs, labels = next(iter(loader))
    weights = runners["a"].model.state_dict()
    norms = {}
    for path, runner in runners.items():
        runner.model.load_state_dict(weights)
        runner.optimizer.zero_grad()
        forward = runner.model if path == "c" else runner.forward  # c: the model's compiled call, as get_loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(forward(inputs), labels)
        loss.backward()
        norms[path] = {name: 0.0 if param.grad is None else param.grad.norm().item()
                       for name, param in runner.model.named_parameters()}
    report = {"a": "(reference)"}
    for path in list(runners)[1:]:
        zero = [name for name, norm in norms[path].items() if norm == 0.0 and norms["a"][name] > 0.0]
        if zero:
            report[path] = f"ZERO for {len(zero)} of {len(norms['a'])} parameters: {', '.join(zero)}"
            continue
        worst = max(abs(norm - norms["a"][name]) / max(norms["a"][name], 1e-12) for name, norm in norms[path].items())
        report[path] = f"norms within {worst:.1%}"
    return report


# --- the report -----------------------------------------------------------------------------------------
def paired(result: dict, top: str, bottom: str) -> float:
    return _common.median([x / y for x, y in zip(result["round_rate"][top], result["round_rate"][bottom])])


def similar(loss: float, reference: float) -> bool:
    return abs(loss - reference) <= 0.05 + 0.1 * abs(reference)


def target_cell(model_name: str, c_over_a: float, c_over_b: float) -> str:
    cells = []
    if model_name in TARGETS_C_OVER_A:
        goal = TARGETS_C_OVER_A[model_name]
        cells.append(f"c/a >= {goal}: {'met' if c_over_a >= goal else 'MISSED'}")
    cells.append(f"c/b >= {TARGET_C_OVER_B}: {'met' if c_over_b >= TARGET_C_OVER_B else 'MISSED'}")
    return "; ".join(cells)


def speed_rows(results: Dict[str, dict]) -> List[List[str]]:
    rows = []
    for model_name, result in results.items():
        c_over_a, c_over_b = paired(result, "c", "a"), paired(result, "c", "b")
        for path in result["paths"]:
            recompiles = str(result["late_graphs"][path])
            if path == "c":
                recompiles += f" (compile_stats: {result['stats']['after_warmup']})"
            first, last = result["losses"][path]
            same = all(similar(loss, reference) for loss, reference in zip((first, last), result["losses"]["a"]))
            ratio_a = "1.000" if path == "a" else _common.fmt_ratio(paired(result, path, "a"))
            ratio_b = _common.fmt_ratio(paired(result, path, "b")) if path not in ("a", "b") else ""
            rows.append([model_name, PATH_NAMES[path], f"{_common.median(result['round_rate'][path]):.0f}",
                         ratio_a, ratio_b,
                         target_cell(model_name, c_over_a, c_over_b) if path == "c" else "", recompiles,
                         f"{first:.4f} / {last:.4f}" + ("" if same else " (DIFFERS from a)"),
                         result["gradients"][path]])
    return rows


SPEED_HEADERS = ["model", "loop", "samples/s (median)", "x a (median paired)", "x b (median paired)", "targets",
                 "graphs compiled after warm-up", "loss: warm-up / last epoch",
                 "gradients of one batch from a's weights, vs a"]


def compile_rows(results: Dict[str, dict]) -> List[List[str]]:
    rows = []
    for model_name, result in results.items():
        for path in PATHS:
            steady = _common.median(result["epoch_s"][path])
            warm = result["warmup"][path]
            cold = result["cold"].get(path)
            cold_cell = "" if cold is None else f"{cold['warmup_s'] - cold['steady_s']:.1f}"
            stats_cell = ""
            if path == "c":
                parts = [f"warm {result['stats']['compile_time_s']:.1f} s"]
                if cold is not None:
                    parts.insert(0, f"cold {cold['stats']['compile_time_s']:.1f} s, {cold['stats']['compiles']} "
                                    f"compiles ({cold['stats']['recompiles']} recompiles)")
                stats_cell = "; ".join(parts)
            rows.append([model_name, PATH_NAMES[path], f"{steady:.3f}", cold_cell,
                         f"{warm['seconds'] - steady:.1f}", str(warm["graphs"]), stats_cell])
    return rows


COMPILE_HEADERS = ["model", "loop", "steady epoch s (median)", "first compile s, cold cache (fresh process)",
                   "warm-up extra s, warm cache", "graphs compiled in warm-up", "c: tl.compile_stats.compile_time_s"]


def describe_models(args) -> str:
    parts = []
    for name in args.models:
        model = MODELS[name][0]()
        loader_batches = args.batches or MODELS[name][3]
        parts.append(f"{name} {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
                     f"parameters, batch {MODELS[name][2]}, {loader_batches} batches + 1 of {MODELS[name][2] // 2})")
    return "; ".join(parts)


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per runner in each round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (runner order rotating)")
    parser.add_argument("--batches", type=int, default=0,
                        help="full batches per epoch (0: the model's default: mlp 80, cnn 150, vit 12)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of b and c")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=[],
                        help="also time loop b with some of TrainLoop's choices: " + "; ".join(
                            f"{name}: {variant[0]}" for name, variant in VARIANTS.items()))
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) in every loop (inductor then keeps the native "
                             "max-pool backward: works around torch 2.13's zero gradients, see RESULTS.md)")
    parser.add_argument("--no-cold", action="store_true",
                        help="skip the first-compile measurement in fresh processes with empty caches")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the 'compile' section of benchmarks/RESULTS.md with this run")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("epochs", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batches < 0:
        parser.error(f"--batches must be >= 0 (0: the model's default), got {args.batches}")
    args.models = list(dict.fromkeys(args.models))
    return args


def main(argv: Optional[List[str]] = None) -> str:
    args = parse_args(argv)
    threads = _common.set_threads(args.threads)
    logging.getLogger("aitoolbox").setLevel(logging.WARNING)  # the epoch summary lines
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    if args.child:
        print(json.dumps(first_compile_child(*args.child, args)))
        return ""
    info = _common.machine_info(torch.device("cpu"))
    info["models"] = describe_models(args)
    info["settings"] = (f"bfloat16 autocast, AdamW(lr={LR}), 1 warm-up epoch per loop, then {args.repeats} rounds "
                        f"x {args.epochs} epochs per loop, threads={threads}, backend {args.backend}"
                        + (", torch.use_deterministic_algorithms(True)" if args.deterministic else ""))
    base = Path(tempfile.mkdtemp(prefix="aitoolbox-bench-compile-"))
    results = {}
    load_before = _common.load_average()
    try:
        pay_process_one_offs(args, str(base / "one-offs"))
        for model_name in args.models:
            cache_dirs = {path: str(base / f"{model_name}-{path}") for path in PATHS}
            if args.no_cold:
                cache_dirs = dict.fromkeys(PATHS, str(base / model_name))
            results[model_name] = benchmark_model(model_name, args, cache_dirs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info["load average (1 min) before / after"] = f"{load_before} / {_common.load_average()}"
    info["inductor caches"] = ("cold: a fresh process and an empty TORCHINDUCTOR_CACHE_DIR per model and loop; "
                               "warm: the main process, reusing that loop's cache" if not args.no_cold else
                               "one empty TORCHINDUCTOR_CACHE_DIR per model, shared by b and c (--no-cold)")
    info["b compiled (dynamo cache entries)"] = ", ".join(
        f"{name}: {'+'.join(result['compiled_frames_b']) or 'NOTHING'}" for name, result in results.items())
    text = "\n".join([f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "",
                      _common.markdown_table(SPEED_HEADERS, speed_rows(results)), "",
                      _common.markdown_table(COMPILE_HEADERS, compile_rows(results)), ""])
    print(text)
    if args.write_results:
        print(f"updated {_common.update_results_section('compile', text)}")
    return text


if __name__ == "__main__":
    main()
