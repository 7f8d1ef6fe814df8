"""A thin layer over a TensorStore KvStore rooted at the store's prefix.

Adds: retries of transient errors, errors that name URL + key, conditional create ("first writer wins"),
range listing that filters client-side (so a server that ignores list offsets cannot widen it), and deletes
that only ever name single keys inside the root or bounded ranges on drivers that honour them.

I/O can be watched through :func:`observe` (a :class:`StoreObserver` told of every read, write, delete and
listing at the KV seams, and of every array written or read); benchmarks count the store's traffic that way.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable, Sequence

import tensorstore as ts

from mgrpo_jax.store.errors import StoreError, TransientStoreError
from mgrpo_jax.store.retry import RetryPolicy, call_with_retry, is_transient
from mgrpo_jax.store.url import StoreLocation

# TensorStore's generation for "key does not exist"; an ``if_equal`` with it means create-only.
NO_VALUE = b"\x02"

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: ts.Context | None = None


# Set to 1 to make file:// stores fsync every object they write (see shared_context).
FILE_SYNC_ENV = "MGRPO_STORE_FILE_SYNC"


def shared_context() -> ts.Context:
    """One TensorStore context per process: memory:// stores of the same URL share data through it.

    TensorStore's own GCS retries are kept short; the store's RetryPolicy does the long back-off so that
    the whole budget is visible and configurable in one place.

    file:// stores do not fsync each object (TensorStore's ``file_io_sync`` off; ``MGRPO_STORE_FILE_SYNC=1``
    turns it on). An fsync costs ~8 ms per object here, which made the per-step exchange of a local run ~20 %
    of its step time. Writes still go through a temporary file and a rename, so a killed or preempted job
    (what the store's guarantees are about) never leaves a partial object; only an OS crash or power loss can
    lose or tear recent writes, and a torn object fails its checksum on read (CorruptRecordError).
    """
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            _CONTEXT = ts.Context(
                {
                    "gcs_request_retries": {"max_retries": 3, "initial_delay": "20ms", "max_delay": "200ms"},
                    "file_io_sync": os.environ.get(FILE_SYNC_ENV, "0") not in ("", "0", "false"),
                }
            )
        return _CONTEXT


class StoreObserver:
    """Told of the store's I/O while registered through :func:`observe`; override the hooks of interest.

    Hooks run on the thread that does the I/O, for every store handle in the process. Keys are relative to
    the store's root. Each attempt counts: a retried operation is reported once per attempt.
    """

    def on_read(self, key: str, value: bytes | None) -> None:
        """A single-key read completed (reported when its result is taken); ``value`` None: the key was missing."""

    def on_write(self, key: str, value: bytes | None) -> None:
        """A single-key write (conditional or not) was issued; ``value`` None: a delete. Range deletes (file://
        and memory:// garbage collection) are not reported."""

    def on_list(self, lo: str, hi: str) -> None:
        """A listing of the key range ``[lo, hi)`` was issued."""

    def on_array_write(self, key: str, nbytes: int) -> None:
        """An array of ``nbytes`` bytes is being written under ``key/`` (``arrays.write_array``)."""

    def on_array_read(self, key: str, nbytes: int) -> None:
        """An array of ``nbytes`` bytes was read and checked from ``key/`` (``arrays.read_array``)."""


# The registered observers. The I/O paths test this list's truthiness only, so with none registered observing
# costs one check per operation.
_OBSERVERS: list[StoreObserver] = []


@contextlib.contextmanager
def observe(observer: StoreObserver):
    """Registers ``observer`` for the store I/O of this process while the block runs; yields it.

    Observers may nest (each is told of everything while registered). A read issued inside the block is
    reported to it when its result is taken, even if that happens after the block.
    """
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


class _ObservedRead:
    """A read future that tells the observers registered when it was issued of its result."""

    __slots__ = ("_future", "_key", "_observers")

    def __init__(self, future, key: str, observers: tuple[StoreObserver, ...]):
        self._future, self._key, self._observers = future, key, observers

    def result(self):
        out = self._future.result()
        value = None if out.state == "missing" else out.value
        for observer in self._observers:
            observer.on_read(self._key, value)
        return out


def key_range_after(prefix: str) -> str:
    """The smallest key greater than every key that starts with ``prefix`` (exclusive upper bound)."""
    raw = prefix.encode()
    while raw and raw[-1] == 0xFF:
        raw = raw[:-1]
    if not raw:
        return ""
    return (raw[:-1] + bytes([raw[-1] + 1])).decode("latin-1")


class KV:
    """Key-value access relative to a StoreLocation's root."""

    def __init__(self, location: StoreLocation, retry: RetryPolicy):
        self.location = location
        self.url = location.url
        self.retry = retry
        spec = location.kvstore_spec()
        self._kv = self._retry(lambda: ts.KvStore.open(spec, context=shared_context()).result(), "open", "")

    # -- error handling --------------------------------------------------------------------------------
    def _retry(self, fn, op: str, key: str):
        def giveup(exc: BaseException, attempts: int) -> Exception:
            if is_transient(exc):
                return TransientStoreError(
                    f"store {op} failed after {attempts} attempts (transient error persisted): {exc}",
                    url=self.url,
                    key=key,
                )
            return StoreError(f"store {op} failed: {exc}", url=self.url, key=key)

        return call_with_retry(fn, self.retry, giveup)

    # Every I/O goes through these three (the seam tests use to inject failures, and where observers are
    # told). They return futures.
    def _start_read(self, key: str):
        if _OBSERVERS:
            return _ObservedRead(self._kv.read(key), key, tuple(_OBSERVERS))
        return self._kv.read(key)

    def _start_write(self, key: str, value: bytes | None, if_equal: bytes | None = None):
        if _OBSERVERS:
            for observer in tuple(_OBSERVERS):
                observer.on_write(key, value)
        return self._kv.write(key, value, if_equal=if_equal)

    def _start_list(self, lo: str, hi: str):
        if _OBSERVERS:
            for observer in tuple(_OBSERVERS):
                observer.on_list(lo, hi)
        return self._kv.list(ts.KvStore.KeyRange(lo, hi))

    def _raw_read(self, key: str):
        return self._start_read(key).result()

    def _raw_write(self, key: str, value: bytes | None, if_equal: bytes | None = None):
        return self._start_write(key, value, if_equal).result()

    def _raw_list(self, lo: str, hi: str) -> list[bytes]:
        return self._start_list(lo, hi).result()

    # -- single keys -----------------------------------------------------------------------------------
    def read(self, key: str) -> tuple[bytes | None, bytes]:
        """Returns ``(value or None if missing, generation)``."""
        result = self._retry(lambda: self._raw_read(key), "read", key)
        if result.state == "missing":
            return None, NO_VALUE
        return bytes(result.value), bytes(result.stamp.generation)

    def write(self, key: str, value: bytes) -> None:
        self._retry(lambda: self._raw_write(key, value), "write", key)

    def write_if(self, key: str, value: bytes | None, generation: bytes) -> bool:
        """Conditional write/delete; False when the key's generation no longer equals ``generation``."""
        stamp = self._retry(
            lambda: self._raw_write(key, value, if_equal=generation), "conditional write", key
        )
        return bytes(stamp.generation) != b""

    def create(self, key: str, value: bytes) -> bool:
        """Writes only if the key does not exist yet. True if this call created it.

        A retry after a lost reply (the write landed, the answer did not) sees the key present and returns
        False, so a retried write never produces a second copy.
        """
        return self.write_if(key, value, NO_VALUE)

    def delete(self, key: str) -> None:
        self._retry(lambda: self._raw_write(key, None), "delete", key)

    def read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Reads keys concurrently; missing keys give None."""
        return [value for value, _ in self.read_many_stamped(keys)]

    def read_many_stamped(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        """Reads keys concurrently; per key ``(value or None if missing, generation)`` as ``read`` gives."""
        futures = {}
        for key in keys:
            try:
                futures[key] = self._start_read(key)
            except Exception:  # noqa: BLE001 - fall back to the retried path below
                futures[key] = None
        out = []
        for key in keys:
            fut = futures[key]
            try:
                if fut is None:
                    raise ConnectionError("read not issued")
                result = fut.result()
                if result.state == "missing":
                    out.append((None, NO_VALUE))
                else:
                    out.append((bytes(result.value), bytes(result.stamp.generation)))
            except Exception:  # noqa: BLE001 - retried (and classified) one by one
                out.append(self.read(key))
        return out

    def _write_batch(self, items: Sequence[tuple[str, bytes | None, bytes | None]]) -> list[bool]:
        """Writes ``(key, value, if_equal)`` items concurrently; failures are retried one by one."""
        futures = []
        for key, value, if_equal in items:
            try:
                futures.append(self._start_write(key, value, if_equal))
            except Exception:  # noqa: BLE001 - retried below
                futures.append(None)
        out = []
        for (key, value, if_equal), fut in zip(items, futures, strict=True):
            try:
                if fut is None:
                    raise ConnectionError("write not issued")
                out.append(bytes(fut.result().generation) != b"")
            except Exception:  # noqa: BLE001 - retried (and classified) one by one
                if if_equal is None:
                    self.write(key, value)
                    out.append(True)
                else:
                    out.append(self.write_if(key, value, if_equal))
        return out

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Unconditional writes issued concurrently (failures retried one by one)."""
        self._write_batch([(key, value, None) for key, value in items])

    def create_many(self, items: Iterable[tuple[str, bytes]]) -> list[bool]:
        """Create-only writes issued concurrently; per key True if this call created it."""
        return self._write_batch([(key, value, NO_VALUE) for key, value in items])

    def write_many_if(self, items: Iterable[tuple[str, bytes | None, bytes]]) -> list[bool]:
        """Conditional writes ``(key, value, generation)`` issued concurrently; per key as ``write_if``."""
        return self._write_batch(list(items))

    # -- listing and deletion --------------------------------------------------------------------------
    def list_prefix(self, prefix: str) -> list[str]:
        """Sorted keys that start with ``prefix`` (relative to the root)."""
        return self.list_range(prefix, key_range_after(prefix), prefix=prefix)

    def list_range(self, lo: str, hi: str, *, prefix: str = "") -> list[str]:
        """Sorted keys in ``[lo, hi)``; filtered here too, in case the server ignores the range."""
        raw = self._retry(lambda: self._raw_list(lo, hi), "list", lo)
        keys = []
        for k in raw:
            key = k.decode()
            if key >= lo and (not hi or key < hi) and key.startswith(prefix):
                keys.append(key)
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key under ``prefix`` (which must be non-empty and end in ``/``); returns the count.

        On GCS this lists and deletes keys one by one: a range delete there goes through objects.list with
        start/end offsets, which some servers (the test emulator) ignore, turning it into a bucket wipe.
        """
        if not prefix or not prefix.endswith("/"):
            raise ValueError(f"delete_prefix needs a non-empty prefix ending in '/', got {prefix!r}")
        keys = self.list_prefix(prefix)
        if self.location.scheme == "gs":
            futures = []
            for key in keys:
                try:
                    futures.append((key, self._start_write(key, None)))
                except Exception:  # noqa: BLE001
                    futures.append((key, None))
            for key, fut in futures:
                try:
                    if fut is None:
                        raise ConnectionError("delete not issued")
                    fut.result()
                except Exception:  # noqa: BLE001 - retried (and classified) one by one
                    self.delete(key)
        else:
            hi = key_range_after(prefix)
            self._retry(
                lambda: self._kv.delete_range(ts.KvStore.KeyRange(prefix, hi)).result(), "delete", prefix
            )
        return len(keys)


def dumps(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
