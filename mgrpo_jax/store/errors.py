"""Exceptions raised by the shared store. Every one names the store URL and, where there is one, the key."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A store operation failed permanently (after retries, or on an error that retrying cannot fix)."""

    def __init__(self, message: str, *, url: str = "", key: str | None = None):
        where = url + (key or "") if url else (key or "")
        super().__init__(f"{message} [{where}]" if where else message)
        self.url = url
        self.key = key


class TransientStoreError(StoreError):
    """A transient error (unavailable, deadline, throttled) that persisted past the retry budget."""


class StoreTimeout(StoreError, TimeoutError):
    """A reader waited for data that did not appear in time; ``missing`` lists what was not there."""

    def __init__(self, message: str, *, url: str = "", missing: tuple[str, ...] = ()):
        super().__init__(message, url=url)
        self.missing = tuple(missing)


class CorruptRecordError(StoreError):
    """A stored object exists but cannot be decoded, or fails its checksum (a partial or damaged write)."""


class ConflictError(StoreError):
    """A conditional update lost a race that the caller must know about (e.g. a FIFO offset moved)."""
