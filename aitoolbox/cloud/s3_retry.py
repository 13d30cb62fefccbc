"""botocore's retries, with the jitter of their backoff drawn from a generator of their own.

botocore's ``'standard'`` and ``'adaptive'`` retry modes wait ``random.random() * bound`` between two tries, with
``random.random`` of Python's global generator bound when botocore was imported. The uploads run in background
threads while training goes on, so every retry would move the training's random stream (augmentations, samplers)
at a moment that depends on the network, and a run would no longer repeat, nor resume bitwise.

:func:`use_private_jitter` gives one client a retry handler built by botocore itself
(``botocore.retries.standard.register_retry_handler``: the same conditions, quota, throttling detection and
backoff bounds as the one botocore registered) whose backoff draws from a ``random.Random`` of its own, and puts it
in the place of botocore's. Where botocore is laid out otherwise, the client keeps botocore's handler and a
warning says that its retries draw from the global generator.

botocore's ``'legacy'`` mode, its default when the configuration names none, draws its waits from the global
generator through a module-level function that cannot be given another: :func:`configured_retries` gives a client
built without a :class:`~aitoolbox.cloud.errors.RetryPolicy` (the SES client of e-mail notifications) the user's
retry settings in ``'standard'`` mode instead.
"""
import random
import sys
import warnings
from typing import Any, Dict

__all__ = ["configured_retries", "use_private_jitter"]

_MODES = ("standard", "adaptive")  # 'adaptive' adds a rate limiter to 'standard''s handler, and draws nothing


def use_private_jitter(client: Any, max_attempts: int) -> bool:
    """Make ``client``'s retries draw their waits from a generator of their own, not from Python's global one.

    Args:
        client: a botocore client made in ``'standard'`` or ``'adaptive'`` retry mode.
        max_attempts: how many times a request is tried in all (the client's ``total_max_attempts``).

    Returns:
        True when the client's handler was replaced. False, with a warning, when botocore is not laid out as
        expected (the client keeps botocore's handler, which works as before); False, silently, for a client in
        another retry mode (botocore's ``'legacy'``, which :class:`~aitoolbox.cloud.errors.RetryPolicy` never
        sets).
    """
    try:
        if client.meta.config.retries.get("mode") not in _MODES:
            return False
        from botocore.retries import standard
        event = client.meta.service_model.service_id.hyphenize()
        # Built as botocore builds it. Its needs-retry registration is skipped (the unique id is taken by
        # botocore's handler); its after-call one releases this handler's retry quota.
        handler = standard.register_retry_handler(client, max_attempts=max_attempts)
        backoff = handler._retry_policy._retry_backoff
        if not isinstance(backoff, standard.ExponentialBackoff) or not callable(backoff._random):
            raise AttributeError(f"unexpected backoff {backoff!r}")
    except (ImportError, AttributeError, TypeError) as error:
        version = getattr(sys.modules.get("botocore"), "__version__", "?")
        warnings.warn(f"botocore {version} is not laid out as aitoolbox expects ({error}): its retries keep drawing "
                      "their waits from Python's global random, so a request retried while training runs moves the "
                      "training's random stream", RuntimeWarning, stacklevel=2)
        return False
    backoff._random = random.Random().random  # seeded from the operating system, not from the global generator
    unique_id = f"retry-config-{event}"  # botocore's id for its handler
    client.meta.events.unregister(f"needs-retry.{event}", unique_id=unique_id)
    # First, where botocore's was: before the handlers registered after it (S3's region redirector).
    client.meta.events.register_first(f"needs-retry.{event}", handler.needs_retry, unique_id=unique_id)
    return True


def configured_retries(session: Any, default_attempts: int) -> Dict[str, Any]:
    """The ``retries`` of a botocore ``Config`` keeping what the user's AWS configuration says, in a mode whose
    waits :func:`use_private_jitter` can draw from a generator of their own.

    Args:
        session: the ``botocore.session.Session`` the client is made from (it reads ``AWS_RETRY_MODE`` and
            ``AWS_MAX_ATTEMPTS``, or ``retry_mode`` and ``max_attempts`` of the profile in ``~/.aws/config``).
        default_attempts: how many times a request is tried in all when the configuration does not say.

    Returns:
        ``{'mode': ..., 'total_max_attempts': ...}``: the configured mode when it is ``'standard'`` or
        ``'adaptive'``; ``'standard'`` when it is ``'legacy'`` (botocore's default), which retries the same errors
        and more; any other mode as it is given, for botocore's ``Config`` to refuse it
        (``InvalidRetryModeError``), as it does for the user's own clients: botocore matches the mode exactly
        (``'Adaptive'`` is refused), and so does this, never running in another mode than the one configured.
        The configured number of attempts, else ``default_attempts``.
    """
    mode = session.get_config_variable("retry_mode")
    attempts = session.get_config_variable("max_attempts")
    return {"mode": "standard" if mode in (None, "legacy") else mode,
            "total_max_attempts": int(attempts) if attempts is not None else default_attempts}
