"""Network calls of the tracking and notification callbacks, made on a thread of their own.

A callback that talks to a service (MLflow, SES) hands each call to a :class:`BackgroundSender` instead of making
it in a hook, so a slow or unreachable service never holds up the training thread. The sender runs the calls
one at a time, in the order they were handed over:

- a call that fails for a passing reason (no connection, a timeout, the service busy) stays at the head of the
  queue, with its data, and is tried again after a growing pause (1 s, 2 s, 4 s, ... up to a minute); the outage
  is reported once, when it starts, and once more when the service answers again;
- a call the service refuses (a bad request, no permission) is logged as an error and dropped: trying it again
  would be refused again;
- the queue holds at most ``max_queued`` calls; when it is full the oldest waiting call is dropped, with a
  warning, so that memory stays bounded however long the service is away;
- :meth:`BackgroundSender.wait` waits a bounded time for the queue to empty (the callbacks call it at the end of
  ``fit``), and :meth:`BackgroundSender.unsent` names what is still queued;
- :meth:`BackgroundSender.pause` ends the thread after the call it is making and keeps the queue: the next
  :meth:`~BackgroundSender.submit` or :meth:`~BackgroundSender.wait` starts a thread again and sends what was
  kept. A callback that pauses at the end of each ``fit`` holds no thread between fits, however many fits (or
  callbacks) a script makes while the service is down.

The thread is a daemon, so it never keeps the process alive. Error texts are logged through
:func:`~aitoolbox.experiment.redaction.redact_message`: a service's error that quotes a URL with a user name and
password (MLflow's does) never puts the password into the log.
"""
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional

from aitoolbox.experiment.redaction import redact_message

logger = logging.getLogger(__name__)

#: The pauses between tries of a call that keeps failing for a passing reason; the last one repeats.
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)


@dataclass
class _Call:
    description: str
    function: Callable[[], Any]
    key: Optional[str]


class BackgroundSender:
    """Run a callback's network calls, in order, on one daemon thread.

    Args:
        owner: who sends, for messages (``'MLflowTracking'``).
        service: what is called, for messages (``'the MLflow tracking server at http://...'``).
        is_transient: tells a failure worth trying again (no connection, a timeout) from a refusal.
        max_queued: the most calls waiting at once; when it is reached the oldest waiting call is dropped.
        retry_delays_s: the pauses between tries of a call that fails for a passing reason; the last repeats.
    """

    def __init__(self, owner: str, service: str, is_transient: Callable[[BaseException], bool],
                 max_queued: int = 1000, retry_delays_s: tuple = RETRY_DELAYS_S):
        if not isinstance(max_queued, int) or isinstance(max_queued, bool) or max_queued < 1:
            raise ValueError(f"max_queued must be a positive int, got {max_queued!r}")
        self.owner, self.service = owner, service
        self.is_transient = is_transient
        self.max_queued = max_queued
        self.retry_delays_s = tuple(retry_delays_s)
        self.pid = os.getpid()  # a forked process must make its own sender: the thread stays in the parent
        self.dropped = 0
        self._calls: Deque[_Call] = deque()
        self._condition = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._failures = 0  # consecutive passing failures of the call at the head
        self._retry_now = False
        self._stopped = False
        self._paused = False

    # --- the training thread's side ----------------------------------------------------------------------------
    def submit(self, description: str, function: Callable[[], Any], key: Optional[str] = None) -> None:
        """Queue ``function`` to be called on the sender's thread.

        Args:
            description: what the call sends, for messages (``'the run's parameters'``).
            function: makes the call; raises on failure.
            key: when a call with this key is already waiting (not started), this one is not queued: the waiting
                one sends what this one would (a call that sends whatever a buffer holds at the time).
        """
        with self._condition:
            if self._stopped:
                return
            if key is not None and any(call.key == key for call in self._waiting()):
                return
            if len(self._calls) >= self.max_queued:
                self._drop_oldest_waiting()
            self._calls.append(_Call(description, function, key))
            self._resume()
            self._condition.notify_all()

    def _resume(self) -> None:
        # Under the condition: sending goes on, on the thread there is or on a new one (never two).
        self._paused = False
        if self._thread is None and self._calls and not self._stopped:
            self._thread = threading.Thread(target=self._run, name=f"{self.owner} sender", daemon=True)
            self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait until every queued call is done (sent, or refused and dropped), at most ``timeout_s`` seconds.

        A call pausing between tries is tried again at once; after :meth:`pause`, sending starts again. Returns
        True when nothing is left.
        """
        with self._condition:
            self._resume()
            self._retry_now = True
            self._condition.notify_all()
            try:
                return self._condition.wait_for(lambda: not self._calls, timeout=timeout_s)
            finally:
                self._retry_now = False

    def unsent(self) -> List[str]:
        """The descriptions of the calls not done yet, oldest first (the one in progress included)."""
        with self._condition:
            return [call.description for call in self._calls]

    @property
    def failures(self) -> int:
        """How many times in a row the call at the head of the queue failed for a passing reason (0: none)."""
        with self._condition:
            return self._failures

    def pause(self) -> None:
        """End the thread after the call it is making (or at once, between tries), keeping every queued call:
        the next :meth:`submit` or :meth:`wait` sends them. See :meth:`join`."""
        with self._condition:
            self._paused = True
            self._condition.notify_all()

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for the thread to end (after :meth:`pause` or :meth:`stop`, or once
        the queue is empty). Returns True when no thread runs. A thread in the middle of a call ends when the
        service's client returns from it (its own timeouts bound that), without another try."""
        with self._condition:
            return self._condition.wait_for(lambda: self._thread is None, timeout=timeout_s)

    @property
    def running(self) -> bool:
        """Whether the sender's thread exists now."""
        with self._condition:
            return self._thread is not None

    def stop(self) -> None:
        """Drop every queued call; the thread ends after the call it is making, whose outcome is ignored."""
        with self._condition:
            self._stopped = True
            self._calls.clear()
            self._condition.notify_all()

    # --- the sender's thread ---------------------------------------------------------------------------------
    def _waiting(self) -> List[_Call]:
        # The head call may be in progress on the thread: only the ones behind it are waiting for sure.
        return list(self._calls)[1:] if self._thread is not None else list(self._calls)

    def _drop_oldest_waiting(self) -> None:
        waiting = self._waiting()
        victim = waiting[0] if waiting else self._calls[0]
        self._calls.remove(victim)
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 100 == 0:
            logger.warning("%s: %d calls are waiting for %s, the most it keeps; dropped the oldest (%s), %d dropped "
                           "so far", self.owner, self.max_queued, self.service, victim.description, self.dropped)

    def _run(self) -> None:
        while True:
            with self._condition:
                if self._stopped or self._paused or not self._calls:
                    self._thread = None
                    self._condition.notify_all()
                    return
                call = self._calls[0]
            try:
                call.function()
            except Exception as error:  # noqa: BLE001 - a failure is reported, never raised into training
                if not self._failed(call, error):
                    continue
            else:
                self._succeeded()
            with self._condition:
                if self._calls and self._calls[0] is call:
                    self._calls.popleft()
                self._condition.notify_all()

    def _succeeded(self) -> None:
        with self._condition:
            failures, self._failures = self._failures, 0
            stopped = self._stopped
        if failures and not stopped:
            logger.warning("%s: %s answers again after %d failed tries; sending what was kept", self.owner,
                           self.service, failures)

    def _failed(self, call: _Call, error: BaseException) -> bool:
        """Report the failure; returns True when the call is dropped, False when it is to be tried again."""
        with self._condition:
            if self._stopped:
                return True
        if not self.is_transient(error):
            logger.error("%s: %s refused %s, which is dropped: %s", self.owner, self.service, call.description,
                         redact_message(str(error)))
            return True
        with self._condition:
            self._failures += 1
            failures = self._failures
            delay = self.retry_delays_s[min(failures, len(self.retry_delays_s)) - 1]
        if failures == 1:  # once per outage: each retry would repeat the same message
            logger.warning("%s: could not send %s to %s (%s: %s). Training goes on; what is not sent is kept and "
                           "tried again in the background (this is reported once, until it gets through)",
                           self.owner, call.description, self.service, type(error).__name__,
                           redact_message(str(error)))
        with self._condition:
            self._condition.wait_for(lambda: self._stopped or self._paused or self._retry_now, timeout=delay)
            self._retry_now = False
        return False
