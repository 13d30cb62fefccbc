"""One line per epoch, as Keras prints it: ``Epoch 3/10 - 2.1s - accumulated_loss 0.4123 - val_loss 0.4512``.

The line lists every metric the epoch recorded in the training history (the accumulated and evaluated losses,
and the metrics of performance callbacks), each to four significant digits. It goes to the logger
``aitoolbox.epochs`` at INFO. Where the application has configured no logging (a plain script, a notebook),
the line is printed to stdout anyway, above any progress bar; where it has, the line goes to the root logger's
handlers like any record, and respects the root logger's level. Silence it with
``logging.getLogger('aitoolbox.epochs').setLevel(logging.WARNING)``.
"""
import logging
import numbers
import sys
import time
from typing import Any, Dict, Mapping

import torch
from tqdm.auto import tqdm

EPOCH_LOGGER_NAME = "aitoolbox.epochs"


class _EpochLineHandler(logging.Handler):
    """Shows epoch lines whether or not the application configured logging, and never twice."""

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        if root.handlers:  # the application's logging setup decides
            if record.levelno >= root.getEffectiveLevel():
                root.handle(record)
            return
        try:
            tqdm.write(self.format(record), file=sys.stdout)  # tqdm.write keeps an open bar intact
        except Exception:  # a broken stdout must not stop training
            self.handleError(record)


def _epoch_logger() -> logging.Logger:
    epoch_logger = logging.getLogger(EPOCH_LOGGER_NAME)
    if not any(isinstance(handler, _EpochLineHandler) for handler in epoch_logger.handlers):
        epoch_logger.addHandler(_EpochLineHandler())
        epoch_logger.propagate = False  # the handler forwards to the application's handlers itself
        if epoch_logger.level == logging.NOTSET:
            epoch_logger.setLevel(logging.INFO)
    return epoch_logger


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

    def start(self, history: Mapping[str, list]) -> None:
        """At the start of an epoch: note the time and what the history holds already."""
        self._start_time = time.monotonic()
        self._history_lengths = {name: len(values) for name, values in history.items()}

    def line(self, epoch: int, num_epochs: int, history: Mapping[str, list]) -> str:
        """The summary of epoch ``epoch`` (0-based; shown 1-based) of ``num_epochs``, with every history entry
        recorded since :meth:`start`."""
        seconds = time.monotonic() - self._start_time
        parts = [f"Epoch {epoch + 1}/{num_epochs}" if num_epochs > 0 else f"Epoch {epoch + 1}", f"{seconds:.1f}s"]
        recorded = [name for name, values in history.items() if len(values) > self._history_lengths.get(name, 0)]
        recorded.sort(key=lambda name: not name.startswith("accumulated_loss"))  # the training loss first, as Keras
        parts.extend(f"{name} {format_value(history[name][-1])}" for name in recorded)
        return " - ".join(parts)

    def log(self, epoch: int, num_epochs: int, history: Mapping[str, list]) -> None:
        """Log :meth:`line` at INFO on the ``aitoolbox.epochs`` logger."""
        epoch_logger = _epoch_logger()
        if epoch_logger.isEnabledFor(logging.INFO):
            epoch_logger.info("%s", self.line(epoch, num_epochs, history))
