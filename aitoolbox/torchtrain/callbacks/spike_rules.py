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
        reference: the run's loss scale (None before the warm-up's end; a 0-d tensor after): the median absolute
            loss of the window, refreshed at each check; where that is 0 (a loss sitting at exactly 0), the last
            scale that was not (the window's mean absolute loss if there was none). The unit of the remembered
            rises and of the default ``min_rise``.
    """

    window: torch.Tensor
    rises: torch.Tensor
    seen: int = 0
    reference: Optional[torch.Tensor] = None
    #: the run's scale when each remembered rise was judged (NaN where unknown: a state from before it was kept).
    rise_scales: Optional[torch.Tensor] = None

    def scales_of_rises(self) -> torch.Tensor:
        """``rise_scales``, NaN-padded at the front to the length of ``rises``."""
        scales = self.rise_scales if self.rise_scales is not None else self.rises[:0]
        scales = scales[-len(self.rises):] if len(self.rises) else scales[:0]
        padding = self.rises.new_full((len(self.rises) - len(scales),), float("nan"))
        return torch.cat([padding, scales.to(self.rises)])


@dataclasses.dataclass
class Judgement:
    """Per loss of an interval: ``flags`` (a spike), ``centres`` (the median of the window before it), ``limits``
    (the loss above which it counted as a spike; NaN where not judged yet), ``rises`` (the loss minus its centre;
    -inf where that is not a finite number), ``scales`` (the run's scale each was judged in, remembered with the
    rises; None for a rule without memory)."""

    flags: torch.Tensor
    centres: torch.Tensor
    limits: torch.Tensor
    rises: torch.Tensor
    scales: Optional[torch.Tensor] = None


def remember(history: LossHistory, losses: torch.Tensor, judgement: Judgement, window: int, warmup: int,
             memory: int) -> LossHistory:
    """The history after the clean ``losses`` (judged as ``judgement``) join it: the window moves on, their rises
    and scales join the memory (the last ``memory``), and the scale is refreshed once the warm-up is over. All on
    the losses' device, no host copy."""
    device = losses.device
    window_values = torch.cat([history.window.to(device), losses])[-window:].clone()
    if memory and judgement.scales is not None:
        kept_rises = torch.cat([history.rises.to(device), judgement.rises])[-memory:].clone()
        kept_scales = torch.cat([history.scales_of_rises().to(device), judgement.scales])[-memory:].clone()
    else:
        kept_rises = kept_scales = losses[:0]
    seen = history.seen + len(losses)
    reference = history.reference
    if seen >= warmup:
        # The scale follows the loss as it falls (a bar fixed at the start would let a x100 spike through once the
        # loss fell by orders of magnitude), but never to 0: a loss sitting at exactly 0 keeps the last scale it
        # had, else every positive batch of a healthy hinge loss would be a spike.
        magnitudes = window_values.abs()
        median = magnitudes.nanmedian()
        previous = magnitudes.nanmean() if reference is None else reference.to(device)
        reference = torch.where(median > 0, median, previous)
    return LossHistory(window_values, kept_rises, seen, reference, kept_scales)


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
      own window, remembered in units of the run's scale then and counted in today's scale), or of the last
      ``window`` of them in the loss's units, if larger: what this run's healthy batches have shown they do (the
      second largest, so that one spike that slipped under the bar cannot raise it alone), and
    * ``min_rise``: by default 5 % of the run's loss scale (the median absolute loss of the window, refreshed at
      each check; where that is 0, the last scale that was not), and ``tail_factor`` times that scale where the
      window sits at exactly 0 (e.g. a hinge loss at 0: no spread, and soon no remembered rise, to judge by).

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
        # Remembered rises count twice: in units of the run's scale when they were judged, times today's scale (the
        # rises of a fast early descent would otherwise hold the bar at the loss's early size for ``memory`` batches
        # after it fell by orders of magnitude), and the last ``window`` of them as they were, in the loss's units
        # (where healthy outliers keep their size while the median falls, one misclassified sample of a small
        # batch, they outgrow the scaled memory). The larger counts.
        scales = self._scales(history, rows)
        remembered = history.rises.to(losses.dtype)
        scaled_memory = remembered / history.scales_of_rises().to(losses.dtype)
        scaled_now = torch.where(scales > 0, finite_rises / scales, -math.inf)
        scaled_rows = torch.nan_to_num(trailing_rows(scaled_memory, scaled_now, self.memory), nan=-math.inf,
                                       posinf=-math.inf)
        recent_rows = torch.nan_to_num(trailing_rows(remembered, finite_rises, min(window, self.memory)),
                                       nan=-math.inf)
        # The second largest: one spike that slipped under the bar (and so into the memory) does not raise it alone.
        second = torch.maximum(self._second(scaled_rows) * scales, self._second(recent_rows))
        margin = torch.maximum(self.threshold * torch.nan_to_num(sigmas, nan=0.0), self.tail_factor * second)
        if self.min_rise is not None:
            floor = scales.new_full((len(rows),), self.min_rise)
        else:
            # A window sitting at exactly 0 (a hinge loss) has no spread and soon no remembered rises: a batch
            # counts only well beyond the size the loss had when it last moved.
            still = torch.nan_to_num(rows.abs().nanmedian(dim=1).values, nan=1.0) == 0
            floor = torch.where(still, self.tail_factor * scales, 0.05 * scales)
        limits = centres + torch.maximum(margin, floor)
        checked = history.seen + torch.arange(len(losses), device=losses.device) >= max(warmup, 1)
        flags = ~torch.isfinite(losses) | (checked & (losses > limits))
        return Judgement(flags, centres, torch.where(checked, limits, torch.nan), finite_rises, scales)

    @staticmethod
    def _second(rows: torch.Tensor) -> torch.Tensor:
        """Per row, the second largest value (the largest where a row has one value), at least 0."""
        return rows.topk(min(2, rows.shape[1]), dim=1).values[:, -1].clamp(min=0.0)

    @staticmethod
    def _scales(history: LossHistory, rows: torch.Tensor) -> torch.Tensor:
        """Per loss, the run's scale: the reference, or in the warm-up the median absolute loss of its window."""
        if history.reference is not None:
            return history.reference.to(rows).expand(len(rows))
        return torch.nan_to_num(rows.abs().nanmedian(dim=1).values, nan=0.0)


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
