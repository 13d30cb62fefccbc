"""What an LR search returns: :class:`LRFinderResult` (the curve, the suggested learning rate and its plot) and the
rules that turn the curve into a suggestion.

The rules read the *smoothed* loss against the learning rate (steps ``0..n-1``):

``'valley'`` (fastai's default rule, written here from its description)
    The longest valley: the longest strictly decreasing subsequence of the smoothed losses (not necessarily of
    neighbouring steps: noise may interrupt the descent), the earliest one when several are equally long. As in
    fastai, the valley spans as many steps as it has points, ending at its last step ``b``: ``a = b - points + 1``,
    so that a long plateau, whose noise the subsequence threads through point by point with the steps in between
    skipped, does not stretch the valley back into it. The suggestion is the learning rate of step
    ``a + (b - a) // 2``: half way down, where the loss still falls fast but is far from the edge where it starts to
    blow up.
``'steepest'``
    The step where the smoothed loss falls fastest against ``log10(lr)`` on the way down to its lowest value: the
    most negative slope (central differences inside, one-sided at both ends, as ``numpy.gradient``) among the steps
    up to the lowest smoothed loss. (After it the loss falls only where it comes down from a blow-up.)
``'minimum'``
    The learning rate of the lowest smoothed loss, divided by 10 (at the minimum itself training is already on the
    edge of diverging).
"""
import dataclasses
import logging
import math
import warnings
from typing import Any, List, Optional, Tuple

import numpy as np

logger = logging.getLogger(__name__)

SUGGESTION_RULES = ("valley", "steepest", "minimum")


@dataclasses.dataclass
class LRFinderResult:
    """The outcome of :meth:`TrainLoop.lr_find <aitoolbox.torchtrain.train_loop.TrainLoop.lr_find>`.

    Attributes:
        lrs: the learning rate of the first parameter group at each optimizer step of the search.
        losses: the smoothed loss of each step (the curve the suggestion is read from).
        raw_losses: each step's own loss (the mean over its accumulation window, and over the ranks).
        suggestion: the suggested learning rate for the first parameter group, or None when the search recorded
            fewer than two steps.
        suggestion_rule: the rule that made the suggestion (``'valley'``, ``'steepest'`` or ``'minimum'``).
        suggestion_index: the step the suggestion was read from (for ``'minimum'``: the step of the lowest loss).
        diverged: the search stopped early because the loss blew up (above the divergence threshold, or not
            finite); the step that was not finite is not recorded.
        num_iterations: the steps the search was asked for (``len(lrs)`` is smaller after a divergence).
    """

    lrs: List[float]
    losses: List[float]
    raw_losses: List[float]
    suggestion: Optional[float]
    suggestion_rule: str
    suggestion_index: Optional[int]
    diverged: bool
    num_iterations: int

    def plot(self, path: Optional[str] = None, ax: Any = None) -> Tuple[Any, Any]:
        """Plot the smoothed loss (and, faintly, the raw one) against the learning rate on a log axis, the
        suggestion marked.

        Args:
            path: also save the figure there (the format from the extension, e.g. ``.png`` or ``.pdf``).
            ax: draw into these matplotlib axes instead of a new figure.

        Returns:
            ``(figure, axes)``.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("LRFinderResult.plot needs matplotlib, which is not installed: pip install matplotlib "
                              "(or pip install aitoolbox[tracking])") from error
        if ax is None:
            # A Figure of its own, not pyplot: no global state, and the user's backend is left alone.
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            figure = Figure(figsize=(7, 4.5))
            FigureCanvasAgg(figure)
            ax = figure.subplots()
        else:
            figure = ax.figure
        ax.plot(self.lrs, self.raw_losses, color="tab:blue", alpha=0.25, linewidth=1, label="loss")
        ax.plot(self.lrs, self.losses, color="tab:blue", linewidth=2, label="smoothed loss")
        if self.suggestion is not None:
            ax.axvline(self.suggestion, color="tab:red", linestyle="--", linewidth=1.5,
                       label=f"suggestion ({self.suggestion_rule}): {self.suggestion:.3g}")
            if self.suggestion_index is not None:
                ax.plot([self.lrs[self.suggestion_index]], [self.losses[self.suggestion_index]], "o",
                        color="tab:red", markersize=7)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        finite = [loss for loss in self.losses if math.isfinite(loss)]
        if finite:  # the divergence at the end would squash the interesting part of the curve
            low, high = min(finite), min(max(finite), finite[0] + 2 * (finite[0] - min(finite)) + 1e-12)
            margin = 0.05 * (high - low) if high > low else 0.05 * abs(low) + 1e-12
            ax.set_ylim(low - margin, high + margin)
        ax.set_title("LR search" + (" (stopped: the loss diverged)" if self.diverged else ""))
        ax.legend(loc="best")
        ax.grid(True, which="both", alpha=0.3)
        figure.tight_layout()
        if path is not None:
            figure.savefig(path)
        return figure, ax


class MovingAverage:
    """Bias-corrected exponential moving average: ``avg_t = (1 - s) * avg_{t-1} + s * x_t`` from ``avg_{-1} = 0``,
    read as ``avg_t / (1 - (1 - s) ** (t + 1))``, so that the first value is the first loss itself
    (``s = smoothing``; 1 is no smoothing). The search's stop rule and the result read the same values."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self._average = 0.0
        self._count = 0

    def add(self, value: float) -> float:
        """Take the next value in; returns the smoothed value now."""
        self._average = (1.0 - self.smoothing) * self._average + self.smoothing * value
        self._count += 1
        return self._average / (1.0 - (1.0 - self.smoothing) ** self._count)


def smoothed_losses(raw: List[float], smoothing: float) -> List[float]:
    """``raw`` through a :class:`MovingAverage` of weight ``smoothing``."""
    average = MovingAverage(smoothing)
    return [average.add(loss) for loss in raw]


def longest_valley(losses: List[float]) -> Tuple[int, int, int]:
    """First step, last step and number of points of the longest strictly decreasing subsequence of ``losses`` (the
    earliest-ending one among equally long ones). O(n^2) over a few hundred steps at most."""
    length = [1] * len(losses)
    start = list(range(len(losses)))
    best_end = 0
    for i in range(1, len(losses)):
        for j in range(i):
            # Ties keep the earlier start: the longer stretch of the descent.
            if losses[j] > losses[i] and (length[j] + 1 > length[i]
                                          or (length[j] + 1 == length[i] and start[j] < start[i])):
                length[i], start[i] = length[j] + 1, start[j]
        if length[i] > length[best_end]:
            best_end = i
    return start[best_end], best_end, length[best_end]


def suggestion_index(lrs: List[float], losses: List[float], rule: str) -> int:
    """The step whose learning rate ``rule`` suggests (see the module's description; ``'minimum'``: the step of the
    lowest loss, the suggestion being a tenth of its learning rate). Needs at least two steps."""
    if rule == "valley":
        _, last, points = longest_valley(losses)
        first = last - points + 1  # the span of its points, not of the plateau it threads through (see above)
        return first + (last - first) // 2
    if rule == "steepest":
        slopes = np.gradient(np.asarray(losses, dtype=np.float64), np.log10(np.asarray(lrs, dtype=np.float64)))
        lowest = int(np.argmin(np.asarray(losses, dtype=np.float64)))
        return int(np.argmin(slopes[:lowest + 1]))
    if rule == "minimum":
        return int(np.argmin(np.asarray(losses, dtype=np.float64)))
    raise ValueError(f"suggestion must be one of {list(SUGGESTION_RULES)}, got {rule!r}")


def make_result(lrs: List[float], raw: List[float], smoothing: float, rule: str, diverged: bool,
                num_iterations: int) -> LRFinderResult:
    """The result of a search that recorded these steps, with the suggestion of ``rule``; warns when the curve
    cannot be trusted (too short, never falling, a suggestion at the edge of the range)."""
    losses = smoothed_losses(raw, smoothing)
    suggestion = index = None
    if len(losses) < 2:
        warnings.warn(f"the LR search stopped after {len(losses)} step(s) (the loss diverged at once): no suggestion. "
                      "Start from a smaller start_lr.", RuntimeWarning, stacklevel=4)
    else:
        index = suggestion_index(lrs, losses, rule)
        suggestion = lrs[index] / 10.0 if rule == "minimum" else lrs[index]
        if min(losses[1:]) >= losses[0]:
            warnings.warn(f"the loss never fell below its first value during the LR search ({losses[0]:.4g} at lr "
                          f"{lrs[0]:.3g}): the range starts too high (try a smaller start_lr), or the model does not "
                          "learn from this data at any of these rates (check the loss and the data); the suggestion "
                          "is not reliable.", RuntimeWarning, stacklevel=4)
        elif index in (0, len(losses) - 1) or (rule == "minimum" and suggestion < lrs[0]):
            warnings.warn(f"the suggested learning rate {suggestion:.3g} lies at the edge of the searched range "
                          f"[{lrs[0]:.3g}, {lrs[-1]:.3g}]: search a wider range (start_lr lower, end_lr higher) or "
                          "more steps.", RuntimeWarning, stacklevel=4)
    return LRFinderResult(lrs=list(lrs), losses=losses, raw_losses=list(raw), suggestion=suggestion,
                          suggestion_rule=rule, suggestion_index=index, diverged=diverged,
                          num_iterations=num_iterations)
