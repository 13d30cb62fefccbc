"""The rules :class:`~aitoolbox.torchtrain.callbacks.spike_rollback.SpikeRollback` judges batch losses by.

A rule looks at the losses of one check interval against what the run has shown before (the clean losses of the last
``window`` batches, and for :class:`RobustRule` the rises of the last ``memory`` clean losses above their centre) and
says, per loss, whether it is a spike and where its limit lay. Everything is a few tensor operations on the losses'
device: no host synchronisation (the caller copies the flags once per interval).

:class:`RobustRule` (the default) is built for the batch losses of ordinary training, which are noisy, skewed and
heavy-tailed at small batch sizes (late in a small-batch classification run most batches are near 0 and a batch with
one confidently misclassified sample lies hundreds of times above the median), and may be negative (a Gaussian
negative log-likelihood). It asks for a rise above the centre that is unusual both in units of the window's robust
spread and against the largest rises the run itself produced lately. :class:`FactorRule` is the rule of aitoolbox
before issue 34 (a loss above ``factor`` times the median), kept for runs configured with it.
"""
import dataclasses
import math
from typing import Any, Optional

import torch

#: The MAD of a normal distribution times this is its standard deviation.
MAD_TO_SIGMA = 1.4826


@dataclasses.dataclass
class LossHistory:
    """What the rules judge an interval against (on the losses' device; kept by SpikeRollback, in its checkpoints).

    Attributes:
        window: the last clean losses (at most ``window`` of them), oldest first.
        rises: each of the last clean losses' rise above the centre of the window before it (at most ``memory``;
            -inf where there was no window yet).
        seen: clean losses that entered the window so far (the warm-up counts them).
        reference: the median absolute loss of the window once the warm-up was over (None before): the scale of the
            default ``min_rise``.
    """

    window: torch.Tensor
    rises: torch.Tensor
    seen: int = 0
    reference: Optional[float] = None


@dataclasses.dataclass
class Judgement:
    """Per loss of an interval: ``flags`` (a spike), ``centres`` (the median of the window before it), ``limits``
    (the loss above which it counted as a spike; NaN where not judged yet), ``rises`` (the loss minus its centre;
    -inf where that is not a finite number)."""

    flags: torch.Tensor
    centres: torch.Tensor
    limits: torch.Tensor
    rises: torch.Tensor


def trailing_rows(earlier: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Row ``i``: the ``size`` values before ``values[i]`` (the tail of ``earlier``, then ``values[:i]``), NaN where
    there were fewer. A view of one concatenated tensor: no copy per row."""
    earlier = earlier[-size:] if size > 0 else earlier[:0]
    padding = values.new_full((size - len(earlier),), float("nan"))
    return torch.cat([padding, earlier, values]).unfold(0, size, 1)[:len(values)]


class FactorRule:
    """aitoolbox's rule before issue 34: a loss is a spike when it is not finite, or (after the warm-up) above
    ``factor`` times the median of the ``window`` clean losses before it. Meaningless for negative losses, and it
    fires on the ordinary noise of small-batch runs whose loss nears 0; chosen by ``SpikeRollback(factor=...)``."""

    def __init__(self, factor: float):
        self.factor = float(factor)

    def __repr__(self) -> str:
        return f"FactorRule(factor={self.factor:g})"

    def judge(self, history: LossHistory, losses: torch.Tensor, window: int, warmup: int) -> Judgement:
        rows = trailing_rows(history.window, losses, window)
        centres = rows.nanmedian(dim=1).values
        limits = self.factor * centres
        checked = history.seen + torch.arange(len(losses), device=losses.device) >= max(warmup, 1)
        flags = ~torch.isfinite(losses) | (checked & (losses > limits))
        return Judgement(flags, centres, torch.where(checked, limits, torch.nan), losses - centres)


class RobustRule:
    """The default spike rule: a loss is a spike when it is not finite, or (after the warm-up) its rise above the
    centre (the median of the ``window`` clean losses before it) exceeds all of

    * ``threshold`` robust standard deviations of that window (1.4826 times its median absolute deviation),
    * ``tail_factor`` times the second largest rise of the last ``memory`` clean losses (each above the centre of its
      own window): what this run's healthy batches have shown they do (the second largest, so that one spike that
      slipped under the bar cannot raise it alone), and
    * ``min_rise``: by default 5 % of the run's loss scale (the median absolute loss of the window when the warm-up
      ended), a floor for losses that sit exactly still (e.g. a hinge loss at 0).

    Rises are differences, so a negative loss is judged like any other, and the run's own outliers set the bar: on a
    small-batch run whose healthy batches reach hundreds of times the median, only a loss well beyond them counts.
    """

    def __init__(self, threshold: float = 10.0, tail_factor: float = 5.0, memory: int = 1000,
                 min_rise: Optional[float] = None):
        self.threshold, self.tail_factor, self.memory = float(threshold), float(tail_factor), int(memory)
        self.min_rise = None if min_rise is None else float(min_rise)

    def __repr__(self) -> str:
        return (f"RobustRule(threshold={self.threshold:g}, tail_factor={self.tail_factor:g}, memory={self.memory}, "
                f"min_rise={self.min_rise!r})")

    def judge(self, history: LossHistory, losses: torch.Tensor, window: int, warmup: int) -> Judgement:
        rows = trailing_rows(history.window, losses, window)
        centres = rows.nanmedian(dim=1).values
        sigmas = MAD_TO_SIGMA * (rows - centres[:, None]).abs().nanmedian(dim=1).values
        rises = losses - centres
        # A non-finite loss is a spike by itself; it must not lift the bar for the losses after it. -inf: no rise
        # (also a first loss, which has nothing before it).
        finite_rises = torch.where(torch.isfinite(rises), rises, -math.inf)
        earlier_rises = torch.nan_to_num(trailing_rows(history.rises, finite_rises, self.memory), nan=-math.inf)
        # The second largest: one spike that slipped under the bar (and so into the memory) does not raise it alone.
        second = earlier_rises.topk(min(2, self.memory), dim=1).values[:, -1].clamp(min=0.0)
        margin = torch.maximum(self.threshold * torch.nan_to_num(sigmas, nan=0.0), self.tail_factor * second)
        margin = torch.maximum(margin, self._floor(history, rows))
        limits = centres + margin
        checked = history.seen + torch.arange(len(losses), device=losses.device) >= max(warmup, 1)
        flags = ~torch.isfinite(losses) | (checked & (losses > limits))
        return Judgement(flags, centres, torch.where(checked, limits, torch.nan), finite_rises)

    def _floor(self, history: LossHistory, rows: torch.Tensor) -> torch.Tensor:
        if self.min_rise is not None:
            return rows.new_full((len(rows),), self.min_rise)
        if history.reference is not None:
            return rows.new_full((len(rows),), 0.05 * history.reference)
        return 0.05 * torch.nan_to_num(rows.abs().nanmedian(dim=1).values, nan=0.0)  # still in the warm-up's reach


def make_rule(factor: Any, threshold: Any, tail_factor: Any, memory: Any, min_rise: Any) -> Any:
    """The rule ``SpikeRollback``'s arguments ask for, checked: :class:`FactorRule` with ``factor``, else
    :class:`RobustRule` with the settings given (None: its default)."""
    settings = {"threshold": threshold, "tail_factor": tail_factor, "memory": memory, "min_rise": min_rise}
    if factor is not None:
        if not positive_number(factor):
            raise ValueError(f"factor must be None (the default rule) or a number > 0 (a loss above factor x the "
                             f"median is a spike), got {factor!r}")
        given = sorted(name for name, value in settings.items() if value is not None)
        if given:
            raise ValueError(f"factor={factor!r} selects the earlier rule (a loss above factor x the median), which "
                             f"does not take {given}: pass either factor or the default rule's settings")
        return FactorRule(factor)
    for name in ("threshold", "tail_factor"):
        if settings[name] is not None and not positive_number(settings[name]):
            raise ValueError(f"{name} must be a number > 0, got {settings[name]!r}")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
        raise ValueError(f"memory must be an int >= 1 (clean losses the largest rise is taken over), got {memory!r}")
    if min_rise is not None and (isinstance(min_rise, bool) or not isinstance(min_rise, (int, float))
                                 or not math.isfinite(min_rise) or min_rise < 0):
        raise ValueError(f"min_rise must be None or a finite number >= 0 (in the loss's units), got {min_rise!r}")
    return RobustRule(**{name: value for name, value in settings.items() if value is not None})


def positive_number(value: Any) -> bool:
    """A finite int or float > 0 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
