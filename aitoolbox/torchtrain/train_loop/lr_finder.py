"""The learning-rate search of :meth:`TrainLoop.lr_find <aitoolbox.torchtrain.train_loop.TrainLoop.lr_find>`.

The search trains on the training loader for ``num_iterations`` optimizer steps while raising the learning rate
from ``start_lr`` to ``end_lr``, records each step's loss, and stops early when the smoothed loss blows up. Then the
run is put back exactly as it was (:class:`~.run_snapshot.RunSnapshot`, in a ``finally``: also after an exception
or Ctrl-C), so that a ``fit`` after the search is bitwise the ``fit`` without it.

What a search step runs is what a training step of ``fit`` runs: the batch's ``get_loss`` through the strategy's
model runner under the precision's autocast, and a :class:`~.step_runner.StepRunner` for backward, loss scaling,
the (compiled) optimizer step and ``zero_grad``; a step spans ``grad_accumulation`` batches (an epoch's last
window may be shorter, as in ``fit``). Every ``use_amp`` mode, ``torch_compile`` and DDP therefore train in the
search as they will train in ``fit``.

The callbacks do not run: a search is not training, and a logger, a checkpoint or early stopping must not record
it. The exception is gradient clipping (:class:`~aitoolbox.torchtrain.callbacks.gradient.GradientClipBase`, e.g.
``GradNormClip``): it changes every step, and a search without it would find the learning rate of another
optimizer. Its ``on_after_gradient_update`` runs exactly as in ``fit``.

In a distributed job every process searches together (DDP averages the gradients); each step's loss is averaged
over the processes before anything is decided, and the result is rank 0's, broadcast: every rank gets the same
suggestion.
"""
import logging
import math
from numbers import Real
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

from aitoolbox.torchtrain.callbacks.gradient import GradientClipBase
from aitoolbox.torchtrain.schedulers.basic import AbstractScheduler
from aitoolbox.torchtrain.train_loop import validation
from aitoolbox.torchtrain.train_loop.evaluation import loader_length
from aitoolbox.torchtrain.train_loop.losses import checked_batch_loss
from aitoolbox.torchtrain.train_loop.lr_suggestion import SUGGESTION_RULES, LRFinderResult, MovingAverage, make_result
from aitoolbox.torchtrain.train_loop.module_modes import modes_restored
from aitoolbox.torchtrain.train_loop.progress import ProgressBar
from aitoolbox.torchtrain.train_loop.run_snapshot import RunSnapshot
from aitoolbox.torchtrain.train_loop.step_runner import StepRunner

if TYPE_CHECKING:  # pragma: no cover
    from aitoolbox.torchtrain.train_loop.train_loop import TrainLoop

logger = logging.getLogger(__name__)

LR_MODES = ("exponential", "linear")


def check_lr_find_arguments(start_lr: Any, end_lr: Any, num_iterations: Any, mode: Any, smoothing: Any,
                            divergence_threshold: Any, suggestion: Any) -> None:
    """Refuse bad arguments before anything is set up, naming the value and what is valid."""
    for name, value in (("start_lr", start_lr), ("end_lr", end_lr)):
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if start_lr >= end_lr:
        raise ValueError(f"start_lr must be smaller than end_lr (the search raises the learning rate from one to the "
                         f"other), got start_lr={start_lr!r}, end_lr={end_lr!r}")
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 2:
        raise ValueError(f"num_iterations must be an int >= 2 (optimizer steps of the search), got {num_iterations!r}")
    if mode not in LR_MODES:
        raise ValueError(f"mode must be one of {list(LR_MODES)}, got {mode!r}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, Real) or not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be a number in (0, 1], the weight of each new loss in the moving average "
                         f"(1: no smoothing), got {smoothing!r}")
    if isinstance(divergence_threshold, bool) or not isinstance(divergence_threshold, Real) \
            or not divergence_threshold > 1:
        raise ValueError(f"divergence_threshold must be a number > 1 (the search stops when the smoothed loss exceeds "
                         f"this many times its lowest value), got {divergence_threshold!r}")
    if suggestion not in SUGGESTION_RULES:
        raise ValueError(f"suggestion must be one of {list(SUGGESTION_RULES)}, got {suggestion!r}")


def lr_schedule(start_lr: float, end_lr: float, num_iterations: int, mode: str) -> List[float]:
    """The learning rate of each step: from ``start_lr`` at step 0 to ``end_lr`` at the last step, by a constant
    factor per step (``'exponential'``) or a constant increment (``'linear'``)."""
    last = num_iterations - 1
    if mode == "exponential":
        return [start_lr * (end_lr / start_lr) ** (step / last) for step in range(num_iterations)]
    return [start_lr + (end_lr - start_lr) * step / last for step in range(num_iterations)]


class SearchHooks:
    """The callbacks handler a search step runs with: only the registered gradient clipping callbacks, called as
    the loop's handler calls them (see the module's description for why)."""

    def __init__(self, callbacks: List[Any]):
        self.clipping = [callback for callback in callbacks if isinstance(callback, GradientClipBase)]
        self.has_batch_hooks = bool(self.clipping)

    def on_after_gradient_update(self, optimizer_idx: int, done: Optional[List[int]] = None) -> None:
        # ``done``: the handler's record of the callbacks finished (the search is never continued: not needed).
        for callback in self.clipping:
            callback.on_after_gradient_update(optimizer_idx)

    def on_after_optimizer_step(self, done: Optional[List[int]] = None) -> None:
        """Nothing: what runs after a step (schedulers, loggers) must not see the search."""


class LRSearch:
    """One search over ``tl``'s training loader (see the module's description); :meth:`run` returns the raw curve.

    Args:
        tl: the loop, set up.
        lrs: the learning rate of the first parameter group at each step.
        smoothing, divergence_threshold: as in ``lr_find``.
        grad_accumulation: batches per optimizer step.
        bar: advanced at each step.
    """

    def __init__(self, tl: "TrainLoop", lrs: List[float], smoothing: float, divergence_threshold: float,
                 grad_accumulation: int, bar: ProgressBar):
        self.tl = tl
        self.lrs = lrs
        self.smoothing = smoothing
        self.divergence_threshold = divergence_threshold
        self.grad_accumulation = grad_accumulation
        self.bar = bar
        # Every group of every optimizer follows the first group's learning rate, keeping its ratio to it.
        reference = _lr_value(tl.optimizers[0].param_groups[0]["lr"])
        if reference <= 0:
            raise ValueError(f"the first parameter group's learning rate is {reference}: the search keeps the ratio "
                             "of every group's learning rate to it, so it must be > 0")
        self.ratios = [[_lr_value(group["lr"]) / reference for group in optimizer.param_groups]
                       for optimizer in tl.optimizers]
        self.runner = StepRunner(
            tl.precision, tl.optimizers, tl.optimizer, SearchHooks(tl.callbacks), tl.state,
            backwards_first=tl.strategy.is_distributed or tl._compiler is not None,
            sync_skipped_gradients=tl.strategy.sync_skipped_gradients,
            batch_done=_nothing, amp_scaler=tl.amp_scaler)
        self._window: List[torch.Tensor] = []

    def run(self) -> Tuple[List[float], List[float], bool]:
        """Train with the rising learning rates; returns ``(lrs, raw losses, diverged)`` of the steps recorded."""
        state = self.tl.state
        state.grad_accumulation = self.grad_accumulation
        recorded_lrs: List[float] = []
        raw: List[float] = []
        average = MovingAverage(self.smoothing)
        best, first = math.inf, None
        self.runner.start()
        self._set_lr(self.lrs[0])
        for step_ended in self._batches():
            if not step_ended:
                continue
            loss = self._step_loss()
            if not math.isfinite(loss):
                return recorded_lrs, raw, True
            self.bar.update()
            step = len(raw)
            recorded_lrs.append(self.lrs[step])
            raw.append(loss)
            smoothed = average.add(loss)
            first = smoothed if first is None else first
            best = min(best, smoothed)
            if step > 0 and diverged(smoothed, best, first, self.divergence_threshold):
                return recorded_lrs, raw, True
            if len(raw) == len(self.lrs):
                return recorded_lrs, raw, False
            self._set_lr(self.lrs[len(raw)])
        raise AssertionError("unreachable: _batches wraps around the loader")  # pragma: no cover

    def _batches(self) -> Iterator[bool]:
        """Train batch after batch, passing over the loader again when it ends; yields after each batch whether it
        ended an optimizer step. Windows end every ``grad_accumulation`` batches and at the end of a pass, as in
        ``fit``."""
        tl, state = self.tl, self.tl.state
        num_batches = loader_length(tl.train_loader)
        while True:
            trained = 0
            for state.iteration, batch in enumerate(tl.train_loader):
                step_due = state.iteration + 1 == num_batches or (state.iteration + 1) % self.grad_accumulation == 0
                self._train_batch(batch, step_due)
                trained += 1
                yield step_due
            if trained == 0:
                raise ValueError("train_loader yielded no batches: the LR search needs at least one batch")
            if num_batches is None and self.runner.step_pending_gradients():  # a loader without len ended a window
                yield True

    def _train_batch(self, batch: Any, step_due: bool) -> None:
        """What ``TrainLoop._run_batch`` does for a batch, without the callbacks and the run's progress."""
        tl = self.tl
        compiler = tl._compiler
        if compiler is not None and compiler.verification_due:
            tl._verify_compiled_gradients(batch)
        tl.state.optimizer_step_due = step_due
        with tl.strategy.skip_gradient_sync(accumulating=not step_due):
            with tl.precision.autocast():
                loss = tl.model_runner.get_loss(batch, tl.criterion, tl.device)
            values, names = checked_batch_loss(loss)
            self._window.append(values.sum() if names is not None else values)
            self.runner.backward_and_step(loss, names, step_due)
        tl.state.optimizer_step_due = False

    def _step_loss(self) -> float:
        """The mean loss of the step's window, averaged over the processes: one host synchronisation per step (the
        stop rule needs the value)."""
        window, self._window = self._window, []
        mean = torch.stack([value.float() for value in window]).mean()
        strategy = self.tl.strategy
        if strategy.world_size > 1:
            mean = strategy.all_reduce_sum(mean) / strategy.world_size
        return mean.item()

    def _set_lr(self, lr: float) -> None:
        for optimizer, ratios in zip(self.tl.optimizers, self.ratios):
            for group, ratio in zip(optimizer.param_groups, ratios):
                _assign_lr(group, lr * ratio)


def diverged(smoothed: float, best: float, first: float, threshold: float) -> bool:
    """The search's stop rule: the smoothed loss exceeds ``threshold`` times its lowest value, i.e. it rose above
    the lowest by ``threshold - 1`` times the lowest. A lowest value at or below 0 (a negative log-likelihood) has no
    such multiple: there the rise is measured in units of the larger of its size and how far the loss fell from its
    first value (so a loss that starts negative is not stopped at its second step)."""
    if best > 0:
        return smoothed > threshold * best
    return smoothed - best > (threshold - 1) * max(abs(best), first - best)


FSDP_REFUSAL = ("lr_find cannot run under gpu_mode='fsdp': it keeps the whole run in memory to put it back after the "
                "search, and each FSDP process holds only its shards. Search with the same model under "
                "gpu_mode='ddp' (or 'single' with the per-process batch size times the number of processes, if it "
                "fits on one device) and give the learning rate it finds to the FSDP run.")


def join_distributed_job(tl: "TrainLoop", distributed_kwargs: dict) -> None:
    """Under ``gpu_mode='ddp'`` in a torchrun / SLURM / OpenMPI process that is not a rank yet, join the job (as
    ``fit_distributed`` would) so that the search runs in every process together.

    Raises:
        TypeError: keyword arguments outside a joining search, or ones ``fit_distributed`` does not take.
        ValueError: ``gpu_mode='fsdp'``, or ``'ddp'`` outside a distributed job.
    """
    from aitoolbox.torchtrain.train_loop.distributed_fit import DistributedFitOptions, join_external_job
    if tl.gpu_mode == "fsdp" or tl.strategy.shards_parameters:
        raise ValueError(FSDP_REFUSAL)
    if tl.gpu_mode != "ddp" or tl.strategy.is_distributed:
        if distributed_kwargs:
            raise TypeError(f"lr_find got unexpected keyword argument(s) {sorted(distributed_kwargs)}: only a search "
                            "that joins a distributed job (gpu_mode='ddp' under torchrun, before the first fit) takes "
                            "fit_distributed's set-up arguments")
        return
    own = sorted(set(distributed_kwargs) & {"num_epochs", "num_iterations", "shard_parameters"})
    if own:
        raise TypeError(f"lr_find does not take {own}: the search's length is num_iterations (optimizer steps)")
    try:  # the job's set-up only: a length to train (which validate() requires) is not used
        options = DistributedFitOptions(num_iterations=1, **distributed_kwargs)
    except TypeError as error:
        raise TypeError(f"lr_find's extra keyword arguments are fit_distributed's set-up arguments: {error}") from None
    if not join_external_job(tl, options):
        raise ValueError("lr_find with gpu_mode='ddp' runs in the processes of a distributed job, all searching "
                         "together: start the script with torchrun (or SLURM / OpenMPI) and call lr_find, then fit, in "
                         "every process. fit_distributed's own launcher cannot run a search; for a search in this "
                         "process, build the TrainLoop with gpu_mode='single'.")


def find_lr(tl: "TrainLoop", start_lr: float = 1e-7, end_lr: float = 10.0, num_iterations: int = 100,
            mode: str = "exponential", smoothing: float = 0.05, divergence_threshold: float = 4.0,
            suggestion: str = "valley", apply: bool = False, grad_accumulation: int = 1,
            callbacks: Optional[List[Any]] = None, distributed_kwargs: Optional[dict] = None) -> LRFinderResult:
    """See :meth:`TrainLoop.lr_find`."""
    check_lr_find_arguments(start_lr, end_lr, num_iterations, mode, smoothing, divergence_threshold, suggestion)
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ValueError(f"grad_accumulation must be an int >= 1, got {grad_accumulation!r}")
    if not isinstance(apply, bool):
        raise TypeError(f"apply must be True or False, got {apply!r}")
    validation.check_ready_to_train(tl.train_loader, tl.optimizers)
    join_distributed_job(tl, distributed_kwargs or {})
    if callbacks:
        tl.callbacks_handler.register_callbacks(callbacks)
    lrs = lr_schedule(float(start_lr), float(end_lr), num_iterations, mode)
    snapshot = RunSnapshot.take(tl, mid_epoch=False)  # sets tl up, as fit would
    wrapper = getattr(tl.model_runner, "wrapper", None)  # DDP's module: its own train/eval flag
    modules = [module for module in (tl.model, wrapper) if isinstance(module, nn.Module)]
    bar = ProgressBar(num_iterations, "LR search", enabled=tl.show_progress, leave=False)
    try:
        with modes_restored(*modules), torch.enable_grad(), tl._compile_recording:
            tl.frozen_modules.enter_training(tl.model, tl.model_runner)
            search = LRSearch(tl, lrs, float(smoothing), float(divergence_threshold), grad_accumulation, bar)
            recorded_lrs, raw, diverged = search.run()
    finally:
        bar.close()
        tl.precision.reset()  # the last step may be half done (an exception): forget what it unscaled
        tl.precision.zero_grad(tl.optimizers)
        snapshot.restore(tl)
    result = make_result(recorded_lrs, raw, float(smoothing), suggestion, diverged, num_iterations)
    result = tl.strategy.broadcast_object(result)  # decided once: every rank gets rank 0's
    if tl.strategy.is_main_process:
        logger.info("LR search: %d step(s) from %.3g to %.3g%s; suggestion (%s): %s", len(result.lrs), lrs[0],
                    result.lrs[-1] if result.lrs else lrs[0], ", stopped as the loss diverged" if diverged else "",
                    suggestion, "none" if result.suggestion is None else f"{result.suggestion:.3g}")
    if apply:
        if result.suggestion is None:
            logger.warning("lr_find(apply=True): no suggestion, the learning rates are left as they were")
        else:
            apply_learning_rate(tl, result.suggestion)
    return result


def apply_learning_rate(tl: "TrainLoop", lr: float) -> None:
    """Make ``lr`` the first parameter group's learning rate; every other group (of every optimizer) keeps its
    ratio to the first one.

    An LR scheduler callback registered for an optimizer computes its rates from base learning rates: those become
    the new ones, and the current learning rate keeps its place in the schedule (a warm-up at 10 % stays at 10 %).
    A cyclic schedule (``OneCycleLR``, ``CyclicLR``) peaks at ``max_lr``, which is what a search finds (the largest
    rate that still trains well): the peak becomes the suggestion, per group with the groups' ratio, and every rate of
    the schedule (its start, floor and the current rate) moves with it, so the cycle keeps its shape.
    """
    schedulers = _registered_torch_schedulers(tl)
    references = [_reference_lrs(optimizer, schedulers) for optimizer in tl.optimizers]
    reference = references[0][0]
    if reference <= 0:
        raise ValueError(f"the first parameter group's learning rate is {reference}: the other groups' ratio to it "
                         "is undefined")
    for optimizer, optimizer_references in zip(tl.optimizers, references):
        # The new reference rate per group, computed as a fit given it would: lr itself for the first group (not
        # old * (lr / old), an ulp off), lr times the group's ratio for the others.
        targets = [lr * (value / reference) for value in optimizer_references]
        driving = [scheduler for scheduler in schedulers if scheduler.optimizer is optimizer]
        for group_idx, (group, value, target) in enumerate(zip(optimizer.param_groups, optimizer_references,
                                                               targets)):
            _assign_lr(group, _moved(_lr_value(group["lr"]), value, target))
            for key in ("initial_lr", "max_lr", "min_lr"):  # where torch schedulers start from, peak and end
                if key in group:
                    group[key] = _moved(group[key], value, target)
            for scheduler in driving:
                for name in ("base_lrs", "max_lrs"):
                    values = getattr(scheduler, name, None)
                    if isinstance(values, list) and len(values) == len(optimizer.param_groups):
                        values[group_idx] = _moved(values[group_idx], value, target)


def _moved(rate: float, reference: float, target: float) -> float:
    """``rate`` moved with its group's reference rate from ``reference`` to ``target``: exactly ``target`` where it
    is the reference (the peak or base rate the suggestion stands for), else scaled by the same factor."""
    if rate == reference:
        return target
    return rate * (target / reference) if reference > 0 else rate


def _registered_torch_schedulers(tl: "TrainLoop") -> List[Any]:
    schedulers = []
    for callback in tl.callbacks:
        if isinstance(callback, AbstractScheduler):
            driven = getattr(callback, "schedulers", None)
            if driven is None:
                driven = [callback.scheduler] if callback.scheduler is not None else []
            schedulers.extend(s for s in _leaf_schedulers(driven)
                              if hasattr(s, "base_lrs") and hasattr(s, "optimizer"))
    return schedulers


def _leaf_schedulers(schedulers: List[Any]) -> List[Any]:
    """``SequentialLR`` and ``ChainedScheduler`` have no base rates of their own: the schedulers they run do, and
    those are what the suggestion must move (else it replaced a warm-up's current rate and the schedule multiplied
    up from there)."""
    leaves = []
    for scheduler in schedulers:
        inner = getattr(scheduler, "_schedulers", None)
        if isinstance(inner, (list, tuple)) and not hasattr(scheduler, "base_lrs"):
            leaves.extend(_leaf_schedulers(list(inner)))
        else:
            leaves.append(scheduler)
    return leaves


def _reference_lrs(optimizer: torch.optim.Optimizer, schedulers: List[Any]) -> List[float]:
    """The rates of ``optimizer``'s groups the suggestion stands for: a cyclic schedule's peaks (``CyclicLR``'s
    ``max_lrs``, ``OneCycleLR``'s groups' ``max_lr``), else a scheduler's base rates, else the groups' rates."""
    groups = optimizer.param_groups
    for scheduler in schedulers:
        if scheduler.optimizer is not optimizer:
            continue
        peaks = getattr(scheduler, "max_lrs", None)
        if isinstance(peaks, list) and len(peaks) == len(groups):
            return [float(peak) for peak in peaks]
        if all("max_lr" in group for group in groups):
            return [float(group["max_lr"]) for group in groups]
        if len(scheduler.base_lrs) == len(groups):
            return [float(base) for base in scheduler.base_lrs]
    return [_lr_value(group["lr"]) for group in groups]


def _lr_value(lr: Any) -> float:
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _assign_lr(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):  # a tensor learning rate (for a compiled step) stays that tensor
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _nothing() -> None:
    """A search step is no progress of the run: nothing to mark."""
