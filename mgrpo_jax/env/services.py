"""The one HTTP client behind every web service a run may call: search, the page reader and the LLM judge.

`ServiceClient` sends GET and JSON POST requests with a socket timeout per attempt, and retries what a later attempt
may fix (refused or dropped connections, timeouts, HTTP 408/429/5xx, and replies its caller's `read` rejects as
malformed) with jittered exponential back-off (`mgrpo_jax.store.retry`). A retryable status with a `Retry-After`
header (seconds or an HTTP-date) waits that long instead when it is longer, at most `RETRY_AFTER_MAX_S`: a
throttled endpoint is not hammered on the client's own clock, and one that asks for an hour does not stall the
run for it (the attempts and the deadline still bound the whole). A service that stays unavailable raises
`ServiceError`, naming the service, its URL without query or credentials, the last failure and the attempts made.
Other HTTP statuses are returned for the caller to interpret (a reader's 404: no such page).

The API key is sent only as an `Authorization: Bearer` header: it is never part of a message, a log line, a metric
or the client's `repr`. `api_key_from_env` reads it from the environment variable a config names, so configs and
checkpoints never hold it.

`ChatEndpoint` is an OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, a hosted API) on that client.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mgrpo_jax.store.retry import RetryPolicy, call_with_retry, is_transient

T = TypeVar("T")
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
DEFAULT_RETRY = RetryPolicy(max_attempts=4, initial_s=1.0, max_delay_s=16.0, deadline_s=600.0)
RETRY_AFTER_MAX_S = 60.0

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A web service could not serve a request: unavailable after retries, or an answer its caller cannot use."""


class MalformedReply(ValueError):
    """A reply a caller's `read` cannot use although the status was fine; retried like a 5xx."""


class _RetryableStatus(Exception):
    def __init__(self, status: int, retry_after_s: float | None = None):
        super().__init__(f"HTTP {status}")
        self.retry_after_s = retry_after_s


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """The wait a `Retry-After` header value asks for, in seconds, capped at `RETRY_AFTER_MAX_S`: delay-seconds, or
    an HTTP-date (a date in the past: 0); None when absent or unreadable (the back-off's own delay applies)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            date = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if date.tzinfo is None:  # RFC 9110 dates are GMT; a zone-less one is read as such
            return None
        seconds = date.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def _wait_hint(error: BaseException) -> float | None:
    return error.retry_after_s if isinstance(error, _RetryableStatus) else None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def public_url(url: str) -> str:
    """`url` without its query, fragment and user:password (what messages may show of it)."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "") + ("" if parts.port is None else f":{parts.port}")
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def api_key_from_env(variable: str) -> str | None:
    """The API key in environment variable `variable`; None when it is unset or empty (a local server needs none)."""
    return (os.environ.get(variable) or None) if variable else None


def _retryable(error: BaseException) -> bool:
    if isinstance(error, http.client.InvalidURL):  # a model-written URL no retry will mend
        return False
    if isinstance(error, _RetryableStatus | MalformedReply | http.client.HTTPException):
        return True
    if isinstance(error, urllib.error.URLError) and not isinstance(error, urllib.error.HTTPError):
        return isinstance(error.reason, OSError)  # refused, reset, timed out, name not resolved
    return is_transient(error)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    return next((value for key, value in headers.items() if key.lower() == name.lower()), None)


def _reason(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, BaseException):
        error = error.reason
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(error, _RetryableStatus | MalformedReply | ServiceError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class ServiceClient:
    """Requests to one named service (`service` is how messages call it, e.g. "the judge endpoint"). Thread-safe:
    the judge calls it from a pool. `attempts` and `retries` count every request's tries (for metrics)."""

    def __init__(self, service: str, *, api_key: str | None = None, timeout_s: float = 30.0,
                 retry: RetryPolicy = DEFAULT_RETRY):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0")
        self.service, self.timeout_s, self.retry = service, float(timeout_s), retry
        self._api_key = api_key
        self._lock = threading.Lock()
        self.attempts = self.retries = 0

    def __repr__(self) -> str:
        key = "set" if self._api_key else "none"
        return f"ServiceClient({self.service!r}, timeout_s={self.timeout_s:g}, api_key={key})"

    def get(self, url: str, params: Mapping[str, str] | None = None,
            read: Callable[[Response], T] | None = None) -> Response | T:
        if params:
            separator = "&" if urllib.parse.urlsplit(url).query else "?"
            url = url + separator + urllib.parse.urlencode(params)
        return self._send(lambda: urllib.request.Request(url), url, read)

    def post_json(self, url: str, payload: Any, read: Callable[[Response], T] | None = None) -> Response | T:
        body = json.dumps(payload).encode()
        return self._send(lambda: urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}), url, read)

    def _open(self, request: urllib.request.Request) -> Response:
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return Response(response.status, response.read(), response.headers.get_content_type(),
                                dict(response.headers.items()))
        except urllib.error.HTTPError as error:
            content_type = error.headers.get_content_type() if error.headers else ""
            return Response(error.code, error.read() if error.fp else b"", content_type,
                            dict(error.headers.items()) if error.headers else {})

    def _send(self, make_request: Callable[[], urllib.request.Request], url: str,
              read: Callable[[Response], T] | None) -> Response | T:
        started, tries = time.monotonic(), 0

        def attempt():
            nonlocal tries
            tries += 1
            with self._lock:
                self.attempts += 1
                self.retries += tries > 1
            response = self._open(make_request())
            if response.status in RETRY_STATUSES:
                wait = retry_after_s(_header(response.headers, "Retry-After"))
                log.debug("%s answered HTTP %d (try %d, Retry-After %s)", self.service, response.status, tries,
                          wait)
                raise _RetryableStatus(response.status, wait)
            return response if read is None else read(response)

        def give_up(error: BaseException, n: int) -> ServiceError:
            if isinstance(error, ServiceError):
                return ServiceError(str(error))
            verb = "is unreachable" if _retryable(error) else "failed"
            return ServiceError(f"the {self.service} {verb} ({_reason(error, self.timeout_s)}; {n} attempt"
                                f"{'s' if n > 1 else ''} in {time.monotonic() - started:.1f} s, {public_url(url)})")

        return call_with_retry(attempt, self.retry, give_up, retryable=_retryable, wait_hint=_wait_hint)


class ChatEndpoint:
    """An OpenAI-compatible chat-completions endpoint: `complete(system, user)` is the reply's text, at temperature 0.
    A status other than 200 (after the client's retries) raises `ServiceError`; a malformed envelope is retried."""

    def __init__(self, base_url: str, model: str, client: ServiceClient, max_tokens: int = 512):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.client, self.max_tokens = model, client, max_tokens

    def complete(self, system: str, user: str) -> str:
        payload = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens,
                   "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        return self.client.post_json(self.url, payload, read=self._reply_text)

    def _reply_text(self, response: Response) -> str:
        if response.status != 200:
            raise ServiceError(f"the {self.client.service} answered HTTP {response.status} "
                               f"({public_url(self.url)}, model {self.model!r})")
        try:
            content = json.loads(response.body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise MalformedReply(f"a reply that is not a chat completion ({type(error).__name__})") from None
        if not isinstance(content, str):
            raise MalformedReply("a chat completion without text content")
        return content
