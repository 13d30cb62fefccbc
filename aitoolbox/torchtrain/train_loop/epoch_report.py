"""One line per epoch, as Keras prints it: ``Epoch 3/10 - 2.1s - accumulated_loss 0.4123 - val_loss 0.4512``.

The line lists every metric the epoch recorded in the training history (the accumulated and evaluated losses,
and the metrics of performance callbacks), each to four significant digits. With several named validation sets
the first set's values show once, under their set's names (``val_in_domain_loss``): the plain names that repeat
them (``val_loss``, ``val_<metric>``) stay in the history and the trackers. It is logged at INFO on the
``aitoolbox.epochs`` logger, so it shows wherever the package's messages show: by default (an application
that has not configured logging) printed above the progress bars; silence it alone with
``logging.getLogger('aitoolbox.epochs').setLevel(logging.WARNING)``. ``TrainLoop(epoch_line_metrics=[...])``
trims it to the entries whose names match the given names or ``fnmatch`` patterns.
"""
import fnmatch
import logging
import numbers
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

logger = logging.getLogger("aitoolbox.epochs")


def format_value(value: Any) -> str:
    """Four significant digits for numbers (``0.4123``, ``1.235e-05``); other values as they print."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{float(value):.4g}"
    return str(value)


class EpochReport:
    """Measures an epoch and logs its summary line (see the module docstring)."""

    def __init__(self):
        self._start_time = 0.0
        self._history_lengths: Dict[str, int] = {}
        self.shown: Optional[List[str]] = None  # patterns of the entries the line shows; None: all
        self._warned: set = set()

    def show_only(self, patterns: Optional[Sequence[str]]) -> None:
        """Show only the entries whose names match one of ``patterns`` (names or ``fnmatch`` patterns; None: all)."""
        if patterns is None:
            self.shown = None
            return
        if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence) \
                or not all(isinstance(pattern, str) and pattern for pattern in patterns):
            raise TypeError("epoch_line_metrics must be None (show every entry) or a list of history names or "
                            f"fnmatch patterns, e.g. ['accumulated_loss', 'val_*loss']; got {patterns!r}")
        self.shown = list(patterns)

    def start(self, history: Mapping[str, list], lengths_before: Optional[Mapping[str, int]] = None) -> None:
        """At the start of an epoch: note the time and what the history holds already (or held before the epoch:
        ``lengths_before``, the length of each list, for an epoch's end continued after an exception)."""
        self._start_time = time.monotonic()
        self._history_lengths = dict(lengths_before) if lengths_before is not None else \
            {name: len(values) for name, values in history.items()}

    def line(self, epoch: int, num_epochs: int, history: Mapping[str, list],
             validation_set_names: Optional[Sequence[str]] = None) -> str:
        """The summary of epoch ``epoch`` (0-based; shown 1-based) of ``num_epochs``, with every history entry
        recorded since :meth:`start`, except the plain ``val_`` names that repeat the first of several named
        validation sets (``validation_set_names``)."""
        seconds = time.monotonic() - self._start_time
        parts = [f"Epoch {epoch + 1}/{num_epochs}" if num_epochs > 0 else f"Epoch {epoch + 1}", f"{seconds:.1f}s"]
        recorded = [name for name, values in history.items() if len(values) > self._history_lengths.get(name, 0)]
        without_aliases = _without_first_set_aliases(recorded, validation_set_names)
        if self.shown is None:
            recorded = without_aliases
        else:  # a plain alias shows when asked for by its exact name
            recorded = [name for name in recorded if name in self.shown or (
                name in without_aliases and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.shown))]
        recorded.sort(key=lambda name: not name.startswith("accumulated_loss"))  # the training loss first, as Keras
        parts.extend(f"{name} {format_value(history[name][-1])}" for name in recorded)
        return " - ".join(parts)

    def warn_unmatched(self, history: Mapping[str, list]) -> None:
        """At the end of a fit: name the patterns that matched no entry of the history (a typo?), once each."""
        if self.shown is None:
            return
        unmatched = [pattern for pattern in self.shown if pattern not in self._warned
                     and not any(fnmatch.fnmatchcase(name, pattern) for name in history)]
        if unmatched:
            self._warned.update(unmatched)
            warnings.warn(f"epoch_line_metrics: {unmatched} matched no entry of the training history, so the epoch "
                          f"line never showed them; the history holds {sorted(history)}", UserWarning, stacklevel=2)

    def log(self, epoch: int, num_epochs: int, history: Mapping[str, list],
            validation_set_names: Optional[Sequence[str]] = None) -> None:
        """Log :meth:`line` at INFO on the ``aitoolbox.epochs`` logger."""
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", self.line(epoch, num_epochs, history, validation_set_names))


def _without_first_set_aliases(names: List[str], validation_set_names: Optional[Sequence[str]]) -> List[str]:
    """``names`` without each ``val_<x>`` (``train_end_val_<x>``) whose ``val_<first set>_<x>`` is among them."""
    if not validation_set_names:
        return names
    present = set(names)
    first = validation_set_names[0]

    def repeats_the_first_set(name: str) -> bool:
        for prefix in ("val_", "train_end_val_"):
            if name.startswith(prefix) and f"{prefix}{first}_{name[len(prefix):]}" in present:
                return True
        return False

    return [name for name in names if not repeats_the_first_set(name)]
