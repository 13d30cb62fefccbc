"""google-api-core's retry, with the jitter of its backoff drawn from a generator of its own.

google-api-core draws each wait between two tries from Python's global ``random``
(``exponential_sleep_generator``). The uploads run in background threads while training goes on, so every retry
would move the training's random stream (augmentations, samplers) at a moment that depends on the network, and a
run would no longer repeat, nor resume bitwise. :class:`PrivateJitterRetry` waits as google-api-core does, with
the same bounds, and draws from a ``random.Random`` it owns. Imported only once google-cloud-storage is (it needs
google-api-core).
"""
import functools
import random
from typing import Any, Callable, Iterator, Optional

from google.api_core.retry import Retry, retry_target

__all__ = ["PrivateJitterRetry"]


class PrivateJitterRetry(Retry):
    """A :class:`google.api_core.retry.Retry` whose waits come from its own ``random.Random``.

    It takes Retry's arguments. Each wait is drawn uniformly between 0 and a bound that starts at ``initial``,
    grows ``multiplier`` times per failure and stops at ``maximum`` (google-api-core's full jitter); tries go on
    until ``timeout`` seconds have passed. The copies made by ``with_delay``, ``with_timeout`` and
    ``with_predicate`` are of this class as well (google-api-core copies with ``type(self)``), each with its own
    generator.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Seeded from the operating system's entropy: nothing is read from, or written to, the global generator.
        self._jitter = random.Random()

    def __call__(self, func: Callable[..., Any], on_error: Optional[Callable[[Exception], Any]] = None
                 ) -> Callable[..., Any]:
        """``func`` wrapped to be retried per this policy (as :meth:`Retry.__call__`), sleeping this object's
        waits."""
        if self._on_error is not None:  # Retry's rule: the constructor's on_error wins
            on_error = self._on_error

        @functools.wraps(func)
        def retried(*args: Any, **kwargs: Any) -> Any:
            # The timeout positionally: google-api-core named it ``deadline`` before 2.17, ``timeout`` since.
            return retry_target(functools.partial(func, *args, **kwargs), self._predicate, self._waits(),
                                self._retry_timeout(), on_error=on_error)
        return retried

    def _waits(self) -> Iterator[float]:
        bound = min(self._initial, self._maximum)
        while True:
            yield self._jitter.uniform(0.0, bound)
            bound = min(bound * self._multiplier, self._maximum)

    def _retry_timeout(self) -> Optional[float]:
        # ``_timeout`` since google-api-core 2.17, ``_deadline`` before (both hold the same seconds).
        return getattr(self, "_timeout", getattr(self, "_deadline", None))
