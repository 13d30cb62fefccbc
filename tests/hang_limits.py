"""Waiting in tests without timing anything: a call or a condition gets a generous hang limit, and a test fails
only when the limit is reached (a hang), never because something was slow on a busy machine."""
import threading
import time

HANG_LIMIT_S = 120.0


def fit_within_hang_limit(tl, waits_on: str = "a service", **fit_arguments) -> None:
    """``tl.fit(...)`` in a thread; fails the test if it has not returned within :data:`HANG_LIMIT_S` (naming what
    it must be waiting on) and re-raises what ``fit`` raised."""
    errors = []

    def fit():
        try:
            tl.fit(**fit_arguments)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(HANG_LIMIT_S)
    assert not thread.is_alive(), f"fit did not return within {HANG_LIMIT_S} s: it waits on {waits_on}"
    if errors:
        raise errors[0]


def wait_until(condition, what: str) -> None:
    """Poll ``condition()`` until it is true; fail after :data:`HANG_LIMIT_S` saying what never happened."""
    deadline = time.monotonic() + HANG_LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {HANG_LIMIT_S} s"
        time.sleep(0.05)


def log_messages(caplog, text: str, level: str = "WARNING") -> list:
    """The captured log messages of ``level`` that contain ``text``."""
    return [record.getMessage() for record in caplog.records if record.levelname == level
            and text in record.getMessage()]
