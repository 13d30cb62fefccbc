"""BackgroundSender: the order of the calls, retries of passing failures (reported once), refusals, the bound of
the queue, waiting and stopping. The calls are plain functions that block on events the test sets, so nothing
depends on timing."""
import logging
import threading
import time

import pytest

from aitoolbox.torchtrain.callbacks.background import BackgroundSender

HANG_LIMIT_S = 120.0


class Passing(Exception):
    """A failure worth trying again."""


@pytest.fixture
def records(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.INFO, logger="aitoolbox")
    return caplog


def make_sender(**options) -> BackgroundSender:
    return BackgroundSender("Test", "the test service", lambda error: isinstance(error, Passing),
                            retry_delays_s=(0.01,), **options)


def warnings(caplog, level="WARNING") -> list:
    return [record.getMessage() for record in caplog.records if record.levelname == level]


def test_calls_run_in_order_and_a_passing_failure_is_retried_and_reported_once(records):
    sender, done, tries = make_sender(), [], []

    def flaky():
        tries.append(1)
        if len(tries) < 4:
            raise Passing("connection refused")
        done.append("flaky")

    sender.submit("the flaky call", flaky)
    sender.submit("the second call", lambda: done.append("second"))
    assert sender.wait(HANG_LIMIT_S) and sender.unsent() == []
    assert done == ["flaky", "second"] and len(tries) == 4
    (report, recovered) = warnings(records)
    assert "could not send the flaky call to the test service (Passing: connection refused)" in report
    assert "answers again after 3 failed tries" in recovered


def test_a_refusal_is_an_error_and_the_next_call_goes_on(records):
    sender, done = make_sender(), []

    def refused():
        raise ValueError("bad request")

    sender.submit("the refused call", refused)
    sender.submit("the next call", lambda: done.append("next"))
    assert sender.wait(HANG_LIMIT_S)
    assert done == ["next"]
    (error,) = warnings(records, "ERROR")
    assert "the test service refused the refused call, which is dropped: bad request" in error


def test_the_queue_is_bounded_a_keyed_call_waits_once_and_stop_drops_the_rest(records):
    sender, release, started, done = make_sender(max_queued=3), threading.Event(), threading.Event(), []

    def blocked():
        started.set()
        release.wait(HANG_LIMIT_S)
        done.append("blocked")

    sender.submit("the blocked call", blocked)
    assert started.wait(HANG_LIMIT_S)
    sender.submit("flush", lambda: done.append("flush"), key="flush")
    sender.submit("flush", lambda: done.append("flush again"), key="flush")  # one is waiting already
    sender.submit("call 1", lambda: done.append(1))
    sender.submit("call 2", lambda: done.append(2))  # the queue is full: the oldest waiting (flush) goes
    assert sender.unsent() == ["the blocked call", "call 1", "call 2"] and sender.dropped == 1
    assert len([text for text in warnings(records) if "dropped the oldest (flush)" in text]) == 1
    assert not sender.wait(0)

    sender.stop()
    assert sender.wait(0) and sender.unsent() == []  # dropped at once, the call in progress included
    sender.submit("late", lambda: done.append("late"))  # a stopped sender takes nothing more
    release.set()
    for thread in threading.enumerate():
        if thread.name == "Test sender":
            thread.join(HANG_LIMIT_S)
    assert done == ["blocked"]  # the call in progress finished; nothing after it ran


def test_wait_cuts_a_pause_between_tries_short():
    sender, tries = BackgroundSender("Test", "the test service", lambda error: True, retry_delays_s=(3600.0,)), []
    failed = threading.Event()

    def second_try_works():
        tries.append(1)
        if len(tries) == 1:
            failed.set()
            raise Passing("timeout")

    sender.submit("the call", second_try_works)
    assert failed.wait(HANG_LIMIT_S)  # the sender now pauses for an hour before the next try
    assert sender.wait(HANG_LIMIT_S) and len(tries) == 2


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_queued must be a positive int, got 0"):
        make_sender(max_queued=0)


def test_pause_ends_the_thread_keeps_the_calls_and_sending_resumes_on_one_thread(records):
    sender, started, release, done = make_sender(), threading.Event(), threading.Event(), []
    outage = [True]

    def blocking():
        started.set()
        assert release.wait(HANG_LIMIT_S)
        done.append("blocking")

    def while_down():
        if outage[0]:
            raise Passing("connection refused")
        done.append("after the outage")

    sender.submit("the blocking call", blocking)
    sender.submit("the call during the outage", while_down)
    assert started.wait(HANG_LIMIT_S)
    sender.pause()  # in the middle of a call: the thread ends after it
    assert not sender.join(0.05) and sender.running
    release.set()
    assert sender.join(HANG_LIMIT_S) and not sender.running
    assert sender.unsent() == ["the call during the outage"] and done == ["blocking"]  # kept, not tried

    sender.submit("the last call", lambda: done.append("last"))  # sending starts again
    deadline = time.monotonic() + HANG_LIMIT_S
    while sender.failures < 2:  # tries while down; then a pause between tries ends the thread at once
        assert time.monotonic() < deadline, "the kept call was not tried again"
        time.sleep(0.01)
    sender.pause()
    assert sender.join(HANG_LIMIT_S)
    assert [name for name in (thread.name for thread in threading.enumerate()) if name == "Test sender"] == []
    outage[0] = False
    assert sender.wait(HANG_LIMIT_S) and done == ["blocking", "after the outage", "last"]
    assert sender.join(HANG_LIMIT_S)  # an empty queue ends the thread too
    assert len([message for message in warnings(records) if "could not send" in message]) == 1
