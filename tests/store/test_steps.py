"""Per-step data: arrays and records behind commit markers, on every backend."""

import threading
import time

import numpy as np
import pytest

from mgrpo_jax.store import CorruptRecordError, Record, StoreTimeout, open_store

Q, K, D = 4, 3, 2


def _sub_records(step, version):
    return [
        Record("sub_answer", step, q, k, i, version, {"text": f"answer {q}/{k}/{i}", "tokens": [q, k, i]})
        for q in range(Q)
        for k in range(K)
        for i in range(D)
    ]


def test_round_trip_arrays_and_records(store_url, fast_poll):
    writer_store = open_store(store_url, poll=fast_poll)
    w = writer_store.step_writer(5, "main", policy_version=12)
    rewards = np.arange(Q * K, dtype=np.float32).reshape(Q, K) / 7
    sub = np.linspace(-1, 1, Q * K * D).reshape(Q, K, D)
    mask = np.array([[True, False, True]] * Q)
    w.put_array("rewards", rewards, shape=(Q, K), dtype=np.float32)
    w.put_array("sub_rewards", sub, shape=(Q, None, D))
    w.put_array("mask", mask)
    w.put_array("count", np.int64(7))
    assert w.put_records(_sub_records(5, 12)) == Q * K * D
    assert w.put_record("main_answer", 1, 2, 0, {"text": "Paris ✓"})
    manifest = w.commit({"note": "smoke"})
    assert manifest["policy_version"] == 12

    view = open_store(store_url, poll=fast_poll).wait_step(5, "main", timeout_s=5)
    np.testing.assert_array_equal(view.array("rewards", shape=(Q, K), dtype="float32"), rewards)
    np.testing.assert_array_equal(view.array("sub_rewards"), sub)
    np.testing.assert_array_equal(view.array("mask"), mask)
    assert view.array("count").shape == () and view.array("count") == 7
    assert view.array_names == ["count", "mask", "rewards", "sub_rewards"]
    assert view.meta == {"note": "smoke"} and view.policy_version == 12
    recs = view.records("sub_answer")
    assert recs == _sub_records(5, 12)
    assert [(r.query, r.rollout, r.invocation) for r in recs] == sorted(
        (r.query, r.rollout, r.invocation) for r in recs
    )
    (main,) = view.records("main_answer")
    assert (main.step, main.query, main.rollout, main.invocation, main.policy_version) == (5, 1, 2, 0, 12)
    assert main.payload == {"text": "Paris ✓"}
    assert view.records("nothing") == []
    with pytest.raises(KeyError, match="no array 'missing'"):
        view.array("missing")


def test_idempotent_rewrite(store_url):
    store = open_store(store_url)
    for attempt in range(2):  # the producer redoes the whole step, e.g. after a crash before commit
        w = store.step_writer(1, "sub", policy_version=3)
        w.put_array("rewards", np.full((Q, K), attempt, np.float32))
        w.put_records(_sub_records(1, 3))
        w.put_records(_sub_records(1, 3))  # a retried batch
    w.commit()
    view = store.read_step(1, "sub")
    assert len(view.records("sub_answer")) == Q * K * D
    assert len(store.kv.list_prefix("steps/0000000001/sub/records/sub_answer/")) == Q * K * D
    np.testing.assert_array_equal(view.array("rewards"), np.ones((Q, K), np.float32))

    # Once committed the step is frozen: a late writer changes nothing and gets the first manifest back.
    late = store.step_writer(1, "sub", policy_version=4)
    assert late.committed
    assert late.put_array("rewards", np.zeros((Q, K), np.float32)) is False
    assert late.put_records(_sub_records(1, 4)) == 0
    assert late.commit()["policy_version"] == 3
    np.testing.assert_array_equal(store.read_step(1, "sub").array("rewards"), np.ones((Q, K), np.float32))
    assert store.committed_steps("sub") == [1]


def test_step_invisible_until_commit(store_url, fast_poll):
    store = open_store(store_url, poll=fast_poll)
    w = store.step_writer(2, "main", policy_version=0)
    w.put_array("rewards", np.zeros((Q, K), np.float32))
    w.put_record("task", 0, 0, 0, {"task": "t"})
    assert not store.is_committed(2, "main")
    assert store.committed_steps("main") == []
    with pytest.raises(StoreTimeout):
        store.read_step(2, "main")

    def commit_later():
        time.sleep(0.3)
        w.commit()

    thread = threading.Thread(target=commit_later)
    thread.start()
    start = time.monotonic()
    view = store.wait_step(2, "main", timeout_s=10)
    waited = time.monotonic() - start
    thread.join()
    assert 0.2 < waited < 30
    assert view.record_ids("task") == ["q000000-r0000-i0000"]


def test_wait_timeout_names_what_is_missing(store_url, fast_poll):
    store = open_store(store_url, poll=fast_poll)
    store.step_writer(3, "main", policy_version=0).commit()  # another producer's marker is not enough
    start = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        store.wait_step(3, "sub", timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 30  # lower bound: it waited; upper: it gave up (a loaded CI is slow)
    message = str(info.value)
    assert "step 3" in message and "'sub'" in message
    assert "steps/0000000003/sub/commit.json" in message and store.url in message
    assert info.value.missing == ("steps/0000000003/sub/commit.json",)
    assert isinstance(info.value, TimeoutError)


@pytest.mark.parametrize(
    ("value", "kwargs", "fragment"),
    [
        (np.zeros((4, 3), np.float32), {"shape": (4, 2)}, "shape (4, 3), expected (4, 2)"),
        (np.zeros((4, 3), np.float32), {"shape": (4,)}, "shape (4, 3), expected (4,)"),
        (np.zeros((4, 3), np.float64), {"dtype": np.float32}, "dtype float64, expected float32"),
        (np.array(["a", "b"]), {}, "unsupported dtype <U1"),
        (np.array([{"x": 1}], dtype=object), {}, "unsupported dtype object"),
        (np.zeros(2, np.complex64), {}, "unsupported dtype complex64"),
    ],
)
def test_bad_arrays_rejected(value, kwargs, fragment):
    w = open_store("memory://bad-arrays").step_writer(0, "main", policy_version=0)
    with pytest.raises(ValueError) as info:
        w.put_array("rewards", value, **kwargs)
    assert fragment in str(info.value) and "'rewards'" in str(info.value)


def test_bad_inputs_rejected():
    store = open_store("memory://bad-inputs")
    with pytest.raises(ValueError, match="invalid step -1"):
        store.step_writer(-1, "main", policy_version=0)
    with pytest.raises(ValueError, match="invalid producer 'Main'"):
        store.step_writer(0, "Main", policy_version=0)
    w = store.step_writer(0, "main", policy_version=0)
    with pytest.raises(ValueError, match="invalid array name"):
        w.put_array("../x", np.zeros(2))
    with pytest.raises(ValueError, match="has step 1, writer is for step 0"):
        w.put_records([Record("a", 1, 0, 0, 0, 0, {})])
    with pytest.raises(ValueError, match="invalid query"):
        Record("a", 0, -3, 0, 0, 0, {})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        Record("a", 0, 0, 0, 0, 0, {"x": object()}).encode()
    w.put_array("r", np.zeros(3))  # no expectation: fine
    w.commit()
    with pytest.raises(ValueError, match=r"array 'r': shape \(3,\), expected \(2,\)"):
        store.read_step(0, "main").array("r", shape=(2,))


def test_corrupt_record_detected(store_url):
    store = open_store(store_url)
    w = store.step_writer(4, "sub", policy_version=1)
    w.put_records(_sub_records(4, 1)[:2])
    w.commit()
    key = "steps/0000000004/sub/records/sub_answer/q000000-r0000-i0001.json"
    raw, _ = store.kv.read(key)
    store.kv.write(key, raw[: len(raw) // 2])  # a partial write
    with pytest.raises(CorruptRecordError) as info:
        store.read_step(4, "sub").records("sub_answer")
    assert key in str(info.value) and store.url in str(info.value)
    store.kv.write(key, raw.replace(b"answer 0", b"answer 9"))  # damaged content, valid JSON
    with pytest.raises(CorruptRecordError, match="checksum mismatch"):
        store.read_step(4, "sub").records("sub_answer")
