"""Progress bars for training and evaluation, cheap enough for tiny models."""
import time
from typing import Iterable, Optional

from tqdm.auto import tqdm

POSTFIX_INTERVAL_S = 0.5


class ProgressBar:
    """A tqdm bar (terminal or Jupyter widget via ``tqdm.auto``) whose postfix updates are throttled.

    Reading the running loss forces a device synchronisation, so it is read at most every
    ``POSTFIX_INTERVAL_S`` seconds instead of every batch.

    Args:
        total: number of steps, if known.
        description: the text left of the bar.
        enabled: False makes every method a no-op.
        leave: keep the finished bar on screen.
    """

    def __init__(self, total: Optional[int], description: str, enabled: bool, leave: bool = True):
        self._bar = tqdm(total=total, desc=description, leave=leave, dynamic_ncols=True) if enabled else None
        self._last_postfix_time = 0.0

    def update(self, postfix_fn=None) -> None:
        """Advance by one step; ``postfix_fn()`` returns the postfix dict and is called only when due."""
        if self._bar is None:
            return
        if postfix_fn is not None:
            now = time.monotonic()
            if now - self._last_postfix_time >= POSTFIX_INTERVAL_S:
                self._last_postfix_time = now
                self._bar.set_postfix(postfix_fn(), refresh=False)
        self._bar.update(1)

    def set_postfix(self, postfix: dict) -> None:
        """Show a final postfix now (e.g. the epoch's mean loss)."""
        if self._bar is not None:
            self._bar.set_postfix(postfix)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def iterate_with_progress(iterable: Iterable, total: Optional[int], description: str, enabled: bool):
    """Yield from ``iterable`` while advancing a transient progress bar."""
    bar = ProgressBar(total, description, enabled, leave=False)
    try:
        for item in iterable:
            yield item
            bar.update()
    finally:
        bar.close()
