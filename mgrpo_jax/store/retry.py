"""Retry with exponential back-off for transient store errors, and polling for readers that wait."""

from __future__ import annotations

import dataclasses
import errno
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# TensorStore raises ValueError whose message starts with the absl status code name.
_TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")
_TRANSIENT_MARKERS = ("CURL error", "Connection reset", "Could not connect", "Timeout was reached")
# gcsfs (listing on GCS) raises aiohttp's connection errors once its own retries are spent; they derive from
# OSError, not ConnectionError. Matched by class name so that this module needs no aiohttp import.
_TRANSIENT_CLASSES = frozenset({"ClientConnectionError", "ServerDisconnectedError", "ServerTimeoutError"})
_TRANSIENT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
                               errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH})
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: service unavailable, deadlines, throttling, dropped connections.

    Covers TensorStore's status errors, connection errors (refused while a store server restarts, reset),
    aiohttp's client connection errors and gcsfs's HTTP errors with a retryable status.
    """
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_CLASSES for cls in type(exc).__mro__):
        return True
    if type(exc).__name__ == "HttpError" and getattr(exc, "code", None) in _TRANSIENT_HTTP:
        return True
    text = str(exc)
    return text.startswith(_TRANSIENT_CODES) or any(m in text for m in _TRANSIENT_MARKERS)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off for transient errors: ``initial_s · multiplier^n`` (capped, jittered).

    Gives up after ``max_attempts`` tries or once ``deadline_s`` seconds have passed since the first try,
    whichever comes first. With the defaults the deadline binds (30 attempts would take ~55 s), so an
    operation rides out a store outage of about half a minute (tests/store/test_faults.py stops the GCS
    emulator mid-run and restarts it).
    """

    max_attempts: int = 30
    initial_s: float = 0.05
    max_delay_s: float = 2.0
    multiplier: float = 2.0
    deadline_s: float = 30.0

    def __post_init__(self):
        if self.max_attempts < 1 or self.initial_s < 0 or self.max_delay_s < 0 or self.multiplier < 1:
            raise ValueError(f"invalid RetryPolicy {self}")

    def delays(self):
        delay = self.initial_s
        while True:
            yield min(delay, self.max_delay_s) * random.uniform(0.8, 1.0)
            delay *= self.multiplier


@dataclasses.dataclass(frozen=True)
class PollPolicy:
    """How readers poll while waiting: first after ``initial_s``, then × ``multiplier`` up to ``max_s``."""

    initial_s: float = 0.01
    max_s: float = 0.5
    multiplier: float = 1.6

    def __post_init__(self):
        if self.initial_s <= 0 or self.max_s < self.initial_s or self.multiplier < 1:
            raise ValueError(f"invalid PollPolicy {self}")


def call_with_retry(
    fn: Callable[[], T], policy: RetryPolicy, on_giveup: Callable[[BaseException, int], Exception],
    retryable: Callable[[BaseException], bool] = is_transient,
    wait_hint: Callable[[BaseException], float | None] | None = None,
):
    """Calls ``fn`` until it succeeds, retrying the errors ``retryable`` accepts (transient store errors by
    default); ``on_giveup(exc, n)`` builds the error. ``wait_hint(exc)``: how long the failed service asked to
    be left alone (an HTTP ``Retry-After``), waited instead of the back-off's delay when longer."""
    start = time.monotonic()
    delays = policy.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            if not retryable(exc):
                raise on_giveup(exc, attempt) from exc
            delay = next(delays)
            hint = wait_hint(exc) if wait_hint is not None else None
            if hint is not None:
                delay = max(delay, hint)
            out_of_time = time.monotonic() - start + delay > policy.deadline_s
            if attempt >= policy.max_attempts or out_of_time:
                raise on_giveup(exc, attempt) from exc
            time.sleep(delay)


def poll_until(check: Callable[[], T | None], timeout_s: float, poll: PollPolicy) -> T | None:
    """Calls ``check`` until it returns something other than None or ``timeout_s`` passes (returns None).

    ``check`` always runs at least once, and once more right at the deadline.
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    delay = poll.initial_s
    while True:
        result = check()
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * poll.multiplier, poll.max_s)
