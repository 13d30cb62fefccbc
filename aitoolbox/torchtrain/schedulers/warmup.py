"""Warmup schedules (as in BERT-style training), stepped after every optimizer step.

Each is a ``LambdaLR`` whose factor rises linearly from 0 to 1 over ``num_warmup_steps`` optimizer steps and
then stays constant, decays linearly, follows a cosine to 0 at ``num_training_steps``, or follows cosines
with hard restarts. A step skipped
because fp16 gradients overflowed does not advance the schedule. The factors are picklable objects (not
closures) so the callbacks can be sent to the processes of distributed training, and their settings are
saved in the scheduler's ``state_dict``.
"""
import math
from numbers import Real

from aitoolbox.torchtrain.schedulers.basic import LambdaLRScheduler


def _check_steps(num_warmup_steps: int, num_training_steps: int = None) -> None:
    if isinstance(num_warmup_steps, bool) or not isinstance(num_warmup_steps, int) or num_warmup_steps < 0:
        raise ValueError(f"num_warmup_steps must be an int >= 0, got {num_warmup_steps!r}")
    if num_training_steps is None:
        return
    if isinstance(num_training_steps, bool) or not isinstance(num_training_steps, int) or num_training_steps < 1:
        raise ValueError(f"num_training_steps must be an int >= 1 (the total number of optimizer steps), "
                         f"got {num_training_steps!r}")
    if num_training_steps < num_warmup_steps:
        raise ValueError(f"num_training_steps ({num_training_steps}) must be >= num_warmup_steps "
                         f"({num_warmup_steps})")


def _check_cycles(num_cycles: float) -> float:
    """``num_cycles`` as a float, after checking it is a number > 0."""
    if isinstance(num_cycles, bool) or not isinstance(num_cycles, Real) or not num_cycles > 0:
        raise ValueError(f"num_cycles must be a number > 0, got {num_cycles!r}")
    return float(num_cycles)


class WarmupFactor:
    """Linear warmup from 0 to 1 over ``num_warmup_steps``, then a constant 1."""

    def __init__(self, num_warmup_steps: int):
        self.num_warmup_steps = num_warmup_steps

    def warmup(self, step: int) -> float:
        return float(step) / float(max(1, self.num_warmup_steps))

    def __call__(self, step: int) -> float:
        return self.warmup(step) if step < self.num_warmup_steps else 1.0


class LinearDecayWarmupFactor(WarmupFactor):
    """Linear warmup, then a linear decay reaching 0 at ``num_training_steps``."""

    def __init__(self, num_warmup_steps: int, num_training_steps: int):
        super().__init__(num_warmup_steps)
        self.num_training_steps = num_training_steps

    def __call__(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return self.warmup(step)
        remaining = float(self.num_training_steps - step)
        return max(0.0, remaining / float(max(1, self.num_training_steps - self.num_warmup_steps)))


class _CyclesAfterWarmupFactor(WarmupFactor):
    """Linear warmup, then a schedule in ``num_cycles`` over the steps up to ``num_training_steps``."""

    def __init__(self, num_warmup_steps: int, num_training_steps: int, num_cycles: float):
        super().__init__(num_warmup_steps)
        self.num_training_steps = num_training_steps
        self.num_cycles = num_cycles

    def progress(self, step: int) -> float:
        """How far past the warmup ``step`` is: 0 at its end, 1 at ``num_training_steps``."""
        return float(step - self.num_warmup_steps) / float(max(1, self.num_training_steps - self.num_warmup_steps))


class CosineDecayWarmupFactor(_CyclesAfterWarmupFactor):
    """Linear warmup, then a cosine with ``num_cycles`` periods over the remaining steps (0.5: down to 0)."""

    def __call__(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return self.warmup(step)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * self.progress(step))))


class HardRestartsCosineWarmupFactor(_CyclesAfterWarmupFactor):
    """Linear warmup, then ``num_cycles`` cosine decays from 1 to 0, each restarting at 1; 0 from the end on."""

    def __call__(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return self.warmup(step)
        progress = self.progress(step)
        if progress >= 1.0:
            return 0.0
        position_in_cycle = (float(self.num_cycles) * progress) % 1.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * position_in_cycle)))


class _PerStepWarmupScheduler(LambdaLRScheduler):
    """A ``LambdaLR`` stepped after every batch by ``factor``, reported under ``callback_name``."""

    def __init__(self, factor: WarmupFactor, callback_name: str, last_epoch: int, **kwargs):
        super().__init__(factor, execute_epoch_end=False, execute_batch_end=True, last_epoch=last_epoch, **kwargs)
        self.callback_name = callback_name


class ConstantWithWarmupScheduler(_PerStepWarmupScheduler):
    """Warm up linearly from 0 to the optimizer's learning rate, then keep it.

    Args:
        num_warmup_steps: optimizer steps of the warmup (an int >= 0).
        last_epoch: the index of the last step when resuming (-1 for a fresh start).
        **kwargs: further ``LambdaLR`` arguments and ``optimizer_idx``.

    Raises:
        ValueError: ``num_warmup_steps`` is not an int >= 0.
    """

    def __init__(self, num_warmup_steps: int, last_epoch: int = -1, **kwargs):
        _check_steps(num_warmup_steps)
        super().__init__(WarmupFactor(num_warmup_steps), "Constant learning rate with warmup", last_epoch, **kwargs)


class LinearWithWarmupScheduler(_PerStepWarmupScheduler):
    """Warm up linearly to the optimizer's learning rate, then decay linearly to 0 at ``num_training_steps``.

    Args:
        num_warmup_steps: optimizer steps of the warmup (an int >= 0).
        num_training_steps: total optimizer steps of the training (an int >= num_warmup_steps, >= 1).
        last_epoch: the index of the last step when resuming (-1 for a fresh start).
        **kwargs: further ``LambdaLR`` arguments and ``optimizer_idx``.

    Raises:
        ValueError: on a bad step count.
    """

    def __init__(self, num_warmup_steps: int, num_training_steps: int, last_epoch: int = -1, **kwargs):
        _check_steps(num_warmup_steps, num_training_steps)
        super().__init__(LinearDecayWarmupFactor(num_warmup_steps, num_training_steps),
                         "Linearly decaying learning rate with warmup", last_epoch, **kwargs)


class CosineWithWarmupScheduler(_PerStepWarmupScheduler):
    """Warm up linearly to the optimizer's learning rate, then follow a cosine (to 0 with ``num_cycles=0.5``).

    Args:
        num_warmup_steps: optimizer steps of the warmup (an int >= 0).
        num_training_steps: total optimizer steps of the training (an int >= num_warmup_steps, >= 1).
        num_cycles: cosine periods after the warmup (a number > 0); 0.5 decays once from the peak to 0.
        last_epoch: the index of the last step when resuming (-1 for a fresh start).
        **kwargs: further ``LambdaLR`` arguments and ``optimizer_idx``.

    Raises:
        ValueError: on a bad step count or ``num_cycles``.
    """

    def __init__(self, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
                 last_epoch: int = -1, **kwargs):
        _check_steps(num_warmup_steps, num_training_steps)
        factor = CosineDecayWarmupFactor(num_warmup_steps, num_training_steps, _check_cycles(num_cycles))
        super().__init__(factor, "Cosine learning rate with warmup", last_epoch, **kwargs)


class HardRestartsCosineWithWarmupScheduler(_PerStepWarmupScheduler):
    """Warm up linearly to the optimizer's learning rate, then ``num_cycles`` cosine decays to 0 with hard restarts.

    Each cycle falls from the peak learning rate to 0 and jumps back to the peak; after ``num_training_steps``
    the learning rate stays 0.

    Args:
        num_warmup_steps: optimizer steps of the warmup (an int >= 0).
        num_training_steps: total optimizer steps of the training (an int >= num_warmup_steps, >= 1).
        num_cycles: how many decays follow the warmup (a number > 0); 0.5 (aitoolbox 1.x default) decays only
            half-way to 0.
        last_epoch: the index of the last step when resuming (-1 for a fresh start).
        **kwargs: further ``LambdaLR`` arguments and ``optimizer_idx``.

    Raises:
        ValueError: on a bad step count or ``num_cycles``.
    """

    def __init__(self, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
                 last_epoch: int = -1, **kwargs):
        _check_steps(num_warmup_steps, num_training_steps)
        factor = HardRestartsCosineWarmupFactor(num_warmup_steps, num_training_steps, _check_cycles(num_cycles))
        super().__init__(factor, "Cosine learning rate with hard restarts and warmup", last_epoch, **kwargs)
