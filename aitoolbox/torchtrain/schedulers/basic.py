"""Learning-rate scheduler callbacks over ``torch.optim.lr_scheduler``, stepped per epoch or per optimizer step.

Every scheduler callback is an :class:`AbstractScheduler`: ``TrainLoop.get_schedulers()`` returns them and
checkpoints hold their ``state_dict()``.
"""
import inspect
import logging
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LambdaLR, MultiStepLR, ReduceLROnPlateau, StepLR

from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.multi_loss_optim import MultiLoss

logger = logging.getLogger(__name__)


def _check_scheduler_arguments(scheduler_class: Any, kwargs: dict) -> None:
    """Fail at construction, not at registration, on keyword arguments the scheduler class cannot take."""
    try:
        parameters = list(inspect.signature(scheduler_class).parameters.values())[1:]  # [0] is the optimizer
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    accepted = {p.name for p in parameters}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(f"{scheduler_class.__name__} does not accept keyword argument(s) {unknown}; "
                        f"it accepts: {sorted(accepted)}")
    missing = [p.name for p in parameters if p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
               and p.name not in kwargs]
    if missing:
        raise TypeError(f"{scheduler_class.__name__} needs the keyword argument(s) {missing}")


class AbstractScheduler:
    """Marks a callback as a learning-rate scheduler and saves / restores its scheduler's state.

    Scheduler callbacks inherit from this class and :class:`~aitoolbox.torchtrain.callbacks.abstract.AbstractCallback`
    and assign the torch scheduler they drive to ``self.scheduler``. The TrainLoop lists them in
    ``get_schedulers()``, and checkpoints store :meth:`state_dict` of each, in that order.
    """

    def __init__(self):
        self.scheduler = None

    def state_dict(self) -> dict:
        """The scheduler's ``state_dict()``."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state returned by :meth:`state_dict`."""
        self.scheduler.load_state_dict(state_dict)


class GeneralLRSchedulerCallback(AbstractScheduler, AbstractCallback):
    """Drives any ``torch.optim.lr_scheduler`` class from the training loop.

    The scheduler is built as ``scheduler_class(optimizer, **kwargs)`` when the callback is registered, so,
    as in a hand-written loop that creates the scheduler before training, its initial learning rate is in
    effect from the first batch. With several optimizers and ``optimizer_idx=None`` one scheduler is built
    per optimizer (see :attr:`schedulers`); ``scheduler`` is the single one otherwise.

    By default the schedulers step at every epoch end. With ``step_per_optimizer_step=True`` each scheduler
    steps after every step of its own optimizer instead (once per ``grad_accumulation`` batches, also when a
    MultiLoss steps several optimizers one after another), except after a step that was skipped because fp16
    gradients overflowed: a skipped update must not advance the schedule.

    Args:
        scheduler_class: a ``torch.optim.lr_scheduler`` class (or any ``fn(optimizer, **kwargs)``).
        optimizer_idx: None for every optimizer of the loop, an int index into the loop's optimizers, or
            the optimizer object itself.
        step_per_optimizer_step: step after each optimizer step rather than at each epoch end.
        **kwargs: the scheduler's arguments, e.g. ``step_size=2, gamma=0.5``.

    Raises:
        TypeError: ``scheduler_class`` is not callable, ``optimizer_idx`` has a wrong type, or ``kwargs``
            do not fit the scheduler's signature.
        ValueError: ``optimizer_idx`` is negative (or, at registration, out of range).
    """

    def __init__(self, scheduler_class: Callable[..., Any],
                 optimizer_idx: Optional[Union[int, torch.optim.Optimizer]] = None,
                 step_per_optimizer_step: bool = False, **kwargs):
        name = getattr(scheduler_class, "__name__", repr(scheduler_class))
        AbstractCallback.__init__(self, f"Learning rate scheduler {name}")
        self.schedulers: List[Any] = []
        if not callable(scheduler_class):
            raise TypeError(f"scheduler_class must be a scheduler class such as torch.optim.lr_scheduler.StepLR, "
                            f"got {scheduler_class!r}")
        if optimizer_idx is not None and not isinstance(optimizer_idx, torch.optim.Optimizer):
            if isinstance(optimizer_idx, bool) or not isinstance(optimizer_idx, int):
                raise TypeError(f"optimizer_idx must be None, an int index or a torch.optim.Optimizer, "
                                f"got {optimizer_idx!r}")
            if optimizer_idx < 0:
                raise ValueError(f"optimizer_idx must be >= 0, got {optimizer_idx}")
        _check_scheduler_arguments(scheduler_class, kwargs)
        self.scheduler_class = scheduler_class
        self.scheduler_args = kwargs
        self.optimizer_idx = optimizer_idx
        self.step_at_epoch_end = not step_per_optimizer_step
        self.step_after_optimizer_step = bool(step_per_optimizer_step)

    @property
    def scheduler(self) -> Optional[Any]:
        """The scheduler (None before registration); with several, use :attr:`schedulers`."""
        if len(self.schedulers) > 1:
            raise RuntimeError(f"{type(self).__name__} drives {len(self.schedulers)} schedulers, one per optimizer: "
                               "use .schedulers, or pass optimizer_idx to drive a single one")
        return self.schedulers[0] if self.schedulers else None

    @scheduler.setter
    def scheduler(self, scheduler: Optional[Any]) -> None:
        # aitoolbox 1.x subclasses assign ``self.scheduler`` themselves.
        self.schedulers = [] if scheduler is None else [scheduler]

    def _paired_optimizers(self) -> List[torch.optim.Optimizer]:
        optimizers = self.train_loop_obj.optimizers
        if self.optimizer_idx is None:
            return list(optimizers)
        if isinstance(self.optimizer_idx, torch.optim.Optimizer):
            return [self.optimizer_idx]
        if self.optimizer_idx >= len(optimizers):
            raise ValueError(f"optimizer_idx={self.optimizer_idx} is out of range: the TrainLoop has "
                             f"{len(optimizers)} optimizer(s), valid indices are 0..{len(optimizers) - 1}")
        return [optimizers[self.optimizer_idx]]

    def register_train_loop_object(self, train_loop_obj) -> "GeneralLRSchedulerCallback":
        """Build the scheduler(s) for the loop's optimizer(s), then register as any callback.

        The schedulers exist before :meth:`on_train_loop_registration` runs, so subclasses overriding that hook
        (as aitoolbox 1.x allowed) find them.
        """
        self.train_loop_obj = train_loop_obj
        paired = self._paired_optimizers()
        self.schedulers = [self.scheduler_class(optimizer, **self.scheduler_args) for optimizer in paired]
        # Each scheduler's optimizer as an index into the loop's optimizers, matched against the loop's
        # ``stepped_optimizers``; None for an optimizer the loop does not step (stepped with every update).
        self._scheduler_optimizer_idx = [next((idx for idx, loop_optimizer in enumerate(train_loop_obj.optimizers)
                                               if loop_optimizer is optimizer), None) for optimizer in paired]
        return super().register_train_loop_object(train_loop_obj)

    def on_epoch_end(self) -> None:
        if self.step_at_epoch_end:
            self.step()

    def on_after_optimizer_step(self) -> None:
        if not self.step_after_optimizer_step or self.train_loop_obj.optimizer_step_skipped:
            return
        # With optimizers stepped one after another the hook runs once per optimizer: only the schedulers of
        # the optimizer that just stepped advance, so each steps once per step of its own optimizer.
        stepped = getattr(self.train_loop_obj, "stepped_optimizers", ())
        paired = getattr(self, "_scheduler_optimizer_idx", [])
        if not stepped or len(paired) != len(self.schedulers):
            # Not told which optimizer stepped, or schedulers a 1.x subclass assigned itself: one step per call.
            self.step()
            return
        last = len(self.train_loop_obj.optimizers) - 1
        for scheduler, optimizer_idx in zip(self.schedulers, paired):
            if optimizer_idx in stepped or (optimizer_idx is None and last in stepped):
                scheduler.step()

    def step(self) -> None:
        """Advance every scheduler by one step."""
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        """The torch scheduler's ``state_dict()`` (aitoolbox 1.x format), or ``{'schedulers': [state, ...]}``
        when the callback drives one scheduler per optimizer.

        Raises:
            RuntimeError: before the callback is registered (no scheduler exists yet).
        """
        self._require_schedulers("state_dict")
        if len(self.schedulers) == 1:
            return self.schedulers[0].state_dict()
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (also an aitoolbox 1.x checkpoint's scheduler state).

        Raises:
            RuntimeError: before the callback is registered.
            ValueError: the number of saved states differs from the number of schedulers.
        """
        self._require_schedulers("load_state_dict")
        states = state_dict["schedulers"] if "schedulers" in state_dict else [state_dict]
        if len(states) != len(self.schedulers):
            raise ValueError(f"the state holds {len(states)} scheduler state(s) but this callback drives "
                             f"{len(self.schedulers)} scheduler(s)")
        for scheduler, state in zip(self.schedulers, states):
            scheduler.load_state_dict(state)

    def _require_schedulers(self, method: str) -> None:
        if not self.schedulers:
            raise RuntimeError(f"{type(self).__name__}.{method}() needs the schedulers, which are created when the "
                               "callback is registered with a TrainLoop (at fit)")


class ReduceLROnPlateauScheduler(GeneralLRSchedulerCallback):
    """``ReduceLROnPlateau`` on the validation loss, stepped at each epoch end.

    The validation loss is the TrainLoop's (evaluated once per epoch and shared with its ``val_loss``
    auto-evaluation). With a MultiLoss the scheduler follows ``main_multi_loss``, or the mean of all losses.

    Args:
        main_multi_loss: with a MultiLoss, the name of the loss to follow; None for the mean of all.
        **kwargs: ``ReduceLROnPlateau`` arguments (``mode``, ``factor``, ``patience``, ``threshold``, ...)
            and ``optimizer_idx``.

    Raises:
        ValueError: at an epoch end, when the TrainLoop has no validation loader.
        KeyError: at an epoch end, when ``main_multi_loss`` is not one of the MultiLoss's names.
    """

    def __init__(self, main_multi_loss: Optional[str] = None, **kwargs):
        # steps need the epoch's metric, so stepping per optimizer step is not offered
        super().__init__(ReduceLROnPlateau, step_per_optimizer_step=False, **kwargs)
        self.callback_name = "Reduce the learning rate when val_loss stops improving"
        self.main_multi_loss = main_multi_loss

    def on_epoch_end(self) -> None:
        tl = self.train_loop_obj
        if tl.validation_loader is None:
            raise ValueError("ReduceLROnPlateauScheduler steps on the validation loss, but the TrainLoop has no "
                             "validation_loader. Pass a validation_loader to TrainLoop, or use "
                             "ReduceLROnPlateauMetricScheduler(metric_name) with a metric recorded every epoch.")
        val_loss = tl.evaluate_loss_on_validation_set()
        if isinstance(val_loss, MultiLoss):
            if self.main_multi_loss is None:
                val_loss = torch.stack([torch.as_tensor(value, dtype=torch.float64).cpu()
                                        for value in val_loss.values()]).mean()
            elif self.main_multi_loss not in val_loss:
                raise KeyError(f"main_multi_loss={self.main_multi_loss!r} is not a loss of the MultiLoss; its losses "
                               f"are {list(val_loss)}")
            else:
                val_loss = val_loss[self.main_multi_loss]
        for scheduler in self.schedulers:
            scheduler.step(float(val_loss))


class ReduceLROnPlateauMetricScheduler(GeneralLRSchedulerCallback):
    """``ReduceLROnPlateau`` on any ``train_history`` metric, stepped at each epoch end.

    Runs late (execution_order 90) so that callbacks computing metrics at the epoch end (such as
    ModelPerformanceEvaluation) have recorded them. Pass ``mode='max'`` for metrics where higher is better.

    Args:
        metric_name: the ``train_history`` metric to follow, e.g. ``'val_Accuracy'``.
        **kwargs: ``ReduceLROnPlateau`` arguments and ``optimizer_idx``.

    Raises:
        ValueError: ``metric_name`` is not a non-empty string, or at an epoch end the metric is missing.
    """

    def __init__(self, metric_name: str, **kwargs):
        super().__init__(ReduceLROnPlateau, step_per_optimizer_step=False, **kwargs)
        if not isinstance(metric_name, str) or not metric_name:
            raise ValueError(f"metric_name must be the name of a train_history metric, got {metric_name!r}")
        self.metric_name = metric_name
        self.callback_name = f"Reduce the learning rate when {metric_name} stops improving"
        self.execution_order = 90

    def on_epoch_end(self) -> None:
        history = self.train_loop_obj.train_history
        if self.metric_name not in history:
            present = ", ".join(repr(name) for name in history) or "none"
            raise ValueError(f"ReduceLROnPlateauMetricScheduler follows {self.metric_name!r}, which is not in "
                             f"train_history (recorded metrics: {present}). Register a callback that records it "
                             "at every epoch end, e.g. ModelPerformanceEvaluation.")
        for scheduler in self.schedulers:
            scheduler.step(history[self.metric_name][-1])


class LambdaLRScheduler(GeneralLRSchedulerCallback):
    """``LambdaLR``: the learning rate is the initial one times ``lr_lambda(step)``.

    Args:
        lr_lambda: a function of the step count returning a factor, or a list with one per parameter group.
        execute_epoch_end: step at each epoch end.
        execute_batch_end: step after each optimizer step (at the end of a batch that updated the model);
            skipped overflow steps are not counted.
        **kwargs: ``LambdaLR`` arguments (``last_epoch``) and ``optimizer_idx``.

    Raises:
        TypeError: ``lr_lambda`` is not callable nor a list of callables.
        ValueError: both ``execute_epoch_end`` and ``execute_batch_end`` are False.
    """

    def __init__(self, lr_lambda: Union[Callable[[int], float], Sequence[Callable[[int], float]]],
                 execute_epoch_end: bool = True, execute_batch_end: bool = False, **kwargs):
        lambdas = lr_lambda if isinstance(lr_lambda, (list, tuple)) else [lr_lambda]
        if not lambdas or not all(callable(fn) for fn in lambdas):
            raise TypeError(f"lr_lambda must be a function of the step count (or a list of them, one per parameter "
                            f"group), got {lr_lambda!r}")
        if not execute_epoch_end and not execute_batch_end:
            raise ValueError("the scheduler would never step: set execute_epoch_end or execute_batch_end to True")
        super().__init__(LambdaLR, lr_lambda=lr_lambda, **kwargs)
        self.callback_name = "LambdaLR learning rate scheduler"
        self.step_at_epoch_end = bool(execute_epoch_end)
        self.step_after_optimizer_step = bool(execute_batch_end)


class StepLRScheduler(GeneralLRSchedulerCallback):
    """``StepLR``: multiply the learning rate by ``gamma`` every ``step_size`` epochs.

    Args:
        step_size: epochs between decays (an int >= 1).
        **kwargs: ``StepLR`` arguments (``gamma``, ``last_epoch``) and ``optimizer_idx``.

    Raises:
        ValueError: ``step_size`` is not a positive int.
    """

    def __init__(self, step_size: int, **kwargs):
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"step_size must be an int >= 1 (epochs between decays), got {step_size!r}")
        super().__init__(StepLR, step_size=step_size, **kwargs)
        self.callback_name = "StepLR learning rate scheduler"


class MultiStepLRScheduler(GeneralLRSchedulerCallback):
    """``MultiStepLR``: multiply the learning rate by ``gamma`` when the epoch count reaches each milestone.

    Args:
        milestones_list: increasing epoch counts (ints >= 1); ``milestones=`` (torch's name) works too.
        **kwargs: ``MultiStepLR`` arguments (``gamma``, ``last_epoch``) and ``optimizer_idx``.

    Raises:
        ValueError: the milestones are empty, not ints >= 1, or not strictly increasing.
        TypeError: both ``milestones_list`` and ``milestones`` are given.
    """

    def __init__(self, milestones_list: Optional[Sequence[int]] = None, **kwargs):
        if "milestones" in kwargs:
            if milestones_list is not None:
                raise TypeError("pass milestones_list or milestones (the same argument), not both")
            milestones_list = kwargs.pop("milestones")
        milestones = milestones_list
        if (not isinstance(milestones, (list, tuple)) or not milestones
                or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in milestones)
                or any(a >= b for a, b in zip(milestones, milestones[1:]))):
            raise ValueError(f"milestones_list must be a non-empty, strictly increasing list of ints >= 1, "
                             f"got {milestones!r}")
        super().__init__(MultiStepLR, milestones=list(milestones), **kwargs)
        self.callback_name = "MultiStepLR learning rate scheduler"
