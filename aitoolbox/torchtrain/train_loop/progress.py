"""Progress bars for training and evaluation, cheap enough for tiny models.

An epoch shows one bar for its training and at most one for its evaluation: inside
:meth:`EvaluationProgress.shared` (the epoch's end: the loop's losses and the callbacks' predictions) every
evaluation pass reuses one transient bar, whose description names the pass running. A pass elsewhere (a
``predict_on_test_set()`` after training) shows a transient bar of its own.

``tqdm.auto`` draws text bars in a terminal and widgets in Jupyter (with ipywidgets installed:
``pip install 'aitoolbox[notebook]'``). A transient bar (``leave=False``, the evaluation bars) vanishes when it
closes; in a notebook tqdm only hides the widget, and the saved ``.ipynb`` would keep its output (a stale
"0%" bar) and its widget models. There the bar is shown under a display id instead: at close its output is
emptied and all its widgets are closed, so the saved notebook holds nothing of it.

Where the output is neither a terminal nor a notebook (stderr redirected to a file or a pipe: a batch job's log),
every redraw would stay in the file as a line of its own. There the transient bars are not drawn at all (a
terminal would wipe them anyway) and the epoch's bar is redrawn at most every ``LOG_FILE_INTERVAL_S`` seconds.
"""
import contextlib
import sys
import time
from typing import Any, Iterable, Iterator, Optional

from tqdm.auto import tqdm

POSTFIX_INTERVAL_S = 0.5
# Steps are handed to tqdm at most this often: tqdm's own update costs microseconds, which a tiny model's
# batch notices, and it redraws no more often than every 0.1 s anyway.
DRAW_INTERVAL_S = 0.05
# The clock is read about this many times a draw interval (at the pace of the steps before the last draw), not at
# every step: reading it costs a tiny model's batch too. A draw comes at most an eighth of an interval late while the
# pace holds. (Before the second draw the pace is unknown: the steps between two reads double.)
CLOCK_READS_PER_DRAW = 8
# A bar written to a file or pipe (not a terminal) redraws at most this often: a line in a job's log each time.
LOG_FILE_INTERVAL_S = 30.0


def writes_to_terminal() -> bool:
    """True when stderr, where tqdm draws, is a terminal (False for a file, a pipe or a closed stream)."""
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def draws_widgets(bar_class: type = tqdm) -> bool:
    """True when ``bar_class`` (by default the bar ``tqdm.auto`` chose) draws Jupyter widgets."""
    # tqdm.auto imports tqdm.notebook only when it picks it: without that module no bar draws widgets.
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(bar_class, notebook.tqdm_notebook)


def _close_widget_tree(widget: Any) -> None:
    """Close a widget with its children, layouts and styles, so that no model of it stays in the kernel
    (nor in the widget state saved with the notebook)."""
    for child in getattr(widget, "children", ()):
        _close_widget_tree(child)
    for part in ("layout", "style"):
        sub_widget = getattr(widget, part, None)
        if callable(getattr(sub_widget, "close", None)):
            sub_widget.close()
    widget.close()


class ProgressBar:
    """A tqdm bar (terminal or Jupyter widget via ``tqdm.auto``) whose postfix updates are throttled.

    Reading the running loss forces a device synchronisation, so it is read at most every
    ``POSTFIX_INTERVAL_S`` seconds instead of every batch.

    Args:
        total: number of steps, if known.
        description: the text left of the bar.
        enabled: False makes every method a no-op.
        leave: keep the finished bar on screen; False removes it at :meth:`close` (in a notebook also from
            the cell's saved output).
    """

    def __init__(self, total: Optional[int], description: str, enabled: bool, leave: bool = True):
        self._bar = None
        self._display = None  # the display handle of a transient notebook bar
        self._last_postfix_time = 0.0
        self._pending_steps = 0  # steps not yet handed to tqdm
        self._next_draw_time = 0.0
        self._last_draw_time: Optional[float] = None
        # update reads the clock once _pending_steps reaches _next_check, then every _check_every steps until a draw
        self._next_check = 1
        self._check_every = 1
        self._paced = False  # _check_every comes from the pace between two draws
        if not enabled:
            return
        widgets = draws_widgets()
        if not widgets and not writes_to_terminal():
            if leave:
                self._bar = tqdm(total=total, desc=description, leave=True, dynamic_ncols=True,
                                 mininterval=LOG_FILE_INTERVAL_S, maxinterval=LOG_FILE_INTERVAL_S)
            return  # a transient bar in a log file is only noise (its last state would stay there)
        if leave or not widgets:
            self._bar = tqdm(total=total, desc=description, leave=leave, dynamic_ncols=True)
            return
        from IPython.display import display  # present wherever tqdm draws widgets
        self._bar = tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, display=False)
        self._display = display(self._bar.container, display_id=True)

    def update(self, postfix_fn=None) -> None:
        """Advance by one step; ``postfix_fn()`` returns the postfix dict and is called only when due."""
        self._pending_steps += 1
        if self._pending_steps >= self._next_check:  # (runs for every batch: a count, no clock)
            self._draw_if_due(postfix_fn)

    def _draw_if_due(self, postfix_fn) -> None:
        """Hand the pending steps to tqdm if ``DRAW_INTERVAL_S`` has passed since the last time (with the postfix,
        if ``POSTFIX_INTERVAL_S`` has), and plan the next clock read: after the steps of a ``CLOCK_READS_PER_DRAW``-th
        of an interval at the pace since the last draw."""
        if self._bar is None:  # disabled, not drawn (a transient bar in a log file) or closed: no clock read again
            self._next_check = float("inf")
            return
        now = time.monotonic()
        if now < self._next_draw_time:
            if not self._paced:  # until the second draw, the pace is unknown: twice as many steps to the next read
                self._check_every *= 2
            self._next_check = self._pending_steps + self._check_every
            return
        self._next_draw_time = now + DRAW_INTERVAL_S
        if postfix_fn is not None and now - self._last_postfix_time >= POSTFIX_INTERVAL_S:
            self._last_postfix_time = now
            self._bar.set_postfix(postfix_fn(), refresh=False)
        self._bar.update(self._pending_steps)
        if self._last_draw_time is not None:  # (a draw is DRAW_INTERVAL_S or more after the last: no zero division)
            pace = self._pending_steps / max(now - self._last_draw_time, 1e-9)  # steps a second
            self._check_every = max(1, int(pace * DRAW_INTERVAL_S / CLOCK_READS_PER_DRAW))
            self._paced = True
        self._last_draw_time = now
        self._pending_steps = 0
        self._next_check = self._check_every

    def restart(self, total: Optional[int], description: str) -> None:
        """Show another pass on the same bar: back to zero, with a new total and description."""
        if self._bar is None:
            return
        self._pending_steps = 0
        self._next_draw_time = 0.0
        self._last_draw_time, self._check_every, self._next_check, self._paced = None, 1, 1, False
        self._bar.reset(total=total)
        self._bar.set_description(description, refresh=False)

    def set_postfix(self, postfix: dict) -> None:
        """Show a final postfix (e.g. the epoch's mean loss): now, or with the steps still to show at
        :meth:`close` if there are any."""
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=self._pending_steps == 0)

    def close(self) -> None:
        """Finish the bar (a transient one disappears); calling it again does nothing."""
        bar, self._bar = self._bar, None
        if bar is None:
            return
        if self._pending_steps:
            bar.update(self._pending_steps)
            self._pending_steps = 0
        bar.close()
        if self._display is not None:
            # Also after an interrupted pass (tqdm would leave a red bar): a transient bar never stays.
            self._display.update({}, raw=True)
            self._display = None
            _close_widget_tree(bar.container)


def iterate_with_progress(iterable: Iterable, total: Optional[int], description: str, enabled: bool):
    """Yield from ``iterable`` while advancing a transient progress bar (removed when the iteration ends)."""
    bar = ProgressBar(total, description, enabled, leave=False)
    try:
        for item in iterable:
            yield item
            bar.update()
    finally:
        bar.close()


class EvaluationProgress:
    """The bars of evaluation passes: one transient bar per pass, or inside :meth:`shared` one bar for them all."""

    def __init__(self):
        self._title: Optional[str] = None  # set inside shared(): passes then show on one bar
        self._enabled = False
        self._bar: Optional[ProgressBar] = None

    def __getstate__(self) -> dict:
        return {"_title": None, "_enabled": False, "_bar": None}  # a bar never travels to another process

    @contextlib.contextmanager
    def shared(self, title: str, enabled: bool) -> Iterator[None]:
        """Within the block every evaluation pass shows on one transient bar, ``<title>: <pass>``, made at the first
        pass (none without one) and closed when the block ends."""
        self._title, self._enabled = title, enabled
        try:
            yield
        finally:
            bar, self._bar, self._title = self._bar, None, None
            if bar is not None:
                bar.close()

    def iterate(self, iterable: Iterable, total: Optional[int], description: str, enabled: bool):
        """Yield from ``iterable`` while advancing the pass's bar."""
        if self._title is None:
            yield from iterate_with_progress(iterable, total, description, enabled)
            return
        description = f"{self._title}: {description}"
        if self._bar is None:
            self._bar = ProgressBar(total, description, self._enabled and enabled, leave=False)
        else:
            self._bar.restart(total, description)
        for item in iterable:
            yield item
            self._bar.update()
