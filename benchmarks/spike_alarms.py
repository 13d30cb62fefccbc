"""SpikeRollback's alarms on healthy runs (must be none) and on injected spikes (must be caught).

Twelve healthy training configurations, each run with ``SpikeRollback()`` at its defaults: a CNN (the digits CNN
of ``examples/quickstart.py``, as the quickstart trains it at batch size 32 for 15 epochs, and at batch size 8),
an MLP, a small transformer, a Gaussian negative log-likelihood whose loss is negative for most of the run, and a
mean-squared error in the target's own units (thousands); batch sizes 8 to 128; Adam, AdamW and SGD; with and
without learning-rate schedules (per epoch and per step, warm-up, one-cycle, cosine). Every data set ships with
scikit-learn or is drawn from a seeded generator: nothing is downloaded.

Each configuration runs twice:

* **healthy**: no batch is touched. Any rollback is a false alarm (each also drops a clean batch). The table also
  counts how many of the same batch losses the rule of aitoolbox before issue 34 (``factor=4``: a loss above four
  times the median of the window) flags, judged offline over the recorded losses.
* **injected**: six batches spread over the run (after the warm-up) are poisoned: five get a loss of ten times the
  run's level (``m + 9 |m|``, ``m`` the median of the last 100 losses: x10 for a positive loss; the gradient is
  scaled by the same ratio where the loss is positive), one a NaN loss. A poisoned batch is *caught* when a
  rollback leaves it out; a rollback of another batch is a false alarm.

Run:  python benchmarks/spike_alarms.py                 (about 5 minutes on 2 idle cores)
      python benchmarks/spike_alarms.py --quick         (smoke test: 2 configurations, a few epochs)
      python benchmarks/spike_alarms.py --record        (also writes the result into RESULTS.md)
"""
import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import _common  # noqa: E402
from quickstart import DigitsCNN, digits_loaders  # noqa: E402

from aitoolbox.torchtrain.callbacks import SpikeRollback  # noqa: E402
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback  # noqa: E402
from aitoolbox.torchtrain.callbacks.spike_rules import FactorRule, LossHistory, RobustRule, remember  # noqa: E402
from aitoolbox.torchtrain.model import TTModel  # noqa: E402
from aitoolbox.torchtrain.schedulers.basic import GeneralLRSchedulerCallback, StepLRScheduler  # noqa: E402
from aitoolbox.torchtrain.schedulers.warmup import CosineWithWarmupScheduler, LinearWithWarmupScheduler  # noqa: E402
from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

SECTION = "spike-alarms"
INJECTED_SPIKES = 5  # x10 losses per injected run, plus one NaN
SPIKE_FACTOR = 10.0


# --- data and models -------------------------------------------------------------------------------------------
def digits_tensors(seed: int):
    """The quickstart's training digits as (images, labels)."""
    train_loader, _, _ = digits_loaders(32, seed)
    return train_loader.dataset.tensors


class FlatMLP(TTModel):
    """An MLP over the 64 pixels of a digit."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64),
                                 nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images):
        return self.net(images)

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


class RowTransformer(TTModel):
    """A small transformer encoder reading a digit as a sequence of its 8 rows (8 tokens of 8 pixels)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(1, 8, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, images):
        tokens = self.embed(images.reshape(-1, 8, 8)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


class GaussianMLP(TTModel):
    """Predicts a mean and a variance; trained with ``nn.GaussianNLLLoss``, whose loss goes negative once the
    predicted variance is small."""

    def __init__(self, in_features: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 2))

    def forward(self, x):
        out = self.net(x)
        return out[:, 0], nn.functional.softplus(out[:, 1]) + 1e-4

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        mean, variance = self(x.to(device))
        return criterion(mean, y.to(device), variance)

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device))[0].cpu(), y, None


class Regressor(TTModel):
    """An MLP regressing the diabetes progression score in its own units (mean squared error in the thousands)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).squeeze(1)

    def get_loss(self, batch_data, criterion, device):
        x, y = batch_data
        return criterion(self(x.to(device)), y.to(device))

    def get_predictions(self, batch_data, device):
        x, y = batch_data
        return self(x.to(device)).cpu(), y, None


def heteroscedastic_data(seed: int, num_samples: int = 3000):
    """``y = sin(2 x0) + x1 x2 / 2 + noise`` whose scale depends on ``x3`` (0.02 to 0.3)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(num_samples, 4, generator=generator) * 2 - 1
    scale = 0.02 + 0.28 * (x[:, 3] + 1) / 2
    y = torch.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] / 2 + scale * torch.randn(num_samples, generator=generator)
    return x, y


def diabetes_data():
    from sklearn.datasets import load_diabetes
    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(data.target, dtype=torch.float32)


DATA = {
    "digits": digits_tensors,
    "heteroscedastic": heteroscedastic_data,
    "diabetes": lambda seed: diabetes_data(),
}


# --- the configurations ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    name: str
    data: str
    model: Callable[[], TTModel]
    batch_size: int
    epochs: int
    optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]
    criterion: Callable[[], nn.Module]
    schedule: Optional[Callable[[int], AbstractCallback]] = None  # fn(total optimizer steps)
    use_amp: bool = False
    description: str = ""


def one_cycle(max_lr: float):
    return lambda steps: GeneralLRSchedulerCallback(torch.optim.lr_scheduler.OneCycleLR, max_lr=max_lr,
                                                   total_steps=steps, step_per_optimizer_step=True)


CONFIGS = [
    Config("quickstart CNN b32", "digits", DigitsCNN, 32, 15, lambda p: torch.optim.Adam(p, lr=2e-3),
           nn.CrossEntropyLoss, use_amp=True, description="examples/quickstart.py as it trains (Adam 2e-3, "
           "use_amp=True), 15 epochs"),
    Config("quickstart CNN b8", "digits", DigitsCNN, 8, 15, lambda p: torch.optim.Adam(p, lr=2e-3),
           nn.CrossEntropyLoss, use_amp=True, description="the same at batch size 8"),
    Config("CNN b16 SGD StepLR", "digits", DigitsCNN, 16, 15,
           lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), nn.CrossEntropyLoss,
           schedule=lambda steps: StepLRScheduler(step_size=5, gamma=0.3), description="SGD 0.05, x0.3 every 5 "
           "epochs"),
    Config("CNN b128 Adam one-cycle", "digits", DigitsCNN, 128, 40, lambda p: torch.optim.Adam(p, lr=1e-3),
           nn.CrossEntropyLoss, schedule=one_cycle(5e-3), description="OneCycleLR to 5e-3, per step"),
    Config("CNN b8 SGD", "digits", DigitsCNN, 8, 10, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
           nn.CrossEntropyLoss, description="SGD 0.01, no schedule"),
    Config("MLP b8 SGD", "digits", FlatMLP, 8, 15, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
           nn.CrossEntropyLoss, description="SGD 0.02, no schedule"),
    Config("MLP b64 Adam cosine", "digits", FlatMLP, 64, 40, lambda p: torch.optim.Adam(p, lr=3e-3),
           nn.CrossEntropyLoss, schedule=lambda steps: CosineWithWarmupScheduler(steps // 10, steps),
           description="cosine decay after a 10 % warm-up, per step"),
    Config("transformer b16 AdamW warm-up", "digits", RowTransformer, 16, 20,
           lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01), nn.CrossEntropyLoss,
           schedule=lambda steps: LinearWithWarmupScheduler(steps // 20, steps),
           description="linear decay after a 5 % warm-up, per step"),
    Config("transformer b64 Adam", "digits", RowTransformer, 64, 40, lambda p: torch.optim.Adam(p, lr=2e-3),
           nn.CrossEntropyLoss, description="no schedule"),
    Config("Gaussian NLL b16 Adam", "heteroscedastic", GaussianMLP, 16, 20, lambda p: torch.optim.Adam(p, lr=2e-3),
           nn.GaussianNLLLoss, description="negative loss for most of the run"),
    Config("Gaussian NLL b64 SGD StepLR", "heteroscedastic", GaussianMLP, 64, 40,
           lambda p: torch.optim.SGD(p, lr=0.005, momentum=0.9), nn.GaussianNLLLoss,
           schedule=lambda steps: StepLRScheduler(step_size=15, gamma=0.3), description="negative loss; x0.3 every "
           "15 epochs"),
    Config("MSE b32 Adam (diabetes)", "diabetes", Regressor, 32, 60, lambda p: torch.optim.Adam(p, lr=1e-2),
           nn.MSELoss, description="target in its own units: loss from 25,000 to 2,500"),
]


# --- the runs --------------------------------------------------------------------------------------------------
class Injector(AbstractCallback):
    """Poisons the batches at planned ``(epoch, loader position)`` places and records every batch's loss.

    Runs first (before SpikeRollback); the criterion (:class:`PoisonableLoss`) reads :attr:`target` while the batch
    runs. A rollback leaves the poisoned batch out, so it is not poisoned twice.
    """

    def __init__(self, planned: Dict[tuple, str]):
        super().__init__("inject spikes", execution_order=-1000)
        self.planned = planned  # (epoch, position) -> "x10" or "nan"
        self.target: Optional[float] = None
        self.losses: List[float] = []  # every trained batch's loss, in order (replays included)
        self.injected: Dict[tuple, tuple] = {}  # (epoch, position) -> (kind, target loss, batch index in the run)

    def on_batch_begin(self):
        tl = self.train_loop_obj
        position = tl.run_state.rollbacks.loader_position(tl.epoch, tl.iteration)
        kind = self.planned.get((tl.epoch, position))
        self.target = None
        if kind is not None:
            recent = self.losses[-100:]
            level = statistics.median(recent) if recent else 1.0
            self.target = float("nan") if kind == "nan" else level + (SPIKE_FACTOR - 1) * abs(level)
            self.injected[(tl.epoch, position)] = (kind, self.target, len(self.losses))

    def on_batch_end(self):
        self.losses.append(float(self.train_loop_obj.last_batch_loss.float().sum()))
        self.target = None


class PoisonableLoss(nn.Module):
    """The configuration's criterion; while :attr:`injector` poisons a batch, the loss becomes its target."""

    def __init__(self, criterion: nn.Module, injector: Injector):
        super().__init__()
        self.criterion, self.injector = criterion, injector

    def forward(self, *args):
        loss = self.criterion(*args)
        target = self.injector.target
        if target is None:
            return loss
        if math.isnan(target):
            return loss * float("nan")
        natural = loss.detach()
        if natural > 0 and target > 0:
            return loss * (target / natural)  # the gradient grows with the loss
        return loss + (target - natural)


def plan_spikes(batches_per_epoch: int, epochs: int, start: int, seed: int) -> Dict[tuple, str]:
    """Six places after ``start`` batches, one in each sixth of the rest (the NaN in the fourth)."""
    total = batches_per_epoch * epochs
    generator = random.Random(seed)
    edges = [start + (total - start) * part // 6 for part in range(7)]
    places = {}
    for part in range(6):
        step = generator.randrange(edges[part], max(edges[part] + 1, edges[part + 1] - 1))
        places[divmod(step, batches_per_epoch)] = "nan" if part == 3 else "x10"
    return places


def run(config: Config, seed: int, planned: Dict[tuple, str], epochs: Optional[int] = None) -> dict:
    """One training of ``config`` with ``SpikeRollback()`` at its defaults (``max_rollbacks`` raised, so that every
    alarm is seen); the spikes ``planned`` are injected."""
    torch.manual_seed(seed)
    x, y = DATA[config.data](seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=config.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    model = config.model()
    injector = Injector(planned)
    epochs = epochs or config.epochs
    tl = TrainLoop(model, loader, None, None, config.optimizer(model.parameters()),
                   PoisonableLoss(config.criterion(), injector), end_auto_eval=False, show_progress=False,
                   use_amp=config.use_amp)
    callbacks = [injector, SpikeRollback(max_rollbacks=1000)]
    if config.schedule is not None:
        callbacks.append(config.schedule(len(loader) * epochs))
    start = time.perf_counter()
    tl.fit(num_epochs=epochs, callbacks=callbacks)
    skipped = {(epoch, position) for epoch, positions in tl.run_state.rollbacks.skipped.items()
               for position in positions}
    return {"losses": injector.losses, "seconds": time.perf_counter() - start, "skipped": skipped,
            "injected": injector.injected, "rollbacks": len(tl.rollbacks), "batches": len(loader)}


def offline_alarms(rule, losses: List[float], window: int = 100, warmup: int = 50, interval: int = 100):
    """How many of ``losses`` ``rule`` flags when judged as SpikeRollback judges them (intervals of ``interval``
    losses; a flagged loss is left out and judging goes on after it, as after a rollback), and the largest ratio of a
    clean loss's rise above its centre to the rise that would have made it a spike (< 1: no alarm; the headroom)."""
    values = torch.tensor(losses, dtype=torch.float64)
    history = LossHistory(values[:0], values[:0])
    alarms, worst, start = 0, 0.0, 0
    while start < len(values):
        chunk = values[start:start + interval]
        judgement = rule.judge(history, chunk, window, warmup)
        flagged = judgement.flags.nonzero()
        end = int(flagged[0]) if flagged.numel() else len(chunk)
        margins = (judgement.limits - judgement.centres)[:end]
        judged = torch.isfinite(margins) & (margins > 0)
        if judged.any():
            worst = max(worst, float((judgement.rises[:end][judged] / margins[judged]).max()))
        clean = dataclasses.replace(judgement, rises=judgement.rises[:end],
                                    scales=None if judgement.scales is None else judgement.scales[:end])
        history = remember(history, chunk[:end], clean, window, warmup, getattr(rule, "memory", 0))
        alarms += 1 if flagged.numel() else 0
        start += end + (1 if flagged.numel() else 0)
    return alarms, worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None, help="run the configurations whose name contains this text")
    parser.add_argument("--quick", action="store_true", help="a smoke test: two configurations, 3 epochs each")
    parser.add_argument("--save-losses", default=None, help="write the healthy runs' batch losses to this JSON file")
    parser.add_argument("--record", action="store_true", help=f"write the result into RESULTS.md ({SECTION})")
    args = parser.parse_args(argv)
    _common.set_threads(args.threads)
    configs = [config for config in CONFIGS if args.only is None or args.only.lower() in config.name.lower()]
    if args.quick:
        configs = configs[:2]
    rows, healthy_losses = [], {}
    totals = dict.fromkeys(("false", "old", "caught", "x10", "beyond", "beyond_caught", "nan_caught", "nan",
                            "injected_false"), 0)
    with _common.stderr_to_devnull():
        for index, config in enumerate(configs):
            epochs = 3 if args.quick else config.epochs
            seed = args.seed + index
            healthy = run(config, seed, {}, epochs)
            losses = healthy_losses[config.name] = healthy["losses"]
            injected = run(config, seed, plan_spikes(healthy["batches"], epochs, 100, seed), epochs)
            caught = {place for place in injected["injected"] if place in injected["skipped"]}
            x10 = {place: info for place, info in injected["injected"].items() if info[0] == "x10"}
            nans = [place for place, info in injected["injected"].items() if info[0] == "nan"]
            # A x10 loss is beyond the healthy range when no healthy batch within 200 of it reached its loss.
            beyond = [(epoch, position) for (epoch, position), (_, target, _) in x10.items()
                      if target > max(losses[max(0, epoch * healthy["batches"] + position - 200):
                                             epoch * healthy["batches"] + position + 200])]
            old_alarms, _ = offline_alarms(FactorRule(4.0), losses)
            _, headroom = offline_alarms(RobustRule(), losses)
            counts = dict(false=healthy["rollbacks"], old=old_alarms, x10=len(x10),
                          caught=sum(place in caught for place in x10), beyond=len(beyond),
                          beyond_caught=sum(place in caught for place in beyond), nan=len(nans),
                          nan_caught=sum(place in caught for place in nans),
                          injected_false=len(injected["skipped"] - set(injected["injected"])))
            for name, value in counts.items():
                totals[name] += value
            tail = losses[len(losses) * 9 // 10:]
            rows.append([config.name, str(config.batch_size), str(len(losses)), config.description,
                         f"{losses[0]:.3g} -> {statistics.median(tail):.3g}", str(counts["false"]),
                         f"{headroom:.2f}", str(old_alarms), f"{counts['caught']}/{counts['x10']}",
                         f"{counts['beyond_caught']}/{counts['beyond']}", f"{counts['nan_caught']}/{counts['nan']}",
                         str(counts["injected_false"]), f"{healthy['seconds'] + injected['seconds']:.0f}"])
            print(f"{config.name}: {counts['false']} false alarm(s), x10 caught {rows[-1][8]} ({rows[-1][9]} beyond "
                  f"the healthy range), NaN {rows[-1][10]}", file=sys.__stdout__, flush=True)
    if args.save_losses:
        Path(args.save_losses).write_text(json.dumps(healthy_losses))
    info = dict(_common.machine_info(torch.device("cpu")), seed=str(args.seed))
    table = _common.markdown_table(
        ["configuration", "batch", "batches", "settings", "loss (first -> median of the last 10 %)",
         "rollbacks, healthy run", "headroom (largest rise / its limit)", "alarms of factor=4 (earlier rule)",
         "x10 caught", "x10 beyond the healthy range caught", "NaN caught", "false alarms, injected run", "s"],
        rows)

    def rate(part: int, whole: int) -> str:
        return f"{part} of {whole} ({part / whole:.0%})" if whole else "none"

    body = "\n".join([
        f"Command: `{_common.command_line()}`", "", _common.info_lines(info), "",
        "SpikeRollback() at its defaults in every run (max_rollbacks raised to see every alarm). Headroom: the largest "
        "ratio of a healthy loss's rise above its window's median to the rise that would have made it a spike, judged "
        "offline over the healthy run's losses (1 would be an alarm). The earlier rule's alarms are counted the same "
        "way. A x10 loss is *beyond the healthy range* when no healthy batch within 200 batches of it reached it.", "",
        table, "",
        f"- false alarms in {len(configs)} healthy runs: {totals['false']} "
        f"({sum(len(losses) for losses in healthy_losses.values())} batches); the earlier rule (factor=4): "
        f"{totals['old']}",
        f"- false alarms in the injected runs: {totals['injected_false']}",
        f"- x10 losses caught: {rate(totals['caught'], totals['x10'])}; of those beyond the healthy range: "
        f"{rate(totals['beyond_caught'], totals['beyond'])}; NaN losses caught: {rate(totals['nan_caught'], totals['nan'])}"])
    print(body)
    if args.record:
        _common.update_results_section(SECTION, body)


if __name__ == "__main__":
    main()
