"""Transient store errors are retried with back-off; permanent ones name the URL and the key."""

import numpy as np
import pytest

from mgrpo_jax.store import Record, RetryPolicy, StoreError, TransientStoreError, open_store
from mgrpo_jax.store.kv import KV
from mgrpo_jax.store.retry import is_transient

FAST = RetryPolicy(max_attempts=6, initial_s=0.001, max_delay_s=0.01, deadline_s=5)


def _flaky(monkeypatch, method, failures, message="UNAVAILABLE: injected outage"):
    """Makes ``KV.<method>`` raise ``failures`` times, then behave; returns the call counter."""
    calls = {"n": 0, "failed": 0}
    real = getattr(KV, method)

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["failed"] < failures:
            calls["failed"] += 1
            raise ValueError(message)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KV, method, flaky)
    return calls


def test_transient_errors_are_retried(store_url, monkeypatch):
    store = open_store(store_url, retry=FAST)
    writes = _flaky(monkeypatch, "_start_write", 3)
    w = store.step_writer(0, "main", policy_version=1)
    w.put_records([Record("r", 0, q, 0, 0, 1, {"q": q}) for q in range(4)])
    w.put_array("rewards", np.ones(3, np.float32))
    w.commit()
    assert writes["failed"] == 3
    reads = _flaky(monkeypatch, "_start_read", 4, message="DEADLINE_EXCEEDED: injected")
    view = store.read_step(0, "main")
    assert [r.payload["q"] for r in view.records("r")] == [0, 1, 2, 3]
    assert reads["failed"] == 4
    lists = _flaky(monkeypatch, "_start_list", 2, message="ABORTED: CURL error Could not connect to server")
    store.fifo("f").append([Record("r", 0, 0, 0, 0, 1, {})])
    assert lists["failed"] == 2


def test_persistent_transient_error_gives_up_with_url_and_key(store_url, monkeypatch):
    store = open_store(store_url, retry=FAST)
    calls = _flaky(monkeypatch, "_start_read", 10**9)
    with pytest.raises(TransientStoreError) as info:
        store.is_committed(3, "sub")
    assert calls["n"] == FAST.max_attempts
    message = str(info.value)
    assert "after 6 attempts" in message and "UNAVAILABLE" in message
    assert store.url + "steps/0000000003/sub/commit.json" in message
    assert info.value.key == "steps/0000000003/sub/commit.json" and info.value.url == store.url


def test_permanent_error_is_not_retried(store_url, monkeypatch):
    store = open_store(store_url, retry=FAST)
    calls = _flaky(monkeypatch, "_start_write", 10**9, message="PERMISSION_DENIED: bucket says no")
    with pytest.raises(StoreError) as info:
        store.tasks.post([Record("task", 1, 0, 0, 0, 0, {})])
    assert not isinstance(info.value, TransientStoreError)
    assert calls["n"] == 2  # the concurrent attempt, then one classified attempt; no back-off loop
    assert "PERMISSION_DENIED" in str(info.value)
    assert store.url + "tasks/0000000001/task/q000000-r0000-i0000.json" in str(info.value)


def test_error_classification():
    assert is_transient(ValueError("UNAVAILABLE: x")) and is_transient(ConnectionResetError())
    assert is_transient(ValueError("ABORTED: All 3 retry attempts failed: CURL error Could not connect"))
    assert not is_transient(ValueError("NOT_FOUND: Failed to create directory"))
    assert not is_transient(ValueError("PERMISSION_DENIED: no"))
    with pytest.raises(ValueError, match="invalid RetryPolicy"):
        RetryPolicy(max_attempts=0)


def test_outage_errors_of_gcsfs_are_transient():
    """While a GCS endpoint restarts, gcsfs's listing raises aiohttp's connection error (an OSError, not a
    ConnectionError) once its own retries are spent: the store must retry it, not give up."""
    import errno

    import aiohttp

    key = aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
    refused = aiohttp.ClientConnectorError(key, OSError(errno.ECONNREFUSED, "Connect call failed"))
    assert not isinstance(refused, ConnectionError) and is_transient(refused)
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(OSError(errno.ECONNREFUSED, "refused"))
    assert not is_transient(OSError(errno.ENOENT, "no such file"))
    assert not is_transient(FileNotFoundError("gone"))


def test_default_policy_rides_out_half_a_minute():
    policy = RetryPolicy()
    delays, total = policy.delays(), 0.0
    for _ in range(policy.max_attempts - 1):
        total += next(delays)
    assert total > policy.deadline_s >= 30  # the deadline, not the attempt count, ends the retries
